"""Chunked prefill (`plain.chunked_forward`, `decode --prefill-chunk`): the prompt's target
forward run C tokens at a time against the cache the earlier chunks wrote gives the one-pass
forward's cache, aux features and last logits (fp32, up to the products' summation order), and
decoding after it is exact: greedy speculative decoding with a chunked prefill equals plain
decoding with the same chunks, batch rows of different lengths included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_prompts, spec_generate

from eagle3_jax.decoding import plain
from eagle3_jax.decoding import speculative as spec
from eagle3_jax.decoding.generate import DecodeOptions
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import target as tgt

TREE = TreeConfig(top_k=3, depth=3, total_tokens=8)


def test_chunks_give_the_one_pass_prefill(spec_setup):
    """Prompts of 150 and 40 tokens (bucket 192) in chunks of 64: the K/V of every prompt slot,
    the aux features of every prompt position and each row's last logits equal the one-pass
    prefill's; the state after it (root, draft cache) too."""
    params, cfg, dparams, dcfg, vocab = spec_setup
    prompts = random_prompts(cfg.vocab_size, [150, 40], seed=3)
    req = plain.prepare(cfg, prompts, 8, (), None, 0, TREE.round_slots + 1)
    assert plain.chunk_sizes(req.shape.prompt_len, 64) == [64, 64, 64]
    assert plain.chunk_sizes(req.shape.prompt_len, 128) == [128, 64]
    args = (params, dparams, params["embed"], vocab, req.tokens, req.lengths, req.limit,
            jax.random.PRNGKey(0), cfg, dcfg, req.shape, TREE, Sampling(), req.eos)  # fmt: skip
    one = spec.prefill(*args)
    for chunk in (64, 128):
        got = spec.prefill_chunked(*args, chunk)
        for layer in range(cfg.num_layers):
            for name in ("k", "v"):
                a, b = one.tcache[name][layer], got.tcache[name][layer]
                for row, n in enumerate(req.lengths):  # the prompt's slots (pads differ nowhere)
                    sl = (
                        (row, ..., slice(0, n))
                        if name == "k"
                        else (row, ..., slice(0, n), slice(None))
                    )
                    np.testing.assert_allclose(np.asarray(b[sl]), np.asarray(a[sl]), atol=2e-5)
        np.testing.assert_array_equal(np.asarray(got.root), np.asarray(one.root))
        np.testing.assert_allclose(np.asarray(got.enc_feat), np.asarray(one.enc_feat), atol=2e-5)
        for a, b in zip(jax.tree.leaves(one.dcache), jax.tree.leaves(got.dcache)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5)
    pre = plain.chunked_forward(params, jnp.asarray(req.tokens), jnp.asarray(req.lengths), cfg,
                                req.shape.slots, 64, dcfg.aux_layer_ids)  # fmt: skip
    full = plain.prefill(params, req.tokens, req.lengths, req.limit, jax.random.PRNGKey(0), cfg,
                         req.shape, Sampling(), req.eos)  # fmt: skip
    aux = jnp.concatenate(pre.aux, axis=1)
    assert aux.shape == (2, req.shape.prompt_len, len(dcfg.aux_layer_ids) * cfg.hidden_size)
    assert np.asarray(jnp.argmax(pre.logits[:, 0], -1)).tolist() == np.asarray(full.last).tolist()


def test_greedy_speculative_with_chunks_equals_plain_with_chunks(spec_setup):
    """Greedy EAGLE-3 (a tree and a chain) after a chunked prefill equals plain decoding after
    the same chunks, for prompts shorter than a chunk, spanning several, and of different
    lengths in one batch; the bad chunk sizes are refused by name."""
    params, cfg, dparams, dcfg, vocab = spec_setup
    prompts = random_prompts(cfg.vocab_size, [150, 40, 90], seed=4)
    ref = plain.generate(params, cfg, prompts, 20, eos_ids=(), prefill_chunk=64)
    for tree in (TREE, TreeConfig(top_k=1, depth=4, total_tokens=4)):
        out = spec_generate(params, cfg, dparams, dcfg, vocab, prompts, 20, tree, eos_ids=(),
                            prefill_chunk=64)  # fmt: skip
        assert out.output_ids == ref.output_ids, tree
    for bad in (32, 100):
        with pytest.raises(Eagle3Error, match=f"prefill chunk {bad}: give a multiple of 64"):
            DecodeOptions("eagle3", 8, prefill_chunk=bad)


def test_restored_chunks_are_bit_for_bit_the_computed_ones(spec_setup):
    """A prefix cache's premise (`slots.PrefixCache`): the K/V of a prompt's first chunks taken
    from one prefill (`plain.take_chunk`) and written into a fresh cache (`plain.put_chunk`),
    the rest of another prompt with the same beginning computed after them, give exactly the
    cache, aux features and logits of computing that prompt's every chunk."""
    params, cfg, dparams, dcfg, vocab = spec_setup
    a = random_prompts(cfg.vocab_size, [150], seed=5)[0]
    b = a[:128] + random_prompts(cfg.vocab_size, [30], seed=6)[0]
    aux_ids, slots, c = dcfg.aux_layer_ids, 256, 64

    def padded(p):
        t = plain.round_up(len(p), plain.PROMPT_BUCKET)
        return jnp.asarray([p + [0] * (t - len(p))]), jnp.asarray([len(p)])

    pa = plain.chunked_forward(params, *padded(a), cfg, slots, c, aux_ids)
    kept = [plain.take_chunk(pa.cache, jnp.int32(i * c), cfg, c) for i in range(2)]
    toks, n = padded(b)
    want = plain.chunked_forward(params, toks, n, cfg, slots, c, aux_ids)
    pre = plain.start_prefill(params, cfg, 1, slots)
    cache = pre.cache
    for i, kv in enumerate(kept):
        cache = plain.put_chunk(cache, kv, jnp.int32(i * c), cfg)
    got = plain.next_chunk(params, plain.Prefilled(cache, pa.aux[:2], pre.logits), toks, n,
                           2 * c, plain.chunk_sizes(toks.shape[1], c)[2], cfg, aux_ids)  # fmt: skip
    for x, y in zip(jax.tree.leaves((got.cache, got.aux, got.logits)),
                    jax.tree.leaves((want.cache, want.aux, want.logits))):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_last_logits_at_every_chunk_boundary(spec_setup):
    """Prompts of 1, 63, 64, 65, 128 and 129 tokens (ending just before, at and just after a
    64-token chunk's edge) in chunks of 64: each row's last logits are the one-pass forward's
    at its last position (not the buffer's zeros of a chunk that missed it)."""
    params, cfg, _, _, _ = spec_setup
    for n in (1, 63, 64, 65, 128, 129):
        prompt = random_prompts(cfg.vocab_size, [n], seed=n)[0]
        t = plain.round_up(n, plain.PROMPT_BUCKET)
        toks = jnp.asarray([prompt + [0] * (t - n)])
        pre = plain.chunked_forward(params, toks, jnp.asarray([n]), cfg, 256, 64)
        want = tgt.full_forward(params, jnp.asarray([prompt]), cfg).logits[0, -1]
        np.testing.assert_allclose(np.asarray(pre.logits[0, 0]), np.asarray(want), atol=2e-5)
