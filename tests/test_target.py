"""models/target.py: parity with transformers' PyTorch models per family, prefill + stepwise decode
== one forward, the cache read or written, bf16 logits, the product policies through a forward;
benchmarks/cpu_rows_kernel.py's kernel. Its building blocks one by one: tests/test_layers.py."""

import dataclasses
import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import FAMILIES
from helpers import (
    assert_forward_matches_transformers,
    assert_stepwise_decode_equals_full_forward,
    family_tokens,
)

from eagle3_jax.checkpoints.hf import load_hf
from eagle3_jax.config import ProductPolicy
from eagle3_jax.models import target as tgt
from eagle3_jax.models.layers import causal_mask

PARITY = [(family, False) for family in FAMILIES] + [("llama", True)]  # True: tied embeddings


@pytest.mark.parametrize(
    "family, tie", PARITY, ids=[f + ("-tied" if tie else "") for f, tie in PARITY]
)
def test_logits_and_hidden_states_match_transformers(family, tie, hf_checkpoint):
    model, path = hf_checkpoint(family, tie=tie)
    params, cfg = load_hf(path)
    assert cfg.tie_word_embeddings == tie and ("lm_head" in params) != tie
    assert_forward_matches_transformers(model, params, cfg, family_tokens(2, 20, cfg.vocab_size))


