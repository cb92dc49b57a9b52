"""`python -m eagle3_jax train-timed`: training fitted to a wall-clock budget.

  python -m eagle3_jax train-timed --config=configs/smollm2_135m_gpu.py --minutes=5

What it does, and every flag: `--help` and eagle3_jax/training/timed.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from eagle3_jax import compile_cache, distributed
from eagle3_jax.data import dataset as dsm
from eagle3_jax.errors import Eagle3Error, Stopped
from eagle3_jax.training.config import load_config
from eagle3_jax.training.loop import train
from eagle3_jax.training.run_dir import check_out_dir
from eagle3_jax.training.timed import (
    plan_steps,
    seconds_per_step,
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", required=True)
    p.add_argument("--minutes", type=float, required=True, help="wall-clock budget, whole job")
    p.add_argument("--calibrate-steps", type=int, default=40)
    p.add_argument("--safety", type=float, default=0.9, help="fraction of the rest to plan on")
    p.add_argument("--exports", type=int, default=0, help="intermediate head exports (evenly)")
    p.add_argument("--no-progress", action="store_true")
    args, overrides = p.parse_known_args(argv)

    compile_cache.enable()
    t0 = time.monotonic()
    try:
        distributed.initialize()  # a pod / SLURM / multi-process job: join it first
        tc = load_config(args.config.removeprefix("="), overrides)
        if tc.optim.grad_accum != 1:
            raise Eagle3Error("timed runs plan optimizer steps with grad_accum 1")
        out = Path(tc.run.out_dir)
        if (out / "checkpoints").exists() and any((out / "checkpoints").iterdir()):
            raise Eagle3Error(
                f"{out} already holds checkpoints: a timed run starts fresh; choose another "
                "out_dir (or continue that run with train.py --resume)"
            )
        cal = Path(f"{tc.run.out_dir}_calibration")
        check_out_dir(cal)  # a folder of that name that is not a run of ours is never deleted
        if distributed.is_primary() and cal.exists():
            shutil.rmtree(cal)  # an earlier calibration: thrown away, as this one will be
        distributed.barrier("calibration folder")
        log_every = max(1, args.calibrate_steps // 8)
        cal_tc = tc.replace(
            out_dir=str(cal),
            max_steps=args.calibrate_steps,
            save_every=0,
            export_every=0,
            log_every=log_every,
            val_data="",  # its head is thrown away: validating it would only spend the budget
        )
        t_cal = time.monotonic()
        try:
            train(cal_tc, progress=not args.no_progress)
        except Stopped:  # nothing to resume: the calibration is thrown away and made again
            raise Stopped(
                "stopped by SIGTERM while calibrating, before the run itself started: run the same "
                "command again"
            ) from None
        # one plan for every process of a run (each timing its own would disagree on max_steps
        # and leave the others waiting at a collective): process 0 measures and decides
        plan = distributed.from_primary(
            "timed plan", lambda: make_plan(args, tc, cal, out, t0, t_cal)
        )
        steps = plan["max_steps"]
        # rounded up: at most `exports` intermediate heads before the final one
        export_every = -(-steps // (args.exports + 1)) if args.exports else 0
        run_tc = tc.replace(max_steps=steps, export_every=export_every)
        try:
            summary = train(run_tc, progress=not args.no_progress)
        except Stopped as e:
            # train.py resumes it with the plan's steps (timed.json), not the config's
            raise Stopped(
                f"{e}; the planned run resumes with train.py --config={args.config} (and the same "
                f"overrides) --resume --config.max_steps={steps} --config.export_every={export_every}"
            ) from None
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(e, file=sys.stderr)
        return e.EXIT_STATUS
    print(json.dumps({**summary, "timed": plan}, indent=1))
    return 0


def make_plan(args, tc, cal: Path, out: Path, t0: float, t_cal: float) -> dict:
    """The run's max_steps from the calibration (process 0: it holds the metrics), with the data
    the plan was made for copied into out_dir and the plan written to out_dir/timed.json."""
    sps = seconds_per_step(cal / "metrics.jsonl")
    # the real run pays the calibration run's fixed costs again (loading the target,
    # compiling unless cached, exporting the head); counting the calibration's whole wall
    # time less its steps also charges its data preparation (tokenising, a regeneration),
    # which the real run reuses: conservative, so prepare the data first for a tight plan
    fixed = max(0.0, time.monotonic() - t_cal - args.calibrate_steps * sps)
    ds = dsm.load(cal / "dataset.npz")
    oc = tc.optim
    cap = (oc.epochs * dsm.steps_per_epoch(ds, oc.batch_size)) if oc.epochs else oc.max_steps
    if oc.max_steps:
        cap = min(cap, oc.max_steps)
    left = args.minutes * 60 - (time.monotonic() - t0) - fixed
    if left * args.safety < sps:
        raise Eagle3Error(
            f"the budget of {args.minutes} min is used up: the calibration took "
            f"{time.monotonic() - t0:.0f} s and a run costs {fixed:.0f} s before its first "
            "step; give more minutes"
        )
    steps = plan_steps(left, sps, cap, args.safety)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("dataset.npz", "vocab.npz"):  # the data the plan was made for
        shutil.copy(cal / name, out / name)
    plan = {
        "seconds_per_step": float(sps),
        "budget_s": float(args.minutes * 60),
        "left_s": float(left),
        "fixed_s": float(fixed),
        "max_steps": int(steps),
        "cap_steps": int(cap),
        "calibrate_steps": args.calibrate_steps,
    }
    (out / "timed.json").write_text(json.dumps(plan, indent=1))
    print(f"timed: {json.dumps(plan)}", file=sys.stderr)
    return plan
