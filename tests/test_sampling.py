"""decoding/sampling.py: the distribution sampled from matches transformers' temperature, top-k and
top-p warpers (applied in generate()'s order), draws follow it, greedy is argmax, bad settings are
refused by name."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.decoding.sampling import Sampling, log_probs, sample
from eagle3_jax.errors import Eagle3Error

SETTINGS = [
    Sampling(temperature=1.0),
    Sampling(temperature=0.7),
    Sampling(temperature=1.3, top_k=5),
    Sampling(temperature=1.0, top_p=0.9),
    Sampling(temperature=0.6, top_k=20, top_p=0.8),
    Sampling(temperature=2.0, top_k=1),
    Sampling(temperature=1.0, top_p=0.05),  # less than the top token's mass: the top token alone
]


def _transformers_probs(logits: np.ndarray, s: Sampling) -> np.ndarray:
    import torch
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(s.temperature)])
    if s.top_k:
        warpers.append(TopKLogitsWarper(s.top_k))
    if s.top_p < 1.0:
        warpers.append(TopPLogitsWarper(s.top_p))
    x = warpers(None, torch.tensor(logits))
    return torch.softmax(x, dim=-1).numpy()


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_distribution_matches_transformers_warpers(s):
    logits = np.random.default_rng(0).normal(0, 3, (4, 97)).astype(np.float32)
    want = _transformers_probs(logits, s)
    got = np.exp(np.asarray(log_probs(jnp.asarray(logits), s)))
    np.testing.assert_array_equal(got > 0, want > 0)  # the same tokens kept
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_draws_follow_the_distribution():
    """20,000 seeded draws at temperature 1.2, top-k 6, top-p 0.95: every drawn token is inside
    the support and the frequencies are within 4 standard errors of the probabilities."""
    s = Sampling(temperature=1.2, top_k=6, top_p=0.95)
    logits = jnp.asarray(np.random.default_rng(1).normal(0, 1.5, (10,)), jnp.float32)
    probs = np.exp(np.asarray(log_probs(logits, s)))
    n = 20_000
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    draws = np.asarray(jax.vmap(lambda k: sample(logits, k, s))(keys))
    assert probs[draws].min() > 0
    freq = np.bincount(draws, minlength=probs.size) / n
    se = np.sqrt(probs * (1 - probs) / n) + 1e-12
    assert np.all(np.abs(freq - probs) <= 4 * se + 1e-9), (freq, probs)
    assert np.array_equal(
        np.asarray(sample(logits, keys[0], s)), np.asarray(sample(logits, keys[0], s))
    )  # the same key draws the same token


def test_greedy_is_argmax_whatever_the_filters():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(3, 5, 31)), jnp.float32)
    for s in (Sampling(), Sampling(0.0, top_k=3, top_p=0.5)):
        assert s.greedy
        got = sample(logits, jax.random.PRNGKey(0), s)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, np.argmax(np.asarray(logits), -1))


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"temperature": -0.5}, "temperature -0.5 < 0"),
        ({"temperature": float("nan")}, "give finite numbers"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p 0.0 outside (0, 1]"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p 1.5 outside (0, 1]"),
        ({"temperature": 1.0, "top_k": -1}, "top_k -1 < 0"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, named):
    with pytest.raises(Eagle3Error, match=named.replace("(", r"\(").replace(")", r"\)")):
        Sampling(**kwargs)


def test_penalties_count_each_tree_nodes_own_path():
    """`process_logits` on a tree's nodes: node n's logits get vLLM's penalties over the row's
    output counts plus the drafted tokens on its own path (ancestors and itself below the root),
    repeated tokens counted twice, as a per-node loop computes them."""
    from eagle3_jax.decoding.sampling import Penalties, RowSampling, process_logits
    from eagle3_jax.decoding.tree import Tree

    v = 11
    parent = np.array([0, 0, 0, 1, 3, 2])  # 0 -> 1 -> 3 -> 4, 0 -> 2 -> 5
    depth = np.array([0, 1, 1, 2, 3, 2])
    n1 = len(parent)
    mask = np.zeros((n1, n1), bool)
    for i in range(n1):
        j = i
        while True:
            mask[i, j] = True
            if j == 0:
                break
            j = parent[j]
    tokens = np.array([[4, 7, 2, 7, 4, 2], [1, 3, 3, 5, 3, 9]])
    both = [jnp.asarray(np.broadcast_to(x, (2,) + x.shape)) for x in (parent, depth, mask)]
    trees = Tree(jnp.asarray(tokens), *both, score=jnp.zeros((2, n1)))
    pens = [Penalties(1.4, 0.5, 0.25), Penalties(0.8, -0.3, 0.6)]
    rows = RowSampling.of([Sampling(penalties=p) for p in pens], widths=(0, 0, v))
    counts = np.array([[0, 2, 0, 0, 1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0, 0, 3, 0, 0, 0]])
    seen = np.zeros((2, v), bool)
    seen[0, [2, 9]] = seen[1, [6]] = True
    rows = dataclasses.replace(rows, out_counts=jnp.asarray(counts), prompt_seen=jnp.asarray(seen))
    raw = np.random.default_rng(0).normal(size=(2, n1, v)).astype(np.float32) * 3
    got = np.asarray(process_logits(jnp.asarray(raw), rows, jnp.zeros((2, n1), jnp.int32), trees))
    for b, p in enumerate(pens):
        for n in range(n1):
            c = counts[b] + np.bincount(tokens[b][mask[n] & (depth >= 1)], minlength=v)
            s = seen[b] | (c > 0)
            x = raw[b, n].astype(np.float64)
            x = np.where(s, np.where(x > 0, x / p.repetition, x * p.repetition), x)
            want = x - p.frequency * c - p.presence * (c > 0)
            np.testing.assert_allclose(got[b, n], want, rtol=1e-6, atol=1e-6, err_msg=(b, n))
