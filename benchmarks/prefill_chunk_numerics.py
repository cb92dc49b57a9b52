#!/usr/bin/env python
"""Is a chunked prefill bit-for-bit the one-pass prefill? The target's K/V, features and last
logits after one pass over a prompt against after writing it C tokens at a time.

  .venv/bin/python benchmarks/prefill_chunk_numerics.py [--chunk 64] [--length 300]

The embedded default target (SmolLM2, fp32) and its shipped head's aux layers, one prompt of
random tokens, a 1,024-slot cache. Prints the largest differences (docs/experiments/
2026-12-07-chunked-prefill-numerics.md holds a run); writes nothing.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.cli import decode, serve
from eagle3_jax.models import target as tgt
from eagle3_jax.models.layers import causal_mask

SLOTS = 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--length", type=int, default=300)
    a = ap.parse_args()
    args = serve.parse_args(["--slots", "1", "--max-context", str(SLOTS)])
    serve.check(args)
    target, head, _ = decode._load(args)
    params, cfg, aux_ids = target.params, target.cfg, head[1].aux_layer_ids
    dtype = jax.tree.leaves(params)[0].dtype
    n, c = a.length, a.chunk
    t = -(-n // c) * c  # the prompt padded to whole chunks (one pass pads it the same)
    prompt = np.zeros((1, t), np.int32)
    prompt[0, :n] = np.random.default_rng(0).integers(10, cfg.vocab_size, n)
    z = jnp.zeros((1,), jnp.int32)

    @jax.jit
    def one_pass(toks):
        out = tgt.forward(params, toks, jnp.arange(t)[None], causal_mask(z, t, SLOTS), cfg,
                          tgt.make_cache(cfg, 1, SLOTS, dtype), z, aux_ids=aux_ids,
                          compute_logits=False)  # fmt: skip
        return out.cache, out.hidden, out.aux

    @jax.jit
    def chunk(cache, toks, start):
        out = tgt.forward(params, toks, start + jnp.arange(c)[None],
                          causal_mask(start[None], c, SLOTS), cfg, cache, start[None],
                          aux_ids=aux_ids, compute_logits=False)  # fmt: skip
        return out.cache, out.hidden, out.aux

    cache1, hidden1, aux1 = one_pass(jnp.asarray(prompt))
    cache2, hid, aux = tgt.make_cache(cfg, 1, SLOTS, dtype), [], []
    for s in range(0, t, c):
        cache2, h, x = chunk(cache2, jnp.asarray(prompt[:, s : s + c]), jnp.int32(s))
        hid.append(h)
        aux.append(x)
    hidden2, aux2 = jnp.concatenate(hid, 1), jnp.concatenate(aux, 1)

    def keys(cache):  # [L, ...] with the slot axis cut to the prompt
        k = cache["k"]
        k = np.stack([np.asarray(x) for x in k]) if isinstance(k, list) else np.asarray(k)
        axis = next(i for i, d in enumerate(k.shape) if d == SLOTS)
        return np.take(k, np.arange(n), axis=axis)

    k1, k2 = keys(cache1), keys(cache2)
    first = next((i for i in range(k1.shape[0]) if not np.array_equal(k1[i], k2[i])), None)
    logits1 = tgt.lm_head(params, hidden1[:, n - 1], cfg)
    logits2 = tgt.lm_head(params, hidden2[:, n - 1], cfg)
    rows = [
        ("first layer whose K differs", "none" if first is None else str(first)),
        ("that layer's K", "-" if first is None else f"{np.abs(k1[first] - k2[first]).max():.2g}"),
        ("all layers' K", f"{np.abs(k1 - k2).max():.2g}"),
        ("the head's features", f"{float(jnp.abs(aux1[:, :n] - aux2[:, :n]).max()):.2g}"),
        ("last logits", f"{float(jnp.abs(logits1 - logits2).max()):.2g}"),
        ("last argmax equal", str(int(logits1.argmax()) == int(logits2.argmax()))),
    ]
    print(f"prompt {n} tokens: one pass of {t} against chunks of {c}")
    for name, value in rows:
        print(f"  {name:28s} {value}")


if __name__ == "__main__":
    main()
