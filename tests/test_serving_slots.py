"""Continuous batching over fixed slots (decoding/slots.py): requests arriving at different rounds
into a 3-slot engine, some leaving and others joining the freed slots, give token for token what
decoding each prompt alone gives (greedy: eagle3 and plain rounds; sampled with a seed: the same
draws as decoding it alone with that seed), with one compiled round and one admission per prompt
bucket; requests with their own sampling settings side by side (a greedy one exact, a seeded
sampled one the same as alone), and the tree switched by occupancy between rounds."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TREE, hf_greedy, random_prompts, spec_generate

from eagle3_jax.checkpoints import Target
from eagle3_jax.checkpoints.heads import Head
from eagle3_jax.checkpoints.hf import load_hf
from eagle3_jax.decoding.generate import DecodeOptions
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.decoding.slots import (
    PLAIN,
    MeasuredSchedule,
    SlotEngine,
    TreeSchedule,
    envelope,
    tree_name,
)
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import target as tgt
from eagle3_jax.sharding import make_mesh, replicated

# (arrival round, prompt length, max_tokens): the fourth and fifth wait for slots the first ones free
ARRIVALS = [(0, 5, 12), (0, 17, 30), (1, 9, 7), (2, 30, 20), (2, 3, 25), (6, 12, 16)]
NEW = 30  # the largest max_tokens: one token buffer (64) for the engine and decoding alone


def _engine(spec_setup, method="eagle3", sampling=Sampling(), slots=3, tree=TREE, schedule=None,
            max_logprobs=None):  # fmt: skip
    params, cfg, dparams, dcfg, vocab = spec_setup
    opts = DecodeOptions(method, NEW, tree, sampling, eos_ids=(), max_context=256)
    head = Head(dparams, dcfg, vocab)
    return SlotEngine(Target(params, cfg, None, None), head, opts, slots, schedule,
                      max_logprobs=max_logprobs)  # fmt: skip


def _serve(engine, requests, seeds=None, max_iters=300, samplings=None, on_update=None):
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
            where[i] = engine.admit(
                i,
                prompt,
                limit,
                seed=0 if seeds is None else seeds[i],
                sampling=None if samplings is None else samplings[i],
            )
        for u in engine.step():
            if on_update is not None:
                on_update(u)
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


@pytest.mark.parametrize("method, tree", [
    ("eagle3", TREE), ("vanilla", TREE),
    # 30-37 s on a busy 2-core VM (a round per verified size and row bucket): with the slow suite
    pytest.param("eagle3", ADAPTIVE, marks=pytest.mark.slow),
])  # fmt: skip
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


def test_chunked_admissions_interleave_with_rounds_and_equal_decoding_alone(spec_setup):
    """prefill_chunk 64: a prompt of 150 tokens (3 chunks) arriving while another decodes is
    prefilled a chunk before each round, the running request gaining tokens in the rounds
    between, and joins the batch when its last chunk has run; greedy tokens equal `decode
    --prefill-chunk 64` of each prompt alone; a staged request released mid-prefill frees its
    slot; `compile_admissions` compiles each chunk size and each bucket's end ahead."""
    params, cfg, dparams, dcfg, vocab = spec_setup
    opts = DecodeOptions("eagle3", NEW, TREE, eos_ids=(), max_context=256, prefill_chunk=64)
    eng = SlotEngine(Target(params, cfg, None, None), Head(dparams, dcfg, vocab), opts, 2)
    assert eng.compile_admissions([64, 192]) == 1 + 2  # chunk size 64; two buckets' ends
    requests = _requests(cfg.vocab_size, [(0, 40, 16), (1, 150, 12), (2, 100, 10)])
    seen = []  # (request, whether a prompt was still prefilling then) per update with tokens
    out, reasons, where = _serve(
        eng, requests, on_update=lambda u: seen.append((u.request, bool(eng.staged)))
    )
    assert (0, True) in seen  # request 0 decoded while request 1's chunks ran
    for i, (_, prompt, limit) in enumerate(requests):
        alone = spec_generate(params, cfg, dparams, dcfg, vocab, [prompt], limit, TREE,
                              eos_ids=(), prefill_chunk=64)  # fmt: skip
        assert out[i] == alone.output_ids[0], i
        assert reasons[i] == "max_tokens"
    slot = eng.admit("gone", requests[1][1], 4)
    assert slot not in eng.free_slots() and eng.busy() == 1
    with pytest.raises(Eagle3Error, match=f"slot {slot} is busy"):
        eng.admit("again", requests[0][1], 4, slot=slot)
    eng.release(slot)
    assert eng.free_slots() == [0, 1] and not eng.staged and eng.step() == []
    # the budget: with nothing decoding, chunks run until a request joins and then C (64)
    # more at most; with a row decoding, C tokens a round at most (at least one chunk)
    for i, (_, prompt, _) in enumerate(requests[1:]):  # 150 and 100 tokens: 3 and 2 chunks
        eng.admit(i, prompt, 4)
    assert eng.prefill_some() == 3 * 64 + 64 and list(eng.staged) == [1]
    assert eng.owner[0] == 0 and eng.prefill_some() == 64 and not eng.staged
    eng.reset()
    eng.admit("a", requests[1][1], 4)
    eng.reset()  # staged work dropped with the state
    assert not eng.staged and eng.free_slots() == [0, 1]


