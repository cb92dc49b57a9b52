"""vocab/methods.py: token counts, FR-Spec and VocabTrim heads (training-free), extended heads and
cut orders, lossless (the mapping they build: tests/test_vocab.py)."""

import gzip
import json

import jax
import numpy as np
import pytest

from eagle3_jax import vocab as vocab_lib
from eagle3_jax.checkpoints import load_target
from eagle3_jax.checkpoints.eagle_format import load_draft, save_draft
from eagle3_jax.checkpoints.heads import Head, load_head
from eagle3_jax.cli.vocab import main
from eagle3_jax.decoding import plain
from eagle3_jax.decoding.generate import DecodeOptions, generate_ids
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf
from eagle3_jax.models import draft_output
from eagle3_jax.vocab.methods import extend_head, top_ids, trim_head


def test_top_ids_ties_forced_and_sorted():
    counts = np.array([5, 9, 9, 0, 1, 9, 2])
    assert top_ids(counts, 3).tolist() == [1, 2, 5]  # ties to the lower id
    assert top_ids(counts, 3, forced=(3,)).tolist() == [1, 2, 3]  # forced in, then the best
    assert top_ids(counts, 7).tolist() == list(range(7))
    with pytest.raises(Eagle3Error, match="between 1"):
        top_ids(counts, 0)


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(tiny_target_dir)


def _heads(target, tmp_path):
    """A full head on the target's output embedding (FR-Spec's source) and one with its own
    full-vocabulary lm_head (VocabTrim's source), saved."""
    cfg = target.cfg
    out = {}
    for name, source in (("tied", "target"), ("full", "own")):
        dcfg = drf.DraftConfig.from_target(cfg, lm_head_source=source)
        params = drf.init_params(dcfg, jax.random.PRNGKey(4), scale=0.2)
        save_draft(tmp_path / name, params, dcfg, vocab_lib.identity(cfg.vocab_size), "float32")
        out[name] = tmp_path / name
    return out


