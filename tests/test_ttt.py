"""Training-time-test loss: the diagonal attention equals SpecForge's dense (i+1)*T mask, the scan
equals a per-step Python loop over `draft.forward` with dense masks, steps=1 is plain training,
gradients flow, and no (steps*T)-sized array is ever built."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax import vocab as vocab_lib
from eagle3_jax.config import rope_inv_freq
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as dr
from eagle3_jax.models import draft_output
from eagle3_jax.models.layers import apply_rope, attention, rope_cos_sin, to_cache_layout
from eagle3_jax.models.target import ParamSpec
from eagle3_jax.training import ttt

# Tiny sizes chosen so that steps*T = 60 and T + steps = 17 match no other dimension.
B, T, STEPS = 3, 12, 5
V, VD, D, HT, F, NH, NKV, HD = 97, 40, 32, 24, 48, 4, 2, 8
CFG = dr.DraftConfig(
    hidden_size=D,
    intermediate_size=F,
    num_heads=NH,
    num_kv_heads=NKV,
    head_dim=HD,
    vocab_size=V,
    draft_vocab_size=VD,
    aux_layer_ids=(2, 4, 5),
    target_hidden_size=HT,
)
TOL = dict(rtol=1e-5, atol=1e-5)


def _numpy_params(cfg, rng, norm_noise):
    """Params built in numpy from the ParamSpecs (fast): norms 1 + noise, matrices at scale 0.15."""
    return jax.tree.map(
        lambda spec: jnp.asarray(
            (1.0 + norm_noise * rng.normal(size=spec.shape))
            if spec.init == "ones"
            else 0.15 * rng.normal(size=spec.shape),
            jnp.float32,
        ),
        dr.param_specs(cfg),
        is_leaf=lambda x: isinstance(x, ParamSpec),
    )


@functools.cache
def _setup():
    """Params with non-trivial norms, a 40-of-97 vocab containing id 0, and a padded batch.

    Row 0: no padding, loss_mask 1 on the last position (its teacher would be the zero fill).
    Row 1: right padding (3 pads). Row 2: left padding (2 pads: fully masked step-0 rows).
    """
    rng = np.random.default_rng(0)
    params = _numpy_params(CFG, rng, norm_noise=0.3)
    dr.check_params(params, CFG)
    embed = jnp.asarray(rng.normal(size=(V, D)).astype(np.float32))
    counts = rng.integers(0, 50, V)
    counts[0] = 1000
    voc = vocab_lib.build_from_counts(counts, VD)
    assert voc.t2d[0] and voc.t2d.sum() == VD

    attn = np.ones((B, T), np.float32)
    attn[1, -3:] = 0
    attn[2, :2] = 0
    loss = (rng.random((B, T)) < 0.7).astype(np.float32) * attn
    loss[0, -1] = 1.0
    logits = rng.normal(size=(B, T, V)).astype(np.float32) * 3.0
    # Half the positions get a draft-vocab argmax, the rest keep a (likely) out-of-vocab one.
    ids_in = vocab_lib.target_ids(voc)
    boost = rng.random((B, T)) < 0.5
    logits[boost, ids_in[rng.integers(0, VD, boost.sum())]] += 20.0
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    aux = rng.normal(size=(B, T, 3 * HT)).astype(np.float32)
    # Where the target agrees with the draft's own step-0 guess, acc is nonzero (not vacuous).
    step0 = dr.forward(
        params,
        embed,
        jnp.asarray(_shift(ids)),
        aux,
        jnp.broadcast_to(jnp.arange(T), (B, T)),
        jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T)),
        CFG,
    )
    guess = ids_in[np.asarray(step0.logits).argmax(-1)]  # [B, T] target ids
    agree = rng.random((B, T)) < 0.4
    for b_, t_ in zip(*np.nonzero(agree[:, :-1])):
        logits[b_, t_ + 1, guess[b_, t_]] += 40.0
    batch = {
        "input_ids": jnp.asarray(ids),
        "aux": jnp.asarray(aux),
        "target_logits": jnp.asarray(logits),
        "loss_mask": jnp.asarray(loss),
        "attention_mask": jnp.asarray(attn),
        "target_hidden": jnp.asarray(rng.normal(size=(B, T, D)).astype(np.float32)),
    }
    return params, embed, voc, batch


def _dense_mask(valid_BT: np.ndarray, i: int) -> np.ndarray:
    """SpecForge's mask over the concatenated keys [K_0 .. K_i] ((i+1)*T of them): causal within
    the first T (padding keys masked), OR kv >= T and (kv - q) % T == 0."""
    q = np.arange(T)[:, None]
    kv = np.arange((i + 1) * T)[None, :]
    first = (kv < T) & (kv <= q)
    diag = (kv >= T) & ((kv - q) % T == 0)
    key_ok = np.concatenate([valid_BT, np.ones((B, i * T), bool)], axis=1)
    return (first[None] & key_ok[:, None, :]) | diag[None]


def _shift(x: np.ndarray, n: int = 1) -> np.ndarray:
    out = np.zeros_like(x)
    out[:, : x.shape[1] - n] = x[:, n:]
    return out


STATIC = ("dcfg", "steps", "feature_loss_weight", "remat")
ttt_loss = jax.jit(ttt.ttt_loss, static_argnames=STATIC)
# Batch, embedding and vocab are arguments, never constants (baked-in arrays crawl to compile).
ttt_grad = jax.jit(jax.grad(ttt.ttt_loss, has_aux=True), static_argnames=STATIC)


def test_diagonal_attention_equals_dense_specforge_mask():
    rng = np.random.default_rng(3)
    _, _, _, batch = _setup()
    valid = np.asarray(batch["attention_mask"]).astype(bool)
    inv = rope_inv_freq(CFG.rope, HD)
    rot = jax.jit(lambda x, p: apply_rope(x, *rope_cos_sin(p, inv)))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    # Keys/values of every step, K_j rotated at t + j; slots beyond the current step hold garbage.
    ks = [
        rot(jnp.asarray(rng.normal(size=(B, T, NKV, HD)), jnp.float32), pos + j)
        for j in range(STEPS)
    ]
    vs = [jnp.asarray(rng.normal(size=(B, T, NKV, HD)), jnp.float32) for _ in range(STEPS)]
    diag_attn, dense_attn = jax.jit(ttt.ttt_attention), jax.jit(attention)
    for i in range(STEPS):
        q = rot(jnp.asarray(rng.normal(size=(B, T, NH, HD)), jnp.float32), pos + i)
        junk = jnp.asarray(50 * rng.normal(size=(B, T, NKV, HD)), jnp.float32)
        garbage = [junk] * (STEPS - 1 - i)
        kbuf, vbuf = jnp.stack(ks[: i + 1] + garbage), jnp.stack(vs[: i + 1] + garbage)
        got = np.asarray(diag_attn(q, kbuf, vbuf, jnp.int32(i), jnp.asarray(valid)))
        mask = _dense_mask(valid, i)
        want = np.asarray(
            dense_attn(
                q,
                *to_cache_layout(jnp.concatenate(ks[: i + 1], 1), jnp.concatenate(vs[: i + 1], 1)),
                jnp.asarray(mask),
            )
        )
        # Rows with no allowed key at all (left padding at step 0) are meaningless in both.
        rows = mask.any(-1)
        assert (~rows).sum() == (2 if i == 0 else 0)
        np.testing.assert_allclose(got[rows], want[rows], **TOL)


def _reference(params, embed, batch, t2d, steps, decay, fw):
    """Per-step Python loop over `draft.forward` with a dense [B, T, steps*T] mask over a cache
    holding every step's keys, and the official shifts/loss/acc written out in numpy."""
    ids = _shift(np.asarray(batch["input_ids"]))
    tgt = _shift(np.asarray(batch["target_logits"], np.float64))
    lm = np.asarray(batch["loss_mask"], np.float64)
    th = _shift(np.asarray(batch["target_hidden"], np.float64))
    has_next = _shift(np.ones((B, T)))
    valid = np.asarray(batch["attention_mask"]).astype(bool)
    nxt = _shift(valid.astype(np.float64))  # the teacher row t+i+1 is a real token
    t2d = np.asarray(t2d)
    s = steps * T
    cache = dr.make_cache(CFG, B, s)
    feat = batch["aux"]
    pos = np.broadcast_to(np.arange(T), (B, T))
    total, plosses, accs, vlosses, xents, chains = 0.0, [], [], [], [], []
    alive = np.ones((B, T))  # chains from t whose drafts so far all matched the target
    denom0 = None
    for i in range(steps):
        mask = np.zeros((B, T, s), bool)
        mask[:, :, : (i + 1) * T] = _dense_mask(valid, i)
        out = dr.forward(
            params,
            embed,
            jnp.asarray(ids),
            feat,
            jnp.asarray(pos + i),
            jnp.asarray(mask),
            CFG,
            cache,
            jnp.full((B,), i * T, jnp.int32),
        )
        feat, cache = out.hidden, out.cache
        logits = np.asarray(out.logits, np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        sub = tgt[..., t2d]
        tp = np.exp(sub - sub.max(-1, keepdims=True))
        tp = tp / tp.sum(-1, keepdims=True)
        # Chains starting at padding (row 2's left pads) and positions whose teacher lies past the
        # row's end are not supervised (the official code has neither factor).
        pm = lm * valid * nxt * t2d[tgt.argmax(-1)]
        ploss = -(pm[..., None] * tp * logp).sum(-1).mean()
        acc = ((logits.argmax(-1) == tp.argmax(-1)) * pm).sum() / ((lm * valid * nxt).sum() + 1e-6)
        alive = alive * (logits.argmax(-1) == tp.argmax(-1)) * pm
        denom0 = (lm * valid * nxt).sum() if denom0 is None else denom0
        chains.append(alive.sum() / (denom0 + 1e-6))
        fm = lm * valid * nxt * has_next
        d = np.asarray(out.hidden, np.float64) - th
        sl1 = np.where(np.abs(d) < 1, 0.5 * d * d, np.abs(d) - 0.5)
        vloss = (sl1.mean(-1) * fm).sum() / (fm.sum() + 1e-5)
        total += decay**i * (ploss + fw * vloss)
        plosses.append(ploss)
        xents.append(-(pm[..., None] * tp * logp).sum() / pm.sum())
        accs.append(acc)
        vlosses.append(vloss)
        ids, tgt, lm, th, has_next, nxt = (_shift(x) for x in (ids, tgt, lm, th, has_next, nxt))
    return (
        total,
        np.array(plosses),
        np.array(accs),
        np.array(vlosses),
        np.array(xents),
        np.array(chains),
    )


def test_loss_and_metrics_equal_dense_per_step_reference():
    params, embed, voc, batch = _setup()
    loss, m = ttt_loss(
        params, embed, batch, CFG, voc.t2d, steps=STEPS, decay=0.8, feature_loss_weight=0.5
    )
    want, pl, acc, vl, xent, chain = _reference(params, embed, batch, voc.t2d, STEPS, 0.8, 0.5)
    np.testing.assert_allclose(m["ploss"], pl, **TOL)
    # chain_i: positions whose drafts 0..i all matched, over those supervised at step 0
    np.testing.assert_allclose(m["chain"], chain, **TOL)
    np.testing.assert_allclose(m["chain"][0], m["acc"][0], **TOL)
    assert np.all(np.diff(np.asarray(m["chain"])) <= 0) and float(m["chain"][0]) > 0
    np.testing.assert_allclose(m["xent"], xent, **TOL)  # per supervised position
    np.testing.assert_allclose(m["vloss"], vl, **TOL)
    np.testing.assert_allclose(m["acc"], acc, **TOL)
    np.testing.assert_allclose(loss, want, **TOL)
    assert loss.dtype == jnp.float32 and m["acc"].shape == (STEPS,)
    # The metrics are not vacuous: some positions are right, some supervised ones are not.
    assert 0 < float(m["correct"].sum()) < float(m["denom"].sum())
    lm, valid = np.asarray(batch["loss_mask"]), np.asarray(batch["attention_mask"])
    nxt = [_shift(valid.astype(float), i + 1) for i in range(STEPS)]
    want_denom = [(_shift(lm, i) * valid * nxt[i]).sum() for i in range(STEPS)]
    np.testing.assert_allclose(m["denom"], want_denom)


def test_extra_right_padding_leaves_loss_and_metrics_unchanged():
    """A batch cut to its longest row (length buckets) trains exactly as one padded further."""
    params, embed, voc, batch = _setup()
    k, rng = 5, np.random.default_rng(1)

    def pad(name, x):
        x = np.asarray(x)
        fill = rng.normal(size=(B, k, *x.shape[2:])) * 3  # garbage the loss must never read
        if name in ("input_ids",):
            fill = rng.integers(0, V, (B, k))
        if name in ("loss_mask", "attention_mask"):
            fill = np.zeros((B, k))
        return jnp.asarray(np.concatenate([x, fill.astype(x.dtype)], axis=1))

    padded = {n: pad(n, x) for n, x in batch.items()}
    kw = dict(steps=STEPS, decay=0.8, feature_loss_weight=0.5)
    loss, m = ttt.ttt_loss(params, embed, batch, CFG, voc.t2d, mean_len=T + k, **kw)
    loss_p, m_p = ttt.ttt_loss(params, embed, padded, CFG, voc.t2d, **kw)
    np.testing.assert_allclose(loss_p, loss, **TOL)
    for name in ("ploss", "acc", "vloss", "denom", "correct", "chain"):
        np.testing.assert_allclose(m_p[name], m[name], **TOL)


@functools.cache
def _grads(remat: bool):
    """(grads, metrics) of the 5-step loss, shared by the tests below (one compile each)."""
    params, embed, voc, batch = _setup()
    return ttt_grad(params, embed, batch, CFG, voc.t2d, steps=STEPS, remat=remat)


def test_one_step_is_plain_training_and_gradients_flow():
    params, embed, voc, batch = _setup()
    loss1, m1 = ttt_loss(params, embed, batch, CFG, voc.t2d, steps=1)
    g, m5 = _grads(False)
    want1, *_ = _reference(params, embed, batch, voc.t2d, 1, 0.8, 0.0)
    np.testing.assert_allclose(loss1, want1, **TOL)
    np.testing.assert_allclose(loss1, m5["ploss"][0], **TOL)
    np.testing.assert_allclose(m1["acc"][0], m5["acc"][0], **TOL)
    assert m1["ploss"].shape == (1,)

    # fc, every layer weight, final_norm and lm_head get finite, nonzero gradients through the scan.
    for path, leaf in jax.tree_util.tree_leaves_with_path(g):
        assert np.isfinite(np.asarray(leaf)).all(), jax.tree_util.keystr(path)
        assert np.abs(np.asarray(leaf)).max() > 0, jax.tree_util.keystr(path)
    # Recomputing each step in the backward pass changes nothing.
    g_remat, _ = _grads(True)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g, g_remat)


