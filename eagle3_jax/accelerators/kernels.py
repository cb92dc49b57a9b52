"""What a compiled program launches and where a device's time goes: kernel counts from optimized
HLO, the per-layer part of them, and a summary of a `jax.profiler` trace (issue 58 item 1).

Pure functions over text and JSON; nothing here needs a device.

  count_kernels      the kernel-launching instructions of an optimized HLO module
                     (`compiled.as_text()`), by kind: every instruction of the entry computation,
                     of while loops' bodies and conditions, conditionals' branches and called
                     computations (each runs as launches of its own), never the insides of a
                     fusion or of a reduction's combiner. `total` counts each instruction once;
                     `launches` counts what one call launches (a loop's body and condition once
                     a trip, a conditional's dearest branch).
  kernels_per_layer  the same program compiled at two layer counts: the per-layer part and the
                     fixed part of both counts.
  trace_summary      a Chrome/Perfetto trace (`jax.profiler.trace(dir,
                     create_perfetto_trace=True)` writes `plugins/profile/RUN/
                     perfetto_trace.json.gz` beside `HOST.trace.json.gz`; both hold the same
                     events): device busy time against wall time, and the top kernels by device
                     time, within a named `jax.profiler.TraceAnnotation` window if asked.

Which events are the device's: on a GPU the CUDA streams' kernels and copies (threads "Stream
#N..." of a "/device:GPU:K" process); on a TPU its "XLA Ops" line; on the CPU, where XLA runs
its thunks on host threads, the host events that carry an `hlo_op` argument (a while loop's
event encloses its body's: busy time is the union of the intervals, and the top list ranks
self time).
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# opcodes of an optimized module that launch nothing themselves: data plumbing, and the control
# flow whose computations are counted on their own
NO_KERNEL = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
    "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain", "while",
    "conditional", "call", "get-dimension-size",
})  # fmt: skip
# custom-call targets that are matrix products from a library (cuBLAS, cuBLASLt, cuDNN's)
_GEMM_TARGET = re.compile(r"cublas|gemm|matmul", re.IGNORECASE)

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_OPCODE = re.compile(r"([a-z][a-z0-9\-]*)\(")


def hlo_text(compiled_or_text: Any) -> str:
    """The optimized HLO text of a `jax.stages.Compiled` (its `as_text()`), or the text itself."""
    return compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()


def _opcode(rhs: str) -> str | None:
    """The opcode of an instruction's right-hand side "TYPE opcode(operands), attrs": TYPE is a
    shape ("f32[4,4]{1,0}") or a tuple of shapes ("(s32[], f32[4])"), which may hold spaces."""
    rhs = rhs.strip()
    if rhs.startswith("("):
        depth = 0
        for i, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                rhs = rhs[i + 1 :]
                break
    else:
        rhs = rhs.split(" ", 1)[1] if " " in rhs else ""
    m = _OPCODE.match(rhs.strip())
    return m[1] if m else None


def parse_hlo(text: str) -> tuple[dict[str, list[tuple[str, str]]], str | None]:
    """{computation name: [(opcode, instruction line)]} and the entry computation's name."""
    comps: dict[str, list[tuple[str, str]]] = {}
    cur, entry = None, None
    for line in text.split("\n"):
        head = _HEADER.match(line)
        if head and not line.startswith(" "):
            cur = head[2]
            comps[cur] = []
            entry = cur if head[1] else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None and " = " in line:
            op = _opcode(line.split(" = ", 1)[1])
            if op:
                comps[cur].append((op, line))
    return comps, entry


def _called(line: str, key: str) -> list[str]:
    """The computations an attribute names: `body=%b`, `branch_computations={%t, %f}`."""
    m = re.search(rf"\b{key}=\{{([^}}]*)\}}", line) or re.search(rf"\b{key}=%?([\w.\-]+)", line)
    return [t.strip().lstrip("%") for t in m[1].split(",") if t.strip()] if m else []


def _kind(op: str, line: str) -> str:
    """The kind a kernel is counted under: fusions split into XLA's own ("fusion") and custom
    ones ("custom_fusion": Triton or cuDNN products on a GPU, XNNPACK's on a CPU), library
    products ("gemm") apart from other custom calls; any other opcode as itself, with "_" for "-"."""
    if op == "fusion":
        return "custom_fusion" if "kind=kCustom" in line else "fusion"
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', line)
        return "gemm" if target and _GEMM_TARGET.search(target[1]) else "custom_call"
    return op.replace("-", "_")


