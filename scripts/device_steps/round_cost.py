"""The `round-cost` step: a plain decode step and a speculative round timed on the device beside
the cost model's predictions (`eagle3_jax.accelerators`) (issue 35 item 3), and the table of what came back.

`step` runs `python -m device_steps.round_timing` as a phase (a subprocess with a deadline that
keeps the whole step inside the device tool's 600 s command limit) and writes, under
OUT/round_cost/: results.json (every program's times, the predictions, the ratios, what was
skipped; rewritten after each program), report.md (`table`), round_timing.log (the subprocess's
output) and device_log.txt. This module imports no jax: the job's own process must leave the GPU's
memory to the subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from device_steps import common as c

# the trees timed, by name: EAGLE-3's reporting tree (the accelerator default, 10/8/60) and a chain
# as deep (accelerators.programs.CHAIN_TREE)
TREE_NAMES = ("10/8/60", "chain")
# the targets' shapes (accelerators.specs: the published config.json sizes; tiny is a CPU toy); the
# SpecVocab paper's are OLMo 2 1B and 7B
TARGETS = ("llama31_8b", "olmo2_7b", "olmo2_1b", "qwen3_4b", "tiny")
# the heads a round can draft with (accelerators.predict.vocab_method_heads): EAGLE-3's 32k lm_head,
# the target's output embedding over all V, SpecVocab (rank d/8, 2,048 candidates a drafted row)
HEADS = ("eagle3", "target_lm_head", "specvocab")
# what the step keeps beside the subprocess: the subprocess's own start (importing jax, starting
# the backend) comes out of its deadline; writing the table and the log after it out of the step's
START_S = 30.0
RESERVE_S = 30.0

# (flag, type, default, help): the flags round_timing takes, forwarded by `step` as they were given
FLAGS = (
    (
        "--target",
        str,
        "llama31_8b",
        f"targets timed in turn, comma separated: {', '.join(TARGETS)} (random bf16 weights; "
        "tiny: a CPU toy)",
    ),
    (
        "--head",
        str,
        "eagle3",
        f"the draft's output layers, comma separated: {', '.join(HEADS)} (each round timed "
        "with each; one target's weights shared)",
    ),
    ("--prompt", int, 1024, "prompt tokens: the cache's cursor starts there"),
    ("--new", int, 1024, "new tokens: the cache holds prompt + new (+ a round's slots)"),
    ("--batches", str, "1,8", "batch sizes, comma separated"),
    ("--trees", str, ",".join(TREE_NAMES), f"rounds timed, of {', '.join(TREE_NAMES)}"),
    ("--warmup", int, 3, "untimed calls of each program after its compilation"),
    ("--reps", int, 20, "timed calls of each program"),
    (
        "--predict-device",
        str,
        "h200",
        "accelerators.specs.DEVICES key the predictions are for (or cpu)",
    ),
)


def _batches(text: str) -> str:
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch sizes >= 1, comma separated")
    return text


def _names(known: tuple[str, ...]):
    """A type for a comma-separated list of `known` names (kept in the order given, once each)."""

    def check(text: str) -> str:
        names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
        bad = [t for t in names if t not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"{', '.join(bad) or repr(text)}: choose among {', '.join(known)}"
            )
        return ",".join(names)

    return check


def add_args(p: argparse.ArgumentParser) -> None:
    """The measurement's flags (round_timing's, and the `round-cost` step's to forward)."""
    check = {
        "--batches": _batches,
        "--trees": _names(TREE_NAMES),
        "--target": _names(TARGETS),
        "--head": _names(HEADS),
    }
    for flag, typ, default, help_ in FLAGS:
        p.add_argument(flag, type=check.get(flag, typ), default=default, help=help_)


def forward(args: argparse.Namespace) -> list[str]:
    """The flags of add_args as command-line words, with the values `args` holds."""
    out = []
    for flag, *_ in FLAGS:
        out += [flag, str(getattr(args, flag[2:].replace("-", "_")))]
    return out


# ----------------------------------------------------------------------------- the table


def _ms(v: float) -> str:
    return f"{v:.3g}" if v < 10 else f"{v:.1f}"


