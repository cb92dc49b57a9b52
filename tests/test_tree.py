"""decoding/tree.py: tree selection, pruning and chains on hand-made pools (greedy acceptance over
them: tests/test_verify.py)."""

import jax.numpy as jnp
import numpy as np
from helpers import draft_pool

from eagle3_jax.decoding.tree import chain_tree, prune_tree, select_tree
from eagle3_jax.decoding.verify import greedy_accept


def test_select_tree_takes_the_top_n_with_parents_first():
    tree = select_tree(jnp.int32(7), *draft_pool(), n=4)  # top-4 scores: pool 0, 2, 6, 1
    np.testing.assert_array_equal(tree.tokens, [7, 10, 11, 12, 16])
    np.testing.assert_array_equal(tree.parent, [0, 0, 0, 1, 3])
    np.testing.assert_array_equal(tree.depth, [0, 1, 1, 2, 3])
    expect = np.array(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    )
    np.testing.assert_array_equal(tree.mask, expect.astype(bool))


def test_pruning_a_tree_equals_selecting_fewer_nodes():
    """prune_tree(select(n), m) is select(m - 1) for every m: the best m - 1 nodes, parents first,
    the same tokens, parents, depths, masks and scores (adaptive verification relies on it)."""
    full = select_tree(jnp.int32(7), *draft_pool(), n=6)
    for size in range(1, 8):
        got = prune_tree(full, size)
        want = select_tree(jnp.int32(7), *draft_pool(), n=size - 1) if size > 1 else None
        if want is None:  # the root alone
            np.testing.assert_array_equal(got.tokens, [7])
            np.testing.assert_array_equal(got.mask, [[True]])
            continue
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


def test_ties_keep_parents():
    tokens = jnp.array([1, 2, 3])
    parent = jnp.array([-1, 0, 1])
    score = jnp.array([-0.5, -0.5, -0.5])  # children with probability 1: equal scores
    tree = select_tree(jnp.int32(0), tokens, parent, score, n=2)
    np.testing.assert_array_equal(tree.tokens, [0, 1, 2])
    np.testing.assert_array_equal(tree.parent, [0, 0, 1])


def test_chain_tree():
    tree = chain_tree(jnp.int32(5), jnp.array([6, 7, 8]), jnp.zeros(3))
    np.testing.assert_array_equal(tree.parent, [0, 0, 1, 2])
    np.testing.assert_array_equal(tree.depth, [0, 1, 2, 3])
    acc = greedy_accept(tree, jnp.array([6, 7, 9, 0]), max_depth=3)
    assert int(acc.length) == 2 and list(np.asarray(acc.path)) == [0, 1, 2, 2]
