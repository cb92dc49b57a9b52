"""The models' frozen configs (static arguments of every jitted function): the target's
(TargetConfig, read from a transformers config.json), the draft head's (DraftConfig), RoPE and its
frequencies, how a few rows are multiplied (ProductPolicy), dtype names and defaults. The tree's
shape is `decoding.tree.TreeConfig`; a training run's is `training.config.TrainConfig`."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.errors import Eagle3Error

# HF `architectures` / `model_type` -> our family name.
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Olmo2ForCausalLM": "olmo2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text model; the vision tower is ignored
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "OlmoeForCausalLM": "olmoe",
}
MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "olmo2": "olmo2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "gpt_oss": "gpt_oss",
    "olmoe": "olmoe",
}
# our family name -> the model_type and architecture a head's config.json records for its target
# (`target_model_type`, `target_architectures`: checkpoints.head_config)
FAMILY_NAMES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
}
# the families whose o_proj has a bias where config.json's attention_bias is true (transformers
# 5.24's modeling files; Qwen2's, Mistral's and Mixtral's never has)
_OUT_BIAS_FAMILIES = ("llama", "qwen3", "olmo2", "gemma3", "qwen3_moe", "gpt_oss", "olmoe")
# the mixture-of-experts families (`TargetConfig.num_experts` > 0)
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "olmoe")


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def default_dtype(name: str | None = None):
    """The parameter dtype a name gives, or the backend's default: float32 on the CPU (exact
    greedy equivalence, and no bf16 matrix units to gain from), bfloat16 on GPUs and TPUs."""
    if name is None:
        name = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return DTYPES[name]


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: `kind` is "default", "linear", "llama3" or "yarn".

    YaRN (gpt-oss) reads `factor`, `original_max_position`, `beta_fast`, `beta_slow` and
    `truncate` (`rope_inv_freq`), and multiplies the cos/sin tables by `attention_factor`
    (transformers' attention_scaling, its "mscale": 1 for every other kind). `to_json` leaves
    these four fields out at their defaults, so other configs' files are unchanged."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class ProductPolicy:
    """How `models.layers.dense` / `dense_t` multiply a few rows: a static choice, part of the
    compiled program. `row_products`: the most rows (2..) done as one vector-matrix product per row
    by `dense`; `logit_reduce`: the most rows done as a row reduction by `dense_t` (a weight stored
    out-by-in, the tied output layer). 0 = plain XLA products for any row count: the default, what
    accelerators and training use. Entry points on the CPU take this machine's choice from
    `eagle3_jax.cpu_tuning.policy_for`."""

    row_products: int = 0
    logit_reduce: int = 0


PLAIN_PRODUCTS = ProductPolicy()


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A decoder-only target model (Llama / Mistral / Qwen2 / Qwen3 / OLMo 2 / Gemma 3's text
    model, and the mixture-of-experts Qwen3-MoE / Mixtral / gpt-oss / OLMoE).

    `qk_norm`: "none", "head" (Qwen3: RMSNorm over head_dim per head) or "full" (OLMo 2: RMSNorm over
    all heads' q and k before the head split). `norm_placement`: "pre" (Llama), "post" (OLMo 2: the
    norm is applied to each block's output before the residual add) or "sandwich" (Gemma 3: both,
    four norms a layer). `sliding_window`: the window of the sliding-window layers, every layer but
    those in `full_attention_layers` (Mistral: all; Gemma 3, gpt-oss: their "sliding_attention"
    layer_types); the layers apply it themselves (`models.target.forward`), so callers' masks
    are plain causal. `products`: how a few rows are multiplied (ProductPolicy); `attention`:
    how attention computes its probabilities and p.V (`models.layers.attention`: "exact", or
    "mixed" as flash attention does); `moe_dispatch`: how a routed layer runs its experts
    (`models.target.MOE_DISPATCHES`: "dense", every expert on every token; "gather", a small
    forward's chosen experts gathered and the rest dense; "ragged", the same gather and larger
    forwards token-sorted through `jax.lax.ragged_dot`), a forward gathering while its n x k
    (token, expert) pairs are at most `moe_gather_pairs` x E (under `moe_mesh`, a device's
    pairs against its own experts: `models.target.moe_path`); `moe_mesh`: the device mesh
    over which a gathered or ragged dispatch runs each device on its own rows and experts
    (`models.target._moe_on_mesh`; None on one device); all five properties of the machine,
    not of the checkpoint (`eagle3_jax.backends` chooses them), so they are left out of
    `to_json`.

    Mixture of experts (`num_experts` > 0): the layers in `moe_layers` replace the SwiGLU MLP
    by `num_experts` SwiGLU experts of width `moe_intermediate_size`, of which a router picks
    `num_experts_per_tok` per token (`models.target`'s routed MLP); the other layers keep a dense
    MLP of width `intermediate_size` (Qwen3-MoE's `mlp_only_layers` / `decoder_sparse_step`).
    `norm_topk_prob`: the chosen experts' probabilities are renormalised to sum to 1 (Mixtral
    always; Qwen3-MoE where its config says). Dense configs leave these fields at their defaults,
    and `to_json` leaves them out.

    Gemma 3 (`to_json` leaves each out at its default): `full_attention_layers`, the layers
    exempt from the window; `sliding_rope`, the RoPE of the sliding-window layers where it differs
    from `rope` (Gemma 3's local base frequency; `rope`, with its scaling, is the global layers');
    `norm_unit_offset`, RMSNorm as x * (1 + w) with the product in fp32; `mlp_activation`
    ("silu", "gelu_tanh", "gelu") of the gated MLP; `scale_embeddings`, the embedding rows
    multiplied by sqrt(hidden_size) rounded to the parameters' dtype, as transformers'
    Gemma3TextScaledWordEmbedding does (the draft head reads the rows unscaled, as SpecForge and
    vLLM's EAGLE-3 heads do: docs/design.md, "Gemma 3 targets"); `query_pre_attn_scalar`, the
    attention scale's 1 / sqrt of it in place of head_dim's; `final_logit_softcapping`, the
    logits as cap * tanh(x / cap) where set.

    gpt-oss (`to_json` leaves each out at its default; docs/design.md, "gpt-oss targets"):
    `attention_sinks`, a learned logit per query head (the layer's `sinks` [H]) that joins each
    softmax's denominator and nothing else; `attention_out_bias`, the output projection's bias
    `bo` [D] (also where Llama's, Qwen3's, OLMo 2's, Gemma 3's, Qwen3-MoE's or OLMoE's
    attention_bias is true: their o_proj takes it, as q/k/v do); `moe_bias`, biases on the router and on every
    expert projection; `router_topk_logits`, the top k of the router's logits and then the softmax over those k
    (rather than the top k of the softmax over all experts); `swiglu_limit` / `swiglu_alpha`,
    the experts' clamped SwiGLU, (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
    g = min(gate, limit), where set.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    attention_bias: bool = False
    qk_norm: str = "none"
    norm_placement: str = "pre"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    full_attention_layers: tuple[int, ...] = ()
    sliding_rope: RopeConfig | None = None
    norm_unit_offset: bool = False
    mlp_activation: str = "silu"
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attention_sinks: bool = False
    attention_out_bias: bool = False
    moe_bias: bool = False
    router_topk_logits: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    products: ProductPolicy = PLAIN_PRODUCTS
    attention: str = "exact"
    moe_dispatch: str = "dense"
    moe_gather_pairs: float = 1.0
    moe_mesh: Any = None  # a jax.sharding.Mesh (hashable, so the config stays a static argument)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is routed over experts."""
        return layer in self.moe_layers

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether layer `layer` attends only to the last `sliding_window` positions."""
        return self.sliding_window is not None and layer not in self.full_attention_layers

    @property
    def attention_scale(self) -> float | None:
        """The scores' scale where it is not 1 / sqrt(head_dim) (Gemma's query_pre_attn_scalar)."""
        q = self.query_pre_attn_scalar
        return None if q is None else float(q) ** -0.5

    @property
    def mixed_layers(self) -> bool:
        """Whether some layers are routed and some dense (they cannot be stacked for a scan)."""
        return 0 < len(self.moe_layers) < self.num_layers

    def default_aux_layer_ids(self) -> tuple[int, ...]:
        """EAGLE-3's low/mid/high features: the inputs to layers 2, L//2 and L-3."""
        n = self.num_layers
        return (
            (2, n // 2, n - 3) if n >= 6 else tuple(sorted({min(1, n - 1), n // 2, max(n - 2, 0)}))
        )

    def check_aux_layer_ids(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        """Aux ids index HF `hidden_states`: i in [0, L) is the input to layer i, L the final norm."""
        ids = tuple(int(i) for i in ids)
        if not ids:
            raise Eagle3Error(
                "aux layer ids are empty: name at least one target layer (e.g. 2,15,27)"
            )
        bad = [i for i in ids if not 0 <= i <= self.num_layers]
        if bad:
            raise Eagle3Error(
                f"aux layer id(s) {bad} outside the target's 0..{self.num_layers} "
                f"({self.num_layers} layers); use ids in that range"
            )
        return ids

    def to_json(self) -> str:
        d = dataclasses.asdict(dataclasses.replace(self, moe_mesh=None))  # asdict copies a Mesh
        for name in ("products", "attention", "moe_dispatch", "moe_gather_pairs", "moe_mesh"):
            del d[name]
        if not self.num_experts:  # a dense config's file stays as it was before MoE targets
            for name in _MOE_FIELDS:
                del d[name]
        for name, default in {**_GEMMA_FIELDS, **_GPT_OSS_FIELDS}.items():  # and before those
            if d[name] == default:
                del d[name]
        for name in ("rope", "sliding_rope"):  # YaRN's fields only where they say something
            if d.get(name) is not None:
                for field, default in _YARN_FIELDS.items():
                    if d[name][field] == default:
                        del d[name][field]
        return json.dumps(d, indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TargetConfig:
        d = dict(d)
        if "products" in d:  # from asdict: to_json leaves it out
            d["products"] = ProductPolicy(**d["products"])
        d["rope"] = RopeConfig(**d.get("rope", {}))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["moe_layers"] = tuple(d.get("moe_layers", ()))
        d["full_attention_layers"] = tuple(d.get("full_attention_layers", ()))
        if d.get("sliding_rope") is not None:
            d["sliding_rope"] = RopeConfig(**d["sliding_rope"])
        return cls(**d)


_MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "moe_layers",
)
# Gemma 3's fields and their defaults (what every other family has)
_GEMMA_FIELDS = {
    "full_attention_layers": (),
    "sliding_rope": None,
    "norm_unit_offset": False,
    "mlp_activation": "silu",
    "scale_embeddings": False,
    "query_pre_attn_scalar": None,
    "final_logit_softcapping": None,
}
# gpt-oss's fields and their defaults
_GPT_OSS_FIELDS = {
    "attention_sinks": False,
    "attention_out_bias": False,
    "moe_bias": False,
    "router_topk_logits": False,
    "swiglu_limit": None,
    "swiglu_alpha": None,
}
# RopeConfig's YaRN fields and their defaults
_YARN_FIELDS = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True, "attention_factor": 1.0}


def _rope_from_hf(hf: dict[str, Any], theta: float = 10000.0) -> RopeConfig:
    """The RoPE of a config.json (`theta` where it names none: the family's default)."""
    # transformers 5.x keeps theta and scaling under `rope_parameters`; 4.x under rope_theta/rope_scaling.
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    if scaling:
        params = {**params, **scaling}
    return _rope_params(
        params, float(hf.get("rope_theta", theta)), hf.get("max_position_embeddings")
    )


def _rope_params(
    params: dict[str, Any], theta: float, max_position: int | None = None
) -> RopeConfig:
    """A RopeConfig from one transformers rope-parameters dict (theta where it names none;
    `max_position`, the config's max_position_embeddings, for YaRN's defaults)."""
    theta = float(params.get("rope_theta", theta))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    if kind == "yarn":
        return _yarn(params, theta, max_position)
    raise Eagle3Error(
        f"unsupported RoPE scaling {kind!r}: supported are default, linear, llama3 and yarn; "
        "convert the checkpoint or drop rope_scaling from config.json"
    )


def _yarn(params: dict[str, Any], theta: float, max_position: int | None) -> RopeConfig:
    """YaRN's RopeConfig as transformers' `_compute_yarn_parameters` reads the dict:
    original_max_position_embeddings defaults to max_position_embeddings, factor to their
    ratio; attention_factor, where not given, is 0.1 ln(factor) + 1 (1 for factor <= 1), or the
    ratio of that formula at mscale and mscale_all_dim where both are set; beta_fast /
    beta_slow 32 / 1 where absent or zero; truncate True where absent."""
    original = params.get("original_max_position_embeddings") or max_position
    if original is None:
        raise Eagle3Error(
            "YaRN RoPE needs original_max_position_embeddings (or max_position_embeddings) "
            "in config.json"
        )
    factor = params.get("factor")
    if factor is None:
        if max_position is None:
            raise Eagle3Error("YaRN RoPE needs a factor or max_position_embeddings in config.json")
        factor = max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeConfig(
        theta=theta,
        kind="yarn",
        factor=float(factor),
        original_max_position=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention),
    )


