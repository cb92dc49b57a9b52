"""Building blocks shared by the target and the draft: RMSNorm, RoPE, masked GQA attention, SwiGLU.

Each mirrors the transformers PyTorch computation order (fp32 statistics, cast back to the compute
dtype) so that parity tests hold at 1e-4 or tighter.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30  # finite: a fully masked row (padding) yields a uniform, not NaN, softmax


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis; statistics in fp32, result in x.dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_cos_sin(positions_BT: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [B, T, 1, K] for rotate-half RoPE at arbitrary (tree) positions."""
    freqs = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BTHK: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x_BTHK.shape[-1] // 2
    rotated = jnp.concatenate([-x_BTHK[..., half:], x_BTHK[..., :half]], axis=-1)
    return (x_BTHK * cos.astype(x_BTHK.dtype) + rotated * sin.astype(x_BTHK.dtype)).astype(
        x_BTHK.dtype
    )


def attention(
    q_BTHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, mask_BTS: jax.Array
) -> jax.Array:
    """Grouped-query attention of T queries over S keys under an explicit boolean mask.

    The mask is the only notion of causality: causal prefill, one decode step, a draft tree (each node
    sees the prefix and its ancestors) and the training-time-test blocks all go through here.
    Returns [B, T, H, K]; softmax in fp32.
    """
    b, t, h, k = q_BTHK.shape
    g = k_BSGK.shape[2]
    q = q_BTHK.reshape(b, t, g, h // g, k)
    scores = jnp.einsum("btgrk,bsgk->bgrts", q, k_BSGK, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / np.sqrt(k))
    scores = jnp.where(mask_BTS[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSGK.dtype)
    out = jnp.einsum("bgrts,bsgk->btgrk", probs, v_BSGK)
    return out.reshape(b, t, h, k)


# XLA:CPU computes a product of a few rows with its GEMM, which handles them poorly: a few rows cost
# far more than one though the weights are read once either way. One vector-matrix product per row
# (a lax.map, so one compiled body whatever the count) does better for 2-8 rows: the whole SmolLM2
# forward over 4 tokens costs 1.52x one token instead of 1.73x on the 2-core VM (3 tokens: 1.58x vs
# 1.79x; 2, 6 and 8 tokens about the same; `benchmarks/verify_cost.py --row-products 8,0`). One
# row goes as a vector too (the same speed). Other backends, and more rows (prefill, trees of 9+
# nodes, training), keep the plain product. That was measured on an AMD EPYC VM; on an Intel Xeon
# VM with AVX-512 the plain product is the faster one (4 tokens: 1.31x one token against 1.84x with
# row products; benchmarks/results/verify_cost_xeon.json), so EAGLE3_JAX_ROW_PRODUCTS sets the
# limit (0: plain products always), read once at import.
ROW_PRODUCTS_MAX = int(os.environ.get("EAGLE3_JAX_ROW_PRODUCTS", "8"))


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x[..., K] @ w[K, N], as one vector-matrix product per row for a few rows on the CPU."""
    rows = int(np.prod(x.shape[:-1]))
    if rows > ROW_PRODUCTS_MAX or jax.default_backend() != "cpu":
        return x @ w
    flat = x.reshape(rows, x.shape[-1])
    out = (flat[0] @ w)[None] if rows == 1 else jax.lax.map(lambda r: r @ w, flat)
    return out.reshape(*x.shape[:-1], w.shape[-1])


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    return dense(jax.nn.silu(dense(x, w_gate)) * dense(x, w_up), w_down)


def causal_mask(cursor_B: jax.Array, t: int, s: int, window: int | None = None) -> jax.Array:
    """[B, T, S] mask for T new tokens written at slots cursor..cursor+T-1 of an S-slot cache."""
    q_pos = cursor_B[:, None] + jnp.arange(t)[None, :]  # [B, T]
    slots = jnp.arange(s)[None, None, :]
    mask = slots <= q_pos[:, :, None]
    if window is not None:
        mask = mask & (slots > q_pos[:, :, None] - window)
    return mask
