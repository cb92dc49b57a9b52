"""Helpers that more than one test file uses (their fixtures are in conftest.py): a hand-made draft
pool, and the speculative engine on raw params with its trees and random prompts."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from eagle3_jax.checkpoints import Target
from eagle3_jax.checkpoints.heads import Head
from eagle3_jax.decoding.generate import DecodeOptions, generate_ids
from eagle3_jax.decoding.tree import TreeConfig

CHAIN = TreeConfig(top_k=1, depth=4, total_tokens=5)
TREE = TreeConfig(top_k=3, depth=3, total_tokens=9)


def draft_pool():
    """A pool of drafted nodes -> (tokens, parent, score), each [7].

    level 1: pool 0 (a, -0.1), 1 (b, -1.0); level 2 children of 0: 2 (c, -0.3), 3 (d, -2.0);
    children of 1: 4 (e, -1.2), 5 (f, -3.0); level 3 child of 2: 6 (g, -0.5)."""
    tokens = jnp.array([10, 11, 12, 13, 14, 15, 16])
    parent = jnp.array([-1, -1, 0, 0, 1, 1, 2])
    score = jnp.array([-0.1, -1.0, -0.3, -2.0, -1.2, -3.0, -0.5])
    return tokens, parent, score


def spec_generate(params, cfg, dparams, dcfg, vocab, prompts, new, tree, method="eagle3", **kw):
    """The speculative engine through the one entry (`generate_ids`), on raw params."""
    opts = DecodeOptions(method, new, tree, same_engine=True, **kw)
    return generate_ids(Target(params, cfg, None, None), Head(dparams, dcfg, vocab), prompts, opts)


def random_prompts(v, lengths, seed=0):
    """Prompts of the given lengths, ids drawn from 3..v-1 (no pad, BOS or EOS)."""
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, v, size=n))) for n in lengths]


def load_script(relative: str):
    """A script of the repository (benchmarks/x.py, scripts/x.py) imported as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spec_prefill(spec_setup, prompts, new, tree, eos_ids=(), **kw):
    """The speculative engine's state after the prefill of `prompts` on the spec_setup fixture's
    target and head (raw params), sized as decoding sizes a request -> (state, shape)."""
    import jax

    from eagle3_jax.decoding import plain
    from eagle3_jax.decoding import speculative as spec
    from eagle3_jax.decoding.sampling import Sampling

    params, cfg, dparams, dcfg, vocab = spec_setup
    req = plain.prepare(cfg, prompts, new, eos_ids, None, 0, tree.round_slots + 1)
    state = spec.prefill(
        params, dparams, params["embed"], vocab, req.tokens, req.lengths, req.limit,
        jax.random.PRNGKey(0), cfg, dcfg, req.shape, tree, Sampling(), req.eos, **kw,
    )  # fmt: skip
    return state, req.shape


def rec(qid, method, seed, new, fw, wall, hist=None, task="t", gens=1, out=None):
    """One harness record (evaluation/records.py's fields) of question `qid`: `new` tokens in
    `fw` target passes and `wall` seconds; `out` its output ids (default [[qid]])."""
    return {
        "question_id": qid,
        "task": task,
        "method": method,
        "seed": seed,
        "new_tokens": new,
        "target_forwards": fw,
        "num_generations": gens,
        "wall_time_s": wall,
        "accept_hist": hist,
        "output_ids": out if out is not None else [[qid]],
    }
