"""Mixture-of-experts targets (models/target.py's routed MLP, checkpoints/hf.py's expert names):
tiny Qwen3-MoE (one dense-MLP layer among routed ones, no renormalisation), Mixtral (every layer
routed, renormalised, a sliding window) and OLMoE (every layer routed, q/k normed over all heads)
against transformers: logits and every hidden state, the
router's choices, a router tie, prefill + steps == one forward, greedy == generate; the fused
expert layout; greedy speculative == plain; experts sharded over the model axis == one device.

The families stay out of conftest's FAMILIES (which parametrises many tests): one model shape per
family, built once per module, keeps this file's compilations few."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import random_hf_model
from helpers import (
    assert_random_head_decodes_plainly,
    assert_stepwise_decode_equals_full_forward,
    family_tokens,
    forward_seeing_routers,
    hf_greedy,
    random_prompts,
)
from jax.sharding import PartitionSpec as P

from eagle3_jax.checkpoints.hf import load_hf
from eagle3_jax.checkpoints.native import load_native, save_native
from eagle3_jax.config import TargetConfig, target_config_from_hf
from eagle3_jax.decoding import plain
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import target as tgt
from eagle3_jax.sharding import make_mesh

MOE_CONFIGS = {
    "qwen3_moe": dict(
        cls="Qwen3MoeConfig",
        head_dim=16,
        intermediate_size=48,  # the dense layer's MLP
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[1],
        norm_topk_prob=False,
    ),
    "mixtral": dict(
        cls="MixtralConfig",
        intermediate_size=48,  # each expert's
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=12,
    ),
    "olmoe": dict(  # OLMo's: q/k normed over all heads (OLMo 2's), pre-norm layers, all routed
        cls="OlmoeConfig",
        intermediate_size=32,  # each expert's
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    ),
}
MOE_FAMILIES = list(MOE_CONFIGS)
# the checks of our own machinery (the cache, the dispatches) on the two that differ most; OLMoE
# changes nothing there, only what transformers is compared with
MACHINERY = ["qwen3_moe", "mixtral"]


def tiny_moe_model(family: str, seed: int = 0, scale: float = 0.08):
    """A 4-layer transformers MoE model with random weights (fp32, eval), as conftest's
    tiny_hf_model builds the dense ones."""
    import transformers

    spec = dict(MOE_CONFIGS[family])
    cls = getattr(transformers, spec.pop("cls"))
    config = cls(
        vocab_size=97,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **spec,
    )
    return random_hf_model(config, seed, scale)  # no biases here: the same draws as before


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """family -> (transformers model, saved checkpoint directory, params, cfg)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            model = tiny_moe_model(family)
            d = tmp_path_factory.mktemp(family)
            model.save_pretrained(d)
            cache[family] = (model, d, *load_hf(d))
        return cache[family]

    return get


