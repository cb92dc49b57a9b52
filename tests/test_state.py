"""decoding/state.py: the accepted path's K/V written where each row's sequence goes on, in both
cache layouts (a list of layers and [L, ...]-stacked), and the EOS mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.decoding.state import eos_mask, gather_path, map_cache, write_pending
from eagle3_jax.models.layers import kv_shapes

L, B, S, G, K, E = 3, 2, 12, 2, 4, 3


def _caches(seed: int):
    rng = np.random.default_rng(seed)
    kshape, vshape = kv_shapes(B, S, G, K)
    cache = {
        "k": [rng.normal(size=kshape).astype(np.float32) for _ in range(L)],
        "v": [rng.normal(size=vshape).astype(np.float32) for _ in range(L)],
    }
    pending = {n: rng.normal(size=(L, B, E, G, K)).astype(np.float32) for n in "kv"}
    return cache, pending


def test_write_pending_puts_each_rows_path_at_its_own_slot():
    """Row b's E entries (pending [L, B, E, G, K]) land at slots at[b]..at[b]+E-1 of every layer
    (K [B, G, K, S], V [B, G, S, K]); every other slot keeps what it held; stacked caches give
    the same arrays."""
    cache, pending = _caches(0)
    at = np.array([2, 7], np.int32)
    out = write_pending(jax.tree.map(jnp.asarray, cache), jax.tree.map(jnp.asarray, pending), at)
    for layer in range(L):
        want_k, want_v = cache["k"][layer].copy(), cache["v"][layer].copy()
        for b in range(B):
            want_k[b, :, :, at[b] : at[b] + E] = pending["k"][layer][b].transpose(1, 2, 0)
            want_v[b, :, at[b] : at[b] + E, :] = pending["v"][layer][b].transpose(1, 0, 2)
        np.testing.assert_array_equal(out["k"][layer], want_k)
        np.testing.assert_array_equal(out["v"][layer], want_v)
    stacked = write_pending({n: jnp.stack(cache[n]) for n in "kv"}, pending, at)
    for n in "kv":
        np.testing.assert_array_equal(stacked[n], np.stack(out[n]))


def test_map_cache_applies_per_layer_in_both_layouts():
    cache, _ = _caches(1)
    listed = map_cache(lambda k: k * 2.0, {n: [jnp.asarray(x) for x in cache[n]] for n in "kv"})
    stacked = map_cache(lambda k: k * 2.0, {n: jnp.stack(cache[n]) for n in "kv"})
    for n in "kv":
        np.testing.assert_array_equal(np.stack(listed[n]), stacked[n])
        np.testing.assert_array_equal(stacked[n], 2.0 * np.stack(cache[n]))


def test_eos_mask():
    tok = jnp.array([[5, 2, 9], [0, 7, 2]])
    np.testing.assert_array_equal(
        eos_mask(tok, (2, 7)), [[False, True, False], [False, True, True]]
    )
    assert not eos_mask(tok, ()).any() and eos_mask(tok, ()).shape == tok.shape


def test_gather_path_takes_each_rows_path_nodes_from_every_layer():
    """The path's K/V for all layers in one gather: node path[b, e] of layer l's new entries
    [B, N+1, G, K] at [l, b, e], from a list of layers or a stacked array alike."""
    rng = np.random.default_rng(2)
    n1 = 6
    new = {n: [rng.normal(size=(B, n1, G, K)).astype(np.float32) for _ in range(L)] for n in "kv"}
    path = np.array([[0, 2, 5], [0, 1, 1]], np.int32)  # row 1 accepted one node, padded
    got = gather_path(jax.tree.map(jnp.asarray, new), jnp.asarray(path))
    same = gather_path({n: jnp.stack(new[n]) for n in "kv"}, jnp.asarray(path))
    for n in "kv":
        want = np.stack([[new[n][lyr][b, path[b]] for b in range(B)] for lyr in range(L)])
        assert got[n].shape == (L, B, E, G, K)
        np.testing.assert_array_equal(got[n], want)
        np.testing.assert_array_equal(same[n], want)
