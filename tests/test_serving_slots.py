"""Continuous batching over fixed slots (decoding/slots.py): requests arriving at different rounds
into a 3-slot engine, some leaving and others joining the freed slots, give token for token what
decoding each prompt alone gives (greedy: eagle3 and plain rounds; sampled with a seed: the same
draws as decoding it alone with that seed), with one compiled round and one admission per prompt
bucket."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import TREE, random_prompts, spec_generate

from eagle3_jax.checkpoints import Target
from eagle3_jax.checkpoints.heads import Head
from eagle3_jax.decoding.generate import DecodeOptions
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.decoding.slots import SlotEngine
from eagle3_jax.errors import Eagle3Error

# (arrival round, prompt length, max_tokens): the fourth and fifth wait for slots the first ones free
ARRIVALS = [(0, 5, 12), (0, 17, 30), (1, 9, 7), (2, 30, 20), (2, 3, 25), (6, 12, 16)]
NEW = 30  # the largest max_tokens: one token buffer (64) for the engine and decoding alone


def _engine(spec_setup, method="eagle3", sampling=Sampling(), slots=3, tree=TREE):
    params, cfg, dparams, dcfg, vocab = spec_setup
    opts = DecodeOptions(method, NEW, tree, sampling, eos_ids=(), max_context=256)
    return SlotEngine(Target(params, cfg, None, None), Head(dparams, dcfg, vocab), opts, slots)


def _serve(engine, requests, seeds=None, max_iters=300):
    """Runs `requests` [(arrival round, prompt, max_tokens)] FIFO through the engine: each
    iteration admits what has arrived into free slots, then runs a round. Returns each request's
    tokens and finish reason, and the slots each went to."""
    waiting = sorted(range(len(requests)), key=lambda i: requests[i][0])
    out = {i: [] for i in range(len(requests))}
    reasons, where = {}, {}
    for it in range(max_iters):
        while waiting and requests[waiting[0]][0] <= it and engine.free_slots():
            i = waiting.pop(0)
            _, prompt, limit = requests[i]
            where[i] = engine.admit(i, prompt, limit, seed=0 if seeds is None else seeds[i])
        for u in engine.step():
            out[u.request] += u.new_ids
            assert u.num_tokens == len(out[u.request])
            if u.finish_reason is not None:
                reasons[u.request] = u.finish_reason
        if not waiting and len(reasons) == len(requests):
            return out, reasons, where
    raise AssertionError(f"not done after {max_iters} iterations: {reasons}")


def _requests(vocab_size, arrivals=ARRIVALS):
    prompts = random_prompts(vocab_size, [n for _, n, _ in arrivals], seed=3)
    return [(t, p, m) for (t, _, m), p in zip(arrivals, prompts)]


# adaptive verification: each round verifies the largest need over the running rows, so what
# is verified depends on the neighbours; the greedy tokens must not
ADAPTIVE = dataclasses.replace(TREE, verify_threshold=0.05)


@pytest.mark.parametrize("method, tree", [("eagle3", TREE), ("vanilla", TREE),
                                          ("eagle3", ADAPTIVE)])  # fmt: skip
def test_staggered_greedy_equals_alone(spec_setup, method, tree):
    params, cfg, dparams, dcfg, vocab = spec_setup
    eng = _engine(spec_setup, method, tree=tree)
    requests = _requests(cfg.vocab_size)
    out, reasons, where = _serve(eng, requests)
    assert len(set(where.values())) == 3  # every slot used, some twice
    for i, (_, prompt, limit) in enumerate(requests):
        alone = spec_generate(params, cfg, dparams, dcfg, vocab, [prompt], limit, tree, method,
                              eos_ids=())  # fmt: skip
        assert out[i] == alone.output_ids[0], (method, i)
        if tree.verify_threshold:  # rounds verified fewer than all nodes: pruning happened
            assert alone.verified_tokens[0] < tree.total_tokens * (alone.target_forwards[0] - 1)
        assert reasons[i] == "max_tokens" and len(out[i]) == limit
    assert eng.compiles()["admit"] >= 1 and eng.busy() == 0
    if method == "eagle3":  # some rounds accepted drafts: fewer rounds than tokens
        assert eng.rounds < sum(m for _, _, m in requests)


def test_one_round_program_one_admission_per_bucket(spec_setup):
    """A second engine of the same shape compiles nothing; a prompt in a new bucket compiles one
    admission, never another round."""
    cfg = spec_setup[1]
    first = _engine(spec_setup)
    _serve(first, _requests(cfg.vocab_size)[:2])
    before = first.compiles()
    eng = _engine(spec_setup)
    _serve(eng, _requests(cfg.vocab_size, [(0, 4, 3), (1, 40, 5), (1, 20, 2)]))
    assert eng.compiles() == before
    _serve(eng, _requests(cfg.vocab_size, [(0, 70, 3)]))  # prompt bucket 128
    assert eng.compiles() == {"admit": before["admit"] + 1, "round": before["round"]}


def test_sampled_request_reproduces_itself(spec_setup):
    """A seeded sampled request gives the same tokens alone in the engine, sharing it with
    others (admitted into another slot, at another round), and decoded alone by generate_ids."""
    params, cfg, dparams, dcfg, vocab = spec_setup
    sampling = Sampling(temperature=1.0)
    prompt = random_prompts(cfg.vocab_size, [11], seed=9)[0]
    solo, _, _ = _serve(_engine(spec_setup, sampling=sampling), [(0, prompt, 20)], seeds=[7])
    others = _requests(cfg.vocab_size)[:4]
    shared_reqs = others[:3] + [(1, prompt, 20)] + others[3:]
    shared, _, where = _serve(_engine(spec_setup, sampling=sampling), shared_reqs,
                              seeds=[1, 2, 3, 7, 4])  # fmt: skip
    assert where[3] != 0
    assert shared[3] == solo[0]
    alone = spec_generate(params, cfg, dparams, dcfg, vocab, [prompt], 20, TREE, sampling=sampling,
                          seed=7, eos_ids=())  # fmt: skip
    assert solo[0] == alone.output_ids[0]
    # another seed, another sample (20 tokens from a 97-token vocabulary)
    other, _, _ = _serve(_engine(spec_setup, sampling=sampling), [(0, prompt, 20)], seeds=[8])
    assert other[0] != solo[0]


def test_release_frees_the_slot_and_refusals(spec_setup):
    """A released request stops reporting and its slot takes the next one, whose output is
    unaffected; requests that cannot fit are refused naming the problem."""
    params, cfg, dparams, dcfg, vocab = spec_setup
    eng = _engine(spec_setup, slots=1)
    a, b = random_prompts(cfg.vocab_size, [6, 8], seed=5)
    eng.admit("a", a, 30)
    eng.step()
    eng.release(0)
    assert eng.free_slots() == [0] and eng.step() == []
    eng.admit("b", b, 9)
    got = []
    for _ in range(50):
        ups = eng.step()
        assert all(u.request == "b" for u in ups)
        got += [t for u in ups for t in u.new_ids]
        if any(u.finish_reason for u in ups):
            break
    alone = spec_generate(params, cfg, dparams, dcfg, vocab, [b], 9, TREE, eos_ids=())
    assert got == alone.output_ids[0]
    with pytest.raises(Eagle3Error, match="exceeds the context of 256"):
        eng.check([5] * 240, 20)
    with pytest.raises(Eagle3Error, match="exceeds this server's limit of 30"):
        eng.check([5], 31)
    with pytest.raises(Eagle3Error, match="max_tokens 0"):
        eng.check([5], 0)
    eng.admit("c", b, 3)
    with pytest.raises(Eagle3Error, match="no free slot"):
        eng.admit("d", b, 3)