def test_configs_read_the_expert_fields(moe_checkpoint):
    """config.json -> TargetConfig: experts, top-k, widths, renormalisation and which layers are
    routed (Qwen3-MoE's mlp_only_layers and decoder_sparse_step), and back through to_json; a
    dense config's file keeps no expert field."""
    _, _, _, qcfg = moe_checkpoint("qwen3_moe")
    assert (qcfg.family, qcfg.qk_norm, qcfg.sliding_window) == ("qwen3_moe", "head", None)
    assert (qcfg.num_experts, qcfg.num_experts_per_tok, qcfg.moe_intermediate_size) == (8, 2, 32)
    assert qcfg.moe_layers == (0, 2, 3) and qcfg.mixed_layers and not qcfg.norm_topk_prob
    _, _, _, mcfg = moe_checkpoint("mixtral")
    assert (mcfg.family, mcfg.qk_norm, mcfg.sliding_window) == ("mixtral", "none", 12)
    assert mcfg.moe_layers == (0, 1, 2, 3) and mcfg.norm_topk_prob
    assert mcfg.moe_intermediate_size == mcfg.intermediate_size == 48
    _, _, _, ocfg = moe_checkpoint("olmoe")  # OLMo 2's q/k norm over all heads, Llama's pre-norm
    assert (ocfg.family, ocfg.qk_norm, ocfg.norm_placement) == ("olmoe", "full", "pre")
    assert ocfg.moe_layers == (0, 1, 2, 3) and not ocfg.norm_topk_prob
    assert ocfg.moe_intermediate_size == ocfg.intermediate_size == 32
    hf = json.loads((moe_checkpoint("olmoe")[1] / "config.json").read_text())
    with pytest.raises(Eagle3Error, match="sets clip_qkv=8.0: clamping q/k/v"):
        target_config_from_hf({**hf, "clip_qkv": 8.0})
    for cfg in (qcfg, mcfg, ocfg):
        assert TargetConfig.from_dict(json.loads(cfg.to_json())) == cfg
    hf = json.loads((moe_checkpoint("qwen3_moe")[1] / "config.json").read_text())
    hf.update(mlp_only_layers=[], decoder_sparse_step=2)
    assert target_config_from_hf(hf).moe_layers == (1, 3)
    dense = dataclasses.replace(qcfg, family="qwen3", num_experts=0, num_experts_per_tok=0,
                                moe_intermediate_size=0, moe_layers=())  # fmt: skip
    assert "experts" not in dense.to_json() and "moe" not in dense.to_json()
    assert TargetConfig.from_dict(json.loads(dense.to_json())) == dense
    with pytest.raises(Eagle3Error, match="num_experts_per_tok must be between 1"):
        target_config_from_hf({**hf, "num_experts_per_tok": 9})
    with pytest.raises(Eagle3Error, match="Qwen3MoeForCausalLM, MixtralForCausalLM, GptOss"):
        target_config_from_hf({"architectures": ["DeepseekV3ForCausalLM"]})


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_logits_hidden_states_and_routing_match_transformers(family, moe_checkpoint):
    """fp32 logits and every hidden state within 1e-4 of transformers; each routed layer's router,
    given the input transformers' router saw, picks the same experts in the same order with the
    same weights."""
    model, _, params, cfg = moe_checkpoint(family)
    toks = family_tokens(2, 20, cfg.vocab_size)
    _, seen = forward_seeing_routers(model, params, cfg, toks, "gate", cfg.moe_layers)
    assert sorted(seen) == list(cfg.moe_layers)
    for i, (x, (_, hf_w, hf_idx)) in seen.items():
        idx, w, weights = tgt.route(params["layers"][i]["router"], jnp.asarray(x.numpy()), cfg)
        np.testing.assert_array_equal(np.asarray(idx), hf_idx.numpy(), err_msg=f"layer {i}")
        np.testing.assert_allclose(np.asarray(w), hf_w.numpy(), rtol=1e-6, atol=1e-6)
        assert (np.count_nonzero(np.asarray(weights), -1) == cfg.num_experts_per_tok).all()
    assert "w_gate" in params["layers"][1] if family == "qwen3_moe" else True


