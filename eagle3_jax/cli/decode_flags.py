"""decode's flags: the parser, and every check of them that needs no model (the run itself is
eagle3_jax/cli/decode.py's).

Each check raises an `Eagle3Error` (one line, exit status 2) before the slow load.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import jax

from eagle3_jax import distributed
from eagle3_jax.checkpoints.heads import parse_draft_vocab
from eagle3_jax.config import DTYPES
from eagle3_jax.decoding.generate import DecodeOptions
from eagle3_jax.decoding.plain import PROMPT_BUCKET
from eagle3_jax.decoding.sampling import Penalties, Sampling
from eagle3_jax.decoding.tree import default_tree
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.heads import default_head
from eagle3_jax.prompts import Prompt, read_prompt_file


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    """decode's flags; `description` heads --help (decode.py's usage)."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for add in (_model_flags, _tree_flags, _prompt_flags, _run_flags, prefill_flag, _output_flags):
        add(p)
    return p.parse_args(argv)


def _model_flags(p: argparse.ArgumentParser) -> None:
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


def _tree_flags(p: argparse.ArgumentParser) -> None:
    # Unset tree flags come from the backend's default (eagle3_jax.decoding.default_tree):
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
        "none could pass; 0 = every node every round. Default: 0.3 on the CPU, where verifying "
        "costs (docs/cli.md), 0 on accelerators",
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


def _prompt_flags(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="a user message (repeatable)")
    src.add_argument(
        "--prompt-file", help="one prompt per line, or FastChat/Spec-Bench JSONL (first turn)"
    )
    src.add_argument("--chat", action="store_true", help="interactive chat with streamed output")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="go on past end-of-sequence tokens: every answer is --max-new-tokens long (fixed-"
        "length timing, as vLLM's ignore_eos); plain decoding in --compare-plain does the same",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument(
        "--sample-top-k", type=int, default=0, help="sampling: keep the k most likely (0 = off)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus mass (1.0 = off)")
    add_penalty_flags(p, "")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1)


def _run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="context limit in tokens (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        help="DATAxMODEL devices (e.g. 1x8): the target and head tensor-parallel over MODEL, the "
        "batch over DATA (default: one device)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=list(DTYPES),
        help="parameter dtype (default: float32 on CPU, bfloat16 on GPU/TPU)",
    )


def prefill_flag(p: argparse.ArgumentParser) -> None:
    """--prefill-chunk (decode and serve: the same chunks give the same tokens)."""
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=0,
        metavar="C",
        help="run a prompt's prefill C tokens at a time (a multiple of 64; serve: one chunk "
        "before each round while other requests decode, so a long prompt stalls them by a "
        "chunk, not its whole prefill). A greedy answer of serve --prefill-chunk C is decode "
        "--prefill-chunk C's (default 0: one pass)",
    )


def _output_flags(p: argparse.ArgumentParser) -> None:
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


