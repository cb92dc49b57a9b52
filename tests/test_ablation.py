"""python -m eagle3_jax ablate: a two-cell grid on the tiny target, end to end and resumed."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from eagle3_jax.ablation.config import AblationConfig, Cell, vary
from eagle3_jax.cli.ablate import main
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation.questions import Question
from eagle3_jax.training.config import TrainConfig, flatten

ROOT = Path(__file__).resolve().parents[1]


def _data(tmp_path):
    rng = np.random.default_rng(0)
    recs = []
    for i in range(12):
        q = " ".join(f"w{x}" for x in rng.integers(3, 97, 6))
        a = " ".join(f"w{x}" for x in rng.integers(3, 97, 14))
        recs.append(
            {
                "id": f"c{i}",
                "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}],
            }
        )
    data = tmp_path / "data.json"
    data.write_text(json.dumps(recs))
    qs = tmp_path / "q.jsonl"
    qs.write_text(
        "\n".join(
            json.dumps({"question_id": i, "category": c, "turns": [t]})
            for i, (c, t) in enumerate([("qa", "w5 w6 w7 w8"), ("writing", "w40 w41 w12 w9")])
        )
    )
    return data, qs


@pytest.mark.slow  # 16-21 s: the grid's pieces (skip-train, results as cells finish, refusals) stay
def test_two_cell_grid_end_to_end_and_resume(tiny_target_dir, tmp_path, capsys):
    data, qs = _data(tmp_path)
    out = tmp_path / "grid"
    argv = ["--config", str(ROOT / "configs/ablate_tiny.py"), "--out", str(out),
            "--bench", str(qs), "--no-progress",
            f"--config.target={tiny_target_dir}", f"--config.data={data}",
            "--config.max_steps=6"]  # fmt: skip
    assert main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    rows = {r["cell"]: r for r in res["cells"]}
    assert list(rows) == ["default", "top_layer_only"]
    # the two cells really trained heads with different fc input widths (3 layers vs 1)
    assert rows["default"]["aux_layer_ids"] == [2, 3, 3]
    assert rows["default"]["fc_input_width"] == 3 * rows["top_layer_only"]["fc_input_width"]
    assert rows["top_layer_only"]["aux_layer_ids"] == [5]
    assert res["config"]["feature_layers"] == [2, 3, 5]
    for r in rows.values():
        assert r["tau"] >= 1.0 and set(r["tau_by_task"]) == {"qa", "mt_bench"}
        assert r["steps"] == 6 and r["train_wall_s"] > 0
        assert len(r["final_acc"]) == r["ttt_steps"] and all(0 <= a <= 1 for a in r["final_acc"])
    assert len(rows["default"]["final_acc"]) == 3 and len(rows["top_layer_only"]["final_acc"]) == 2
    report = (out / "report.md").read_text()
    assert "| default | 2,3,3 |" in report and "| top_layer_only | 5 |" in report
    assert "acc_2" in report and (out / "tau_per_cell.png").is_file()
    assert (out / "acc_by_ttt_step.png").is_file()
    # the paired table: same records step by step, same questions
    for r in rows.values():
        assert set(r["tau_by_question"]) == {"0", "1"} and r["batch_size"] == 4
        assert len(r["acc_by_step"]) == r["acc_steps"]
    assert "Paired differences against `default`" in report
    paired = report.split("Paired differences")[1]
    assert "| top_layer_only | " in paired and "% t interval" in paired
    assert paired.count(" (") >= 2  # Δτ over 2 questions, with its interval
    # features are computed once, in one shared store; both cells read it
    feats = json.loads((out / "features/features.json").read_text())
    assert feats["layers"] == [2, 3, 5]
    for name in rows:
        cfg = json.loads((out / "cells" / name / "train_config.json").read_text())
        assert cfg["store"]["features"] == "offline"
        assert cfg["store"]["features_dir"] == str(out / "features")
    # rerun: nothing retrained or re-evaluated, same table
    stamp = {n: (out / "cells" / n / "head/model.safetensors").stat().st_mtime_ns for n in rows}
    capsys.readouterr()
    assert main(argv) == 0
    assert json.loads((out / "results.json").read_text())["cells"] == res["cells"]
    assert stamp == {
        n: (out / "cells" / n / "head/model.safetensors").stat().st_mtime_ns for n in rows
    }
    assert "training" not in capsys.readouterr().err
    # a changed budget is refused by name, never answered with the heads of the old one
    argv_more = [a if a != "--config.max_steps=6" else "--config.max_steps=7" for a in argv]
    assert main(argv_more) == 2
    assert "'default'" in (err := capsys.readouterr().err) and "another config (max_steps)" in err
    # the same grid on a 2 x 4 mesh of simulated devices (batch over data, matrices over model):
    # the default cell trains to the same losses as on one device
    mesh_out = tmp_path / "grid_mesh"
    argv_mesh = [a if a != str(out) else str(mesh_out) for a in argv]
    argv_mesh += ["--config.mesh_data=2", "--config.mesh_model=4", "--cells", "default"]
    assert main(argv_mesh + ["--no-eval"]) == 0  # train only: no harness run, no tau

    def losses(root):
        lines = (root / "cells/default/metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["loss"] for x in lines]

    assert len(losses(out)) == 6
    np.testing.assert_allclose(losses(mesh_out), losses(out), rtol=2e-4)
    mesh_res = json.loads((mesh_out / "results.json").read_text())
    mesh_row = mesh_res["cells"][0]
    assert mesh_row["fc_input_width"] == rows["default"]["fc_input_width"]
    assert mesh_row["tau"] is None and not (mesh_out / "cells/default/eval").exists()
    assert mesh_res["config"]["evaluate"] is False
    assert "not evaluated here" in (mesh_out / "report.md").read_text()


def test_bad_grids_are_refused(tiny_target_dir, tmp_path):
    base = TrainConfig().replace(data="x")
    with pytest.raises(Eagle3Error, match="no cells"):
        AblationConfig(base, ()).validate()
    with pytest.raises(Eagle3Error, match="repeat"):
        AblationConfig(base, (Cell("a"), Cell("a"))).validate()
    with pytest.raises(Eagle3Error, match="features_dir"):
        AblationConfig(base, (Cell("a", {"features_dir": "y"}),)).validate()
    cells = vary("ttt_steps", [1, 3, 7])
    assert [c.name for c in cells] == ["ttt_steps=1", "ttt_steps=3", "ttt_steps=7"]
    assert vary("aux_layer_ids", [(1, 2)])[0].name == "aux_layer_ids=1,2"
    data, qs = _data(tmp_path)
    argv = ["--config", str(ROOT / "configs/ablate_tiny.py"), "--out", str(tmp_path / "g"),
            f"--config.target={tiny_target_dir}", f"--config.data={data}", "--cells", "nope"]  # fmt: skip
    assert main(argv) == 2


def test_a_cell_whose_head_would_be_refused_stops_the_grid_before_any_work(
    tiny_target_dir, tmp_path
):
    """Every cell's head is built first, also when one cell is asked for (the study drivers run
    a grid a cell at a time): aux id 0 has no name in the official format, so its head could
    never be exported, and the grid stops before any cell trains."""
    from eagle3_jax.ablation.config import load_ablation
    from eagle3_jax.ablation.runner import run_ablation

    data, _ = _data(tmp_path)
    grid = load_ablation(ROOT / "configs/ablate_tiny.py")
    base = grid.base.replace(target=str(tiny_target_dir), data=str(data), max_steps=2)
    ac = dataclasses.replace(
        grid, base=base, out_dir=str(tmp_path / "g"),
        cells=(Cell("default"), Cell("embedding", {"aux_layer_ids": (0, 2)})),
    )  # fmt: skip
    with pytest.raises(Eagle3Error, match=r"aux layer id 0 \(the embedding output\)"):
        run_ablation(ac, only=["default"], progress=False)
    assert not (tmp_path / "g" / "cells").exists() and not (tmp_path / "g" / "shared").exists()


def test_final_metrics_average_the_last_logged_steps(tmp_path):
    from eagle3_jax.ablation.runner import final_metrics

    recs = [
        {"step": 1, "loss": 4.0, "acc_0": 0.0, "acc_1": 0.0, "tokens": 10},
        {"step": 2, "loss": 3.0, "acc_0": 0.2, "acc_1": 0.1, "tokens": 20},
        {"step": 3, "loss": 1.0, "acc_0": 0.4, "acc_1": None, "tokens": 30},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    last = final_metrics(tmp_path)
    assert last["acc_0"] == 0.4 and last["loss"] == 1.0 and last["window"] == 1
    two = final_metrics(tmp_path, window=2)
    assert two["step"] == 3 and two["tokens"] == 30 and two["window"] == 2
    assert two["loss"] == pytest.approx(2.0) and two["acc_0"] == pytest.approx(0.3)
    assert two["acc_1"] == pytest.approx(0.1)  # a step that logged no value is skipped
    assert final_metrics(tmp_path / "absent") == {}
    with pytest.raises(Eagle3Error, match="acc_window"):
        AblationConfig(base=TrainConfig(), cells=(Cell("a"),), acc_window=0).validate()
    # acc_records: the logged steps among the last ceil(records / batch) training steps
    grid = AblationConfig(base=TrainConfig(), cells=(Cell("a"),), acc_window=3, acc_records=40)
    assert grid.acc_span(TrainConfig().replace(batch_size=8)) == 5
    assert grid.acc_span(TrainConfig().replace(batch_size=3)) == 14  # ceil(40 / 3)
    assert dataclasses.replace(grid, acc_records=0).acc_span(TrainConfig()) is None
    with pytest.raises(Eagle3Error, match="acc_records"):
        dataclasses.replace(grid, acc_records=-1).validate()
    span = final_metrics(tmp_path, window=1, span=2)  # steps 2 and 3, whatever log_every was
    assert span["window"] == 2 and span["acc_0"] == pytest.approx(0.3)


def test_paired_differences_cancel_what_cells_share():
    from eagle3_jax.ablation.report import paired_table

    # record difficulty varies 0.1..0.9 and is the same for every cell: pairing cancels it
    hard = {str(i): 0.1 + 0.8 * i / 9 for i in range(10)}
    jitter = {k: (0.01 if int(k) % 2 else -0.01) for k in hard}

    def row(name, shift, batch=1, steps=3, noise=0.0):
        return {
            "cell": name,
            "batch_size": batch,
            "acc_by_step": {k: [v + shift + noise * jitter[k]] * steps for k, v in hard.items()},
            "tau_by_question": {"q1": 1.2 + shift, "q2": 1.5 + shift, "q3": 1.1 + 2 * shift},
        }

    lines = paired_table([row("ref", 0.0), row("up", 0.05, noise=1.0), row("b8", 0.1, batch=8),
                          row("one_step", 0.1, steps=1), row("same", 0.0, noise=1.0)])  # fmt: skip
    table = {ln.split(" | ")[0][2:]: ln.split(" | ")[1:] for ln in lines if ln.startswith("| ")}
    # +0.05 with per-record noise 0.01: t(9) 2.262 x 0.01 / sqrt(10) x sqrt(10/9) half-width
    half = 2.2622 * 0.01 * (10 / 9) ** 0.5 / 10**0.5
    assert table["up"][0] == f"+0.050 ({0.05 - half:.3f}, {0.05 + half:.3f})*"
    # tau: +0.05, +0.05, +0.10 over three questions: mean 0.067, sd 0.029, t(2) 4.303
    assert table["up"][3].startswith("+0.067 (-0.005, 0.138)")  # includes zero: not real
    assert table["b8"][:3] == ["–"] * 3  # another batch size reads the records in another order
    assert table["one_step"][1] == "-" and table["one_step"][0].endswith("*")
    assert table["same"][0].startswith("+0.000 (") and not table["same"][0].endswith("*")
    assert "up acc_0 +0.050" in lines[-1] and "same" not in lines[-1] and "up τ" not in lines[-1]
    assert paired_table([row("alone", 0.0)]) == []
    assert paired_table([row("ref", 0.0), row("same", 0.0, noise=1.0)])[-1].startswith("No diff")


def test_a_cell_trained_under_another_config_is_refused(tmp_path):
    from eagle3_jax.ablation.config import cell_record, check_cell_config

    cell, tc = Cell("c"), TrainConfig().replace(data="d", max_steps=20, lr=1e-3)
    check_cell_config(cell, tmp_path, {}, tc)  # a new cell: nothing to compare
    rec = cell_record(tc)
    state = {"config": rec}
    check_cell_config(cell, tmp_path, state, tc.replace(save_every=7, mesh_data=1))
    moved = {**rec, "compute": {**rec["compute"], "mesh_model": 4}}
    check_cell_config(cell, tmp_path, {"config": moved}, tc)
    with pytest.raises(Eagle3Error, match=r"'c' .* another config \(lr, max_steps\)"):
        check_cell_config(cell, tmp_path, state, tc.replace(lr=3e-4, max_steps=30))
    # a record in the flat layout of before the groups is the same config field by field
    flat = flatten(rec)
    assert "lr" in flat and "optim" not in flat
    check_cell_config(cell, tmp_path, {"config": flat}, tc)
    with pytest.raises(Eagle3Error, match=r"\(lr\)"):
        check_cell_config(cell, tmp_path, {"config": flat}, tc.replace(lr=3e-4))
    # a field added to TrainConfig after the cell was recorded counts as its default
    old = {"config": {k: v for k, v in flat.items() if k != "remat" and k != "seed"}}
    check_cell_config(cell, tmp_path, old, tc)
    with pytest.raises(Eagle3Error, match=r"\(seed\)"):
        check_cell_config(cell, tmp_path, old, tc.replace(seed=5))
    # a cell from before records: its train_config.json (no max_steps) and its head's step count
    legacy = {k: v for k, v in flat.items() if k != "max_steps"}
    (tmp_path / "train_config.json").write_text(json.dumps({**legacy, "out_dir": "elsewhere"}))
    check_cell_config(cell, tmp_path, {}, tc)  # interrupted: the step budget is not known
    (tmp_path / "head").mkdir()
    (tmp_path / "head/training.json").write_text(json.dumps({"step": 20, "tokens": 99}))
    check_cell_config(cell, tmp_path, {}, tc)
    with pytest.raises(Eagle3Error, match=r"\(max_steps\)"):
        check_cell_config(cell, tmp_path, {}, tc.replace(max_steps=160))


def test_skip_train_measures_only_a_head_trained_under_its_cells_config(tiny_target_dir, tmp_path):
    """The study scripts' --skip-train (`trained_head`): a cell with no finished head, a head
    with no record of its config, or one trained under another config is refused, naming the
    cell; the head of a cell trained under the grid's config is what is measured."""
    from eagle3_jax.ablation.config import cell_config, cell_record, load_ablation, trained_head
    from eagle3_jax.checkpoints import load_target_config

    ac = load_ablation(ROOT / "configs/ablate_tiny.py")
    ac = dataclasses.replace(ac, base=ac.base.replace(target=str(tiny_target_dir)))
    tcfg, out = load_target_config(str(tiny_target_dir)), tmp_path / "g"
    cell = ac.cells[-1]
    cdir = out / "cells" / cell.name
    with pytest.raises(Eagle3Error, match=rf"'{cell.name}' has no trained head"):
        trained_head(ac, cell, out, tcfg)
    (cdir / "head").mkdir(parents=True)
    (cdir / "head/config.json").write_text("{}")
    with pytest.raises(Eagle3Error, match="no record of the config"):
        trained_head(ac, cell, out, tcfg)
    (cdir / "cell.json").write_text(json.dumps({"step": 3}))  # a state, but no config in it
    with pytest.raises(Eagle3Error, match="no record of the config"):
        trained_head(ac, cell, out, tcfg)
    tc = cell_config(ac, cell, out, tcfg)
    (cdir / "cell.json").write_text(json.dumps({"config": cell_record(tc)}))
    assert trained_head(ac, cell, out, tcfg) == cdir / "head"
    other = cell_record(tc.replace(lr=tc.optim.lr * 2))
    (cdir / "cell.json").write_text(json.dumps({"config": other}))
    with pytest.raises(Eagle3Error, match=r"another config \(lr\)"):
        trained_head(ac, cell, out, tcfg)