def test_a_prefix_cache_restores_shared_chunks_and_keeps_the_tokens(spec_setup):
    """prefill_chunk 64 with a prefix cache: a second prompt beginning with the first's 128
    tokens restores those two chunks (`PrefixCache`: hit 128 of its 128 whole-chunk tokens)
    and computes only its last; both answers equal `decode --prefill-chunk 64` alone. A budget
    of one chunk keeps the first prompt's first chunk, not its deeper one (usable only after
    the first), so the second prompt restores 64 tokens; a cache without chunks is refused."""
    params, cfg, dparams, dcfg, vocab = spec_setup
    opts = DecodeOptions("eagle3", NEW, TREE, eos_ids=(), max_context=256, prefill_chunk=64)
    a = random_prompts(cfg.vocab_size, [150], seed=5)[0]
    b = a[:128] + random_prompts(cfg.vocab_size, [30], seed=6)[0]
    for budget, hit in ((64 << 20, 128), (1, 0), ("one chunk", 64)):
        eng = SlotEngine(Target(params, cfg, None, None), Head(dparams, dcfg, vocab), opts, 2,
                         prefix_cache_bytes=1 if budget == "one chunk" else budget)  # fmt: skip
        if budget == "one chunk":  # sized now that an entry's bytes are known
            eng.prefix.budget = _chunk_bytes(eng, a)
            assert eng.compile_admissions([192]) == 1 + 1 + 2  # chunk, end, keep and restore
        out, _, _ = _serve(eng, [(0, a, 8), (6, b, 8)])
        assert (eng.prefix.hit_tokens, eng.prefix.query_tokens) == (hit, 2 * 64 + 2 * 64)
        for i, prompt in enumerate((a, b)):
            alone = spec_generate(params, cfg, dparams, dcfg, vocab, [prompt], 8, TREE,
                                  eos_ids=(), prefill_chunk=64)  # fmt: skip
            assert out[i] == alone.output_ids[0], (budget, i)
    assert len(eng.prefix.entries) == 1 and eng.prefix.bytes <= eng.prefix.budget
    with pytest.raises(Eagle3Error, match="a prefix cache keeps prefill chunks"):
        SlotEngine(Target(params, cfg, None, None), Head(dparams, dcfg, vocab),
                   dataclasses.replace(opts, prefill_chunk=0), 2, prefix_cache_bytes=1 << 20)  # fmt: skip


def _chunk_bytes(eng, prompt) -> int:
    """One prefix-cache entry's bytes for `eng` (a chunk's K/V and aux features)."""
    from eagle3_jax.decoding import plain

    c = eng.prefill_chunk
    pre = plain.start_prefill(eng.models[0], eng.cfgs[0], 1, eng.shape.slots)
    kv = plain.take_chunk(pre.cache, jnp.int32(0), eng.cfgs[0], c)
    aux = c * len(eng.cfgs[1].aux_layer_ids) * eng.cfgs[0].hidden_size * 4
    return sum(x.nbytes for x in jax.tree.leaves(kv)) + aux


def test_slots_on_a_mesh_equal_one_device(spec_setup, hf_checkpoint):
    """`serve --mesh 2x2`: the target tensor-parallel over `model` (the head replicated), 4
    slots' rows over `data`; the staggered requests give the tokens of one device, and the state
    keeps its layout (`SlotEngine.state_shardings`: the target cache's kv heads over model,
    every field's rows over data) through admissions and rounds (over the busy rows and over
    all), which propagation alone left replicated over data."""
    data, model = 2, 2
    params, cfg, dparams, dcfg, vocab = spec_setup
    _, path = hf_checkpoint("llama")
    mesh = make_mesh(data, model, devices=jax.devices()[: data * model])
    sharded, _ = load_hf(path, mesh=mesh)
    setup = (sharded, cfg, jax.device_put(dparams, replicated(mesh)), dcfg, vocab)
    requests = _requests(cfg.vocab_size)
    want = _serve(_engine(spec_setup, slots=4), requests)[:2]
    eng = _engine(setup, slots=4)
    layout = eng.state_shardings(eng.state)
    assert _serve(eng, requests)[:2] == want
    for (where, arr), sh in zip(jax.tree_util.tree_leaves_with_path(eng.state),
                                jax.tree.leaves(layout)):  # fmt: skip
        assert arr.sharding.is_equivalent_to(sh, arr.ndim), (jax.tree_util.keystr(where), sh)
    k = eng.state.tcache["k"][0].sharding.spec
    assert k[:2] == ("data", "model"), k


