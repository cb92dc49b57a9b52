"""gpt-oss as a target (config.py, models/layers.py, models/target.py, checkpoints/hf.py and
checkpoints/mxfp4.py): a tiny GptOssForCausalLM with sliding-window (8) and full layers in turn,
YaRN RoPE (factor 4, truncate off), attention sinks, q/k/v/o biases, 4 experts top-2 with a
biased router and biased experts and a clamped SwiGLU whose limit (1.0) the activations cross,
against transformers: the YaRN tables, logits and every hidden state, the router's choices,
prefill + steps == one forward (unrolled and scanned), greedy == generate; greedy speculative ==
plain; sharded == unsharded; the sinks on the mixed path and the Pallas kernel; MXFP4 expert
weights dequantised as transformers does and loaded from a hub-layout checkpoint.

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
    CHAIN,
    assert_random_head_decodes_plainly,
    assert_stepwise_decode_equals_full_forward,
    family_tokens,
    forward_seeing_routers,
    hf_greedy,
    random_prompts,
)

from eagle3_jax.checkpoints.hf import load_hf
from eagle3_jax.checkpoints.mxfp4 import Mxfp4Experts, dequantize
from eagle3_jax.config import RopeConfig, TargetConfig, rope_inv_freq, target_config_from_hf
from eagle3_jax.decoding import plain
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf
from eagle3_jax.models import layers
from eagle3_jax.models import target as tgt
from eagle3_jax.sharding import make_mesh

WINDOW = 8
LIMIT = 1.0  # the clamped SwiGLU's limit: below the gate/up activations' spread, so it bites
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10_000.0,
    "factor": 4.0,
    "beta_fast": 16.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 256,
}
CONFIG = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention"] * 2,
    max_position_embeddings=1024,  # = factor x original: transformers warns otherwise
    rope_parameters=YARN,
    swiglu_limit=LIMIT,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_gpt_oss(seed: int = 0, scale: float = 0.08):
    """The transformers model with random weights (fp32, eval): norms around 1, sinks of unit
    spread (so they take a real share of each softmax), every other weight and bias
    normal(0, scale)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG)).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_((1.0 if "sinks" in name else scale) * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(transformers GptOssForCausalLM, its saved checkpoint directory, params, cfg)."""
    model = tiny_gpt_oss()
    d = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(d)
    return (model, d, *load_hf(d))


def test_config_reads_the_gpt_oss_fields(gpt_oss, tmp_path):
    """config.json -> TargetConfig: the alternating layers, YaRN, sinks, biases, the router's
    order, the clamped SwiGLU and the experts; the hub's field names (transformers 4.x:
    rope_scaling and rope_theta, no layer_types, experts_per_token) give the same config; no
    RoPE at all takes GptOssConfig's default (YaRN, factor 32, theta 150000); to_json
    round-trips, as does our converted format; a dense config's file names none of the new
    fields; a head's YaRN survives its config.json; other quantisations and other
    architectures are refused by name."""
    from eagle3_jax.checkpoints.head_config import draft_config_from_hf, draft_config_to_hf
    from eagle3_jax.checkpoints.native import load_native, save_native

    _, path, params, cfg = gpt_oss
    assert (cfg.family, cfg.sliding_window, cfg.full_attention_layers) == (
        "gpt_oss",
        WINDOW,
        (1, 3),
    )
    assert [cfg.is_sliding_layer(i) for i in range(4)] == [True, False, True, False]
    assert cfg.rope == RopeConfig(
        theta=10_000.0, kind="yarn", factor=4.0, original_max_position=256, beta_fast=16.0,
        beta_slow=1.0, truncate=False, attention_factor=0.1 * np.log(4.0) + 1.0,
    )  # fmt: skip
    assert cfg.attention_bias and cfg.attention_out_bias and cfg.attention_sinks
    assert cfg.moe_bias and cfg.router_topk_logits and cfg.norm_topk_prob
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (LIMIT, 1.702)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    assert cfg.moe_layers == (0, 1, 2, 3) and not cfg.mixed_layers
    assert (cfg.qk_norm, cfg.norm_placement, cfg.tie_word_embeddings) == ("none", "pre", False)
    assert params["layers"][0]["sinks"].shape == (4,) and params["layers"][0]["bo"].shape == (64,)
    assert TargetConfig.from_dict(json.loads(cfg.to_json())) == cfg
    save_native(tmp_path / "native", params, cfg)
    again, cfg2 = load_native(tmp_path / "native")
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hf = json.loads((path / "config.json").read_text())
    hub = {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters")}
    hub.update(rope_theta=10_000.0, experts_per_token=2, num_experts_per_tok=None,
               rope_scaling={k: v for k, v in YARN.items() if k != "rope_theta"},
               quantization_config={"quant_method": "mxfp4"})  # fmt: skip
    assert target_config_from_hf(hub) == cfg
    bare = target_config_from_hf({k: v for k, v in hub.items() if k != "rope_scaling"})
    assert bare.rope == RopeConfig(
        theta=10_000.0, kind="yarn", factor=32.0, original_max_position=4096, truncate=False,
        attention_factor=0.1 * np.log(32.0) + 1.0,
    )  # fmt: skip
    del hub["rope_theta"], hub["rope_scaling"]
    assert target_config_from_hf(hub).rope.theta == 150_000.0
    dense = dataclasses.replace(
        cfg, family="llama", rope=RopeConfig(), full_attention_layers=(), sliding_window=None,
        attention_sinks=False, attention_out_bias=False, moe_bias=False,
        router_topk_logits=False, swiglu_limit=None, swiglu_alpha=None, num_experts=0,
        num_experts_per_tok=0, moe_intermediate_size=0, norm_topk_prob=False, moe_layers=(),
    )  # fmt: skip
    text = dense.to_json()
    for name in ("attention_sinks", "attention_out_bias", "moe_bias", "router_topk_logits",
                 "swiglu_limit", "swiglu_alpha", "beta_fast", "beta_slow", "truncate",
                 "attention_factor"):  # fmt: skip
        assert name not in text
    assert TargetConfig.from_dict(json.loads(text)) == dense
    head = drf.DraftConfig.from_target(cfg, rope=cfg.rope)
    assert draft_config_from_hf(draft_config_to_hf(head), cfg).rope == cfg.rope
    with pytest.raises(Eagle3Error, match="quant_method 'fp8' is not supported"):
        target_config_from_hf({**hf, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(Eagle3Error, match="GptOssForCausalLM, OlmoeForCausalLM checkpoints"):
        target_config_from_hf({"architectures": ["DeepseekV3ForCausalLM"]})


@pytest.mark.parametrize(
    "params",
    [
        YARN,
        {**YARN, "truncate": True, "beta_fast": 32.0, "factor": 32.0,
         "original_max_position_embeddings": 32},
        {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5},
        {**YARN, "attention_factor": 1.5},
        {k: v for k, v in YARN.items() if k not in ("beta_fast", "truncate")},
        {**YARN, "factor": None},
    ],
    ids=["tiny-model", "truncated", "mscale", "attention-factor", "defaults", "no-factor"],
)  # fmt: skip
def test_yarn_matches_transformers(params):
    """YaRN read from a config (config._yarn, rope_inv_freq) against transformers'
    GptOssRotaryEmbedding: the inverse frequencies, the attention factor, and the scaled cos/sin
    tables at positions past the original context; each way the dict can say it (a factor of
    None, which transformers' config validation refuses but its YaRN function reads as
    max_position_embeddings / original_max_position_embeddings, set after validation)."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    given = {**params, "factor": params["factor"] or 4.0}
    hf = transformers.GptOssConfig(**{**CONFIG, "rope_parameters": given})
    if params["factor"] is None:
        hf.rope_parameters["factor"] = None
    rope = target_config_from_hf(hf.to_dict()).rope
    emb = GptOssRotaryEmbedding(hf)
    assert rope.kind == "yarn" and rope.attention_factor == pytest.approx(emb.attention_scaling)
    np.testing.assert_allclose(rope_inv_freq(rope, 16), emb.inv_freq.numpy(), rtol=1e-7)
    pos = np.array([[0, 1, 5, 300, 1000, 7]], np.int32)
    with torch.no_grad():
        cos_t, sin_t = emb(torch.zeros(1), torch.from_numpy(pos).long())  # [B, T, K/2]
    cos, sin = layers.rope_cos_sin(jnp.asarray(pos), rope_inv_freq(rope, 16), rope.attention_factor)
    for got, want in ((cos, cos_t), (sin, sin_t)):
        want = np.concatenate([want.numpy()] * 2, axis=-1)
        np.testing.assert_allclose(np.asarray(got[:, :, 0]), want, rtol=1e-5, atol=1e-5)


