"""Plain (non-speculative) decoding: jitted prefill + a jitted while-loop over fixed-size buffers.

Shapes are bucketed (prompt length to a multiple of `PROMPT_BUCKET`, cache slots to a multiple of
`SLOT_BUCKET`) so a new prompt length does not mean a new compilation. Prompts are right-padded: row b's
pad slots beyond its own length are overwritten by its generated tokens and never attended to
(the causal mask stops at each row's cursor).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax import distributed
from eagle3_jax.config import TargetConfig
from eagle3_jax.decoding.sampling import RowSampling, Sampling, process_logits, sample
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import target as tgt
from eagle3_jax.models.layers import causal_mask
from eagle3_jax.sharding import mesh_of, put_batch

PROMPT_BUCKET = 64
SLOT_BUCKET = 256
NEW_BUCKET = 64
FINISH_REASONS = ("running", "eos", "max_tokens", "context")


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclasses.dataclass(frozen=True)
class Shape:
    """Static sizes of one compiled decode program."""

    batch: int
    prompt_len: int  # bucketed
    slots: int  # KV cache size (bucketed)
    max_new: int  # token buffer size
    # the speculative state keeps each emitted token's log-probability and its `logprobs` most
    # likely alternatives (`state.TokenLogProbs`); None: none
    logprobs: int | None = None
    # (K, K2, V'): the logit_bias entries, the ids barred until min_tokens and the token counts
    # of the penalties (0 or the vocabulary) that each row of the speculative state keeps
    # (`sampling.RowSampling`; serving); 0: none, nothing runs
    row_widths: tuple[int, int, int] = (0, 0, 0)


def plan_shape(
    lengths: list[int],
    max_new: int,
    max_context: int,
    extra_slots: int = 0,
    buckets: tuple[int, int] | None = None,
) -> Shape:
    """Checks the request against the context and picks bucketed static sizes; `buckets` =
    (prompt, slots) replaces (PROMPT_BUCKET, SLOT_BUCKET): coarser buckets, fewer programs to
    compile for a stream of batches of varied lengths (regenerating long conversations)."""
    prompt_bucket, slot_bucket = buckets or (PROMPT_BUCKET, SLOT_BUCKET)
    if not lengths or min(lengths) < 1:
        raise Eagle3Error("empty prompt: give at least one token of text")
    if max_new < 1:
        raise Eagle3Error(f"max_new_tokens {max_new} < 1")
    longest = max(lengths)
    if longest + max_new > max_context:
        raise Eagle3Error(
            f"prompt of {longest} tokens + {max_new} new tokens exceeds the context of {max_context}: "
            "shorten the prompt, lower --max-new-tokens or raise --max-context"
        )
    prompt_len = min(round_up(longest, prompt_bucket), max_context)
    slots = round_up(max(prompt_len, longest + max_new + extra_slots), slot_bucket)
    return Shape(len(lengths), prompt_len, slots, round_up(max_new, NEW_BUCKET))


class Request(NamedTuple):
    """A batch of prompts made ready for a compiled program: static sizes and padded arrays."""

    shape: Shape
    tokens: np.ndarray  # [B, prompt_len] right-padded prompts
    lengths: np.ndarray  # [B]
    limit: np.ndarray  # [B] max new tokens per row
    eos: tuple[int, ...]


def prepare(
    cfg: TargetConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: tuple[int, ...] | None = None,
    max_context: int | None = None,
    pad_id: int = 0,
    extra_slots: int = 0,
    buckets: tuple[int, int] | None = None,
) -> Request:
    """Checks the request, picks bucketed static sizes and pads the prompts (plain and speculative
    decoding, batch and streaming, all start here)."""
    shape = plan_shape(
        [len(p) for p in prompts],
        max_new_tokens,
        max_context or cfg.max_position_embeddings,
        extra_slots,
        buckets,
    )
    toks, lengths = pad_prompts(prompts, shape, pad_id)
    eos = tuple(cfg.eos_token_ids if eos_ids is None else eos_ids)
    return Request(shape, toks, lengths, np.full(shape.batch, max_new_tokens, np.int32), eos)


class DecodeState(NamedTuple):
    cache: dict[str, Any]
    tokens: jax.Array  # [B, N] generated tokens (pad after each row's end)
    num_new: jax.Array  # [B] tokens generated so far
    cursor: jax.Array  # [B] cache slot where `last` goes (= its position)
    last: jax.Array  # [B] newest token, not yet in the cache
    finish: jax.Array  # [B] index into FINISH_REASONS (0 = running)
    forwards: jax.Array  # [] target forward passes, prefill included
    limit: jax.Array  # [B] max new tokens per row (<= Shape.max_new; a runtime value, no recompile)
    key: jax.Array
    # the penalties' logit processing (their token counts), as the speculative state keeps it
    # (`SpecState.sampling`); None without penalties: the step is plain decoding's own
    sampling: RowSampling | None


def pad_prompts(
    prompts: list[list[int]], shape: Shape, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    toks = np.full((shape.batch, shape.prompt_len), pad_id, np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    return toks, np.array([len(p) for p in prompts], np.int32)


def _finish_code(tok, num_new, limit, cursor, eos_ids, shape: Shape):
    is_eos = (
        jnp.isin(tok, jnp.asarray(eos_ids, jnp.int32)) if eos_ids else jnp.zeros_like(tok, bool)
    )
    return jnp.where(
        is_eos, 1, jnp.where(num_new >= limit, 2, jnp.where(cursor >= shape.slots - 1, 3, 0))
    ).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "shape", "sampling", "eos_ids", "mesh"))
def prefill(
    params,
    prompt_BT,
    lengths_B,
    limit_B,
    key,
    cfg: TargetConfig,
    shape: Shape,
    sampling: Sampling,
    eos_ids: tuple[int, ...],
    mesh=None,
) -> DecodeState:
    """Fills the cache with the (right-padded) prompts and samples each row's first new token.
    With a mesh (the parameters' own, `sharding.mesh_of`) the cache is laid out on it
    (`target.make_cache`); the decode loop keeps it there."""
    b, t = prompt_BT.shape
    dtype = jax.tree.leaves(params)[0].dtype
    stacked = not isinstance(params["layers"], list)
    cache = tgt.make_cache(cfg, b, shape.slots, dtype, stacked=stacked, mesh=mesh)
    zeros = jnp.zeros((b,), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = tgt.forward(
        params,
        prompt_BT,
        positions,
        causal_mask(zeros, t, shape.slots),
        cfg,
        cache,
        zeros,
        logits_idx_BP=(lengths_B - 1)[:, None],
    )
    key, sub = jax.random.split(key)
    rows = None
    logits = out.logits[:, 0]
    if sampling.penalties.on:
        rows = RowSampling.fill(sampling, b, (0, 0, cfg.vocab_size))
        rows = rows.counting(prompt_BT, lengths_B)
        logits = process_logits(logits, rows, zeros)
    first = sample(logits, sub, sampling)
    tokens = jnp.zeros((b, shape.max_new), jnp.int32).at[:, 0].set(first)
    num_new = jnp.ones((b,), jnp.int32)
    finish = _finish_code(first, num_new, limit_B, lengths_B, eos_ids, shape)
    return DecodeState(
        out.cache, tokens, num_new, lengths_B, first, finish, jnp.int32(1), limit_B, key,
        None if rows is None else rows.count(first[:, None], jnp.ones((b, 1), bool)),
    )  # fmt: skip


def _step(
    params,
    state: DecodeState,
    cfg: TargetConfig,
    shape: Shape,
    sampling: Sampling,
    eos_ids: tuple[int, ...],
) -> DecodeState:
    running = state.finish == 0
    out = tgt.forward(
        params,
        state.last[:, None],
        state.cursor[:, None],
        causal_mask(state.cursor, 1, shape.slots),
        cfg,
        state.cache,
        state.cursor,
    )
    key, sub = jax.random.split(state.key)
    logits, proc = out.logits[:, 0], state.sampling
    if proc is not None:  # the penalties
        logits = process_logits(logits, proc, state.num_new)
    tok = sample(logits, sub, sampling)
    idx = jnp.minimum(state.num_new, shape.max_new - 1)
    rows = jnp.arange(tok.shape[0])
    tokens = state.tokens.at[rows, idx].set(jnp.where(running, tok, state.tokens[rows, idx]))
    num_new = state.num_new + running
    cursor = state.cursor + running
    finish = jnp.where(
        running, _finish_code(tok, num_new, state.limit, cursor, eos_ids, shape), state.finish
    )
    last = jnp.where(running, tok, state.last)
    return DecodeState(
        out.cache, tokens, num_new, cursor, last, finish, state.forwards + 1, state.limit, key,
        None if proc is None else proc.count(tok[:, None], running[:, None]),
    )  # fmt: skip


decode_step = jax.jit(
    _step, static_argnames=("cfg", "shape", "sampling", "eos_ids"), donate_argnums=1
)


@functools.partial(
    jax.jit, static_argnames=("cfg", "shape", "sampling", "eos_ids"), donate_argnums=1
)
def decode_loop(
    params,
    state: DecodeState,
    cfg: TargetConfig,
    shape: Shape,
    sampling: Sampling,
    eos_ids: tuple[int, ...],
) -> DecodeState:
    """Runs steps until every row has finished, entirely on device (no host round trip per token)."""
    return jax.lax.while_loop(
        lambda s: jnp.any(s.finish == 0),
        lambda s: _step(params, s, cfg, shape, sampling, eos_ids),
        state,
    )


class Result(NamedTuple):
    output_ids: list[list[int]]
    finish_reasons: list[str]
    target_forwards: int
    wall_time_s: float

    def rows(self) -> list[dict]:
        """Per row, the fields speculative.SpecResult.rows gives (one target pass per token)."""
        return [
            {
                "output_ids": o,
                "finish_reason": f,
                "target_forwards": len(o),
                "accept_hist": None,
                "verified_tokens": None,
            }
            for o, f in zip(self.output_ids, self.finish_reasons)
        ]


def _collect(state: DecodeState) -> tuple[list[list[int]], list[str]]:
    tokens, n, finish = distributed.to_host((state.tokens, state.num_new, state.finish))
    return [list(map(int, tokens[i, : n[i]])) for i in range(len(n))], [
        FINISH_REASONS[f] for f in finish
    ]


def generate(
    params,
    cfg: TargetConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seed: int = 0,
    eos_ids: tuple[int, ...] | None = None,
    max_context: int | None = None,
    pad_id: int = 0,
    warmup: bool = False,
    buckets: tuple[int, int] | None = None,
) -> Result:
    """Batched plain decoding of token-id prompts; each row stops at EOS, max tokens or the context.

    `warmup` first runs the same compiled programs with a one-token limit, so `wall_time_s` measures
    decoding, not compilation. `buckets`: see plan_shape.
    """
    req = prepare(cfg, prompts, max_new_tokens, eos_ids, max_context, pad_id, buckets=buckets)
    args = (cfg, req.shape, sampling, req.eos)
    key = jax.random.PRNGKey(seed)
    mesh = mesh_of(params)
    tokens, lengths, limit, ones = put_batch(mesh, req.tokens, req.lengths, req.limit,
                                             np.ones_like(req.limit))  # fmt: skip
    if warmup:
        state = prefill(params, tokens, lengths, ones, key, *args, mesh=mesh)
        jax.block_until_ready(decode_loop(params, state, *args))
    t0 = time.perf_counter()
    state = prefill(params, tokens, lengths, limit, key, *args, mesh=mesh)
    state = decode_loop(params, state, *args)
    out, reasons = _collect(state)
    wall = time.perf_counter() - t0
    return Result(out, reasons, int(distributed.to_host(state.forwards)), wall)


def stream(
    params,
    cfg: TargetConfig,
    prompt: list[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seed: int = 0,
    eos_ids: tuple[int, ...] | None = None,
    max_context: int | None = None,
) -> Iterator[int]:
    """Yields one row's tokens as they are produced (for interactive chat)."""
    req = prepare(cfg, [prompt], max_new_tokens, eos_ids, max_context)
    args = (cfg, req.shape, sampling, req.eos)
    key = jax.random.PRNGKey(seed)
    state = prefill(params, req.tokens, req.lengths, req.limit, key, *args, mesh=mesh_of(params))
    while True:
        yield int(state.last[0])
        if int(state.finish[0]) != 0:
            return
        state = decode_step(params, state, *args)
