"""The draft-vocabulary study's report: every head against EAGLE-3 on the same questions, per tree.

Input: one harness results.json per tree shape (the same questions for every head; the runs of
the study's groups joined by `merge_groups`), the heads' drafting times (benchmarks/draft_cost.py;
several runs put on one scale by `calibrated_costs`) and their held-out training curves. Output: a table
shaped like the SpecVocab paper's (tau per Spec-Bench task, throughput, speedup) with the paper's
figures beside it, per-question paired differences against the reference head with 95 %
intervals, drafting time per step and per round, and plots. Speed without the draft's cost is not
the paper's measure, so every row carries both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from eagle3_jax.accelerators import predict, specs
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation import metrics, paired
from eagle3_jax.evaluation.questions import task_order
from eagle3_jax.evaluation.records import read_jsonl
from eagle3_jax.evaluation.report import table_head

# The SpecVocab paper and README (H100, Spec-Bench, greedy, batch 1), as
# ../shared/reference/draft-vocab-methods.md quotes them: tau on OLMo 2 1B, tokens/s on OLMo 2 7B.
PAPER = {
    "eagle3": {"tau_olmo2_1b": 4.31, "tps_olmo2_7b": 189.3},
    "frspec": {"tps_olmo2_7b": 190.9},
    "vocabtrim": {"tps_olmo2_7b": 194.2},
    "specvocab": {"tau_olmo2_1b": 4.53, "tps_olmo2_7b": 204.7},
}
FAMILIES = ("eagle3", "frspec", "vocabtrim", "specvocab", "full", "target_lm_head")


@dataclasses.dataclass(frozen=True)
class StudyHead:
    """One head of the study: its harness draft name, the method family it stands for (one of
    FAMILIES), its draft vocabulary size (None: the target's whole vocabulary, `target_vocab`
    ids where known) and how it was made."""

    name: str
    family: str
    vocab: int | None
    note: str = ""
    target_vocab: int | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"head {self.name}: family {self.family!r} not in {FAMILIES}")


def head_of_cell(name: str, overrides: dict, vocab_size: int) -> StudyHead:
    """The study head a training cell stands for, from the overrides that define it: a
    speculator is SpecVocab, the target's output embedding is FR-Spec's source, a reduced own
    lm_head is EAGLE-3, a full own lm_head is VocabTrim's source."""
    vd = overrides.get("draft_vocab_size", vocab_size)
    if overrides.get("speculator_rank"):
        aux = overrides.get("speculator_loss_weight")
        note = "no auxiliary loss" if aux == 0 else ""
        return StudyHead(name, "specvocab", None, note, vocab_size)
    if overrides.get("lm_head_source") == "target":
        return StudyHead(name, "target_lm_head", None, "FR-Spec's source, untrimmed", vocab_size)
    if vd < vocab_size:
        return StudyHead(name, "eagle3", vd, "", vocab_size)
    return StudyHead(name, "full", None, "VocabTrim's source, untrimmed", vocab_size)


def label_of(results: dict, head: str) -> str | None:
    """The harness's method label that ran draft `head` in this run (None if it did not)."""
    for m in results["config"]["methods"]:
        if m.get("draft") == head:
            return m["label"]
    return None


def tree_of(results: dict) -> tuple:
    """The one speculative tree shape of a run (every eagle3 method shares it)."""
    shapes = {tuple(m["tree"]) for m in results["config"]["methods"] if m["kind"] == "eagle3"}
    if len(shapes) != 1:
        raise ValueError(f"a study run has one tree shape, this one has {sorted(shapes)}")
    return shapes.pop()


def _group_names(parts: Sequence, names: Sequence[str] | None) -> list[str]:
    """What a refusal calls each group run: its name, else "#i" for its index."""
    return list(names) if names is not None else [f"#{i}" for i in range(len(parts))]


