#!/usr/bin/env python
"""A few-row product kernel for the CPU against XLA:CPU's products, in the whole target forward.

  .venv/bin/python benchmarks/cpu_rows_kernel.py [--sizes 1,2,3,4,6,8] [--reps 20]
      [--questions 0,10,40,60] [--tree 2,3,4,0.3] [--out F]

XLA:CPU multiplies one row by a weight matrix as a matrix-vector product and 2-8 rows with its
GEMM (YNNPACK), which on some CPUs costs far more than one row though the weights are read once
either way: on a 2-core Intel Xeon (Sapphire Rapids) VM the SmolLM2 forward over 4 tokens costs
~1.5x one token (`verify_cost.py`), and that is a tree verification's price. `cpu_rows_kernel.cc`
(an XLA FFI custom call, compiled here with g++ -O3 -march=native against jax's FFI headers) reads
each weight matrix once for all M <= 8 rows from a panel-packed copy ([N/64, K, 64]) and splits the
panels over XLA's intra-op threads; every output is one fp32 multiply-add chain over K in order,
so a row's products are bitwise the same whatever M is (a decode step and a verification would
compute identical products). This script builds it, checks it (every M against XLA's product,
and row 0 bitwise against M = 1), then times the embedded SmolLM2's whole target forward (T new
tokens against a 320-token cache, logits for all: as `verify_cost.py`) with the decoder layers'
seven products each way, the two programs alternating rep by rep; then answers MT-bench first
turns end to end (plain decoding and `decode.py`'s CPU default with the shipped head, each with
both kinds of product, alternating; outputs compared). The engine does not use the kernel
(BENCHMARKS.md, "What a round costs": what it would buy). Prints two tables and writes
benchmarks/results/cpu_rows_kernel.json.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax import cpu_tuning
from eagle3_jax.checkpoints import load_target
from eagle3_jax.config import PLAIN_PRODUCTS
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.models import layers
from eagle3_jax.models import target as tgt
from eagle3_jax.paths import cpu_model

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "benchmarks" / "cpu_rows_kernel.cc"
PANEL = 64
LAYER_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def build(out_dir: Path) -> Path:
    """Compiles the kernel into out_dir; exits with the compiler's message if it cannot."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        sys.exit("cpu_rows_kernel: no C++ compiler (g++ or c++) on PATH")
    lib = out_dir / "cpu_rows_kernel.so"
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w"]
    cmd += ["-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(lib)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"cpu_rows_kernel: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return lib


def register(lib: Path) -> None:
    handle = ctypes.cdll.LoadLibrary(str(lib))
    jax.ffi.register_ffi_target(
        "eagle3_cpu_rows", jax.ffi.pycapsule(handle.Eagle3CpuRows), platform="cpu"
    )


def pack(w: np.ndarray) -> jax.Array:
    """W [K, N] -> panels [ceil(N/64), K, 64], the last one zero-padded."""
    k, n = w.shape
    p = -(-n // PANEL)
    w = np.pad(np.asarray(w, np.float32), ((0, 0), (0, p * PANEL - n)))
    return jnp.asarray(np.ascontiguousarray(w.reshape(k, p, PANEL).transpose(1, 0, 2)))


def rows_product(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """x[..., K] (at most 8 rows) . W[K, n] from W's panels, by the kernel."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    out = jax.ffi.ffi_call("eagle3_cpu_rows", jax.ShapeDtypeStruct((flat.shape[0], n), jnp.float32))
    return out(flat, panels, n=np.int64(n)).reshape(*lead, n)


def check(rng: np.random.Generator) -> dict:
    """The kernel against XLA's product for M = 1..8 on odd sizes (a partial last panel)."""
    w = rng.standard_normal((200, 300), dtype=np.float32)
    x = jnp.asarray(rng.standard_normal((8, 200), dtype=np.float32))
    panels = pack(w)
    alone = np.asarray(rows_product(x[:1], panels, 300))
    worst, bitwise = 0.0, True
    for m in range(1, 9):
        got = np.asarray(rows_product(x[:m], panels, 300))
        want = np.asarray(jnp.matmul(x[:m], w, precision=jax.lax.Precision.HIGHEST))
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
        bitwise &= bool(np.array_equal(got[0], alone[0]))
    if worst > 1e-5 or not bitwise:
        sys.exit(f"cpu_rows_kernel: wrong results (relative error {worst:.1e}, bitwise {bitwise})")
    return {"max_relative_error": worst, "row_bitwise_across_m": bitwise}


def end_to_end(target, packed, args) -> list[dict]:
    """Each question answered by plain decoding and by the speculative engine with the shipped
    head, each with the target's products by XLA and by the kernel: compiled, then `reps` (at
    most 3) alternating timed runs; medians. `dense` is patched by the caller."""
    from eagle3_jax.checkpoints.heads import load_head
    from eagle3_jax.decoding.generate import DecodeOptions, generate_ids
    from eagle3_jax.evaluation.questions import load_questions
    from eagle3_jax.heads import default_head
    from eagle3_jax.prompts import encode_chat

    head = load_head(default_head(), target, draft_vocab="auto")
    f = [float(x) for x in args.tree.split(",")]
    tree = TreeConfig(int(f[0]), int(f[1]), int(f[2]), f[3] if len(f) > 3 else 0.0)
    plain_opts, spec_opts = (DecodeOptions(m, args.new, tree) for m in ("vanilla", "eagle3"))
    questions = load_questions("mt_bench")
    print(f"\nMT-bench first turns, {args.new} new tokens, tree {args.tree}; ms per token")
    print(
        f"{'q':>3} {'plain XLA':>10} {'plain kernel':>13} {'spec XLA':>9} {'spec kernel':>12} "
        f"{'speedup XLA':>12} {'speedup kernel':>15} {'identical':>10}"
    )
    answers = []
    for q in [int(i) for i in args.questions.split(",")]:
        ids = [encode_chat(target.tokenizer, [{"role": "user", "content": questions[q].turns[0]}])]
        runs = {}
        for name, p in (("xla", target.params), ("kernel", packed)):
            t = target._replace(params=p)
            runs[f"plain_{name}"] = lambda t=t: generate_ids(t, None, ids, plain_opts)
            runs[f"spec_{name}"] = lambda t=t: generate_ids(t, head, ids, spec_opts)
        first = {k: fn() for k, fn in runs.items()}  # compiles
        outs = {k: list(r.output_ids[0]) for k, r in first.items()}
        walls: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(min(args.reps, 3)):
            for k, fn in runs.items():
                walls[k].append(fn().wall_time_s)
        n = len(outs["plain_xla"])
        ms = {k: 1e3 * float(np.median(v)) / n for k, v in walls.items()}
        row = {
            "question": q,
            "tokens": n,
            "identical": all(o == outs["plain_xla"] for o in outs.values()),
            "target_forwards": {
                k: int(first[k].target_forwards[0]) for k in ("spec_xla", "spec_kernel")
            },
            **{f"{k}_ms_per_token": v for k, v in ms.items()},
            "speedup_xla": ms["plain_xla"] / ms["spec_xla"],
            "speedup_kernel": ms["plain_kernel"] / ms["spec_kernel"],
        }
        answers.append(row)
        print(
            f"{q:>3} {ms['plain_xla']:10.1f} {ms['plain_kernel']:13.1f} {ms['spec_xla']:9.1f} "
            f"{ms['spec_kernel']:12.1f} {row['speedup_xla']:11.2f}x {row['speedup_kernel']:14.2f}x "
            f"{str(row['identical']):>10}",
            flush=True,
        )
    return answers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--slots", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sizes", default="1,2,3,4,6,8", help="comma list of T (at most 8)")
    ap.add_argument(
        "--questions",
        default="0,10,40,60",
        help="MT-bench indices (first turns) answered end to "
        "end, plain and speculative, each with XLA's products and the kernel ('' skips)",
    )
    ap.add_argument("--tree", default="2,3,4,0.3", help="top_k,depth,total[,threshold]")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/cpu_rows_kernel.json"))
    args = ap.parse_args()
    if jax.default_backend() != "cpu":
        sys.exit("cpu_rows_kernel: a CPU benchmark (run with JAX_PLATFORMS=cpu)")
    sizes = sorted({int(s) for s in args.sizes.split(",")} | {1})
    if sizes[-1] > 8:
        sys.exit("cpu_rows_kernel: the kernel takes at most 8 rows")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        register(build(Path(d)))  # loaded now; the file may go
    checked = check(rng)

    target = load_target(args.target)
    # XLA's side as decode.py runs it: this machine's few-row products (cpu_tuning)
    products = cpu_tuning.policy_for()
    target = target._replace(cfg=dataclasses.replace(target.cfg, products=products))
    cfg = target.cfg
    if not isinstance(target.params["layers"], list):
        sys.exit("cpu_rows_kernel: expects unrolled (list) layers, as load_target gives")
    widths = {name: target.params["layers"][0][name].shape[1] for name in LAYER_WEIGHTS}
    packed = {
        **target.params,
        "layers": [
            {**lp, **{n: pack(np.asarray(lp[n])) for n in LAYER_WEIGHTS}}
            for lp in target.params["layers"]
        ],
    }
    panels_of = {-(-w // PANEL): w for w in widths.values()}
    if len(panels_of) != len(set(widths.values())):
        sys.exit(
            "cpu_rows_kernel: two layer widths share a panel count; the benchmark needs them apart"
        )

    xla_dense = layers.dense

    def any_dense(x, w, out_dtype=None, *, policy=PLAIN_PRODUCTS):
        """The packed weights ([panels, K, 64]) through the kernel (<= 8 rows) or XLA's product
        on the panels (more: a prefill); the rest (the draft's, unpacked) as the engine does."""
        if w.ndim != 3:
            return xla_dense(x, w, out_dtype, policy=policy)
        n = panels_of[w.shape[0]]
        if int(np.prod(x.shape[:-1])) <= 8:
            return rows_product(x, w, n)
        return jnp.einsum("...k,pkc->...pc", x, w).reshape(*x.shape[:-1], -1)[..., :n]

    # target.py and layers.py (swiglu) look `dense` up when tracing: unpacked params trace as before
    tgt.dense = layers.dense = any_dense

    @jax.jit
    def step(params, tokens, cache, start):
        t = tokens.shape[1]
        pos = start[:, None] + jnp.arange(t)[None, :]
        mask = jnp.arange(args.slots)[None, None, :] <= pos[:, :, None]
        return tgt.forward(params, tokens, pos, mask, cfg, cache, start)

    ways = {"xla": target.params, "kernel": packed}
    cache = tgt.make_cache(cfg, 1, args.slots)
    start = jnp.full((1,), args.context, jnp.int32)
    rows = []
    for t in sizes:
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, t)), jnp.int32)
        outs = {k: step(p, tokens, cache, start).logits for k, p in ways.items()}
        gap = float(jnp.abs(outs["xla"] - outs["kernel"]).max())
        # the two programs in turn, rep by rep (the product probes' timing loop)
        fns = {k: functools.partial(step, p) for k, p in ways.items()}
        ms = cpu_tuning.median_ms_alternating(fns, tokens, cache, start, reps=args.reps)
        rows.append({"tokens": t, **{f"{k}_ms": v for k, v in ms.items()}, "max_logit_gap": gap})
    unit = {k: rows[0][f"{k}_ms"] for k in ways}
    print(f"target forward over T new tokens, context {args.context}, fp32, batch 1")
    head = f"{'T':>3} {'XLA ms':>8} {'/ T=1':>6} {'kernel ms':>10} {'/ T=1':>6} {'kernel/XLA':>11}"
    print(f"{head} {'logit gap':>10}")
    for r in rows:
        r["xla_relative"] = r["xla_ms"] / unit["xla"]
        r["kernel_relative"] = r["kernel_ms"] / unit["kernel"]
        print(
            f"{r['tokens']:>3} {r['xla_ms']:8.1f} {r['xla_relative']:6.2f} {r['kernel_ms']:10.1f} "
            f"{r['kernel_relative']:6.2f} {r['kernel_ms'] / r['xla_ms']:11.2f} {r['max_logit_gap']:10.1e}"
        )
    answers = end_to_end(target, packed, args) if args.questions else []
    tgt.dense = layers.dense = xla_dense
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": cpu_model(),
        "cpus": jax.local_device_count(),
        "jax": jax.__version__,
        "context": args.context,
        "reps": args.reps,
        "check": checked,
        "questions": args.questions,
        "tree": args.tree,
        "new": args.new,
    }
    result = {"meta": meta, "rows": rows, "answers": answers}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
