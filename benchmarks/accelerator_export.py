#!/usr/bin/env python
"""Every jitted program exported for TPUs and GPUs at real sizes, and what it holds in HBM.

  .venv/bin/python benchmarks/accelerator_export.py [--targets llama31_8b,olmo2_7b,qwen3_4b]
      [--batches 1,8] [--meshes 1x8,1x1] [--programs ...] [--prompt 1024] [--new 1024] [--out F]

For each target (Llama-3.1-8B, OLMo-2-7B and Qwen3-4B shapes, bf16), batch and (data x model)
decoding mesh, `eagle3_jax.accelerators.lowering` exports the plain prefill, the speculative prefill, the
plain decode step, the speculative round (EAGLE-3's reporting tree top-k 10 / depth 8 / 60 tokens,
and a chain of depth 8) and the TTT training step (sequence length 2048, 7 steps; on 8 devices the
training config's data x model split where the batch allows) with `jax.export` for ("tpu",
"cuda"), from ShapeDtypeStructs: no weights, no compilation. The machine needs as many (simulated
CPU) devices as the largest mesh; this script asks XLA for 8 when XLA_FLAGS does not say.

Per program: GB per device of parameters (target + head), KV caches (context = prompt + new
tokens, plus a round's slots), other state and activations (a verification of the tree's nodes, a
prefill of the prompt, a TTT step without remat: counted from shapes), whether the total fits an
H100 (80 GB), H200 (141 GB), TPU v5e (16 GB) and v5p (95 GB) chip, and anything a TPU or GPU would
object to (`lowering.Report.problems`). Prints a table and writes
benchmarks/results/accelerator_export/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after XLA_FLAGS)

from eagle3_jax.accelerators import lowering, programs, specs  # noqa: E402
from eagle3_jax.decoding.tree import ACCELERATOR_TREE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _mesh(text: str) -> tuple[int, int]:
    data, model = (int(x) for x in text.lower().split("x"))
    return data, model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default=",".join(specs.REAL_TARGETS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--meshes", default="1x8,1x1")
    ap.add_argument("--programs", default=",".join(programs.PROGRAMS))
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=1024)
    ap.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/accelerator_export/results.json")
    )
    args = ap.parse_args()
    rows, failed = [], []
    head = (
        f"{'target':<11} {'program':<12} {'B':>2} {'mesh':>4} {'exp s':>5} {'params':>6} "
        f"{'kv':>6} {'state':>6} {'act':>6} {'total':>6}  H100 H200 v5e v5p  problems"
    )
    print("GB per device; activations counted from shapes", file=sys.stderr)
    print(head)
    for target in args.targets.split(","):
        for mesh in (_mesh(m) for m in args.meshes.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                setup = programs.Setup(
                    target=target, batch=batch, prompt=args.prompt, new=args.new, mesh=mesh
                )
                for program in args.programs.split(","):
                    try:
                        report, mem = lowering.run(program, setup)
                    except Exception as e:  # a program that does not lower is a result
                        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                        failed.append({"target": target, "program": program, "batch": batch,
                                       "mesh": "x".join(map(str, mesh)), "error": msg})  # fmt: skip
                        print(f"{target:<11} {program:<12} {batch:>2} FAILED {msg}")
                        continue
                    r = lowering.row(report, mem)
                    if program == "train_step":
                        r["mesh"] = "x".join(map(str, setup.train_mesh))
                    rows.append(r)
                    g = r["gb_per_device"]
                    fits = "  ".join(
                        f"{'yes' if r['fits'][d] else 'NO':>3}" for d in specs.HBM_BYTES
                    )
                    print(
                        f"{target:<11} {program:<12} {batch:>2} {r['mesh']:>4} "
                        f"{r['export_s']:>5.1f} {g['params']:>6.2f} {g['kv_cache']:>6.2f} "
                        f"{g['state']:>6.2f} {g['activations']:>6.2f} {g['total']:>6.2f}  "
                        f"{fits}  {'; '.join(r['problems']) or '-'}"
                    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "what": "jax.export of every jitted program for tpu+cuda at real sizes; GB per device",
        "jax": jax.__version__,
        "platforms": list(lowering.PLATFORMS),
        "devices_gb": {d: c / 1e9 for d, c in specs.HBM_BYTES.items()},
        "prompt": args.prompt,
        "new": args.new,
        "tree": ACCELERATOR_TREE.__dict__,
        "chain": programs.CHAIN_TREE.__dict__,
        "train": {"seq_len": programs.Setup().train_len, "ttt_steps": programs.Setup().ttt_steps},
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
        "failed": failed,
    }
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out} ({len(rows)} programs, {len(failed)} failed)", file=sys.stderr)


if __name__ == "__main__":
    main()