def target_config_from_hf(hf: dict[str, Any]) -> TargetConfig:
    """Builds a TargetConfig from a transformers `config.json` dict; refuses what we cannot run."""
    archs = hf.get("architectures") or []
    family = next((FAMILIES[a] for a in archs if a in FAMILIES), None)
    if family is None:
        family = MODEL_TYPES.get(hf.get("model_type", ""))
    if family is None:
        raise Eagle3Error(
            f"unsupported architecture {archs or hf.get('model_type')!r}: eagle3_jax runs "
            f"{', '.join(FAMILIES)} checkpoints"
        )
    if hf.get("clip_qkv") is not None:  # OLMo 1 / OLMoE's option; released OLMoE leaves it null
        raise Eagle3Error(
            f"this {family} config.json sets clip_qkv={hf['clip_qkv']}: clamping q/k/v after "
            "their projections is not implemented"
        )
    layered: dict[str, Any] = {}  # Gemma 3's or gpt-oss's: per-layer windows, their RoPE
    if family == "gemma3":
        hf = _gemma3_text_config(hf)
        layered = _gemma3_fields(hf)
    elif family == "gpt_oss":
        layered = _gpt_oss_fields(hf)
    hidden = int(hf["hidden_size"])
    heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    window = hf.get("sliding_window")
    if family == "qwen2" and not hf.get("use_sliding_window", False):
        window = None
    if family in ("qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
        window = None
    # transformers' attention modules: Qwen2's q/k/v always carry a bias and its o_proj never;
    # Mistral's and Mixtral's carry none; the others put one on q/k/v and o_proj alike where
    # attention_bias says so (gpt-oss's default True)
    bias = {"qwen2": True, "mistral": False, "mixtral": False}.get(
        family, bool(hf.get("attention_bias", family == "gpt_oss"))
    )
    if layered:
        if len(layered["full_attention_layers"]) == int(hf["num_hidden_layers"]):
            window = None
        if not window:  # no layer is windowed
            layered["full_attention_layers"] = ()
    return TargetConfig(
        family=family,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=layered.pop("rope") if layered else _rope_from_hf(hf),
        attention_bias=bias,
        attention_out_bias=bias and family in _OUT_BIAS_FAMILIES,
        qk_norm={
            "qwen3": "head",
            "qwen3_moe": "head",
            "olmo2": "full",
            "gemma3": "head",
            "olmoe": "full",
        }.get(family, "none"),  # fmt: skip
        norm_placement={"olmo2": "post", "gemma3": "sandwich"}.get(family, "pre"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        sliding_window=int(window) if window else None,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=hf.get("pad_token_id"),
        **(_moe_from_hf(hf, family) if family in MOE_FAMILIES else {}),
        **layered,
    )


# transformers' Gemma3TextConfig defaults: hub config.json files leave out what they do not change
# (a Gemma3ForConditionalGeneration's text_config names little more than its sizes)
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}
# transformers' activation names -> `TargetConfig.mlp_activation`
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}


