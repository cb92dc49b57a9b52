"""What decoding does differently by backend, decided in one place before anything compiles.

On the CPU the few-row products are the ones this machine measured faster (`cpu_tuning`), a
layer's seven projections stay seven products, and attention is exact (the paths the CPU's probes
and figures were taken with). On a GPU or TPU, where a decode step at batch 1 is a chain of small
kernels and each costs a fixed few microseconds whatever its size (issue 58: 20-23 kernels a
layer, 47 % of an H200's bandwidth at 8B), q/k/v and gate/up are fused into one product each at
load (`models.target.fuse_projections`); with weights that are not fp32, attention takes its
products' inputs in their dtype with fp32 accumulation, a verification's cached and new parts
merged by their log-sum-exp (`models.layers.mixed_attention`), as flash attention does, and on a
GPU a decode step's and a verification's cached part run through JAX's Pallas flash-decoding
kernel, which reads only the valid slots (`models.layers.pallas_attention`). A
mixture-of-experts target's routed layers run only their tokens' chosen experts on one device
(`models.target.moe_path`: a step's few experts gathered everywhere, and on a TPU larger
forwards sorted by expert through `jax.lax.ragged_dot`), and on a mesh each device does so for
its own rows and its own experts (expert parallelism: no expert's weights move). XLA
is asked to capture the programs' kernels, loops and conditionals included, as CUDA graphs
(command buffers), so a round is launched as a few graphs rather than thousands of kernels.

Entry points call `set_xla_flags()` before jax starts a backend (cli/__init__.py does, for every
command) and `prepare_target` once the target is loaded. Environment overrides, for measuring one
choice against the other in one run (scripts/device_steps/gpu_speed.py):
  EAGLE3_JAX_FUSED_PROJECTIONS  1 / 0: fuse or not, whatever the backend (unset: by backend)
  EAGLE3_JAX_ATTENTION          exact / mixed / pallas, whatever the backend and dtype (unset:
                                as above)
  EAGLE3_JAX_MOE_DISPATCH       dense / gather / ragged, whatever the backend and mesh (unset:
                                as above)
  EAGLE3_JAX_MOE_GATHER_PAIRS   a routed forward gathers while its n k pairs are at most this
                                times a device's experts (unset: 1 on the CPU, 1/3 elsewhere)
  EAGLE3_JAX_XLA_DEFAULTS       0: leave XLA_FLAGS as it is (XLA's own defaults)
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models.layers import ATTENTION_KINDS
from eagle3_jax.models.target import MOE_DISPATCHES, fuse_projections
from eagle3_jax.sharding import mesh_of

FUSED_ENV = "EAGLE3_JAX_FUSED_PROJECTIONS"
ATTENTION_ENV = "EAGLE3_JAX_ATTENTION"
MOE_DISPATCH_ENV = "EAGLE3_JAX_MOE_DISPATCH"
MOE_GATHER_ENV = "EAGLE3_JAX_MOE_GATHER_PAIRS"
# A routed forward gathers its n x k (token, expert) pairs' expert matrices while n k is at most
# this many times E (`TargetConfig.moe_gather_pairs`), by backend. The CPU's, measured against
# the dense product (which reads all E): 0.11x of dense's time at n k = E / 8, 0.64x at n k = E,
# 1.18x at 2 E (benchmarks/moe_dispatch.py: 64 experts of 1,024 x 512, top 8, fp32, 2-core CPU;
# benchmarks/results/moe_dispatch.json). Accelerators': a guess that a gathered pair costs
# three times its bytes there (read, written as the gathered copy, read by the product), until
# gpu-speed's moe phase measures it.
MOE_GATHER_PAIRS = {"cpu": 1.0, "accelerator": 1 / 3}
XLA_DEFAULTS_ENV = "EAGLE3_JAX_XLA_DEFAULTS"

# XLA's GPU command buffers: its default kinds (fusions, cuBLAS/cuBLASLt products, custom calls,
# cuDNN) plus WHILE and CONDITIONAL, so that a whole decode loop (`lax.while_loop` over rounds, a
# round's `lax.cond`/`lax.switch`) can run as one CUDA graph instead of returning to the host at
# every iteration. Other backends ignore GPU flags.
GPU_COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
XLA_FLAGS = {"--xla_gpu_enable_command_buffer": GPU_COMMAND_BUFFER}


def set_xla_flags(environ: dict | None = None) -> str:
    """Adds the engine's XLA flags to XLA_FLAGS, each unless the user's XLA_FLAGS names it already
    (theirs wins) or EAGLE3_JAX_XLA_DEFAULTS=0. Returns XLA_FLAGS as it now stands. XLA reads it
    when jax starts its first backend: call this before any computation."""
    env = os.environ if environ is None else environ
    flags = env.get("XLA_FLAGS", "")
    if env.get(XLA_DEFAULTS_ENV, "1").strip() == "0":
        return flags
    given = {f.split("=", 1)[0] for f in flags.split()}
    extra = [f"{name}={value}" for name, value in XLA_FLAGS.items() if name not in given]
    if extra:
        flags = " ".join([*flags.split(), *extra])
        env["XLA_FLAGS"] = flags
    return flags


def fuse_projections_wanted(backend: str | None = None) -> bool:
    """Whether decoding fuses q/k/v and gate/up: on accelerators, not on the CPU; the
    environment's EAGLE3_JAX_FUSED_PROJECTIONS (1 or 0) decides where set."""
    value = os.environ.get(FUSED_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise Eagle3Error(f"{FUSED_ENV}={value!r}: use 1 (fuse), 0 (do not) or leave it unset")
    if value:
        return value == "1"
    return (backend or jax.default_backend()) != "cpu"


def attention_wanted(dtype, backend: str | None = None, devices: int = 1) -> str:
    """The target's attention (`TargetConfig.attention`, `models.layers.ATTENTION_KINDS`): for
    weights that are not fp32, "pallas" (the flash-decoding kernel, a Triton kernel) on a GPU and
    "mixed" on a TPU and on a mesh of several `devices` (the kernel is a custom call XLA cannot
    partition: it would gather every layer's cache onto each device); "exact" on the CPU and for
    fp32 weights (the exactness checks); the environment's EAGLE3_JAX_ATTENTION decides where
    set."""
    value = os.environ.get(ATTENTION_ENV, "").strip()
    if value and value not in ATTENTION_KINDS:
        raise Eagle3Error(f"{ATTENTION_ENV}={value!r}: use one of {', '.join(ATTENTION_KINDS)}")
    if value:
        return value
    backend = backend or jax.default_backend()
    if backend == "cpu" or jnp.dtype(dtype) == jnp.float32:
        return "exact"
    return "pallas" if backend in ("gpu", "cuda", "rocm") and devices == 1 else "mixed"


def moe_dispatch_wanted(backend: str | None = None) -> str:
    """How routed layers run their experts (`TargetConfig.moe_dispatch`): "ragged" on TPUs (a
    step's chosen experts gathered, larger forwards sorted by expert through
    `jax.lax.ragged_dot`, which XLA's TPU backend runs as a grouped product); "gather" (a step's
    chosen experts gathered, larger forwards dense: never more bytes than the dense dispatch)
    elsewhere: on the CPU, where jax lowers `ragged_dot` as a dense product over every group
    (8-9x dense at 512 tokens), and on a GPU, where XLA may lower it as a zero-padded dense
    product (its grouped kernel sits behind an experimental flag; gpu-speed's moe phase
    measures both). On a mesh (`routed_as_wanted` sets the config's moe_mesh) each device runs
    the dispatch on its own rows and its own experts, expert parallelism included
    (`models.target._moe_on_mesh`). The environment's EAGLE3_JAX_MOE_DISPATCH decides where
    set."""
    value = os.environ.get(MOE_DISPATCH_ENV, "").strip()
    if value and value not in MOE_DISPATCHES:
        raise Eagle3Error(f"{MOE_DISPATCH_ENV}={value!r}: use one of {', '.join(MOE_DISPATCHES)}")
    if value:
        return value
    return "ragged" if (backend or jax.default_backend()) == "tpu" else "gather"


def moe_gather_pairs_wanted(backend: str | None = None) -> float:
    """`TargetConfig.moe_gather_pairs` for the backend (`MOE_GATHER_PAIRS`); the environment's
    EAGLE3_JAX_MOE_GATHER_PAIRS (a number >= 0; inf gathers every forward) decides where set."""
    value = os.environ.get(MOE_GATHER_ENV, "").strip()
    if value:
        try:
            pairs = float(value)
        except ValueError:
            pairs = -1.0
        if not pairs >= 0:
            raise Eagle3Error(f"{MOE_GATHER_ENV}={value!r}: give a number >= 0 (times E)")
        return pairs
    cpu = (backend or jax.default_backend()) == "cpu"
    return MOE_GATHER_PAIRS["cpu" if cpu else "accelerator"]


def routed_as_wanted(cfg, backend: str | None = None, mesh=None):
    """`cfg` with a routed target's dispatch, gather line and mesh for `backend` on `mesh`
    (`moe_dispatch_wanted`, `moe_gather_pairs_wanted`; the mesh where it has several devices);
    a dense target's as it is."""
    if not cfg.num_experts:
        return cfg
    return dataclasses.replace(
        cfg,
        moe_dispatch=moe_dispatch_wanted(backend),
        moe_gather_pairs=moe_gather_pairs_wanted(backend),
        moe_mesh=mesh if mesh is not None and mesh.size > 1 else None,
    )


def prepare_target(target, products=None, backend: str | None = None, mesh=None):
    """The loaded target (`checkpoints.Target`) as this backend decodes it: the few-row products
    given (the CPU's measured `ProductPolicy`, or None to keep the config's), its attention
    (`attention_wanted`), a routed target's dispatch (`moe_dispatch_wanted`), and q/k/v and
    gate/up fused where `fuse_projections_wanted` (on `mesh`, the parameters' own when None). The
    unfused matrices are deleted as their fused ones are made: use the returned target."""
    dtype = target.params["embed"].dtype
    mesh = mesh if mesh is not None else mesh_of(target.params)
    devices = 1 if mesh is None else mesh.size
    cfg = dataclasses.replace(target.cfg, attention=attention_wanted(dtype, backend, devices))
    cfg = routed_as_wanted(cfg, backend, mesh)
    if products is not None:
        cfg = dataclasses.replace(cfg, products=products)
    target = target._replace(cfg=cfg)
    if fuse_projections_wanted(backend):
        target = target._replace(params=fuse_projections(target.params, target.cfg, mesh))
    return target
