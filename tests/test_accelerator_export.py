"""Every jitted program lowers for TPUs and GPUs at real sizes under an 8-device mesh
(`eagle3_jax.accelerators`: programs, lowering): one real-size config per program, batch 1,
exported with `jax.export` for ("tpu", "cuda") from ShapeDtypeStructs (no weights, no
compilation). A program fails on what only the CPU backend accepts: a custom call other than a
sharding annotation (a host callback, a CPU library kernel), work run at trace time (a probe, a
backend query), a float buffer of the params or state in another dtype than the bf16 asked for,
or a size in HBM that a device cannot hold. `benchmarks/accelerator_export.py` runs the full grid
(3 targets x batch 1 and 8)."""

from __future__ import annotations

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
