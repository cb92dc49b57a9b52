#!/usr/bin/env python
"""Plain greedy decoding speed: eagle3_jax vs transformers' PyTorch `generate`, interleaved in one run.

  .venv/bin/python benchmarks/plain_decoding.py [--new-tokens 256] [--reps 3] [--target PATH]

Batch 1, fp32, CPU, EOS disabled so every run makes exactly --new-tokens tokens; each engine is warmed
up (compiled) first and the runs alternate, so machine noise hits both alike. Prints a table and
writes benchmarks/results/plain_decoding.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax

from eagle3_jax.checkpoints import default_gguf_path, load_target
from eagle3_jax.decoding import plain
from eagle3_jax.models import target as tgt
from eagle3_jax.paths import cpu_model
from eagle3_jax.prompts import encode_chat

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _until_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    """Greedy outputs are compared up to the first EOS: past it, transformers suppresses EOS
    (min_new_tokens) while we keep decoding with EOS disabled."""
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:cut]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--out", default="benchmarks/results/plain_decoding.json")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    target = load_target(args.target)
    ids = encode_chat(target.tokenizer, [{"role": "user", "content": PROMPT}])
    if args.target is None:
        g = default_gguf_path()
        ref = AutoModelForCausalLM.from_pretrained(
            str(g.parent), gguf_file=g.name, dtype=torch.float32
        )
    else:
        ref = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    ref.eval()
    n = args.new_tokens

    engines = {
        "eagle3_jax (unrolled layers)": target.params,
        "eagle3_jax (scanned layers)": tgt.stack_layers(target.params),
    }

    def run_ours(params):
        res = plain.generate(params, target.cfg, [ids], n, eos_ids=())
        assert len(res.output_ids[0]) == n
        return res.wall_time_s, res.output_ids[0]

    def run_torch():
        t0 = time.perf_counter()
        with torch.no_grad():
            # min_new_tokens suppresses EOS; passing eos_token_id=None instead changes transformers'
            # greedy output (seen with transformers 5.24), so it is not used
            out = ref.generate(
                torch.tensor([ids]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=2,
            )
        return time.perf_counter() - t0, out[0, len(ids) :].tolist()

    # warm-up: compile every program, touch every weight
    outputs = {name: run_ours(p)[1] for name, p in engines.items()}
    outputs["transformers"] = run_torch()[1]
    times = {name: [] for name in outputs}
    for _ in range(args.reps):
        for name, p in engines.items():
            times[name].append(run_ours(p)[0])
        times["transformers"].append(run_torch()[0])

    eos = target.cfg.eos_token_ids
    base = statistics.median(times["transformers"])
    rows = []
    print(
        f"\ngreedy decoding of {n} new tokens, batch 1, fp32, prompt {len(ids)} tokens, "
        f"{args.reps} interleaved reps (median)\n"
    )
    print("| engine | tokens/s | ratio vs transformers | identical to transformers (up to EOS) |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        same = _until_eos(outputs[name], eos) == _until_eos(outputs["transformers"], eos)
        rows.append(
            {
                "engine": name,
                "median_s": med,
                "tokens_per_s": n / med,
                "ratio": base / med,
                "times_s": ts,
                "identical_output": same,
            }
        )
        print(f"| {name} | {n / med:.1f} | {base / med:.2f}x | {same} |")
    result = {
        "benchmark": "plain_decoding",
        "new_tokens": n,
        "prompt_tokens": len(ids),
        "reps": args.reps,
        "target": str(target.path),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
