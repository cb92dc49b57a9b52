"""EAGLE-3 speculative decoding: one jitted round = draft a tree + verify it + update both caches.

Per row and round (all shapes static; per-row lengths are arrays):
  1. the draft encodes the pairs (target feature at p, token at p + 1) for the positions the target
     committed last round, onto its stable cache; the last pair ends at the root (the token produced
     last, at position r = `length`, in neither cache yet);
  2. EAGLE-2's dynamic tree: top-k children of the root, then `depth - 1` expansion levels, each
     running the draft on the k best nodes (by cumulative log-prob) with a mask of prefix + ancestors;
     the global top-N of the candidate pool forms the tree (drafters.py, tree.py);
  3. the target runs the N + 1 tree tokens at positions r + depth against its cache under the tree
     mask, returning logits and the aux features of every node (verify.py);
  4. acceptance (greedy, or the lossless sampling rule) picks a root-to-node path, whose K/V are
     compacted to the contiguous slots r .. r + a, and a bonus token (verify.py);
  5. the a + 1 new tokens are emitted; their features become the next round's encode pairs (here).

Nothing about a round depends on Python values, so a whole generation is one `lax.while_loop`
(`decode_loop`); `round_step` is one round, for streaming. `generate.py` runs them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from eagle3_jax.config import TargetConfig
from eagle3_jax.decoding.drafters import DRAFTERS, encode_drafter, pairs_full
from eagle3_jax.decoding.plain import Shape, chunked_forward
from eagle3_jax.decoding.sampling import (
    RowSampling,
    Sampling,
    process_logits,
    row_sample,
    sample,
    widths_for,
)
from eagle3_jax.decoding.state import SpecState, TokenLogProbs, eos_mask, write_pending
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.decoding.verify import (
    Verdict,
    emitted,
    forward_tree,
    token_logprobs,
    verify_tree,
)
from eagle3_jax.models import draft as drf
from eagle3_jax.models import target as tgt
from eagle3_jax.models.layers import causal_mask, slot_major_keys
from eagle3_jax.vocab import DraftVocab


def _encode_prompt(dparams, embed, prompt_BT, aux_BTF, dtype, dcfg, shape: Shape, tree: TreeConfig):
    """The draft's cache (of `dtype`, the target parameters') after encoding the pairs (feature
    p, token p + 1) for p < length - 1; the last pair (p = length - 1, root) is left to the first
    round, which needs its output to start the tree."""
    b, t = prompt_BT.shape
    zeros = jnp.zeros((b,), jnp.int32)
    next_tok = jnp.concatenate([prompt_BT[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
    dslots = shape.slots + tree.tree_slots
    return drf.forward(
        dparams,
        embed,
        next_tok,
        aux_BTF,
        jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        causal_mask(zeros, t, dslots),
        dcfg,
        drf.make_cache(dcfg, b, dslots, dtype),
        zeros,
        compute_logits=False,
        target_features=True,
    ).cache


@functools.partial(
    jax.jit, static_argnames=("tcfg", "dcfg", "shape", "tree", "sampling", "eos_ids", "mesh")
)
def prefill(
    tparams,
    dparams,
    embed,
    vocab: DraftVocab,
    prompt_BT,
    lengths_B,
    limit_B,
    key,
    tcfg: TargetConfig,
    dcfg: drf.DraftConfig,
    shape: Shape,
    tree: TreeConfig,
    sampling: Sampling,
    eos_ids: tuple[int, ...],
    mesh=None,
    row_sampling: RowSampling | None = None,
) -> SpecState:
    """Target prefill (root token + aux features) and the draft's encode of the prompt
    (right-padded prompt_BT [B, T], lengths_B and limit_B [B]). `row_sampling`: each row's sampling
    settings (runtime arrays, `sampling.RowSampling`; default `sampling` for every row), kept in
    the state; `sampling` greedy compiles the greedy programs, where every row is greedy. The
    state's E is `tree`'s depth + 1 and its draft cache holds `tree`'s scratch slots: a round
    may run any tree no deeper and no wider on it. With a mesh (the target
    parameters', `sharding.mesh_of`) the target cache is laid out on it (`target.make_cache`);
    the decode loop keeps it there. The draft's small cache follows the draft parameters' layout."""
    b, t = prompt_BT.shape
    dtype = jax.tree.leaves(tparams)[0].dtype
    zeros = jnp.zeros((b,), jnp.int32)
    stacked = not isinstance(tparams["layers"], list)
    out = tgt.forward(
        tparams,
        prompt_BT,
        jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        causal_mask(zeros, t, shape.slots),
        tcfg,
        tgt.make_cache(tcfg, b, shape.slots, dtype, stacked=stacked, mesh=mesh),
        zeros,
        aux_ids=() if dcfg is None else dcfg.aux_layer_ids,
        logits_idx_BP=(lengths_B - 1)[:, None],
    )
    feat = out.aux if dcfg is not None else jnp.zeros((b, t, 0), dtype)
    return _from_prefill(tparams, dparams, embed, out.cache, feat, out.logits, prompt_BT, lengths_B,
                         limit_B, key, tcfg, dcfg, shape, tree, sampling, eos_ids,
                         row_sampling)  # fmt: skip


def _from_prefill(tparams, dparams, embed, cache, feat_BTX, logits_B1V, prompt_BT, lengths_B,
                  limit_B, key, tcfg: TargetConfig, dcfg: drf.DraftConfig, shape: Shape,
                  tree: TreeConfig, sampling: Sampling, eos_ids: tuple[int, ...],
                  row_sampling: RowSampling | None = None) -> SpecState:  # fmt: skip
    """The state after a prefill's target forward (`prefill`, or `plain.chunked_forward`'s
    chunks): `cache` holding the prompt's K/V, the aux features of every prompt position
    (`feat_BTX`, [B, T, 0] without a head; or its chunks, [B, C_i, .] each, concatenated here)
    and each row's logits at its last position
    [B, 1, V]: the root sampled, the draft's encode of the prompt."""
    if isinstance(feat_BTX, (tuple, list)):  # a chunked prefill's, chunk by chunk
        feat_BTX = jnp.concatenate(feat_BTX, axis=1)
    b, t = prompt_BT.shape
    dtype = jax.tree.leaves(tparams)[0].dtype
    zeros = jnp.zeros((b,), jnp.int32)
    key, sub = jax.random.split(key)
    if row_sampling is None:  # a decode's: its static sampling's, penalties included
        widths = widths_for(shape.row_widths, sampling, tcfg.vocab_size)
        row_sampling = RowSampling.fill(sampling, b, widths)
    rows = jnp.arange(b)
    row_sampling = row_sampling.counting(prompt_BT, lengths_B)
    logits = process_logits(logits_B1V[:, 0], row_sampling, zeros)  # the first new token's
    if sampling.greedy:
        root = sample(logits, sub, sampling)
    else:
        root = row_sample(logits, sub, row_sampling)
    row_sampling = row_sampling.count(root[:, None], jnp.ones((b, 1), bool))
    e = tree.depth + 1
    dcache: dict[str, Any] = {}
    feat = feat_BTX
    if dcfg is not None:
        dcache = _encode_prompt(dparams, embed, prompt_BT, feat, dtype, dcfg, shape, tree)
    num_new = jnp.ones((b,), jnp.int32)
    stops = eos_mask(root, eos_ids) & ~row_sampling.ignore_eos
    finish = jnp.where(stops, 1, jnp.where(num_new >= limit_B, 2, 0))
    logprobs = None
    if shape.logprobs is not None:  # the root's, at emitted position 0
        first = token_logprobs(logits_B1V, root[:, None], shape.logprobs)
        n = shape.max_new + e
        logprobs = TokenLogProbs(
            *(jnp.zeros((b, n) + x.shape[2:], x.dtype).at[:, :1].set(x) for x in first)
        )
    return SpecState(
        tcache=cache,
        pending_kv={
            n: jnp.zeros((tcfg.num_layers, b, e, tcfg.num_kv_heads, tcfg.head_dim), dtype)
            for n in ("k", "v")
        },
        pending_at=lengths_B,
        dcache=dcache,
        length=lengths_B,
        root=root,
        enc_tok=jnp.zeros((b, e), jnp.int32).at[:, 0].set(root),
        enc_feat=jnp.zeros((b, e, feat.shape[-1]), feat.dtype)
        .at[:, 0]
        .set(feat[rows, lengths_B - 1]),
        enc_n=jnp.ones((b,), jnp.int32),
        tokens=jnp.zeros((b, shape.max_new + e), jnp.int32).at[:, 0].set(root),
        history=jnp.zeros((b, shape.slots), jnp.int32)
        .at[:, :t]
        .set(prompt_BT)
        .at[rows, lengths_B]
        .set(root),
        num_new=num_new,
        finish=finish.astype(jnp.int32),
        forwards=jnp.ones((b,), jnp.int32),
        verified=jnp.zeros((b,), jnp.int32),
        accept_hist=jnp.zeros((b, e), jnp.int32),
        limit=limit_B,
        key=key,
        sampling=row_sampling,
        logprobs=logprobs,
    )


