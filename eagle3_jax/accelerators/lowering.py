"""A program exported for TPUs and GPUs (`jax.export`, from `programs`), and what a TPU or GPU
would object to in it.

`export_program` exports one program for `platforms` (("tpu", "cuda") by default) and inspects the
result (`Report`): the StableHLO's custom-call targets (a host callback, or a kernel only the CPU
backend has, fails `problems`), float buffers in the state that are not in the dtype asked for,
and any backend compilation while tracing (a probe that runs at trace time: on a TPU host it
would run there, once per trace, or fail). `memory` sizes it in HBM per device: parameters and KV
caches from the exported inputs' avals and shardings, activations counted from the shapes
(`hbm`); `Memory.fits` compares them with each device's memory. `run` does all three for one
program, `row` makes the record `benchmarks/accelerator_export.py` writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from eagle3_jax.accelerators import roofline
from eagle3_jax.accelerators.experts import Routing
from eagle3_jax.accelerators.hbm import (
    Memory,
    prefill_activations,
    train_activations,
    verify_activations,
)
from eagle3_jax.accelerators.programs import Program, Setup, build
from eagle3_jax.accelerators.specs import draft_for, target_config
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf
from eagle3_jax.models import target as tgt
from eagle3_jax.sharding import named

PLATFORMS = ("tpu", "cuda")

# custom calls a TPU/GPU program may hold: sharding annotations (no kernel). Anything else in the
# hot path is reported (a host callback, a CPU library kernel, a platform-specific kernel).
ALLOWED_CUSTOM_CALLS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}
CALLBACK = re.compile(r"callback|xla_python|py_func", re.I)

# ----------------------------------------------------------------------------- export and checks


@contextlib.contextmanager
def trace_time_work():
    """Records what runs on this machine while the block traces a program: XLA compilations
    (tracing for export compiles nothing, so any is a probe or an eager computation run at trace
    time, which a TPU host would run there too, once per trace) and `jax.default_backend()`
    queries (a program whose shape depends on the exporting machine: here "cpu")."""
    events: list[str] = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append("compile")

    real = jax.default_backend

    def query():
        events.append("default_backend")
        return real()

    jax.monitoring.register_event_duration_secs_listener(listen)
    jax.default_backend = query
    try:
        yield events
    finally:
        jax.default_backend = real
        jax.monitoring.unregister_event_duration_listener(listen)


def custom_call_targets(text: str) -> set[str]:
    """Every custom-call target in a StableHLO module's text."""
    found = set(re.findall(r"custom_call\s*@([\w.$]+)", text))
    return found | set(re.findall(r'call_target_name\s*=\s*"([^"]+)"', text))


def shard_bytes(aval, sharding) -> int:
    """Bytes of one device's shard of an array."""
    shape = sharding.shard_shape(aval.shape) if sharding is not None else aval.shape
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


@dataclasses.dataclass
class Report:
    """What one exported program is, and what a TPU or GPU would object to."""

    program: str
    target: str
    batch: int
    mesh: str
    platforms: tuple[str, ...]
    seconds: float
    module_chars: int
    custom_calls: list[str]
    trace_work: list[str]  # compilations and backend queries while tracing (trace_time_work)
    inputs: dict[str, int]  # group -> bytes per device (params, head, state, ...)
    outputs_bytes: int  # bytes per device of the outputs (as their input counterparts are laid out)
    off_dtype: list[str]  # float state/param buffers not in the dtype asked for
    nr_devices: int

    @property
    def problems(self) -> list[str]:
        out = []
        bad = [c for c in self.custom_calls if c not in ALLOWED_CUSTOM_CALLS]
        if bad:
            out.append(f"custom calls {bad}")
        if self.trace_work:
            out.append(f"at trace time: {sorted(set(self.trace_work))}")
        if self.off_dtype:
            out.append(f"dtype: {self.off_dtype[:4]}")
        if tuple(self.platforms) != PLATFORMS:
            out.append(f"platforms {self.platforms}")
        return out