def check_settings(args) -> None:
    """Every numeric flag finite and in range, and the --json path writable, before any work."""
    for name in ("temperature", "top_p", "verify_threshold"):
        v = getattr(args, name, None)
        if v is not None and not math.isfinite(v):
            raise Eagle3Error(f"--{name.replace('_', '-')} {v}: give a finite number")
    v = getattr(args, "verify_threshold", None)
    if v is not None and not 0.0 <= v <= 1.0:
        raise Eagle3Error(f"--verify-threshold {v}: give a probability in [0, 1]")
    for name in ("max_new_tokens", "batch_size", "timing_runs"):
        if getattr(args, name, 1) < 1:
            raise Eagle3Error(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    if args.max_context is not None and args.max_context < 2:
        raise Eagle3Error(f"--max-context {args.max_context}: give 2 or more positions")
    chunk = getattr(args, "prefill_chunk", 0)
    if chunk and (chunk < 0 or chunk % PROMPT_BUCKET):
        raise Eagle3Error(f"--prefill-chunk {chunk}: give a multiple of {PROMPT_BUCKET} "
                          "(0: the prompt in one pass)")  # fmt: skip
    if args.json:  # process 0 writes it, so checks it; the others get its error
        distributed.from_primary("decode: --json", lambda: check_writable(args.json, "--json"))


def check_writable(path: str | Path, what: str) -> None:
    """Refuses an output file that cannot be written, before the work that would fill it."""
    path = Path(path)
    if path.is_dir():
        raise Eagle3Error(f"{what} {path} is a directory: give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise Eagle3Error(f"{what} {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise Eagle3Error(f"{what} {path} cannot be written here (permissions)")


def resolve_method(args) -> None:
    """Fills --method / --draft defaults: the embedded target decodes with its shipped head."""
    if args.method is None:
        args.method = "eagle3" if args.draft or args.target is None else "vanilla"
    if args.method == "eagle3" and not args.draft and args.target is None:
        args.draft = str(default_head())


def draft_vocab(args):
    """--draft-vocab parsed: "auto" (also when the namespace has no such flag), "full" or N."""

    return parse_draft_vocab(getattr(args, "draft_vocab", None) or "auto")


def tree_of(args):
    """The tree from --top-k/--depth/--total-tokens/--verify-threshold, each unset one from the
    backend's default (`default_tree`: a small adaptive tree on the CPU, EAGLE-3's
    60-token tree on accelerators)."""

    return default_tree(
        top_k=getattr(args, "top_k", None),
        depth=getattr(args, "depth", None),
        total_tokens=getattr(args, "total_tokens", None),
        verify_threshold=getattr(args, "verify_threshold", None),
    )


def check_tree(args) -> None:
    """The tree's shape, checked; an error says which flags were left to the backend's default."""

    try:
        tree_of(args).validate(10**9)
    except Eagle3Error as e:
        fields = ("top_k", "depth", "total_tokens")
        unset = [f"--{f.replace('_', '-')}" for f in fields if getattr(args, f, None) is None]
        if not unset:
            raise
        d = default_tree()
        raise Eagle3Error(
            f"{e}; unset, {' '.join(unset)} took this backend's default tree (--top-k {d.top_k} "
            f"--depth {d.depth} --total-tokens {d.total_tokens}): give them too"
        ) from None


def decode_options(args, max_context: int) -> DecodeOptions:
    """The flags as the one `DecodeOptions` every batch and the chat decode with."""
    return DecodeOptions(
        method=args.method,
        max_new_tokens=args.max_new_tokens,
        tree=tree_of(args),
        sampling=sampling_of(args),
        seed=args.seed,
        eos_ids=() if getattr(args, "ignore_eos", False) else None,
        max_context=max_context,
        same_engine=args.same_engine,
        prefill_chunk=getattr(args, "prefill_chunk", 0),
    )


def add_penalty_flags(p, who: str) -> None:
    """The penalty flags (`sampling.Penalties`; `who`: whose default they are, for serve)."""
    for flag, default, says in (
        ("--repetition-penalty", 1.0, "vLLM's repetition penalty over the prompt's and the "
         "output's tokens (1 = off)"),
        ("--frequency-penalty", 0.0, "OpenAI's frequency penalty, [-2, 2] (0 = off)"),
        ("--presence-penalty", 0.0, "OpenAI's presence penalty, [-2, 2] (0 = off)"),
    ):  # fmt: skip
        p.add_argument(flag, type=float, default=default, help=who + says)


def sampling_of(args) -> Sampling:
    """The sampling flags as a `Sampling` (its errors name the setting)."""
    penalties = Penalties(args.repetition_penalty, args.frequency_penalty, args.presence_penalty)
    return Sampling(args.temperature, args.sample_top_k, args.top_p, penalties)


def read_prompts(args) -> list[Prompt]:
    """The flags checked (before the slow load) and the prompts they name (none for --chat)."""
    if args.batch_size < 1:
        raise Eagle3Error(f"--batch-size {args.batch_size} < 1")
    if args.timing_runs < 1:
        raise Eagle3Error(f"--timing-runs {args.timing_runs} < 1")
    resolve_method(args)
    if args.compare_plain and (args.method == "vanilla" or args.chat):
        raise Eagle3Error("--compare-plain compares eagle3/pld with plain decoding, not in --chat")
    if args.chat and jax.process_count() > 1:
        raise Eagle3Error(
            f"--chat reads this terminal: run it as one process ({jax.process_count()} joined)"
        )
    check_settings(args)
    sampling_of(args)  # its errors before the load too
    if args.method != "vanilla":
        check_tree(args)  # shape errors before the (slow) load; Vd is checked later
    if args.method == "eagle3":
        draft_vocab(args)  # its errors before the (slow) load, too
    if args.prompt_file:
        prompts = read_prompt_file(args.prompt_file)
    elif args.prompt:
        prompts = [Prompt(str(i), t) for i, t in enumerate(args.prompt)]
    elif args.chat:
        prompts = []
    else:
        prompts = [Prompt("0", "What is speculative decoding? Answer in three sentences.")]
    for p in prompts:
        if not p.text.strip():
            raise Eagle3Error(f"prompt {p.id} is empty: give some text")
    return prompts
