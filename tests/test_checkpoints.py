"""Loaders: mesh placement, our converted format, and clear errors for bad checkpoints."""

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
from eagle3_jax.sharding import make_mesh


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
