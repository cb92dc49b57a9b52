#!/usr/bin/env python
"""Speculative decoding on the CPU: vanilla vs pld vs eagle3 (chain and trees), interleaved, one run.

  .venv/bin/python benchmarks/speculative_decoding.py [--draft HEAD_DIR] [--new-tokens 128] [--reps 2]

Without --draft the head is randomly initialised (acceptance near zero: this measures the machinery's
overhead, the floor a trained head must beat). Greedy, batch 1, fp32. Every method runs each prompt
once per rep, methods interleaved per prompt, after a warm-up that compiles every program. Speedup is
the ratio of summed wall times against `vanilla` (our plain decoding loop) from the same run. Prints a
table and writes benchmarks/results/speculative_decoding[_<tag>].json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
from pathlib import Path

import jax
import numpy as np

from eagle3_jax import cpu_tuning
from eagle3_jax.checkpoints import load_target
from eagle3_jax.checkpoints.heads import Head
from eagle3_jax.decoding.generate import DecodeOptions, generate_ids
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.evaluation import metrics
from eagle3_jax.models import draft as drf
from eagle3_jax.prompts import encode_chat
from eagle3_jax.vocab import build_from_counts

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works and when to use one instead of a list.",
    "Summarise this: The city council met on Tuesday to discuss the new park. The council agreed that "
    "the new park will open in May. The new park will have a playground, a pond and a cafe. Residents "
    "asked the council to keep the new park open late in summer.",
]
CONFIGS = [  # name, method, TreeConfig
    ("vanilla", "vanilla", None),
    ("vanilla (spec engine)", "vanilla", TreeConfig(1, 1, 1)),
    ("pld chain d4", "pld", TreeConfig(1, 4, 5)),
    ("eagle3 chain d2", "eagle3", TreeConfig(1, 2, 3)),
    ("eagle3 chain d3", "eagle3", TreeConfig(1, 3, 4)),
    ("eagle3 chain d4", "eagle3", TreeConfig(1, 4, 5)),
    ("eagle3 tree k2 d3 n6", "eagle3", TreeConfig(2, 3, 6)),
    ("eagle3 tree k2 d3 n8", "eagle3", TreeConfig(2, 3, 8)),
    ("eagle3 tree k4 d4 n16", "eagle3", TreeConfig(4, 4, 16)),
    ("eagle3 tree k4 d5 n24", "eagle3", TreeConfig(4, 5, 24)),
]


def table_rows(records: dict[str, list[dict]]) -> list[dict]:
    """One row per CONFIGS entry from its records (the harness's record fields): τ, throughput
    and speedup against `vanilla`'s records of the same run (eagle3_jax.evaluation.metrics),
    acceptance by depth, and whether every output equals vanilla's."""
    rows = []
    for name, method, tree in CONFIGS:
        recs = records[name]
        rows.append(
            {
                "name": name,
                "method": method,
                "tree": None if tree is None else tree.__dict__,
                "tau": metrics.tau(recs),
                "tokens_per_s": metrics.throughput(recs),
                "speedup": metrics.speedup(recs, records["vanilla"]),
                "alpha_by_depth": metrics.acceptance_by_depth(recs) or [],
                "identical_to_vanilla": metrics.exactness(recs, records["vanilla"]) == 1.0,
                "wall_s": sum(r["wall_time_s"] for r in recs),
                "tokens": sum(r["new_tokens"] for r in recs),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None, help="EAGLE-3 head dir (default: a random head)")
    ap.add_argument("--draft-vocab", type=int, default=16384, help="Vd of the random head")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tag", default="random_head")
    args = ap.parse_args()

    target = load_target(args.target)
    products = cpu_tuning.policy_for()  # as decode.py: this machine's few-row products
    target = target._replace(cfg=dataclasses.replace(target.cfg, products=products))
    cfg = target.cfg
    if args.draft:
        from eagle3_jax.checkpoints.heads import load_head

        head = load_head(args.draft, target)
    else:
        counts = np.random.default_rng(0).integers(1, 1000, cfg.vocab_size)
        vocab = build_from_counts(counts, args.draft_vocab)
        dcfg = drf.DraftConfig.from_target(
            cfg, draft_vocab_size=args.draft_vocab, products=products
        )
        head = Head(drf.init_params(dcfg, jax.random.PRNGKey(0)), dcfg, vocab)
    prompts = [encode_chat(target.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    n = args.new_tokens

    def run(method, tree, ids):
        # no tree: plain decoding's loop; a tree: the speculative engine (vanilla's root alone)
        opts = DecodeOptions(method, n, tree or TreeConfig(), same_engine=tree is not None)
        r = generate_ids(target, head, [ids], opts)
        hist = None if r.accept_hist is None else r.accept_hist[0]
        return r.output_ids[0], r.target_forwards[0], r.wall_time_s, hist

    for _, method, tree in CONFIGS:  # warm-up: compile every program (each prompt-length bucket)
        for ids in prompts:
            run(method, tree, ids)
    records = {name: [] for name, _, _ in CONFIGS}
    for seed in range(args.reps):
        for i, ids in enumerate(prompts):
            for name, method, tree in CONFIGS:
                out, fw, wall, hist = run(method, tree, ids)
                records[name].append(
                    {
                        "question_id": i,
                        "seed": seed,
                        "output_ids": out,
                        "new_tokens": len(out),
                        "target_forwards": fw,
                        "wall_time_s": wall,
                        "accept_hist": hist,
                    }
                )
    rows = table_rows(records)
    print(
        f"\n{len(prompts)} prompts x {args.reps} reps, {n} new tokens, greedy, batch 1, fp32, "
        f"head: {args.draft or f'random (Vd {args.draft_vocab})'}\n"
    )
    print(
        "| method | tau | tokens/s | speedup vs vanilla | alpha by depth | identical to vanilla |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        a = " ".join(f"{x:.2f}" for x in row["alpha_by_depth"]) or "-"
        print(
            f"| {row['name']} | {row['tau']:.2f} | {row['tokens_per_s']:.1f} | "
            f"{row['speedup']:.2f}x | {a} | {row['identical_to_vanilla']} |"
        )
    out = Path(f"benchmarks/results/speculative_decoding_{args.tag}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "speculative_decoding",
                "draft": args.draft,
                "new_tokens": n,
                "reps": args.reps,
                "prompts": PROMPTS,
                "backend": jax.default_backend(),
                "cores": os.cpu_count(),
                "machine": platform.machine(),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
