"""Official EAGLE-3 head checkpoints (SafeAILab/EAGLE, SpecForge, SGLang, vLLM) in and out.

A head is a directory with `config.json` and `model.safetensors` (SpecForge) or `pytorch_model.bin`
(EAGLE's trainer, fp16). Tensor names carry no `model.` prefix and are PyTorch [out, in]:
  fc.weight [D, n_aux*Ht]; midlayer.self_attn.{q,k,v}_proj.weight [H*K | G*K, 2D], o_proj [D, H*K];
  midlayer.mlp.{gate,up}_proj.weight [F, D], down_proj [D, F];
  midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight [D]; norm.weight [D];
  lm_head.weight [Vd, D]; d2t [Vd] int64 and t2d [V] bool (absent when Vd == V);
  embed_tokens.weight [V, D] (optional; when present it wins over the target's).
config.json is `head_config`'s (its aux layer ids name target layer OUTPUTS, ours layer INPUTS).
Heads in vLLM's `speculators` layout are read too, and either layout written (`layouts`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from eagle3_jax import vocab as vocab_lib
from eagle3_jax.checkpoints import layouts
from eagle3_jax.checkpoints.atomic import atomic_directory
from eagle3_jax.checkpoints.head_config import (
    draft_config_from_hf,
    draft_config_to_hf,
    read_head_config,
)
from eagle3_jax.checkpoints.safetensors_io import read_safetensors, write_safetensors
from eagle3_jax.config import FAMILY_NAMES, TargetConfig
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as dr
from eagle3_jax.sharding import put
from eagle3_jax.vocab import DraftVocab

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


# ----------------------------------------------------------------------------- load


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
    _check_tensors(tensors, cfg, where)
    vocab = vocab_from_tensors(tensors, cfg, where)
    params = _params_from_tensors(tensors, cfg, dtype, mesh)
    embed = _embed_from_tensors(tensors, cfg, dtype, where)
    dr.check_params(params, cfg)
    if target_cfg is not None:
        check_compatible(cfg, vocab, target_cfg, embed)
    return params, cfg, vocab, embed


def _check_tensors(tensors: dict[str, np.ndarray], cfg: dr.DraftConfig, where: str) -> None:
    """Refuses a head whose tensors are not those its config.json implies: names missing or
    unexpected, or a shape that disagrees."""
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


def _params_from_tensors(
    tensors: dict[str, np.ndarray], cfg: dr.DraftConfig, dtype, mesh
) -> dr.Params:
    """The params pytree of the head's official tensors, [out, in] transposed to ours, each placed
    on its sharding when a mesh is given."""
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
    return params


def _embed_from_tensors(tensors: dict[str, np.ndarray], cfg: dr.DraftConfig, dtype, where: str):
    """The head's own embedding [V, D], or None when it carries none."""
    embed = None
    if _EMBED in tensors:
        e = tensors[_EMBED]
        if tuple(e.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise Eagle3Error(
                f"{where}: {_EMBED} has shape {tuple(e.shape)}, expected "
                f"({cfg.vocab_size}, {cfg.hidden_size}) from config.json"
            )
        embed = put(e, None, dtype)
    return embed


def check_compatible(
    draft_cfg: dr.DraftConfig, vocab: DraftVocab, target_cfg: TargetConfig, embed=None
) -> None:
    """Refuses a head that cannot run on this target, before any compute.

    `embed` is the head's own embedding if it has one; without it the target's embedding is used,
    which needs the draft hidden size to equal the target's.
    """
    family = draft_cfg.target_family
    if family is not None and family != target_cfg.family:
        ours = ", ".join(FAMILY_NAMES.get(target_cfg.family, (target_cfg.family,)))
        raise Eagle3Error(
            f"the head was made for a {family} target (its config.json's target model type / "
            f"architecture) and this target is {target_cfg.family} ({ours}): its features "
            "come from another model; use a head trained on this target"
        )
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
    check_aux_ids(draft_cfg, target_cfg)
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


def check_aux_ids(draft_cfg: dr.DraftConfig, target_cfg: TargetConfig) -> None:
    """The head's aux ids name tensors this target has: layer inputs 0..L-1, and id L (the final
    normed state, HF `hidden_states[L]`) only for a head that says it was trained on it
    (`final_norm_aux`). Without that flag id L is refused: it comes from an official "output of
    layer L-1", which SpecForge's current trainer takes before the final norm (its earlier one,
    and HF's hidden_states[L], after it), so the head could silently read another tensor."""
    ids, n = draft_cfg.aux_layer_ids, target_cfg.num_layers
    if draft_cfg.final_norm_aux and max(ids) != n:
        raise Eagle3Error(
            f"the head's config says (final_norm_aux) that its largest aux id, {max(ids)}, is the "
            f"final normed state of a {max(ids)}-layer target; this target has {n} layers: it "
            "was trained for another target"
        )
    top = n if draft_cfg.final_norm_aux else n - 1
    bad = sorted({i for i in ids if not 0 <= i <= top})
    if bad == [n]:
        raise Eagle3Error(
            f"draft aux layer ids {ids} include {n}, an official config's output of the last "
            "layer, which trainers take before the final norm (SpecForge today) or after it "
            "(HF's hidden_states): ambiguous, so refused. A head known to be trained on the "
            'normed state runs with "eagle3_jax": {"final_norm_aux": true} in its config.json'
        )
    if bad:
        raise Eagle3Error(
            f"draft aux layer ids {ids} (inputs to target "
            f"layers) include {bad}, outside the target's layers "
            f"0..{n - 1}: the head was trained for a deeper "
            "target, or its ids are off by one"
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
    tensors = _official_tensors(params, cfg, vocab, np_dtype, embed)
    if layout == layouts.SPECULATORS:
        if cfg.final_norm_aux:
            raise Eagle3Error(
                f"the head reads the target's final normed state (aux ids {cfg.aux_layer_ids}, "
                "final_norm_aux): vLLM captures only layer inputs, so it cannot run this head"
            )
        if verifier is None:
            raise Eagle3Error(
                "the speculators layout names its verifier (the target): give its name or path"
            )
        hf = layouts.to_speculators(hf, verifier[0], verifier[1], speculative_tokens)
    tensors = layouts.tensors_to_layout(tensors, layout)
    with atomic_directory(path, overwrite=overwrite, sources=sources) as tmp:
        write_safetensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))


def _official_tensors(params: dr.Params, cfg: dr.DraftConfig, vocab: DraftVocab, np_dtype, embed):
    """The head's tensors by official name, [in, out] transposed to PyTorch's [out, in], in
    `np_dtype`: d2t/t2d when Vd < V, embed_tokens.weight when `embed` is given."""
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
    return tensors
