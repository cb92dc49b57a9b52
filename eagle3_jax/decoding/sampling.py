"""Turning logits into tokens: greedy, temperature, top-k, top-p (shared by plain and speculative decoding)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from eagle3_jax.errors import Eagle3Error


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and math.isfinite(self.top_p)):
            raise Eagle3Error(
                f"temperature {self.temperature} / top_p {self.top_p}: give finite numbers"
            )
        if self.temperature < 0:
            raise Eagle3Error(
                f"temperature {self.temperature} < 0: use 0 for greedy or a positive value"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise Eagle3Error(f"top_p {self.top_p} outside (0, 1]")
        if self.top_k < 0:
            raise Eagle3Error(f"top_k {self.top_k} < 0: use 0 to disable")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def log_probs(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """The distribution actually sampled from, as log-probs (-inf outside top-k / top-p), fp32."""
    x = logits.astype(jnp.float32) / max(sampling.temperature, 1e-6)
    if sampling.top_k > 0 and sampling.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, sampling.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if sampling.top_p < 1.0:
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
        cutoff = jnp.min(
            jnp.where(before < sampling.top_p, sorted_x, jnp.inf), axis=-1, keepdims=True
        )
        x = jnp.where(x < cutoff, -jnp.inf, x)
    return jax.nn.log_softmax(x, axis=-1)


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """[..., V] logits -> [...] int32 tokens."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, log_probs(logits, sampling), axis=-1).astype(jnp.int32)
