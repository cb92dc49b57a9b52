"""evaluation/study/: the vocabulary study's report from harness results, costs and curves."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import load_script

from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation import study

TREE = [10, 8, 60]
ROOT = Path(__file__).resolve().parents[1]


def _results(tree=TREE, n=6):
    methods = [{"label": "vanilla", "kind": "vanilla", "tree": [1, 1, 1], "draft": None}]
    for d in ("ref", "spec"):
        methods.append(
            {"label": f"eagle3:{tree}@{d}", "kind": "eagle3", "tree": list(tree), "draft": d}
        )
    recs = []
    for i in range(n):
        task = "mt_bench" if i % 2 else "qa"
        base = {"question_id": i, "task": task, "seed": 0, "num_generations": 1, "new_tokens": 41}
        recs.append({**base, "method": "vanilla", "target_forwards": 41, "wall_time_s": 4.0})
        # ref: tau 2, 2 s; spec: tau 4 on mt_bench and 2.5 on qa, 1 s
        recs.append(
            {**base, "method": methods[1]["label"], "target_forwards": 21, "wall_time_s": 2.0}
        )
        fw = 11 if task == "mt_bench" else 17
        recs.append(
            {**base, "method": methods[2]["label"], "target_forwards": fw, "wall_time_s": 1.0}
        )
    return {"config": {"methods": methods, "max_new_tokens": 256}, "records": recs}


HEADS = [
    study.StudyHead("ref", "eagle3", 8192),
    study.StudyHead("spec", "specvocab", None, "", 49152),
    study.StudyHead("absent", "frspec", 8192),
]
COSTS = {
    "ref": {"kind": "own lm_head", "step_ms_rows1": 2.0, "step_ms_rows10": 5.0},
    "spec": {"kind": "SpecVocab", "step_ms_rows1": 3.0, "step_ms_rows10": 6.0},
}


def test_the_cost_section_gives_rounds_and_specvocab_s_gather():
    """The drafting-time table has a round column when rounds were timed whole, and a line says
    which candidate gather SpecVocab's timed level took (the chain's single row says nothing)."""
    heads = [
        study.StudyHead("ref", "eagle3", 8192, ""),
        study.StudyHead("spec", "specvocab", None, ""),
    ]
    costs = {
        "ref": {**COSTS["ref"], "round_ms": 27.1},
        "spec": {
            **COSTS["spec"], "round_ms": 80.2,
            "union_rows1": {"distinct": 2048, "capacity": 2048, "shared": False},
            "union_rows10": {"distinct": 3323, "capacity": 8896, "shared": True},
        },
    }  # fmt: skip
    text = "\n".join(study.cost_section("10/8/60", costs, heads))
    assert "| head | output layer | step r1 | step r10 | round |" in text
    assert "| spec | SpecVocab | 3.00 | 6.00 | 80.20 |" in text
    assert (
        "spec, 10 rows: 3,323 distinct candidates of 8,896 shared slots (one shared gather)" in text
    )
    assert "rows: 2,048" not in text
    costs["spec"]["union_rows10"] = {"distinct": 9000, "capacity": 8896, "shared": False}
    assert "(gathered per row)" in "\n".join(study.cost_section("10/8/60", costs, heads))


def test_a_round_drafts_one_row_then_top_k_rows_per_level():
    assert study.round_draft_ms(COSTS["ref"], (10, 8, 60)) == pytest.approx(2.0 + 7 * 5.0)
    assert study.round_draft_ms(COSTS["ref"], (1, 1, 2)) == pytest.approx(2.0)
    assert study.round_draft_ms(None, (10, 8, 60)) != study.round_draft_ms(None, (10, 8, 60))
    assert study.round_draft_ms({"step_ms_rows1": 1.0}, (4, 3, 8)) != 0  # NaN: no 4-row timing
    assert (
        study.round_draft_ms({**COSTS["ref"], "round_ms": 30.5}, (10, 8, 60)) == 30.5
    )  # timed whole


def test_rows_measure_each_head_against_the_reference():
    rows = {r["head"]: r for r in study.head_rows(_results(), HEADS, "ref", COSTS)}
    assert set(rows) == {"ref", "spec"}  # a head the run lacks gives no row
    assert rows["ref"]["tau"] == pytest.approx(2.0) and "vs_reference" not in rows["ref"]
    assert rows["ref"]["speedup"] == pytest.approx(2.0)
    spec = rows["spec"]
    assert spec["tau_by_task"] == pytest.approx({"mt_bench": 4.0, "qa": 2.5})
    assert spec["vs_reference"]["throughput"]["mean"] == pytest.approx(2.0)
    assert spec["vs_reference_by_task"]["mt_bench"]["mean"] == pytest.approx(2.0)
    assert spec["vs_reference"]["tau"]["mean"] == pytest.approx((2.0 + 0.5) / 2)
    assert spec["draft_round_ms"] == pytest.approx(3.0 + 7 * 6.0)
    assert spec["round_ms"] == pytest.approx(1e3 * 6 / (3 * 10 + 3 * 16))


def test_a_head_is_also_paired_with_eagle3_at_its_own_size():
    """VocabTrim at 16,384 ids is paired with the reference (EAGLE-3 at 8,192) and with EAGLE-3
    at 16,384 too; here that head drafts exactly as the reference did, so both pairings agree.
    Neither EAGLE-3 head gets a second pairing, and the report has the size-matched table."""
    res = _results()
    ref_label = res["config"]["methods"][1]["label"]
    label = ref_label.replace("@ref", "@e16")
    res["config"]["methods"].append({**res["config"]["methods"][1], "label": label, "draft": "e16"})
    res["records"] += [{**r, "method": label} for r in res["records"] if r["method"] == ref_label]
    heads = [study.StudyHead("ref", "eagle3", 8192), study.StudyHead("e16", "eagle3", 16384),
             study.StudyHead("spec", "vocabtrim", 16384)]  # fmt: skip
    rows = {r["head"]: r for r in study.head_rows(res, heads, "ref", COSTS)}
    spec = rows["spec"]
    assert spec["vs_same_size"]["head"] == "e16"
    for k in ("tau", "throughput"):
        assert spec["vs_same_size"][k] == spec["vs_reference"][k]
    assert spec["vs_reference"]["tau"]["mean"] == pytest.approx((2.0 + 0.5) / 2)
    assert "vs_same_size" not in rows["e16"] and "vs_same_size" not in rows["ref"]
    text = "\n".join(study.tree_section("10/8/60", res, list(rows.values()), "ref"))
    assert "| head | Vd | against | tau - it | throughput / it |" in text
    assert "| spec | 16,384 | e16 | +1.25" in text


def _split(res: dict, slow: float = 1.0) -> list[dict]:
    """The run as two group runs, each head beside its own plain decoding; the second group's
    machine `slow` times slower at everything."""
    parts = []
    for i, label in enumerate(m["label"] for m in res["config"]["methods"][1:]):
        methods = [res["config"]["methods"][0]] + [
            m for m in res["config"]["methods"] if m["label"] == label
        ]
        f = slow if i else 1.0
        recs = [
            {**r, "wall_time_s": r["wall_time_s"] * f}
            for r in res["records"]
            if r["method"] in ("vanilla", label)
        ]
        config = {**res["config"], "methods": methods, "target_digest": f"t{i}"}
        parts.append({"config": config, "records": recs})
    return parts


def test_groups_measured_apart_merge_into_the_one_run_s_rows():
    """Heads measured in separate group runs, each beside its own plain decoding: merged, their
    rows equal the one run's (tau, speedup, paired tau and throughput); on a slower machine the
    speedups and the paired ratio stand, as each is taken over the group's own plain decoding
    (a ratio of speedups, and so labelled). Runs that differ in more than their heads are refused,
    naming the group; one group merged alone is one run."""
    one = {r["head"]: r for r in study.head_rows(_results(), HEADS, "ref", COSTS)}
    for slow in (1.0, 3.0):
        merged = study.merge_groups(_split(_results(), slow))
        assert [m["label"] for m in merged["config"]["methods"]] == [
            m["label"] for m in _results()["config"]["methods"]
        ]
        rows = {r["head"]: r for r in study.head_rows(merged, HEADS, "ref", COSTS)}
        for head in ("ref", "spec"):
            assert rows[head]["tau"] == pytest.approx(one[head]["tau"])
            assert rows[head]["speedup"] == pytest.approx(one[head]["speedup"])
        for k in ("tau", "throughput"):
            assert rows["spec"]["vs_reference"][k]["mean"] == pytest.approx(
                one["spec"]["vs_reference"][k]["mean"]
            )
        # so the report calls the paired speed column what it compares: speedups across runs
        text = "\n".join(study.tree_section("t", merged, list(rows.values()), "ref"))
        assert "| head | tau - ref | speedup / ref |" in text
        assert "question by question over 6 questions" in text
    text = "\n".join(study.tree_section("t", _results(), list(one.values()), "ref"))
    assert "| head | tau - ref | throughput / ref |" in text  # one run: its plain decoding cancels
    alone = study.merge_groups([_results()])  # one group kept: still one run
    text = "\n".join(study.tree_section("t", alone, list(one.values()), "ref"))
    assert "| head | tau - ref | throughput / ref |" in text and "separate runs" not in text
    short = {**one["spec"], "vs_reference": {**one["spec"]["vs_reference"]}}
    short["vs_reference"]["tau"] = {**short["vs_reference"]["tau"], "n": 5}
    assert study.paired_n([one["ref"], one["spec"], {**short, "head": "spec2"}]) == "5-6"
    assert study.paired_n([one["ref"]]) == ""  # nothing paired: no count
    for cut in ("vanilla", "eagle3"):  # a group (or one head of it) short of a question
        parts = _split(_results())
        parts[1]["records"] = [
            r for r in parts[1]["records"] if r["question_id"] != 5 or cut not in r["method"]
        ]
        with pytest.raises(
            Eagle3Error, match="group b .*answered 5 questions, not the 6 of group a"
        ):
            study.merge_groups(parts, ["a", "b"])
    parts = _split(_results())
    parts[1]["config"]["max_new_tokens"] = 128
    with pytest.raises(
        Eagle3Error, match="group #1's run differs from group #0's in max_new_tokens"
    ):
        study.merge_groups(parts)


def test_drafting_times_from_separate_runs_are_scaled_by_the_calibration_head():
    """Each timing run also times the calibration head: a run on a machine twice as slow has its
    times halved to the runs' common scale (the calibration's median over runs), the measured
    times kept under `measured`, and the cost table says so; without a calibration head, times
    stand as measured; a head timed in two runs is refused, not one of them silently kept."""
    fast = {"calibration": {"round_ms": 10.0, "step_ms_rows1": 1.0}, "a": {"round_ms": 30.0,
            "step_ms_rows1": 2.0, "kind": "own lm_head"}}  # fmt: skip
    slow = {"calibration": {"round_ms": 30.0, "step_ms_rows1": 3.0}, "b": {"round_ms": 90.0,
            "step_ms_rows1": 9.0}}  # fmt: skip
    costs = study.calibrated_costs([fast, slow], "calibration")
    assert set(costs) == {"a", "b"}
    assert costs["a"]["round_ms"] == pytest.approx(30.0 * 20 / 10)  # median 20 over 10
    assert costs["b"]["round_ms"] == pytest.approx(90.0 * 20 / 30)  # the same ratio to the head
    assert costs["b"]["measured"]["round_ms"] == 90.0
    assert costs["b"]["step_ms_rows1"] == pytest.approx(6.0)
    text = "\n".join(study.cost_section("t", costs, [study.StudyHead("a", "eagle3", 8192)]))
    assert "| a | " in text and "calibration head" in text
    assert costs["a"]["kind"] == "own lm_head"
    raw = study.calibrated_costs([{"a": {"round_ms": 30.0}}], None)
    assert raw["a"]["round_ms"] == 30.0 and "scale" not in raw["a"]
    with pytest.raises(Eagle3Error, match=r"head a was timed in two runs \(groups g0 and g1\)"):
        study.calibrated_costs([fast, {**slow, "a": fast["a"]}], "calibration", ["g0", "g1"])


def _replayed(res: dict) -> dict:
    """The run as `eval --replay` writes it: the heads' records replayed, decoding time 0."""
    for r in res["records"]:
        if r["method"] != "vanilla":
            r.update(replayed=True, wall_time_s=0.0, replay_time_s=0.5)
    return res