def merge_groups(parts: Sequence[dict], names: Sequence[str] | None = None) -> dict:
    """One tree's results from its groups' harness runs (benchmarks/vocab_study.py runs each
    cell, with the heads cut from it, as its own run beside its own plain decoding, so that a
    finished group outlives the machine and the heads that made it): every group's heads, the
    first group's plain decoding as `vanilla`, and under `baselines` each head's own group's
    plain decoding, over which its speedup and its paired throughput are taken. The runs must
    agree on all but their heads (the same target files, questions, budget and batch); runs
    that do not are refused (Eagle3Error) naming the group (`names`: each part's, else its
    index)."""
    if not parts:
        raise ValueError("no group results to merge")
    names = _group_names(parts, names)
    # target_digest holds the target files' times, which a fresh machine's conversion changes:
    # the groups' stamps (benchmarks/vocab_study.py) hold the target's identity instead
    mine = ("target", "target_digest", "drafts", "methods", "draft_digests", "draft_vocab")
    common = [{k: v for k, v in p["config"].items() if k not in mine} for p in parts]
    for name, c in zip(names[1:], common[1:]):
        if c != common[0]:
            diff = sorted(k for k in set(c) | set(common[0]) if c.get(k) != common[0].get(k))
            raise Eagle3Error(
                f"group {name}'s run differs from group {names[0]}'s in {', '.join(diff)}: "
                "they cannot be merged (remeasure one, or move it away)"
            )
    config = {**parts[0]["config"], "methods": [], "drafts": {}, "draft_digests": {}}
    records, baselines, asked = [], {}, None
    for i, p in enumerate(parts):
        vanilla = [r for r in p["records"] if r["method"] == metrics.VANILLA]
        # every head paired on the questions of every other: each group's plain decoding and
        # heads answered the same ones (a run cut short, or from another question set, is not)
        by_method = {}
        for r in p["records"]:
            by_method.setdefault(r["method"], set()).add(str(r["question_id"]))
        mine = by_method.get(metrics.VANILLA, set())
        asked = mine if asked is None else asked
        odd = {m: q for m, q in by_method.items() if q != asked}
        if odd:
            m, q = next(iter(odd.items()))
            raise Eagle3Error(
                f"group {names[i]} ({m}) answered {len(q)} questions, not the {len(asked)} of "
                f"group {names[0]}'s plain decoding ({len(q ^ asked)} differ): they cannot be "
                "merged (remeasure one, or move it away)"
            )
        labels = {}  # a run of one head labels it without its name: named here, as in a run of many
        for m in p["config"]["methods"]:
            if m["kind"] == "vanilla":
                if i == 0:
                    config["methods"].insert(0, m)
                continue
            draft = m.get("draft")
            label = m["label"] if not draft or "@" in m["label"] else f"{m['label']}@{draft}"
            if label in baselines:
                raise Eagle3Error(f"method {label} is in two group runs (group {names[i]})")
            labels[m["label"]] = label
            config["methods"].append({**m, "label": label})
            baselines[label] = vanilla
        config["drafts"].update(p["config"].get("drafts") or {})
        config["draft_digests"].update(p["config"].get("draft_digests") or {})
        records += vanilla if i == 0 else []
        records += [
            {**r, "method": labels[r["method"]]} for r in p["records"] if r["method"] in labels
        ]
    return {"config": config, "records": records, "baselines": baselines, "runs": len(parts)}


def calibrated_costs(
    parts: Sequence[dict], calibration: str | None, names: Sequence[str] | None = None
) -> dict[str, dict]:
    """head -> benchmarks/draft_cost.py row, from several timing runs (`parts`: each a
    draft_cost.json's rows by head). Where every run also timed the `calibration` head (the
    same files each time), each run's times are scaled by that head's median time over the runs
    over its time in this run, so heads timed on different days (or machines) compare as if
    timed together; `scale` records the factors and `measured` the times as timed. A head in
    two runs is refused (Eagle3Error), naming both (`names`: each part's, else its index)."""
    names = _group_names(parts, names)
    out: dict[str, dict] = {}
    where: dict[str, str] = {}
    cal = [p.get(calibration) for p in parts] if calibration else []
    for name, p, c in zip(names, parts, cal or [None] * len(parts)):
        scale = {}
        if c is not None and all(x is not None for x in cal):
            keys = [k for k in c if k.endswith("_ms") or "_ms_" in k]
            scale = {k: float(np.median([x[k] for x in cal])) / c[k] for k in keys if c[k]}
        for head, row in p.items():
            if head == calibration:
                continue
            if head in out:  # which run's time would stand is not ours to pick
                raise Eagle3Error(
                    f"head {head} was timed in two runs (groups {where[head]} and {name}): "
                    "keep one of them"
                )
            row = dict(row)
            if scale:
                row["measured"] = {k: row[k] for k in scale if row.get(k) is not None}
                row.update({k: v * scale[k] for k, v in row["measured"].items()})
                row["scale"] = {k: round(f, 4) for k, f in scale.items()}
            out[head] = row
            where[head] = name
    return out


