"""Replay (decoding/replay.py): greedy speculative decoding replayed over the plain greedy answer
gives decoding's own rounds: the same accept length in every round, hence the same τ."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.checkpoints import Target
from eagle3_jax.checkpoints.eagle_format import save_draft
from eagle3_jax.checkpoints.heads import Head
from eagle3_jax.checkpoints.hf import load_hf
from eagle3_jax.cli.eval import main
from eagle3_jax.decoding import plain, replay
from eagle3_jax.decoding import speculative as spec
from eagle3_jax.decoding.drafters import eagle3_drafter
from eagle3_jax.decoding.generate import DecodeOptions, generate_ids
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.decoding.verify import forward_tree
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf
from eagle3_jax.models import target as tgt
from eagle3_jax.vocab import build_from_counts, identity

TREES = {
    "chain": TreeConfig(top_k=1, depth=4, total_tokens=5),
    "tree": TreeConfig(top_k=3, depth=3, total_tokens=9),
    "adaptive": TreeConfig(top_k=2, depth=3, total_tokens=4, verify_threshold=0.3),
    "k10d8n60": TreeConfig(top_k=10, depth=8, total_tokens=60),
}
NEW = 40
# (drafter, tree): the random head accepts little, the guided one (below) long paths
CASES = [("eagle3", "chain"), ("eagle3", "k10d8n60")] + [
    ("guided", t) for t in ("chain", "tree", "adaptive", "k10d8n60")
]


@pytest.fixture(scope="module")
def setup(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    params, cfg = load_hf(path)
    counts = np.random.default_rng(1).integers(0, 100, cfg.vocab_size)
    vocab = build_from_counts(counts, 60)
    dcfg = drf.DraftConfig.from_target(cfg, draft_vocab_size=60)
    dparams = drf.init_params(dcfg, jax.random.PRNGKey(0), scale=0.2)
    return Target(params, cfg, None, None), Head(dparams, dcfg, vocab)


def _prompts(v, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, v, size=n))) for n in lengths]


def _guided(dparams, embed, vocab, state, dcfg, shape, tree):
    """The EAGLE-3 drafter's tree (read from the target's features like any other), with the
    first child of each node turned into the true greedy token except at every fourth (output
    position, node) pair: long and partial acceptances, as a trained head's are (a random head on
    a random target accepts almost nothing). The rule reads positions, not the draft's scores:
    a score threshold would flip on the last bits in which replay's features differ from
    decoding's (docs/replay.md), which no trained head's argmax notices."""
    trees, dcache = eagle3_drafter(dparams, embed, vocab, state, dcfg, shape, tree)
    ref = dparams["ref"]  # [B, R] the greedy continuation, output index by output index
    n1 = trees.tokens.shape[1]
    i = jnp.arange(n1)
    same = trees.parent[:, :, None] == trees.parent[:, None, :]
    first = ~jnp.any(same & (i[None, None, :] < i[None, :, None]) & (i > 0), axis=2) & (i > 0)
    idx = jnp.minimum(state.num_new[:, None] - 1 + trees.depth, ref.shape[1] - 1)
    keep = (idx * 5 + i) % 4 != 0
    true = jnp.take_along_axis(ref, idx, axis=1)
    return trees._replace(tokens=jnp.where(first & keep, true, trees.tokens)), dcache


def _head(setup, method, prompts):
    """The head a method drafts with: the random head, or the guided one (the random head and
    the greedy continuation past any EOS)."""
    target, head = setup
    if method == "eagle3":
        return head
    ref = plain.generate(target.params, target.cfg, prompts, NEW + 16, eos_ids=()).output_ids
    table = jnp.asarray(np.array(ref, np.int32))
    return Head({**head.params, "ref": table}, head.cfg, head.vocab)


def _rounds(models, state, static, method, target_pass):
    """Rounds one at a time: (outputs, target passes, accept length of every round of each row)."""
    accepts = [[] for _ in range(state.root.shape[0])]
    while True:
        fin, hist = jax.device_get((state.finish, state.accept_hist))
        if (fin != 0).all():
            break
        state = spec.round_step(*models, state, *static, method, target_pass=target_pass)
        new = jax.device_get(state.accept_hist) - hist
        for b in np.flatnonzero(fin == 0):
            accepts[b].append(int(np.argmax(new[b])))
    tokens, n, fw = jax.device_get((state.tokens, state.num_new, state.forwards))
    return [list(map(int, tokens[b, : n[b]])) for b in range(len(n))], fw.tolist(), accepts


def _real(target, head, prompts, opts, tree):
    """Decoding's own rounds (the target verifies each tree), as generate_ids runs them."""
    req = plain.prepare(target.cfg, prompts, opts.max_new_tokens, opts.eos_ids, None, 0,
                        tree.round_slots + 1)  # fmt: skip
    static = (target.cfg, head.cfg, req.shape, tree, Sampling(), req.eos)
    models = (target.params, head.params, target.params["embed"], head.vocab)
    state = spec.prefill(*models, req.tokens, req.lengths, req.limit, jax.random.PRNGKey(0),
                         *static)  # fmt: skip
    return _rounds(models, state, static, opts.method, forward_tree)


