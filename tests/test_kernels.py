"""accelerators/kernels.py: kernel counts of optimized HLO (a hand-written GPU-like module counted
exactly, compiled programs whose structure is known, the engine's programs per target layer) and
the trace summary (a hand-made GPU trace exactly, a real CPU trace of a jitted loop)."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest
from helpers import load_script

from eagle3_jax.accelerators import kernels

# an optimized module as XLA:GPU prints it: a cuBLAS product, a Triton product (a custom fusion),
# loop fusions, a copy, a while loop of 4 trips whose body holds a cuBLAS product and a fusion,
# a conditional whose branches launch 2 and 1 kernels, and a reduction's combiner and fusions'
# insides that must not count
GPU_HLO = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[8,8]{1,0})->f32[8,8]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a, %b)
}

%fused_exp (p0: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %m = f32[8,8]{1,0} multiply(%p0, %p0)
  ROOT %e = f32[8,8]{1,0} exponential(%m)
}

%triton_gemm (p0: bf16[8,8], p1: bf16[8,8]) -> f32[8,8] {
  %p0 = bf16[8,8]{1,0} parameter(0)
  %p1 = bf16[8,8]{1,0} parameter(1)
  ROOT %d = f32[8,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,8]{1,0} get-tuple-element(%t), index=1
  %g = f32[8,8]{1,0} custom-call(%x, %x), custom_call_target="__cublas$gemm"
  %f = f32[8,8]{1,0} fusion(%g), kind=kLoop, calls=%fused_exp
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[8,8]{1,0}) tuple(%n, %f)
}

%cond (t: (s32[], f32[8,8])) -> pred[] {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %k = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

%then (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  %f1 = f32[8,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_exp
  ROOT %f2 = f32[8,8]{1,0} fusion(%f1), kind=kLoop, calls=%fused_exp
}

%else (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  ROOT %c = f32[8,8]{1,0} copy(%x)
}

ENTRY %main (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[8,8]{1,0}) tuple(%zero, %x)
  %w = (s32[], f32[8,8]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %y = f32[8,8]{1,0} get-tuple-element(%w), index=1
  %bx = bf16[8,8]{1,0} convert(%y)
  %tg = f32[8,8]{1,0} fusion(%bx, %bx), kind=kCustom, calls=%triton_gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %s = f32[] reduce(%tg, %zero), dimensions={0,1}, to_apply=%add
  %p = pred[] compare(%s, %s), direction=GT
  %cd = f32[8,8]{1,0} conditional(%p, %tg, %tg), true_computation=%then, false_computation=%else
  ROOT %out = f32[8,8]{1,0} copy(%cd)
}
"""  # noqa: E501


def test_count_kernels_of_a_gpu_module_by_kind():
    """Each launching instruction once, by kind; a call's launches with the loop's trips and the
    dearer branch; the combiner and the fusions' insides never count."""
    k = kernels.count_kernels(GPU_HLO)
    # entry: convert, the Triton fusion, reduce, compare, copy; body: gemm, fusion, add;
    # cond: compare; branches: two fusions, a copy
    assert k["by_kind"] == {
        "gemm": 1, "custom_fusion": 1, "fusion": 3, "convert": 1, "reduce": 1, "compare": 2,
        "copy": 2, "add": 1,
    }  # fmt: skip
    assert k["total"] == 12 == sum(k["by_kind"].values())
    # 5 in the entry + 4 trips x (3 body + 1 condition) + the exit's condition + 2 (then)
    assert k["launches"] == 5 + 4 * 4 + 1 + 2
    assert (k["loops"], k["unknown_trips"]) == (1, 0)
    # without a known trip count the loop is counted once, and said so
    unknown = kernels.count_kernels(
        GPU_HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
    )
    assert unknown["launches"] == 5 + 4 + 1 + 2 and unknown["unknown_trips"] == 1
    # a Compiled and its text count the same
    compiled = jax.jit(lambda x: jnp.tanh(x @ x)).lower(jnp.ones((8, 8))).compile()
    assert kernels.count_kernels(compiled) == kernels.count_kernels(compiled.as_text())


def _matmuls(n: int):
    """n products, each followed by tanh, in a jitted function, compiled."""

    def f(x, ws):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    return jax.jit(f).lower(jnp.ones((16, 16)), [jnp.ones((16, 16))] * n).compile()


