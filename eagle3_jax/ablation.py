"""Ablation grids: many heads trained from ONE set of precomputed target features, each evaluated on
the same questions, summarised in one table.

An `AblationConfig` (a Python config file, see configs/ablate_*.py) holds a base `TrainConfig` and
named cells, each a dict of TrainConfig overrides (aux_layer_ids, ttt_steps, feature_loss_weight,
draft_vocab_size, ...). `run_ablation`:
  1. builds the dataset once (OUT/shared) and precomputes the target's features once (OUT/features)
     for the union of every cell's aux layers (plus the final hidden state);
  2. trains each cell in OUT/cells/NAME with the same data, seed and step budget (and data order,
     for cells of one batch size)
     (offline features; resumes a cell interrupted mid-run, skips a finished one);
  3. evaluates each head with the harness (tau only, no vanilla) on the same questions and tree;
  4. writes OUT/results.json, OUT/report.md, OUT/tau_per_cell.png and OUT/acc_by_ttt_step.png,
     again as each cell finishes (a partial report names the cells still to come).
Every stage is resumable: rerunning the same command continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from eagle3_jax.checkpoints import load_target_config
from eagle3_jax.checkpoints.atomic import exclusive, write_text_atomic
from eagle3_jax.checkpoints.eagle_format import load_draft
from eagle3_jax.errors import Eagle3Error, differing_keys
from eagle3_jax.evaluation import paired
from eagle3_jax.evaluation.metrics import tau
from eagle3_jax.evaluation.options import EvalOptions
from eagle3_jax.evaluation.report import strict_json
from eagle3_jax.evaluation.runner import run_eval
from eagle3_jax.evaluation.study import read_curve
from eagle3_jax.training.config import FIELDS, TrainConfig, flatten, load_python_config, resolve
from eagle3_jax.training.loop import train
from eagle3_jax.training.prepare import precompute_features

CELL_FIELDS = set(FIELDS) - {
    "out_dir",
    "features",
    "features_dir",
    "feature_layers",
    "feature_dtype",
    "target",
    "data",
}


@dataclasses.dataclass(frozen=True)
class Cell:
    """One grid cell: a name (a directory) and TrainConfig overrides, each field by its name
    (`lr`) or by group and name (`optim.lr`), as `TrainConfig.replace` takes them."""

    name: str
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class AblationConfig:
    base: TrainConfig
    cells: tuple[Cell, ...]
    out_dir: str = "runs/ablate"
    bench: str = "mt_bench"  # spec_bench | mt_bench | gsm8k | a question file
    questions: int | None = 2  # per task
    max_new_tokens: int = 128
    tree: tuple[int, int, int] = (1, 4, 5)  # top_k, depth, total_tokens of the evaluation
    dtype: str | None = None
    # acc_i in the table: the mean over the last `acc_window` logged steps (log_every 1 and a run
    # shorter than an epoch make each a batch the head had not trained on yet, scored before its
    # update: progressive validation); 1 = the last logged step alone
    acc_window: int = 1
    # > 0: instead, each cell averages the logged steps among its last
    # ceil(acc_records / batch_size) training steps, so cells that differ in batch size are scored
    # on as many records (not the same ones: length buckets order records by batch size)
    acc_records: int = 0
    evaluate: bool = True  # False: train only (a caller measures the heads itself, e.g. in one run)

    def acc_span(self, tc: TrainConfig) -> int | None:
        """The training steps whose logged acc_i a cell averages (None: the last acc_window
        logged steps)."""
        return math.ceil(self.acc_records / tc.optim.batch_size) if self.acc_records else None

    def validate(self) -> AblationConfig:
        if not self.cells:
            raise Eagle3Error("the ablation has no cells: list at least one Cell")
        if self.acc_window < 1:
            raise Eagle3Error(f"acc_window {self.acc_window} < 1")
        if self.acc_records < 0:
            raise Eagle3Error(f"acc_records {self.acc_records} < 0 (0 = use acc_window)")
        names = [c.name for c in self.cells]
        if len(set(names)) != len(names):
            raise Eagle3Error(f"cell names repeat: {', '.join(names)}")
        for c in self.cells:
            if not c.name or "/" in c.name or c.name.startswith("."):
                raise Eagle3Error(f"cell name {c.name!r} is not a plain directory name")
            bad = sorted(k for k in c.overrides if _field_name(k) not in CELL_FIELDS)
            if bad:
                raise Eagle3Error(
                    f"cell {c.name!r} overrides {', '.join(bad)}: a cell may change training "
                    "fields only (data, target and features are shared by the whole grid)"
                )
        self.base.validate()
        return self


def _field_name(key: str) -> str | None:
    """The field an override names (`lr` or `optim.lr` -> `lr`); None for no field."""
    try:
        return resolve(key)[1]
    except Eagle3Error:
        return None


def vary(field: str, values, base: dict[str, Any] | None = None, fmt=None) -> list[Cell]:
    """One cell per value of one field (on top of `base` overrides), named `field=value`."""
    fmt = fmt or (lambda v: ",".join(map(str, v)) if isinstance(v, tuple | list) else str(v))
    return [Cell(f"{field}={fmt(v)}", {**(base or {}), field: v}) for v in values]


def load_ablation(path: str | Path) -> AblationConfig:
    cfg = load_python_config(path)
    if not isinstance(cfg, AblationConfig):
        raise Eagle3Error(f"{path}: get_config() must return an AblationConfig")
    return cfg.validate()


def cell_config(ac: AblationConfig, cell: Cell, out: Path, tcfg) -> TrainConfig:
    """The TrainConfig of one cell: base + overrides, offline features from the shared store."""
    tc = ac.base.replace(
        **cell.overrides,
        out_dir=str(out / "cells" / cell.name),
        features="offline",
        features_dir=str(out / "features"),
        feature_layers=feature_layers(ac, tcfg),
    )
    return tc.validate()


def aux_ids_of(tc: TrainConfig, tcfg) -> tuple[int, ...]:
    return tcfg.check_aux_layer_ids(tc.head.aux_layer_ids or tcfg.default_aux_layer_ids())


def feature_layers(ac: AblationConfig, tcfg) -> tuple[int, ...]:
    """Sorted union of every cell's aux layers (what the shared feature store must hold)."""
    ids = set()
    for c in ac.cells:
        ids |= set(aux_ids_of(ac.base.replace(**c.overrides), tcfg))
    return tuple(sorted(ids))


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