def test_replayed_heads_have_tau_and_no_speed(tmp_path):
    """A tree measured by replay gives each head its tau and paired tau differences, and no
    throughput, speedup or time per round (the run timed none of its rounds); the report says
    so and the plots leave the throughput panel empty."""
    res = _replayed(_results())
    rows = {r["head"]: r for r in study.head_rows(res, HEADS, "ref", COSTS)}
    spec = rows["spec"]
    assert spec["replayed"] and spec["tau_by_task"] == pytest.approx({"mt_bench": 4.0, "qa": 2.5})
    assert spec["tokens_per_s"] is None and spec["speedup"] is None and spec["round_ms"] is None
    assert set(spec["vs_reference"]) == {"tau"}
    assert spec["vs_reference"]["tau"]["mean"] == pytest.approx((2.0 + 0.5) / 2)
    text, summary = study.report({"10/8/60": res, "cpu": _results(tree=[2, 3, 4])}, HEADS, "ref",
                                 {"10/8/60": COSTS}, None)  # fmt: skip
    assert "| spec (replayed) | specvocab |" in text and "timed none of their rounds" in text
    assert "| spec | specvocab |" in text  # the cpu tree decoded for real
    assert any(
        line.startswith("| spec | +1.25 (") and " | - | " in line for line in text.splitlines()
    )
    assert all(p.stat().st_size > 1000 for p in study.plot(summary, None, tmp_path))


