"""Training data: chat files, assistant-only loss masks from the chat template, resumable
regeneration, the .npz dataset, token counts and the resumable, sharded batch order."""

import copy
import gzip
import json
import sys

import numpy as np
import pytest
from conftest import write_tiny_tokenizer

from eagle3_jax.data import dataset as dsm
from eagle3_jax.data import masks
from eagle3_jax.data.conversations import first_user_turns, read_conversations
from eagle3_jax.data.regenerate import regenerate
from eagle3_jax.errors import Eagle3Error

TWO_TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome is the capital of Italy."},
]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from eagle3_jax.checkpoints import load_tokenizer, resolve_target

    return load_tokenizer(resolve_target(None))


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(d)
    return AutoTokenizer.from_pretrained(d)


def masked_runs(tokenizer, ids, mask):
    """The decoded text of each contiguous run of mask == 1 tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [tokenizer.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]


# ---- reading -------------------------------------------------------------------------------------


def test_reads_sharegpt_json_array_skipping_malformed_records(tmp_path):
    recs = [
        {
            "id": "a",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
        },
        {
            "id": "b",
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "gpt", "value": "orphan"},  # dropped: no prompt
                {"from": "human", "value": "q"},
                {"from": "chatgpt", "value": "r"},
                {"from": "bing", "value": "s"},
            ],
        },
        {"id": "c", "conversations": []},  # empty
        {"id": "d", "conversations": [{"from": "robot", "value": "x"}]},  # unknown role
        {"id": "e", "conversations": [{"from": "human", "value": 3}]},  # not text
        {"id": "f"},  # no turns
        "not a record",
        {"id": "a", "conversations": [{"from": "human", "value": "again"}]},  # repeated id
        {"conversations": [{"from": "human", "value": "no id"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(recs))
    convs, skipped = read_conversations(path)
    assert skipped == 5
    assert [c.id for c in convs] == ["a", "b", "a#2", "sg:8"]
    assert convs[0].messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    assert [m["role"] for m in convs[1].messages] == ["system", "user", "assistant", "assistant"]
    assert first_user_turns(convs) == [("a", "hi"), ("b", "q"), ("a#2", "again"), ("sg:8", "no id")]


def test_reads_role_content_and_sharegpt_jsonl_with_bad_lines(tmp_path):
    lines = [
        json.dumps(
            {
                "id": 7,
                "messages": [
                    {"role": "user", "content": "u"},
                    {"role": "assistant", "content": "v"},
                ],
            }
        ),
        '{"id": "cut", "messages": [{"role": "us',  # a partial line
        "",
        json.dumps({"id": "s", "conversations": [{"from": "human", "value": "w"}]}),
        json.dumps({"id": "x", "messages": "nope"}),
    ]
    path = tmp_path / "rc.jsonl"
    path.write_text("\n".join(lines) + "\n")
    convs, skipped = read_conversations(path)
    assert skipped == 2
    assert [c.id for c in convs] == ["7", "s"]
    assert convs[0].messages[1] == {"role": "assistant", "content": "v"}
    gz = tmp_path / "rc.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert read_conversations(gz) == (convs, skipped)
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(Eagle3Error, match="bad.jsonl.gz"):
        read_conversations(tmp_path / "bad.jsonl.gz")
    # JSON leaves U+2028, U+2029 and U+0085 raw inside strings when ensure_ascii=False, as the
    # regeneration writes, and str.splitlines cuts at them: a line must stay one record, and a
    # resume must still find its id
    odd = tmp_path / "odd.jsonl"
    rec = {"id": "u", "conversations": [{"from": "human", "value": "a\u2028b\x85c\u2029d"}]}
    odd.write_text(json.dumps(rec, ensure_ascii=False) + "\n", encoding="utf-8")
    assert len(odd.read_text(encoding="utf-8").splitlines()) == 4  # what the old reader saw
    (c,), bad = read_conversations(odd)
    assert bad == 0 and c.messages[0]["content"] == "a\u2028b\x85c\u2029d"
    from eagle3_jax.data.regen_output import prepare_resume

    assert prepare_resume(odd) == {"u"}
    # several files, comma-separated: concatenated in order, a repeated id renamed
    both, skipped2 = read_conversations(f"{path},{gz}")
    assert [c.id for c in both] == ["7", "s", "7#2", "s#2"] and skipped2 == 4
    # renaming never collides with a name an earlier file's renaming took
    twice = tmp_path / "twice.jsonl"
    twice.write_text(
        (json.dumps({"id": 7, "messages": [{"role": "user", "content": "u"}]}) + "\n") * 2
    )
    ids = [c.id for c in read_conversations(f"{twice},{path}")[0]]
    assert ids == ["7", "7#2", "7#3", "s"]
    assert both[2].messages == convs[0].messages
    # repeated="first": a file of whole conversations supersedes the same ids answered alone
    # later (a repeat inside one file is still renamed and kept)
    first, skipped3 = read_conversations(f"{twice},{path},{gz}", repeated="first")
    assert [c.id for c in first] == ["7", "7#2", "s"] and skipped3 == 4
    assert first[0].messages == [{"role": "user", "content": "u"}]
    with pytest.raises(Eagle3Error, match="repeated ids 'last'"):
        read_conversations(f"{path},{gz}", repeated="last")
    with pytest.raises(Eagle3Error, match="missing.jsonl"):
        read_conversations(f"{path},{tmp_path / 'missing.jsonl'}")


def test_unreadable_files_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"id": 1,')
    with pytest.raises(Eagle3Error, match="bad.json"):
        read_conversations(bad)
    with pytest.raises(Eagle3Error, match="missing.jsonl"):
        read_conversations(tmp_path / "missing.jsonl")
    junk = tmp_path / "junk.jsonl"
    junk.write_text("nothing\nhere\n")
    with pytest.raises(Eagle3Error, match="junk.jsonl.*no usable"):
        read_conversations(junk)


# ---- loss masks ----------------------------------------------------------------------------------


def test_mask_is_exactly_the_answers_under_the_default_chatml_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids, mask = masks.tokenize_conversation(tok, TWO_TURNS, 4096)
    assert ids.dtype == np.int32 and mask.dtype == np.int8 and ids.shape == mask.shape
    assert ids.tolist() == masks.template_ids(tok, TWO_TURNS)
    assert masked_runs(tok, ids, mask) == [
        "The capital of France is Paris.<|im_end|>",
        "Rome is the capital of Italy.<|im_end|>",
    ]
    # The template's inserted system prompt, user turns and headers are all unmasked.
    assert "You are a helpful AI assistant" in tok.decode(ids[mask == 0])
    assert tok.decode(ids[mask == 1]) == (
        "The capital of France is Paris.<|im_end|>Rome is the capital of Italy.<|im_end|>"
    )


def test_fallback_for_templates_that_rewrite_history_gives_the_same_mask(
    smollm2_tokenizer, monkeypatch
):
    tok = smollm2_tokenizer
    convo = [
        {"role": "system", "content": "Answer in one word."},
        *TWO_TURNS,
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "Paris"},
    ]
    ids, mask = masks.tokenize_conversation(tok, convo, 4096)
    monkeypatch.setattr(masks, "prefix_turn_bounds", lambda *a: None)
    ids2, mask2 = masks.tokenize_conversation(tok, convo, 4096)
    np.testing.assert_array_equal(ids, ids2)
    np.testing.assert_array_equal(mask, mask2)
    assert masked_runs(tok, ids, mask)[-1] == "Paris<|im_end|>"


def test_mask_under_the_tiny_trivial_template_and_truncation(tiny_tokenizer):
    convo = [
        {"role": "user", "content": "w5 w6"},
        {"role": "assistant", "content": "w7 w8"},
        {"role": "user", "content": "w9"},
        {"role": "assistant", "content": "w10"},
    ]
    ids, mask = masks.tokenize_conversation(tiny_tokenizer, convo, 64)
    # "<s> w5 w6 </s> <s> w7 w8 </s> <s> w9 </s> <s> w10 </s>"
    assert ids.tolist() == [1, 5, 6, 2, 1, 7, 8, 2, 1, 9, 2, 1, 10, 2]
    assert mask.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]
    ids6, mask6 = masks.tokenize_conversation(tiny_tokenizer, convo, 6)
    assert ids6.tolist() == ids[:6].tolist() and mask6.tolist() == mask[:6].tolist()
    ids_u, mask_u = masks.tokenize_conversation(tiny_tokenizer, convo[:1], 64)
    assert ids_u.size == 4 and not mask_u.any()


# ---- dataset -------------------------------------------------------------------------------------


def test_build_save_load_and_empty_records(tiny_tokenizer, tmp_path):
    convs = [
        [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6 w7"}],
        [{"role": "user", "content": "w8"}],  # no answer: skipped
        [
            {"role": "user", "content": " ".join(["w9"] * 7)},  # answer truncated away: skipped
            {"role": "assistant", "content": "w4"},
        ],
        [{"role": "user", "content": "w8"}, {"role": "assistant", "content": "w4"}],
    ]
    ds = dsm.build_dataset(tiny_tokenizer, convs, max_len=8, progress=False)
    assert (ds.skipped, ds.pad_id, ds.num_records, ds.max_len) == (2, 0, 2, 8)
    assert ds.input_ids.dtype == np.int32 and ds.loss_mask.dtype == np.int8
    assert ds.lengths.tolist() == [7, 6]
    assert ds.input_ids.tolist() == [[1, 5, 2, 1, 6, 7, 2, 0], [1, 8, 2, 1, 4, 2, 0, 0]]
    assert ds.loss_mask.tolist() == [[0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 0, 0]]
    path = dsm.save(ds, tmp_path / "sub" / "train.npz")
    assert sorted(p.name for p in path.parent.iterdir()) == ["train.npz"]  # no temp file left
    back = dsm.load(path)
    for name in ("input_ids", "loss_mask", "lengths"):
        np.testing.assert_array_equal(getattr(back, name), getattr(ds, name))
    assert (back.pad_id, back.skipped) == (ds.pad_id, ds.skipped)
    with pytest.raises(Eagle3Error, match="no assistant tokens"):
        dsm.build_dataset(tiny_tokenizer, convs[1:2], max_len=5, progress=False)
    (tmp_path / "x.npz").write_bytes(b"not a zip")
    with pytest.raises(Eagle3Error, match="x.npz"):
        dsm.load(tmp_path / "x.npz")


def test_conversations_the_template_refuses_are_skipped(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
        "{% endif %}" + tiny_tokenizer.chat_template
    )
    convs = [
        [
            {"role": "system", "content": "w3"},
            {"role": "user", "content": "w5"},
            {"role": "assistant", "content": "w6"},
        ],
        [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6"}],
    ]
    with pytest.raises(masks.UnrenderableConversation, match="user first"):
        masks.tokenize_conversation(tok, convs[0], 16)
    ds = dsm.build_dataset(tok, convs, max_len=16, progress=False)
    assert ds.skipped == 1 and ds.loss_mask.tolist() == [[0, 0, 0, 0, 1, 1] + [0] * 10]


def test_token_counts_on_a_hand_made_dataset():
    ds = dsm.TokenizedDataset(
        input_ids=np.array([[1, 5, 5, 7, 0], [1, 3, 7, 7, 7]], np.int32),
        loss_mask=np.array([[0, 1, 1, 1, 0], [0, 0, 1, 0, 1]], np.int8),
        lengths=np.array([4, 5], np.int32),
        pad_id=0,
    )
    counts = dsm.token_counts(ds, 10)
    assert counts.tolist() == [0, 0, 0, 0, 0, 2, 0, 3, 0, 0]
    with pytest.raises(Eagle3Error, match="vocabulary"):
        dsm.token_counts(ds, 6)


def _numbered(n, length=3):
    ids = np.arange(n, dtype=np.int32)[:, None].repeat(length, 1)
    return dsm.TokenizedDataset(ids, np.ones_like(ids, np.int8), np.full(n, length, np.int32), 0)


def test_batches_resume_and_shard():
    ds = _numbered(10)  # 3 steps per epoch at batch 3 (one record dropped per epoch)
    full = list(dsm.batches(ds, 3, seed=4, num_steps=10))
    assert [b.step for b in full] == list(range(10)) and [b.epoch for b in full[:4]] == [0, 0, 0, 1]
    firsts = [b.input_ids[:, 0].tolist() for b in full]
    epoch0 = sum(firsts[:3], [])
    assert len(set(epoch0)) == 9 and epoch0 != sorted(epoch0)  # shuffled, no repeats in an epoch
    assert sum(firsts[3:6], []) != epoch0  # a new order each epoch
    resumed = list(dsm.batches(ds, 3, seed=4, start_step=4, num_steps=6))
    assert [b.input_ids[:, 0].tolist() for b in resumed] == firsts[4:]
    assert list(dsm.batches(ds, 3, seed=5, num_steps=1))[0].input_ids[:, 0].tolist() != firsts[0]
    ds12 = _numbered(12)
    whole = [b.input_ids[:, 0].tolist() for b in dsm.batches(ds12, 4, seed=1, num_steps=5)]
    hosts = [
        [b.input_ids[:, 0].tolist() for b in dsm.batches(ds12, 4, 1, 0, p, 2, num_steps=5)]
        for p in range(2)
    ]
    assert [h0 + h1 for h0, h1 in zip(*hosts)] == whole
    with pytest.raises(Eagle3Error, match="multiple"):
        next(dsm.batches(ds12, 3, 0, process_count=2))
    with pytest.raises(Eagle3Error, match="exceeds"):
        next(dsm.batches(ds12, 16, 0))


def test_length_bucketed_batches_cut_padding_and_keep_resume_and_shards():
    rng = np.random.default_rng(0)
    n, max_len = 64, 40
    lengths = rng.integers(1, max_len + 1, n).astype(np.int32)
    ids = np.zeros((n, max_len), np.int32)
    for i, t in enumerate(lengths):
        ids[i, :t] = i + 1  # record i is recognisable by its first id
    ds = dsm.TokenizedDataset(ids, (ids > 0).astype(np.int8), lengths, 0)
    kw = dict(seed=3, num_steps=16, length_bucket=8)
    got = list(dsm.batches(ds, 4, **kw))
    for b in got:
        assert b.input_ids.shape[1] == min(max_len, -(-int(b.lengths.max()) // 8) * 8)
        assert (b.input_ids[:, 0] - 1 == b.rows).all() and (b.lengths == lengths[b.rows]).all()
    epoch0 = np.concatenate([b.rows for b in got[:16]])
    assert sorted(epoch0.tolist()) == list(range(64))  # each record once per epoch
    spread = np.mean([np.ptp(b.lengths) for b in got])
    plain = np.mean([np.ptp(b.lengths) for b in dsm.batches(ds, 4, seed=3, num_steps=16)])
    assert spread < plain / 3  # batches group similar lengths
    again = list(dsm.batches(ds, 4, seed=3, start_step=5, num_steps=11, length_bucket=8))
    assert [b.rows.tolist() for b in again] == [b.rows.tolist() for b in got[5:]]
    hosts = [list(dsm.batches(ds, 4, 3, 0, p, 2, num_steps=16, length_bucket=8)) for p in (0, 1)]
    for b, h0, h1 in zip(got, *hosts):  # each host cuts to the GLOBAL batch's bucket
        assert np.concatenate([h0.rows, h1.rows]).tolist() == b.rows.tolist()
        assert h0.input_ids.shape == h1.input_ids.shape == (2, b.input_ids.shape[1])


# ---- regeneration --------------------------------------------------------------------------------

PROMPTS = [(f"p{i}", " ".join(f"w{3 + (7 * i + j) % 90}" for j in range(3 + i))) for i in range(5)]


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    from eagle3_jax.checkpoints import load_target

    return load_target(tiny_target_dir)


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_regenerate_writes_records_and_resumes_without_duplicates(tiny_target, tmp_path):
    kw = dict(max_new_tokens=8, batch_size=2, progress=False)
    long_prompt = ("long", " ".join(["w9"] * 40))
    once = tmp_path / "once.jsonl"
    stats = regenerate(tiny_target, PROMPTS + [long_prompt], once, max_prompt_tokens=30, **kw)
    assert (stats.answered, stats.skipped, stats.resumed) == (5, 1, 0)
    recs = _read_jsonl(once)
    assert [r["id"] for r in recs] == [p for p, _ in PROMPTS]
    tok = tiny_target.tokenizer
    for r, (_, text) in zip(recs, PROMPTS):
        assert r["conversations"][0] == {"from": "human", "value": text}
        assert r["prompt_ids"] == [1, *tok.convert_tokens_to_ids(text.split()), 2, 1]
        assert 1 <= len(r["output_ids"]) <= 8
        answer = tok.decode(r["output_ids"], skip_special_tokens=True)
        assert r["conversations"][1]["value"] == answer

    # Interrupted: the first three answered, then a crash in the middle of writing the fourth.
    part = tmp_path / "part.jsonl"
    regenerate(tiny_target, PROMPTS[:3], part, max_prompt_tokens=30, **kw)
    with open(part, "a") as f:
        f.write(json.dumps(recs[3])[:25])
    stats = regenerate(tiny_target, PROMPTS + [long_prompt], part, max_prompt_tokens=30, **kw)
    assert (stats.answered, stats.skipped, stats.resumed) == (2, 1, 3)
    assert _read_jsonl(part) == recs
    stats = regenerate(tiny_target, PROMPTS, part, max_prompt_tokens=30, **kw)  # nothing left
    assert (stats.answered, stats.resumed) == (0, 5) and _read_jsonl(part) == recs

    # The regenerated file reads back as training data whose masks are exactly the answers.
    convs, skipped = read_conversations(part)
    assert skipped == 0 and len(convs) == 5
    ds = dsm.build_dataset(tok, convs, max_len=64, progress=False)
    for row, m, r in zip(ds.input_ids, ds.loss_mask, recs):
        words = [i for i in r["output_ids"] if i > 2]
        if len(words) == len(r["output_ids"]) - (r["output_ids"][-1] == 2):  # no stray specials
            assert row[m == 1].tolist() == words + [2]


def test_regeneration_folds_in_what_a_killed_multi_process_run_left(tiny_target, tmp_path):
    """Two processes killed mid-run leave their shards beside the answers: a resumed run (here
    one process) appends their complete records, skips those prompts, answers the rest and
    removes the shards; every record is an uninterrupted run's."""
    from eagle3_jax.data.regen_output import shard_path

    kw = dict(max_new_tokens=8, batch_size=2, max_prompt_tokens=30, progress=False)
    ref = tmp_path / "ref.jsonl"
    regenerate(tiny_target, PROMPTS, ref, **kw)
    line = {json.loads(x)["id"]: x + "\n" for x in ref.read_text().splitlines()}
    out = tmp_path / "out.jsonl"
    regenerate(tiny_target, PROMPTS[:1], out, **kw)  # p0 answered (and the settings claimed)
    shard_path(out, 0, 2).write_text(line["p1"])
    shard_path(out, 1, 2).write_text(line["p2"] + line["p3"][:20])  # p3's write cut short
    stats = regenerate(tiny_target, PROMPTS, out, **kw)
    assert (stats.answered, stats.resumed) == (2, 3)
    assert sorted(out.read_text().splitlines()) == sorted(ref.read_text().splitlines())
    assert not list(tmp_path.glob("out.jsonl.part*"))


