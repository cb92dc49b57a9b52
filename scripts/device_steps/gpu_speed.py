"""The `gpu-speed` step: measure before changing (issue 58 items 1, 4a and 6). One call of at most
~8 minutes on a lent GPU, random bf16 weights made on the device, nothing carried.

Four phases, each a subprocess (`python -m device_steps.gpu_speed PHASE`) with a deadline, each
writing its JSON after every program, and `summary.json` with `report.md` rewritten after every
phase, so a call cut off early still returns what was measured:

  kernels  the kernels each program launches per target layer and the fixed rest
           (`accelerators.kernels.kernels_per_layer`: the program compiled at --layers, e.g. 3
           and 5 layers of --target's shape, batch 1, nothing run): the plain step, the 10/8/60
           round and the chain round (1/8/9), for each --variants entry -> kernels.json
  trace    for each variant, with XLA's command buffers (CUDA graphs) off and on: the plain step
           and the 10/8/60 round at --target's shape, batch 1, compiled (kernels counted), timed
           call by call (each waited for), then `--plain-steps` plain steps and `--rounds` rounds
           traced by `jax.profiler` (each waited for, as decoding waits); the trace summarized per
           program (`kernels.trace_summary`: device busy time against wall time, the top
           kernels) -> trace_VARIANT_CB.json, and the trace itself under traces/ when small
  sweep    the plain step and the rounds (the chain, 10/8/60 and the cost model's best tree for
           the batch, `accelerators.predict.best_tree`) at each of --targets' shapes and
           --batches, timed without host overhead: `--loop-steps` steps in one program (a
           `lax.fori_loop` over the donated state) divided by that count, each beside the
           cost model's time and its roofline (the same without the launch and loop costs it
           assumes), the most important first (Llama-3.1-8B, batch 1), with decoding's own
           XLA flags (`backends.set_xla_flags`) -> sweep.json
  moe      a mixture-of-experts target's routed layers alone (`benchmarks/moe_dispatch.py`:
           --moe-layers layers of --moe-target's shape, bf16) at each --moe-tokens count under
           each dispatch (dense, gather, ragged: `models.target.moe_path`) and gathered past
           where the dispatch would gather (to place `backends.MOE_GATHER_PAIRS` on the
           device, and to see whether ragged or gather should be a GPU's dispatch), ms a
           layer beside the bytes of the experts touched -> moe.json

The variants (`VARIANTS`): a name mapped to a kernel path of the engine, as a function
TargetConfig -> TargetConfig (a path its static config selects) and, where the path lays the
weights out at load, a function of the weights (`fused_projections`: q/k/v and gate/up as one
product each, `models.target.fuse_projections`, what `backends.prepare_target` does on
accelerators), so that each path is measured beside the baseline in the same call (phases kernels
and trace run each; the sweep runs the first).

Command buffers: "cb_off" runs with `--xla_gpu_enable_command_buffer=` (none); "cb_on" adds WHILE
and CONDITIONAL to XLA's default set and keeps them on while the profiler traces
(`--xla_enable_command_buffers_during_profiling=true`: XLA turns them off under a trace by
default). Should this XLA refuse those flags, cb_on runs again with XLA's defaults and says so.

Everything lands in OUT/gpu_speed/: summary.json (`{"device", "programs": [{"target", "batch",
"program", "tree", "measured_ms", "roofline_ms", "plain_steps", ...}], "kernels", "traces",
"real_head": null, "peers": null, ...}`), report.md, the phases' JSON, their logs and
device_log.txt. `--target tiny` runs the whole step on a CPU in well under a minute.

This module imports no jax at import time: the step's own process leaves the GPU's memory to the
phases' subprocesses; the phases import it inside their functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from device_steps import common as c

if TYPE_CHECKING:
    from eagle3_jax.config import TargetConfig


def _same(cfg: TargetConfig) -> TargetConfig:
    return cfg


def _attention(kind: str) -> Callable[[TargetConfig], TargetConfig]:
    """The target's attention set to `kind` (`models.layers.attention`): "mixed" computes as flash
    attention does, in XLA (a TPU's choice for bf16 weights); "pallas" runs a decode step and a
    verification's cached part through the Pallas flash-decoding kernel (a GPU's)."""
    return lambda cfg: dataclasses.replace(cfg, attention=kind)


def _fused_projections(params: dict, cfg: TargetConfig) -> dict:
    """The target's weights with q/k/v and gate/up fused as `backends.prepare_target` fuses them
    on accelerators; weights' shapes only (ShapeDtypeStructs) fused by shape."""
    import jax

    from eagle3_jax.models import target as tgt

    if isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct):
        fuse = functools.partial(tgt.fuse_layer, cfg=cfg)
        layers = params["layers"]
        fused = [jax.eval_shape(fuse, lp) for lp in layers] if isinstance(layers, list) else (
            jax.eval_shape(fuse, layers)
        )  # fmt: skip
        return {**params, "layers": fused}
    return tgt.fuse_projections(params, cfg)


@dataclasses.dataclass(frozen=True)
class Variant:
    """A kernel path of the engine: the target's config as the path sets it, and its weights as
    the path lays them out at load (None: as `init_params` makes them)."""

    config: Callable[[TargetConfig], TargetConfig] = _same
    params: Callable[[dict, TargetConfig], dict] | None = None


# the engine's kernel paths, by name (one dict, so that a new path is one line here and measured
# by `--variants baseline,NAME`)
VARIANTS: dict[str, Variant] = {
    "baseline": Variant(),
    "fused_projections": Variant(params=_fused_projections),
    "mixed_attention": Variant(config=_attention("mixed")),
    "flash_decoding": Variant(config=_attention("pallas")),
    # what `backends.prepare_target` does on a GPU with bf16 weights: fused projections and the
    # flash-decoding kernel (on a TPU: mixed attention)
    "engine": Variant(config=_attention("pallas"), params=_fused_projections),
}