def test_a_missing_reference_or_a_head_without_rounds_leaves_dashes():
    """A reference that did not run in a tree pairs nothing (its absence said, every other row
    "-", not "reference"); a head listed in the run without records (or rounds) has no speed and
    no throughput ratio, and the report still comes out; tasks outside Spec-Bench keep columns."""
    res = _results()
    for r in res["records"]:
        if r["task"] == "qa":
            r["task"] = "gsm8k"
    text, _ = study.report({"t": res}, HEADS, "absent", {}, None)
    assert "`absent` did not run in this tree: nothing is paired." in text
    assert "| spec | - | - |" in text and "| ref | - | - |" in text
    assert "gsm8k" in text.split("| tau | tokens/s")[0].splitlines()[-1]
    res = _results()
    res["records"] = [r for r in res["records"] if not r["method"].endswith("@spec")]
    rows = {r["head"]: r for r in study.head_rows(res, HEADS, "ref", {})}
    assert rows["spec"]["tokens_per_s"] is None and "throughput" not in rows["spec"].get(
        "vs_reference", {}
    )
    text, _ = study.report({"t": res}, HEADS, "ref", {}, None)
    assert "| ref | reference | reference |" in text


def test_a_run_with_two_tree_shapes_is_refused():
    res = _results()
    res["config"]["methods"][2]["tree"] = [4, 4, 16]
    with pytest.raises(ValueError, match="one tree shape"):
        study.tree_of(res)


