"""The devices and models the cost model and the exports are sized for: published figures only.

`Device`: one chip's peaks (HBM bandwidth and size, matrix-unit and float32 FLOP/s) from the
vendors' pages, plus three overheads that are our assumptions (each named in `source`);
`DEVICES` the accelerators, `CPU_2CORE` our CPU measurements' machine (assumed figures).
`HBM_BYTES`: the memory per chip the exports' sizes are checked against (DEVICES' hbm_bytes).

Targets two ways, from the same Hugging Face model cards: `TARGETS` as TargetConfigs (sizes
only; what the roofline counts) and `REAL_TARGETS` as the config.json fields, turned into
TargetConfigs by the loaders' own `target_config_from_hf` (`target_config`; what the exports
lower). `tests/test_cost_model.py` checks that both agree. Heads are sized like the target with
EAGLE-3's 32k draft vocabulary (`draft_for`), as the published heads are.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from eagle3_jax.config import (
    PLAIN_PRODUCTS,
    DraftConfig,
    RopeConfig,
    TargetConfig,
    target_config_from_hf,
)
from eagle3_jax.errors import Eagle3Error


@dataclasses.dataclass(frozen=True)
class Device:
    """Published peaks of one chip; the last three fields are our assumptions (stated in
    `source`), not vendor figures."""

    name: str
    hbm_bw: float  # bytes/s
    matmul_flops: float  # FLOP/s of products in the parameters' dtype (bf16 dense; fp32 on CPUs)
    fp32_flops: float  # FLOP/s of products at full float32 precision
    hbm_bytes: float
    launch_s: float = 20e-6  # per jitted program (dispatch + first kernel)
    loop_iter_s: float = 5e-6  # per iteration of a small on-device while loop
    allreduce_s: float = 10e-6  # per all-reduce of an activation across chips (chips > 1)
    source: str = ""


DEVICES: dict[str, Device] = {
    # https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 3.35 TB/s HBM3, 80 GB, BF16 Tensor
    # Core 1,979 TFLOPS with sparsity = 989 dense, FP32 67 TFLOPS)
    "H100": Device(
        "H100 SXM", 3.35e12, 989e12, 67e12, 80e9, 20e-6, 5e-6, 10e-6,
        "nvidia.com/en-us/data-center/h100 (SXM)",
    ),
    # https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: 4.8 TB/s HBM3e, 141 GB, BF16 1,979
    # TFLOPS with sparsity = 989 dense, FP32 67 TFLOPS)
    "H200": Device(
        "H200 SXM", 4.8e12, 989e12, 67e12, 141e9, 20e-6, 5e-6, 10e-6,
        "nvidia.com/en-us/data-center/h200 (SXM)",
    ),
    # https://cloud.google.com/tpu/docs/v5e (819 GBps HBM2, 16 GiB, 197 TFLOPs bf16); no float32
    # matrix unit: a HIGHEST-precision f32 product is 6 bf16 passes
    "TPU v5e": Device(
        "TPU v5e", 819e9, 197e12, 197e12 / 6, 16 * 2**30, 20e-6, 1e-6, 10e-6,
        "cloud.google.com/tpu/docs/v5e",
    ),
    # https://cloud.google.com/tpu/docs/v5p (2,765 GBps HBM2e, 95 GiB, 459 TFLOPs bf16)
    "TPU v5p": Device(
        "TPU v5p", 2765e9, 459e12, 459e12 / 6, 95 * 2**30, 20e-6, 1e-6, 10e-6,
        "cloud.google.com/tpu/docs/v5p",
    ),
}  # fmt: skip

# Our CPU measurements' machines (2-core VMs, BENCHMARKS.md): an ASSUMED ~20 GB/s and ~100 GFLOP/s
# fp32 (2 cores x AVX2/AVX-512 FMA at a sustained fraction of peak), no vendor figure.
CPU_2CORE = Device("2-core CPU (assumed)", 20e9, 100e9, 100e9, 16e9, 50e-6, 1e-6, 0.0, "assumption")

# HBM per chip for the exports' "fits": DEVICES' own figure (the vendors', decimal GB for the GPUs
# and binary GiB for the TPUs, as each vendor states it; a little less is usable).
HBM_BYTES = {name: device.hbm_bytes for name, device in DEVICES.items()}

# ----------------------------------------------------------------------------- targets and heads


def _target(**kw) -> TargetConfig:
    return TargetConfig(**kw)


# Published config.json sizes (the Hugging Face model cards' config files).
TARGETS: dict[str, TargetConfig] = {
    # meta-llama/Llama-3.1-8B-Instruct
    "llama31_8b": _target(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rope=RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192),
    ),
    # allenai/OLMo-2-1124-7B-Instruct
    "olmo2_7b": _target(
        family="olmo2", vocab_size=100352, hidden_size=4096, intermediate_size=11008,
        num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, qk_norm="full",
        norm_placement="post", rope=RopeConfig(500000.0),
    ),
    # allenai/OLMo-2-0425-1B-Instruct
    "olmo2_1b": _target(
        family="olmo2", vocab_size=100352, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=16, num_kv_heads=16, head_dim=128, qk_norm="full",
        norm_placement="post", rope=RopeConfig(500000.0),
    ),
    # Qwen/Qwen3-4B (tied embeddings)
    "qwen3_4b": _target(
        family="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm="head",
        tie_word_embeddings=True, rope=RopeConfig(1000000.0),
    ),
    # Qwen/Qwen3-30B-A3B: mixture of experts, every layer routed, 128 experts of width 768, top 8
    # (renormalised); 30.5B parameters, 3.3B active a token
    "qwen3_30b_a3b": _target(
        family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, qk_norm="head",
        rope=RopeConfig(1000000.0), num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, moe_layers=tuple(range(48)),
    ),
    # openai/gpt-oss-20b: 24 layers, every one routed over 32 experts of width 2880, top 4 (a
    # softmax over the top 4 logits), biases on attention, router and experts, a 128-token sliding
    # window on the even layers, attention sinks, YaRN RoPE. Its experts are MXFP4 on the hub (4.25
    # bits a weight); our loader dequantises them to bf16 (checkpoints/mxfp4.py), so the cost
    # model counts bf16 bytes: 20.9B parameters, 3.6B active a token
    "gpt_oss_20b": _target(
        family="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64, attention_bias=True,
        sliding_window=128, full_attention_layers=tuple(range(1, 24, 2)),
        rope=RopeConfig(150000.0, "yarn", 32.0, original_max_position=4096, truncate=False,
                        attention_factor=0.1 * math.log(32.0) + 1.0),
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=2880, norm_topk_prob=True,
        moe_layers=tuple(range(24)), attention_sinks=True, attention_out_bias=True,
        moe_bias=True, router_topk_logits=True, swiglu_limit=7.0, swiglu_alpha=1.702,
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct (our CPU target; tied embeddings)
    "smollm2_135m": _target(
        family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True,
        rope=RopeConfig(100000.0),
    ),
}  # fmt: skip

DRAFT_VOCAB = 32000  # the published EAGLE-3 heads' Vd (and configs/*.py)


def draft_for(tcfg: TargetConfig, draft_vocab: int = DRAFT_VOCAB) -> DraftConfig:
    """An EAGLE-3 head sized like the target (as the published heads are), Vd draft ids."""
    return DraftConfig.from_target(tcfg, draft_vocab_size=min(draft_vocab, tcfg.vocab_size))


# config.json fields of the published checkpoints (what `target_config_from_hf` reads)
REAL_TARGETS: dict[str, dict[str, Any]] = {
    "llama31_8b": {  # meta-llama/Llama-3.1-8B-Instruct
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    "olmo2_7b": {  # allenai/OLMo-2-1124-7B-Instruct
        "architectures": ["Olmo2ForCausalLM"],
        "vocab_size": 100352,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 100257,
        "eos_token_id": 100257,
        "pad_token_id": 100277,
    },
    "qwen3_30b_a3b": {  # Qwen/Qwen3-30B-A3B
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "gpt_oss_20b": {  # openai/gpt-oss-20b (its quantization_config, MXFP4 experts, left out)
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "attention_bias": True,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "eos_token_id": 200002,
        "pad_token_id": 199999,
    },
    "qwen3_4b": {  # Qwen/Qwen3-4B
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],
    },
}


def target_config(name: str) -> TargetConfig:
    """The TargetConfig of a `REAL_TARGETS` entry, as the loaders build it, with plain products."""
    if name not in REAL_TARGETS:
        raise Eagle3Error(f"unknown target {name!r}: choose one of {', '.join(REAL_TARGETS)}")
    cfg = target_config_from_hf(REAL_TARGETS[name])
    return dataclasses.replace(cfg, products=PLAIN_PRODUCTS)  # accelerators: plain products
