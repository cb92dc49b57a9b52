"""The logic inside benchmark scripts: what they time must be what they claim, and their figures
must come from the project's own metrics."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from helpers import load_script, rec

from eagle3_jax.models.layers import kv_shapes

ROOT = Path(__file__).resolve().parents[1]

attention_layout = load_script("benchmarks/attention_layout.py")
speculative_decoding = load_script("benchmarks/speculative_decoding.py")
draft_cost = load_script("benchmarks/draft_cost.py")


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


def test_speculative_decoding_rows_come_from_the_metrics():
    """τ, throughput, speedup and exactness of the table are eagle3_jax.evaluation.metrics'
    over the run's records: summed tokens over summed time, against vanilla of the same run."""
    names = [name for name, _, _ in speculative_decoding.CONFIGS]
    records = {name: [] for name in names}
    for q in range(2):
        out = list(range(10 + q))
        records["vanilla"].append(rec(q, "vanilla", 0, len(out), len(out), 1.0 + q, out=out))
        for name in names[1:]:
            records[name].append(rec(q, name, 0, len(out), 4, 0.5, np.array([1, 2, 1]), out=out))
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


def test_bf16_exactness_compares_verification_with_steps_at_the_same_positions(
    sharp_target_dir, monkeypatch
):
    """In float32 the verification's logits match n decode steps' to rounding (1.9e-5 on this
    peaked tiny model, whose logits of neighbouring positions differ by ~12), so the benchmark's
    bfloat16 differences are the dtype's and not an offset between the two."""
    from eagle3_jax.checkpoints import load_target

    bf16_exactness = load_script("benchmarks/bf16_exactness.py")
    monkeypatch.setattr(bf16_exactness, "TEXT", " ".join(f"w{i}" for i in range(5, 40, 3)))
    found = bf16_exactness.verify_against_steps(load_target(str(sharp_target_dir)), n=4)
    assert found["tokens"] == 4 and found["logits_dtype"] == "float32"
    assert found["max_logit_difference"] < 1e-3, found


def test_profile_round_counts_self_time_once(tmp_path):
    """op_self_times: a parent's children are taken out of its time (nested spans on one thread),
    another thread's events are not, runtime events are left out, kinds drop the HLO number."""
    import gzip
    import json

    profile_round = load_script("benchmarks/profile_round.py")
    runtime = profile_round.NOT_OPS[1]  # a runtime event, not an operation
    events = [
        {"ph": "X", "name": "fusion.1", "tid": 1, "ts": 0, "dur": 100},
        {"ph": "X", "name": "dot.7", "tid": 1, "ts": 10, "dur": 30},
        {"ph": "X", "name": "dot.8", "tid": 1, "ts": 50, "dur": 20},
        {"ph": "X", "name": "fusion.2", "tid": 2, "ts": 20, "dur": 40},  # another thread
        {"ph": "X", "name": runtime + "x", "tid": 1, "ts": 200, "dur": 999},
        {"ph": "i", "name": "dot.9", "tid": 1, "ts": 5},  # not a span
    ]
    trace = tmp_path / "plugins/profile/run1/host.trace.json.gz"
    trace.parent.mkdir(parents=True)
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)

    kinds = profile_round.op_self_times(str(tmp_path))
    assert kinds == {"fusion": 100 - 30 - 20 + 40, "dot": 50}


def test_training_benchmark_times_the_training_step(tiny_target_dir):
    """benchmarks/training.py's worker starts the config's head as `train` does and times the real
    step: on the tiny config it reports the shapes it ran, its throughput and a finite loss."""
    import argparse

    training = load_script("benchmarks/training.py")
    args = argparse.Namespace(
        config=str(ROOT / "configs/tiny.py"), target=str(tiny_target_dir), steps=2, seq=32,
        batch=2, data=1, model=1,
    )  # fmt: skip
    row = training.worker(args)
    assert row["mesh"] == "1x1" and row["batch"] == 2 and row["seq"] == 32
    assert row["draft_vocab"] == 64 and row["ttt_steps"] >= 1
    assert row["step_s"] > 0 and row["target_tokens_per_s"] == 2 * 32 / row["step_s"]
    assert np.isfinite(row["loss"]) and row["loss"] > 0


def test_draft_cost_times_a_tree_level_as_decoding_runs_it(spec_setup):
    """draft_cost's level (the context prefilled, the root's best children as siblings) through
    its decoder layer gives the hidden states, children and cache that the drafter's own level
    step (drafters._level at depth 2) gives for the same frontier."""
    from eagle3_jax.checkpoints import Target
    from eagle3_jax.checkpoints.heads import Head
    from eagle3_jax.decoding import drafters, plain
    from eagle3_jax.decoding.tree import TreeConfig
    from eagle3_jax.models import draft_output

    params, cfg, dparams, dcfg, vocab = spec_setup
    prompt, r = list(range(5, 31)), 3
    lv, sizes = draft_cost.real_level(
        Target(params, cfg, None, None), Head(dparams, dcfg, vocab), params["embed"], prompt, r
    )
    assert lv.tokens.shape == (1, r) and len(set(np.asarray(lv.tokens[0]).tolist())) == r
    got = draft_cost.level_hidden(dparams, params["embed"], lv, dcfg, sizes)
    tree = TreeConfig(top_k=r, depth=2, total_tokens=r + 1)
    shape = plain.prepare(cfg, [prompt], 8, (), None, 0, tree.round_slots + 1).shape
    front = drafters._Frontier(
        idx=jnp.arange(r)[None], tok=lv.tokens, score=jnp.zeros((1, r)), h=lv.hidden,
        anc=jnp.zeros((1, r, sizes[1]), bool),
    )  # fmt: skip
    _, hidden, _, children, _ = drafters._level(
        dparams, params["embed"], vocab, lv.cache, front, lv.length, 2, jnp.ones((1,), bool),
        dcfg, shape, tree,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), np.asarray(hidden), rtol=1e-5, atol=1e-5)
    _, mine = draft_output.draft_topk(dparams, got, dcfg, vocab, r)
    assert (np.asarray(mine) == np.asarray(children)).all()


def test_draft_cost_times_heads_in_turns():
    """Interleaved: every call runs once when added (compile, warm-up), then once per repetition
    in an order rotated each time, so each head meets the machine's drifting load alike; one
    median a call, in the order they were added."""
    order = []

    def call(name):
        order.append(name)
        return jnp.zeros(())

    timer = draft_cost.Interleaved()
    assert [timer.add(call, n) for n in "abc"] == [0, 1, 2]
    assert order == ["a", "b", "c"]
    ms = timer.run(reps=4)
    assert order[3:] == list("abcbcacababc")
    assert len(ms) == 3 and all(t >= 0 for t in ms)
