"""Runs an ablation grid (`run_ablation`): the shared data and features once, then each cell
trained and evaluated in turn, resumably, its row added to the results as it finishes."""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

from eagle3_jax.ablation.config import (
    AblationConfig,
    Cell,
    cell_config,
    cell_record,
    check_cell_config,
    feature_layers,
)
from eagle3_jax.ablation.report import write_outputs
from eagle3_jax.ablation.status import logged_seconds
from eagle3_jax.checkpoints import load_target, load_target_config
from eagle3_jax.checkpoints.atomic import exclusive, write_text_atomic
from eagle3_jax.checkpoints.eagle_format import load_draft
from eagle3_jax.config import DTYPES
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation.metrics import tau
from eagle3_jax.evaluation.options import EvalOptions
from eagle3_jax.evaluation.records import read_jsonl
from eagle3_jax.evaluation.runner import run_eval
from eagle3_jax.evaluation.study import read_curve
from eagle3_jax.training.config import TrainConfig
from eagle3_jax.training.loop import train
from eagle3_jax.training.prepare import draft_size, precompute_features, prepare_data
from eagle3_jax.training.start import draft_config


def run_ablation(ac: AblationConfig, only: list[str] | None = None, progress: bool = True) -> dict:

    ac = ac.validate()
    cells = [c for c in ac.cells if only is None or c.name in only]
    if only is not None and len(cells) != len(set(only)):
        missing = sorted(set(only) - {c.name for c in ac.cells})
        raise Eagle3Error(f"no cell named {', '.join(missing)} in this grid")
    out = Path(ac.out_dir)
    if out.exists() and not out.is_dir():
        raise Eagle3Error(f"out_dir {out} is a file: give a directory")
    mine = {"cells", "shared", "features", "features.partial", "report.md", "results.json",
            "ablation.json", "tau_per_cell.png", ".lock"}  # fmt: skip
    if (
        out.is_dir()
        and not (out / "cells").exists()
        and any(p.name not in mine and not p.name.startswith(".") for p in out.iterdir())
    ):
        raise Eagle3Error(
            f"out_dir {out} holds files that are not an ablation run: use a new or empty one "
            "(nothing there was changed)"
        )
    out.mkdir(parents=True, exist_ok=True)
    with exclusive(out, "out_dir"):  # a second grid on the same out_dir is refused at once
        return _run_locked(ac, cells, out, progress)


def _run_locked(ac: AblationConfig, cells, out: Path, progress: bool) -> dict:
    tcfg = load_target_config(ac.base.corpus.target)
    layers = feature_layers(ac, tcfg)
    for cell in ac.cells:  # every cell's head, also those a driver runs later one at a time
        tc = cell_config(ac, cell, out, tcfg)
        draft_config(tc, tcfg, draft_size(tc, tcfg.vocab_size))
    plan = _plan(ac, cells, out, tcfg)
    _shared_features(ac, out, layers, progress)  # 1. data and features, once

    # 2 + 3. each cell: train (resumable), then evaluate (resumable); the results so far are
    # written as each cell finishes, so a grid stopped or failed midway keeps what it finished
    rows = []
    result = {
        "config": {
            "bench": ac.bench,
            "questions": ac.questions,
            "max_new_tokens": ac.max_new_tokens,
            "tree": list(ac.tree),
            "acc_window": ac.acc_window,
            "acc_records": ac.acc_records,
            "evaluate": ac.evaluate,
            "feature_layers": list(layers),
            "online_features": ac.online_features,
            "base": ac.base.record(),
        },
        "planned": [cell.name for cell, _, _ in plan],
        "cells": rows,
    }
    for cell, tc, state in plan:
        cdir = Path(tc.run.out_dir)
        _train_cell(cell, tc, state, out, progress)
        summary = _evaluate_cell(ac, cell, cdir, progress) if ac.evaluate else None
        rows.append(cell_row(cell, tc, cdir, summary, tcfg, ac.acc_window, ac.acc_span(tc)))
        write_outputs(out, result)
    return result


def _plan(ac: AblationConfig, cells, out: Path, tcfg) -> list[tuple[Cell, TrainConfig, dict]]:
    """(cell, its TrainConfig, its cell.json state) of each cell, every cell's config checked
    first: a refusal must not come after hours of work."""
    plan = []
    for cell in cells:
        tc = cell_config(ac, cell, out, tcfg)
        path = Path(tc.run.out_dir) / "cell.json"
        state = json.loads(path.read_text()) if path.exists() else {}
        check_cell_config(cell, Path(tc.run.out_dir), state, tc)
        plan.append((cell, tc, state))
    return plan


def _shared_features(ac: AblationConfig, out: Path, layers, progress: bool) -> None:
    """The grid's dataset (OUT/shared) and the target's features of `layers` (OUT/features), made
    once; a store lacking layers the grid now needs is refused. With `online_features` the
    dataset alone: each cell computes its features as it trains."""
    if ac.online_features:
        shared = ac.base.replace(out_dir=str(out / "shared"), features="online")
        (out / "shared").mkdir(parents=True, exist_ok=True)
        if not (out / "shared" / "dataset.npz").exists():
            target = load_target(shared.corpus.target, dtype=DTYPES[shared.compute.param_dtype])
            prepare_data(shared, target, out / "shared", progress)
        print("dataset ready (features computed online by each cell)", file=sys.stderr)
        return
    shared = ac.base.replace(
        out_dir=str(out / "shared"),
        features="offline",
        features_dir=str(out / "features"),
        feature_layers=layers,
    )
    feats_meta = out / "features" / "features.json"
    if feats_meta.exists():
        lacking = sorted(set(layers) - set(json.loads(feats_meta.read_text())["layers"]))
        if lacking:
            raise Eagle3Error(
                f"{out / 'features'} lacks layers {lacking} that the grid now needs: delete "
                "it to precompute again, or use another out_dir"
            )
    t0 = time.perf_counter()
    precompute_features(shared, progress=progress)
    print(
        f"features ready ({time.perf_counter() - t0:.0f}s): layers {list(layers)}", file=sys.stderr
    )


