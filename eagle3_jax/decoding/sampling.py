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
class Penalties:
    """A request's penalties (OpenAI's presence and frequency, in [-2, 2]; vLLM's repetition,
    > 0); the defaults are off."""

    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0

    def __post_init__(self):
        if not all(math.isfinite(x) for x in (self.repetition, self.frequency, self.presence)):
            raise Eagle3Error("penalties must be finite numbers")
        if self.repetition <= 0:
            raise Eagle3Error(f"repetition_penalty {self.repetition}: give a number > 0")
        for name, x in (("frequency_penalty", self.frequency), ("presence_penalty", self.presence)):
            if not -2 <= x <= 2:
                raise Eagle3Error(f"{name} {x} outside [-2, 2]")

    @property
    def on(self) -> bool:
        return self != Penalties()


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters; `penalties` are
    applied to the logits first (`process_logits`; off by default)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    penalties: Penalties = Penalties()

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
    ask, in vLLM's order: `bias` [B, K] float32 added at token ids `bias_ids` [B, K]
    (`logit_bias`); the ids `ban_ids` [B, K2] (EOS and a request's stop token ids) barred while
    fewer than `min_tokens` [B] tokens have been emitted; then the penalties: `repetition` [B]
    (a logit of a token in the prompt or the output divided by it where positive, multiplied
    where negative; 1: off), `frequency` and `presence` [B] (subtracted times the token's count
    in the output, and once if it is there at all; 0: off), from `out_counts` [B, V'] int32 (each
    token's count among the emitted ones, kept up to date by the rounds) and `prompt_seen`
    [B, V'] bool. K, K2 and V' (0 or the vocabulary) are static, 0 outside serving: nothing
    runs. Unused bias and barred entries hold `NO_ID`."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    ignore_eos: jax.Array
    bias_ids: jax.Array
    bias: jax.Array
    min_tokens: jax.Array
    ban_ids: jax.Array
    repetition: jax.Array
    frequency: jax.Array
    presence: jax.Array
    out_counts: jax.Array
    prompt_seen: jax.Array

    @classmethod
    def fill(cls, sampling: Sampling, batch: int, widths: tuple[int, int, int] = (0, 0, 0)
             ) -> RowSampling:  # fmt: skip
        """`sampling` for every one of `batch` rows, no bias or bars, room for `widths` = (K,
        K2, V') entries of bias, barred ids and token counts."""
        return cls.of([sampling] * batch, widths=widths)

    def counting(self, prompt_BT: jax.Array, lengths_B: jax.Array) -> RowSampling:
        """Ready to count for the penalties: each row's prompt tokens (the first lengths_B of
        prompt_BT) marked seen; itself without the counts' room."""
        if not self.prompt_seen.shape[1]:
            return self
        rows = jnp.arange(prompt_BT.shape[0])[:, None]
        in_prompt = jnp.arange(prompt_BT.shape[1])[None, :] < lengths_B[:, None]
        return dataclasses.replace(
            self, prompt_seen=self.prompt_seen.at[rows, prompt_BT].max(in_prompt)
        )

    def count(self, tokens_BE: jax.Array, emitted_BE: jax.Array) -> RowSampling:
        """The penalties' counts with `tokens_BE` [B, E] added where `emitted_BE` (the tokens a
        step or round emitted); itself without the counts' room."""
        if not self.out_counts.shape[1]:
            return self
        rows = jnp.arange(tokens_BE.shape[0])[:, None]
        counts = self.out_counts.at[rows, tokens_BE].add(emitted_BE.astype(jnp.int32))
        return dataclasses.replace(self, out_counts=counts)

    @classmethod
    def of(cls, rows: list[Sampling], ignore_eos: list[bool] | None = None,
           logit_bias: list[dict[int, float]] | None = None,
           min_tokens: list[int] | None = None, ban: list[tuple[int, ...]] | None = None,
           widths: tuple[int, int, int] = (0, 0, 0)) -> RowSampling:  # fmt: skip
        """One row per `Sampling` (each validated on construction; its penalties need V' =
        widths[2], the vocabulary: the counts start empty, the prefill fills them); per row,
        `ignore_eos` its flag (default False), `logit_bias` {token id: bias} (at most K =
        widths[0] entries), `min_tokens` and `ban` the ids barred until then (at most K2 =
        widths[1])."""
        b = len(rows)
        k, k2, v = widths
        bias_ids, bias = np.full((b, k), NO_ID, np.int32), np.zeros((b, k))
        ban_ids = np.full((b, k2), NO_ID, np.int32)
        for i, (biased, barred) in enumerate(zip(logit_bias or [{}] * b, ban or [()] * b)):
            if len(biased) > k or len(barred) > k2:
                raise Eagle3Error(f"{len(biased)} logit biases and {len(barred)} barred ids: "
                                  f"room for {k} and {k2}")  # fmt: skip
            bias_ids[i, : len(biased)] = list(biased)
            bias[i, : len(biased)] = list(biased.values())
            ban_ids[i, : len(barred)] = barred
        pens = [r.penalties for r in rows]
        if not v and any(p.on for p in pens):
            raise Eagle3Error("penalties need the token counts' room (widths[2]: the vocabulary)")
        return cls(
            jnp.asarray([s.temperature for s in rows], jnp.float32),
            jnp.asarray([s.top_k for s in rows], jnp.int32),
            jnp.asarray([s.top_p for s in rows], jnp.float32),
            jnp.asarray(ignore_eos or [False] * b, jnp.bool_),
            jnp.asarray(bias_ids),
            jnp.asarray(bias, jnp.float32),
            jnp.asarray(min_tokens or [0] * b, jnp.int32),
            jnp.asarray(ban_ids),
            jnp.asarray([p.repetition for p in pens], jnp.float32),
            jnp.asarray([p.frequency for p in pens], jnp.float32),
            jnp.asarray([p.presence for p in pens], jnp.float32),
            jnp.zeros((b, v), jnp.int32),
            jnp.zeros((b, v), jnp.bool_),
        )


def widths_for(
    widths: tuple[int, int, int], sampling: Sampling, vocab_size: int
) -> tuple[int, int, int]:
    """`widths` (K, K2, V'), with the counts' room (V' the vocabulary) when `sampling` has
    penalties: a decode's static sampling asking for them gets the room it needs."""
    k, k2, v = widths
    return (k, k2, vocab_size if sampling.penalties.on else v)


NO_ID = np.iinfo(np.int32).max  # an unused bias or barred entry: out of range, dropped


def _penalized(x, count, seen, rows: RowSampling, b: int):
    """vLLM's penalties on logits x given each token's output count and whether it was seen
    (prompt or output); rows' settings broadcast over x's [B, ...] leading axes."""

    def per_row(a):
        return a.reshape((b,) + (1,) * (x.ndim - 1))

    rep, freq, pres = per_row(rows.repetition), per_row(rows.frequency), per_row(rows.presence)
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    return x - freq * count - pres * (count > 0)


def process_logits(logits_BXV: jax.Array, rows: RowSampling, emitted_BX: jax.Array,
                   trees=None) -> jax.Array:  # fmt: skip
    """The target's logits [B, ..., V] as a request's settings change them before sampling:
    each row's `bias` added at `bias_ids`, its `ban_ids` at -inf where the token these logits
    choose would be emitted before `min_tokens` (`emitted_BX` [B, ...]: how many tokens the row
    has emitted before it), then the penalties (`_penalized`). `trees` (`tree.Tree`, [B]-leading;
    logits [B, N+1, V] at its nodes): a node's own path counts as output too, so its logits get
    the penalties of the row's output followed by the drafted tokens down to it. Bias and bars
    are scatters of K and K2 entries a position (no branch: a conditional costs a GPU a host
    round trip); the penalties one elementwise pass and a scatter of the path tokens, run only
    when some row asks for one. Returned as given when K, K2 and V' are 0 (static)."""
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
    if not rows.out_counts.shape[1]:
        return logits_BXV
    # a pass over the vocabulary at every node: skipped at run time when no row asks (it cost
    # 5 % of a CPU round; a GPU pays a host round trip for the branch, less than the pass)
    on = (rows.repetition != 1) | (rows.frequency != 0) | (rows.presence != 0)
    return jax.lax.cond(jnp.any(on), lambda x: _penalize_all(x, rows, trees), lambda x: x,
                        logits_BXV)  # fmt: skip


def _penalize_all(raw, rows: RowSampling, trees):
    """`process_logits`' penalties ([B, ..., V] logits; `trees` as it takes them)."""
    b = raw.shape[0]
    mid = (1,) * (raw.ndim - 2)
    count = rows.out_counts.reshape((b,) + mid + (-1,))
    seen = rows.prompt_seen.reshape((b,) + mid + (-1,)) | (count > 0)
    out = _penalized(raw, count, seen, rows, b).astype(raw.dtype)
    if trees is None:
        return out
    # node n's path: its ancestors and itself below the root (drafted, not yet emitted)
    on_path = trees.mask & (trees.depth >= 1)[:, None, :]  # [B, N+1, N+1]
    tok = trees.tokens  # [B, N+1]
    same = tok[:, :, None] == tok[:, None, :]  # [B, j, k]
    extra = jnp.einsum("bnk,bjk->bnj", on_path.astype(jnp.int32), same.astype(jnp.int32))
    n1 = tok.shape[1]
    ids = jnp.where(on_path, tok[:, None, :], NO_ID)  # [B, n, j]: token of path node j
    base = jnp.take_along_axis(rows.out_counts, jnp.minimum(tok, rows.out_counts.shape[1] - 1),
                               axis=1)  # fmt: skip
    at = jnp.take_along_axis(raw, jnp.minimum(ids, raw.shape[-1] - 1), axis=2)  # [B, n, j]
    fixed = _penalized(at, base[:, None, :] + extra, True, rows, b)
    rows_i = jnp.arange(b)[:, None, None]
    nodes = jnp.arange(n1)[None, :, None]
    return out.at[rows_i, nodes, ids].set(fixed.astype(out.dtype), mode="drop")


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
