"""The heads' drafting times (benchmarks/draft_cost.py): runs put on one scale, a round's time
from its steps', and their table."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation.report import table_head
from eagle3_jax.evaluation.study.heads import StudyHead, group_names
from eagle3_jax.evaluation.study.text import fmt


def calibrated_costs(
    parts: Sequence[dict], calibration: str | None, names: Sequence[str] | None = None
) -> dict[str, dict]:
    """head -> benchmarks/draft_cost.py row, from several timing runs (`parts`: each a
    draft_cost.json's rows by head). Where every run also timed the `calibration` head (the
    same files each time), each run's times are scaled by that head's median time over the runs
    over its time in this run, so heads timed on different days (or machines) compare as if
    timed together; `scale` records the factors and `measured` the times as timed. A head in
    two runs is refused (Eagle3Error), naming both (`names`: each part's, else its index)."""
    names = group_names(parts, names)
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
