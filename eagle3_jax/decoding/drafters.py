"""Drafting a round's tree (steps 1-2 of a round, see speculative.py): EAGLE-3, prompt lookup, none.

A drafter is `drafter(dparams, embed, vocab, state, dcfg, shape, tree) -> (Tree [B-batched],
draft cache)`: it reads the state (root, encode pairs, history) and proposes the tree the target
verifies. `DRAFTERS` names them for `generate(method=...)`; `method_tree` is the tree each
verifies. Tests may pass a drafter function of that signature as the method.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.decoding.plain import Shape
from eagle3_jax.decoding.state import SpecState
from eagle3_jax.decoding.tree import TreeConfig, chain_tree, select_tree
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf
from eagle3_jax.models import draft_output
from eagle3_jax.vocab import DraftVocab

NEG_SCORE = -1e30  # the score of a node a skipped draft level did not draft: never verified


def _encode_pairs(dparams, embed, state: SpecState, dcfg: drf.DraftConfig, shape: Shape, tree):
    """Step 1: the pairs (target feature at p, token at p + 1) committed last round, onto the
    draft's stable cache. Returns (the draft's hidden state at the last pair, the root's
    [B, H]; the draft cache)."""
    b, e = state.enc_tok.shape  # E: the state's (its largest tree's depth + 1)
    dslots = _draft_slots(state.dcache)
    start = state.length - state.enc_n
    pos = start[:, None] + jnp.arange(e, dtype=jnp.int32)[None, :]
    # stable slots only: tree slots are >= S > pos
    mask = jnp.arange(dslots)[None, None, :] <= pos[:, :, None]
    out = drf.forward(
        dparams,
        embed,
        state.enc_tok,
        state.enc_feat,
        pos,
        mask,
        dcfg,
        state.dcache,
        start,
        compute_logits=False,
        target_features=True,
    )
    return out.hidden[jnp.arange(b), state.enc_n - 1], out.cache


def _draft_slots(dcache) -> int:
    """The draft cache's slots: S stable ones, then the scratch slots of the largest tree the
    state was sized for (a smaller tree uses the first of them)."""
    return dcache["v"].shape[-2]


class _Frontier(NamedTuple):
    """The k nodes a level expands, per row: [B, k] pool index, token and cumulative log-prob,
    [B, k, H] their draft hidden state, [B, k, tree_slots] their ancestors' scratch slots."""

    idx: jax.Array
    tok: jax.Array
    score: jax.Array
    h: jax.Array
    anc: jax.Array


def _level(dparams, embed, vocab, dcache, front: _Frontier, r, lvl, running, dcfg, shape, tree):
    """The draft over the frontier's k nodes at tree level `lvl` (2 .. depth), in the scratch
    slots after the S stable ones, for rows whose root sits at r [B]. Returns (draft cache,
    hidden [B, k, H], the children's log-probs and target ids [B, k, k], the nodes' ancestor
    masks [B, k, tree_slots])."""
    b, k, s = front.tok.shape[0], tree.top_k, shape.slots
    own = jax.nn.one_hot((lvl - 2) * k + jnp.arange(k), tree.tree_slots, dtype=bool)  # [k, TS]
    anc = front.anc | own[None]
    stable = jnp.arange(s)[None, None, :] < r[:, None, None]  # [B, 1, S]
    extra = _draft_slots(dcache) - s - tree.tree_slots  # a larger tree's scratch: unused here
    mask = jnp.concatenate(
        [jnp.broadcast_to(stable, (b, k, s)), anc, jnp.zeros((b, k, extra), bool)], axis=-1
    )
    pos = jnp.broadcast_to((r + lvl - 2)[:, None], (b, k))

    def expand(dc):
        o = drf.forward(
            dparams,
            embed,
            front.tok,
            front.h,
            pos,
            mask,
            dcfg,
            dc,
            jnp.full((b,), s + (lvl - 2) * k, jnp.int32),
            compute_logits=False,
            target_features=False,
        )
        return (o.cache, o.hidden, *draft_output.draft_topk(dparams, o.hidden, dcfg, vocab, k))

    if tree.verify_threshold <= 0:
        return (*expand(dcache), anc)
    # adaptive verification: a level whose expanded nodes all score below the threshold can only
    # add nodes below it (a child never outscores its parent), so the draft skips it at run time
    shapes = jax.eval_shape(expand, dcache)

    def skip(dc):
        _, h, sc, tk = shapes
        h, tk = jnp.zeros(h.shape, h.dtype), jnp.zeros(tk.shape, tk.dtype)
        return dc, h, jnp.full(sc.shape, NEG_SCORE, sc.dtype), tk

    log_thr = float(np.log(tree.verify_threshold))
    run = jnp.any((front.score >= log_thr) & running[:, None])
    return (*jax.lax.cond(run, expand, skip, dcache), anc)


