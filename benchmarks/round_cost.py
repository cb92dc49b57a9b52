#!/usr/bin/env python
"""What a speculative round costs, in plain decoding steps, on the embedded default and its head.

  .venv/bin/python benchmarks/round_cost.py [--new 200] [--reps 3] [--context 300] [--out F]

Generates `new` tokens after a `context`-token prompt (random ids, fixed seed) with plain decoding
and with each configuration below through the speculative engine, `reps` times in turn (the first
pass also compiles), and reports medians: ms per round, τ (tokens per round), tree tokens verified
per round, a round's cost in plain steps and the resulting speedup (τ / cost). The `vanilla`
row verifies the root alone: what the engine adds to a plain step. Prints a table and writes
benchmarks/results/round_cost.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from eagle3_jax import cpu_tuning
from eagle3_jax.checkpoints import load_target
from eagle3_jax.checkpoints.heads import load_head
from eagle3_jax.decoding.generate import DecodeOptions, generate_ids
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.paths import cpu_model

ROOT = Path(__file__).resolve().parents[1]
HEAD = ROOT / "eagle3_jax/heads/smollm2_135m_instruct"
CONFIGS = "eagle3:1,3,4,eagle3:2,3,4,eagle3:2,4,8,eagle3:2,3,4,0.3,eagle3:2,4,8,0.3"


def parse(text: str) -> list[tuple[str, str, TreeConfig]]:
    from eagle3_jax.evaluation.options import parse_methods

    # the root-only round always runs first (main): a `vanilla` in the list adds nothing
    return [
        (m.label, m.kind, TreeConfig(*m.tree))
        for m in parse_methods(text, {"head": str(HEAD)})
        if m.kind != "vanilla"
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/round_cost.json"))
    args = ap.parse_args()
    target = load_target(None)
    # as decode.py: this machine's few-row products, the head cut to its vocab_order.json's cpu_size on a CPU
    products = cpu_tuning.policy_for()
    target = target._replace(cfg=dataclasses.replace(target.cfg, products=products))
    head = load_head(HEAD, target, draft_vocab="auto")
    rng = np.random.default_rng(0)
    prompt = [list(map(int, rng.integers(100, 20000, args.context)))]
    configs = [("vanilla", "vanilla", TreeConfig(1, 1, 2))] + parse(args.configs)
    times: dict[str, list] = {"plain": []}
    for rep in range(args.reps + 1):  # rep 0 compiles
        plain = DecodeOptions("vanilla", args.new, eos_ids=())
        res = generate_ids(target, None, prompt, plain)
        if rep:
            times["plain"].append(res.wall_time_s / args.new)
        for label, kind, tree in configs:
            # vanilla here: the root-only round, through the speculative engine
            opts = DecodeOptions(kind, args.new, tree, eos_ids=(), same_engine=True)
            out = generate_ids(target, head, prompt, opts)
            rounds = out.target_forwards[0] - 1
            if rep:
                times.setdefault(label, []).append(
                    (out.wall_time_s / rounds, args.new / rounds, out.verified_tokens[0] / rounds)
                )
    step = float(np.median(times["plain"]))
    rows = [{"config": "plain", "ms_per_round": 1e3 * step, "tau": 1.0, "verified": 1.0}]
    for label, *_ in configs:
        ms, tau, ver = np.median(np.asarray(times[label]), axis=0)
        rows.append({"config": label, "ms_per_round": 1e3 * ms, "tau": tau, "verified": ver})
    print(f"{args.context}-token prompt, {args.new} new tokens, medians of {args.reps} runs")
    print(
        f"{'config':<22} {'ms/round':>9} {'tau':>5} {'verified':>8} {'plain steps':>11} {'speedup':>8}"
    )
    for r in rows:
        r["plain_steps"] = r["ms_per_round"] / (1e3 * step)
        r["speedup"] = r["tau"] / r["plain_steps"]
        print(
            f"{r['config']:<22} {r['ms_per_round']:>9.1f} {r['tau']:>5.2f} {r['verified']:>8.2f} "
            f"{r['plain_steps']:>11.2f} {r['speedup']:>7.2f}x"
        )
    meta = {
        "machine": cpu_model(),
        "jax": jax.__version__,
        "row_products_max": products.row_products,
        "context": args.context,
        "new": args.new,
        "reps": args.reps,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