def round_draft_ms(cost: dict | None, tree: tuple) -> float:
    """Drafting time of one round of `tree` = (top_k, depth, nodes, ...): the round as timed
    whole (benchmarks/draft_cost.py --tree: the drafter as decoding runs it), else composed from
    the step timings (the first level drafts one row, each of the depth - 1 later levels top_k
    rows; each step timed alone pays its own dispatch). NaN without a timing."""
    if cost is None:
        return float("nan")
    if cost.get("round_ms") is not None:
        return float(cost["round_ms"])
    k, depth = int(tree[0]), int(tree[1])
    first, later = cost.get("step_ms_rows1"), cost.get(f"step_ms_rows{k}")
    if first is None or (depth > 1 and later is None):
        return float("nan")
    return first + (depth - 1) * (later or 0.0)


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


def fmt(x, digits=2, suffix="") -> str:
    """x to `digits` decimals with `suffix`; "-" for None or a non-finite x."""
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}{suffix}"


def _vocab(v: int | None, total: int | None = None) -> str:
    """A head's draft vocabulary as its table text: its size, or the target's whole one."""
    if v is not None:
        return f"{v:,}"
    return f"{total:,} (all)" if total else "all"


def paired_text(d: dict | None, none: str = "reference") -> str:
    """A `Paired.as_dict()` as its table text; `none` for None (the reference's own row)."""
    if not d:
        return none
    return paired.Paired(d["mean"], d["lo"], d["hi"], d["n"], d["ratio"]).text()


def _paper_cells(family: str) -> str:
    p = PAPER.get(family, {})
    return f"{fmt(p.get('tau_olmo2_1b'))} | {fmt(p.get('tps_olmo2_7b'), 1)}"


def paired_speed(results: dict) -> str:
    """What the paired speed column compares: "throughput" when the heads were timed in one run
    (its plain decoding cancels), "speedup" when merged from groups timed in separate runs
    (`merge_groups`: each question's throughput over its own run's plain decoding first). One
    merged group is one run."""
    return "speedup" if results.get("runs", 1) > 1 else "throughput"


def paired_n(rows: list[dict]) -> str:
    """How many questions the heads' tau is paired on, as text ("180", or "170-180" where
    heads answered different numbers; `merge_groups` refuses groups that did). "" when nothing
    is paired."""
    ns = sorted({r["vs_reference"]["tau"]["n"] for r in rows if r.get("vs_reference")})
    if not ns:
        return ""
    return f"{ns[0]}" if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"


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
            f"{_vocab(r['vocab'], r.get('target_vocab'))} | "
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
                f"| {r['head']} | {_vocab(r['vocab'])} | {vs['head']} | {paired_text(vs['tau'])}"
                f" | {paired_text(vs.get('throughput'), '-')} |"
            )
    return out + [""]


def read_curve(run: Path) -> list[dict]:
    """A training run's held-out curve: step, tokens read by then, val acc_0 and the replayed
    chain tau, from its validation.jsonl and metrics.jsonl (or metrics.jsonl.gz, as a cell's
    curve is committed; [] when it has not validated)."""
    metrics_file = run / "metrics.jsonl"
    if not metrics_file.exists() and (run / "metrics.jsonl.gz").exists():
        metrics_file = run / "metrics.jsonl.gz"
    tokens = {r["step"]: r.get("tokens") for r in read_jsonl(metrics_file)}
    return [
        {
            "step": v["step"],
            "tokens": tokens.get(v["step"]),
            "acc_0": v.get("val_acc_0"),
            "chain_tau": v.get("val_replay_tau"),
        }
        for v in read_jsonl(run / "validation.jsonl")
    ]


