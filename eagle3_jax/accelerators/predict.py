"""Predicted speedups: a plain step's and a round's roofline times on a device at a τ, the best
tree of a grid, the τ a published speedup implies, and the check against our CPU measurement.

Each program's cache is the static size `plan_shape` gives it for the context (`slots_for`),
read whole; the chips are the fewest whose HBM holds the model (`hbm.chips_needed`) unless given.
"""

from __future__ import annotations

import dataclasses
import math

from eagle3_jax.accelerators.acceptance import SMOLLM2_ACCEPTANCE, Acceptance
from eagle3_jax.accelerators.experts import ROUTED, Routing
from eagle3_jax.accelerators.hbm import chips_needed
from eagle3_jax.accelerators.roofline import (
    Phase,
    plain_step,
    slots_for,
    spec_round,
    target_forward,
)
from eagle3_jax.accelerators.specs import (
    CPU_2CORE,
    DEVICES,
    DRAFT_VOCAB,
    TARGETS,
    Device,
    draft_for,
)
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
    routing: Routing = ROUTED,
) -> Prediction:
    """Plain step and round times on `dev` at τ `tau`, for `context` tokens (prompt + new): each
    program's cache is the static size `plan_shape` gives it (`slots_for`), read whole. A
    mixture-of-experts target's layers read the experts `routing` says (`experts.Routing`: by
    default the uniform expectation under a routed dispatch; measured counts where given)."""
    tcfg = TARGETS[target] if isinstance(target, str) else target
    dcfg = dcfg or draft_for(tcfg)
    slots, rslots = slots_for(context), slots_for(context, tree)
    if chips is None:
        chips = chips_needed(dev, tcfg, dcfg, batch, rslots, dtype_bytes)
    plain = plain_step(tcfg, batch, slots, dtype_bytes, routing, chips)
    rnd = spec_round(tcfg, dcfg, tree, batch, rslots, dtype_bytes, routing=routing, chips=chips)
    plain_s = plain.time_s(dev, chips, layer_overhead_s)
    round_s = rnd.time_s(dev, chips, layer_overhead_s)
    name = target if isinstance(target, str) else tcfg.family
    return Prediction(dev.name, name, tree, batch, context, chips, plain_s, round_s, tau)


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
    target: str | TargetConfig,
    acc: Acceptance,
    batch: int = 1,
    context: int = 2048,
    trees: list[TreeConfig] | None = None,
    routing: Routing = ROUTED,
    **predict_kw,
) -> Prediction:
    """The tree of the grid with the highest predicted speedup at τ = acc.tau(tree); `predict_kw`
    go to `predict` (dtype_bytes, dcfg, chips)."""
    preds = [
        predict(dev, target, t, acc.tau(t), batch, context, routing=routing, **predict_kw)
        for t in (trees or tree_grid())
    ]
    return max(preds, key=lambda p: p.speedup)


def device_spec(device_kind: str) -> Device | None:
    """The `DEVICES` entry for a jax device's `device_kind` ("NVIDIA H200", "TPU v5 lite"), or
    None where the cost model has no figures for it (a CPU, another GPU)."""
    kind = device_kind.lower()
    for name, dev in DEVICES.items():
        if name.lower() in kind:
            return dev
    if "tpu v5 lite" in kind or "tpu v5e" in kind:
        return DEVICES["TPU v5e"]
    return None


def serving_tree(
    dev: Device,
    tcfg: TargetConfig,
    dcfg: DraftConfig | None,
    slots: int,
    context: int,
    acc: Acceptance | None = None,
    dtype_bytes: int = 2,
) -> Prediction:
    """The cost model's best tree for a serving engine of `slots` rows (every round runs them
    all) and `context` cache slots, at the SmolLM2 head's acceptance profile unless `acc` is
    given (a head's own curve is not known at load): one candidate of the measured choice
    (`slots.MeasuredSchedule`), which then keeps it only if it is faster where it runs."""
    trees = [t for t in tree_grid() if dcfg is None or t.top_k <= dcfg.draft_choices]
    return best_tree(dev, tcfg, acc or SMOLLM2_ACCEPTANCE, slots, context, trees,
                     dtype_bytes=dtype_bytes, dcfg=dcfg, chips=1)  # fmt: skip


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