def test_report_and_plots(tmp_path):
    runs = {"10/8/60": _results(), "cpu": _results(tree=[2, 3, 4])}
    curves = {"ref": [{"step": 50, "tokens": 100, "acc_0": 0.5, "chain_tau": 1.9},
                      {"step": 200, "tokens": 400, "acc_0": 0.6, "chain_tau": 2.1}],
              "spec": [{"step": 50, "tokens": None, "acc_0": 0.5, "chain_tau": 1.9}]}  # fmt: skip
    costs = {"10/8/60": COSTS, "cpu": {"ref": {"step_ms_rows1": 2.0, "step_ms_rows2": 3.0}}}
    text, summary = study.report(runs, HEADS, "ref", costs, curves)
    assert "| spec | specvocab | 49,152 (all) |" in text
    assert "4.53 | 204.7" in text and "4.31 | 189.3" in text  # the paper's columns
    assert "+1.25 (" in text  # spec's paired tau difference
    assert "| ref | 200 | 400 | 0.600 | 2.10 | 1.90 |" in text
    assert "| spec | 50 | - | 0.500 | 1.90 | - |" in text
    assert summary["trees"]["cpu"]["tree"] == [2, 3, 4]
    assert summary["trees"]["cpu"]["rows"][0]["draft_round_ms"] == pytest.approx(2.0 + 2 * 3.0)
    assert "| head | output layer | step r1 | step r2 |" in text
    json.dumps(summary)  # the summary is JSON
    paths = study.plot(summary, curves, tmp_path)
    assert [p.name for p in paths] == ["paired.png", "tau_vs_draft_cost.png", "training_curves.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_read_curve_joins_validation_with_tokens_read(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "tokens": 10 * s}) for s in (25, 50, 75, 100)) + "\n"
    )
    (tmp_path / "validation.jsonl").write_text(
        json.dumps({"step": 50, "val_acc_0": 0.5, "val_replay_tau": 1.8}) + "\n"
        + json.dumps({"step": 100, "val_acc_0": 0.6, "val_replay_tau": 2.0}) + "\n"
    )  # fmt: skip
    assert study.read_curve(tmp_path) == [
        {"step": 50, "tokens": 500, "acc_0": 0.5, "chain_tau": 1.8},
        {"step": 100, "tokens": 1000, "acc_0": 0.6, "chain_tau": 2.0},
    ]
    assert study.read_curve(tmp_path / "missing") == []