def test_count_kernels_grows_with_the_products_and_the_trips():
    """Products XLA cannot fuse into one another: 4 launch more than 2, twice what 2 launch more
    than 1; a loop's launches grow by its body's kernels a trip, its static count not at all."""
    n1, n2, n4 = (kernels.count_kernels(_matmuls(n)) for n in (1, 2, 4))
    assert n4["total"] - n2["total"] == 2 * (n2["total"] - n1["total"]) > 0
    assert n4["launches"] == n4["total"] and n4["loops"] == 0

    def looped(trips):
        f = lambda x: jax.lax.fori_loop(0, trips, lambda i, c: jnp.tanh(c @ x) + i, x)  # noqa: E731
        return kernels.count_kernels(jax.jit(f).lower(jnp.ones((16, 16))).compile())

    l5, l10 = looped(5), looped(10)
    assert l5["total"] == l10["total"] and l5["loops"] == 1 and l5["unknown_trips"] == 0
    assert l10["launches"] - l5["launches"] > 0
    assert looped(20)["launches"] - l10["launches"] == 2 * (l10["launches"] - l5["launches"])


def test_kernels_per_layer_separates_the_fixed_part():
    """Two layer counts of a program with a fixed head and tail: the per-layer part is each
    layer's kernels, the fixed part what the rest launches; both counts are returned."""

    def compile_at(n):
        def f(x, ws):
            x = jnp.sin(x) @ x  # a fixed head: a product and its input's fusion
            for w in ws:
                x = jnp.tanh(x @ w)
            return jnp.sum(x, axis=0)  # a fixed tail

        return jax.jit(f).lower(jnp.ones((16, 16)), [jnp.ones((16, 16))] * n).compile()

    r = kernels.kernels_per_layer(compile_at, (2, 4))
    per = kernels.count_kernels(_matmuls(2))["total"] - kernels.count_kernels(_matmuls(1))["total"]
    assert r["per_layer"]["total"] == per and r["per_layer"]["launches"] == per
    assert r["fixed"]["total"] > 0
    assert r["counts"][0]["total"] == r["fixed"]["total"] + 2 * per
    assert r["layers"] == [2, 4] and sum(r["per_layer"]["by_kind"].values()) == per
    with pytest.raises(ValueError):
        kernels.kernels_per_layer(compile_at, (4, 2))


@pytest.fixture(scope="module")
def gs():
    """scripts/device_steps/gpu_speed.py (its program builders)."""
    load_script("scripts/device_job.py")  # puts scripts/ on sys.path
    from device_steps import gpu_speed

    return gpu_speed


@pytest.mark.parametrize("tree", [None, "chain"])
def test_kernels_per_layer_of_the_engines_programs(gs, tree):
    """plain.decode_step and speculative.round_step on the toy target (weights' shapes only):
    a whole number of kernels per layer, a fixed part, and the toy's own 4 layers counted as
    fixed + 4 x per layer."""
    trees = gs._trees("chain")

    def compile_at(n):
        x = gs.inputs(*gs.shapes("tiny", layers=n), abstract=True)
        fn, fixed, state, _ = gs.step_program(x, 1, 16, 16, trees.get(tree), abstract=True)
        return gs.compile_step(fn, fixed, state)

    r = kernels.kernels_per_layer(compile_at, (3, 5))
    for key in ("total", "launches"):
        per, fixed = r["per_layer"][key], r["fixed"][key]
        assert per > 0 and per == int(per) and fixed > 0, r
    four = kernels.count_kernels(compile_at(4))
    assert four["launches"] == r["fixed"]["launches"] + 4 * r["per_layer"]["launches"]


# ----------------------------------------------------------------------------- traces


