"""Training within a wall-clock budget: fit max_steps to the minutes a machine is lent for.

  python -m eagle3_jax train-timed --config=configs/smollm2_135m_gpu.py --minutes=5

A short calibration run (its own out_dir, `<out_dir>_calibration`) measures the seconds per step
after compilation; the real run then gets max_steps = min(epochs x steps per epoch,
remaining budget / seconds per step x safety), so its learning-rate schedule decays to zero inside
the budget instead of being cut off mid-way. The calibration does not validate (its head is thrown
away); the real run's validations (`val_data`) fall within the safety margin, not the plan. The
chosen max_steps is written to
`<out_dir>/timed.json`: rerunning train.py with `--config.max_steps=N` reproduces the run on any
machine. The calibration run's dataset.npz and vocab.npz are reused (the data is prepared once),
but the real run compiles its train step again: the learning-rate schedule, fitted to the new
max_steps, is part of the program (the persistent compilation cache, `eagle3_jax.compile_cache`,
serves what does not change, such as the validation's loss). Other `--config.FIELD=VALUE`
overrides apply to both runs.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation.records import read_jsonl


def seconds_per_step(metrics_path: Path) -> float:
    """Seconds per step: the median over the logged intervals (`log_intervals`) after the first
    (which pays compilation). The median, not the mean: with length buckets another shape can
    first appear mid-calibration, and its compilation would otherwise count as step time (one
    16 s compile in 40 steps of 0.08 s would plan a sixth of the steps)."""
    recs = read_jsonl(metrics_path)
    if len(recs) < 2:
        raise Eagle3Error(
            f"{metrics_path} holds {len(recs)} logged steps: the calibration needs 2 or more "
            "(raise --calibrate-steps or lower log_every)"
        )
    return statistics.median(t / n for n, t in log_intervals(recs)[1:])


def log_intervals(metrics: list[dict]) -> list[tuple[int, float]]:
    """(steps, seconds) of each logged interval of a run: a metrics.jsonl record's interval_steps
    and interval_s (the steps and wall time since the previous record of its process, held-out
    validation, checkpoint and a resume's compile included). A record written before those
    fields existed gives its tokens since the record before over its tokens_per_s, which
    overstates a resume's first interval when the resume fell between two logged steps. A resumed
    run's log keeps the records up to the resume, so these are the kept trajectory's intervals;
    the work a stop threw away (after its last checkpoint) is not among them."""
    out, prev = [], {"step": 0, "tokens": 0}
    for r in metrics:
        if "interval_s" in r and "interval_steps" in r:
            if r["interval_steps"] > 0:
                out.append((r["interval_steps"], r["interval_s"]))
        elif r.get("tokens_per_s") and "tokens" in r and r.get("step", 0) > prev["step"]:
            out.append(
                (r["step"] - prev["step"], (r["tokens"] - prev["tokens"]) / r["tokens_per_s"])
            )
        else:
            continue
        prev = r
    return out


def plan_steps(budget_s: float, sec_per_step: float, cap: int, safety: float = 0.9) -> int:
    """Steps that fit `budget_s` at `sec_per_step` (times `safety`), at most `cap`, at least 1."""
    if sec_per_step <= 0:
        raise Eagle3Error(f"seconds per step {sec_per_step} <= 0: the calibration failed")
    return max(1, min(cap, int(budget_s * safety / sec_per_step)))
