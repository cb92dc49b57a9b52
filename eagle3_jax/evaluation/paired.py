"""Paired comparisons of two methods over the same questions, with 95 % intervals.

Every method in a harness run answers the same questions, so the honest comparison is per
question: d_q = x_q(method) - x_q(reference), and the interval is Student's t over the d_q. tau is
compared as a difference (tokens per round); throughput as a ratio, taken on the log scale
(log tokens/s, then exponentiated), so "1.05 (1.02-1.08)" reads "5 % faster, between 2 and 8 %".
The records of one question (its seeds, its turns) are pooled first (tokens over target passes,
or over time): the question is the unit, not the run.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from eagle3_jax.evaluation import metrics


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (p in (0.5, 1)).

    Bisection on the CDF, the density integrated by Simpson's rule: numpy only, accurate to
    1e-6 for df >= 1 at the quantiles an interval needs."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(t: float) -> float:
        x = np.linspace(0.0, t, 4001)
        f = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
        h = t / 4000
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


@dataclasses.dataclass(frozen=True)
class Paired:
    """A paired estimate over n questions: `mean` with its 95 % interval [lo, hi].

    For a ratio the three are ratios (exponentiated from the log scale); `real` says the interval
    excludes no-difference (0 for a difference, 1 for a ratio)."""

    mean: float
    lo: float
    hi: float
    n: int
    ratio: bool = False

    @property
    def real(self) -> bool:
        null = 1.0 if self.ratio else 0.0
        return self.n >= 2 and (self.lo > null or self.hi < null)

    def text(self, digits: int = 2) -> str:
        if self.n < 2:
            return "-"
        sign = "" if self.ratio else "+"
        mark = "*" if self.real else ""
        return f"{self.mean:{sign}.{digits}f} ({self.lo:.{digits}f}, {self.hi:.{digits}f}){mark}"

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "real": self.real}


def interval(diffs: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean of `diffs` and its two-sided t interval at `level` (NaN bounds under 2 values)."""
    d = np.asarray([x for x in diffs if x is not None and math.isfinite(x)], dtype=np.float64)
    if d.size == 0:
        return float("nan"), float("nan"), float("nan")
    m = float(d.mean())
    if d.size < 2:
        return m, float("nan"), float("nan")
    half = t_quantile(0.5 + level / 2, d.size - 1) * float(d.std(ddof=1)) / math.sqrt(d.size)
    return m, m - half, m + half


def per_question(
    records: Iterable[dict], method: str, value: Callable[[list[dict]], float]
) -> dict[str, float]:
    """value(records of one question) for each question `method` answered (its seeds pooled)."""
    by_q: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r["method"] == method:
            by_q[str(r["question_id"])].append(r)
    out = {q: value(rs) for q, rs in by_q.items()}
    return {q: v for q, v in out.items() if v is not None and math.isfinite(v)}


def paired_difference(
    a: dict[str, float], b: dict[str, float], level: float = 0.95, ratio: bool = False
) -> Paired:
    """a - b over the questions both hold (a / b on the log scale when `ratio`)."""
    keys = [k for k in a if k in b]
    if ratio:
        keys = [k for k in keys if a[k] > 0 and b[k] > 0]
        m, lo, hi = interval([math.log(a[k] / b[k]) for k in keys], level)
        return Paired(math.exp(m), math.exp(lo), math.exp(hi), len(keys), ratio=True)
    m, lo, hi = interval([a[k] - b[k] for k in keys], level)
    return Paired(m, lo, hi, len(keys))


def over_baseline(tps: dict[str, float], baseline: Sequence[dict]) -> dict[str, float]:
    """Each question's throughput over plain decoding's of the same question in `baseline` (a
    run's vanilla records); questions without a timed baseline are left out."""
    base = per_question(baseline, metrics.VANILLA, metrics.throughput)
    return {q: v / base[q] for q, v in tps.items() if base.get(q, 0) > 0}


def category_of(record: dict) -> str:
    """A record's category (MT-bench's subcategory; records written before categories were
    kept, and tasks without any, give their task)."""
    return record.get("category") or record["task"]


def compare(
    records: Sequence[dict],
    method: str,
    reference: str,
    task: str | None = None,
    category: str | None = None,
    baselines: dict[str, Sequence[dict]] | None = None,
) -> dict:
    """`method` against `reference` on the same questions (of one task, or one `category_of`,
    when given): tau as a difference, throughput as a ratio, each a `Paired`.

    `baselines` ({method: the plain-decoding records of the run it was timed in}) is for
    methods timed in different runs: each question's throughput is then taken over its own
    run's plain decoding of that question (its speedup) before the two are compared. In one run
    the baseline cancels and the ratio is the plain one."""
    keep = lambda r: task in (None, r.get("task")) and category in (None, category_of(r))  # noqa: E731
    recs = [r for r in records if keep(r)]
    tau_m, tau_r = (per_question(recs, x, metrics.tau) for x in (method, reference))
    tps_m, tps_r = (per_question(recs, x, metrics.throughput) for x in (method, reference))
    if baselines and method in baselines and reference in baselines:
        tps_m, tps_r = (
            over_baseline(tps, [r for r in baselines[x] if keep(r)])
            for tps, x in ((tps_m, method), (tps_r, reference))
        )
    return {
        "tau": paired_difference(tau_m, tau_r),
        "throughput": paired_difference(tps_m, tps_r, ratio=True),
    }
