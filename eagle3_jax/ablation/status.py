"""Where a long study stands, read from its folders alone (nothing is started, locked or
written): each grid cell's training, and the records of each harness run. The study scripts'
`--status` (benchmarks/vocab_study.py, benchmarks/fusion_ablation.py) prints it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from eagle3_jax.ablation.config import AblationConfig


def _records(path: Path) -> list[dict]:
    """A JSONL file's records ([] when there is none; a line cut short is left out)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _last(path: Path) -> dict:
    """The last record of a JSONL file ({} when there is none)."""
    recs = _records(path)
    return recs[-1] if recs else {}


def seconds_per_step(metrics: list[dict], window: int = 20) -> float | None:
    """A run's recent pace from its last `window` metrics.jsonl intervals: each record's tokens
    since the one before over its tokens_per_s is the interval's time (held-out validations and
    a resume's compile fall inside the intervals after them); None with fewer than two records."""
    recs = [r for r in metrics if "tokens_per_s" in r and "tokens" in r][-(window + 1) :]
    pairs = [(a, b) for a, b in zip(recs, recs[1:]) if b["step"] > a["step"]]
    secs = sum(
        (b["tokens"] - a["tokens"]) / b["tokens_per_s"] for a, b in pairs if b["tokens_per_s"]
    )
    steps = sum(b["step"] - a["step"] for a, b in pairs)
    return secs / steps if steps else None


def cell_status(ac: AblationConfig, root: Path) -> list[dict]:
    """Per cell of the grid whose folders are under `root`: trained (its head exported) or the
    last logged step of its budget and the time left at its recent pace, its last held-out
    validation and its training time so far."""
    rows = []
    for cell in ac.cells:
        d = root / "cells" / cell.name
        val = _last(d / "validation.jsonl")
        state = json.loads((d / "cell.json").read_text()) if (d / "cell.json").exists() else {}
        trained = (d / "head" / "config.json").exists()
        metrics = _records(d / "metrics.jsonl")
        step = metrics[-1].get("step", 0) if metrics else 0
        max_steps = cell.overrides.get("max_steps", ac.base.optim.max_steps)
        pace = None if trained else seconds_per_step(metrics)
        rows.append({
            "cell": cell.name,
            "trained": trained,
            "step": step,
            "max_steps": max_steps,
            "left_s": None if pace is None or not max_steps else pace * (max_steps - step),
            "val_step": val.get("step"),
            "acc_0": val.get("val_acc_0"),
            "chain_tau": val.get("val_replay_tau"),
            "train_s": state.get("train_wall_s"),
        })  # fmt: skip
    return rows


def records_by_method(eval_dir: Path) -> dict[str, int]:
    """How many questions (records) a harness run has written per method."""
    path = eval_dir / "records.jsonl"
    if not path.exists():
        return {}
    return dict(
        Counter(json.loads(x)["method"] for x in path.read_text().splitlines() if x.strip())
    )


def status_lines(
    cells: list[dict], evals: dict[str, Path], planned: int | None = None
) -> list[str]:
    """The cells' and the harness runs' standing as lines for a terminal (`planned`: the
    questions each method of a harness run answers)."""
    lines = []
    for r in cells:
        if r["trained"]:
            where = "trained"
        elif r["step"]:
            where = f"training: step {r['step']} of {r['max_steps']}"
            if r.get("left_s") is not None:
                where += f" (~{r['left_s'] / 3600:.1f} h left at its recent pace)"
        else:
            where = "not started"
        if r["val_step"] is not None:
            where += (
                f"; held-out at step {r['val_step']}: acc_0 {r['acc_0']:.3f}, "
                f"replayed chain tau {r['chain_tau']:.2f}"
            )
        if r["train_s"]:
            where += f"; {r['train_s'] / 3600:.1f} h of training"
        lines.append(f"cell {r['cell']}: {where}")
    for name, d in evals.items():
        counts = records_by_method(d)
        text = ", ".join(f"{m} {n}" for m, n in counts.items()) if counts else "not started"
        of = f", of {planned} questions" if planned else ""
        lines.append(f"harness {name}: {text} (records per method{of})")
    return lines
