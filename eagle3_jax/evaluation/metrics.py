"""Metrics over per-question records: tau, throughput, speedup, acceptance by depth, exactness.

τ (`tau_of`) and the acceptance rates by depth (`acceptance_rates`) are defined here once, for
every reader: a `Generation`, decode.py, the harness, the ablation runner and the benchmarks.
This module imports nothing of the package (layer 0), so decoding can use it.

A record is one (question, method, seed) result, a dict with at least `question_id`, `task`,
`method`, `seed`, `new_tokens`, `target_forwards`, `num_generations` (1 per turn; each generation
has its own prefill), `wall_time_s`, `output_ids` (a list per turn) and, for speculative methods,
`accept_hist` (rounds by number of accepted drafted tokens, summed over turns).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

VANILLA = "vanilla"


@dataclasses.dataclass(frozen=True)
class MeanStd:
    """Mean and sample standard deviation (ddof 1; 0 for a single value) over seeds."""

    mean: float
    std: float
    n: int

    def as_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "std": self.std, "n": self.n}


def mean_std(values: Sequence[float]) -> MeanStd:
    """Mean ± sample std of the finite values (NaN mean when none)."""
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    if not v:
        return MeanStd(float("nan"), float("nan"), 0)
    std = float(np.std(v, ddof=1)) if len(v) > 1 else 0.0
    return MeanStd(float(np.mean(v)), std, len(v))


def tau_of(
    new_tokens: int, target_forwards: int, generations: int = 1, no_round: float = math.nan
) -> float:
    """τ: tokens per verification round, the bonus token included, over `generations`
    generations that made `new_tokens` tokens in `target_forwards` target passes; each
    generation's prefill (its first token, its pass) is left out. `no_round` when no round ran
    (NaN: nothing to average; decode.py shows 1.0, one token for the prefill's one pass)."""
    rounds = target_forwards - generations
    return (new_tokens - generations) / rounds if rounds > 0 else no_round


def tau(records: Iterable[dict]) -> float:
    """`tau_of` over all records' generations (`num_generations` each, default 1). NaN when no
    round."""
    recs = list(records)
    return tau_of(
        sum(int(r["new_tokens"]) for r in recs),
        sum(int(r["target_forwards"]) for r in recs),
        sum(int(r.get("num_generations", 1)) for r in recs),
    )


def acceptance_rates(hist) -> list[float]:
    """Per-depth acceptance alpha_d = P(accept >= d+1 | accept >= d) from a rounds-by-length
    histogram ([depth + 1] or [B, depth + 1], summed over rows). NaN where no round reached
    depth d."""
    h = np.asarray(hist).reshape(-1, np.shape(hist)[-1]).sum(0)
    at_least = np.cumsum(h[::-1])[::-1]  # rounds accepting >= d
    return [
        float(at_least[d + 1] / at_least[d]) if at_least[d] else float("nan")
        for d in range(len(h) - 1)
    ]


def verified_per_round(records: Iterable[dict]) -> float:
    """Tree tokens the target verified per round (root included), over the records that counted
    them (speculative ones; adaptive verification makes it vary). NaN when none did."""
    recs = [r for r in records if r.get("verified_tokens") is not None]
    gens = sum(int(r.get("num_generations", 1)) for r in recs)
    rounds = sum(int(r["target_forwards"]) for r in recs) - gens
    return sum(int(r["verified_tokens"]) for r in recs) / rounds if rounds > 0 else float("nan")


def throughput(records: Iterable[dict]) -> float:
    """Generated tokens per second of timed wall time (sum over sum). NaN without time."""
    recs = list(records)
    wall = sum(float(r["wall_time_s"]) for r in recs)
    return sum(int(r["new_tokens"]) for r in recs) / wall if wall > 0 else float("nan")


def speedup(method_records: Iterable[dict], vanilla_records: Iterable[dict]) -> float:
    """Method throughput / vanilla throughput (both from the same run and questions)."""
    base = throughput(vanilla_records)
    return throughput(method_records) / base if base > 0 else float("nan")


def summed_hist(records: Iterable[dict]) -> np.ndarray | None:
    """The records' acceptance histograms summed (None when no record has one)."""
    hists = [np.asarray(r["accept_hist"]) for r in records if r.get("accept_hist") is not None]
    if not hists:
        return None
    width = max(h.shape[-1] for h in hists)
    total = np.zeros(width, np.int64)
    for h in hists:
        total[: h.shape[-1]] += h.reshape(-1, h.shape[-1]).sum(0)
    return total


def acceptance_by_depth(records: Iterable[dict]) -> list[float] | None:
    """Per-depth acceptance alpha_d from the summed histograms (None without histograms)."""
    h = summed_hist(records)
    return None if h is None else acceptance_rates(h)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two outputs share (the index of the first that differs)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def exactness(method_records: Iterable[dict], vanilla_records: Iterable[dict]) -> float:
    """Fraction of (question, seed) pairs whose output (every turn) equals vanilla's."""
    base = {(r["question_id"], r["seed"]): r["output_ids"] for r in vanilla_records}
    pairs = [
        r["output_ids"] == base[(r["question_id"], r["seed"])]
        for r in method_records
        if (r["question_id"], r["seed"]) in base
    ]
    return sum(pairs) / len(pairs) if pairs else float("nan")


def _select(records: Sequence[dict], **match) -> list[dict]:
    return [r for r in records if all(r[k] == v for k, v in match.items())]


def group_stats(records: Sequence[dict], method: str, task: str | None) -> dict:
    """Per-seed tau / throughput / speedup of `method` on `task` (None = all), then mean ± std;
    acceptance by depth from the histograms summed over every seed."""
    scope = records if task is None else _select(records, task=task)
    mine = _select(scope, method=method)
    seeds = sorted({r["seed"] for r in mine})
    taus, tps, sps = [], [], []
    for s in seeds:
        m, v = _select(mine, seed=s), _select(scope, method=VANILLA, seed=s)
        taus.append(tau(m))
        tps.append(throughput(m))
        sps.append(speedup(m, v) if v else float("nan"))
    return {
        "questions": len({r["question_id"] for r in mine}),
        "seeds": seeds,
        "new_tokens": sum(int(r["new_tokens"]) for r in mine),
        "tau": mean_std(taus).as_dict(),
        "throughput": mean_std(tps).as_dict(),
        "speedup": mean_std(sps).as_dict(),
        "acceptance_by_depth": acceptance_by_depth(mine),
        "verified_per_round": verified_per_round(mine),
    }


def summarize(
    records: Sequence[dict], methods: Sequence[str], tasks: Sequence[str], greedy: bool
) -> dict:
    """Per method: stats per task and overall, plus exactness vs vanilla (greedy runs only);
    `replayed` when its records were replayed over vanilla's answers (τ and acceptance only:
    no speedup, and no exactness, their outputs being vanilla's by construction)."""
    out = {}
    for m in methods:
        mine = _select(records, method=m)
        replayed = bool(mine) and all(r.get("replayed") for r in mine)
        out[m] = {
            "tasks": {t: group_stats(records, m, t) for t in tasks},
            "overall": group_stats(records, m, None),
            "exactness": (
                exactness(mine, _select(records, method=VANILLA))
                if greedy and mine and not replayed
                else None
            ),
            "replayed": replayed,
        }
    return {"methods": list(methods), "tasks": list(tasks), "by_method": out}
