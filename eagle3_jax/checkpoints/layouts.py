"""The published EAGLE-3 head layouts, read and written: which config keys and tensor names each
runtime uses, normalised to one form (the official one) for `eagle_format`.

Two layouts exist in the wild (docs/interop.md lists each runtime's rules with their sources):

  official     config.json of a Llama draft (`LlamaForCausalLMEagle3`, `Eagle3LlamaForCausalLM` or
               `LlamaForCausalLM`), tensors `midlayer.*`: written by SafeAILab/EAGLE, SpecForge and
               eagle3_jax, read by EAGLE, SGLang and vLLM.
  speculators  vLLM's `speculators` library (`Eagle3Speculator`): the decoder layer's settings under
               `transformer_layer_config`, `speculators_config` naming the verifier, tensors
               `layers.0.*`; read by vLLM and the speculators library.

The layer-id keys are the trap between them: `eagle_config.eagle_aux_hidden_state_layer_ids`
(SpecForge, SGLang) names target layer OUTPUTS (SGLang adds 1 before capturing), while a top-level
`eagle_aux_hidden_state_layer_ids` (vLLM, speculators) names `hidden_states` indices, used as they
are. Our `aux_layer_ids` are `hidden_states` indices (inputs to target layers): nested + 1 == top.
"""

from __future__ import annotations

from typing import Any

from eagle3_jax.errors import Eagle3Error

OFFICIAL = "official"
SPECULATORS = "speculators"
LAYOUTS = (OFFICIAL, SPECULATORS)

# the decoder layer's keys a speculators config keeps under transformer_layer_config
_LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "num_hidden_layers",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
)


def detect(hf: dict[str, Any]) -> str:
    """The layout of a head's config.json."""
    if "speculators_model_type" in hf or "transformer_layer_config" in hf:
        return SPECULATORS
    return OFFICIAL


def aux_ids_from_config(hf: dict[str, Any]) -> tuple[int, ...] | None:
    """The head's aux layers as `hidden_states` indices (our convention), from either key; None
    when the config names none (every runtime then takes the target's (2, L//2, L-3))."""
    import json

    eagle = hf.get("eagle_config") or {}
    if isinstance(eagle, str):  # some exporters serialise the nested config as a JSON string
        try:
            eagle = json.loads(eagle)
        except ValueError:
            raise Eagle3Error(
                "config.json eagle_config is a string that is not JSON: fix it"
            ) from None
    nested, top = (
        eagle.get("eagle_aux_hidden_state_layer_ids"),
        hf.get("eagle_aux_hidden_state_layer_ids"),
    )
    for name, ids in (("eagle_config.", nested), ("", top)):
        if ids is not None and (not ids or min(int(i) for i in ids) < 0):
            raise Eagle3Error(
                f"config.json {name}eagle_aux_hidden_state_layer_ids {ids} is empty or has a "
                "negative id"
            )
    ours_nested = None if nested is None else tuple(int(i) + 1 for i in nested)
    ours_top = None if top is None else tuple(int(i) for i in top)
    if ours_nested is not None and ours_top is not None and ours_nested != ours_top:
        raise Eagle3Error(
            f"config.json names two layer sets: eagle_config.eagle_aux_hidden_state_layer_ids "
            f"{nested} (layer outputs, read by SGLang/SpecForge) and a top-level "
            f"eagle_aux_hidden_state_layer_ids {top} (hidden_states indices, read by vLLM); they "
            "should differ by exactly 1: fix the one the head was not trained with"
        )
    return ours_nested if ours_nested is not None else ours_top


def aux_ids_to_config(aux_layer_ids) -> dict[str, Any]:
    """Both keys, so that every runtime captures the layers the head was trained on: the nested
    one (layer outputs) for SpecForge/SGLang, the top-level one (hidden_states indices) for vLLM."""
    ids = [int(i) for i in aux_layer_ids]
    if min(ids) < 1:
        raise Eagle3Error(
            f"aux layer id 0 (the embedding output) in {tuple(ids)} has no layer-output name in "
            "the official format: use ids >= 1"
        )
    return {
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
            "use_aux_hidden_state": True,
        },
        "eagle_aux_hidden_state_layer_ids": ids,
    }


def check_official_flags(hf: dict[str, Any]) -> None:
    """Refuses the variants a trainer may have switched on: computing them as the plain head
    would be silently wrong. In this layout `norm_output` is SpecForge's (false: lm_head without
    the final norm); in the speculators layout it means something else (`from_speculators`)."""
    if hf.get("fc_norm") or hf.get("use_aux_norm"):
        raise Eagle3Error(
            "draft config sets fc_norm (per-feature RMSNorm before fc): unsupported; "
            "use a head trained without it"
        )
    eagle = hf.get("eagle_config") if isinstance(hf.get("eagle_config"), dict) else {}
    if hf.get("norm_before_fc") or eagle.get("norm_before_fc"):
        raise Eagle3Error(
            "draft config sets norm_before_fc (RMSNorm before fc): unsupported; use a head "
            "trained without it"
        )
    if hf.get("norm_output") is False:
        raise Eagle3Error(
            "draft config sets norm_output=false (lm_head without the final norm): "
            "unsupported; use a head trained with the final norm"
        )
    if hf.get("norm_before_residual"):
        raise Eagle3Error(
            "draft config sets norm_before_residual (residual taken after "
            "hidden_norm): unsupported; use a head trained without it"
        )
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise Eagle3Error(
            "draft config sets attention_bias/mlp_bias: unsupported; eagle3_jax runs bias-free "
            "Llama decoder layers"
        )


