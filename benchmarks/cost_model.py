#!/usr/bin/env python
"""What a plain step and a speculative round cost on accelerators, predicted from the shapes
(`eagle3_jax.accelerators`: roofline, acceptance, predict): tables per device x target x tree,
the best tree per device, mixture-of-experts targets beside Llama-3.1-8B, the calibration against
published speedups and our CPU measurement, a JSON and a plot.

  .venv/bin/python benchmarks/cost_model.py                 # tables, JSON, plot (~10 s)
  .venv/bin/python benchmarks/cost_model.py --xla           # + XLA's own FLOP counts (~20 s more)
  .venv/bin/python benchmarks/cost_model.py --expert-counts qwen3_30b_a3b=counts.json
      # a MoE target's distinct experts per forward as its router measured them
      # (`accelerators.experts.ExpertCounts`), in place of the uniform expectation

No device is used: bytes and FLOPs are counted from the configs; --xla lowers the real programs
(`eagle3_jax.accelerators.programs`, Llama-3.1-8B shapes, on this CPU) and compares their
`cost_analysis()` FLOPs with the model's. Where a device's `scripts/device_job.py gpu-speed` run
is kept (--gpu-speed, benchmarks/results/gpu_speed/summary.json) the cost of a kernel launch is
fitted to it (`predict.fit_kernel_cost`) and every measured program re-checked against the
roofline plus its launches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3_jax.accelerators import acceptance, experts, hbm, predict, roofline, specs  # noqa: E402
from eagle3_jax.decoding.tree import TreeConfig  # noqa: E402
from eagle3_jax.evaluation import study  # noqa: E402

TARGETS = ("llama31_8b", "olmo2_7b", "qwen3_4b", "olmo2_1b")
TREES = {
    "reporting 10/8/60": acceptance.REPORTING_TREE,
    "chain 1/8/9": TreeConfig(1, 8, 9),
    "tree 4/6/32": TreeConfig(4, 6, 32),
    "tree 2/3/4": TreeConfig(2, 3, 4),
}
# published speedups (the figures; hardware and τ as far as we know them)
PUBLISHED = [
    ("SpecVocab", "olmo2_1b", (1.32, 1.38), "OLMo 2 1B, 10/8/60; GPU and τ not verified here"),
    ("SpecVocab", "olmo2_7b", (2.04, 2.20), "OLMo 2 7B, 10/8/60; GPU and τ not verified here"),
    ("EAGLE-3", "llama31_8b", (3.0, 6.5), "8B targets, τ ~6-7 at 60 nodes; GPU not verified here"),
]
# measured: a 4-token target forward over a 1-token one, SmolLM2-135M fp32, 320 tokens in a
# 512-slot cache (benchmarks/results/verify_cost_*.json)
CPU_MEASURED = {
    "Intel Xeon, XLA products (verify_cost_xeon.json)": 1.31,
    "AMD EPYC, output layer as a reduction (verify_cost_logit_reduce.json)": 1.35,
    "AMD EPYC, XLA products (verify_cost_logit_reduce.json)": 1.48,
}
LAYER_OVERHEAD_S = 50e-6  # an eager framework: ~10 kernel launches of ~5 us per layer (assumed)
# mixture-of-experts targets beside Llama-3.1-8B; "<name>_dense_twin": the target with each routed
# MLP one dense SwiGLU k x F' wide (the same active size, `experts.dense_twin`)
MOE_TARGETS = ("llama31_8b", "qwen3_30b_a3b", "qwen3_30b_a3b_dense_twin", "gpt_oss_20b")
TWIN = "_dense_twin"


def us(s: float) -> str:
    return f"{s * 1e6:,.0f}"


def table(head: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--context", type=int, default=2048, help="prompt + new tokens (default 2048)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--tau", type=float, default=acceptance.EAGLE3_LLAMA_TAU, help="τ at 10/8/60")
    p.add_argument("--xla", action="store_true", help="compare with XLA's cost_analysis FLOPs")
    p.add_argument(
        "--expert-counts", action="append", default=[], metavar="TARGET=FILE",
        help="measured distinct experts per forward for a MoE target (experts.ExpertCounts JSON)",
    )  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/cost_model"))
    p.add_argument(
        "--gpu-speed", default=str(ROOT / "benchmarks/results/gpu_speed/summary.json"),
        help="a device's gpu-speed summary: the per-kernel cost is fitted to it (when present)",
    )  # fmt: skip
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    acc = acceptance.llama_acceptance(args.tau)
    res: dict = {
        "context": args.context,
        "acceptance": {
            "smollm2": vars(acceptance.SMOLLM2_ACCEPTANCE),
            "smollm2_rms_error": acceptance.rms_error(acceptance.SMOLLM2_ACCEPTANCE),
            "assumed_head": vars(acc),
        },
        "devices": {k: vars(d) for k, d in specs.DEVICES.items()},
    }

    # 1. per device x target x tree
    rows, recs = [], []
    for b in batches:
        for dname, dev in specs.DEVICES.items():
            for tg in TARGETS:
                for tname, tree in TREES.items():
                    pr = predict.predict(dev, tg, tree, acc.tau(tree), b, args.context)
                    recs.append({**pred_dict(pr), "tree_name": tname})
                    rows.append([
                        b, dname, tg, tname, pr.chips, us(pr.plain_s), us(pr.round_s),
                        f"{pr.ratio:.2f}", f"{pr.tau:.2f}", f"{pr.speedup:.2f}",
                    ])  # fmt: skip
    res["predictions"] = columnar(recs)
    print(f"## Predicted cost, context {args.context} (τ from the assumed head: {acc.label})\n")
    print(table(
        ["B", "device", "target", "tree", "chips", "plain µs", "round µs", "round/plain", "τ",
         "speedup"], rows,
    ))  # fmt: skip

    # 2. best tree per device (B = 1 and the largest batch)
    best_rows, best = [], []
    trees = predict.tree_grid()
    chains = [t for t in trees if t.top_k == 1]
    branching = [t for t in trees if t.top_k > 1]
    for b in batches:
        for dname, dev in specs.DEVICES.items():
            for tg in TARGETS:
                bc = predict.best_tree(dev, tg, acc, b, args.context, chains)
                bt = predict.best_tree(dev, tg, acc, b, args.context, branching)
                top = max(bc, bt, key=lambda x: x.speedup)
                best.append({
                    "batch": b, "device": dname, "target": tg, "best": pred_dict(top),
                    "best_chain": pred_dict(bc), "best_branching": pred_dict(bt),
                })  # fmt: skip
                best_rows.append([
                    b, dname, tg, predict.tree_text(bc.tree), f"{bc.tau:.2f}", f"{bc.speedup:.2f}",
                    predict.tree_text(bt.tree), f"{bt.tau:.2f}", f"{bt.speedup:.2f}",
                ])  # fmt: skip
    kinds = ("best", "best_chain", "best_branching")
    res["best_trees"] = columnar([{"kind": k, **e[k]} for e in best for k in kinds])
    print(f"\n## Best tree per device ({len(trees)} shapes; τ from the acceptance model)\n")
    print(table(
        ["B", "device", "target", "best chain", "τ", "speedup", "best tree", "τ", "speedup"],
        best_rows,
    ))  # fmt: skip

    # 3. where a round's time goes (Llama-3.1-8B, reporting tree, B = 1)
    tcfg = specs.TARGETS["llama31_8b"]
    dcfg = specs.draft_for(tcfg)
    slots = roofline.slots_for(args.context, acceptance.REPORTING_TREE)
    rnd = roofline.spec_round(tcfg, dcfg, acceptance.REPORTING_TREE, 1, slots)
    br_rows = []
    for dname, dev in specs.DEVICES.items():
        chips = hbm.chips_needed(dev, tcfg, dcfg, 1, slots)
        parts = rnd.breakdown_s(dev, chips)
        draft = sum(v for k, v in parts.items() if k.startswith("draft_"))
        br_rows.append([
            dname, us(draft), us(parts["verify"]), us(parts["bookkeeping"]),
            us(parts["pending"]), us(dev.launch_s),
        ])  # fmt: skip
    res["round_breakdown_llama_10_8_60"] = br_rows
    print("\n## Where a round's time goes (Llama-3.1-8B, 10/8/60, B 1), µs\n")
    print(
        table(["device", "8 draft steps", "verify", "tree loops", "pending K/V", "launch"], br_rows)
    )

    # 4. calibration
    h100 = specs.DEVICES["H100"]
    cal_rows, cal = [], []
    for src, tg, (lo, hi), note in PUBLISHED:
        pr = predict.predict(h100, tg, acceptance.REPORTING_TREE, args.tau, 1, args.context)
        pe = predict.predict(
            h100,
            tg,
            acceptance.REPORTING_TREE,
            args.tau,
            1,
            args.context,
            layer_overhead_s=LAYER_OVERHEAD_S,
        )
        rec = {
            "source": src, "target": tg, "published": [lo, hi], "note": note,
            "ratio": pr.ratio, "speedup_at_tau": pr.speedup, "tau": args.tau,
            "implied_tau": [predict.implied_tau(pr, lo), predict.implied_tau(pr, hi)],
            "eager_ratio": pe.ratio, "eager_speedup_at_tau": pe.speedup,
        }  # fmt: skip
        cal.append(rec)
        cal_rows.append([
            src, tg, f"{lo:.2f}-{hi:.2f}×", f"{pr.ratio:.2f}", f"{pr.speedup:.2f}×",
            f"{rec['implied_tau'][0]:.1f}-{rec['implied_tau'][1]:.1f}", f"{pe.speedup:.2f}×", note,
        ])  # fmt: skip
    cpu = predict.cpu_verify_ratio()
    res["calibration"] = {"published": cal, "cpu": {"model": cpu, "measured": CPU_MEASURED}}
    print(f"\n## Calibration (H100, 10/8/60, B 1, context {args.context}, τ {args.tau})\n")
    print(table(
        ["source", "target", "published", "round/plain", f"model at τ {args.tau}",
         "τ that gives the published", "model, eager (50 µs/layer)", "setting"], cal_rows,
    ))  # fmt: skip
    print(
        "\nCPU: 4-token over 1-token target forward, SmolLM2-135M fp32 (assumed 20 GB/s, 100 GFLOP/s)"
    )
    print(table(
        ["what", "T=4 / T=1"],
        [["roofline max(bytes/bw, flops/peak)", f"{cpu['roofline']:.2f}"],
         ["serial bytes/bw + flops/peak", f"{cpu['serial']:.2f}"],
         *[[f"measured: {k}", v] for k, v in CPU_MEASURED.items()],
         ["few-row product rate the serial model needs for 1.4x",
          f"{cpu['rate_for_1.4x_gflops']:.0f} GFLOP/s"]],
    ))  # fmt: skip

    res["vocab_methods"] = vocab_section(args.context)
    counts = dict(c.split("=", 1) for c in args.expert_counts)
    res["moe"] = moe_section(args.context, batches, acc, counts)

    # 5. acceptance model against our measured τ
    acc_rows = [
        [
            predict.tree_text(TreeConfig(*k)),
            v,
            f"{acceptance.SMOLLM2_ACCEPTANCE.tau(TreeConfig(*k)):.2f}",
        ]
        for k, v in acceptance.SMOLLM2_TAUS.items()
    ]
    print(f"\n## Acceptance model: {acceptance.SMOLLM2_ACCEPTANCE} against measured τ\n")
    print(table(["tree", "measured τ", "model τ"], acc_rows))

    if args.xla:
        res["xla_check"] = xla_check()
        print("\n## FLOPs: model against XLA's cost_analysis (Llama-3.1-8B, B 1, 1024 + 1024)\n")
        print(table(
            ["program", "XLA GFLOP", "model GFLOP", "model/XLA"],
            [[r["program"], f"{r['xla']:.1f}", f"{r['model']:.1f}", f"{r['model'] / r['xla']:.3f}"]
             for r in res["xla_check"]],
        ))  # fmt: skip

    measured = Path(args.gpu_speed)
    if measured.is_file():  # a device's gpu-speed run: the per-kernel cost it implies
        summary = json.loads(measured.read_text())
        fit = predict.fit_kernel_cost(summary)
        res["kernel_cost"] = {**dataclasses.asdict(fit), "device": summary.get("device"),
                              "recheck": predict.recheck(summary, fit)}  # fmt: skip
        print(f"\n## Kernel launches: {fit.seconds * 1e6:.2f} µs each on {summary.get('device')}, "
              f"fitted on {fit.rows} programs at batch 1 (rms {fit.rms_ms:.2f} ms)\n")  # fmt: skip
        print(table(
            ["target", "B", "program", "tree", "measured ms", "roofline ms", "+ launches ms",
             "error"],
            [[r["target"], r["batch"], r["program"], r["tree"] or "", f"{r['measured_ms']:.2f}",
              f"{r['roofline_ms']:.2f}", f"{r['with_kernels_ms']:.2f}", f"{r['error']:+.0%}"]
             for r in res["kernel_cost"]["recheck"]],
        ))  # fmt: skip

    (out / "results.json").write_text(dump(res))
    plot(out / "speedup_vs_tree.png", acc, args.context)
    print(f"\nwrote {out / 'results.json'} and {out / 'speedup_vs_tree.png'}")
    return 0


def vocab_section(context: int) -> dict:
    """The draft-vocabulary methods' heads at the SpecVocab paper's setting (H100, 10/8/60, batch
    1) and in a chain: drafting and round time per method, and the τ each needs to match EAGLE-3;
    then what the paper's OLMo 2 7B throughputs imply for τ, beside the τ gain it reports at 1B."""
    rows, recs = [], []
    for tg in ("olmo2_1b", "olmo2_7b", "llama31_8b"):
        for tree in (TreeConfig(10, 8, 60), TreeConfig(1, 8, 9)):
            for r in predict.vocab_methods(specs.DEVICES["H100"], tg, tree, context):
                recs.append(r)
                rows.append([
                    tg, r["tree"], r["method"], f"{r['draft_ms']:.2f}", f"{r['round_ms']:.2f}",
                    f"{r['round_over_plain']:.2f}", f"{r['tau_ratio_to_match']:.3f}",
                    f"{r['draft_ms_fused_gather']:.2f}",
                    f"{r['tau_ratio_to_match_fused_gather']:.3f}",
                ])  # fmt: skip
    print(f"\n## Draft-vocabulary methods on an H100 (B 1, context {context})\n")
    print(table(
        ["target", "tree", "head", "draft ms", "round ms", "round/plain",
         "τ / EAGLE-3's τ to match it", "draft ms, gather fused", "τ ratio, gather fused"],
        rows,
    ))  # fmt: skip
    tps, tau_1b = study.paper_specvocab_over_eagle3()
    implied = {
        f"{r['tree']}{gather}": tps * r[f"tau_ratio_to_match{gather}"]
        for r in recs
        if r["target"] == "olmo2_7b" and r["method"] == "specvocab"
        for gather in ("", "_fused_gather")
    }
    print(
        f"\nSpecVocab over EAGLE-3 as published: OLMo 2 7B tokens/s x{tps:.3f}, OLMo 2 1B τ "
        f"x{tau_1b:.3f}. The τ ratio the 7B throughput implies under this model: "
        + ", ".join(f"x{v:.3f} at {k}" for k, v in implied.items())
    )
    return {
        "rows": recs,
        "paper_specvocab_over_eagle3": {"tps_olmo2_7b": tps, "tau_olmo2_1b": tau_1b},
        "implied_tau_ratio_olmo2_7b": implied,
    }


