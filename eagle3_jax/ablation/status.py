"""Where a long study stands, read from its folders alone (nothing is started, locked or
written): each grid cell's training, and the records of each harness run. The study scripts'
`--status` (benchmarks/vocab_study.py, benchmarks/fusion_ablation.py) prints it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from eagle3_jax.ablation.config import AblationConfig


def _last(path: Path) -> dict:
    """The last record of a JSONL file ({} when there is none)."""
    if not path.exists():
        return {}
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    return json.loads(lines[-1]) if lines else {}


def cell_status(ac: AblationConfig, root: Path) -> list[dict]:
    """Per cell of the grid whose folders are under `root`: trained (its head exported) or the
    last logged step of its budget, its last held-out validation and its training time so far."""
    rows = []
    for cell in ac.cells:
        d = root / "cells" / cell.name
        val = _last(d / "validation.jsonl")
        state = json.loads((d / "cell.json").read_text()) if (d / "cell.json").exists() else {}
        rows.append({
            "cell": cell.name,
            "trained": (d / "head" / "config.json").exists(),
            "step": _last(d / "metrics.jsonl").get("step", 0),
            "max_steps": cell.overrides.get("max_steps", ac.base.optim.max_steps),
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


def status_lines(cells: list[dict], evals: dict[str, Path]) -> list[str]:
    """The cells' and the harness runs' standing as lines for a terminal."""
    lines = []
    for r in cells:
        if r["trained"]:
            where = "trained"
        elif r["step"]:
            where = f"training: step {r['step']} of {r['max_steps']}"
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
        lines.append(f"harness {name}: {text} (records per method)")
    return lines
