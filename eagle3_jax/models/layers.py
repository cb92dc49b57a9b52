"""Building blocks shared by the target and the draft: RMSNorm, RoPE, masked GQA attention (with
gpt-oss's attention sinks), the gated MLP (SwiGLU, Gemma's GeGLU).

Each mirrors the transformers PyTorch computation order (fp32 statistics, cast back to the compute
dtype) so that parity tests hold at 1e-4 or tighter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.config import PLAIN_PRODUCTS, ProductPolicy

NEG_INF = -1e30  # finite: a fully masked row (padding) yields a uniform, not NaN, softmax


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, unit_offset: bool = False) -> jax.Array:
    """RMSNorm over the last axis; statistics in fp32, result in x.dtype. `unit_offset` (Gemma):
    x * (1 + w), the product in fp32 before the rounding (Llama rounds, then multiplies by w)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def rope_cos_sin(
    positions_BT: jax.Array, inv_freq: np.ndarray, scale: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [B, T, 1, K] for rotate-half RoPE at arbitrary (tree) positions, times
    `scale` where it is not 1 (YaRN's attention factor, `RopeConfig.attention_factor`: both q and
    k are rotated with the scaled tables, as transformers does)."""
    freqs = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    if scale == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * np.float32(scale), jnp.sin(emb) * np.float32(scale)


def apply_rope(x_BTHK: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x_BTHK.shape[-1] // 2
    rotated = jnp.concatenate([-x_BTHK[..., half:], x_BTHK[..., :half]], axis=-1)
    return (x_BTHK * cos.astype(x_BTHK.dtype) + rotated * sin.astype(x_BTHK.dtype)).astype(
        x_BTHK.dtype
    )


# KV cache layout, per layer: K as [B, G, K, S] and V as [B, G, S, K] (G kv heads, K head dim,
# S slots). The scores q.K and the output p.V are then plain batched matrix products over (B, G)
# with the slots where each product wants them, so XLA reads the cache as it lies: the old
# [B, S, G, K] layout made XLA transpose every layer's K and V on every forward. On a 2-core Intel
# Xeon, 30 layers of cached attention at 512 slots: 6.2 -> 2.0 ms for one query, 8.9 -> 2.6 ms for
# four (`benchmarks/attention_layout.py`). The flash-decoding kernel (`pallas_attention`, GPUs)
# reads K as V lies, [B, G, S, K]: caches made for it are "slot-major" (`slot_major_keys`).

ATTENTION_KINDS = ("exact", "mixed", "pallas")


def slot_major_keys(attention: str) -> bool:
    """Whether a target whose attention is `attention` (`TargetConfig.attention`) keeps K as
    [B, G, S, K] (the flash-decoding kernel's) rather than [B, G, K, S]."""
    return attention == "pallas"


def kv_shapes(
    batch: int, slots: int, groups: int, head_dim: int, slot_major: bool = False
) -> tuple[tuple, tuple]:
    """The shapes of one layer's K [B, G, K, S] (slot_major: [B, G, S, K]) and V [B, G, S, K]."""
    v = (batch, groups, slots, head_dim)
    return (v if slot_major else (batch, groups, head_dim, slots)), v


def to_cache_layout(
    k_BTGK: jax.Array, v_BTGK: jax.Array, slot_major: bool = False
) -> tuple[jax.Array, jax.Array]:
    """New keys/values [B, T, G, K] -> K [B, G, K, T] (slot_major: [B, G, T, K]), V [B, G, T, K]
    (the cache layout)."""
    v = v_BTGK.transpose(0, 2, 1, 3)
    return (k_BTGK.transpose(0, 2, 1, 3) if slot_major else k_BTGK.transpose(0, 2, 3, 1)), v


# The most queries per attention call computed for exactness (fp32 probabilities in p.V): decode
# steps and tree verifications (EAGLE-3's reporting tree verifies 60 tokens); prefills and training
# features above it use a p.V product in the cache's dtype at the default precision.
EXACT_QUERIES = 64


def attention(
    q_BTHK: jax.Array,
    k_BGKS: jax.Array,
    v_BGSK: jax.Array,
    mask_BTS: jax.Array,
    k_new: jax.Array | None = None,
    v_new: jax.Array | None = None,
    mask_new_BTT: jax.Array | None = None,
    kind: str = "exact",
    one_range: bool = True,
    scale: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query attention of T queries over S keys under an explicit boolean mask.

    Keys and values come in the cache layout (K [B, G, K, S], V [B, G, S, K]). The mask is the only
    notion of causality: causal prefill, one decode step, a draft tree (each node sees the prefix
    and its ancestors) and the training-time-test blocks all go through here. With k_new/v_new
    [B, T, G, K] the queries also attend to those T entries (under mask_new) in one softmax with the
    S cached ones, which are only read: a tree verification that leaves the cache untouched (no copy
    of it, even inside a lax.switch branch). Returns [B, T, H, K]; softmax in fp32.

    `kind` (`ATTENTION_KINDS`): "exact" as below; "mixed", products in the cache's dtype with fp32
    accumulation (`mixed_attention`); "pallas", K slot-major ([B, G, S, K]) and a decode step or a
    verification through the flash-decoding kernel (`pallas_attention`) where `one_range` (the
    caller's promise that every query's cached slots are the first query's, one contiguous range:
    no sliding window across a tree), else the mixed path. `scale`: the scores' scale (default
    1 / sqrt(K); Gemma 3's 1 / sqrt(query_pre_attn_scalar)). `sinks` [H] (gpt-oss): a learned
    logit per query head that joins the softmax's denominator once and contributes no value, as
    transformers' eager_attention_forward appends it as one more column and drops it.
    """
    if kind == "pallas" and one_range and (q_BTHK.shape[1] == 1 or k_new is not None):
        return pallas_attention(
            q_BTHK, k_BGKS, v_BGSK, mask_BTS, k_new, v_new, mask_new_BTT, scale=scale, sinks=sinks
        )
    if kind in ("mixed", "pallas"):
        return mixed_attention(
            q_BTHK, k_BGKS, v_BGSK, mask_BTS, k_new, v_new, mask_new_BTT, kind == "pallas", scale,
            sinks,
        )  # fmt: skip
    b, t, h, k = q_BTHK.shape
    g = k_BGKS.shape[1]
    r = h // g
    s = k_BGKS.shape[-1]
    scale = 1.0 / np.sqrt(k) if scale is None else scale
    f32, dt = jnp.float32, v_BGSK.dtype
    # A decode step (one query) and a verification (up to EXACT_QUERIES) compute the same products
    # and differ only in the order of fp32 sums, so that a verification's logits equal a decode
    # step's as nearly as the dtype allows (greedy speculative decoding = plain decoding): the
    # probabilities stay fp32 for p.V (every rounding of a value two paths sum in different orders
    # can turn a last-bit difference into a bf16 step: rounding them to bf16 in both paths made
    # bf16 greedy answers part sooner, BENCHMARKS.md "Exactness in bfloat16"), every sum is fp32
    # with one rounding at the end, and fp32 operands run at full precision (a GPU's default
    # would round them to TF32 in the matrix products but not in the one-query multiply-and-sum).
    # Longer calls (prefill, training features) are compared with nothing: there p.V is a product
    # in the cache's dtype (bf16 as flash attention does) at the backend's default precision.
    exact = t <= EXACT_QUERIES
    pv_dtype = f32 if exact else dt
    pv_hi = jax.lax.Precision.HIGHEST if exact else None  # pv_dtype is fp32 there
    qk_hi = pv_hi if jnp.result_type(q_BTHK, k_BGKS) == f32 else None
    # queries as [B, G, R*T, K]: one (R*T x K) @ (K x S) product per kv head
    q = q_BTHK.reshape(b, t, g, r, k).transpose(0, 2, 3, 1, 4).reshape(b, g, r * t, k)
    if t == 1:
        # one query: a multiply-and-sum XLA fuses into one loop, where a product routine of 3-row
        # matrices costs twice as much on the CPU
        scores = jnp.sum(q[..., None].astype(f32) * k_BGKS[:, :, None].astype(f32), axis=-2)
    else:
        scores = jnp.einsum(
            "bgmk,bgks->bgms", q, k_BGKS, preferred_element_type=f32, precision=qk_hi
        )
    scores = scores.reshape(b, g, r, t, s)
    scores = jnp.where(mask_BTS[:, None, None, :, :], scores * scale, NEG_INF)
    if k_new is not None:  # rounded to the cache's dtype, as a decode step writes it
        own = jnp.einsum(
            "bgrtk,bugk->bgrtu",
            q.reshape(b, g, r, t, k),
            k_new.astype(k_BGKS.dtype),
            preferred_element_type=f32,
            precision=qk_hi,
        )
        own = jnp.where(mask_new_BTT[:, None, None, :, :], own * scale, NEG_INF)
        scores = jnp.concatenate([scores, own], axis=-1)
    if sinks is not None:  # one more column in the softmax, dropped after it
        sink = jnp.broadcast_to(_head_sinks(sinks, g, r), (*scores.shape[:-1], 1))
        scores = jnp.concatenate([scores, sink], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1).astype(pv_dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    p = probs[..., :s].reshape(b, g, r * t, s)
    if t == 1:
        out = jnp.sum(p[..., None] * v_BGSK[:, :, None].astype(f32), axis=-2)
    else:
        out = jnp.einsum(
            "bgms,bgsk->bgmk",
            p,
            v_BGSK.astype(pv_dtype),
            preferred_element_type=f32,
            precision=pv_hi,
        )
    out = out.reshape(b, g, r, t, k)
    if k_new is not None:
        out = out + jnp.einsum(
            "bgrtu,bugk->bgrtk",
            probs[..., s:],
            v_new.astype(dt).astype(pv_dtype),
            preferred_element_type=f32,
            precision=pv_hi,
        )
    return out.astype(dt).transpose(0, 3, 1, 2, 4).reshape(b, t, h, k)


def mixed_attention(
    q_BTHK: jax.Array,
    k_BGKS: jax.Array,
    v_BGSK: jax.Array,
    mask_BTS: jax.Array,
    k_new: jax.Array | None = None,
    v_new: jax.Array | None = None,
    mask_new_BTT: jax.Array | None = None,
    slot_major: bool = False,
    scale: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`attention` as flash attention computes it, for accelerators with bf16 weights: both
    products take their inputs in the cache's dtype (queries, and the probabilities, rounded to
    it) and accumulate in fp32 at the backend's default precision, on the matrix units; the
    softmax is fp32. The cached part and the new entries (a tree verification) are each reduced
    to (max, sum of exponentials, unnormalised p.V) and merged by their log-sum-exp, so no
    [.., S + T] score matrix is concatenated. Unlike the exact path, a decode step and a
    verification round their probabilities alike, and neither runs fp32 products at HIGHEST (on
    an H100's CUDA cores, 67 TFLOP/s against the matrix units' 989). `slot_major`: K is
    [B, G, S, K]; `scale`, `sinks`: `attention`'s (a sink enters the merged denominator once,
    after the parts are merged)."""
    q = _grouped_queries(q_BTHK, k_BGKS.shape[1], v_BGSK.dtype)
    k_spec = "bgrtk,bgsk->bgrts" if slot_major else "bgrtk,bgks->bgrts"
    scores = jnp.einsum(k_spec, q, k_BGKS, preferred_element_type=jnp.float32)
    part = _reduced_part(scores, mask_BTS, v_BGSK, "bgrts,bgsk->bgrtk", scale)
    return _merged_heads(q, *part, k_new, v_new, mask_new_BTT, scale, sinks)


def _head_sinks(sinks_H: jax.Array, groups: int, rep: int) -> jax.Array:
    """gpt-oss's per-head sink logits [H] as fp32 [1, G, R, 1, 1] (head h = g R + r)."""
    return sinks_H.astype(jnp.float32).reshape(1, groups, rep, 1, 1)


def _grouped_queries(q_BTHK: jax.Array, groups: int, dtype) -> jax.Array:
    """Queries [B, T, H, K] -> [B, G, R, T, K] in the cache's dtype (head h = g R + r reads kv
    head g)."""
    b, t, h, k = q_BTHK.shape
    return q_BTHK.astype(dtype).reshape(b, t, groups, h // groups, k).transpose(0, 2, 3, 1, 4)


def _reduced_part(scores, mask, values, spec: str, scale=None):
    """One part of flash-style attention: fp32 scores [B, G, R, T, X] (unscaled) under mask
    [B, T, X] -> (max [B, G, R, T, 1], sum of exponentials, unnormalised p.V [B, G, R, T, K]),
    the probabilities rounded to the values' dtype for the product (`spec`); `scale` (default
    1 / sqrt(K)) as `attention`'s."""
    scale = 1.0 / np.sqrt(values.shape[-1]) if scale is None else scale
    scores = jnp.where(mask[:, None, None], scores * scale, NEG_INF)
    top = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(mask[:, None, None], jnp.exp(scores - top), 0.0)
    pv = jnp.einsum(spec, p.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return top, jnp.sum(p, axis=-1, keepdims=True), pv


def _merged_heads(q, top, total, out, k_new, v_new, mask_new_BTT, scale=None, sinks=None):
    """The cached part's (max, sum of exponentials, unnormalised p.V) with a verification's new
    entries ([B, U, G, K] under mask_new [B, T, U], when given) merged in by their log-sum-exp,
    and then the sinks [H] (gpt-oss: one more exponential in each head's sum, no value), when
    given; normalised, as [B, T, H, K] in the cache's dtype; q [B, G, R, T, K] in that dtype."""
    dt = q.dtype
    if k_new is not None:  # rounded to the cache's dtype, as a decode step writes them
        kn, vn = k_new.astype(dt), v_new.astype(dt)
        s_new = jnp.einsum("bgrtk,bugk->bgrtu", q, kn, preferred_element_type=jnp.float32)
        top2, total2, out2 = _reduced_part(s_new, mask_new_BTT, vn, "bgrtu,bugk->bgrtk", scale)
        both = jnp.maximum(top, top2)
        a, a2 = jnp.exp(top - both), jnp.exp(top2 - both)
        out, total, top = out * a + out2 * a2, total * a + total2 * a2, both
    if sinks is not None:
        sink = _head_sinks(sinks, q.shape[1], q.shape[2])
        both = jnp.maximum(top, sink)
        a = jnp.exp(top - both)
        out, total = out * a, total * a + jnp.exp(sink - both)
    b, g, r, t, k = out.shape
    return (out / total).astype(dt).transpose(0, 3, 1, 2, 4).reshape(b, t, g * r, k)


def _split_len(slots: int) -> int:
    """The slots each of the flash-decoding kernel's splits reads: the largest of 128, 64, 32, 16
    that divides the cache (its blocks must tile a split, of at least 16 slots)."""
    for n in (128, 64, 32, 16):
        if slots % n == 0:
            return n
    raise ValueError(f"{slots} cache slots: the flash-decoding kernel needs a multiple of 16")


def pallas_attention(
    q_BTHK: jax.Array,
    k_BGSK: jax.Array,
    v_BGSK: jax.Array,
    mask_BTS: jax.Array,
    k_new: jax.Array | None = None,
    v_new: jax.Array | None = None,
    mask_new_BTT: jax.Array | None = None,
    interpret: bool | None = None,
    scale: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`mixed_attention` with the cached part through JAX's Pallas flash-decoding kernel
    (jax.experimental.pallas.ops.gpu.decode_attention, Triton on a GPU), which reads only each
    row's valid slots: the range of the FIRST query's mask (every query must share it: a decode
    step, or a verification without a sliding window), split across the kernel's programs, each
    returning its max and sum of exponentials so that the splits, and then the tree's own
    entries, are merged by their log-sum-exp. The T queries of a row ride as T x R heads of each
    kv head. K and V are [B, G, S, K] (`slot_major_keys`). `interpret` (default: off a GPU) runs
    the kernel through Pallas' interpreter, for the CPU's tests; `scale`: `attention`'s;
    `sinks` (`attention`'s) join the merge after the kernel, which never sees them."""
    from jax.experimental.pallas.ops.gpu import decode_attention as flash

    b, t, h, k = q_BTHK.shape
    g, s = k_BGSK.shape[1], k_BGSK.shape[2]
    r = h // g
    scale = 1.0 / np.sqrt(k) if scale is None else scale
    row = mask_BTS[:, 0, :]  # [B, S]: one contiguous range of slots per row
    start = jnp.argmax(row, axis=-1).astype(jnp.int32)
    end = jnp.where(jnp.any(row, axis=-1), s - jnp.argmax(row[:, ::-1], axis=-1), 0)
    q = _grouped_queries(q_BTHK, g, v_BGSK.dtype)
    split = _split_len(s)
    one = functools.partial(
        flash.decode_attn_unbatched, sm_scale=float(scale), block_h=16, block_k=split,
        k_splits=s // split, num_warps=None, num_stages=2, grid=None,
        interpret=jax.default_backend() != "gpu" if interpret is None else interpret,
        debug=False, return_residuals=True, normalize_output=True,
    )  # fmt: skip
    rows = (
        jnp.broadcast_to(start[:, None], (b, g)),
        jnp.broadcast_to(end[:, None].astype(jnp.int32), (b, g)),
    )
    o, (total, top) = jax.vmap(jax.vmap(one))(q.reshape(b, g, r * t, k), k_BGSK, v_BGSK, *rows)
    top = top.reshape(b, g, r, t, 1)
    total = total.reshape(b, g, r, t, 1)
    out = o.reshape(b, g, r, t, k).astype(jnp.float32) * total  # unnormalised, as mixed's
    return _merged_heads(q, top, total, out, k_new, v_new, mask_new_BTT, scale, sinks)


def write_kv(
    kv: tuple[jax.Array, jax.Array],
    k_BTGK: jax.Array,
    v_BTGK: jax.Array,
    start_B: jax.Array,
    slot_major: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Writes each row's T new keys/values [B, T, G, K] at its own slot offset of a layer's cache
    (`slot_major`: K is [B, G, S, K])."""
    k_new, v_new = to_cache_layout(
        k_BTGK.astype(kv[0].dtype), v_BTGK.astype(kv[1].dtype), slot_major
    )
    k_at = (lambda s: (0, s, 0)) if slot_major else (lambda s: (0, 0, s))
    k = jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, k_at(s)))(kv[0], k_new, start_B)
    v = jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (0, s, 0)))(
        kv[1], v_new, start_B
    )
    return k, v


def cached_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv: tuple[jax.Array, jax.Array] | None,
    write_B: jax.Array | None,
    mask: jax.Array,
    mask_new: jax.Array | None = None,
    kind: str = "exact",
    one_range: bool = True,
    scale: float | None = None,
    sinks: jax.Array | None = None,
    cache_rows: jax.Array | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """Attention of a layer's new q/k/v [B, T, ...] with its K/V cache, -> (out, kv):
    no cache: over the T new tokens; kv is None;
    a cache, no mask_new: the new K/V written at write_B first, then attended; kv the new cache;
    a cache and mask_new: the cache only read, the new K/V joined in one softmax; kv the new
      entries (k, v) [B, T, G, K], for the caller to write where it wants (`write_kv`).
    `cache_rows` [B] (with mask_new): the cache has C >= B rows and row b of this call is its
    row cache_rows[b] (distinct), `rows_attention`.
    `kind`, `one_range`, `scale`, `sinks`: `attention`'s (a "pallas" cache is slot-major)."""
    at = functools.partial(attention, kind=kind, one_range=one_range, scale=scale, sinks=sinks)
    if kv is not None and mask_new is not None:
        with jax.named_scope("attention"):
            if cache_rows is not None:
                return rows_attention(at, q, kv, mask, k, v, mask_new, cache_rows), (k, v)
            return at(q, kv[0], kv[1], mask, k, v, mask_new), (k, v)
    slot_major = slot_major_keys(kind)
    if kv is not None:
        kv = write_kv(kv, k, v, write_B, slot_major)
        keys, values = kv
    else:
        keys, values = to_cache_layout(k, v, slot_major)
    with jax.named_scope("attention"):
        return at(q, keys, values, mask), kv


def rows_attention(at, q, kv, mask, k_new, v_new, mask_new, cache_rows):
    """`at` (`attention` with its options) of B rows' queries over rows `cache_rows` [B] of a
    cache of C rows, reading the cache in place: the queries, masks and new entries are put at
    their rows of C (the other rows attend to nothing cached and to themselves alone) and the
    B rows' outputs taken back. A gather of the cache's rows would copy them, in XLA:CPU slower
    than attending over all C (docs/serving.md); only the projections and MLP, which scale with
    the rows, run on B. Each row's products are those it gets over its own cache."""
    c, t = kv[1].shape[0], q.shape[1]

    def put(x, fill):
        return jnp.full((c,) + x.shape[1:], fill, x.dtype).at[cache_rows].set(x)

    self_only = jnp.broadcast_to(jnp.eye(t, dtype=bool), (c, t, t)).at[cache_rows].set(mask_new)
    out = at(put(q, 0), kv[0], kv[1], put(mask, False), put(k_new, 0), put(v_new, 0), self_only)
    return out[cache_rows]


# XLA:CPU computes a product of a few rows with its GEMM, which handles them poorly on some CPUs: a
# few rows cost far more than one though the weights are read once either way. One vector-matrix
# product per row (a lax.map, so one compiled body whatever the count) can do better for 2-8 rows
# on one CPU and worse on another (BENCHMARKS.md, "Which product is faster depends on the
# machine"), so the choice is a static ProductPolicy (config.py) that an entry point measures for
# its machine (eagle3_jax.cpu_tuning) and passes in with the config; the default is the plain
# product for any row count.
def dense(
    x: jax.Array, w: jax.Array, out_dtype=None, *, policy: ProductPolicy = PLAIN_PRODUCTS
) -> jax.Array:
    """x[..., K] @ w[K, N]; 2..policy.row_products rows as one vector-matrix product per row.
    `out_dtype` (e.g. fp32 for logits from bf16 weights) is the products' result type, accumulated
    and returned without a rounding to the inputs' dtype."""
    mm = functools.partial(jnp.matmul, preferred_element_type=out_dtype)
    rows = int(np.prod(x.shape[:-1]))
    if not 1 < rows <= policy.row_products:
        return mm(x, w)
    flat = x.reshape(rows, x.shape[-1])
    return jax.lax.map(lambda r: mm(r, w), flat).reshape(*x.shape[:-1], w.shape[-1])


# A product with a weight stored [N, K] (out, in): the tied output layer, whose matrix is the
# [V, D] embedding (113 MB for SmolLM2's 49,152 x 576). XLA:CPU's GEMM scores 2-8 rows with it at
# ~1.5-2x the cost of one row on some CPUs, though the matrix is read once either way; written as
# a multiply-and-sum over K (a row reduction, each output a dot of two contiguous rows, all rows in
# one pass over the matrix) it can cost less (BENCHMARKS.md, "The output layer as a row
# reduction"). One row stays a matrix-vector product (the reduction is far slower there). As with
# row products the choice is the static policy's (`logit_reduce`), measured per machine by
# eagle3_jax.cpu_tuning.


def product_t(x: jax.Array, w_t: jax.Array, out_dtype=None, weight_left: bool = False) -> jax.Array:
    """x[R, K] . w_t[N, K]^T as XLA's dot: [R, N]. weight_left puts the weight as the LEFT operand
    ([N, R], then transposed): the same products, but XLA:CPU's GEMM once streamed the 113 MB
    SmolLM2 embedding far better that way round for a few rows (an earlier jax)."""
    dims = (((1,), (1,)), ((), ()))  # K against K
    if weight_left:
        return jax.lax.dot_general(w_t, x, dims, preferred_element_type=out_dtype).T
    return jax.lax.dot_general(x, w_t, dims, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def reduce_t(x: jax.Array, w_t: jax.Array, out_dtype=None) -> jax.Array:
    """x[R, K] . w_t[N, K]^T as a multiply-and-sum over K (a row reduction), accumulated in
    out_dtype (or the inputs' type): [R, N]. Its gradient is the plain products' (autodiff of the
    reduction would build [R, N, K] temporaries: 0.9 GB for 8 rows of SmolLM2's embedding)."""
    acc = out_dtype or jnp.result_type(x, w_t)
    return jnp.sum(w_t.astype(acc)[None, :, :] * x.astype(acc)[:, None, :], axis=-1)


def _reduce_t_fwd(x, w_t, out_dtype):
    return reduce_t(x, w_t, out_dtype), (x, w_t)


def _reduce_t_bwd(out_dtype, res, g):
    x, w_t = res
    acc = out_dtype or jnp.result_type(x, w_t)
    g = g.astype(acc)
    dx = jnp.matmul(g, w_t.astype(acc)).astype(x.dtype)
    dw = jnp.matmul(g.T, x.astype(acc)).astype(w_t.dtype)
    return dx, dw


reduce_t.defvjp(_reduce_t_fwd, _reduce_t_bwd)


def dense_t(
    x: jax.Array,
    w_t: jax.Array,
    out_dtype=None,
    weight_left: bool = False,
    *,
    policy: ProductPolicy = PLAIN_PRODUCTS,
) -> jax.Array:
    """x[..., K] . w_t[N, K]^T (a weight stored out-by-in, e.g. a tied embedding): 2..
    policy.logit_reduce rows as a row reduction, else as the product (`weight_left`: see
    product_t). `out_dtype` is the result type, accumulated in it (fp32 logits from bf16 weights).
    Meant for jitted callers: run eagerly, the reduction materialises its [rows, N, K] products."""
    lead = x.shape[:-1]
    rows = int(np.prod(lead))
    flat = x.reshape(rows, x.shape[-1])
    if 1 < rows <= policy.logit_reduce:
        out = reduce_t(flat, w_t, out_dtype)
    else:
        out = product_t(flat, w_t, out_dtype, weight_left)
    return out.reshape(*lead, w_t.shape[0])


# The gated MLP's activations (`TargetConfig.mlp_activation`): SiLU (SwiGLU), and GELU with
# transformers' tanh approximation (gelu_pytorch_tanh, Gemma's GeGLU) or exact.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
}


def swiglu(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    policy: ProductPolicy = PLAIN_PRODUCTS,
    activation: str = "silu",
) -> jax.Array:
    """act(x w_gate) * (x w_up), times w_down; `activation` names one of ACTIVATIONS."""
    gate, up = dense(x, w_gate, policy=policy), dense(x, w_up, policy=policy)
    return dense(ACTIVATIONS[activation](gate) * up, w_down, policy=policy)


def causal_mask(cursor_B: jax.Array, t: int, s: int, window: int | None = None) -> jax.Array:
    """[B, T, S] mask for T new tokens written at slots cursor..cursor+T-1 of an S-slot cache."""
    q_pos = cursor_B[:, None] + jnp.arange(t)[None, :]  # [B, T]
    slots = jnp.arange(s)[None, None, :]
    mask = slots <= q_pos[:, :, None]
    if window is not None:
        mask = mask & (slots > q_pos[:, :, None] - window)
    return mask