def _gemma3_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 text model's config.json fields with transformers' defaults filled in: those of
    a Gemma3ForCausalLM (model_type gemma3_text), or a Gemma3ForConditionalGeneration's
    text_config (model_type gemma3), which takes the token ids and the tying from the top level
    where it does not name them itself."""
    text = dict(hf)
    if "text_config" in hf or hf.get("model_type") == "gemma3":
        text = dict(hf.get("text_config") or {})
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            if name not in text and hf.get(name) is not None:
                text[name] = hf[name]
    out = {**_GEMMA3_TEXT_DEFAULTS, **text}
    if "sliding_window_pattern" not in text and "_sliding_window_pattern" in text:
        out["sliding_window_pattern"] = text["_sliding_window_pattern"]
    return out


def _gemma3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """TargetConfig's Gemma 3 fields (and its `rope`, the global layers') from a filled-in text
    config (`_gemma3_text_config`), as transformers' Gemma3TextConfig reads them: layer i is a
    sliding-window layer where layer_types says "sliding_attention", or, without layer_types,
    unless (i + 1) is a multiple of sliding_window_pattern; the global layers' RoPE is
    rope_parameters["full_attention"] (transformers 5) or rope_theta with rope_scaling (4.x), the
    sliding layers' rope_parameters["sliding_attention"] or rope_local_base_freq."""
    if hf.get("use_bidirectional_attention"):
        raise Eagle3Error(
            "this Gemma 3 config sets use_bidirectional_attention (an encoder, not a causal "
            "decoder): eagle3_jax runs causal targets only"
        )
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise Eagle3Error(
            f"Gemma 3 hidden_activation {act!r} is not supported: use one of "
            f"{', '.join(_ACTIVATIONS)}"
        )
    full_layers = _full_attention_layers(hf, int(hf.get("sliding_window_pattern") or 6), "Gemma 3")
    params = hf.get("rope_parameters") or {}
    per_type = isinstance(params.get("full_attention"), dict) or isinstance(
        params.get("sliding_attention"), dict
    )
    if per_type:
        full = _rope_params(params.get("full_attention") or {}, hf["rope_theta"])
        local = _rope_params(params.get("sliding_attention") or {}, hf["rope_local_base_freq"])
    else:
        full = _rope_from_hf({**hf, "rope_parameters": params})
        local = RopeConfig(theta=float(hf["rope_local_base_freq"]))
    # attn_logit_softcapping is Gemma 2's: transformers' Gemma 3 attention keeps the field but
    # never applies it (QK-norm took its place), so neither do we
    cap = hf.get("final_logit_softcapping")
    return dict(
        rope=full,
        full_attention_layers=full_layers,
        sliding_rope=None if local == full else local,
        norm_unit_offset=True,
        mlp_activation=_ACTIVATIONS[act],
        scale_embeddings=True,
        query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
        final_logit_softcapping=None if cap is None else float(cap),
    )


