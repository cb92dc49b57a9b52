#!/usr/bin/env python
"""Where decoding time goes on the CPU: matrix products against everything else, per token.

  .venv/bin/python benchmarks/profile_round.py [--question 40] [--new 128] [--tree 2,3,4,0.3]

Answers one MT-bench question (its first turn, chat template) with plain decoding and with the
speculative engine and the shipped head, each compiled and run twice first, then once more under
the JAX profiler with XLA:CPU's per-operation trace events on (`--xla_cpu_enable_xprof_traceme`,
set here before JAX starts). Each operation's self time (its span less the operations inside it)
is summed by kind: the matrix products (XLA:CPU's `dot` thunks, Eigen, for one row; `ynn_fusion`,
YNNPACK, for several rows, which may use both cores, so operation time can exceed wall time), and
the rest by name (fusions, and the runtime's host-side events: well under 0.01 ms a token). Wall
time is the median of three untraced runs. Prints per-token milliseconds for both and writes
benchmarks/results/profile_round.json (jax writes the trace itself; nothing else to install).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"
).strip()

import jax  # noqa: E402  (after XLA_FLAGS)

from eagle3_jax import cpu_tuning  # noqa: E402
from eagle3_jax.checkpoints import load_target  # noqa: E402
from eagle3_jax.checkpoints.heads import load_head  # noqa: E402
from eagle3_jax.decoding.generate import DecodeOptions, generate_ids  # noqa: E402
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.evaluation import metrics  # noqa: E402
from eagle3_jax.evaluation.questions import load_questions  # noqa: E402
from eagle3_jax.heads import default_head  # noqa: E402
from eagle3_jax.paths import cpu_model  # noqa: E402
from eagle3_jax.prompts import encode_chat  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PRODUCTS = ("dot", "ynn_fusion")
NOT_OPS = ("$", "ThunkExecutor", "np.asarray", "SlinkyThreadPool", "end: ")


def op_self_times(trace_dir: str) -> collections.Counter:
    """Self time (µs) by operation kind (the HLO name less its number) over every trace event
    of XLA:CPU's operations in the profile under trace_dir."""
    files = glob.glob(f"{trace_dir}/plugins/profile/*/*.trace.json.gz")
    if not files:
        sys.exit(f"no *.trace.json.gz written under {trace_dir} by jax.profiler")
    with gzip.open(files[0], "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ops = sorted(
        (e for e in events if not e["name"].startswith(NOT_OPS)),
        key=lambda e: (e["tid"], e["ts"], -e["dur"]),
    )
    self_us: dict[int, float] = {}
    stack: list[dict] = []
    for e in ops:  # per thread, an event inside the previous one's span is its child
        while stack and not (
            stack[-1]["tid"] == e["tid"] and e["ts"] < stack[-1]["ts"] + stack[-1]["dur"]
        ):
            stack.pop()
        self_us[id(e)] = e["dur"]
        if stack:
            self_us[id(stack[-1])] -= e["dur"]
        stack.append(e)
    kinds: collections.Counter = collections.Counter()
    for e in ops:
        kinds[re.sub(r"\.\d+$", "", e["name"])] += self_us[id(e)]
    return kinds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--question", type=int, default=40, help="MT-bench index (40: coding)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--tree", default="2,3,4,0.3", help="top_k,depth,total[,threshold]")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/profile_round.json"))
    args = ap.parse_args()
    target = load_target(None)
    # as decode.py: this machine's few-row products, the head cut to its vocab_order.json's
    # cpu_size on a CPU
    products = cpu_tuning.policy_for()
    target = target._replace(cfg=dataclasses.replace(target.cfg, products=products))
    head = load_head(default_head(), target, draft_vocab="auto")
    question = load_questions("mt_bench")[args.question]
    ids = [encode_chat(target.tokenizer, [{"role": "user", "content": question.turns[0]}])]
    f = [float(x) for x in args.tree.split(",")]
    tree = TreeConfig(int(f[0]), int(f[1]), int(f[2]), f[3] if len(f) > 3 else 0.0)

    runs = {
        name: lambda m=m: generate_ids(target, head, ids, DecodeOptions(m, args.new, tree))
        for name, m in (("plain", "vanilla"), ("speculative", "eagle3"))
    }
    rows = {}
    for name, fn in runs.items():
        fn()  # compiles
        walls = [fn().wall_time_s for _ in range(3)]  # the wall time: untraced runs (median)
        with tempfile.TemporaryDirectory() as d:
            jax.profiler.start_trace(d)
            res = fn()
            jax.profiler.stop_trace()
            kinds = op_self_times(d)
        tokens = len(res.output_ids[0])
        products = sum(v for k, v in kinds.items() if k in PRODUCTS)
        rest = sum(v for k, v in kinds.items() if k not in PRODUCTS)
        rows[name] = {
            "tokens": tokens,
            "target_forwards": int(res.target_forwards[0]),  # plain: one pass per token
            "wall_ms_per_token": 1e3 * sorted(walls)[1] / tokens,
            "traced_wall_ms_per_token": 1e3 * res.wall_time_s / tokens,
            "products_ms_per_token": products / 1e3 / tokens,
            "rest_ms_per_token": rest / 1e3 / tokens,
            "rest_top": {
                k: round(v / 1e3 / tokens, 4)
                for k, v in sorted(
                    ((k, v) for k, v in kinds.items() if k not in PRODUCTS), key=lambda kv: -kv[1]
                )[:8]
            },
        }
    print(f"MT-bench question {args.question} ({question.category}), {args.new} new tokens")
    print("ms per generated token: wall (untraced, median of 3) and operation self time (traced;")
    print("products may run on two cores); tau as the harness counts it (prefill left out)")
    print(f"{'':12} {'wall':>7} {'products':>9} {'the rest':>9} {'tau':>5}")
    for name, r in rows.items():
        tau = metrics.tau_of(r["tokens"], r["target_forwards"], no_round=1.0)
        print(
            f"{name:12} {r['wall_ms_per_token']:7.2f} {r['products_ms_per_token']:9.2f} "
            f"{r['rest_ms_per_token']:9.2f} {tau:5.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": cpu_model(), "jax": jax.__version__}
    meta.update(question=args.question, new=args.new, tree=args.tree)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
