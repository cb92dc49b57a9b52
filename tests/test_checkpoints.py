"""Loaders: our converted format, bfloat16, clear errors for bad checkpoints, GGUF without PyTorch
(a target loaded onto a mesh: tests/test_sharding.py)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.checkpoints import load_target, load_target_config
from eagle3_jax.checkpoints.hf import load_hf
from eagle3_jax.checkpoints.native import load_native, save_native
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import target as tgt


def test_native_format_round_trip_is_exact(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("olmo2")
    params, cfg = load_hf(path)
    save_native(tmp_path / "conv", params, cfg)
    again, cfg2 = load_native(tmp_path / "conv")
    assert cfg2 == cfg
    # the config alone, without reading weights, from either format
    assert load_target_config(tmp_path / "conv") == cfg == load_target_config(path)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_load(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    params, _ = load_hf(path, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))


def test_bad_checkpoints_get_clear_errors(tmp_path, hf_checkpoint):
    with pytest.raises(Eagle3Error, match="does not exist"):
        load_target(tmp_path / "nope")
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(Eagle3Error, match="not a .gguf"):
        load_target(tmp_path / "w.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(Eagle3Error, match="no config.json"):
        load_target(tmp_path / "empty")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(Eagle3Error, match="unsupported architecture"):
        load_target(gpt2)
    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(Eagle3Error, match="cannot read GGUF"):
        load_target(bad_gguf)
    _, path = hf_checkpoint("llama")
    _, cfg = load_hf(path)
    with pytest.raises(Eagle3Error, match="outside the target"):
        cfg.check_aux_layer_ids((2, 99))


def _write_tiny_gguf(path):
    """A one-layer llama GGUF (fp32 tensors) with a byte-level BPE tokenizer, as llama.cpp lays
    it out: q/k rows interleaved for its RoPE, three control tokens, a ChatML template."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = (
        control + sorted(set(bytes_to_unicode().values())) + [m.replace(" ", "") for m in merges]
    )
    d, ff, heads, kv, v = 16, 32, 2, 1, len(tokens)
    hd = d // heads
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(v)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(control) + [1] * (v - len(control)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    shapes = {
        "token_embd.weight": (v, d),
        "output_norm.weight": (d,),
        "blk.0.attn_norm.weight": (d,),
        "blk.0.attn_q.weight": (heads * hd, d),
        "blk.0.attn_k.weight": (kv * hd, d),
        "blk.0.attn_v.weight": (kv * hd, d),
        "blk.0.attn_output.weight": (d, heads * hd),
        "blk.0.ffn_norm.weight": (d,),
        "blk.0.ffn_gate.weight": (ff, d),
        "blk.0.ffn_up.weight": (ff, d),
        "blk.0.ffn_down.weight": (d, ff),
    }
    for name, shape in shapes.items():
        x = (
            1.0 + 0.1 * rng.standard_normal(shape)
            if len(shape) == 1
            else rng.standard_normal(shape)
        )
        w.add_tensor(name, (0.3 * x if len(shape) > 1 else x).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_converts_without_torch_as_transformers_reads_it(tmp_path):
    """A GGUF converts with no PyTorch installed (the base install has none; transformers' own GGUF
    reader imports it, and a fresh `make demo` failed there), into the model and tokenizer
    transformers builds from the same file."""
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    gguf_path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(gguf_path)
    out = tmp_path / "converted"
    script = (
        "import sys; sys.modules['torch'] = None  # as if not installed\n"
        "from pathlib import Path\n"
        "from eagle3_jax.checkpoints import convert_gguf\n"
        f"convert_gguf(Path({str(gguf_path)!r}), Path({str(out)!r}))\n"
        "assert sys.modules['torch'] is None\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]

    target = load_target(out)
    ref_tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path), gguf_file=gguf_path.name)
    assert target.tokenizer.backend_tokenizer.to_str() == ref_tok.backend_tokenizer.to_str()
    msgs = [{"role": "user", "content": "hello world"}]
    ids = target.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ids == ref_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert (target.tokenizer.bos_token, target.tokenizer.eos_token) == (
        "<|im_start|>",
        "<|im_end|>",
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=gguf_path.name, dtype=torch.float32
    )
    toks = np.asarray([target.tokenizer("hello world, hello")["input_ids"]], np.int32)
    with torch.no_grad():
        ref = model(torch.tensor(toks, dtype=torch.long)).logits.numpy()
    got = tgt.full_forward(target.params, jnp.asarray(toks), target.cfg).logits
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4)