def test_results_are_written_as_cells_finish(tiny_target_dir, tmp_path, monkeypatch):
    """A grid stopped after its first cell keeps that cell's row in results.json and a report
    marked partial, naming the cells still to come; the complete grid's report is not marked."""
    from eagle3_jax.ablation import runner as abl
    from eagle3_jax.ablation.config import load_ablation

    ac = load_ablation(ROOT / "configs/ablate_tiny.py")
    ac = dataclasses.replace(
        ac, out_dir=str(tmp_path / "g"), evaluate=False,
        base=ac.base.replace(target=str(tiny_target_dir)),
    )  # fmt: skip
    out = tmp_path / "g"

    def precompute(tc, progress=True):
        Path(tc.run.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(tc.run.out_dir) / "dataset.npz").write_bytes(b"")

    def train(tc, resume=False, progress=True):
        if Path(tc.run.out_dir).name == "top_layer_only":
            raise Eagle3Error("stopped")
        (Path(tc.run.out_dir) / "head").mkdir()
        (Path(tc.run.out_dir) / "head/config.json").write_text("{}")

    def row(cell, tc, *args):
        return {"cell": cell.name, "aux_layer_ids": [1], "fc_input_width": 64, "ttt_steps": 3,
                "feature_loss_weight": 0.0, "draft_vocab_size": 64, "tau": None,
                "tau_by_task": {}, "final_acc": [0.5, 0.2, 0.1], "train_wall_s": 1.0}  # fmt: skip

    monkeypatch.setattr(abl, "precompute_features", precompute)
    monkeypatch.setattr(abl, "train", train)
    monkeypatch.setattr(abl, "cell_row", row)
    with pytest.raises(Eagle3Error, match="stopped"):
        abl.run_ablation(ac, progress=False)
    res = json.loads((out / "results.json").read_text())
    assert [r["cell"] for r in res["cells"]] == ["default"]
    assert res["planned"] == ["default", "top_layer_only"]
    report = (out / "report.md").read_text()
    assert "**Partial:** 1 of 2 cells finished; still to come: top_layer_only" in report
    assert "| default |" in report and (out / "tau_per_cell.png").is_file()
    (out / "cells/top_layer_only/head").mkdir()  # that cell trained since: the grid completes
    (out / "cells/top_layer_only/head/config.json").write_text("{}")
    abl.run_ablation(ac, progress=False)
    res = json.loads((out / "results.json").read_text())
    assert [r["cell"] for r in res["cells"]] == ["default", "top_layer_only"]
    assert "Partial" not in (out / "report.md").read_text()


