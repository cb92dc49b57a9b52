"""How the study's tables write numbers, vocabulary sizes and paired differences."""

from __future__ import annotations

import math

from eagle3_jax.evaluation import paired


def fmt(x, digits=2, suffix="") -> str:
    """x to `digits` decimals with `suffix`; "-" for None or a non-finite x."""
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}{suffix}"


def vocab_text(v: int | None, total: int | None = None) -> str:
    """A head's draft vocabulary as its table text: its size, or the target's whole one."""
    if v is not None:
        return f"{v:,}"
    return f"{total:,} (all)" if total else "all"


def paired_text(d: dict | None, none: str = "reference") -> str:
    """A `Paired.as_dict()` as its table text; `none` for None (the reference's own row)."""
    if not d:
        return none
    return paired.Paired(d["mean"], d["lo"], d["hi"], d["n"], d["ratio"]).text()


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
