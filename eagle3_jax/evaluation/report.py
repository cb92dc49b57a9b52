"""An evaluation run's outputs: results.json (strict JSON), report.md (the paper-shaped table)
and the plots, from its records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from eagle3_jax.evaluation import metrics
from eagle3_jax.evaluation.questions import task_order


def strict_json(x):
    """NaN -> None, recursively, so results.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [strict_json(v) for v in x]
    return x


def table_head(columns: list[str]) -> list[str]:
    """A markdown table's header and rule lines, one rule cell per column."""
    return ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]


def write_outputs(out: Path, records, questions, methods, seeds, opts) -> dict:
    """results.json, report.md and the plots for this run's questions, methods and seeds."""
    ids = {q.id for q in questions}
    labels = [m.label for m in methods]
    order = {(q.id): i for i, q in enumerate(questions)}
    mine = [
        r
        for r in records
        if str(r["question_id"]) in ids and r["method"] in labels and r["seed"] in seeds
    ]
    mine.sort(key=lambda r: (r["seed"], order[str(r["question_id"])], labels.index(r["method"])))
    tasks = task_order(q.task for q in questions)
    summary = metrics.summarize(mine, labels, tasks, greedy=opts.temperature == 0)
    summary = strict_json(summary)
    config = json.loads((out / "config.json").read_text())
    (out / "results.json").write_text(
        json.dumps(
            {
                "config": config,
                "summary": summary,
                "records": strict_json(mine),
            },
            indent=1,
        )
        + "\n"
    )
    cuts = config.get("draft_vocab")
    report = report_markdown(summary, opts, len(questions), len(seeds), cuts)
    (out / "report.md").write_text(report)
    plot_summary(summary, out)
    return summary


def _fmt(ms: dict, digits: int = 2, suffix: str = "") -> str:
    if ms["mean"] is None:
        return "–"
    s = f"{ms['mean']:.{digits}f}"
    if ms["n"] > 1:
        s += f"±{ms['std']:.{digits}f}"
    return s + suffix


def report_markdown(summary: dict, opts, n_questions: int, n_seeds: int, cuts=None) -> str:
    """The paper-shaped table: rows = methods, columns = tasks + Overall, cells "τ / speedup"
    (`cuts`: {draft: ids kept} of drafts run cut by --draft-vocab, said under the title)."""
    tasks, methods = summary["tasks"], summary["methods"]
    lines = [
        "# EAGLE-3 evaluation",
        "",
        f"bench `{opts.bench}`, {n_questions} questions, temperature {opts.temperature}, "
        f"max new tokens {opts.max_new_tokens}, {n_seeds} seed(s), batch size {opts.batch_size}. "
        "Cells: τ (tokens per verification round) / speedup over vanilla (throughput ratio, "
        "same run); mean ± std over seeds. Exact: fraction of questions whose greedy output equals "
        "vanilla's."
        + (
            " A method marked (τ replayed) was replayed over vanilla's greedy answers "
            "(--replay, docs/replay.md): decoding's τ and acceptance, no timing."
            if any(summary["by_method"][m].get("replayed") for m in methods)
            else ""
        )
        + "".join(
            f" Draft `{n}` cut to its first {k} ids (--draft-vocab)."
            for n, k in (cuts or {}).items()
        ),
        "",
        "| Method | " + " | ".join(tasks) + " | Overall | Exact |",
        "| --- | " + " | ".join("---" for _ in tasks) + " | --- | --- |",
    ]
    for m in methods:
        s = summary["by_method"][m]
        cells = [
            f"{_fmt(g['tau'])} / {_fmt(g['speedup'], suffix='×')}"
            for g in [s["tasks"][t] for t in tasks] + [s["overall"]]
        ]
        ex = "–" if s["exactness"] is None else f"{s['exactness']:.2f}"
        name = f"{m} (τ replayed)" if s.get("replayed") else m
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ex} |")
    lines += [
        "",
        "## Throughput (tokens/s, overall) and tree tokens verified per round",
        "",
        "| Method | tokens/s | verified / round |",
        "| --- | --- | --- |",
    ]
    for m in methods:
        o = summary["by_method"][m]["overall"]
        ver = o.get("verified_per_round")
        ver = "–" if ver is None or not math.isfinite(ver) else f"{ver:.2f}"
        lines.append(f"| {m} | {_fmt(o['throughput'], 1)} | {ver} |")
    acc = {m: summary["by_method"][m]["overall"]["acceptance_by_depth"] for m in methods}
    acc = {m: a for m, a in acc.items() if a}
    if acc:
        depth = max(len(a) for a in acc.values())
        lines += [
            "",
            "## Acceptance by depth (overall)",
            "",
            "α_d = P(accept ≥ d+1 drafted tokens | ≥ d), from histograms summed over questions.",
            "",
            "| Method | " + " | ".join(f"α{d}" for d in range(depth)) + " |",
            "| --- | " + " | ".join("---" for _ in range(depth)) + " |",
        ]
        for m, a in acc.items():
            vals = ["–" if v is None else f"{v:.2f}" for v in a] + [""] * (depth - len(a))
            lines.append(f"| {m} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def plot_summary(summary: dict, out: Path) -> list[Path]:
    """tau_per_task.png, speedup_per_task.png, acceptance_by_depth.png (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks, methods = summary["tasks"], summary["methods"]
    cols = tasks + ["overall"]
    paths = []
    for key, title in (("tau", "τ (tokens per round)"), ("speedup", "speedup over vanilla")):
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cols) * max(1, len(methods)) / 2), 4))
        width = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            s = summary["by_method"][m]
            groups = [s["tasks"][t] for t in tasks] + [s["overall"]]
            means = [np.nan if g[key]["mean"] is None else g[key]["mean"] for g in groups]
            stds = [0.0 if g[key]["std"] is None else g[key]["std"] for g in groups]
            x = np.arange(len(cols)) + (i - (len(methods) - 1) / 2) * width
            ax.bar(x, means, width, yerr=stds, label=m, capsize=2)
        ax.set_xticks(np.arange(len(cols)), cols, rotation=20)
        ax.set_ylabel(title)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.legend(fontsize="small")
        fig.tight_layout()
        paths.append(out / f"{key}_per_task.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        a = summary["by_method"][m]["overall"]["acceptance_by_depth"]
        if a:
            ax.plot(range(len(a)), [np.nan if v is None else v for v in a], marker="o", label=m)
    ax.set_xlabel("depth d")
    ax.set_ylabel("α_d")
    ax.set_ylim(0, 1.05)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    paths.append(out / "acceptance_by_depth.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
