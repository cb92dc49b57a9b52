#!/usr/bin/env python
"""Which target layers to fuse (and how long a training-time test), end to end and resumable.

  .venv/bin/python benchmarks/fusion_ablation.py --publish benchmarks/results/fusion_ablation

Each cell is measured to the end before the next, and its results are kept under
RESULTS/groups/CELL (RESULTS: --publish, else --out), stamped with what decides them (its training
config, the target, the questions, the tree): they stand without its head, so a fresh machine with
them committed goes on with the next cell. Rerun the same command after any stop; each stage
resumes or skips what is done. Per cell:
  1. its head is trained (`python -m eagle3_jax ablate --config GRID --cells CELL --no-eval`:
     one feature store, the same data in the same order and the same step budget for every
     cell, each head validated on held-out conversations along the way: its curve);
  2. one harness run of plain decoding and its head on the grid's questions and tree, the head
     replayed over plain decoding's greedy answers (`eval --replay`, docs/replay.md: the tau
     decoding gives, from draft-only rounds).
Then 3, the report (eagle3_jax.evaluation.grid_report) from the cells' results, made at the
start and after each cell from those measured so far (it names the others): tau per cell and
task, per-question paired differences against --reference with 95 % intervals, the held-out
curves, plots. With --publish DIR: report.md, summary.json, the plots and the curves go there
beside the groups. `--config.FIELD=VALUE` overrides the grid's base TrainConfig (every cell), as
`ablate` takes it (a target on disk: `--config.target=DIR`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from eagle3_jax.ablation.config import trained_head
from eagle3_jax.ablation.status import cell_status, running_line, status_lines, store_line
from eagle3_jax.checkpoints import load_target_config, resolve_target, target_digest
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation import grid_report, study
from eagle3_jax.evaluation.questions import load_questions
from eagle3_jax.evaluation.records import read_results

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vocab_study import (  # noqa: E402  the same stage runner, lock and groups
    cell_curve,
    grid_root,
    kept_groups,
    load_grid,
    locked,
    pending_groups,
    publish_group,
    run,
    so_far,
)

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """(the ablation's flags, the grid's `--config.FIELD=VALUE` overrides)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--grid", default=str(ROOT / "configs/fusion_ablation_smollm2.py"))
    ap.add_argument("--reference", default="low_mid_high", help="the cell others are paired with")
    ap.add_argument("--bench", default=None, help="default: the grid's")
    ap.add_argument("--questions", type=int, default=None, help="per category; default: the grid's")
    ap.add_argument(
        "--batch-size", type=int, default=8,
        help="questions per batch of the replayed run (untimed: greedy outputs, target passes and "
        "acceptance are the same at any batch)",
    )  # fmt: skip
    ap.add_argument("--out", default=str(ROOT / "runs/fusion_ablation_eval"))
    ap.add_argument("--publish", default=None, help="copy the report and results here")
    ap.add_argument(
        "--skip-train", action="store_true",
        help="stage 1 off: every cell still to measure has its head, trained under the cell's "
        "config (its cell.json, checked before any work)",
    )  # fmt: skip
    ap.add_argument(
        "--cells", default=None,
        help="comma-separated cells to measure now, in this order (default: every cell not "
        "measured yet, in the grid's order); the report still covers every kept group",
    )  # fmt: skip
    ap.add_argument(
        "--status", action="store_true",
        help="print where the ablation stands (cells, harness records) and start nothing",
    )  # fmt: skip
    args, rest = ap.parse_known_args(argv)
    bad = [a for a in rest if not a.startswith("--config.")]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    return args, rest


def describe(overrides: dict) -> str:
    """A cell's overrides as the report's 'what differs' column."""
    names = {"aux_layer_ids": "layers", "ttt_steps": "TTT steps"}
    return ", ".join(
        f"{names.get(k, k)} {'/'.join(map(str, v)) if isinstance(v, tuple | list) else v}"
        for k, v in overrides.items()
    )


def what_is_asked(args: argparse.Namespace, grid) -> tuple[str, int | None]:
    """(bench, questions per category): the flags', else the grid's."""
    return (
        args.bench or grid.bench,
        args.questions if args.questions is not None else grid.questions,
    )


def main(argv=None) -> int:
    args, overrides = parse_args(argv)
    if args.status:
        grid = load_grid(args.grid, overrides)
        bench, questions = what_is_asked(args, grid)
        root = grid_root(grid)
        lines = [running_line(Path(args.out), "ablation"), store_line(root / "features")]
        lines += status_lines(
            cell_status(grid, root),
            {p.name: p for p in sorted((Path(args.out) / "eval").glob("*")) if p.is_dir()},
            load_questions(bench, questions),
        )
        groups = Path(args.publish or args.out) / "groups"
        kept = ", ".join(c.name for c in kept_groups(grid, groups)) or "none yet"
        print("\n".join(lines + [f"groups measured ({groups}): {kept}"]))
        return 0
    return locked(Path(args.out), "fusion ablation", lambda out: stages(args, overrides, out))