PHASES = ("kernels", "trace", "sweep", "moe")
# each phase's share of what is left when it starts (a phase that ends early leaves the rest to
# the next)
SHARES = {"kernels": 0.2, "trace": 0.35, "sweep": 0.35, "moe": 0.1}
MOE_TARGETS = ("qwen3_30b_a3b", "gpt_oss_20b")
# the moe phase's layer at --target tiny: 16 experts of width 32, top 2, hidden 64
TINY_MOE = (16, 2, 64, 32)
TARGETS = ("llama31_8b", "olmo2_7b", "olmo2_1b", "qwen3_4b", "tiny")
SWEEP_TARGETS = "llama31_8b,olmo2_7b,olmo2_1b"
# the rounds --trees may name: EAGLE-3's reporting tree, a chain as deep (1/8/9) and, in the
# sweep, the cost model's best tree for the batch
TREE_NAMES = ("10/8/60", "chain", "best")
# XLA_FLAGS per command-buffer setting (the flags XLA_FLAGS already holds come first)
COMMAND_BUFFERS = {
    "cb_off": ["--xla_gpu_enable_command_buffer="],
    "cb_on": [
        "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
        "--xla_enable_command_buffers_during_profiling=true",
    ],
}
# a phase's subprocess starts (imports jax, starts the backend) within its deadline (the toy's
# on a CPU in a few seconds); the summary and the log are written after it
START_S = {"gpu": 20.0, "tiny": 10.0}
# the compile estimates (`round_timing.COMPILE_S`, a 32-layer target on a GPU, scaled by the
# layers) times this for the toy on a 2-core CPU until its first compilation is timed
TINY_COMPILE_SCALE = 2.0
RESERVE_S = 20.0
# the trace files kept beside the summaries (the device tool returns files of up to 16 MiB)
TRACE_KEEP_BYTES = 8 << 20
# what each program's aux layer ids are when kernels are counted at few layers: the same three
# ids at both counts, so that only the layers differ
AUX_FOR_COUNTS = (0, 1, 2)


def _names(known: tuple[str, ...] | None):
    """A type for a comma-separated list (of `known` names, when given; order kept, once each)."""

    def check(text: str) -> str:
        names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
        bad = [t for t in names if known is not None and t not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"{', '.join(bad) or repr(text)}: choose among {', '.join(known or ())}"
            )
        return ",".join(names)

    return check


def _ints(text: str) -> str:
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: positive integers, comma separated")
    return text


def _layers(text: str) -> str:
    vals = [int(v) for v in _ints(text).split(",")]
    if len(vals) != 2 or not max(AUX_FOR_COUNTS) < vals[0] < vals[1]:
        raise argparse.ArgumentTypeError(
            f"{text!r}: two layer counts a,b with {max(AUX_FOR_COUNTS)} < a < b"
        )
    return text


# (flag, type, default, help): the measurement's flags, taken by the step and by every phase
FLAGS = (
    ("--target", _names(TARGETS), "llama31_8b",
     "the shape of the kernels and trace phases (tiny: a CPU toy)"),
    ("--targets", _names(TARGETS), None,
     f"the sweep's targets in order (default {SWEEP_TARGETS}; tiny with --target tiny)"),
    ("--batches", _ints, "1,8,32,64", "the sweep's batch sizes in order"),
    ("--trees", _names(TREE_NAMES), "chain,10/8/60,best",
     "the rounds: kernels counts each but best, trace traces 10/8/60 (else the first), the "
     "sweep times each"),
    ("--variants", _names(tuple(VARIANTS)), "engine,baseline",
     f"kernel-path variants measured in kernels and trace: {', '.join(VARIANTS)}"),
    ("--layers", _layers, "3,5", "the two layer counts kernels are counted at"),
    ("--prompt", int, 1024, "prompt tokens: the cache's cursor starts there"),
    ("--new", int, 1024, "new tokens: the cache holds prompt + new (+ a round's slots)"),
    ("--plain-steps", int, 10, "plain steps traced"),
    ("--rounds", int, 3, "rounds traced"),
    ("--reps", int, 5, "timed calls of each program (trace: single calls; sweep: loops)"),
    ("--loop-steps", int, 16, "steps or rounds in one sweep program"),
    ("--moe-target", _names(MOE_TARGETS), "qwen3_30b_a3b",
     "the moe phase's routed-layer shape (`benchmarks/moe_dispatch.py`)"),
    ("--moe-tokens", _ints, "1,8,16,32,60,512", "the moe phase's forward sizes (tokens)"),
    ("--moe-layers", int, 4, "the moe phase's routed layers a program"),
    ("--predict-device", str, "auto",
     "accelerators.specs.DEVICES key the cost model is for, cpu, or auto (the device's kind)"),
)  # fmt: skip


def add_args(p: argparse.ArgumentParser, step: bool = False) -> None:
    """The measurement's flags (`FLAGS`), and with `step` the step's own (its budget, where the
    results go, which phases run)."""
    add_flags(p, FLAGS, step, 8.0, "gpu_speed", PHASES)


