"""evaluation/grid_report.py and benchmarks/fusion_ablation.py: a grid's heads measured in one
harness run (replayed over plain decoding), paired against a reference cell, beside their curves."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from eagle3_jax.evaluation import grid_report

ROOT = Path(__file__).resolve().parents[1]


def _results(n=6):
    methods = [{"label": "vanilla", "kind": "vanilla", "tree": [1, 1, 1], "draft": None}]
    for d in ("ref", "top", "same"):
        methods.append({"label": f"eagle3@{d}", "kind": "eagle3", "tree": [10, 8, 60], "draft": d})
    recs = []
    for i in range(n):
        task = "mt_bench" if i % 2 else "qa"
        base = {"question_id": i, "task": task, "seed": 0, "num_generations": 1, "new_tokens": 61}
        recs.append({**base, "method": "vanilla", "target_forwards": 60, "wall_time_s": 4.0})
        # tau = new tokens / rounds (forwards less the prefill's): ref 3; top 2 or 2.4 (a real
        # difference); same 3 give or take a round (none)
        for d, fw in (("ref", 21), ("top", 31 if i % 3 else 26), ("same", 20 + i % 3)):
            recs.append({**base, "method": f"eagle3@{d}", "target_forwards": fw,
                         "wall_time_s": 0.0, "replayed": True})  # fmt: skip
    return {"config": {"methods": methods, "max_new_tokens": 60}, "records": recs}


CELLS = {"ref": "layers 2/15/27", "top": "layers 29", "same": "TTT steps 3", "absent": "x"}


def test_rows_pair_every_cell_with_the_reference():
    rows = {r["cell"]: r for r in grid_report.cell_rows(_results(), CELLS, "ref")}
    assert list(rows) == ["ref", "top", "same"]  # a cell the run lacks gives no row
    assert rows["ref"]["tau"] == pytest.approx(3.0) and "vs_reference" not in rows["ref"]
    assert rows["ref"]["replayed"] and rows["ref"]["questions"] == 6
    assert set(rows["top"]["tau_by_task"]) == {"mt_bench", "qa"}
    assert rows["top"]["vs_reference"]["real"] and rows["top"]["vs_reference"]["mean"] < -0.5
    assert not rows["same"]["vs_reference"]["real"]


def test_mt_bench_categories_get_their_own_columns():
    """Records that carry MT-bench's subcategory are grouped by it (a task without one is its
    own); records written before categories were kept fall back to their task."""
    res = _results()
    for r in res["records"]:
        if r["task"] == "mt_bench":
            r["category"] = "writing" if r["question_id"] % 4 == 1 else "coding"
    rows = {r["cell"]: r for r in grid_report.cell_rows(res, CELLS, "ref")}
    assert list(rows["top"]["tau_by_task"]) == ["qa", "writing", "coding"]
    assert set(rows["top"]["vs_reference_by_task"]) == {"qa", "writing", "coding"}
    text, _ = grid_report.report(res, CELLS, "ref", {})
    assert "| cell | qa | writing | coding |" in text and "Not in this run: absent." in text


def test_a_missing_reference_pairs_nothing():
    """A reference the run lacks: said at the top, every row "-" (not "reference"), no line
    about real differences."""
    text, summary = grid_report.report(_results(), CELLS, "absent", {})
    assert "`absent` is not among the cells measured: nothing is paired below." in text
    assert "| top | layers 29 | 2.12 | - |" in text and "reference |" not in text
    assert "real at 95 %" not in text and "Real differences" not in text
    assert summary["real"] == []


def test_report_says_which_differences_are_real(tmp_path):
    curves = {"ref": [{"step": 50, "tokens": 100, "acc_0": 0.5, "chain_tau": 1.9},
                      {"step": 100, "tokens": 200, "acc_0": 0.61, "chain_tau": 2.1}],
              "top": []}  # fmt: skip
    text, summary = grid_report.report(_results(), CELLS, "ref", curves, title="Fusion")
    assert text.startswith("# Fusion") and "replayed over plain decoding's answers" in text
    assert "| ref | layers 2/15/27 | 3.00 | reference |" in text
    assert "| 0.610 | 2.10 | 100 |" in text  # ref's held-out point at its last validation
    assert "Real differences from `ref` at 95 %: top." in text
    assert summary["real"] == ["top"] and summary["tree"] == [10, 8, 60]
    json.dumps(summary)
    paths = grid_report.plot(summary, curves, tmp_path)
    assert [p.name for p in paths] == ["paired.png", "training_curves.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_curve_table_puts_every_cell_at_every_validation():
    """One row a validation step, one column a cell; a step a cell has not reached is "-", and a
    grid with no curves prints no table."""
    curves = {"ref": [{"step": 100, "tokens": 95058, "acc_0": 0.194, "chain_tau": 1.213},
                      {"step": 200, "tokens": 188620, "acc_0": 0.264, "chain_tau": 1.308}],
              "top": [{"step": 100, "tokens": 95058, "acc_0": 0.105, "chain_tau": 1.108}],
              "four": []}  # fmt: skip
    table = grid_report.curve_table(curves)
    assert "| step | tokens read | ref | top |" in table
    assert "| 100 | 95,058 | 0.194 / 1.21 | 0.105 / 1.11 |" in table
    assert "| 200 | 188,620 | 0.264 / 1.31 | - |" in table
    text, _ = grid_report.report(_results(), CELLS, "ref", curves)
    assert "| 200 | 188,620 | 0.264 / 1.31 | - |" in text
    assert grid_report.curve_table({"ref": []}) == []


@pytest.mark.slow  # two tiny heads trained and a replayed harness run, in subprocesses: ~2 min
def test_fusion_ablation_end_to_end(tiny_target_dir, tmp_path, monkeypatch):
    """benchmarks/fusion_ablation.py on the tiny two-cell grid: trains and replays each cell's head
    in its own harness run, publishes each cell's results as it finishes, reports from them;
    a rerun redoes nothing, and without the heads (a fresh machine) it only reports."""
    from test_ablation import _data  # the tests' folder is on sys.path (rootdir conftest)

    data, qs = _data(tmp_path)
    val = tmp_path / "val.json"  # held-out: the training answers reversed, under other ids
    recs = json.loads(data.read_text())[:3]
    for r in recs:
        r["id"] = "v" + r["id"]
        r["conversations"][1]["value"] = " ".join(r["conversations"][1]["value"].split()[::-1])
    val.write_text(json.dumps(recs))
    grid = tmp_path / "grid.py"
    grid.write_text(
        "import dataclasses, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'configs')!r})\n"
        "import ablate_tiny\n"
        "def get_config():\n"
        "    ac = ablate_tiny.get_config()\n"
        f"    base = ac.base.replace(target={str(tiny_target_dir)!r}, data={str(data)!r},\n"
        "                           max_steps=4, export_every=2, val_every=2,\n"
        f"                           val_data={str(val)!r}, val_conversations=3)\n"
        f"    return dataclasses.replace(ac, base=base, out_dir={str(tmp_path / 'runs')!r})\n"
    )
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import fusion_ablation

    pub = tmp_path / "pub"
    argv = ["--grid", str(grid), "--reference", "default", "--bench", str(qs),
            "--out", str(tmp_path / "eval"), "--publish", str(pub)]  # fmt: skip
    assert fusion_ablation.main(argv) == 0
    text = (pub / "report.md").read_text()
    assert "| default | " in text and "| top_layer_only | layers 5, TTT steps 2 |" in text
    for cell in ("default", "top_layer_only"):
        assert (pub / "groups" / f"{cell}.inputs.json").is_file()
        with gzip.open(pub / "groups" / cell / "results.json.gz", "rt") as f:
            recs = json.load(f)["records"]
        heads = [r for r in recs if r["method"] != "vanilla"]
        assert heads and all(r["replayed"] for r in heads)
        assert {r["method"] for r in recs} >= {"vanilla"} and len({r["method"] for r in heads}) == 1
    curve = json.loads((pub / "curves/default.json").read_text())
    assert [p["step"] for p in curve] == [2, 4]
    before = (tmp_path / "eval/eval/default/records.jsonl").read_bytes()
    assert fusion_ablation.main(argv + ["--skip-train"]) == 0
    assert (tmp_path / "eval/eval/default/records.jsonl").read_bytes() == before
    shutil.rmtree(tmp_path / "runs" / "cells")  # the heads gone: the report from the groups
    report = (pub / "report.md").read_text()
    assert fusion_ablation.main([*argv[:-3], str(tmp_path / "eval2"), *argv[-2:]]) == 0
    assert (pub / "report.md").read_text() == report
    assert fusion_ablation.main([*argv[:2], "--reference", "nope", *argv[4:]]) == 2
    # one cell measured so far (the other's group not yet kept): its report, naming the other
    (pub / "groups" / "top_layer_only.inputs.json").unlink()
    args, _ = fusion_ablation.parse_args(argv)
    fusion_ablation.report_stage(args, tmp_path / "eval2", fusion_ablation.load_grid(str(grid), []),
                                 pub / "groups")  # fmt: skip
    text = (pub / "report.md").read_text()
    assert "Cells measured so far: 1 of 2 (still to come: top_layer_only)." in text
    assert "| default | " in text and "| top_layer_only |" not in text
    assert "Only `default` is in: nothing is paired yet." in text and "real at 95" not in text
    assert json.loads((pub / "summary.json").read_text())["cells_measured"] == ["default"]
