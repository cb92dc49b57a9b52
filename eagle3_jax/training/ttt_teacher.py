"""The teacher of the TTT loss (`training.ttt`): what step i at position t is supervised by, and
whether it is supervised at all, computed once per batch.

The target's distribution over the draft columns (target_p), its argmax, whether the target's own
argmax over the full vocabulary is a draft id, the loss and position masks, the token each step
reads and (for the feature loss) the target's hidden state: each array extended by `steps`
positions past T, shifted as the official trainer shifts it after every step (zero filled), so
that step i reads its [B, T] view with one dynamic slice (`at_step`) and the scan never
materialises a shifted copy. The shifts and the two masks that differ from the official code are
described in `training.ttt`'s docstring.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def _shift_ext(x_BT: jax.Array, steps: int, fill) -> jax.Array:
    """[B, T, ...] -> [B, T + steps, ...] with out[p] = x[p + 1] for p + 1 < T, else `fill`.

    Step i reads out[i : i + T] (= x shifted left i + 1 times, filled) with one dynamic slice, so
    the scan never materialises a shifted copy per step.
    """
    pad_shape = (x_BT.shape[0], steps + 1, *x_BT.shape[2:])
    pad = jnp.broadcast_to(jnp.asarray(fill, x_BT.dtype), pad_shape)
    return jnp.concatenate([x_BT[:, 1:], pad], axis=1)


def _pad_ext(x_BT: jax.Array, steps: int) -> jax.Array:
    """[B, T, ...] -> [B, T + steps, ...] zero padded: step i reads x shifted left i times."""
    pad = jnp.zeros((x_BT.shape[0], steps, *x_BT.shape[2:]), x_BT.dtype)
    return jnp.concatenate([x_BT, pad], axis=1)


class Teacher(NamedTuple):
    """The teacher and the masks, each extended by `steps` positions past T (`_shift_ext`,
    `_pad_ext`) so that step i reads its [B, T] view with one dynamic slice (`at_step`)."""

    tp: jax.Array  # [B, T+J, Vd] target_p: softmax over the draft columns of the target logits
    top: jax.Array  # [B, T+J] int32 argmax of target_p
    in_draft: jax.Array  # [B, T+J] bool: the target's argmax over its full vocabulary is a draft id
    valid_next: jax.Array  # [B, T+J] the teacher row is a real token (attention_mask, shifted)
    lm: jax.Array  # [B, T+J] loss_mask_i before the start mask
    pm: jax.Array  # [B, T+J] position_mask_i (lm and in_draft) before the start mask
    start_ok: jax.Array  # [B, T] a chain may start at t (not a padding position)
    ids: jax.Array  # [B, T+J] int32 the token input at step i
    hidden: jax.Array | None  # [B, T+J, D] the target's final hidden state (feature loss only)
    has_next: jax.Array | None  # [B, T+J] a teacher row exists inside T (feature loss only)


def make_teacher(batch, ids_BT, t2d_V, vd: int, steps: int, feature_loss: bool) -> Teacher:
    """The teacher, computed once on the unshifted target and then shifted: the fill rows are what
    the official zero-filled target logits give (uniform target_p, argmax 0)."""
    f32 = jnp.float32
    b, t = ids_BT.shape
    draft_cols = jnp.nonzero(t2d_V, size=vd)[0]  # ascending: column c is draft id c
    with jax.named_scope("teacher"):
        target_BTV = jax.lax.stop_gradient(batch["target_logits"]).astype(f32)
        in_draft_BT = t2d_V[jnp.argmax(target_BTV, axis=-1)]
        sub_BTC = jnp.take(target_BTV, draft_cols, axis=-1)
        tp_ext = _shift_ext(jax.nn.softmax(sub_BTC, axis=-1), steps, 1.0 / vd)  # [B, T+J, Vd]
        tp_top_ext = _shift_ext(jnp.argmax(sub_BTC, axis=-1).astype(jnp.int32), steps, 0)
        in_draft_ext = _shift_ext(in_draft_BT, steps, t2d_V[0])
        # A position is supervised at step i only if its teacher row t+i+1 is a real token
        # (attention_mask[t+i+1] = 1): past a row's end the teacher would be the target's output
        # at a padding token (official) or the zero fill, and which one depends on how far the
        # batch is padded. Only rows whose last token is supervised (cut answers) lose anything.
        valid_next_ext = _shift_ext(batch["attention_mask"].astype(f32), steps, 0.0)
        lm_ext = _pad_ext(batch["loss_mask"].astype(f32), steps) * valid_next_ext  # [B, T+J]
        pm_ext = in_draft_ext.astype(f32) * lm_ext
        # A chain that starts at a padding position (left or middle padding) runs on a padding
        # feature; the official code would still supervise it at later steps. Never the case with
        # right padding (loss_mask[t+i] = 1 implies t is valid), where this changes nothing.
        start_ok_BT = batch["attention_mask"].astype(f32)
        ids_ext = _shift_ext(ids_BT, steps, 0)
        th_ext = has_next_ext = None
        if feature_loss:
            th_ext = _shift_ext(
                jax.lax.stop_gradient(batch["target_hidden"]).astype(f32), steps, 0.0
            )
            has_next_ext = _shift_ext(jnp.ones((b, t), f32), steps, 0.0)
    return Teacher(tp_ext, tp_top_ext, in_draft_ext, valid_next_ext, lm_ext, pm_ext, start_ok_BT,
                   ids_ext, th_ext, has_next_ext)  # fmt: skip


def at_step(x_ext: jax.Array, i, t: int) -> jax.Array:
    """Step i's [B, T, ...] view of an extended [B, T+J, ...] array."""
    return jax.lax.dynamic_slice_in_dim(x_ext, i, t, axis=1)
