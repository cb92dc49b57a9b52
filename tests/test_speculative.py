"""Speculative decoding (decoding/speculative.py): exact greedy equivalence with plain decoding, for
every tree, drafter and head; caches, adaptive verification, EOS, compiles. The tree's forward and
the acceptance rules: tests/test_verify.py; on a mesh: tests/test_sharding.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CHAIN, TREE, random_prompts, spec_generate, spec_prefill

from eagle3_jax.checkpoints.hf import load_hf
from eagle3_jax.decoding import plain
from eagle3_jax.decoding import speculative as spec
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.models import draft as drf
from eagle3_jax.models import draft_output
from eagle3_jax.models import target as tgt


@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("lengths", [[7], [5, 12, 9]], ids=["batch1", "batch3"])
def test_greedy_output_is_identical_to_plain_decoding(spec_setup, tree, lengths):
    params, cfg, dparams, dcfg, vocab = spec_setup
    prompts = random_prompts(cfg.vocab_size, lengths, seed=len(lengths))
    ref = plain.generate(params, cfg, prompts, 40, eos_ids=())
    out = spec_generate(params, cfg, dparams, dcfg, vocab, prompts, 40, tree, eos_ids=())
    assert out.output_ids == ref.output_ids
    assert out.finish_reasons == ["max_tokens"] * len(lengths)
    for row, n in zip(out.accept_hist, out.target_forwards):
        assert row.sum() == n - 1  # one verification per round after the prefill


@pytest.mark.parametrize("method", ["pld", "vanilla"])
def test_baselines_in_the_same_engine_are_exact(spec_setup, method):
    params, cfg, *_ = spec_setup
    # a prompt that repeats itself, so prompt lookup finds matches
    base = random_prompts(cfg.vocab_size, [6], seed=7)[0]
    prompts = [base * 3, random_prompts(cfg.vocab_size, [9], seed=8)[0]]
    ref = plain.generate(params, cfg, prompts, 30, eos_ids=())
    out = spec_generate(
        params,
        cfg,
        None,
        None,
        None,
        prompts,
        30,
        TreeConfig(1, 5, 6),
        eos_ids=(),
        method=method,
    )
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


def _oracle_run(params, cfg, prompts, new, tree, noise_every, wrap=lambda d: d):
    """Plain decoding of `prompts`, then speculative decoding with the near-oracle chain (its
    drafter passed through `wrap`): -> (plain result, speculative result)."""
    ref = plain.generate(params, cfg, prompts, new, eos_ids=())
    table = np.zeros((len(prompts), new + 16), np.int32)
    for i, r in enumerate(ref.output_ids):
        table[i, : len(r)] = r
    drafter = wrap(_oracle_drafter(noise_every))
    out = spec_generate(
        params,
        cfg,
        {"ref": jnp.asarray(table)},
        None,
        None,
        prompts,
        new,
        tree,
        eos_ids=(),
        method=drafter,
    )
    return ref, out


def test_long_acceptances_keep_the_cache_exact(spec_setup):
    """With a near-oracle draft most rounds accept the whole chain: cache compaction, positions and
    bookkeeping are exercised at full length, and the output must still equal plain decoding."""
    params, cfg, *_ = spec_setup
    prompts = random_prompts(cfg.vocab_size, [5, 11], seed=11)
    ref, out = _oracle_run(params, cfg, prompts, 48, TreeConfig(1, 5, 6), noise_every=3)
    assert out.output_ids == ref.output_ids
    assert out.accept_hist[:, 5].sum() > 0 and out.accept_hist[:, 2].sum() > 0
    tau = [48 / f for f in out.target_forwards]
    assert min(tau) > 3.0


@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain", "tree"])
def test_adaptive_verification_is_exact_and_verifies_fewer_tokens(spec_setup, tree):
    """verify_threshold > 0: each round verifies only the nodes the draft gives at least that
    cumulative probability (rounded up to a compiled size), and skips draft levels none could
    pass; the output is still plain decoding's, and fewer tokens are verified, yet more than the
    roots alone (this random draft spreads its probability, so 0.05 splits its nodes)."""
    import dataclasses

    params, cfg, dparams, dcfg, vocab = spec_setup
    prompts = random_prompts(cfg.vocab_size, [5, 12, 9], seed=3)
    ref = plain.generate(params, cfg, prompts, 40, eos_ids=())
    adaptive = dataclasses.replace(tree, verify_threshold=0.05)
    assert adaptive.verify_sizes == ((1, 2, 4, 5) if tree.top_k == 1 else (1, 2, 4, 8, 9))
    full = spec_generate(params, cfg, dparams, dcfg, vocab, prompts, 40, tree, eos_ids=())
    out = spec_generate(params, cfg, dparams, dcfg, vocab, prompts, 40, adaptive, eos_ids=())
    assert out.output_ids == ref.output_ids == full.output_ids
    rounds = [f - 1 for f in out.target_forwards]
    assert full.verified_tokens == [r * tree.total_tokens for r in rounds]
    for v, r in zip(out.verified_tokens, rounds):
        assert r < v < r * tree.total_tokens


def test_adaptive_verification_prunes_accepted_paths_exactly(spec_setup):
    """A near-oracle chain whose later tokens score low every other round: those rounds verify a
    shorter chain (accepting at most its length), the others the whole one; still exact."""
    params, cfg, *_ = spec_setup

    def low_scores_every_other_round(oracle):
        def drafter(dparams, embed, vocab, state, dcfg, shape, tree):
            trees, dcache = oracle(dparams, embed, vocab, state, dcfg, shape, tree)
            odd = (jnp.sum(state.accept_hist, axis=1) % 2 == 1)[:, None]
            low = jnp.where(odd & (trees.depth > 2), -5.0, 0.0)  # p = e^-5 below depth 2
            return trees._replace(score=low), dcache

        return drafter

    tree = TreeConfig(1, 5, 6, verify_threshold=0.5)  # sizes 1, 2, 4, 6
    prompts = random_prompts(cfg.vocab_size, [5, 11], seed=11)
    ref, out = _oracle_run(
        params, cfg, prompts, 48, tree, noise_every=1000, wrap=low_scores_every_other_round
    )
    assert out.output_ids == ref.output_ids
    hist = out.accept_hist.sum(0)
    # full chains (5 accepted) on even rounds; at most 3 on odd ones (size 4: root + 3)
    assert hist[5] > 0 and hist[3] > 0 and hist[4] == 0
    rounds = sum(f - 1 for f in out.target_forwards)
    assert sum(out.verified_tokens) < rounds * 6


def test_sliding_window_target_is_exact(hf_checkpoint):
    """A Mistral-style window (12 tokens) shorter than the context: verification masks what plain
    decoding masks, at every tree node, so a near-oracle chain still reproduces plain decoding."""
    _, path = hf_checkpoint("mistral")
    params, cfg = load_hf(path)
    assert cfg.sliding_window == 12
    prompts = random_prompts(cfg.vocab_size, [20, 9], seed=4)
    ref, out = _oracle_run(params, cfg, prompts, 30, TreeConfig(1, 4, 5), noise_every=3)
    assert out.output_ids == ref.output_ids
    assert out.accept_hist[:, 3:].sum() > 0  # long paths were accepted past the window


def test_trees_deeper_than_their_node_count_keep_room_for_the_path(spec_setup):
    """The accepted path is written as depth + 1 entries: a round reserves max(total, depth + 1)
    slots, so a 4-node tree of depth 6 never writes over the prompt near the end of the cache."""
    params, cfg, dparams, dcfg, vocab = spec_setup
    tree = TreeConfig(2, 6, 4)
    assert tree.round_slots == 7
    for n, new in ((5, 40), (57, 3)):
        prompts = random_prompts(cfg.vocab_size, [n], seed=n)
        ref = plain.generate(params, cfg, prompts, new, eos_ids=())
        out = spec_generate(params, cfg, dparams, dcfg, vocab, prompts, new, tree, eos_ids=())
        assert out.output_ids == ref.output_ids


def test_draft_cache_equals_a_fresh_encode_of_the_sequence(spec_setup):
    """After many rounds the draft's stable cache holds exactly what encoding the whole accepted
    sequence at once would: the re-encode of newly accepted tokens is right."""
    params, cfg, dparams, dcfg, vocab = spec_setup
    prompt = random_prompts(cfg.vocab_size, [8], seed=5)
    state, shape = spec_prefill(spec_setup, prompt, 32, TREE)
    args = (cfg, dcfg, shape, TREE, Sampling(), ())
    state = spec.decode_loop(params, dparams, params["embed"], vocab, state, *args)
    n = int(state.num_new[0])
    seq = prompt[0] + list(map(int, state.tokens[0, :n]))
    done = int(state.length[0] - state.enc_n[0])  # positions encoded before the last round's pairs
    assert done > 12
    feats = tgt.full_forward(params, jnp.asarray([seq]), cfg, dcfg.aux_layer_ids).aux
    t = len(seq) - 1
    pos = jnp.arange(t)[None]
    mask = (jnp.arange(t)[None, :] <= jnp.arange(t)[:, None])[None]
    kv = drf.make_cache(dcfg, 1, t, jnp.float32)
    ref = drf.forward(
        dparams,
        params["embed"],
        jnp.asarray([seq[1:]]),
        feats[:, :t],
        pos,
        mask,
        dcfg,
        kv,
        jnp.zeros((1,), jnp.int32),
        target_features=True,
    )
    np.testing.assert_allclose(
        state.dcache["k"][0, ..., :done], ref.cache["k"][0, ..., :done], rtol=1e-4, atol=1e-4
    )  # K [B, G, K, S], V [B, G, S, K]
    np.testing.assert_allclose(
        state.dcache["v"][0, :, :done], ref.cache["v"][0, :, :done], rtol=1e-4, atol=1e-4
    )


def test_one_compilation_for_a_whole_generation(spec_setup):
    params, cfg, dparams, dcfg, vocab = spec_setup
    before = spec.decode_loop._cache_size(), spec.prefill._cache_size()
    for n, new in ((4, 20), (13, 33), (30, 50)):  # same prompt / cache / max-new buckets
        spec_generate(
            params,
            cfg,
            dparams,
            dcfg,
            vocab,
            random_prompts(cfg.vocab_size, [n], seed=n),
            new,
            TREE,
            eos_ids=(),
        )
    after = spec.decode_loop._cache_size(), spec.prefill._cache_size()
    assert after[0] - before[0] <= 1 and after[1] - before[1] <= 1


def test_bad_tree_shapes_are_refused(spec_setup):
    params, cfg, dparams, dcfg, vocab = spec_setup
    from eagle3_jax.errors import Eagle3Error

    p = random_prompts(cfg.vocab_size, [5])
    for tree, msg in [
        (TreeConfig(2, 2, 9), "total_tokens 9 must be"),
        (TreeConfig(61, 2, 8), "exceeds the draft vocabulary"),
        (TreeConfig(2, 0, 3), "depth 0 < 1"),
        (TreeConfig(2, 2, 4, verify_threshold=1.0), "verify threshold 1.0 must be"),
    ]:
        with pytest.raises(Eagle3Error, match=msg):
            spec_generate(params, cfg, dparams, dcfg, vocab, p, 8, tree)
    with pytest.raises(Eagle3Error, match="needs a head"):
        spec_generate(params, cfg, None, None, None, p, 8, TREE)


def test_eos_stops_a_row_inside_a_round(spec_setup):
    params, cfg, dparams, dcfg, vocab = spec_setup
    prompts = random_prompts(cfg.vocab_size, [6, 10], seed=9)
    ref = plain.generate(params, cfg, prompts, 24, eos_ids=())
    eos = ref.output_ids[0][7]
    want = plain.generate(params, cfg, prompts, 24, eos_ids=(eos,))
    got = spec_generate(params, cfg, dparams, dcfg, vocab, prompts, 24, TREE, eos_ids=(eos,))
    assert got.output_ids == want.output_ids and got.finish_reasons == want.finish_reasons


@pytest.mark.parametrize("rank", [0, 4], ids=["target-lm-head", "specvocab"])
def test_heads_reading_the_target_output_embedding_are_exact(spec_setup, rank):
    """Full-vocabulary heads on the target's output embedding, and SpecVocab (candidates from the
    speculator, exact logits among them): greedy output == plain decoding, chain and trees (the
    wide one's levels share one candidate gather: draft_output.candidate_logits)."""
    from eagle3_jax.vocab import identity

    params, cfg, *_ = spec_setup
    kw = dict(lm_head_source="target", speculator_rank=rank)
    if rank:
        kw["spec_candidates"] = 12
    dcfg = drf.DraftConfig.from_target(cfg, **kw)
    dparams = drf.init_params(dcfg, jax.random.PRNGKey(5), scale=0.2)
    with pytest.raises(Exception, match="output embedding"):
        spec_generate(params, cfg, dparams, dcfg, identity(cfg.vocab_size), [[5, 6]], 4, CHAIN)
    dparams = draft_output.attach_target_head(dparams, dcfg, params, cfg)
    prompts = random_prompts(cfg.vocab_size, [5, 12, 9], seed=11)
    ref = plain.generate(params, cfg, prompts, 30, eos_ids=())
    wide = TreeConfig(top_k=6, depth=3, total_tokens=16)
    assert draft_output.union_capacity(6, 12, cfg.vocab_size) < 6 * 12
    for tree in (CHAIN, TREE, wide):
        out = spec_generate(
            params, cfg, dparams, dcfg, identity(cfg.vocab_size), prompts, 30, tree, eos_ids=()
        )
        assert out.output_ids == ref.output_ids


def test_penalties_decode_as_plain_decoding_and_transformers(spec_setup, hf_checkpoint):
    """decode's --repetition/--frequency/--presence-penalty (a `Sampling`'s penalties): greedy
    speculative decoding with prompt-lookup drafts (accepted: the tiny target repeats itself)
    and with the head's tree equal plain decoding with the same penalties, a batch of two
    prompts, and plain decoding's repetition penalty equals transformers' `generate`."""
    import torch

    from eagle3_jax.decoding.sampling import Penalties

    params, cfg, dparams, dcfg, vocab = spec_setup
    model, _ = hf_checkpoint("llama")
    prompts = [random_prompts(cfg.vocab_size, [7], seed=29)[0],
               random_prompts(cfg.vocab_size, [11], seed=5)[0]]  # fmt: skip
    for pen in (Penalties(repetition=1.05), Penalties(frequency=0.02, presence=0.01)):
        sampling = Sampling(penalties=pen)
        ref = plain.generate(params, cfg, prompts, 30, sampling, eos_ids=())
        assert ref.output_ids != plain.generate(params, cfg, prompts, 30, eos_ids=()).output_ids
        pld = spec_generate(params, cfg, None, None, None, prompts, 30, TREE, "pld",
                            sampling=sampling, eos_ids=())  # fmt: skip
        assert pld.output_ids == ref.output_ids
        assert sum(int(h[1:].sum()) for h in pld.accept_hist) > 2  # drafts were accepted
        tree = spec_generate(params, cfg, dparams, dcfg, vocab, prompts, 30, TREE,
                             sampling=sampling, eos_ids=())  # fmt: skip
        assert tree.output_ids == ref.output_ids
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompts[0]]), max_new_tokens=30, min_new_tokens=30,
                            do_sample=False, pad_token_id=0, eos_token_id=None,
                            repetition_penalty=1.05)  # fmt: skip
    rep = plain.generate(params, cfg, prompts[:1], 30, Sampling(penalties=Penalties(1.05)),
                         eos_ids=())  # fmt: skip
    assert rep.output_ids[0] == hf[0, len(prompts[0]) :].tolist()