def count_kernels(compiled_or_text: Any) -> dict:
    """The kernel-launching instructions of an optimized HLO module.

    Returns {"total": instructions that launch a kernel, each counted once, "by_kind": {kind:
    count} (summing to total), "launches": kernels one call launches (a while loop's body and
    condition times its known trip count, once where XLA left none: "unknown_trips"; the
    condition once more for the exit; a conditional's dearest branch), "loops": while loops,
    "unknown_trips", "computations": the computations counted}."""
    comps, entry = parse_hlo(hlo_text(compiled_or_text))
    by_kind: dict[str, int] = {}
    seen: set[str] = set()
    stats = {"loops": 0, "unknown_trips": 0}

    def visit(name: str) -> int:
        """Counts `name`'s kernels into by_kind (once per computation) and returns its launches."""
        first = name not in seen
        seen.add(name)
        n = 0
        for op, line in comps.get(name, []):
            if op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                if first:
                    stats["loops"] += 1
                    stats["unknown_trips"] += trips is None
                k = int(trips[1]) if trips else 1
                body = sum(visit(c) for c in _called(line, "body"))
                cond = sum(visit(c) for c in _called(line, "condition"))
                n += k * (body + cond) + cond
            elif op == "conditional":
                branches = _called(line, "branch_computations") or [
                    *_called(line, "true_computation"),
                    *_called(line, "false_computation"),
                ]
                n += max((visit(b) for b in branches), default=0)
            elif op == "call" or op.endswith("-start") and "calls=" in line:
                n += sum(visit(c) for c in _called(line, "to_apply" if op == "call" else "calls"))
            elif op not in NO_KERNEL and not op.endswith("-done"):
                n += 1
                if first:
                    kind = _kind(op, line)
                    by_kind[kind] = by_kind.get(kind, 0) + 1
        return n

    launches = visit(entry) if entry else 0
    return {
        "total": sum(by_kind.values()),
        "by_kind": dict(sorted(by_kind.items())),
        "launches": launches,
        **stats,
        "computations": len(seen),
    }


def kernels_per_layer(compile_at: Callable[[int], Any], layers: tuple[int, int] = (2, 4)) -> dict:
    """One program compiled at two layer counts (`compile_at(n)` -> a Compiled or its HLO text),
    counted: the per-layer part is the difference over the layers added, the fixed part what is
    left of the smaller count. For both `total` (instructions) and `launches` (a call's kernels).

    Returns {"layers": [a, b], "counts": [count_kernels at a, at b], "per_layer": {"total",
    "launches", "by_kind"}, "fixed": {"total", "launches"}}; a per-layer figure that is not a
    whole number says that XLA compiled some layers differently (fused across them, say)."""
    a, b = layers
    if not 0 < a < b:
        raise ValueError(f"layers {layers}: two counts, the first smaller and positive")
    ca, cb = count_kernels(compile_at(a)), count_kernels(compile_at(b))
    per = {k: (cb[k] - ca[k]) / (b - a) for k in ("total", "launches")}
    kinds = sorted(set(ca["by_kind"]) | set(cb["by_kind"]))
    per_kind = {k: (cb["by_kind"].get(k, 0) - ca["by_kind"].get(k, 0)) / (b - a) for k in kinds}
    return {
        "layers": [a, b],
        "counts": [ca, cb],
        "per_layer": {**per, "by_kind": {k: v for k, v in per_kind.items() if v}},
        "fixed": {k: ca[k] - a * per[k] for k in ("total", "launches")},
    }


# ----------------------------------------------------------------------------- traces