def test_a_router_tie_goes_to_the_lowest_expert():
    """Experts 1, 2 and 3 of 4 tied exactly (integer logits, exact in any summation order):
    jax.lax.top_k takes the lowest indices first, for top-1 and top-2, renormalised or not.
    transformers' router (torch.topk) takes tied experts in an order of its own (torch 2.13 on
    the CPU: expert 2 for top-1, here), so at an exact tie the two can route differently; only
    the weights, equal among the tied, agree. Away from ties both pick alike (the parity test)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    w_ED = np.zeros((4, 8), np.float32)
    w_ED[0, 0] = 1.0
    w_ED[1:, 1] = 3.0  # experts 1-3 read the same input, more strongly than expert 0
    x = np.zeros((5, 8), np.float32)
    x[:, 0], x[:, 1] = [0, 1, 2, -1, 4], 1.0  # token 4's expert 0 (logit 4) beats the tie (3)
    for k in (1, 2):
        for norm in (False, True):
            hf_cfg = Qwen3MoeConfig(hidden_size=8, num_experts=4, num_experts_per_tok=k,
                                    norm_topk_prob=norm)  # fmt: skip
            router = Qwen3MoeTopKRouter(hf_cfg)
            with torch.no_grad():
                router.weight.copy_(torch.from_numpy(w_ED))
                _, hf_w, hf_idx = router(torch.from_numpy(x))
            cfg = TargetConfig(family="qwen3_moe", vocab_size=8, hidden_size=8,
                               intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                               head_dim=8, num_experts=4, num_experts_per_tok=k,
                               moe_intermediate_size=8, norm_topk_prob=norm,
                               moe_layers=(0,))  # fmt: skip
            idx, w, _ = tgt.route(jnp.asarray(w_ED.T), jnp.asarray(x), cfg)
            idx, hf_idx = np.asarray(idx), hf_idx.numpy()
            assert idx[:4].tolist() == [[1, 2][:k]] * 4
            assert idx[4].tolist() == [0, 1][:k]
            assert set(hf_idx[:4].ravel()) <= {1, 2, 3} and hf_idx[4, 0] == 0
            np.testing.assert_allclose(np.asarray(w), hf_w.numpy(), rtol=1e-6, atol=1e-7)


def test_fused_expert_tensors_load_like_per_expert_ones(moe_checkpoint, tmp_path):
    """Loaders. A checkpoint holding transformers 5's fused experts (gate_up_proj [E, 2F, D], down_proj
    [E, D, F], under `mlp.` for both families) loads to the same parameters as the per-expert
    names save_pretrained writes (Qwen3-MoE gate/up/down_proj, Mixtral w1/w3/w2 under
    block_sparse_moe); one missing expert is named; our converted format round-trips."""
    from safetensors.numpy import load_file, save_file

    for family in MOE_FAMILIES:
        _, path, params, cfg = moe_checkpoint(family)
        mixtral = family == "mixtral"
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        prefix = "block_sparse_moe" if mixtral else "mlp"
        flat = load_file(path / "model.safetensors")
        assert f"model.layers.0.{prefix}.experts.0.{names[0]}.weight" in flat
        for i in cfg.moe_layers:
            base = f"model.layers.{i}.{prefix}"
            per = [
                np.stack(
                    [flat.pop(f"{base}.experts.{e}.{n}.weight") for e in range(cfg.num_experts)]
                )
                for n in names
            ]
            flat[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate(per[:2], axis=1)
            flat[f"model.layers.{i}.mlp.experts.down_proj"] = per[2]
            flat[f"model.layers.{i}.mlp.gate.weight"] = flat.pop(f"{base}.gate.weight")
        d = tmp_path / family
        d.mkdir()
        save_file(flat, d / "model.safetensors")
        (d / "config.json").write_text((path / "config.json").read_text())
        fused, fcfg = load_hf(d)
        assert fcfg == cfg
        for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        # an expert missing from the per-expert layout is named
        broken = load_file(path / "model.safetensors")
        del broken[f"model.layers.0.{prefix}.experts.1.{names[2]}.weight"]
        save_file(broken, d / "model.safetensors")
        with pytest.raises(Eagle3Error, match="layer 0's we_down has experts"):
            load_hf(d)
    # our converted format keeps each layer's own parameters (Qwen3-MoE's dense layer 1 too)
    _, _, params, cfg = moe_checkpoint("qwen3_moe")
    save_native(tmp_path / "native", params, cfg)
    again, cfg2 = load_native(tmp_path / "native")
    assert cfg2 == cfg and "w_gate" in again["layers"][1] and "router" in again["layers"][0]
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("family", MACHINERY)
def test_prefill_then_stepwise_decode_equals_full_forward(family, moe_checkpoint):
    """A 9-token prefill and 15 single-token steps through the cache give one full forward's
    logits and aux states; Mixtral (every layer routed) also with its layers stacked for the
    scan, which Qwen3-MoE's mixed layers refuse."""
    _, _, params, cfg = moe_checkpoint(family)
    toks = jnp.asarray(family_tokens(2, 24, cfg.vocab_size, seed=1))
    aux_ids = cfg.default_aux_layer_ids()
    layouts = [False]
    if cfg.mixed_layers:
        with pytest.raises(Eagle3Error, match=r"layers \[0, 2, 3\] are mixture-of-experts"):
            tgt.stack_layers(params)
        with pytest.raises(Eagle3Error, match="cannot be stacked"):
            tgt.init_params(cfg, jax.random.PRNGKey(0), stacked=True)
    else:
        layouts.append(True)
    for stacked in layouts:
        assert_stepwise_decode_equals_full_forward(params, cfg, toks, 9, 32, aux_ids, stacked)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_decoding_matches_transformers_generate(family, moe_checkpoint):
    model, _, params, cfg = moe_checkpoint(family)
    prompts = random_prompts(cfg.vocab_size, [5, 11], seed=2)
    res = plain.generate(params, cfg, prompts, 8, eos_ids=())
    for p, got in zip(prompts, res.output_ids):
        assert got == hf_greedy(model, p, 8)


