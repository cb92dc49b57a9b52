"""The six groups of a training run's config (`training.config.TrainConfig`), each a frozen
dataclass whose `validate()` checks its own fields, naming the field and what to give:

  CorpusConfig   what the head learns from (the target, the conversations, regeneration, batching)
  StoreConfig    where the target's features come from (online, or a store on disk)
  HeadConfig     the head and its objective (draft vocabulary, aux layers, TTT, init, losses)
  OptimConfig    AdamW, its schedule, batch, steps, seed
  ComputeConfig  dtypes, the (data, model) mesh, remat
  RunConfig      out_dir, checkpoints, exports, logging, held-out validation

Every field name is unique across the groups (`training.config.FIELDS` relies on it).
"""

from __future__ import annotations

import dataclasses
import math

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
    """AdamW with linear warmup and cosine decay (or a constant rate after warmup), clipped, over
    a number of steps of a batch."""

    lr: float = 1e-4
    warmup_ratio: float = 0.015
    # "cosine": warmup then cosine to zero at the last step; "constant": warmup then lr to the
    # end, so that a head exported at any step is what a run stopped there gives (a grid that
    # measures one run at several budgets: configs/fusion_ablation_trained_smollm2.py)
    schedule: str = "cosine"
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
        _check_choice(self, "schedule", ("cosine", "constant"))
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
