"""sharding.py, the one place that knows the mesh: --mesh parsing, the (data, model) mesh, the
logical-axis rules (a dimension that does not divide its mesh axis is replicated), batches placed
over data; and sharded == unsharded: the target's forward, speculative decoding with its caches on
the mesh, the training loss and gradients (8 simulated CPU devices, conftest)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TREE, random_prompts, spec_generate, spec_prefill
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.checkpoints.hf import load_hf
from eagle3_jax.decoding import plain
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf
from eagle3_jax.models import target as tgt
from eagle3_jax.sharding import (
    Rules,
    make_mesh,
    mesh_of,
    named,
    parse_mesh,
    put_batch,
    replicated,
    spec_for,
)
from eagle3_jax.training.config import TrainConfig
from eagle3_jax.training.step import batch_sharding, loss_fn

# ---- the mesh, the rules, the batch


def test_parse_mesh_and_make_mesh():
    """--mesh DATAxMODEL over the visible devices; none for "" or None; one line for the rest."""
    assert jax.device_count() >= 8, "tests expect 8 simulated devices (conftest's XLA_FLAGS)"
    assert parse_mesh(None) is None and parse_mesh("") is None
    mesh = parse_mesh("2x4")
    assert mesh.axis_names == ("data", "model") and dict(mesh.shape) == {"data": 2, "model": 4}
    assert dict(parse_mesh("1X8").shape) == {"data": 1, "model": 8}
    for text, msg in [
        ("2x", "give DATAxMODEL"),
        ("axb", "give DATAxMODEL"),
        ("0x8", "both sizes must be >= 1"),
        ("3x3", "needs 9 devices; 8 are visible"),
    ]:
        with pytest.raises(Eagle3Error, match=msg):
            parse_mesh(text)
    assert dict(make_mesh(2).shape) == {"data": 2, "model": 4}  # model: the devices left
    two = make_mesh(1, 2, devices=jax.devices()[2:4])
    assert list(two.devices.flat) == jax.devices()[2:4]
    with pytest.raises(Eagle3Error, match="mesh 4x4 needs 16 devices, 8 present"):
        make_mesh(4, 4)


def test_rules_split_what_divides_and_replicate_the_rest():
    """Logical axes map to mesh axes (batch over data, heads/mlp/vocab over model, embed
    replicated); a dimension its mesh axis does not divide is replicated, not refused."""
    mesh = make_mesh(2, 4)
    rules = Rules()
    assert spec_for(("embed", "mlp"), (64, 96), mesh, rules) == P(None, "model")
    assert spec_for(("embed", "mlp"), (64, 90), mesh, rules) == P(None, None)  # 90 % 4 != 0
    assert spec_for(("batch", None), (6, 3), mesh, rules) == P("data", None)
    assert spec_for(("batch", None), (3, 3), mesh, rules) == P(None, None)
    assert spec_for(("vocab", "embed"), (96, 64), mesh, Rules(vocab=None)) == P(None, None)
    assert named(mesh, ("heads",), (8,)) == NamedSharding(mesh, P("model"))
    assert replicated(mesh) == NamedSharding(mesh, P())


def test_put_batch_places_rows_over_data():
    """Rows over `data` where the batch divides it (each device holds its rows), replicated where
    it does not; the values are the host's; no mesh leaves the arrays alone."""
    mesh = make_mesh(2, 4)
    rows = np.arange(4 * 3, dtype=np.int32).reshape(4, 3)
    odd = np.ones((3, 5), np.float32)
    assert put_batch(None, rows, odd) == (rows, odd)
    a, b = put_batch(mesh, rows, odd)
    assert a.sharding.spec == P("data", None) and b.sharding.spec == P(None, None)
    assert a.dtype == rows.dtype and b.dtype == odd.dtype
    assert {s.data.shape for s in a.addressable_shards} == {(2, 3)}
    np.testing.assert_array_equal(a, rows)
    np.testing.assert_array_equal(b, odd)
    assert mesh_of(a) == mesh and mesh_of(rows) is None


# ---- sharded == unsharded


@pytest.mark.parametrize("data,model", [(1, 8), (2, 4)])
def test_loading_onto_a_mesh_gives_the_same_logits(data, model, hf_checkpoint):
    assert jax.device_count() >= 8, (
        "tests expect XLA_FLAGS=--xla_force_host_platform_device_count=8"
    )
    _, path = hf_checkpoint("qwen2")
    params, cfg = load_hf(path)
    mesh = make_mesh(data, model)
    sharded, _ = load_hf(path, mesh=mesh)
    wq = sharded["layers"][0]["wq"]
    assert (
        len(wq.sharding.device_set) == 8 and wq.addressable_shards[0].data.shape[1] == 64 // model
    )
    toks = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 16)), jnp.int32)
    ref = tgt.full_forward(params, toks, cfg, (2, 3))
    out = tgt.full_forward(sharded, toks, cfg, (2, 3))  # shardings travel with the arrays
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.aux), np.asarray(ref.aux), rtol=1e-5, atol=1e-5)


def test_sharded_target_gives_the_same_tokens(spec_setup, hf_checkpoint):
    """Target tensor-parallel over 8 simulated devices (draft replicated): same tokens as one device."""
    params, cfg, dparams, dcfg, vocab = spec_setup
    _, path = hf_checkpoint("llama")
    mesh = make_mesh(1, 8)
    sharded, _ = load_hf(path, mesh=mesh)
    assert len(sharded["layers"][0]["w_gate"].sharding.device_set) == 8
    dsharded = jax.device_put(dparams, replicated(mesh))
    prompts = random_prompts(cfg.vocab_size, [6, 11], seed=4)
    ref = spec_generate(params, cfg, dparams, dcfg, vocab, prompts, 24, TREE, eos_ids=())
    out = spec_generate(sharded, cfg, dsharded, dcfg, vocab, prompts, 24, TREE, eos_ids=())
    assert out.output_ids == ref.output_ids


