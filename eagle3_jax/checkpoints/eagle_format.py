"""Official EAGLE-3 head checkpoints (SafeAILab/EAGLE, SpecForge, SGLang, vLLM) in and out.

A head is a directory with `config.json` and `model.safetensors` (SpecForge) or `pytorch_model.bin`
(EAGLE's trainer, fp16). Tensor names carry no `model.` prefix and are PyTorch [out, in]:
  fc.weight [D, n_aux*Ht]; midlayer.self_attn.{q,k,v}_proj.weight [H*K | G*K, 2D], o_proj [D, H*K];
  midlayer.mlp.{gate,up}_proj.weight [F, D], down_proj [D, F];
  midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight [D]; norm.weight [D];
  lm_head.weight [Vd, D]; d2t [Vd] int64 and t2d [V] bool (absent when Vd == V);
  embed_tokens.weight [V, D] (optional; when present it wins over the target's).
`eagle_config.eagle_aux_hidden_state_layer_ids` in config.json names target layer OUTPUTS; our
`DraftConfig.aux_layer_ids` name layer INPUTS (HF hidden_states indices), so ours = theirs + 1;
a top-level `eagle_aux_hidden_state_layer_ids` (vLLM's key) names hidden_states indices, ours as is.
Heads in vLLM's `speculators` layout are read too, and either layout written (`layouts`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from eagle3_jax import vocab as vocab_lib
from eagle3_jax.checkpoints import layouts
from eagle3_jax.checkpoints.atomic import atomic_directory
from eagle3_jax.checkpoints.safetensors_io import read_safetensors, write_safetensors
from eagle3_jax.config import RopeConfig, TargetConfig, _rope_from_hf
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as dr
from eagle3_jax.sharding import put
from eagle3_jax.vocab import DraftVocab

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")

# Official name -> (our flat name, whether the PyTorch [out, in] matrix is transposed to [in, out]).
_KEYS = {
    "fc.weight": ("fc", True),
    "midlayer.self_attn.q_proj.weight": ("layer.wq", True),
    "midlayer.self_attn.k_proj.weight": ("layer.wk", True),
    "midlayer.self_attn.v_proj.weight": ("layer.wv", True),
    "midlayer.self_attn.o_proj.weight": ("layer.wo", True),
    "midlayer.mlp.gate_proj.weight": ("layer.w_gate", True),
    "midlayer.mlp.up_proj.weight": ("layer.w_up", True),
    "midlayer.mlp.down_proj.weight": ("layer.w_down", True),
    "midlayer.hidden_norm.weight": ("layer.hidden_norm", False),
    "midlayer.input_layernorm.weight": ("layer.input_norm", False),
    "midlayer.post_attention_layernorm.weight": ("layer.post_attn_norm", False),
    "norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
    # SpecVocab's speculator (our extension; heads without one never have these)
    "speculator.down_proj.weight": ("spec_a", True),
    "speculator.up_proj.weight": ("spec_b", True),
}
_EMBED = "embed_tokens.weight"
_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def _keys(cfg: dr.DraftConfig) -> dict[str, tuple[str, bool]]:
    """The _KEYS a head with this config has (no lm_head when it reads the target's, no
    speculator unless SpecVocab)."""
    flat = dr._flat_specs(cfg)
    return {name: v for name, v in _KEYS.items() if v[0] in flat}


def official_shapes(cfg: dr.DraftConfig) -> dict[str, tuple[int, ...]]:
    """The PyTorch tensor shapes of a head with this config (d2t/t2d only when Vd < V)."""
    flat = dr._flat_specs(cfg)
    out = {}
    for name, (ours, transpose) in _keys(cfg).items():
        shape = flat[ours].shape
        out[name] = tuple(reversed(shape)) if transpose else shape
    if cfg.draft_vocab_size != cfg.vocab_size:
        out["d2t"] = (cfg.draft_vocab_size,)
        out["t2d"] = (cfg.vocab_size,)
    return out


# ----------------------------------------------------------------------------- config.json


def draft_config_from_hf(
    hf: dict[str, Any], target_cfg: TargetConfig | None = None
) -> dr.DraftConfig:
    """Builds a DraftConfig from an official head's config.json; refuses what we cannot run."""
    archs = hf.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        raise Eagle3Error(
            f"config.json architectures {archs} is not an EAGLE-3 Llama head "
            f"({' or '.join(ARCHITECTURES)}): point at an EAGLE-3 draft checkpoint"
        )
    if int(hf.get("num_hidden_layers", 1)) != 1:
        raise Eagle3Error(
            f"draft config has num_hidden_layers={hf['num_hidden_layers']}: only "
            "single-midlayer EAGLE-3 heads are supported"
        )
    # Variants some trainers added; computing them as the plain head would be silently wrong.
    layouts.check_official_flags(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise Eagle3Error(f"draft hidden_act {hf['hidden_act']!r} is not silu: unsupported head")
    try:
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        vocab_size = int(hf["vocab_size"])
        intermediate = int(hf["intermediate_size"])
    except KeyError as e:
        raise Eagle3Error(
            f"draft config.json lacks {e.args[0]}: not a complete EAGLE-3 config"
        ) from None
    ours = layouts.aux_ids_from_config(hf)
    if ours is None and target_cfg is not None:
        ours = target_cfg.default_aux_layer_ids()
    elif ours is None:
        raise Eagle3Error(
            "draft config.json has no eagle_config.eagle_aux_hidden_state_layer_ids: "
            "pass the target's config (target_cfg) so its defaults (2, L//2, L-3) "
            "apply"
        )
    return dr.DraftConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        vocab_size=vocab_size,
        draft_vocab_size=int(hf.get("draft_vocab_size") or vocab_size),
        aux_layer_ids=ours,
        target_hidden_size=int(hf.get("target_hidden_size") or hidden),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),  # transformers' LlamaConfig default
        rope=_rope_from_hf(hf),
        **_output_from_hf(hf),
    )