def test_rounds_over_the_busy_rows_equal_rounds_over_all(spec_setup):
    """A round over the busy slots (padded with free ones to a power of two, the target cache
    read in place: `speculative.rows_round`) gives every request the tokens and finish reasons
    of rounds over all slots, in as many rounds; 4 slots run rows 1, 2 and 4 as requests come
    and go (the staggered tests check both against decoding alone, adaptive trees too)."""
    reqs = _requests(spec_setup[1].vocab_size)
    runs = {}
    for busy in (True, False):
        eng = _engine(spec_setup, slots=4)
        eng.busy_rows = busy
        out, reasons, _ = _serve(eng, reqs)
        runs[busy] = (out, reasons, eng.rounds)
    assert runs[True] == runs[False]
    assert eng.row_buckets() == [4]
    eng.busy_rows = True
    assert eng.row_buckets() == [1, 2, 4]
    assert eng.round_rows([2]) == [2] and eng.round_rows([3, 1]) == [1, 3]
    assert eng.round_rows([0, 1, 2]) is None  # four rows: the round over all of them
    eng.slots = 6
    assert eng.row_buckets() == [1, 2, 4, 6]
    assert eng.round_rows([5, 2, 4]) == [0, 2, 4, 5]  # padded with the first free slot


def test_logprobs_are_the_targets(spec_setup):
    """With max_logprobs, each emitted token comes with its log-probability under the target and
    the k most likely tokens there, equal to the log-softmax of a full forward over the prompt
    and the tokens before it (prefill's root, accepted drafts and bonus tokens alike; rounds over
    busy rows and over all); greedy: the token is its own top-1. Without, none."""
    params, cfg, *_ = spec_setup
    eng = _engine(spec_setup, slots=3, max_logprobs=3)
    requests = _requests(cfg.vocab_size)
    got = {i: [] for i in range(len(requests))}
    out, _, _ = _serve(eng, requests, on_update=lambda u: got[u.request].extend(u.logprobs))
    assert eng.rounds < sum(m for _, _, m in requests)  # drafts were accepted
    seqs = [p + out[i] for i, (_, p, _) in enumerate(requests)]
    width = max(map(len, seqs))  # one batch, right-padded: a causal forward, one compile
    batch = jnp.asarray([q + [0] * (width - len(q)) for q in seqs])
    logits = tgt.full_forward(params, batch, cfg).logits
    refs = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    for i, (_, prompt, _) in enumerate(requests):
        ref = refs[i]
        assert len(got[i]) == len(out[i])
        for j, (tok, (lp, top)) in enumerate(zip(out[i], got[i])):
            want = ref[len(prompt) - 1 + j]
            assert lp == pytest.approx(want[tok], abs=2e-4), (i, j)
            assert [t for t, _ in top][0] == tok and len(top) == 3  # greedy: its own top-1
            np.testing.assert_allclose([x for _, x in top], np.sort(want)[::-1][:3], atol=2e-4)
    plain_eng = _engine(spec_setup)
    _serve(plain_eng, requests[:1], on_update=lambda u: got.__setitem__("none", u.logprobs))
    assert got["none"] is None


def test_one_round_program_one_admission_per_bucket(spec_setup):
    """A second engine of the same shape compiles nothing; a prompt in a new bucket compiles one
    admission, never another round. (The first engine serves the staggered requests, which
    run 1, 2 and 3 busy rows: every row bucket's round; with two requests it ran none at 3, and
    the test passed only after another test had compiled that round.)"""
    cfg = spec_setup[1]
    first = _engine(spec_setup)
    _serve(first, _requests(cfg.vocab_size))
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


