"""The decoding paths chosen by backend for fewer, larger kernels (issue 58, eagle3_jax/backends.py),
each against the path it replaces: the draft's top-k without a written-out log-softmax, q/k/v and
gate/up fused at load (alone, on a mesh, and under speculative decoding), mixed-precision attention
and the Pallas flash-decoding kernel (interpreted on the CPU), the XLA flags."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.models.draft_output import topk_log_probs


def test_topk_log_probs_equals_top_k_of_log_softmax():
    """Scores bit for bit, ids equal where no two logits round to one log-probability."""
    x = 6 * jax.random.normal(jax.random.PRNGKey(0), (3, 5, 2000), jnp.float32)
    for k in (1, 4, 10):
        got_s, got_i = topk_log_probs(x, k)
        want_s, want_i = jax.lax.top_k(jax.nn.log_softmax(x, axis=-1), k)
        np.testing.assert_array_equal(got_s, want_s)
        np.testing.assert_array_equal(got_i, want_i)


FAMILIES = ("llama", "qwen2", "qwen3", "olmo2")


def test_fused_projections_give_the_unfused_forward(hf_checkpoint):
    """q/k/v and gate/up fused at load: logits, hidden and aux states of a cached prefill plus a
    decode step equal the unfused model's (fp32; the same products, in one matrix) for every
    family's layout (biases, per-head and full q/k norms, post-norm), unrolled, and stacked. The
    unfused matrices are deleted as the fused ones are made."""
    from eagle3_jax.checkpoints.hf import load_hf
    from eagle3_jax.models import target as tgt
    from eagle3_jax.models.layers import causal_mask

    for fam in FAMILIES:
        params, cfg = load_hf(hf_checkpoint(fam)[1])
        for stacked in (False, True) if fam == "llama" else (False,):
            p = tgt.stack_layers(params) if stacked else params
            copy = jax.tree.map(jnp.copy, p)
            fused = tgt.fuse_projections(copy, cfg)
            gone = copy["layers"]["wq"] if stacked else copy["layers"][0]["wq"]
            assert gone.is_deleted()
            first = fused["layers"] if stacked else fused["layers"][0]
            assert {"wqkv", "w_gate_up"} <= set(first) and "wq" not in first
            tgt.check_params(fused, cfg)
            toks = jnp.asarray([[5, 9, 2, 7, 11, 3]], jnp.int32)
            outs = []
            for pp in (p, fused):
                cache = tgt.make_cache(cfg, 1, 16, stacked=stacked)
                zero = jnp.zeros((1,), jnp.int32)
                pos = jnp.arange(5, dtype=jnp.int32)[None]
                o1 = tgt.forward(pp, toks[:, :5], pos, causal_mask(zero, 5, 16), cfg, cache, zero,
                                 aux_ids=(1, 2))  # fmt: skip
                five = jnp.full((1,), 5, jnp.int32)
                o2 = tgt.forward(pp, toks[:, 5:], pos[:, :1] + 5, causal_mask(five, 1, 16), cfg,
                                 o1.cache, five, aux_ids=(1, 2))  # fmt: skip
                outs.append((o1.logits, o1.aux, o2.logits, o2.hidden, o2.cache["k"][1]))
            for a, b in zip(*outs):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{fam} {stacked}")


def test_speculative_decoding_on_fused_projections_is_plain_greedy(spec_setup, hf_checkpoint):
    """The target fused as an accelerator decodes it (`backends.prepare_target`, forced on the
    CPU): greedy speculative output is token for token plain decoding of the unfused target, on
    one device and tensor parallel over 2 (q/k/v and gate/up fused: 2 kv heads, 96 units) and 4
    simulated devices (gate/up only: 2 kv heads do not split 4 ways, so q/k/v stay unfused)."""
    from helpers import TREE, random_prompts, spec_generate

    from eagle3_jax.backends import prepare_target
    from eagle3_jax.checkpoints import Target
    from eagle3_jax.checkpoints.hf import load_hf
    from eagle3_jax.sharding import make_mesh, replicated

    params, cfg, dparams, dcfg, vocab = spec_setup
    prompts = random_prompts(cfg.vocab_size, [6, 11], seed=4)
    ref = spec_generate(params, cfg, None, None, None, prompts, 24, TREE, method="vanilla",
                        eos_ids=())  # fmt: skip
    for model in (None, 2, 4):
        mesh = None if model is None else make_mesh(8 // model, model)
        loaded, _ = load_hf(hf_checkpoint("llama")[1], mesh=mesh)
        target = prepare_target(Target(loaded, cfg, None, None), backend="gpu", mesh=mesh)
        lp = target.params["layers"][0]
        assert ("wqkv" in lp) == (model != 4) and "w_gate_up" in lp
        if model is not None:
            width = lp["w_gate_up"].addressable_shards[0].data.shape[1]
            assert width == 2 * cfg.intermediate_size // model  # each device its own units
        d = dparams if mesh is None else jax.device_put(dparams, replicated(mesh))
        out = spec_generate(target.params, cfg, d, dcfg, vocab, prompts, 24, TREE, eos_ids=())
        assert out.output_ids == ref.output_ids, model


def test_the_backend_decides_fusion_unless_the_environment_does(monkeypatch):
    import pytest

    from eagle3_jax import backends
    from eagle3_jax.errors import Eagle3Error

    monkeypatch.delenv(backends.FUSED_ENV, raising=False)
    assert backends.fuse_projections_wanted("gpu") and backends.fuse_projections_wanted("tpu")
    assert not backends.fuse_projections_wanted("cpu")
    monkeypatch.setenv(backends.FUSED_ENV, "0")
    assert not backends.fuse_projections_wanted("gpu")
    monkeypatch.setenv(backends.FUSED_ENV, "1")
    assert backends.fuse_projections_wanted("cpu")
    monkeypatch.setenv(backends.FUSED_ENV, "yes")
    with pytest.raises(Eagle3Error, match="EAGLE3_JAX_FUSED_PROJECTIONS"):
        backends.fuse_projections_wanted("gpu")


def test_xla_flags_are_added_unless_the_user_set_them():
    from eagle3_jax import backends

    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    flags = backends.set_xla_flags(env)
    assert env["XLA_FLAGS"] == flags and flags.split() == [
        "--xla_force_host_platform_device_count=8",
        f"--xla_gpu_enable_command_buffer={backends.GPU_COMMAND_BUFFER}",
    ]
    assert backends.set_xla_flags(env) == flags  # once only
    mine = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}  # the user's choice wins
    assert backends.set_xla_flags(mine) == "--xla_gpu_enable_command_buffer="
    off = {backends.XLA_DEFAULTS_ENV: "0"}
    assert backends.set_xla_flags(off) == "" and "XLA_FLAGS" not in off


def _attention_inputs(seed, b=2, t=5, s=12, u=5, h=4, g=2, k=8, dtype=jnp.float32):
    from eagle3_jax.models.layers import kv_shapes

    rng = np.random.default_rng(seed)
    ks, vs = kv_shapes(b, s, g, k)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    mask = jnp.asarray(rng.random((b, t, s)) < 0.6).at[:, :, 0].set(True)
    tri = jnp.tril(jnp.ones((u, u), bool))
    mask_new = jnp.broadcast_to(tri | jnp.asarray(rng.random((u, u)) < 0.3), (b, u, u))
    return arr(b, t, h, k), arr(*ks), arr(*vs), mask, arr(b, u, g, k), arr(b, u, g, k), mask_new


def test_mixed_attention_equals_the_exact_path():
    """The flash-style path (products in the cache's dtype, fp32 accumulation, a verification's
    cached and new parts merged by their log-sum-exp) gives exact attention's output: to fp32
    rounding with fp32 inputs (one query, several, and a verification with new entries), and to
    bf16's with bf16 ones."""
    from eagle3_jax.models.layers import attention, mixed_attention

    q, kc, vc, mask, kn, vn, mask_new = _attention_inputs(0)
    for t in (1, 5):
        got = mixed_attention(q[:, :t], kc, vc, mask[:, :t])
        np.testing.assert_allclose(got, attention(q[:, :t], kc, vc, mask[:, :t]), atol=2e-6)
    got = mixed_attention(q, kc, vc, mask, kn, vn, mask_new)
    want = attention(q, kc, vc, mask, kn, vn, mask_new)
    np.testing.assert_allclose(got, want, atol=2e-6)
    assert jnp.array_equal(attention(q, kc, vc, mask, kn, vn, mask_new, kind="mixed"), got)
    bf = _attention_inputs(0, dtype=jnp.bfloat16)
    got = mixed_attention(*bf).astype(jnp.float32)
    want = attention(*bf).astype(jnp.float32)
    np.testing.assert_allclose(got, want, atol=3e-2)


