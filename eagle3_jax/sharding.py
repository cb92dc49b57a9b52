"""The one place that knows the device mesh: logical axis names -> mesh axes.

Model code names logical axes only (`ParamSpec.axes`); `Rules` maps them onto a mesh with a `data`
and a `model` axis. A dimension that does not divide the mesh axis is replicated rather than refused,
so a small model still runs on a big mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.errors import Eagle3Error


@dataclasses.dataclass(frozen=True)
class Rules:
    """Logical axis -> mesh axis (None: replicated). Tensor parallel over `model`, batch over `data`."""

    batch: str | None = "data"
    vocab: str | None = "model"
    embed: str | None = None
    heads: str | None = "model"
    kv_heads: str | None = "model"
    mlp: str | None = "model"
    draft_vocab: str | None = "model"
    # mixture-of-experts targets: expert parallelism, each device holding whole experts; an
    # expert count the model axis does not divide leaves the experts replicated (one mesh axis
    # cannot split both, so expert_mlp is only for rules that set experts=None)
    experts: str | None = "model"
    expert_mlp: str | None = None

    def mesh_axis(self, logical: str | None) -> str | None:
        return None if logical is None else getattr(self, logical)


def make_mesh(data: int = 1, model: int | None = None, devices=None) -> Mesh:
    """A (data, model) mesh; `model` defaults to all devices not used by `data`."""
    devices = list(jax.devices() if devices is None else devices)
    if model is None:
        model = len(devices) // data
    if data * model != len(devices) and data * model > len(devices):
        raise Eagle3Error(
            f"mesh {data}x{model} needs {data * model} devices, {len(devices)} present"
        )
    grid = np.array(devices[: data * model]).reshape(data, model)
    return Mesh(grid, ("data", "model"))


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, rules: Rules) -> P:
    out = []
    for name, dim in zip(axes, shape):
        ax = rules.mesh_axis(name)
        out.append(ax if ax is not None and dim % mesh.shape[ax] == 0 else None)
    return P(*out)


def named(mesh: Mesh, axes, shape, rules: Rules = Rules()) -> NamedSharding:
    return NamedSharding(mesh, spec_for(tuple(axes), tuple(shape), mesh, rules))


def mesh_of(tree: Any) -> Mesh | None:
    """The (data, model) mesh a tree of arrays is laid out on (its first leaf's); None on one
    device, for host arrays or tracers, and for a mesh of other axis names (which `Rules` cannot
    map onto)."""
    leaves = jax.tree.leaves(tree)
    sharding = getattr(leaves[0], "sharding", None) if leaves else None
    if not isinstance(sharding, NamedSharding) or sharding.mesh.size == 1:
        return None
    return sharding.mesh if {"data", "model"} <= set(sharding.mesh.axis_names) else None


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def put(array: np.ndarray, sharding: NamedSharding | None, dtype) -> jax.Array:
    """Places a host array (possibly a memory map) so each device only ever reads its own shard."""
    if sharding is None:
        return jax.device_put(np.asarray(array).astype(dtype))
    return jax.make_array_from_callback(
        array.shape, sharding, lambda idx: np.asarray(array[idx]).astype(dtype)
    )


def put_batch(mesh: Mesh | None, *arrays: np.ndarray) -> tuple:
    """Host arrays of B rows as global arrays on `mesh`, rows over `data` where B divides it
    (else replicated), built from the same host values on every process; unchanged without a
    mesh. Each process keeps only its devices' rows."""
    if mesh is None:
        return arrays
    return tuple(
        put(a, named(mesh, ("batch",) + (None,) * (a.ndim - 1), a.shape), a.dtype) for a in arrays
    )


def shard_tree(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(jax.device_put, tree, shardings)


def parse_mesh(text: str | None) -> Mesh | None:
    """`--mesh DATAxMODEL` (e.g. 2x4): batch over `data`, tensor parallel over `model`; None or
    "" for no mesh (one device)."""
    if not text:
        return None
    try:
        data, model = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise Eagle3Error(f"--mesh {text!r}: give DATAxMODEL, e.g. 1x8 or 2x4") from None
    if data < 1 or model < 1:
        raise Eagle3Error(f"--mesh {text}: both sizes must be >= 1")
    if data * model > len(jax.devices()):
        raise Eagle3Error(
            f"--mesh {text} needs {data * model} devices; {len(jax.devices())} are visible "
            f"({jax.default_backend()})"
        )
    return make_mesh(data, model)
