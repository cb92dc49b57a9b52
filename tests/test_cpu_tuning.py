"""The CPU product probes (cpu_tuning): set per machine by the environment or measured once and
cached, given to the models as a static ProductPolicy; tracing the models never probes."""

from __future__ import annotations

import builtins
import dataclasses
import io
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax import cpu_tuning
from eagle3_jax.config import PLAIN_PRODUCTS, ProductPolicy, TargetConfig
from eagle3_jax.models import draft as dr
from eagle3_jax.models import draft_output, layers
from eagle3_jax.models import target as tgt
from eagle3_jax.models.layers import causal_mask

PROBES = {
    # kind: its environment variable, cache file, getter and chooser; the timing function, a small
    # run of it and its fast key; the policy field; the product, its weight shape, and how its program shows the
    # fast way
    "row-products": dict(
        env="EAGLE3_JAX_ROW_PRODUCTS",
        cache="row_products.json",
        getter="row_products_max",
        chooser="choose_row_products",
        timing="time_row_products",
        small=dict(rows=2, layers=1, reps=2),
        fast_key="row_products_ms",
        field="row_products",
        fn=layers.dense,
        w_shape=(48, 40),
        fast_way=lambda hlo: "while" in hlo.as_text(),
    ),
    "output-layer-reduction": dict(
        env="EAGLE3_JAX_LOGIT_REDUCE",
        cache="logit_reduce.json",
        getter="logit_reduce_max",
        chooser="choose_logit_reduce",
        timing="time_logit_reduce",
        small=dict(rows=2, vocab=256, width=32, reps=2),
        fast_key="reduce_ms",
        field="logit_reduce",
        fn=layers.dense_t,
        w_shape=(40, 48),
        fast_way=lambda hlo: "dot(" not in hlo.as_text("hlo"),
    ),
}


@pytest.fixture(autouse=True)
def fresh_probes():
    """Each test starts as a new process would, and leaves no choice of its own behind (the
    command-line tests in this process probe for real)."""
    for p in PROBES.values():
        getattr(cpu_tuning, p["chooser"]).cache_clear()
    yield
    for p in PROBES.values():
        getattr(cpu_tuning, p["chooser"]).cache_clear()


@pytest.mark.parametrize("kind", list(PROBES))
def test_product_probe_times_both_ways(kind):
    """The real probe, small: both medians are positive times."""
    p = PROBES[kind]
    t = getattr(cpu_tuning, p["timing"])(**p["small"])
    assert set(t) == {p["fast_key"], "plain_products_ms"} and min(t.values()) > 0


@pytest.mark.parametrize("kind", list(PROBES))
def test_product_choices_can_be_set_per_machine(monkeypatch, kind):
    """EAGLE3_JAX_ROW_PRODUCTS / EAGLE3_JAX_LOGIT_REDUCE set the limit (0: the plain product for
    any row count) and skip the probe; unset or auto leaves it to the probe; anything else is an
    error. The CPU's policy carries the limit, other backends' is plain, and the policy decides
    the program."""
    p = PROBES[kind]
    monkeypatch.setattr(cpu_tuning, p["chooser"], lambda: 3)  # "the probe's answer"
    getter = getattr(cpu_tuning, p["getter"])
    for value, want in (("0", 0), ("8", 8), (" 8 ", 8), ("auto", 3), ("", 3)):
        monkeypatch.setenv(p["env"], value)
        assert getter() == want
    monkeypatch.delenv(p["env"])
    assert getter() == 3
    monkeypatch.setenv(p["env"], "fast")
    with pytest.raises(ValueError, match=f"{p['env']}='fast'"):
        getter()
    x, w = jnp.ones((4, 48), jnp.float32), jnp.ones(p["w_shape"], jnp.float32)
    for limit in (0, 8):
        monkeypatch.setenv(p["env"], str(limit))
        monkeypatch.setenv(
            "EAGLE3_JAX_LOGIT_REDUCE" if kind == "row-products" else "EAGLE3_JAX_ROW_PRODUCTS", "0"
        )
        policy = cpu_tuning.policy_for("cpu")
        assert (
            getattr(policy, p["field"]) == limit and cpu_tuning.policy_for("gpu") == PLAIN_PRODUCTS
        )
        hlo = jax.jit(lambda *a, policy=policy: p["fn"](*a, policy=policy)).lower(x, w)
        assert p["fast_way"](hlo) == (limit > 0)


