"""How many tokens a round accepts (τ) for a tree shape, from a model of the draft's ranking.

SpecInfer/Sequoia's positional model (`Acceptance`): the target's next token is the draft's i-th
ranked candidate with a probability that depends on the rank alone, independently at every depth;
the tree is grown as the drafter grows it (top-k children, the k best nodes expanded per level,
the best total_tokens - 1 of the pool kept), scoring nodes by path probability, and τ = 1 + the
sum of the kept nodes' path probabilities.

Calibrated on measured τ (`SMOLLM2_TAUS`, the GPU head on SmolLM2-135M-Instruct at seven tree
shapes; `fit_acceptance`, stored as `SMOLLM2_ACCEPTANCE`), and scaled to EAGLE-3's published τ
on Llama-3.1-8B-Instruct (`llama_acceptance`).
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from eagle3_jax.decoding.tree import TreeConfig


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Positional acceptance (SpecInfer/Sequoia's model): the target's next token is the draft's
    top-1 with probability p1, its rank-i candidate (i >= 2) with probability
    (1 - p1) * cover * (1 - ratio) * ratio**(i - 2), whatever the depth and the path: `cover` is
    how often the draft's lower ranks hold the token when its top-1 misses, `ratio` how fast that
    mass falls with rank. Assumptions: independence across depths (no drift of the draft with
    depth), no per-round variation of confidence (so no model of the adaptive threshold), and a
    draft whose ranking is what the tree builder sees (its scores rank nodes as their acceptance
    probabilities do)."""

    p1: float
    cover: float
    ratio: float
    label: str = ""

    def rank_probs(self, k: int) -> np.ndarray:
        p = np.zeros(k)
        p[0] = self.p1
        if k > 1:
            rest = (1 - self.p1) * self.cover * (1 - self.ratio)
            p[1:] = rest * self.ratio ** np.arange(k - 1, dtype=np.float64)
        return p

    def tau(self, tree: TreeConfig) -> float:
        """Expected tokens per round (accepted + bonus) for the tree the drafter grows: top_k
        children of the root, the top_k best new nodes expanded at each further level, the best
        total_tokens - 1 nodes of the pool verified; τ = 1 + their path probabilities' sum."""
        k, n = tree.top_k, tree.total_tokens - 1
        p = self.rank_probs(k)
        pool = list(p)
        exp = p
        for _ in range(2, tree.depth + 1):
            children = (exp[:, None] * p[None, :]).ravel()
            pool.extend(children)
            exp = np.sort(children)[::-1][:k]
        return 1.0 + float(sum(heapq.nlargest(n, pool)))

    def scaled_to(self, tree: TreeConfig, tau: float, label: str = "") -> Acceptance:
        """A stronger (or weaker) head: the same cover and ratio, p1 chosen so that
        tau(tree) = tau (bisection)."""
        lo, hi = 1e-4, 0.9999
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if dataclasses.replace(self, p1=mid).tau(tree) < tau:
                lo = mid
            else:
                hi = mid
        return Acceptance(round(0.5 * (lo + hi), 4), self.cover, self.ratio, label or self.label)


# τ of the GPU head (the Vd 8,192 head trained on one H200) on SmolLM2-135M-Instruct, MT-bench,
# greedy, 128 new tokens, every node verified (benchmarks/results/*/report.md):
# (top_k, depth, total_tokens) -> τ. One head, so the shape's effect is not mixed with another's.
SMOLLM2_TAUS: dict[tuple[int, int, int], float] = {
    (1, 3, 4): 1.865,  # chain d3: 1.84 (gpu_head_mt_bench), 1.89 (gpu_head_mt_bench_80)
    (1, 4, 5): 1.90,  # gpu_head_mt_bench
    (1, 6, 7): 1.92,  # gpu_head_mt_bench
    (2, 3, 4): 1.96,  # reporting_tree_mt_bench_80, adaptive_mt_bench_80
    (2, 4, 8): 2.185,  # 2.15 (gpu_head_mt_bench), 2.22 (gpu_head_mt_bench_80)
    (4, 4, 16): 2.39,  # gpu_head_mt_bench
    (10, 8, 60): 2.95,  # reporting_tree_mt_bench_80
}
# the shipped head (Vd 16,384): τ 3.019 at the reporting tree (vocab16k_trained_cpu_600) and 1.69
# at the CPU default with θ 0.3, verifying 2.2 tokens a round on average (cpu_default_400_vs_600_*)
SHIPPED_TAU_REPORTING = 3.019
SHIPPED_TAU_CPU_DEFAULT = 1.69
SHIPPED_VERIFIED_CPU_DEFAULT = 2.2
REPORTING_TREE = TreeConfig(top_k=10, depth=8, total_tokens=60)
CPU_DEFAULT_TREE = TreeConfig(top_k=2, depth=3, total_tokens=4, verify_threshold=0.3)
# EAGLE-3 on Llama-3.1-8B-Instruct, MT-bench, at its reporting tree: τ ~6-7 (the paper); we take
# the middle
EAGLE3_LLAMA_TAU = 6.5


def fit_acceptance(
    taus: dict[tuple[int, int, int], float] = SMOLLM2_TAUS, label: str = "SmolLM2 GPU head"
) -> Acceptance:
    """Least squares in τ over a (p1, cover, ratio) grid."""
    trees = [(TreeConfig(k, d, n), t) for (k, d, n), t in taus.items()]
    best = None
    for p1 in np.linspace(0.30, 0.70, 21):
        for cover in np.linspace(0.10, 1.0, 19):
            for ratio in np.linspace(0.10, 0.95, 18):
                a = Acceptance(float(p1), float(cover), float(ratio))
                err = sum((a.tau(tr) - t) ** 2 for tr, t in trees)
                if best is None or err < best[0]:
                    best = (err, a)
    a = best[1]
    return Acceptance(round(a.p1, 4), round(a.cover, 4), round(a.ratio, 4), label)


# the fit of SMOLLM2_TAUS (`fit_acceptance()`: rms error 0.05 τ), stored so nothing refits it
SMOLLM2_ACCEPTANCE = Acceptance(0.5, 0.65, 0.7, "SmolLM2 GPU head")


def rms_error(acc: Acceptance, taus: dict[tuple[int, int, int], float] = SMOLLM2_TAUS) -> float:
    errs = [acc.tau(TreeConfig(k, d, n)) - t for (k, d, n), t in taus.items()]
    return float(np.sqrt(np.mean(np.square(errs))))


def llama_acceptance(tau: float = EAGLE3_LLAMA_TAU) -> Acceptance:
    """EAGLE-3's Llama-3.1-8B head: SmolLM2's rank profile with p1 raised until the reporting
    tree reads `tau`."""
    return SMOLLM2_ACCEPTANCE.scaled_to(REPORTING_TREE, tau, f"EAGLE-3 Llama-3.1-8B (τ {tau})")
