"""GGUF files of the mixture-of-experts and Gemma 3 families (checkpoints/gguf.py): a tiny
transformers model of each, saved as safetensors and written as GGUF the way llama.cpp's
convert_hf_to_gguf.py writes that architecture (tensor names from gguf-py's TensorNameMap,
experts stacked [E, out, in], Llama's q/k rows permuted for Mixtral, Gemma's norms stored as
1 + w, gpt-oss's gate_up split and its experts in MXFP4), loads to the parameters and logits of
the safetensors folder (fp32, F32 tensors but gpt-oss's MXFP4 experts)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eagle3_jax.checkpoints import convert_gguf, load_target
from eagle3_jax.checkpoints.gguf import read_gguf
from eagle3_jax.checkpoints.hf import load_hf, read_tensors
from eagle3_jax.checkpoints.mxfp4 import dequantize
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import target as tgt

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# each family as llama.cpp can describe it: the fields its GGUF does not store at the values
# llama.cpp's graph assumes (Qwen3-MoE renormalised, every layer routed; Mixtral without a
# window; Gemma 3 with every sixth layer global, local base 10000, 1/sqrt(head_dim) scores;
# gpt-oss alternating from a sliding layer, YaRN betas 32 / 1 untruncated, SwiGLU limit 7;
# OLMoE not renormalised)
FAMILIES = {
    "qwen3_moe": (
        "qwen3moe",
        "Qwen3MoeConfig",
        dict(num_hidden_layers=2, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "mixtral": (
        "llama",
        "MixtralConfig",
        dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=4,
             num_experts_per_tok=2, sliding_window=None, rope_theta=1e6),
    ),
    "gemma3": (
        "gemma3",
        "Gemma3TextConfig",
        dict(num_hidden_layers=6, intermediate_size=96, query_pre_attn_scalar=16,
             sliding_window=8, sliding_window_pattern=6, final_logit_softcapping=30.0,
             rope_parameters={
                 "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
             }),
    ),
    "olmoe": (
        "olmoe",
        "OlmoeConfig",
        dict(num_hidden_layers=2, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
             norm_topk_prob=False),
    ),
    "gpt_oss": (
        "gpt-oss",
        "GptOssConfig",
        dict(num_hidden_layers=2, intermediate_size=32, num_local_experts=4,
             num_experts_per_tok=2, sliding_window=8, max_position_embeddings=1024,
             rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False, "rope_theta": 150_000.0,
                              "original_max_position_embeddings": 256}),
    ),
}  # fmt: skip


def _tiny(family: str, seed: int = 0):
    """The transformers model with random fp32 weights: norms around Gemma's 0 or 1, sinks of
    unit spread, the rest normal(0, 0.08)."""
    import transformers

    _, cls, spec = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cls)(**{**COMMON, **spec})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if family == "gemma3" else 1.0) + 0.2 * torch.randn_like(p))
            else:
                p.copy_((1.0 if "sinks" in name else 0.08) * torch.randn_like(p))
    return model.eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: q/k rows interleaved for its RoPE."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _mxfp4(w: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 weights shaped like w [E, out, in] (as the hub stores gpt-oss's: blocks
    [E, out, in/32, 16], scales [E, out, in/32]), and their ggml MXFP4 bytes as llama.cpp's
    GptOssModel.repack_mxfp4 writes them (per block: the scale, then 16 bytes holding elements j
    and j + 16 in the low and high nibbles, where the hub holds 2j and 2j + 1)."""
    e, rows, cols = w.shape
    blocks = rng.integers(0, 256, (e, rows, cols // 32, 16), dtype=np.uint8)
    scales = rng.integers(121, 126, (e, rows, cols // 32), dtype=np.uint8)
    nibbles = np.stack([blocks & 0x0F, blocks >> 4], -1).reshape(*blocks.shape[:-1], 32)
    ggml = nibbles[..., :16] | (nibbles[..., 16:] << 4)
    raw = np.concatenate([scales[..., None], ggml], -1).reshape(e, rows, -1)
    # checkpoints.mxfp4's (transformers') decoding: [E, in, out] -> [E, out, in]
    return dequantize(blocks, scales).transpose(0, 2, 1), raw


def _write_gguf(model, d, path, family: str, rng) -> None:
    """The GGUF llama.cpp's converter would write for the checkpoint in d (see the module
    docstring), with a byte-level tokenizer of the model's vocabulary size."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    arch, _, _ = FAMILIES[family]
    c = model.config
    n_layers = c.num_hidden_layers
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    rope = c.rope_parameters
    if family == "gemma3":
        full = rope["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_sliding_window(c.sliding_window)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    else:
        w.add_rope_freq_base(rope["rope_theta"])
    if family != "gemma3":
        w.add_expert_count(getattr(c, "num_experts", None) or c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if family == "qwen3_moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if family == "gpt_oss":
        w.add_sliding_window(c.sliding_window)
        w.add_expert_feed_forward_length(c.intermediate_size)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    tokens = ["<pad>", "<s>", "</s>"] + sorted(set(bytes_to_unicode().values()))
    tokens = tokens[: c.vocab_size - 1] + ["he"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    w.add_token_merges(["h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)

    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), n_layers
    )
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, x in read_tensors(d).items():
        x = np.array(x, np.float32)
        parts = name.split(".")
        if ".experts." in name and parts[5].isdigit():  # experts.{e}.{proj}.weight, hub layout
            experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = x
            continue
        if family == "gpt_oss" and ".experts." in name:
            base = f"blk.{parts[2]}"
            if parts[-1] == "down_proj":
                x = x.transpose(0, 2, 1)  # [E, D, F]
                q, raw = _mxfp4(x, rng)
                w.add_tensor(
                    f"{base}.ffn_down_exps.weight", raw, raw_dtype=gguf.GGMLQuantizationType.MXFP4
                )
                model.get_parameter(name).data.copy_(torch.from_numpy(q.transpose(0, 2, 1).copy()))
            elif parts[-1] == "down_proj_bias":
                w.add_tensor(f"{base}.ffn_down_exps.bias", x)
            elif parts[-1] == "gate_up_proj":
                x = x.transpose(0, 2, 1)  # [E, 2F, D], gate rows 0::2
                both = np.empty_like(x)
                for k, proj in ((0, "gate"), (1, "up")):
                    q, raw = _mxfp4(x[:, k::2], rng)
                    both[:, k::2] = q
                    w.add_tensor(
                        f"{base}.ffn_{proj}_exps.weight",
                        raw,
                        raw_dtype=gguf.GGMLQuantizationType.MXFP4,
                    )
                model.get_parameter(name).data.copy_(
                    torch.from_numpy(both.transpose(0, 2, 1).copy())
                )
            else:  # gate_up_proj_bias [E, 2F]
                w.add_tensor(f"{base}.ffn_gate_exps.bias", np.ascontiguousarray(x[:, 0::2]))
                w.add_tensor(f"{base}.ffn_up_exps.bias", np.ascontiguousarray(x[:, 1::2]))
            continue
        if name.endswith(".sinks"):
            name += ".weight"
        if family == "gemma3" and name.endswith("norm.weight"):
            x = x + np.float32(1.0)
        if family == "mixtral" and "q_proj" in name:
            x = _permute(x, c.num_attention_heads)
        if family == "mixtral" and "k_proj" in name:
            x = _permute(x, c.num_key_value_heads)
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        w.add_tensor(new, x)
    gguf_proj = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                 "down_proj": "down", "w2": "down"}  # fmt: skip
    for (i, proj), per in sorted(experts.items()):
        stacked = np.stack([per[e] for e in sorted(per)])
        w.add_tensor(f"blk.{i}.ffn_{gguf_proj[proj]}_exps.weight", stacked)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if family == "gpt_oss":  # the reference now holds the MXFP4 values
        model.save_pretrained(d)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_gguf_loads_as_its_safetensors_folder(family, tmp_path):
    """The GGUF converts (checkpoints.convert_gguf) to the config, parameters (within the
    rounding of Gemma's 1 + w) and logits (1e-5) of the safetensors folder."""
    import gguf

    model = _tiny(family)
    d = tmp_path / "hf"
    model.save_pretrained(d)
    path = tmp_path / f"{family}.gguf"
    _write_gguf(model, d, path, family, np.random.default_rng(1))
    if family == "gpt_oss":  # its experts as llama.cpp writes the hub's: GGML MXFP4
        kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
        assert kinds["blk.1.ffn_gate_exps.weight"] == kinds["blk.1.ffn_down_exps.weight"] == "MXFP4"
    params, cfg = load_hf(d)
    got = load_target(convert_gguf(path, tmp_path / "conv"), with_tokenizer=False)
    same_ids = dict(bos_token_id=cfg.bos_token_id, eos_token_ids=cfg.eos_token_ids)
    assert dataclasses.replace(got.cfg, **same_ids) == cfg
    ref_leaves = dict(_leaves(params))
    got_leaves = dict(_leaves(got.params))
    assert sorted(got_leaves) == sorted(ref_leaves)
    for k, v in ref_leaves.items():
        np.testing.assert_allclose(got_leaves[k], v, rtol=0, atol=1e-7, err_msg=k)
    toks = jnp.asarray(np.random.default_rng(2).integers(3, 97, (2, 20)), jnp.int32)
    ref = tgt.full_forward(params, toks, cfg).logits
    out = tgt.full_forward(got.params, toks, got.cfg).logits
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], np.asarray(tree)


def test_gguf_architectures_it_cannot_read_are_refused(tmp_path):
    """An architecture the reader does not know, or experts in one that has none, is one
    Eagle3Error naming it (before any tensor is read)."""
    import gguf

    for arch, experts in (("deepseek2", 0), ("qwen2", 8)):
        path = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        w.add_block_count(1)
        w.add_embedding_length(8)
        w.add_feed_forward_length(8)
        w.add_head_count(2)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(4)
        if experts:
            w.add_expert_count(experts)
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(Eagle3Error, match=f"GGUF architecture {arch!r}"):
            read_gguf(path)
