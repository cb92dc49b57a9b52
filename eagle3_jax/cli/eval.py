"""Speculative-decoding evaluation on Spec-Bench / MT-bench / GSM8K: τ, speedup, acceptance.

  python -m eagle3_jax eval --target CKPT --draft HEAD --methods vanilla,pld,eagle3 --questions 10
  python -m eagle3_jax eval --draft a=HEAD_A --draft b=HEAD_B --methods eagle3:4,4,16@a,eagle3@b
  python -m eagle3_jax eval --bench mt_bench --temperature 1.0 --seeds 5 --out runs/mt_t1

Methods: vanilla (always run: the speedup and exactness baseline), pld[:k,d,t] (prompt lookup),
eagle3[:k,d,t[,v]][@DRAFT] (tree shape top_k,depth,total_tokens; default: decode.py's, 2,3,4,0.3
on the CPU and 10,8,60 elsewhere; v > 0: adaptive verification, only nodes of cumulative draft
probability >= v verified). Rerunning with the
same --out resumes; another configuration in the same --out is refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eagle3_jax import compile_cache, distributed
from eagle3_jax.config import DTYPES
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation.options import EvalOptions
from eagle3_jax.evaluation.runner import run_eval
from eagle3_jax.heads import default_head


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m eagle3_jax eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_flags(p)
    _run_flags(p)
    return p.parse_args(argv)


def _model_flags(p: argparse.ArgumentParser) -> None:
    """What decodes: the target, the heads and their vocabularies, the methods."""
    p.add_argument(
        "--target",
        default=None,
        help="transformers checkpoint dir, .gguf file or converted dir (default: SmolLM2-135M)",
    )
    p.add_argument(
        "--draft",
        action="append",
        default=[],
        help="EAGLE-3 head dir, or NAME=PATH (repeatable; methods pick one with eagle3@NAME; "
        "default on the embedded target: the head shipped in eagle3_jax/heads)",
    )
    p.add_argument(
        "--draft-vocab",
        action="append",
        default=[],
        metavar="[NAME=]auto|full|N",
        help="how many of a draft's ids to keep (repeatable; NAME= for one draft): auto "
        "(default, as decode.py: on the CPU the size its vocab_order.json names, if any), "
        "full, or the first N of its vocab_order.json",
    )
    p.add_argument(
        "--methods",
        default=None,
        help="comma list of vanilla, pld[:k,d,t], eagle3[:k,d,t][@NAME] "
        "(default: vanilla,pld and eagle3 when there is a draft)",
    )


def _run_flags(p: argparse.ArgumentParser) -> None:
    """What is decoded and how: the questions, sampling, batches, devices, output."""
    p.add_argument(
        "--bench", default="spec_bench", help="spec_bench | mt_bench | gsm8k | question.jsonl PATH"
    )
    p.add_argument(
        "--questions",
        type=int,
        default=None,
        help="first N questions of EACH category (MT-bench: 8 categories, so N=1 runs 8 "
        "questions); the total is printed at the start",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per turn")
    p.add_argument("--seeds", type=int, default=None, help="default: 1 at T=0, 5 at T>0")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", default=None, choices=list(DTYPES))
    p.add_argument(
        "--mesh", default=None, help="DATAxMODEL devices (e.g. 1x8; default: one device)"
    )
    p.add_argument("--out", default="runs/eval", help="output directory (resumable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the vanilla runs: tau and acceptance only (no speedup, no exactness)",
    )
    p.add_argument(
        "--replay",
        action="store_true",
        help="greedy only: replay pld and eagle3 over vanilla's answers (run first) instead of "
        "decoding them: the same tau and acceptance from draft-only rounds; no timing, no "
        "speedup (docs/replay.md)",
    )


def drafts_of(args) -> tuple[str, ...]:
    """--draft values; none given on the embedded target: its shipped head (as in decode.py)."""
    if args.draft or args.target is not None:
        return tuple(args.draft)

    return (str(default_head()),)


def main(argv=None) -> int:

    args = parse_args(argv)
    compile_cache.enable()
    opts = EvalOptions(
        out=Path(args.out),
        target=args.target,
        drafts=drafts_of(args),
        methods=args.methods,
        bench=args.bench,
        questions=args.questions,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seeds=args.seeds,
        batch_size=args.batch_size,
        dtype=args.dtype,
        mesh=args.mesh,
        progress=not args.no_progress,
        baseline=not args.no_baseline,
        draft_vocab=tuple(args.draft_vocab),
        replay=args.replay,
    )
    try:
        distributed.initialize()  # a pod / SLURM / multi-process job: join it first
        run_eval(opts)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: rerun with --out {args.out} to resume", file=sys.stderr)
        return 130
    print((opts.out / "report.md").read_text())
    print(f"wrote {opts.out}/results.json, report.md and plots", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
