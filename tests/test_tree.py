"""decoding/tree.py: tree selection, pruning and chains on hand-made pools (greedy acceptance over
them: tests/test_verify.py)."""

import jax
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


def _random_parents(rng, m):
    """A random tree of m nodes, parents before children (node 0 the root, its own parent)."""
    return np.array([0] + [int(rng.integers(0, i)) for i in range(1, m)], np.int32)


def test_depth_and_mask_equal_a_walk_up_the_tree():
    """The vectorised closure (log2 squarings) gives every node's depth and ancestors exactly as
    walking up its parents does, for random trees of every size up to EAGLE-3's 60 nodes."""
    from eagle3_jax.decoding.tree import _depth_and_mask

    rng = np.random.default_rng(0)
    for m in [1, 2, 3, 5, 16, 33, 60, 64, 65]:
        parent = _random_parents(rng, m)
        want_mask = np.eye(m, dtype=bool)
        want_depth = np.zeros(m, np.int32)
        for i in range(1, m):
            j = i
            while j != 0:
                j = parent[j]
                want_mask[i, j] = True
                want_depth[i] += 1
        depth, mask = _depth_and_mask(jnp.asarray(parent))
        np.testing.assert_array_equal(depth, want_depth)
        np.testing.assert_array_equal(mask, want_mask)
    chain = chain_tree(jnp.int32(1), jnp.arange(6), jnp.zeros(6))
    np.testing.assert_array_equal(chain.mask, _depth_and_mask(chain.parent)[1])
    np.testing.assert_array_equal(chain.depth, _depth_and_mask(chain.parent)[0])


def test_accepted_path_equals_propagating_acceptance_down_the_tree():
    """Acceptance's one masked reduction (a node is accepted when no ancestor is rejected) picks
    the same deepest node, length and path as passing `ok` down from parent to child did."""
    from eagle3_jax.decoding.tree import Tree, _depth_and_mask
    from eagle3_jax.decoding.verify import accepted_path

    # compiled as decoding runs them (one small program per tree size, not every operation alone)
    _depth_and_mask = jax.jit(_depth_and_mask)
    accepted_path = jax.jit(accepted_path, static_argnums=2)
    rng = np.random.default_rng(1)
    for trial in range(40):
        m = int(rng.integers(1, 40))
        parent = _random_parents(rng, m)
        depth, mask = _depth_and_mask(jnp.asarray(parent))
        ok = rng.random(m) < 0.7
        prop = ok.copy()
        prop[0] = True
        for i in range(1, m):
            prop[i] = prop[i] and prop[parent[i]]
        best = int(np.argmax(np.where(prop, np.asarray(depth), -1)))
        max_depth = int(np.max(depth)) + 1
        tree = Tree(jnp.zeros(m, jnp.int32), jnp.asarray(parent), depth, mask, jnp.zeros(m))
        acc = accepted_path(tree, jnp.asarray(ok), max_depth)
        assert int(acc.last) == best and int(acc.length) == int(depth[best]), trial
        path = [best]
        while path[-1] != 0:
            path.append(int(parent[path[-1]]))
        path = path[::-1] + [best] * (max_depth + 1 - len(path))
        np.testing.assert_array_equal(acc.path, path)