_OUTPUT_FIELDS = ("lm_head_source", "speculator_rank", "spec_candidates")


def _output_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Our output-layer extension (config.json "eagle3_jax" block); absent in official heads."""
    ext = hf.get("eagle3_jax") or {}
    bad = sorted(set(ext) - set(_OUTPUT_FIELDS))
    if bad:
        raise Eagle3Error(f"draft config.json eagle3_jax block has unknown keys {bad}")
    return dict(ext)


def _rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_theta": float(rope.theta)}
    if rope.kind == "linear":
        # {type, factor} exactly: EAGLE's EConfig refuses any other key in rope_scaling.
        out["rope_scaling"] = {"type": "linear", "factor": float(rope.factor)}
    elif rope.kind == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": float(rope.factor),
            "low_freq_factor": float(rope.low_freq_factor),
            "high_freq_factor": float(rope.high_freq_factor),
            "original_max_position_embeddings": int(rope.original_max_position),
        }
    return out


def draft_config_to_hf(cfg: dr.DraftConfig, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json for a head (SpecForge/SGLang form, readable by EAGLE's loader too).

    `target_hidden_size` is written only when it differs from `hidden_size`: the official loader
    (SafeAILab/EAGLE `cnets.Model`) takes the presence of that key to mean "the head carries its
    own `embed_tokens.weight`" and otherwise leaves its embedding randomly initialised, silently
    (docs/interop.md). Every runtime defaults the key to `hidden_size`.
    """
    aux = layouts.aux_ids_to_config(cfg.aux_layer_ids)  # refuses id 0
    width = (
        {"target_hidden_size": cfg.target_hidden_size}
        if cfg.target_hidden_size != cfg.hidden_size
        else {}
    )
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        **width,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        **_rope_to_hf(cfg.rope),
        **aux,
        **_output_to_hf(cfg),
    }


def _output_to_hf(cfg: dr.DraftConfig) -> dict[str, Any]:
    """Non-default output layers only: a plain EAGLE-3 head's config.json stays official."""
    default = dr.DraftConfig.__dataclass_fields__
    ext = {f: getattr(cfg, f) for f in _OUTPUT_FIELDS if getattr(cfg, f) != default[f].default}
    if cfg.speculator_rank:
        ext["spec_candidates"] = cfg.spec_candidates
    return {"eagle3_jax": ext} if ext else {}


# ----------------------------------------------------------------------------- load