def find_trace(log_dir: str | Path) -> Path:
    """The newest trace file a `jax.profiler.trace(log_dir, ...)` wrote: its Perfetto JSON, or
    else the Chrome JSON (`*.trace.json.gz`)."""
    root = Path(log_dir)
    for pattern in ("perfetto_trace.json.gz", "*.trace.json.gz"):
        found = sorted(root.rglob(pattern), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
    raise FileNotFoundError(f"no trace under {root}")


def load_trace(trace: str | Path | dict | list) -> list[dict]:
    """The events of a Chrome-format trace: a path (gzipped or not), its parsed JSON (an object
    with "traceEvents" or a bare list), or the list itself."""
    if isinstance(trace, (str, Path)):
        raw = Path(trace).read_bytes()
        trace = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    return trace["traceEvents"] if isinstance(trace, dict) else list(trace)


def device_threads(events: Iterable[dict]) -> list[str]:
    """The names of the device processes' threads ("/device:GPU:0: Stream #13(Compute)", ...):
    what a trace offered, when its summary needs checking."""
    events = list(events)
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    return sorted(
        f"{procs[e['pid']]}: {e['args']['name']}"
        for e in events
        if e.get("name") == "thread_name" and procs.get(e["pid"], "").startswith("/device:")
    )


def device_events(events: Iterable[dict]) -> tuple[list[dict], str]:
    """The complete ("X") events that are the device's work, and which kind they are: "gpu
    streams", "xla ops line" (TPU) or "cpu thunks" (see the module docstring)."""
    events = list(events)
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("name") == "thread_name"
    }
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]

    def on_device(e: dict) -> bool:
        return procs.get(e["pid"], "").startswith("/device:")

    def thread(e: dict) -> str:
        return threads.get((e["pid"], e.get("tid")), "")

    streams = [e for e in xs if on_device(e) and thread(e).startswith("Stream")]
    if streams:
        return streams, "gpu streams"
    ops = [e for e in xs if on_device(e) and thread(e) == "XLA Ops"]
    if ops:
        return ops, "xla ops line"
    thunks = [
        e
        for e in xs
        if "hlo_op" in e.get("args", {}) and not str(e.get("name", "")).startswith("end: ")
    ]
    return thunks, "cpu thunks"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _self_times(ops: list[dict]) -> list[float]:
    """Each event's duration less the events nested inside it on its own thread (a CPU while
    loop's event holds its body's; a GPU stream's kernels do not nest)."""
    out = [float(e["dur"]) for e in ops]
    by_thread: dict[tuple, list[int]] = {}
    for i, e in enumerate(ops):
        by_thread.setdefault((e["pid"], e.get("tid")), []).append(i)
    for idx in by_thread.values():
        idx.sort(key=lambda i: (ops[i]["ts"], -ops[i]["dur"]))
        stack: list[int] = []
        for i in idx:
            s = ops[i]["ts"]
            while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] <= s:
                stack.pop()
            if stack:
                out[stack[-1]] -= ops[i]["dur"]
            stack.append(i)
    return out


def _long_name(e: dict) -> str | None:
    """An annotation's full name: the profiler keeps "a:b" as name "b", long_name "a:b"."""
    return e.get("args", {}).get("long_name")


def trace_summary(
    trace: str | Path | dict | list, window: str | None = None, top: int = 10
) -> dict:
    """Device time against wall time, and the `top` kernels by device time.

    `window`: the name of a `jax.profiler.TraceAnnotation` (a host event): the wall time is the
    sum of its occurrences and only device events that start inside one count; without it, the
    wall time runs from the first device event's start to the last one's end. Times in ms.

    Returns {"source" (`device_events`), "device_threads" (`device_threads`), "window",
    "windows" (occurrences), "wall_ms", "device_busy_ms" (the union of the device events'
    intervals), "busy_fraction", "events" (device events counted), "top": [{"name", "calls",
    "total_ms" (self time), "mean_us", "share" (of the summed self time), "hlo_op" (of the first
    such event, if any)}]}."""
    events = load_trace(trace)
    ops, source = device_events(events)
    spans: list[tuple[float, float]] = []
    if window is not None:
        spans = [
            (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            for e in events
            if e.get("ph") == "X" and "dur" in e and window in (e.get("name"), _long_name(e))
        ]
        ops = [e for e in ops if any(s <= e["ts"] < t for s, t in spans)]
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ops]
    if window is not None:
        wall = sum(t - s for s, t in spans)
        # a device event that starts inside the window and runs past its end (a host that did
        # not wait) counts up to the window's end only
        intervals = [(s, min(t, max(w for v, w in spans if v <= s))) for s, t in intervals]
    else:
        wall = max((t for _, t in intervals), default=0.0) - min(
            (s for s, _ in intervals), default=0.0
        )
    busy = _union(intervals)
    groups: dict[str, dict] = {}
    for e, self_us in zip(ops, _self_times(ops), strict=True):
        g = groups.setdefault(
            str(e.get("name")),
            {"name": str(e.get("name")), "calls": 0, "total_us": 0.0,
             "hlo_op": e.get("args", {}).get("hlo_op")},
        )  # fmt: skip
        g["calls"] += 1
        g["total_us"] += max(self_us, 0.0)
    summed = sum(g["total_us"] for g in groups.values()) or 1.0
    ranked = sorted(groups.values(), key=lambda g: -g["total_us"])[:top]
    return {
        "source": source,
        "device_threads": device_threads(events),
        "window": window,
        "windows": len(spans) if window is not None else None,
        "wall_ms": wall / 1e3,
        "device_busy_ms": busy / 1e3,
        "busy_fraction": busy / wall if wall > 0 else None,
        "events": len(ops),
        "top": [
            {
                "name": g["name"],
                "calls": g["calls"],
                "total_ms": g["total_us"] / 1e3,
                "mean_us": g["total_us"] / g["calls"],
                "share": g["total_us"] / summed,
                "hlo_op": g["hlo_op"],
            }
            for g in ranked
        ],
    }