def add_flags(p, flags, step: bool, minutes: float, folder: str, phases: tuple) -> None:
    """A device step's measurement flags (`flags`: (flag, type, default, help) rows), and with
    `step` the step's own: --minutes (default `minutes`), --out (`folder` under it) and
    --phases (of `phases`, in order). gpu-speed's and peers' (peers.py)."""
    for flag, typ, default, help_ in flags:
        p.add_argument(flag, type=typ, default=default, help=help_)
    if step:
        p.add_argument("--minutes", type=float, default=minutes, help="the step's whole budget")
        p.add_argument("--out", default=os.environ.get("OUT"), help=f"default: runs/ ({folder}/)")
        p.add_argument(
            "--phases", type=_names(phases), default=",".join(phases), help="phases run, in order"
        )


def forward(args: argparse.Namespace, flags=FLAGS) -> list[str]:
    """The flags of `flags` (default `FLAGS`) as command-line words, with the values `args`
    holds (those it holds as None left out)."""
    out = []
    for flag, *_ in flags:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    return out


def sweep_targets(args: argparse.Namespace) -> list[str]:
    if args.targets:
        return args.targets.split(",")
    return ["tiny"] if args.target == "tiny" else SWEEP_TARGETS.split(",")


# ============================================================================= the step


def _flags(cb: str, env: dict) -> str:
    return " ".join([env.get("XLA_FLAGS", ""), *COMMAND_BUFFERS[cb]]).strip()


def step(args: argparse.Namespace) -> int:
    """Runs the phases within --minutes, writing summary.json and report.md after each; 1 when
    nothing was measured or a phase failed."""
    c.check_budget(args.minutes)
    out = Path(args.out or (c.ROOT / "runs")) / "gpu_speed"
    out.mkdir(parents=True, exist_ok=True)
    log = c.Log(out / "device_log.txt")
    log(f"gpu-speed start: {c.accelerator()}")
    env = c.base_env()  # jax alone: no wheel, no GGUF
    env["PYTHONPATH"] = os.pathsep.join([str(c.ROOT / "scripts"), env["PYTHONPATH"]])
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(c.DEVICE / "jax_cache"))
    phases = [p for p in PHASES if p in args.phases.split(",")]
    status: dict[str, Any] = {}
    for i, name in enumerate(phases):
        later = sum(SHARES[p] for p in phases[i:])
        budget = (log.left(args.minutes) - RESERVE_S) * SHARES[name] / later
        t0 = time.monotonic()
        runs = (
            [(v, cb) for v in args.variants.split(",") for cb in COMMAND_BUFFERS]
            if name == "trace"
            else [(None, None)]
        )
        rcs = []
        for j, (variant, cb) in enumerate(runs):
            timeout = budget - (time.monotonic() - t0)
            timeout = timeout / (len(runs) - j)  # the runs left share what is left
            start = START_S["tiny" if args.target == "tiny" else "gpu"]
            cmd = [sys.executable, "-m", "device_steps.gpu_speed", name, "--out", str(out),
                   "--deadline-s", f"{max(timeout - start, 0):.0f}", *forward(args)]  # fmt: skip
            penv = dict(env)
            label = name
            if cb is not None:
                cmd += ["--variant", variant, "--cb", cb]
                penv["XLA_FLAGS"] = _flags(cb, env)
                label = f"trace_{variant}_{cb}"
            rc = c.phase(log, label, cmd, penv, timeout, log_dir=out)
            text = (out / f"{label}.log").read_text(errors="replace") if rc else ""
            if rc and cb == "cb_on" and ("XLA_FLAGS" in text or "Flag parsing failed" in text):
                log(f"{label}: XLA refused {COMMAND_BUFFERS[cb]}; again with XLA's defaults")
                penv["XLA_FLAGS"] = env.get("XLA_FLAGS", "")
                cmd += ["--refused-flags"]
                rc = c.phase(log, label, cmd, penv, budget - (time.monotonic() - t0), out)
            rcs.append(rc)
        status[name] = {"rc": rcs, "seconds": round(time.monotonic() - t0, 1)}
        summary = write_summary(out, args, status)
        log(f"{name}: {len(summary['programs'])} sweep programs so far -> {out / 'summary.json'}")
    summary = write_summary(out, args, status)
    measured = summary["programs"] or summary["kernels"] or summary["traces"]
    failed = any(rc not in (0, -1) for s in status.values() for rc in s["rc"])  # -1: no time
    return 0 if measured and not failed else 1


# ----------------------------------------------------------------------------- the summary


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_summary(out: Path, args: argparse.Namespace, status: dict) -> dict:
    """summary.json and report.md from the phases' JSON files found in `out`."""
    kern = _read(out / "kernels.json") or {}
    sweep = _read(out / "sweep.json") or {}
    moe = _read(out / "moe.json") or {}
    traces: dict[str, dict] = {}
    for path in sorted(out.glob("trace_*.json")):
        t = _read(path)
        if t:
            traces.setdefault(t["variant"], {})[t["cb"]] = t
    parts = [kern, sweep, moe, *(t for v in traces.values() for t in v.values())]
    first = next((p for p in parts if p.get("device")), {})
    summary = {
        "device": first.get("device"),
        "jax": first.get("jax"),
        "date": time.strftime("%Y-%m-%d"),
        "dtype": "bfloat16, random weights",
        "target": args.target,
        "variants": args.variants.split(","),
        "predicted_for": sweep.get("predicted_for"),
        "sweep_xla_flags": sweep.get("xla_flags"),
        "context": args.prompt + args.new,
        "loop_steps": args.loop_steps,
        "programs": sweep.get("rows", []),
        "kernels": kern.get("programs", {}),
        "traces": traces,
        "moe": {k: moe.get(k) for k in ("shape", "gather_pairs", "rows")} if moe else None,
        "skipped": [s for p in parts for s in p.get("skipped", [])],
        "failed": [s for p in parts for s in p.get("failed", [])],
        "phases": status,
        "real_head": None,
        "peers": None,
    }
    c_tmp = out / "summary.json.tmp"
    c_tmp.write_text(json.dumps(summary, indent=1) + "\n")
    c_tmp.replace(out / "summary.json")
    (out / "report.md").write_text(report(summary))
    return summary


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 10**digits else f"{v:.0f}"
    return str(v)


