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
from eagle3_jax.models.layers import causal_mask, slot_major_keys
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
    return _first_tokens(out.logits, out.cache, prompt_BT, lengths_B, limit_B, key, cfg, shape,
                         sampling, eos_ids)  # fmt: skip


def _first_tokens(logits_B1V, cache, prompt_BT, lengths_B, limit_B, key, cfg: TargetConfig,
                  shape: Shape, sampling: Sampling, eos_ids: tuple[int, ...]) -> DecodeState:  # fmt: skip
    """The decode state after a prefill: each row's first new token sampled from its last prompt
    position's logits (`logits_B1V`), `cache` the prompt's."""
    b = prompt_BT.shape[0]
    zeros = jnp.zeros((b,), jnp.int32)
    key, sub = jax.random.split(key)
    rows = None
    logits = logits_B1V[:, 0]
    if sampling.penalties.on:
        rows = RowSampling.fill(sampling, b, (0, 0, cfg.vocab_size))
        rows = rows.counting(prompt_BT, lengths_B)
        logits = process_logits(logits, rows, zeros)
    first = sample(logits, sub, sampling)
    tokens = jnp.zeros((b, shape.max_new), jnp.int32).at[:, 0].set(first)
    num_new = jnp.ones((b,), jnp.int32)
    finish = _finish_code(first, num_new, limit_B, lengths_B, eos_ids, shape)
    return DecodeState(
        cache, tokens, num_new, lengths_B, first, finish, jnp.int32(1), limit_B, key,
        None if rows is None else rows.count(first[:, None], jnp.ones((b, 1), bool)),
    )  # fmt: skip


# --------------------------------------------------------------------------- chunked prefill


@functools.partial(jax.jit, static_argnames=("cfg", "aux_ids"), donate_argnums=(1, 2))
def prefill_chunk(params, cache, logits_B1V, tokens_BC, start, lengths_B, cfg: TargetConfig,
                  aux_ids: tuple[int, ...] = ()):  # fmt: skip
    """One chunk of a chunked prefill (`chunked_forward`): the C prompt tokens at positions
    start .. start + C - 1 (`start` a runtime int: one compile per chunk size) run against the
    cache holding the positions before them, their K/V written at those slots; a row whose last
    prompt position falls in the chunk has its logits there put in `logits_B1V`. Returns the
    cache, the chunk's aux features [B, C, n_aux D] and the logits (the two buffers donated)."""
    b, c = tokens_BC.shape
    slots = jax.tree.leaves(cache["v"])[0].shape[-2]  # V is [.., B, G, S, K] in every layout
    starts = jnp.full((b,), start, jnp.int32)
    last = lengths_B - 1 - start  # the row's last prompt position within the chunk
    out = tgt.forward(
        params,
        tokens_BC,
        starts[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :],
        causal_mask(starts, c, slots),
        cfg,
        cache,
        starts,
        aux_ids=aux_ids,
        logits_idx_BP=jnp.clip(last, 0, c - 1)[:, None],
    )
    inside = (last >= 0) & (last < c)
    logits = jnp.where(inside[:, None, None], out.logits, logits_B1V)
    aux = out.aux if aux_ids else jnp.zeros((b, c, 0), jax.tree.leaves(params)[0].dtype)
    return Chunk(out.cache, aux, logits)


class Chunk(NamedTuple):
    """What `prefill_chunk` returns: the cache, the chunk's aux features, the logits buffer
    (fp32 as `target.lm_head` gives them)."""

    cache: dict[str, Any]
    aux: jax.Array
    logits: jax.Array


def chunk_sizes(prompt_len: int, chunk: int) -> list[int]:
    """The chunks a prompt padded to `prompt_len` is prefilled in: `chunk` tokens each (a
    multiple of PROMPT_BUCKET), the last one the rest (so a prompt never reaches past its
    bucket): one compiled chunk program per distinct size."""
    if chunk < PROMPT_BUCKET or chunk % PROMPT_BUCKET:
        raise Eagle3Error(f"prefill chunk {chunk}: give a multiple of {PROMPT_BUCKET}")
    return [min(chunk, prompt_len - s) for s in range(0, prompt_len, chunk)]


