"""Predicted speedups: a plain step's and a round's roofline times on a device at a τ, the best
tree of a grid, the τ a published speedup implies, and the check against our CPU measurement.

Each program's cache is the static size `plan_shape` gives it for the context (`slots_for`),
read whole; the chips are the fewest whose HBM holds the model (`hbm.chips_needed`) unless given.
"""

from __future__ import annotations

import dataclasses
import math

from eagle3_jax.accelerators.acceptance import Acceptance
from eagle3_jax.accelerators.hbm import chips_needed
from eagle3_jax.accelerators.roofline import (
    Phase,
    plain_step,
    slots_for,
    spec_round,
    target_forward,
)
from eagle3_jax.accelerators.specs import CPU_2CORE, DRAFT_VOCAB, TARGETS, Device, draft_for
from eagle3_jax.config import DraftConfig, TargetConfig
from eagle3_jax.decoding.tree import TreeConfig


@dataclasses.dataclass(frozen=True)
class Prediction:
    device: str
    target: str
    tree: TreeConfig
    batch: int
    context: int
    chips: int
    plain_s: float
    round_s: float
    tau: float

    @property
    def ratio(self) -> float:
        """Round time in plain steps."""
        return self.round_s / self.plain_s

    @property
    def speedup(self) -> float:
        return self.tau * self.plain_s / self.round_s


def predict(
    dev: Device,
    target: str | TargetConfig,
    tree: TreeConfig,
    tau: float,
    batch: int = 1,
    context: int = 2048,
    dtype_bytes: int = 2,
    dcfg: DraftConfig | None = None,
    chips: int | None = None,
    layer_overhead_s: float = 0.0,
) -> Prediction:
    """Plain step and round times on `dev` at τ `tau`, for `context` tokens (prompt + new): each
    program's cache is the static size `plan_shape` gives it (`slots_for`), read whole."""
    tcfg = TARGETS[target] if isinstance(target, str) else target
    dcfg = dcfg or draft_for(tcfg)
    slots, rslots = slots_for(context), slots_for(context, tree)
    if chips is None:
        chips = chips_needed(dev, tcfg, dcfg, batch, rslots, dtype_bytes)
    plain = plain_step(tcfg, batch, slots, dtype_bytes).time_s(dev, chips, layer_overhead_s)
    rnd = spec_round(tcfg, dcfg, tree, batch, rslots, dtype_bytes).time_s(
        dev, chips, layer_overhead_s
    )
    name = target if isinstance(target, str) else tcfg.family
    return Prediction(dev.name, name, tree, batch, context, chips, plain, rnd, tau)


def tree_grid() -> list[TreeConfig]:
    """Chains of depth 1-8 and trees of top-k 2-10, depth 3-8, 8-128 nodes (valid ones)."""
    trees = [TreeConfig(1, d, d + 1) for d in range(1, 9)]
    for k in (2, 4, 6, 8, 10):
        for d in (3, 4, 5, 6, 8):
            for n in (8, 16, 24, 32, 48, 60, 64, 96, 128):
                t = TreeConfig(k, d, n)
                if n <= t.pool_size + 1:
                    trees.append(t)
    return trees


def best_tree(
    dev: Device,
    target: str,
    acc: Acceptance,
    batch: int = 1,
    context: int = 2048,
    trees: list[TreeConfig] | None = None,
) -> Prediction:
    """The tree of the grid with the highest predicted speedup at τ = acc.tau(tree)."""
    preds = [predict(dev, target, t, acc.tau(t), batch, context) for t in (trees or tree_grid())]
    return max(preds, key=lambda p: p.speedup)


def implied_tau(pred: Prediction, speedup: float) -> float:
    """The τ at which the model's round/plain ratio gives `speedup`."""
    return speedup * pred.ratio


# ----------------------------------------------------------------------------- CPU check


def cpu_verify_ratio(
    tokens: int = 4,
    slots: int = 512,
    dev: Device = CPU_2CORE,
    few_row_rate: float | None = None,
) -> dict[str, float]:
    """A `tokens`-token target forward over a 1-token one on SmolLM2-135M in float32 with a
    `slots`-slot cache holding 320 tokens (benchmarks/verify_cost.py's measurement: new K/V
    written into the cache, then attended), three ways:
      roofline: max(bytes / bw, flops / peak), as for accelerators;
      serial: bytes / bw + flops / peak (XLA:CPU's few-row products do not overlap streaming the
        weights with the arithmetic);
      few_row: serial with the products of 2+ rows at `few_row_rate` FLOP/s (default: the rate
        that reproduces 1.4x, returned as `rate_for_1.4x`)."""
    tcfg = TARGETS["smollm2_135m"]
    one = target_forward(tcfg, 1, 1, slots, 4)
    many = target_forward(tcfg, 1, tokens, slots, 4)
    t1_roof, tn_roof = one.time_s(dev), many.time_s(dev)

    def serial(p: Phase, rate: float) -> float:
        return p.bytes / dev.hbm_bw + (p.flops + p.fp32_flops) / rate

    t1 = serial(one, dev.matmul_flops)
    out = {
        "one_token_ms_roofline": 1e3 * t1_roof,
        "roofline": tn_roof / t1_roof,
        "serial": serial(many, dev.matmul_flops) / t1,
        "weights_mb": one.weights / 1e6,
        "flops_per_token_g": (one.flops + one.fp32_flops) / 1e9,
    }
    # the few-row rate at which the serial model gives 1.4x
    lo, hi = 1e9, 1e13
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        if serial(many, mid) / t1 > 1.4:
            lo = mid
        else:
            hi = mid
    out["rate_for_1.4x_gflops"] = math.sqrt(lo * hi) / 1e9
    if few_row_rate:
        out["few_row"] = serial(many, few_row_rate) / t1
    return out


