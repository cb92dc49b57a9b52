"""GGUF files (llama.cpp): dequantised with the `gguf` package, tokenizer via transformers; no torch.

transformers' own GGUF reader (`transformers.integrations.gguf.reader`, which `from_pretrained(...,
gguf_file=)` goes through) imports PyTorch since transformers 5, and the base install has none: a
fresh `make demo` failed converting the embedded default. The metadata is read here with the
`gguf` package, and only transformers' tokenizer builder (`gguf_tokenizer_mapping`, no torch) is
used, with the same inputs its reader would give it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eagle3_jax.errors import Eagle3Error

_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
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
}


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
    hf = {
        "architectures": [_ARCH[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": int(g("attention.key_length") or hidden // heads),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = gguf.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape.tolist())])
        if t.name in _TOP:
            tensors[_TOP[t.name]] = w
            continue
        parts = t.name.split(".")
        if parts[0] != "blk" or parts[2] not in _BLOCK:
            continue
        i, kind, suffix = parts[1], parts[2], parts[3]
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            w = _unpermute(w, heads if kind == "attn_q" else kv)
        tensors[f"model.layers.{i}.{_BLOCK[kind]}.{suffix}"] = w
    return hf, tensors


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
