"""One prepared job for a lent accelerator: the next data step of the shipped SmolLM2 head.

The `device` tool (../.library/device) sends the working tree, at most 64 MiB with what `carry`
names, to a machine that reaches nothing else: no PyPI, so neither the default target's wheel nor
the `gguf` package nor the ShareGPT wheel. The GGUF (98 MB) travels in parts, one call each, every
part as large as what the working tree leaves a call (`part_size`; the tree is 45.6 MiB with the
shipped head, so six parts, seven at most as results are added), the conversations in a call of
their own; the machine keeps ignored files between calls while it is warm (30 s idle), and `run`
joins the parts and checks their sha256.

Here, once (writes .device/, ignored by git):
  python scripts/device_job.py pack
On the device, with the `run` tool, back to back (the calls `pack` prints):
  carry [".device/conv", ".device/whl"]  python3 scripts/device_job.py check   (installs gguf,
                                          imports what the job imports, names the GPU)
  carry [".device/p0"]                   python3 scripts/device_job.py check
  ...
  carry [".device/p5", ".device/whl"]    python3 scripts/device_job.py run --minutes M --out $OUT
  (M: at most 9, and at most the device time left less ~1.5 minutes: a command the tool cuts
  off at its limit returns nothing it had not yet packed)
  then, if ~4 minutes are left, in the same lease (timeout_s 300; fetch run's files first where
  they are not fetched for you: the tool returns only the latest command's):
  python3 scripts/device_job.py bench --minutes 3.5 --out $OUT   (the shipped head's trees timed)
Here again, on the files that came back (bench's into a folder of their own: --dest):
  python scripts/device_job.py unpack FILES_AT        # -> runs/device_result/

`run`: joins the GGUF; answers every user turn of the conversations in context (those whose
first turn is one of data/smollm2_135m_regenerated_heldout.jsonl.gz's 270 are left out by `pack`)
(`eagle3_jax.data.regenerate --all-turns`, which converts the target from the GGUF on its first
load) within `--regen-minutes`, and packs those answers into $OUT at once; grows the shipped
head's draft vocabulary to `--extend-vocab` ids if it has fewer (`python -m eagle3_jax vocab extend`, with the
counts `pack` made of the first-turn answers; the shipped head has 16,384, so
this step is skipped) and continues it on the answers plus the first-turn files for the
rest of the budget
(`eagle3_jax.training.timed`, configs/smollm2_135m_turns.py); packs the answers, the head (split
to fit) and the logs into $OUT: at most 8 files of at most 15 MiB. Each phase is a subprocess
with its own deadline. The answers are resumable by conversation: a second `run` in the same
lease (the machine still warm) continues them; in a later lease, carry runs/turns/ back.

`round-cost` (no carry, no GGUF): a plain decode step and a speculative round at Llama-3.1-8B's
shape, random bf16 weights made on the device, batch 1 and 8, each timed beside
the cost model's prediction (device_steps/round_timing.py); into $OUT/round_cost/:
  python3 scripts/device_job.py round-cost --minutes 8 --out $OUT   (timeout_s 600)

`gpu-speed` (no carry, no GGUF): measure before changing (device_steps/gpu_speed.py): kernels per
target layer of the plain step and the rounds at Llama-3.1-8B's shape, a jax.profiler trace of 10
plain steps and 3 rounds with XLA's command buffers off and on, and a sweep of the programs at
Llama-3.1-8B, OLMo-2-7B and OLMo-2-1B shapes, batch 1 to 64, each timed without host overhead
beside the cost model; into $OUT/gpu_speed/ (summary.json, report.md):
  python3 scripts/device_job.py gpu-speed --minutes 8 --out $OUT   (timeout_s 600)

`peers` (no carry, no GGUF): our plain greedy decoding beside transformers' on the same chip
(device_steps/peers.py): the engine as decoding runs it on a GPU and transformers' model of the
family with a static cache and torch.compile (mode reduce-overhead), random bf16 weights at
Llama-3.1-8B's shape, batch 1 then 8, tokens/s of each and the ratio ours / theirs; where the
machine has no torch with CUDA it says so ("available": false) and times ours alone; into
$OUT/peers/ (summary.json, report.md):
  python3 scripts/device_job.py peers --minutes 6 --out $OUT   (timeout_s 420)

`vocab-study` (after the GGUF's parts, as `run`): the draft-vocabulary study
(benchmarks/vocab_study.py, the SmolLM2 grid) on the accelerator, resumable across calls while
the machine is warm; what is finished goes into $OUT/vocab_study.tar.gz after every call:
  python3 scripts/device_job.py vocab-study --minutes 9 --out $OUT   (again to continue)

`fusion-ablation` (after the GGUF's parts, as `run`): the trained fusion ablation (issue 62:
benchmarks/fusion_ablation_trained.py, five cells at ~20M tokens, each measured at four budgets):
first every turn of the carried conversations answered (resumable; the answers into
$OUT/turns/ in parts once they grow), then the cells trained on the device and replayed, the
same way; $OUT/fusion_ablation_trained.tar.gz after every call:
  python3 scripts/device_job.py fusion-ablation --minutes 9 --out $OUT   (again to continue)

`serving` (after the GGUF's parts, as `run`): continuous batching on the accelerator, EAGLE-3
against plain rounds in one run (device_steps/serving.py: benchmarks/serving.py --sweep
--in-process, 16 slots, 1-32 clients, every greedy output checked against decoding alone); into
$OUT/serving/:
  python3 scripts/device_job.py serving --minutes 9 --out $OUT

This file parses the command line; the steps live in device_steps/: common.py (paths, the log,
phases and their environment), transfer.py (pack, check, unpack), turns.py (run, bench),
round_cost.py and round_timing.py, gpu_speed.py, peers.py, study.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # device_steps, however this is loaded

from device_steps import common as c
from device_steps import gpu_speed, peers, round_cost, serving, study, transfer, turns


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack", help="here: the GGUF in parts + the gguf wheel under .device/")
    pk.add_argument(
        "--part-mib", type=float, default=None, help="default: the largest that fits a call"
    )
    pk.add_argument(
        "--shipped-conversations",
        action="store_true",
        help="do not select the full ShareGPT V3 (the job answers the shipped 3,814)",
    )
    sub.add_parser("check", help="device: which parts are there")
    r = sub.add_parser("run", help="device: join, regenerate every turn, train, pack")
    r.add_argument("--minutes", type=float, required=True, help="the whole job's budget")
    r.add_argument("--regen-minutes", type=float, default=4.0)
    r.add_argument("--reserve-s", type=float, default=40.0, help="kept for packing")
    r.add_argument("--out", default=os.environ.get("OUT"))
    r.add_argument("--target", default=None, help="a converted target (CPU dry runs)")
    r.add_argument(
        "--conversations",
        default=None,
        help="default: the full selection `pack` made if carried, else the shipped 3,814",
    )
    r.add_argument("--config", default=str(c.CONFIG))
    r.add_argument("--batch-size", type=int, default=512)
    r.add_argument("--chunk", type=int, default=512)
    r.add_argument(
        "--max-batch-tokens", type=int, default=262144, help="rows x (context + answer) a batch"
    )
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--limit", type=int, default=0, help="first N conversations (dry runs)")
    r.add_argument("--buckets", default="256,512", help="regeneration shape buckets")
    r.add_argument("--unrolled", action="store_true", help="regenerate with unrolled layers")
    r.add_argument(
        "--extend-vocab", type=int, default=16384,
        help="grow the head's draft vocabulary to this many ids before training (0: keep it)",
    )  # fmt: skip
    r.add_argument("--no-train", action="store_true")
    r.add_argument("--no-install", action="store_true")
    r.add_argument(
        "--train-arg", action="append", default=[], help="passed to timed.py (repeatable)"
    )
    b = sub.add_parser("bench", help="device: the shipped head's trees timed on MT-bench")
    b.add_argument("--minutes", type=float, default=4.0, help="the bench's whole budget")
    b.add_argument("--out", default=os.environ.get("OUT"))
    b.add_argument("--target", default=None, help="a converted target (CPU dry runs)")
    b.add_argument("--draft", default=None, help="default: the shipped head")
    b.add_argument("--methods", default=c.BENCH_METHODS)
    b.add_argument("--questions", type=int, default=1, help="per MT-bench category")
    b.add_argument(
        "--max-new-tokens", type=int, default=64, help="per turn (64: compiles leave time)"
    )
    b.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="default: the backend's (bfloat16 on a GPU); float32 checks exactness",
    )
    b.add_argument("--no-install", action="store_true")
    u = sub.add_parser("unpack", help="here: the files that came back -> runs/device_result/")
    u.add_argument("files_at")
    u.add_argument("--dest", default=str(c.ROOT / "runs" / "device_result"))
    rc = sub.add_parser(
        "round-cost", help="device: a plain step and a round timed beside the cost model's"
    )
    round_cost.add_args(rc)
    rc.add_argument("--minutes", type=float, default=8.0, help="the step's whole budget")
    rc.add_argument("--out", default=os.environ.get("OUT"), help="default: runs/ (round_cost/)")
    gs = sub.add_parser(
        "gpu-speed", help="device: kernels per layer, traces (command buffers off/on), a sweep"
    )
    gpu_speed.add_args(gs, step=True)
    pe = sub.add_parser(
        "peers", help="device: our plain decoding beside transformers' (static cache, compiled)"
    )
    peers.add_args(pe, step=True)
    vs = sub.add_parser("vocab-study", help="device: the draft-vocabulary study, resumable")
    study.add_args(vs, study.STUDIES["vocab-study"])
    fa = sub.add_parser("fusion-ablation", help="device: the fusion ablation, resumable")
    study.add_args(fa, study.STUDIES["fusion-ablation"])
    sv = sub.add_parser("serving", help="device: continuous batching, EAGLE-3 vs plain rounds")
    serving.add_args(sv)
    args = p.parse_args(argv)
    cmds = {
        "pack": transfer.pack,
        "check": transfer.check,
        "run": turns.run,
        "bench": turns.bench,
        "unpack": transfer.unpack,
        "round-cost": round_cost.step,
        "gpu-speed": gpu_speed.step,
        "peers": peers.step,
        "vocab-study": study.step,
        "fusion-ablation": study.step,
        "serving": serving.step,
    }
    return cmds[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
