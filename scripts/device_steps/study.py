"""The draft-vocabulary study (benchmarks/vocab_study.py, the SmolLM2 grid by default) on a lent
accelerator, within one call's budget (issue 33 item 5).

The study resumes stage by stage and cell by cell from runs/ (ignored by git, so the machine keeps
it between calls while it is warm): a call that runs out of time is followed by the same call,
which goes on where it stopped. On an accelerator every tree decodes for real (τ and speedup).
Whatever is finished (each measured group's results, the published report, every cell's training
curve, the logs) is packed into $OUT/vocab_study.tar.gz after every call, so a lease that ends
midway still returns the groups it measured; committed, they let the next lease (or a CPU) go on
with the next cell.

  carry [".device/pK", ".device/whl"]  python3 scripts/device_job.py vocab-study --minutes 9 --out $OUT
  (after the GGUF's parts, as `run`; again while warm to continue)
"""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

from device_steps import common as c

GRID = c.ROOT / "configs" / "vocab_study_smollm2.py"
STUDY = c.ROOT / "runs" / "vocab_study_device"  # the study's --out (its harness runs, heads)
PUBLISHED = STUDY / "published"
ARCHIVE = "vocab_study.tar.gz"


def add_args(p) -> None:
    p.add_argument("--minutes", type=float, required=True, help="this call's budget")
    p.add_argument("--out", default=None, help="default: runs/vocab_study_device/out")
    p.add_argument("--grid", default=str(GRID))
    p.add_argument("--questions", type=int, default=20, help="per Spec-Bench task")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--reserve-s", type=float, default=30.0, help="kept for packing")
    p.add_argument("--target", default=None, help="a converted target (CPU dry runs)")
    p.add_argument("--no-install", action="store_true")
    p.add_argument(
        "--study-arg", action="append", default=[], help="passed to vocab_study.py (repeatable)"
    )


def command(args) -> list[str]:
    """The study's command line (run as a phase)."""
    cmd = [sys.executable, "benchmarks/vocab_study.py", "--grid", args.grid,
           "--out", str(STUDY), "--publish", str(PUBLISHED),
           "--questions", str(args.questions), "--max-new-tokens", str(args.max_new_tokens),
           *args.study_arg]  # fmt: skip
    if args.target:
        cmd.append(f"--config.target={args.target}")
    return cmd


def step(args) -> int:
    c.check_budget(args.minutes)
    out = Path(args.out or STUDY / "out")
    out.mkdir(parents=True, exist_ok=True)
    log = c.Log(STUDY / "device_log.txt")
    log(f"start: {c.accelerator()}")
    rc = 1
    try:
        env = c.env(args)
        if not args.target and not c.gguf_ready(log):
            return 1
        left = log.left(args.minutes) - args.reserve_s
        rc = c.phase(log, "vocab_study", command(args), env, left, log_dir=STUDY)
        log("the study finished" if rc == 0 else f"the study stopped (rc {rc}): call again")
    finally:
        n = pack(out, grid_root(args.grid))
        log(f"packed {n} files into {out / ARCHIVE}")
    return 0 if rc in (0, -9) else rc  # -9: out of time, resumable


def grid_root(grid: str) -> Path:
    """Where the grid trains its cells (its out_dir)."""
    sys.path.insert(0, str(c.ROOT))
    from eagle3_jax.ablation.config import load_ablation

    out = Path(load_ablation(grid).out_dir)
    return out if out.is_absolute() else c.ROOT / out


def pack(out: Path, root: Path) -> int:
    """The published report, every cell's curve and config, and the logs, as one tarball (the
    device tool returns at most 8 files)."""
    files = [p for p in sorted(PUBLISHED.rglob("*")) if p.is_file()] if PUBLISHED.exists() else []
    for cell in sorted((root / "cells").glob("*")) if (root / "cells").exists() else []:
        files += [cell / n for n in ("metrics.jsonl", "validation.jsonl", "train_config.json",
                                     "cell.json") if (cell / n).exists()]  # fmt: skip
    files += sorted(STUDY.glob("*.log")) + sorted(STUDY.glob("device_log.txt"))
    tmp = out / (ARCHIVE + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=str(f.relative_to(c.ROOT)))
    tmp.replace(out / ARCHIVE)
    return len(files)
