"""An ablation grid measured in one harness run: every cell's head against a reference cell on the
same questions, tau and paired intervals, beside each cell's held-out training curve.

Input: the harness's results.json of one run that holds plain decoding and every cell's head
(each an `eagle3` method whose draft name is the cell's name; replayed or decoded), the cells'
descriptions and their curves (`study.read_curve`). Output: report.md text, a JSON summary and
plots. Used by benchmarks/fusion_ablation.py (which target layers to fuse, TTT length).
"""

from __future__ import annotations

import math
from pathlib import Path

from eagle3_jax.evaluation import metrics, paired
from eagle3_jax.evaluation.paired import category_of
from eagle3_jax.evaluation.questions import task_order
from eagle3_jax.evaluation.report import table_head
from eagle3_jax.evaluation.study.curves import curve_points
from eagle3_jax.evaluation.study.heads import label_of, tree_of
from eagle3_jax.evaluation.study.text import fmt, paired_text


def cell_rows(results: dict, cells: dict[str, str], reference: str) -> list[dict]:
    """One row per cell that ran (`cells`: name -> what differs): tau overall and per category
    (`paired.category_of`: MT-bench's eight subcategories, a task its own), whether it was
    replayed, and tau's paired difference against `reference` with its 95 % interval, overall
    and per category."""
    recs = results["records"]
    tasks = task_order(category_of(r) for r in recs)
    ref = label_of(results, reference)
    rows = []
    for name, what in cells.items():
        label = label_of(results, name)
        if label is None:
            continue
        mine = [r for r in recs if r["method"] == label]
        row = {
            "cell": name,
            "what": what,
            "label": label,
            "questions": len({str(r["question_id"]) for r in mine}),
            "replayed": bool(mine) and all(r.get("replayed") for r in mine),
            "tau": metrics.tau(mine),
            "tau_by_task": {
                t: metrics.tau([r for r in mine if category_of(r) == t]) for t in tasks
            },
        }
        if ref is not None and label != ref:
            row["vs_reference"] = paired.compare(recs, label, ref)["tau"].as_dict()
            row["vs_reference_by_task"] = {
                t: paired.compare(recs, label, ref, category=t)["tau"].as_dict() for t in tasks
            }
        rows.append(row)
    return rows


def report(
    results: dict,
    cells: dict[str, str],
    reference: str,
    curves: dict[str, list[dict]],
    title: str = "Ablation",
) -> tuple[str, dict]:
    """(report.md text, JSON summary) of a grid measured in one harness run."""

    def none(r: dict) -> str:  # a row without a paired difference
        return "reference" if r["cell"] == reference else "-"

    rows = cell_rows(results, cells, reference)
    tasks = list(rows[0]["tau_by_task"]) if rows else []
    k, d, n = tree_of(results)[:3]
    replayed = any(r["replayed"] for r in rows)
    real = [r["cell"] for r in rows if r.get("vs_reference", {}).get("real")]
    ran = {r["cell"] for r in rows}
    n_q = max((r["questions"] for r in rows), default=0)
    missing = [c for c in cells if c not in ran]
    held_out = ["held-out acc_0", "held-out chain tau", "step"]
    lines = [
        f"# {title}",
        "",
        *(
            [f"`{reference}` is not among the cells measured: nothing is paired below.", ""]
            if reference not in ran
            else []
        ),
        *([f"Not in this run: {', '.join(missing)}.", ""] if missing else []),
        f"Every cell's head against `{reference}` on the same {n_q} "
        f"questions ({', '.join(tasks)}), greedy, tree top-k {k}, depth {d}, {n} nodes, max "
        f"{results['config'].get('max_new_tokens', '?')} new tokens a turn"
        + (
            "; each head replayed over plain decoding's answers (`eval --replay`, "
            "docs/replay.md: the tau decoding gives)."
            if replayed
            else "."
        ),
        "",
        "tau: tokens per target forward, bonus included. tau - ref: the mean per-question "
        "difference against the reference with its 95 % t interval (* the interval excludes no "
        "difference). Held-out: acc_0 and the replayed chain tau of the exported head at the last "
        "validation of its training.",
        "",
        *table_head(["cell", "what differs", "tau", "tau - ref", *tasks, *held_out]),
    ]
    for r in rows:
        last = (curves.get(r["cell"]) or [{}])[-1]
        lines.append(
            f"| {r['cell']} | {r['what']} "
            f"| {fmt(r['tau'])} | {paired_text(r.get('vs_reference'), none(r))} | "
            + " | ".join(fmt(r["tau_by_task"][t]) for t in tasks)
            + f" | {fmt(last.get('acc_0'), 3)} | {fmt(last.get('chain_tau'))} "
            f"| {last.get('step', '-')} |"
        )
    lines += [
        "",
        "Per category, tau - ref (95 %; each interval on its own, no correction for comparing "
        "several cells and categories):",
        "",
        *table_head(["cell", *tasks]),
    ]
    for r in rows:
        by = r.get("vs_reference_by_task")
        lines.append(
            f"| {r['cell']} | "
            + " | ".join(paired_text(by.get(t)) if by else "-" for t in tasks)
            + " |"
        )
    if reference in ran and len(ran) == 1:
        lines += ["", f"Only `{reference}` is in: nothing is paired yet."]
    elif reference in ran:
        lines += [
            "",
            f"Real differences from `{reference}` at 95 %: {', '.join(real)}."
            if real
            else f"No difference from `{reference}` is real at 95 %.",
        ]
    lines += ["", *curve_table(curves)]
    summary = {"reference": reference, "tree": [k, d, n], "rows": rows, "real": real}
    summary["curves"] = {c: v[-1] for c, v in curves.items() if v}
    return "\n".join(lines), summary


