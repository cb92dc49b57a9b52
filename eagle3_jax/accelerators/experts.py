"""How many experts a mixture-of-experts forward reads: what the cost model charges a routed layer.

A routed layer holds E experts; its router sends each token to k distinct ones. A forward of B
rows x T tokens routes n = B T tokens through every routed layer, and an engine that runs only the
chosen experts (a grouped product, as vLLM's and SGLang's MoE kernels) reads the weights of the
distinct experts those n tokens chose, once each, whatever the number of tokens per expert. A
plain step at batch 1 reads k experts a layer; a tree verification of 60 tokens reads nearly all
of them. That is what changes the economics of speculation on a MoE target (`roofline`).

Two sources for the count of distinct experts per routed layer, E_touched(n):

  the expectation (`expected_touched`), under uniform, independent routing: a token picks k
    distinct experts of E, so a given expert is left out by one token with probability
    C(E-1, k) / C(E, k) = 1 - k/E, by n independent tokens with probability (1 - k/E)^n, and
    E_touched(n) = E (1 - (1 - k/E)^n): k at n = 1, E in the limit, never above min(E, n k).
    Real routers are not uniform. For tokens that route independently from one common
    distribution, however skewed its load (expert e chosen with probability p_e, sum p_e = k),
    E_touched = sum_e 1 - (1 - p_e)^n, a concave function of the loads, which the uniform load
    maximises (Jensen): the figure is then an upper bound on the expected bytes. It is no bound
    for tokens that prefer different experts from one another (n different prompts of a batch
    can touch more experts than n uniform tokens, up to min(E, n k)); tokens that share a context
    (the nodes of one draft tree, siblings at one position) tend to share experts and touch
    fewer. What a real target does is measured:
  the count from the router (`record_routes`, `distinct_experts`, `ExpertCounts`): the experts
    `models.target.route` chose in real forwards, counted per routed layer and averaged per n,
    stored as a small JSON file the predictor reads instead of the formula.

`Routing` says which source a prediction uses and how the engine dispatches: "routed" (the
engines above, and ours where `models.target.moe_path` gathers or sorts: a small forward
anywhere, and on TPUs larger ones: the touched experts' weights, k experts' FLOPs a token) or
"dense" (ours for a larger forward on the CPU or a GPU: every expert read and run on every
token, E / k times the routed FLOPs). A gather on chips that split the experts takes a matrix
for every pair of its rows, its own or not, more than "routed" charges (`moe_path` keeps it to
forwards of few pairs).
With the experts split over `chips` (expert parallelism, `sharding.Rules.experts`) the time is
the busiest chip's: `busiest_chip` gives its expected share of the touched experts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np

from eagle3_jax.config import TargetConfig
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import target as tgt

# ----------------------------------------------------------------------------- the expectation


def expected_touched(num_experts: int, top_k: int, tokens: float) -> float:
    """E (1 - (1 - k/E)^n): the expected distinct experts `tokens` (n, may be fractional: a mean
    verified size) uniform, independent routings of k distinct experts each touch."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def busiest_chip(num_experts: int, touched: float, chips: int) -> float:
    """The expected number of touched experts on the busiest of `chips` chips that each hold
    E / chips experts, when `touched` of the E are touched: each expert touched with probability
    q = touched / E independently (a binomial approximation: a token's k experts are distinct, so
    the counts are in fact slightly less spread), the chips' counts X_j ~ Binomial(E / chips, q)
    and E[max_j X_j] = sum_x 1 - P(X <= x - 1)^chips. One chip: `touched` itself. Where the chips
    do not divide E the experts are replicated (`sharding.spec_for`) and each chip reads them all."""
    if chips <= 1 or num_experts % chips:
        return touched
    m = num_experts // chips
    q = min(max(touched / num_experts, 0.0), 1.0)
    pmf = [math.comb(m, x) * q**x * (1.0 - q) ** (m - x) for x in range(m + 1)]
    cdf, expect = 0.0, 0.0
    for x in range(1, m + 1):
        cdf += pmf[x - 1]
        expect += 1.0 - min(cdf, 1.0) ** chips
    return expect


# ----------------------------------------------------------------------------- the router's count


def distinct_experts(top_idx: Any, valid: Any = None) -> int:
    """The distinct experts one routed layer's forward chose: `top_idx` int [B, T, k] (the first
    output of `models.target.route`), `valid` bool [B, T] to leave out padding (default: all)."""
    idx = np.asarray(top_idx)
    if valid is not None:
        idx = idx[np.asarray(valid, bool)]
    return int(np.unique(idx).size)


