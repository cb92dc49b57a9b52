"""Building blocks shared by the target and the draft: RMSNorm, RoPE, masked GQA attention, SwiGLU.

Each mirrors the transformers PyTorch computation order (fp32 statistics, cast back to the compute
dtype) so that parity tests hold at 1e-4 or tighter.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.compile_cache import cpu_model

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


# KV cache layout, per layer: K as [B, G, K, S] and V as [B, G, S, K] (G kv heads, K head dim,
# S slots). The scores q.K and the output p.V are then plain batched matrix products over (B, G)
# with the slots where each product wants them, so XLA reads the cache as it lies: the old
# [B, S, G, K] layout made XLA transpose every layer's K and V on every forward. On a 2-core Intel
# Xeon, 30 layers of cached attention at 512 slots: 6.2 -> 2.0 ms for one query, 8.9 -> 2.6 ms for
# four (`benchmarks/attention_layout.py`).


def kv_shapes(batch: int, slots: int, groups: int, head_dim: int) -> tuple[tuple, tuple]:
    """The shapes of one layer's K [B, G, K, S] and V [B, G, S, K] cache."""
    return (batch, groups, head_dim, slots), (batch, groups, slots, head_dim)


def to_cache_layout(k_BTGK: jax.Array, v_BTGK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """New keys/values [B, T, G, K] -> K [B, G, K, T], V [B, G, T, K] (the cache layout)."""
    return k_BTGK.transpose(0, 2, 3, 1), v_BTGK.transpose(0, 2, 1, 3)


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
) -> jax.Array:
    """Grouped-query attention of T queries over S keys under an explicit boolean mask.

    Keys and values come in the cache layout (K [B, G, K, S], V [B, G, S, K]). The mask is the only
    notion of causality: causal prefill, one decode step, a draft tree (each node sees the prefix
    and its ancestors) and the training-time-test blocks all go through here. With k_new/v_new
    [B, T, G, K] the queries also attend to those T entries (under mask_new) in one softmax with the
    S cached ones, which are only read: a tree verification that leaves the cache untouched (no copy
    of it, even inside a lax.switch branch). Returns [B, T, H, K]; softmax in fp32.
    """
    b, t, h, k = q_BTHK.shape
    g = k_BGKS.shape[1]
    r = h // g
    s = k_BGKS.shape[-1]
    scale = 1.0 / np.sqrt(k)
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
    probs = jax.nn.softmax(scores, axis=-1).astype(pv_dtype)
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