# what a cell's result depends on: every TrainConfig field but where and how often it writes,
# where the shared feature store is and what else it holds, and how the work is laid out (a cell
# on a mesh trains to the same losses as on one device, tested; remat recomputes the same values)
_BOOKKEEPING = (
    "out_dir",
    "save_every",
    "log_every",
    "keep_checkpoints",
    "export_every",
    "features_dir",
    "feature_layers",
    "mesh_data",
    "mesh_model",
    "remat",
)


def cell_record(tc: TrainConfig) -> dict:
    """What cell.json records of a cell's config: nested by group, without `_BOOKKEEPING`."""
    return tc.record(_BOOKKEEPING)


def check_cell_config(cell: Cell, cdir: Path, state: dict, tc: TrainConfig) -> None:
    """A cell trained (or started) under another config is refused, never silently reused.

    Records are compared field by field (`flatten`), so one written nested by group and one in
    the flat layout of before the groups are the same config when their fields are. A field
    missing from a saved record (added to TrainConfig since) counts as its default. Cells from
    before records (train_config.json only, which omits max_steps) are checked on the fields it
    has, and a finished one on its step count."""
    now = flatten(cell_record(tc))
    saved = state.get("config")
    if saved is None:
        path = cdir / "train_config.json"
        if not path.exists():
            return
        saved = flatten(json.loads(path.read_text()))
        now = {k: v for k, v in now.items() if k in saved or k == "max_steps"}
        info = cdir / "head" / "training.json"
        steps = json.loads(info.read_text())["step"] if info.exists() else None
        saved["max_steps"] = steps if steps is not None and tc.optim.max_steps else now["max_steps"]
    saved = {k: v for k, v in flatten(saved).items() if k not in _BOOKKEEPING}  # as recorded before
    defaults = flatten(cell_record(TrainConfig()))
    saved = {**{k: defaults.get(k) for k in now.keys() - saved.keys()}, **saved}
    diff = differing_keys(saved, now)
    if diff:
        raise Eagle3Error(
            f"cell {cell.name!r} in {cdir} was trained with another config ({', '.join(diff)}): "
            "delete that directory to train it again, or use another out_dir"
        )


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
    plan = []  # (cell, its TrainConfig, its cell.json state)
    for cell in cells:  # every cell's config first: a refusal must not come after hours of work
        tc = cell_config(ac, cell, out, tcfg)
        path = Path(tc.run.out_dir) / "cell.json"
        state = json.loads(path.read_text()) if path.exists() else {"train_wall_s": 0.0}
        check_cell_config(cell, Path(tc.run.out_dir), state, tc)
        plan.append((cell, tc, state))

    # 1. data and features, once
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
            "base": ac.base.record(),
        },
        "planned": [cell.name for cell, _, _ in plan],
        "cells": rows,
    }
    for cell, tc, state in plan:
        cdir = Path(tc.run.out_dir)
        cdir.mkdir(parents=True, exist_ok=True)
        if not (cdir / "dataset.npz").exists():
            shutil.copyfile(out / "shared" / "dataset.npz", cdir / "dataset.npz")
        state_path = cdir / "cell.json"
        state["config"] = cell_record(tc)
        write_text_atomic(state_path, json.dumps(state) + "\n")
        if not (cdir / "head" / "config.json").exists():
            print(f"[{cell.name}] training {cell.overrides}", file=sys.stderr)
            t0 = time.perf_counter()
            resume = (cdir / "checkpoints").exists() and any((cdir / "checkpoints").iterdir())
            try:
                train(tc, resume=resume, progress=progress)
            finally:  # an interrupted run's time counts too (it resumes from its checkpoint)
                state["train_wall_s"] += time.perf_counter() - t0
                write_text_atomic(state_path, json.dumps(state) + "\n")
        summary = None
        if ac.evaluate:
            print(f"[{cell.name}] evaluating", file=sys.stderr)
            k, d, n = ac.tree
            summary = run_eval(
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
        rows.append(
            cell_row(
                cell, tc, cdir, summary, state["train_wall_s"], tcfg, ac.acc_window, ac.acc_span(tc)
            )
        )
        write_outputs(out, result)
    return result


def cell_row(
    cell: Cell,
    tc: TrainConfig,
    cdir: Path,
    summary: dict | None,  # the harness summary; None: the cell was not evaluated
    wall: float,
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
        "train_wall_s": wall,
    }


def _f(x, digits=2):
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def missing_cells(result: dict) -> list[str]:
    """The planned cells a (partial) result does not hold yet, in grid order."""
    done = {r["cell"] for r in result["cells"]}
    return [c for c in result.get("planned", []) if c not in done]


def report_markdown(result: dict) -> str:
    cfg, rows = result["config"], result["cells"]
    missing = missing_cells(result)
    tasks = list(dict.fromkeys(t for r in rows for t in r["tau_by_task"]))
    steps = max((len(r["final_acc"]) for r in rows), default=0)
    held = [r["curve"][-1] if r.get("curve") else {} for r in rows]
    held_cols = ["held-out acc_0", "held-out chain τ"] if any(held) else []
    lines = [
        "# Ablation",
        "",
        *(
            [
                f"**Partial:** {len(rows)} of {len(rows) + len(missing)} cells finished; still to "
                f"come: {', '.join(missing)} (rerun the same command to continue).",
                "",
            ]
            if missing
            else []
        ),
        f"Every cell trained from the same precomputed features (layers {cfg['feature_layers']}), "
        f"records, seed and step budget (in one order per batch size); "
        + (
            f"evaluated greedily on `{cfg['bench']}` ({cfg['questions']} questions per task, "
            f"{cfg['max_new_tokens']} new tokens per turn, tree top_k,depth,total = "
            f"{','.join(map(str, cfg['tree']))}). τ = tokens per target forward; "
            if cfg.get("evaluate", True)
            else "not evaluated here (evaluate=False). "
        )
        + "acc_i = training accuracy of TTT step i, "
        + (
            f"mean over the logged steps among each cell's last {cfg['acc_records']} "
            "training records."
            if cfg.get("acc_records")
            else f"mean of the last {cfg['acc_window']} logged steps."
            if cfg.get("acc_window", 1) > 1
            else "at the last logged step."
        )
        + (
            " Held-out acc_0 and chain τ: the last validation of the cell's exported head on "
            "held-out conversations (each cell's curve against tokens read is in results.json)."
            if held_cols
            else ""
        ),
        "",
        "| "
        + " | ".join(
            ["cell", "aux layers", "fc in", "TTT", "feat. loss", "Vd"]
            + [f"τ {t}" for t in tasks]
            + ["τ"]
            + [f"acc_{i}" for i in range(steps)]
            + held_cols
            + ["train s"]
        )
        + " |",
        "|" + " --- |" * (8 + len(tasks) + steps + len(held_cols)),
    ]
    for r, h in zip(rows, held):
        accs = [_f(a) for a in r["final_acc"]] + [""] * (steps - len(r["final_acc"]))
        cells = [
            r["cell"],
            ",".join(map(str, r["aux_layer_ids"])),
            str(r["fc_input_width"]),
            str(r["ttt_steps"]),
            f"{r['feature_loss_weight']:g}",
            str(r["draft_vocab_size"]),
            *(_f(r["tau_by_task"].get(t)) for t in tasks),
            _f(r["tau"]),
            *accs,
            *([_f(h.get("acc_0"), 3), _f(h.get("chain_tau"))] if held_cols else []),
            f"{r['train_wall_s']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + paired_table(rows)) + "\n"


PAIRED_ACC = 3  # acc_0..acc_2 in the paired table


def _present(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def paired_table(rows: list[dict]) -> list[str]:
    """Each cell against the first, paired: acc_i step by step over the same records (only
    between cells of one batch size, which read the records in one order), τ question by
    question. Record difficulty and question difficulty cancel; what is left is the head. Each
    difference carries its 95 % Student's t interval (`evaluation.paired`), and the lines below
    the table name the differences whose interval excludes zero."""
    if len(rows) < 2:
        return []
    ref = rows[0]
    lines = [
        "",
        f"Paired differences against `{ref['cell']}`: mean (95 % t interval); acc_i over the "
        "same training records step by step, τ over the same questions; * the interval excludes "
        "no difference.",
        "",
        "| cell | " + " | ".join(f"Δacc_{i}" for i in range(PAIRED_ACC)) + " | Δτ |",
        "|" + " --- |" * (PAIRED_ACC + 2),
    ]

    def step_column(row: dict, i: int) -> dict:
        return {k: v[i] if i < len(v) else None for k, v in row.get("acc_by_step", {}).items()}

    ref_cols = [_present(step_column(ref, i)) for i in range(PAIRED_ACC)]
    real = []
    for r in rows[1:]:
        same_order = r.get("batch_size") == ref.get("batch_size")
        diffs = {
            f"acc_{i}": paired.paired_difference(_present(step_column(r, i)), ref_cols[i])
            for i in range(PAIRED_ACC)
            if same_order
        }
        diffs["τ"] = paired.paired_difference(
            _present(r.get("tau_by_question", {})), _present(ref.get("tau_by_question", {}))
        )
        cols = [diffs[f"acc_{i}"].text(3) if same_order else "–" for i in range(PAIRED_ACC)]
        lines.append(f"| {r['cell']} | " + " | ".join([*cols, diffs["τ"].text(3)]) + " |")
        real += [f"{r['cell']} {k} {d.mean:+.3f}" for k, d in diffs.items() if d.real]
    verdict = (
        f"Real differences (95 %): {'; '.join(real)}."
        if real
        else "No difference is real at 95 %: every interval includes zero."
    )
    return lines + ["", verdict]


def write_outputs(out: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # rewritten as each cell finishes: a kill mid-write leaves the previous complete files
    write_text_atomic(out / "results.json", json.dumps(strict_json(result), indent=1) + "\n")
    write_text_atomic(out / "report.md", report_markdown(result))
    rows = result["cells"]
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(rows) + 2), 4))
    ax.bar(range(len(rows)), [r["tau"] or 0 for r in rows])  # 0: a cell not evaluated
    ax.set_xticks(range(len(rows)), [r["cell"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("τ (tokens per target forward)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "tau_per_cell.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        acc = [a for a in r["final_acc"] if a is not None]
        ax.plot(range(len(acc)), acc, "o-", label=r["cell"])
    ax.set_xlabel("TTT step i")
    ax.set_ylabel("training acc_i (end of training)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "acc_by_ttt_step.png", dpi=120)
    plt.close(fig)