# attention_bias=True: Llama's and Qwen3-MoE's o_proj take a bias as q/k/v do; Mistral's
# attention ignores the flag (no bias anywhere), Qwen2's biases q/k/v whatever it says
BIASED = {
    "LlamaConfig": dict(attention_bias=True),
    "Qwen3MoeConfig": dict(
        attention_bias=True, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "OlmoeConfig": dict(attention_bias=True, num_experts=4, num_experts_per_tok=2),
    "MistralConfig": dict(attention_bias=True),
    "Qwen2Config": dict(attention_bias=False, use_sliding_window=False),
}  # fmt: skip


@pytest.mark.parametrize("cls", list(BIASED))
def test_attention_biases_follow_each_family(cls, tmp_path):
    import transformers

    config = getattr(transformers, cls)(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, **BIASED[cls],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    params, cfg = load_hf(tmp_path)
    attn = model.model.layers[0].self_attn
    assert cfg.attention_bias == (attn.q_proj.bias is not None)
    assert cfg.attention_out_bias == (attn.o_proj.bias is not None)
    assert ("bo" in params["layers"][0]) == (attn.o_proj.bias is not None)
    toks = family_tokens(2, 12, cfg.vocab_size)
    with torch.no_grad():
        ref = model(torch.tensor(toks, dtype=torch.long)).logits.numpy()
    out = tgt.full_forward(params, jnp.asarray(toks), cfg, ())
    np.testing.assert_allclose(np.asarray(out.logits), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_stepwise_decode_equals_full_forward(family, hf_checkpoint):
    _, path = hf_checkpoint(family)
    params, cfg = load_hf(path)
    toks = jnp.asarray(family_tokens(2, 24, cfg.vocab_size, seed=1))
    aux_ids = cfg.default_aux_layer_ids()
    for stacked in (False, True):
        assert_stepwise_decode_equals_full_forward(params, cfg, toks, 9, 32, aux_ids, stacked)


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "scanned"])
def test_reading_the_cache_equals_writing_it(stacked, hf_checkpoint):
    """forward(..., mask_new=M) (the cache only read, the new tokens attending to each other under
    M) gives the logits and aux of the same tokens written into the cache first, and returns
    exactly the K/V that the writing call puts at their slots."""
    _, path = hf_checkpoint("qwen3")
    params, cfg = load_hf(path)
    params = tgt.stack_layers(params) if stacked else params
    b, prompt, t, s = 2, 7, 4, 24
    toks = jnp.asarray(family_tokens(b, prompt + t, cfg.vocab_size, seed=5))
    aux_ids = cfg.default_aux_layer_ids()
    zero = jnp.zeros((b,), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (b, prompt))
    cache = tgt.forward(
        params,
        toks[:, :prompt],
        pos,
        causal_mask(zero, prompt, s),
        cfg,
        tgt.make_cache(cfg, b, s, stacked=stacked),
        zero,
    ).cache
    start = jnp.full((b,), prompt, jnp.int32)
    # a small tree: node 1 and 2 children of the root, node 3 child of 1
    tree = jnp.asarray([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], bool)
    depth = jnp.asarray([0, 1, 1, 2])
    pos = jnp.broadcast_to(prompt + depth, (b, t))
    slots = jnp.arange(s)
    written = (slots[None, :] < prompt) | jnp.pad(tree, ((0, 0), (prompt, s - prompt - t)))
    ref = tgt.forward(
        params,
        toks[:, prompt:],
        pos,
        jnp.broadcast_to(written, (b, t, s)),
        cfg,
        cache,
        start,
        aux_ids,
    )
    got = tgt.forward(
        params,
        toks[:, prompt:],
        pos,
        jnp.broadcast_to(slots < prompt, (b, t, s)),
        cfg,
        cache,
        start,
        aux_ids,
        mask_new=jnp.broadcast_to(tree, (b, t, t)),
    )
    np.testing.assert_allclose(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.aux, ref.aux, rtol=1e-5, atol=1e-5)
    # the new entries come back as [B, T, G, K]; the cache holds K [B, G, K, S], V [B, G, S, K]
    # per layer (a list, or stacked [L, ...])
    for layer in range(cfg.num_layers):
        want_k = ref.cache["k"][layer][..., prompt : prompt + t].transpose(0, 3, 1, 2)
        want_v = ref.cache["v"][layer][:, :, prompt : prompt + t].transpose(0, 2, 1, 3)
        np.testing.assert_allclose(got.cache["k"][layer], want_k, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got.cache["v"][layer], want_v, rtol=1e-5, atol=1e-5)


def test_bf16_logits_are_fp32(hf_checkpoint):
    """bf16 parameters give fp32 logits: bf16 ones tie (0.125 apart at a logit of 16-32), and a
    greedy choice then flips on the order of a sum."""
    for tie in (True, False):
        _, path = hf_checkpoint("llama", tie=tie)
        params, cfg = load_hf(path, dtype=jnp.bfloat16)
        out = tgt.full_forward(params, jnp.asarray(family_tokens(1, 5, cfg.vocab_size)), cfg)
        assert out.logits.dtype == jnp.float32
        # the fp32 product of the bf16 inputs, not a bf16 result widened afterwards
        w = params["embed"].T if tie else params["lm_head"]
        want = np.asarray(out.hidden, np.float32) @ np.asarray(w, np.float32)
        np.testing.assert_allclose(np.asarray(out.logits), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_product_policies_compute_the_same_forward(tie, hf_checkpoint):
    """A tree verification's few tokens through the target with row products and the row
    reduction (policy 8/8) and with plain products: the same logits, hidden and aux states within
    fp32 rounding, the same greedy tokens, and the same new cache entries."""
    _, path = hf_checkpoint("llama", tie=tie)
    params, cfg = load_hf(path)
    b, t, s = 2, 4, 16
    cache = tgt.make_cache(cfg, b, s)
    prefix = jnp.asarray(family_tokens(b, 8, cfg.vocab_size, seed=3))
    pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (b, 8))
    zero = jnp.zeros((b,), jnp.int32)
    cache = tgt.forward(params, prefix, pos, causal_mask(zero, 8, s), cfg, cache, zero).cache
    toks = jnp.asarray(family_tokens(b, t, cfg.vocab_size, seed=4))
    start = jnp.full((b,), 8, jnp.int32)
    pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    aux = (1, cfg.num_layers // 2, cfg.num_layers)

    @functools.partial(jax.jit, static_argnames="cfg")
    def verify(params, cache, toks, pos, start, cfg):
        return tgt.forward(params, toks, pos, causal_mask(start, t, s), cfg, cache, start, aux)

    cfgs = {k: dataclasses.replace(cfg, products=ProductPolicy(k, k)) for k in (0, 8)}
    outs = {k: verify(params, cache, toks, pos, start, c) for k, c in cfgs.items()}
    for name in ("logits", "hidden", "aux"):
        a, b_ = (np.asarray(getattr(outs[k], name)) for k in (8, 0))
        np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(outs[8].logits.argmax(-1), outs[0].logits.argmax(-1))
    for a, b_ in zip(jax.tree.leaves(outs[8].cache), jax.tree.leaves(outs[0].cache)):
        np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-5)
    # the policy is part of the program: the row products are there with 8, not with 0
    text = {k: verify.lower(params, cache, toks, pos, start, c).as_text() for k, c in cfgs.items()}
    assert "while" in text[8] and "while" not in text[0]


@pytest.mark.skipif(
    shutil.which("g++") is None or jax.default_backend() != "cpu", reason="needs g++ and the CPU"
)
def test_few_row_kernel_of_the_benchmark_builds_and_is_exact(tmp_path):
    """benchmarks/cpu_rows_kernel.py (measured, not used by the engine): its FFI kernel compiles
    against this jax's headers and gives XLA's product for 1-8 rows, each row bitwise the same
    alone or among others, also with a partial last panel and under jit."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks/cpu_rows_kernel.py"
    spec = importlib.util.spec_from_file_location("cpu_rows_kernel", path)
    crk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(crk)
    crk.register(crk.build(tmp_path))
    checked = crk.check(np.random.default_rng(1))  # exits (fails the test) if wrong
    assert checked["row_bitwise_across_m"] and checked["max_relative_error"] < 1e-5
    rng = np.random.default_rng(2)
    w = rng.standard_normal((96, 130), dtype=np.float32)
    x = jnp.asarray(rng.standard_normal((3, 96), dtype=np.float32))
    panels = crk.pack(w)
    assert panels.shape == (3, 96, 64)
    got = jax.jit(lambda x, p: crk.rows_product(x, p, 130))(x, panels)
    np.testing.assert_allclose(got, np.asarray(x) @ w, rtol=1e-5, atol=1e-5)
