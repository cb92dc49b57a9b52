"""EAGLE-3 draft head: parity with a PyTorch reference, official-format round trips, refusals,
full-size shapes, the output layers (own, the target's, SpecVocab) and the Flax module. The
draft-vocabulary mapping itself: tests/test_vocab.py."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from reference_eagle3 import Eagle3Draft
from safetensors.torch import save_file

from eagle3_jax import vocab as vocab_lib
from eagle3_jax.checkpoints import eagle_format as ef
from eagle3_jax.checkpoints.head_config import draft_config_to_hf
from eagle3_jax.checkpoints.safetensors_io import read_safetensors
from eagle3_jax.config import ProductPolicy, RopeConfig, TargetConfig
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as dr
from eagle3_jax.models import draft_output
from eagle3_jax.sharding import make_mesh
from eagle3_jax.training.checkpoint import restore_orbax, save_orbax

# A tiny head whose hidden size differs from its target's (so fc, target_hidden_size and the
# head's own embedding are all exercised), with GQA and a 40-of-97 draft vocabulary.
V, VD, D, HT, F, NH, NKV, HD, L = 97, 40, 64, 48, 96, 4, 2, 16, 8
THEIR_AUX = [1, 3, 4]  # layer OUTPUTS in config.json ...
OUR_AUX = (2, 4, 5)  # ... = inputs to layers 2, L//2, L-3 for L = 8
TARGET = TargetConfig(
    family="llama",
    vocab_size=V,
    hidden_size=HT,
    intermediate_size=80,
    num_layers=L,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
)
DRAFT_IDS = np.sort(np.random.default_rng(7).choice(V, VD, replace=False))


def _hf_config(**over):
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": D,
        "intermediate_size": F,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "vocab_size": V,
        "draft_vocab_size": VD,
        "target_hidden_size": HT,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": THEIR_AUX},
    }
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


@functools.cache
def _torch_head() -> Eagle3Draft:
    torch.manual_seed(0)
    m = Eagle3Draft(D, F, NH, NKV, HD, V, VD, HT, eps=1e-5, theta=10000.0).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            noise = torch.randn_like(p)
            p.copy_((1.0 + 0.2 * noise) if "norm" in name else 0.08 * noise)
        voc = vocab_lib.from_target_ids(DRAFT_IDS, V)
        m.d2t.copy_(torch.from_numpy(voc.d2t))
        m.t2d.copy_(torch.from_numpy(voc.t2d))
    return m


def _write_official(path, model=None, config=None, drop=(), replace=None, fmt="safetensors"):
    """An official-format head directory from the torch reference's state dict."""
    path.mkdir(parents=True, exist_ok=True)
    model = model or _torch_head()
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for k in drop:
        state.pop(k)
    state.update(replace or {})
    (path / "config.json").write_text(json.dumps(config or _hf_config()))
    if fmt == "safetensors":
        save_file(state, str(path / "model.safetensors"))
    else:
        torch.save(state, path / "pytorch_model.bin")
    return path


@pytest.fixture(scope="module")
def official_dir(tmp_path_factory):
    return _write_official(tmp_path_factory.mktemp("official") / "head")


# ----------------------------------------------------------------------------- (a) parity