class Prefilled(NamedTuple):
    """What a prefill's target forward leaves (`chunked_forward`): the cache with the prompt's
    K/V, the aux features of the prompt's positions, chunk by chunk ([B, C_i, n_aux D] each;
    [B, C_i, 0] without aux ids; `jnp.concatenate` along axis 1 gives [B, T, .]), and each row's
    logits at its last prompt position [B, 1, V]."""

    cache: dict[str, Any]
    aux: tuple[jax.Array, ...]
    logits: jax.Array


def start_prefill(params, cfg: TargetConfig, batch: int, slots: int, mesh=None) -> Prefilled:
    """Empty buffers for a chunked prefill of `batch` prompts into a cache of `slots` (laid out
    on `mesh` where given, as `prefill` lays its cache out)."""
    dtype = jax.tree.leaves(params)[0].dtype
    stacked = not isinstance(params["layers"], list)
    cache = _empty_cache(cfg, batch, slots, dtype, stacked, mesh)
    return Prefilled(cache, (), jnp.zeros((batch, 1, cfg.vocab_size), jnp.float32))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _empty_cache(cfg, batch, slots, dtype, stacked, mesh):
    return tgt.make_cache(cfg, batch, slots, dtype, stacked=stacked, mesh=mesh)


def next_chunk(params, pre: Prefilled, prompt_BT, lengths_B, at: int, size: int,
               cfg: TargetConfig, aux_ids: tuple[int, ...] = ()) -> Prefilled:  # fmt: skip
    """`pre` after the chunk of `size` prompt tokens from position `at` (`prefill_chunk`)."""
    cache, aux, logits = prefill_chunk(params, pre.cache, pre.logits, prompt_BT[:, at : at + size],
                                       jnp.int32(at), lengths_B, cfg, aux_ids)  # fmt: skip
    return Prefilled(cache, (*pre.aux, aux), logits)


def chunked_forward(params, prompt_BT, lengths_B, cfg: TargetConfig, slots: int, chunk: int,
                    aux_ids: tuple[int, ...] = (), mesh=None) -> Prefilled:  # fmt: skip
    """The prefill's target forward `chunk` tokens at a time (`prefill_chunk`, a jitted program
    per chunk size), each chunk attending to the cache the ones before it wrote: the K/V, aux
    features and last logits of the one-pass forward up to the products' summation order (a
    product's bits depend on its row count, so the two are not bit for bit alike: decoding
    and serving with the same chunk run the same programs)."""
    b, t = prompt_BT.shape
    pre, at = start_prefill(params, cfg, b, slots, mesh), 0
    for size in chunk_sizes(t, chunk):
        pre = next_chunk(params, pre, prompt_BT, lengths_B, at, size, cfg, aux_ids)
        at += size
    return pre


def _slot_axes(cfg: TargetConfig) -> dict[str, int]:
    """The slot axis of a cache's K and V leaves (from the end): V [.., G, S, K]; K [.., G, K, S],
    or [.., G, S, K] slot-major (`layers.slot_major_keys`)."""
    return {"k": -2 if slot_major_keys(cfg.attention) else -1, "v": -2}


@functools.partial(jax.jit, static_argnames=("cfg", "size"))
def take_chunk(cache, start, cfg: TargetConfig, size: int) -> dict[str, Any]:
    """The K/V of cache slots start .. start + size - 1 (a prefix cache's entry), every layer."""
    axes = _slot_axes(cfg)
    return {
        n: jax.tree.map(
            lambda a, ax=axes[n]: jax.lax.dynamic_slice_in_dim(a, start, size, a.ndim + ax),
            cache[n],
        )
        for n in ("k", "v")
    }


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnums=0)
def put_chunk(cache, kv, start, cfg: TargetConfig) -> dict[str, Any]:
    """`cache` (donated) with `take_chunk`'s K/V written back at slots from `start`."""
    axes = _slot_axes(cfg)
    return {
        n: jax.tree.map(
            lambda a, b, ax=axes[n]: jax.lax.dynamic_update_slice_in_dim(a, b, start, a.ndim + ax),
            cache[n],
            kv[n],
        )
        for n in ("k", "v")
    }


