#!/usr/bin/env python
"""Drafting time per step for each head: what the draft-vocabulary methods exist to cut.

  .venv/bin/python benchmarks/draft_cost.py --draft eagle3=HEAD_A --draft specvocab=HEAD_B ...

One draft step = the head's decoder layer over `rows` new rows (1: a chain; 4 / 10: the nodes a
tree level expands) attending to a cache of `context` slots, then its output layer choosing the
top-k tokens of each row (own lm_head over Vd, the target's output embedding over V, or SpecVocab's
speculator + exact logits over its candidates). Also timed alone: the output layer (norm, logits,
top-k). fp32, batch 1, jitted, medians of `reps`. Prints a table, writes
benchmarks/results/draft_cost.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax import cpu_tuning
from eagle3_jax.checkpoints import load_target
from eagle3_jax.checkpoints.heads import load_head
from eagle3_jax.evaluation.options import parse_drafts
from eagle3_jax.models import draft as drf
from eagle3_jax.models import draft_output
from eagle3_jax.paths import cpu_model

ROOT = Path(__file__).resolve().parents[1]


def _median_ms(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def kind_of(dcfg) -> str:
    if dcfg.speculator_rank:
        return f"SpecVocab r{dcfg.speculator_rank} k{dcfg.spec_candidates}"
    if dcfg.lm_head_source == "target":
        return "target lm_head (V)"
    return f"own lm_head (Vd {dcfg.draft_vocab_size})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", action="append", required=True, help="[NAME=]HEAD (repeatable)")
    ap.add_argument("--rows", default="1,4,10")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/draft_cost.json"))
    args = ap.parse_args()
    target = load_target(args.target)
    # as decode.py: this machine's few-row products (load_head gives the heads the target's)
    products = cpu_tuning.policy_for()
    target = target._replace(cfg=dataclasses.replace(target.cfg, products=products))
    rows_list = [int(x) for x in args.rows.split(",")]
    results = []
    for name, path in parse_drafts(args.draft).items():
        params, dcfg, vocab, embed = load_head(path, target)
        emb = target.params["embed"] if embed is None else embed
        k = min(args.top_k, dcfg.spec_candidates if dcfg.speculator_rank else dcfg.draft_vocab_size)
        slots = args.context + max(rows_list)

        @jax.jit
        def step(params, tokens, hidden, cache, dcfg=dcfg, vocab=vocab, k=k):
            r = tokens.shape[1]
            pos = jnp.full((1, r), args.context, jnp.int32)
            mask = jnp.arange(slots)[None, None, :] <= args.context + jnp.arange(r)[None, :, None]
            out = drf.forward(
                params, emb, tokens, hidden, pos, mask, dcfg, cache,
                jnp.full((1,), args.context, jnp.int32), compute_logits=False,
                target_features=False,
            )  # fmt: skip
            return draft_output.draft_topk(params, out.hidden, dcfg, vocab, k)

        @jax.jit
        def output(params, hidden, dcfg=dcfg, vocab=vocab, k=k):
            return draft_output.draft_topk(params, hidden, dcfg, vocab, k)

        cache = drf.make_cache(dcfg, 1, slots)
        row = {"head": name, "path": str(path), "kind": kind_of(dcfg), "top_k": k}
        for r in rows_list:
            tokens = jnp.asarray(np.random.default_rng(r).integers(0, dcfg.vocab_size, (1, r)))
            hidden = jax.random.normal(jax.random.PRNGKey(r), (1, r, dcfg.hidden_size))
            row[f"step_ms_rows{r}"] = _median_ms(
                step, params, tokens, hidden, cache, reps=args.reps
            )
            row[f"output_ms_rows{r}"] = _median_ms(output, params, hidden, reps=args.reps)
        results.append(row)
    print(f"one draft step (layer + output top-{args.top_k}), context {args.context}, fp32, ms")
    head = f"{'head':<14} {'kind':<28}" + "".join(
        f" {'step r' + str(r):>9} {'out r' + str(r):>8}" for r in rows_list
    )
    print(head)
    for row in results:
        print(
            f"{row['head']:<14} {row['kind']:<28}"
            + "".join(
                f" {row[f'step_ms_rows{r}']:>9.2f} {row[f'output_ms_rows{r}']:>8.2f}"
                for r in rows_list
            )
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": cpu_model(), "jax": jax.__version__}
    meta.update(context=args.context, reps=args.reps, rows=rows_list)
    out.write_text(json.dumps({"meta": meta, "rows": results}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