from_prefill = jax.jit(
    _from_prefill,
    static_argnames=("tcfg", "dcfg", "shape", "tree", "sampling", "eos_ids"),
    donate_argnums=3,
)


def prefill_chunked(tparams, dparams, embed, vocab: DraftVocab, prompt_BT, lengths_B, limit_B,
                    key, tcfg: TargetConfig, dcfg: drf.DraftConfig, shape: Shape,
                    tree: TreeConfig, sampling: Sampling, eos_ids: tuple[int, ...], chunk: int,
                    mesh=None, row_sampling: RowSampling | None = None) -> SpecState:  # fmt: skip
    """`prefill` with the prompt's target forward run `chunk` tokens at a time
    (`plain.chunked_forward`: the programs serving's chunked admissions run), then the same
    root and draft encode (`from_prefill`)."""
    aux_ids = () if dcfg is None else dcfg.aux_layer_ids
    pre = chunked_forward(tparams, prompt_BT, lengths_B, tcfg, shape.slots, chunk, aux_ids, mesh)
    return from_prefill(tparams, dparams, embed, pre.cache, pre.aux, pre.logits, prompt_BT,
                        lengths_B, limit_B, key, tcfg, dcfg, shape, tree, sampling, eos_ids,
                        row_sampling)  # fmt: skip