def _full_attention_layers(hf: dict[str, Any], pattern: int, name: str) -> tuple[int, ...]:
    """The layers exempt from the sliding window, as transformers reads them (Gemma 3,
    gpt-oss): layer i is a sliding-window layer where layer_types says "sliding_attention", or,
    without layer_types, unless (i + 1) is a multiple of `pattern` (the family's default)."""
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]  # fmt: skip
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise Eagle3Error(
            f"{name} layer_types {types!r} must name {layers} layers, each sliding_attention "
            "or full_attention"
        )
    return tuple(i for i, t in enumerate(types) if t == "full_attention")


# transformers' GptOssConfig defaults where config.json leaves them out: its RoPE (YaRN) and
# theta, the experts' clamped SwiGLU
_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_GPT_OSS_THETA = 150_000.0


def _gpt_oss_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """TargetConfig's gpt-oss fields (and its `rope` and `full_attention_layers`) from a
    GptOssForCausalLM config.json, as transformers' GptOssConfig and modeling_gpt_oss read it:
    layer_types (default: every other layer slides, the first included), RoPE from
    rope_parameters / rope_scaling (YaRN, factor 32, where it names none) with theta 150000 by
    default, attention biases on q/k/v and o (attention_bias, default True), per-head sinks,
    biased router and experts, top-k of the router logits then their softmax, the clamped
    SwiGLU (swiglu_limit 7, swiglu_alpha 1.702). Quantised weights other than the hub's MXFP4
    experts (`checkpoints.mxfp4`) are refused."""
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise Eagle3Error(
            f"gpt-oss quantization_config quant_method {quant!r} is not supported: eagle3_jax "
            "reads unquantised weights or the hub's MXFP4 experts"
        )
    if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
        hf = {**hf, "rope_parameters": dict(_GPT_OSS_ROPE)}
    return dict(
        rope=_rope_from_hf(hf, _GPT_OSS_THETA),
        full_attention_layers=_full_attention_layers(hf, 2, "gpt-oss"),
        attention_sinks=True,
        moe_bias=True,
        router_topk_logits=True,
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
    )