# ----------------------------------------------------------------------------- vocabulary methods


def vocab_method_heads(
    tcfg: TargetConfig, draft_vocab: int = DRAFT_VOCAB, candidates: int = 2048
) -> dict[str, DraftConfig]:
    """The heads the draft-vocabulary methods decode with, sized like the target: EAGLE-3's lm_head
    over `draft_vocab` ids (FR-Spec and VocabTrim heads are such heads, over their own ids, and
    cost the same), the target's output embedding over all V (FR-Spec's source head), and
    SpecVocab at rank d/8 with `candidates` exact-logit candidates per drafted row."""
    v, d = tcfg.vocab_size, tcfg.hidden_size
    return {
        "eagle3": draft_for(tcfg, draft_vocab),
        "target_lm_head": DraftConfig.from_target(
            tcfg, draft_vocab_size=v, lm_head_source="target"
        ),
        "specvocab": DraftConfig.from_target(
            tcfg,
            draft_vocab_size=v,
            lm_head_source="target",
            speculator_rank=d // 8,
            spec_candidates=min(candidates, v),
        ),
    }


def draft_share(
    dev: Device,
    tcfg: TargetConfig,
    dcfg: DraftConfig,
    tree: TreeConfig,
    context: int = 2048,
    batch: int = 1,
    chips: int = 1,
    fused_gather: bool = False,
) -> dict[str, float]:
    """A round's time on `dev` split into drafting (every draft forward and its output layer) and
    the rest (verification, bookkeeping, launch), in seconds."""
    slots = slots_for(context, tree)
    prog = spec_round(tcfg, dcfg, tree, batch, slots, fused_gather=fused_gather)
    parts = prog.breakdown_s(dev, chips)
    draft = sum(t for name, t in parts.items() if name.startswith("draft"))
    return {"draft_s": draft, "round_s": prog.time_s(dev, chips)}


def vocab_methods(
    dev: Device, target: str, tree: TreeConfig, context: int = 2048, candidates: int = 2048
) -> list[dict]:
    """Per vocabulary method's head: drafting and round time on `dev`, the round in plain steps,
    and the τ it needs to match EAGLE-3's speedup (τ_method / τ_eagle3 = its round time over
    EAGLE-3's: what a method must gain in τ to pay for its draft). SpecVocab's figures count its
    gathered candidate rows as `draft_topk` gathers them (per row, or once per tree level for
    siblings: `roofline.output_layer`); the `*_fused_gather` ones, the
    lower bound of a gather fused into the product (the same for the other heads)."""
    tcfg = TARGETS[target]
    plain = plain_step(tcfg, 1, slots_for(context)).time_s(dev)
    heads = vocab_method_heads(tcfg, candidates=candidates)
    rows = []
    for name, dcfg in heads.items():
        t = draft_share(dev, tcfg, dcfg, tree, context)
        fused = draft_share(dev, tcfg, dcfg, tree, context, fused_gather=True)
        rows.append({
            "device": dev.name, "target": target, "method": name, "tree": tree_text(tree),
            "draft_ms": 1e3 * t["draft_s"], "round_ms": 1e3 * t["round_s"],
            "round_over_plain": t["round_s"] / plain,
            "draft_ms_fused_gather": 1e3 * fused["draft_s"],
            "round_ms_fused_gather": 1e3 * fused["round_s"],
        })  # fmt: skip
    base = rows[0]["round_ms"]  # eagle3's (no gather: the same both ways)
    for r in rows:
        r["tau_ratio_to_match"] = r["round_ms"] / base
        r["tau_ratio_to_match_fused_gather"] = r["round_ms_fused_gather"] / base
    return rows


def tree_text(tree: TreeConfig) -> str:
    """A tree as the cost model's tables name it: "top_k/depth/total_tokens"."""
    return f"{tree.top_k}/{tree.depth}/{tree.total_tokens}"