def test_forward_matches_pytorch_reference_two_step_chain(official_dir):
    params, cfg, voc, embed = ef.load_draft(official_dir, TARGET)
    assert embed is not None and cfg.aux_layer_ids == OUR_AUX and cfg.feature_size == 3 * HT
    model = _torch_head()
    b, t, s = 2, 7, 18  # 2T used slots + spare ones that stay masked
    rng = np.random.default_rng(1)
    feat = rng.normal(size=(b, t, 3 * HT)).astype(np.float32)
    toks1 = rng.integers(0, V, (b, t)).astype(np.int32)
    toks2 = rng.integers(0, V, (b, t)).astype(np.int32)
    pos1 = np.broadcast_to(np.arange(t, dtype=np.int32) + np.array([[0], [5]], np.int32), (b, t))
    pos2 = pos1 + 1  # TTT step i rotates at position t + i
    # Step 1: causal over step-1 keys; row 1 has a padded key at slot 1.
    valid = np.ones((b, t), bool)
    valid[1, 1] = False
    causal = np.tril(np.ones((t, t), bool))
    m1 = causal[None] & (valid[:, None, :] | np.eye(t, dtype=bool)[None])
    # Step 2 (a tree of depth 1 per position): the prefix 0..t of step 1 plus only its own node.
    m2 = np.concatenate([m1, np.broadcast_to(np.eye(t, dtype=bool), (b, t, t))], axis=-1)

    with torch.no_grad():
        h1_ref, lg1_ref, kv = model(
            torch.from_numpy(feat),
            torch.from_numpy(toks1).long(),
            torch.from_numpy(pos1.copy()).long(),
            torch.from_numpy(m1),
        )
        h2_ref, lg2_ref, _ = model(
            h1_ref,
            torch.from_numpy(toks2).long(),
            torch.from_numpy(pos2.copy()).long(),
            torch.from_numpy(m2),
            kv,
        )

    step = jax.jit(dr.forward, static_argnames=("cfg",))
    cache = dr.make_cache(cfg, b, s)
    mask1 = np.zeros((b, t, s), bool)
    mask1[:, :, :t] = m1
    mask2 = np.zeros((b, t, s), bool)
    mask2[:, :, : 2 * t] = m2
    out1 = step(params, embed, toks1, feat, pos1, mask1, cfg, cache, jnp.zeros((b,), jnp.int32))
    out2 = step(
        params,
        embed,
        toks2,
        out1.hidden,
        pos2,
        mask2,
        cfg,
        out1.cache,
        jnp.full((b,), t, jnp.int32),
    )
    tol = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out1.hidden, h1_ref.numpy(), **tol)
    np.testing.assert_allclose(out1.logits, lg1_ref.numpy(), **tol)
    np.testing.assert_allclose(out2.hidden, h2_ref.numpy(), **tol)
    np.testing.assert_allclose(out2.logits, lg2_ref.numpy(), **tol)
    # Without a cache ([B, T, T] mask) step 1 is the same computation.
    nocache = step(params, embed, toks1, feat, pos1, m1, cfg)
    np.testing.assert_allclose(nocache.logits, out1.logits, rtol=1e-6, atol=1e-6)
    assert nocache.cache is None and out1.logits.shape == (b, t, VD)
    # Draft ids map back to the target vocab through d2t.
    top = jnp.argmax(out2.logits, -1).astype(jnp.int32)
    np.testing.assert_array_equal(
        draft_output.draft_to_target_ids(top, voc), DRAFT_IDS[np.asarray(top)]
    )


def test_pytorch_bin_checkpoint_loads_like_safetensors(official_dir, tmp_path, monkeypatch):
    a = ef.load_draft(official_dir, TARGET)
    b = ef.load_draft(_write_official(tmp_path / "bin", fmt="bin"), TARGET)
    jax.tree.map(np.testing.assert_array_equal, a[0], b[0])
    assert a[1] == b[1]
    np.testing.assert_array_equal(a[2].d2t, b[2].d2t)
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # "torch is not installed"
    with pytest.raises(Eagle3Error, match="torch is not installed.*safetensors"):
        ef.load_draft(tmp_path / "bin", TARGET)


# ----------------------------------------------------------------------------- (b) round trips


def _assert_same_head(a, b):
    jax.tree.map(np.testing.assert_array_equal, a[0], b[0])
    assert a[1] == b[1]
    np.testing.assert_array_equal(a[2].d2t, b[2].d2t)
    np.testing.assert_array_equal(a[2].t2d, b[2].t2d)
    assert a[2].d2t.dtype == np.int64 and a[2].t2d.dtype == np.bool_


def test_import_export_import_round_trip(official_dir, tmp_path):
    first = ef.load_draft(official_dir, TARGET)
    ef.save_draft(tmp_path / "out", first[0], first[1], first[2], dtype="float32", embed=first[3])
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["num_hidden_layers"] == 1
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in OUR_AUX]
    assert hf["tie_word_embeddings"] is False and hf["draft_vocab_size"] == VD
    tensors = read_safetensors(tmp_path / "out" / "model.safetensors")
    ref = _torch_head().state_dict()
    assert set(tensors) == set(ref)  # exactly the official names, nothing more
    for k, v in ref.items():
        np.testing.assert_array_equal(tensors[k], v.numpy(), err_msg=k)
    second = ef.load_draft(tmp_path / "out", TARGET)
    _assert_same_head(first, second)
    np.testing.assert_array_equal(first[3], second[3])
    # Saving over an existing head replaces it; bf16 export rounds each weight once.
    ef.save_draft(tmp_path / "out", first[0], first[1], first[2], dtype="bfloat16", embed=first[3])
    third = ef.load_draft(tmp_path / "out", TARGET)
    rounded = jax.tree.map(
        lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32), first[0]
    )
    jax.tree.map(np.testing.assert_array_equal, rounded, third[0])
    assert not list(tmp_path.glob(".out.*"))  # no temporary directory left behind


def test_load_onto_a_mesh_places_each_tensor_on_its_sharding(official_dir):
    mesh = make_mesh(data=2)  # 2 x 4 over the 8 fake CPU devices
    plain = ef.load_draft(official_dir, TARGET)[0]
    sharded = ef.load_draft(official_dir, TARGET, mesh=mesh)[0]
    jax.tree.map(np.testing.assert_array_equal, plain, sharded)
    assert tuple(sharded["lm_head"].sharding.spec) == (None, "model")  # Vd = 40 splits over 4
    assert tuple(sharded["layer"]["wk"].sharding.spec) == (None, "model")


