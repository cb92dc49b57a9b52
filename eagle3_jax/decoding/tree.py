"""Draft trees with static shapes: candidate pools, top-N selection, masks, pruning.

A tree has N + 1 nodes: node 0 is the root (the token the target produced last, not yet in its cache),
nodes 1..N are drafted tokens sorted so that every parent precedes its children. Everything here works
on one row; vmap it over the batch. Which nodes the target accepts is verify.py's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Tree(NamedTuple):
    tokens: jax.Array  # [N+1] target-vocabulary ids, root at 0
    parent: jax.Array  # [N+1] parent node (the root is its own parent)
    depth: jax.Array  # [N+1] 0 for the root
    mask: jax.Array  # [N+1, N+1] bool: mask[i, j] = j is i or an ancestor of i
    score: jax.Array  # [N+1] cumulative draft log-prob (0 at the root)


def select_tree(
    root: jax.Array, pool_tokens: jax.Array, pool_parent: jax.Array, pool_score: jax.Array, n: int
) -> Tree:
    """The global top-n of a candidate pool as a tree.

    pool_parent[p] is the pool index of p's parent, -1 for children of the root. A child's score never
    exceeds its parent's (log-probs are <= 0) and top_k breaks ties toward the lower index, which a
    parent always has, so every selected node's parent is selected too.
    """
    _, sel = jax.lax.top_k(pool_score, n)
    sel = jnp.sort(sel)  # pool order: parents before children
    node_of = (
        jnp.zeros(pool_score.shape[0], jnp.int32).at[sel].set(jnp.arange(1, n + 1, dtype=jnp.int32))
    )
    par = pool_parent[sel]
    parent = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.where(par < 0, 0, node_of[jnp.maximum(par, 0)])]
    )
    tokens = jnp.concatenate([root[None].astype(jnp.int32), pool_tokens[sel].astype(jnp.int32)])
    score = jnp.concatenate([jnp.zeros((1,), pool_score.dtype), pool_score[sel]])
    depth, mask = _depth_and_mask(parent)
    return Tree(tokens, parent, depth, mask, score)


def _depth_and_mask(parent: jax.Array) -> tuple[jax.Array, jax.Array]:
    m = parent.shape[0]
    eye = jnp.eye(m, dtype=bool)

    def body(i, carry):
        depth, mask = carry
        p = parent[i]
        depth = depth.at[i].set(depth[p] + 1)
        mask = mask.at[i].set(mask[p] | eye[i])
        return depth, mask

    return jax.lax.fori_loop(1, m, body, (jnp.zeros((m,), jnp.int32), eye))


def chain_tree(root: jax.Array, tokens: jax.Array, scores: jax.Array) -> Tree:
    """A chain root -> tokens[0] -> tokens[1] ... (prompt lookup, or a top-1 draft)."""
    n = tokens.shape[0]
    parent = jnp.arange(n + 1, dtype=jnp.int32) - 1
    parent = parent.at[0].set(0)
    depth, mask = _depth_and_mask(parent)
    return Tree(
        jnp.concatenate([root[None], tokens]).astype(jnp.int32),
        parent,
        depth,
        mask,
        jnp.concatenate([jnp.zeros((1,), scores.dtype), scores]),
    )


def prune_tree(tree: Tree, size: int) -> Tree:
    """The root and the size - 1 best-scoring other nodes, as a tree of `size` nodes in the same
    order. A child never outscores its parent and top_k prefers the lower (parent's) index on
    ties, so every kept node's ancestors are kept: the result is a tree, and it holds every node
    scoring above any dropped one."""
    n1 = tree.tokens.shape[0]
    if size >= n1:
        return tree
    _, best = jax.lax.top_k(tree.score[1:], size - 1)
    idx = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.sort(best).astype(jnp.int32) + 1])
    node_of = jnp.zeros((n1,), jnp.int32).at[idx].set(jnp.arange(size, dtype=jnp.int32))
    return Tree(
        tree.tokens[idx],
        node_of[tree.parent[idx]],
        tree.depth[idx],
        tree.mask[idx][:, idx],
        tree.score[idx],
    )
