"""The SmolLM2 studies on a lent accelerator, each within one call's budget (issue 33): the
draft-vocabulary study (benchmarks/vocab_study.py, item 5) and the fusion ablation
(benchmarks/fusion_ablation.py, item 3).

A study resumes stage by stage and cell by cell from runs/ (ignored by git, so the machine keeps it
between calls while it is warm): a call that runs out of time is followed by the same call, which
goes on where it stopped. Whatever is finished (each measured group's results, the published
report, every cell's training curve, the logs) is packed into $OUT/STUDY.tar.gz after every call,
so a lease that ends midway still returns the groups it measured. On an accelerator the vocabulary
study decodes every tree for real (τ and speedup); the fusion ablation replays its heads (τ only,
as on the CPU) and trains all four cells there, so that they share a platform.

  carry [".device/pK", ".device/whl"]  python3 scripts/device_job.py vocab-study --minutes 9 --out $OUT
  carry [".device/pK", ".device/whl"]  python3 scripts/device_job.py fusion-ablation --minutes 9 --out $OUT
  (after the GGUF's parts, as `run`; again while warm to continue)

`fusion-ablation` runs the trained grid (issue 62: benchmarks/fusion_ablation_trained.py,
configs/fusion_ablation_trained_smollm2.py, five cells at ~20M tokens each, measured at four
budgets). Its training data must be whole before any cell trains (the same tokens a cell), so a
regeneration phase comes first: every user turn of the carried conversations (.device/conv, as
`run`'s) answered in context into runs/turns/regenerated_turns.jsonl, resumably, until all are
answered (then runs/turns/regenerated_turns.complete); the answers go into $OUT gzipped (15 MiB
parts) after each call that added some, and a later lease restores them from
.device/turns/ (carry the parts and the marker there: no regeneration again). The study phase
starts only once the answers are complete, in the same call when time is left.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import shutil
import sys
import tarfile
from pathlib import Path

from device_steps import common as c


@dataclasses.dataclass(frozen=True)
class Study:
    name: str  # the phase, the log and the tarball's stem
    script: str  # the study's driver, from the repository root
    grid: str  # its default grid, under configs/
    sizes: bool  # whether the driver takes --max-new-tokens (the fusion ablation's is the grid's)
    regenerate: bool = False  # the grid trains on runs/turns' answers: answer them all first

    @property
    def home(self) -> Path:
        """The study's --out on the device (its harness runs); --publish is home/published."""
        return c.ROOT / "runs" / f"{self.name}_device"

    @property
    def published(self) -> Path:
        return self.home / "published"

    @property
    def archive(self) -> str:
        return f"{self.name}.tar.gz"


STUDIES = {
    "vocab-study": Study(
        "vocab_study", "benchmarks/vocab_study.py", "vocab_study_smollm2.py", sizes=True
    ),
    "fusion-ablation": Study(
        "fusion_ablation_trained",
        "benchmarks/fusion_ablation_trained.py",
        "fusion_ablation_trained_smollm2.py",
        False,
        regenerate=True,
    ),
}


def complete_marker() -> Path:
    """Written once every carried conversation is answered."""
    return c.TURNS.with_suffix(".complete")


def carried() -> Path:
    """Where a later lease carries the answers: regenerated_turns.jsonl.gz.partN and complete."""
    return c.DEVICE / "turns"


def add_args(p, study: Study) -> None:
    p.add_argument("--minutes", type=float, required=True, help="this call's budget")
    p.add_argument("--out", default=None, help=f"default: runs/{study.name}_device/out")
    p.add_argument("--grid", default=str(c.ROOT / "configs" / study.grid))
    if study.sizes:
        p.add_argument("--questions", type=int, default=20, help="per Spec-Bench task")
        p.add_argument("--max-new-tokens", type=int, default=256)
    else:
        p.add_argument(
            "--questions", type=int, default=None, help="per category; default the grid's"
        )
    p.add_argument("--reserve-s", type=float, default=30.0, help="kept for packing")
    p.add_argument("--target", default=None, help="a converted target (CPU dry runs)")
    p.add_argument("--no-install", action="store_true")
    if study.regenerate:
        p.add_argument("--regen-batch-size", type=int, default=512)
        p.add_argument(
            "--regen-max-new-tokens", type=int, default=256,
            help="per answered turn (a toy target's context needs fewer: CPU dry runs)",
        )  # fmt: skip
        p.add_argument("--limit", type=int, default=0, help="first N conversations (dry runs)")
        p.add_argument(
            "--no-regenerate", action="store_true",
            help="the answers in runs/turns are taken as they are (dry runs)",
        )  # fmt: skip
    p.add_argument(
        "--study-arg", action="append", default=[], help=f"passed to {study.script} (repeatable)"
    )
    p.set_defaults(study=study)


def command(args) -> list[str]:
    """The study's command line (run as a phase)."""
    st: Study = args.study
    cmd = [sys.executable, st.script, "--grid", args.grid, "--out", str(st.home),
           "--publish", str(st.published)]  # fmt: skip
    if args.questions is not None:
        cmd += ["--questions", str(args.questions)]
    if st.sizes:
        cmd += ["--max-new-tokens", str(args.max_new_tokens)]
    cmd += args.study_arg
    if args.target:
        cmd.append(f"--config.target={args.target}")
    return cmd