def _commit(state: SpecState, v: Verdict, dcache, key, shape: Shape, tree: TreeConfig, eos_ids):
    """Step 5: the accepted drafted tokens and the bonus emitted (up to an EOS or the row's
    limit), the path's K/V made pending at r, the path's features next round's encode pairs;
    rows that had finished keep their state."""
    b, e = state.enc_tok.shape  # E: the state's (its largest tree's depth + 1)
    rows, j = jnp.arange(b), jnp.arange(e)[None, :]
    running = state.finish == 0
    r, a = state.length, v.accepted
    emit = emitted(v.path_tok, v.bonus, a)
    is_eos = eos_mask(emit, eos_ids) & (j <= a[:, None]) & ~state.sampling.ignore_eos[:, None]
    has_eos = jnp.any(is_eos, axis=1)
    count = jnp.where(has_eos, jnp.argmax(is_eos, axis=1) + 1, a + 1)
    room = state.limit - state.num_new
    stop_eos = has_eos & (count <= room)
    count = jnp.minimum(count, room)
    length = r + a + 1
    no_room = length + tree.round_slots + 1 > shape.slots  # the next round would not fit
    finish = jnp.where(stop_eos, 1, jnp.where(count >= room, 2, jnp.where(no_room, 3, 0)))
    # writes past `count` are overwritten next round or lie beyond the row's final length
    tokens = state.tokens.at[rows[:, None], state.num_new[:, None] + j].set(emit)
    history = state.history.at[rows[:, None], jnp.minimum(r[:, None] + 1 + j, shape.slots - 1)].set(
        emit
    )
    upd = lambda new, old: jnp.where(running.reshape((b,) + (1,) * (new.ndim - 1)), new, old)  # noqa
    # the penalties' counts: the tokens emitted
    rows_sampling = state.sampling.count(emit, (j < count[:, None]) & running[:, None])
    logprobs = state.logprobs
    if logprobs is not None:  # at the emitted tokens' positions, as `tokens`
        at = (rows[:, None], state.num_new[:, None] + j)
        logprobs = TokenLogProbs(
            *(upd(buf.at[at].set(new), buf) for buf, new in zip(logprobs, v.logprobs))
        )
    return dataclasses.replace(
        state,
        # the path goes to slots r .. r + depth next round (slots past r + a get padding, beyond
        # the new length: masked, then overwritten)
        pending_kv=v.path_kv,
        pending_at=r,
        dcache=dcache,
        length=upd(length, state.length),
        root=upd(v.bonus, state.root),
        enc_tok=upd(emit, state.enc_tok),
        enc_feat=upd(v.enc_feat, state.enc_feat),
        enc_n=upd(a + 1, state.enc_n),
        tokens=upd(tokens, state.tokens),
        history=upd(history, state.history),
        num_new=upd(state.num_new + count, state.num_new),
        finish=upd(finish.astype(jnp.int32), state.finish),
        forwards=state.forwards + running,
        verified=state.verified + v.verified * running,
        accept_hist=state.accept_hist.at[rows, a].add(running.astype(jnp.int32)),
        key=key,
        sampling=rows_sampling,
        logprobs=logprobs,
    )


