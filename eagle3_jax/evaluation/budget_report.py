"""An ablation grid measured at several training budgets: each cell's head exported at steps
B1 < B2 < ... (one run a cell, a constant learning rate after warmup), every head paired against
the reference cell's head of the same budget, on each bench; which differences are real and at
which budget they first appear; and the cells' held-out curves against tokens read in one figure.

Input: per bench, one harness results dict holding every (cell, budget) head as an `eagle3`
method whose draft is named `head_name(cell, step)` (`study.merge_groups` of the cells' groups),
the cells' descriptions, the budgets (steps) and the curves (`study.read_curve`). Output: report.md
text, a JSON summary, tau_vs_tokens.png. Used by benchmarks/fusion_ablation_trained.py.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_jax.evaluation import grid_report
from eagle3_jax.evaluation.report import table_head
from eagle3_jax.evaluation.study.text import fmt, paired_text


def head_name(cell: str, step: int) -> str:
    """The draft name of `cell`'s head exported at training step `step`."""
    return f"{cell}_step{step}"


def budget_rows(results: dict, cells: dict[str, str], reference: str, step: int) -> list[dict]:
    """grid_report's rows of the heads exported at `step` (named by cell), each paired with the
    reference's head of the same step."""
    named = {head_name(c, step): what for c, what in cells.items()}
    rows = grid_report.cell_rows(results, named, head_name(reference, step))
    for r in rows:
        r["cell"] = r["cell"].removesuffix(f"_step{step}")
    return rows


def tokens_at(curves: dict[str, list[dict]], step: int) -> int | None:
    """Tokens read by training step `step` (every cell reads the same records in the same order:
    the first curve with that step says)."""
    for pts in curves.values():
        for p in pts:
            if p["step"] == step and p.get("tokens"):
                return int(p["tokens"])
    return None


def report(
    runs: dict[str, dict],
    cells: dict[str, str],
    reference: str,
    budgets: list[int],
    curves: dict[str, list[dict]],
    title: str = "Ablation at several budgets",
) -> tuple[str, dict]:
    """(report.md text, JSON summary). `runs`: bench label -> merged results of that bench."""
    lines = [f"# {title}", ""]
    lines += [
        f"Each cell's head at every budget against `{reference}`'s head at the same budget, on the "
        "same questions (tau: tokens per target forward, bonus included; tau - ref: the mean "
        "per-question difference with its 95 % t interval, * where it excludes no difference). "
        "One training run a cell at a constant learning rate after warmup: the head at step B is "
        "what a run of B steps gives. A difference is called real at a budget where its interval "
        "excludes zero; 'first real' is the smallest such budget, 'holds' whether it stays real "
        "at every larger budget measured.",
        "",
    ]
    summary: dict = {"reference": reference, "budgets": list(budgets), "benches": {}}
    summary["tokens"] = {str(b): tokens_at(curves, b) for b in budgets}
    summary["first_real"] = {}
    for bench, results in runs.items():
        by_step = {b: budget_rows(results, cells, reference, b) for b in budgets}
        shown = [b for b in budgets if by_step[b]]
        summary["benches"][bench] = {str(b): by_step[b] for b in shown}
        first = summary["first_real"][bench] = {}
        n_q = max((r["questions"] for b in shown for r in by_step[b]), default=0)
        lines += [f"## {bench} ({n_q} questions)", ""]
        if not shown:
            lines += ["No head measured yet.", ""]
            continue
        heads = [
            f"step {b:,} ({tokens:,} tokens)" if (tokens := tokens_at(curves, b)) else f"step {b:,}"
            for b in shown
        ]
        lines += table_head(["cell", "what differs", *heads, "first real", "holds"])
        for name, what in cells.items():
            got = {b: next((r for r in by_step[b] if r["cell"] == name), None) for b in shown}
            if not any(got.values()):
                continue
            real = [b for b in shown if (r := got[b]) and r.get("vs_reference", {}).get("real")]
            first[name] = real[0] if real else None
            holds = bool(real) and all(
                (r := got[b]) and r.get("vs_reference", {}).get("real")
                for b in shown
                if b >= real[0]
            )
            cols = [
                "-"
                if r is None
                else f"{fmt(r['tau'])} "
                + paired_text(r.get("vs_reference"), "(reference)" if name == reference else "")
                for r in got.values()
            ]
            lines.append(
                f"| {name} | {what} | "
                + " | ".join(cols)
                + f" | {f'step {real[0]:,}' if real else ('-' if name == reference else 'none')}"
                + f" | {('yes' if holds else 'no') if real else '-'} |"
            )
        last = shown[-1]
        tasks = list(by_step[last][0]["tau_by_task"]) if by_step[last] else []
        lines += [
            "",
            f"Per task at step {last:,}, tau - ref (95 %; each interval on its own, no "
            "correction for comparing several cells and tasks):",
            "",
            *table_head(["cell", *tasks]),
        ]
        for r in by_step[last]:
            by = r.get("vs_reference_by_task")
            lines.append(
                f"| {r['cell']} | "
                + " | ".join(paired_text(by.get(t)) if by else "-" for t in tasks)
                + " |"
            )
        named = [f"{c} (from step {b:,})" for c, b in first.items() if b is not None]
        lines += [
            "",
            f"Real differences from `{reference}` at 95 %: {', '.join(named)}."
            if named
            else f"No difference from `{reference}` is real at 95 % at any budget measured.",
            "",
        ]
    lines += grid_report.curve_table(curves)
    summary["curves"] = {c: v[-1] for c, v in curves.items() if v}
    return "\n".join(lines), summary


def plot_tau_vs_tokens(
    curves: dict[str, list[dict]], out: Path, target_acc: float | None = 0.65
) -> Path:
    """tau_vs_tokens.png: every cell's held-out acc_0 (left) and replayed chain tau (right)
    against training tokens read (steps where a point lacks tokens), so a reader sees whether
    the cells part as data grows; a dotted line at `target_acc` (the shipped head's held-out
    acc_0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "tokens" if all(p.get("tokens") for v in curves.values() for p in v) else "step"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, what, label in (
        (axes[0], "acc_0", "held-out acc_0"),
        (axes[1], "chain_tau", "held-out replayed chain tau"),
    ):
        for name, pts in curves.items():
            pts = [p for p in pts if p.get(what) is not None]
            if pts:
                ax.plot([p[key] for p in pts], [p[what] for p in pts], "o-", ms=3, label=name)
        ax.set_xlabel("training tokens read" if key == "tokens" else "training steps")
        ax.set_ylabel(label)
        if key == "tokens":
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
    if target_acc is not None:
        axes[0].axhline(target_acc, color="grey", ls=":", lw=1, label="shipped head")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = out / "tau_vs_tokens.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
