"""`python -m eagle3_jax regenerate`: answer prompts with the target itself (training data).

  python -m eagle3_jax regenerate PROMPTS.jsonl OUT.jsonl [--target CKPT] [--batch-size 64]
      [--max-new-tokens 256] [--max-prompt-tokens 256] [--limit N]
      [--all-turns --max-len 2048 --chunk N --max-batch-tokens N --buckets P,S] [--scan-layers]

What it does, and every flag: `--help` and eagle3_jax/data/regenerate.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from eagle3_jax import backends, compile_cache, cpu_tuning, distributed
from eagle3_jax.checkpoints import load_target
from eagle3_jax.data.conversations import first_user_turns, read_conversations
from eagle3_jax.data.regenerate import (
    regenerate,
    regenerate_turns,
)
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models.target import stack_layers


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("prompts", help="ShareGPT / role-content file(s), comma-separated")
    p.add_argument("out", help="answers, ShareGPT JSONL (resumed when it exists)")
    p.add_argument("--target", default=None)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, default=0, help="first N prompts only (0 = all)")
    p.add_argument(
        "--all-turns",
        action="store_true",
        help="answer every user turn in context (multi-turn records), not only the first",
    )
    p.add_argument("--max-len", type=int, default=2048, help="--all-turns: prompt + answer limit")
    p.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="--all-turns: conversations answered (and saved) together (default 8 batches)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=0,
        help="--all-turns: at most rows x (prompt + max new tokens) per batch (0 = no bound); "
        "262144 keeps an H200 inside its memory at batch 512",
    )
    p.add_argument(
        "--buckets",
        default="",
        help="--all-turns: PROMPT,SLOTS shape buckets (e.g. 256,512: fewer compilations)",
    )
    p.add_argument(
        "--scan-layers",
        action="store_true",
        help="run the target's layers as one lax.scan: compiles several times faster "
        "(accelerators; on the CPU the unrolled layers decode faster)",
    )
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    compile_cache.enable()
    try:
        distributed.initialize()  # a pod / SLURM / multi-process job: join it first
        convs = read_conversations(args.prompts)[0]
        convs = convs[: args.limit] if args.limit else convs
        buckets = tuple(int(x) for x in args.buckets.split(",")) if args.buckets else None
        if buckets is not None and (len(buckets) != 2 or min(buckets) < 1):
            raise Eagle3Error(f"--buckets {args.buckets!r}: give PROMPT,SLOTS, e.g. 256,512")
        target = _target(args)
        t0 = time.perf_counter()
        stats = _run(args, target, convs, buckets)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({**stats._asdict(), "wall_s": round(time.perf_counter() - t0, 1)}))
    return 0


def _target(args):
    """The target with this machine's few-row products (batched decoding), its layers stacked
    for one lax.scan under --scan-layers."""
    target = backends.prepare_target(load_target(args.target), cpu_tuning.policy_for())
    if args.scan_layers:
        target = target._replace(params=stack_layers(target.params))
    return target


def _run(args, target, convs, buckets):
    """Every user turn in context (--all-turns), or the first turns."""
    common = dict(
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    if args.all_turns:
        return regenerate_turns(
            target,
            convs,
            args.out,
            max_len=args.max_len,
            chunk=args.chunk,
            max_batch_tokens=args.max_batch_tokens,
            buckets=buckets,
            **common,
        )
    prompts = first_user_turns(convs)
    return regenerate(target, prompts, args.out, max_prompt_tokens=args.max_prompt_tokens, **common)