def test_per_request_sampling_settings(spec_setup):
    """Each request's own temperature, top-k, top-p in one batch (one compiled round): the
    greedy requests give exactly what decoding them alone gives, and each seeded sampled one
    what decoding it alone with its seed and settings gives."""
    params, cfg, dparams, dcfg, vocab = spec_setup
    requests = _requests(cfg.vocab_size)[:4]
    samplings = [Sampling(), Sampling(0.8, 5, 1.0), Sampling(), Sampling(1.3, 0, 0.9)]
    seeds = [0, 11, 0, 12]
    eng = _engine(spec_setup)  # the default (opts.sampling) is greedy: the requests override it
    out, _, _ = _serve(eng, requests, seeds=seeds, samplings=samplings)
    assert eng.compiles()["round"] >= 1
    # every request has ended: no row keeps its temperature, so a batch of greedy requests
    # admitted next skips the sampling branch
    assert not np.asarray(eng.state.sampling.temperature).any()
    for i, (_, prompt, limit) in enumerate(requests):
        alone = spec_generate(params, cfg, dparams, dcfg, vocab, [prompt], limit, TREE,
                              sampling=samplings[i], seed=seeds[i], eos_ids=())  # fmt: skip
        assert out[i] == alone.output_ids[0], (i, samplings[i])
    # the sampled ones did sample: not their greedy decoding
    greedy = spec_generate(params, cfg, dparams, dcfg, vocab, [requests[1][1]], requests[1][2],
                           TREE, eos_ids=())  # fmt: skip
    assert out[1] != greedy.output_ids[0]


SCHEDULE = "1:3/3/9,2:1/2/3,3-:plain"


def test_tree_schedule_parse():
    base = TREE
    s = TreeSchedule.parse(SCHEDULE, base)
    assert [s.tree_for(n) for n in (1, 2, 3, 7)] == [TREE, TreeConfig(1, 2, 3), PLAIN, PLAIN]
    s = TreeSchedule.parse("2-3:2/2/4/0.1", base)
    assert s.tree_for(1) == base and s.tree_for(3).verify_threshold == 0.1
    assert envelope(TreeSchedule.parse(SCHEDULE, base).trees()) == TREE
    with pytest.raises(Eagle3Error, match="RANGE:TREE"):
        TreeSchedule.parse("1-2:10/8", base)


# prompt lookup (12-13 s) with the slow suite: it serves in the default suite in the penalties test
@pytest.mark.parametrize("method, kind", [("eagle3", "table"),
                                          pytest.param("pld", "table", marks=pytest.mark.slow),
                                          ("eagle3", "measured")])  # fmt: skip
def test_tree_by_occupancy_greedy_equals_alone(spec_setup, method, kind):
    """The tree switches between rounds as staggered requests arrive and leave (3 slots; a
    table: the full tree at one, a chain at two, plain rounds at three; measured: the three
    candidates tried in turn and then every other round): each greedy output is still that of
    decoding the prompt alone; each tree compiled one round."""
    params, cfg, dparams, dcfg, vocab = spec_setup
    if kind == "table":
        schedule = TreeSchedule.parse(SCHEDULE, TREE)
    else:
        schedule = MeasuredSchedule([TREE, TreeConfig(1, 2, 3), PLAIN], explore_every=2)
    eng = _engine(spec_setup, method, schedule=schedule)
    requests = _requests(cfg.vocab_size)
    out, reasons, _ = _serve(eng, requests)
    assert set(eng.tree_rounds) == ({"3/3/9", "1/2/3", "plain"} if method == "eagle3"
                                    else {"1/3/4", "1/2/3", "plain"})  # fmt: skip
    if kind == "measured":  # every round was measured, by the busy slots it ran with
        stats = eng.schedule.stats
        assert sum(int(st[0]) for st in stats.values()) == eng.rounds
        assert {n for n, _ in stats} == {1, 2, 3}
    for i, (_, prompt, limit) in enumerate(requests):
        alone = spec_generate(params, cfg, dparams, dcfg, vocab, [prompt], limit, TREE, method,
                              eos_ids=())  # fmt: skip
        assert out[i] == alone.output_ids[0], (method, i)
        assert reasons[i] == "max_tokens"