# dense: 5-6 s, with the slow suite (test_gpt_oss's speculative check runs the dense dispatch)
@pytest.mark.parametrize("dispatch", [pytest.param("dense", marks=pytest.mark.slow), "ragged"])
def test_greedy_speculative_decoding_equals_plain(dispatch, moe_checkpoint):
    """Qwen3-MoE (routed and dense layers) with a random head: chain and tree give plain
    decoding's tokens; the verification routes its tree's tokens as the steps routed them. With
    the accelerators' dispatch ("ragged"), one prompt: its steps gather their 2 of 8 experts and
    the verifications sort their tokens' pairs through `ragged_dot`."""
    _, _, params, cfg = moe_checkpoint("qwen3_moe")
    cfg = dataclasses.replace(cfg, moe_dispatch=dispatch)
    prompts = random_prompts(cfg.vocab_size, [7, 12] if dispatch == "dense" else [12], seed=3)
    if dispatch == "ragged":
        assert (tgt.moe_path(cfg, 1), tgt.moe_path(cfg, 5)) == ("gather", "ragged")
    assert_random_head_decodes_plainly(params, cfg, prompts)


@pytest.mark.parametrize("family", MACHINERY)
def test_routed_dispatches_give_the_dense_forward(family, moe_checkpoint):
    """The gathered and the ragged dispatch run each token on its k experts only, and give the
    dense dispatch's logits and aux states (fp32, up to the products' summation order) for
    forwards of 1, 3 and 4 x 1 tokens (gathered while their pairs are at most E: all three for
    Qwen3-MoE's 8 experts, one for Mixtral's 4) and 2 x 12 tokens (dense or ragged); the
    programs hold a grouped product only where `moe_path` says ragged."""
    _, _, params, cfg = moe_checkpoint(family)
    for b, t in ((1, 1), (1, 3), (4, 1), (2, 12)):
        toks = jnp.asarray(family_tokens(b, t, cfg.vocab_size, seed=5))
        ref = tgt.full_forward(params, toks, cfg, (1, 3))
        for dispatch in ("gather", "ragged"):
            routed = dataclasses.replace(cfg, moe_dispatch=dispatch)
            path = tgt.moe_path(routed, b * t)
            gathered = b * t * cfg.num_experts_per_tok <= cfg.num_experts  # moe_gather_pairs 1
            larger = "ragged" if dispatch == "ragged" else "dense"
            assert path == ("gather" if gathered else larger), (dispatch, b, t)
            out = tgt.full_forward(params, toks, routed, (1, 3))
            for got, exp in ((out.logits, ref.logits), (out.aux, ref.aux)):
                np.testing.assert_allclose(np.asarray(got), np.asarray(exp), rtol=2e-5, atol=2e-5)
            jaxpr = str(
                jax.make_jaxpr(lambda p, x, c=routed: tgt.full_forward(p, x, c, ()))(params, toks)
            )
            assert ("ragged_dot" in jaxpr) == (path == "ragged"), (dispatch, b, t)
    with pytest.raises(Eagle3Error, match="moe_dispatch 'sparse': choose one of dense, gather"):
        tgt.moe_path(dataclasses.replace(cfg, moe_dispatch="sparse"), 1)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routed_greedy_decoding_matches_transformers_generate(family, moe_checkpoint):
    """With the accelerators' dispatch, a prefill sorted through ragged_dot and one-token steps
    (gathered for Qwen3-MoE, ragged for Mixtral) decode transformers' greedy tokens."""
    model, _, params, cfg = moe_checkpoint(family)
    cfg = dataclasses.replace(cfg, moe_dispatch="ragged")
    prompt = random_prompts(cfg.vocab_size, [9], seed=6)[0]
    res = plain.generate(params, cfg, [prompt], 8, eos_ids=())
    assert res.output_ids[0] == hf_greedy(model, prompt, 8)


