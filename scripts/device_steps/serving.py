"""The `serving` step (issue 60 item 5): continuous batching measured on the accelerator, EAGLE-3
against plain rounds in one run. After the GGUF's parts (as `run`): the embedded SmolLM2 and the
shipped head, one call of at most ~9 minutes.

One phase, a subprocess with a deadline: `benchmarks/serving.py --sweep --in-process` (the
engine and scheduler `serve` runs, driven without HTTP: the device image has no fastapi, uvicorn
or openai, and the front end is not what a GPU changes) at each `--concurrency` over MT-bench's
first turns, the EAGLE-3 engine (`--tree-by-occupancy`, default measured among EAGLE-3's
reporting tree, two smaller trees and plain rounds) and the plain one side by side, each level
run twice by each, interleaved (`--repeats`), then every prompt decoded alone (batch 1) and each
greedy output checked against it. Into OUT/serving/:
serving.json (the sweep), serving.log, device_log.txt.

  python3 scripts/device_job.py serving --minutes 9 --out $OUT     (after the GGUF's parts)

`--target DIR --serve-arg=--method --serve-arg=pld` runs it on a CPU with a converted toy target
(the test's dry run).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from device_steps import common as c

SCRIPT = c.ROOT / "benchmarks" / "serving.py"
# EAGLE-3's reporting tree (the accelerator default), a 16-node tree, a chain, and plain rounds:
# per occupancy the fastest, measured (slots.MeasuredSchedule)
TREES = "auto:10/8/60,4/4/16,1/3/4,plain"


def add_args(p) -> None:
    p.add_argument("--minutes", type=float, required=True, help="this call's budget")
    p.add_argument("--out", default=None, help="default: runs/ (serving/)")
    p.add_argument("--concurrency", default="1,4,8,16,32")
    p.add_argument("--requests", type=int, default=32, help="per level (MT-bench first turns)")
    p.add_argument("--repeats", type=int, default=2,
                   help="each level run this many times by each engine, interleaved")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--tree-by-occupancy", default=TREES)
    p.add_argument("--target", default=None, help="a converted target (CPU dry runs)")
    p.add_argument("--serve-arg", action="append", default=[], help="more serve flags")
    p.add_argument("--no-install", action="store_true")


def command(args, out: Path) -> list[str]:
    serve_args = ["--slots", str(args.slots), "--max-context", str(args.max_context)]
    if args.target:
        serve_args += ["--target", args.target]
    serve_args += args.serve_arg
    return [
        sys.executable, str(SCRIPT), "--sweep", "--in-process",
        "--concurrency", *args.concurrency.split(","), "--requests", str(args.requests),
        "--repeats", str(args.repeats),
        "--max-tokens", str(args.max_tokens), "--serve-args", shlex.join(serve_args),
        "--tree-by-occupancy", args.tree_by_occupancy, "--out", str(out / "serving.json"),
    ]  # fmt: skip


def step(args) -> int:
    c.check_budget(args.minutes)
    out = Path(args.out or (c.ROOT / "runs")) / "serving"
    out.mkdir(parents=True, exist_ok=True)
    log = c.Log(out / "device_log.txt")
    log(f"serving start: {c.accelerator()}")
    env = c.env(args)
    if not args.target and not c.gguf_ready(log):
        return 1
    rc = c.phase(log, "serving", command(args, out), env, log.left(args.minutes) - 20, out)
    log(f"serving: rc {rc}; {'serving.json written' if (out / 'serving.json').exists() else ''}")
    return 0 if rc == 0 else 1
