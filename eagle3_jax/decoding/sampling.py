"""Turning logits into tokens: greedy, temperature, top-k, top-p (shared by plain and speculative decoding).

`Sampling` is the settings of one decode (static in plain decoding's programs). The speculative
engine keeps them per row as runtime arrays (`RowSampling`, in `SpecState.sampling`), so rows of
one batch may sample differently (a greedy row next to sampled ones, each its own temperature,
top-k and top-p: the serving slots) without a compile per setting; its compiled programs keep
only `Sampling.greedy` static (a batch that never samples skips the sampling code).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Each row's settings as arrays: temperature [B] float32 (0: greedy), top_k [B] int32
    (0: off), top_p [B] float32 (1: off), and ignore_eos [B] bool (vLLM's request setting: an
    EOS token is emitted and decoding goes on, to the row's limit).

    The target's logits are processed first (`process_logits`), as OpenAI's and vLLM's requests
    ask: `bias` [B, K] float32 added at token ids `bias_ids` [B, K] (`logit_bias`), and the ids
    `ban_ids` [B, K2] (EOS and a request's stop token ids) barred while fewer than `min_tokens`
    [B] tokens have been emitted. K and K2 are static (0 outside serving: nothing runs);
    unused entries hold `NO_ID`."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    ignore_eos: jax.Array
    bias_ids: jax.Array
    bias: jax.Array
    min_tokens: jax.Array
    ban_ids: jax.Array

    @classmethod
    def fill(cls, sampling: Sampling, batch: int, widths: tuple[int, int] = (0, 0)) -> RowSampling:
        """`sampling` for every one of `batch` rows, no logit processing, room for `widths` =
        (K, K2) entries of bias and barred ids."""
        return cls.of([sampling] * batch, widths=widths)

    @classmethod
    def of(cls, rows: list[Sampling], ignore_eos: list[bool] | None = None,
           logit_bias: list[dict[int, float]] | None = None,
           min_tokens: list[int] | None = None, ban: list[tuple[int, ...]] | None = None,
           widths: tuple[int, int] = (0, 0)) -> RowSampling:  # fmt: skip
        """One row per `Sampling` (each validated on construction); per row, `ignore_eos` its
        flag (default False), `logit_bias` {token id: bias} (at most K = widths[0] entries),
        `min_tokens` and `ban` the ids barred until then (at most K2 = widths[1])."""
        b = len(rows)
        bias_ids, bias = np.full((b, widths[0]), NO_ID, np.int32), np.zeros((b, widths[0]))
        ban_ids = np.full((b, widths[1]), NO_ID, np.int32)
        for i, (biased, barred) in enumerate(zip(logit_bias or [{}] * b, ban or [()] * b)):
            if len(biased) > widths[0] or len(barred) > widths[1]:
                raise Eagle3Error(f"{len(biased)} logit biases and {len(barred)} barred ids: "
                                  f"room for {widths[0]} and {widths[1]}")  # fmt: skip
            bias_ids[i, : len(biased)] = list(biased)
            bias[i, : len(biased)] = list(biased.values())
            ban_ids[i, : len(barred)] = barred
        return cls(
            jnp.asarray([s.temperature for s in rows], jnp.float32),
            jnp.asarray([s.top_k for s in rows], jnp.int32),
            jnp.asarray([s.top_p for s in rows], jnp.float32),
            jnp.asarray(ignore_eos or [False] * b, jnp.bool_),
            jnp.asarray(bias_ids),
            jnp.asarray(bias, jnp.float32),
            jnp.asarray(min_tokens or [0] * b, jnp.int32),
            jnp.asarray(ban_ids),
        )


NO_ID = np.iinfo(np.int32).max  # an unused bias or barred entry: out of range, dropped


def process_logits(logits_BXV: jax.Array, rows: RowSampling, emitted_BX: jax.Array) -> jax.Array:
    """The target's logits [B, ..., V] as a request's settings change them before sampling:
    each row's `bias` added at `bias_ids`, then its `ban_ids` at -inf where the token these
    logits choose would be emitted before `min_tokens` (`emitted_BX` [B, ...]: how many tokens
    the row has emitted before it). Two scatters of K and K2 entries a position (no pass over
    the vocabulary, no branch: a conditional would cost a GPU a host round trip); returned as
    given when K and K2 are 0 (static)."""
    b, k, k2 = logits_BXV.shape[0], rows.bias_ids.shape[1], rows.ban_ids.shape[1]
    if k:
        logits_BXV = jax.vmap(lambda x, ids, v: x.at[..., ids].add(v.astype(x.dtype), mode="drop"))(
            logits_BXV, rows.bias_ids, rows.bias
        )
    if k2:  # scatter-min: -inf where the row is short of min_tokens, else +inf (no change)
        short = emitted_BX < rows.min_tokens.reshape((b,) + (1,) * (emitted_BX.ndim - 1))
        floor = jnp.where(short, -jnp.inf, jnp.inf).astype(logits_BXV.dtype)[..., None]
        logits_BXV = jax.vmap(
            lambda x, ids, f: x.at[..., ids].min(
                jnp.broadcast_to(f, f.shape[:-1] + ids.shape), mode="drop"
            )  # fmt: skip
        )(logits_BXV, rows.ban_ids, floor)
    return logits_BXV


def row_log_probs(logits_BXV: jax.Array, rows: RowSampling) -> jax.Array:
    """`log_probs` with each row's own settings ([B, ..., V] logits, rows [B]); fp32. Top-k is a
    rank mask over the sorted logits (a per-row k, the shapes static); a row whose filters are
    off gets exactly its unfiltered log-softmax (`jnp.where`, not arithmetic), as `log_probs`
    gives it. The sort runs only when some row filters."""
    x_ = logits_BXV.astype(jnp.float32)
    extra = (1,) * (x_.ndim - 1)
    t = rows.temperature.reshape((-1,) + extra)
    k = rows.top_k.reshape((-1,) + extra)
    p = rows.top_p.reshape((-1,) + extra)
    x = x_ / jnp.maximum(t, 1e-6)
    v = x.shape[-1]

    def filtered(x):
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        idx = jnp.broadcast_to(jnp.clip(k - 1, 0, v - 1), x.shape[:-1] + (1,))
        kth = jnp.take_along_axis(sorted_x, idx, axis=-1)
        use_k = (k > 0) & (k < v)
        x = jnp.where(use_k & (x < kth), -jnp.inf, x)
        sorted_x = jnp.where(use_k & (sorted_x < kth), -jnp.inf, sorted_x)
        probs = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
        cutoff = jnp.min(jnp.where(before < p, sorted_x, jnp.inf), axis=-1, keepdims=True)
        return jnp.where((p < 1.0) & (x < cutoff), -jnp.inf, x)

    needs = jnp.any(((rows.top_k > 0) & (rows.top_k < v)) | (rows.top_p < 1.0))
    x = jax.lax.cond(needs, filtered, lambda x: x, x)
    return jax.nn.log_softmax(x, axis=-1)


def row_sample(logits_BV: jax.Array, key: jax.Array, rows: RowSampling) -> jax.Array:
    """[B, V] logits -> [B] int32 tokens, each row as its settings say (temperature 0: the
    argmax); one key for the batch, as `sample` draws."""
    greedy = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    drawn = jax.random.categorical(key, row_log_probs(logits_BV, rows), axis=-1).astype(jnp.int32)
    return jnp.where(rows.temperature == 0, greedy, drawn)


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