def write_kv(
    kv: tuple[jax.Array, jax.Array], k_BTGK: jax.Array, v_BTGK: jax.Array, start_B: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Writes each row's T new keys/values [B, T, G, K] at its own slot offset of a layer's cache."""
    k_new, v_new = to_cache_layout(k_BTGK.astype(kv[0].dtype), v_BTGK.astype(kv[1].dtype))
    k = jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (0, 0, s)))(
        kv[0], k_new, start_B
    )
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
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """Attention of a layer's new q/k/v [B, T, ...] with its K/V cache, -> (out, kv):
    no cache: over the T new tokens; kv is None;
    a cache, no mask_new: the new K/V written at write_B first, then attended; kv the new cache;
    a cache and mask_new: the cache only read, the new K/V joined in one softmax; kv the new
      entries (k, v) [B, T, G, K], for the caller to write where it wants (`write_kv`)."""
    if kv is not None and mask_new is not None:
        with jax.named_scope("attention"):
            return attention(q, kv[0], kv[1], mask, k, v, mask_new), (k, v)
    if kv is not None:
        kv = write_kv(kv, k, v, write_B)
        keys, values = kv
    else:
        keys, values = to_cache_layout(k, v)
    with jax.named_scope("attention"):
        return attention(q, keys, values, mask), kv


# XLA:CPU computes a product of a few rows with its GEMM, which handles them poorly on some CPUs: a
# few rows cost far more than one though the weights are read once either way. One vector-matrix
# product per row (a lax.map, so one compiled body whatever the count) can do better for 2-8 rows:
# on an AMD EPYC VM the whole SmolLM2 forward over 4 tokens costs 1.52x one token that way instead
# of 1.73x (`benchmarks/verify_cost.py --row-products 8,0`). On an Intel Xeon VM with AVX-512 it is
# the opposite (4 tokens: 1.84x one token with row products, 1.31x with plain products;
# benchmarks/results/verify_cost_xeon.json). So the choice is measured per machine: the first time
# a few rows are multiplied on the CPU, `choose_row_products` times both ways on SmolLM2-shaped
# weights and keeps the faster, cached per CPU model in the cache folder. EAGLE3_JAX_ROW_PRODUCTS
# (an integer, read at import) skips the probe: 0 = plain products always, 8 = row products for 2-8
# rows. Other backends, and more rows (prefill, trees of 9+ nodes, training), use the plain product.
def _limit_from_env(name: str) -> int | None:
    """A row limit set in the environment variable `name` (read at import), or None (unset or
    "auto": probed on first use); anything else is an error."""
    value = os.environ.get(name, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if not value.isdigit():
        raise ValueError(f"{name}={value!r}: use auto or a row count (0 = plain products)")
    return int(value)


def _median_ms_alternating(ways: dict, *args, reps: int) -> dict[str, float]:
    """Median ms of each of `ways` (jitted functions of `args`), warmed up, then timed in turn rep
    by rep so all see the same machine. Call outside any trace."""
    times: dict[str, list[float]] = {k: [] for k in ways}
    for fn in ways.values():
        jax.block_until_ready(fn(*args))
    for _ in range(reps):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {k: float(np.median(v)) for k, v in times.items()}


ROW_PRODUCTS_ENV = "EAGLE3_JAX_ROW_PRODUCTS"
ROW_PRODUCTS_ON = 8  # the most rows done one by one, when the probe picks row products
ROW_PRODUCTS_MAX: int | None = _limit_from_env(ROW_PRODUCTS_ENV)  # None: not probed yet


def time_row_products(rows: int = 4, layers: int = 6, reps: int = 25) -> dict[str, float]:
    """Median ms of `layers` SmolLM2-135M-shaped layers' projections (q, k, v, o, gate, up, down:
    576 wide, 1536 MLP, 192 K/V) over `rows` rows, as row products and as plain products, timed
    alternately so both see the same machine. Call outside any trace (see choose_row_products)."""
    d, f, kv = 576, 1536, 192
    rng = np.random.default_rng(0)
    shapes = ((d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d))
    first = [jnp.asarray(0.02 * rng.standard_normal(s, dtype=np.float32)) for s in shapes]
    # one random draw, `layers` distinct copies: the stack reads as many bytes as a real one
    ws = [[w + 0.0 for w in first] for _ in range(layers)]

    def stack(prod):
        def f_(x):
            for q, k, v, o, g, u, dn in ws:
                x = x + prod(prod(x, q), o) + prod(x, k).sum() + prod(x, v).sum()
                x = x + prod(jax.nn.silu(prod(x, g)) * prod(x, u), dn)
            return x

        return jax.jit(f_)

    ways = {
        "row_products_ms": stack(lambda x, w: jax.lax.map(lambda r: r @ w, x)),
        "plain_products_ms": stack(lambda x, w: x @ w),
    }
    x = jnp.asarray(rng.standard_normal((rows, d), dtype=np.float32))
    return _median_ms_alternating(ways, x, reps=reps)


def _probed_choice(file: str, timing, fast: str, slow: str, on: int, what: str, report) -> int:
    """`on` if timing()[fast] beats timing()[slow] by 5 % on this machine, else 0; measured once per
    CPU model and jax version and cached in <cache>/<file>; `report(result, faster, path)` is the
    stderr line that says what was chosen, `what` names the probe if it fails. The probe runs in
    its own thread: JAX's trace state is per thread, so a call made while a caller is being traced
    (dense is) times real computations instead of staging them into the caller."""
    from eagle3_jax.checkpoints import cache_dir  # late: checkpoints imports the models

    path = cache_dir() / file
    key = f"{cpu_model()} | {os.cpu_count()} cpus | jax {jax.__version__}"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):  # not ours (or damaged): measure again and replace it
        known = {}
    if isinstance(known.get(key), dict) and "choice" in known[key]:
        return int(known[key]["choice"])
    result: dict[str, Any] = {}

    def probe():
        try:
            result.update(timing())
        except Exception as e:  # noqa: BLE001 - reported below, then the plain product
            result["error"] = repr(e)

    worker = threading.Thread(target=probe, name=f"eagle3-probe-{file}")
    worker.start()
    worker.join()
    if "error" in result:
        print(f"eagle3_jax: {what} failed ({result['error']}); plain products", file=sys.stderr)
        return 0
    faster = result[fast] < 0.95 * result[slow]
    result["choice"] = on if faster else 0
    known[key] = result
    try:
        from eagle3_jax.checkpoints.atomic import write_text_atomic

        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(known, indent=1) + "\n")
    except OSError:
        pass  # a read-only cache only costs the probe again next time
    print(report(result, faster, path), file=sys.stderr)
    return result["choice"]


def choose_row_products() -> int:
    """The row-product limit for this machine: ROW_PRODUCTS_ON if row products beat plain products
    by 5 % at 4 rows here, else 0 (cached in <cache>/row_products.json)."""
    return _probed_choice(
        "row_products.json",
        time_row_products,
        "row_products_ms",
        "plain_products_ms",
        ROW_PRODUCTS_ON,
        "row-product probe",
        lambda r, faster, path: (
            f"eagle3_jax: {'row' if faster else 'plain'} products for 2-{ROW_PRODUCTS_ON} rows on "
            f"this CPU (4 rows: {r['row_products_ms']:.1f} ms row products, "
            f"{r['plain_products_ms']:.1f} ms plain; {ROW_PRODUCTS_ENV} overrides; cached in {path})"
        ),
    )


def _probed_limit(name: str, choose) -> int:
    """The module setting `name`, probed with `choose()` and kept there on first use."""
    if globals()[name] is None:
        globals()[name] = choose()
    return globals()[name]


def _limit_for(rows: int, name: str, choose, on: int) -> int:
    """The limit `rows` are held against: a set one as is; unset, the probe's, asked only where its
    answer matters (2..on rows; more rows use the plain product whatever it says)."""
    if globals()[name] is not None:
        return globals()[name]
    return _probed_limit(name, choose) if rows <= on else 0


def row_products_max() -> int:
    """The most rows `dense` multiplies one by one on the CPU (0: none), probed on first use."""
    return _probed_limit("ROW_PRODUCTS_MAX", choose_row_products)


def dense(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x[..., K] @ w[K, N], as one vector-matrix product per row for a few rows on the CPU where
    that is faster (see row_products_max). `out_dtype` (e.g. fp32 for logits from bf16 weights)
    is the products' result type, accumulated and returned without a rounding to the inputs' dtype."""
    mm = functools.partial(jnp.matmul, preferred_element_type=out_dtype)
    rows = int(np.prod(x.shape[:-1]))
    if jax.default_backend() != "cpu":
        return mm(x, w)
    if rows == 1:  # a vector-matrix product either way
        return mm(x.reshape(-1), w).reshape(*x.shape[:-1], w.shape[-1])
    if rows > _limit_for(rows, "ROW_PRODUCTS_MAX", choose_row_products, ROW_PRODUCTS_ON):
        return mm(x, w)
    flat = x.reshape(rows, x.shape[-1])
    return jax.lax.map(lambda r: mm(r, w), flat).reshape(*x.shape[:-1], w.shape[-1])