def test_speculative_decoding_with_mixed_attention_is_plain_greedy(spec_setup):
    """fp32 weights with the mixed path forced (`TargetConfig.attention`, as EAGLE3_JAX_ATTENTION
    does): greedy speculative output equals plain decoding with it, which equals plain decoding
    with exact attention."""
    import dataclasses

    from helpers import TREE, random_prompts, spec_generate

    params, cfg, dparams, dcfg, vocab = spec_setup
    mixed = dataclasses.replace(cfg, attention="mixed")
    prompts = random_prompts(cfg.vocab_size, [7, 12], seed=5)
    plain_kw = dict(method="vanilla", eos_ids=())
    ref = spec_generate(params, cfg, None, None, None, prompts, 24, TREE, **plain_kw)
    plain = spec_generate(params, mixed, None, None, None, prompts, 24, TREE, **plain_kw)
    out = spec_generate(params, mixed, dparams, dcfg, vocab, prompts, 24, TREE, eos_ids=())
    assert plain.output_ids == ref.output_ids
    assert out.output_ids == ref.output_ids


def test_the_backend_and_dtype_decide_attention_unless_the_environment_does(monkeypatch):
    import pytest

    from eagle3_jax import backends
    from eagle3_jax.errors import Eagle3Error

    monkeypatch.delenv(backends.ATTENTION_ENV, raising=False)
    assert backends.attention_wanted(jnp.bfloat16, "gpu") == "pallas"
    assert backends.attention_wanted(jnp.bfloat16, "tpu") == "mixed"  # no Triton kernel there
    assert backends.attention_wanted(jnp.bfloat16, "gpu", devices=2) == "mixed"  # unpartitioned
    assert backends.attention_wanted(jnp.float32, "gpu") == "exact"  # fp32: exactness runs
    assert backends.attention_wanted(jnp.bfloat16, "cpu") == "exact"
    monkeypatch.setenv(backends.ATTENTION_ENV, "mixed")
    assert backends.attention_wanted(jnp.float32, "cpu") == "mixed"
    monkeypatch.setenv(backends.ATTENTION_ENV, "flash")
    with pytest.raises(Eagle3Error, match="EAGLE3_JAX_ATTENTION"):
        backends.attention_wanted(jnp.bfloat16, "gpu")