def _train_cell(cell: Cell, tc: TrainConfig, state: dict, out: Path, progress: bool) -> None:
    """Trains one cell in its folder on the shared dataset (resuming it; a finished one is left);
    its cell.json `state` records the cell's config (its training time is read from its log:
    `status.logged_seconds`, which a kill cannot lose)."""
    cdir = Path(tc.run.out_dir)
    cdir.mkdir(parents=True, exist_ok=True)
    if not (cdir / "dataset.npz").exists():
        shutil.copyfile(out / "shared" / "dataset.npz", cdir / "dataset.npz")
    state["config"] = cell_record(tc)
    state.pop("train_wall_s", None)  # an older runner's count: what the processes it saw end ran
    write_text_atomic(cdir / "cell.json", json.dumps(state) + "\n")
    if not (cdir / "head" / "config.json").exists():
        print(f"[{cell.name}] training {cell.overrides}", file=sys.stderr)
        resume = (cdir / "checkpoints").exists() and any((cdir / "checkpoints").iterdir())
        train(tc, resume=resume, progress=progress)


def _evaluate_cell(ac: AblationConfig, cell: Cell, cdir: Path, progress: bool) -> dict:
    """The harness's summary of a cell's head: τ only (no vanilla), on the grid's questions and
    tree."""
    print(f"[{cell.name}] evaluating", file=sys.stderr)
    k, d, n = ac.tree
    return run_eval(
        EvalOptions(
            out=cdir / "eval",
            target=ac.base.corpus.target,
            drafts=(f"head={cdir / 'head'}",),
            methods=f"eagle3:{k},{d},{n}",
            bench=ac.bench,
            questions=ac.questions,
            max_new_tokens=ac.max_new_tokens,
            dtype=ac.dtype,
            progress=progress,
            baseline=False,
        )
    )


def cell_row(
    cell: Cell,
    tc: TrainConfig,
    cdir: Path,
    summary: dict | None,  # the harness summary; None: the cell was not evaluated
    tcfg,
    window: int = 1,
    span: int | None = None,
) -> dict:

    s = summary["by_method"][summary["methods"][0]] if summary else None
    last = final_metrics(cdir, window, span)
    params, dcfg, _, _ = load_draft(cdir / "head", tcfg)
    return {
        "cell": cell.name,
        "overrides": json.loads(json.dumps(cell.overrides)),
        "aux_layer_ids": list(dcfg.aux_layer_ids),
        "fc_input_width": int(params["fc"].shape[0]),
        "ttt_steps": tc.head.ttt_steps,
        "feature_loss_weight": tc.head.feature_loss_weight,
        "draft_vocab_size": dcfg.draft_vocab_size,
        "tau": s["overall"]["tau"]["mean"] if s else None,
        "tau_by_task": {t: g["tau"]["mean"] for t, g in s["tasks"].items()} if s else {},
        "acceptance_by_depth": s["overall"]["acceptance_by_depth"] if s else None,
        "final_acc": [last.get(f"acc_{i}") for i in range(tc.head.ttt_steps)],
        "final_loss": last.get("loss"),
        "steps": last.get("step"),
        "acc_steps": last.get("window"),  # logged steps acc_i averages
        "acc_by_step": last.get("acc_by_step", {}),
        "batch_size": tc.optim.batch_size,
        "tau_by_question": tau_by_question(cdir / "eval", summary["methods"][0]) if s else {},
        "tokens": last.get("tokens"),
        "curve": read_curve(cdir),  # held-out acc_0 and replayed chain τ against tokens read
        # the kept run's wall time from its log: steps, validations, checkpoints and each
        # resume's compile (work a stop threw away is not counted)
        "train_wall_s": logged_seconds(read_jsonl(cdir / "metrics.jsonl")),
    }


def final_metrics(run: Path, window: int = 1, span: int | None = None) -> dict:
    """The last logged training record, with loss and acc_i replaced by their means over the
    last `window` logged steps or, when `span` is given, over the logged steps among the last
    `span` training steps (whatever log_every was)."""
    path = run / "metrics.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    recs = [r for r in recs if "loss" in r]
    if not recs:
        return {}
    last = dict(recs[-1])
    tail = recs[-window:] if span is None else [r for r in recs if r["step"] > last["step"] - span]
    for k in [k for k in last if k == "loss" or k.startswith("acc_")]:
        vals = [r[k] for r in tail if r.get(k) is not None]
        last[k] = sum(vals) / len(vals) if vals else None
    last["window"] = len(tail)
    # the averaged steps' own values: cells that read the same records in the same order are
    # compared step by step (paired), which cancels how hard each record is
    last["acc_by_step"] = {
        str(r["step"]): [r.get(f"acc_{i}") for i in range(_num_acc(r))] for r in tail
    }
    return last


def _num_acc(rec: dict) -> int:
    return sum(1 for k in rec if k.startswith("acc_") and k[4:].isdigit())


def tau_by_question(eval_dir: Path, method: str | None = None) -> dict[str, float]:
    """τ of each question (all its turns; the harness's definition, `metrics.tau`), from its
    records.jsonl (of `method` only, when given)."""

    path = eval_dir / "records.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if method in (None, r.get("method")) and math.isfinite(t := tau([r])):
            out[str(r["question_id"])] = t
    return out