def test_duplicate_prompt_ids_are_refused(tiny_target, tmp_path):
    with pytest.raises(Eagle3Error, match="twice"):
        regenerate(tiny_target, [("a", "w5"), ("a", "w6")], tmp_path / "d.jsonl", progress=False)


def test_prompt_selection_skips_answered_repeated_held_out_and_long_prompts():
    from eagle3_jax.data.select_prompts import fold, select

    held = {fold("What is the capital of France? Answer in one word, please.")}
    prompts = [
        ("a", "Write a poem"),
        ("b", "write  a\npoem "),  # the same text, case and whitespace folded
        ("c", "Done before"),  # answered under another id
        ("d", "Tell me: what is the capital of France? answer in one word, please."),
        ("e", "x " * 50),
        ("f", "A new question"),
        ("a", "Another text under an answered id"),
    ]
    exclude = [("z", "done before"), ("f", "answered under this id before")]
    kept, why = select(
        prompts, exclude, held, n_tokens=lambda t: len(t.split()), max_prompt_tokens=20
    )
    assert kept == [("a", "Write a poem")]
    assert why == {
        "repeated text": 2,
        "evaluation question": 1,
        "too long": 1,
        "already answered": 2,  # "f" by the exclude list, the second "a" by the first
    }
    from eagle3_jax.data.select_prompts import clip_turns

    turns = [
        {"role": r, "content": "x" * n} for r, n in (("user", 9), ("assistant", 9), ("user", 3))
    ]
    assert clip_turns(turns, 10) == turns[:2]  # the first two always stay
    assert clip_turns(turns, 21) == turns and clip_turns(turns, 0) == turns


