"""Transformers checkpoint directories: config.json + safetensors (one file or sharded, any float dtype)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_jax.checkpoints.safetensors_io import read_safetensors
from eagle3_jax.config import TargetConfig, target_config_from_hf
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import target as tgt
from eagle3_jax.sharding import put

# HF per-layer names -> ours, and whether the HF [out, in] matrix is transposed to our [in, out].
_LAYER_KEYS = {
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
_PRE_NORMS = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm"}
_POST_NORMS = {
    "post_attention_layernorm.weight": "attn_norm",
    "post_feedforward_layernorm.weight": "mlp_norm",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def read_config(path: Path) -> dict[str, Any]:
    cfg_file = path / "config.json"
    try:
        return json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise Eagle3Error(
            f"{path} has no config.json: point --target at a transformers checkpoint "
            "directory, a .gguf file or an eagle3_jax converted directory"
        ) from None
    except (OSError, ValueError) as e:
        raise Eagle3Error(f"cannot read {cfg_file}: {e}") from e


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory, memory-mapped, across shards."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if list(path.glob("*.bin")):
            raise Eagle3Error(
                f"{path} holds only PyTorch .bin weights: convert them to safetensors "
                "(transformers: model.save_pretrained(dir, safe_serialization=True))"
            )
        raise Eagle3Error(f"{path} has no *.safetensors weights")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(read_safetensors(f))
    return tensors


def hf_to_params(
    tensors: dict[str, np.ndarray], cfg: TargetConfig, dtype, shardings=None
) -> tgt.Params:
    """Maps HF names to our pytree (transposing matrices), placing each onto its sharding."""
    norms = _POST_NORMS if cfg.norm_placement == "post" else _PRE_NORMS
    specs = tgt.layer_param_specs(cfg)
    layers: list[dict[str, Any]] = [{} for _ in range(cfg.num_layers)]
    top: dict[str, Any] = {}
    sh = (lambda *k: None) if shardings is None else (lambda *k: _get(shardings, k))
    for name, arr in tensors.items():
        m = _LAYER_RE.match(name)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            if rest in norms:
                key, transpose = norms[rest], False
            elif rest in _LAYER_KEYS:
                key, transpose = _LAYER_KEYS[rest]
            else:
                continue  # e.g. rotary inv_freq buffers
            if i >= cfg.num_layers or key not in specs:
                continue
            layers[i][key] = put(arr.T if transpose else arr, sh("layers", i, key), dtype)
        elif name == "model.embed_tokens.weight":
            top["embed"] = put(arr, sh("embed"), dtype)
        elif name == "model.norm.weight":
            top["final_norm"] = put(arr, sh("final_norm"), dtype)
        elif name == "lm_head.weight" and not cfg.tie_word_embeddings:
            top["lm_head"] = put(arr.T, sh("lm_head"), dtype)
    missing = [n for n in tgt.top_param_specs(cfg) if n not in top]
    missing += [f"layers.{i}.{n}" for i, lp in enumerate(layers) for n in specs if n not in lp]
    if missing:
        raise Eagle3Error(
            f"checkpoint is missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}"
            " for its config.json: the files are incomplete or of another architecture"
        )
    params = {**top, "layers": layers}
    try:
        tgt.check_params(params, cfg)
    except AssertionError as e:
        raise Eagle3Error(f"checkpoint tensor shape does not match config.json: {e}") from None
    return params


def _get(tree, keys):
    for k in keys:
        tree = tree[k]
    return tree


def load_hf(path: str | Path, dtype=np.float32, mesh=None) -> tuple[tgt.Params, TargetConfig]:
    path = Path(path)
    cfg = target_config_from_hf(read_config(path))
    shardings = None if mesh is None else tgt.param_shardings(cfg, mesh)
    return hf_to_params(read_tensors(path), cfg, dtype, shardings), cfg
