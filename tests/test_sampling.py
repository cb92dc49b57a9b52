"""decoding/sampling.py: the distribution sampled from matches transformers' temperature, top-k and
top-p warpers (applied in generate()'s order), draws follow it, greedy is argmax, bad settings are
refused by name."""

from __future__ import annotations

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
