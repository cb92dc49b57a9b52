"""An ablation grid's configuration: the base TrainConfig and its named cells (`AblationConfig`,
`Cell`, `vary`), each cell's TrainConfig, and what a cell records of it (cell.json) so that a cell
trained under another config is refused, never silently reused."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from eagle3_jax.errors import Eagle3Error, differing_keys
from eagle3_jax.training.config import FIELDS, TrainConfig, flatten, load_python_config, resolve

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
    # training steps at which each cell's exported head is measured (each a multiple of the base's
    # export_every; the last may be max_steps, the final head); () = the final head alone. With a
    # constant learning rate after warmup (`schedule="constant"`) the head at step B is what a run
    # of B steps gives, so one run per cell answers "at which budget do the cells part"
    budgets: tuple[int, ...] = ()
    # (bench, questions per task) measured on each head, in order; () = ((bench, questions),)
    benches: tuple[tuple[str, int | None], ...] = ()
    # True: the cells compute the target's features as they train (features="online"; the shared
    # dataset is still built once) instead of reading one precomputed store: a store of six
    # layers in bfloat16 is ~7 KB a token, more than a device's disk at tens of millions of tokens
    online_features: bool = False

    def measured(self) -> tuple[tuple[str, int | None], ...]:
        """(bench, questions per task) of every harness run a head gets."""
        return self.benches or ((self.bench, self.questions),)

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
        every = self.base.run.export_every
        last = self.base.optim.max_steps
        for b in self.budgets:
            if b < 1 or (b != last and (not every or b % every)):
                raise Eagle3Error(
                    f"budget {b}: measured budgets are steps where a head is exported (multiples "
                    f"of export_every {every}, or max_steps {last})"
                )
            if last and b > last:
                raise Eagle3Error(f"budget {b} is past max_steps {last}")
        if list(self.budgets) != sorted(set(self.budgets)):
            raise Eagle3Error(f"budgets {self.budgets}: give them increasing, once each")
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
        features="online" if ac.online_features else "offline",
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


def trained_head(ac: AblationConfig, cell: Cell, out: Path, tcfg) -> Path:
    """The head of a cell trained already under `out` (what the study scripts' --skip-train
    measure): refused when the cell has no finished head, no record of its config, or a record
    of another config than the grid's (`check_cell_config`), so that results kept under the
    cell's config are never measured on a head trained under another."""
    tc = cell_config(ac, cell, out, tcfg)
    cdir = Path(tc.run.out_dir)
    if not (cdir / "head" / "config.json").is_file():
        raise Eagle3Error(
            f"--skip-train: cell {cell.name!r} has no trained head ({cdir / 'head'}): run "
            "without --skip-train to train it"
        )
    path = cdir / "cell.json"
    state = json.loads(path.read_text()) if path.is_file() else {}
    if state.get("config") is None and not (cdir / "train_config.json").is_file():
        raise Eagle3Error(
            f"--skip-train: cell {cell.name!r} in {cdir} has no record of the config it was "
            "trained with (cell.json): run without --skip-train to train it here"
        )
    check_cell_config(cell, cdir, state, tc)
    return cdir / "head"