def step(args) -> int:
    st: Study = args.study
    c.check_budget(args.minutes)
    out = Path(args.out or st.home / "out")
    out.mkdir(parents=True, exist_ok=True)
    log = c.Log(st.home / "device_log.txt")
    log(f"start: {c.accelerator()}")
    rc = 1
    try:
        env = c.env(args)
        if not args.target and not c.gguf_ready(log):
            return 1
        if st.regenerate and not getattr(args, "no_regenerate", False):
            if not answers_ready(args, log, env, out):
                log("the answers are not complete yet: call again")
                return 0
        left = log.left(args.minutes) - args.reserve_s
        rc = c.phase(log, st.name, command(args), env, left, log_dir=st.home)
        log(
            f"the {st.name} finished" if rc == 0 else f"the {st.name} stopped (rc {rc}): call again"
        )
    finally:
        n = pack(st, out, grid_root(args.grid))
        log(f"packed {n} files into {out / st.archive}")
    return 0 if rc in (0, -9) else rc  # -9: out of time, resumable


def answers_ready(args, log: c.Log, env: dict, out: Path) -> bool:
    """Whether every carried conversation is answered in every turn (runs/turns/): restored from
    .device/turns/ where a later lease carried them, else answered here within this call's time
    (resumable by conversation) and, when some were added, packed into `out` gzipped in parts."""
    COMPLETE, CARRIED = complete_marker(), carried()
    if not COMPLETE.exists() and (CARRIED / "complete").exists():
        parts = sorted(CARRIED.glob("regenerated_turns.jsonl.gz.part*"),
                       key=lambda p: int(p.name.rsplit("part", 1)[1]))  # fmt: skip
        c.TURNS.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(io.BytesIO(b"".join(p.read_bytes() for p in parts))) as f:
            c.TURNS.write_bytes(f.read())
        COMPLETE.write_text((CARRIED / "complete").read_text())
        log(f"answers restored from {CARRIED}: {c.count_lines(c.TURNS)} conversations")
    if COMPLETE.exists():
        return True
    conversations = c.FULL_CONVERSATIONS if c.FULL_CONVERSATIONS.exists() else (
        c.SHIPPED_CONVERSATIONS)  # fmt: skip
    before = c.count_lines(c.TURNS)
    cmd = [sys.executable, "-m", "eagle3_jax", "regenerate", str(conversations), str(c.TURNS),
           "--all-turns", "--max-len", "2048", "--batch-size", str(args.regen_batch_size),
           "--chunk", "512", "--max-new-tokens", str(args.regen_max_new_tokens),
           "--max-batch-tokens", "262144",
           "--buckets", "256,512", "--scan-layers", "--no-progress",
           *(["--target", args.target] if args.target else []),
           *(["--limit", str(args.limit)] if args.limit else [])]  # fmt: skip
    rc = c.phase(log, "regenerate", cmd, env, log.left(args.minutes) - args.reserve_s - 60)
    after = c.count_lines(c.TURNS)
    log(f"conversations answered in every turn: {after} ({after - before} this call)")
    if rc == 0 and not after:  # every conversation skipped: no cell may train on nothing
        log("regenerate answered no conversation (each too long for the context?): not complete")
    elif rc == 0:
        COMPLETE.write_text(f"{conversations.name} {after}\n")
    if after > before or (rc == 0 and after):
        gz = out / "regenerated_turns.jsonl.gz"
        with open(c.TURNS, "rb") as src, gzip.open(gz, "wb") as dst:
            shutil.copyfileobj(src, dst)
        parts = c.split_file(gz, out / "turns", c.PART_MIB * c.MIB, gz.name)
        gz.unlink()
        if COMPLETE.exists():
            shutil.copy2(COMPLETE, out / "turns" / "complete")
        log(f"answers packed into {len(parts)} parts under {out / 'turns'}")
    return rc == 0 and after > 0


def grid_root(grid: str) -> Path:
    """Where the grid trains its cells (its out_dir)."""
    sys.path.insert(0, str(c.ROOT))
    from eagle3_jax.ablation.config import load_ablation

    out = Path(load_ablation(grid).out_dir)
    return out if out.is_absolute() else c.ROOT / out


def pack(st: Study, out: Path, root: Path) -> int:
    """The published report and groups, every cell's curve and config, and the logs, as one
    tarball (the device tool returns at most 8 files)."""
    pub = st.published
    files = [p for p in sorted(pub.rglob("*")) if p.is_file()] if pub.exists() else []
    for cell in sorted((root / "cells").glob("*")) if (root / "cells").exists() else []:
        files += [cell / n for n in ("metrics.jsonl", "validation.jsonl", "train_config.json",
                                     "cell.json") if (cell / n).exists()]  # fmt: skip
    files += sorted(st.home.glob("*.log")) + sorted(st.home.glob("device_log.txt"))
    tmp = out / (st.archive + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=str(f.relative_to(c.ROOT)))
    tmp.replace(out / st.archive)
    return len(files)
