"""--write-target-hf: our converted target as a transformers Llama checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_target_hf(out: Path, spec: str | None) -> None:
    """config.json + model.safetensors (+ its index, which the official draft loader reads) +
    tokenizer files of a Llama target as eagle3_jax loads it (default: the embedded SmolLM2,
    dequantised from its GGUF), in float32; lm_head.weight is written too (= the embedding when
    tied), so that no loader has to tie it."""
    import numpy as np

    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.checkpoints.head_config import _rope_to_hf
    from eagle3_jax.checkpoints.hf import _LAYER_KEYS, _PRE_NORMS
    from eagle3_jax.checkpoints.safetensors_io import write_safetensors
    from eagle3_jax.config import target_config_from_hf
    from eagle3_jax.models import target as tgt

    target = load_target(spec)
    cfg = target.cfg
    if cfg.family != "llama":
        raise SystemExit(
            f"--write-target-hf writes Llama targets only ({cfg.family} given): pass the model's "
            "own transformers checkpoint to --target-hf instead"
        )
    params = tgt.unstack_layers(target.params)
    tensors = {
        "model.embed_tokens.weight": np.asarray(params["embed"], np.float32),
        "model.norm.weight": np.asarray(params["final_norm"], np.float32),
    }
    tensors["lm_head.weight"] = (
        tensors["model.embed_tokens.weight"]
        if cfg.tie_word_embeddings
        else np.asarray(params["lm_head"], np.float32).T
    )
    names = {**_LAYER_KEYS, **{k: (v, False) for k, v in _PRE_NORMS.items()}}
    for i, layer in enumerate(params["layers"]):
        for hf_name, (ours, transposed) in names.items():
            if ours in layer:
                a = np.asarray(layer[ours], np.float32)
                tensors[f"model.layers.{i}.{hf_name}"] = a.T if transposed else a
    eos = list(cfg.eos_token_ids)
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": "float32",
        **_rope_to_hf(cfg.rope),
    }
    back = target_config_from_hf(hf)
    if back != cfg:
        raise SystemExit(f"config round trip failed: {back} != {cfg}")
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
        "weight_map": {k: "model.safetensors" for k in sorted(tensors)},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    target.tokenizer.save_pretrained(out)
    # a class name transformers 4.x knows as well ("TokenizersBackend" is 5.x's)
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # what transformers 5 saves of this load
        tc.pop(key, None)
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    print(f"wrote {out} ({len(tensors)} tensors, float32, from {target.path})", file=sys.stderr)
