"""Training configuration: frozen dataclasses grouped by concern, config files, overrides.

One `TrainConfig` holds six groups, each a frozen dataclass:

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
at one level, written up to 2026-12-03), and `flatten` maps either layout to {field: value}, the form
that resume and reuse checks compare: an old run's record equals the same config today.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle3_jax.data.conversations import REPEATED
from eagle3_jax.errors import Eagle3Error

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _check_numbers(cfg, ranges: tuple[tuple[str, float, float, bool], ...]) -> None:
    """Every float of `ranges` (field, lowest, highest, whether the lowest is allowed) finite and
    in range, every int field an int, each named: a NaN learning rate would train garbage with
    exit 0."""
    for name, lo, hi, lo_ok in ranges:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise Eagle3Error(f"{name} {v!r}: give a number")
        if not math.isfinite(v) or v > hi or v < lo or (v == lo and not lo_ok):
            left = "[" if lo_ok else "("
            raise Eagle3Error(f"{name} {v}: give a finite number in {left}{lo}, {hi}]")
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.type in ("int", int) and (isinstance(v, bool) or not isinstance(v, int)):
            raise Eagle3Error(f"{f.name} {v!r}: give an integer")


def _check_choice(cfg, name: str, choices) -> None:
    if getattr(cfg, name) not in choices:
        raise Eagle3Error(f"{name} {getattr(cfg, name)!r}: use {' or '.join(choices)}")


def _check_not_negative(cfg, meaning_of_zero: dict[str, str]) -> None:
    for name, zero in meaning_of_zero.items():
        if getattr(cfg, name) < 0:
            raise Eagle3Error(f"{name} {getattr(cfg, name)} < 0 (0 means {zero})")


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
    """What the head learns from: conversations answered by the target, tokenised, batched."""

    target: str | None = None  # checkpoint path; None = the embedded SmolLM2-135M-Instruct
    data: str = ""  # ShareGPT JSON/JSONL or role/content JSONL, several comma-separated
    regenerate: bool = True  # answer the prompts with the target itself (greedy) first
    regen_max_new_tokens: int = 256
    regen_batch_size: int = 8
    num_conversations: int = 0  # 0 = all
    repeated_ids: str = "rename"  # an id in several data files: "rename" keeps every record
    # (id#2, ...), "first" keeps the first file's (whole conversations listed before their
    # first turns answered alone)
    max_len: int = 1024
    length_bucket: int = 0  # > 0: batch records of similar length, each batch cut to a multiple
    # of this (less padding; at most max_len / length_bucket compiled shapes); 0: pad to max_len

    def validate(self) -> None:
        _check_numbers(self, ())
        if self.max_len < 2 or self.regen_max_new_tokens < 1 or self.regen_batch_size < 1:
            raise Eagle3Error(
                f"max_len {self.max_len}, regen_max_new_tokens {self.regen_max_new_tokens}, "
                f"regen_batch_size {self.regen_batch_size}: give max_len >= 2 and the others >= 1"
            )
        _check_choice(self, "repeated_ids", REPEATED)
        if self.length_bucket < 0:
            raise Eagle3Error(f"length_bucket {self.length_bucket} < 0 (0 pads to max_len)")


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """Where the target's features come from: its forward inside each step, or a store on disk
    (`train.py --precompute-features` writes it)."""

    features: str = "online"  # "online": target forward in the step; "offline": from features_dir
    features_dir: str = ""
    feature_layers: tuple[int, ...] = ()  # layers to precompute (default: the aux ids); a superset
    # lets ablations over aux-layer sets share one precomputation
    feature_dtype: str = "float32"  # or "bfloat16": half the disk (a pod-sized fp32 store is TBs)

    def validate(self) -> None:
        _check_numbers(self, ())
        _check_choice(self, "features", ("online", "offline"))
        if self.features == "offline" and not self.features_dir:
            raise Eagle3Error(
                "features=offline needs features_dir (precompute it with "
                "`train.py --precompute-features`)"
            )
        _check_choice(self, "feature_dtype", ("float32", "bfloat16"))


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """The head and its objective: what it predicts, from which target layers, how far it is
    trained ahead (TTT), where it starts from, and the losses beside the TTT one."""

    draft_vocab_size: int = 32000  # Vd; >= target vocab means the full vocabulary
    aux_layer_ids: tuple[int, ...] = ()  # () = the target's default (2, L//2, L-3)
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    feature_loss_weight: float = 0.0  # EAGLE-1/2-style regression of the target's hidden state
    head_init: str = "random"  # "target": lm_head rows and final norm start as the target's
    init_head: str = ""  # a head directory (official format) to start from instead: continue
    # training a shipped head on more data; its shapes and draft vocabulary must match this run's
    # output layer (docs/draft_vocab.md): "own" lm_head over Vd, or "target" = the target's frozen
    # output embedding over the full vocabulary (FR-Spec's source head; SpecVocab)
    lm_head_source: str = "own"
    init_trunk: str = ""  # a head directory whose fc, decoder layer and final norm this run
    # starts from, while the output layer starts as head_init / speculator_init say: compare output
    # layers (draft-vocabulary methods) on one trained trunk. Same target, aux layers and sizes.
    speculator_rank: int = 0  # SpecVocab: > 0 trains a (h A) B speculator, rank r (d/8 published)
    speculator_loss_weight: float = 0.1  # SpecVocab's auxiliary loss weight (published 0.1)
    speculator_init: str = "svd"  # "svd": (h A) B starts as the best rank-r approximation of the
    # target's output embedding (truncated SVD: the target's own logits, compressed); "random"

    _RANGES = (
        ("ttt_decay", 0.0, math.inf, False),
        ("feature_loss_weight", 0.0, math.inf, True),
        ("speculator_loss_weight", 0.0, math.inf, True),
    )

    def validate(self) -> None:
        _check_numbers(self, self._RANGES)
        if self.ttt_steps < 1:
            raise Eagle3Error(f"ttt_steps {self.ttt_steps} < 1 (1 means no training-time test)")
        _check_choice(self, "lm_head_source", ("own", "target"))
        if self.speculator_rank and self.lm_head_source != "target":
            raise Eagle3Error(
                "speculator_rank > 0 (SpecVocab) needs lm_head_source=target: its exact "
                "logits come from the target's output embedding"
            )
        _check_choice(self, "speculator_init", ("svd", "random"))
        if self.init_head and self.init_trunk:
            raise Eagle3Error(
                "init_head and init_trunk both set: init_head continues a whole head, "
                "init_trunk takes only its fc/layer/norm; choose one"
            )
        _check_choice(self, "head_init", ("random", "target"))


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay, clipped, over a number of steps of a batch."""

    lr: float = 1e-4
    warmup_ratio: float = 0.015
    epochs: int = 1
    max_steps: int = 0  # 0 = epochs * steps per epoch
    batch_size: int = 8  # global sequences per optimizer step (before accumulation)
    grad_accum: int = 1
    clip_norm: float = 0.5
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.0
    seed: int = 0  # the head's initialisation, the data order, the validation sample

    _RANGES = (
        ("lr", 0.0, math.inf, True),
        ("warmup_ratio", 0.0, 1.0, True),
        ("clip_norm", 0.0, math.inf, False),
        ("beta1", 0.0, 1.0, True),
        ("beta2", 0.0, 1.0, True),
        ("weight_decay", 0.0, math.inf, True),
    )

    def validate(self) -> None:
        _check_numbers(self, self._RANGES)
        _check_not_negative(self, {"max_steps": "epochs x steps per epoch",
                                   "epochs": "max_steps alone"})  # fmt: skip
        if self.epochs == 0 and self.max_steps == 0:
            raise Eagle3Error("epochs 0 and max_steps 0: nothing to train; set one of them")
        if self.batch_size < 1 or self.grad_accum < 1:
            raise Eagle3Error("batch_size and grad_accum must be >= 1")


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
    """How the work is laid out: parameter and compute dtypes, the (data, model) mesh, remat."""

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: bool = False  # recompute each TTT step in the backward pass (full-vocabulary memory)
    mesh_data: int = 1
    mesh_model: int = 1

    def validate(self) -> None:
        _check_numbers(self, ())
        if self.mesh_data < 1 or self.mesh_model < 1:
            raise Eagle3Error(f"mesh {self.mesh_data}x{self.mesh_model}: give sizes >= 1")
        for name in ("param_dtype", "compute_dtype"):
            _check_dtype(self, name)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where the run writes and how often: checkpoints, exported heads, metrics, and the held-out
    validation (training.validate): the head's TTT metrics on conversations it does not train
    on, written to out_dir/validation.jsonl (val_acc_i, val_chain_i, val_chain_tau,
    val_replay_tau)."""

    out_dir: str = "runs/default"
    save_every: int = 200  # 0: a checkpoint at the last step only
    keep_checkpoints: int = 3
    export_every: int = 0  # > 0: also export the head to out_dir/heads/step_N every N steps
    log_every: int = 10
    export_dtype: str = "bfloat16"
    val_data: str = ""  # ShareGPT / role-content file(s), comma-separated; "" = no validation
    val_every: int = 0  # steps between validations; 0 = at the last step only
    val_conversations: int = 200  # at most this many of val_data, drawn at random; 0 = all

    def validate(self) -> None:
        _check_numbers(self, ())
        if self.log_every < 1:
            raise Eagle3Error(f"log_every {self.log_every} < 1 (the last step is always logged)")
        _check_not_negative(self, {
            "save_every": "a checkpoint at the last step only",
            "export_every": "no intermediate exports",
            "val_every": "validation at the last step only",
            "val_conversations": "every val_data conversation",
        })  # fmt: skip
        if self.keep_checkpoints < 1:
            raise Eagle3Error(f"keep_checkpoints {self.keep_checkpoints} < 1")
        _check_dtype(self, "export_dtype")


def _check_dtype(cfg, name: str) -> None:
    if getattr(cfg, name) not in DTYPE_NAMES:
        raise Eagle3Error(f"{name} {getattr(cfg, name)!r}: use float32, bfloat16 or float16")


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
        groups (up to 2026-12-03). Fields a record leaves out take their defaults (records omit
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