def _corpus(path, question, answers):
    """A ShareGPT-style jsonl file: one conversation per answer, all to the same question."""
    recs = [
        {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": a}]}
        for a in answers
    ]
    path.write_text("\n".join(json.dumps(r) for r in recs))
    return path


def test_count_and_trim_end_to_end(target, tiny_target_dir, tmp_path):
    corpus = _corpus(tmp_path / "c.jsonl", "w7 w7 w8", ["w5 w6 w5", "w5 w9", "w10 w5 w6"])
    counts_path = tmp_path / "counts.npy"
    assert main(["count", "--target", str(tiny_target_dir), "--corpus", str(corpus),
                 "--out", str(counts_path)]) == 0  # fmt: skip
    counts = np.load(counts_path)
    tok = target.tokenizer
    ids = {w: tok.convert_tokens_to_ids(w) for w in ("w5", "w6", "w7", "w9", "w10")}
    assert counts[ids["w5"]] == 4 and counts[ids["w6"]] == 2 and counts[ids["w9"]] == 1
    assert counts[ids["w7"]] == 0  # only assistant messages by default
    assert json.loads(counts_path.with_suffix(".json").read_text())["tokens"] == counts.sum()
    heads = _heads(target, tmp_path)
    prompts = [[5, 9, 11, 5, 9], [40, 41, 12]]
    ref = plain.generate(target.params, target.cfg, prompts, 24, eos_ids=())
    for name in ("tied", "full"):
        new = tmp_path / f"{name}_trim"
        argv = ["trim", "--target", str(tiny_target_dir), "--draft", str(heads[name]),
                "--counts", str(counts_path), "--size", "6", "--out", str(new),
                "--dtype", "float32"]  # fmt: skip
        assert main(argv) == 0
        p, c, v, _ = load_draft(new, target.cfg)
        assert c.draft_vocab_size == 6 and c.lm_head_source == "own"
        chosen = set(vocab_lib.target_ids(v).tolist())
        assert {ids["w5"], ids["w6"], ids["w9"], ids["w10"]} <= chosen
        assert set(target.cfg.eos_token_ids) <= chosen  # EOS forced in
        # lossless: the trimmed head decodes exactly what plain decoding does
        opts = DecodeOptions("eagle3", 24, TreeConfig(2, 3, 6), eos_ids=())
        out = generate_ids(target, Head(p, c, v), prompts, opts)
        assert out.output_ids == ref.output_ids
    bad = np.zeros(7)
    np.save(tmp_path / "bad.npy", bad)
    argv = ["trim", "--target", str(tiny_target_dir), "--draft", str(heads["tied"]),
            "--counts", str(tmp_path / "bad.npy"), "--size", "6", "--out", str(tmp_path / "x")]  # fmt: skip
    assert main(argv) == 2


@pytest.mark.parametrize("source", ["target", "own"])
def test_trimmed_logits_are_the_full_heads_on_the_subset(target, tmp_path, source):
    """FR-Spec = the target's output rows, VocabTrim = the head's own columns: the trimmed head's
    logits equal the full head's at the kept ids, so its choices are the full head's restricted."""
    head = _heads(target, tmp_path)["tied" if source == "target" else "full"]
    params, cfg, vocab, _ = load_head(head, target)
    ids = np.array([3, 5, 8, 13, 21, 34])
    p2, c2, v2 = trim_head(params, cfg, vocab, target.params, target.cfg, ids)
    h = jax.random.normal(jax.random.PRNGKey(0), (2, 4, cfg.hidden_size))
    full = np.asarray(draft_output.head_logits(params, h, cfg))
    np.testing.assert_allclose(
        draft_output.head_logits(p2, h, c2), full[..., ids], rtol=1e-5, atol=1e-5
    )
    score, tok = draft_output.draft_topk(p2, h, c2, v2, 3)
    sub = full[..., ids]
    want = ids[np.argsort(-sub, axis=-1, kind="stable")[..., :3]]
    assert (np.asarray(tok) == want).all()
    # a reduced head trims to a subset of its ids: the same head as trimming the source directly
    sub_ids = ids[[0, 2, 5]]
    p3, c3, v3 = trim_head(p2, c2, v2, target.params, target.cfg, sub_ids)
    p4, c4, v4 = trim_head(params, cfg, vocab, target.params, target.cfg, sub_ids)
    assert c3 == c4 and (vocab_lib.target_ids(v3) == sub_ids).all()
    np.testing.assert_array_equal(p3["lm_head"], p4["lm_head"])
    with pytest.raises(Eagle3Error, match="1 of the 3 ids to keep are not in the head's draft"):
        trim_head(p2, c2, v2, target.params, target.cfg, np.array([3, 4, 5]))


def test_speculator_recall_benchmark(target, tiny_target_dir, tmp_path):
    """benchmarks/speculator_recall.py: a full-rank SVD speculator ranks exactly as the exact
    logits (head@1 = 1), every k = V recall is 1 and top1@V is the exact top-1; a rank-2 one
    recalls less at small k, monotonically in k."""
    import importlib.util
    from pathlib import Path

    spec_ = importlib.util.spec_from_file_location(
        "speculator_recall", Path(__file__).resolve().parents[1] / "benchmarks/speculator_recall.py"
    )
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    cfg = target.cfg
    v, d = cfg.vocab_size, cfg.hidden_size
    heads = []
    for name, rank in (("full_rank", d), ("rank2", 2)):
        dcfg = drf.DraftConfig.from_target(
            cfg, lm_head_source="target", speculator_rank=rank, spec_candidates=v
        )
        params = drf.init_params(dcfg, jax.random.PRNGKey(4), scale=0.2)
        params = drf.init_speculator_svd(params, target.params, cfg, dcfg)
        save_draft(tmp_path / name, params, dcfg, vocab_lib.identity(v), "float32")
        heads += ["--draft", f"{name}={tmp_path / name}"]
    answers = ["w5 w6 w5 w11 w12 w30", "w5 w9 w40 w41 w42", "w10 w5 w6 w60 w61 w62 w63"]
    data = _corpus(tmp_path / "c.jsonl", "w7 w8 w9", answers)
    out = tmp_path / "recall.json"
    argv = ["--target", str(tiny_target_dir), "--data", str(data), "--records", "0:3",
            "--k", f"1,4,{v}", "--max-len", "64", "--out", str(out), *heads]  # fmt: skip
    assert mod.main(argv) == 0
    rows = {r["head"]: r for r in json.loads(out.read_text())["rows"]}
    assert "| full_rank |" in out.with_suffix(".md").read_text()
    for r in rows.values():
        assert r["positions"] > 10
        assert r[f"head@{v}"] == r[f"target@{v}"] == 1.0
        assert r[f"top1@{v}"] == r["exact_top1"]
        assert r["head@1"] <= r["head@4"] <= r[f"head@{v}"]
        assert r["target@1"] <= r["target@4"] <= r[f"target@{v}"]
    assert rows["full_rank"]["head@1"] == 1.0
    assert rows["rank2"]["head@1"] < 1.0
    with pytest.raises(Eagle3Error, match="no speculator"):
        mod.main(["--target", str(tiny_target_dir), "--data", str(data), "--records", "0:3",
                  "--draft", str(_heads(target, tmp_path)["tied"])])  # fmt: skip


def _reduced_head(target, ids, seed=6):
    """A reduced head (own lm_head over `ids`) whose rows are the target's output rows through a
    known linear map: what extend must recover for the ids it adds."""
    cfg = drf.DraftConfig.from_target(target.cfg, draft_vocab_size=len(ids))
    params = drf.init_params(cfg, jax.random.PRNGKey(seed), scale=0.2)
    out = np.asarray(draft_output.target_output_embedding(target.params, target.cfg))
    m = np.eye(cfg.hidden_size) * 0.7 + 0.05 * np.random.default_rng(seed).normal(
        size=(cfg.hidden_size, cfg.hidden_size)
    )
    params["lm_head"] = np.asarray((out[ids] @ m).T, np.float32)
    return params, cfg, vocab_lib.from_target_ids(ids, cfg.vocab_size), out, m


def test_extend_keeps_trained_rows_and_maps_the_targets_for_new_ids(target):
    ids = np.arange(3, 93)  # 90 of the 97 ids
    params, cfg, vocab, out, m = _reduced_head(target, ids)
    grown = np.arange(0, 97)
    p2, c2, v2, fit = extend_head(params, cfg, vocab, target.params, target.cfg, grown, 1e-9)
    assert c2.draft_vocab_size == 97 and vocab_lib.target_ids(v2).tolist() == grown.tolist()
    lm = np.asarray(p2["lm_head"]).T
    np.testing.assert_array_equal(lm[ids], np.asarray(params["lm_head"]).T)  # trained rows kept
    new = np.setdiff1d(grown, ids)
    np.testing.assert_allclose(lm[new], out[new] @ m, rtol=1e-4, atol=1e-4)  # the map recovered
    assert fit["held_out_residual"] < 1e-4 and fit["residual"] < 1e-4
    with pytest.raises(Eagle3Error, match="leaves out 3"):
        extend_head(params, cfg, vocab, target.params, target.cfg, np.arange(6, 97))
    with pytest.raises(Eagle3Error, match="does not grow"):
        extend_head(params, cfg, vocab, target.params, target.cfg, ids)
    full = drf.DraftConfig.from_target(target.cfg, lm_head_source="target")
    with pytest.raises(Eagle3Error, match="already drafts over the whole vocabulary"):
        extend_head(params, full, vocab, target.params, target.cfg, grown)


def test_extend_end_to_end_is_lossless(target, tiny_target_dir, tmp_path, capsys):
    corpus = _corpus(tmp_path / "c.jsonl", "w7", ["w50 w51 w50", "w52 w50"])
    counts_path = tmp_path / "counts.npy"
    assert main(["count", "--target", str(tiny_target_dir), "--corpus", str(corpus),
                 "--out", str(counts_path)]) == 0  # fmt: skip
    tok = target.tokenizer
    added = [tok.convert_tokens_to_ids(w) for w in ("w50", "w51", "w52")]
    ids = np.setdiff1d(np.arange(3, 97), added + list(target.cfg.eos_token_ids))
    params, cfg, vocab, _, _ = _reduced_head(target, ids)
    save_draft(tmp_path / "small", params, cfg, vocab, "float32")
    size = ids.size + 3 + len(set(target.cfg.eos_token_ids) - set(ids.tolist()))
    argv = ["extend", "--target", str(tiny_target_dir), "--draft", str(tmp_path / "small"),
            "--counts", str(counts_path), "--size", str(size), "--out", str(tmp_path / "big"),
            "--dtype", "float32"]  # fmt: skip
    assert main(argv) == 0
    p, c, v, _ = load_draft(tmp_path / "big", target.cfg)
    chosen = set(vocab_lib.target_ids(v).tolist())
    assert c.draft_vocab_size == size and set(ids.tolist()) | set(added) <= chosen
    assert set(target.cfg.eos_token_ids) <= chosen  # EOS forced in
    prompts = [[50, 51, 50, 52], [40, 41, 12]]
    ref = plain.generate(target.params, target.cfg, prompts, 20, eos_ids=())
    opts = DecodeOptions("eagle3", 20, TreeConfig(2, 3, 6), eos_ids=())
    out = generate_ids(target, Head(p, c, v), prompts, opts)
    assert out.output_ids == ref.output_ids
    argv[argv.index("--size") + 1] = str(ids.size)
    assert main(argv) == 2  # does not grow: a clear error, exit 2
    # trim undoes extend: --like the small head gives back exactly its ids and rows
    base = ["trim", "--target", str(tiny_target_dir), "--draft", str(tmp_path / "big"),
            "--dtype", "float32"]  # fmt: skip
    assert main(base + ["--like", str(tmp_path / "small"), "--out", str(tmp_path / "back")]) == 0
    p2, c2, v2, _ = load_draft(tmp_path / "back", target.cfg)
    assert c2.draft_vocab_size == cfg.draft_vocab_size
    assert (vocab_lib.target_ids(v2) == vocab_lib.target_ids(vocab)).all()
    np.testing.assert_array_equal(p2["lm_head"], params["lm_head"])
    # by counts, a reduced head keeps the most frequent of its own ids (EOS forced in)
    argv = base + ["--counts", str(counts_path), "--size", "5", "--out", str(tmp_path / "top")]
    assert main(argv) == 0
    kept = set(vocab_lib.target_ids(load_draft(tmp_path / "top", target.cfg)[2]).tolist())
    assert set(added) | set(target.cfg.eos_token_ids) <= kept and kept <= chosen
    capsys.readouterr()
    assert main(argv[:-4] + ["--size", str(size + 1), "--out", str(tmp_path / "x")]) == 2
    assert "exceeds the head's draft vocabulary" in capsys.readouterr().err
    assert main(argv + ["--like", str(tmp_path / "small")]) == 2  # one way of choosing, not both
    assert "not both" in capsys.readouterr().err


def test_vocab_coverage_benchmark(tmp_path):
    """benchmarks/vocab_coverage.py reads answers from a harness results.json (one method's
    records) and from a data file's output_ids (flat or per turn), and counts membership."""
    import importlib.util
    from pathlib import Path

    spec_ = importlib.util.spec_from_file_location(
        "vocab_coverage", Path(__file__).resolve().parents[1] / "benchmarks/vocab_coverage.py"
    )
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    results = {"config": {}, "records": [
        {"method": "vanilla", "output_ids": [[5, 6], [7]]},
        {"method": "eagle3", "output_ids": [[5, 6], [7]]},  # the same text: not counted twice
        {"method": "vanilla", "output_ids": [[8]]},
    ]}  # fmt: skip
    (tmp_path / "r.json").write_text(json.dumps(results))
    assert mod.answer_tokens(tmp_path / "r.json").tolist() == [5, 6, 7, 8]
    with gzip.open(tmp_path / "results.json.gz", "wt") as f:  # as benchmarks/results commits them
        json.dump(results, f)
    assert mod.answer_tokens(tmp_path / "results.json.gz").tolist() == [5, 6, 7, 8]
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")  # a damaged file: one clear line
    with pytest.raises(Eagle3Error, match="cannot read evaluation results .*bad.json.gz"):
        mod.answer_tokens(tmp_path / "bad.json.gz")
    lines = [{"id": "a", "output_ids": [9, 5]}, {"id": "b", "output_ids": [[6], [6, 4]]},
             {"id": "c", "turn_output_ids": [[3], [2]]}]  # fmt: skip
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    toks = mod.answer_tokens(tmp_path / "d.jsonl")
    assert toks.tolist() == [9, 5, 6, 6, 4, 3, 2]
    assert mod.coverage(toks, np.array([5, 6]), 10) == 3 / 7
    (tmp_path / "e.jsonl").write_text(json.dumps({"id": "x", "conversations": []}) + "\n")
    with pytest.raises(Eagle3Error, match="no answer token ids"):
        mod.answer_tokens(tmp_path / "e.jsonl")
    with pytest.raises(Eagle3Error, match="does not exist"):
        mod.answer_tokens(tmp_path / "missing.json")


def test_vocab_order_cuts_a_head_at_load_to_the_head_it_was_grown_from(
    target, tiny_target_dir, tmp_path, capsys
):
    """`order --first` puts the ids of the head a larger one was grown from first; cut to that
    many at load (decode.py's --draft-vocab, "auto" on the CPU with --cpu-size), the larger head
    is exactly the head `trim --like` writes, and `trim --size` without counts writes it too."""
    from eagle3_jax.checkpoints.heads import cut_size, read_vocab_order, write_vocab_order

    v = target.cfg.vocab_size
    counts = np.random.default_rng(0).integers(0, 50, v)
    np.save(tmp_path / "c.npy", counts)
    full = _heads(target, tmp_path)["full"]
    params, cfg, vocab, _ = load_head(full, target)
    (eos,) = target.cfg.eos_token_ids
    others = np.random.default_rng(1).choice(np.setdiff1d(np.arange(v), [eos]), 13, replace=False)
    big_ids = np.sort(np.append(others, eos))
    counts[eos] = 0  # the rarest id: only the forcing puts it first
    # the "grown from" head: EOS and the 5 of big's ids the counts rank LAST (so --first must win)
    small_ids = np.sort(np.append(others[np.argsort(counts[others], kind="stable")[:5]], eos))
    for name, ids in (("big", big_ids), ("small", small_ids)):
        p, c, vv = trim_head(params, cfg, vocab, target.params, target.cfg, ids)
        save_draft(tmp_path / name, p, c, vv, "float32")
    big, small = tmp_path / "big", tmp_path / "small"
    base = ["--target", str(tiny_target_dir)]
    assert main(["order", *base, "--draft", str(big), "--counts", str(tmp_path / "c.npy"),
                 "--first", str(small), "--cpu-size", "6"]) == 0  # fmt: skip
    meta = read_vocab_order(big, load_draft(big)[2])
    assert set(meta["order"][:6].tolist()) == set(small_ids.tolist()) and meta["cpu_size"] == 6
    rest = meta["order"][6:]
    assert set(rest.tolist()) == set(big_ids.tolist()) - set(small_ids.tolist())
    assert (np.diff(counts[rest]) <= 0).all()  # then by descending count
    assert meta["order"][0] == eos  # EOS first: every cut keeps it
    assert [counts[i] for i in meta["order"][1:6]] == sorted(counts[small_ids], reverse=True)[:5]

    cut = load_head(big, target, draft_vocab=6)
    like = load_head(small, target)
    assert cut[1] == like[1] and (cut[2].d2t == like[2].d2t).all()
    jax.tree.map(np.testing.assert_array_equal, cut[0], like[0])
    auto = load_head(big, target, draft_vocab="auto")  # the CPU backend: the head's cpu_size
    assert auto[1].draft_vocab_size == (6 if jax.default_backend() == "cpu" else 14)
    assert load_head(big, target)[1].draft_vocab_size == 14  # the library default: every id
    assert cut_size("auto", big, load_draft(big)[2], "gpu") == (None, None)
    # the cut head is lossless like any other
    prompts = [[5, 9, 11, 5, 9], [40, 41, 12]]
    ref = plain.generate(target.params, target.cfg, prompts, 16, eos_ids=())
    opts = DecodeOptions("eagle3", 16, TreeConfig(2, 3, 6), eos_ids=())
    out = generate_ids(target, Head(*cut[:3]), prompts, opts)
    assert out.output_ids == ref.output_ids
    # trim --size N by the order, no counts: the same file as trimming --like the small head
    for flag, val, out_dir in (("--size", "6", "a"), ("--like", str(small), "b")):
        assert main(["trim", *base, "--draft", str(big), flag, val, "--dtype", "float32",
                     "--out", str(tmp_path / out_dir)]) == 0  # fmt: skip
    a, b = (tmp_path / d / "model.safetensors" for d in "ab")
    assert a.read_bytes() == b.read_bytes()
    # FR-Spec: a head on the target's output embedding is cut to the target's rows of its ids
    tied = _heads(target, tmp_path)["tied"]
    write_vocab_order(tied, np.arange(v)[::-1], None)
    tp, tc, tv, _ = load_head(tied, target)
    want = trim_head(tp, tc, tv, target.params, target.cfg, np.arange(v - 5, v))
    got = load_head(tied, target, draft_vocab=5)
    assert got[1] == want[1] and got[1].lm_head_source == "own"
    np.testing.assert_array_equal(got[0]["lm_head"], want[0]["lm_head"])
    assert load_head(tied, target, draft_vocab="auto")[1].draft_vocab_size == v  # no cpu_size

    # refusals: a size past Vd, a head without an order, an order of another head's ids
    capsys.readouterr()
    with pytest.raises(Eagle3Error, match=r"1\.\.14"):
        load_head(big, target, draft_vocab=15)
    with pytest.raises(Eagle3Error, match="has no vocab_order.json"):
        load_head(small, target, draft_vocab=3)
    assert load_head(small, target, draft_vocab="auto")[1].draft_vocab_size == 6  # none: all
    write_vocab_order(small, big_ids, 3)
    with pytest.raises(Eagle3Error, match="belongs to another head"):
        load_head(small, target, draft_vocab="auto")
    assert main(["order", *base, "--draft", str(big), "--counts", str(tmp_path / "c.npy"),
                 "--first", str(full)]) == 2  # fmt: skip
    assert "not the head's" in capsys.readouterr().err
    for head, size, msg in ((big, "14", "give 1..13"), (tmp_path / "a", "3", "give --counts")):
        argv = ["trim", *base, "--draft", str(head), "--size", size, "--out", str(tmp_path / "x")]
        assert main(argv) == 2 and msg in capsys.readouterr().err
    sv = drf.DraftConfig.from_target(target.cfg, lm_head_source="target", speculator_rank=2)
    save_draft(tmp_path / "sv", drf.init_params(sv, jax.random.PRNGKey(0)), sv,
               vocab_lib.identity(v), "float32")  # fmt: skip
    assert main(["order", *base, "--draft", str(tmp_path / "sv"), "--counts",
                 str(tmp_path / "c.npy")]) == 2  # fmt: skip
    assert "SpecVocab" in capsys.readouterr().err