def test_the_mesh_and_backend_decide_the_dispatch_unless_the_environment_does(
    moe_checkpoint, monkeypatch
):
    """TPUs: ragged; the CPU and a GPU (until a device measures its ragged_dot): gather; a
    gather up to E pairs on the CPU, E / 3 elsewhere; the environment's EAGLE3_JAX_MOE_DISPATCH
    and EAGLE3_JAX_MOE_GATHER_PAIRS win. prepare_target sets both on a routed target's config,
    with the mesh where it has several devices, and leaves a dense one's alone; to_json leaves
    them out. On a mesh a device counts its own rows and experts (`moe_split`): the data axis
    where it divides the batch, the model axis where it divides the experts."""
    from eagle3_jax import backends
    from eagle3_jax.checkpoints import Target

    for name in (backends.MOE_DISPATCH_ENV, backends.MOE_GATHER_ENV):
        monkeypatch.delenv(name, raising=False)
    assert backends.moe_dispatch_wanted("tpu") == "ragged"
    assert backends.moe_dispatch_wanted("gpu") == "gather"
    assert backends.moe_dispatch_wanted("cpu") == "gather"
    assert backends.moe_gather_pairs_wanted("cpu") == 1.0
    assert backends.moe_gather_pairs_wanted("gpu") == pytest.approx(1 / 3)
    _, _, params, cfg = moe_checkpoint("qwen3_moe")
    got = backends.prepare_target(Target(params, cfg, None, None), backend="cpu")
    assert (got.cfg.moe_dispatch, got.cfg.moe_gather_pairs) == ("gather", 1.0)
    assert got.cfg.to_json() == cfg.to_json() and got.cfg.moe_mesh is None
    mesh = make_mesh(2, 4)
    tpu = backends.routed_as_wanted(cfg, "tpu", mesh)  # prepare_target's (it fuses on a TPU)
    assert (tpu.moe_dispatch, tpu.moe_mesh) == ("ragged", mesh)
    assert tpu.to_json() == cfg.to_json() and hash(tpu) == hash(dataclasses.replace(tpu))
    assert tgt.moe_split(tpu, 4) == (2, 4) and tgt.moe_split(tpu, 3) == (1, 4)
    # a step of 2 rows: a device's one row's 2 pairs against its 2 experts x the line (1/3)
    assert (tgt.moe_path(tpu, 2, 2), tgt.moe_path(tpu, 1, 1)) == ("ragged", "ragged")
    cpu = backends.routed_as_wanted(cfg, "cpu", mesh)  # line 1: 2 pairs <= 2 experts
    assert (tgt.moe_path(cpu, 2, 2), tgt.moe_path(cpu, 2, 1)) == ("gather", "dense")
    three = dataclasses.replace(  # 8 % 3: the experts whole on every device
        cfg, moe_dispatch="gather", moe_mesh=make_mesh(1, 3, jax.devices()[:3])
    )
    assert tgt.moe_split(three, 1) == (1, 1) and tgt.moe_path(three, 4) == "gather"
    dense_cfg = dataclasses.replace(cfg, num_experts=0, num_experts_per_tok=0, moe_layers=())
    got = backends.prepare_target(Target(params, dense_cfg, None, None), backend="cpu")
    assert got.cfg.moe_dispatch == "dense"
    monkeypatch.setenv(backends.MOE_DISPATCH_ENV, "dense")
    assert backends.moe_dispatch_wanted("gpu") == "dense"
    monkeypatch.setenv(backends.MOE_DISPATCH_ENV, "sorted")
    with pytest.raises(Eagle3Error, match="EAGLE3_JAX_MOE_DISPATCH='sorted'"):
        backends.moe_dispatch_wanted("gpu")
    monkeypatch.setenv(backends.MOE_GATHER_ENV, "inf")
    assert backends.moe_gather_pairs_wanted("gpu") == float("inf")
    for bad in ("-1", "many", "nan"):
        monkeypatch.setenv(backends.MOE_GATHER_ENV, bad)
        with pytest.raises(Eagle3Error, match="EAGLE3_JAX_MOE_GATHER_PAIRS=.*a number >= 0"):
            backends.moe_gather_pairs_wanted("gpu")