def test_measured_schedule_picks_the_faster_per_occupancy():
    """Each candidate is measured min_rounds times at an occupancy, then the one with the most
    tokens per second runs and the other again every explore_every rounds, less often the more it
    falls short; when the rates change the choice follows them."""
    s = MeasuredSchedule([TREE, PLAIN], min_rounds=2, explore_every=4, smoothing=0.1)
    # tokens and seconds a round of each tree gives: the tree wins at one busy slot (30 vs 25
    # tok/s), plain rounds at four (41.4 vs 50 tok/s)
    # (a tree's tokens per busy row are pooled over the occupancies: 3 here at both)
    cost = {
        (1, TREE): (3, 0.1),
        (1, PLAIN): (1, 0.04),
        (4, TREE): (12, 0.29),
        (4, PLAIN): (4, 0.08),
    }

    def run(occupied, rounds):
        picked = []
        for _ in range(rounds):
            tree = s.tree_for(occupied)
            s.observe(occupied, tree, *cost[(occupied, tree)])
            picked.append(tree_name(tree))
        return picked

    # TREE and PLAIN twice each (the least seen first), then TREE with PLAIN every 4th round
    # (20 % short: 4 x 2 rounds apart)
    assert run(1, 20) == ["3/3/9", "plain"] * 2 + (["3/3/9"] * 7 + ["plain"]) * 2
    assert s.rate(1, TREE) == pytest.approx(30) and s.rate(1, PLAIN) == pytest.approx(25)
    # at four busy slots the tree is 17 % short: one round in 8 is a tree's
    assert run(4, 20).count("3/3/9") == 2 + 2 and s.best == {1: TREE, 4: PLAIN}
    # 10 tok/s: 200 % short once the median of plain rounds' first 10 (smoothing 0.1) has
    # moved, which takes as many slow rounds as the fast ones before; then tried every 32 rounds
    cost[(1, PLAIN)] = (1, 0.1)
    picked = run(1, 64)
    assert s.rate(1, PLAIN) == pytest.approx(10) and 2 <= picked.count("plain") <= 6
    assert picked[-32:].count("plain") <= 1
    cost[(4, TREE)] = (12, 12 / 50.5)  # 1 % ahead of plain rounds: within the margin, no change
    run(4, 200)
    assert s.rate(4, TREE) > s.rate(4, PLAIN) and s.best[4] == PLAIN
    cost[(4, PLAIN)] = (4, 0.2)  # plain rounds got slower (20 tok/s): the tree takes over
    picked = run(4, 60)
    assert s.best[4] == TREE and picked[-8:].count("3/3/9") >= 7


@pytest.mark.parametrize("unlucky", [False, True])
def test_measured_schedule_holds_a_small_lead_through_noisy_acceptance(unlucky):
    """A tree 9 % ahead of plain rounds at one busy slot, its accepted tokens as variable as a
    real head's (1-4 a round, mean 1.5) and round times jittered 5 %: the settled choice stays
    the tree for all but a few of 3,000 rounds, and the pooled tokens per row come within 3 %
    of the truth. (The first estimator, each occupancy's own tokens per round averaged over ~20
    rounds, settled on plain rounds for 70-80 % of them: a bad streak sank the tree's mean,
    which then moved only on its rare exploring rounds.) `unlucky`: the tree's first three
    rounds accept nothing, so plain rounds settle first; tried every 4 rounds while its
    hopeful rate is not short, the tree takes over within a few hundred rounds and runs most."""
    rng = np.random.default_rng(0)
    s = MeasuredSchedule([TREE, PLAIN])
    plain_settled, tree_rounds, took_over = 0, 0, None
    for i in range(3000):
        tree = s.tree_for(1)
        tokens = 1 if tree == PLAIN else int(rng.choice([1, 2, 3, 4], p=[0.65, 0.25, 0.05, 0.05]))
        if tree == TREE:
            tree_rounds += 1
            tokens = 1 if unlucky and tree_rounds <= 3 else tokens
        seconds = (0.04 if tree == PLAIN else 0.055) * rng.uniform(0.95, 1.05)
        s.observe(1, tree, tokens, seconds)
        plain_settled += i >= 100 and s.best.get(1) == PLAIN
        if took_over is None and s.best.get(1) == TREE:
            took_over = i
    assert s.tokens_per_row(TREE) == pytest.approx(1.5, rel=0.03)
    if unlucky:
        assert took_over < 600 and tree_rounds > 0.75 * 3000, (took_over, tree_rounds)
    else:
        assert plain_settled < 150, plain_settled  # 5 %


def test_a_slow_first_run_does_not_sink_a_tree():
    """Rounds of 60 ms but two of 250 and 300 among the tree's first (on the CPU, the first run
    of each verified size): its seconds stay 60 ms (the median of its first rounds), so the tree
    (3 tokens) stays ahead of plain rounds (1 token in 40 ms); later a round of 2 s counts as
    three times the mean."""
    s = MeasuredSchedule([TREE, PLAIN])
    for seconds in (0.06, 0.25, 0.3, 0.06, 0.06):
        s.observe(4, TREE, 12, seconds)
    s.observe(4, PLAIN, 4, 0.04)
    assert s.stats[(4, TREE)][1] == pytest.approx(0.06) and s.rate(4, TREE) > s.rate(4, PLAIN)
    for _ in range(20):
        s.observe(4, TREE, 12, 0.06)
    s.observe(4, TREE, 12, 2.0)
    assert s.stats[(4, TREE)][1] == pytest.approx(0.06 + 0.05 * 0.12)


