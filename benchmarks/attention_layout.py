#!/usr/bin/env python
"""The KV-cache layout's cost: 30 layers of cached attention, as in one SmolLM2 forward.

  .venv/bin/python benchmarks/attention_layout.py [--slots 512,2048] [--queries 1,4,16,64]
                                                  [--reps 5] [--out F]

Times a jitted function that, for each of 30 layers (9 query heads, 3 kv heads, head dim 64),
writes T new keys/values into its cache (donated, updated in place) and attends T queries over
the S slots: only the attention and the cache writes of a SmolLM2-135M forward, no projections.
Two implementations, same inputs:

- `bsgk`: the layout this project used before, K and V cached as [B, S, G, K] and both products
  as one einsum each (XLA transposes the cache to feed them);
- `layers`: `eagle3_jax.models.layers.cached_attention` as the target and draft call it (K cached
  as [B, G, K, S], V as [B, G, S, K]; one query by multiply-and-sum).

Reports the best of `reps` timings of 20 calls each (ms per forward) and the ratio; prints a table
and writes benchmarks/results/attention_layout.json. Noisy machines: compare the ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.models.layers import NEG_INF, cached_attention, kv_shapes
from eagle3_jax.paths import cpu_model

ROOT = Path(__file__).resolve().parents[1]
LAYERS, HEADS, GROUPS, DIM = 30, 9, 3, 64


def bsgk_attention(q, k_new, v_new, kv, start, mask):
    """The former formulation: cache [B, S, G, K], write then attend with two einsums."""
    kc = jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (s, 0, 0)))(
        kv[0], k_new, start
    )
    vc = jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (s, 0, 0)))(
        kv[1], v_new, start
    )
    b, t, h, k = q.shape
    qg = q.reshape(b, t, GROUPS, h // GROUPS, k)
    scores = jnp.einsum("btgrk,bsgk->bgrts", qg, kc, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores / np.sqrt(k), NEG_INF)
    out = jnp.einsum("bgrts,bsgk->btgrk", jax.nn.softmax(scores, -1), vc)
    return out.reshape(b, t, h, k), (kc, vc)


def layers_attention(q, k_new, v_new, kv, start, mask):
    return cached_attention(q, k_new, v_new, kv, start, mask)


def stack(attend, x, ks, vs, start, mask):
    """Thirty layers; each layer's queries/keys/values are cheap functions of the running x."""
    new_k, new_v = [], []
    b, t, _ = x.shape
    for i in range(LAYERS):
        q = (x * (1.0 + 1e-3 * i)).reshape(b, t, HEADS, DIM)
        kn = x[..., : GROUPS * DIM].reshape(b, t, GROUPS, DIM)
        out, (k, v) = attend(q, kn, 0.5 * kn, (ks[i], vs[i]), start, mask)
        x = x + 0.01 * out.reshape(b, t, -1)
        new_k.append(k)
        new_v.append(v)
    return x, new_k, new_v


def time_one(name: str, slots: int, t: int, reps: int) -> float:
    if name == "bsgk":
        kshape = vshape = (1, slots, GROUPS, DIM)
        attend = bsgk_attention
    else:
        kshape, vshape = kv_shapes(1, slots, GROUPS, DIM)
        attend = layers_attention
    ks = [jnp.full(kshape, 0.01, jnp.float32) for _ in range(LAYERS)]
    vs = [jnp.full(vshape, 0.01, jnp.float32) for _ in range(LAYERS)]
    f = jax.jit(partial(stack, attend), donate_argnums=(1, 2))
    x = jnp.full((1, t, HEADS * DIM), 0.1, jnp.float32)
    mask = jnp.ones((1, t, slots), bool)
    start = jnp.zeros((1,), jnp.int32)
    for _ in range(3):
        x, ks, vs = f(x, ks, vs, start, mask)
    jax.block_until_ready(x)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(20):
            x, ks, vs = f(x, ks, vs, start, mask)
        jax.block_until_ready(x)
        best = min(best, (time.perf_counter() - t0) / 20)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--slots", default="512,2048")
    ap.add_argument("--queries", default="1,4,16,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/attention_layout.json"))
    args = ap.parse_args()
    rows = []
    print(f"{'slots':>6} {'T':>4} {'bsgk ms':>9} {'layers ms':>10} {'ratio':>6}")
    for slots in map(int, args.slots.split(",")):
        for t in map(int, args.queries.split(",")):
            old = time_one("bsgk", slots, t, args.reps)
            new = time_one("layers", slots, t, args.reps)
            rows.append({"slots": slots, "queries": t, "bsgk_ms": old, "layers_ms": new})
            print(f"{slots:>6} {t:>4} {old:>9.2f} {new:>10.2f} {old / new:>5.2f}x", flush=True)
    meta = {
        "machine": platform.machine(),
        "processor": cpu_model(),
        "jax": jax.__version__,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
