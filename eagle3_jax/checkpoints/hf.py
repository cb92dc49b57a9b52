"""Transformers checkpoint directories: config.json + safetensors (one file or sharded, any float
dtype); dense families, Gemma 3's text model (a Gemma3ForCausalLM, or the language model of a
Gemma3ForConditionalGeneration, whose vision tower is not read) and the mixture-of-experts
Qwen3-MoE and Mixtral (their experts one by one or fused) and gpt-oss (its experts fused, or as
the hub's MXFP4 blocks and scales, dequantised at load: `checkpoints.mxfp4`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_jax.checkpoints.mxfp4 import Mxfp4Experts
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
    "self_attn.o_proj.bias": ("bo", False),  # read where attention_out_bias says it is there
    "self_attn.sinks": ("sinks", False),  # gpt-oss
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
_SANDWICH_NORMS = {  # Gemma 3
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}
_NORMS = {"pre": _PRE_NORMS, "post": _POST_NORMS, "sandwich": _SANDWICH_NORMS}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# A Gemma3ForConditionalGeneration's language model, as hub checkpoints name it
# (language_model.model.*, language_model.lm_head) and as transformers 5 does
# (model.language_model.*, lm_head); its vision tower and projector are not read.
_LANGUAGE_MODEL = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
# Mixture-of-experts layers (Qwen3-MoE `mlp.`, Mixtral `block_sparse_moe.`; transformers 5 renames
# Mixtral's to `mlp.` in memory). The router [E, D] (ours [D, E]); the experts one by one as hub
# checkpoints and transformers' save_pretrained write them, [F', D] gate/up and [D, F'] down
# (Qwen3-MoE gate_proj/up_proj/down_proj, Mixtral w1/w3/w2), or fused as transformers 5 holds
# them in memory: gate_up_proj [E, 2F', D] (gate rows first) and down_proj [E, D, F'].
# gpt-oss: the router `mlp.router` with a bias, and its experts fused as transformers holds them
# (gate_up_proj [E, D, 2F'], each unit's gate and up columns interleaved, gate first; down_proj
# [E, F', D]; biases [E, 2F'] and [E, D]) or, in hub checkpoints, gate_up_proj / down_proj as
# MXFP4 `_blocks` and `_scales` (the same matrices transposed, rows = outputs).
_MOE = r"(?:mlp|block_sparse_moe)\."
_ROUTER_RE = re.compile(_MOE + r"(?:gate|router)\.weight$")
_ROUTER_BIAS_RE = re.compile(_MOE + r"router\.bias$")
_GPT_OSS_EXPERTS_RE = re.compile(
    _MOE + r"experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$"
)
_EXPERT_RE = re.compile(_MOE + r"experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED_EXPERTS_RE = re.compile(_MOE + r"experts\.(gate_up_proj|down_proj)$")
_EXPERT_KEYS = {
    "gate_proj": "we_gate",
    "w1": "we_gate",
    "up_proj": "we_up",
    "w3": "we_up",
    "down_proj": "we_down",
    "w2": "we_down",
}


class _Experts:
    """E per-expert host matrices (memory-mapped views, already [in, out]) seen as one
    [E, in, out] array, read only where indexed: `sharding.put` asks each device for its own
    experts, so no process reads the others'."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.shape = (len(parts),) + tuple(parts[0].shape)
        self.dtype = parts[0].dtype
        self.ndim = len(self.shape)

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        chosen = range(self.shape[0])[idx[0]]
        return np.stack([np.asarray(self.parts[e][idx[1:]]) for e in chosen])

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)


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
    norms = _NORMS[cfg.norm_placement]
    specs = [tgt.layer_param_specs(cfg, i) for i in range(cfg.num_layers)]
    layers: list[dict[str, Any]] = [{} for _ in range(cfg.num_layers)]
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}  # (layer, key) -> expert -> matrix
    packed: dict[tuple[int, str], dict[str, np.ndarray]] = {}  # (layer, proj) -> MXFP4 parts
    top: dict[str, Any] = {}
    sh = (lambda *k: None) if shardings is None else (lambda *k: _get(shardings, k))
    for name, arr in tensors.items():
        for prefix, ours in _LANGUAGE_MODEL:
            if name.startswith(prefix):
                name = ours + name[len(prefix) :]
                break
        m = _LAYER_RE.match(name)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            if i >= cfg.num_layers:
                continue
            if rest in norms:
                key, transpose = norms[rest], False
            elif rest in _LAYER_KEYS:
                key, transpose = _LAYER_KEYS[rest]
            elif _ROUTER_RE.match(rest):
                key, transpose = "router", True
            elif _ROUTER_BIAS_RE.match(rest):
                key, transpose = "router_bias", False
            elif cfg.family == "gpt_oss" and (gm := _GPT_OSS_EXPERTS_RE.match(rest)):
                proj, part = gm.group(1), gm.group(2) or ""
                if part in ("_blocks", "_scales"):
                    packed.setdefault((i, proj), {})[part] = arr
                    continue
                for key, value in _gpt_oss_experts(proj + part, arr).items():
                    if key in specs[i]:
                        layers[i][key] = put(value, sh("layers", i, key), dtype)
                continue
            elif em := _EXPERT_RE.match(rest):
                experts.setdefault((i, _EXPERT_KEYS[em.group(2)]), {})[int(em.group(1))] = arr.T
                continue
            elif fm := _FUSED_EXPERTS_RE.match(rest):
                for key, value in _unfuse_experts(fm.group(1), arr).items():
                    if key in specs[i]:
                        layers[i][key] = put(value, sh("layers", i, key), dtype)
                continue
            else:
                continue  # e.g. rotary inv_freq buffers
            if key not in specs[i]:
                continue
            layers[i][key] = put(arr.T if transpose else arr, sh("layers", i, key), dtype)
        elif name == "model.embed_tokens.weight":
            top["embed"] = put(arr, sh("embed"), dtype)
        elif name == "model.norm.weight":
            top["final_norm"] = put(arr, sh("final_norm"), dtype)
        elif name == "lm_head.weight" and not cfg.tie_word_embeddings:
            top["lm_head"] = put(arr.T, sh("lm_head"), dtype)
    for (i, proj), parts in packed.items():
        if set(parts) != {"_blocks", "_scales"}:
            raise Eagle3Error(
                f"layer {i}'s MXFP4 {proj} has {sorted(parts)} but needs both _blocks and "
                "_scales: the files are incomplete"
            )
        for key, value in _mxfp4_experts(proj, parts["_blocks"], parts["_scales"]).items():
            if key in specs[i] and key not in layers[i]:
                layers[i][key] = put(value, sh("layers", i, key), dtype)
    for (i, key), parts in experts.items():
        if key not in specs[i] or key in layers[i]:
            continue
        if sorted(parts) != list(range(cfg.num_experts)):
            raise Eagle3Error(
                f"layer {i}'s {key} has experts {sorted(parts)[:8]}... of the "
                f"{cfg.num_experts} config.json names: the files are incomplete"
            )
        ordered = [parts[e] for e in range(cfg.num_experts)]
        if len({p.shape for p in ordered}) > 1:
            raise Eagle3Error(f"layer {i}'s experts differ in shape for {key}: corrupt checkpoint")
        layers[i][key] = put(_Experts(ordered), sh("layers", i, key), dtype)
    missing = [n for n in tgt.top_param_specs(cfg) if n not in top]
    missing += [f"layers.{i}.{n}" for i, lp in enumerate(layers) for n in specs[i] if n not in lp]
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