def cost_section(name: str, costs: dict[str, dict], heads: Sequence[StudyHead]) -> list[str]:
    """Drafting time per step of each head at one tree's row counts and per round of the tree
    (medians, ms), and which candidate gather SpecVocab's timed level took."""
    cols = sorted(
        {k for c in costs.values() for k in c if k.startswith(("step_ms_rows", "output_ms_rows"))},
        key=lambda k: (int(k.rsplit("rows", 1)[1]), k),
    )
    cols += ["round_ms"] if any("round_ms" in c for c in costs.values()) else []
    out = [
        f"## Drafting time per step at tree {name} (ms): the layer and output top-k over r rows",
        "",
        *table_head(
            ["head", "output layer"]
            + [c.replace("_ms_rows", " r").replace("round_ms", "round") for c in cols]
        ),
    ]
    notes = []
    for h in heads:
        c = costs.get(h.name)
        if c:
            out.append(
                f"| {h.name} | {c.get('kind', '-')} | "
                + " | ".join(fmt(c.get(k)) for k in cols)
                + " |"
            )
            for key, u in sorted(c.items()):
                rows = key.rsplit("rows", 1)[-1]
                if key.startswith("union_rows") and rows != "1":
                    gather = "one shared gather" if u.get("shared") else "gathered per row"
                    notes.append(
                        f"{h.name}, {rows} rows: {u['distinct']:,} distinct candidates of "
                        f"{u['capacity']:,} shared slots ({gather})"
                    )
    if notes:
        out += ["", "SpecVocab's timed level: " + "; ".join(notes) + "."]
    if any(c.get("scale") for c in costs.values()):
        out += [
            "",
            "Heads timed in different runs (one per group), each beside the same calibration "
            "head: every run's times are scaled by that head's median over the runs over its "
            "time in the run (each group's draft_cost file holds the times as measured).",
        ]
    return out + [""]


def curve_section(curves: dict[str, list[dict]]) -> list[str]:
    """Held-out acc_0 and replayed chain tau at the last validation of each head's training."""
    out = [
        "## Training: held-out validation at the end of each head's budget",
        "",
        "| head | step | tokens | acc_0 | replayed chain tau | tau 100 steps earlier |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, pts in curves.items():
        if not pts:
            continue
        last = pts[-1]
        earlier = [p for p in pts if p["step"] <= last["step"] - 100]
        prev = earlier[-1].get("chain_tau") if earlier else None
        tokens = f"{last['tokens']:,}" if last.get("tokens") else "-"
        out.append(
            f"| {name} | {last['step']} | {tokens} | {fmt(last.get('acc_0'), 3)} "
            f"| {fmt(last.get('chain_tau'))} | {fmt(prev)} |"
        )
    return out + [""]


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


def report(
    runs: dict[str, dict],
    heads: Sequence[StudyHead],
    reference: str,
    costs: dict[str, dict[str, dict]],
    curves: dict[str, list[dict]] | None = None,
    measured: Sequence[dict] = (),
) -> tuple[str, dict]:
    """The study's report.md text and its JSON summary, from one harness results.json per tree
    (`runs`: tree name -> results), the heads' drafting times at each tree's top-k (`costs`: tree
    name -> head -> benchmarks/draft_cost.py row), held-out curves (`curves`: head ->
    `read_curve`) and the heads' rounds timed on an accelerator (`measured`: round-cost
    results.json files, `measured_section`)."""
    summary = {"reference": reference, "trees": {}}
    lines = [
        "# The draft-vocabulary study",
        "",
        f"Every head against `{reference}` (EAGLE-3's reduced vocabulary) on the same questions.",
        "",
    ]
    for name, results in runs.items():
        rows = head_rows(results, heads, reference, costs.get(name, {}))
        summary["trees"][name] = {
            "tree": list(tree_of(results)),
            "paired_speed": paired_speed(results),
            "rows": rows,
        }
        lines += tree_section(name, results, rows, reference)
    for name, tree_costs in costs.items():
        lines += cost_section(name, tree_costs, heads)
    if curves:
        lines += curve_section(curves)
        summary["curves"] = {k: v[-1] for k, v in curves.items() if v}
    section, summary["accelerator_prediction"] = accelerator_section()
    lines += section
    section, timed = measured_section(measured)
    if section:
        lines += section
        summary["accelerator_measured"] = timed
    return "\n".join(lines), summary


def curve_points(curves: dict[str, list[dict]]) -> tuple[dict[str, list[dict]], str]:
    """(each curve's points with a replayed chain tau, the x key for all of them): tokens read
    where every point has them, else steps, so that one axis never mixes the two."""
    shown = {n: [p for p in pts if p.get("chain_tau") is not None] for n, pts in curves.items()}
    key = "tokens" if all(p.get("tokens") for v in shown.values() for p in v) else "step"
    return shown, key


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
