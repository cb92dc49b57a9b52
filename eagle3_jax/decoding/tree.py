"""Draft trees with static shapes: their shape (`TreeConfig`, and the backend's default tree),
candidate pools, top-N selection, masks, pruning.

A tree has N + 1 nodes: node 0 is the root (the token the target produced last, not yet in its cache),
nodes 1..N are drafted tokens sorted so that every parent precedes its children. Everything here works
on one row; vmap it over the batch. Which nodes the target accepts is verify.py's.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from eagle3_jax.errors import Eagle3Error


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """EAGLE-2 dynamic tree: `depth` drafted tokens at most per path, `top_k` children per expanded
    node, `total_tokens` nodes verified per round including the root (SGLang's
    num-draft-tokens). A chain is top_k = 1, total_tokens = depth + 1. EAGLE's own `depth` flag
    counts expansion steps after the first: its depth d is our depth d + 1."""

    top_k: int = 4
    depth: int = 4
    total_tokens: int = 16
    # adaptive verification: > 0 verifies only the nodes whose cumulative draft probability is at
    # least this (rounded up to one of verify_sizes, the largest need over the batch), and skips
    # draft levels no node could pass; 0 verifies every node every round
    verify_threshold: float = 0.0

    @property
    def n(self) -> int:
        return self.total_tokens - 1

    @property
    def round_slots(self) -> int:
        """Cache slots a round may write past the committed length: the verified tree's nodes and
        the accepted path (depth + 1 entries, padded), whichever is longer."""
        return max(self.total_tokens, self.depth + 1)

    @property
    def verify_sizes(self) -> tuple[int, ...]:
        """Tree sizes (root included) a round may verify: one compiled target forward each."""
        if self.verify_threshold <= 0:
            return (self.total_tokens,)
        small = {1} | {2**i for i in range(1, 8) if 2**i < self.total_tokens}
        return tuple(sorted(small | {self.total_tokens}))

    @property
    def pool_size(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k**2

    @property
    def tree_slots(self) -> int:
        """Draft cache slots for the nodes expanded in one round (never kept across rounds)."""
        return (self.depth - 1) * self.top_k

    def validate(self, draft_vocab_size: int) -> TreeConfig:
        if self.depth < 1:
            raise Eagle3Error(f"tree depth {self.depth} < 1: draft at least one token per round")
        if self.top_k < 1:
            raise Eagle3Error(f"top_k {self.top_k} < 1")
        if self.top_k > draft_vocab_size:
            raise Eagle3Error(
                f"top_k {self.top_k} exceeds the draft vocabulary ({draft_vocab_size})"
            )
        if not 0 <= self.verify_threshold < 1:
            raise Eagle3Error(
                f"verify threshold {self.verify_threshold} must be in [0, 1): a cumulative draft "
                "probability (0: verify every node)"
            )
        if not 2 <= self.total_tokens <= self.pool_size + 1:
            raise Eagle3Error(
                f"total_tokens {self.total_tokens} must be in 2..{self.pool_size + 1} for top_k "
                f"{self.top_k} and depth {self.depth} (root + at most {self.pool_size} candidates)"
            )
        return self


# The tree decode.py and the evaluation harness use when none is given, by backend: on a CPU the
# best shape measured with the shipped SmolLM2 head (few nodes, adaptive verification); on
# accelerators, where verifying more tokens is nearly free, the shape EAGLE-3 and SpecVocab report
# tau with (top-k 10, 60 tokens, EAGLE's depth 7 = ours 8). Measurements: BENCHMARKS.md.
CPU_TREE = TreeConfig(top_k=2, depth=3, total_tokens=4, verify_threshold=0.3)
ACCELERATOR_TREE = TreeConfig(top_k=10, depth=8, total_tokens=60)


def default_tree(
    backend: str | None = None,
    top_k: int | None = None,
    depth: int | None = None,
    total_tokens: int | None = None,
    verify_threshold: float | None = None,
) -> TreeConfig:
    """The backend's default tree (`jax.default_backend()` unless given), with any given field in
    place of the default's. An unspecified total is capped at what the given top_k and depth can
    hold, so `top_k=1` is a chain (of the given or the default depth)."""
    if backend is None:
        backend = jax.default_backend()
    base = CPU_TREE if backend == "cpu" else ACCELERATOR_TREE
    tree = TreeConfig(
        top_k=base.top_k if top_k is None else top_k,
        depth=base.depth if depth is None else depth,
        total_tokens=base.total_tokens if total_tokens is None else total_tokens,
        verify_threshold=base.verify_threshold if verify_threshold is None else verify_threshold,
    )
    if total_tokens is None and tree.top_k == 1:
        tree = dataclasses.replace(tree, total_tokens=tree.depth + 1)  # a chain
    elif total_tokens is None and tree.top_k >= 1 and tree.depth >= 1:
        tree = dataclasses.replace(tree, total_tokens=min(tree.total_tokens, tree.pool_size + 1))
    return tree


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
    """Each node's depth [M] and ancestor mask [M, M] (mask[i, j]: j is i or an ancestor of i)
    from its parent [M] (the root is its own parent), without a serial loop over the nodes: the
    reflexive closure of the parent relation by repeated squaring, ceil(log2 M) boolean products
    of [M, M] (6 for EAGLE-3's 60-node tree, where a loop over nodes was 59 dependent steps,
    each a kernel on a GPU). Exact: boolean, whatever the order of the sums."""
    m = parent.shape[0]
    reach = jnp.eye(m, dtype=jnp.int32) | jax.nn.one_hot(parent, m, dtype=jnp.int32)
    # reach covers paths of up to 2^i edges after i squarings; a path has at most m - 1 edges
    for _ in range(max(m - 1, 1).bit_length()):
        reach = jnp.minimum(jnp.matmul(reach, reach), 1)
    mask = reach.astype(bool)
    return jnp.sum(reach, axis=1, dtype=jnp.int32) - 1, mask


def chain_tree(root: jax.Array, tokens: jax.Array, scores: jax.Array) -> Tree:
    """A chain root -> tokens[0] -> tokens[1] ... (prompt lookup, or a top-1 draft)."""
    n = tokens.shape[0]
    depth = jnp.arange(n + 1, dtype=jnp.int32)
    parent = jnp.maximum(depth - 1, 0)
    mask = depth[None, :] <= depth[:, None]  # a chain's ancestors: every earlier node
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