def test_experts_sharded_over_the_model_axis_give_the_same_forward(moe_checkpoint):
    """Qwen3-MoE loaded onto a 2x4 mesh: each device holds 2 of the 8 experts (expert
    parallelism; the router and the dense layer's MLP as the rules say), the forward equals one
    device's, and the compiled program moves no expert weights (no all-gather of them: the
    contraction over experts is all-reduced instead); so does it with the dense layer's gate/up
    fused at load."""
    _, path, params, cfg = moe_checkpoint("qwen3_moe")
    mesh = make_mesh(2, 4)
    sharded, _ = load_hf(path, mesh=mesh)
    for name in ("we_gate", "we_up", "we_down"):
        w = sharded["layers"][0][name]
        assert w.sharding.spec[0] == "model", (name, w.sharding.spec)
        assert {s.data.shape[0] for s in w.addressable_shards} == {2}
    assert sharded["layers"][0]["router"].sharding.is_fully_replicated
    assert sharded["layers"][1]["w_gate"].sharding.spec == P(None, "model")
    toks = jnp.asarray(family_tokens(2, 16, cfg.vocab_size, seed=4))
    aux_ids = (2, 3)
    ref = tgt.full_forward(params, toks, cfg, aux_ids)
    out = tgt.full_forward(sharded, toks, cfg, aux_ids)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.aux), np.asarray(ref.aux), rtol=1e-5, atol=1e-5)
    hlo = tgt.full_forward.lower(sharded, toks, cfg, aux_ids).compile().as_text()
    gathered = [
        line
        for line in hlo.splitlines()
        if "all-gather" in line and ("[8,64,32]" in line or "[8,32,64]" in line)
    ]
    assert not gathered, gathered[:2]
    assert "all-reduce" in hlo
    # gate/up fused at load where the mesh allows (the dense layer's; the experts stay unfused)
    fused = tgt.fuse_projections(load_hf(path, mesh=mesh)[0], cfg, mesh)
    assert "w_gate_up" in fused["layers"][1] and "we_gate" in fused["layers"][0]
    assert fused["layers"][0]["we_gate"].sharding.spec[0] == "model"
    tgt.check_params(fused, cfg)
    out = tgt.full_forward(fused, toks, cfg, aux_ids)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "family,mesh_shape",
    [("qwen3_moe", (2, 4)), ("qwen3_moe", (2, 3)), ("mixtral", (4, 2))],
    ids=["experts-split", "experts-whole", "rows-and-experts-split"],
)
def test_routed_dispatches_on_a_mesh_give_one_devices_forward(family, mesh_shape, moe_checkpoint):
    """Under a mesh (cfg.moe_mesh, `_moe_on_mesh`) each device gathers or sorts its own rows'
    pairs for its own experts and the partial sums are all-reduced: Qwen3-MoE's 8 experts split
    2 a device over a 2 x 4 mesh (expert parallelism) and whole on each device of a 2 x 3 mesh
    (8 % 3), Mixtral's 4 split 2 a device with the rows over 4 (a batch of 4; a batch of 1 or 2
    replicated over the data axis): the logits and aux states equal one device's dense forward
    (fp32, up to summation order) for steps, a 4-row step and a 2 x 12 prefill, the stacked
    (scanned) layout too, and the compiled program moves no expert weights."""
    _, path, params, cfg = moe_checkpoint(family)
    mesh = make_mesh(*mesh_shape, devices=jax.devices()[: mesh_shape[0] * mesh_shape[1]])
    sharded, _ = load_hf(path, mesh=mesh)
    split = mesh_shape[1] if cfg.num_experts % mesh_shape[1] == 0 else 1
    stacked = tgt.stack_layers(sharded) if not cfg.mixed_layers else None
    for b, t in ((1, 1), (4, 1), (2, 12)):
        toks = jnp.asarray(family_tokens(b, t, cfg.vocab_size, seed=7))
        ref = tgt.full_forward(params, toks, cfg, (1, 3))
        for dispatch in ("gather", "ragged"):
            routed = dataclasses.replace(cfg, moe_dispatch=dispatch, moe_mesh=mesh)
            rows = mesh_shape[0] if b % mesh_shape[0] == 0 else 1
            assert tgt.moe_split(routed, b) == (rows, split)
            for p in (sharded, stacked) if b * t > 1 else (sharded,):
                if p is None:
                    continue
                out = tgt.full_forward(p, toks, routed, (1, 3))
                for got, exp in ((out.logits, ref.logits), (out.aux, ref.aux)):
                    np.testing.assert_allclose(
                        np.asarray(got), np.asarray(exp), rtol=2e-5, atol=2e-5
                    )
    routed = dataclasses.replace(cfg, moe_dispatch="ragged", moe_mesh=mesh)
    toks = jnp.asarray(family_tokens(2, 12, cfg.vocab_size, seed=7))
    jaxpr = str(jax.make_jaxpr(lambda p, x: tgt.full_forward(p, x, routed, ()))(sharded, toks))
    assert "shard_map" in jaxpr and "ragged_dot" in jaxpr
    hlo = tgt.full_forward.lower(sharded, toks, routed, ()).compile().as_text()
    d, f, e = cfg.hidden_size, cfg.moe_intermediate_size or cfg.intermediate_size, cfg.num_experts
    whole = [
        dims
        for dims in re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo)
        if sorted(map(int, dims.split(","))) == sorted((e, d, f))
    ]
    assert not whole, whole
    assert split == 1 or "all-reduce(" in hlo  # the partial sums over the experts' devices


