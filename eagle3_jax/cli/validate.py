"""`python -m eagle3_jax validate`: how well a head drafts held-out text, from its TTT metrics.

  python -m eagle3_jax validate --draft HEAD --data [NAME=]FILE [--data ...]       [--target PATH] \
      [--max-len 512] [--sample N] [--batch-size 4] [--json OUT]

What it does, and every flag: `--help` and eagle3_jax/training/validate.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp

from eagle3_jax import compile_cache, distributed
from eagle3_jax.checkpoints import load_target
from eagle3_jax.checkpoints.heads import load_head
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.training.validate import (
    load_set,
    score_head,
    split_set,
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("--draft", required=True, help="head directory (official EAGLE-3 format)")
    ap.add_argument("--data", action="append", required=True, help="[NAME=]FILE, repeatable")
    ap.add_argument("--target", default=None, help="checkpoint (default: the embedded SmolLM2)")
    ap.add_argument("--max-len", type=int, default=512, help="tokens per conversation, cut after")
    ap.add_argument(
        "--sample", type=int, default=0, help="conversations per set, at random (0: all)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--json", default=None, help="write the scores here")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def score_sets(args: argparse.Namespace) -> dict:
    """Every --data set scored with the head: {"draft", "max_len", "sets": {name: scores}}."""
    names = [split_set(s)[0] for s in args.data]
    if len(set(names)) < len(names):
        raise Eagle3Error(f"two --data sets share a name ({', '.join(names)}): name them")
    target = load_target(args.target, dtype=jnp.float32)
    dparams, dcfg, vocab, _ = load_head(args.draft, target, jnp.float32)
    sets = [load_set(s, target.tokenizer, args.max_len, args.sample, args.seed) for s in args.data]
    result = {"draft": str(args.draft), "max_len": args.max_len, "sets": {}}
    for name, ds in sets:
        t0 = time.perf_counter()
        sc = score_head(
            target, dparams, dcfg, vocab, ds, steps=args.ttt_steps,
            batch_size=args.batch_size, progress=not args.no_progress,
        )  # fmt: skip
        result["sets"][name] = {**sc.as_dict(), "seconds": time.perf_counter() - t0}
    return result


def table(result: dict, steps: int) -> str:
    """The scores as markdown: acc_i per TTT step, chain and replayed tau, one row a set."""
    accs = " | ".join(f"acc_{i}" for i in range(steps))
    d3 = min(3, steps)
    lines = [
        f"| set | records (skipped) | supervised | {accs} | chain tau d{d3} | replayed tau d{d3} | "
        f"replayed tau d{steps} |",
        "|---" * (steps + 6) + "|",
    ]
    for name, s in result["sets"].items():
        row = " | ".join(f"{a:.3f}" for a in s["acc"])
        lines.append(
            f"| {name} | {s['records']} ({s['skipped']}) | {s['supervised']} | {row} | "
            f"{s['chain_tau'][d3 - 1]:.2f} | {s['replay_tau'][d3 - 1]:.2f} | "
            f"{s['replay_tau'][-1]:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    compile_cache.enable()
    try:
        distributed.initialize()  # a pod / SLURM / multi-process job: join it first
        result = score_sets(args)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(result, args.ttt_steps))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