def _unfuse_experts(kind: str, arr: np.ndarray) -> dict[str, np.ndarray]:
    """transformers 5's fused expert tensors -> ours, as views: gate_up_proj [E, 2F', D] ->
    we_gate, we_up [E, D, F']; down_proj [E, D, F'] -> we_down [E, F', D]."""
    if kind == "down_proj":
        return {"we_down": arr.transpose(0, 2, 1)}
    f = arr.shape[1] // 2
    return {"we_gate": arr[:, :f].transpose(0, 2, 1), "we_up": arr[:, f:].transpose(0, 2, 1)}


def _gpt_oss_experts(name: str, arr: np.ndarray) -> dict[str, np.ndarray]:
    """gpt-oss's fused expert tensors -> ours, as views: gate_up_proj [E, D, 2F'] -> we_gate
    (columns 0::2), we_up (1::2) [E, D, F'], as GptOssExperts._apply_gate splits them;
    down_proj [E, F', D] as it is; their biases alike ([E, 2F'] -> be_gate, be_up; [E, D])."""
    if name == "down_proj":
        return {"we_down": arr}
    if name == "down_proj_bias":
        return {"be_down": arr}
    prefix = "we" if name == "gate_up_proj" else "be"
    return {f"{prefix}_gate": arr[..., 0::2], f"{prefix}_up": arr[..., 1::2]}


def _mxfp4_experts(proj: str, blocks: np.ndarray, scales: np.ndarray) -> dict[str, Mxfp4Experts]:
    """A hub gpt-oss projection in MXFP4 (blocks [E, R, G, 16], scales [E, R, G]) -> ours,
    dequantised per expert where read: gate_up_proj's rows are the 2F' interleaved gate/up
    outputs (gate rows 0::2, up rows 1::2), down_proj's the D outputs."""
    if proj == "down_proj":
        return {"we_down": Mxfp4Experts(blocks, scales)}
    return {
        "we_gate": Mxfp4Experts(blocks, scales, slice(0, None, 2)),
        "we_up": Mxfp4Experts(blocks, scales, slice(1, None, 2)),
    }


def _get(tree, keys):
    for k in keys:
        tree = tree[k]
    return tree


def load_hf(path: str | Path, dtype=np.float32, mesh=None) -> tuple[tgt.Params, TargetConfig]:
    path = Path(path)
    cfg = target_config_from_hf(read_config(path))
    shardings = None if mesh is None else tgt.param_shardings(cfg, mesh)
    return hf_to_params(read_tensors(path), cfg, dtype, shardings), cfg
