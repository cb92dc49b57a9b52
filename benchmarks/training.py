#!/usr/bin/env python
"""Training throughput and peak memory: the SmolLM2 config's step on one CPU device, and the same step
on a simulated 8-device (2 data x 4 model) mesh, each in its own process.

  .venv/bin/python benchmarks/training.py [--steps 5] [--seq 512] [--batch 4] [--config C] [--target T]

Synthetic batches (random tokens, 60 % supervised) through the real jitted train step (online target
features; the config's head, TTT and Vd, started as `train` starts it; default
configs/smollm2_135m.py: TTT 7, Vd 8192). Prints a table, writes benchmarks/results/training.json. The simulated
mesh shares the same 2 cores: its figure measures the cost of the sharded program, not a speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(args) -> dict:
    """One process's timing: the config's head started as training starts it (`training.start`),
    the real jitted step (`training.step`) over a synthetic batch."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.sharding import make_mesh
    from eagle3_jax.training.config import load_config
    from eagle3_jax.training.start import draft_config, start_params
    from eagle3_jax.training.step import batch_sharding, init_state, jit_train_step, make_optimizer
    from eagle3_jax.vocab import build_from_counts

    tc = load_config(args.config)
    tc = tc.replace(batch_size=args.batch, mesh_data=args.data, mesh_model=args.model)
    mesh = make_mesh(args.data, args.model) if args.data * args.model > 1 else None
    target = load_target(args.target or tc.corpus.target, mesh=mesh)
    cfg = target.cfg
    vocab = build_from_counts(
        np.random.default_rng(0).integers(1, 100, cfg.vocab_size), tc.head.draft_vocab_size
    )
    dcfg = draft_config(tc, cfg, vocab.draft_size)
    tx = make_optimizer(tc.optim, 1000)
    state = init_state(start_params(tc, dcfg, target, vocab, mesh), tx, mesh)
    state_sh = target_sh = None
    if mesh is not None:
        state_sh = jax.tree.map(lambda x: x.sharding, state)
        target_sh = jax.tree.map(lambda x: x.sharding, target.params)
    step = jit_train_step(cfg, dcfg, tc, tx, mesh, state_sh, target_sh)
    rng = np.random.default_rng(0)
    batch = {
        "input_ids": rng.integers(3, cfg.vocab_size, (args.batch, args.seq)).astype(np.int32),
        "loss_mask": (rng.random((args.batch, args.seq)) < 0.6).astype(np.float32),
        "attention_mask": np.ones((args.batch, args.seq), np.int32),
    }
    if mesh is not None:
        batch = jax.tree.map(lambda x: jax.device_put(x, batch_sharding(mesh)), batch)
    t2d = jnp.asarray(vocab.t2d)
    t0 = time.perf_counter()
    state, m = step(state, target.params, batch, t2d)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, m = step(state, target.params, batch, t2d)
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t0) / args.steps
    return {
        "devices": args.data * args.model,
        "mesh": f"{args.data}x{args.model}",
        "batch": args.batch,
        "seq": args.seq,
        "ttt_steps": tc.head.ttt_steps,
        "draft_vocab": tc.head.draft_vocab_size,
        "step_s": dt,
        "target_tokens_per_s": args.batch * args.seq / dt,
        "compile_s": compile_s,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "loss": float(m["loss"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--data", type=int, default=1)
    ap.add_argument("--model", type=int, default=1)
    ap.add_argument("--config", default=str(ROOT / "configs/smollm2_135m.py"))
    ap.add_argument("--target", default=None, help="default: the config's (the embedded SmolLM2)")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    rows = []
    for data, model, devices in [(1, 1, 1), (2, 4, 8)]:
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        }
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            f"--steps={args.steps}",
            f"--seq={args.seq}",
            f"--batch={args.batch}",
            f"--data={data}",
            f"--model={model}",
            f"--config={args.config}",
        ]
        if args.target:
            cmd.append(f"--target={args.target}")
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if res.returncode:
            sys.exit(res.stderr[-3000:])
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(
        f"\n{args.target or Path(args.config).name}, the config's head (Vd "
        f"{rows[0]['draft_vocab']}), TTT {rows[0]['ttt_steps']}, batch {args.batch} x {args.seq} "
        f"tokens, the config's dtypes, {args.steps} timed steps\n"
    )
    print("| mesh | step (s) | target tokens/s | compile (s) | peak RSS (GiB) | loss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mesh']} ({r['devices']} device{'s' if r['devices'] > 1 else ''}) | "
            f"{r['step_s']:.2f} | {r['target_tokens_per_s']:.0f} | {r['compile_s']:.1f} | "
            f"{r['peak_rss_gib']:.2f} | {r['loss']:.4f} |"
        )
    out = ROOT / "benchmarks/results/training.json"
    out.write_text(json.dumps({"benchmark": "training", "rows": rows}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