def test_training_time_is_read_from_the_log_across_a_resume():
    """A cell's training time is its log's intervals (tokens over tokens_per_s), the first one
    and a resume's compile included, so a kill loses none of it; the recent pace leaves out the
    start's interval."""
    from eagle3_jax.ablation.status import logged_seconds, seconds_per_step

    log = [  # 100 tokens a step; killed after step 10's checkpoint, resumed (the log kept 5, 10)
        {"step": 5, "tokens": 500, "tokens_per_s": 10.0},  # 50 s: the start's compile inside
        {"step": 10, "tokens": 1000, "tokens_per_s": 25.0},  # 20 s
        {"step": 15, "tokens": 1500, "tokens_per_s": 12.5},  # 40 s: the resume's compile
        {"step": 20, "tokens": 2000, "tokens_per_s": 25.0},  # 20 s
        {"step": 20, "val_acc_0": 0.5},  # not an interval
    ]
    assert logged_seconds(log) == pytest.approx(130.0)
    assert seconds_per_step(log) == pytest.approx(80.0 / 15)
    assert seconds_per_step(log, window=1) == pytest.approx(4.0)
    assert seconds_per_step(log[:1]) is None and logged_seconds([]) == 0.0
    # records with their own interval (what the loop writes now): a resume between two logged
    # steps (from a SIGTERM's step-12 checkpoint) times its 3 steps alone, not the 5 since step 10
    log = [
        {"step": 5, "tokens": 500, "tokens_per_s": 10.0, "interval_steps": 5, "interval_s": 50.0},
        {"step": 10, "tokens": 1000, "tokens_per_s": 25.0, "interval_steps": 5, "interval_s": 20.0},
        {"step": 15, "tokens": 1500, "tokens_per_s": 7.5, "interval_steps": 3, "interval_s": 40.0},
        {"step": 20, "tokens": 2000, "tokens_per_s": 25.0, "interval_steps": 5, "interval_s": 20.0},
    ]
    assert logged_seconds(log) == pytest.approx(130.0)
    assert seconds_per_step(log) == pytest.approx(80.0 / 13)