def test_a_device_runs_only_its_own_rows_and_experts(moe_checkpoint, monkeypatch):
    """The work `_moe_on_mesh` saves, not only its result: on a 2 x 4 mesh a device's body sees
    its own row of a 2-row forward and its own 2 experts (the grouped product's operands
    [12 x 2 pairs, D] and [2, D, F']), and a device's grouped product multiplies only the pairs
    routed to its own experts (the others sort past every group: the groups hold exactly the
    local pairs, checked on `_moe_pairs` run eagerly)."""
    _, path, params, cfg = moe_checkpoint("qwen3_moe")
    mesh = make_mesh(2, 4)
    sharded, _ = load_hf(path, mesh=mesh)
    routed = dataclasses.replace(cfg, moe_dispatch="ragged", moe_mesh=mesh)
    toks = jnp.asarray(family_tokens(2, 12, cfg.vocab_size, seed=7))
    closed = jax.make_jaxpr(lambda p, x: tgt.full_forward(p, x, routed, ()))(sharded, toks)
    d, f, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    products = [e for e in _eqns(closed.jaxpr, inside=False) if "ragged_dot" in e.primitive.name]
    assert products  # each routed layer's three, all inside the shard_map
    for e in products:
        lhs, rhs = (v.aval.shape for v in e.invars[:2])
        assert lhs[0] == 12 * k and rhs[0] == 2 and set(rhs[1:]) == {d, f}, (lhs, rhs)
    sizes = []
    real = jax.lax.ragged_dot

    def spy(lhs, rhs, group_sizes, **kw):
        sizes.append(np.asarray(group_sizes))
        return real(lhs, rhs, group_sizes, **kw)

    monkeypatch.setattr(jax.lax, "ragged_dot", spy)
    x = jax.random.normal(jax.random.key(0), (1, 12, d))
    idx = jax.random.randint(jax.random.key(1), (1, 12, k), 0, cfg.num_experts)
    w = jnp.full((1, 12, k), 0.5)
    experts = {n: params["layers"][0][n][2:4] for n in ("we_gate", "we_up", "we_down")}
    tgt._moe_pairs(experts, x, idx - 2, w, routed, "ragged", local_experts=2)
    local = np.bincount(np.asarray(idx).ravel(), minlength=cfg.num_experts)[2:4]
    assert len(sizes) == 3 and all((s == local).all() for s in sizes), (sizes, local)


def _eqns(jaxpr, inside: bool):
    """The equations inside `jax.shard_map` bodies of `jaxpr`, sub-jaxprs included."""
    for e in jaxpr.eqns:
        if inside:
            yield e
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub, inside or e.primitive.name == "shard_map")