def table(res: dict) -> str:
    """results.json as markdown: each program measured beside its prediction (and the kernels a
    call launches, `round_timing.launches`), then a round in
    plain steps (measured and predicted) and the speedup each gives at the model's τ, then each
    other head's round against EAGLE-3's, then what was skipped and what failed."""
    lines = [
        f"# Round cost: {res.get('target')}; heads {res.get('head', 'eagle3')} "
        f"({res.get('dtype')}, random weights) on {res.get('device')}",
        "",
        f"Caches sized for {res.get('context')} tokens, the cursor at {res.get('prompt')}, the "
        f"state {res.get('state')}; warm-up calls {res.get('warmup')}, timed {res.get('reps')} "
        f"(ms: median [10th-90th percentile]); predicted: eagle3_jax.accelerators for "
        f"{res.get('predicted_for')}, one chip. jax {res.get('jax')}.",
        "",
        "| target | batch | program | head | tree | measured ms, median [p10-p90] | predicted ms "
        "| measured / predicted | kernels a call |",
        "|---|---:|---|---|---|---:|---:|---:|---:|",
    ]
    for r in res.get("rows", []):
        lines.append(
            f"| {r.get('target', res.get('target'))} | {r['batch']} | {r['program']} "
            f"| {r.get('head') or '-'} | {r['tree'] or '-'} | {_ms(r['median_ms'])} "
            f"[{_ms(r['p10_ms'])}-{_ms(r['p90_ms'])}] | {_ms(r['predicted_ms'])} "
            f"| {r['measured_over_predicted']:.2f} | {r.get('kernels', '-')} |"
        )
    if not res.get("rows"):
        lines.append("| - | - | nothing measured | | | | | | |")
    if res.get("ratios"):
        lines += [
            "",
            "A round in plain steps, and the speedup it gives at the acceptance model's τ "
            "(τ / (round / plain)); τ is EAGLE-3's model for every head, so for the other "
            "heads read the round / plain columns, not the speedups:",
            "",
            "| target | batch | head | tree | round / plain measured | predicted | τ (model) "
            "| speedup at τ, measured | predicted |",
            "|---|---:|---|---|---:|---:|---:|---:|---:|",
        ]
        for q in res["ratios"]:
            lines.append(
                f"| {q.get('target', res.get('target'))} | {q['batch']} "
                f"| {q.get('head', res.get('head'))} | {q['tree']} | {q['measured']:.2f} "
                f"| {q['predicted']:.2f} | {q['tau_model']:.2f} | {q['speedup_measured']:.2f} "
                f"| {q['speedup_predicted']:.2f} |"
            )
    if res.get("over_eagle3"):
        lines += [
            "",
            "Each other head's round against EAGLE-3's (same target, batch and tree): the τ gain "
            "a method needs to pay for its head.",
            "",
            "| target | batch | head | tree | round / EAGLE-3's measured | predicted |",
            "|---|---:|---|---|---:|---:|",
        ]
        for q in res["over_eagle3"]:
            lines.append(
                f"| {q['target']} | {q['batch']} | {q['head']} | {q['tree']} "
                f"| {q['measured']:.3f} | {q['predicted']:.3f} |"
            )
    if res.get("skipped"):
        lines += ["", "Skipped (the deadline):", ""]
        lines += [f"- {s}" for s in res["skipped"]]
    if res.get("failed"):
        lines += ["", "Failed:", ""]
        lines += [f"- {s}" for s in res["failed"]]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- the step


def step(args: argparse.Namespace) -> int:
    """Runs round_timing within --minutes and writes its table; 1 when nothing came back or the
    subprocess failed."""
    c.check_budget(args.minutes)
    out = Path(args.out or (c.ROOT / "runs")) / "round_cost"
    out.mkdir(parents=True, exist_ok=True)
    log = c.Log(out / "device_log.txt")
    log(f"round-cost start: {c.accelerator()}")
    env = c.base_env()  # jax alone: no wheel, no GGUF
    env["PYTHONPATH"] = os.pathsep.join([str(c.ROOT / "scripts"), env["PYTHONPATH"]])
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(c.DEVICE / "jax_cache"))
    timeout = log.left(args.minutes) - RESERVE_S
    cmd = [sys.executable, "-m", "device_steps.round_timing", "--out", str(out),
           "--deadline-s", f"{timeout - START_S:.0f}", *forward(args)]  # fmt: skip
    rc = c.phase(log, "round_timing", cmd, env, timeout, log_dir=out)
    results = out / "results.json"
    if not results.exists():
        log("round-cost: no results.json")
        return 1
    res = json.loads(results.read_text())
    (out / "report.md").write_text(table(res))
    log(
        f"round-cost: {len(res['rows'])} programs timed, {len(res['skipped'])} skipped, "
        f"{len(res.get('failed', []))} failed -> {out}"
    )
    return 0 if rc == 0 else 1
