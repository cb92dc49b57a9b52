"""Verifying a draft tree (steps 3-4 of a round, see speculative.py): the target's pass over the
tree, the acceptance rules, and the accepted path's tokens, K/V and features.

Greedy: node i is accepted when it equals the target's argmax at its parent and its parent is
accepted; the deepest accepted node wins (the first on ties) and the bonus is the argmax there.

Sampling (temperature > 0, top-k/top-p applied to the TARGET's distribution p): the draft is treated
as deterministic (q = 1), and each level samples from p by trying the current node's children in
order: accept child x with probability p(x) / sum(p); on rejection set p(x) = 0 and try the next
child; if all fail, the bonus is drawn from what is left of p. Each step draws exactly from p
conditioned on the earlier rejections, so the emitted token has distribution p whatever the draft
proposed (see docs/speculative_sampling.md for the argument).

Adaptive verification (`TreeConfig.verify_threshold` > 0): the target runs only the smallest
compiled size (`verify_sizes`) holding every node at or above the threshold in every row.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.config import TargetConfig
from eagle3_jax.decoding.plain import Shape
from eagle3_jax.decoding.sampling import (
    RowSampling,
    Sampling,
    log_probs,
    process_logits,
    row_log_probs,
)
from eagle3_jax.decoding.state import SpecState, TokenLogProbs, gather_path
from eagle3_jax.decoding.tree import Tree, TreeConfig, prune_tree
from eagle3_jax.models import draft as drf
from eagle3_jax.models import target as tgt


class Accepted(NamedTuple):
    length: jax.Array  # [] number of accepted drafted tokens (0..max depth)
    path: jax.Array  # [D+1] node indices root..deepest accepted, padded by repeating the last
    last: jax.Array  # [] the deepest accepted node (its target output gives the bonus token)


def accepted_path(tree: Tree, ok: jax.Array, max_depth: int) -> Accepted:
    """The deepest node whose whole root path is accepted (the first such node on ties). A node's
    path is accepted when no node of its ancestor mask is rejected: one masked reduction over
    [N+1, N+1], not a serial pass down the tree."""
    ok = ok.at[0].set(True)  # the root is always accepted
    ok = ~jnp.any(tree.mask & ~ok[None, :], axis=1)
    best = jnp.argmax(jnp.where(ok, tree.depth, -1)).astype(jnp.int32)
    length = tree.depth[best]
    on_path = tree.mask[best]
    # node at depth d of the path; padding slots (d > length) repeat the deepest accepted node
    slot = jnp.where(on_path, tree.depth, max_depth + 1)
    path = (
        jnp.full((max_depth + 2,), best, jnp.int32).at[slot].set(jnp.arange(tree.parent.shape[0]))
    )
    return Accepted(length, path[: max_depth + 1], best)


def greedy_accept(tree: Tree, target_tokens: jax.Array, max_depth: int) -> Accepted:
    """Greedy verification of one row: node i matches if it equals the target's argmax at its
    parent (target_tokens [N+1])."""
    return accepted_path(tree, tree.tokens == target_tokens[tree.parent], max_depth)


def sample_accept(
    tree: Tree, logp_NV: jax.Array, key: jax.Array, depth: int, max_children: int
) -> tuple[Accepted, jax.Array]:
    """One row of the lossless multi-candidate rule (see the module docstring)."""
    n1 = tree.tokens.shape[0]
    idx = jnp.arange(n1)
    k = min(max_children, n1 - 1)
    probs = jnp.exp(logp_NV)

    def level(carry, key_l):
        cur, p, done, length, path, bonus = carry
        is_child = (tree.parent == cur) & (idx > 0)
        order = jnp.argsort(jnp.where(is_child, idx, n1 + idx))[:k]  # children in tree order
        keys = jax.random.split(key_l, k + 1)
        chosen = jnp.int32(-1)
        for i in range(k):
            c = order[i]
            tok = tree.tokens[c]
            live = is_child[c] & (chosen < 0) & ~done
            take = live & (jax.random.uniform(keys[i]) * jnp.sum(p) < p[tok])
            chosen = jnp.where(take, c, chosen).astype(jnp.int32)
            p = jnp.where(live & ~take, p.at[tok].set(0.0), p)
        moved = chosen >= 0
        stop_here = ~done & ~moved
        residual = jax.random.categorical(keys[k], jnp.log(p)).astype(jnp.int32)
        bonus = jnp.where(stop_here, residual, bonus)
        length = length + moved
        path = jnp.where(moved, path.at[length].set(chosen), path)
        cur = jnp.where(moved, chosen, cur)
        p = jnp.where(moved, probs[jnp.maximum(chosen, 0)], p)
        return (cur, p, done | ~moved, length, path, bonus), None

    init = (
        jnp.int32(0),
        probs[0],
        jnp.bool_(False),
        jnp.int32(0),
        jnp.zeros((depth + 1,), jnp.int32),
        jnp.int32(0),
    )
    keys = jax.random.split(key, depth + 1)
    (cur, p, done, length, path, bonus), _ = jax.lax.scan(level, init, keys[:depth])
    # the whole depth accepted: the bonus comes from the target at the deepest node
    bonus = jnp.where(
        done, bonus, jax.random.categorical(keys[depth], jnp.log(p)).astype(jnp.int32)
    )
    path = jnp.where(jnp.arange(depth + 1) <= length, path, cur)
    return Accepted(length, path, cur), bonus


def accept(
    trees: Tree,
    logits_BNV: jax.Array,
    key: jax.Array,
    sampling: Sampling,
    depth: int,
    max_children: int,
    rows: RowSampling | None = None,
) -> tuple[Accepted, jax.Array]:
    """Batched: (Accepted with [B]-leading fields, bonus [B]), greedy or sampled as `sampling`
    says, or, given `rows` (and `sampling` not greedy), as each row's settings say: a row at
    temperature 0 gets exactly the greedy rule's verdict. max_children bounds any node's child
    count (the tree's top_k). Greedy also takes the target's tokens themselves, int [B, N+1], in
    place of logits (replay.py's oracle)."""
    b = logits_BNV.shape[0]
    if sampling.greedy or jnp.issubdtype(logits_BNV.dtype, jnp.integer):
        target_tokens = (
            logits_BNV
            if jnp.issubdtype(logits_BNV.dtype, jnp.integer)
            else jnp.argmax(logits_BNV, axis=-1).astype(jnp.int32)
        )
        acc = jax.vmap(greedy_accept, in_axes=(0, 0, None))(trees, target_tokens, depth)
        return acc, target_tokens[jnp.arange(b), acc.last]
    # one key for the batch is split over its rows; a key per row ([B, 2], decoding/slots.py) is
    # split as a batch of one would split it, so a row draws what it would draw decoded alone
    if key.ndim == 2:
        keys = jax.vmap(lambda k: jax.random.split(k, 1)[0])(key)
    else:
        keys = jax.random.split(key, b)

    def sampled(logp):
        return jax.vmap(sample_accept, in_axes=(0, 0, 0, None, None))(
            trees, logp, keys, depth, max_children
        )

    if rows is None:
        return sampled(log_probs(logits_BNV, sampling))
    greedy = accept(trees, logits_BNV, key, Sampling(), depth, max_children)

    def mixed(_):
        drawn = sampled(row_log_probs(logits_BNV, rows))
        is_greedy = rows.temperature == 0
        pick = lambda g, d: jnp.where(is_greedy.reshape((b,) + (1,) * (g.ndim - 1)), g, d)  # noqa
        return jax.tree.map(pick, greedy, drawn)

    # a batch of greedy rows skips the sampling (its sort over the vocabulary) at run time
    return jax.lax.cond(jnp.any(rows.temperature > 0), mixed, lambda _: greedy, None)


def forward_tree(
    tparams, trees: Tree, state: SpecState, tcfg: TargetConfig, dcfg: drf.DraftConfig,
    shape: Shape, cache_rows: jax.Array | None = None,
) -> tgt.Output:  # fmt: skip
    """Step 3: the target over the tree tokens at positions r + depth. It reads the cache (slots
    < r) and writes nothing: the nodes attend to their ancestors through the tree mask, and
    Output.cache holds their new K/V ([B, N+1, G, K] per layer) for the accepted path alone to be
    written. `cache_rows` [B]: the state's cache has more rows and these are the state's
    (`target.forward`; a round over some slots, `speculative.rows_round`)."""
    r = state.length
    n1 = trees.tokens.shape[1]
    slots = jnp.arange(shape.slots)[None, None, :]
    positions = r[:, None] + trees.depth  # [B, N+1]; committed tokens sit at slot = position
    # sliding-window layers narrow it to each node's own window (`target.forward`)
    mask = jnp.broadcast_to(slots < r[:, None, None], (r.shape[0], n1, shape.slots))
    return tgt.forward(
        tparams,
        trees.tokens,
        positions,
        mask,
        tcfg,
        state.tcache,
        r,
        aux_ids=() if dcfg is None else dcfg.aux_layer_ids,
        mask_new=trees.mask,
        cache_rows=cache_rows,
    )


class Verdict(NamedTuple):
    """What a round's verification decided, per row (E: the state's, depth + 1 of its largest
    tree)."""

    accepted: jax.Array  # [B] a: drafted tokens accepted (0 .. depth)
    path_tok: jax.Array  # [B, E] the token after each path node: the accepted drafted ones first
    bonus: jax.Array  # [B] the target's token after the path
    path_kv: dict[str, Any]  # the path's K/V [L, B, E, G, K] (padding repeats its last node)
    enc_feat: jax.Array  # [B, E, F] the path nodes' target aux features (next round's pairs)
    logprobs: TokenLogProbs | None  # [B, E]: the emitted tokens' (Shape.logprobs set), else None
    verified: jax.Array  # [] tree tokens the target ran, root included


def _check(
    tparams, trees: Tree, state: SpecState, key, size: int, tcfg, dcfg, shape, tree, sampling,
    target_pass,
):  # fmt: skip
    """Steps 3-4 on the tree's best `size` nodes: verify, accept, gather the path's K/V.
    Returns the Verdict's fields but `verified`."""
    if size < trees.tokens.shape[1]:
        trees = jax.vmap(prune_tree, in_axes=(0, None))(trees, size)
    tout = target_pass(tparams, trees, state, tcfg, dcfg, shape)
    logits = tout.logits  # a node's logits choose the token emitted after num_new + its depth
    if not jnp.issubdtype(logits.dtype, jnp.integer):  # replay's oracle gives tokens
        logits = process_logits(logits, state.sampling, state.num_new[:, None] + trees.depth,
                                trees)  # fmt: skip
    acc, bonus = accept(trees, logits, key, sampling, tree.depth, tree.top_k, state.sampling)
    # the state's E may exceed this tree's depth + 1 (serving sizes it for its largest tree):
    # the path is padded as it is past the accepted length, by repeating its last node
    e = state.enc_tok.shape[1]
    path = acc.path
    if e > path.shape[1]:
        path = jnp.concatenate([path, jnp.repeat(acc.last[:, None], e - path.shape[1], 1)], 1)
        acc = acc._replace(path=path)
    path_kv = tout.cache and gather_path(tout.cache, acc.path)  # a replay's oracle has none: {}
    path_next = jnp.take_along_axis(acc.path, jnp.minimum(jnp.arange(1, e + 1), e - 1)[None], 1)
    path_tok = jnp.take_along_axis(trees.tokens, path_next, axis=1)
    enc_feat = (
        state.enc_feat
        if tout.aux is None
        else jnp.take_along_axis(tout.aux, acc.path[:, :, None], axis=1)
    )
    logprobs = None
    if shape.logprobs is not None:  # token j of the round comes from path node j's logits
        emit = emitted(path_tok, bonus, acc.length)
        logits = jnp.take_along_axis(tout.logits, acc.path[:, :, None], axis=1)
        logprobs = token_logprobs(logits, emit, shape.logprobs)
    return acc.length, path_tok, bonus, path_kv, enc_feat, logprobs


def emitted(path_tok_BE: jax.Array, bonus_B: jax.Array, accepted_B: jax.Array) -> jax.Array:
    """The tokens a round emits [B, E]: the accepted drafted ones, then the bonus (repeated
    past it, where `_commit` cuts)."""
    j = jnp.arange(path_tok_BE.shape[1])[None, :]
    return jnp.where(j < accepted_B[:, None], path_tok_BE, bonus_B[:, None])


def token_logprobs(logits_BEV: jax.Array, tokens_BE: jax.Array, k: int) -> TokenLogProbs:
    """`TokenLogProbs` of tokens [B, E] under logits [B, E, V] (fp32 log-softmax), with the k
    most likely tokens at each."""
    lp = jax.nn.log_softmax(logits_BEV.astype(jnp.float32), axis=-1)
    own = jnp.take_along_axis(lp, tokens_BE[..., None], axis=-1)[..., 0]
    if k == 0:
        b, e = tokens_BE.shape
        return TokenLogProbs(own, jnp.zeros((b, e, 0), jnp.int32), jnp.zeros((b, e, 0)))
    top, ids = jax.lax.top_k(lp, k)
    return TokenLogProbs(own, ids.astype(jnp.int32), top)


def verify_tree(
    tparams,
    trees: Tree,
    state: SpecState,
    key: jax.Array,
    tcfg: TargetConfig,
    dcfg: drf.DraftConfig | None,
    shape: Shape,
    tree: TreeConfig,
    sampling: Sampling,
    target_pass=forward_tree,
) -> Verdict:
    """Steps 3-4 of a round on the B trees (N + 1 nodes each): the target's pass, acceptance and
    the accepted path. With adaptive verification on the full tree, one `lax.switch` branch per
    compiled size runs the smallest that holds every node at or above the threshold, over the
    running rows. `target_pass` is `forward_tree`, or a function of its arguments giving what
    acceptance reads from it (replay.py's oracle: the target's greedy tokens and features)."""
    n1 = trees.tokens.shape[1]
    check = functools.partial(
        _check, tparams, trees, state, key, tcfg=tcfg, dcfg=dcfg, shape=shape, tree=tree,
        sampling=sampling, target_pass=target_pass,
    )  # fmt: skip
    sizes = tree.verify_sizes if n1 == tree.total_tokens else (n1,)
    if len(sizes) == 1:
        return Verdict(*check(size=n1), verified=jnp.int32(n1))
    passing = trees.score[:, 1:] >= float(np.log(tree.verify_threshold))
    need = jnp.max(jnp.where(state.finish == 0, 1 + jnp.sum(passing, axis=1), 1))
    which = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), need).astype(jnp.int32)
    branches = [functools.partial(lambda _, size: check(size=size), size=z) for z in sizes]
    return Verdict(
        *jax.lax.switch(which, branches, None), verified=jnp.asarray(sizes, jnp.int32)[which]
    )