def test_cells_map_to_the_methods_they_stand_for():
    v = 49152
    assert study.head_of_cell("a", {"draft_vocab_size": 8192}, v) == study.StudyHead(
        "a", "eagle3", 8192, "", v
    )
    olmo = study.head_of_cell("f", {"draft_vocab_size": 100352, "lm_head_source": "target"}, 100352)
    assert (olmo.vocab, olmo.target_vocab) == (None, 100352)
    assert study.vocab_text(olmo.vocab, olmo.target_vocab) == "100,352 (all)"
    assert study.vocab_text(None) == "all" and study.vocab_text(8192, 100352) == "8,192"
    full = {"draft_vocab_size": v, "remat": True}
    assert study.head_of_cell("b", full, v).family == "full"
    assert study.head_of_cell("c", {**full, "lm_head_source": "target"}, v).family == (
        "target_lm_head"
    )
    spec = {**full, "lm_head_source": "target", "speculator_rank": 72}
    assert study.head_of_cell("d", spec, v).family == "specvocab"
    noaux = study.head_of_cell("e", {**spec, "speculator_loss_weight": 0.0}, v)
    assert noaux.note == "no auxiliary loss"
    with pytest.raises(ValueError, match="family"):
        study.StudyHead("x", "medusa", None)


def test_study_artefacts_are_remade_only_from_the_same_inputs(tmp_path):

    from eagle3_jax.checkpoints.atomic import made_from
    from eagle3_jax.errors import Eagle3Error

    vs = load_script("benchmarks/vocab_study.py")
    counts, calls = tmp_path / "counts.npy", []

    def make():
        calls.append(1)
        counts.write_bytes(b"counts")

    inputs = {"corpus": "abc", "roles": "all"}
    vs.made(counts, inputs, make)
    vs.made(counts, inputs, make)  # resumed with the same inputs: reused, not remade
    assert calls == [1] and made_from(counts, inputs)
    with pytest.raises(Eagle3Error, match=r"other inputs \(corpus differ\)"):
        vs.made(counts, {**inputs, "corpus": "edited"}, make)
    assert counts.read_bytes() == b"counts" and calls == [1]  # refused, left as it was
    theirs = tmp_path / "theirs.npy"
    theirs.write_bytes(b"a user's file")
    with pytest.raises(Eagle3Error, match="no record of what it was made from"):
        vs.made(theirs, inputs, make)
    assert theirs.read_bytes() == b"a user's file"