def _three(target):
    """Three prompts of different lengths (one compiled shape for every test here)."""
    return _prompts(target.cfg.vocab_size, [5, 12, 9], seed=3)


@pytest.mark.parametrize(("method", "tree"), CASES, ids=[f"{m}-{t}" for m, t in CASES])
def test_replay_accepts_what_decoding_accepts_in_every_round(setup, method, tree):
    """Every round of every row accepts as many drafted tokens in replay as in decoding (and
    so τ, forwards and outputs are equal), batch of three prompts of different lengths."""
    target, _ = setup
    tree = TREES[tree]
    prompts = _three(target)
    head = _head(setup, method, prompts)
    opts = DecodeOptions(_guided if method == "guided" else "eagle3", NEW, tree, eos_ids=())
    answers = plain.generate(target.params, target.cfg, prompts, NEW, eos_ids=()).output_ids
    out, fw, accepts = _real(target, head, prompts, opts, tree)
    rp = replay.start(target, head, prompts, answers, opts)
    r_out, r_fw, r_accepts = _rounds(rp.models, rp.state, rp.static, rp.method, replay.oracle_pass)
    assert out == answers and r_out == answers
    assert r_accepts == accepts
    assert r_fw == fw
    if method == "guided":  # long acceptances, so the equality is not one of empty rounds
        assert max(max(a) for a in accepts) >= (1 if tree.verify_threshold else 3)


def test_replay_equals_decoding_through_an_eos(setup):
    """Answers that end at an EOS: decoding's last round may accept drafted tokens past it
    (counted, never emitted); replay's extension past the answer gives the same."""
    target, _ = setup
    tree = TREES["k10d8n60"]
    prompts = _three(target)
    free = plain.generate(target.params, target.cfg, prompts, NEW, eos_ids=()).output_ids
    eos = free[0][12]  # a token the first answer reaches
    head = _head(setup, "guided", prompts)
    opts = DecodeOptions(_guided, NEW, tree, eos_ids=(eos,))
    answers = plain.generate(target.params, target.cfg, prompts, NEW, eos_ids=(eos,)).output_ids
    assert answers[0][-1] == eos and len(answers[0]) <= 13
    out, fw, accepts = _real(target, head, prompts, opts, tree)
    rp = replay.start(target, head, prompts, answers, opts)
    r_out, r_fw, r_accepts = _rounds(rp.models, rp.state, rp.static, rp.method, replay.oracle_pass)
    assert out == answers and r_out == answers
    assert (r_accepts, r_fw) == (accepts, fw)


def test_replay_ids_gives_decodings_generation(setup):
    """The whole loop on device (`replay_ids`) against `generate_ids`: the same outputs, finish
    reasons, target passes, acceptance histograms, verified tokens and τ."""
    target, _ = setup
    tree = TREES["k10d8n60"]
    prompts = _three(target)
    head = _head(setup, "guided", prompts)
    opts = DecodeOptions(_guided, NEW, tree, eos_ids=())
    real = generate_ids(target, head, prompts, opts)
    rep = replay.replay_ids(target, head, prompts, real.output_ids, opts)
    assert rep.output_ids == real.output_ids
    assert rep.finish_reasons == real.finish_reasons
    assert rep.target_forwards == real.target_forwards
    np.testing.assert_array_equal(rep.accept_hist, real.accept_hist)
    assert rep.verified_tokens == real.verified_tokens
    assert rep.tau == real.tau > 1.5