# A product with a weight stored [N, K] (out, in): the tied output layer, whose matrix is the
# [V, D] embedding (113 MB for SmolLM2's 49,152 x 576). XLA:CPU's GEMM scores 2-8 rows with it at
# ~1.5-2x the cost of one row (4 rows: 10.1 ms against 4.9 ms on the 2-core AMD EPYC VM), though the
# matrix is read once either way; written as a multiply-and-sum over K (a row reduction, each
# output a dot of two contiguous rows, all rows in one pass over the matrix) the same 4 rows cost
# 6.8 ms. One row stays a matrix-vector product (the reduction is far slower there). As with row
# products the choice is measured per machine (`choose_logit_reduce`, cached in
# <cache>/logit_reduce.json); EAGLE3_JAX_LOGIT_REDUCE (an integer, read at import) skips the
# probe: 0 = the plain product always, 8 = the reduction for 2-8 rows. Other backends, one row and
# more rows (prefill, trees of 9+ nodes, training) use the plain product.
LOGIT_REDUCE_ENV = "EAGLE3_JAX_LOGIT_REDUCE"
LOGIT_REDUCE_ON = 8
LOGIT_REDUCE_MAX: int | None = _limit_from_env(LOGIT_REDUCE_ENV)  # None: not probed yet


def _product_t(
    x: jax.Array, w_t: jax.Array, out_dtype=None, weight_left: bool = False
) -> jax.Array:
    """x[R, K] . w_t[N, K]^T as XLA's dot: [R, N]. weight_left puts the weight as the LEFT operand
    ([N, R], then transposed): the same products, but XLA:CPU's GEMM once streamed the 113 MB
    SmolLM2 embedding far better that way round for a few rows (8 ms against 13 ms for 2-4 rows,
    an earlier jax)."""
    dims = (((1,), (1,)), ((), ()))  # K against K
    if weight_left:
        return jax.lax.dot_general(w_t, x, dims, preferred_element_type=out_dtype).T
    return jax.lax.dot_general(x, w_t, dims, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _reduce_t(x: jax.Array, w_t: jax.Array, out_dtype=None) -> jax.Array:
    """x[R, K] . w_t[N, K]^T as a multiply-and-sum over K (a row reduction), accumulated in
    out_dtype (or the inputs' type): [R, N]. Its gradient is the plain products' (autodiff of the
    reduction would build [R, N, K] temporaries: 0.9 GB for 8 rows of SmolLM2's embedding)."""
    acc = out_dtype or jnp.result_type(x, w_t)
    return jnp.sum(w_t.astype(acc)[None, :, :] * x.astype(acc)[:, None, :], axis=-1)


def _reduce_t_fwd(x, w_t, out_dtype):
    return _reduce_t(x, w_t, out_dtype), (x, w_t)


def _reduce_t_bwd(out_dtype, res, g):
    x, w_t = res
    acc = out_dtype or jnp.result_type(x, w_t)
    g = g.astype(acc)
    dx = jnp.matmul(g, w_t.astype(acc)).astype(x.dtype)
    dw = jnp.matmul(g.T, x.astype(acc)).astype(w_t.dtype)
    return dx, dw


_reduce_t.defvjp(_reduce_t_fwd, _reduce_t_bwd)


def time_logit_reduce(
    rows: int = 4, vocab: int = 49152, width: int = 576, reps: int = 15
) -> dict[str, float]:
    """Median ms of a SmolLM2-sized tied output layer ([vocab, width] fp32) over `rows` rows, as a
    row reduction and as a plain product, timed alternately. Call outside any trace."""
    rng = np.random.default_rng(0)
    w_t = jnp.asarray(0.02 * rng.standard_normal((vocab, width), dtype=np.float32))
    x = jnp.asarray(rng.standard_normal((rows, width), dtype=np.float32))
    ways = {"reduce_ms": jax.jit(_reduce_t), "plain_products_ms": jax.jit(_product_t)}
    return _median_ms_alternating(ways, x, w_t, reps=reps)


def choose_logit_reduce() -> int:
    """LOGIT_REDUCE_ON if the row reduction beats the plain product by 5 % at 4 rows here, else 0
    (cached in <cache>/logit_reduce.json)."""
    return _probed_choice(
        "logit_reduce.json",
        time_logit_reduce,
        "reduce_ms",
        "plain_products_ms",
        LOGIT_REDUCE_ON,
        "output-layer probe",
        lambda r, faster, path: (
            f"eagle3_jax: output layer {'as a row reduction' if faster else 'as a plain product'} "
            f"for 2-{LOGIT_REDUCE_ON} rows on this CPU (4 rows: {r['reduce_ms']:.1f} ms reduction, "
            f"{r['plain_products_ms']:.1f} ms product; {LOGIT_REDUCE_ENV} overrides; cached in {path})"
        ),
    )


def logit_reduce_max() -> int:
    """The most rows `dense_t` computes as a row reduction on the CPU (0: none), probed on first use."""
    return _probed_limit("LOGIT_REDUCE_MAX", choose_logit_reduce)


def dense_t(x: jax.Array, w_t: jax.Array, out_dtype=None, weight_left: bool = False) -> jax.Array:
    """x[..., K] . w_t[N, K]^T (a weight stored out-by-in, e.g. a tied embedding), as a row
    reduction for a few rows on the CPU where that is faster (see logit_reduce_max), else as the
    product (`weight_left`: see _product_t). `out_dtype` is the result type, accumulated in it
    (fp32 logits from bf16 weights). Meant for jitted callers: run eagerly, the reduction
    materialises its [rows, N, K] products."""
    lead = x.shape[:-1]
    rows = int(np.prod(lead))
    flat = x.reshape(rows, x.shape[-1])
    if (
        jax.default_backend() == "cpu"
        and rows > 1
        and rows <= _limit_for(rows, "LOGIT_REDUCE_MAX", choose_logit_reduce, LOGIT_REDUCE_ON)
    ):
        out = _reduce_t(flat, w_t, out_dtype)
    else:
        out = _product_t(flat, w_t, out_dtype, weight_left)
    return out.reshape(*lead, w_t.shape[0])


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
