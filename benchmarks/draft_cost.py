#!/usr/bin/env python
"""Drafting time per step for each head: what the draft-vocabulary methods exist to cut.

  .venv/bin/python benchmarks/draft_cost.py --draft eagle3=HEAD_A --draft specvocab=HEAD_B ...

One draft step = a tree level as decoding runs it: the head's decoder layer over `rows` sibling
rows (1: a chain; 4 / 10: the nodes a level expands), each the root's child, attending to the
context and itself, then its output layer choosing the top-k tokens of each row (own lm_head over
Vd, the target's output embedding over V, or SpecVocab's speculator + exact logits over its
candidates). Also timed alone: the output layer (norm, logits, top-k) on the level's hidden
states. The level is real: a context of MT-bench questions (about `context` tokens) prefilled
through the target and the head (`speculative.prefill`), the root's draft hidden state, its
`rows` best children as the tokens. That matters for SpecVocab, whose siblings share one
candidate gather when their candidates' union fits (`draft_output.candidate_logits`; the two
branches cost differently): each row records the union's size and capacity. The level is a
depth-2 tree's (its rows see the context and their own scratch slot; a deeper tree's cache has
more scratch slots, which the mask hides). With `--tree`, a whole round after the same context:
where the tree has a verify threshold, which levels run depends on that one context's scores.
fp32, batch 1, jitted; every head's calls are timed in turns, `reps` times, and each time is a
median (`Interleaved`: heads of the same shape then time alike beside other work). Prints a table,
writes benchmarks/results/draft_cost.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax import cpu_tuning
from eagle3_jax.checkpoints import load_target
from eagle3_jax.checkpoints.heads import load_head
from eagle3_jax.decoding import drafters, plain
from eagle3_jax.decoding import speculative as spec
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.evaluation.options import _parse_tree, parse_drafts
from eagle3_jax.evaluation.questions import BENCHES, read_questions
from eagle3_jax.models import draft as drf
from eagle3_jax.models import draft_output
from eagle3_jax.paths import cpu_model
from eagle3_jax.prompts import encode_chat

ROOT = Path(__file__).resolve().parents[1]


class Interleaved:
    """Calls timed in turns: each is compiled and warmed when added, then every repetition runs
    each call once (the order rotated by one each repetition), so load that drifts on a shared
    machine falls on every head alike; a call's time is the median of its repetitions, in ms."""

    def __init__(self):
        self.calls: list = []

    def add(self, fn, *args) -> int:
        """Registers fn(*args) (run once now: compile and warm-up); returns its index."""
        jax.block_until_ready(fn(*args))
        self.calls.append(functools.partial(fn, *args))
        return len(self.calls) - 1

    def run(self, reps: int) -> list[float]:
        times: list[list[float]] = [[] for _ in self.calls]
        n = len(self.calls)
        for rep in range(reps):
            for j in range(n):
                i = (j + rep) % n
                t0 = time.perf_counter()
                jax.block_until_ready(self.calls[i]())
                times[i].append(time.perf_counter() - t0)
        return [1e3 * float(np.median(t)) for t in times]


def union_of(params, hidden, dcfg) -> dict:
    """A SpecVocab level's candidates: distinct ids among its rows', the shared set's capacity, and
    whether the level takes the shared gather (a capacity below rows x K that holds the union)."""
    _, cand = draft_output.speculator_candidates(params, hidden, dcfg)
    r, k = hidden.shape[-2], dcfg.spec_candidates
    distinct = int(np.unique(np.asarray(cand)).size)
    cap = draft_output.union_capacity(r, k, dcfg.vocab_size)
    return {"distinct": distinct, "capacity": cap, "shared": cap < r * k and distinct <= cap}


def kind_of(dcfg) -> str:
    if dcfg.speculator_rank:
        return f"SpecVocab r{dcfg.speculator_rank} k{dcfg.spec_candidates}"
    if dcfg.lm_head_source == "target":
        return "target lm_head (V)"
    return f"own lm_head (Vd {dcfg.draft_vocab_size})"


