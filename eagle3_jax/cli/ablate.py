"""Run an ablation grid: heads trained from one set of precomputed features, one table.

  python -m eagle3_jax ablate --config configs/ablate_smollm2.py
  python -m eagle3_jax ablate --config configs/ablate_smollm2.py --cells default,top_layer_only
  python -m eagle3_jax ablate --config configs/ablate_smollm2.py --config.max_steps=50 --out runs/x

`--config.FIELD=VALUE` overrides a field of the grid's base TrainConfig (every cell). Rerunning the
same command resumes: features, finished cells and evaluated questions are kept. Writes
OUT/results.json, OUT/report.md, OUT/tau_per_cell.png, OUT/acc_by_ttt_step.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from eagle3_jax import compile_cache, distributed
from eagle3_jax.ablation.config import load_ablation
from eagle3_jax.ablation.report import report_markdown
from eagle3_jax.ablation.runner import run_ablation
from eagle3_jax.errors import Eagle3Error, Stopped
from eagle3_jax.training.config import apply_overrides


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m eagle3_jax ablate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="a configs/ablate_*.py file")
    p.add_argument("--out", default=None, help="output directory (default: the config's out_dir)")
    p.add_argument("--cells", default=None, help="comma list of cell names (default: all)")
    p.add_argument("--bench", default=None, help="override the grid's evaluation bench")
    p.add_argument("--questions", type=int, default=None, help="override questions per task")
    p.add_argument(
        "--no-eval", action="store_true", help="train the cells only (no harness run per cell)"
    )
    p.add_argument("--no-progress", action="store_true")
    return p.parse_known_args(argv)


def main(argv=None) -> int:

    args, rest = parse_args(argv)
    compile_cache.enable()
    try:
        distributed.initialize()  # a pod / SLURM / multi-process job: join it first
        ac = load_ablation(args.config)
        ac = dataclasses.replace(ac, base=apply_overrides(ac.base, rest))
        for name in ("bench", "questions"):
            if getattr(args, name) is not None:
                ac = dataclasses.replace(ac, **{name: getattr(args, name)})
        if args.out:
            ac = dataclasses.replace(ac, out_dir=args.out)
        if args.no_eval:
            ac = dataclasses.replace(ac, evaluate=False)
        only = [c.strip() for c in args.cells.split(",")] if args.cells else None
        result = run_ablation(ac, only=only, progress=not args.no_progress)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(e, file=sys.stderr)
        return e.EXIT_STATUS

    print(report_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