first_tokens = jax.jit(
    _first_tokens, static_argnames=("cfg", "shape", "sampling", "eos_ids"), donate_argnums=1
)


def prefill_chunked(params, prompt_BT, lengths_B, limit_B, key, cfg: TargetConfig, shape: Shape,
                    sampling: Sampling, eos_ids: tuple[int, ...], chunk: int,
                    mesh=None) -> DecodeState:  # fmt: skip
    """`prefill` with the prompt's forward run `chunk` tokens at a time (`chunked_forward`)."""
    pre = chunked_forward(params, prompt_BT, lengths_B, cfg, shape.slots, chunk, mesh=mesh)
    return first_tokens(pre.logits, pre.cache, prompt_BT, lengths_B, limit_B, key, cfg, shape,
                        sampling, eos_ids)  # fmt: skip


def start(params, prompt_BT, lengths_B, limit_B, key, cfg: TargetConfig, shape: Shape,
          sampling: Sampling, eos_ids: tuple[int, ...], prefill_chunk: int = 0,
          mesh=None) -> DecodeState:  # fmt: skip
    """The decode state after the prompts' prefill: one pass (`prefill`), or `prefill_chunk`
    tokens at a time (`prefill_chunked`)."""
    if prefill_chunk:
        return prefill_chunked(params, prompt_BT, lengths_B, limit_B, key, cfg, shape, sampling,
                               eos_ids, prefill_chunk, mesh=mesh)  # fmt: skip
    return prefill(params, prompt_BT, lengths_B, limit_B, key, cfg, shape, sampling, eos_ids,
                   mesh=mesh)  # fmt: skip


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
    prefill_chunk: int = 0,
) -> Result:
    """Batched plain decoding of token-id prompts; each row stops at EOS, max tokens or the context.

    `warmup` first runs the same compiled programs with a one-token limit, so `wall_time_s` measures
    decoding, not compilation. `buckets`: see plan_shape. `prefill_chunk`: the prompts' forward
    run that many tokens at a time (`prefill_chunked`); 0: in one pass.
    """
    req = prepare(cfg, prompts, max_new_tokens, eos_ids, max_context, pad_id, buckets=buckets)
    args = (cfg, req.shape, sampling, req.eos)
    key = jax.random.PRNGKey(seed)
    mesh = mesh_of(params)
    tokens, lengths, limit, ones = put_batch(mesh, req.tokens, req.lengths, req.limit,
                                             np.ones_like(req.limit))  # fmt: skip
    if warmup:
        state = start(params, tokens, lengths, ones, key, *args, prefill_chunk, mesh)
        jax.block_until_ready(decode_loop(params, state, *args))
    t0 = time.perf_counter()
    state = start(params, tokens, lengths, limit, key, *args, prefill_chunk, mesh)
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
    prefill_chunk: int = 0,
) -> Iterator[int]:
    """Yields one row's tokens as they are produced (for interactive chat)."""
    req = prepare(cfg, [prompt], max_new_tokens, eos_ids, max_context)
    args = (cfg, req.shape, sampling, req.eos)
    key = jax.random.PRNGKey(seed)
    state = start(params, req.tokens, req.lengths, req.limit, key, *args, prefill_chunk,
                  mesh_of(params))  # fmt: skip
    while True:
        yield int(state.last[0])
        if int(state.finish[0]) != 0:
            return
        state = decode_step(params, state, *args)