def test_capped_rounds_are_timed_but_say_nothing_of_the_tree():
    """A round where a row stopped at its max_tokens (or the context) counts for the time, not
    for the tokens per row; a candidate with only such rounds stays young (tried in turn)."""
    s = MeasuredSchedule([TREE, PLAIN], min_rounds=1)
    s.observe(1, TREE, 3, 0.1)
    s.observe(1, TREE, 1, 0.1, capped=True)  # a request of one more token
    assert s.tokens_per_row(TREE) == 3 and s.stats[(1, TREE)][0] == 2
    s.observe(1, PLAIN, 1, 0.04, capped=True)
    assert s.tokens_per_row(PLAIN) is None and s.tree_for(1) == PLAIN  # still to be measured


def test_measured_schedule_parse():
    base = TREE
    assert MeasuredSchedule.parse("auto", base).trees() == [TREE, PLAIN]
    assert MeasuredSchedule.parse("auto:1/2/3,plain", base).trees() == [TreeConfig(1, 2, 3), PLAIN]
    with pytest.raises(Eagle3Error, match="'1/2' is not a tree"):
        MeasuredSchedule.parse("auto:1/2", base)
    with pytest.raises(Eagle3Error, match="min_rounds"):
        MeasuredSchedule([TREE], min_rounds=0)


def test_admissions_compile_ahead_of_time(spec_setup):
    """compile_admissions compiles one admission per prompt bucket up to the longest prompt the
    context lets in, running nothing; admitting prompts of every bucket then compiles nothing
    (JAX's backend-compile events, none while admitting; the session's compilation cache is off
    here, so a program it holds cannot stand in for one compiled ahead)."""
    import jax
    import jax.monitoring

    cfg = spec_setup[1]
    cache_on = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        _admit_without_compiling(spec_setup, cfg)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_on)


def _admit_without_compiling(spec_setup, cfg):
    import jax.monitoring

    eng = _engine(spec_setup, slots=2)
    assert eng.prompt_buckets() == [64, 128, 192, 256]  # max_context 256
    before = eng.state
    assert eng.compile_admissions() == 4 and eng.state is before
    eng.release(eng.admit("x", [1, 2, 3], 5))  # the release's own small program
    compiled, listening = [], [True]

    def on_duration(event: str, duration: float, **_) -> None:
        if listening[0] and event == "/jax/core/compile/backend_compile_duration":
            compiled.append(duration)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        for p in random_prompts(cfg.vocab_size, [64, 65, 150, 200], seed=5):
            eng.release(eng.admit("x", p, 5))
    finally:
        listening[0] = False
    assert compiled == []


def test_plain_rounds_encode_the_pairs_e_at_a_time(spec_setup):
    """With a head, a plain round leaves the draft cache alone and appends its pair to the
    waiting ones until a running row holds E of them; the next plain round encodes them all at
    once (the buffer back to the new pair alone). A speculative round then drafts from the whole
    context: greedy tokens equal decoding alone, however the plain and speculative rounds
    interleave (test_tree_by_occupancy_greedy_equals_alone)."""
    cfg = spec_setup[1]
    eng = _engine(spec_setup, slots=2, schedule=TreeSchedule.parse("1-:plain", TREE))
    e = eng.state.enc_tok.shape[1]  # TREE's depth + 1
    (prompt,) = random_prompts(cfg.vocab_size, [9], seed=7)
    eng.admit("a", prompt, 20)
    seen = []
    for _ in range(2 * e):
        before = np.asarray(eng.state.dcache["k"])
        eng.step()
        changed = not np.array_equal(before, np.asarray(eng.state.dcache["k"]))
        seen.append((int(eng.state.enc_n[0]), changed))
    # admitted with one pair; rounds 1 .. E-1 append; round E finds E pairs and encodes them
    assert seen[: e + 1] == [(n, False) for n in range(2, e + 1)] + [(1, True), (2, False)]


def test_auto_adds_the_cost_models_tree_on_a_known_accelerator(spec_setup):
    """`auto`'s candidates: the tree flags' tree and plain rounds on a CPU; on an H200 also the
    cost model's best tree for the slots (a valid tree of the head's draft ids)."""
    from eagle3_jax.accelerators import predict
    from eagle3_jax.cli import serve

    _, cfg, _, dcfg, _ = spec_setup
    assert serve.auto_candidates(TREE, cfg, dcfg, 4, 256, "cpu") == [TREE, PLAIN]
    got = serve.auto_candidates(TREE, cfg, dcfg, 4, 256, "NVIDIA H200", 4)
    assert got[0] == TREE and got[-1] == PLAIN and 2 <= len(got) <= 3
    best = predict.serving_tree(predict.DEVICES["H200"], cfg, dcfg, 4, 256, dtype_bytes=4)
    assert best.tree in got and best.tree.validate(dcfg.draft_vocab_size) == best.tree
    assert predict.device_spec("TPU v5 lite").name == "TPU v5e"


