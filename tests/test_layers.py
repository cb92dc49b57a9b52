"""models/layers.py, component by component: RMSNorm, RoPE (every kind), SwiGLU and masked GQA
attention against transformers' PyTorch modules; bf16 attention; the dense products' row policies.
The blocks assembled into a model: tests/test_target.py (target), tests/test_draft.py (head)."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama as hf_llama

from eagle3_jax.config import ProductPolicy, rope_inv_freq, target_config_from_hf
from eagle3_jax.models import layers


def _torch(x, dtype=torch.float32):
    return torch.from_numpy(np.array(jnp.asarray(x).astype(jnp.float32))).to(dtype)


# ---- parity with transformers' modules


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_matches_transformers(dtype):
    """LlamaRMSNorm: fp32 statistics, the input's dtype for the scaled result and the weight."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(3.0 * rng.standard_normal((2, 5, 64)), dtype)
    w = jnp.asarray(1.0 + 0.2 * rng.standard_normal(64), dtype)
    norm = hf_llama.LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(_torch(w))
        norm = norm.to(getattr(torch, dtype))
        want = norm(_torch(x, getattr(torch, dtype))).float().numpy()
    got = layers.rms_norm(x, w, 1e-5)
    assert got.dtype == x.dtype
    tol = 1e-6 if dtype == "float32" else 2.0**-7  # bf16: never more than one step apart
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=tol, atol=tol)


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_matches_transformers(kind):
    """LlamaRotaryEmbedding's cos/sin and apply_rotary_pos_emb, for each RoPE kind read from the
    same config (config.rope_inv_freq), at tree positions: repeated, out of order, and past the
    original context (where llama3 scaling bends the long wavelengths)."""
    hf = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters=ROPES[kind],
    )
    rope = target_config_from_hf(hf.to_dict()).rope
    assert rope.kind == kind
    pos = np.array([[0, 1, 2, 2, 3, 3, 3, 4], [90, 91, 91, 92, 300, 301, 7, 500]], np.int32)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 8, 4, 16)).astype(np.float32)  # [B, T, H, K]
    k = rng.standard_normal((2, 8, 2, 16)).astype(np.float32)
    with torch.no_grad():
        emb = hf_llama.LlamaRotaryEmbedding(hf)
        cos_t, sin_t = emb(torch.from_numpy(q), torch.from_numpy(pos).long())  # [B, T, K]
        q_t, k_t = hf_llama.apply_rotary_pos_emb(
            torch.from_numpy(q), torch.from_numpy(k), cos_t, sin_t, unsqueeze_dim=2
        )
    np.testing.assert_allclose(rope_inv_freq(rope, 16), emb.inv_freq.numpy(), rtol=1e-6)
    cos, sin = layers.rope_cos_sin(jnp.asarray(pos), rope_inv_freq(rope, 16))
    np.testing.assert_allclose(cos[:, :, 0], cos_t.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sin[:, :, 0], sin_t.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layers.apply_rope(q, cos, sin), q_t.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layers.apply_rope(k, cos, sin), k_t.numpy(), rtol=1e-5, atol=1e-5)


