"""An EAGLE-3 head's config.json, both ways: `draft_config_from_hf` reads an official (or
SpecForge, SGLang, vLLM) config into a DraftConfig and refuses what we cannot run;
`draft_config_to_hf` writes one that every runtime reads. Our output-layer extensions (a head
reading the target's lm_head, SpecVocab) and a head fed the target's final normed state
(`final_norm_aux`: no other runtime captures it) travel in an "eagle3_jax" block, absent from a
plain head's config.

`eagle_config.eagle_aux_hidden_state_layer_ids` names target layer OUTPUTS; our
`DraftConfig.aux_layer_ids` name layer INPUTS (HF hidden_states indices), so ours = theirs + 1;
a top-level `eagle_aux_hidden_state_layer_ids` (vLLM's key) names hidden_states indices, ours as is
(`layouts`).

The target a head was made for (`DraftConfig.target_family`) is written as `target_model_type`
(SpecForge's key, e.g. its Gemma 3 heads') and `target_architectures`; read from those, from a
speculators head's verifier architectures, or from a head's own `model_type` where it is not
"llama" (SpecForge's gpt-oss heads name "gpt_oss" there). `eagle_format.check_compatible` refuses
a head whose recorded family is not its target's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_jax.checkpoints import layouts
from eagle3_jax.config import (
    FAMILIES,
    FAMILY_NAMES,
    MODEL_TYPES,
    RopeConfig,
    TargetConfig,
    _rope_from_hf,
)
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as dr

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")


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
        target_family=target_family_from_hf(hf),
        **_output_from_hf(hf),
    )


def target_family_from_hf(hf: dict[str, Any]) -> str | None:
    """The family of the target a head's config.json names (`target_architectures`,
    `target_model_type`, or a `model_type` other than the head's own "llama"), as our family
    name, or as the name given where it is none of ours; None where it names none. Names that
    disagree are refused."""
    archs = hf.get("target_architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    named = [(f"target_architectures {a!r}", FAMILIES.get(a, a)) for a in archs]
    for key in ("target_model_type", "model_type"):
        kind = hf.get(key)
        if kind and not (key == "model_type" and kind == "llama"):
            named.append((f"{key} {kind!r}", MODEL_TYPES.get(kind, kind)))
    families = {f for _, f in named}
    if len(families) > 1:
        raise Eagle3Error(
            f"the head's config.json names targets of different families ("
            f"{', '.join(w for w, _ in named)}): fix the one it was not trained for"
        )
    return families.pop() if families else None


_OUTPUT_FIELDS = ("lm_head_source", "speculator_rank", "spec_candidates", "final_norm_aux")


def _output_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Our extensions (config.json "eagle3_jax" block: the output layer, a feature read from the
    final normed state); absent in official heads."""
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
    elif rope.kind == "yarn":  # attention_factor written out: it may not be the factor's default
        out["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": float(rope.factor),
            "original_max_position_embeddings": int(rope.original_max_position),
            "beta_fast": float(rope.beta_fast),
            "beta_slow": float(rope.beta_slow),
            "truncate": bool(rope.truncate),
            "attention_factor": float(rope.attention_factor),
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
        **_target_to_hf(cfg.target_family),
        **_output_to_hf(cfg),
    }


def _target_to_hf(family: str | None) -> dict[str, Any]:
    """The target's model_type and architecture (ours' canonical names; a name that is none of
    our families as it was read); nothing where the head records none."""
    if family is None:
        return {}
    model_type, arch = FAMILY_NAMES.get(family, (family, None))
    out: dict[str, Any] = {"target_model_type": model_type}
    if arch is not None:
        out["target_architectures"] = [arch]
    return out


def _output_to_hf(cfg: dr.DraftConfig) -> dict[str, Any]:
    """Non-default extensions only: a plain EAGLE-3 head's config.json stays official."""
    default = dr.DraftConfig.__dataclass_fields__
    ext = {f: getattr(cfg, f) for f in _OUTPUT_FIELDS if getattr(cfg, f) != default[f].default}
    if cfg.speculator_rank:
        ext["spec_candidates"] = cfg.spec_candidates
    return {"eagle3_jax": ext} if ext else {}


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