def moe_target(name: str):
    """A MOE_TARGETS name -> its TargetConfig."""
    if name.endswith(TWIN):
        return experts.dense_twin(specs.TARGETS[name[: -len(TWIN)]])
    return specs.TARGETS[name]


def moe_section(
    context: int, batches: list[int], acc: acceptance.Acceptance, counts: dict[str, str]
) -> dict:
    """Mixture-of-experts targets beside Llama-3.1-8B and a dense twin of Qwen3-30B-A3B's active
    size, per batch and device: the plain step, the distinct experts a layer reads in a step and
    in the reporting tree's verification (the uniform expectation, or `counts`' measured file per
    target), each tree's round in plain steps and speedup at the assumed head's τ, and the best
    tree of the grid; then the dense dispatch (every expert read and run: ours in a GPU's
    larger forwards, `backends.moe_dispatch_wanted`) for contrast."""
    routings = {
        name: experts.Routing(measured=experts.ExpertCounts.from_json(path))
        for name, path in counts.items()
    }
    rows, recs, best_recs = [], [], []
    for b in batches:
        for dname, dev in specs.DEVICES.items():
            for name in MOE_TARGETS:
                tcfg, routing = moe_target(name), routings.get(name, experts.ROUTED)
                moe = bool(tcfg.num_experts)
                step_experts = routing.touched(tcfg, b) if moe else None
                cells = []
                for tree in TREES.values():
                    pr = predict.predict(
                        dev, tcfg, tree, acc.tau(tree), b, context, routing=routing
                    )
                    touched = routing.touched(tcfg, b * tree.total_tokens) if moe else None
                    recs.append([
                        b, dname, name, pr.chips, pr.plain_s * 1e6, step_experts,
                        predict.tree_text(tree), pr.round_s * 1e6, touched, pr.ratio, pr.tau,
                        pr.speedup,
                    ])  # fmt: skip
                    cells.append(recs[-1])
                best = predict.best_tree(dev, tcfg, acc, b, context, routing=routing)
                best_recs.append([
                    b, dname, name, predict.tree_text(best.tree), best.round_s * 1e6, best.ratio,
                    best.tau, best.speedup,
                ])  # fmt: skip
                rep = cells[0]  # the reporting tree's
                rows.append([
                    b, dname, name, pr.chips, us(pr.plain_s),
                    "-" if not moe else f"{step_experts:.1f} / {tcfg.num_experts}",
                    us(rep[7] * 1e-6), "-" if not moe else f"{rep[8]:.1f}",
                    *[f"{c[11]:.2f}× ({c[9]:.2f})" for c in cells],
                    f"{predict.tree_text(best.tree)}: {best.speedup:.2f}× (τ {best.tau:.2f})",
                ])  # fmt: skip
    print(f"\n## Mixture-of-experts targets beside Llama-3.1-8B (context {context}; τ from the "
          f"assumed head for every target; experts: distinct per routed layer)\n")  # fmt: skip
    print(table(
        ["B", "device", "target", "chips", "plain µs", "experts a step", "10/8/60 round µs",
         "experts a round", *[f"{t}: speedup (round/plain)" for t in TREES], "best tree"],
        rows,
    ))  # fmt: skip
    # the dense dispatch (models.target._moe's larger forwards on a GPU): every expert read and
    # run on every token
    dense, dense_rows = experts.Routing("dense"), []
    h100, rep_tree = specs.DEVICES["H100"], acceptance.REPORTING_TREE
    for b in batches:
        for name in ("qwen3_30b_a3b", "gpt_oss_20b"):
            tcfg = moe_target(name)
            for label, routing in (("routed", experts.ROUTED), ("dense dispatch", dense)):
                pr = predict.predict(h100, tcfg, rep_tree, acc.tau(rep_tree), b, context,
                                     routing=routing)  # fmt: skip
                dense_rows.append(
                    [b, name, label, pr.plain_s * 1e6, pr.round_s * 1e6, pr.ratio, pr.speedup]
                )
    print("\nRouted (the chosen experts only: ours in a plain step, and in a round on TPUs) "
          "against the dense dispatch (ours in a GPU's rounds until its ragged_dot is "
          "measured), H100, 10/8/60:\n")  # fmt: skip
    print(table(
        ["B", "target", "dispatch", "plain µs", "round µs", "round/plain", "speedup"],
        [[b, n, d, us(p * 1e-6), us(r * 1e-6), f"{q:.2f}", f"{x:.2f}×"]
         for b, n, d, p, r, q, x in dense_rows],
    ))  # fmt: skip
    return {
        "routing": {
            n: ("measured: " + routings[n].measured.source) if n in routings else "uniform"
            for n in MOE_TARGETS if moe_target(n).num_experts
        },
        "columns": ["batch", "device", "target", "chips", "plain_us", "experts_step", "tree",
                    "round_us", "experts_round", "ratio", "tau", "speedup"],
        "rows": recs,
        "best_columns": ["batch", "device", "target", "tree", "round_us", "ratio", "tau",
                         "speedup"],
        "best": best_recs,
        "dispatch_h100_columns": ["batch", "target", "dispatch", "plain_us", "round_us", "ratio",
                                  "speedup"],
        "dispatch_h100": dense_rows,
    }  # fmt: skip


