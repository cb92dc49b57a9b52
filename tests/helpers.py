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


def family_tokens(b, t, v, seed=0):
    """Random token ids [b, t] in 3..v-1 (no pad, bos or eos), int32."""
    return np.random.default_rng(seed).integers(3, v, size=(b, t)).astype(np.int32)


def assert_forward_matches_transformers(model, params, cfg, toks, tol=1e-4):
    """Our full forward of `toks` against transformers' `model` (fp32): logits and every hidden
    state (the embedding output first) within `tol`. -> (ours, transformers' output), for the
    caller's further checks (a hook registered on `model` sees this call)."""
    import torch

    from eagle3_jax.models import target as tgt

    with torch.no_grad():
        ref = model(torch.tensor(toks, dtype=torch.long), output_hidden_states=True)
    aux_ids = tuple(range(cfg.num_layers + 1))
    out = tgt.full_forward(params, jnp.asarray(toks), cfg, aux_ids)
    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), rtol=tol, atol=tol)
    d = cfg.hidden_size
    for i in aux_ids:
        np.testing.assert_allclose(
            np.asarray(out.aux[..., i * d : (i + 1) * d]),
            ref.hidden_states[i].numpy(),
            rtol=tol,
            atol=tol,
            err_msg=f"hidden_states[{i}]",
        )
    return out, ref


def forward_seeing_routers(model, params, cfg, toks, router: str, layers):
    """`assert_forward_matches_transformers`, recording what transformers' router module
    (`layer.mlp.<router>`) of each of `layers` took and gave: -> (ours, {layer: (input, output)})."""
    seen = {}
    hooks = [
        getattr(model.model.layers[i].mlp, router).register_forward_hook(
            lambda mod, inp, out, i=i: seen.__setitem__(i, (inp[0], out))
        )
        for i in layers
    ]
    try:
        out, _ = assert_forward_matches_transformers(model, params, cfg, toks)
    finally:
        for h in hooks:
            h.remove()
    return out, seen


def assert_stepwise_decode_equals_full_forward(params, cfg, toks, prompt, slots, aux_ids, stacked):
    """A `prompt`-token prefill of `toks` [B, T] into a cache of `slots`, then one token a step to
    T: the logits and aux states equal one full forward's (1e-4), unrolled or with the layers
    stacked for the scan."""
    import jax

    from eagle3_jax.models import target as tgt
    from eagle3_jax.models.layers import causal_mask

    b, t = toks.shape
    full = tgt.full_forward(params, toks, cfg, aux_ids)
    step = jax.jit(tgt.forward, static_argnames=("cfg", "aux_ids"))
    p = tgt.stack_layers(params) if stacked else params
    cache = tgt.make_cache(cfg, b, slots, stacked=stacked)
    cursor = jnp.zeros((b,), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (b, prompt))
    mask = causal_mask(cursor, prompt, slots)  # the layers add their windows
    out = step(p, toks[:, :prompt], pos, mask, cfg, cache, cursor, aux_ids)
    logits, aux, cursor = [out.logits], [out.aux], cursor + prompt
    for i in range(prompt, t):
        mask = causal_mask(cursor, 1, slots)
        out = step(p, toks[:, i : i + 1], cursor[:, None], mask, cfg, out.cache, cursor, aux_ids)
        logits.append(out.logits)
        aux.append(out.aux)
        cursor = cursor + 1
    np.testing.assert_allclose(np.concatenate(logits, 1), full.logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.concatenate(aux, 1), full.aux, rtol=1e-4, atol=1e-4)


def hf_greedy(model, prompt, n):
    """transformers' greedy `generate` of exactly n tokens after `prompt` (no EOS stop)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n, pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def assert_random_head_decodes_plainly(params, cfg, prompts, new=24):
    """A random head over a 60-id draft vocabulary (the top of random counts, as conftest's
    spec_setup): greedy speculative decoding of `prompts` with CHAIN and TREE gives plain
    decoding's tokens."""
    import jax

    from eagle3_jax.decoding import plain
    from eagle3_jax.models import draft as drf
    from eagle3_jax.vocab import build_from_counts

    vocab = build_from_counts(np.random.default_rng(1).integers(0, 100, cfg.vocab_size), 60)
    dcfg = drf.DraftConfig.from_target(cfg, draft_vocab_size=60)
    dparams = drf.init_params(dcfg, jax.random.PRNGKey(0), scale=0.2)
    ref = plain.generate(params, cfg, prompts, new, eos_ids=())
    for tree in (CHAIN, TREE):
        out = spec_generate(params, cfg, dparams, dcfg, vocab, prompts, new, tree, eos_ids=())
        assert out.output_ids == ref.output_ids, tree