def eagle3_drafter(
    dparams,
    embed,
    vocab: DraftVocab,
    state: SpecState,
    dcfg: drf.DraftConfig,
    shape: Shape,
    tree: TreeConfig,
):
    """EAGLE-2's dynamic tree: encode the new pairs, take the top-k children of the root, then
    `depth - 1` levels each expanding the k best nodes (by cumulative log-prob) with a mask of
    prefix + ancestors; the global top-N of the candidate pool is the tree (`select_tree`).
    Returns (Tree [B-batched, N + 1 nodes], draft cache)."""
    b, k = state.root.shape[0], tree.top_k
    h0, dcache = _encode_pairs(dparams, embed, state, dcfg, shape, tree)
    score, tok = draft_output.draft_topk(
        dparams, h0, dcfg, vocab, k
    )  # [B, k] log-probs, target ids
    pool_tok, pool_par, pool_score = [tok], [jnp.full((b, k), -1, jnp.int32)], [score]
    front = _Frontier(
        idx=jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k)),
        tok=tok,
        score=score,
        h=jnp.broadcast_to(h0[:, None, :], (b, k, h0.shape[-1])),
        anc=jnp.zeros((b, k, tree.tree_slots), bool),
    )
    running = state.finish == 0
    for lvl in range(2, tree.depth + 1):
        dcache, hidden, cs, ct, anc = _level(
            dparams, embed, vocab, dcache, front, state.length, lvl, running, dcfg, shape, tree
        )
        # hidden [B, k, H]; cs, ct [B, k, k]: children's log-probs and target ids
        cum = (front.score[:, :, None] + cs).reshape(b, k * k)
        child_tok = ct.reshape(b, k * k)
        pool_tok.append(child_tok)
        pool_par.append(jnp.repeat(front.idx, k, axis=1))
        pool_score.append(cum)
        if lvl < tree.depth:
            nxt_score, j = jax.lax.top_k(cum, k)
            par = j // k
            front = _Frontier(
                idx=k + (lvl - 2) * k * k + j,
                tok=jnp.take_along_axis(child_tok, j, axis=1),
                score=nxt_score,
                h=jnp.take_along_axis(hidden, par[:, :, None], axis=1),
                anc=jnp.take_along_axis(anc, par[:, :, None], axis=1),
            )
    pool = [jnp.concatenate(x, axis=1) for x in (pool_tok, pool_par, pool_score)]
    trees = jax.vmap(select_tree, in_axes=(0, 0, 0, 0, None))(state.root, *pool, tree.n)
    return trees, dcache