def dump(res: dict) -> str:
    """JSON, indented, each list of plain values on one line (the tables' rows)."""
    text = json.dumps(rounded(res), indent=1, default=str)
    inner = re.compile(r"\[\n\s*([^\[\]{}]*?)\n\s*\]")
    return inner.sub(lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text)


def columnar(records: list[dict]) -> dict:
    """Records with the same keys as {"columns": keys, "rows": [values, ...]} (the JSON's size)."""
    cols = list(records[0])
    return {"columns": cols, "rows": [[r[c] for c in cols] for r in records]}


def rounded(x, digits: int = 5):
    """Floats to `digits` significant digits (the JSON's size; the model is no more precise)."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v, digits) for v in x]
    return x


def pred_dict(p: predict.Prediction) -> dict:
    return {
        "device": p.device, "target": p.target, "tree": predict.tree_text(p.tree), "batch": p.batch,
        "context": p.context, "chips": p.chips, "plain_us": p.plain_s * 1e6,
        "round_us": p.round_s * 1e6, "ratio": p.ratio, "tau": p.tau, "speedup": p.speedup,
    }  # fmt: skip


def xla_check() -> list[dict]:
    """XLA's FLOPs of the real Llama-3.1-8B programs (lowered on this CPU) next to ours."""
    from eagle3_jax.accelerators import lowering, programs

    return lowering.flops_check(programs.Setup(target="llama31_8b", mesh=(1, 1)))


