"""The EAGLE-3 training-time-test (TTT) loss: `steps` draft steps unrolled with one `lax.scan`.

Semantics as read from SafeAILab/EAGLE `eagle/traineagle3/cnets.py` and SpecForge's
`OnlineEagle3Model` with the `cache_hidden` attention of `llama3_eagle.py` (both agree):

* Data, once: `input_ids` and `target_logits` shifted left by 1 (zero fill), `loss_mask` NOT
  shifted. Step 0 pairs the feature at t with token t+1 and is supervised by the target's
  distribution at t+1; h0 = fc(aux).
* Step i (0-based) at position t: token input_ids[t+i+1] (0 past the end), feature = h0 at step 0,
  else the draft's own pre-norm output of step i-1 at t (D wide, fc skipped); RoPE at t+i. It is
  supervised by target_logits[t+i+1] under loss_mask[t+i] (all three arrays are shifted left by one
  more, zero filled, after each step).
* Attention at step i: the query at t sees the step-0 keys 0..t (causal, non-padding keys only)
  and, for j = 1..i, only the diagonal key K_j[t]; one softmax over both. This is the official
  cache_hidden attention (whose diagonal keys are not padding-masked: they are the query's own
  position); SpecForge's flex mask over the (i+1)*T keys is the same thing written densely (it
  differs only on padding queries, which the loss never reads). Here the diagonal is kept as a
  [steps, B, T, G, K] key/value buffer (slot 0 holds the step-0 keys, slot j the keys of step j)
  and scored elementwise, so no [T, (i+1)*T] mask or score array exists.
* Loss per step: target_p = softmax over the draft-vocab columns of the target logits (fp32,
  renormalised); position_mask = loss_mask * t2d[argmax over the full target vocab];
  ploss_i = -sum_v position_mask * target_p * log_softmax(draft logits), averaged over ALL B*T
  positions (the official `.mean()`, not over the masked ones). Total = sum_i decay^i * ploss_i.
* acc_i = sum[(argmax draft == argmax target_p) * position_mask] / (sum(loss_mask_i) + 1e-6): the
  denominator counts every supervised position, also those whose target token is outside the
  draft vocabulary (they can never be right).

Two deliberate differences, both no-ops for rows whose last token is unsupervised (every answer
that ends with the template's end-of-turn and trailing newline) under right padding:
* loss_mask_i[t] is also multiplied by attention_mask[t], so a chain that STARTS at a padding
  position (left or middle padding) is never supervised; the official code would supervise it at
  later steps with a padding-derived feature.
* loss_mask_i[t] is also multiplied by attention_mask[t + i + 1]: a position whose teacher row
  lies past the row's end (the target's output at a padding token, or the zero fill) is not
  supervised, so the loss does not depend on how far a batch is padded.
These factors enter the ploss, acc and its denominator and the feature loss alike.

Memory: per step the scan keeps what one step's backward needs (the [B, H, T, T] probabilities
of the step-0 block, [B, T, Vd] logits, ...), so that part is linear in steps; the carried key /
value buffer adds steps * [steps, B, T, G, K] residuals, which is small beside the T*T terms
(steps*G*K vs H*T per position). `remat=True` keeps only the carries per step and recomputes the
rest in the backward pass.

The teacher (the shifted targets and masks each step reads) is `training.ttt_teacher`'s; the
draft layer's math is `models.draft`'s (`project_qkv`, `finish_layer`), shared with decoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.config import rope_inv_freq
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models.draft import DraftConfig, finish_layer, fuse, project_qkv
from eagle3_jax.models.draft_output import head_logits, speculator_logits
from eagle3_jax.models.layers import NEG_INF, rms_norm, rope_cos_sin
from eagle3_jax.training.ttt_teacher import Teacher, at_step, make_teacher

Params = dict[str, Any]

ACC_EPS = 1e-6  # the official acc denominator: loss_mask.sum() + 1e-6
VLOSS_EPS = 1e-5  # EAGLE-1/2 vloss denominator: loss_mask.sum() + 1e-5


def ttt_attention(
    q_BTHK: jax.Array,
    k_JBTGK: jax.Array,
    v_JBTGK: jax.Array,
    step: jax.Array | int,
    key_valid_BT: jax.Array,
) -> jax.Array:
    """Attention of TTT step `step` in the diagonal form; GQA, one fp32 softmax over both blocks.

    Args:
      q_BTHK: [B, T, H, K] queries of this step (RoPE at t + step already applied).
      k_JBTGK, v_JBTGK: [J, B, T, G, K] (J = steps) buffers: slot 0 the step-0 keys/values (the
        causal block), slot j >= 1 those of step j. Slots beyond `step` are ignored (they may hold
        anything finite).
      step: int or int32 scalar, 0 <= step < J.
      key_valid_BT: bool [B, T], False at padding (only step-0 keys are padding-masked; the
        diagonal keys are the query's own position, as in the official cache_hidden attention).
    Returns:
      [B, T, H, K] in v's dtype. A query with no valid step-0 key at step 0 (a padding row) gets a
      finite, meaningless output, as with `layers.attention`; the loss masks such rows.
    """
    b, t, h, kd = q_BTHK.shape
    g = k_JBTGK.shape[3]
    q = q_BTHK.reshape(b, t, g, h // g, kd)
    scale = 1.0 / np.sqrt(kd)
    # Step-0 block: [B, G, R, T, S] with S = T, causal and padding-masked like a plain prefill.
    s0 = jnp.einsum("btgrk,bsgk->bgrts", q, k_JBTGK[0], preferred_element_type=jnp.float32) * scale
    mask0 = jnp.tril(jnp.ones((t, t), bool))[None] & key_valid_BT.astype(bool)[:, None, :]
    s0 = jnp.where(mask0[:, None, None], s0, NEG_INF)
    # Diagonal block: query t against K_j[t] only, elementwise over t: [B, G, R, T, J].
    sd = jnp.einsum("btgrk,jbtgk->bgrtj", q, k_JBTGK, preferred_element_type=jnp.float32) * scale
    j = jnp.arange(k_JBTGK.shape[0])
    sd = jnp.where((j >= 1) & (j <= step), sd, NEG_INF)  # slot 0 is the causal block itself
    # One softmax over [S block ; J block] without concatenating them (no [T, T + J] copy).
    m = jax.lax.stop_gradient(jnp.maximum(s0.max(-1, keepdims=True), sd.max(-1, keepdims=True)))
    e0, ed = jnp.exp(s0 - m), jnp.exp(sd - m)
    denom = e0.sum(-1, keepdims=True) + ed.sum(-1, keepdims=True)
    p0, pd = (e0 / denom).astype(v_JBTGK.dtype), (ed / denom).astype(v_JBTGK.dtype)
    out = jnp.einsum("bgrts,bsgk->btgrk", p0, v_JBTGK[0])
    out = out + jnp.einsum("bgrtj,jbtgk->btgrk", pd, v_JBTGK)
    return out.reshape(b, t, h, kd)


def _check(
    batch: Mapping[str, jax.Array],
    dcfg: DraftConfig,
    vocab_t2d,
    steps: int,
    feature_loss_weight: float,
) -> None:
    for name in ("input_ids", "aux", "target_logits", "loss_mask", "attention_mask"):
        if name not in batch:
            raise Eagle3Error(
                f"TTT batch has no '{name}': it needs input_ids, aux, target_logits, "
                "loss_mask and attention_mask (and target_hidden for the feature "
                "loss)"
            )
    if not isinstance(steps, int) or steps < 1:
        raise Eagle3Error(f"TTT steps must be a static int >= 1 (1 = no TTT), got {steps!r}")
    b, t = batch["input_ids"].shape
    want = {
        "aux": (b, t, dcfg.feature_size),
        "target_logits": (b, t, dcfg.vocab_size),
        "loss_mask": (b, t),
        "attention_mask": (b, t),
    }
    if feature_loss_weight > 0:
        if "target_hidden" not in batch:
            raise Eagle3Error(
                "feature_loss_weight > 0 needs batch['target_hidden'] [B, T, D]: the "
                "target's final hidden state"
            )
        want["target_hidden"] = (b, t, dcfg.hidden_size)
    if "position_ids" in batch:
        want["position_ids"] = (b, t)
    for name, shape in want.items():
        if tuple(batch[name].shape) != shape:
            raise Eagle3Error(
                f"TTT batch['{name}'] has shape {tuple(batch[name].shape)}, expected "
                f"{shape} for input_ids {(b, t)} and this DraftConfig"
            )
    if tuple(np.shape(vocab_t2d)) != (dcfg.vocab_size,):
        raise Eagle3Error(
            f"t2d has shape {tuple(np.shape(vocab_t2d))}, expected "
            f"({dcfg.vocab_size},): pass the DraftVocab.t2d of this head"
        )


def ttt_loss(
    dparams: Params,
    embed_VD: jax.Array,
    batch: Mapping[str, jax.Array],
    dcfg: DraftConfig,
    vocab_t2d: jax.Array,
    steps: int = 7,
    decay: float = 0.8,
    feature_loss_weight: float = 0.0,
    remat: bool = False,
    mean_len: int | None = None,
    speculator_loss_weight: float = 0.0,
    per_position: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The decayed sum of the per-step TTT losses and per-step metrics.

    Static under jit: dcfg, steps, feature_loss_weight (it decides whether the feature loss is
    built), remat, per_position; decay may be static or traced.

    Args:
      dparams: draft params (`models.draft.init_params` layout), fp32 or bf16.
      embed_VD: the frozen token embedding [V, D] (never differentiated here unless asked).
      batch: input_ids int [B, T]; aux [B, T, n_aux*Ht] target features at each position;
        target_logits [B, T, V] the target's logits at each position (any float dtype);
        loss_mask [B, T] (1 on assistant tokens); attention_mask [B, T] (1 on non-padding);
        optional position_ids int [B, T] (default 0..T-1); optional target_hidden [B, T, D] the
        target's final hidden state at each position (feature loss only).
      vocab_t2d: bool [V], `DraftVocab.t2d` (its True ids, ascending, are the draft columns).
      steps: TTT length (static; 1 = plain next-token training, no TTT).
      decay: weight of step i is decay**i.
      feature_loss_weight: > 0 adds the EAGLE-1/2 feature regression at each step: smooth-L1 (beta
        1) between the step's pre-norm output h at t and target_hidden[t + i + 1] (the feature it
        stands for), mean over D, summed over positions with loss_mask_i = 1 (and t + i + 1 < T),
        divided by their count + 1e-5; weighted by feature_loss_weight * decay**i.
      remat: recompute each step in the backward pass (keeps only h and the K/V buffers per step).
      mean_len: positions per row that ploss averages over (default T). Training passes max_len,
        so a batch cut to its longest row (length buckets) has the same loss as one padded to
        max_len.
      speculator_loss_weight: > 0 (SpecVocab heads, whose Vd = V) adds, per step, the auxiliary
        loss of the speculator: the same soft cross-entropy as ploss but of softmax((hA)B), i.e.
        KL(target || speculator) up to a constant, weighted speculator_loss_weight * decay**i.
        Its gradient reaches A, B and (through h) the layer (docs/draft_vocab.md).

    Every loss_mask_i below is loss_mask shifted left i times AND attention_mask (see the module
    docstring; identical to the official loss_mask_i for right-padded batches).
    Returns:
      loss: fp32 scalar sum_i decay^i * (ploss_i + feature_loss_weight * vloss_i
        + speculator_loss_weight * sloss_i).
      metrics: fp32 arrays [steps]: "ploss", "acc", "correct" (acc numerator), "denom" (sum of
        loss_mask_i, the acc denominator without its 1e-6, for exact averaging across batches),
        "chain" (the share of positions supervised at step 0 whose steps 0..i all drafted the
        target's token: what a chain decoded from there accepts, see `chain_tau`) with its
        numerator "chain_correct", and "vloss" when feature_loss_weight > 0. With
        per_position, also "streak" [B, T]: how many steps in a row from step 0 drafted the
        target's greedy token at each position, whatever the loss mask (a teacher token must
        exist): the tokens a greedy chain from there accepts (training.validate replays
        decoding's rounds with it).
    """
    _check(batch, dcfg, vocab_t2d, steps, feature_loss_weight)
    feature_loss = feature_loss_weight > 0
    speculator = speculator_loss_weight > 0
    vd = dcfg.draft_vocab_size
    if speculator and (not dcfg.speculator_rank or vd != dcfg.vocab_size):
        raise Eagle3Error(
            "speculator_loss_weight > 0 needs a SpecVocab head (speculator_rank > 0, "
            "full vocabulary)"
        )
    ids_BT = batch["input_ids"].astype(jnp.int32)
    b, t = ids_BT.shape
    mean_len = t if mean_len is None else mean_len
    tch = make_teacher(batch, ids_BT, jnp.asarray(vocab_t2d).astype(bool), vd, steps, feature_loss)

    positions_BT = batch.get("position_ids")
    if positions_BT is None:
        positions_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    positions_BT = positions_BT.astype(jnp.int32)
    key_valid_BT = batch["attention_mask"].astype(bool)
    inv_freq = rope_inv_freq(dcfg.rope, dcfg.head_dim)

    h0_BTD = fuse(dparams, batch["aux"])
    kv_dtype = jnp.result_type(h0_BTD.dtype, dparams["layer"]["wk"].dtype)
    buf_shape = (steps, b, t, dcfg.num_kv_heads, dcfg.head_dim)
    # streak_BT: 1 where every step so far drafted the target's token (a chain from t still alive)
    carry0 = (
        h0_BTD,
        jnp.zeros(buf_shape, kv_dtype),
        jnp.zeros(buf_shape, kv_dtype),
        jnp.ones((b, t), jnp.float32),
        jnp.ones((b, t), jnp.float32),  # the same streak without the loss mask (per_position only)
    )
    opts = _LossOptions(mean_len, per_position, feature_loss, speculator)

    def body(carry, i):
        h_BTD, k_JBTGK, v_JBTGK, streak_BT, run_BT = carry
        h_new, k_JBTGK, v_JBTGK = _layer_step(
            dparams, embed_VD, dcfg, (h_BTD, k_JBTGK, v_JBTGK), i,
            at_step(tch.ids, i, t), positions_BT, inv_freq, key_valid_BT, kv_dtype,
        )  # fmt: skip
        with jax.named_scope("ttt_step_loss"):
            streak_BT, run_BT, out = _step_loss(
                dparams, h_new, dcfg, tch, i, streak_BT, run_BT, opts
            )
        return (h_new, k_JBTGK, v_JBTGK, streak_BT, run_BT), out

    if remat:
        body = jax.checkpoint(body)
    _, per_step = jax.lax.scan(body, carry0, jnp.arange(steps, dtype=jnp.int32))
    return _totals(
        per_step, steps, decay, b * mean_len, feature_loss_weight, speculator_loss_weight, opts
    )


class _LossOptions(NamedTuple):
    mean_len: int  # positions per row that ploss averages over
    per_position: bool  # also the [B, T] streaks (validation)
    feature_loss: bool  # also vloss (feature_loss_weight > 0)
    speculator: bool  # also sloss and scorrect (speculator_loss_weight > 0)


def _layer_step(dparams, embed_VD, dcfg, carry, i, ids_BT, positions_BT, inv_freq, key_valid_BT,
                kv_dtype):  # fmt: skip
    """The draft layer at TTT step i: (h_new [B, T, D], K and V buffers with slot i written).
    Its inputs are the true tokens `ids_BT` of step i and the previous step's output h."""
    h_BTD, k_JBTGK, v_JBTGK = carry
    lp = dparams["layer"]
    emb_BTD = embed_VD[ids_BT].astype(h_BTD.dtype)
    cos, sin = rope_cos_sin(positions_BT + i, inv_freq, dcfg.rope.attention_factor)
    q, k, v = project_qkv(lp, emb_BTD, h_BTD, cos, sin, dcfg)
    k_JBTGK = jax.lax.dynamic_update_index_in_dim(k_JBTGK, k.astype(kv_dtype), i, 0)
    v_JBTGK = jax.lax.dynamic_update_index_in_dim(v_JBTGK, v.astype(kv_dtype), i, 0)
    with jax.named_scope("ttt_attention"):
        o = ttt_attention(q, k_JBTGK, v_JBTGK, i, key_valid_BT)
    h_new = finish_layer(lp, h_BTD, o, dcfg).astype(h_BTD.dtype)
    return h_new, k_JBTGK, v_JBTGK


def _step_loss(dparams, h_new, dcfg, tch: Teacher, i, streak_BT, run_BT, opts: _LossOptions):
    """The losses and counts of TTT step i: (streak_BT, run_BT, {ploss, correct, ...})."""
    f32 = jnp.float32
    b, t = streak_BT.shape
    # the product in the parameters' dtype, so that its backward products stay there
    logits_BTC = head_logits(dparams, h_new, dcfg, out_dtype=None).astype(f32)
    logp = jax.nn.log_softmax(logits_BTC, axis=-1)
    pm_BT = at_step(tch.pm, i, t) * tch.start_ok
    lm_BT = at_step(tch.lm, i, t) * tch.start_ok
    tp_BTC = at_step(tch.tp, i, t)
    # Official: -sum(position_mask * target_p * logp, vocab).mean() over all B*T (here
    # B * mean_len, so that cutting a batch's padding leaves the loss unchanged).
    ploss = -jnp.sum(pm_BT[..., None] * tp_BTC * logp) / (b * opts.mean_len)
    top_BT = at_step(tch.top, i, t)
    hit = (jnp.argmax(logits_BTC, axis=-1) == top_BT).astype(f32)
    correct = jax.lax.stop_gradient(jnp.sum(hit * pm_BT))
    denom = jnp.sum(lm_BT)
    # the draft's inputs at step i are the true tokens, which a decoded chain only sees
    # while every earlier draft was right: so a chain from t accepts step i exactly when
    # steps 0..i all hit (the TTT attention is the decoding one; see the docstring)
    streak_BT = jax.lax.stop_gradient(streak_BT * hit * pm_BT)
    out = {
        "ploss": ploss,
        "correct": correct,
        "denom": denom,
        "chain_correct": jnp.sum(streak_BT),
        "pcount": jax.lax.stop_gradient(jnp.sum(pm_BT)),
    }
    if opts.per_position:  # validation only: the training step carries it unchanged
        ok_BT = (
            at_step(tch.in_draft, i, t).astype(f32) * at_step(tch.valid_next, i, t) * tch.start_ok
        )
        run_BT = jax.lax.stop_gradient(run_BT * hit * ok_BT)
        out["run"] = run_BT
    if opts.feature_loss:
        fm_BT = lm_BT * at_step(tch.has_next, i, t)
        diff = h_new.astype(f32) - at_step(tch.hidden, i, t)
        ad = jnp.abs(diff)
        sl1 = jnp.where(ad < 1.0, 0.5 * diff * diff, ad - 0.5)  # torch SmoothL1, beta 1
        out["vloss"] = jnp.sum(sl1.mean(-1) * fm_BT) / (jnp.sum(fm_BT) + VLOSS_EPS)
    if opts.speculator:
        normed = rms_norm(h_new, dparams["final_norm"], dcfg.rms_norm_eps)
        s_BTV = speculator_logits(dparams, normed).astype(f32)
        slogp = jax.nn.log_softmax(s_BTV, axis=-1)
        out["sloss"] = -jnp.sum(pm_BT[..., None] * tp_BTC * slogp) / (b * opts.mean_len)
        shit = (jnp.argmax(s_BTV, axis=-1) == top_BT).astype(f32)
        out["scorrect"] = jax.lax.stop_gradient(jnp.sum(shit * pm_BT))
    return streak_BT, run_BT, out


def _totals(per_step, steps: int, decay, positions: int, feature_loss_weight: float,
            speculator_loss_weight: float, opts: _LossOptions):  # fmt: skip
    """(loss, metrics) from the per-step outputs of the scan ([steps] each); `positions` is
    B * mean_len, what ploss is divided by."""
    f32 = jnp.float32
    weights = jnp.power(jnp.asarray(decay, f32), jnp.arange(steps, dtype=f32))
    step_loss = per_step["ploss"]
    if opts.feature_loss:
        step_loss = step_loss + feature_loss_weight * per_step["vloss"]
    if opts.speculator:
        step_loss = step_loss + speculator_loss_weight * per_step["sloss"]
    loss = jnp.sum(weights * step_loss)
    metrics = dict(per_step)
    if opts.per_position:  # a streak's length: the steps in a row, from step 0, its chain was alive
        metrics["streak"] = metrics.pop("run").sum(axis=0)
    metrics["acc"] = per_step["correct"] / (per_step["denom"] + ACC_EPS)
    # chain_i: of the chains that could start (positions supervised at step 0), the share whose
    # first i + 1 drafts all match the target; 1 + sum(chain[:d]) estimates a depth-d chain's tau
    metrics["chain"] = per_step["chain_correct"] / (per_step["denom"][0] + ACC_EPS)
    metrics["ploss"] = jax.lax.stop_gradient(per_step["ploss"])
    # cross-entropy per supervised position: ploss is scaled by B * mean_len so that padding
    # leaves it unchanged, hence it grows with a batch's supervised tokens; xent does not
    metrics["xent"] = metrics["ploss"] * positions / (per_step["pcount"] + ACC_EPS)
    if opts.feature_loss:
        metrics["vloss"] = jax.lax.stop_gradient(per_step["vloss"])
    if opts.speculator:
        metrics["sloss"] = jax.lax.stop_gradient(per_step["sloss"])
        metrics["sacc"] = per_step["scorrect"] / (per_step["denom"] + ACC_EPS)
    return loss, metrics
