"""One optimisation step: frozen target features (online) or precomputed ones (offline) -> TTT loss
-> AdamW update, jitted with explicit shardings and a donated state.

The target's logits are recomputed from its final hidden state in both modes (offline features
store the hidden state, not [T, V] logits), so online and offline give the same loss.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.config import DTYPES, TargetConfig
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf
from eagle3_jax.models import draft_output
from eagle3_jax.models import target as tgt
from eagle3_jax.training.config import TrainConfig
from eagle3_jax.training.config_groups import OptimConfig
from eagle3_jax.training.ttt import ttt_loss


class TrainState(NamedTuple):
    step: jax.Array
    params: dict[str, Any]
    opt_state: Any


def make_optimizer(oc: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW (beta 0.9/0.95, no weight decay by default), linear warmup then cosine (or the
    peak rate held: `schedule="constant"`), clip 0.5, gradient accumulation over `grad_accum`
    micro-steps."""
    updates = max(1, total_steps // oc.grad_accum)
    warmup = max(1, int(round(updates * oc.warmup_ratio)))
    if oc.schedule == "constant":
        schedule = optax.join_schedules(
            [optax.linear_schedule(0.0, oc.lr, warmup), optax.constant_schedule(oc.lr)], [warmup]
        )
    else:
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, oc.lr, warmup, max(updates, warmup + 1), 0.0
        )
    tx = optax.chain(
        optax.clip_by_global_norm(oc.clip_norm),
        optax.adamw(schedule, b1=oc.beta1, b2=oc.beta2, weight_decay=oc.weight_decay),
    )
    return optax.MultiSteps(tx, every_k_schedule=oc.grad_accum) if oc.grad_accum > 1 else tx


def init_state(dparams, tx: optax.GradientTransformation, mesh=None) -> TrainState:
    """Fresh state. With a mesh, leaves that are not already spread over it (the step counter,
    optimiser counts) are replicated on it, so the whole state lives on one set of devices."""
    state = TrainState(jnp.zeros((), jnp.int32), dparams, tx.init(dparams))
    if mesh is None:
        return state
    rep = NamedSharding(mesh, P())

    def put(x):
        if len(x.sharding.device_set) == mesh.size:
            return x
        # across hosts, a global array made from the value every process holds alike
        return replicate(x, mesh) if jax.process_count() > 1 else jax.device_put(x, rep)

    return jax.tree.map(put, state)


def target_features(
    tparams,
    input_ids_BT: jax.Array,
    attention_mask_BT: jax.Array,
    tcfg: TargetConfig,
    aux_ids: tuple[int, ...],
) -> tuple[jax.Array, jax.Array]:
    """The frozen target's (aux features [B, T, n_aux*D], final hidden [B, T, D]) without gradient."""
    b, t = input_ids_BT.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    q = jnp.arange(t)
    causal = q[None, :] <= q[:, None]
    mask = causal[None] & attention_mask_BT[:, None, :].astype(bool)
    out = tgt.forward(
        tparams, input_ids_BT, positions, mask, tcfg, aux_ids=aux_ids, compute_logits=False
    )
    return jax.lax.stop_gradient(out.aux), jax.lax.stop_gradient(out.hidden)