def _gpu_trace():
    """A hand-made trace as jax's profiler writes one on a GPU: the host's python thread with the
    window annotation, the device's compute stream (kernels and a copy) and its derived "XLA
    Ops" line, which must not count twice."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 1, "tid": 10, "name": "thread_name", "args": {"name": "python"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 7, "tid": 3, "name": "thread_name",
         "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "pid": 7, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]  # fmt: skip
    x = lambda pid, tid, ts, dur, name, **a: {  # noqa: E731
        "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": a,
    }  # fmt: skip
    events = [
        x(1, 10, 100.0, 100.0, "step", long_name="gpu_speed:step"),  # the window, 100 us
        x(7, 3, 110.0, 30.0, "gemm_kernel", hlo_op="custom-call.1"),
        x(7, 3, 150.0, 10.0, "loop_fusion", hlo_op="fusion.2"),
        x(7, 3, 160.0, 10.0, "gemm_kernel", hlo_op="custom-call.3"),
        x(7, 3, 185.0, 5.0, "MemcpyD2H"),
        x(7, 9, 110.0, 80.0, "fusion.2"),  # derived line: left out
        x(7, 3, 400.0, 50.0, "gemm_kernel"),  # after the window: left out
    ]
    return {"displayTimeUnit": "ns", "traceEvents": meta + events}


def test_trace_summary_of_a_gpu_trace(tmp_path):
    """Busy time is the streams' kernels and copies in the window, against the window's wall
    time; kernels ranked by their time; the file gzipped or not reads the same."""
    path = tmp_path / "perfetto_trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(_gpu_trace()).encode()))
    s = kernels.trace_summary(path, window="gpu_speed:step")
    assert s["source"] == "gpu streams" and s["windows"] == 1 and s["events"] == 4
    assert s["device_threads"] == ["/device:GPU:0: Stream #13(Compute)", "/device:GPU:0: XLA Ops"]
    assert s["wall_ms"] == pytest.approx(0.1) and s["device_busy_ms"] == pytest.approx(0.055)
    assert s["busy_fraction"] == pytest.approx(0.55)
    assert [(k["name"], k["calls"]) for k in s["top"]] == [
        ("gemm_kernel", 2), ("loop_fusion", 1), ("MemcpyD2H", 1),
    ]  # fmt: skip
    assert s["top"][0]["total_ms"] == pytest.approx(0.04) and s["top"][0]["mean_us"] == 20.0
    assert s["top"][0]["share"] == pytest.approx(40 / 55)
    assert s["top"][0]["hlo_op"] == "custom-call.1"
    whole = kernels.trace_summary(_gpu_trace())  # no window: first to last device event
    assert whole["events"] == 5 and whole["wall_ms"] == pytest.approx(0.34)
    assert kernels.trace_summary(_gpu_trace()["traceEvents"], top=1)["top"][0]["calls"] == 3


def test_trace_summary_of_a_cpu_trace(tmp_path):
    """A real trace of a jitted loop on the CPU (XLA's thunks on host threads, the loop's event
    around its body's): every call's body kernels are found, busy time within the window, the
    file jax.profiler wrote found under the log folder."""
    trips, calls = 6, 3
    f = jax.jit(lambda x: jax.lax.fori_loop(0, trips, lambda i, c: jnp.tanh(c @ x) + i, x))
    x = jnp.ones((64, 64)) * 0.01
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        with jax.profiler.TraceAnnotation("loop_window"):
            for _ in range(calls):
                f(x).block_until_ready()
    path = kernels.find_trace(tmp_path)
    assert path.name == "perfetto_trace.json.gz"
    s = kernels.trace_summary(path, window="loop_window", top=50)
    assert s["source"] == "cpu thunks" and s["windows"] == 1 and s["device_threads"] == []
    assert 0 < s["device_busy_ms"] <= s["wall_ms"] and 0 < s["busy_fraction"] <= 1
    assert s["events"] > 0 and sum(k["share"] for k in s["top"]) == pytest.approx(1.0)
    # the loop's body runs `trips` times a call: its kernels are called trips x calls times
    assert max(k["calls"] for k in s["top"]) == trips * calls
    assert all(k["total_ms"] >= 0 for k in s["top"])
    with pytest.raises(FileNotFoundError):
        kernels.find_trace(tmp_path / "nothing")


def test_fused_projections_launch_fewer_kernels_a_layer(gs):
    """The `fused_projections` variant (q/k/v and gate/up one product each, as decoding loads a
    target on accelerators) counted against the baseline: fewer kernels a layer, the same
    outside the layers."""
    per = {}
    for variant in ("baseline", "fused_projections"):

        def compile_at(n, variant=variant):
            x = gs.inputs(*gs.shapes("tiny", variant, n), True, variant)
            assert ("wqkv" in x.tparams["layers"][0]) == (variant != "baseline")
            fn, fixed, state, _ = gs.step_program(x, 1, 16, 16, None, abstract=True)
            return gs.compile_step(fn, fixed, state)

        per[variant] = kernels.kernels_per_layer(compile_at, (3, 5))
    base, fused = per["baseline"], per["fused_projections"]
    assert 0 < fused["per_layer"]["launches"] < base["per_layer"]["launches"]
    assert fused["fixed"]["launches"] == base["fixed"]["launches"]