def moe_table(rows: list[dict]) -> str:
    """The moe phase's rows: ms a layer by dispatch beside dense's and the experts' bytes."""
    dense = {r["tokens"]: r["ms_per_layer"] for r in rows if r["dispatch"] == "dense"}
    out = [
        "| tokens | dispatch | path | ms a layer | / dense | experts touched | GB touched "
        "| GB/s at the touched bytes |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms, ref = r["ms_per_layer"], dense.get(r["tokens"])
        gb = r["all_gb_per_layer"] if r["path"] == "dense" else r["touched_gb_per_layer"]
        out.append(
            f"| {r['tokens']} | {r['dispatch']} | {r['path']} | {_f(ms)} "
            f"| {_f(ms / ref if ref else None)} | {_f(r['experts_touched'])} | {_f(gb)} "
            f"| {_f(gb / ms * 1e3 if ms else None)} |"
        )
    return "\n".join(out)


def report(s: dict) -> str:
    """summary.json as markdown: the sweep, the kernels per layer, the traces."""
    lines = [
        f"# GPU speed: {s.get('device')} (jax {s.get('jax')}, {s.get('date')})",
        "",
        f"{s.get('dtype')}; caches sized for {s.get('context')} tokens. Sweep programs run "
        f"{s.get('loop_steps')} steps or rounds in one program (ms per step or round); the cost "
        f"model and its roofline are for {s.get('predicted_for')}, one chip.",
        "",
        "| target | batch | program | tree | measured ms | cost model ms | roofline ms "
        "| measured / roofline | round in plain steps (model) | τ model | speedup at τ |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in s.get("programs", []):
        tree = (r.get("tree") or "-") + (" (best)" if r.get("best") else "")
        steps = r.get("plain_steps")
        lines.append(
            f"| {r['target']} | {r['batch']} | {r['program']} | {tree} | {_f(r['measured_ms'])} "
            f"| {_f(r['predicted_ms'])} | {_f(r['roofline_ms'])} "
            f"| {_f(r['measured_ms'] / r['roofline_ms'])} "
            f"| {_f(steps)} ({_f(r.get('plain_steps_predicted'))}) | {_f(r.get('tau_model'))} "
            f"| {_f(r.get('speedup_measured'))} |"
        )
    if not s.get("programs"):
        lines.append("| - | - | nothing measured | | | | | | | | |")
    lines += [
        "",
        f"Kernels per target layer ({s.get('target')}, batch 1, the optimized HLO): "
        "instructions that launch a kernel (each once) and the kernels one call launches "
        "(loops' bodies once a trip); the full model is fixed + layers × per layer.",
        "",
        "| variant | program | per layer (launches) | fixed (launches) | full model (launches) "
        "| per layer by kind |",
        "|---|---|---:|---:|---:|---|",
    ]
    for variant, progs in s.get("kernels", {}).items():
        for prog, k in progs.items():
            kinds = ", ".join(f"{n} {_f(v)}" for n, v in k["per_layer"]["by_kind"].items())
            lines.append(
                f"| {variant} | {prog} | {_f(k['per_layer']['total'])} "
                f"({_f(k['per_layer']['launches'])}) | {_f(k['fixed']['total'])} "
                f"({_f(k['fixed']['launches'])}) | {_f(k['full_model']['total'])} "
                f"({_f(k['full_model']['launches'])}) | {kinds} |"
            )
    lines += [
        "",
        f"Traces ({s.get('target')}, batch 1): each call waited for; device busy time is the "
        "union of the device's kernels and copies inside the program's window.",
        "",
        "| variant | command buffers | program | calls | timed ms a call (median) | wall ms "
        "| device busy ms | busy | kernels a call (trace) | top kernels (share) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for variant, cbs in s.get("traces", {}).items():
        for cb, t in cbs.items():
            for prog, tr in t.get("trace", {}).items():
                calls = tr.get("calls") or 1
                top = ", ".join(
                    f"{k['name'][:40]} ({k['share']:.0%})" for k in tr.get("top", [])[:3]
                )
                timed = t.get("timed", {}).get(prog, {}).get("median_ms")
                lines.append(
                    f"| {variant} | {cb}{' (refused: defaults)' if t.get('refused_flags') else ''} "
                    f"| {prog} | {calls} | {_f(timed)} | {_f(tr['wall_ms'])} "
                    f"| {_f(tr['device_busy_ms'])} | {_f(tr['busy_fraction'])} "
                    f"| {_f(tr['events'] / calls)} | {top} |"
                )
    moe = s.get("moe") or {}
    if moe.get("rows"):
        shape = moe["shape"]
        lines += [
            "",
            f"Routed layers alone ({shape['target'] or 'toy'}: {shape['experts']} experts, top "
            f"{shape['k']}, hidden {shape['hidden']}, expert width {shape['ffn']}, "
            f"{shape['layers']} layers, {shape['dtype']}), by dispatch "
            "(`benchmarks/moe_dispatch.py`):",
            "",
            moe_table(moe["rows"]),
        ]
    for key, title in (("skipped", "Skipped (the deadline)"), ("failed", "Failed")):
        if s.get(key):
            lines += ["", f"{title}:", ""] + [f"- {x}" for x in s[key]]
    return "\n".join(lines) + "\n"


# ============================================================================= the phases
# (subprocesses: they import jax)


def _device() -> tuple[str, str, str]:
    """(a name for the device, its platform, its kind)."""
    import jax

    dev = jax.devices()[0]
    name = (
        dev.device_kind if dev.platform == dev.device_kind else f"{dev.platform} {dev.device_kind}"
    )
    return name, dev.platform, dev.device_kind


def predict_device(name: str):
    """The cost model's device: `--predict-device` by name, or for "auto" the H100 or H200 the
    device's kind names (another GPU: the H100's figures), and the assumed 2-core CPU on a CPU."""
    from device_steps import round_timing as rt
    from eagle3_jax.accelerators import specs

    if name != "auto":
        return rt.predict_device(name)
    _, platform, kind = _device()
    for key in ("H200", "H100"):
        if key in kind.upper():
            return specs.DEVICES[key]
    return specs.CPU_2CORE if platform == "cpu" else specs.DEVICES["H100"]


def shapes(target: str, variant: str = "baseline", layers: int | None = None):
    """(TargetConfig, DraftConfig): `round_timing.shapes`' target (Llama-3.1-8B's or OLMo 2's
    published sizes; tiny for the CPU) and EAGLE-3 head, the variant applied to the target; with
    `layers`, the target cut to that many layers and the head reading `AUX_FOR_COUNTS`."""
    from device_steps import round_timing as rt

    tcfg, dcfg = rt.shapes(target)
    tcfg = VARIANTS[variant].config(tcfg)
    if layers is not None:
        tcfg = dataclasses.replace(tcfg, num_layers=layers)
        dcfg = dataclasses.replace(dcfg, aux_layer_ids=AUX_FOR_COUNTS)
    return tcfg, dcfg


def random_weights(avals, seed: int):
    """Arrays shaped as `avals` (a pytree of ShapeDtypeStructs) made on the device: matrices
    normal(0, 0.02), vectors (norms, biases) ones, integers zeros. One small program per
    distinct shape, so that an 8B target's weights take seconds, not the minutes a jitted
    `init_params` over 32 unrolled layers takes to compile."""
    import jax
    import jax.numpy as jnp

    makers: dict[tuple, Callable] = {}

    def make(i: int, a):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.zeros(a.shape, a.dtype)
        if len(a.shape) < 2:
            return jnp.ones(a.shape, a.dtype)
        if (a.shape, a.dtype) not in makers:
            makers[a.shape, a.dtype] = jax.jit(
                lambda k, shape=a.shape, dtype=a.dtype: (
                    0.02 * jax.random.normal(k, shape, jnp.float32)
                ).astype(dtype)
            )
        return makers[a.shape, a.dtype](jax.random.key(seed * 100_003 + i))

    leaves, treedef = jax.tree.flatten(avals)
    return jax.block_until_ready(
        jax.tree.unflatten(treedef, [make(i, a) for i, a in enumerate(leaves)])
    )


def inputs(tcfg, dcfg, abstract: bool = False, variant: str = "baseline"):
    """`round_timing.Inputs` of random bf16 weights (`random_weights`), or of their shapes only
    (`abstract`: enough to compile), the target's laid out as the variant lays them out."""
    import jax
    import jax.numpy as jnp

    from device_steps import round_timing as rt
    from eagle3_jax.models import draft as drf
    from eagle3_jax.models import target as tgt
    from eagle3_jax.models.draft_output import attach_target_head
    from eagle3_jax.vocab import DraftVocab

    bf16 = jnp.bfloat16
    tav = jax.eval_shape(functools.partial(tgt.init_params, tcfg, dtype=bf16), jax.random.key(0))
    dav = jax.eval_shape(functools.partial(drf.init_params, dcfg, dtype=bf16), jax.random.key(1))
    vd, v = dcfg.draft_vocab_size, tcfg.vocab_size
    if abstract:
        tp, dp = tav, dav
        vocab = DraftVocab(jax.ShapeDtypeStruct((vd,), jnp.int32), jax.ShapeDtypeStruct((v,), bool))
    else:
        tp, dp = random_weights(tav, 0), random_weights(dav, 1)
        vocab = DraftVocab(jnp.zeros((vd,), jnp.int32), jnp.arange(v) < vd)  # the first Vd ids
    if VARIANTS[variant].params is not None:
        tp = VARIANTS[variant].params(tp, tcfg)
    return rt.Inputs(tp, attach_target_head(dp, dcfg, tp, tcfg), vocab, tcfg, dcfg)


def step_program(x, b: int, prompt: int, new: int, tree=None, abstract: bool = False):
    """(step, fixed args, state, shape) of the plain step (`tree` None) or a round (eagle3
    drafter, greedy): `step(*fixed, state)` is `plain.decode_step` or `speculative.round_step`
    with its static arguments bound, as decoding calls it; the state is zeros with the cursor at
    `prompt` (as `round_timing`'s), or its shapes only (`abstract`)."""
    import jax
    import jax.numpy as jnp

    from eagle3_jax.decoding import plain
    from eagle3_jax.decoding import speculative as spec
    from eagle3_jax.decoding.sampling import Sampling

    def full(v: int):
        if abstract:
            return jax.ShapeDtypeStruct((b,), jnp.int32)
        return jnp.full((b,), v, jnp.int32)  # a fresh buffer a leaf (the state is donated)

    def zeros(aval):
        if abstract:
            return aval
        if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
            return jax.random.key(0)
        return jnp.zeros(aval.shape, aval.dtype)

    prompt_args = lambda t, limit: (  # noqa: E731
        jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32), jax.random.key(0),
    )  # fmt: skip
    eos = x.tcfg.eos_token_ids
    if tree is None:
        shape = plain.plan_shape([prompt] * b, new, prompt + new + 1)
        kw = dict(cfg=x.tcfg, shape=shape, sampling=Sampling(), eos_ids=eos)
        args = prompt_args(shape.prompt_len, shape.max_new)
        avals = jax.eval_shape(functools.partial(plain.prefill, **kw), x.tparams, *args)
        state = jax.tree.map(zeros, avals)._replace(cursor=full(prompt), limit=full(shape.max_new))
        return functools.partial(plain.decode_step, **kw), (x.tparams,), state, shape
    tree = tree.validate(x.dcfg.draft_vocab_size)
    extra = tree.round_slots + 1
    shape = plain.plan_shape([prompt] * b, new, prompt + new + extra + 1, extra)
    kw = dict(tcfg=x.tcfg, dcfg=x.dcfg, shape=shape, tree=tree, sampling=Sampling(), eos_ids=eos)
    head = (x.tparams, x.dparams, x.tparams["embed"], x.vocab)
    args = prompt_args(shape.prompt_len, shape.max_new)
    avals = jax.eval_shape(functools.partial(spec.prefill, **kw), *head, *args)
    state = dataclasses.replace(
        jax.tree.map(zeros, avals),
        length=full(prompt),
        pending_at=full(prompt),
        limit=full(shape.max_new),
        enc_n=full(1),
    )
    return functools.partial(spec.round_step, **kw, method="eagle3"), head, state, shape


def compile_step(step, fixed: tuple, state, loop_steps: int = 0):
    """The step compiled as decoding runs it (`loop_steps` 0), or `loop_steps` of it in one
    program (a `lax.fori_loop` over the state), the state donated either way."""
    import jax

    if loop_steps:

        def run(*a):
            return jax.lax.fori_loop(0, loop_steps, lambda i, s: step(*a[:-1], s), a[-1])

        return jax.jit(run, donate_argnums=len(fixed)).lower(*fixed, state).compile()
    return jax.jit(step, donate_argnums=len(fixed)).lower(*fixed, state).compile()


def _median_ms(ts: list[float], per: int = 1) -> dict:
    import numpy as np

    a = np.asarray(ts) * 1e3 / per
    return {"median_ms": float(np.median(a)), "min_ms": float(a.min()),
            "max_ms": float(a.max()), "reps": len(ts)}  # fmt: skip


def _trees(names: str) -> dict:
    """{name: TreeConfig} of the named trees but "best" (the sweep's, chosen per batch)."""
    from eagle3_jax.accelerators.programs import CHAIN_TREE
    from eagle3_jax.decoding.tree import ACCELERATOR_TREE

    known = {"chain": CHAIN_TREE, "10/8/60": ACCELERATOR_TREE}
    return {n: known[n] for n in names.split(",") if n in known}


class _Phase(c.PhaseResults):
    """A phase's results file (`common.PhaseResults`), its deadline and its compile estimates
    (`round_timing.Budget`: a guess for a 32-layer target until a compilation is timed)."""

    def __init__(self, args: argparse.Namespace, path: Path, **fields):
        import jax

        from device_steps import round_timing as rt

        name, *_ = _device()
        super().__init__(path, device=name, jax=jax.__version__, **fields)
        self.budget = rt.Budget(args.deadline_s, self.t0)
        if "tiny" in (args.target, *sweep_targets(args)):
            self.budget.scale = TINY_COMPILE_SCALE

    def fits(self, what: str, name: str, calls: int, call_s: float, layers: int) -> bool:
        need = self.budget.need(name, calls, call_s, layers)
        if need <= self.budget.left():
            return True
        return self.skip(
            f"{what}: needs ~{need:.0f} s (compile ~{self.budget.estimate(name, layers):.0f} s),"
            f" {self.budget.left():.0f} s left"
        )


def run_kernels(args: argparse.Namespace) -> dict:
    """Phase `kernels`: each variant's plain step and rounds compiled at the two --layers counts
    (weights' shapes only) and counted -> kernels.json."""
    from eagle3_jax.accelerators import kernels

    a, b = (int(v) for v in args.layers.split(","))
    ph = _Phase(args, Path(args.out) / "kernels.json", target=args.target, batch=1,
                layers=[a, b], programs={})  # fmt: skip
    trees = {"plain": None, **_trees(args.trees)}
    for variant in args.variants.split(","):
        for prog, tree in trees.items():
            what = f"kernels {variant} {args.target} {prog}"
            # two compilations of b layers at most, estimated as one of twice b
            if not ph.fits(what, "plain" if tree is None else prog, 0, 0.0, 2 * b):
                continue
            t = time.monotonic()
            try:

                def compile_at(n: int, tree=tree, variant=variant):
                    x = inputs(*shapes(args.target, variant, n), True, variant)
                    fn, fixed, state, _ = step_program(x, 1, args.prompt, args.new, tree, True)
                    return compile_step(fn, fixed, state)

                r = kernels.kernels_per_layer(compile_at, (a, b))
            except Exception as e:  # noqa: BLE001
                ph.fail(what, e)
                continue
            seconds = time.monotonic() - t
            ph.budget.learn("plain" if tree is None else prog, seconds, 2 * b)
            layers = shapes(args.target, variant)[0].num_layers
            r["full_model"] = {
                k: r["fixed"][k] + layers * r["per_layer"][k] for k in ("total", "launches")
            }
            r["target_layers"], r["compile_s"] = layers, round(seconds, 1)
            ph.res["programs"].setdefault(variant, {})[prog] = r
            print(json.dumps({what: r["per_layer"]}), flush=True)
            ph.save()
    return ph.res


def run_trace(args: argparse.Namespace) -> dict:
    """Phase `trace` for one variant and command-buffer setting (XLA_FLAGS set by the step): the
    plain step and the 10/8/60 round at batch 1, compiled, counted, timed call by call, then
    traced -> trace_VARIANT_CB.json (and the trace under traces/ when small)."""
    import jax

    from device_steps import round_timing as rt
    from eagle3_jax.accelerators import kernels

    out = Path(args.out)
    ph = _Phase(args, out / f"trace_{args.variant}_{args.cb}.json", variant=args.variant,
                cb=args.cb, target=args.target, batch=1,
                xla_flags=os.environ.get("XLA_FLAGS", ""), refused_flags=args.refused_flags,
                kernels={}, timed={}, trace={})  # fmt: skip
    tcfg, dcfg = shapes(args.target, args.variant)
    layers = tcfg.num_layers
    t = time.monotonic()
    try:
        x = inputs(tcfg, dcfg, variant=args.variant)
    except Exception as e:  # noqa: BLE001
        ph.fail(f"trace {args.variant} {args.cb}: weights", e)
        return ph.res
    ph.res["init_s"] = round(time.monotonic() - t, 1)
    ready = {}
    rounds = _trees(args.trees)
    round_name = "10/8/60" if "10/8/60" in rounds else next(iter(rounds), None)
    ph.res["round_tree"] = round_name
    todo = [("plain", None)] + ([("round", rounds[round_name])] if round_name else [])
    for prog, tree in todo:
        what = f"trace {args.variant} {args.cb} {args.target} {prog}"
        name = "plain" if tree is None else round_name
        calls = 2 + args.reps + (args.plain_steps if tree is None else args.rounds)
        if not ph.fits(what, name, calls, 0.05, layers):
            continue
        t = time.monotonic()
        try:
            fn, fixed, state, _ = step_program(x, 1, args.prompt, args.new, tree)
            compiled = compile_step(fn, fixed, state)
            compile_s = time.monotonic() - t
            ph.budget.learn(name, compile_s, layers)
            ph.res["kernels"][prog] = kernels.count_kernels(compiled)
            ts, state = rt.time_calls(compiled, fixed, state, 2, args.reps)
        except Exception as e:  # noqa: BLE001
            ph.fail(what, e)
            continue
        ph.res["timed"][prog] = {**_median_ms(ts), "compile_s": round(compile_s, 1)}
        ready[prog] = (compiled, fixed, state)
        ph.save()
    if not ready:
        return ph.res
    counts = {"plain": args.plain_steps, "round": args.rounds}
    tmp = Path(tempfile.mkdtemp(prefix="gpu_speed_trace_"))
    try:
        with jax.profiler.trace(str(tmp), create_perfetto_trace=True, profiler_options=_options()):
            for prog, (compiled, fixed, state) in ready.items():
                with jax.profiler.TraceAnnotation(f"gpu_speed_{prog}"):
                    for _ in range(counts[prog]):
                        state = compiled(*fixed, state)
                        jax.block_until_ready(state)
                ready[prog] = (compiled, fixed, state)
        path = kernels.find_trace(tmp)
        for prog in ready:
            s = kernels.trace_summary(path, window=f"gpu_speed_{prog}", top=10)
            ph.res["trace"][prog] = {**s, "calls": counts[prog]}
        if path.stat().st_size <= TRACE_KEEP_BYTES:
            (out / "traces").mkdir(exist_ok=True)
            shutil.copyfile(
                path, out / "traces" / f"{args.variant}_{args.cb}.perfetto_trace.json.gz"
            )
    except Exception as e:  # noqa: BLE001
        ph.fail(f"trace {args.variant} {args.cb}: the profiler", e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ph.save()
    return ph.res


def _options():
    """The profiler's options: no Python tracer (its events would slow the host the wall time
    counts); None where this jax has no such option."""
    import jax

    try:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
        return opts
    except AttributeError:
        return None


def _predicted(dev, tcfg, dcfg, b: int, context: int, tree) -> dict:
    """The cost model's time (with the launch and loop costs it assumes) and its roofline (the
    same without them) of one plain step (`tree` None) or one round, in ms, with τ for a round."""
    from eagle3_jax.accelerators import acceptance, roofline

    bare = dataclasses.replace(dev, launch_s=0.0, loop_iter_s=0.0)
    if tree is None:
        prog = roofline.plain_step(tcfg, b, roofline.slots_for(context))
        tau = None
    else:
        prog = roofline.spec_round(tcfg, dcfg, tree, b, roofline.slots_for(context, tree))
        tau = acceptance.llama_acceptance().tau(tree)
    return {"predicted_ms": prog.time_s(dev) * 1e3, "roofline_ms": prog.time_s(bare) * 1e3,
            "tau_model": tau}  # fmt: skip


def run_sweep(args: argparse.Namespace) -> dict:
    """Phase `sweep`: every target, batch and program in order, `--loop-steps` a program, each
    beside the cost model -> sweep.json. It runs with decoding's own XLA flags
    (`backends.set_xla_flags`: command buffers with WHILE and CONDITIONAL, unless XLA_FLAGS
    names them), set before jax starts its backend."""
    import gc

    from device_steps import round_timing as rt
    from eagle3_jax import backends
    from eagle3_jax.accelerators import acceptance, predict

    xla_flags = backends.set_xla_flags()
    dev = predict_device(args.predict_device)
    variant = args.variants.split(",")[0]
    ph = _Phase(args, Path(args.out) / "sweep.json", variant=variant, predicted_for=dev.name,
                xla_flags=xla_flags, loop_steps=args.loop_steps, rows=[], init_s={})  # fmt: skip
    n = args.loop_steps
    context = args.prompt + args.new
    call_s = 0.05
    for target in sweep_targets(args):
        tcfg, dcfg = shapes(target, variant)
        layers = tcfg.num_layers
        if not ph.fits(f"{target}: weights", "plain", 0, 0.0, layers):
            continue
        t = time.monotonic()
        try:
            x = inputs(tcfg, dcfg, variant=variant)
        except Exception as e:  # noqa: BLE001
            ph.fail(f"{target}: weights", e)
            continue
        ph.res["init_s"][target] = round(time.monotonic() - t, 1)
        for b in (int(v) for v in args.batches.split(",")):
            trees: dict[str, Any] = {"plain": None, **_trees(args.trees)}
            best_name = None
            if "best" in args.trees.split(","):
                acc = acceptance.llama_acceptance()
                best = predict.best_tree(dev, tcfg, acc, b, context).tree
                best_name = predict.tree_text(best)
                if best_name not in {predict.tree_text(t) for t in trees.values() if t}:
                    trees[best_name] = best
            plain_ms = plain_pred = None
            for name, tree in trees.items():
                label = "plain step" if tree is None else f"round {name}"
                what = f"{target} batch {b} {label}"
                est = "plain" if tree is None else ("chain" if name == "chain" else "10/8/60")
                if not ph.fits(what, est, 1 + args.reps, n * call_s, layers):
                    continue
                t = time.monotonic()
                try:
                    fn, fixed, state, shape = step_program(x, b, args.prompt, args.new, tree)
                    compiled = compile_step(fn, fixed, state, n)
                    compile_s = time.monotonic() - t
                    ph.budget.learn(est, compile_s, layers)
                    ts, state = rt.time_calls(compiled, fixed, state, 1, args.reps)
                except Exception as e:  # noqa: BLE001
                    ph.fail(what, e)
                    state = compiled = fixed = None  # the next program's state needs the room
                    gc.collect()
                    continue
                stats = _median_ms(ts, n)
                call_s = max(call_s, stats["max_ms"] / 1e3)
                p = _predicted(dev, tcfg, dcfg, b, context, tree)
                row = {
                    "target": target, "batch": b,
                    "program": "plain" if tree is None else "round",
                    "tree": None if tree is None else name,
                    "tree_shape": None if tree is None else predict.tree_text(tree),
                    "best": tree is not None and predict.tree_text(tree) == best_name,
                    "measured_ms": stats["median_ms"], **p,
                    "plain_steps": None, "plain_steps_predicted": None, "speedup_measured": None,
                    "loop_steps": n, "slots": shape.slots, "compile_s": round(compile_s, 1),
                    **{k: stats[k] for k in ("min_ms", "max_ms", "reps")},
                }  # fmt: skip
                if tree is None:
                    plain_ms, plain_pred = stats["median_ms"], p["predicted_ms"]
                elif plain_ms is not None:
                    row["plain_steps"] = stats["median_ms"] / plain_ms
                    row["plain_steps_predicted"] = p["predicted_ms"] / plain_pred
                    row["speedup_measured"] = p["tau_model"] / row["plain_steps"]
                ph.res["rows"].append(row)
                print(json.dumps(row), flush=True)
                ph.save()
                del state, compiled, fixed
        del x
        gc.collect()
    return ph.res


def run_moe(args: argparse.Namespace) -> dict:
    """Phase `moe`: --moe-target's routed layers alone under each dispatch at each --moe-tokens
    count (`benchmarks.moe_dispatch.measure`; a toy layer with --target tiny) -> moe.json, saved
    after every program."""
    import jax.numpy as jnp

    from benchmarks import moe_dispatch as md

    ph = _Phase(args, Path(args.out) / "moe.json", rows=[])
    tiny = args.target == "tiny"
    tcfg = md.layer_config(None if tiny else args.moe_target, *TINY_MOE)
    dtype = jnp.float32 if tiny else jnp.bfloat16
    ph.res["shape"] = md.shape_of(tcfg, None if tiny else args.moe_target, args.moe_layers, dtype)
    ph.res["gather_pairs"] = md.gather_pairs()
    tokens = [int(t) for t in args.moe_tokens.split(",")]

    def log(line: str) -> None:
        print(line, flush=True)
        ph.save()

    try:
        md.measure(tcfg, tokens, list(md.MOE_DISPATCHES), args.moe_layers, dtype, args.reps,
                   deadline=ph.t0 + args.deadline_s, log=log, rows=ph.res["rows"])  # fmt: skip
    except Exception as e:  # noqa: BLE001
        ph.fail(f"moe {ph.res['shape']['target']}", e)
    ph.save()
    return ph.res


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("phase", choices=PHASES)
    add_args(p)
    p.add_argument("--out", required=True)
    p.add_argument("--deadline-s", type=float, required=True, help="stop starting programs after")
    p.add_argument("--variant", default="baseline", choices=tuple(VARIANTS), help="trace's")
    p.add_argument("--cb", default="cb_off", choices=tuple(COMMAND_BUFFERS), help="trace's")
    p.add_argument("--refused-flags", action="store_true", help="trace's: XLA refused --cb's")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    phases = {"kernels": run_kernels, "trace": run_trace, "sweep": run_sweep, "moe": run_moe}
    res = phases[args.phase](args)
    # the last lines are what the step's log shows of this phase
    print(f"{args.phase}: {len(res['skipped'])} skipped, {len(res['failed'])} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