def read_head_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise Eagle3Error(
            f"{path} has no config.json: point at an EAGLE-3 head directory "
            "(config.json + model.safetensors or pytorch_model.bin)"
        ) from None
    except (OSError, ValueError) as e:
        raise Eagle3Error(f"cannot read {path / 'config.json'}: {e}") from e


def _read_bin(file: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise Eagle3Error(
            f"{file} is a PyTorch pickle and torch is not installed: convert it "
            "once to model.safetensors (safetensors.torch.save_file on a machine "
            "with torch)"
        ) from None
    state = torch.load(file, map_location="cpu", weights_only=True)
    out = {}
    for name, t in state.items():
        t = t.detach()
        out[name] = (t.float() if t.is_floating_point() else t).numpy()
    return out


def read_head_tensors(path: Path) -> dict[str, np.ndarray]:
    files = sorted(path.glob("*.safetensors"))
    tensors: dict[str, np.ndarray] = {}
    if files:
        for f in files:
            tensors.update(read_safetensors(f))
    elif (path / "pytorch_model.bin").is_file():
        tensors = _read_bin(path / "pytorch_model.bin")
    else:
        raise Eagle3Error(f"{path} has neither model.safetensors nor pytorch_model.bin")
    return layouts.tensors_to_official(tensors, str(path))


def vocab_from_tensors(
    tensors: dict[str, np.ndarray], cfg: dr.DraftConfig, where: str
) -> DraftVocab:
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    v, vd = cfg.vocab_size, cfg.draft_vocab_size
    if d2t is None and t2d is None:
        if vd != v:
            raise Eagle3Error(
                f"{where}: draft_vocab_size {vd} < vocab_size {v} but the checkpoint "
                "has no d2t/t2d mapping: the head is incomplete; re-export it with "
                "its mapping"
            )
        return vocab_lib.identity(v)
    # Either buffer determines the other (ids ascending): derive a missing one, check a pair.
    if d2t is not None:
        d2t = np.asarray(d2t).astype(np.int64)
        if d2t.shape != (vd,):
            raise Eagle3Error(
                f"{where}: d2t has shape {d2t.shape} but draft_vocab_size is {vd}: "
                "the mapping belongs to another head"
            )
    if t2d is not None:
        t2d = np.asarray(t2d)
        if t2d.shape != (v,):
            raise Eagle3Error(
                f"{where}: t2d has shape {t2d.shape} but vocab_size is {v}: the "
                "mapping was built for another target vocabulary"
            )
        if t2d.dtype != np.bool_:
            if not np.isin(t2d, (0, 1)).all():
                raise Eagle3Error(f"{where}: t2d holds values other than 0/1: it is not a mask")
            t2d = t2d.astype(np.bool_)
    if d2t is None:
        d2t = vocab_lib.from_target_ids(np.flatnonzero(t2d), v).d2t
    if t2d is None:
        ids = np.arange(vd, dtype=np.int64) + d2t
        if ids.min() < 0 or ids.max() >= v:
            raise Eagle3Error(f"{where}: d2t maps draft ids outside the target vocab 0..{v - 1}")
        t2d = np.zeros((v,), np.bool_)
        t2d[ids] = True
    voc = DraftVocab(d2t, t2d)
    vocab_lib.check(voc, v, vd, where=where)
    return voc


def load_draft(
    path: str | os.PathLike, target_cfg: TargetConfig | None = None, dtype=np.float32, mesh=None
) -> tuple[dr.Params, dr.DraftConfig, DraftVocab, jax.Array | None]:
    """Reads an official EAGLE-3 head.

    Args:
      target_cfg: the target it will run with; enables the default aux ids when config.json names
        none, and `check_compatible` before anything is computed.
      mesh: when given, each tensor is placed on its sharding as it is read.
    Returns:
      (params, DraftConfig, DraftVocab, embedding [V, D] when the checkpoint carries one else None).
    """
    path = Path(path)
    if not path.is_dir():
        raise Eagle3Error(f"draft checkpoint {path} is not a directory: pass the head's directory")
    where = str(path)
    hf = read_head_config(path)
    if layouts.detect(hf) == layouts.SPECULATORS:
        hf = layouts.from_speculators(hf)
    cfg = draft_config_from_hf(hf, target_cfg)
    tensors = read_head_tensors(path)
    expected = official_shapes(cfg)
    expected.pop("d2t", None)
    expected.pop("t2d", None)
    missing = [n for n in expected if n not in tensors]
    unknown = [n for n in tensors if n not in expected and n not in ("d2t", "t2d", _EMBED)]
    if missing or unknown:
        raise Eagle3Error(
            f"{where}: {'missing ' + str(missing) if missing else ''}"
            f"{'; ' if missing and unknown else ''}"
            f"{'unexpected ' + str(unknown[:5]) if unknown else ''}: not a "
            "single-layer EAGLE-3 head in the official layout"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise Eagle3Error(
                f"{where}: {name} has shape {tuple(tensors[name].shape)}, "
                f"config.json implies {shape} (hidden {cfg.hidden_size}, heads "
                f"{cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim}, "
                f"draft_vocab_size {cfg.draft_vocab_size}, {cfg.n_aux}x "
                f"target_hidden_size {cfg.target_hidden_size}): the weights and "
                "config disagree"
            )
    vocab = vocab_from_tensors(tensors, cfg, where)
    shardings = None if mesh is None else dr.param_shardings(cfg, mesh)
    params: dr.Params = {"layer": {}}
    for name, (ours, transpose) in _keys(cfg).items():
        arr = tensors[name].T if transpose else tensors[name]
        if ours.startswith("layer."):
            key = ours.split(".", 1)[1]
            sh = None if shardings is None else shardings["layer"][key]
            params["layer"][key] = put(arr, sh, dtype)
        else:
            params[ours] = put(arr, None if shardings is None else shardings[ours], dtype)
    embed = None
    if _EMBED in tensors:
        e = tensors[_EMBED]
        if tuple(e.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise Eagle3Error(
                f"{where}: {_EMBED} has shape {tuple(e.shape)}, expected "
                f"({cfg.vocab_size}, {cfg.hidden_size}) from config.json"
            )
        embed = put(e, None, dtype)
    dr.check_params(params, cfg)
    if target_cfg is not None:
        check_compatible(cfg, vocab, target_cfg, embed)
    return params, cfg, vocab, embed


def check_compatible(
    draft_cfg: dr.DraftConfig, vocab: DraftVocab, target_cfg: TargetConfig, embed=None
) -> None:
    """Refuses a head that cannot run on this target, before any compute.

    `embed` is the head's own embedding if it has one; without it the target's embedding is used,
    which needs the draft hidden size to equal the target's.
    """
    if draft_cfg.target_hidden_size != target_cfg.hidden_size:
        raise Eagle3Error(
            f"draft target_hidden_size {draft_cfg.target_hidden_size} != the "
            f"target's hidden size {target_cfg.hidden_size}: the head was trained "
            "for another target"
        )
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise Eagle3Error(
            f"draft vocab_size {draft_cfg.vocab_size} != the target's vocab size "
            f"{target_cfg.vocab_size}: the head was trained for another tokenizer"
        )
    # Id L is refused too: target.forward captures the final NORMED state there, while the official
    # "output of layer L-1" is pre-norm, so a head asking for it would silently read another tensor.
    bad = [i for i in draft_cfg.aux_layer_ids if not 0 <= i < target_cfg.num_layers]
    if bad:
        raise Eagle3Error(
            f"draft aux layer ids {draft_cfg.aux_layer_ids} (inputs to target "
            f"layers) include {bad}, outside the target's layers "
            f"0..{target_cfg.num_layers - 1}: the head was trained for a deeper "
            "target, or its ids are off by one"
        )
    vocab_lib.check(
        vocab,
        target_cfg.vocab_size,
        draft_cfg.draft_vocab_size,
        where="draft vocab mapping vs target",
    )
    if embed is not None:
        if tuple(embed.shape) != (draft_cfg.vocab_size, draft_cfg.hidden_size):
            raise Eagle3Error(
                f"draft embedding has shape {tuple(embed.shape)}, expected "
                f"({draft_cfg.vocab_size}, {draft_cfg.hidden_size})"
            )
    elif draft_cfg.hidden_size != target_cfg.hidden_size:
        raise Eagle3Error(
            f"draft hidden size {draft_cfg.hidden_size} != the target's "
            f"{target_cfg.hidden_size} and the head carries no embed_tokens.weight: "
            "the target's embedding cannot feed it; use a checkpoint that includes "
            "one"
        )


# ----------------------------------------------------------------------------- save


def save_draft(
    path: str | os.PathLike,
    params: dr.Params,
    cfg: dr.DraftConfig,
    vocab: DraftVocab,
    dtype: str = "bfloat16",
    embed=None,
    overwrite: bool = True,
    sources=(),
    *,
    layout: str = layouts.OFFICIAL,
    verifier: tuple[str, list[str]] | None = None,
    speculative_tokens: int = 3,
) -> None:
    """Writes a head (config.json + model.safetensors), atomically, in the official layout or
    vLLM's speculators layout (which also names the `verifier`: (name_or_path, architectures),
    and the chain length vLLM drafts by default, `speculative_tokens`).

    An existing `path` is replaced only if this project wrote it and `overwrite` is set; a path
    equal to, inside or around one of `sources` (the heads it was made from) is refused
    (`atomic.check_destination`).

    `embed` ([V, D]) is written as embed_tokens.weight when given. A head whose width D differs
    from its target's (`target_hidden_size`) must carry one: no runtime can feed it the target's
    [V, Ht] embedding, and the official loader expects it in the file whenever config.json names
    `target_hidden_size` (V x D more values in the file: docs/interop.md).
    """
    if dtype not in _DTYPES:
        raise Eagle3Error(f"save dtype {dtype!r} unsupported: use one of {sorted(_DTYPES)}")
    if cfg.target_hidden_size != cfg.hidden_size and embed is None:
        raise Eagle3Error(
            f"the head's hidden size {cfg.hidden_size} differs from its target's "
            f"{cfg.target_hidden_size}: save it with its own embedding (embed=[V, D]); runtimes "
            "read embed_tokens.weight from such a head's file"
        )
    np_dtype = _DTYPES[dtype]
    dr.check_params(params, cfg)
    vocab_lib.check(vocab, cfg.vocab_size, cfg.draft_vocab_size)
    hf = draft_config_to_hf(cfg, dtype)
    flat = {k: v for k, v in params.items() if k != "layer"}
    flat.update({f"layer.{k}": v for k, v in params["layer"].items()})
    tensors = {}
    for name, (ours, transpose) in _keys(cfg).items():
        a = np.asarray(jax.device_get(flat[ours]))
        tensors[name] = (a.T if transpose else a).astype(np_dtype)
    if cfg.draft_vocab_size != cfg.vocab_size:
        tensors["d2t"] = np.asarray(vocab.d2t).astype(np.int64)
        tensors["t2d"] = np.asarray(vocab.t2d).astype(np.bool_)
    if embed is not None:
        if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise Eagle3Error(
                f"embedding has shape {tuple(embed.shape)}, expected "
                f"({cfg.vocab_size}, {cfg.hidden_size})"
            )
        tensors[_EMBED] = np.asarray(jax.device_get(embed)).astype(np_dtype)
    if layout == layouts.SPECULATORS:
        if verifier is None:
            raise Eagle3Error(
                "the speculators layout names its verifier (the target): give its name or path"
            )
        hf = layouts.to_speculators(hf, verifier[0], verifier[1], speculative_tokens)
    tensors = layouts.tensors_to_layout(tensors, layout)
    with atomic_directory(path, overwrite=overwrite, sources=sources) as tmp:
        write_safetensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))


# ----------------------------------------------------------------------------- orbax (training)


def save_orbax(path: str | os.PathLike, params: Any) -> None:
    """Saves a pytree (draft params, optimizer state ...) with orbax, overwriting `path`."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(Path(path).absolute(), params, force=True)
        ckptr.wait_until_finished()


def restore_orbax(path: str | os.PathLike, like: Any) -> Any:
    """Restores a pytree saved by `save_orbax` into the structure, shapes, dtypes and shardings of
    `like` (arrays or jax.ShapeDtypeStruct leaves)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if not path.exists():
        raise Eagle3Error(f"no orbax checkpoint at {path}: check the path")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path, abstract)