def test_flash_decoding_equals_the_mixed_path():
    """The Pallas flash-decoding kernel (interpreted on the CPU) over slot-major K: a decode step
    reading only each row's valid range (a sliding window's start too), and a verification whose
    tree entries are merged by the kernel's log-sum-exp, equal the mixed path over the same
    cache to fp32 rounding."""
    from eagle3_jax.models.layers import mixed_attention, pallas_attention

    q, kc, vc, _, kn, vn, mask_new = _attention_inputs(1, s=256)
    k_slot_major = kc.transpose(0, 1, 3, 2)  # [B, G, S, K]
    slots = jnp.arange(256)[None, None, :]
    for lo, hi in (([0, 0], [40, 200]), ([30, 5], [41, 256])):  # [start, end) per row
        mask = (slots >= jnp.asarray(lo)[:, None, None]) & (slots < jnp.asarray(hi)[:, None, None])
        want = mixed_attention(q[:, :1], kc, vc, mask[:, :1].repeat(1, 1))
        got = pallas_attention(q[:, :1], k_slot_major, vc, mask[:, :1])
        np.testing.assert_allclose(got, want, atol=2e-6)
        mask5 = jnp.broadcast_to(mask, (2, 5, 256))
        want = mixed_attention(q, kc, vc, mask5, kn, vn, mask_new)
        got = pallas_attention(q, k_slot_major, vc, mask5, kn, vn, mask_new)
        np.testing.assert_allclose(got, want, atol=2e-6)
        assert jnp.array_equal(
            mixed_attention(q, k_slot_major, vc, mask5, kn, vn, mask_new, slot_major=True), want
        )


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_speculative_decoding_with_flash_decoding_is_plain_greedy(
    spec_setup, hf_checkpoint, family
):
    """fp32 weights with the GPU's flash-decoding path forced (slot-major K cache, the Pallas
    kernel interpreted): greedy speculative output equals plain decoding with exact attention,
    for a sliding-window target (Mistral: its verifications take the mixed path) too."""
    import dataclasses

    from helpers import TREE, random_prompts, spec_generate

    from eagle3_jax.checkpoints.hf import load_hf

    _, _, dparams, dcfg, vocab = spec_setup
    params, cfg = load_hf(hf_checkpoint(family)[1])
    flash = dataclasses.replace(cfg, attention="pallas")
    prompts = random_prompts(cfg.vocab_size, [7, 12], seed=6)
    plain_kw = dict(method="vanilla", eos_ids=())
    ref = spec_generate(params, cfg, None, None, None, prompts, 24, TREE, **plain_kw)
    plain = spec_generate(params, flash, None, None, None, prompts, 24, TREE, **plain_kw)
    out = spec_generate(params, flash, dparams, dcfg, vocab, prompts, 24, TREE, eos_ids=())
    assert plain.output_ids == ref.output_ids
    assert out.output_ids == ref.output_ids