def from_speculators(hf: dict[str, Any]) -> dict[str, Any]:
    """An `Eagle3Speculator` config.json as the official-form dict `draft_config_from_hf` reads."""
    kind = hf.get("speculators_model_type")
    if kind != "eagle3":
        raise Eagle3Error(
            f"speculators config with speculators_model_type {kind!r}: only eagle3 heads can run "
            "here"
        )
    layer = hf.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise Eagle3Error("speculators config has no transformer_layer_config: incomplete head")
    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        raise Eagle3Error(
            f"speculators head with a {model_type!r} decoder layer (transformer_layer_config): "
            "unsupported; eagle3_jax runs Llama-layer heads"
        )
    if "norm_before_residual" not in hf:
        raise Eagle3Error(
            "speculators config lacks norm_before_residual: vLLM then assumes true and the "
            "speculators library false; set it to the value the head was trained with"
        )
    if hf.get("norm_output"):
        raise Eagle3Error(
            "speculators config sets norm_output=true (the normed state fed back between "
            "draft steps): unsupported; use a head trained without it"
        )
    for flag in ("norm_before_fc", "fc_norm", "norm_before_residual"):
        if hf.get(flag):
            check_official_flags({flag: True})
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        check_official_flags({"attention_bias": True})
    out: dict[str, Any] = {k: layer[k] for k in _LAYER_KEYS if k in layer}
    out["architectures"] = ["LlamaForCausalLMEagle3"]
    out["model_type"] = "llama"
    out["draft_vocab_size"] = hf.get("draft_vocab_size") or layer.get("vocab_size")
    if hf.get("target_hidden_size"):
        out["target_hidden_size"] = hf["target_hidden_size"]
    if hf.get("eagle_aux_hidden_state_layer_ids") is not None:
        out["eagle_aux_hidden_state_layer_ids"] = hf["eagle_aux_hidden_state_layer_ids"]
    verifier = (hf.get("speculators_config") or {}).get("verifier") or {}
    if verifier.get("architectures"):  # the target it was made for (head_config reads it)
        out["target_architectures"] = list(verifier["architectures"])
    if "eagle3_jax" in hf:
        out["eagle3_jax"] = hf["eagle3_jax"]
    return out


def to_speculators(
    official: dict[str, Any],
    verifier: str,
    verifier_architectures: list[str],
    speculative_tokens: int = 3,
) -> dict[str, Any]:
    """An official-form config.json (`draft_config_to_hf`) in the speculators layout. Every flag
    is written explicitly: vLLM reads a missing `norm_before_residual` as true."""
    if speculative_tokens < 1:
        raise Eagle3Error(f"speculative_tokens {speculative_tokens}: give 1 or more")
    layer = {k: official[k] for k in _LAYER_KEYS if k in official}
    layer.update(model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=False,
                 mlp_bias=False, tie_word_embeddings=False)  # fmt: skip
    hidden = official["hidden_size"]
    out = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier,
                "architectures": list(verifier_architectures),
            },
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": official["draft_vocab_size"],
        "target_hidden_size": official.get("target_hidden_size", hidden),
        "eagle_aux_hidden_state_layer_ids": official["eagle_aux_hidden_state_layer_ids"],
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "torch_dtype": official.get("torch_dtype", "bfloat16"),
    }
    if "eagle3_jax" in official:
        out["eagle3_jax"] = official["eagle3_jax"]
    return out


def tensors_to_official(tensors: dict, where: str) -> dict:
    """`layers.0.*` (speculators, newer SGLang/vLLM names) as `midlayer.*`; a `model.` prefix and
    recomputable rotary buffers dropped; a second decoder layer refused."""
    out = {}
    for name, arr in tensors.items():
        name = name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name.startswith("layers."):
            idx, _, rest = name[len("layers.") :].partition(".")
            if idx != "0":
                raise Eagle3Error(
                    f"{where}: tensor {name} belongs to decoder layer {idx}: only "
                    "single-layer EAGLE-3 heads can run here"
                )
            name = "midlayer." + rest
        out[name] = arr
    return out


def tensors_to_layout(tensors: dict, layout: str) -> dict:
    """Official tensor names as `layout` names them."""
    if layout == OFFICIAL:
        return dict(tensors)
    if layout == SPECULATORS:
        return {
            ("layers.0." + n[len("midlayer.") :] if n.startswith("midlayer.") else n): a
            for n, a in tensors.items()
        }
    raise Eagle3Error(f"layout {layout!r}: use one of {', '.join(LAYOUTS)}")