def _round(
    tparams,
    dparams,
    embed,
    vocab,
    state: SpecState,
    tcfg,
    dcfg,
    shape: Shape,
    tree: TreeConfig,
    sampling: Sampling,
    eos_ids,
    method="eagle3",
    target_pass=forward_tree,
) -> SpecState:
    """One round for every row (finished rows ride along unchanged). `method` names a drafter
    (`drafters.DRAFTERS`); tests may pass a drafter function. `target_pass` is the target's
    pass over the tree (`verify.verify_tree`); replay.py passes its oracle there, as tparams,
    with a state that holds no target cache."""
    state = _pending_written(state, tcfg)
    return _draft_verify_commit(tparams, dparams, embed, vocab, state, tcfg, dcfg, shape, tree,
                                sampling, eos_ids, method, target_pass)  # fmt: skip


def _pending_written(state: SpecState, tcfg) -> SpecState:
    """Last round's accepted K/V written into the target cache: from here on a round only reads
    it."""
    if not state.tcache:
        return state
    layout = slot_major_keys(tcfg.attention)
    tcache = write_pending(state.tcache, state.pending_kv, state.pending_at, layout)
    return dataclasses.replace(state, tcache=tcache)


def _draft_verify_commit(tparams, dparams, embed, vocab, state: SpecState, tcfg, dcfg, shape,
                         tree, sampling, eos_ids, method, target_pass) -> SpecState:  # fmt: skip
    """Steps 1-5 of `_round` on a state whose cache holds last round's path."""
    drafter = DRAFTERS[method] if isinstance(method, str) else method
    trees, dcache = drafter(dparams, embed, vocab, state, dcfg, shape, tree)
    if state.key.ndim == 2:  # a key per row [B, 2] (decoding/slots.py): each row's own stream
        key, sub = jnp.moveaxis(jax.vmap(jax.random.split)(state.key), 1, 0)
    else:
        key, sub = jax.random.split(state.key)
    verdict = verify_tree(
        tparams, trees, state, sub, tcfg, dcfg, shape, tree, sampling, target_pass
    )
    new = _commit(state, verdict, dcache, key, shape, tree, eos_ids)
    if drafter is encode_drafter:  # the pairs were left in the buffer unless it was full
        new = append_pair(state, new, verdict)
    return new


