"""Our converted-cache format: params in our own layout, so a reload is one memory map (~0.1 s).

A directory with `eagle3_target.json` (format version + TargetConfig), `params.safetensors`
(keys `embed`, `final_norm`, `lm_head`, `layers.{i}.{name}`, already [in, out]) and the tokenizer
files (tokenizer.json, tokenizer_config.json, chat template).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from eagle3_jax.checkpoints.atomic import atomic_directory
from eagle3_jax.checkpoints.safetensors_io import read_safetensors, write_safetensors
from eagle3_jax.config import TargetConfig
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import target as tgt
from eagle3_jax.sharding import put

NATIVE_CONFIG = "eagle3_target.json"
FORMAT_VERSION = 1


def is_native(path: Path) -> bool:
    return (path / NATIVE_CONFIG).is_file()


def save_native(
    path: str | Path, params: tgt.Params, cfg: TargetConfig, tokenizer=None, source: str = ""
) -> None:
    """Writes into a temporary sibling directory and renames it into place (atomic for readers)."""
    with atomic_directory(path) as tmp:
        flat = {k: np.asarray(v) for k, v in params.items() if k != "layers"}
        for i, lp in enumerate(tgt.unstack_layers(params)["layers"]):
            flat.update({f"layers.{i}.{k}": np.asarray(v) for k, v in lp.items()})
        write_safetensors(tmp / "params.safetensors", flat)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        meta = {
            "format_version": FORMAT_VERSION,
            "source": source,
            "config": json.loads(cfg.to_json()),
        }
        (tmp / NATIVE_CONFIG).write_text(json.dumps(meta, indent=1))


def read_native_config(path: Path) -> TargetConfig:
    try:
        meta = json.loads((path / NATIVE_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise Eagle3Error(f"cannot read {path / NATIVE_CONFIG}: {e}") from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise Eagle3Error(
            f"{path} is eagle3_jax format {meta.get('format_version')}, this version reads "
            f"{FORMAT_VERSION}: delete it and convert the source checkpoint again"
        )
    return TargetConfig.from_dict(meta["config"])


def load_native(path: str | Path, dtype=np.float32, mesh=None) -> tuple[tgt.Params, TargetConfig]:
    path = Path(path)
    cfg = read_native_config(path)
    flat = read_safetensors(path / "params.safetensors")
    sh = None if mesh is None else tgt.param_shardings(cfg, mesh)
    params: tgt.Params = {"layers": [{} for _ in range(cfg.num_layers)]}
    try:
        for key, arr in flat.items():
            parts = key.split(".")
            if parts[0] == "layers":
                i, name = int(parts[1]), parts[2]
                params["layers"][i][name] = put(
                    arr, None if sh is None else sh["layers"][i][name], dtype
                )
            else:
                params[key] = put(arr, None if sh is None else sh[key], dtype)
        tgt.check_params(params, cfg)
    except (AssertionError, KeyError) as e:
        raise Eagle3Error(
            f"{path}/params.safetensors does not match its config ({e}): convert again"
        ) from e
    return params, cfg


def tree_nbytes(params) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(params))