def _path_str(path) -> str:
    return jax.tree_util.keystr(path)


def _off_dtype(prog: Program, exported) -> list[str]:
    """Float leaves of the params, head and state (in and out) whose dtype is not the one asked
    for: an fp32 cache or weight where bf16 was asked doubles its HBM."""
    want = np.dtype(prog.want_dtype)
    bad = []
    skip = {"inputs", "batch", "t2d", "vocab"}
    flat, _ = jax.tree_util.tree_flatten_with_path(prog.args)
    names = []
    for g, n in prog.groups.items():
        names += [g] * n
    for (path, leaf), g in zip(flat, names):
        if g in skip or _kept_fp32(path):
            continue
        if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != want:
            bad.append(f"in{_path_str(path)}: {leaf.dtype}")
    if prog.state_arg is not None or prog.name.endswith("prefill"):  # the state it returns
        out = jax.tree.unflatten(exported.out_tree, exported.out_avals)
        state_out, _ = jax.tree_util.tree_flatten_with_path(
            out[0] if prog.name == "train_step" else out
        )
        for i, (path, a) in enumerate(state_out):
            if _kept_fp32(path):
                continue
            if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != want:
                bad.append(f"out state leaf {i} {a.shape}: {a.dtype}")
    return bad


def _kept_fp32(path) -> bool:
    """A row's sampling settings (SpecState.sampling: temperature, top-p, [B] float32 each),
    the emitted tokens' log-probabilities (SpecState.logprobs: the fp32 log-softmax, as vLLM
    reports them) and a chunked prefill's last logits (`plain.Chunk.logits`, fp32 as the LM
    head gives them): per-request numbers, neither a cache nor a weight, kept in float32
    whatever the dtype."""
    return any(getattr(k, "name", None) in ("sampling", "logprobs", "logits") for k in path)


def export_program(prog: Program, platforms=PLATFORMS):
    """(jax.export.Exported, Report) of a program for `platforms`."""
    t0 = time.perf_counter()
    with trace_time_work() as compiles:
        exported = export.export(prog.fn, platforms=platforms)(*prog.args, **prog.kwargs)
        text = exported.mlir_module()
    seconds = time.perf_counter() - t0
    # laid out as the caller holds them: an argument the program does not read (the head's
    # lm_head in a prefill) keeps no sharding in the export, but the caller's copy stays sharded
    # the arrays among the keyword arguments (an admission's rows' sampling) come after the
    # positional ones, as the export flattens (args, kwargs)
    given = [x for x in jax.tree.leaves((prog.args, prog.kwargs))
             if isinstance(x, jax.ShapeDtypeStruct)]  # fmt: skip
    if len(given) != len(exported.in_avals):
        raise Eagle3Error(f"{prog.name}: {len(exported.in_avals)} inputs, {len(given)} given")
    per_leaf = [shard_bytes(a, g.sharding) for a, g in zip(exported.in_avals, given)]
    inputs, i = {}, 0
    for g, n in prog.groups.items():
        inputs[g] = sum(per_leaf[i : i + n])
        i += n
    if i != len(per_leaf):
        raise Eagle3Error(f"{prog.name}: {len(per_leaf)} inputs, groups count {i}")
    out_bytes = _outputs_bytes(prog, exported)
    mesh = "x".join(str(x) for x in prog.mesh.devices.shape)
    report = Report(
        prog.name,
        "",
        0,
        mesh,
        tuple(exported.platforms),
        seconds,
        len(text),
        sorted(custom_call_targets(text)),
        list(compiles),
        inputs,
        out_bytes,
        _off_dtype(prog, exported),
        exported.nr_devices,
    )
    if CALLBACK.search(" ".join(report.custom_calls)) or "host_callback" in text:
        report.custom_calls.append("<host callback>")
    return exported, report


