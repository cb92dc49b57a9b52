"""Gemma 3's text model as a target (models/target.py, config.py, checkpoints/hf.py): a tiny
Gemma3ForCausalLM with sliding-window and global layers (each kind with its own RoPE, the global
one linearly scaled), query_pre_attn_scalar != head_dim, against transformers: logits and every
hidden state, prefill + steps == one forward (unrolled and scanned), greedy == generate; greedy
speculative == plain with trees that cross the window; sharded == unsharded; the same language
model read from a Gemma3ForConditionalGeneration checkpoint.

The family stays out of conftest's FAMILIES (which parametrises many tests): one model shape,
built once per module, keeps this file's compilations few."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import (
    assert_forward_matches_transformers,
    assert_random_head_decodes_plainly,
    assert_stepwise_decode_equals_full_forward,
    family_tokens,
    hf_greedy,
    random_prompts,
)

from eagle3_jax.checkpoints.hf import load_hf
from eagle3_jax.config import TargetConfig, target_config_from_hf
from eagle3_jax.decoding import plain
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import target as tgt
from eagle3_jax.sharding import make_mesh

WINDOW = 8
TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2  # layers 2, 5 global
TEXT = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=WINDOW,
    layer_types=TYPES,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0},
    },
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _randomise(model, seed: int, scale: float = 0.08):
    """Random weights (norms too, around Gemma's identity w = 0), fp32, eval."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((0.2 if "norm" in name else scale) * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(transformers Gemma3ForCausalLM, its saved checkpoint directory, params, cfg)."""
    import transformers

    config = transformers.Gemma3TextConfig(**TEXT)
    model = transformers.Gemma3ForCausalLM(config).to(torch.float32)
    _randomise(model, 0)
    d = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(d)
    return (model, d, *load_hf(d))


def test_config_reads_the_gemma3_fields(gemma3):
    """config.json -> TargetConfig: which layers slide, each kind's RoPE, the attention scale,
    the sandwich norms, GeGLU, the scaled embedding and the tying; transformers 4.x's field names
    (sliding_window_pattern, rope_theta / rope_local_base_freq / rope_scaling) give the same
    config; to_json round-trips it and a dense config's file names none of the new fields."""
    _, path, _, cfg = gemma3
    assert (cfg.family, cfg.sliding_window, cfg.full_attention_layers) == ("gemma3", WINDOW, (2, 5))
    assert [cfg.is_sliding_layer(i) for i in range(6)] == [True, True, False] * 2
    assert (cfg.rope.kind, cfg.rope.theta, cfg.rope.factor) == ("linear", 100_000.0, 4.0)
    assert (cfg.sliding_rope.kind, cfg.sliding_rope.theta) == ("default", 1_000.0)
    assert cfg.attention_scale == 24**-0.5 and cfg.qk_norm == "head"
    assert (cfg.norm_placement, cfg.norm_unit_offset, cfg.mlp_activation) == (
        "sandwich", True, "gelu_tanh",
    )  # fmt: skip
    assert cfg.scale_embeddings and cfg.tie_word_embeddings and cfg.final_logit_softcapping is None
    assert TargetConfig.from_dict(json.loads(cfg.to_json())) == cfg
    hf = json.loads((path / "config.json").read_text())
    old = {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters")}
    old.update(sliding_window_pattern=3, rope_theta=100_000.0, rope_local_base_freq=1_000.0,
               rope_scaling={"rope_type": "linear", "factor": 4.0})  # fmt: skip
    old.pop("_sliding_window_pattern", None)
    assert target_config_from_hf(old) == cfg
    # no sliding layer at all: no window
    every = target_config_from_hf({**hf, "layer_types": ["full_attention"] * 6})
    assert every.sliding_window is None and every.full_attention_layers == ()
    dense = dataclasses.replace(
        cfg, family="llama", full_attention_layers=(), sliding_rope=None, norm_unit_offset=False,
        mlp_activation="silu", scale_embeddings=False, query_pre_attn_scalar=None,
        norm_placement="pre", qk_norm="none",
    )  # fmt: skip
    text = dense.to_json()
    for name in ("full_attention_layers", "sliding_rope", "norm_unit_offset", "mlp_activation",
                 "scale_embeddings", "query_pre_attn_scalar", "final_logit_softcapping"):  # fmt: skip
        assert name not in text
    assert TargetConfig.from_dict(json.loads(text)) == dense
    with pytest.raises(Eagle3Error, match="use_bidirectional_attention"):
        target_config_from_hf({**hf, "use_bidirectional_attention": True})
    with pytest.raises(Eagle3Error, match="hidden_activation 'relu'"):
        target_config_from_hf({**hf, "hidden_activation": "relu"})
    with pytest.raises(Eagle3Error, match="Gemma3ForCausalLM, Gemma3ForConditionalGeneration"):
        target_config_from_hf({"architectures": ["DeepseekV3ForCausalLM"]})


def test_logits_and_hidden_states_match_transformers(gemma3):
    """fp32 logits and every hidden state (the scaled embedding first) within 1e-4 of
    transformers over 20 tokens, past the 8-token window; logits soft-capped as
    final_logit_softcapping says."""
    model, _, params, cfg = gemma3
    toks = family_tokens(2, 20, cfg.vocab_size)
    out, _ = assert_forward_matches_transformers(model, params, cfg, toks)
    # the final soft-capping, on the same hidden states (transformers reads it at forward time)
    capped = dataclasses.replace(cfg, final_logit_softcapping=0.5)
    model.config.final_logit_softcapping = 0.5
    try:
        with torch.no_grad():
            ref_capped = model(torch.tensor(toks, dtype=torch.long)).logits.numpy()
    finally:
        model.config.final_logit_softcapping = None
    assert np.abs(ref_capped).max() < 0.5
    got = np.asarray(tgt.lm_head(params, out.hidden, capped))
    np.testing.assert_allclose(got, ref_capped, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "scanned"])
def test_prefill_then_stepwise_decode_equals_full_forward(gemma3, stacked):
    """A 6-token prefill and 14 single-token steps through the cache (the sliding layers'
    window passed after 8) give one full forward's logits and every hidden state; with the layers
    stacked too, where a scanned flag picks each layer's window and RoPE."""
    _, _, params, cfg = gemma3
    toks = jnp.asarray(family_tokens(2, 20, cfg.vocab_size))
    aux_ids = tuple(range(cfg.num_layers + 1))
    assert_stepwise_decode_equals_full_forward(params, cfg, toks, 6, 32, aux_ids, stacked)


def test_greedy_decoding_matches_transformers_generate(gemma3):
    """Prompts of 5 and 11 tokens and 12 new ones: both cross the window while decoding."""
    model, _, params, cfg = gemma3
    prompts = random_prompts(cfg.vocab_size, [5, 11], seed=2)
    res = plain.generate(params, cfg, prompts, 12, eos_ids=())
    for p, got in zip(prompts, res.output_ids):
        assert got == hf_greedy(model, p, 12)


def test_greedy_speculative_decoding_equals_plain(gemma3):
    """A random head's chain and tree, and a near-oracle chain (long acceptances, so deep tree
    nodes decide tokens), on prompts longer than the window: each node sees its own window of
    the cache, and the output is plain decoding's."""
    from test_speculative import _oracle_run

    _, _, params, cfg = gemma3
    prompts = random_prompts(cfg.vocab_size, [9, 14], seed=3)
    assert_random_head_decodes_plainly(params, cfg, prompts)
    ref, out = _oracle_run(params, cfg, prompts, 24, TreeConfig(1, 4, 5), noise_every=3)
    assert out.output_ids == ref.output_ids
    assert out.accept_hist[:, 3:].sum() > 0  # long paths accepted past the window


def test_sharded_forward_equals_one_device(gemma3):
    """The checkpoint loaded onto a 2x4 mesh (kv heads and MLP units over the model axis where
    they divide) gives one device's logits and aux states; so does it with gate/up fused at load
    (the GeGLU reads the fused matrix)."""
    _, path, params, cfg = gemma3
    mesh = make_mesh(2, 4)
    sharded, _ = load_hf(path, mesh=mesh)
    assert not sharded["layers"][0]["w_gate"].sharding.is_fully_replicated
    toks = jnp.asarray(family_tokens(2, 20, cfg.vocab_size, seed=4))
    aux_ids = tuple(range(cfg.num_layers + 1))
    ref = tgt.full_forward(params, toks, cfg, aux_ids)
    out = tgt.full_forward(sharded, toks, cfg, aux_ids)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.aux), np.asarray(ref.aux), rtol=1e-5, atol=1e-5)
    fused = tgt.fuse_projections(sharded, cfg, mesh)
    assert "w_gate_up" in fused["layers"][0]  # q/k/v stay apart: 2 kv heads over 4 devices
    tgt.check_params(fused, cfg)
    out = tgt.full_forward(fused, toks, cfg, aux_ids)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), rtol=1e-5, atol=1e-5)