@pytest.mark.slow  # four tiny heads, counts, cuts, draft costs, two harness runs: ~4 min
def test_the_paper_grid_end_to_end_on_the_tiny_target(tiny_target_dir, tmp_path, monkeypatch):
    """configs/vocab_study_paper.py's four cells (regenerated answers, the same budget) through
    benchmarks/vocab_study.py on the tiny target: FR-Spec and VocabTrim cut at the EAGLE-3 cell's
    size, every head measured at the grid's tree (replayed on this CPU) and the CPU tree (real),
    the paper-shaped report published."""
    import gzip
    from pathlib import Path

    from test_ablation import _data  # the tests' folder is on sys.path (rootdir conftest)

    from eagle3_jax.training.config import load_config
    from eagle3_jax.training.loop import train

    root = Path(__file__).resolve().parents[1]
    data, qs = _data(tmp_path)
    # the grid's trunk, as the shipped head is the SmolLM2 grid's: every cell starts from it and
    # every group's drafting times are taken beside it (the calibration head)
    trunk = train(
        load_config(root / "configs/tiny.py").replace(
            target=str(tiny_target_dir), data=str(data), num_conversations=8, max_steps=2,
            batch_size=2, epochs=0, out_dir=str(tmp_path / "trunk")),
        progress=False,
    )["head"]  # fmt: skip
    grid = tmp_path / "grid.py"
    grid.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(root / 'configs')!r})\n"
        "from vocab_study_paper import paper_grid\n"
        "from eagle3_jax.training.config import load_config\n"
        "import dataclasses\n"
        "def get_config():\n"
        f"    base = load_config({str(root / 'configs/tiny.py')!r}).replace(\n"
        f"        target={str(tiny_target_dir)!r}, data={str(data)!r}, num_conversations=8,\n"
        "        regen_max_new_tokens=10, max_steps=3, batch_size=2, epochs=0)\n"
        f"    base = base.replace(init_trunk={str(trunk)!r})\n"
        "    g = paper_grid(base, 'tiny', hidden_size=64, draft_vocab_size=40, tree=(2, 2, 4),\n"
        "                   dtype=None)\n"
        f"    return dataclasses.replace(g, out_dir={str(tmp_path / 'grid')!r})\n"
    )
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import vocab_study

    pub = tmp_path / "pub"
    argv = ["--grid", str(grid), "--bench", str(qs), "--questions", "1", "--max-new-tokens", "8",
            "--frspec-corpus", str(data), "--out", str(tmp_path / "study"),
            "--publish", str(pub)]  # fmt: skip
    assert vocab_study.main(argv) == 0
    text = (pub / "report.md").read_text()
    for head in ("eagle3_vd40", "specvocab", "target_lm_head", "full_vocab", "frspec_40",
                 "vocabtrim_40"):  # fmt: skip
        assert f"| {head}" in text, head
    assert "(replayed)" in text  # the grid's tree, replayed on this CPU
    # each cell's group (the cell and the heads cut from it) published on its own, stamped
    groups = pub / "groups"
    assert sorted(p.name for p in groups.iterdir() if p.is_dir()) == sorted(
        ["eagle3_vd40", "specvocab", "target_lm_head", "full_vocab"]
    )
    for cell in ("eagle3_vd40", "specvocab", "target_lm_head", "full_vocab"):
        assert (groups / f"{cell}.inputs.json").is_file()
        with gzip.open(groups / cell / "results_2-2-4.json.gz", "rt") as f:
            recs = json.load(f)["records"]
        assert recs and all(r.get("replayed") for r in recs if r["method"] != "vanilla")
        with gzip.open(groups / cell / "results_cpu.json.gz", "rt") as f:
            assert not any(r.get("replayed") for r in json.load(f)["records"])
        costs = json.loads((groups / cell / "draft_cost_cpu.json").read_text())["rows"]
        assert {cell, "calibration"} <= {r["head"] for r in costs}
    # each group's drafting times scaled by the calibration head's median over the groups
    rows = json.loads((pub / "summary.json").read_text())["trees"]["cpu"]["rows"]
    assert len(rows) == 6 and all(r["draft_scale"]["round_ms"] > 0 for r in rows)
    assert "each beside the same calibration head" in text
    with gzip.open(groups / "target_lm_head" / "results_cpu.json.gz", "rt") as f:
        drafts = json.load(f)["config"]["drafts"]
    assert sorted(drafts) == ["frspec_40", "target_lm_head"]  # the cut head runs in its group
    # the drafting times are stamped with what was timed: the heads, the calibration head and
    # the target, by content (a head edited in place under the same path is timed again)
    from eagle3_jax.checkpoints import files_digest, target_digest
    from eagle3_jax.checkpoints.atomic import made_from
    from eagle3_jax.evaluation.fingerprint import head_digest

    target = target_digest(str(tiny_target_dir), times=False)
    stamp = json.loads((tmp_path / "study/draft_cost_cpu_specvocab.json.inputs.json").read_text())
    assert stamp["calibration"] == head_digest(trunk) and stamp["target"] == target
    assert stamp["heads"] == {"specvocab": head_digest(tmp_path / "grid/cells/specvocab/head")}
    # a fresh machine with the published groups: the study only reports (its --out is empty,
    # no cell's head exists, nothing trains or measures; the counts are made again, the same)
    import shutil

    shutil.rmtree(tmp_path / "grid" / "cells")
    before = (pub / "report.md").read_text()
    argv2 = [a if a != str(tmp_path / "study") else str(tmp_path / "study2") for a in argv]
    assert vocab_study.main(argv2) == 0
    assert (pub / "report.md").read_text() == before
    assert not (tmp_path / "grid" / "cells").exists()
    regen = tmp_path / "grid/shared/regenerated.jsonl"
    assert regen.exists()  # VocabTrim counted the target's own answers
    # the counts depend on the target's tokenizer: stamped with its files, not its identity
    files = files_digest([tiny_target_dir])
    counted = {"corpus": files_digest([str(regen)]), "roles": "assistant", "target": files}
    assert made_from(tmp_path / "study/counts_generated.npy", counted)
    recall = json.loads(
        (tmp_path / "study/speculator_recall_specvocab.json.inputs.json").read_text()
    )
    assert recall["target"] == files and recall["k"]  # this grid holds out no data: records 0
    assert (recall["data"], recall["records"]) == ("", 0)


