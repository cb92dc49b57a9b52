"""evaluation/paired.py: Student's t quantiles, paired intervals over questions, method comparison."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import rec

from eagle3_jax.evaluation import paired

# two-sided 95 % and 99 % critical values from a printed t table
T_TABLE = [
    (0.975, 1, 12.706),
    (0.975, 2, 4.303),
    (0.975, 4, 2.776),
    (0.975, 10, 2.228),
    (0.975, 30, 2.042),
    (0.975, 120, 1.980),
    (0.995, 5, 4.032),
    (0.995, 20, 2.845),
]


@pytest.mark.parametrize("p,df,want", T_TABLE)
def test_t_quantile_matches_the_table(p, df, want):
    assert paired.t_quantile(p, df) == pytest.approx(want, abs=6e-4)


def test_t_quantile_tends_to_the_normal():
    assert paired.t_quantile(0.975, 100_000) == pytest.approx(1.959964, abs=1e-4)


def test_t_quantile_refuses_what_it_cannot_answer():
    with pytest.raises(ValueError):
        paired.t_quantile(0.4, 5)
    with pytest.raises(ValueError):
        paired.t_quantile(0.975, 0)


def test_interval_is_the_t_interval():
    m, lo, hi = paired.interval([1.0, 2.0, 3.0, 4.0, 5.0])
    half = paired.t_quantile(0.975, 4) * np.std([1, 2, 3, 4, 5], ddof=1) / math.sqrt(5)
    assert m == 3.0
    assert (lo, hi) == pytest.approx((3.0 - half, 3.0 + half))
    assert half == pytest.approx(1.9632, abs=1e-3)
    m, lo, hi = paired.interval([2.0, float("nan")])  # one finite value: no interval
    assert m == 2.0 and math.isnan(lo) and math.isnan(hi)


def test_paired_difference_uses_only_shared_questions():
    a = {"q1": 2.0, "q2": 3.0, "q3": 4.0, "only_a": 100.0}
    b = {"q1": 1.0, "q2": 2.5, "q3": 3.0, "only_b": -100.0}
    d = paired.paired_difference(a, b)
    assert d.n == 3 and d.mean == pytest.approx((1.0 + 0.5 + 1.0) / 3)
    assert d.lo < d.mean < d.hi and not d.ratio


def test_ratio_is_taken_on_the_log_scale():
    a = {"q1": 2.0, "q2": 8.0, "q3": 0.5}
    b = {"q1": 1.0, "q2": 4.0, "q3": 0.25}
    r = paired.paired_difference(a, b, ratio=True)
    assert (r.mean, r.lo, r.hi) == pytest.approx((2.0, 2.0, 2.0))
    assert r.real and r.text() == "2.00 (2.00, 2.00)*"


def test_an_interval_across_no_difference_is_not_real():
    a = {f"q{i}": 1.0 + (0.1 if i % 2 else -0.1) for i in range(10)}
    b = {f"q{i}": 1.0 for i in range(10)}
    d = paired.paired_difference(a, b)
    assert d.lo < 0 < d.hi and not d.real and "*" not in d.text()


def test_compare_pairs_per_question_and_pools_seeds():
    recs = []
    for i in range(8):
        # reference: tau (41 - 1) / (21 - 1) = 2; method: (41 - 1) / (11 - 1) = 4, twice as fast
        recs.append(rec(i, "ref", 0, 41, 21, 2.0, task="qa"))
        recs.append(rec(i, "m", 0, 41, 11, 1.0, task="qa"))
        recs.append(rec(i, "m", 1, 41, 11, 1.0, task="qa"))
    out = paired.compare(recs, "m", "ref")
    assert out["tau"].n == 8 and out["tau"].mean == pytest.approx(2.0)
    assert out["throughput"].mean == pytest.approx(2.0) and out["throughput"].ratio
    assert paired.compare(recs, "m", "ref", task="math_reasoning")["tau"].n == 0