def test_ignore_eos_goes_on_past_eos(spec_setup):
    """Two requests for one prompt in an engine whose EOS is a token the greedy output reaches:
    the one without ignore_eos stops there (EOS emitted, reason eos); the one with it goes on to
    its max_tokens with exactly the tokens of decoding with no EOS at all."""
    params, cfg, dparams, dcfg, vocab = spec_setup
    prompt = random_prompts(cfg.vocab_size, [7], seed=29)[0]
    free = spec_generate(params, cfg, dparams, dcfg, vocab, [prompt], 12, TREE, eos_ids=())
    out = free.output_ids[0]
    k = next(i for i in range(2, 12) if out[i] not in out[:i])  # its first occurrence
    opts = DecodeOptions("eagle3", NEW, TREE, eos_ids=(out[k],), max_context=256)
    eng = SlotEngine(Target(params, cfg, None, None), Head(dparams, dcfg, vocab), opts, 2)
    eng.admit("stops", prompt, 12)
    eng.admit("goes on", prompt, 12, ignore_eos=True)
    got, why = {"stops": [], "goes on": []}, {}
    for _ in range(40):
        for u in eng.step():
            got[u.request] += u.new_ids
            if u.finish_reason:
                why[u.request] = u.finish_reason
        if len(why) == 2:
            break
    assert (got["stops"], why["stops"]) == (out[: k + 1], "eos")
    assert (got["goes on"], why["goes on"]) == (out, "max_tokens")


def _until_all_end(eng, names, rounds=60):
    """Rounds until every admitted request in `names` has ended: ({name: tokens}, {name:
    finish reason})."""
    got, why = {r: [] for r in names}, {}
    for _ in range(rounds):
        for u in eng.step():
            got[u.request] += u.new_ids
            why[u.request] = u.finish_reason
        if all(why.get(r) for r in names):
            return got, why
    raise AssertionError(f"not all ended after {rounds} rounds: {why}")


def test_logit_bias_and_min_tokens_are_transformers_processing(spec_setup, hf_checkpoint):
    """Side by side in one engine, greedy: a request with logit_bias (its second token barred at
    -100, another token raised) gives transformers' greedy `generate` with that `sequence_bias`,
    and one with min_tokens past the EOS its output reaches gives `generate` with
    `min_new_tokens` (EOS barred until then, then stopping at it): the draft proposes from the
    unbiased head and verification applies the request's processing, token for token. A sampled
    request with +100 on one token (OpenAI's exclusive selection) draws nothing else."""
    import torch

    params, cfg, dparams, dcfg, vocab = spec_setup
    model, _ = hf_checkpoint("llama")
    prompt = random_prompts(cfg.vocab_size, [7], seed=29)[0]
    with torch.no_grad():
        out = hf_greedy(model, prompt, 12)
    k = next(i for i in range(2, 8) if out[i] not in out[:i])  # EOS: a token it reaches
    eos, raised = out[k], next(t for t in range(3, cfg.vocab_size) if t not in out)
    bias = {out[1]: -100.0, raised: 0.05}
    opts = DecodeOptions("eagle3", NEW, TREE, eos_ids=(eos,), max_context=256)
    eng = SlotEngine(Target(params, cfg, None, None), Head(dparams, dcfg, vocab), opts, 3)
    eng.admit("bias", prompt, 12, logit_bias=bias, ignore_eos=True)
    eng.admit("min", prompt, 12, min_tokens=k + 3)
    eng.admit("only", prompt, 10, seed=3, sampling=Sampling(temperature=1.0),
              logit_bias={raised: 100.0})  # fmt: skip
    got, why = _until_all_end(eng, ["bias", "min", "only"])
    with torch.no_grad():
        ids = torch.tensor([prompt])
        biased = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                pad_token_id=0, eos_token_id=None,
                                sequence_bias={(t,): b for t, b in bias.items()})  # fmt: skip
        held = model.generate(ids, max_new_tokens=12, min_new_tokens=k + 3, do_sample=False,
                              pad_token_id=0, eos_token_id=eos)  # fmt: skip
    assert got["bias"] == biased[0, len(prompt) :].tolist() and out[1] not in got["bias"]
    assert got["min"] == held[0, len(prompt) :].tolist() and eos not in got["min"][: k + 2]
    assert got["bias"][:2] != out[:2] and len(got["min"]) > k + 1  # both changed the output
    assert got["only"] == [raised] * 10 and why["only"] == "max_tokens"
    with pytest.raises(Eagle3Error, match="min_tokens 13"):
        eng.admit("x", prompt, 12, min_tokens=13)
    with pytest.raises(Eagle3Error, match="token id 97"):
        eng.admit("x", prompt, 12, logit_bias={97: 1.0})


