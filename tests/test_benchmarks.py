"""The logic inside benchmark scripts: what they time must be what they claim, and their figures
must come from the project's own metrics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers import load_script

from eagle3_jax.models.layers import kv_shapes

attention_layout = load_script("benchmarks/attention_layout.py")
speculative_decoding = load_script("benchmarks/speculative_decoding.py")


def test_attention_layouts_compute_the_same_attention():
    """The benchmark's former [B, S, G, K] formulation and layers.cached_attention give the same
    outputs and caches (new keys written at a nonzero start, a mask over part of the slots), so
    the ratio it reports compares one computation in two layouts."""
    b, t, slots = 2, 4, 16
    groups, heads, dim = attention_layout.GROUPS, attention_layout.HEADS, attention_layout.DIM
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    q = jax.random.normal(keys[0], (b, t, heads, dim))
    k_new = jax.random.normal(keys[1], (b, t, groups, dim))
    v_new = jax.random.normal(keys[2], (b, t, groups, dim))
    k_bsgk = jax.random.normal(keys[3], (b, slots, groups, dim))
    v_bsgk = jax.random.normal(keys[4], (b, slots, groups, dim))
    start = jnp.array([3, 7], jnp.int32)
    pos = start[:, None] + jnp.arange(t)[None]  # each query sees the slots up to its own
    mask = jnp.arange(slots)[None, None, :] <= pos[:, :, None]

    out_old, (kc_old, vc_old) = attention_layout.bsgk_attention(
        q, k_new, v_new, (k_bsgk, v_bsgk), start, mask
    )
    kshape, vshape = kv_shapes(b, slots, groups, dim)
    kv = (k_bsgk.transpose(0, 2, 3, 1), v_bsgk.transpose(0, 2, 1, 3))
    assert kv[0].shape == kshape and kv[1].shape == vshape
    out_new, (kc_new, vc_new) = attention_layout.layers_attention(q, k_new, v_new, kv, start, mask)

    np.testing.assert_allclose(out_new, out_old, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(kc_new, kc_old.transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(vc_new, vc_old.transpose(0, 2, 1, 3))


def _record(question, seed, out, forwards, wall, hist=None):
    return {
        "question_id": question,
        "seed": seed,
        "output_ids": out,
        "new_tokens": len(out),
        "target_forwards": forwards,
        "wall_time_s": wall,
        "accept_hist": hist,
    }


def test_speculative_decoding_rows_come_from_the_metrics():
    """τ, throughput, speedup and exactness of the table are eagle3_jax.evaluation.metrics'
    over the run's records: summed tokens over summed time, against vanilla of the same run."""
    names = [name for name, _, _ in speculative_decoding.CONFIGS]
    records = {name: [] for name in names}
    for q in range(2):
        out = list(range(10 + q))
        records["vanilla"].append(_record(q, 0, out, len(out), 1.0 + q))
        for name in names[1:]:
            records[name].append(_record(q, 0, out, 4, 0.5, np.array([1, 2, 1])))
    records["pld chain d4"][1]["output_ids"] = [0]  # one output differs from vanilla's
    rows = {r["name"]: r for r in speculative_decoding.table_rows(records)}

    assert rows["vanilla"]["speedup"] == 1.0 and rows["vanilla"]["identical_to_vanilla"]
    eagle = rows["eagle3 chain d4"]
    assert eagle["tokens_per_s"] == 21 / 1.0
    assert eagle["speedup"] == (21 / 1.0) / (21 / 3.0)
    assert eagle["tau"] == (21 - 2) / (8 - 2)  # prefills left out
    assert eagle["alpha_by_depth"] and eagle["identical_to_vanilla"]
    assert not rows["pld chain d4"]["identical_to_vanilla"]
    assert rows["vanilla"]["alpha_by_depth"] == []