# ----------------------------------------------------------------------------- kernel launches


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """What launching kernels adds to a program on one device, learnt from a measurement
    (`fit_kernel_cost`): `seconds` per kernel a call launches, and the launches of each measured
    program, `per_layer` per target layer plus a `fixed` rest (the draft, the output layer, the
    bookkeeping), keyed "plain", "chain" and "tree" (the 10/8/60 round)."""

    seconds: float
    per_layer: dict[str, float]
    fixed: dict[str, float]
    rows: int = 0  # measurements it was fitted on
    rms_ms: float = 0.0  # their residual (measured - roofline - launches x seconds)

    def launches(self, program: str, layers: int) -> float:
        return self.per_layer[program] * layers + self.fixed[program]

    def time_s(self, program: str, layers: int) -> float:
        return self.seconds * self.launches(program, layers)


def kernel_program(row: dict) -> str:
    """Which measured program a sweep row's launches are counted from: the plain step, a chain
    (top-k 1; its launches do not grow with width) or a tree (10/8/60's, for any branching
    tree: the same draft levels and one verification, the node count changing sizes only)."""
    if row["program"] == "plain":
        return "plain"
    shape = row.get("tree_shape") or row.get("tree") or ""
    return "chain" if shape == "chain" or shape.startswith("1/") else "tree"


def fit_kernel_cost(summary: dict, batch: int | None = 1) -> KernelCost:
    """The per-kernel cost a `gpu-speed` summary implies (scripts/device_steps/gpu_speed.py,
    benchmarks/results/gpu_speed/summary.json): least squares of measured - roofline over the
    sweep's rows (at `batch` only, default 1, where programs are bandwidth-bound and a launch
    cost shows; None: every batch) against the launches each row's program makes, counted in
    the summary's kernels phase for the variant the sweep ran (its first) and scaled to the
    row's target by its layer count. Raises ValueError when the summary holds no such rows."""
    variant = (summary.get("variants") or [None])[0]
    kernels = summary["kernels"].get(variant) or next(iter(summary["kernels"].values()))
    names = {"plain": "plain", "chain": "chain", "tree": "10/8/60"}
    per_layer = {k: kernels[v]["per_layer"]["launches"] for k, v in names.items() if v in kernels}
    fixed = {k: kernels[v]["fixed"]["launches"] for k, v in names.items() if v in kernels}
    pairs = []
    for row in summary["programs"]:
        prog = kernel_program(row)
        if (batch is not None and row["batch"] != batch) or prog not in per_layer:
            continue
        if row.get("measured_ms") is None or row.get("roofline_ms") is None:
            continue
        n = per_layer[prog] * TARGETS[row["target"]].num_layers + fixed[prog]
        pairs.append((n, (row["measured_ms"] - row["roofline_ms"]) * 1e-3))
    if not pairs:
        raise ValueError("no sweep row with a measured time and a counted program to fit")
    seconds = sum(n * gap for n, gap in pairs) / sum(n * n for n, _ in pairs)
    rms = math.sqrt(sum((gap - seconds * n) ** 2 for n, gap in pairs) / len(pairs))
    return KernelCost(seconds, per_layer, fixed, len(pairs), rms * 1e3)


def recheck(summary: dict, cost: KernelCost) -> list[dict]:
    """Each sweep row of a gpu-speed summary beside the roofline plus `cost`'s launches: the
    model's prediction re-checked against what was measured (issue 58, items 4a and 5)."""
    out = []
    for row in summary["programs"]:
        prog = kernel_program(row)
        if row.get("measured_ms") is None or prog not in cost.per_layer:
            continue
        layers = TARGETS[row["target"]].num_layers
        with_kernels = row["roofline_ms"] + cost.time_s(prog, layers) * 1e3
        out.append({
            **{k: row.get(k) for k in ("target", "batch", "program", "tree", "measured_ms")},
            "roofline_ms": row["roofline_ms"], "with_kernels_ms": with_kernels,
            "error": with_kernels / row["measured_ms"] - 1,
        })  # fmt: skip
    return out
