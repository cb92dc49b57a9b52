"""Where a long study stands, read from its folders alone (nothing is started, locked or
written): each grid cell's training, and the records of each harness run. The study scripts'
`--status` (benchmarks/vocab_study.py, benchmarks/fusion_ablation.py) prints it."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from eagle3_jax.ablation.config import AblationConfig
from eagle3_jax.checkpoints.atomic import holder
from eagle3_jax.evaluation.records import read_jsonl
from eagle3_jax.training.features import META, build_progress
from eagle3_jax.training.timed import log_intervals


def _last(path: Path) -> dict:
    """The last record of a JSONL file ({} when there is none)."""
    recs = read_jsonl(path)
    return recs[-1] if recs else {}


def seconds_per_step(metrics: list[dict], window: int = 20) -> float | None:
    """A run's recent pace from its last `window` logged intervals
    (`training.timed.log_intervals`; the first, which holds the start's compile, left out); None
    with fewer than two records."""
    recent = log_intervals(metrics)[1:][-window:]
    steps = sum(n for n, _ in recent)
    return sum(t for _, t in recent) / steps if steps else None


def logged_seconds(metrics: list[dict]) -> float:
    """A run's training wall time read from its log (`training.timed.log_intervals`): what a
    kill cannot lose, as a time kept by the training process itself would, nor inflate with work
    done twice."""
    return sum(t for _, t in log_intervals(metrics))


def cell_status(ac: AblationConfig, root: Path) -> list[dict]:
    """Per cell of the grid whose folders are under `root`: trained (its head exported) or the
    last logged step of its budget and the time left at its recent pace, its last held-out
    validation and its training time so far (from its log)."""
    rows = []
    for cell in ac.cells:
        d = root / "cells" / cell.name
        val = _last(d / "validation.jsonl")
        trained = (d / "head" / "config.json").exists()
        metrics = read_jsonl(d / "metrics.jsonl")
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
            "train_s": logged_seconds(metrics),
        })  # fmt: skip
    return rows


def harness_left_s(eval_dir: Path, questions: Sequence, records: list[dict]) -> float | None:
    """A harness run's time left at its pace: per method (OUT/config.json's), the user turns of
    the `questions` (`Question`s) it has not answered times its mean time a turn (decoding's and
    replay's: an MT-bench question's two turns cost about twice another's one), a method without
    records at the mean of the others' speculative methods (vanilla's when there are none); None
    before the first record or without config.json. `records`: the run's records.jsonl, read."""
    try:
        labels = [m["label"] for m in json.loads((eval_dir / "config.json").read_text())["methods"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    turns = {str(q.id): len(q.turns) for q in questions}
    spent: dict[str, list[float]] = {}  # method -> [seconds, turns]
    done: dict[str, set[str]] = {}
    for r in records:
        m, qid = r.get("method"), str(r.get("question_id"))
        t = float(r.get("wall_time_s") or 0.0) + float(r.get("replay_time_s") or 0.0)
        acc = spent.setdefault(m, [0.0, 0])
        acc[0] += t
        acc[1] += turns.get(qid, len(r.get("turns") or [None]))
        done.setdefault(m, set()).add(qid)
    pace = {m: t / n for m, (t, n) in spent.items() if m in labels and n}
    if not pace:
        return None
    spec = [t for m, t in pace.items() if m != "vanilla"] or list(pace.values())
    fill = sum(spec) / len(spec)
    return sum(
        sum(n for qid, n in turns.items() if qid not in done.get(m, ())) * pace.get(m, fill)
        for m in labels
    )


def store_line(features_dir: Path) -> str:
    """Where a grid's shared feature store stands, as a line: ready (its features.json), being
    built (`training.features.build_progress`: the batches done, of their total where the
    progress files record it), or not started."""
    if (features_dir / META).exists():
        return "feature store: ready"
    progress = build_progress(features_dir)
    if progress is None:
        return "feature store: not started"
    done, total = progress
    of = f" of {total:,}" if total is not None else ""
    return f"feature store: being built ({done:,}{of} batches done)"


def running_line(out: Path, what: str) -> str:
    """Whether the study writing `out` runs now (a process holds its lock: its pid), as a line."""
    pid = holder(out) if out.is_dir() else None
    if pid is None:
        return f"{what}: not running"
    return f"{what}: running (pid {pid})"


def status_lines(
    cells: list[dict], evals: dict[str, Path], questions: Sequence | None = None
) -> list[str]:
    """The cells' and the harness runs' standing as lines for a terminal (`questions`: the
    `Question`s each method of a harness run answers)."""
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
            t = r["train_s"]
            where += f"; {t / 3600:.1f} h" if t >= 3600 else f"; {t / 60:.0f} min"
            where += " of training"
        lines.append(f"cell {r['cell']}: {where}")
    for name, d in evals.items():
        records = read_jsonl(d / "records.jsonl")  # a record being written is left out
        counts = Counter(r["method"] for r in records)  # questions answered, per method
        text = ", ".join(f"{m} {n}" for m, n in counts.items()) if counts else "not started"
        of = f", of {len(questions)} questions" if questions else ""
        left = harness_left_s(d, questions, records) if questions else None
        pace = f"; ~{left / 3600:.1f} h left at its pace" if left else ""
        lines.append(f"harness {name}: {text} (records per method{of}{pace})")
    return lines
