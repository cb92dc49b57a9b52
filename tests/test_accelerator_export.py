"""Every jitted program lowers for TPUs and GPUs at real sizes under an 8-device mesh
(`eagle3_jax.accelerators`: programs, lowering): one real-size config per program, batch 1,
exported with `jax.export` for ("tpu", "cuda") from ShapeDtypeStructs (no weights, no
compilation). A program fails on what only the CPU backend accepts: a custom call other than a
sharding annotation (a host callback, a CPU library kernel), work run at trace time (a probe, a
backend query), a float buffer of the params or state in another dtype than the bf16 asked for,
or a size in HBM that a device cannot hold. The mixture-of-experts targets (Qwen3-30B-A3B,
gpt-oss-20b) lower their decoding programs with each device holding its own eighth of the
experts, and their compiled programs move no expert weight. `benchmarks/accelerator_export.py`
runs the full grid (every `specs.REAL_TARGETS` target x batch 1 and 8)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.accelerators import lowering, programs, specs
from eagle3_jax.accelerators.hbm import Memory
from eagle3_jax.models import target as tgt
from eagle3_jax.sharding import make_mesh

# one real-size target per program, so each family is lowered by some program
CASES = {
    "prefill": "qwen3_4b",
    "spec_prefill": "olmo2_7b",
    "decode_step": "olmo2_7b",
    "round_tree": "llama31_8b",
    "round_chain": "qwen3_4b",
    "train_step": "llama31_8b",
}


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
    if len(jax.devices()) < 8:
        pytest.skip(
            "needs 8 (simulated) devices: XLA_FLAGS=--xla_force_host_platform_device_count=8"
        )


@pytest.mark.parametrize("program", list(CASES))
def test_program_lowers_for_tpu_and_cuda(program):
    setup = programs.Setup(target=CASES[program], batch=1)
    prog = programs.build(program, setup)
    exported, report = lowering.export_program(prog)
    report.target, report.batch = setup.target, setup.batch
    assert exported.platforms == ("tpu", "cuda") and exported.nr_devices == 8
    assert report.problems == [], report.problems
    # bf16 weights laid out over the mesh: one device holds an eighth of the target
    tcfg = specs.target_config(setup.target)
    shapes = jax.eval_shape(lambda k: tgt.init_params(tcfg, k, jnp.bfloat16), jax.random.key(0))
    full = sum(x.size * 2 for x in jax.tree.leaves(shapes))
    assert full / 8 <= report.inputs["params"] <= 1.01 * full / 8
    mem = lowering.memory(prog, report, setup)
    if program != "train_step":  # decoding runs what an accelerator's engine runs (backends.py)
        assert {"wqkv", "w_gate_up"} <= set(prog.args[0]["layers"][0])
        assert (prog.kwargs.get("cfg") or prog.kwargs["tcfg"]).attention == "mixed"
    if program in ("decode_step", "round_tree", "round_chain"):
        # the target's bf16 cache, kv heads over the 8 devices
        shape = prog.kwargs["shape"]
        per_layer = 2 * shape.slots * tcfg.num_kv_heads * tcfg.head_dim * 2
        want = tcfg.num_layers * per_layer / min(8, tcfg.num_kv_heads)
        assert want <= mem.kv_cache <= 1.2 * want
    for device, fits in mem.fits().items():
        assert fits, f"{program} ({setup.target}) needs {mem.total / 1e9:.1f} GB on a {device}"
    # the reporting tree verifies 60 nodes per round; the chain one more than its depth
    if program == "round_tree":
        assert prog.kwargs["tree"].total_tokens == 60 and prog.kwargs["tree"].top_k == 10


@pytest.mark.parametrize("program", ["serve_admit", "serve_round", "serve_score", "serve_chunk"])
def test_serving_programs_lower_for_tpu_and_cuda(program):
    """`serve`'s programs for 8 slots of Llama 3.1 8B (each with 20 log-probabilities kept): an
    admission into a slot, a round over 4 of the 8 slots' rows (the target cache read in place),
    an echoed prompt's scoring and a chunked admission's 512-token chunk (`--prefill-chunk`),
    with the engine's state layout (the target cache's kv heads over the 8 devices) and nothing
    only a CPU accepts; each fits every device."""
    setup = programs.Setup(target="llama31_8b", batch=8)
    prog = programs.build(program, setup)
    exported, report = lowering.export_program(prog)
    assert exported.platforms == ("tpu", "cuda") and exported.nr_devices == 8
    assert report.problems == [], report.problems
    tcfg = specs.target_config(setup.target)
    if program == "serve_chunk":  # the row's cache: a batch of one, kv heads over 8
        row = jax.tree.leaves(prog.args[1])
        slots = row[0].shape[-1]
        per_layer = 2 * slots * tcfg.num_kv_heads * tcfg.head_dim * 2
        assert sum(lowering.shard_bytes(a, a.sharding) for a in row) == (
            tcfg.num_layers * per_layer / 8
        )  # fmt: skip
        assert prog.args[3].shape == (1, programs.SERVE_CHUNK)
    elif program != "serve_score":
        slots = prog.kwargs["shape"].slots  # an admission's batch of one has the same S
        per_layer = 2 * 8 * slots * tcfg.num_kv_heads * tcfg.head_dim * 2  # k and v, bf16
        cache = jax.tree.leaves(prog.args[4].tcache)
        assert sum(lowering.shard_bytes(a, a.sharding) for a in cache) == (
            tcfg.num_layers * per_layer / 8
        )  # fmt: skip
    mem = lowering.memory(prog, report, setup)
    assert all(mem.fits().values()), mem


# mixture-of-experts targets: name -> (experts, bf16 bytes of the whole target)
MOE = {"qwen3_30b_a3b": (128, 61.1e9), "gpt_oss_20b": (32, 41.8e9)}


@pytest.mark.parametrize("program", ["decode_step", "round_tree"])
@pytest.mark.parametrize("target", list(MOE))
def test_moe_target_lowers_with_its_experts_over_the_model_axis(target, program):
    """Qwen3-30B-A3B (48 routed layers, 128 experts of width 768, top 8) and gpt-oss-20b (24
    layers, 32 experts of width 2880, top 4, its MXFP4 experts in bf16) at real size on a 1 x 8
    mesh: the plain step and the reporting-tree round export for TPUs and GPUs with nothing a
    device would object to, every expert matrix laid out [E / 8, ...] per device (expert
    parallelism), one device holding an eighth of the target's bf16 weights, and the program
    fitting every chip's HBM. The experts run routed (`models.target._moe_on_mesh`): each
    device sorts the pairs routed to its own experts through `ragged_dot` (a step's 8 or 4
    pairs are more than a third of a device's 16 or 4 experts) and no [..., E, F'] activations
    of the dense dispatch are made."""
    experts, nbytes = MOE[target]
    setup = programs.Setup(target=target, batch=1)
    prog = programs.build(program, setup)
    exported, report = lowering.export_program(prog)
    assert exported.nr_devices == 8 and report.problems == [], report.problems
    tcfg = specs.target_config(target)
    ran = prog.kwargs.get("cfg") or prog.kwargs["tcfg"]
    assert (ran.moe_dispatch, ran.moe_mesh) == ("ragged", prog.mesh)
    assert tgt.moe_split(ran, 1) == (1, 8) and tgt.moe_path(ran, 1, 1) == "ragged"
    text = exported.mlir_module()
    assert "ragged_dot" in text and f"x{experts}x{tcfg.moe_intermediate_size}x" not in text
    assert tcfg.moe_layers == tuple(range(tcfg.num_layers)) and tcfg.num_experts == experts
    for layer in prog.args[0]["layers"]:
        for name in ("we_gate", "we_up", "we_down"):
            w = layer[name]
            assert w.sharding.spec[0] == "model", (name, w.sharding.spec)
            assert w.sharding.shard_shape(w.shape)[0] == experts // 8
    shapes = jax.eval_shape(lambda k: tgt.init_params(tcfg, k, jnp.bfloat16), jax.random.key(0))
    full = sum(x.size * 2 for x in jax.tree.leaves(shapes))
    assert full == pytest.approx(nbytes, rel=0.01)
    assert full / 8 <= report.inputs["params"] <= 1.01 * full / 8
    mem = lowering.memory(prog, report, setup)
    for device, fits in mem.fits().items():
        assert fits, f"{program} ({target}) needs {mem.total / 1e9:.1f} GB on a {device}"


@pytest.mark.parametrize(
    "program", ["decode_step", pytest.param("round_tree", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("target", list(MOE))
def test_moe_program_moves_no_expert_weights(target, program, monkeypatch):
    """Compiled for this CPU's 8 devices (the SPMD partitioner inserts the collectives), two of
    the target's routed layers at real width: each device's parameters hold its E / 8 experts
    and no all-gather has an expert matrix's shape (each device's partial sum over its experts
    is all-reduced instead). Two layers, not all: the layers are alike, and the compile takes
    2-4 s for the plain step (9-13 s for the round, marked slow)."""
    two = {**specs.REAL_TARGETS[target], "num_hidden_layers": 2}
    if "layer_types" in two:  # gpt-oss: one sliding-window layer and one full
        two["layer_types"] = two["layer_types"][:2]
    monkeypatch.setitem(specs.REAL_TARGETS, "moe_2_layers", two)
    tcfg = specs.target_config("moe_2_layers")
    d, f, local = tcfg.hidden_size, tcfg.moe_intermediate_size, MOE[target][0] // 8
    prog = programs.build(program, programs.Setup(target="moe_2_layers", batch=1))
    hlo = prog.fn.lower(*prog.args, **prog.kwargs).compile().as_text()
    held = re.findall(rf"bf16\[{local},(?:{d},{f}|{f},{d})\]\S* parameter\(", hlo)
    assert len(held) >= 2 * 3, f"each device should hold [{local}, ...] of every expert matrix"
    gathered = [
        dims
        for dims in re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo)
        if sorted(map(int, dims.split(",")))[-2:] == sorted((d, f))
    ]
    assert not gathered, gathered
    assert "all-reduce(" in hlo


def test_moe_training_step_runs_the_targets_experts_routed(monkeypatch):
    """The TTT training step on Qwen3-30B-A3B (two routed layers at real width, a 1 x 8 mesh,
    16 x 2,048 tokens) computes its target features as `training.loop` does: each device sorts
    its rows' pairs for its own 16 experts through `ragged_dot`, with no [..., 128, 768]
    activations of the dense dispatch (16x the routed FLOPs), and exports for TPUs and GPUs."""
    two = {**specs.REAL_TARGETS["qwen3_30b_a3b"], "num_hidden_layers": 2}
    monkeypatch.setitem(specs.REAL_TARGETS, "moe_2_layers", two)
    prog = programs.build("train_step", programs.Setup(target="moe_2_layers", batch=16))
    exported, report = lowering.export_program(prog)
    assert exported.nr_devices == 8 and report.problems == [], report.problems
    text = exported.mlir_module()
    assert "ragged_dot" in text and "x128x768x" not in text


@pytest.mark.parametrize("program", ["decode_step", "round_tree"])
def test_moe_on_one_chip_lowers_its_routed_dispatch(program, monkeypatch):
    """On one chip (a 1 x 1 mesh) Qwen3-30B-A3B's routed layers (two of them, at real width) take
    a TPU's dispatch (`backends.moe_dispatch_wanted`: ragged): the plain step gathers its token's
    8 experts (no product over all 128) and the reporting tree's 60 tokens go through
    `ragged_dot`; both export for TPUs and GPUs with nothing a device would object to (a GPU
    decodes with "gather" until its ragged_dot is measured)."""
    two = {**specs.REAL_TARGETS["qwen3_30b_a3b"], "num_hidden_layers": 2}
    monkeypatch.setitem(specs.REAL_TARGETS, "moe_2_layers", two)
    prog = programs.build(program, programs.Setup(target="moe_2_layers", batch=1, mesh=(1, 1)))
    tcfg = prog.kwargs.get("cfg") or prog.kwargs["tcfg"]
    assert tcfg.moe_dispatch == "ragged"
    exported, report = lowering.export_program(prog)
    assert exported.nr_devices == 1 and report.problems == [], report.problems
    text = exported.mlir_module()
    assert ("ragged_dot" in text) == (program == "round_tree")
    assert "x128x768x" not in text  # no dense product's [B, T, 128 experts, 768] activations
    if program == "decode_step":  # the token's 8 experts' gate/up matrices, gathered
        assert "tensor<8x2048x768xbf16>" in text


def _toy(fn, dtype=jnp.bfloat16):
    mesh = make_mesh(1, 8, jax.devices()[:8])
    x = jax.ShapeDtypeStruct((8, 16), dtype, sharding=NamedSharding(mesh, P(None, "model")))
    return programs.Program(fn.__name__, jax.jit(fn), (x,), {}, mesh, {"params": 1})


def test_the_checks_catch_what_only_a_cpu_accepts():
    def probe(x):  # measures something on this machine while tracing
        with jax.ensure_compile_time_eval():
            n = float(jax.jit(lambda a: a.sum())(np.ones(3, np.float32)))
        return x * n

    def backend(x):  # a program shaped by the exporting machine's backend
        return x * (2 if jax.default_backend() == "cpu" else 1)

    def fp32(x):
        return x * 2

    def callback(x):
        return jax.pure_callback(np.asarray, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    assert "at trace time: ['compile']" in lowering.export_program(_toy(probe))[1].problems
    assert (
        "at trace time: ['default_backend']" in lowering.export_program(_toy(backend))[1].problems
    )
    assert lowering.export_program(_toy(fp32, jnp.float32))[1].off_dtype
    assert lowering.export_program(_toy(fp32))[1].problems == []
    # a host callback lowers for neither platform list: not for two ("multi-platform lowering"),
    # nor for one that is not this machine's backend
    for platforms in (lowering.PLATFORMS, ("cuda",)):
        try:
            _, report = lowering.export_program(_toy(callback), platforms)
        except (NotImplementedError, ValueError):
            continue
        assert report.problems


def test_fits_counts_each_chip_as_the_cost_model_sizes_it():
    """One capacity per chip: a program between 16e9 bytes and 16 GiB fits a v5e (16 GiB), and
    one byte over a chip's HBM does not fit it."""
    assert specs.HBM_BYTES == {name: d.hbm_bytes for name, d in specs.DEVICES.items()}
    between = Memory(params=int(16.5e9), kv_cache=0, state=0, activations=0)
    assert between.fits()["TPU v5e"] and between.fits()["H100"]
    for name, device in specs.DEVICES.items():
        over = Memory(params=int(device.hbm_bytes) + 1, kv_cache=0, state=0, activations=0)
        assert not over.fits()[name]