def test_aux_layer_id_conventions(tmp_path):
    # config.json names layer outputs [1, L//2-1, L-4]: ours are the inputs (2, L//2, L-3).
    p = _write_official(
        tmp_path / "a",
        config=_hf_config(
            eagle_config={"eagle_aux_hidden_state_layer_ids": [1, L // 2 - 1, L - 4]}
        ),
    )
    assert ef.load_draft(p, TARGET)[1].aux_layer_ids == TARGET.default_aux_layer_ids() == (2, 4, 5)
    # Absent: the target's defaults.
    p = _write_official(tmp_path / "b", config=_hf_config(eagle_config=None))
    assert ef.load_draft(p, TARGET)[1].aux_layer_ids == (2, 4, 5)
    with pytest.raises(Eagle3Error, match="eagle_aux_hidden_state_layer_ids.*target_cfg"):
        ef.load_draft(p)
    # Ours -> config.json subtracts one; id 0 has no output name.
    cfg = dr.DraftConfig.from_target(TARGET, aux_layer_ids=(1, 4, 7))
    hf = draft_config_to_hf(cfg)
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 6]
    with pytest.raises(Eagle3Error, match="aux layer id 0"):
        draft_config_to_hf(dataclasses.replace(cfg, aux_layer_ids=(0, 4, 7)))


def test_full_vocab_head_has_no_mapping_and_rope_survives(tmp_path):
    cfg = dr.DraftConfig.from_target(
        TARGET, rope=RopeConfig(theta=5e5, kind="llama3", factor=8.0, original_max_position=64)
    )
    params = dr.init_params(cfg, jax.random.key(0))
    ef.save_draft(tmp_path / "full", params, cfg, vocab_lib.identity(V), dtype="float32")
    assert not {"d2t", "t2d", "embed_tokens.weight"} & set(
        read_safetensors(tmp_path / "full" / "model.safetensors")
    )
    p2, cfg2, voc2, embed = ef.load_draft(tmp_path / "full", TARGET)
    assert cfg2 == cfg and voc2.is_identity and embed is None
    jax.tree.map(np.testing.assert_array_equal, params, p2)


def test_orbax_round_trip(tmp_path):
    cfg = dr.DraftConfig.from_target(TARGET, draft_vocab_size=VD)
    params = dr.init_params(cfg, jax.random.key(1))
    save_orbax(tmp_path / "ckpt", params)
    back = restore_orbax(tmp_path / "ckpt", params)
    jax.tree.map(np.testing.assert_array_equal, params, back)


# ----------------------------------------------------------------------------- (c) refusals


def test_wrong_shapes_are_refused(tmp_path):
    bad_q = torch.zeros(NH * HD + 4, 2 * D)
    p = _write_official(tmp_path / "q", replace={"midlayer.self_attn.q_proj.weight": bad_q})
    with pytest.raises(Eagle3Error, match=r"q_proj.weight has shape \(68, 128\).*\(64, 128\)"):
        ef.load_draft(p, TARGET)
    p = _write_official(tmp_path / "miss", drop=["midlayer.hidden_norm.weight"])
    with pytest.raises(Eagle3Error, match="missing.*hidden_norm"):
        ef.load_draft(p, TARGET)
    p = _write_official(tmp_path / "arch", config=_hf_config(architectures=["MistralForCausalLM"]))
    with pytest.raises(Eagle3Error, match="architectures"):
        ef.load_draft(p, TARGET)
    params, cfg, voc, embed = ef.load_draft(_write_official(tmp_path / "ok"), TARGET)
    bad = {**params, "layer": {**params["layer"], "wq": params["layer"]["wq"][:, :8]}}
    with pytest.raises(Eagle3Error, match=r"layer.wq has shape \(128, 8\)"):
        dr.check_params(bad, cfg)
    with pytest.raises(Eagle3Error, match="feature width 50"):
        dr.forward(
            params,
            embed,
            jnp.zeros((1, 2), jnp.int32),
            jnp.zeros((1, 2, 50)),
            jnp.zeros((1, 2), jnp.int32),
            jnp.ones((1, 2, 2), bool),
            cfg,
        )
    with pytest.raises(Eagle3Error, match=r"embedding has shape \(97, 48\)"):
        dr.forward(
            params,
            jnp.zeros((V, HT)),
            jnp.zeros((1, 2), jnp.int32),
            jnp.zeros((1, 2, D)),
            jnp.zeros((1, 2), jnp.int32),
            jnp.ones((1, 2, 2), bool),
            cfg,
        )


def test_wrong_draft_vocab_size_is_refused(tmp_path):
    p = _write_official(tmp_path / "vd", config=_hf_config(draft_vocab_size=VD + 1))
    with pytest.raises(Eagle3Error, match=r"lm_head.weight has shape \(40, 64\).*\(41, 64\)"):
        ef.load_draft(p, TARGET)
    p = _write_official(tmp_path / "d2t", replace={"d2t": torch.zeros(VD + 3, dtype=torch.int64)})
    with pytest.raises(Eagle3Error, match=r"d2t has shape \(43,\) but draft_vocab_size is 40"):
        ef.load_draft(p, TARGET)
    p = _write_official(tmp_path / "nomap", drop=["d2t", "t2d"])
    with pytest.raises(Eagle3Error, match="no d2t/t2d mapping"):
        ef.load_draft(p, TARGET)


def test_mapping_inconsistent_with_target_is_refused(tmp_path):
    t2d = _torch_head().t2d.clone()
    t2d[int(np.flatnonzero(~t2d.numpy())[0])] = True  # one id too many
    p = _write_official(tmp_path / "t2d", replace={"t2d": t2d})
    with pytest.raises(Eagle3Error, match="t2d marks 41 target ids, expected 40"):
        ef.load_draft(p, TARGET)
    # Same size, different set (SpecForge#764): d2t says one thing, t2d another.
    moved = t2d.clone()
    moved[int(DRAFT_IDS[0])] = False
    p = _write_official(tmp_path / "moved", replace={"t2d": moved})
    with pytest.raises(Eagle3Error, match="t2d is not True at the target ids d2t names"):
        ef.load_draft(p, TARGET)
    d2t = _torch_head().d2t.clone()
    d2t[5] = d2t[4] - 1  # maps draft id 5 below draft id 4
    p = _write_official(tmp_path / "order", replace={"d2t": d2t})
    with pytest.raises(Eagle3Error, match="not strictly ascending"):
        ef.load_draft(p, TARGET)
    # The head itself is fine; the targets are not.
    params, cfg, voc, embed = ef.load_draft(_write_official(tmp_path / "ok"), TARGET)
    with pytest.raises(Eagle3Error, match="vocab_size 97 != the target's vocab size 101"):
        ef.check_compatible(cfg, voc, dataclasses.replace(TARGET, vocab_size=101), embed)
    with pytest.raises(Eagle3Error, match="target_hidden_size 48 != the target's hidden size 64"):
        ef.check_compatible(cfg, voc, dataclasses.replace(TARGET, hidden_size=64), embed)
    with pytest.raises(Eagle3Error, match=r"include \[4, 5\], outside the target's layers 0..3"):
        ef.check_compatible(cfg, voc, dataclasses.replace(TARGET, num_layers=4), embed)
    # id L from an official config: the last layer's output, before or after the final norm
    with pytest.raises(Eagle3Error, match="include 5, an official config's output .* ambiguous"):
        ef.check_compatible(cfg, voc, dataclasses.replace(TARGET, num_layers=5), embed)
    # a head of ours that read the final normed state runs on a target of its depth only
    normed = dataclasses.replace(cfg, final_norm_aux=True)
    ef.check_compatible(normed, voc, dataclasses.replace(TARGET, num_layers=5), embed)
    with pytest.raises(Eagle3Error, match="of a 5-layer target; this target has 8 layers"):
        ef.check_compatible(normed, voc, TARGET, embed)
    with pytest.raises(Eagle3Error, match="no embed_tokens.weight"):
        ef.check_compatible(cfg, voc, TARGET)
    with pytest.raises(Eagle3Error, match=r"t2d has shape \(97,\), expected \[101\]"):
        ef.check_compatible(
            dataclasses.replace(cfg, vocab_size=101),
            voc,
            dataclasses.replace(TARGET, vocab_size=101),
            embed,
        )


# ----------------------------------------------------------------------------- (d) full size


def test_llama31_8b_head_has_the_published_shapes():
    target = TargetConfig(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
    )
    cfg = dr.DraftConfig.from_target(target, draft_vocab_size=32000)
    assert cfg.aux_layer_ids == (2, 16, 29) and cfg.rope == RopeConfig(theta=10000.0)
    shapes = jax.eval_shape(
        functools.partial(dr.init_params, cfg, dtype=jnp.bfloat16), jax.random.key(0)
    )
    published = {  # PyTorch [out, in] shapes of the released Llama-3.1-8B EAGLE-3 head
        "fc.weight": (4096, 12288),
        "midlayer.self_attn.q_proj.weight": (4096, 8192),
        "midlayer.self_attn.k_proj.weight": (1024, 8192),
        "midlayer.self_attn.v_proj.weight": (1024, 8192),
        "midlayer.self_attn.o_proj.weight": (4096, 4096),
        "midlayer.mlp.gate_proj.weight": (14336, 4096),
        "midlayer.mlp.down_proj.weight": (4096, 14336),
        "lm_head.weight": (32000, 4096),
        "norm.weight": (4096,),
        "d2t": (32000,),
        "t2d": (128256,),
    }
    official = ef.official_shapes(cfg)
    for name, shape in published.items():
        assert official[name] == shape, name
    ours = {
        "fc": shapes["fc"].shape,
        "wq": shapes["layer"]["wq"].shape,
        "wk": shapes["layer"]["wk"].shape,
        "lm_head": shapes["lm_head"].shape,
    }
    assert ours == {
        "fc": (12288, 4096),
        "wq": (8192, 4096),
        "wk": (8192, 1024),
        "lm_head": (4096, 32000),
    }
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(shapes))
    out = jax.eval_shape(
        functools.partial(dr.forward, cfg=cfg),
        shapes,
        jax.ShapeDtypeStruct((128256, 4096), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, 5), jnp.int32),
        jax.ShapeDtypeStruct((1, 5, 12288), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, 5), jnp.int32),
        jax.ShapeDtypeStruct((1, 5, 5), jnp.bool_),
    )
    assert out.hidden.shape == (1, 5, 4096) and out.logits.shape == (1, 5, 32000)
    # fc + q + k,v + o + mlp + 4 norms + lm_head
    assert dr.num_params(shapes) == (
        12288 * 4096
        + 8192 * 4096
        + 2 * 8192 * 1024
        + 4096 * 4096
        + 3 * 4096 * 14336
        + 4 * 4096
        + 4096 * 32000
    )