@pytest.mark.parametrize("queries", [1, 60])
def test_flash_decoding_lowers_to_a_triton_kernel_for_cuda(queries):
    """At Llama-3.1-8B's attention shape (32 heads over 8 kv heads of 128, bf16, 2,304 slots),
    a decode step and a 60-node verification lower for CUDA to the Triton flash-decoding kernel
    (exported without a GPU; the Triton call has no serialisation guarantee, so that one check
    is off) and nothing of the CPU's interpreter."""
    import functools

    from jax import export

    from eagle3_jax.models.layers import pallas_attention

    b, h, g, k, s = 1, 32, 8, 128, 2304
    sds = jax.ShapeDtypeStruct
    args = [sds((b, queries, h, k), jnp.bfloat16), sds((b, g, s, k), jnp.bfloat16),
            sds((b, g, s, k), jnp.bfloat16), sds((b, queries, s), jnp.bool_)]  # fmt: skip
    if queries > 1:
        args += [sds((b, queries, g, k), jnp.bfloat16)] * 2 + [sds((b, queries, queries), bool)]
    fn = jax.jit(functools.partial(pallas_attention, interpret=False))
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = export.export(fn, platforms=("cuda",), disabled_checks=[triton])(*args)
    text = exported.mlir_module()
    assert text.count("xla.gpu.triton") == 1 and 'name = "mha_forward"' in text
    assert "while" not in text.split("xla.gpu.triton")[0].lower()  # no interpreted grid loop
