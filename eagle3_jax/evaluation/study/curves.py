"""The heads' held-out training curves: read from a run, their table, and the points a plot
shows."""

from __future__ import annotations

from pathlib import Path

from eagle3_jax.evaluation.records import read_jsonl
from eagle3_jax.evaluation.study.text import fmt


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


def curve_points(curves: dict[str, list[dict]]) -> tuple[dict[str, list[dict]], str]:
    """(each curve's points with a replayed chain tau, the x key for all of them): tokens read
    where every point has them, else steps, so that one axis never mixes the two."""
    shown = {n: [p for p in pts if p.get("chain_tau") is not None] for n, pts in curves.items()}
    key = "tokens" if all(p.get("tokens") for v in shown.values() for p in v) else "step"
    return shown, key
