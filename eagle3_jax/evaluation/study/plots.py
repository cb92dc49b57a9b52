"""The study's plots: paired differences per tree, tau against drafting time, training curves."""

from __future__ import annotations

import math
from pathlib import Path

from eagle3_jax.evaluation.study.curves import curve_points


def plot(summary: dict, curves: dict[str, list[dict]] | None, out: Path) -> list[Path]:
    """tau difference and throughput (or speedup: `paired_speed`) ratio against the reference
    with their intervals (one panel per tree), draft time per round against tau, and the
    held-out training curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    trees = summary["trees"]
    fig, axes = plt.subplots(len(trees), 2, figsize=(11, 0.5 + 3.2 * len(trees)), squeeze=False)
    for ax_row, (name, t) in zip(axes, trees.items()):
        rows = [r for r in t["rows"] if "vs_reference" in r]
        ys = range(len(rows))
        for ax, key, null in ((ax_row[0], "tau", 0.0), (ax_row[1], "throughput", 1.0)):
            for y, r in zip(ys, rows):
                d = r["vs_reference"].get(key)
                if d is None:  # replayed: no throughput
                    continue
                ax.errorbar(
                    d["mean"], y, xerr=[[d["mean"] - d["lo"]], [d["hi"] - d["mean"]]], fmt="o"
                )
            ax.axvline(null, color="grey", lw=0.8)
            ax.set_yticks(list(ys), [r["head"] for r in rows])
            speed = t.get("paired_speed", "throughput")
            ax.set_title(
                f"tree {name}: " + ("tau - ref" if key == "tau" else f"{speed} / ref") + " (95 %)"
            )
    fig.tight_layout()
    paths.append(out / "paired.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # one panel per tree (their rounds differ in size); a head keeps its colour and marker
    heads = list(dict.fromkeys(r["head"] for t in trees.values() for r in t["rows"]))
    style = {h: (f"C{i % 10}", "osD^v<>ph*"[i % 10]) for i, h in enumerate(heads)}
    width = 1.5 + 4.5 * len(trees)  # inches: the panels and 1.5 for the legend
    fig, axes = plt.subplots(1, len(trees), figsize=(width, 4.5), squeeze=False)
    for ax, (name, t) in zip(axes[0], trees.items()):
        for r in t["rows"]:
            x, y = r["draft_round_ms"], r["tau"]
            if not all(v is not None and math.isfinite(v) for v in (x, y)):
                continue  # a head without records or without a drafting time
            color, marker = style[r["head"]]
            ax.scatter(x, y, color=color, marker=marker, label=r["head"])
        ax.set_title(f"tree {name}")
        ax.set_xlabel("drafting time per round (ms)")
        ax.set_ylabel("tau")
    handles = {}
    for ax in axes[0]:
        for hd, lb in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lb, hd)
    if handles:
        fig.legend(handles.values(), handles.keys(), loc="center right", fontsize=7)
    fig.tight_layout(rect=(0, 0, 1 - 1.4 / width, 1))
    paths.append(out / "tau_vs_draft_cost.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    if curves:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        shown, key = curve_points(curves)
        for name, pts in shown.items():
            ax.plot([p[key] for p in pts], [p["chain_tau"] for p in pts], "o-", label=name)
        ax.legend(fontsize=8)
        ax.set_xlabel("training tokens read" if key == "tokens" else "training steps")
        ax.set_ylabel("held-out replayed chain tau")
        fig.tight_layout()
        paths.append(out / "training_curves.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
