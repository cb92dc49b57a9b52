#!/usr/bin/env python
"""The fusion ablation at a budget where heads are trained (issue 62), end to end and resumable.

  .venv/bin/python benchmarks/fusion_ablation_trained.py \
      --publish benchmarks/results/fusion_ablation_trained          # on a GPU: device_job.py

Per cell of the grid (configs/fusion_ablation_trained_smollm2.py), measured to the end before the
next: 1. its head trained (`ablate --cells CELL --no-eval`; the same records in the same order
for every cell, a constant learning rate after warmup, a head exported at every budget and
validated along the way); 2. for each of the grid's benches, one harness run of plain decoding
and the cell's heads at every budget, replayed (`eval --replay`); both kept under
RESULTS/groups/CELL (results_BENCH.json.gz, the curve, the config) with a stamp of what decides
them, so that a fresh machine with them goes on with the next cell. 3. The report
(eagle3_jax.evaluation.budget_report): every cell against --reference at every budget, on each
bench, which differences are real and from which budget; the held-out curves; tau_vs_tokens.png.
Rerun the same command after any stop. `--config.FIELD=VALUE` overrides the grid's base.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from eagle3_jax.ablation.status import cell_status, running_line, status_lines, store_line
from eagle3_jax.checkpoints import resolve_target, target_digest
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation import budget_report, study
from eagle3_jax.evaluation.questions import BENCHES, load_questions
from eagle3_jax.evaluation.records import read_results

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fusion_ablation import describe, parse_args, pick_cells  # noqa: E402
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
GRID = ROOT / "configs/fusion_ablation_trained_smollm2.py"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--grid" or a.startswith("--grid=") for a in argv):
        argv = ["--grid", str(GRID), *argv]
    if not any(a == "--out" or a.startswith("--out=") for a in argv):
        argv += ["--out", str(ROOT / "runs/fusion_ablation_trained_eval")]
    args, overrides = parse_args(argv)
    if args.status:
        print("\n".join(status(args, overrides)))
        return 0
    return locked(Path(args.out), "trained fusion ablation", lambda o: stages(args, overrides, o))


def status(args, overrides: list[str]) -> list[str]:
    """Where the study stands (starts nothing): the driver, every cell's training, each harness
    run under --out/eval/CELL/BENCH against its bench's questions, the groups kept."""
    grid = load_grid(args.grid, overrides)
    root, out = grid_root(grid), Path(args.out)
    lines = [running_line(out, "trained fusion ablation")]
    lines.append(
        "features: computed online by each cell" if grid.online_features
        else store_line(root / "features")
    )  # fmt: skip
    lines += status_lines(cell_status(grid, root), {})
    for bench, q in grid.measured():
        q = args.questions if args.questions is not None else q
        runs = {f"{c.name} {bench_name(bench)}": out / "eval" / c.name / bench_name(bench)
                for c in grid.cells if (out / "eval" / c.name / bench_name(bench)).is_dir()}  # fmt: skip
        lines += status_lines([], runs, load_questions(bench, q))
    groups = Path(args.publish or out) / "groups"
    kept = ", ".join(c.name for c in kept_groups(grid, groups)) or "none yet"
    return lines + [f"groups measured ({groups}): {kept}"]


def budgets_of(grid) -> list[int]:
    return list(grid.budgets or (grid.base.optim.max_steps,))


def bench_name(bench: str) -> str:
    """A bench as its files and the report name it: a built-in's name, a question file's stem."""
    return bench if bench in BENCHES else Path(bench).name.split(".")[0]


def head_dir(cdir: Path, step: int, last: int) -> Path:
    """The head a cell exported at `step` (its final head at the last step)."""
    return cdir / "head" if step == last else cdir / "heads" / f"step_{step:06d}"