def context_ids(tokenizer, length: int) -> list[int]:
    """A chat prompt of MT-bench first turns (one user message), as many as fit in `length`
    (the first one's first `length` ids when even it does not)."""
    qs = [q.turns[0] for q in read_questions(BENCHES["mt_bench"])]
    ids = encode_chat(tokenizer, [{"role": "user", "content": qs[0]}])[:length]
    for n in range(2, len(qs) + 1):
        more = encode_chat(tokenizer, [{"role": "user", "content": "\n\n".join(qs[:n])}])
        if len(more) > length:
            break
        ids = more
    return ids


class Level(NamedTuple):
    """A real tree level: its sibling tokens [1, R], their parent's hidden state [1, R, D], the
    draft cache after the context and the context's length [1]."""

    tokens: jax.Array
    hidden: jax.Array
    cache: dict
    length: jax.Array


def prefilled(target, head, embed, prompt: list[int], tree: TreeConfig) -> tuple:
    """The context through the target and the head as decoding's prefill runs it, sized for
    rounds of `tree` -> (the speculative state, its static shape)."""
    req = plain.prepare(target.cfg, [prompt], 8, (), None, 0, tree.round_slots + 1)
    state = spec.prefill(
        target.params, head.params, embed, head.vocab, req.tokens, req.lengths, req.limit,
        jax.random.PRNGKey(0), target.cfg, head.cfg, req.shape, tree, Sampling(), (),
    )  # fmt: skip
    return state, req.shape


def real_level(target, head, embed, prompt: list[int], rows: int) -> tuple[Level, tuple]:
    """The context prefilled (target features, the head's cache), the last pair encoded (the
    root's draft hidden state) and the root's `rows` best children: the first level of a tree.
    Returns it and its static sizes (stable slots, scratch slots)."""
    params, dcfg, vocab = head.params, head.cfg, head.vocab
    tree = TreeConfig(top_k=rows, depth=2, total_tokens=rows + 1)
    state, shape = prefilled(target, head, embed, prompt, tree)
    h0, cache = drafters._encode_pairs(params, embed, state, dcfg, shape, tree)
    _, tokens = draft_output.draft_topk(params, h0, dcfg, vocab, rows)
    hidden = jnp.broadcast_to(h0[:, None, :], (1, rows, h0.shape[-1]))
    return Level(tokens, hidden, cache, state.length), (shape.slots, tree.tree_slots)


def level_hidden(params, embed, lv: Level, dcfg, sizes: tuple) -> jax.Array:
    """The decoder layer over a level's siblings, as `drafters._level` runs it at depth 2."""
    (slots, tree_slots), r = sizes, lv.tokens.shape[1]
    stable = jnp.arange(slots)[None, :] < lv.length[:, None]  # [1, S]
    own = jnp.eye(r, tree_slots, dtype=bool)  # each sibling's scratch slot
    mask = jnp.concatenate([jnp.broadcast_to(stable, (r, slots)), own], axis=-1)[None]
    return drf.forward(
        params, embed, lv.tokens, lv.hidden, jnp.broadcast_to(lv.length[:, None], (1, r)), mask,
        dcfg, lv.cache, jnp.full((1,), slots, jnp.int32), compute_logits=False,
        target_features=False,
    ).hidden  # fmt: skip