def _outputs_bytes(prog: Program, exported) -> int:
    """Bytes per device of the outputs: the state as its input is laid out (donated: it replaces
    the input), the rest replicated (an upper bound for small results)."""
    state_in = None if prog.state_arg is None else prog.args[prog.state_arg]
    outs = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    if state_in is not None:
        state_out = outs[0] if prog.name == "train_step" else outs
        if jax.tree.structure(state_out) == jax.tree.structure(state_in):
            rest = jax.tree.leaves(outs[1]) if prog.name == "train_step" else []
            return sum(
                shard_bytes(a, s.sharding)
                for a, s in zip(jax.tree.leaves(state_out), jax.tree.leaves(state_in))
            ) + sum(shard_bytes(a, None) for a in rest)
    if prog.name in ("prefill", "spec_prefill"):  # the state the decode loop then holds
        return sum(shard_bytes(a, None) for a in exported.out_avals if a.size < 2**20) + sum(
            shard_bytes(a, named(prog.mesh, ("batch", "kv_heads", None, None), a.shape))
            for a in exported.out_avals
            if a.size >= 2**20
        )
    return sum(shard_bytes(a, None) for a in exported.out_avals)


# ----------------------------------------------------------------------------- sizes in HBM


def memory(prog: Program, report: Report, s: Setup) -> Memory:
    """A program's bytes per device: inputs from the exported avals and shardings, activations
    counted from shapes."""
    tcfg = target_config(s.target)
    dcfg = draft_for(tcfg)
    params = sum(report.inputs.get(g, 0) for g in ("params", "head", "vocab"))
    if prog.name == "train_step":
        acts = train_activations(tcfg, dcfg, s.batch, s.train_len, s.ttt_steps, s.train_mesh)
        # the head's state and its gradients (one more copy of the params), plus the batch
        st = report.inputs["state"]
        grads = sum(shard_bytes(a, a.sharding) for a in jax.tree.leaves(prog.args[0].params))
        return Memory(params, 0, st + grads + report.inputs["batch"], acts)
    if prog.name == "serve_score":  # one prompt's pass, no cache kept
        t = prog.args[1].shape[1]
        return Memory(params, 0, 0, prefill_activations(tcfg, 1, t, t, s.mesh))
    if prog.name == "serve_chunk":  # a chunk into a batch of one's cache (the slots' state aside)
        kv = report.inputs["state"]  # the row's cache is the program's whole state
        c, slots_ = prog.args[3].shape[1], jax.tree.leaves(prog.args[1]["v"])[0].shape[-2]
        return Memory(params, kv, 0, prefill_activations(tcfg, 1, c, slots_, s.mesh))
    shape = prog.kwargs["shape"]
    if prog.name in ("prefill", "spec_prefill"):
        state = report.outputs_bytes
        kv = _cache_bytes_out(prog, s, tcfg, dcfg, shape)
        acts = prefill_activations(tcfg, s.batch, shape.prompt_len, shape.slots, s.mesh)
        return Memory(params, kv, max(state - kv, 0), acts)
    st = prog.args[prog.state_arg]
    cache = st.cache if prog.name == "decode_step" else (st.tcache, st.dcache)
    kv = sum(shard_bytes(a, a.sharding) for a in jax.tree.leaves(cache))
    rest = report.inputs["state"] - kv
    if prog.name == "decode_step":
        acts = verify_activations(tcfg, dcfg, s.batch, 1, shape.slots, s.mesh)
    elif prog.name == "serve_admit":  # a batch of one's prefill, beside the slots' state
        acts = prefill_activations(tcfg, 1, shape.prompt_len, shape.slots, s.mesh)
    else:  # a round over the busy slots' rows (serve_round) verifies those rows alone
        rows = (
            prog.args[5].shape[0] if prog.name == "serve_round" and len(prog.args) > 5 else s.batch
        )
        tree = prog.kwargs["tree"]
        acts = verify_activations(tcfg, dcfg, rows, tree.total_tokens, shape.slots, s.mesh)
    return Memory(params, kv, rest, acts)