def pld_drafter(
    dparams,
    embed,
    vocab,
    state: SpecState,
    dcfg,
    shape: Shape,
    tree: TreeConfig,
    max_ngram: int = 3,
):
    """Prompt lookup decoding: find the latest earlier occurrence of the context's last n tokens
    (n = max_ngram, then shorter) and propose the `depth` tokens that followed it, as a chain."""
    r = state.length
    hist = state.history
    s = hist.shape[1]
    pos = jnp.arange(s)[None, :]
    found = jnp.zeros(r.shape, bool)
    start = jnp.zeros(r.shape, jnp.int32)
    for n in range(max_ngram, 0, -1):
        # match[b, i]: hist[i - n + 1 .. i] == hist[r - n + 1 .. r] with i < r (an EARLIER window)
        match = (pos < r[:, None]) & (pos >= n - 1)
        for m in range(n):
            want = jnp.take_along_axis(hist, jnp.maximum(r - m, 0)[:, None], axis=1)
            match = match & (jnp.roll(hist, m, axis=1) == want) & (r[:, None] >= n - 1)
        last = jnp.max(jnp.where(match, pos, -1), axis=1)
        use = ~found & (last >= 0)
        start = jnp.where(use, last + 1, start)
        found = found | use
    idx = jnp.minimum(start[:, None] + jnp.arange(tree.depth)[None, :], r[:, None])
    chain = jnp.take_along_axis(hist, idx, axis=1)
    return jax.vmap(chain_tree)(
        state.root, chain, jnp.zeros(chain.shape, jnp.float32)
    ), state.dcache


def vanilla_drafter(dparams, embed, vocab, state: SpecState, dcfg, shape: Shape, tree: TreeConfig):
    """No draft: the root alone is verified (plain decoding through the same verification step)."""
    b = state.root.shape[0]
    root_only = jax.vmap(chain_tree)(state.root, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0)))
    return root_only, state.dcache


def encode_drafter(dparams, embed, vocab, state: SpecState, dcfg, shape: Shape, tree: TreeConfig):
    """No draft, but the head keeps up: the root alone is verified, and the pairs not yet in the
    draft cache are encoded as EAGLE-3's round encodes them only once some running row's
    buffer is full (`pairs_full`: E pairs); until then each round's new pair is appended to the
    buffer instead (`speculative.append_pair`), so the head runs once every E - 1 plain rounds,
    on E pairs at a time, and a later speculative round encodes what is left and drafts from the
    whole context. Serving's plain rounds with a head (`slots.TreeSchedule`)."""
    dcache = jax.lax.cond(
        pairs_full(state),
        lambda: _encode_pairs(dparams, embed, state, dcfg, shape, tree)[1],
        lambda: state.dcache,
    )
    return vanilla_drafter(dparams, embed, vocab, state, dcfg, shape, tree)[0], dcache


def pairs_full(state: SpecState) -> jax.Array:
    """[] whether a running row holds E pairs not yet encoded (no room for another)."""
    return jnp.any((state.finish == 0) & (state.enc_n >= state.enc_tok.shape[1]))


DRAFTERS = {"eagle3": eagle3_drafter, "pld": pld_drafter, "vanilla": vanilla_drafter}


def method_head_tree(method, head, tree: TreeConfig, where: str = ""):
    """(the head `method` drafts with, or None; the tree it verifies): eagle3 needs a loaded head
    (a `checkpoints.heads.Head`: params, cfg, vocab, embed), pld and vanilla draft without one,
    and the tree is checked against the ids the head drafts from (`method_tree`). `where` ends
    the missing-head error (which flag gives one)."""
    if method == "eagle3" and (head is None or any(x is None for x in head[:3])):
        raise Eagle3Error(f"method eagle3 needs a head: load one with load_head{where}")
    if method != "eagle3" and not callable(method):
        head = None  # pld and vanilla draft without one
    choices = None
    if head is not None and head[1] is not None:  # SpecVocab drafts among its candidates only
        dcfg = head[1]
        choices = dcfg.draft_choices
    return head, method_tree(method, tree, choices)


def method_tree(method, tree: TreeConfig, draft_vocab_size: int | None) -> TreeConfig:
    """The tree each method verifies: eagle3 (or a drafter function) its own, checked against the
    ids it drafts from; pld a chain of `depth`; vanilla the root alone."""
    if method == "vanilla":
        return TreeConfig(top_k=1, depth=1, total_tokens=1)
    if method == "pld":
        return TreeConfig(top_k=1, depth=tree.depth, total_tokens=tree.depth + 1).validate(1)
    if method != "eagle3" and not callable(method):
        raise Eagle3Error(f"unknown method {method!r}: use eagle3, pld or vanilla")
    return tree.validate(draft_vocab_size or tree.top_k)