def test_swiglu_matches_transformers_mlp():
    """LlamaMLP: down(silu(gate x) * up x); our weights are stored in-by-out (PyTorch's
    transposed)."""
    hf = transformers.LlamaConfig(hidden_size=32, intermediate_size=48)
    mlp = hf_llama.LlamaMLP(hf).eval()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 32)).astype(np.float32)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(0.2 * torch.randn_like(p))
        want = mlp(torch.from_numpy(x)).numpy()
    w = {n: m.weight.detach().numpy().T for n, m in mlp.named_children() if hasattr(m, "weight")}
    got = layers.swiglu(x, w["gate_proj"], w["up_proj"], w["down_proj"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [1, 6, 70], ids=["one-query", "few", "past-exact-queries"])
def test_attention_matches_transformers_eager(t):
    """transformers' eager attention (repeat_kv GQA, an additive mask, fp32 softmax) over a cache
    of S slots, for one query (the decode step's multiply-and-sum), a few (a verification) and more
    than EXACT_QUERIES (prefill): the boolean mask is causal after a left-padded prefix."""
    b, h, g, k, s = 2, 4, 2, 16, 80
    rng = np.random.default_rng(3)
    q = rng.standard_normal((b, t, h, k)).astype(np.float32)
    keys = rng.standard_normal((b, s, g, k)).astype(np.float32)  # [B, S, G, K] as HF holds them
    values = rng.standard_normal((b, s, g, k)).astype(np.float32)
    start = np.array([s - t, s - t - 3])  # row 1 leaves its last 3 slots empty
    pad = np.array([0, 4])  # row 1's first 4 slots are padding
    slots, q_pos = np.arange(s), start[:, None] + np.arange(t)[None, :]
    mask = (slots[None, None] <= q_pos[:, :, None]) & (slots[None, None] >= pad[:, None, None])
    got = layers.attention(jnp.asarray(q), *layers.to_cache_layout(keys, values), jnp.asarray(mask))
    module = types.SimpleNamespace(num_key_value_groups=h // g, training=False)
    additive = torch.from_numpy(np.where(mask, 0.0, -1e30).astype(np.float32))[:, None]
    with torch.no_grad():
        want, _ = hf_llama.eager_attention_forward(
            module,
            torch.from_numpy(q).transpose(1, 2),
            torch.from_numpy(keys).transpose(1, 2),
            torch.from_numpy(values).transpose(1, 2),
            additive,
            scaling=1.0 / math.sqrt(k),
        )
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


# ---- bf16 attention and the dense products


@pytest.mark.parametrize("new_entries", [False, True], ids=["cache", "cache+new"])
def test_bf16_attention_one_query_and_many_compute_alike(new_entries):
    """With a bf16 cache, attention is the fp32 computation of its bf16 inputs rounded once, for
    one query (a decode step) and for several (a verification, with its new entries beside the
    cache or not). The one-query path used to keep the probabilities in fp32 while the
    several-query one rounded them to bf16, so ~40 % of the outputs differed by a bf16 step."""
    import ml_dtypes

    from eagle3_jax.models.layers import attention

    rng = np.random.default_rng(0)
    b, g, r, k, s, valid, t = 1, 3, 3, 64, 256, 200, 4
    bf16 = jnp.bfloat16
    keys = jnp.asarray(rng.standard_normal((b, g, k, s)), bf16)
    values = jnp.asarray(rng.standard_normal((b, g, s, k)), bf16)
    q = jnp.asarray(rng.standard_normal((b, t, g * r, k)), bf16)
    mask = jnp.broadcast_to(jnp.arange(s)[None, None] < valid, (b, t, s))
    extra = ()
    if new_entries:  # the verified tokens' own K/V, attended causally beside the cache
        k_new = jnp.asarray(rng.standard_normal((b, t, g, k)), bf16)
        v_new = jnp.asarray(rng.standard_normal((b, t, g, k)), bf16)
        extra = (k_new, v_new, jnp.tril(jnp.ones((t, t), bool))[None])
    got = np.asarray(jax.jit(attention)(q, keys, values, mask, *extra).astype(jnp.float32))

    def as64(x):
        return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)

    # the reference in fp64 from the same bf16 inputs, per query row: [B, T, G, R, K]
    qf = as64(q).reshape(b, t, g, r, k)
    kf, vf = as64(keys)[..., :valid], as64(values)[:, :, :valid]
    scores = np.einsum("btgrk,bgks->btgrs", qf, kf)
    vals = np.broadcast_to(vf[:, None], (b, t, g, valid, k))
    if new_entries:
        own = np.einsum("btgrk,bugk->btgru", qf, as64(k_new))
        own = np.where(np.tril(np.ones((t, t), bool))[None, :, None, None], own, -np.inf)
        scores = np.concatenate([scores, own], -1)
        vn = np.broadcast_to(as64(v_new).transpose(0, 2, 1, 3)[:, None], (b, t, g, t, k))
        vals = np.concatenate([vals, vn], -2)
    scores = scores / np.sqrt(k)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    want = np.einsum("btgrs,btgsk->btgrk", p, vals).reshape(got.shape)
    want = want.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    step = np.abs(want) * 2.0**-7  # one bf16 step at that magnitude (8 significant bits)
    off = got != want
    # never more than one step (or fp32's error on terms of size ~1, where a sum cancels)
    assert np.all(np.abs(got - want) <= step + 1e-6)
    # off by a step only where an fp32 sum and the fp64 one round to different sides
    assert off.mean() < 0.01, f"{off.mean():.1%} of the outputs off by a bf16 step"
    if not new_entries:  # each row alone (a decode step's one query) gives the same bits
        for i in range(t):
            one = jax.jit(attention)(q[:, i : i + 1], keys, values, mask[:, i : i + 1])
            np.testing.assert_array_equal(np.asarray(one.astype(jnp.float32))[:, 0], got[:, i])


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 4), (1, 9), (3, 5)])
@pytest.mark.parametrize("limit", [0, 8])
def test_row_products_equal_the_matrix_product(shape, limit):
    """dense gives the product's numbers either way; 2..policy.row_products rows go one
    vector-matrix product per row (a loop), one row and more rows one product."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((*shape, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((48, 40)), jnp.float32)
    fn = jax.jit(lambda x, w: layers.dense(x, w, policy=ProductPolicy(row_products=limit)))
    got = fn(x, w)
    assert got.shape == (*shape, 40)
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)
    rows = int(np.prod(shape))
    assert ("while" in fn.lower(x, w).as_text()) == (1 < rows <= limit)


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 4), (1, 9), (3, 5)])
@pytest.mark.parametrize("limit", [0, 8])
def test_output_layer_reduction_equals_the_product(shape, limit):
    """dense_t (x . w^T with w stored [N, K], the tied output layer) gives the product's numbers
    either way, bf16 weights scored in fp32 too; 2..policy.logit_reduce rows are a row reduction
    (no dot in the program), one row and more rows a dot."""
    policy = ProductPolicy(logit_reduce=limit)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((*shape, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 48)), jnp.float32)
    fn = jax.jit(lambda *a: layers.dense_t(*a, policy=policy))
    got = fn(x, w)
    assert got.shape == (*shape, 40)
    np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-5)
    rows = int(np.prod(shape))
    assert ("dot(" not in fn.lower(x, w).as_text("hlo")) == (1 < rows <= limit)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    got_b = jax.jit(lambda *a: layers.dense_t(*a, out_dtype=jnp.float32, policy=policy))(xb, wb)
    assert got_b.dtype == jnp.float32
    want_b = np.asarray(xb.astype(jnp.float32)) @ np.asarray(wb.astype(jnp.float32)).T
    np.testing.assert_allclose(got_b, want_b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_output_layer_reduction_has_the_products_gradient(dtype):
    """Differentiated (a head that reads the target's output layer trains through it, a few rows
    in tiny batches), the reduction gives the product's gradients in the inputs' dtypes, computed
    as products (no [rows, N, K] temporaries in the backward program)."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 3, 48)), dtype)
    w = jnp.asarray(rng.standard_normal((40, 48)), dtype)
    g = jnp.asarray(rng.standard_normal((2, 3, 40)), jnp.float32)

    def loss(x, w, out_dtype, policy):
        return jnp.sum(layers.dense_t(x, w, out_dtype, policy=policy).astype(jnp.float32) * g)

    grads = {}
    for limit in (0, 8):
        policy = ProductPolicy(logit_reduce=limit)
        for out_dtype in (None, jnp.float32):
            fn = jax.jit(jax.grad(lambda x, w: loss(x, w, out_dtype, policy), argnums=(0, 1)))
            grads[limit, out_dtype] = fn(x, w)
            assert [t.dtype for t in grads[limit, out_dtype]] == [dtype, dtype]
            if limit:
                text = fn.lower(x, w).as_text("hlo")
                assert "f32[6,40,48]" not in text and "bf16[6,40,48]" not in text
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for out_dtype in (None, jnp.float32):
        for a, b in zip(grads[8, out_dtype], grads[0, out_dtype]):
            np.testing.assert_allclose(
                np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol
            )
