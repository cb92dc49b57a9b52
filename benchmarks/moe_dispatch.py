#!/usr/bin/env python
"""What a routed (mixture-of-experts) layer costs under each dispatch, by the tokens a forward runs.

  .venv/bin/python benchmarks/moe_dispatch.py [--target qwen3_30b_a3b] [--experts 64 --hidden 1024
      --ffn 512] [--dtype float32] [--tokens 1,2,4,8,60,512] [--layers 4] [--reps 7] [--out F]

Times the routed MLPs alone (router, experts, combine: `models.target._moe`) of `--layers` layers
with random weights, one jitted program per (dispatch, tokens), the layers scanned and the MLP's
output added to its input, as a decode step (1 token), a short chain, a tree verification (60)
and a prefill run them. The dispatches (`models.target.MOE_DISPATCHES`, `moe_path` says which
computation each runs at a token count):

- `dense`: every expert on every token (reads all E experts, E / k times the routed FLOPs);
- `gather`: the chosen experts' matrices gathered for a small forward (n k at most
  `moe_gather_pairs` x E, as decoding sets it on this backend: `backends.MOE_GATHER_PAIRS`),
  else dense;
- `ragged`: the same gather, larger forwards sorted by expert through `jax.lax.ragged_dot`;
- `gather_forced`: the gathered path at every token count up to n k = 2 E, to show where
  gathering stops paying (what `moe_gather_pairs` should be on the machine).

Prints ms a layer (median of `--reps` calls, each waited for), each dispatch's ratio to dense,
the experts a forward touches in expectation (uniform routing) and XLA's own count of the bytes the
program accesses; checks each dispatch's output against dense's (max |difference|). A dispatch
whose path at a token count is one measured already (gather's larger forwards are dense's) is
not compiled again: its row says `same_program_as`. The CPU's
`ragged_dot` is lowered as a dense product over every group (jax's fallback), so `ragged` is only
meaningful on a GPU or TPU; the device's gpu-speed step runs this at Qwen3-30B-A3B's layer shape
(`scripts/device_steps/gpu_speed.py`, phase moe). Writes benchmarks/results/moe_dispatch.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax import backends
from eagle3_jax.accelerators.experts import expected_touched
from eagle3_jax.accelerators.specs import target_config
from eagle3_jax.config import TargetConfig
from eagle3_jax.models import target as tgt

ROOT = Path(__file__).resolve().parents[1]


def layer_config(target: str | None, experts: int, k: int, hidden: int, ffn: int) -> TargetConfig:
    """The routed layer's shape: a real target's (accelerators.specs) or the numbers given."""
    if target:
        return target_config(target)
    return TargetConfig(
        family="qwen3_moe", vocab_size=128, hidden_size=hidden, intermediate_size=ffn,
        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=hidden, num_experts=experts,
        num_experts_per_tok=k, moe_intermediate_size=ffn, norm_topk_prob=True, moe_layers=(0,),
    )  # fmt: skip


def random_layers(tcfg: TargetConfig, layers: int, dtype, seed: int = 0) -> dict:
    """[L, ...] router and expert weights, scaled so that the residual stream stays O(1)."""
    e, d, f = tcfg.num_experts, tcfg.hidden_size, tcfg.moe_intermediate_size
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)

    def normal(key, shape, fan_in):
        return (jax.random.normal(key, (layers, *shape), jnp.float32) / np.sqrt(fan_in)).astype(
            dtype
        )

    return {
        "router": normal(keys[0], (d, e), d),
        "we_gate": normal(keys[1], (e, d, f), d),
        "we_up": normal(keys[2], (e, d, f), d),
        "we_down": normal(keys[3], (e, f, d), f),
    }


def shape_of(tcfg: TargetConfig, target: str | None, layers: int, dtype) -> dict:
    """The measured layer's shape as results record it."""
    return {
        "target": target,
        "experts": tcfg.num_experts,
        "k": tcfg.num_experts_per_tok,
        "hidden": tcfg.hidden_size,
        "ffn": tcfg.moe_intermediate_size,
        "layers": layers,
        "dtype": jnp.dtype(dtype).name,
    }


def program(tcfg: TargetConfig):
    """x [1, n, D] through the stacked layers' routed MLPs (residual added), jitted."""

    @jax.jit
    def run(params, x):
        def layer(h, p):
            return h + tgt._moe(p, h, tcfg), None

        return jax.lax.scan(layer, x, params)[0]

    return run


