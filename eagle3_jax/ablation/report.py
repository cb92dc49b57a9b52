"""An ablation grid's outputs: results.json, report.md (a row per cell; each cell against the
first, paired) and the plots (tau_per_cell.png, acc_by_ttt_step.png), rewritten as each cell
finishes."""

from __future__ import annotations

import json
import math
from pathlib import Path

from eagle3_jax.checkpoints.atomic import write_text_atomic
from eagle3_jax.evaluation import paired
from eagle3_jax.evaluation.report import strict_json, table_head


def _f(x, digits=2):
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def missing_cells(result: dict) -> list[str]:
    """The planned cells a (partial) result does not hold yet, in grid order."""
    done = {r["cell"] for r in result["cells"]}
    return [c for c in result.get("planned", []) if c not in done]


def report_markdown(result: dict) -> str:
    cfg, rows = result["config"], result["cells"]
    missing = missing_cells(result)
    tasks = list(dict.fromkeys(t for r in rows for t in r["tau_by_task"]))
    steps = max((len(r["final_acc"]) for r in rows), default=0)
    held = [r["curve"][-1] if r.get("curve") else {} for r in rows]
    held_cols = ["held-out acc_0", "held-out chain τ"] if any(held) else []
    lines = [
        "# Ablation",
        "",
        *(
            [
                f"**Partial:** {len(rows)} of {len(rows) + len(missing)} cells finished; still to "
                f"come: {', '.join(missing)} (rerun the same command to continue).",
                "",
            ]
            if missing
            else []
        ),
        _how_measured(cfg, held_cols),
        "",
        *table_head(
            ["cell", "aux layers", "fc in", "TTT", "feat. loss", "Vd"]
            + [f"τ {t}" for t in tasks]
            + ["τ"]
            + [f"acc_{i}" for i in range(steps)]
            + held_cols
            + ["train s"]
        ),
    ]
    for r, h in zip(rows, held):
        lines.append("| " + " | ".join(_row_cells(r, h, tasks, steps, held_cols)) + " |")
    return "\n".join(lines + paired_table(rows)) + "\n"


def _how_measured(cfg: dict, held_cols: list[str]) -> str:
    """The report's paragraph on how every cell was trained and measured."""
    return (
        "Every cell trained from the same "
        + (
            "target features, computed as it trained"
            if cfg.get("online_features")
            else "precomputed features"
        )
        + f" (layers {cfg['feature_layers']}), records, seed and step budget (in one order per "
        "batch size); "
        + (
            f"evaluated greedily on `{cfg['bench']}` ({cfg['questions']} questions per task, "
            f"{cfg['max_new_tokens']} new tokens per turn, tree top_k,depth,total = "
            f"{','.join(map(str, cfg['tree']))}). τ = tokens per target forward; "
            if cfg.get("evaluate", True)
            else "not evaluated here (evaluate=False). "
        )
        + "acc_i = training accuracy of TTT step i, "
        + (
            f"mean over the logged steps among each cell's last {cfg['acc_records']} "
            "training records."
            if cfg.get("acc_records")
            else f"mean of the last {cfg['acc_window']} logged steps."
            if cfg.get("acc_window", 1) > 1
            else "at the last logged step."
        )
        + (
            " Held-out acc_0 and chain τ: the last validation of the cell's exported head on "
            "held-out conversations (each cell's curve against tokens read is in results.json)."
            if held_cols
            else ""
        )
    )


def _row_cells(r: dict, h: dict, tasks: list, steps: int, held_cols: list[str]) -> list[str]:
    """One cell's row of the table: its head, τ per task and overall, acc_i (padded to `steps`),
    its last held-out validation `h` (when the table has those columns), training time."""
    accs = [_f(a) for a in r["final_acc"]] + [""] * (steps - len(r["final_acc"]))
    return [
        r["cell"],
        ",".join(map(str, r["aux_layer_ids"])),
        str(r["fc_input_width"]),
        str(r["ttt_steps"]),
        f"{r['feature_loss_weight']:g}",
        str(r["draft_vocab_size"]),
        *(_f(r["tau_by_task"].get(t)) for t in tasks),
        _f(r["tau"]),
        *accs,
        *([_f(h.get("acc_0"), 3), _f(h.get("chain_tau"))] if held_cols else []),
        f"{r['train_wall_s']:.0f}",
    ]


PAIRED_ACC = 3  # acc_0..acc_2 in the paired table


def _present(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def paired_table(rows: list[dict]) -> list[str]:
    """Each cell against the first, paired: acc_i step by step over the same records (only
    between cells of one batch size, which read the records in one order), τ question by
    question. Record difficulty and question difficulty cancel; what is left is the head. Each
    difference carries its 95 % Student's t interval (`evaluation.paired`), and the lines below
    the table name the differences whose interval excludes zero."""
    if len(rows) < 2:
        return []
    ref = rows[0]
    lines = [
        "",
        f"Paired differences against `{ref['cell']}`: mean (95 % t interval); acc_i over the "
        "same training records step by step, τ over the same questions; * the interval excludes "
        "no difference.",
        "",
        *table_head(["cell", *(f"Δacc_{i}" for i in range(PAIRED_ACC)), "Δτ"]),
    ]

    def step_column(row: dict, i: int) -> dict:
        return {k: v[i] if i < len(v) else None for k, v in row.get("acc_by_step", {}).items()}

    ref_cols = [_present(step_column(ref, i)) for i in range(PAIRED_ACC)]
    real = []
    for r in rows[1:]:
        same_order = r.get("batch_size") == ref.get("batch_size")
        diffs = {
            f"acc_{i}": paired.paired_difference(_present(step_column(r, i)), ref_cols[i])
            for i in range(PAIRED_ACC)
            if same_order
        }
        diffs["τ"] = paired.paired_difference(
            _present(r.get("tau_by_question", {})), _present(ref.get("tau_by_question", {}))
        )
        cols = [diffs[f"acc_{i}"].text(3) if same_order else "–" for i in range(PAIRED_ACC)]
        lines.append(f"| {r['cell']} | " + " | ".join([*cols, diffs["τ"].text(3)]) + " |")
        real += [f"{r['cell']} {k} {d.mean:+.3f}" for k, d in diffs.items() if d.real]
    verdict = (
        f"Real differences (95 %): {'; '.join(real)}."
        if real
        else "No difference is real at 95 %: every interval includes zero."
    )
    return lines + ["", verdict]


def write_outputs(out: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # rewritten as each cell finishes: a kill mid-write leaves the previous complete files
    write_text_atomic(out / "results.json", json.dumps(strict_json(result), indent=1) + "\n")
    write_text_atomic(out / "report.md", report_markdown(result))
    rows = result["cells"]
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(rows) + 2), 4))
    ax.bar(range(len(rows)), [r["tau"] or 0 for r in rows])  # 0: a cell not evaluated
    ax.set_xticks(range(len(rows)), [r["cell"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("τ (tokens per target forward)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "tau_per_cell.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        acc = [a for a in r["final_acc"] if a is not None]
        ax.plot(range(len(acc)), acc, "o-", label=r["cell"])
    ax.set_xlabel("TTT step i")
    ax.set_ylabel("training acc_i (end of training)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "acc_by_ttt_step.png", dpi=120)
    plt.close(fig)