def speedup(dev: specs.Device, tree: TreeConfig, acc: acceptance.Acceptance, context: int) -> float:
    return predict.predict(dev, "llama31_8b", tree, acc.tau(tree), 1, context).speedup


def plot(path: Path, acc: acceptance.Acceptance, context: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [4, 8, 16, 24, 32, 48, 60, 64, 96, 128]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for dname, dev in specs.DEVICES.items():
        ys = [speedup(dev, TreeConfig(10, 8, n), acc, context) for n in sizes]
        ax.plot(sizes, ys, marker="o", label=dname)
        ch = [speedup(dev, TreeConfig(1, d, d + 1), acc, context) for d in range(1, 9)]
        ax.plot(range(2, 10), ch, ls="--", color=ax.lines[-1].get_color(), alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens verified per round (top-k 10, depth 8; dashed: chains)")
    ax.set_ylabel("predicted speedup over plain decoding")
    ax.set_title(f"Llama-3.1-8B, batch 1, context {context}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    taus = [acc.tau(TreeConfig(10, 8, n)) for n in sizes]
    small = [acceptance.SMOLLM2_ACCEPTANCE.tau(TreeConfig(10, 8, n)) for n in sizes]
    ax2.plot(sizes, taus, marker="o", label=acc.label)
    ax2.plot(sizes, small, marker="s", label=acceptance.SMOLLM2_ACCEPTANCE.label + " (fit)")
    meas = [(k[2], v) for k, v in acceptance.SMOLLM2_TAUS.items()]
    ax2.scatter(*zip(*meas), color="k", zorder=3, label="SmolLM2 GPU head, measured")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("tokens verified per round")
    ax2.set_ylabel("τ (acceptance model)")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
