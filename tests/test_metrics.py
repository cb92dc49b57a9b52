"""evaluation/metrics.py: τ, acceptance rates, throughput, speedup, exactness and the summary, on
hand-made records whose numbers are worked out in the comments."""

import math

import numpy as np
import pytest
from helpers import rec

from eagle3_jax.evaluation import metrics


def test_metric_arithmetic():
    a = rec("1", "e", 0, 11, 5, 1.0, [1, 2, 1])  # (11 - 1) / (5 - 1) = 2.5
    b = rec("2", "e", 0, 21, 6, 2.0, [0, 3, 2], gens=2)  # two prefills: (21 - 2) / (6 - 2)
    assert metrics.tau([a]) == 2.5
    assert metrics.tau([a, b]) == pytest.approx((10 + 19) / (4 + 4))
    assert metrics.throughput([a, b]) == pytest.approx(32 / 3.0)
    v = [rec("1", "vanilla", 0, 11, 11, 4.0), rec("2", "vanilla", 0, 21, 21, 8.0)]
    assert metrics.tau(v) == 1.0
    assert metrics.speedup([a, b], v) == pytest.approx((32 / 3) / (32 / 12))
    # summed histogram [1, 5, 3]: alpha_0 = 8/9, alpha_1 = 3/8
    assert metrics.acceptance_by_depth([a, b]) == pytest.approx([8 / 9, 3 / 8])
    assert metrics.acceptance_by_depth(v) is None
    ms = metrics.mean_std([1.0, 2.0, 3.0])
    assert (ms.mean, ms.std, ms.n) == (2.0, 1.0, 3)
    assert metrics.mean_std([4.0]).std == 0.0 and math.isnan(metrics.mean_std([]).mean)
    # per-seed speedup, then mean +- std
    recs = [
        rec("1", "vanilla", 0, 10, 10, 1.0),
        rec("1", "e", 0, 10, 5, 0.5),
        rec("1", "vanilla", 1, 10, 10, 1.0),
        rec("1", "e", 1, 10, 5, 0.25),
    ]
    g = metrics.group_stats(recs, "e", None)
    assert g["speedup"]["mean"] == pytest.approx(3.0)
    assert g["speedup"]["std"] == pytest.approx(math.sqrt(2.0))
    assert g["tau"]["mean"] == pytest.approx(9 / 4)
    # exactness: fraction of questions equal to vanilla
    x = [rec("1", "e", 0, 1, 1, 1, out=[[1]]), rec("2", "e", 0, 1, 1, 1, out=[[5]])]
    y = [rec("1", "vanilla", 0, 1, 1, 1, out=[[1]]), rec("2", "vanilla", 0, 1, 1, 1, out=[[2]])]
    assert metrics.exactness(x, y) == 0.5
    # tree tokens verified per round: over the records that counted them
    a["verified_tokens"], b["verified_tokens"] = 12, 10  # (12 + 10) / (4 + 4) rounds
    assert metrics.verified_per_round([a, b, v[0]]) == pytest.approx(22 / 8)
    assert math.isnan(metrics.verified_per_round(v))


def test_tau_of_leaves_each_generations_prefill_out():
    """τ counts the tokens of the verification rounds, each bonus token included: a generation's
    prefill (its first token and its pass) is left out; `no_round` when no round ran."""
    assert metrics.tau_of(11, 5) == 2.5  # 10 tokens over 4 rounds
    assert metrics.tau_of(21, 6, generations=2) == 19 / 4  # two prefills
    assert metrics.tau_of(8, 8) == 1.0  # vanilla: one token a pass
    assert math.isnan(metrics.tau_of(1, 1))  # a prefill alone: no round to average
    assert metrics.tau_of(1, 1, no_round=1.0) == 1.0  # what decode.py shows


def test_acceptance_rates_are_conditional_per_depth():
    """alpha_d = P(accept >= d + 1 | accept >= d) from rounds by accepted length, rows summed;
    NaN at a depth no round reached."""
    # rounds accepting 0, 1, 2, 3 tokens: 2, 3, 1, 0 -> >= 0: 6, >= 1: 4, >= 2: 1, >= 3: 0
    assert metrics.acceptance_rates([2, 3, 1, 0]) == pytest.approx([4 / 6, 1 / 4, 0.0])
    rows = np.array([[2, 1, 1, 0], [0, 2, 0, 0]])  # [B, depth + 1]: the same summed histogram
    assert metrics.acceptance_rates(rows) == pytest.approx([4 / 6, 1 / 4, 0.0])
    rates = metrics.acceptance_rates([3, 0, 0])  # nothing accepted: depth 1 never reached
    assert rates[0] == 0.0 and math.isnan(rates[1])
    # histograms of different depths sum by accepted length (summed_hist pads the shorter)
    hists = [rec("1", "e", 0, 5, 3, 1.0, [1, 1]), rec("2", "e", 0, 5, 3, 1.0, [[0, 1, 1]])]
    np.testing.assert_array_equal(metrics.summed_hist(hists), [1, 2, 1])


def test_summarize_per_task_overall_and_exactness():
    """Per method: each task's stats and the overall ones; exactness only for greedy runs of
    methods not replayed over vanilla's answers."""
    recs = [
        rec("1", "vanilla", 0, 10, 10, 1.0, task="a", out=[[1, 2]]),
        rec("2", "vanilla", 0, 10, 10, 1.0, task="b", out=[[3, 4]]),
        rec("1", "e", 0, 10, 4, 0.5, [0, 1, 2], task="a", out=[[1, 2]]),
        rec("2", "e", 0, 10, 6, 0.25, [1, 2, 2], task="b", out=[[3, 5]]),
        {**rec("1", "r", 0, 10, 4, 0.0, [0, 1, 2], task="a"), "replayed": True},
    ]
    s = metrics.summarize(recs, ["vanilla", "e", "r"], ["a", "b"], greedy=True)
    assert s["methods"] == ["vanilla", "e", "r"] and s["tasks"] == ["a", "b"]
    e = s["by_method"]["e"]
    assert e["tasks"]["a"]["tau"]["mean"] == pytest.approx(9 / 3)
    assert e["tasks"]["b"]["tau"]["mean"] == pytest.approx(9 / 5)
    assert e["overall"]["tau"]["mean"] == pytest.approx(18 / 8)
    assert e["tasks"]["a"]["speedup"]["mean"] == pytest.approx(2.0)
    assert e["overall"]["speedup"]["mean"] == pytest.approx((20 / 0.75) / (20 / 2.0))
    assert e["overall"]["questions"] == 2 and e["overall"]["new_tokens"] == 20
    assert e["exactness"] == 0.5 and not e["replayed"]
    assert s["by_method"]["vanilla"]["exactness"] == 1.0
    r = s["by_method"]["r"]
    assert r["replayed"] and r["exactness"] is None
    assert r["tasks"]["b"]["questions"] == 0
    sampled = metrics.summarize(recs, ["e"], ["a"], greedy=False)
    assert sampled["by_method"]["e"]["exactness"] is None
