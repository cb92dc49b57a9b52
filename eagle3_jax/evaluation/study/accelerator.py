"""The paper's setting on an accelerator: the heads' rounds predicted by the cost model and
timed on a lent device, and the tau the paper's throughput implies under each."""

from __future__ import annotations

from collections.abc import Sequence

from eagle3_jax.accelerators import predict, specs
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.evaluation.study.heads import PAPER
from eagle3_jax.evaluation.study.text import fmt


def paper_specvocab_over_eagle3() -> tuple[float, float]:
    """SpecVocab over EAGLE-3 as published: (tokens/s on OLMo 2 7B, τ on OLMo 2 1B)."""
    sv, e3 = PAPER["specvocab"], PAPER["eagle3"]
    return sv["tps_olmo2_7b"] / e3["tps_olmo2_7b"], sv["tau_olmo2_1b"] / e3["tau_olmo2_1b"]


def accelerator_section(context: int = 2048) -> tuple[list[str], dict]:
    """The methods' heads at the paper's own setting, predicted (`accelerators.predict`): an H100,
    OLMo 2 1B and 7B, the 10/8/60 tree, batch 1; each head's drafting and round time and the τ it
    needs to match EAGLE-3, SpecVocab's with its candidate gather as `draft_topk` runs it and
    fused (the lower bound); then the τ the paper's 7B throughput implies."""
    tree = TreeConfig(10, 8, 60)
    lines = [
        "## The paper's setting on an accelerator (predicted)",
        "",
        f"Cost model (docs/cost_model.md): one H100, batch 1, {context} tokens of context, tree "
        "10/8/60, heads sized like the target (EAGLE-3 over 32k ids; FR-Spec and VocabTrim heads "
        "cost the same). 'τ to match' is the method's τ over EAGLE-3's at which its speedup "
        "equals EAGLE-3's; SpecVocab's second figure has its candidate gather fused.",
        "",
        "| target | head | draft ms / round | round ms | τ to match EAGLE-3 |",
        "|---|---|---|---|---|",
    ]
    rows = []
    for target in ("olmo2_1b", "olmo2_7b"):
        for r in predict.vocab_methods(specs.DEVICES["H100"], target, tree, context):
            rows.append(r)
            fused = r["draft_ms_fused_gather"] != r["draft_ms"]
            lines.append(
                f"| {target} | {r['method']} | {r['draft_ms']:.2f}"
                + (f" ({r['draft_ms_fused_gather']:.2f} fused)" if fused else "")
                + f" | {r['round_ms']:.2f} | {r['tau_ratio_to_match']:.3f}"
                + (f" ({r['tau_ratio_to_match_fused_gather']:.3f} fused)" if fused else "")
                + " |"
            )
    tps, tau_1b = paper_specvocab_over_eagle3()
    (sv,) = [r for r in rows if r["target"] == "olmo2_7b" and r["method"] == "specvocab"]
    implied = (tps * sv["tau_ratio_to_match"], tps * sv["tau_ratio_to_match_fused_gather"])
    lines += [
        "",
        f"The paper's SpecVocab over EAGLE-3: x{tps:.3f} tokens/s on OLMo 2 7B, x{tau_1b:.3f} τ "
        f"on OLMo 2 1B. Under the model the 7B throughput needs x{implied[0]:.3f} τ with the "
        f"gather as we run it, x{implied[1]:.3f} with it fused.",
        "",
    ]
    return lines, {"rows": rows, "paper_tps_ratio_olmo2_7b": tps, "implied_tau_ratio": implied}


def measured_section(measured: Sequence[dict]) -> tuple[list[str], dict]:
    """The methods' rounds timed on an accelerator (`scripts/device_job.py round-cost --head ...`:
    random weights at the paper's targets' shapes, batch 1; `measured`: its results.json files),
    each head's round against EAGLE-3's beside the cost model's ratio, and the τ the paper's 7B
    throughput needs under the measured ratio ([], {} when nothing was measured)."""
    rows = [
        {**q, "device": res.get("device"), "predicted_for": res.get("predicted_for")}
        for res in measured
        for q in res.get("over_eagle3", [])
    ]
    if not rows:
        return [], {}
    rounds = {
        (res.get("device"), r["target"], r["batch"], r["tree"], r["head"]): r["median_ms"]
        for res in measured
        for r in res.get("rows", [])
        if r["program"] == "round"
    }
    devices = sorted({str(r["device"]) for r in rows})
    sizes = sorted({(res.get("context"), res.get("reps")) for res in measured})
    lines = [
        f"## The paper's setting, measured ({', '.join(devices)})",
        "",
        "Each head's round timed on the accelerator (`scripts/device_job.py round-cost`: random "
        "bf16 weights at the target's shape; caches for "
        + ", ".join(f"{c} tokens, medians of {n} calls" for c, n in sizes)
        + ") against EAGLE-3's round on the same device, target, batch and tree, beside the cost "
        "model's ratio: the τ over EAGLE-3's a method needs to match its speedup.",
        "",
        "| device | target | batch | tree | head | round ms | EAGLE-3's round ms | ratio measured "
        "| predicted |",
        "|---|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        key = (r["device"], r["target"], r["batch"], r["tree"])
        lines.append(
            f"| {r['device']} | {r['target']} | {r['batch']} | {r['tree']} | {r['head']} "
            f"| {fmt(rounds.get((*key, r['head'])))} | {fmt(rounds.get((*key, 'eagle3')))} "
            f"| {r['measured']:.3f} | {r['predicted']:.3f} |"
        )
    tps, _ = paper_specvocab_over_eagle3()
    sv = [
        r for r in rows
        if (r["target"], r["head"], r["batch"]) == ("olmo2_7b", "specvocab", 1)
        and r["tree"].startswith("10/8/60")
    ]  # fmt: skip
    implied = tps * sv[-1]["measured"] if sv else None  # the last run measured
    if implied:
        lines += [
            "",
            f"Under the measured 10/8/60 ratio ({sv[-1]['device']}), the paper's x{tps:.3f} "
            f"tokens/s on OLMo 2 7B needs x{implied:.3f} τ from SpecVocab over EAGLE-3 on this "
            "engine.",
        ]
    return lines + [""], {"rows": rows, "implied_tau_ratio_olmo2_7b": implied}