def test_replay_refuses_what_is_not_the_greedy_answer(setup):
    target, head = setup
    prompts = _three(target)
    opts = DecodeOptions("eagle3", NEW, TREES["chain"], eos_ids=())
    ys = plain.generate(target.params, target.cfg, prompts, NEW, eos_ids=()).output_ids
    # the second answer's token 6 replaced by the one the target likes least after it
    p, y = prompts[1], ys[1]
    logits = np.asarray(jax.jit(lambda w, x: target_logits(w, x, target.cfg))(target.params, p + y))
    worst = int(np.argmin(logits[len(p) + 5]))
    with pytest.raises(Eagle3Error, match="answer 1's token 6 .* not the target's greedy answer"):
        replay.start(target, head, prompts, [ys[0], y[:6] + [worst] + y[7:], ys[2]], opts)
    with pytest.raises(Eagle3Error, match="answer 1 starts with token .* not the target's greedy"):
        replay.start(target, head, prompts, [ys[0], [worst] + y[1:], ys[2]], opts)
    with pytest.raises(Eagle3Error, match="answer 2 ends after 10 tokens .* whole greedy answer"):
        replay.start(target, head, prompts, [ys[0], y, ys[2][:10]], opts)
    with pytest.raises(Eagle3Error, match="only greedy decoding"):
        replay.start(
            target, head, prompts, ys, DecodeOptions("eagle3", NEW, sampling=Sampling(1.0))
        )
    replay.start(target, head, prompts, ys, opts)  # the answers themselves are taken


def target_logits(params, ids, cfg):
    """Logits [T, V] of one causal forward over ids (no cache)."""
    t = len(ids)
    pos = jnp.arange(t)[None]
    mask = jnp.tril(jnp.ones((t, t), bool))[None]
    return tgt.forward(params, jnp.asarray(ids)[None], pos, mask, cfg).logits[0]


QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["w5 w6 w7 w8 w5 w6 w7", "w9 w10 w11"]},
    {"question_id": 2, "category": "qa", "turns": ["w40 w41 w12 w40 w41"]},
]


@pytest.mark.slow  # 22-26 s: the engine-level replay tests above stay in the default suite
def test_eval_replay_records_decodings_tau(tiny_target_dir, tmp_path, capsys):
    """`eval --replay`: pld and eagle3 replayed over vanilla's answers (a two-turn question turn
    by turn) record what decoding them records, but the time; marked replayed. Replayed in
    batches of questions (the studies' untimed runs) they record the same again."""
    _, cfg = load_hf(tiny_target_dir)
    dcfg = drf.DraftConfig.from_target(cfg)
    head = tmp_path / "head"
    params = drf.init_params(dcfg, jax.random.PRNGKey(3), scale=0.2)
    save_draft(head, params, dcfg, identity(cfg.vocab_size), dtype="float32")
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    common = ["--target", str(tiny_target_dir), "--draft", str(head), "--bench", str(qfile),
              "--methods", "vanilla,pld:1,3,4,eagle3:3,3,9", "--max-new-tokens", "16",
              "--no-progress"]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "real")]) == 0
    assert main([*common, "--out", str(tmp_path / "replay"), "--replay"]) == 0
    batched = ["--out", str(tmp_path / "batched"), "--replay", "--batch-size", "2"]
    assert main([*common, *batched]) == 0
    real, rep, bat = (
        json.loads((tmp_path / d / "results.json").read_text())
        for d in ("real", "replay", "batched")
    )
    same = ("output_ids", "new_tokens", "target_forwards", "accept_hist", "verified_tokens", "tau")
    assert len(real["records"]) == len(rep["records"]) == len(bat["records"]) == 6
    key = lambda r: (r["question_id"], r["method"])  # noqa: E731
    batched_by = {key(r): r for r in bat["records"]}
    for a, b in zip(real["records"], rep["records"]):
        assert key(a) == key(b)
        assert {k: a[k] for k in same} == {k: b[k] for k in same}
        assert {k: a[k] for k in same} == {k: batched_by[key(a)][k] for k in same}
        assert b.get("replayed") is (True if b["method"] != "vanilla" else None)
    by = rep["summary"]["by_method"]
    assert by["eagle3:3,3,9"]["replayed"] and not by["vanilla"]["replayed"]
    assert by["eagle3:3,3,9"]["overall"]["speedup"]["mean"] is None
    assert "| eagle3:3,3,9 (τ replayed) |" in (tmp_path / "replay" / "report.md").read_text()
    capsys.readouterr()
    nb = ["--methods", "eagle3:3,3,9", "--replay", "--no-baseline"]
    assert main([*common, "--out", str(tmp_path / "x"), *nb]) == 2
    assert "drop --no-baseline" in capsys.readouterr().err