def _row_axes(state: SpecState) -> SpecState:
    """Each field's row axis, as a SpecState of ints: 1 for the pending K/V [L, B, E, G, K], 0
    for the rest (the draft's one-layer cache [B, ...] included); `state` holds no target
    cache (`_rows_round` keeps it out)."""
    axes = jax.tree.map(lambda _: 0, state)
    return dataclasses.replace(axes, pending_kv={n: 1 for n in state.pending_kv})


def _rows_round(
    tparams, dparams, embed, vocab, state: SpecState, rows_b, tcfg, dcfg, shape: Shape,
    tree: TreeConfig, sampling: Sampling, eos_ids, method="eagle3",
) -> SpecState:  # fmt: skip
    """`_round` over rows `rows_b` [b] (distinct) of the state's B, the others untouched: the
    drafter, the target's projections and the bookkeeping run on b rows, and the target's
    attention reads their cache rows in place (`target.forward`'s cache_rows), so a round's cost
    follows the rows it runs, where a round over all B costs B rows however few are busy
    (serving, decoding/slots.py). Every field but the target cache is taken at the rows and put
    back. Each row's tokens, K/V and key are those a round over all B gives it."""
    state = _pending_written(state, tcfg)  # all B rows: a row that ran no round rewrites its own
    rest = dataclasses.replace(state, tcache={})
    axes = _row_axes(rest)
    sub = jax.tree.map(lambda x, ax: jnp.take(x, rows_b, axis=ax), rest, axes)
    sub = dataclasses.replace(sub, tcache=state.tcache)
    target_pass = functools.partial(forward_tree, cache_rows=rows_b)
    new = _draft_verify_commit(tparams, dparams, embed, vocab, sub, tcfg, dcfg, shape, tree,
                               sampling, eos_ids, method, target_pass)  # fmt: skip
    new = dataclasses.replace(new, tcache={})

    def put(x, y, ax):
        return x.at[(slice(None),) * ax + (rows_b,)].set(y.astype(x.dtype))

    return dataclasses.replace(jax.tree.map(put, rest, new, axes), tcache=state.tcache)


def append_pair(old: SpecState, new: SpecState, v: Verdict) -> SpecState:
    """A plain round that did not encode (`drafters.encode_drafter`: no running row's buffer
    full): its new pair (the root's feature, the bonus token) is appended to the pairs still
    waiting, where `_commit` replaced them as if they had been encoded. Rows that had finished
    keep their state."""
    b = old.enc_tok.shape[0]
    rows = jnp.arange(b)
    keep = (old.finish == 0) & ~pairs_full(old)
    at = jnp.minimum(old.enc_n, old.enc_tok.shape[1] - 1)  # < E wherever keep holds
    tok = old.enc_tok.at[rows, at].set(v.bonus)
    feat = old.enc_feat.at[rows, at].set(v.enc_feat[:, 0])
    return dataclasses.replace(
        new,
        enc_tok=jnp.where(keep[:, None], tok, new.enc_tok),
        enc_feat=jnp.where(keep[:, None, None], feat, new.enc_feat),
        enc_n=jnp.where(keep, old.enc_n + 1, new.enc_n),
    )


_STATIC = ("tcfg", "dcfg", "shape", "tree", "sampling", "eos_ids", "method", "target_pass")
round_step = jax.jit(_round, static_argnames=_STATIC, donate_argnums=4)
rows_round = jax.jit(_rows_round, static_argnames=_STATIC[:-1], donate_argnums=4)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnums=4)
def decode_loop(
    tparams,
    dparams,
    embed,
    vocab,
    state: SpecState,
    tcfg,
    dcfg,
    shape: Shape,
    tree: TreeConfig,
    sampling: Sampling,
    eos_ids,
    method="eagle3",
    target_pass=forward_tree,
) -> SpecState:
    """Rounds until every row has finished, on device."""
    models, static = (tparams, dparams, embed, vocab), (tcfg, dcfg, shape, tree, sampling, eos_ids)
    return jax.lax.while_loop(
        lambda st: jnp.any(st.finish == 0),
        lambda st: _round(*models, st, *static, method, target_pass),
        state,
    )