# ----------------------------------------------------------------------------- (e) output layers


@pytest.mark.parametrize("tied", [True, False])
def test_output_init_from_target_reproduces_target_logits_on_the_draft_vocab(tied):
    from eagle3_jax.models import target as tg
    from eagle3_jax.models.layers import rms_norm

    tcfg = dataclasses.replace(TARGET, tie_word_embeddings=tied)
    tparams = tg.init_params(tcfg, jax.random.PRNGKey(0))
    tparams["final_norm"] = 1.0 + 0.3 * jax.random.normal(jax.random.PRNGKey(1), (HT,))
    dcfg = dr.DraftConfig.from_target(tcfg, draft_vocab_size=VD)
    counts = np.random.default_rng(0).integers(0, 50, V)
    voc = vocab_lib.build_from_counts(counts, VD)
    params = dr.init_params(dcfg, jax.random.PRNGKey(2))
    init = dr.init_output_from_target(params, tparams, tcfg, voc, dcfg)
    h = jax.random.normal(jax.random.PRNGKey(3), (2, 5, HT))
    want = tg.lm_head(tparams, rms_norm(h, tparams["final_norm"], tcfg.rms_norm_eps), tcfg)
    got = draft_output.head_logits(init, h, dcfg)
    np.testing.assert_allclose(got, want[..., vocab_lib.target_ids(voc)], rtol=1e-5, atol=1e-5)
    assert init["fc"] is params["fc"]  # everything else untouched
    small = dataclasses.replace(dcfg, hidden_size=HT // 2)
    with pytest.raises(Eagle3Error, match="hidden sizes differ"):
        dr.init_output_from_target(params, tparams, tcfg, voc, small)


def _target_head_setup(rank=0, candidates=2048):
    """A head of TARGET reading the target's output embedding (tied), SpecVocab when rank > 0."""
    from eagle3_jax.models import target as tg

    tcfg = dataclasses.replace(TARGET, tie_word_embeddings=True)
    tparams = tg.init_params(tcfg, jax.random.PRNGKey(0))
    kw = dict(lm_head_source="target", speculator_rank=rank)
    if rank:
        kw["spec_candidates"] = candidates
    dcfg = dr.DraftConfig.from_target(tcfg, **kw)
    params = dr.init_params(dcfg, jax.random.PRNGKey(1), scale=0.3)
    return tcfg, tparams, dcfg, draft_output.attach_target_head(params, dcfg, tparams, tcfg)


def test_target_lm_head_reads_the_target_output_embedding():
    from eagle3_jax.models import target as tg
    from eagle3_jax.models.layers import rms_norm

    tcfg, tparams, dcfg, params = _target_head_setup()
    assert "lm_head" not in params and params["out_embed"] is tparams["embed"]  # shared, no copy
    h = jax.random.normal(jax.random.PRNGKey(2), (2, 3, HT))
    want = tg.lm_head(tparams, rms_norm(h, params["final_norm"], dcfg.rms_norm_eps), tcfg)
    np.testing.assert_allclose(
        draft_output.head_logits(params, h, dcfg), want, rtol=1e-5, atol=1e-5
    )
    bare = {k: v for k, v in params.items() if k != "out_embed"}
    with pytest.raises(Eagle3Error, match="attach it first"):
        draft_output.head_logits(bare, h, dcfg)


@pytest.mark.parametrize("row_products", [0, 8], ids=["plain-products", "row-products"])
@pytest.mark.parametrize("source", ["own", "target", "specvocab"])
def test_bf16_head_logits_are_fp32(source, row_products):
    """bf16 parameters give fp32 draft logits, the fp32 product of the bf16 inputs (as the
    target's), through either product policy (a few rows as one product, or one per row and, for
    heads that read the target's output layer, a row reduction): the draft's
    top-k and the tree's cumulative scores rank by them, and bf16 logits tie often (a one-step
    rounding at a logit of 16-32 is 0.125). SpecVocab's exact logits over its candidates too.
    `out_dtype=None` (training's choice) keeps the parameters' dtype."""
    from eagle3_jax.models.layers import rms_norm

    if source == "own":
        dcfg = dr.DraftConfig.from_target(TARGET, draft_vocab_size=VD)
        params = dr.init_params(dcfg, jax.random.PRNGKey(1), scale=0.3)
        voc = vocab_lib.build_from_counts(np.random.default_rng(0).integers(0, 50, V), VD)
    else:  # every token a SpecVocab candidate: its exact logits are the full head's
        _, _, dcfg, params = _target_head_setup(
            rank=HT // 8 if source == "specvocab" else 0, candidates=V
        )
        voc = vocab_lib.identity(V)
    dcfg = dataclasses.replace(dcfg, products=ProductPolicy(row_products, row_products))
    bf16 = jnp.bfloat16
    params = jax.tree.map(lambda x: x.astype(bf16), params)
    h = jax.random.normal(jax.random.PRNGKey(2), (2, 3, HT), bf16)
    normed = np.asarray(rms_norm(h, params["final_norm"], dcfg.rms_norm_eps), np.float64)
    w = params["lm_head"] if source == "own" else params["out_embed"].T
    want = normed @ np.asarray(w, np.float64)  # [2, 3, Vd]: the exact product of bf16 inputs
    if source != "specvocab":
        got = draft_output.head_logits(params, h, dcfg)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
        one = draft_output.head_logits(params, h[:1, :1], dcfg)  # one row: the vector product
        np.testing.assert_allclose(np.asarray(one), want[:1, :1], rtol=1e-5, atol=1e-5)
        assert draft_output.head_logits(params, h, dcfg, out_dtype=None).dtype == bf16
    score, _ = draft_output.draft_topk(params, h, dcfg, voc, 4)
    lp = want - want.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    np.testing.assert_allclose(
        np.asarray(score), -np.sort(-lp, axis=-1)[..., :4], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("source", ["own", "target"])
def test_product_policies_compute_the_same_draft_step(source):
    """A tree level's few rows through the head (fc, midlayer, output layer) with row products and
    the row reduction (policy 8/8) and with plain products: the same hidden states and logits
    within fp32 rounding, the same top tokens and cache entries."""
    from eagle3_jax.models.layers import causal_mask

    if source == "own":
        dcfg = dr.DraftConfig.from_target(TARGET, draft_vocab_size=VD)
        params = dr.init_params(dcfg, jax.random.PRNGKey(1), scale=0.3)
    else:
        _, _, dcfg, params = _target_head_setup()
    b, t, s = 2, 4, 8
    embed = jax.random.normal(jax.random.PRNGKey(3), (V, dcfg.hidden_size))
    toks = jax.random.randint(jax.random.PRNGKey(4), (b, t), 0, V)
    feat = jax.random.normal(jax.random.PRNGKey(5), (b, t, dcfg.feature_size))
    start = jnp.full((b,), 2, jnp.int32)
    pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    cache = dr.make_cache(dcfg, b, s)

    @functools.partial(jax.jit, static_argnames="cfg")
    def step(params, embed, toks, feat, pos, cache, start, cfg):
        mask = causal_mask(start, t, s)
        return dr.forward(params, embed, toks, feat, pos, mask, cfg, cache, start)

    cfgs = {k: dataclasses.replace(dcfg, products=ProductPolicy(k, k)) for k in (0, 8)}
    outs = {k: step(params, embed, toks, feat, pos, cache, start, c) for k, c in cfgs.items()}
    # hidden states reach ~12: fp32 sums of 64 such products round to ~1e-5 apart in either
    # order (LLVM -O0, the tests' level, rounds the row products' loops differently from -O2)
    np.testing.assert_allclose(outs[8].hidden, outs[0].hidden, rtol=1e-5, atol=3e-5)
    np.testing.assert_allclose(outs[8].logits, outs[0].logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(outs[8].logits.argmax(-1), outs[0].logits.argmax(-1))
    for a, b_ in zip(jax.tree.leaves(outs[8].cache), jax.tree.leaves(outs[0].cache)):
        np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_speculator_svd_init_is_the_best_rank_r_approximation_of_the_target_logits(tied):
    """(h A) B after the SVD init equals h times the truncated-SVD output embedding (numpy's), and
    its error is Eckart-Young's: the norm of the dropped singular values."""
    from eagle3_jax.models import target as tg

    r = 4
    tcfg = dataclasses.replace(TARGET, tie_word_embeddings=tied)
    tparams = tg.init_params(tcfg, jax.random.PRNGKey(0))
    dcfg = dr.DraftConfig.from_target(
        tcfg, lm_head_source="target", speculator_rank=r, spec_candidates=8
    )
    params = dr.init_speculator_svd(
        dr.init_params(dcfg, jax.random.PRNGKey(1)), tparams, tcfg, dcfg
    )
    out = np.asarray(tparams["embed"] if tied else tparams["lm_head"].T, np.float64)  # [V, D]
    u, s, vt = np.linalg.svd(out, full_matrices=False)
    best = (u[:, :r] * s[:r]) @ vt[:r]  # [V, D]
    h = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (5, HT)), np.float64)
    got = np.asarray(
        draft_output.speculator_logits(params, jnp.asarray(h, jnp.float32)), np.float64
    )
    np.testing.assert_allclose(got, h @ best.T, rtol=1e-4, atol=1e-4)
    ab = np.asarray(params["spec_a"], np.float64) @ np.asarray(params["spec_b"], np.float64)
    np.testing.assert_allclose(np.linalg.norm(ab.T - out), np.sqrt((s[r:] ** 2).sum()), rtol=1e-4)
    plain = dr.DraftConfig.from_target(tcfg)
    with pytest.raises(Eagle3Error, match="no speculator"):
        dr.init_speculator_svd(dr.init_params(plain, jax.random.PRNGKey(1)), tparams, tcfg, plain)


@pytest.mark.parametrize("k_cand", [V, 16])
def test_specvocab_topk_is_the_exact_topk_among_the_speculator_candidates(k_cand):
    from eagle3_jax.models.layers import rms_norm

    tcfg, tparams, dcfg, params = _target_head_setup(rank=HT // 8, candidates=k_cand)
    assert params["spec_a"].shape == (HT, HT // 8) and params["spec_b"].shape == (HT // 8, V)
    h = jax.random.normal(jax.random.PRNGKey(3), (2, 3, HT))
    score, ids = draft_output.draft_topk(params, h, dcfg, vocab_lib.identity(V), 4)
    # reference in numpy: candidates = top-K of (h A) B, then log-softmax of exact logits over them
    normed = np.asarray(rms_norm(h, params["final_norm"], dcfg.rms_norm_eps), np.float64)
    approx = normed @ np.asarray(params["spec_a"]) @ np.asarray(params["spec_b"])
    exact = normed @ np.asarray(tparams["embed"], np.float64).T  # [2, 3, V]
    for idx in np.ndindex(2, 3):
        cand = np.argsort(-approx[idx], kind="stable")[:k_cand]
        z = exact[idx][cand]
        lp = z - z.max() - np.log(np.exp(z - z.max()).sum())
        top = np.argsort(-lp, kind="stable")[:4]
        assert ids[idx].tolist() == cand[top].tolist()
        np.testing.assert_allclose(score[idx], lp[top], rtol=1e-4, atol=1e-4)
    if k_cand == V:  # every token a candidate: the full-vocabulary head's choice
        full = jax.lax.top_k(jax.nn.log_softmax(draft_output.head_logits(params, h, dcfg)), 4)
        assert (np.asarray(full[1]) == np.asarray(ids)).all()


def test_specvocab_sibling_rows_share_one_candidate_gather():
    """A tree level's sibling rows [B, R, D]: the deduplicated gather (candidates that fit the
    union capacity) and the per-row fallback (candidates that do not) give the per-row gather's
    logits, hence the same top-k ids and scores as draft_topk always gave."""
    tcfg, tparams, dcfg, params = _target_head_setup(rank=HT // 8, candidates=16)
    embed = params["out_embed"]
    b, r, k = 2, 8, 16
    assert draft_output.union_capacity(r, k, V) == 64 < r * k
    assert draft_output.union_capacity(2, k, V) == 2 * k  # no saving: per-row gather
    assert draft_output.union_capacity(1, 2048, 49152) == 2048
    assert draft_output.union_capacity(10, 2048, 49152) == 8896
    normed = jax.random.normal(jax.random.PRNGKey(4), (b, r, HT))
    rng = np.random.default_rng(0)
    # siblings sharing most candidates (the union fits) and random sets (it does not)
    pool = rng.permutation(V)[:24]
    near = np.stack([[rng.choice(pool, k, replace=False) for _ in range(r)] for _ in range(b)])
    spread = np.stack([[rng.choice(V, k, replace=False) for _ in range(r)] for _ in range(b)])
    assert len(np.unique(spread[0])) > 64 >= len(np.unique(near[0]))
    for cand in (near, spread):
        cand = jnp.asarray(cand, jnp.int32)
        want = np.asarray(normed)[:, :, None, :] @ np.asarray(embed)[np.asarray(cand)].swapaxes(
            -1, -2
        )
        got = jax.jit(draft_output.candidate_logits)(normed, cand, embed)
        np.testing.assert_allclose(np.asarray(got), want[:, :, 0], rtol=1e-5, atol=1e-5)
    # through draft_topk: a level of 8 siblings equals each row drafted alone
    h = jax.random.normal(jax.random.PRNGKey(5), (b, r, HT)) * 0.1 + jax.random.normal(
        jax.random.PRNGKey(6), (b, 1, HT)
    )
    voc = vocab_lib.identity(V)
    score, ids = jax.jit(draft_output.draft_topk, static_argnums=(2, 4))(params, h, dcfg, voc, 4)
    for i in range(r):
        s1, i1 = draft_output.draft_topk(params, h[:, i : i + 1], dcfg, voc, 4)
        assert (np.asarray(i1[:, 0]) == np.asarray(ids[:, i])).all()
        np.testing.assert_allclose(np.asarray(s1[:, 0]), np.asarray(score[:, i]), atol=1e-5)


def test_target_and_specvocab_heads_round_trip(tmp_path):
    for rank in (0, HT // 8):
        tcfg, tparams, dcfg, params = _target_head_setup(rank=rank, candidates=32)
        d = tmp_path / f"r{rank}"
        ef.save_draft(d, params, dcfg, vocab_lib.identity(V), dtype="float32")
        hf = json.loads((d / "config.json").read_text())
        names = set(read_safetensors(d / "model.safetensors"))
        assert "lm_head.weight" not in names
        assert ("speculator.up_proj.weight" in names) == bool(rank)
        ext = hf["eagle3_jax"]
        assert ext["lm_head_source"] == "target" and ext.get("speculator_rank", 0) == rank
        p2, c2, v2, _ = ef.load_draft(d, tcfg)
        assert c2 == dcfg and v2.is_identity and "out_embed" not in p2
        bare = {k: v for k, v in params.items() if k != "out_embed"}
        jax.tree.map(np.testing.assert_array_equal, p2, bare)
    # a plain head's config.json carries no extension block (it stays the official format)
    plain_cfg = dr.DraftConfig.from_target(TARGET, draft_vocab_size=VD)
    assert "eagle3_jax" not in draft_config_to_hf(plain_cfg)


def test_output_layer_configs_are_validated():
    with pytest.raises(Eagle3Error, match="full vocabulary"):
        dr.DraftConfig.from_target(TARGET, lm_head_source="target", draft_vocab_size=VD)
    with pytest.raises(Eagle3Error, match="SpecVocab needs"):
        dr.DraftConfig.from_target(TARGET, speculator_rank=4)
    with pytest.raises(Eagle3Error, match="spec_candidates"):
        dr.DraftConfig.from_target(
            TARGET, lm_head_source="target", speculator_rank=4, spec_candidates=V + 1
        )
    with pytest.raises(Eagle3Error, match="own or target"):
        dr.DraftConfig.from_target(TARGET, lm_head_source="tied")


def test_flax_module_computes_the_functional_head():
    """models.flax_head.DraftHead holds the same params as nnx.Param leaves and calls
    draft.forward: the same hidden states and logits, its params round-trip through nnx.split /
    nnx.merge, and nnx.grad differentiates it like jax.grad the functional head."""
    from flax import nnx

    from eagle3_jax.models.flax_head import DraftHead
    from eagle3_jax.models.layers import causal_mask

    dcfg = dr.DraftConfig.from_target(TARGET, draft_vocab_size=VD)
    params = dr.init_params(dcfg, jax.random.PRNGKey(1), scale=0.3)
    head = DraftHead(dcfg, params)
    b, t = 2, 5
    embed = jax.random.normal(jax.random.PRNGKey(3), (V, dcfg.hidden_size))
    toks = jax.random.randint(jax.random.PRNGKey(4), (b, t), 0, V)
    feat = jax.random.normal(jax.random.PRNGKey(5), (b, t, dcfg.feature_size))
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = causal_mask(jnp.zeros((b,), jnp.int32), t, t)
    want = dr.forward(params, embed, toks, feat, pos, mask, dcfg)
    got = head(embed, toks, feat, pos, mask)
    np.testing.assert_array_equal(got.logits, want.logits)
    np.testing.assert_array_equal(got.hidden, want.hidden)
    graph, state = nnx.split(head)
    again = nnx.merge(graph, state)
    for a, b_ in zip(jax.tree.leaves(again.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b_)

    def loss_of(p):
        return dr.forward(p, embed, toks, feat, pos, mask, dcfg).logits.sum()

    g_fn = jax.grad(loss_of)(params)
    g_nnx = nnx.grad(lambda m: m(embed, toks, feat, pos, mask).logits.sum())(head)
    for a, b_ in zip(jax.tree.leaves(g_nnx), jax.tree.leaves(g_fn)):
        np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-5)
    fresh = DraftHead(dcfg, rngs=nnx.Rngs(params=0))
    dr.check_params(fresh.params, dcfg)
