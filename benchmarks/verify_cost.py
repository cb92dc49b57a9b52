#!/usr/bin/env python
"""What one target forward over T tokens costs against one token: the ceiling speculative decoding
lives under on a given machine.

  .venv/bin/python benchmarks/verify_cost.py [--context 320] [--reps 20] [--sizes 1,2,4] [--out F]

The embedded SmolLM2-135M-Instruct (or --target) runs T new tokens (T = 1, 2, 3, 4, 5, 6, 8, 12,
16, 24, 32, 64) against a cache holding `context` tokens, with logits for every new token, as a
tree verification does (fp32, batch 1, jitted, K/V written into the cache, medians of `reps`).
With a perfect draft a round of T tokens yields T tokens, so T / cost(T) bounds the speedup of
a chain of depth T - 1 before any drafting cost. Prints a table and writes
benchmarks/results/verify_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.checkpoints import load_target
from eagle3_jax.models import target as tgt

ROOT = Path(__file__).resolve().parents[1]
SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma list of T")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/verify_cost.json"))
    args = ap.parse_args()
    target = load_target(args.target)
    cfg = target.cfg

    @jax.jit
    def step(params, tokens, cache, start):
        t = tokens.shape[1]
        pos = start[:, None] + jnp.arange(t)[None, :]
        mask = jnp.arange(args.slots)[None, None, :] <= pos[:, :, None]
        return tgt.forward(params, tokens, pos, mask, cfg, cache, start)

    cache = tgt.make_cache(cfg, 1, args.slots)
    start = jnp.full((1,), args.context, jnp.int32)
    rng = np.random.default_rng(0)
    rows = []
    sizes = sorted({int(x) for x in args.sizes.split(",")} | {1})  # T = 1 is the unit
    for t in sizes:
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, t)), jnp.int32)
        jax.block_until_ready(step(target.params, tokens, cache, start))
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(step(target.params, tokens, cache, start).logits)
            times.append(time.perf_counter() - t0)
        rows.append({"tokens": t, "ms": 1e3 * float(np.median(times))})
    base = rows[0]["ms"]
    print(f"target forward over T new tokens, context {args.context}, fp32, batch 1")
    print(f"{'T':>4} {'ms':>8} {'cost/T=1':>9} {'T/cost':>7}")
    for r in rows:
        r["relative"] = r["ms"] / base
        r["ceiling"] = r["tokens"] / r["relative"]
        print(f"{r['tokens']:>4} {r['ms']:>8.1f} {r['relative']:>9.2f} {r['ceiling']:>7.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.processor() or platform.machine(),
        "cpus": jax.local_device_count(),
        "jax": jax.__version__,
        "context": args.context,
        "reps": args.reps,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
