"""One tree's run: a row per head (tau per task, speed, drafting time, paired differences) and
its tables, the paper-shaped one and the paired ones."""

from __future__ import annotations

from collections.abc import Sequence

from eagle3_jax.evaluation import metrics, paired
from eagle3_jax.evaluation.questions import task_order
from eagle3_jax.evaluation.report import table_head
from eagle3_jax.evaluation.study.costs import round_draft_ms
from eagle3_jax.evaluation.study.heads import PAPER, StudyHead, label_of, tree_of
from eagle3_jax.evaluation.study.text import fmt, paired_n, paired_speed, paired_text, vocab_text


def head_rows(results: dict, heads: Sequence[StudyHead], reference: str, costs: dict) -> list[dict]:
    """One row per head that ran: tau per task and overall, throughput, speedup, time per round,
    paired tau difference and throughput ratio against `reference`, drafting times; and, for a
    head cut to the size of an EAGLE-3 head other than the reference, the same pairing against
    that head (`vs_same_size`: FR-Spec and VocabTrim at 16,384 against EAGLE-3 at 16,384)."""
    recs = results["records"]
    tasks = task_order(r["task"] for r in recs)
    vanilla = [r for r in recs if r["method"] == metrics.VANILLA]
    baselines = results.get("baselines") or {}  # merged groups: each head's own plain decoding
    ref = label_of(results, reference)
    tree = tree_of(results)
    same_size = {h.vocab: h.name for h in heads if h.family == "eagle3"}
    rows = []
    for h in heads:
        label = label_of(results, h.name)
        if label is None:
            continue
        mine = [r for r in recs if r["method"] == label]
        rounds = sum(int(r["target_forwards"]) - int(r.get("num_generations", 1)) for r in mine)
        # replayed over vanilla's answers (eval --replay): τ and acceptance, no decoding time
        replayed = bool(mine) and all(r.get("replayed") for r in mine)
        timed = not replayed and rounds > 0
        row = {
            "head": h.name,
            "family": h.family,
            "vocab": h.vocab,
            "target_vocab": h.target_vocab,
            "label": label,
            "questions": len({str(r["question_id"]) for r in mine}),
            "tau": metrics.tau(mine),
            "tau_by_task": {t: metrics.tau([r for r in mine if r["task"] == t]) for t in tasks},
            "replayed": replayed,
            "tokens_per_s": metrics.throughput(mine) if timed else None,
            "speedup": metrics.speedup(mine, baselines.get(label, vanilla)) if timed else None,
            "round_ms": 1e3 * sum(float(r["wall_time_s"]) for r in mine) / rounds
            if timed
            else None,
            "draft_step_ms": (costs.get(h.name) or {}).get("step_ms_rows1", float("nan")),
            "draft_round_ms": round_draft_ms(costs.get(h.name), tree),
            # the factors its run's times were scaled by (`calibrated_costs`); None: as timed
            "draft_scale": (costs.get(h.name) or {}).get("scale"),
        }
        if ref is not None and label != ref:
            cmp = paired.compare(recs, label, ref, baselines=baselines)
            row["vs_reference"] = {
                k: v.as_dict() for k, v in cmp.items() if timed or k != "throughput"
            }
            row["vs_reference_by_task"] = {
                t: paired.compare(recs, label, ref, task=t)["tau"].as_dict() for t in tasks
            }
        peer = same_size.get(h.vocab)
        peer_label = None if peer is None else label_of(results, peer)
        if peer not in (None, h.name, reference) and peer_label is not None:
            cmp = paired.compare(recs, label, peer_label, baselines=baselines)
            row["vs_same_size"] = {
                "head": peer,
                **{k: v.as_dict() for k, v in cmp.items() if timed or k != "throughput"},
            }
        rows.append(row)
    return rows


def _paper_cells(family: str) -> str:
    p = PAPER.get(family, {})
    return f"{fmt(p.get('tau_olmo2_1b'))} | {fmt(p.get('tps_olmo2_7b'), 1)}"