def loss_fn(
    dparams,
    tparams,
    batch: dict[str, jax.Array],
    t2d: jax.Array,
    tcfg: TargetConfig,
    dcfg: drf.DraftConfig,
    tc: TrainConfig,
    per_position: bool = False,
):
    """TTT loss of a batch; `batch` has input_ids, loss_mask, attention_mask and, offline, aux/hidden.
    per_position adds the [B, T] "streak" metric (ttt_loss)."""
    compute = DTYPES[tc.compute.compute_dtype]
    if "aux" in batch:
        aux, hidden = batch["aux"], batch["hidden"]
    else:
        aux, hidden = target_features(
            tparams, batch["input_ids"], batch["attention_mask"], tcfg, dcfg.aux_layer_ids
        )
    target_logits = tgt.lm_head(tparams, hidden.astype(tparams["embed"].dtype), tcfg).astype(
        jnp.float32
    )
    dp = jax.tree.map(lambda x: x.astype(compute), dparams)
    # heads reading the target's output embedding get it here, outside the differentiated params
    dp = draft_output.attach_target_head(
        dp, dcfg, jax.tree.map(lambda x: x.astype(compute), tparams), tcfg
    )
    ttt_batch = {
        "input_ids": batch["input_ids"],
        "aux": aux.astype(compute),
        "target_logits": target_logits,
        "loss_mask": batch["loss_mask"],
        "attention_mask": batch["attention_mask"],
        "target_hidden": hidden.astype(compute),
    }
    return ttt_loss(
        dp,
        tparams["embed"].astype(compute),
        ttt_batch,
        dcfg,
        t2d,
        steps=tc.head.ttt_steps,
        decay=tc.head.ttt_decay,
        feature_loss_weight=tc.head.feature_loss_weight,
        remat=tc.compute.remat,
        mean_len=tc.corpus.max_len,
        speculator_loss_weight=tc.head.speculator_loss_weight if dcfg.speculator_rank else 0.0,
        per_position=per_position,
    )


def train_step(
    state: TrainState,
    tparams,
    batch,
    t2d,
    *,
    tcfg: TargetConfig,
    dcfg: drf.DraftConfig,
    tc: TrainConfig,
    tx: optax.GradientTransformation,
):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, tparams, batch, t2d, tcfg, dcfg, tc
    )
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
    return TrainState(state.step + 1, params, opt_state), metrics


def batch_sharding(mesh) -> NamedSharding:
    """Sequences over the `data` axis (the leading dimension of every batch array)."""
    return NamedSharding(mesh, P("data"))


def process_rows(mesh, batch_size: int) -> slice:
    """The rows of a global batch that this process's devices hold under `batch_sharding`: all of
    them with one process (or a `data` axis inside one host), else this process's share of the
    `data` axis. The rows a process reads, and hands to `global_batch`."""
    shards = batch_sharding(mesh).addressable_devices_indices_map((batch_size,))
    ranges = sorted({idx[0].indices(batch_size)[:2] for idx in shards.values()})
    lo, hi = ranges[0][0], max(stop for _, stop in ranges)
    if sum(stop - start for start, stop in ranges) != hi - lo:
        raise Eagle3Error(
            f"this process's devices hold rows {ranges} of the batch, not one block: order the "
            "mesh's devices process by process"
        )
    return slice(lo, hi)


def global_batch(arrays: dict[str, np.ndarray], mesh, batch_size: int) -> dict[str, jax.Array]:
    """This process's rows (`process_rows`) of every batch array -> global arrays sharded over
    `data`: what a step jitted with global shardings takes in a multi-process run (JAX refuses
    host-local numpy there)."""
    sh = batch_sharding(mesh)
    return {
        k: jax.make_array_from_process_local_data(sh, v, (batch_size, *v.shape[1:]))
        for k, v in arrays.items()
    }


def replicate(x, mesh) -> jax.Array:
    """A host value every process holds alike -> one array replicated over the whole mesh."""
    x = np.asarray(x)
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P()), x, x.shape)


def place(tree, shardings):
    """Host or single-device arrays every process holds alike -> global arrays laid out as
    `shardings` (each process fills only its own devices' shards)."""

    def put(x, sh):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, sh)  # a global array already: laid out anew
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])

    return jax.tree.map(put, tree, shardings)


def jit_train_step(
    tcfg: TargetConfig,
    dcfg: drf.DraftConfig,
    tc: TrainConfig,
    tx,
    mesh=None,
    state_shardings=None,
    target_shardings=None,
):
    """The jitted step; with a mesh, explicit in/out shardings (batch over data, params as given)."""
    fn = functools.partial(train_step, tcfg=tcfg, dcfg=dcfg, tc=tc, tx=tx)
    if mesh is None:
        return jax.jit(fn, donate_argnums=0)
    rep = NamedSharding(mesh, P())
    return jax.jit(
        fn,
        donate_argnums=0,
        in_shardings=(state_shardings, target_shardings, batch_sharding(mesh), rep),
        out_shardings=(state_shardings, rep),
    )