def test_status_reads_where_each_cell_and_harness_run_stands(tmp_path):
    """--status of the study scripts: a cell with an exported head is trained, one with logged
    steps is training (its last validation and its time so far, from its log), one without either has not
    started; a harness run's records are counted per method, with the time it has left at its
    pace (a method not started at the others' speculative pace). Nothing is written."""
    from eagle3_jax.ablation.status import cell_status, status_lines

    ac = AblationConfig(
        base=TrainConfig().replace(max_steps=400),
        cells=(Cell("done", {}), Cell("going", {"max_steps": 300}), Cell("later", {})),
    )
    cells = tmp_path / "cells"
    (cells / "done" / "head").mkdir(parents=True)
    (cells / "done" / "head" / "config.json").write_text("{}")
    (cells / "going").mkdir()
    (cells / "going" / "metrics.jsonl").write_text(  # 100 tokens a step, 18 s a step
        '{"step": 5, "tokens": 500, "tokens_per_s": 9.0}\n'
        '{"step": 10, "tokens": 1000, "tokens_per_s": 5.555555555555555}\n'
        '{"step": 10, "tokens": 10'  # a line cut short
    )
    (cells / "going" / "validation.jsonl").write_text(
        '{"step": 10, "val_acc_0": 0.5, "val_replay_tau": 1.8}\n'
    )
    # an older runner's count, lost by kills: the training time is read from the log instead
    (cells / "going" / "cell.json").write_text('{"train_wall_s": 7200}')
    ev = tmp_path / "eval"
    ev.mkdir()
    methods = ["vanilla", "eagle3@a", "eagle3@b"]
    (ev / "config.json").write_text(json.dumps({"methods": [{"label": m} for m in methods]}))
    # 80 questions: 40 of two turns (MT-bench's), 40 of one
    qs = [Question(str(i), "t", ("a", "b") if i < 40 else ("a",)) for i in range(80)]
    (ev / "records.jsonl").write_text(  # vanilla 5 s a turn; a replayed head 15 s a turn
        "".join(
            json.dumps({"question_id": q, "method": m, "wall_time_s": w, "replay_time_s": r}) + "\n"
            for q, m, w, r in (
                ("0", "vanilla", 8.0, None),
                ("1", "vanilla", 12.0, None),
                ("0", "eagle3@a", 0.0, 30.0),
            )
        )
    )
    before = sorted(p for p in tmp_path.rglob("*"))
    lines = status_lines(cell_status(ac, tmp_path), {"replay": ev, "cpu": tmp_path / "none"}, qs)
    assert lines == [
        "cell done: trained",
        "cell going: training: step 10 of 300 (~1.4 h left at its recent pace); held-out at "
        "step 10: acc_0 0.500, replayed chain tau 1.80; 2 min of training",  # 55.6 + 90 s
        "cell later: not started",
        # 120 turns: vanilla 116 x 5 s, a 118 x 15 s, b (not started, at a's pace) 120 x 15 s
        # = 4,150 s
        "harness replay: vanilla 2, eagle3@a 1 (records per method, of 80 questions; ~1.2 h "
        "left at its pace)",
        "harness cpu: not started (records per method, of 80 questions)",
    ]
    assert sorted(p for p in tmp_path.rglob("*")) == before