def test_the_report_predicts_the_papers_setting_on_an_accelerator():
    """The section on the paper's own setting: every method's head on OLMo 2 1B and 7B from the
    cost model, EAGLE-3 the unit of 'τ to match', SpecVocab's fused gather never dearer than the
    written-then-read one, and the τ the paper's 7B throughput implies = its ratio x the round ratio."""
    from eagle3_jax.accelerators import predict, specs
    from eagle3_jax.decoding.tree import TreeConfig

    lines, summary = study.accelerator_section()
    rows = {(r["target"], r["method"]): r for r in summary["rows"]}
    assert set(rows) == {(t, m) for t in ("olmo2_1b", "olmo2_7b")
                         for m in ("eagle3", "target_lm_head", "specvocab")}  # fmt: skip
    assert rows["olmo2_7b", "eagle3"]["tau_ratio_to_match"] == 1.0
    sv = rows["olmo2_7b", "specvocab"]
    assert sv["tau_ratio_to_match_fused_gather"] <= sv["tau_ratio_to_match"]
    want = [r for r in predict.vocab_methods(specs.DEVICES["H100"], "olmo2_7b",
                                             TreeConfig(10, 8, 60)) if r["method"] == "specvocab"]  # fmt: skip
    assert sv["round_ms"] == pytest.approx(want[0]["round_ms"])
    tps = summary["paper_tps_ratio_olmo2_7b"]
    assert tps == pytest.approx(204.7 / 189.3)
    assert summary["implied_tau_ratio"][0] == pytest.approx(tps * sv["tau_ratio_to_match"])
    text = "\n".join(lines)
    assert "(predicted)" in text and "| olmo2_7b | specvocab |" in text


def test_the_report_puts_the_measured_rounds_beside_the_model():
    """The committed H200 round-cost runs (benchmarks/results/round_cost_h200): every other head's
    round against EAGLE-3's as measured and predicted, the rounds' times, and the τ the paper's
    7B throughput needs under the measured 10/8/60 ratio; nothing measured leaves no section."""
    assert study.measured_section([]) == ([], {})
    folder = ROOT / "benchmarks/results/round_cost_h200"
    measured = [json.loads(p.read_text()) for p in sorted(folder.glob("*/results.json"))]
    lines, summary = study.measured_section(measured)
    rows = {(r["target"], r["tree"], r["head"]): r for r in summary["rows"]}
    assert {k for k in rows if k[0].startswith("olmo2")} == {
        (t, tree, h) for t in ("olmo2_1b", "olmo2_7b") for tree in ("10/8/60", "chain 1/8/9")
        for h in ("specvocab", "target_lm_head")
    }  # fmt: skip
    (res,) = [r for r in measured if r["target"].startswith("olmo2_7b")]
    ms = {(r["target"], r["head"]): r["median_ms"] for r in res["rows"] if r["program"] == "round"}
    sv = rows["olmo2_7b", "10/8/60", "specvocab"]
    assert sv["measured"] == pytest.approx(ms["olmo2_7b", "specvocab"] / ms["olmo2_7b", "eagle3"])
    tps, _ = study.paper_specvocab_over_eagle3()
    assert summary["implied_tau_ratio_olmo2_7b"] == pytest.approx(tps * sv["measured"])
    text = "\n".join(lines)
    assert "measured (gpu NVIDIA H200)" in text
    assert f"| olmo2_7b | 1 | 10/8/60 | specvocab | {ms['olmo2_7b', 'specvocab']:.2f} |" in text
    text, summary = study.report({}, HEADS, "ref", {}, None, measured)
    assert "## The paper's setting, measured" in text and "accelerator_measured" in summary


