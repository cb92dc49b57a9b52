"""The head a training run trains (`draft_config`) and its parameters at step 0 (`start_params`):
initialised, or taken from an existing head, the target, or another head's trunk."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.checkpoints.eagle_format import check_aux_ids, load_draft
from eagle3_jax.checkpoints.head_config import draft_config_to_hf
from eagle3_jax.config import DTYPES
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf
from eagle3_jax.training.config import TrainConfig
from eagle3_jax.training.step import place


def draft_config(tc: TrainConfig, tcfg, draft_size: int) -> drf.DraftConfig:
    """The head this run trains: its aux layers (checked against the target as decoding and
    exporting will check them; id L, the final normed state, marks the head `final_norm_aux`),
    output layer and draft vocabulary size. A grid builds every cell's before training any
    (ablation.runner)."""
    aux_ids = tcfg.check_aux_layer_ids(tc.head.aux_layer_ids or tcfg.default_aux_layer_ids())
    dcfg = drf.DraftConfig.from_target(
        tcfg,
        draft_vocab_size=draft_size,
        aux_layer_ids=aux_ids,
        lm_head_source=tc.head.lm_head_source,
        speculator_rank=tc.head.speculator_rank,
        final_norm_aux=tcfg.num_layers in aux_ids,  # id L: the final normed state (EAGLE-1/2's)
    )
    check_aux_ids(dcfg, tcfg)  # what decoding will refuse ...
    draft_config_to_hf(dcfg)  # ... and what exporting will (aux id 0 has no official name)
    return dcfg


def start_params(tc: TrainConfig, dcfg, target, vocab, mesh):
    """The head's parameters at step 0: initialised, then taken from a head, the target or a
    trunk as `tc.head` says, laid out on the mesh."""
    head, dtype, tcfg = tc.head, DTYPES[tc.compute.param_dtype], target.cfg
    multi = jax.process_count() > 1
    dparams = drf.init_params(dcfg, jax.random.PRNGKey(tc.optim.seed), dtype)
    if multi:  # global arrays before anything mixes them with the target's (global) params
        dparams = place(dparams, drf.param_shardings(dcfg, mesh))
    if head.init_head:
        dparams = start_from_head(head.init_head, dcfg, vocab, tcfg, dtype)
    elif head.head_init == "target" and dcfg.lm_head_source == "own":
        dparams = drf.init_output_from_target(dparams, target.params, tcfg, vocab, dcfg)
    elif head.head_init == "target":  # the lm_head IS the target's: start the norm as its too
        dparams = {**dparams, "final_norm": target.params["final_norm"].astype(dtype)}
    if dcfg.speculator_rank and head.speculator_init == "svd" and not head.init_head:
        dparams = drf.init_speculator_svd(dparams, target.params, tcfg, dcfg)
    if head.init_trunk:
        dparams = start_trunk_from(head.init_trunk, dparams, dcfg, tcfg, dtype)
    if mesh is not None:
        dparams = (
            place(dparams, drf.param_shardings(dcfg, mesh))
            if multi
            else jax.tree.map(jax.device_put, dparams, drf.param_shardings(dcfg, mesh))
        )
    # The step donates the head's state while it reads the target's params, so no leaf may share
    # a buffer with them: a start taken from the target (head_init=target: its final norm, which
    # astype to the same dtype returns as the same array) is copied here, once, for every start.
    return jax.tree.map(jnp.copy, dparams)


def start_from_head(path: str, dcfg, vocab, tcfg, dtype):
    """The params of an existing head, refused unless it is the head this run would train."""

    params, cfg, head_vocab, _ = load_draft(path, tcfg, dtype=dtype)
    if cfg != dcfg:
        diff = [
            f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(dcfg, f.name)
        ]
        raise Eagle3Error(
            f"init_head {path} differs from this run's head in {', '.join(diff)}: start from "
            "a head with the same aux layers, sizes and draft vocabulary size"
        )
    if not np.array_equal(np.asarray(head_vocab.d2t), np.asarray(vocab.d2t)):
        raise Eagle3Error(
            f"init_head {path} has another draft vocabulary than this run's vocab.npz: copy "
            "its mapping (or train with the data it was built from)"
        )
    return params


TRUNK = ("fc", "layer", "final_norm")


def start_trunk_from(path: str, dparams, dcfg, tcfg, dtype):
    """`dparams` with fc, decoder layer and final norm taken from the head at `path` (trained);
    its output layer is left as this run initialised it. Refused unless the trunks match."""

    params, cfg, _, _ = load_draft(path, tcfg, dtype=dtype)
    trunk_fields = ("aux_layer_ids", "hidden_size", "intermediate_size", "num_heads",
                    "num_kv_heads", "head_dim", "feature_size")  # fmt: skip
    diff = [f for f in trunk_fields if getattr(cfg, f, None) != getattr(dcfg, f, None)]
    if diff:
        raise Eagle3Error(
            f"init_trunk {path} differs from this run's head in {', '.join(diff)}: its fc, "
            "layer and norm only fit a head with the same aux layers and sizes"
        )
    new = dict(dparams)
    for k in TRUNK:
        new[k] = jax.tree.map(lambda a: a.astype(dtype), params[k])
    return new