def test_status_says_where_the_shared_feature_store_stands(tmp_path):
    """--status's feature-store line: not started, being built (the batches done over every
    process's progress file, of their total where the files record it), ready once features.json
    is written; a progress file being replaced is skipped, not an error."""
    from eagle3_jax.ablation.status import store_line

    store = tmp_path / "features"
    assert store_line(store) == "feature store: not started"
    part = tmp_path / "features.partial"
    part.mkdir()
    assert store_line(store) == "feature store: being built (0 batches done)"
    (part / "progress.json").write_text('{"done_batches": 453, "total_batches": 1200}')
    assert store_line(store) == "feature store: being built (453 of 1,200 batches done)"
    (part / "progress.json").write_text('{"done_batches": 453}')  # begun before totals were kept
    assert store_line(store) == "feature store: being built (453 batches done)"
    (part / "progress.json").unlink()
    for p, (done, total) in enumerate([(300, 600), (250, 600)]):  # two processes' shards
        (part / f"shard{p}").mkdir()
        (part / f"shard{p}" / "progress.json").write_text(
            json.dumps({"done_batches": done, "total_batches": total})
        )
    (part / "shard2").mkdir()
    (part / "shard2" / "progress.json").write_text('{"done_bat')  # cut short while replaced
    assert store_line(store) == "feature store: being built (550 of 1,200 batches done)"
    store.mkdir()
    (store / "features.json").write_text("{}")
    assert store_line(store) == "feature store: ready"
