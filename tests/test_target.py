"""Target model parity with transformers' PyTorch models, per family."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import FAMILIES

from eagle3_jax.checkpoints.hf import load_hf
from eagle3_jax.models import target as tgt
from eagle3_jax.models.layers import causal_mask


def _tokens(b, t, v, seed=0):
    return np.random.default_rng(seed).integers(3, v, size=(b, t)).astype(np.int32)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_hidden_states_match_transformers(family, hf_checkpoint):
    model, path = hf_checkpoint(family)
    params, cfg = load_hf(path)
    toks = _tokens(2, 20, cfg.vocab_size)
    with torch.no_grad():
        ref = model(torch.tensor(toks, dtype=torch.long), output_hidden_states=True)
    aux_ids = tuple(range(cfg.num_layers + 1))
    out = tgt.full_forward(params, jnp.asarray(toks), cfg, aux_ids)
    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), rtol=1e-4, atol=1e-4)
    d = cfg.hidden_size
    for i in aux_ids:
        ours = np.asarray(out.aux[..., i * d : (i + 1) * d])
        np.testing.assert_allclose(
            ours, ref.hidden_states[i].numpy(), rtol=1e-4, atol=1e-4, err_msg=f"hidden_states[{i}]"
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_stepwise_decode_equals_full_forward(family, hf_checkpoint):
    _, path = hf_checkpoint(family)
    params, cfg = load_hf(path)
    b, t, prompt, s = 2, 24, 9, 32
    toks = jnp.asarray(_tokens(b, t, cfg.vocab_size, seed=1))
    aux_ids = cfg.default_aux_layer_ids()
    full = tgt.full_forward(params, toks, cfg, aux_ids)
    step = jax.jit(tgt.forward, static_argnames=("cfg", "aux_ids"))
    for stacked in (False, True):
        p = tgt.stack_layers(params) if stacked else params
        cache = tgt.make_cache(cfg, b, s, stacked=stacked)
        cursor = jnp.zeros((b,), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (b, prompt))
        out = step(
            p,
            toks[:, :prompt],
            pos,
            causal_mask(cursor, prompt, s, cfg.sliding_window),
            cfg,
            cache,
            cursor,
            aux_ids,
        )
        logits, aux = [out.logits], [out.aux]
        cache, cursor = out.cache, cursor + prompt
        for i in range(prompt, t):
            out = step(
                p,
                toks[:, i : i + 1],
                cursor[:, None],
                causal_mask(cursor, 1, s, cfg.sliding_window),
                cfg,
                out.cache,
                cursor,
                aux_ids,
            )
            logits.append(out.logits)
            aux.append(out.aux)
            cursor = cursor + 1
        np.testing.assert_allclose(np.concatenate(logits, 1), full.logits, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.concatenate(aux, 1), full.aux, rtol=1e-4, atol=1e-4)


def test_tied_embeddings(hf_checkpoint):
    model, path = hf_checkpoint("llama", tie=True)
    params, cfg = load_hf(path)
    assert cfg.tie_word_embeddings and "lm_head" not in params
    toks = _tokens(1, 12, cfg.vocab_size)
    with torch.no_grad():
        ref = model(torch.tensor(toks, dtype=torch.long)).logits.numpy()
    out = tgt.full_forward(params, jnp.asarray(toks), cfg)
    np.testing.assert_allclose(np.asarray(out.logits), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "scanned"])
def test_reading_the_cache_equals_writing_it(stacked, hf_checkpoint):
    """forward(..., mask_new=M) (the cache only read, the new tokens attending to each other under
    M) gives the logits and aux of the same tokens written into the cache first, and returns
    exactly the K/V that the writing call puts at their slots."""
    _, path = hf_checkpoint("qwen3")
    params, cfg = load_hf(path)
    params = tgt.stack_layers(params) if stacked else params
    b, prompt, t, s = 2, 7, 4, 24
    toks = jnp.asarray(_tokens(b, prompt + t, cfg.vocab_size, seed=5))
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
        out = tgt.full_forward(params, jnp.asarray(_tokens(1, 5, cfg.vocab_size)), cfg)
        assert out.logits.dtype == jnp.float32
        # the fp32 product of the bf16 inputs, not a bf16 result widened afterwards
        w = params["embed"].T if tie else params["lm_head"]
        want = np.asarray(out.hidden, np.float32) @ np.asarray(w, np.float32)
        np.testing.assert_allclose(np.asarray(out.logits), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("new_entries", [False, True], ids=["cache", "cache+new"])
def test_bf16_attention_one_query_and_many_compute_alike(new_entries):
    """With a bf16 cache, attention is the fp32 computation of its bf16 inputs rounded once, for
    one query (a decode step) and for several (a verification, with its new entries beside the
    cache or not). The one-query path used to keep the probabilities in fp32 while the
    several-query one rounded them to bf16, so ~40 % of the outputs differed by a bf16 step."""
    import ml_dtypes

    from eagle3_jax.models.layers import attention

    rng = np.random.default_rng(0)
    b, g, r, k, s, valid, t = 1, 3, 3, 64, 256, 200, 4
    bf16 = jnp.bfloat16
    keys = jnp.asarray(rng.standard_normal((b, g, k, s)), bf16)
    values = jnp.asarray(rng.standard_normal((b, g, s, k)), bf16)
    q = jnp.asarray(rng.standard_normal((b, t, g * r, k)), bf16)
    mask = jnp.broadcast_to(jnp.arange(s)[None, None] < valid, (b, t, s))
    extra = ()
    if new_entries:  # the verified tokens' own K/V, attended causally beside the cache
        k_new = jnp.asarray(rng.standard_normal((b, t, g, k)), bf16)
        v_new = jnp.asarray(rng.standard_normal((b, t, g, k)), bf16)
        extra = (k_new, v_new, jnp.tril(jnp.ones((t, t), bool))[None])
    got = np.asarray(jax.jit(attention)(q, keys, values, mask, *extra).astype(jnp.float32))

    def as64(x):
        return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)

    # the reference in fp64 from the same bf16 inputs, per query row: [B, T, G, R, K]
    qf = as64(q).reshape(b, t, g, r, k)
    kf, vf = as64(keys)[..., :valid], as64(values)[:, :, :valid]
    scores = np.einsum("btgrk,bgks->btgrs", qf, kf)
    vals = np.broadcast_to(vf[:, None], (b, t, g, valid, k))
    if new_entries:
        own = np.einsum("btgrk,bugk->btgru", qf, as64(k_new))
        own = np.where(np.tril(np.ones((t, t), bool))[None, :, None, None], own, -np.inf)
        scores = np.concatenate([scores, own], -1)
        vn = np.broadcast_to(as64(v_new).transpose(0, 2, 1, 3)[:, None], (b, t, g, t, k))
        vals = np.concatenate([vals, vn], -2)
    scores = scores / np.sqrt(k)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    want = np.einsum("btgrs,btgsk->btgrk", p, vals).reshape(got.shape)
    want = want.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    step = np.abs(want) * 2.0**-7  # one bf16 step at that magnitude (8 significant bits)
    off = got != want
    # never more than one step (or fp32's error on terms of size ~1, where a sum cancels)
    assert np.all(np.abs(got - want) <= step + 1e-6)
    # off by a step only where an fp32 sum and the fp64 one round to different sides
    assert off.mean() < 0.01, f"{off.mean():.1%} of the outputs off by a bf16 step"
    if not new_entries:  # each row alone (a decode step's one query) gives the same bits
        for i in range(t):
            one = jax.jit(attention)(q[:, i : i + 1], keys, values, mask[:, i : i + 1])
            np.testing.assert_array_equal(np.asarray(one.astype(jnp.float32))[:, 0], got[:, i])


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 4), (1, 9), (3, 5)])
def test_row_products_equal_the_matrix_product(shape):
    from eagle3_jax.models import layers

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((*shape, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((48, 40)), jnp.float32)
    got = jax.jit(layers.dense)(x, w)
    assert got.shape == (*shape, 40)
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)
    rows = int(np.prod(shape))
    hlo = jax.jit(layers.dense).lower(x, w).as_text()
    # on the CPU, 2..row_products_max() rows go one vector-matrix product per row (a loop)
    assert ("while" in hlo) == (
        jax.default_backend() == "cpu" and 1 < rows <= layers.row_products_max()
    )


def test_row_product_probe_times_both_ways():
    """The real probe, small: both medians are positive times."""
    from eagle3_jax.models import layers

    t = layers.time_row_products(rows=2, layers=1, reps=2)
    assert set(t) == {"row_products_ms", "plain_products_ms"} and min(t.values()) > 0


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 4), (1, 9), (3, 5)])
@pytest.mark.parametrize("limit", [0, 8])
def test_output_layer_reduction_equals_the_product(shape, limit, monkeypatch):
    """dense_t (x . w^T with w stored [N, K], the tied output layer) gives the product's numbers
    either way, bf16 weights scored in fp32 too; on the CPU 2..limit rows are a row reduction
    (no dot in the program), one row and more rows a dot."""
    from eagle3_jax.models import layers

    monkeypatch.setattr(layers, "LOGIT_REDUCE_MAX", limit)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((*shape, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 48)), jnp.float32)
    fn = jax.jit(lambda *a: layers.dense_t(*a))
    got = fn(x, w)
    assert got.shape == (*shape, 40)
    np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-5)
    rows = int(np.prod(shape))
    reduced = jax.default_backend() == "cpu" and 1 < rows <= limit
    assert ("dot(" not in fn.lower(x, w).as_text("hlo")) == reduced
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    got_b = jax.jit(lambda *a: layers.dense_t(*a, out_dtype=jnp.float32))(xb, wb)
    assert got_b.dtype == jnp.float32
    want_b = np.asarray(xb.astype(jnp.float32)) @ np.asarray(wb.astype(jnp.float32)).T
    np.testing.assert_allclose(got_b, want_b, rtol=1e-5, atol=1e-4)


PROBES = {
    # kind: the limit's module attribute, its environment variable, cache file and getter; the
    # timing function and its fast key; the product, its weight shape, and how its program shows
    # the fast way
    "row-products": dict(
        attr="ROW_PRODUCTS_MAX",
        env="EAGLE3_JAX_ROW_PRODUCTS",
        cache="row_products.json",
        getter="row_products_max",
        timing="time_row_products",
        fast_key="row_products_ms",
        fn="dense",
        w_shape=(48, 40),
        fast_way=lambda hlo: "while" in hlo.as_text(),
    ),
    "output-layer-reduction": dict(
        attr="LOGIT_REDUCE_MAX",
        env="EAGLE3_JAX_LOGIT_REDUCE",
        cache="logit_reduce.json",
        getter="logit_reduce_max",
        timing="time_logit_reduce",
        fast_key="reduce_ms",
        fn="dense_t",
        w_shape=(40, 48),
        fast_way=lambda hlo: "dot(" not in hlo.as_text("hlo"),
    ),
}


@pytest.mark.parametrize("kind", list(PROBES))
def test_product_choices_can_be_set_per_machine(monkeypatch, kind):
    """EAGLE3_JAX_ROW_PRODUCTS / EAGLE3_JAX_LOGIT_REDUCE set the limit at import (0: the plain
    product for any row count) and skip the probe; unset or auto leaves it to the probe; anything
    else is an error. A set limit decides the program."""
    import os
    import subprocess
    import sys

    from eagle3_jax.models import layers

    p = PROBES[kind]
    code = f"from eagle3_jax.models import layers; print(layers.{p['attr']})"
    for value, want in (("0", "0"), ("8", "8"), ("auto", "None"), ("fast", None)):
        env = {**os.environ, p["env"]: value, "JAX_PLATFORMS": "cpu"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if want is None:
            assert out.returncode != 0 and f"{p['env']}='fast'" in out.stderr
        else:
            assert out.stdout.strip() == want, out.stderr
    # a fresh function per setting: jit caches a traced function, and the limit is read in tracing
    x, w = jnp.ones((4, 48), jnp.float32), jnp.ones(p["w_shape"], jnp.float32)
    fn = getattr(layers, p["fn"])
    for limit in (0, 8):
        monkeypatch.setattr(layers, p["attr"], limit)
        hlo = jax.jit(lambda *a: fn(*a)).lower(x, w)
        assert p["fast_way"](hlo) == (limit > 0 and jax.default_backend() == "cpu")


@pytest.mark.parametrize("kind", list(PROBES))
@pytest.mark.parametrize("fast_ms,want", [(5.0, 8), (9.8, 0), (20.0, 0)])
def test_product_probes_pick_the_faster_way_once_per_cpu(
    monkeypatch, tmp_path, kind, fast_ms, want
):
    """Unset, each CPU choice (per-row products for dense, a row reduction for dense_t) is measured
    the first time a few rows are multiplied, even while a caller is being traced (the probe runs
    in its own thread, so its work is timed, not staged), used by that program and cached; unset
    again (as in a new process) the cache answers. The faster way only when 5 % faster."""
    import threading

    from eagle3_jax.models import layers

    p = PROBES[kind]
    if jax.default_backend() != "cpu":
        pytest.skip("the probes are CPU-only")
    monkeypatch.setenv("EAGLE3_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(layers, p["attr"], None)
    probes = []

    def fake_timing():
        probes.append(threading.current_thread() is threading.main_thread())
        return {p["fast_key"]: fast_ms, "plain_products_ms": 10.0}

    monkeypatch.setattr(layers, p["timing"], fake_timing)
    fn = getattr(layers, p["fn"])
    w = jnp.ones(p["w_shape"], jnp.float32)
    jax.jit(lambda *a: fn(*a)).lower(jnp.ones((1, 48), jnp.float32), w)
    assert probes == []  # one row is a vector product whatever the machine: no probe
    hlo = jax.jit(lambda *a: fn(*a)).lower(jnp.ones((4, 48), jnp.float32), w)
    assert probes == [False]  # once, in its own thread
    assert getattr(layers, p["attr"]) == want and p["fast_way"](hlo) == (want > 0)
    assert '"choice": ' + str(want) in (tmp_path / p["cache"]).read_text()
    monkeypatch.setattr(layers, p["attr"], None)  # as in a new process: the cache answers
    assert getattr(layers, p["getter"])() == want and len(probes) == 1


def test_output_layer_probe_times_both_ways():
    from eagle3_jax.models import layers

    t = layers.time_logit_reduce(rows=2, vocab=256, width=32, reps=2)
    assert set(t) == {"reduce_ms", "plain_products_ms"} and min(t.values()) > 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_output_layer_reduction_has_the_products_gradient(dtype, monkeypatch):
    """Differentiated (a head that reads the target's output layer trains through it, a few rows
    in tiny batches), the reduction gives the product's gradients in the inputs' dtypes, computed
    as products (no [rows, N, K] temporaries in the backward program)."""
    from eagle3_jax.models import layers

    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 3, 48)), dtype)
    w = jnp.asarray(rng.standard_normal((40, 48)), dtype)
    g = jnp.asarray(rng.standard_normal((2, 3, 40)), jnp.float32)

    def loss(x, w, out_dtype):
        return jnp.sum(layers.dense_t(x, w, out_dtype).astype(jnp.float32) * g)

    grads = {}
    for limit in (0, 8):
        monkeypatch.setattr(layers, "LOGIT_REDUCE_MAX", limit)
        for out_dtype in (None, jnp.float32):
            fn = jax.jit(jax.grad(lambda x, w: loss(x, w, out_dtype), argnums=(0, 1)))
            grads[limit, out_dtype] = fn(x, w)
            assert [t.dtype for t in grads[limit, out_dtype]] == [dtype, dtype]
            if limit and jax.default_backend() == "cpu":
                text = fn.lower(x, w).as_text("hlo")
                assert "f32[6,40,48]" not in text and "bf16[6,40,48]" not in text
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for out_dtype in (None, jnp.float32):
        for a, b in zip(grads[8, out_dtype], grads[0, out_dtype]):
            np.testing.assert_allclose(
                np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol
            )


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
