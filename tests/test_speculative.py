"""Speculative decoding: exact greedy equivalence with plain decoding, tree verification, compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.checkpoints.hf import load_hf
from eagle3_jax.decoding import plain, speculative as spec
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.models import draft as drf
from eagle3_jax.models import target as tgt
from eagle3_jax.vocab import build_from_counts, identity

CHAIN = spec.TreeConfig(top_k=1, depth=4, total_tokens=5)
TREE = spec.TreeConfig(top_k=3, depth=3, total_tokens=9)


def _prompts(v, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, v, size=n))) for n in lengths]


@pytest.fixture(scope="module")
def setup(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    params, cfg = load_hf(path)
    counts = np.random.default_rng(1).integers(0, 100, cfg.vocab_size)
    vocab = build_from_counts(counts, 60)
    dcfg = drf.DraftConfig.from_target(cfg, draft_vocab_size=60)
    dparams = drf.init_params(dcfg, jax.random.PRNGKey(0), scale=0.2)
    return params, cfg, dparams, dcfg, vocab


@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("lengths", [[7], [5, 12, 9]], ids=["batch1", "batch3"])
def test_greedy_output_is_identical_to_plain_decoding(setup, tree, lengths):
    params, cfg, dparams, dcfg, vocab = setup
    prompts = _prompts(cfg.vocab_size, lengths, seed=len(lengths))
    ref = plain.generate(params, cfg, prompts, 40, eos_ids=())
    out = spec.generate(params, cfg, dparams, dcfg, vocab, prompts, 40, tree, eos_ids=())
    assert out.output_ids == ref.output_ids
    assert out.finish_reasons == ["max_tokens"] * len(lengths)
    for row, n in zip(out.accept_hist, out.target_forwards):
        assert row.sum() == n - 1  # one verification per round after the prefill


@pytest.mark.parametrize("method", ["pld", "vanilla"])
def test_baselines_in_the_same_engine_are_exact(setup, method):
    params, cfg, *_ = setup
    # a prompt that repeats itself, so prompt lookup finds matches
    base = _prompts(cfg.vocab_size, [6], seed=7)[0]
    prompts = [base * 3, _prompts(cfg.vocab_size, [9], seed=8)[0]]
    ref = plain.generate(params, cfg, prompts, 30, eos_ids=())
    out = spec.generate(params, cfg, None, None, None, prompts, 30, spec.TreeConfig(1, 5, 6),
                        eos_ids=(), method=method)
    assert out.output_ids == ref.output_ids
    if method == "vanilla":
        assert out.target_forwards == [30, 30] and out.accept_hist[:, 1:].sum() == 0


def _oracle_drafter(noise_every):
    """A chain of the TRUE greedy continuation (read from dparams["ref"]), with every
    `noise_every`-th round's third token corrupted: long and partial acceptances, many rounds."""

    def drafter(dparams, embed, vocab, state, dcfg, shape, tree):
        from eagle3_jax.decoding.tree import chain_tree

        ref = dparams["ref"]
        j = jnp.arange(tree.depth)[None, :]
        idx = jnp.minimum(state.num_new[:, None] + j, ref.shape[1] - 1)
        chain = jnp.take_along_axis(ref, idx, axis=1)
        bad = (jnp.sum(state.accept_hist, axis=1) % noise_every == 0)[:, None] & (j == 2)
        chain = jnp.where(bad, (chain + 1) % 97, chain)
        return jax.vmap(chain_tree)(state.root, chain, jnp.zeros(chain.shape)), state.dcache

    return drafter


def test_long_acceptances_keep_the_cache_exact(setup):
    """With a near-oracle draft most rounds accept the whole chain: cache compaction, positions and
    bookkeeping are exercised at full length, and the output must still equal plain decoding."""
    params, cfg, *_ = setup
    prompts = _prompts(cfg.vocab_size, [5, 11], seed=11)
    ref = plain.generate(params, cfg, prompts, 48, eos_ids=())
    table = np.zeros((2, 64), np.int32)
    for i, r in enumerate(ref.output_ids):
        table[i, : len(r)] = r
    drafter = _oracle_drafter(noise_every=3)
    out = spec.generate(params, cfg, {"ref": jnp.asarray(table)}, None, None, prompts, 48,
                        spec.TreeConfig(1, 5, 6), eos_ids=(), method=drafter)
    assert out.output_ids == ref.output_ids
    assert out.accept_hist[:, 5].sum() > 0 and out.accept_hist[:, 2].sum() > 0
    tau = [48 / f for f in out.target_forwards]
    assert min(tau) > 3.0