@pytest.mark.parametrize("kind", list(PROBES))
@pytest.mark.parametrize("fast_ms,want", [(5.0, 8), (9.8, 0), (20.0, 0)])
def test_product_probes_pick_the_faster_way_once_per_cpu(
    monkeypatch, tmp_path, kind, fast_ms, want
):
    """Unset, each CPU choice (per-row products for dense, a row reduction for dense_t) is measured
    the first time it is asked for, kept for the process and cached on disk; in a new process the
    cache answers. The faster way only when 5 % faster."""
    p = PROBES[kind]
    monkeypatch.setenv("EAGLE3_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv(p["env"], raising=False)
    probes = []

    def fake_timing():
        probes.append(1)
        return {p["fast_key"]: fast_ms, "plain_products_ms": 10.0}

    monkeypatch.setattr(cpu_tuning, p["timing"], fake_timing)
    getter = getattr(cpu_tuning, p["getter"])
    assert getter() == want and len(probes) == 1
    assert getter() == want and len(probes) == 1  # once per process
    assert '"choice": ' + str(want) in (tmp_path / p["cache"]).read_text()
    getattr(cpu_tuning, p["chooser"]).cache_clear()  # as in a new process: the cache answers
    assert getter() == want and len(probes) == 1
    (tmp_path / p["cache"]).write_text("[1, 2]")  # not ours: measured again and replaced
    getattr(cpu_tuning, p["chooser"]).cache_clear()
    assert getter() == want and len(probes) == 2
    assert '"choice": ' + str(want) in (tmp_path / p["cache"]).read_text()


@pytest.mark.parametrize("kind", list(PROBES))
def test_a_failed_probe_means_plain_products_and_is_not_cached(monkeypatch, tmp_path, capsys, kind):
    p = PROBES[kind]
    monkeypatch.setenv("EAGLE3_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv(p["env"], raising=False)

    def broken():
        raise RuntimeError("no clock")

    monkeypatch.setattr(cpu_tuning, p["timing"], broken)
    assert getattr(cpu_tuning, p["getter"])() == 0
    assert "failed" in capsys.readouterr().err and not (tmp_path / p["cache"]).exists()


TINY = TargetConfig(
    family="llama",
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=12,
    tie_word_embeddings=True,
)


def test_tracing_the_models_never_probes(monkeypatch, tmp_path):
    """The models read the policy in their config and nothing else: jitting and running a target
    verification and a draft step, with row products and the row reduction (8/8) and with the
    default policy, touches no file, starts no thread and calls nothing of cpu_tuning."""

    def forbidden(*a, **k):
        raise AssertionError("the models probed the CPU")

    for name in (
        "policy_for",
        "row_products_max",
        "logit_reduce_max",
        "choose_row_products",
        "choose_logit_reduce",
        "time_row_products",
        "time_logit_reduce",
        "median_ms_alternating",
        "_probed_choice",
        "limit_from_env",
    ):
        monkeypatch.setattr(cpu_tuning, name, forbidden)
    monkeypatch.setenv("EAGLE3_JAX_CACHE", str(tmp_path))
    tparams = tgt.init_params(TINY, jax.random.PRNGKey(0))
    b, t, s = 2, 4, 8
    toks = jax.random.randint(jax.random.PRNGKey(1), (b, t), 0, TINY.vocab_size)
    start = jnp.full((b,), 2, jnp.int32)
    pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    tcache = tgt.make_cache(TINY, b, s)
    dcfg0 = dr.DraftConfig.from_target(TINY, lm_head_source="target")
    dparams = draft_output.attach_target_head(
        dr.init_params(dcfg0, jax.random.PRNGKey(2)), dcfg0, tparams, TINY
    )
    dcache = dr.make_cache(dcfg0, b, s)

    def verify(params, cache, toks, pos, start, cfg):
        mask = causal_mask(start, t, s)
        return tgt.forward(params, toks, pos, mask, cfg, cache, start, dcfg0.aux_layer_ids)

    def draft_step(params, embed, toks, feat, pos, cache, start, cfg):
        mask = causal_mask(start, t, s)
        return dr.forward(params, embed, toks, feat, pos, mask, cfg, cache, start)

    opened = []
    real_open = io.open  # builtins.open, and what pathlib calls

    def recording_open(*a, **k):
        opened.append(a)
        return real_open(*a, **k)

    monkeypatch.setattr(builtins, "open", recording_open)
    monkeypatch.setattr(io, "open", recording_open)
    monkeypatch.setattr(threading.Thread, "start", forbidden)
    outs = {}
    for policy in (ProductPolicy(row_products=8, logit_reduce=8), PLAIN_PRODUCTS):
        tcfg = dataclasses.replace(TINY, products=policy)
        dcfg = dataclasses.replace(dcfg0, products=policy)
        vjit = jax.jit(verify, static_argnames="cfg")
        out = vjit(tparams, tcache, toks, pos, start, tcfg)
        djit = jax.jit(draft_step, static_argnames="cfg")
        d = djit(dparams, tparams["embed"], toks, out.aux, pos, dcache, start, dcfg)
        outs[policy] = jax.block_until_ready((out.logits, d.logits))
    monkeypatch.setattr(builtins, "open", real_open)
    monkeypatch.setattr(io, "open", real_open)
    # what JAX itself writes to the tests' compilation cache (conftest) is no probe
    cache = jax.config.jax_compilation_cache_dir
    opened = [a for a in opened if not (cache and str(a[0]).startswith(cache))]
    assert opened == [] and list(tmp_path.iterdir()) == []
    for a, b_ in zip(*outs.values()):
        np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-5)