def test_bf16_params_give_fp32_loss_close_to_fp32():
    params, embed, voc, batch = _setup()
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    loss16, m16 = ttt_loss(p16, embed.astype(jnp.bfloat16), batch, CFG, voc.t2d, steps=STEPS)
    assert loss16.dtype == jnp.float32 and np.isfinite(np.asarray(m16["ploss"])).all()
    np.testing.assert_allclose(m16["ploss"], _grads(False)[1]["ploss"], rtol=5e-2)


def _all_shapes(jaxpr) -> list[tuple[int, ...]]:
    """Every intermediate shape in a jaxpr, sub-jaxprs (scan bodies, remat, pjit) included."""
    shapes = []

    def visit(jp):
        jp = getattr(jp, "jaxpr", jp)  # ClosedJaxpr -> Jaxpr
        for eqn in jp.eqns:
            shapes.extend(tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
            for p in eqn.params.values():
                for sub in p if isinstance(p, (list, tuple)) else (p,):
                    if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        visit(sub)

    visit(jaxpr)
    return shapes


def test_no_steps_times_t_array_forward_or_backward():
    params, embed, voc, batch = _setup()

    def f(p):
        return ttt.ttt_loss(p, embed, batch, CFG, voc.t2d, steps=STEPS, feature_loss_weight=0.5)

    shapes = _all_shapes(jax.make_jaxpr(jax.value_and_grad(f, has_aux=True))(params))
    assert len(shapes) > 100 and any(T in s for s in shapes)
    assert not [s for s in shapes if STEPS * T in s], "a (steps*T)-sized array was built"
    # The detector does see the dense formulation's keys and mask.
    dense = _all_shapes(jax.make_jaxpr(lambda p: _reference_dense_attention(p))(params))
    assert any(STEPS * T in s for s in dense)

    # Compiled memory (where the backend reports it), at a T where the [T, T] scores dominate:
    # 4x the steps must cost about 4x the temporaries (linear), far below the ~12x of a dense
    # (i+1)*T-key formulation (sum of i+1 over 8 steps / over 2 steps).
    big = {k: jnp.concatenate([v] * 16, axis=1) for k, v in batch.items()}  # T = 192

    def temp_bytes(steps):
        lowered = ttt_grad.lower(params, embed, big, CFG, voc.t2d, steps=steps)
        ma = lowered.compile().memory_analysis()
        return None if ma is None else ma.temp_size_in_bytes

    t2, t8 = temp_bytes(2), temp_bytes(8)
    if t2 is None:
        pytest.skip("memory_analysis unavailable on this backend")
    assert t8 < 5 * t2, (t2, t8)


def _reference_dense_attention(params):
    """The last TTT step the SpecForge way (for the shape detector): steps*T keys, dense mask."""
    q = jnp.zeros((B, T, NH, HD))
    k = jnp.zeros((B, STEPS * T, NKV, HD)) + params["fc"][0, 0]
    return attention(q, *to_cache_layout(k, k), jnp.ones((B, T, STEPS * T), bool))


def test_refuses_bad_batches():
    params, embed, voc, batch = _setup()
    with pytest.raises(Eagle3Error, match="target_logits"):
        ttt.ttt_loss(
            params, embed, {**batch, "target_logits": batch["target_logits"][..., :5]}, CFG, voc.t2d
        )
    with pytest.raises(Eagle3Error, match="steps"):
        ttt.ttt_loss(params, embed, batch, CFG, voc.t2d, steps=0)
    with pytest.raises(Eagle3Error, match="target_hidden"):
        ttt.ttt_loss(
            params,
            embed,
            {k: v for k, v in batch.items() if k != "target_hidden"},
            CFG,
            voc.t2d,
            feature_loss_weight=1.0,
        )


def test_specvocab_auxiliary_loss_is_the_speculator_soft_cross_entropy():
    """A full-vocabulary head on the target's output embedding with a speculator: the loss adds
    w * sum_i decay^i * sloss_i, sloss_i the soft CE of softmax((hA)B) against the target, masked
    and averaged like ploss; its gradient trains the speculator."""
    _, embed, _, batch = _setup()
    cfg = dataclasses.replace(CFG, draft_vocab_size=V, lm_head_source="target", speculator_rank=4)
    params = _numpy_params(cfg, np.random.default_rng(3), norm_noise=0.2)
    params = {**params, "out_embed": embed}  # a tied target: its embedding is the output layer
    t2d = vocab_lib.identity(V).t2d
    kw = dict(steps=3, decay=0.8)
    base, m0 = ttt.ttt_loss(params, embed, batch, cfg, t2d, **kw)
    total, m = ttt.ttt_loss(params, embed, batch, cfg, t2d, speculator_loss_weight=0.1, **kw)
    np.testing.assert_allclose(m["ploss"], m0["ploss"], rtol=1e-6)
    want = float(base) + 0.1 * float(np.sum(0.8 ** np.arange(3) * np.asarray(m["sloss"])))
    np.testing.assert_allclose(total, want, rtol=1e-5)
    # step 0 by hand: the speculator reads the step-0 hidden state
    ids = np.asarray(batch["input_ids"])
    h0 = dr.forward(
        params,
        embed,
        jnp.asarray(_shift(ids)),
        batch["aux"],
        jnp.broadcast_to(jnp.arange(T), (B, T)),
        jnp.asarray(_dense_mask(np.asarray(batch["attention_mask"]).astype(bool), 0)),
        cfg,
        compute_logits=False,
    ).hidden
    from eagle3_jax.models.layers import rms_norm

    s = np.asarray(
        draft_output.speculator_logits(
            params, rms_norm(h0, params["final_norm"], cfg.rms_norm_eps)
        ),
        np.float64,
    )
    logp = s - s.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    tgt = _shift(np.asarray(batch["target_logits"], np.float64))
    tp = np.exp(tgt - tgt.max(-1, keepdims=True))
    tp /= tp.sum(-1, keepdims=True)
    valid = np.asarray(batch["attention_mask"])
    pm = np.asarray(batch["loss_mask"]) * valid * _shift(valid.astype(float))
    want0 = -(pm[..., None] * tp * logp).sum() / (B * T)
    np.testing.assert_allclose(m["sloss"][0], want0, rtol=1e-4)
    assert 0 <= float(m["sacc"][0]) <= 1
    grads, _ = jax.grad(ttt.ttt_loss, has_aux=True)(
        params, embed, batch, cfg, t2d, speculator_loss_weight=0.1, **kw
    )
    assert float(jnp.abs(grads["spec_b"]).sum()) > 0 and float(jnp.abs(grads["spec_a"]).sum()) > 0
    plain_params, _, voc, _ = _setup()
    with pytest.raises(Eagle3Error, match="SpecVocab head"):
        ttt.ttt_loss(plain_params, embed, batch, CFG, voc.t2d, speculator_loss_weight=0.1, **kw)
