"""Verification rules: which drafted nodes the target accepts, and the bonus token.

Greedy: node i is accepted when it equals the target's argmax at its parent and its parent is
accepted; the deepest accepted node wins (the first on ties) and the bonus is the argmax there.

Sampling (temperature > 0, top-k/top-p applied to the TARGET's distribution p): the draft is treated
as deterministic (q = 1), and each level samples from p by trying the current node's children in
order: accept child x with probability p(x) / sum(p); on rejection set p(x) = 0 and try the next
child; if all fail, the bonus is drawn from what is left of p. Each step draws exactly from p
conditioned on the earlier rejections, so the emitted token has distribution p whatever the draft
proposed (see docs/speculative_sampling.md for the argument).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3_jax.decoding.sampling import Sampling, log_probs
from eagle3_jax.decoding.tree import Accepted, Tree, greedy_accept


def accept(
    trees: Tree,
    logits_BNV: jax.Array,
    key: jax.Array,
    sampling: Sampling,
    depth: int,
    max_children: int,
) -> tuple[Accepted, jax.Array]:
    """Batched: (Accepted with [B]-leading fields, bonus [B]). max_children bounds any node's
    child count (the tree's top_k)."""
    b = logits_BNV.shape[0]
    if sampling.greedy:
        target_tokens = jnp.argmax(logits_BNV, axis=-1).astype(jnp.int32)
        acc = jax.vmap(greedy_accept, in_axes=(0, 0, None))(trees, target_tokens, depth)
        return acc, target_tokens[jnp.arange(b), acc.last]
    logp = log_probs(logits_BNV, sampling)
    return jax.vmap(sample_accept, in_axes=(0, 0, 0, None, None))(
        trees, logp, jax.random.split(key, b), depth, max_children
    )


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
