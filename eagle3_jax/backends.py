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
(`models.target.moe_path`: a step's few experts gathered everywhere, and on a GPU or TPU larger
forwards sorted by expert through `jax.lax.ragged_dot`); across a mesh whose model axis splits the
experts each device keeps running its own experts on every token (no expert's weights move). XLA
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


def moe_dispatch_wanted(backend: str | None = None, devices: int = 1, model_axis: int = 1) -> str:
    """How routed layers run their experts (`TargetConfig.moe_dispatch`): "dense" where the
    mesh's model axis splits the experts over `model_axis` > 1 devices (each device runs its own
    experts on every token and nothing moves; a gather or a grouped product over a split expert
    axis would gather the weights); "gather" (a step's chosen experts gathered, larger forwards
    dense) on the CPU, where jax lowers `ragged_dot` as a dense product over every expert, and on
    a mesh of several `devices` that replicates the experts (a gather stays on each device's
    rows; the grouped product's sort would span the batch); "ragged" on one GPU or TPU (the same
    gather, and larger forwards through `jax.lax.ragged_dot`, which XLA and Pallas lower as
    grouped products). The environment's EAGLE3_JAX_MOE_DISPATCH decides where set."""
    value = os.environ.get(MOE_DISPATCH_ENV, "").strip()
    if value and value not in MOE_DISPATCHES:
        raise Eagle3Error(f"{MOE_DISPATCH_ENV}={value!r}: use one of {', '.join(MOE_DISPATCHES)}")
    if value:
        return value
    if model_axis > 1:
        return "dense"
    if devices > 1 or (backend or jax.default_backend()) == "cpu":
        return "gather"
    return "ragged"


def prepare_target(target, products=None, backend: str | None = None, mesh=None):
    """The loaded target (`checkpoints.Target`) as this backend decodes it: the few-row products
    given (the CPU's measured `ProductPolicy`, or None to keep the config's), its attention
    (`attention_wanted`), a routed target's dispatch (`moe_dispatch_wanted`), and q/k/v and
    gate/up fused where `fuse_projections_wanted` (on `mesh`, the parameters' own when None). The
    unfused matrices are deleted as their fused ones are made: use the returned target."""
    dtype = target.params["embed"].dtype
    mesh = mesh if mesh is not None else mesh_of(target.params)
    devices = 1 if mesh is None else mesh.size
    model_axis = 1 if mesh is None else dict(mesh.shape).get("model", 1)
    cfg = dataclasses.replace(
        target.cfg,
        attention=attention_wanted(dtype, backend, devices),
        moe_dispatch=moe_dispatch_wanted(backend, devices, model_axis)
        if target.cfg.num_experts
        else "dense",
    )
    if products is not None:
        cfg = dataclasses.replace(cfg, products=products)
    target = target._replace(cfg=cfg)
    if fuse_projections_wanted(backend):
        target = target._replace(params=fuse_projections(target.params, target.cfg, mesh))
    return target