def curve_table(curves: dict[str, list[dict]]) -> list[str]:
    """Every cell's held-out validations step by step (acc_0 / replayed chain tau), one column a
    cell, so that a reader sees where each curve stands at every budget and whether it still
    rises; [] when no cell has validated."""
    shown = {c: {p["step"]: p for p in pts} for c, pts in curves.items() if pts}
    if not shown:
        return []
    steps = sorted({s for pts in shown.values() for s in pts})
    tokens = {s: p.get("tokens") for pts in shown.values() for s, p in pts.items()}
    out = [
        "Held-out validation along training (acc_0 / replayed chain tau; the same held-out "
        "conversations and the same training records in the same order for every cell):",
        "",
        *table_head(["step", "tokens read", *shown]),
    ]
    for s in steps:
        cells = [
            f"{fmt(p.get('acc_0'), 3)} / {fmt(p.get('chain_tau'))}" if (p := pts.get(s)) else "-"
            for pts in shown.values()
        ]
        out.append(
            f"| {s} | {f'{tokens[s]:,}' if tokens.get(s) else '-'} | " + " | ".join(cells) + " |"
        )
    return out + [""]


def plot(summary: dict, curves: dict[str, list[dict]], out: Path) -> list[Path]:
    """paired.png (tau - ref with 95 % intervals, one line per cell) and training_curves.png
    (held-out replayed chain tau against tokens read)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summary["rows"] if "vs_reference" in r]
    fig, ax = plt.subplots(figsize=(6.5, 0.8 + 0.5 * max(len(rows), 1)))
    for y, r in enumerate(rows):
        v = r["vs_reference"]
        if math.isfinite(v["lo"]):
            ax.errorbar(v["mean"], y, xerr=[[v["mean"] - v["lo"]], [v["hi"] - v["mean"]]], fmt="o")
        else:
            ax.plot(v["mean"], y, "o")
    ax.axvline(0.0, color="grey", lw=0.8)
    ax.set_yticks(range(len(rows)), [r["cell"] for r in rows])
    ax.set_xlabel(f"tau - {summary['reference']} (95 %)")
    fig.tight_layout()
    paths = [out / "paired.png"]
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    shown, key = curve_points(curves)
    for name, pts in shown.items():
        if pts:
            ax.plot([p[key] for p in pts], [p["chain_tau"] for p in pts], "o-", label=name)
    ax.set_xlabel("training tokens read" if key == "tokens" else "training steps")
    ax.set_ylabel("held-out replayed chain tau")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "training_curves.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
