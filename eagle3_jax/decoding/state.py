"""The speculative decoder's state: every row's caches, cursors, buffers and counters, fixed-size.

`SpecState` is a pytree (`jax.tree_util.register_dataclass`) whose fields are all data: arrays and
the caches' arrays, batch-leading. Nothing in it is static (a meta field would key a compilation
by its value); the sizes come from the arrays' shapes, which the compiled program's static
`Shape` and `TreeConfig` fix. `speculative.prefill` builds it, by keyword; each round returns it
with `dataclasses.replace`. The cache helpers here work on either cache layout: a list of
per-layer [B, ...] arrays (unrolled) or [L, B, ...]-stacked arrays (scanned).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from eagle3_jax.decoding.sampling import RowSampling
from eagle3_jax.models.layers import write_kv


class TokenLogProbs(NamedTuple):
    """By emitted position (the token buffer's): each emitted token's log-probability under the
    target's own distribution (its fp32 logits' log-softmax, before temperature, top-k or top-p,
    as vLLM reports them by default) and the ids and log-probabilities of the K most likely
    tokens there, most likely first (`plain.Shape.logprobs` = K)."""

    logprob: jax.Array  # [B, M + E] (or [B, E] for one round's path)
    top_ids: jax.Array  # [B, M + E, K] int32
    top: jax.Array  # [B, M + E, K]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """One batch of B rows between rounds (E = depth + 1 encode pairs, F = aux feature width).

    E is the depth + 1 of the tree prefill was given; a round may run a shallower tree on it
    (serving switches trees by occupancy on a state sized for its largest: `slots.py`), padding
    its path to E.

    The root (the newest token, already emitted) sits at position `length` and is in neither
    cache; `length` counts the tokens committed to the target cache, last round's path K/V
    possibly still pending.
    """

    tcache: dict[str, Any]  # the target's KV cache, S slots
    # last round's accepted path K/V ({"k", "v"}: [L, B, E, G, K], all layers in one array
    # whatever the cache's layout: `gather_path`) and the slot it goes to: written at the start of
    # the next round, so the cache is written before it is read (written after the verification's
    # read, XLA copied the whole cache twice per round: ~20 ms on CPU)
    pending_kv: dict[str, Any]
    pending_at: jax.Array  # [B]
    dcache: dict[str, Any]  # the draft's KV cache: S stable slots + the tree's scratch slots
    length: jax.Array  # [B] tokens committed
    root: jax.Array  # [B] newest token
    enc_tok: jax.Array  # [B, E] tokens at positions length - enc_n + 1 .. length (root last)
    enc_feat: jax.Array  # [B, E, F] target aux features at positions length - enc_n .. length - 1
    enc_n: jax.Array  # [B] valid encode pairs (1 .. E)
    tokens: jax.Array  # [B, max_new + E] emitted tokens
    history: jax.Array  # [B, S] every token by position (prompt, then emitted): prompt lookup
    num_new: jax.Array  # [B] tokens emitted
    finish: jax.Array  # [B] index into plain.FINISH_REASONS (0: running)
    forwards: jax.Array  # [B] target passes while the row ran, the prefill's included
    verified: jax.Array  # [B] tree tokens (root included) the target ran in rounds, row running
    accept_hist: jax.Array  # [B, E] rounds by number of accepted draft tokens
    limit: jax.Array  # [B] max new tokens (a runtime value: no recompile per limit)
    key: jax.Array  # the PRNG key (sampling): [2] for the batch, or [B, 2] a row each (slots.py)
    sampling: RowSampling  # [B] each row's temperature, top-k, top-p (runtime values)
    logprobs: TokenLogProbs | None = None  # kept where the program's Shape.logprobs is set


def map_cache(fn: Callable, *caches: dict[str, Any]) -> dict[str, Any]:
    """Applies a per-layer function of [B, ...] arrays to list-of-layers or [L, ...]-stacked
    caches (each {"k", "v"})."""
    if isinstance(caches[0]["k"], list):
        return {n: [fn(*c) for c in zip(*(x[n] for x in caches))] for n in ("k", "v")}
    return {n: jax.vmap(fn)(*(x[n] for x in caches)) for n in ("k", "v")}


def gather_path(new: dict[str, Any], path_BE: jax.Array) -> dict[str, Any]:
    """The accepted path's K/V out of a verification's new entries ([B, N+1, G, K] per layer, a
    list or [L, ...]-stacked): {"k", "v"} [L, B, E, G, K], node path_BE[b, e] of row b at e. One
    gather for all layers (a list is stacked first, which XLA fuses into it), where a gather per
    layer and per K/V was 2L small kernels a round."""
    out = {}
    for n in ("k", "v"):
        x = jnp.stack(new[n]) if isinstance(new[n], list) else new[n]
        out[n] = jnp.take_along_axis(x, path_BE[None, :, :, None, None], axis=2)
    return out


def write_pending(
    tcache: dict[str, Any], pending: dict[str, Any], at_B: jax.Array, slot_major: bool = False
):
    """Writes last round's accepted K/V ({"k", "v"} [L, B, E, G, K]) at slots at_B onwards of
    every layer (`slot_major`: the cache's K is [B, G, S, K], `layers.slot_major_keys`)."""

    def write(k, v, pk, pv):
        return write_kv((k, v), pk, pv, at_B, slot_major)

    if isinstance(tcache["k"], list):
        layers = zip(tcache["k"], tcache["v"], pending["k"], pending["v"])  # [B, E, G, K] slices
        kv = [write(*c) for c in layers]
        return {"k": [k for k, _ in kv], "v": [v for _, v in kv]}
    k, v = jax.vmap(write)(tcache["k"], tcache["v"], pending["k"], pending["v"])
    return {"k": k, "v": v}


def eos_mask(tok: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """[...] bool: which tokens end a row (none when there are no EOS ids)."""
    if not eos_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.isin(tok, jnp.asarray(eos_ids, jnp.int32))
