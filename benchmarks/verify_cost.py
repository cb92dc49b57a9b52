#!/usr/bin/env python
"""What one target forward over T tokens costs against one token: the ceiling speculative decoding
lives under on a given machine.

  .venv/bin/python benchmarks/verify_cost.py [--context 320] [--reps 20] [--sizes 1,2,4] [--out F]

The embedded SmolLM2-135M-Instruct (or --target) runs T new tokens (T = 1, 2, 3, 4, 5, 6, 8, 12,
16, 24, 32, 64) against a cache holding `context` tokens, with logits for every new token, as a
tree verification does (fp32, batch 1, jitted, K/V written into the cache, medians of `reps`).
With a perfect draft a round of T tokens yields T tokens, so T / cost(T) bounds the speedup of
a chain of depth T - 1 before any drafting cost. `--row-products 8,0` times the per-row
products of models.layers (`dense`) against plain matrix products in the same run, and
`--logit-reduce 8,0` the output layer as a row reduction (`dense_t`) against the plain product
(every combination of the two lists is its own config.ProductPolicy, so its own program; unset,
this machine's choice from cpu_tuning.policy_for). Prints a table and writes
benchmarks/results/verify_cost.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax import cpu_tuning
from eagle3_jax.checkpoints import load_target
from eagle3_jax.config import ProductPolicy
from eagle3_jax.models import target as tgt
from eagle3_jax.paths import cpu_model

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
    ap.add_argument(
        "--row-products",
        default=None,
        help="comma list of ProductPolicy.row_products settings to compare (0: plain "
        "matrix products only), e.g. 8,0; default: this machine's choice (cpu_tuning)",
    )
    ap.add_argument(
        "--logit-reduce",
        default=None,
        help="comma list of ProductPolicy.logit_reduce settings to compare (0: the plain "
        "product), e.g. 8,0; default: this machine's choice (cpu_tuning)",
    )
    args = ap.parse_args()
    if args.row_products is None or args.logit_reduce is None:
        mine = cpu_tuning.policy_for()
        if args.row_products is None:
            args.row_products = str(mine.row_products)
        if args.logit_reduce is None:
            args.logit_reduce = str(mine.logit_reduce)
    target = load_target(args.target)
    cfg = target.cfg

    def make_step(s):
        step_cfg = dataclasses.replace(cfg, products=ProductPolicy(*s))

        @jax.jit
        def step(params, tokens, cache, start):
            t = tokens.shape[1]
            pos = start[:, None] + jnp.arange(t)[None, :]
            mask = jnp.arange(args.slots)[None, None, :] <= pos[:, :, None]
            return tgt.forward(params, tokens, pos, mask, step_cfg, cache, start)

        return step

    # each setting (row_products, logit_reduce) is its own program; the settings are timed in
    # turn, rep by rep, so they see the same machine
    settings = [
        (int(r), int(g)) for r in args.row_products.split(",") for g in args.logit_reduce.split(",")
    ]
    steps = {s: make_step(s) for s in settings}

    def call(s, tokens):
        return steps[s](target.params, tokens, cache, start)

    cache = tgt.make_cache(cfg, 1, args.slots)
    start = jnp.full((1,), args.context, jnp.int32)
    rng = np.random.default_rng(0)
    rows = []
    sizes = sorted({int(x) for x in args.sizes.split(",")} | {1})  # T = 1 is the unit
    for t in sizes:
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, t)), jnp.int32)
        for s in settings:
            jax.block_until_ready(call(s, tokens))
        times = {s: [] for s in settings}
        for _ in range(args.reps):
            for s in settings:
                t0 = time.perf_counter()
                jax.block_until_ready(call(s, tokens).logits)
                times[s].append(time.perf_counter() - t0)
        for s in settings:
            rows.append(
                {
                    "tokens": t,
                    "row_products_max": s[0],
                    "logit_reduce_max": s[1],
                    "ms": 1e3 * float(np.median(times[s])),
                }
            )

    def key(r):
        return r["row_products_max"], r["logit_reduce_max"]

    unit = {key(r): r["ms"] for r in rows if r["tokens"] == 1}
    print(f"target forward over T new tokens, context {args.context}, fp32, batch 1")
    print(
        f"{'T':>4} {'rows<=':>6} {'logit<=':>7} {'ms':>8} {'cost/T=1':>9} {'T/cost':>7} "
        f"{'vs first T=1':>12}"
    )
    for r in rows:
        r["relative"] = r["ms"] / unit[key(r)]
        r["ceiling"] = r["tokens"] / r["relative"]
        r["relative_to_first"] = r["ms"] / unit[settings[0]]
        print(
            f"{r['tokens']:>4} {r['row_products_max']:>6} {r['logit_reduce_max']:>7} "
            f"{r['ms']:>8.1f} {r['relative']:>9.2f} {r['ceiling']:>7.2f} "
            f"{r['relative_to_first']:>12.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": cpu_model(),
        "cpus": jax.local_device_count(),
        "jax": jax.__version__,
        "context": args.context,
        "reps": args.reps,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "row_products": sorted({s[0] for s in settings}),
        "logit_reduce": sorted({s[1] for s in settings}),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