def _penalized_greedy(params, cfg, prompt, n, rep=1.0, freq=0.0, pres=0.0):
    """Greedy decoding by full forwards with vLLM's penalties applied in numpy: the reference."""
    out, t = [], len(prompt) + n  # every pass padded to t: one compile
    q = jnp.arange(t)
    forward = jax.jit(lambda seq: tgt.forward(params, seq[None], q[None],
                                              (q[None, :] <= q[:, None])[None], cfg).logits[0])  # fmt: skip
    for _ in range(n):
        seq = prompt + out
        logits = forward(jnp.asarray(seq + [0] * (t - len(seq))))[len(seq) - 1]
        x = np.asarray(logits, np.float64)
        counts = np.bincount(out, minlength=cfg.vocab_size)
        seen = counts > 0
        seen[prompt] = True
        x = (
            np.where(seen, np.where(x > 0, x / rep, x * rep), x)
            - freq * counts
            - pres * (counts > 0)
        )
        out.append(int(x.argmax()))
    return out


def test_penalties_are_vllms_on_every_tree_node(spec_setup, hf_checkpoint):
    """Repetition, frequency and presence penalties, greedy, side by side with an unpenalised
    request, with prompt-lookup drafts (the tiny target repeats itself, so drafted tokens are
    accepted): each penalised request gives greedy decoding by full forwards with vLLM's
    formulas (the repetition one also transformers' `generate(repetition_penalty=...)`), which
    needs every tree node's logits penalised for the drafted tokens above it as output (without
    that, the frequency request's tokens differ); the unpenalised one gives decoding alone."""
    import torch

    from eagle3_jax.decoding.sampling import Penalties

    params, cfg, *_ = spec_setup
    model, _ = hf_checkpoint("llama")
    prompt, n = random_prompts(cfg.vocab_size, [7], seed=29)[0], 30
    opts = DecodeOptions("pld", NEW, TREE, eos_ids=(), max_context=256)
    eng = SlotEngine(Target(params, cfg, None, None), None, opts, 3)
    asks = {"rep": Penalties(repetition=1.05), "freq": Penalties(frequency=0.02, presence=0.01),
            "none": None}  # fmt: skip
    for name, pen in asks.items():
        eng.admit(name, prompt, n, sampling=Sampling(penalties=pen or Penalties()))
    got, why = _until_all_end(eng, list(asks))
    assert (jax.device_get(eng.state.accept_hist)[:2, 1:].sum(1) > 2).all()  # drafts accepted
    alone = spec_generate(params, cfg, None, None, None, [prompt], n, TREE, "pld", eos_ids=())
    assert got["none"] == alone.output_ids[0]
    assert got["rep"] == _penalized_greedy(params, cfg, prompt, n, rep=1.05) != got["none"]
    assert got["freq"] == _penalized_greedy(params, cfg, prompt, n, freq=0.02, pres=0.01)
    assert got["freq"] != got["none"]
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0, eos_token_id=None,
                            repetition_penalty=1.05)  # fmt: skip
    assert got["rep"] == hf[0, len(prompt) :].tolist()
    with pytest.raises(Eagle3Error, match="repetition_penalty 0"):
        Penalties(repetition=0.0)


def test_free_and_finished_rows_leave_the_penalties_pass_off(spec_setup):
    """An empty engine's free rows are greedy and unpenalised (zeros would read as a repetition
    penalty of 0, keeping `process_logits`' pass on in every round), and a request's penalties
    and temperature are reset when it ends."""
    from eagle3_jax.decoding.sampling import Penalties

    eng = _engine(spec_setup, slots=2)
    rows = jax.device_get(eng.state.sampling)
    assert (rows.repetition == 1).all() and (rows.frequency == 0).all()
    assert (rows.temperature == 0).all() and (rows.top_p == 1).all()
    prompt = random_prompts(spec_setup[1].vocab_size, [5], seed=3)[0]
    eng.admit("a", prompt, 3, sampling=Sampling(0.7, penalties=Penalties(1.2, 0.1, 0.1)))
    while eng.busy():
        eng.step()
    rows = jax.device_get(eng.state.sampling)
    assert rows.repetition[0] == 1 and rows.frequency[0] == rows.presence[0] == 0
    assert rows.temperature[0] == 0