@contextlib.contextmanager
def record_routes():
    """Within the block, every routed layer's choice of experts, as `models.target.route` makes
    it, is appended (a numpy int32 [B, T, k]) to the list this yields, in call order: one entry
    per routed layer per forward of an unrolled target. It wraps `target.route` for the block and
    runs with jit disabled, so the forward runs op by op and its routes are concrete (a compiled
    program would neither call the wrapper nor hold values); measure on a small batch, not at
    serving speed."""
    seen: list[np.ndarray] = []
    real = tgt.route

    def route(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(np.asarray(out[0]))
        return out

    tgt.route = route
    try:
        with jax.disable_jit():
            yield seen
    finally:
        tgt.route = real


@dataclasses.dataclass(frozen=True)
class ExpertCounts:
    """Measured distinct experts per routed layer, by tokens routed per forward (n = B x T):
    `counts[n]` the mean over the routed layers and the forwards measured. Between measured n it
    interpolates linearly (n = 1 is always k); above the largest, it scales the uniform
    expectation by its ratio there; never outside [k, min(E, n k)]."""

    num_experts: int
    top_k: int
    counts: dict[int, float]
    source: str = ""

    def touched(self, tokens: float) -> float:
        e, k = self.num_experts, self.top_k
        if tokens <= 0:
            return 0.0
        pts = sorted({1: float(k), **{int(n): float(c) for n, c in self.counts.items()}}.items())
        ns = [n for n, _ in pts]
        if tokens <= ns[-1]:
            out = float(np.interp(tokens, ns, [c for _, c in pts]))
        else:
            n_hi, c_hi = pts[-1]
            out = c_hi / expected_touched(e, k, n_hi) * expected_touched(e, k, tokens)
        return min(max(out, float(min(k, e))), float(min(e, tokens * k)))

    @classmethod
    def from_routes(
        cls, tcfg: TargetConfig, routes: dict[int, list[Any]], source: str = ""
    ) -> ExpertCounts:
        """From recorded routes: `routes[n]` the [B, T, k] choices of every routed layer in
        forwards of n = B x T tokens (`record_routes`)."""
        counts = {
            int(n): float(np.mean([distinct_experts(r) for r in rs]))
            for n, rs in routes.items()
            if rs
        }
        return cls(tcfg.num_experts, tcfg.num_experts_per_tok, counts, source)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["counts"] = {str(n): c for n, c in sorted(self.counts.items())}
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> ExpertCounts:
        """From `to_json`'s text or a file holding it; a count may be a per-layer list (its mean
        is taken)."""
        path = Path(text_or_path)
        text = path.read_text() if "{" not in str(text_or_path) else str(text_or_path)
        d = json.loads(text)
        try:
            counts = {int(n): float(np.mean(c)) for n, c in d["counts"].items()}
            return cls(int(d["num_experts"]), int(d["top_k"]), counts, d.get("source", ""))
        except (KeyError, TypeError, ValueError) as e:
            raise Eagle3Error(
                f"expert counts need num_experts, top_k and counts {{tokens: distinct}}: {e}"
            ) from e


# ----------------------------------------------------------------------------- what a prediction uses

DISPATCHES = ("routed", "dense")


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a prediction charges routed layers: `dispatch` "routed" (the touched experts read,
    k experts' FLOPs a token) or "dense" (every expert read and run on every token, as
    `models.target._moe`'s dense dispatch does); `measured` counts instead of the uniform
    expectation."""

    dispatch: str = "routed"
    measured: ExpertCounts | None = None

    def __post_init__(self):
        if self.dispatch not in DISPATCHES:
            raise Eagle3Error(f"dispatch {self.dispatch!r}: choose one of {', '.join(DISPATCHES)}")

    def touched(self, tcfg: TargetConfig, tokens: float) -> float:
        """Distinct experts a routed layer reads for `tokens` routed tokens (the mean over the
        layers)."""
        e, k = tcfg.num_experts, tcfg.num_experts_per_tok
        if self.dispatch == "dense":
            return float(e)
        if self.measured is not None:
            if (self.measured.num_experts, self.measured.top_k) != (e, k):
                raise Eagle3Error(
                    f"expert counts for {self.measured.num_experts} experts, top {self.measured.top_k}"
                    f", given for a target of {e}, top {k}"
                )
            return self.measured.touched(tokens)
        return expected_touched(e, k, tokens)

    def experts_per_token(self, tcfg: TargetConfig) -> int:
        """Experts each token is run through: k routed, all E dense."""
        return tcfg.num_experts if self.dispatch == "dense" else tcfg.num_experts_per_tok


ROUTED = Routing()


def dense_twin(tcfg: TargetConfig) -> TargetConfig:
    """A dense target of the same active size: every routed layer's MLP replaced by one SwiGLU
    k x F' wide (the k experts a token runs, side by side), the router dropped."""
    if not tcfg.num_experts:
        return tcfg
    if tcfg.mixed_layers:
        raise Eagle3Error("a dense twin of a target mixing routed and dense layers is not defined")
    return dataclasses.replace(
        tcfg,
        intermediate_size=tcfg.num_experts_per_tok * tcfg.moe_intermediate_size,
        num_experts=0,
        num_experts_per_tok=0,
        moe_intermediate_size=0,
        norm_topk_prob=False,
        moe_layers=(),
    )