def test_regenerate_turns_answers_every_turn_in_its_own_context(tiny_target, tmp_path, monkeypatch):
    from eagle3_jax.data.conversations import Conversation
    from eagle3_jax.data.regenerate import regenerate_turns
    from eagle3_jax.decoding import plain
    from eagle3_jax.prompts import encode_chat

    def conv(cid, *users):
        msgs = []
        for u in users:  # original answers are replaced by the target's own
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": "w5 w6"}]
        return Conversation(cid, msgs)

    convs = [
        conv("a", "w3 w4 w5", "w7 w8"),
        conv("b", "w9 w10", "w11 w12 w13", "w14"),
        conv("c", " ".join(["w20"] * 30), "w21"),  # a second turn that does not fit max_len
        conv("d", " ".join(["w30"] * 60)),  # not even the first turn fits: skipped
    ]
    out = tmp_path / "turns.jsonl"
    kw = dict(max_new_tokens=6, batch_size=2, max_len=48, progress=False)
    stats = regenerate_turns(tiny_target, convs, out, **kw)
    assert (stats.answered, stats.skipped, stats.resumed) == (3, 1, 0)
    recs = {r["id"]: r for r in _read_jsonl(out)}
    assert [len(recs[c]["conversations"]) for c in "abc"] == [4, 6, 2]
    tok, t = tiny_target.tokenizer, tiny_target
    for r in recs.values():  # each answer = plain greedy decoding of the context so far
        msgs = []
        for human, gpt, ids in zip(
            r["conversations"][::2], r["conversations"][1::2], r["turn_output_ids"]
        ):
            msgs.append({"role": "user", "content": human["value"]})
            prompt = encode_chat(tok, msgs)
            ref = plain.generate(t.params, t.cfg, [prompt], 6, pad_id=0).output_ids[0]
            assert ids == ref and gpt["value"] == tok.decode(ref, skip_special_tokens=True)
            msgs.append({"role": "assistant", "content": gpt["value"]})
    # resumed: nothing answered twice; the records read back as multi-turn conversations
    again = regenerate_turns(tiny_target, convs, out, **kw)
    assert (again.answered, again.resumed) == (0, 4 - 1) and len(_read_jsonl(out)) == 3
    back = {c.id: c for c in read_conversations(out)[0]}
    assert [m["role"] for m in back["b"].messages] == ["user", "assistant"] * 3
    # a token budget per batch (rows x (prompt + new) <= 40) splits batches, not answers
    regen_mod = sys.modules["eagle3_jax.data.regenerate"]  # the module, whatever a name shadows

    calls = []

    def spy(target, rows, n, *a):
        calls.append((n, max(len(r) for r in rows)))
        return answer(target, rows, n, *a)

    answer = regen_mod._answer
    monkeypatch.setattr(regen_mod, "_answer", spy)
    regenerate_turns(tiny_target, convs, tmp_path / "whole.jsonl", **kw)
    whole = len(calls)
    calls.clear()
    split = tmp_path / "split.jsonl"
    regenerate_turns(tiny_target, convs, split, **kw, max_batch_tokens=40)
    assert len(calls) > whole and all(n == 1 or n * (t + 6) <= 40 for n, t in calls)
    assert {r["id"]: r for r in _read_jsonl(split)} == recs
    # coarser compiled shapes (prompt padded to 128, cache to 256 slots): the same answers
    coarse = tmp_path / "coarse.jsonl"
    regenerate_turns(tiny_target, convs, coarse, **kw, buckets=(128, 256))
    assert {r["id"]: r for r in _read_jsonl(coarse)} == recs