def _moe_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """TargetConfig's expert fields from a Qwen3-MoE, Mixtral, gpt-oss or OLMoE config.json
    (transformers' own rules: Qwen3MoeDecoderLayer routes layer i unless i is in mlp_only_layers
    or (i + 1) is not a multiple of decoder_sparse_step; Mixtral and gpt-oss route every layer,
    their experts as wide as intermediate_size, the chosen experts' weights summing to 1; OLMoE
    routes every layer too, its experts as wide as intermediate_size, renormalised where
    norm_topk_prob says so, as Qwen3-MoE)."""
    layers = int(hf["num_hidden_layers"])
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    top_k = int(hf.get("num_experts_per_tok") or hf.get("experts_per_token") or 0)
    if family in ("mixtral", "gpt_oss", "olmoe"):  # every layer routed, experts intermediate_size
        width, moe = int(hf["intermediate_size"]), tuple(range(layers))
        # gpt-oss: the softmax over the top-k logits sums to 1; OLMoE as its config says
        norm = bool(hf.get("norm_topk_prob", False)) if family == "olmoe" else True
    else:
        width, norm = int(hf["moe_intermediate_size"]), bool(hf.get("norm_topk_prob", False))
        step = int(hf.get("decoder_sparse_step") or 1)
        dense = set(hf.get("mlp_only_layers") or ())
        moe = tuple(
            i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0
        )
    if moe and not 1 <= top_k <= experts:
        raise Eagle3Error(
            f"{family} config.json routes each token to {top_k} of {experts} experts: "
            "num_experts_per_tok must be between 1 and the number of experts"
        )
    return dict(
        num_experts=experts if moe else 0,
        num_experts_per_tok=top_k if moe else 0,
        moe_intermediate_size=width if moe else 0,
        norm_topk_prob=norm if moe else False,
        moe_layers=moe,
    )


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Per-pair inverse frequencies [K/2], float32, computed as transformers does (so parity is tight)."""
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / (np.float32(rope.theta) ** exps)).astype(np.float32)
    if rope.kind == "linear":
        return (inv / np.float32(rope.factor)).astype(np.float32)
    if rope.kind == "llama3":
        old = np.float32(rope.original_max_position)
        low_wavelen = old / np.float32(rope.low_freq_factor)
        high_wavelen = old / np.float32(rope.high_freq_factor)
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / np.float32(rope.factor), inv)
        smooth = (old / wavelen - np.float32(rope.low_freq_factor)) / np.float32(
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / np.float32(rope.factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    return inv


def _yarn_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """YaRN's inverse frequencies, step by step as transformers' `_compute_yarn_parameters`
    (float64 for the correction range, float32 tensors for the rest): the pairs below the
    range keep their frequency (extrapolation), those above it are divided by `factor`
    (interpolation), a linear ramp blends the two between."""
    dim, base = head_dim, rope.theta

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = (np.float32(base) ** exps).astype(np.float32)
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)
    ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    keep = np.float32(1.0) - np.clip(ramp, 0, 1).astype(np.float32)
    return (interpolation * (np.float32(1.0) - keep) + extrapolation * keep).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Sizes of one EAGLE-3 head.

    `aux_layer_ids` use OUR convention: HF `hidden_states` indices, i.e. the INPUTS to target layers
    (default (2, L//2, L-3)). SGLang/SpecForge configs name the same tensors as layer OUTPUTS, one
    less; the checkpoint converter translates. `final_norm_aux`: the largest id is L, the target's
    final NORMED state (HF `hidden_states[L]`, what the LM head reads: EAGLE-1/2's feature), which
    only eagle3_jax captures (every runtime captures layer inputs; docs/interop.md). `rope` is the
    draft's own (theta 10000 unless the head's config says otherwise), not the target's.
    `products`: how a few rows are multiplied (config.ProductPolicy), a property of the machine:
    the loaders give the target's.
    """

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    target_hidden_size: int | None = None  # None: same as hidden_size
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    # Output layer (the draft-vocabulary methods, docs/draft_vocab.md):
    # "own": the head's lm_head [D, Vd] (EAGLE-3; Vd = V is a full-vocabulary head).
    # "target": logits from the TARGET's frozen output embedding over the full vocabulary (EAGLE-1/2
    #   style; FR-Spec restricts it to a subset; SpecVocab adds a speculator). Nothing is stored:
    #   the output embedding is attached at load time as params["out_embed"] [V, D].
    lm_head_source: str = "own"
    speculator_rank: int = 0  # SpecVocab: > 0 adds spec_a [D, r] and spec_b [r, V]
    spec_candidates: int = 0  # SpecVocab: exact-logit candidates per drafted row (decode time);
    # 0 = min(2048, V), the published k
    final_norm_aux: bool = False
    products: ProductPolicy = PLAIN_PRODUCTS
    # the family of the target it was made for (TargetConfig.family), or the model_type /
    # architecture a head's config.json names where it is not one of ours; None: not recorded.
    # Out of == and hash: it changes no program, only which targets `check_compatible` accepts.
    target_family: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if self.target_hidden_size is None:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)
        if not self.aux_layer_ids:
            raise Eagle3Error(
                "draft aux_layer_ids are empty: name the target layers whose inputs "
                "feed the head, e.g. (2, L//2, L-3)"
            )
        if min(self.aux_layer_ids) < 0:
            raise Eagle3Error(
                f"draft aux_layer_ids {self.aux_layer_ids} contain a negative id: "
                "use HF hidden_states indices (inputs to target layers), all >= 0"
            )
        if self.num_heads % self.num_kv_heads:
            raise Eagle3Error(
                f"draft num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads}: fix the head's config"
            )
        if self.head_dim % 2:
            raise Eagle3Error(f"draft head_dim {self.head_dim} is odd: RoPE needs an even head_dim")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise Eagle3Error(
                f"draft_vocab_size {self.draft_vocab_size} must be between 1 and "
                f"vocab_size {self.vocab_size} (the target vocab)"
            )
        if self.lm_head_source not in ("own", "target"):
            raise Eagle3Error(f"lm_head_source {self.lm_head_source!r}: use own or target")
        if self.lm_head_source == "target" and self.draft_vocab_size != self.vocab_size:
            raise Eagle3Error(
                "a head reading the target's output embedding covers the full vocabulary "
                f"(draft_vocab_size {self.draft_vocab_size} != {self.vocab_size}); restrict it "
                "afterwards (FR-Spec) with `python -m eagle3_jax vocab`"
            )
        if self.speculator_rank < 0 or (self.speculator_rank and self.lm_head_source != "target"):
            raise Eagle3Error(
                f"speculator_rank {self.speculator_rank}: SpecVocab needs rank > 0 and "
                "lm_head_source='target' (exact logits come from the target's output embedding)"
            )
        if self.speculator_rank and self.spec_candidates == 0:
            object.__setattr__(self, "spec_candidates", min(2048, self.vocab_size))
        if self.speculator_rank and not 1 <= self.spec_candidates <= self.vocab_size:
            raise Eagle3Error(
                f"spec_candidates {self.spec_candidates} must be in 1..{self.vocab_size}"
            )

    @property
    def draft_choices(self) -> int:
        """The ids a tree's top-k picks among: SpecVocab's candidates, else the draft vocabulary."""
        return self.spec_candidates if self.speculator_rank else self.draft_vocab_size

    @property
    def n_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def uses_target_head(self) -> bool:
        """Whether params["out_embed"] (the target's output embedding) must be attached."""
        return self.lm_head_source == "target"

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features fed to fc (3 * Ht for EAGLE-3)."""
        return self.n_aux * self.target_hidden_size

    @classmethod
    def from_target(cls, target_cfg: TargetConfig, **overrides) -> DraftConfig:
        """A head sized like the target (as published EAGLE-3 heads are), full vocab by default,
        recording the target's family.

        RoPE defaults to theta 10000 without scaling whatever the target uses: the published
        Llama-3.1 head is trained that way (override `rope` for a head that is not). The MLP is
        the target's intermediate_size, dense: a Qwen3-MoE config's dense width (Qwen3-30B-A3B's
        6144, as SpecForge's head for it), a Mixtral's expert width (14336); gpt-oss's experts
        are narrow (2880 = hidden_size), and SpecForge's gpt-oss heads are 6 x hidden_size wide
        (17280 for gpt-oss-20b), which we take; OLMoE's intermediate_size is one expert's (1024,
        half its hidden size) and no published head sets it, so its head takes the width its k
        experts give a token together (8 x 1024 = 8192, OLMo 2 1B's own MLP width).
        """
        width = target_cfg.intermediate_size
        if target_cfg.family == "gpt_oss":
            width = 6 * target_cfg.hidden_size
        elif target_cfg.family == "olmoe":
            width = target_cfg.num_experts_per_tok * target_cfg.moe_intermediate_size
        fields = dict(
            hidden_size=target_cfg.hidden_size,
            intermediate_size=width,
            num_heads=target_cfg.num_heads,
            num_kv_heads=target_cfg.num_kv_heads,
            head_dim=target_cfg.head_dim,
            vocab_size=target_cfg.vocab_size,
            draft_vocab_size=target_cfg.vocab_size,
            aux_layer_ids=target_cfg.default_aux_layer_ids(),
            target_hidden_size=target_cfg.hidden_size,
            rms_norm_eps=target_cfg.rms_norm_eps,
            rope=RopeConfig(theta=10000.0),
            target_family=target_cfg.family,
        )
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise Eagle3Error(
                f"unknown DraftConfig field(s) {sorted(unknown)}: valid are "
                f"{sorted(f.name for f in dataclasses.fields(cls))}"
            )
        return cls(**{**fields, **overrides})