def test_logits_hidden_states_and_routing_match_transformers(gpt_oss):
    """fp32 logits and every hidden state within 1e-4 of transformers over 20 tokens, past the
    8-token window; each layer's router, given the input transformers' router saw, picks the
    same experts in the same order with the same weights, and that input drives gate and up
    activations past the SwiGLU's limit (the clamp is exercised). Zero sinks would change the
    logits (the sinks are exercised)."""
    model, _, params, cfg = gpt_oss
    toks = family_tokens(2, 20, cfg.vocab_size)
    out, seen = forward_seeing_routers(model, params, cfg, toks, "router", range(cfg.num_layers))
    assert sorted(seen) == list(range(cfg.num_layers))
    for i, (x, (_, hf_w, hf_idx)) in seen.items():
        lp = params["layers"][i]
        x = jnp.asarray(x.numpy())
        idx, w, weights = tgt.route(lp["router"], x, cfg, lp["router_bias"])
        np.testing.assert_array_equal(np.asarray(idx), hf_idx.numpy(), err_msg=f"layer {i}")
        np.testing.assert_allclose(np.asarray(w), hf_w.numpy(), rtol=1e-6, atol=1e-6)
        assert (np.count_nonzero(np.asarray(weights), -1) == cfg.num_experts_per_tok).all()
        gate = np.asarray(jnp.einsum("td,edf->tef", x, lp["we_gate"]) + lp["be_gate"])
        up = np.asarray(jnp.einsum("td,edf->tef", x, lp["we_up"]) + lp["be_up"])
        assert (gate > LIMIT).any() and (up > LIMIT).any() and (up < -LIMIT).any()
    no_sinks = {**params, "layers": [{**lp, "sinks": lp["sinks"] * 0} for lp in params["layers"]]}
    other = tgt.full_forward(no_sinks, jnp.asarray(toks), cfg)
    assert np.abs(np.asarray(other.logits) - np.asarray(out.logits)).max() > 1e-2


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "scanned"])
def test_prefill_then_stepwise_decode_equals_full_forward(gpt_oss, stacked):
    """A 6-token prefill and 14 single-token steps through the cache (the sliding layers'
    window passed after 8) give one full forward's logits and every hidden state; with the layers
    stacked too (every layer routed, so they stack), a scanned flag picking each layer's
    window."""
    _, _, params, cfg = gpt_oss
    toks = jnp.asarray(family_tokens(2, 20, cfg.vocab_size))
    aux_ids = tuple(range(cfg.num_layers + 1))
    assert_stepwise_decode_equals_full_forward(params, cfg, toks, 6, 32, aux_ids, stacked)


