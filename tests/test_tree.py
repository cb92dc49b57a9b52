"""Tree construction and greedy acceptance on hand-made pools."""

import jax.numpy as jnp
import numpy as np

from eagle3_jax.decoding.tree import chain_tree, prune_tree, select_tree
from eagle3_jax.decoding.verify import greedy_accept


def _pool():
    # level 1: pool 0 (a, -0.1), 1 (b, -1.0); level 2 children of 0: 2 (c, -0.3), 3 (d, -2.0);
    # children of 1: 4 (e, -1.2), 5 (f, -3.0); level 3 child of 2: 6 (g, -0.5)
    tokens = jnp.array([10, 11, 12, 13, 14, 15, 16])
    parent = jnp.array([-1, -1, 0, 0, 1, 1, 2])
    score = jnp.array([-0.1, -1.0, -0.3, -2.0, -1.2, -3.0, -0.5])
    return tokens, parent, score


def test_select_tree_takes_the_top_n_with_parents_first():
    tree = select_tree(jnp.int32(7), *_pool(), n=4)  # top-4 scores: pool 0, 2, 6, 1
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
    full = select_tree(jnp.int32(7), *_pool(), n=6)
    for size in range(1, 8):
        got = prune_tree(full, size)
        want = select_tree(jnp.int32(7), *_pool(), n=size - 1) if size > 1 else None
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


def test_greedy_accept_picks_the_longest_matching_path():
    tree = select_tree(jnp.int32(7), *_pool(), n=6)
    # nodes: 0 root(7), 1:10, 2:11, 3:12 (p1), 4:14 (p2), 5:16 (p3), 6:13? -> check ordering first
    toks = np.asarray(tree.tokens)
    # the target's argmax after each node: root->11, node(11)->14, everything else -> 0
    target = np.zeros(len(toks), np.int32)
    target[0] = 11
    target[list(toks).index(11)] = 14
    acc = greedy_accept(tree, jnp.asarray(target), max_depth=3)
    assert int(acc.length) == 2
    path = np.asarray(acc.path)
    assert [int(toks[i]) for i in path[:3]] == [7, 11, 14]
    assert path[3] == path[2]  # padding repeats the deepest accepted node
    # nothing matches: only the root, bonus from the root
    acc = greedy_accept(tree, jnp.zeros(len(toks), jnp.int32), max_depth=3)
    assert int(acc.length) == 0 and int(acc.last) == 0


def test_chain_tree():
    tree = chain_tree(jnp.int32(5), jnp.array([6, 7, 8]), jnp.zeros(3))
    np.testing.assert_array_equal(tree.parent, [0, 0, 1, 2])
    np.testing.assert_array_equal(tree.depth, [0, 1, 2, 3])
    acc = greedy_accept(tree, jnp.array([6, 7, 9, 0]), max_depth=3)
    assert int(acc.length) == 2 and list(np.asarray(acc.path)) == [0, 1, 2, 2]