def stages(args, overrides: list[str], out: Path) -> None:
    grid = load_grid(args.grid, overrides)
    names = [c.name for c in grid.cells]
    if args.reference not in names:
        raise Eagle3Error(f"--reference {args.reference} is not a cell of {args.grid}: {names}")
    root = grid_root(grid)
    k, d, n = grid.tree
    benches = [(b, args.questions if args.questions is not None else q)
               for b, q in grid.measured()]  # fmt: skip
    target = resolve_target(grid.base.corpus.target or None)
    results = Path(args.publish or out) / "groups"
    common = {
        "target": target_digest(target, times=False),
        "benches": [list(b) for b in benches],
        "budgets": budgets_of(grid),
        "tree": list(grid.tree),
        "max_new_tokens": grid.max_new_tokens,
        "batch_size": args.batch_size,
        "dtype": grid.dtype,
    }
    pending = pick_cells(pending_groups(grid, results, common, "ablation"), args.cells, names)
    report_stage(args, out, grid, results)
    last = grid.base.optim.max_steps
    for c, gdir, key in pending:
        cdir = root / "cells" / c.name
        if not args.skip_train:  # 1
            run([PY, "-m", "eagle3_jax", "ablate", "--config", args.grid, "--cells", c.name,
                 "--no-eval", "--no-progress", *overrides])  # fmt: skip
        files = {}
        for bench, questions in benches:  # 2, each resuming from its records
            where = out / "eval" / c.name / bench_name(bench)
            ev = [PY, "-m", "eagle3_jax", "eval", "--methods", f"vanilla,eagle3:{k},{d},{n}",
                  "--replay", "--bench", bench, "--max-new-tokens", str(grid.max_new_tokens),
                  "--no-progress", "--batch-size", str(args.batch_size),
                  "--out", str(where)]  # fmt: skip
            for b in budgets_of(grid):
                ev += ["--draft", f"{budget_report.head_name(c.name, b)}={head_dir(cdir, b, last)}"]
            if grid.base.corpus.target:
                ev += ["--target", str(grid.base.corpus.target)]
            if grid.dtype:
                ev += ["--dtype", grid.dtype]
            if questions:
                ev += ["--questions", str(questions)]
            run(ev)
            files[f"results_{bench_name(bench)}.json.gz"] = where / "results.json"
        publish_group(files, cdir, gdir, key)
        report_stage(args, out, grid, results)


def report_stage(args, out: Path, grid, results: Path) -> None:
    """3: the report of the groups kept so far (no head needed), into --out and beside them."""
    kept = kept_groups(grid, results)
    if not kept:
        return
    runs = {}
    for bench in (bench_name(b) for b, _ in grid.measured()):
        parts = [(c.name, results / c.name / f"results_{bench}.json.gz") for c in kept]
        parts = [(name, p) for name, p in parts if p.exists()]
        if parts:
            runs[bench] = study.merge_groups(
                [read_results(p) for _, p in parts], [name for name, _ in parts]
            )
    curves = {c.name: cell_curve(results.parent, c.name, study.read_curve(results / c.name))
              for c in kept}  # fmt: skip
    cells = {c.name: describe(c.overrides) for c in kept}
    text, summary = budget_report.report(
        runs, cells, args.reference, budgets_of(grid), curves,
        title="Which target layers to fuse, at budgets where heads are trained",
    )  # fmt: skip
    text = so_far(text, grid, kept, "Cells")
    summary["cells_measured"] = [c.name for c in kept]
    (out / "report.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    png = budget_report.plot_tau_vs_tokens(curves, out)
    print(text)
    if args.publish:
        pub = Path(args.publish)
        (pub / "curves").mkdir(parents=True, exist_ok=True)
        for p in (out / "report.md", out / "summary.json", png):
            shutil.copy2(p, pub / p.name)
        for name, curve in curves.items():
            (pub / "curves" / f"{name}.json").write_text(json.dumps(curve) + "\n")
        print(f"published to {pub}")


if __name__ == "__main__":
    sys.exit(main())