def test_greedy_decoding_matches_transformers_generate(gpt_oss):
    """Prompts of 5 and 11 tokens and 12 new ones: both cross the window while decoding."""
    model, _, params, cfg = gpt_oss
    prompts = random_prompts(cfg.vocab_size, [5, 11], seed=2)
    res = plain.generate(params, cfg, prompts, 12, eos_ids=())
    for p, got in zip(prompts, res.output_ids):
        assert got == hf_greedy(model, p, 12)


def test_routed_dispatches_give_the_dense_forward(gpt_oss):
    """gpt-oss's router bias, expert biases (the down bias weighted like its expert's output),
    clamped SwiGLU and top-k-of-logits routing on the gathered and the ragged dispatch
    (`models.target.moe_path`): the dense dispatch's logits and aux states (fp32, up to the
    products' summation order) at 1, 3 and 2 x 12 tokens (4 experts, top 2: gathered up to 2)."""
    _, _, params, cfg = gpt_oss
    for b, t in ((1, 1), (1, 3), (2, 12)):
        toks = jnp.asarray(family_tokens(b, t, cfg.vocab_size, seed=7))
        ref = tgt.full_forward(params, toks, cfg, (1, 3))
        for dispatch in ("gather", "ragged"):
            routed = dataclasses.replace(cfg, moe_dispatch=dispatch)
            gathered = b * t * cfg.num_experts_per_tok <= cfg.num_experts
            path = tgt.moe_path(routed, b * t)
            assert path == ("gather" if gathered else {"gather": "dense"}.get(dispatch, dispatch))
            out = tgt.full_forward(params, toks, routed, (1, 3))
            for got, exp in ((out.logits, ref.logits), (out.aux, ref.aux)):
                np.testing.assert_allclose(np.asarray(got), np.asarray(exp), rtol=2e-5, atol=2e-5)


