"""Training configuration: a frozen dataclass, Python config files, `--config.field=value` overrides.

A config file (configs/*.py) defines `get_config() -> TrainConfig`; its docstring holds the launch
command. `load_config("configs/x.py", ["--config.lr=3e-4", ...])` applies overrides with the field's
own type (tuples as comma lists, bools as true/false, None as none).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

from eagle3_jax.data.conversations import REPEATED
from eagle3_jax.errors import Eagle3Error


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # what to train on
    target: str | None = None  # checkpoint path; None = the embedded SmolLM2-135M-Instruct
    data: str = ""  # ShareGPT JSON/JSONL or role/content JSONL
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
    # the head
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
    remat: bool = False  # recompute each TTT step in the backward pass (full-vocabulary memory)
    # optimisation
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
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    seed: int = 0
    # features
    features: str = "online"  # "online": target forward in the step; "offline": precomputed on disk
    features_dir: str = ""
    feature_layers: tuple[int, ...] = ()  # layers to precompute (default: the aux ids); a superset
    # lets ablations over aux-layer sets share one precomputation
    feature_dtype: str = "float32"  # or "bfloat16": half the disk (a pod-sized fp32 store is TBs)
    # parallelism
    mesh_data: int = 1
    mesh_model: int = 1
    # bookkeeping
    out_dir: str = "runs/default"
    save_every: int = 200  # 0: a checkpoint at the last step only
    keep_checkpoints: int = 3
    export_every: int = 0  # > 0: also export the head to out_dir/heads/step_N every N steps
    log_every: int = 10
    export_dtype: str = "bfloat16"
    # held-out validation (training.validate): the head's TTT metrics on conversations it does not
    # train on, written to out_dir/validation.jsonl (val_acc_i, val_chain_i, val_chain_tau,
    # val_replay_tau)
    val_data: str = ""  # ShareGPT / role-content file(s), comma-separated; "" = no validation
    val_every: int = 0  # steps between validations; 0 = at the last step only
    val_conversations: int = 200  # at most this many of val_data, drawn at random; 0 = all

    # (field, lowest, highest, whether the lowest is allowed): every float a run reads
    _RANGES = (
        ("lr", 0.0, math.inf, True),
        ("warmup_ratio", 0.0, 1.0, True),
        ("clip_norm", 0.0, math.inf, False),
        ("beta1", 0.0, 1.0, True),
        ("beta2", 0.0, 1.0, True),
        ("weight_decay", 0.0, math.inf, True),
        ("ttt_decay", 0.0, math.inf, False),
        ("feature_loss_weight", 0.0, math.inf, True),
        ("speculator_loss_weight", 0.0, math.inf, True),
    )

    def _check_numbers(self) -> None:
        """Finite and in range, each named: a NaN learning rate would train garbage with exit 0."""
        for name, lo, hi, lo_ok in self._RANGES:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise Eagle3Error(f"{name} {v!r}: give a number")
            if not math.isfinite(v) or v > hi or v < lo or (v == lo and not lo_ok):
                left = "[" if lo_ok else "("
                raise Eagle3Error(f"{name} {v}: give a finite number in {left}{lo}, {hi}]")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(v, bool) or not isinstance(v, int)):
                raise Eagle3Error(f"{f.name} {v!r}: give an integer")
        if self.max_len < 2 or self.regen_max_new_tokens < 1 or self.regen_batch_size < 1:
            raise Eagle3Error(
                f"max_len {self.max_len}, regen_max_new_tokens {self.regen_max_new_tokens}, "
                f"regen_batch_size {self.regen_batch_size}: give max_len >= 2 and the others >= 1"
            )
        if self.mesh_data < 1 or self.mesh_model < 1:
            raise Eagle3Error(f"mesh {self.mesh_data}x{self.mesh_model}: give sizes >= 1")

    def record(self, drop: tuple[str, ...] = ()) -> dict:
        """The fields as JSON reads them back (tuples as lists), without those in `drop`."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in drop}
        return json.loads(json.dumps(d))

    def validate(self) -> TrainConfig:
        self._check_numbers()
        if self.log_every < 1:
            raise Eagle3Error(f"log_every {self.log_every} < 1 (the last step is always logged)")
        for name, zero in (
            ("save_every", "a checkpoint at the last step only"),
            ("export_every", "no intermediate exports"),
            ("max_steps", "epochs x steps per epoch"),
            ("val_every", "validation at the last step only"),
            ("val_conversations", "every val_data conversation"),
            ("epochs", "max_steps alone"),
        ):
            if getattr(self, name) < 0:
                raise Eagle3Error(f"{name} {getattr(self, name)} < 0 (0 means {zero})")
        if self.epochs == 0 and self.max_steps == 0:
            raise Eagle3Error("epochs 0 and max_steps 0: nothing to train; set one of them")
        if self.keep_checkpoints < 1:
            raise Eagle3Error(f"keep_checkpoints {self.keep_checkpoints} < 1")
        if self.ttt_steps < 1:
            raise Eagle3Error(f"ttt_steps {self.ttt_steps} < 1 (1 means no training-time test)")
        if self.lm_head_source not in ("own", "target"):
            raise Eagle3Error(f"lm_head_source {self.lm_head_source!r}: use own or target")
        if self.speculator_rank and self.lm_head_source != "target":
            raise Eagle3Error(
                "speculator_rank > 0 (SpecVocab) needs lm_head_source=target: its exact "
                "logits come from the target's output embedding"
            )
        if self.speculator_init not in ("svd", "random"):
            raise Eagle3Error(f"speculator_init {self.speculator_init!r}: use svd or random")
        if self.init_head and self.init_trunk:
            raise Eagle3Error(
                "init_head and init_trunk both set: init_head continues a whole head, "
                "init_trunk takes only its fc/layer/norm; choose one"
            )

        if self.repeated_ids not in REPEATED:
            raise Eagle3Error(f"repeated_ids {self.repeated_ids!r}: use {' or '.join(REPEATED)}")
        if self.head_init not in ("random", "target"):
            raise Eagle3Error(f"head_init {self.head_init!r}: use random or target")
        if self.features not in ("online", "offline"):
            raise Eagle3Error(f"features {self.features!r}: use online or offline")
        if self.features == "offline" and not self.features_dir:
            raise Eagle3Error(
                "features=offline needs features_dir (precompute it with "
                "`train.py --precompute-features`)"
            )
        if self.feature_dtype not in ("float32", "bfloat16"):
            raise Eagle3Error(f"feature_dtype {self.feature_dtype!r}: use float32 or bfloat16")
        if self.length_bucket < 0:
            raise Eagle3Error(f"length_bucket {self.length_bucket} < 0 (0 pads to max_len)")
        if self.batch_size < 1 or self.grad_accum < 1:
            raise Eagle3Error("batch_size and grad_accum must be >= 1")
        if self.batch_size % (self.mesh_data * self.grad_accum):
            raise Eagle3Error(
                f"batch_size {self.batch_size} must divide by mesh_data x grad_accum "
                f"({self.mesh_data} x {self.grad_accum})"
            )
        for name in ("param_dtype", "compute_dtype", "export_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise Eagle3Error(
                    f"{name} {getattr(self, name)!r}: use float32, bfloat16 or float16"
                )
        return self


def _convert(text: str, annotation: Any, name: str) -> Any:
    hint = typing.get_type_hints(TrainConfig)[name]
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
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    changes = {}
    for item in overrides:
        if not item.startswith("--config.") or "=" not in item:
            raise Eagle3Error(f"bad override {item!r}: write --config.FIELD=VALUE")
        key, value = item[len("--config.") :].split("=", 1)
        if key not in fields:
            raise Eagle3Error(f"unknown config field {key!r}; fields: {', '.join(fields)}")
        changes[key] = _convert(value, fields[key].type, key)
    return dataclasses.replace(cfg, **changes)


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