def test_vocab_study_status_starts_nothing(tmp_path, capsys):
    """`benchmarks/vocab_study.py --status` prints whether the study runs (the pid holding its
    lock), each cell's and stage's standing, and returns
    without training, measuring or writing (its --out stays empty)."""
    vs = load_script("benchmarks/vocab_study.py")
    out = tmp_path / "study"
    out.mkdir()
    grid = str(vs.ROOT / "configs/ablate_tiny.py")
    assert vs.main(["--status", "--grid", grid, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert (
        text.startswith("study: not running\nfeature store: ") and "draft costs: none yet" in text
    )
    assert "\ncell default: " in text
    assert "harness: not started" in text and "report: not yet" in text
    assert not any(out.iterdir())
    # a harness run under way: its records per method, of the questions it plans (Spec-Bench's
    # 80 MT-bench questions and 20 of each other task at the default 20 a category)
    (out / "eval_cpu" / "default").mkdir(parents=True)  # the tree's run of one group
    (out / "eval_cpu" / "default" / "records.jsonl").write_text('{"method": "vanilla"}\n')
    assert vs.main(["--status", "--grid", grid, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "harness cpu default: vanilla 1 (records per method, of 180 questions)" in text
    assert "groups measured" in text and "none yet" in text
    with vs.exclusive(out, "study"):  # the study running: its driver's pid
        assert vs.main(["--status", "--grid", grid, "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"study: running (pid {os.getpid()})\n")


def test_fusion_ablation_status_names_the_groups_kept(tmp_path, capsys):
    """`benchmarks/fusion_ablation.py --status --publish DIR` names the cells whose group is kept
    under DIR/groups (a folder and its stamp; a folder without one is not kept) and writes nothing."""
    fa = load_script("benchmarks/fusion_ablation.py")
    pub, out = tmp_path / "pub", tmp_path / "eval"
    (pub / "groups" / "default").mkdir(parents=True)
    (pub / "groups" / "default.inputs.json").write_text("{}")
    (pub / "groups" / "top_layer_only").mkdir()  # a publish cut short: no stamp
    grid = str(fa.ROOT / "configs/ablate_tiny.py")
    before = sorted(tmp_path.rglob("*"))
    assert fa.main(["--status", "--grid", grid, "--out", str(out), "--publish", str(pub)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ablation: not running\nfeature store: ")
    assert f"groups measured ({pub / 'groups'}): default\n" in text
    assert sorted(tmp_path.rglob("*")) == before


def test_fusion_ablation_takes_the_grid_s_overrides_and_refuses_other_flags():
    """`--config.FIELD=VALUE` reaches the grid's base (every cell; the device step's dry runs
    name a target this way); any other unknown flag is an error."""
    fa = load_script("benchmarks/fusion_ablation.py")
    args, overrides = fa.parse_args(["--config.target=/t", "--config.max_steps=8"])
    assert overrides == ["--config.target=/t", "--config.max_steps=8"] and args.publish is None
    grid = fa.load_grid(args.grid, overrides)
    assert (grid.base.corpus.target, grid.base.optim.max_steps) == ("/t", 8)
    assert fa.load_grid(args.grid, []).base.optim.max_steps == 1200
    with pytest.raises(SystemExit):
        fa.parse_args(["--steps=8"])


def test_fusion_ablation_measures_the_cells_asked_for_in_their_order():
    """--cells picks among the cells still to measure and orders them (a cheaper cell first when a
    session is short); a cell measured already is skipped, an unknown one refused before work."""
    fa = load_script("benchmarks/fusion_ablation.py")
    names = ["low_mid_high", "top_layer", "four_layers", "ttt_3"]

    class Cell:
        def __init__(self, name):
            self.name = name

    pending = [(Cell(n), f"groups/{n}", {}) for n in names[2:]]
    assert fa.pick_cells(pending, None, names) == pending
    picked = fa.pick_cells(pending, "ttt_3, four_layers", names)
    assert [p[0].name for p in picked] == ["ttt_3", "four_layers"]
    assert [p[0].name for p in fa.pick_cells(pending, "top_layer,ttt_3", names)] == ["ttt_3"]
    assert fa.pick_cells(pending, "top_layer", names) == []
    with pytest.raises(Eagle3Error, match="--cells ttt_9: the grid's cells are low_mid_high"):
        fa.pick_cells(pending, "ttt_9", names)
    assert fa.parse_args(["--cells", "ttt_3"])[0].cells == "ttt_3"


def test_a_sigterm_to_the_study_reaches_its_stage_and_ends_it_resumably(tmp_path, capsys):
    """The study driver runs each stage as a subprocess: a SIGTERM to the driver is passed on to
    the stage in progress (a training stage checkpoints its step and stops), and the study ends
    with status 143 and a line saying to run the same command again."""
    import os
    import signal
    import sys
    import threading

    vs = load_script("benchmarks/vocab_study.py")
    ready = tmp_path / "ready"
    child = f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"

    def notice():
        for _ in range(600):
            if ready.exists():
                break
            threading.Event().wait(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # to the driver (this process) only

    before = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=notice)
    t.start()
    code = vs.locked(tmp_path / "out", "study", lambda out: vs.run([sys.executable, "-c", child]))
    t.join()
    assert code == 143
    assert "stopped by SIGTERM in a stage" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before  # the driver's own handling is back