def test_conditional_generation_checkpoint_reads_its_language_model(gemma3, tmp_path):
    """A Gemma3ForConditionalGeneration (a tiny SigLIP tower beside the same language model)
    saved by transformers loads to the text model's config and parameters, its vision tower and
    projector left unread, and its text-only logits match transformers'; so do the names
    transformers 5 gives the weights in memory (model.language_model.*) in place of the hub's
    (language_model.model.*, which save_pretrained writes)."""
    import transformers
    from safetensors.numpy import load_file, save_file

    model, _, params, cfg = gemma3
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=TEXT, vision_config=vision, mm_tokens_per_image=4, image_token_index=96,
        boi_token_index=94, eoi_token_index=95,
    )  # fmt: skip
    mm = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    _randomise(mm, 1)
    missing = mm.model.language_model.load_state_dict(model.model.state_dict(), strict=True)
    assert not missing.missing_keys
    mm.save_pretrained(tmp_path)
    names = json.loads((tmp_path / "config.json").read_text())
    assert names["model_type"] == "gemma3" and "text_config" in names
    got, gcfg = load_hf(tmp_path)
    assert gcfg == cfg
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    toks = family_tokens(2, 20, cfg.vocab_size)
    with torch.no_grad():
        ref = mm(input_ids=torch.tensor(toks, dtype=torch.long)).logits.numpy()
    out = tgt.full_forward(got, jnp.asarray(toks), gcfg, tuple(range(cfg.num_layers + 1)))
    np.testing.assert_allclose(np.asarray(out.logits), ref, rtol=1e-4, atol=1e-4)
    flat = load_file(tmp_path / "model.safetensors")
    assert "language_model.model.embed_tokens.weight" in flat
    assert any(name.startswith("vision_tower.") for name in flat)
    renamed = {
        n.replace("language_model.model.", "model.language_model."): a for n, a in flat.items()
    }
    save_file(renamed, tmp_path / "model.safetensors")
    again, _ = load_hf(tmp_path)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_every_attention_path_takes_the_query_pre_attn_scale():
    """Gemma 3's score scale 1/sqrt(query_pre_attn_scalar) reaches the exact path, the mixed one
    and the Pallas flash-decoding kernel (interpreted on the CPU): a decode step and a
    verification with new entries agree across paths to fp32 rounding, and differ from the
    default 1/sqrt(head_dim)."""
    from eagle3_jax.models.layers import attention, mixed_attention, pallas_attention

    b, t, h, g, k, s = 2, 3, 4, 2, 16, 32
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    q = jax.random.normal(ks[0], (b, t, h, k))
    kc = jax.random.normal(ks[1], (b, g, k, s))  # [B, G, K, S]
    vc = jax.random.normal(ks[2], (b, g, s, k))
    kn, vn = jax.random.normal(ks[3], (b, t, g, k)), jax.random.normal(ks[4], (b, t, g, k))
    mask = jnp.broadcast_to(jnp.arange(s)[None, None, :] < jnp.asarray([20, 9])[:, None, None],
                            (b, t, s))  # fmt: skip
    mask_new = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    scale = 24**-0.5
    for args in ((q[:, :1], kc, vc, mask[:, :1]), (q, kc, vc, mask, kn, vn, mask_new)):
        want = attention(*args, scale=scale)
        assert not np.allclose(want, attention(*args), atol=1e-3)
        np.testing.assert_allclose(mixed_attention(*args, scale=scale), want, atol=2e-6)
        slot_major = (args[0], kc.transpose(0, 1, 3, 2), *args[2:])
        np.testing.assert_allclose(pallas_attention(*slot_major, scale=scale), want, atol=2e-6)
