#!/usr/bin/env python
"""Generate with a target model: plain, prompt lookup, or EAGLE-3 speculative decoding.

  python decode.py --prompt "Explain speculative decoding in two sentences." --compare-plain
  python decode.py --method eagle3 --draft heads/my_head --top-k 4 --depth 4 --total-tokens 16
  python decode.py --target ~/ckpt/Llama-3.1-8B-Instruct --prompt-file questions.jsonl --json out.json
  python decode.py --chat

Every flag's default runs on the embedded SmolLM2-135M-Instruct with its shipped EAGLE-3 head. See
README.md for the --json schema.
"""

from __future__ import annotations

import argparse
import sys

from eagle3_jax.cli import decode_main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--target",
        default=None,
        help="transformers checkpoint dir, .gguf file or eagle3_jax converted dir "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--method",
        default=None,
        choices=["eagle3", "pld", "vanilla"],
        help="eagle3: draft tree from --draft; pld: prompt lookup chain; vanilla: plain "
        "(default: eagle3 with --draft or on the embedded default target, else vanilla)",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="EAGLE-3 head directory in the official format (config.json + safetensors); "
        "default on the embedded target: the head shipped in eagle3_jax/heads",
    )
    p.add_argument(
        "--draft-vocab",
        default="auto",
        metavar="auto|full|N",
        help="draft ids the head proposes from: full (all), N (the first N its vocab_order.json "
        "lists: a smaller output layer, cheaper rounds on a CPU) or auto (default: on the CPU "
        "the size its vocab_order.json names, if any, else all; the shipped head: 8,192 of "
        "16,384 on the CPU)",
    )
    p.add_argument(
        "--compare-plain",
        action="store_true",
        help="also decode each batch plainly and report the speedup and whether outputs match",
    )
    # Unset tree flags come from the backend's default (eagle3_jax.decoding.speculative.default_tree):
    # on the CPU the best shape measured with the Vd 8,192 GPU head (4 nodes, the 2 best tokens at each
    # depth, 3 deep, verify threshold 0.3); on GPUs/TPUs, where verifying more tokens is nearly free,
    # EAGLE-3's reporting tree (top-k 10, depth 8 = EAGLE's 7, 60 tokens). See BENCHMARKS.md.
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="children per expanded tree node (1 = a chain); default 2 on the CPU, 10 elsewhere",
    )
    p.add_argument(
        "--depth",
        type=int,
        default=None,
        help="max drafted tokens per path (pld: chain length); default 3 on the CPU, 8 elsewhere",
    )
    p.add_argument(
        "--total-tokens",
        type=int,
        default=None,
        help="tree nodes verified per round, root included; default 4 on the CPU, 60 elsewhere "
        "(capped at what --top-k and --depth hold: --top-k 1 alone is a chain)",
    )
    p.add_argument(
        "--verify-threshold",
        type=float,
        default=None,
        help="adaptive verification: verify only the nodes whose cumulative draft probability is "
        "at least this (rounded up to a compiled size: 1, 2, 4, ..., total), and skip draft levels "
        "none could pass; 0 = every node every round. Default: 0.3 on the CPU (verifying costs "
        "there: 1.13-1.17x against 1.08-1.09x plain decoding on MT-bench), 0 on accelerators",
    )
    p.add_argument(
        "--spec-candidates",
        type=int,
        default=None,
        help="SpecVocab heads: exact-logit candidates per drafted row (default: the head's, 2048)",
    )
    p.add_argument(
        "--same-engine",
        action="store_true",
        help="run vanilla through the speculative engine's verification step",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="a user message (repeatable)")
    src.add_argument(
        "--prompt-file", help="one prompt per line, or FastChat/Spec-Bench JSONL (first turn)"
    )
    src.add_argument("--chat", action="store_true", help="interactive chat with streamed output")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument(
        "--sample-top-k", type=int, default=0, help="sampling: keep the k most likely (0 = off)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus mass (1.0 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="context limit in tokens (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="parameter dtype (default: float32 on CPU, bfloat16 on GPU/TPU)",
    )
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts as raw text")
    p.add_argument("--system", default=None, help="system message (default: the template's own)")
    p.add_argument("--json", default=None, help="write one record per prompt to this file")
    p.add_argument(
        "--timing-runs",
        type=int,
        default=1,
        help="run each batch N times (with --compare-plain alternating with plain decoding) and "
        "report the median wall time: a steadier speedup on a noisy machine",
    )
    p.add_argument(
        "--no-warmup", action="store_true", help="time the first batch including compilation"
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(decode_main(parse_args()))