def test_greedy_speculative_decoding_equals_plain(gpt_oss):
    """A random head's chain and tree, and a near-oracle chain (long acceptances, so deep tree
    nodes decide tokens), on prompts longer than the window: the verification's sinks, window
    and routing give plain decoding's tokens."""
    from test_speculative import _oracle_run

    _, _, params, cfg = gpt_oss
    prompts = random_prompts(cfg.vocab_size, [9, 14], seed=3)
    assert_random_head_decodes_plainly(params, cfg, prompts)
    ref, out = _oracle_run(params, cfg, prompts, 24, CHAIN, noise_every=3)
    assert out.output_ids == ref.output_ids
    assert out.accept_hist[:, 3:].sum() > 0  # long paths accepted past the window


def test_sharded_forward_equals_one_device(gpt_oss):
    """The checkpoint loaded onto a 2x4 mesh: one expert per device (weights and biases split
    over the model axis), the sinks split with their heads, the router replicated; logits and
    every hidden state equal one device's, with the dense dispatch and the routed ones."""
    _, path, params, cfg = gpt_oss
    mesh = make_mesh(2, 4)
    sharded, _ = load_hf(path, mesh=mesh)
    lp = sharded["layers"][0]
    for name in ("we_gate", "we_up", "we_down", "be_gate", "be_up", "be_down"):
        assert lp[name].sharding.spec[0] == "model", (name, lp[name].sharding.spec)
        assert {s.data.shape[0] for s in lp[name].addressable_shards} == {1}
    assert lp["sinks"].sharding.spec[0] == "model"
    assert lp["router"].sharding.is_fully_replicated
    assert lp["router_bias"].sharding.is_fully_replicated
    toks = jnp.asarray(family_tokens(2, 20, cfg.vocab_size, seed=4))
    aux_ids = tuple(range(cfg.num_layers + 1))
    ref = tgt.full_forward(params, toks, cfg, aux_ids)
    out = tgt.full_forward(sharded, toks, cfg, aux_ids)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.aux), np.asarray(ref.aux), rtol=1e-5, atol=1e-5)
    # each device gathering (a step) or sorting (a prefill) the pairs routed to its own
    # experts, with their biases (`models.target._moe_on_mesh`): two experts a device on a
    # 2 x 2 mesh, so a bias row taken by the wrong index shows
    two = make_mesh(2, 2, devices=jax.devices()[:4])
    split, _ = load_hf(path, mesh=two)
    assert {s.data.shape[0] for s in split["layers"][0]["be_down"].addressable_shards} == {2}
    for dispatch, (b, t) in (("gather", (2, 1)), ("ragged", (2, 20))):
        routed = dataclasses.replace(cfg, moe_dispatch=dispatch, moe_mesh=two, moe_gather_pairs=2)
        assert tgt.moe_path(routed, b * t, b) == dispatch and tgt.moe_split(routed, b) == (2, 2)
        part = jnp.asarray(family_tokens(b, t, cfg.vocab_size, seed=4))
        ref = tgt.full_forward(params, part, cfg, aux_ids)
        out = tgt.full_forward(split, part, routed, aux_ids)
        for got, exp in ((out.logits, ref.logits), (out.aux, ref.aux)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(exp), rtol=2e-5, atol=2e-5)
    # on one device q/k/v and their biases fuse (as accelerators load them); bo, the sinks and
    # the experts stay as they are
    fused = tgt.fuse_projections(load_hf(path)[0], cfg)
    assert {"wqkv", "bqkv", "bo", "sinks", "we_gate"} <= set(fused["layers"][0])
    tgt.check_params(fused, cfg)
    out = tgt.full_forward(fused, toks, cfg, aux_ids)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), rtol=1e-5, atol=1e-5)


