"""GGUF files (llama.cpp): dequantised with the `gguf` package, tokenizer via transformers; no torch.

transformers' own GGUF reader (`transformers.integrations.gguf.reader`, which `from_pretrained(...,
gguf_file=)` goes through) imports PyTorch since transformers 5, and the base install has none: a
fresh `make demo` failed converting the embedded default. The metadata is read here with the
`gguf` package, and only transformers' tokenizer builder (`gguf_tokenizer_mapping`, no torch) is
used, with the same inputs its reader would give it.

Architectures, as llama.cpp's `convert_hf_to_gguf.py` writes them (tensor names from gguf-py's
`TensorNameMap`): llama (Llama, Mistral; Mixtral too, as "llama" with an `expert_count`), qwen2,
qwen3, olmo2, qwen3moe, gemma3 (the text model), gpt-oss and olmoe. What a GGUF file does not
record is what llama.cpp's graph hard-codes, and we read it the same way: Qwen3-MoE renormalises
the chosen experts' weights (`expert_weights_norm`, absent = true; for OLMoE, absent = false,
its released config's norm_topk_prob); Gemma 3
has every sixth layer global (`attention.sliding_window_pattern` where given), a local RoPE base
of 10000 (`rope.freq_base_swa`) and scores scaled by 1/sqrt(head_dim) (hidden/heads for the 62-layer
27B); gpt-oss alternates sliding and full layers (the first sliding), clamps its SwiGLU at 7 and
takes YaRN's betas 32 / 1 without truncation (transformers' GptOssConfig; llama.cpp's own YaRN
truncates the correction range, a difference of the runtime, not of the file). The converter
stores Gemma's norm weights as 1 + w (Gemma3RMSNorm's x * (1 + w)); the reader subtracts the 1
(exact: Sterbenz), so 1 + w is again the file's value. gpt-oss's MXFP4 experts are GGML type
MXFP4, which the `gguf` package dequantises.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eagle3_jax.errors import Eagle3Error

_ARCH = {
    "llama": "LlamaForCausalLM",  # MixtralForCausalLM where it has experts
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate_inp": "mlp.gate",  # the router [E, D]; gpt-oss's mlp.router
    "attn_sinks": "self_attn.sinks",  # gpt-oss, [H]
}
# per-architecture exceptions to _BLOCK
_BLOCK_ARCH = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "gpt-oss": {"ffn_gate_inp": "mlp.router"},
}
# stacked experts [E, out, in] (and gpt-oss's biases [E, out]): the matrix they are
_EXPS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
# llama.cpp's early Mixtral files: one tensor per expert, blk.{i}.ffn_{gate,up,down}.{e}.weight
_ONE_EXPERT = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


def _f32(x) -> float:
    """A GGUF float32 as the decimal it was written from (1e-05, not 9.999999747378752e-06): the
    shortest repr that rounds to the same float32, so configs equal their config.json's."""
    return float(str(np.float32(x)))


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp interleaves q/k rows for its RoPE; restore the rotate-half (HF) row order."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _open(path: Path):
    """(gguf.GGUFReader, metadata {key: value}) of a GGUF file; a bad file is one Eagle3Error."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    except Exception as e:  # the gguf package raises assorted errors on a bad file
        raise Eagle3Error(f"cannot read GGUF file {path}: {e}") from e
    return reader, meta


def read_gguf(path: str | Path):
    """(HF-style config dict, HF-named float32 tensors, tokenizer) of a llama-family GGUF file,
    parsed once (~3 s for SmolLM2's 49,152-token vocabulary). The tokenizer is the one
    transformers builds from the file (`from_pretrained(dir, gguf_file=name)`), without
    transformers' torch-importing GGUF reader."""
    path = Path(path)
    reader, meta = _open(path)
    return (*_config_and_tensors(path, reader, meta), _tokenizer(path, meta))


def _config_and_tensors(path: Path, reader, meta: dict) -> tuple[dict, dict[str, np.ndarray]]:
    import gguf

    arch = meta.get("general.architecture")
    if arch not in _ARCH:
        raise Eagle3Error(
            f"GGUF architecture {arch!r} is not supported: use one of {sorted(_ARCH)}"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise Eagle3Error(
            f"{path} uses llama3 RoPE scaling (rope_freqs), which GGUF import does not "
            "cover: load the transformers checkpoint directory instead"
        )
    g = lambda k, d=None: meta.get(f"{arch}.{k}", d)  # noqa: E731
    heads, kv = (
        int(g("attention.head_count")),
        int(g("attention.head_count_kv") or g("attention.head_count")),
    )
    hidden = int(g("embedding_length"))
    vocab = int(g("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ())))
    if not vocab:
        raise Eagle3Error(f"GGUF file {path} states no vocabulary size and holds no tokenizer")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    experts = int(g("expert_count") or 0)
    hf = {
        "architectures": [_ARCH[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length") or g("expert_feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": int(g("attention.key_length") or hidden // heads),
        "rms_norm_eps": _f32(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    if experts:
        if arch not in ("llama", "qwen3moe", "gpt-oss", "olmoe"):
            raise Eagle3Error(
                f"GGUF architecture {arch!r} with {experts} experts is not supported: "
                "mixture-of-experts GGUF files are read for Mixtral (llama), qwen3moe, gpt-oss "
                "and olmoe"
            )
        if arch == "llama":
            hf["architectures"] = ["MixtralForCausalLM"]
        hf.update(
            num_experts=experts,
            num_local_experts=experts,
            num_experts_per_tok=int(g("expert_used_count")),
            moe_intermediate_size=int(g("expert_feed_forward_length") or hf["intermediate_size"]),
            norm_topk_prob=bool(g("expert_weights_norm", arch != "olmoe")),
        )
    hf.update(_ARCH_FIELDS.get(arch, lambda g, hf: {})(g, hf))
    layer_names = {**_BLOCK, **_BLOCK_ARCH.get(arch, {})}
    tensors: dict[str, np.ndarray] = {}
    stacked: dict[
        tuple[str, str, str], np.ndarray
    ] = {}  # (layer, gate/up/down, suffix) -> [E, ...]
    for t in reader.tensors:
        w = gguf.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape.tolist())])
        if arch == "gemma3" and t.name.split(".")[-2].endswith("norm"):
            w = w - np.float32(1.0)  # stored as 1 + w (Gemma3RMSNorm's scale)
        if t.name in _TOP:
            tensors[_TOP[t.name]] = w
            continue
        parts = t.name.split(".")
        if parts[0] != "blk":
            continue
        i, kind, suffix = parts[1], parts[2], parts[-1]
        if kind in _EXPS:
            stacked[i, _EXPS[kind], suffix] = w
            continue
        if len(parts) == 5 and kind in _ONE_EXPERT:  # blk.i.ffn_gate.{e}.weight
            tensors[f"model.layers.{i}.mlp.experts.{parts[3]}.{_ONE_EXPERT[kind]}.weight"] = w
            continue
        if kind not in layer_names:
            continue
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            w = _unpermute(w, heads if kind == "attn_q" else kv)
        name = f"model.layers.{i}.{layer_names[kind]}"
        tensors[name if kind == "attn_sinks" else f"{name}.{suffix}"] = w
    for (i, which, suffix), w in stacked.items():
        if which == "up":
            continue
        tensors.update(_experts(arch, i, which, suffix, w, stacked.get((i, "up", suffix))))
    return hf, tensors


def _experts(arch: str, i: str, which: str, suffix: str, w: np.ndarray, up) -> dict:
    """Stacked expert tensors (gate, up, down [E, out, in]; gpt-oss's biases [E, out]) under the
    names checkpoints.hf reads: transformers 5's fused experts (gate_up_proj [E, 2F', D] with the
    gate rows first, down_proj [E, D, F']), or gpt-oss's (gate_up_proj [E, D, 2F'] with gate and
    up columns interleaved, down_proj [E, F', D], biases [E, 2F'] and [E, D])."""
    base = f"model.layers.{i}.mlp.experts"
    if which == "gate" and up is None:
        raise Eagle3Error(f"GGUF layer {i} has ffn_gate_exps but no ffn_up_exps")
    if arch != "gpt-oss":
        if suffix != "weight":
            raise Eagle3Error(f"GGUF layer {i}'s experts have a {suffix} (only gpt-oss has one)")
        if which == "down":
            return {f"{base}.down_proj": w}
        return {f"{base}.gate_up_proj": np.concatenate([w, up], axis=1)}
    if suffix == "bias":
        if which == "down":
            return {f"{base}.down_proj_bias": w}
        return {f"{base}.gate_up_proj_bias": np.stack([w, up], -1).reshape(*w.shape[:-1], -1)}
    if which == "down":
        return {f"{base}.down_proj": w.transpose(0, 2, 1)}
    both = np.stack([w.transpose(0, 2, 1), up.transpose(0, 2, 1)], -1)
    return {f"{base}.gate_up_proj": both.reshape(*both.shape[:-2], -1)}


def _gemma3_fields(g, hf: dict) -> dict:
    """A Gemma 3 text config as llama.cpp's graph reads the file: the fields it does not store
    are what llama.cpp hard-codes (every sixth layer global, a local RoPE base of 10000, the
    scores scaled by 1/sqrt(head_dim), or hidden/heads for the 62-layer 27B)."""
    layers, pattern = hf["num_hidden_layers"], g("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag a layer, true = sliding
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        types = [
            "sliding_attention" if (i + 1) % int(pattern) else "full_attention"
            for i in range(layers)
        ]
    cap, scale = g("final_logit_softcapping"), g("attention.scale")
    if scale:
        scalar = _f32(scale) ** -2
    else:
        scalar = hf["hidden_size"] / hf["num_attention_heads"] if layers == 62 else hf["head_dim"]
    out = {
        "model_type": "gemma3_text",
        "sliding_window": int(g("attention.sliding_window") or 4096),
        "layer_types": types,
        "rope_local_base_freq": _f32(g("rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": cap if cap is None else _f32(cap),
        "hidden_activation": "gelu_pytorch_tanh",
    }
    kind = g("rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise Eagle3Error(f"Gemma 3 GGUF RoPE scaling {kind!r} is not supported (linear is)")
        out["rope_scaling"] = {"rope_type": "linear", "factor": _f32(g("rope.scaling.factor"))}
    return out


def _gpt_oss_fields(g, hf: dict) -> dict:
    """A gpt-oss config as the file gives it, with what it leaves out as GptOssConfig has it."""
    rope = {
        "rope_type": "yarn",
        "factor": _f32(g("rope.scaling.factor", 32.0)),
        "original_max_position_embeddings": int(g("rope.scaling.original_context_length", 4096)),
        "beta_fast": _f32(g("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": _f32(g("rope.scaling.yarn_beta_slow", 1.0)),
        "truncate": False,
    }
    if g("rope.scaling.attn_factor"):
        rope["attention_factor"] = _f32(g("rope.scaling.attn_factor"))
    return {
        "sliding_window": int(g("attention.sliding_window") or 128),
        "rope_scaling": rope,
        "attention_bias": True,
        "intermediate_size": int(g("expert_feed_forward_length") or hf["intermediate_size"]),
    }


_ARCH_FIELDS = {"gemma3": _gemma3_fields, "gpt-oss": _gpt_oss_fields}


# the tokenizer's special tokens: PreTrainedTokenizerFast argument <- tokenizer.ggml.<key> (an id)
_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _tokenizer(path: Path, meta: dict):
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    if "tokenizer.ggml.tokens" not in meta:
        raise Eagle3Error(f"GGUF file {path} holds no tokenizer (no tokenizer.ggml.tokens)")
    # llama.cpp's keys renamed to the builder's: tokenizer fields and tokenizer_config fields
    groups = {
        group: {n: meta[f"tokenizer.{k}"] for k, n in renames.items() if f"tokenizer.{k}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    spec, config = groups["tokenizer"], groups["tokenizer_config"]
    kind = spec.get("tokenizer_type")
    if kind == "llama":  # sentencepiece files without the flag: llama.cpp adds BOS
        config.setdefault("add_bos_token", True)
    elif kind == "gemma4":  # its chat template writes <bos> itself
        config["add_bos_token"] = False
    for name, key in _SPECIAL_IDS.items():
        i = meta.get(f"tokenizer.ggml.{key}")
        config[name] = spec["tokens"][int(i)] if i is not None else None
    try:
        backend, extra = convert_gguf_tokenizer(meta.get("general.architecture"), spec)
    except ValueError as e:  # an unsupported tokenizer.ggml.model
        raise Eagle3Error(f"cannot build the tokenizer of GGUF file {path}: {e}") from e
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