def test_select_prompts_command_writes_the_selection(tiny_target_dir, tmp_path, capsys):
    """`select-prompts`: the prompts kept (not answered, not an evaluation question, not too
    long in the target's chat template) written as ShareGPT, or with --conversations the whole
    conversations that hold an answer; the same .gz bytes on a second run; bad input exits 2."""
    from eagle3_jax.cli.select_prompts import main as select_prompts
    from eagle3_jax.evaluation.questions import load_questions

    question = load_questions("mt_bench")[0].turns[0]  # held out: never a training prompt
    convs = [
        {"id": "a", "conversations": [{"from": "human", "value": "w5 w6 w7"},
                                      {"from": "gpt", "value": "w8 w9"}]},
        {"id": "b", "conversations": [{"from": "human", "value": question},
                                      {"from": "gpt", "value": "w8"}]},
        {"id": "c", "conversations": [{"from": "human", "value": " ".join(["w9"] * 40)},
                                      {"from": "gpt", "value": "w8"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "w10 w11"},
                                      {"from": "gpt", "value": "w12"}]},
        {"id": "e", "conversations": [{"from": "human", "value": "w13 w14"}]},
    ]  # fmt: skip
    src, done = tmp_path / "src.jsonl", tmp_path / "done.jsonl"
    src.write_text("\n".join(json.dumps(c) for c in convs) + "\n")
    done.write_text(json.dumps(convs[3]) + "\n")  # "d" was answered already
    common = [str(src), "--target", str(tiny_target_dir), "--max-prompt-tokens", "20",
              "--exclude", str(done)]  # fmt: skip
    out = tmp_path / "prompts.jsonl.gz"
    assert select_prompts([*common, "--out", str(out)]) == 0
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kept = [json.loads(line) for line in gzip.decompress(out.read_bytes()).splitlines()]
    assert [k["id"] for k in kept] == ["a", "e"]
    assert kept[0]["conversations"] == [{"from": "human", "value": "w5 w6 w7"}]
    assert counts["kept"] == 2 and counts["evaluation question"] == 1
    assert counts["too long"] == 1 and counts["already answered"] == 1
    first = out.read_bytes()
    assert select_prompts([*common, "--out", str(out)]) == 0 and out.read_bytes() == first

    whole = tmp_path / "convs.jsonl"
    assert select_prompts([*common, "--out", str(whole), "--conversations"]) == 0
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = [json.loads(line) for line in whole.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a"] and counts["no answer"] == 1  # "e" has no answer
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant"]

    assert select_prompts([str(tmp_path / "missing.json"), "--out", str(out)]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_shards_merge_in_plan_order_and_a_killed_runs_fold_in_once(tmp_path):
    """regen_output's multi-process file handling on one process (the two-process run is in the
    slow suite): process 0 merges the shards, each in plan order, into the one-process order
    byte for byte (a raw U+2028 inside a record included) and removes them; a killed run's
    shards fold into the file once, the records it already holds and a torn last line skipped."""
    from eagle3_jax.data.regen_output import fold_shards, merge_shards, shard_path

    def line(rid, text="x"):
        return (json.dumps({"id": rid, "text": text}, ensure_ascii=False) + "\n").encode()

    out = tmp_path / "answers.jsonl"
    out.write_bytes(line("a"))
    order = {rid: i for i, rid in enumerate("abcdef")}
    shard_path(out, 0, 2).write_bytes(line("b") + line("e", "p\u2028q"))
    shard_path(out, 1, 2).write_bytes(line("c") + line("d") + line("f"))
    merge_shards(out, 2, order)
    assert out.read_bytes() == b"".join(
        line(r) if r != "e" else line("e", "p\u2028q") for r in "abcdef"
    )
    assert not list(tmp_path.glob("*.part*"))
    killed = tmp_path / "killed.jsonl"
    killed.write_bytes(line("a") + line("b"))
    shard_path(killed, 0, 2).write_bytes(line("b") + line("c") + b'{"id": "torn"')
    shard_path(killed, 1, 2).write_bytes(line("d"))
    assert fold_shards(killed) == 2
    assert killed.read_bytes() == b"".join(line(r) for r in "abcd")
    assert not list(tmp_path.glob("killed.jsonl.part*")) and fold_shards(killed) == 0
