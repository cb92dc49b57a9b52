"""Training checkpoints: orbax CheckpointManager over {draft params, optimiser state, step} plus JSON
metadata (data position, config, vocab size). Orbax writes each step into a temporary directory and
renames it when complete, so a run killed mid-save never leaves a checkpoint that loads half-written;
`latest_step` only sees finished ones. Across processes (docs/multihost.md) every process creates
the manager on the same shared directory and calls `save`/`restore` at the same steps: each writes
and reads only its own shards, process 0 the metadata and the commit (orbax's multi-host path).

`save_orbax` / `restore_orbax` save and restore one pytree at a path, without a manager."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from eagle3_jax.errors import Eagle3Error


class Checkpoints:
    def __init__(self, directory: str | Path, keep: int = 3):
        self.directory = Path(directory).resolve()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=False
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        self.manager.wait_until_finished()

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restores into the structure, dtypes and shardings of `like` (concrete or abstract)."""
        step = self.latest_step() if step is None else step
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        return out["state"], out["meta"]

    def close(self) -> None:
        self.manager.close()


def save_orbax(path: str | os.PathLike, params: Any) -> None:
    """Saves a pytree (draft params, optimizer state ...) with orbax, overwriting `path`."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(Path(path).absolute(), params, force=True)
        ckptr.wait_until_finished()


def restore_orbax(path: str | os.PathLike, like: Any) -> Any:
    """Restores a pytree saved by `save_orbax` into the structure, shapes, dtypes and shardings of
    `like` (arrays or jax.ShapeDtypeStruct leaves)."""
    path = Path(path).absolute()
    if not path.exists():
        raise Eagle3Error(f"no orbax checkpoint at {path}: check the path")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path, abstract)