def test_sinks_on_every_attention_path():
    """The sinks enter the softmax's denominator once on every path: the exact one (against a
    numpy softmax with the sink column appended and dropped), the mixed one (cached part and a
    verification's new entries merged, then the sink) and the Pallas flash-decoding kernel
    (interpreted on the CPU: kernel splits, the tree's entries, then the sink), for a decode step
    and a verification; and they change the output."""
    from eagle3_jax.models.layers import attention, mixed_attention, pallas_attention

    b, t, h, g, k, s = 2, 3, 4, 2, 16, 32
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    q = jax.random.normal(ks[0], (b, t, h, k))
    kc = jax.random.normal(ks[1], (b, g, k, s))  # [B, G, K, S]
    vc = jax.random.normal(ks[2], (b, g, s, k))
    kn, vn = jax.random.normal(ks[3], (b, t, g, k)), jax.random.normal(ks[4], (b, t, g, k))
    sinks = 2.0 * jax.random.normal(ks[5], (h,))
    mask = jnp.broadcast_to(jnp.arange(s)[None, None, :] < jnp.asarray([20, 9])[:, None, None],
                            (b, t, s))  # fmt: skip
    mask_new = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    # the reference: per head, scores over the cache and the new entries, the sink appended
    r = h // g
    kc_h, vc_h, kn_h, vn_h = (
        np.repeat(x, r, axis=a) for x, a in ((kc, 1), (vc, 1), (kn, 2), (vn, 2))
    )
    scores = np.einsum("bthk,bhks->bths", q, kc_h) / np.sqrt(k)
    own = np.einsum("bthk,buhk->bthu", q, kn_h) / np.sqrt(k)
    scores = np.where(np.asarray(mask)[:, :, None], scores, -np.inf)
    own = np.where(np.asarray(mask_new)[:, :, None], own, -np.inf)
    sink = np.broadcast_to(np.asarray(sinks)[None, None, :, None], (b, t, h, 1))
    logits = np.concatenate([scores, own, sink], -1)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    want_tree = np.einsum("bths,bhsk->bthk", p[..., :s], vc_h)
    want_tree += np.einsum("bthu,buhk->bthk", p[..., s:-1], vn_h)
    np.testing.assert_allclose(
        attention(q, kc, vc, mask, kn, vn, mask_new, sinks=sinks), want_tree, atol=2e-6
    )
    for args in ((q[:, :1], kc, vc, mask[:, :1]), (q, kc, vc, mask, kn, vn, mask_new)):
        want = attention(*args, sinks=sinks)
        assert not np.allclose(want, attention(*args), atol=1e-3)
        np.testing.assert_allclose(mixed_attention(*args, sinks=sinks), want, atol=2e-6)
        slot_major = (args[0], kc.transpose(0, 1, 3, 2), *args[2:])
        np.testing.assert_allclose(pallas_attention(*slot_major, sinks=sinks), want, atol=2e-6)