def _cache_bytes_out(prog, s, tcfg, dcfg, shape) -> int:
    mesh = prog.mesh
    ks, vs = tgt.kv_shapes(s.batch, shape.slots, tcfg.num_kv_heads, tcfg.head_dim)
    sh = tgt.cache_sharding(tcfg, mesh, s.batch)["k"][0]
    kv = tcfg.num_layers * sum(
        shard_bytes(jax.ShapeDtypeStruct(x, jnp.bfloat16), sh) for x in (ks, vs)
    )
    if prog.name == "spec_prefill":
        dslots = shape.slots + prog.kwargs["tree"].tree_slots
        ks, vs = tgt.kv_shapes(s.batch, dslots, dcfg.num_kv_heads, dcfg.head_dim)
        dsh = drf.cache_sharding(dcfg, mesh, s.batch)["k"]
        kv += sum(shard_bytes(jax.ShapeDtypeStruct(x, jnp.bfloat16), dsh) for x in (ks, vs))
    return kv


# ----------------------------------------------------------------------------- one row


def run(name: str, s: Setup, platforms=PLATFORMS) -> tuple[Report, Memory]:
    """Builds, exports and sizes one program: (Report, Memory)."""
    prog = build(name, s)
    _, report = export_program(prog, platforms)
    report.target, report.batch = s.target, s.batch
    return report, memory(prog, report, s)


def row(report: Report, mem: Memory) -> dict[str, Any]:
    """A JSON-ready record of one export."""
    gb = lambda x: round(x / 1e9, 3)  # noqa: E731
    return {
        "target": report.target,
        "program": report.program,
        "batch": report.batch,
        "mesh": report.mesh,
        "platforms": list(report.platforms),
        "export_s": round(report.seconds, 2),
        "module_chars": report.module_chars,
        "custom_calls": report.custom_calls,
        "problems": report.problems,
        "gb_per_device": {
            "params": gb(mem.params),
            "kv_cache": gb(mem.kv_cache),
            "state": gb(mem.state),
            "activations": gb(mem.activations),
            "total": gb(mem.total),
        },
        "fits": mem.fits(),
    }


def flops_check(s: Setup, names=("decode_step", "round_tree", "round_chain")) -> list[dict]:
    """XLA's FLOPs of the real programs (`cost_analysis()` of the unoptimized HLO, lowered on
    this backend) beside the roofline's count of the same shapes, in GFLOP; `xla` is None when
    the backend gives no cost analysis. A mixture-of-experts target is counted as each program
    runs it (`models.target.moe_path` at its target forward's tokens): every expert on every
    token where dense, k experts a token where gathered or ragged. A ragged program lowered on
    the CPU is jax's dense fallback for `ragged_dot` (every group over every row): its `xla` is
    None there (EAGLE3_JAX_MOE_DISPATCH=gather checks the CPU's own dispatch)."""
    tcfg = target_config(s.target)
    dcfg = draft_for(tcfg)
    rows = []
    for name in names:
        prog = build(name, s)
        ran = prog.kwargs.get("cfg") or prog.kwargs["tcfg"]
        tree = prog.kwargs.get("tree")
        tokens = s.batch * (1 if name == "decode_step" else tree.total_tokens)
        path = tgt.moe_path(ran, tokens, s.batch) if ran.num_experts else "dense"
        routing = Routing("dense" if path == "dense" else "routed")
        analysis = prog.fn.lower(*prog.args, **prog.kwargs).cost_analysis() or {}
        slots = prog.kwargs["shape"].slots
        if name == "decode_step":
            model = roofline.plain_step(tcfg, s.batch, slots, routing=routing).flops
        else:
            model = roofline.spec_round(tcfg, dcfg, tree, s.batch, slots, routing=routing).flops
        xla = analysis.get("flops")
        if path == "ragged" and jax.default_backend() == "cpu":
            xla = None
        rows.append(
            {
                "program": name,
                "xla": None if xla is None else xla / 1e9,
                "model": model / 1e9,
                "moe_path": path,
            }  # fmt: skip
        )
    return rows