def tree_section(name: str, results: dict, rows: list[dict], reference: str) -> list[str]:
    """The markdown for one tree's run: the paper-shaped table, then the paired table."""
    tasks = list(rows[0]["tau_by_task"]) if rows else []
    n_q = rows[0]["questions"] if rows else 0
    out = [
        f"## Tree {name}: {n_q} questions, "
        + ", ".join(f"{t}" for t in tasks)
        + f"; max {results['config'].get('max_new_tokens', '?')} new tokens a turn",
        "",
        "tau per task (tokens per target forward, bonus included), throughput and speedup over "
        "plain decoding in the same run; drafting time of one round of this tree (ms). "
        "The paper's columns are the SpecVocab paper's H100 figures for its own targets.",
        *(
            [
                "Heads marked replayed were replayed over plain decoding's greedy answers "
                "(`eval --replay`, docs/replay.md): their tau is decoding's, but the run timed "
                "none of their rounds, so their speed is the drafting time beside it."
            ]
            if any(r.get("replayed") for r in rows)
            else []
        ),
        "",
        "ms/round is a head's wall time over its rounds, each answer's prefill included.",
        "",
        *table_head(
            ["head", "method", "Vd", *tasks, "tau", "tokens/s", "speedup", "ms/round"]
            + ["draft ms/round", "paper tau (OLMo 2 1B)", "paper tok/s (OLMo 2 7B)"]
        ),
    ]
    for r in rows:
        out.append(
            f"| {r['head']}{' (replayed)' if r.get('replayed') else ''} | {r['family']} | "
            f"{vocab_text(r['vocab'], r.get('target_vocab'))} | "
            + " | ".join(fmt(r["tau_by_task"][t]) for t in tasks)
            + f" | {fmt(r['tau'])} | {fmt(r['tokens_per_s'], 1)} | {fmt(r['speedup'], 2, 'x')}"
            f" | {fmt(r['round_ms'], 1)} | {fmt(r['draft_round_ms'], 1)} | {_paper_cells(r['family'])} |"
        )
    ran = any(r["head"] == reference for r in rows)
    speed, n_paired = paired_speed(results), paired_n(rows)
    out += [
        "",
        f"Paired against `{reference}`, question by question"
        + (f" over {n_paired} questions " if n_paired else " ")
        + "(mean and 95 % t interval; * the "
        f"interval excludes no difference): tau difference, {speed} ratio, and tau difference "
        "per task. These are means over questions (each question's tau pooled over its turns; "
        f"the {speed} ratio a geometric mean), so they need not equal the differences of the "
        f"table's pooled tau and {'speedup' if speed == 'speedup' else 'tokens/s'}.",
        *(
            [
                "The heads were timed in separate runs (one per group), so each question's "
                "throughput is first taken over its own run's plain decoding of that question: "
                "the ratio compares speedups, not raw tokens/s across runs."
            ]
            if speed == "speedup"
            and any((r.get("vs_reference") or {}).get("throughput") for r in rows)
            else []
        ),
        *([] if ran else ["", f"`{reference}` did not run in this tree: nothing is paired."]),
        "",
        *table_head(["head", "tau - ref", f"{speed} / ref", *tasks]),
    ]
    for r in rows:
        vs = r.get("vs_reference")
        by_task = r.get("vs_reference_by_task", {})
        none = "reference" if r["head"] == reference else "-"
        out.append(
            f"| {r['head']} | {paired_text(vs and vs['tau'], none)} | "
            f"{paired_text(vs and vs.get('throughput'), '-' if vs else none)} | "
            + " | ".join(paired_text(by_task.get(t), "-") if vs else "-" for t in tasks)
            + " |"
        )
    same = [r for r in rows if r.get("vs_same_size")]
    if same:
        out += [
            "",
            "Against EAGLE-3 at the same draft vocabulary size, where that is not the reference "
            f"(paired the same way): tau difference and {speed} ratio.",
            "",
            *table_head(["head", "Vd", "against", "tau - it", f"{speed} / it"]),
        ]
        for r in same:
            vs = r["vs_same_size"]
            out.append(
                f"| {r['head']} | {vocab_text(r['vocab'])} | {vs['head']} | {paired_text(vs['tau'])}"
                f" | {paired_text(vs.get('throughput'), '-')} |"
            )
    return out + [""]