def test_mxfp4_dequantisation_matches_transformers():
    """`dequantize` against transformers' convert_moe_packed_tensors (float32) on random blocks
    over every nibble and every scale that stays finite in transformers' 2^(s - 127) (0-254:
    subnormal results, overflow to inf), bit for bit; `Mxfp4Experts` gives the same numbers for
    any experts, inputs and rows asked."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 6, 4, 16), dtype=np.uint8)
    scales = rng.integers(0, 255, (3, 6, 4), dtype=np.uint8)
    scales[0, 0, :] = [0, 1, 253, 254]
    want = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    ).numpy()
    got = dequantize(blocks, scales)
    assert got.shape == want.shape == (3, 128, 6) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    assert np.isinf(got).any() and (np.abs(got[got != 0]) < 2.0**-126).any()
    lazy = Mxfp4Experts(blocks, scales, slice(1, None, 2))
    assert lazy.shape == (3, 128, 3)
    np.testing.assert_array_equal(np.asarray(lazy), want[..., 1::2])
    np.testing.assert_array_equal(lazy[1:3, 32:96, 1:], want[1:3, 32:96, 3::2])


def _pack_mxfp4(rng, e, rows, cols):
    """Random MXFP4 blocks [E, rows, cols/32, 16] and scales [E, rows, cols/32] whose values
    stay small (scales 2^-6 .. 2^-4: at most 0.375), like trained weights."""
    blocks = rng.integers(0, 256, (e, rows, cols // 32, 16), dtype=np.uint8)
    scales = rng.integers(121, 124, (e, rows, cols // 32), dtype=np.uint8)
    return blocks, scales


def test_mxfp4_checkpoint_loads_to_dequantised_values(gpt_oss, tmp_path):
    """A checkpoint in the hub's layout: each layer's experts as gate_up_proj / down_proj
    _blocks and _scales (uint8) beside the unquantised rest, and config.json's
    quantization_config. It loads to transformers' dequantisation of those blocks (split into
    the interleaved gate and up), the other parameters unchanged; the same onto a 2x4 mesh, each
    device decoding only its expert; a missing _scales is named."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, path, params, cfg = gpt_oss
    flat = load_file(path / "model.safetensors")
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    rng = np.random.default_rng(5)
    want = {}
    for i in range(cfg.num_layers):
        base = f"model.layers.{i}.mlp.experts"
        for proj, rows, cols in (("gate_up_proj", 2 * f, d), ("down_proj", d, f)):
            del flat[f"{base}.{proj}"]
            blocks, scales = _pack_mxfp4(rng, e, rows, cols)
            flat[f"{base}.{proj}_blocks"], flat[f"{base}.{proj}_scales"] = blocks, scales
            want[i, proj] = convert_moe_packed_tensors(
                torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
            ).numpy()
    save_file(flat, tmp_path / "model.safetensors")
    hf = json.loads((path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    for mesh in (None, make_mesh(2, 4)):
        got, gcfg = load_hf(tmp_path, mesh=mesh)
        assert gcfg == cfg
        for i, lp in enumerate(got["layers"]):
            np.testing.assert_array_equal(lp["we_gate"], want[i, "gate_up_proj"][..., 0::2])
            np.testing.assert_array_equal(lp["we_up"], want[i, "gate_up_proj"][..., 1::2])
            np.testing.assert_array_equal(lp["we_down"], want[i, "down_proj"])
            for name in set(lp) - {"we_gate", "we_up", "we_down"}:
                np.testing.assert_array_equal(lp[name], params["layers"][i][name], err_msg=name)
    del flat["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(flat, tmp_path / "model.safetensors")
    with pytest.raises(Eagle3Error, match="layer 2's MXFP4 down_proj has \\['_blocks'\\]"):
        load_hf(tmp_path)