def round_call(target, head, embed, prompt: list[int], tree: TreeConfig) -> tuple:
    """A whole drafting round as decoding runs it (`drafters.eagle3_drafter`: the last pairs
    encoded, the root's children, depth - 1 levels, the tree selected) after the context's
    prefill -> (fn, *args) for `Interleaved.add`."""
    state, shape = prefilled(target, head, embed, prompt, tree)
    fn = jax.jit(drafters.eagle3_drafter, static_argnames=("dcfg", "shape", "tree"))
    run = functools.partial(fn, dcfg=head.cfg, shape=shape, tree=tree)
    return run, head.params, embed, head.vocab, state


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", action="append", required=True, help="[NAME=]HEAD (repeatable)")
    ap.add_argument("--rows", default="1,4,10")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--context", type=int, default=320, help="context tokens, at most")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument(
        "--tree", default=None, help="TOP_K,DEPTH,TOTAL[,THRESHOLD]: also time a whole round"
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/draft_cost.json"))
    args = ap.parse_args()
    target = load_target(args.target)
    # as decode.py: this machine's few-row products (load_head gives the heads the target's)
    products = cpu_tuning.policy_for()
    target = target._replace(cfg=dataclasses.replace(target.cfg, products=products))
    rows_list = [int(x) for x in args.rows.split(",")]
    tree = TreeConfig(*_parse_tree(args.tree, "--tree")) if args.tree else None
    extra = max(2 * max(rows_list), tree.round_slots + 1 if tree else 0)  # the level, the round
    room = target.cfg.max_position_embeddings - extra - 16  # and the prefill's new tokens
    prompt = context_ids(target.tokenizer, min(args.context, room))
    results, timer, slots = [], Interleaved(), []  # slots: (row, key, call index)
    for name, path in parse_drafts(args.draft).items():
        head = load_head(path, target)
        params, dcfg, vocab = head.params, head.cfg, head.vocab
        emb = target.params["embed"] if head.embed is None else head.embed
        k = min(args.top_k, dcfg.draft_choices)

        @functools.partial(jax.jit, static_argnums=2)
        def step(params, lv, sizes, dcfg=dcfg, vocab=vocab, k=k, emb=emb):
            return draft_output.draft_topk(
                params, level_hidden(params, emb, lv, dcfg, sizes), dcfg, vocab, k
            )

        @jax.jit
        def output(params, hidden, dcfg=dcfg, vocab=vocab, k=k):
            return draft_output.draft_topk(params, hidden, dcfg, vocab, k)

        row = {"head": name, "path": str(path), "kind": kind_of(dcfg), "top_k": k}
        for r in rows_list:
            lv, sizes = real_level(target, head, emb, prompt, r)
            slots.append((row, f"step_ms_rows{r}", timer.add(step, params, lv, sizes)))
            hidden = jax.jit(level_hidden, static_argnums=(3, 4))(params, emb, lv, dcfg, sizes)
            slots.append((row, f"output_ms_rows{r}", timer.add(output, params, hidden)))
            if dcfg.speculator_rank:
                row[f"union_rows{r}"] = union_of(params, hidden, dcfg)
        if tree is not None:
            slots.append((row, "round_ms", timer.add(*round_call(target, head, emb, prompt, tree))))
        results.append(row)
    ms = timer.run(args.reps)  # every head's calls in turns
    for row, key, i in slots:
        row[key] = ms[i]
    print(f"one draft step (layer + output top-{args.top_k}), context {len(prompt)}, fp32, ms")
    head = f"{'head':<14} {'kind':<28}" + "".join(
        f" {'step r' + str(r):>9} {'out r' + str(r):>8}" for r in rows_list
    )
    print(head + (f" {'round ' + args.tree:>16}" if tree else ""))
    for row in results:
        print(
            f"{row['head']:<14} {row['kind']:<28}"
            + "".join(
                f" {row[f'step_ms_rows{r}']:>9.2f} {row[f'output_ms_rows{r}']:>8.2f}"
                for r in rows_list
            )
            + (f" {row['round_ms']:>16.2f}" if tree else "")
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": cpu_model(), "jax": jax.__version__}
    meta.update(context=len(prompt), reps=args.reps, rows=rows_list, tree=args.tree)
    meta["timing"] = "interleaved"  # every head's calls in turns, medians (Interleaved)
    out.write_text(json.dumps({"meta": meta, "rows": results}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