def _median_ms(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


MOE_DISPATCHES = tgt.MOE_DISPATCHES
# the forced gather is measured while a forward's pairs n k are at most this many times E (past
# that the gathered copies outgrow the weights: 38 GB at Qwen3-30B-A3B's shape and 512 tokens)
FORCED_GATHER_UP_TO = 2.0
FORCED = "gather_forced"


def gather_pairs() -> float:
    """`TargetConfig.moe_gather_pairs` as decoding sets it on this backend."""
    return backends.moe_gather_pairs_wanted(jax.default_backend())


def measure(
    tcfg: TargetConfig,
    tokens: list[int],
    dispatches: list[str],
    layers: int,
    dtype,
    reps: int,
    deadline: float | None = None,
    log=print,
    rows: list | None = None,
    forced: bool = True,
) -> list[dict]:
    """One row per (tokens, dispatch), dense first at each token count (the others' reference),
    appended to `rows` (a new list if None) as each is measured, then `log` called; with
    `forced`, also the gathered path where the dispatch would not gather (`FORCED`, while the
    pairs are at most `FORCED_GATHER_UP_TO` x E). Stops starting programs once
    time.monotonic() passes `deadline`."""
    params = random_layers(tcfg, layers, dtype)
    e, k = tcfg.num_experts, tcfg.num_experts_per_tok
    expert_bytes = 3 * tcfg.hidden_size * tcfg.moe_intermediate_size * jnp.dtype(dtype).itemsize
    rows = [] if rows is None else rows
    order = ["dense"] + [d for d in dispatches if d != "dense"]
    pairs = gather_pairs()
    for n in tokens:
        x = jax.random.normal(jax.random.PRNGKey(n), (1, n, tcfg.hidden_size), jnp.float32)
        x = x.astype(dtype)
        ref = None
        by_path: dict[str, dict] = {}
        runs = [(d, d, pairs) for d in order]
        if forced and n * k <= FORCED_GATHER_UP_TO * e:
            runs.append((FORCED, "gather", float("inf")))  # every forward gathers
        for dispatch, kind, most in runs:
            cfg = dataclasses.replace(tcfg, moe_dispatch=kind, moe_gather_pairs=most)
            path = tgt.moe_path(cfg, n)
            if path in by_path:  # the same program as a dispatch measured already
                if dispatch != FORCED:
                    rows.append({**by_path[path], "dispatch": dispatch,
                                 "same_program_as": by_path[path]["dispatch"]})  # fmt: skip
                continue
            if deadline is not None and time.monotonic() > deadline:
                log(f"moe dispatch: deadline, stopped before {dispatch} at {n} tokens")
                return rows
            t0 = time.perf_counter()
            compiled = program(cfg).lower(params, x).compile()
            compile_s = time.perf_counter() - t0
            analysis = compiled.cost_analysis() or {}
            if isinstance(analysis, list):  # older jax: one dict per program
                analysis = analysis[0] if analysis else {}
            out = np.asarray(compiled(params, x), np.float32)
            if ref is None:
                ref = out
            ms = _median_ms(compiled, (params, x), reps) / layers
            touched = float(expected_touched(e, k, n))
            row = {
                "tokens": n,
                "dispatch": dispatch,
                "path": path,
                "ms_per_layer": round(ms, 4),
                "experts_touched": round(touched, 1),
                "touched_gb_per_layer": round(touched * expert_bytes / 1e9, 6),
                "all_gb_per_layer": round(e * expert_bytes / 1e9, 6),
                "xla_gb_accessed_per_layer": (
                    round(analysis["bytes accessed"] / layers / 1e9, 6)
                    if "bytes accessed" in analysis
                    else None
                ),
                "max_abs_diff_vs_dense": float(np.max(np.abs(out - ref))),
                "compile_s": round(compile_s, 2),
            }
            rows.append(row)
            by_path[path] = row
            log(
                f"{n:>5} tokens  {dispatch:<13} ({row['path']:<6}) {ms:9.3f} ms/layer  "
                f"|diff| {row['max_abs_diff_vs_dense']:.2e}"
            )
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table, each dispatch's time beside dense's at the same tokens."""
    dense = {r["tokens"]: r["ms_per_layer"] for r in rows if r["dispatch"] == "dense"}
    lines = [
        "| tokens | dispatch | path | ms / layer | vs dense | experts touched | XLA GB accessed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["ms_per_layer"] / dense[r["tokens"]] if dense.get(r["tokens"]) else None
        xla = r["xla_gb_accessed_per_layer"]
        lines.append(
            f"| {r['tokens']} | {r['dispatch']} | {r['path']} | {r['ms_per_layer']:.3f} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | {r['experts_touched']} | "
            f"{'-' if xla is None else f'{xla:.3f}'} |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--target", default=None, help="a real target's layer shape (accelerators.specs)"
    )
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--k", type=int, default=8, help="experts a token")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=512, help="each expert's intermediate width")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tokens", default="1,2,4,8,16,60,512")
    p.add_argument(
        "--dispatches",
        default=None,
        help="default: dense,gather on the CPU (its ragged_dot is a dense fallback, "
        "8-9x dense at 512 tokens), all three elsewhere",
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/moe_dispatch.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    tcfg = layer_config(args.target, args.experts, args.k, args.hidden, args.ffn)
    tokens = [int(t) for t in args.tokens.split(",")]
    default = "dense,gather" if jax.default_backend() == "cpu" else ",".join(tgt.MOE_DISPATCHES)
    dispatches = [d for d in (args.dispatches or default).split(",") if d]
    bad = [d for d in dispatches if d not in tgt.MOE_DISPATCHES]
    if bad:
        raise SystemExit(f"--dispatches: {', '.join(bad)}: choose among {tgt.MOE_DISPATCHES}")
    rows = measure(tcfg, tokens, dispatches, args.layers, jnp.dtype(args.dtype), args.reps)
    print(table(rows))
    result = {
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "machine": platform.processor() or platform.machine(),
        "shape": shape_of(tcfg, args.target, args.layers, args.dtype),
        "gather_pairs": gather_pairs(),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