def test_specvocab_on_a_sharded_target_gives_the_same_tokens(spec_setup, hf_checkpoint):
    """A SpecVocab head reading the sharded target's output embedding, at a tree whose levels
    share one candidate gather (draft_output.candidate_logits), two prompts over the data axis:
    the same tokens as one device."""
    from eagle3_jax.decoding.tree import TreeConfig
    from eagle3_jax.models import draft_output
    from eagle3_jax.vocab import identity

    params, cfg, *_ = spec_setup
    _, path = hf_checkpoint("llama")
    mesh = make_mesh(2, 4)
    sharded, _ = load_hf(path, mesh=mesh)
    dcfg = drf.DraftConfig.from_target(
        cfg, lm_head_source="target", speculator_rank=4, spec_candidates=12
    )
    dparams = drf.init_params(dcfg, jax.random.PRNGKey(5), scale=0.2)
    wide = TreeConfig(top_k=6, depth=3, total_tokens=16)
    assert draft_output.union_capacity(6, 12, cfg.vocab_size) < 6 * 12
    voc, prompts = identity(cfg.vocab_size), random_prompts(cfg.vocab_size, [6, 11], seed=4)
    ref = spec_generate(
        params, cfg, draft_output.attach_target_head(dparams, dcfg, params, cfg), dcfg, voc,
        prompts, 24, wide, eos_ids=(),
    )  # fmt: skip
    dsharded = draft_output.attach_target_head(
        jax.device_put(dparams, replicated(mesh)), dcfg, sharded, cfg
    )
    out = spec_generate(sharded, cfg, dsharded, dcfg, voc, prompts, 24, wide, eos_ids=())
    assert out.output_ids == ref.output_ids


def test_caches_are_laid_out_on_the_target_mesh(spec_setup, hf_checkpoint):
    """On a mesh whose model axis divides the kv heads, the target's cache is split over it (batch
    over data) from prefill on (left to propagation it was replicated), and the tokens are those
    of one device."""
    params, cfg, dparams, dcfg, vocab = spec_setup
    _, path = hf_checkpoint("llama")
    mesh = make_mesh(1, 2, devices=jax.devices()[:2])
    assert cfg.num_kv_heads % 2 == 0 and dcfg.num_kv_heads % 2 == 0
    sharded, _ = load_hf(path, mesh=mesh)
    assert mesh_of(sharded) == mesh and mesh_of(params) is None
    other = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))  # axes Rules cannot map
    assert mesh_of(jax.device_put(params, NamedSharding(other, P()))) is None
    dsharded = jax.device_put(dparams, replicated(mesh))
    prompts = random_prompts(cfg.vocab_size, [7, 12], seed=6)
    state, _ = spec_prefill((sharded, cfg, dsharded, dcfg, vocab), prompts, 16, TREE, mesh=mesh)
    want = NamedSharding(mesh, P("data", "model", None, None))
    for cache in state.tcache["k"] + state.tcache["v"]:
        assert cache.sharding.is_equivalent_to(want, 4), cache.sharding
    ref = spec_generate(params, cfg, dparams, dcfg, vocab, prompts, 16, TREE, eos_ids=())
    out = spec_generate(sharded, cfg, dsharded, dcfg, vocab, prompts, 16, TREE, eos_ids=())
    assert out.output_ids == ref.output_ids
    assert plain.generate(sharded, cfg, prompts, 16, eos_ids=()).output_ids == ref.output_ids


def test_sharded_loss_and_gradients_equal_single_device(tiny_target_dir):
    """Loss and gradients on a 2 x 4 mesh (batch over data, matrices over model) equal one device."""
    mesh = make_mesh(2, 4)
    params, cfg = load_hf(tiny_target_dir)
    sharded, _ = load_hf(tiny_target_dir, mesh=mesh)
    dcfg = drf.DraftConfig.from_target(cfg)
    dparams = drf.init_params(dcfg, jax.random.PRNGKey(0), scale=0.1)
    dsharded = jax.tree.map(jax.device_put, dparams, drf.param_shardings(dcfg, mesh))
    rng = np.random.default_rng(0)
    lengths = np.array([20, 13, 24, 7])
    batch = {
        "input_ids": rng.integers(3, 97, (4, 24)).astype(np.int32),
        "loss_mask": (rng.random((4, 24)) < 0.6).astype(np.float32),
        "attention_mask": (np.arange(24)[None] < lengths[:, None]).astype(np.int32),
    }
    t2d = jnp.ones((cfg.vocab_size,), bool)
    tc = TrainConfig().replace(ttt_steps=3)
    grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=(4, 5, 6))
    (l1, _), g1 = grad(dparams, params, batch, t2d, cfg, dcfg, tc)
    sb = jax.tree.map(lambda x: jax.device_put(x, batch_sharding(mesh)), batch)
    (l8, _), g8 = grad(dsharded, sharded, sb, t2d, cfg, dcfg, tc)
    assert len(g8["fc"].sharding.device_set) == 8
    np.testing.assert_allclose(float(l8), float(l1), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
