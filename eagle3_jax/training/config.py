"""Training configuration: one TrainConfig of six groups, its field names, records, config files
and overrides.

One `TrainConfig` holds six groups, each a frozen dataclass that checks its own fields
(`training.config_groups`):

  corpus   CorpusConfig   what the head learns from: the target, the conversations, their
                          regeneration by the target, tokenising and batching by length
  store    StoreConfig    where the target's features come from: the step itself (online) or a
                          store precomputed on disk (offline)
  head     HeadConfig     the head and its objective: draft vocabulary, aux layers, TTT, where it
                          starts from, the feature and speculator losses
  optim    OptimConfig    the optimisation: AdamW, its schedule, batch, steps, seed
  compute  ComputeConfig  how the work is laid out: dtypes, the mesh, remat (the mesh and remat
                          change no result, tested)
  run      RunConfig      bookkeeping: out_dir, checkpoints, exports, logging, held-out validation

A config file (configs/*.py) defines `get_config() -> TrainConfig` and holds its launch command in
its docstring. Every field name is unique across the groups, so an override names a field with or
without its group: `--config.optim.lr=3e-4` and `--config.lr=3e-4` are the same; the value takes
the field's own type (tuples as comma lists, bools as true/false, None as none). In code,
`tc.replace(lr=3e-4, max_len=512)` changes fields of any group the same way (an ablation cell's
overrides are such a dict).

Records (a run's train_config.json, an ablation cell's cell.json) are written nested by group.
`TrainConfig.from_dict` also reads the flat layout every record had before the groups (all fields
at one level, as older versions wrote them), and `flatten` maps either layout to {field: value}, the form
that resume and reuse checks compare: an old run's record equals the same config today.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle3_jax.errors import Eagle3Error
from eagle3_jax.training.config_groups import (
    ComputeConfig,
    CorpusConfig,
    HeadConfig,
    OptimConfig,
    RunConfig,
    StoreConfig,
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run: the six groups above. Build one in a config file, change it with
    `replace`, check it with `validate`."""

    corpus: CorpusConfig = dataclasses.field(default_factory=CorpusConfig)
    store: StoreConfig = dataclasses.field(default_factory=StoreConfig)
    head: HeadConfig = dataclasses.field(default_factory=HeadConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    compute: ComputeConfig = dataclasses.field(default_factory=ComputeConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)

    def validate(self) -> TrainConfig:
        for group, cls in GROUPS.items():
            if not isinstance(getattr(self, group), cls):
                raise Eagle3Error(
                    f"{group} is {getattr(self, group)!r}: it must be {cls.__name__}(...) (or set "
                    f"its fields with replace / --config.{group}.FIELD=VALUE)"
                )
            getattr(self, group).validate()
        mesh_data, accum = self.compute.mesh_data, self.optim.grad_accum
        if self.optim.batch_size % (mesh_data * accum):
            raise Eagle3Error(
                f"batch_size {self.optim.batch_size} must divide by mesh_data x grad_accum "
                f"({mesh_data} x {accum})"
            )
        return self

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with `changes`: fields by name (`lr=3e-4`) or by group and name
        (`**{"optim.lr": 3e-4}`), or whole groups (`optim=OptimConfig(...)`). Not validated."""
        whole = {k: v for k, v in changes.items() if k in GROUPS}
        fields: dict[str, dict[str, Any]] = {}
        for key, value in changes.items():
            if key not in GROUPS:
                group, name = resolve(key)
                fields.setdefault(group, {})[name] = value
        groups = {
            g: dataclasses.replace(whole.get(g, getattr(self, g)), **fields.get(g, {}))
            for g in whole.keys() | fields.keys()
        }
        return dataclasses.replace(self, **groups)

    def record(self, drop: tuple[str, ...] = ()) -> dict:
        """The fields by group as JSON reads them back (tuples as lists), without those in `drop`
        (field names). What train_config.json and cell.json hold; `flatten` gives {field: value}."""
        d = {
            group: {k: v for k, v in dataclasses.asdict(getattr(self, group)).items()
                    if k not in drop}
            for group in GROUPS
        }  # fmt: skip
        return json.loads(json.dumps(d))

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> TrainConfig:
        """The config a record describes, in either layout: nested by group (`record()`), or flat,
        every field at the top level, as train_config.json and cell.json were written before the
        groups (older versions). Fields a record leaves out take their defaults (records omit
        the resumable ones, and fields are added over time); an unknown field is refused. JSON
        lists become tuples. Not validated."""
        changes = {}
        for key, value in flatten(record).items():
            group, name = resolve(key)
            if isinstance(value, list) and typing.get_origin(_hint(group, name)) is tuple:
                value = tuple(value)
            changes[f"{group}.{name}"] = value
        return cls().replace(**changes)


GROUPS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}
# every field's group, by the field's name (unique across groups, and never a group's name)
FIELDS: dict[str, str] = {
    f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)
}


def resolve(key: str) -> tuple[str, str]:
    """(group, field) of `lr` or `optim.lr`; an unknown field is refused, naming the fields."""
    group, _, name = key.rpartition(".")
    if name in FIELDS and group in ("", FIELDS[name]):
        return FIELDS[name], name
    if key in GROUPS:
        raise Eagle3Error(
            f"{key} is a group of fields: set one of them, e.g. --config.{key}."
            f"{next(iter(_fields_of(key)))}=VALUE"
        )
    if name in FIELDS:
        raise Eagle3Error(f"unknown config field {key!r}: {name} is {FIELDS[name]}.{name}")
    raise Eagle3Error(f"unknown config field {key!r}; fields: {', '.join(FIELDS)}")


def flatten(record: Mapping[str, Any]) -> dict[str, Any]:
    """{field: value} of a record in either layout, nested by group or flat (before the groups):
    the form that checks comparing a saved record with a config compare, so that a record of an
    unchanged config equals it whichever layout it was written in."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key in GROUPS and isinstance(value, Mapping):
            out.update(value)
        else:
            out[key] = value
    return out


def _fields_of(group: str) -> list[str]:
    return [f.name for f in dataclasses.fields(GROUPS[group])]


def _hint(group: str, name: str) -> Any:
    return typing.get_type_hints(GROUPS[group])[name]


def _convert(text: str, group: str, name: str) -> Any:
    hint = _hint(group, name)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if text.lower() == "none" and type(None) in args:
        return None
    if origin in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    try:
        if hint is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if origin is tuple:
            return tuple(args[0](x) for x in text.split(",") if x.strip())
        return hint(text)
    except (ValueError, TypeError):
        raise Eagle3Error(f"--config.{name}={text}: not a valid {hint}") from None


def apply_overrides(cfg: TrainConfig, overrides: list[str]) -> TrainConfig:
    """`--config.FIELD=VALUE` or `--config.GROUP.FIELD=VALUE` items applied in order."""
    changes = {}
    for item in overrides:
        if not item.startswith("--config.") or "=" not in item:
            raise Eagle3Error(f"bad override {item!r}: write --config.FIELD=VALUE")
        key, value = item[len("--config.") :].split("=", 1)
        group, name = resolve(key)
        changes[f"{group}.{name}"] = _convert(value, group, name)
    return cfg.replace(**changes)


def load_python_config(path: str | Path) -> Any:
    """Imports a config file and returns what its get_config() returns."""
    path = Path(path)
    if not path.is_file():
        raise Eagle3Error(f"config file {path} does not exist: see configs/ for the shipped ones")
    spec = importlib.util.spec_from_file_location(f"eagle3_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        return module.get_config()
    except Eagle3Error:
        raise
    except Exception as e:  # a config file is user code: report, do not dump a traceback
        raise Eagle3Error(f"config {path} failed to load: {type(e).__name__}: {e}") from e


def load_config(path: str | Path, overrides: list[str] = ()) -> TrainConfig:
    """Imports a config file, calls its get_config(), applies overrides and validates."""
    cfg = load_python_config(path)
    if not isinstance(cfg, TrainConfig):
        raise Eagle3Error(f"{path}: get_config() must return a TrainConfig")
    return apply_overrides(cfg, list(overrides)).validate()