def stages(args: argparse.Namespace, overrides: list[str], out: Path) -> None:
    grid = load_grid(args.grid, overrides)
    names = [c.name for c in grid.cells]
    if args.reference not in names:
        raise Eagle3Error(f"--reference {args.reference} is not a cell of {args.grid}: {names}")
    root = grid_root(grid)
    k, d, n = grid.tree
    bench, questions = what_is_asked(args, grid)
    target = resolve_target(grid.base.corpus.target or None)
    results = Path(args.publish or out) / "groups"
    common = {
        "target": target_digest(target, times=False),
        "bench": bench,
        "questions": questions,
        "tree": list(grid.tree),
        "max_new_tokens": grid.max_new_tokens,
        "batch_size": args.batch_size,
        "dtype": grid.dtype,
    }
    pending = pick_cells(pending_groups(grid, results, common, "ablation"), args.cells, names)
    report_stage(args, out, grid, results)  # 3, of the groups kept so far
    if args.skip_train:  # every head there, trained under its cell's config, before any work
        tcfg = load_target_config(target)
        for c, _, _ in pending:
            trained_head(grid, c, root, tcfg)
    for c, gdir, key in pending:
        if not args.skip_train:  # 1
            run([PY, "-m", "eagle3_jax", "ablate", "--config", args.grid, "--cells", c.name,
                 "--no-eval", "--no-progress", *overrides])  # fmt: skip
        ev = [PY, "-m", "eagle3_jax", "eval", "--methods", f"vanilla,eagle3:{k},{d},{n}",
              "--replay", "--bench", bench, "--max-new-tokens", str(grid.max_new_tokens),
              "--no-progress", "--batch-size", str(args.batch_size),
              "--out", str(out / "eval" / c.name),
              "--draft", f"{c.name}={root / 'cells' / c.name / 'head'}"]  # fmt: skip
        if grid.base.corpus.target:
            ev += ["--target", str(grid.base.corpus.target)]
        if grid.dtype:
            ev += ["--dtype", grid.dtype]
        if questions:
            ev += ["--questions", str(questions)]
        run(ev)  # 2 (resumes from its records)
        files = {"results.json.gz": out / "eval" / c.name / "results.json"}
        publish_group(files, root / "cells" / c.name, gdir, key)
        report_stage(args, out, grid, results)  # 3, of the groups kept so far


def pick_cells(pending: list[tuple], chosen: str | None, names: list[str]) -> list[tuple]:
    """The pending (cell, folder, stamp) entries of the --cells asked for, in their order (all
    of them, in the grid's order, without --cells); a name the grid lacks is refused before any
    work, and one measured already is simply not pending."""
    if chosen is None:
        return pending
    asked = [c.strip() for c in chosen.split(",") if c.strip()]
    unknown = [c for c in asked if c not in names]
    if unknown or not asked:
        raise Eagle3Error(f"--cells {chosen}: the grid's cells are {', '.join(names)}")
    by_name = {p[0].name: p for p in pending}
    return [by_name[c] for c in dict.fromkeys(asked) if c in by_name]


def report_stage(args: argparse.Namespace, out: Path, grid, results: Path) -> None:
    """3: the report from the groups kept under `results` (no head needed), into --out, and
    with --publish beside the groups; made after each cell, of the cells measured so far (the
    report names the others)."""
    kept = kept_groups(grid, results)
    if not kept:
        return
    groups = [read_results(results / c.name / "results.json.gz") for c in kept]
    merged = study.merge_groups(groups, [c.name for c in kept])
    curves = {c.name: cell_curve(results.parent, c.name, study.read_curve(results / c.name))
              for c in kept}  # fmt: skip
    cells = {c.name: describe(c.overrides) for c in kept}
    text, summary = grid_report.report(
        merged, cells, args.reference, curves, title="Which target layers to fuse"
    )
    text = so_far(text, grid, kept, "Cells")
    summary["cells_measured"] = [c.name for c in kept]
    (out / "report.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    pngs = grid_report.plot(summary, curves, out)
    print(text)
    if args.publish:
        pub = Path(args.publish)
        (pub / "curves").mkdir(parents=True, exist_ok=True)
        for p in [out / "report.md", out / "summary.json", *pngs]:
            shutil.copy2(p, pub / p.name)
        for name, curve in curves.items():
            (pub / "curves" / f"{name}.json").write_text(json.dumps(curve) + "\n")
        print(f"published to {pub}")


if __name__ == "__main__":
    sys.exit(main())
