"""Training end to end on a tiny target: it learns, resumes exactly, shards, online == offline."""

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.training.config import load_config
from eagle3_jax.training.loop import train

ROOT = Path(__file__).resolve().parents[1]


def _conversations(path: Path, n: int = 12, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        q = " ".join(f"w{x}" for x in rng.integers(3, 97, 6))
        a = " ".join(f"w{x}" for x in rng.integers(3, 97, 14))
        recs.append(
            {
                "id": f"c{i}",
                "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}],
            }
        )
    path.write_text(json.dumps(recs))
    return path


def _cfg(tiny_target_dir, tmp_path, *overrides):
    data = _conversations(tmp_path / "data.json")
    return load_config(
        ROOT / "configs/tiny.py",
        [
            f"--config.target={tiny_target_dir}",
            f"--config.data={data}",
            f"--config.out_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )


# a head that learns the sharp target's argmax in 160 steps (TTT 2, the full draft vocabulary:
# the data are not regenerated before the vocabulary is built, so a reduced one built from them
# would miss many of the target's argmax tokens and cap acc_0 well below 1)
SHARP_RECIPE = ("--config.max_steps=160", "--config.lr=1e-2", "--config.log_every=20",
                "--config.ttt_steps=2", "--config.draft_vocab_size=97", "--config.regenerate=true",
                "--config.regen_max_new_tokens=24")  # fmt: skip


def _metrics(run_dir, key):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)[key] for x in lines]


def _losses(run_dir):
    return [
        json.loads(x)["loss"] for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    ]


def test_a_tiny_head_overfits_and_exports(sharp_target_dir, tmp_path):
    from eagle3_jax.checkpoints.eagle_format import load_draft

    tc = _cfg(sharp_target_dir, tmp_path, *SHARP_RECIPE, "--config.save_every=80")
    summary = train(tc, progress=False)
    accs = [
        json.loads(x)["acc_0"] for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()
    ]
    assert accs[0] < 0.6 and accs[-1] > 0.9, accs
    params, dcfg, vocab, _ = load_draft(summary["head"])
    assert dcfg.draft_vocab_size == 97 and vocab.is_identity

    # held-out scoring (training.validate) of the exported head: on its own training text it
    # scores what the training log ends at, and its sums do not depend on how rows are batched
    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.checkpoints.heads import load_head
    from eagle3_jax.cli import validate
    from eagle3_jax.data.conversations import read_conversations
    from eagle3_jax.data.dataset import build_dataset
    from eagle3_jax.training import validate as validation
    from eagle3_jax.training.validate import score_head

    out = tmp_path / "scores.json"
    held = _conversations(tmp_path / "held.json", n=5, seed=7)
    argv = ["--draft", summary["head"], "--target", str(sharp_target_dir), "--ttt-steps", "2"]
    regen = Path(tc.run.out_dir) / "regenerated.jsonl"  # what it trained on: the target's answers
    argv += ["--data", f"train={regen}", "--data", str(held), "--json", str(out), "--no-progress"]
    assert validate.main(argv) == 0
    sets = json.loads(out.read_text())["sets"]
    assert set(sets) == {"train", "held"} and sets["train"]["records"] == 12
    assert sets["train"]["skipped"] == 0  # every answer starts within --max-len
    train_acc = sets["train"]["acc"]
    assert train_acc[0] > 0.9 and abs(train_acc[0] - accs[-1]) < 0.1, (train_acc, accs)
    chain = sets["train"]["chain"]
    assert chain[0] == pytest.approx(train_acc[0]) and 0.5 < chain[1] <= chain[0]
    assert sets["train"]["chain_tau"] == pytest.approx([1 + chain[0], 1 + chain[0] + chain[1]])
    target = load_target(str(sharp_target_dir))
    dparams, dcfg, vocab, _ = load_head(summary["head"], target)
    ds = build_dataset(target.tokenizer, read_conversations(regen)[0], 64, progress=False)
    one, five = (
        score_head(target, dparams, dcfg, vocab, ds, steps=2, batch_size=n, progress=False)
        for n in (1, 5)
    )
    for name in ("acc", "chain", "xent"):
        np.testing.assert_allclose(getattr(five, name), getattr(one, name), rtol=1e-5)
    assert one.supervised == sets["train"]["supervised"]
    assert validate.main(["--draft", summary["head"], "--data", str(tmp_path / "nope.json")]) == 2

    # replayed from the TTT streaks over the target's own greedy text, chain decoding's rounds
    # are exactly those speculative decoding takes: same tokens, same rounds, row by row
    from eagle3_jax.checkpoints.heads import Head
    from eagle3_jax.data.dataset import TokenizedDataset
    from eagle3_jax.decoding.generate import DecodeOptions, generate_ids

    # the prompts it was trained on (the head knows their answers: long acceptances)
    prompts = [json.loads(x)["prompt_ids"] for x in regen.read_text().splitlines()[:4]]
    for depth in (1, 2):
        tree = TreeConfig(top_k=1, depth=depth, total_tokens=depth + 1)
        opts = DecodeOptions("eagle3", 24, tree, eos_ids=())
        out = generate_ids(target, Head(dparams, dcfg, vocab), prompts, opts)
        rows = [p + o for p, o in zip(prompts, out.output_ids)]
        ids = np.zeros((len(rows), 40), np.int32)
        mask = np.zeros((len(rows), 40), np.int8)
        for i, (p, r) in enumerate(zip(prompts, rows)):
            ids[i, : len(r)], mask[i, len(p) : len(r)] = r, 1
        lengths = np.array([len(r) for r in rows], np.int32)
        ds = TokenizedDataset(ids, mask, lengths, 0, 0)
        loss = validation._jitted_loss(target.cfg, dcfg, tc.replace(max_len=40))
        arrays = {
            "input_ids": ids,
            "loss_mask": mask.astype(np.float32),
            "attention_mask": (np.arange(40)[None] < lengths[:, None]).astype(np.int32),
        }
        streak = np.asarray(loss(dparams, target.params, arrays, vocab.t2d)[1]["streak"])
        got = [validation.replay_chain(st, m, depth) for st, m in zip(streak, mask)]
        want = [(n - 1, f - 1) for n, f in zip(map(len, out.output_ids), out.target_forwards)]
        assert got == want, (got, want)
        assert np.asarray(out.accept_hist)[:, depth].sum() > 20  # whole chains were accepted
        sc = score_head(target, dparams, dcfg, vocab, ds, steps=2, progress=False)
        assert sc.replay_tau[depth - 1] == pytest.approx(
            sum(t for t, _ in want) / sum(r for _, r in want)
        )


def test_init_head_continues_a_head_with_its_vocabulary(tiny_target_dir, tmp_path):
    from eagle3_jax import vocab as vocab_lib
    from eagle3_jax.checkpoints.eagle_format import load_draft
    from eagle3_jax.checkpoints.heads import read_vocab_order, write_vocab_order

    first = _cfg(
        tiny_target_dir, tmp_path, "--config.max_steps=3", f"--config.out_dir={tmp_path / 'a'}"
    )
    head = train(first, progress=False)["head"]
    order = vocab_lib.target_ids(load_draft(head)[2])[::-1]
    write_vocab_order(head, order, cpu_size=2)  # the continued head keeps its ids' order
    # lr 0 for one step: the continued run exports exactly the head it started from
    # (save_every 0: one checkpoint, at the last step)
    cont = first.replace(
        out_dir=str(tmp_path / "b"),
        init_head=head,
        lr=0.0,
        max_steps=1,
        seed=9,
        save_every=0,
    )
    again = train(cont, progress=False)["head"]
    (p0, c0, v0, _), (p1, c1, v1, _) = load_draft(head), load_draft(again)
    assert c0 == c1 and np.array_equal(v0.d2t, v1.d2t)
    jax.tree.map(np.testing.assert_array_equal, p1, p0)
    assert read_vocab_order(again, v1)["order"].tolist() == order.tolist()
    write_vocab_order(head, order[:-1], cpu_size=2)  # not the head's ids: not passed on
    stale = train(cont.replace(out_dir=str(tmp_path / "d")), progress=False)["head"]
    assert not (Path(stale) / "vocab_order.json").exists()
    other = cont.replace(out_dir=str(tmp_path / "c"), ttt_steps=2, aux_layer_ids=(1,))
    with pytest.raises(Eagle3Error, match="aux_layer_ids"):
        train(other, progress=False)


def _assert_svd_speculator(got, cfg, tiny_target_dir):
    """The head's speculator is the SVD start on the target's output embedding."""
    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.models import draft as drf

    target = load_target(str(tiny_target_dir))
    blank = {k: v for k, v in got.items() if not k.startswith("spec_")}
    svd = drf.init_speculator_svd(
        {**blank, **drf.init_params(cfg, jax.random.PRNGKey(0))}, target.params, target.cfg, cfg
    )
    for k in ("spec_a", "spec_b"):
        np.testing.assert_allclose(got[k], svd[k], rtol=1e-5, atol=1e-6)


def test_init_trunk_takes_fc_layer_and_norm_and_leaves_the_output_layer(tiny_target_dir, tmp_path):
    """A target-lm_head SpecVocab head started from the trunk of an own-lm_head head: its fc,
    layer and final norm are that head's, its speculator the SVD start; other aux layers are
    refused by name."""
    from eagle3_jax.checkpoints.eagle_format import load_draft

    first = _cfg(
        tiny_target_dir, tmp_path, "--config.max_steps=3", f"--config.out_dir={tmp_path / 'a'}"
    )
    head = train(first, progress=False)["head"]
    spec = first.replace(
        out_dir=str(tmp_path / "b"), init_trunk=head, lr=0.0, max_steps=1,
        draft_vocab_size=10**6, lm_head_source="target", speculator_rank=4,
        speculator_loss_weight=0.1, export_dtype="float32",
    )  # fmt: skip
    got, cfg, _, _ = load_draft(train(spec, progress=False)["head"])
    trunk, _, _, _ = load_draft(head)
    for k in ("fc", "layer", "final_norm"):
        jax.tree.map(np.testing.assert_array_equal, got[k], trunk[k])
    assert "lm_head" not in got and cfg.speculator_rank == 4
    _assert_svd_speculator(got, cfg, tiny_target_dir)
    other = spec.replace(out_dir=str(tmp_path / "c"), aux_layer_ids=(1,))
    with pytest.raises(Eagle3Error, match="init_trunk .* aux_layer_ids"):
        train(other, progress=False)
    with pytest.raises(Eagle3Error, match="choose one"):
        spec.replace(init_head=head).validate()


def test_specvocab_without_its_auxiliary_loss_trains_the_target_lm_head_head(
    tiny_target_dir, tmp_path
):
    """With speculator_loss_weight 0 nothing reaches the speculator (its top-k passes no
    gradient): the exact head trains to the same weights and losses as the cell without a
    speculator, and the speculator stays the SVD start. The study's no-aux SpecVocab cell
    therefore differs from the target-lm_head cell in its speculator alone."""
    from eagle3_jax.checkpoints.eagle_format import load_draft

    base = _cfg(tiny_target_dir, tmp_path, "--config.max_steps=4").replace(
        draft_vocab_size=10**6, lm_head_source="target", export_dtype="float32"
    )
    plain = train(base.replace(out_dir=str(tmp_path / "plain")), progress=False)["head"]
    noaux = base.replace(
        out_dir=str(tmp_path / "noaux"), speculator_rank=4, speculator_loss_weight=0.0
    )
    spec = train(noaux, progress=False)["head"]
    assert _losses(tmp_path / "plain") == _losses(tmp_path / "noaux")
    got, cfg, _, _ = load_draft(spec)
    want, _, _, _ = load_draft(plain)
    for k in ("fc", "layer", "final_norm"):
        jax.tree.map(np.testing.assert_array_equal, got[k], want[k])
    _assert_svd_speculator(got, cfg, tiny_target_dir)


def test_resume_reproduces_the_uninterrupted_run(tiny_target_dir, tmp_path):
    # held-out validation every 3 steps, on 4 new conversations and a copy of a training one
    held = json.loads(_conversations(tmp_path / "held.json", n=4, seed=5).read_text())
    copy = {**json.loads((_conversations(tmp_path / "data.json")).read_text())[0], "id": "dup"}
    (tmp_path / "held.json").write_text(json.dumps(held + [copy]))
    full = _cfg(
        tiny_target_dir,
        tmp_path,
        "--config.max_steps=10",
        "--config.save_every=4",
        "--config.export_every=5",
        "--config.log_every=1",
        f"--config.val_data={tmp_path / 'held.json'}",
        "--config.val_every=3",
        f"--config.out_dir={tmp_path / 'a'}",
    )
    train(full, progress=False)
    vals = [json.loads(x) for x in (tmp_path / "a/validation.jsonl").read_text().splitlines()]
    assert [v["step"] for v in vals] == [3, 6, 9, 10]
    assert all(v["val_records"] == 4 for v in vals)  # the training record's copy is left out
    assert all(0 <= v["val_acc_0"] <= 1 and v["val_chain_tau"] >= 1 for v in vals)
    assert all(1 <= v["val_replay_tau"] <= 4 for v in vals)  # a depth-3 chain: 3 + the bonus
    assert vals[0]["val_xent_0"] != vals[-1]["val_xent_0"]  # it scores the head of that step
    part = full.replace(out_dir=str(tmp_path / "b"))
    # an interruption after the step-4 checkpoint: run to step 6, then drop the checkpoints past 4
    train(part.replace(max_steps=10), progress=False, stop_after=6)
    train(part, resume=True, progress=False)
    np.testing.assert_allclose(_losses(tmp_path / "b"), _losses(tmp_path / "a"), rtol=1e-5)
    # the resumed run's validation file reads as the uninterrupted one (step 6 of the killed run,
    # past the step-4 checkpoint, is dropped and validated again)
    resumed = [json.loads(x) for x in (tmp_path / "b/validation.jsonl").read_text().splitlines()]
    assert [v["step"] for v in resumed] == [3, 6, 9, 10]
    for got, want in zip(resumed, vals):
        np.testing.assert_allclose(got["val_xent_0"], want["val_xent_0"], rtol=1e-5)
    # tokens seen carry over the resume; the step-5 head was exported with them
    tokens = [_metrics(tmp_path / r, "tokens") for r in "ab"]
    assert tokens[0] == tokens[1] and all(np.diff(tokens[0]) > 0)
    for r in "ab":
        info = json.loads((tmp_path / r / "heads/step_000005/training.json").read_text())
        assert info == {"step": 5, "tokens": tokens[0][4]}
        assert (tmp_path / r / "heads/step_000005/model.safetensors").is_file()
    with pytest.raises(Eagle3Error, match="already holds checkpoints"):
        train(part, progress=False)


def test_a_stop_between_a_checkpoint_and_its_validation_is_made_up_on_resume(
    tiny_target_dir, tmp_path
):
    # a step's checkpoint is written before its held-out validation and its export: a run stopped
    # while it validated resumes from that step, and must still record the step's validation and
    # export its head
    tc = _cfg(
        tiny_target_dir,
        tmp_path,
        "--config.max_steps=4",
        "--config.save_every=2",
        "--config.export_every=2",
        f"--config.val_data={_conversations(tmp_path / 'held.json', n=3, seed=5)}",
        "--config.val_every=2",
    )
    train(tc, progress=False, stop_after=2)
    path = tmp_path / "run/validation.jsonl"
    head = tmp_path / "run/heads/step_000002"
    (done,) = [json.loads(x) for x in path.read_text().splitlines()]
    weights = (head / "model.safetensors").read_bytes()
    path.write_text("")  # the stop: the step-2 record never written, the head half written
    (head / "training.json").unlink()
    (head / "model.safetensors").write_bytes(b"")
    train(tc, resume=True, progress=False)
    assert (head / "model.safetensors").read_bytes() == weights
    assert json.loads((head / "training.json").read_text())["step"] == 2
    vals = [json.loads(x) for x in path.read_text().splitlines()]
    assert [v["step"] for v in vals] == [2, 4]
    for key in ("val_acc_0", "val_xent_0", "val_replay_tau"):
        np.testing.assert_allclose(vals[0][key], done[key], rtol=1e-6)
    train(tc, resume=True, progress=False)  # a finished run: nothing is validated again
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [2, 4]


def test_online_and_offline_features_give_the_same_losses(tiny_target_dir, tmp_path):
    from eagle3_jax.training.prepare import precompute_features

    online = _cfg(
        tiny_target_dir,
        tmp_path,
        "--config.max_steps=4",
        "--config.length_bucket=4",  # offline features cut to each batch's bucket
        f"--config.out_dir={tmp_path / 'on'}",
    )
    train(online, progress=False)
    offline = online.replace(
        out_dir=str(tmp_path / "off"),
        features="offline",
        features_dir=str(tmp_path / "feats"),
        feature_layers=(1, 2, 3, 4),
    )
    precompute_features(offline, progress=False)
    train(offline, progress=False)
    np.testing.assert_allclose(_losses(tmp_path / "off"), _losses(tmp_path / "on"), rtol=1e-5)
    bad = offline.replace(out_dir=str(tmp_path / "bad"), aux_layer_ids=(2, 3, 5))
    with pytest.raises(Eagle3Error, match="not \\[5\\]"):  # a layer the store does not hold
        train(bad, progress=False)
    with pytest.raises(Eagle3Error, match="aux layer id 0"):  # no name in the official format
        train(bad.replace(aux_layer_ids=(0, 2, 3)), progress=False)


@pytest.mark.slow  # 14-16 s: aux id L's parity with HF stays in test_target
def test_a_head_on_the_final_normed_state_trains_and_decodes_what_it_trained_on(
    sharp_target_dir, tmp_path, capsys
):
    """Aux id L (6 here): the final normed state, EAGLE-1/2's feature and the fusion ablation's
    top_layer cell. Training marks the head final_norm_aux, the exported head loads with it and
    drafts whole chains the target accepts, and the output is plain greedy decoding's (that id L
    IS HF's normed hidden_states[L] is test_target's parity test); the same ids without the mark
    (an official config's "output of layer L-1", ambiguous) are refused, and so is the
    speculators export (vLLM captures layer inputs only)."""
    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.checkpoints.eagle_format import load_draft, save_draft
    from eagle3_jax.checkpoints.heads import Head, load_head
    from eagle3_jax.decoding.generate import DecodeOptions, generate_ids

    tc = _cfg(sharp_target_dir, tmp_path, *SHARP_RECIPE, "--config.aux_layer_ids=2,6")
    summary = train(tc, progress=False)
    assert _metrics(tmp_path / "run", "acc_0")[-1] > 0.9
    hf = json.loads((Path(summary["head"]) / "config.json").read_text())
    assert hf["eagle3_jax"] == {"final_norm_aux": True}
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 6]

    target = load_target(str(sharp_target_dir))
    dparams, dcfg, vocab, _ = load_head(summary["head"], target)
    assert dcfg.final_norm_aux and dcfg.aux_layer_ids == (2, 6)
    regen = Path(tc.run.out_dir) / "regenerated.jsonl"
    prompts = [json.loads(x)["prompt_ids"] for x in regen.read_text().splitlines()[:4]]
    tree = TreeConfig(top_k=2, depth=2, total_tokens=5)
    spec = generate_ids(
        target, Head(dparams, dcfg, vocab), prompts, DecodeOptions("eagle3", 24, tree, eos_ids=())
    )
    plain = generate_ids(target, None, prompts, DecodeOptions("vanilla", 24, tree, eos_ids=()))
    assert spec.output_ids == plain.output_ids
    assert np.asarray(spec.accept_hist)[:, 2].sum() > 20  # whole chains accepted

    from eagle3_jax.cli import export

    argv = ["--draft", summary["head"], "--target", str(sharp_target_dir)]
    assert export.main([*argv, "--out", str(tmp_path / "official")]) == 0
    assert "only eagle3_jax runs this head" in capsys.readouterr().out
    assert export.main([*argv, "--out", str(tmp_path / "spec"), "--layout", "speculators"]) == 2
    assert "vLLM captures only layer inputs" in capsys.readouterr().err
    hf.pop("eagle3_jax")  # the same ids as an official config names them: ambiguous, refused
    (Path(summary["head"]) / "config.json").write_text(json.dumps(hf))
    with pytest.raises(Eagle3Error, match="ambiguous, so refused"):
        load_draft(summary["head"], target.cfg)
    with pytest.raises(Eagle3Error, match="vLLM captures only layer inputs"):
        save_draft(tmp_path / "spec", dparams, dcfg, vocab, layout="speculators",
                   verifier=("t", ["LlamaForCausalLM"]))  # fmt: skip
    assert not (tmp_path / "spec").exists()


def test_length_buckets_leave_the_loss_unchanged(tiny_target_dir, tmp_path):
    """One batch holding every record: cut to its bucket or padded to max_len, the same loss."""
    base = ["--config.batch_size=12", "--config.max_steps=3"]
    full = _cfg(tiny_target_dir, tmp_path, *base, f"--config.out_dir={tmp_path / 'full'}")
    train(full, progress=False)
    cut = full.replace(out_dir=str(tmp_path / "cut"), length_bucket=4)
    train(cut, progress=False)
    np.testing.assert_allclose(_losses(tmp_path / "cut"), _losses(tmp_path / "full"), rtol=1e-5)


def test_tensorboard_event_files_read_back(tmp_path):
    """An event file as TensorBoard reads it: TFRecord frames whose masked CRC-32Cs hold, the
    first Event naming the format, each scalars call one Event, on disk before the writer closes;
    a flipped byte is refused."""
    from tensorboardX.proto.event_pb2 import Event

    from eagle3_jax.training.tensorboard import SummaryWriter, read_scalars

    tb = SummaryWriter(tmp_path / "tb")
    tb.scalars(5, {"loss": 2.5, "acc_0": 0.25})
    (event_file,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    assert read_scalars(event_file) == [(5, {"loss": 2.5, "acc_0": 0.25})]
    tb.scalars(6, {"loss": 1.5})
    tb.close()
    assert read_scalars(event_file) == [(5, {"loss": 2.5, "acc_0": 0.25}), (6, {"loss": 1.5})]
    data = event_file.read_bytes()
    (n,) = np.frombuffer(data[:8], "<u8")
    assert Event.FromString(data[12 : 12 + n]).file_version == "brain.Event:2"
    event_file.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    with pytest.raises(ValueError, match="bad CRC"):
        read_scalars(event_file)


def test_tensorboard_events_and_nan_stop(tiny_target_dir, tmp_path):
    from eagle3_jax.training.tensorboard import read_scalars

    tc = _cfg(tiny_target_dir, tmp_path, "--config.max_steps=3")
    train(tc, progress=False)
    (event_file,) = (tmp_path / "run/tensorboard").glob("events.out.tfevents.*")
    events = read_scalars(event_file)
    assert [s for s, _ in events] == [1, 2, 3]
    assert abs(events[-1][1]["loss"] - _losses(tmp_path / "run")[-1]) < 1e-5
    boom = tc.replace(out_dir=str(tmp_path / "nan"), lr=1e38, save_every=1, max_steps=8)
    with pytest.raises(
        Eagle3Error, match=r"loss is nan at step \d+: stopped; the last good checkpoint"
    ):
        train(boom, progress=False)


@pytest.mark.slow  # ~40-75 s on 2 cores; CI runs it (make test-slow)
def test_sigkill_or_sigterm_mid_run_then_resume(tiny_target_dir, tmp_path):
    """train.py killed with SIGKILL loses at most the steps since its last checkpoint; one sent
    SIGTERM (a preemption notice, `kill`) finishes its step, checkpoints it and exits with status
    143, losing none. --resume continues either to the losses of a run never interrupted."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from eagle3_jax.training.checkpoint import Checkpoints

    data = _conversations(tmp_path / "data.json")
    args = [
        f"--config.target={tiny_target_dir}",
        f"--config.data={data}",
        "--config.max_steps=24",
        "--config.save_every=5",
    ]
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(ROOT / "train.py"), "--config=configs/tiny.py", "--no-progress"]
    cmd += args

    def interrupted(name: str, sig) -> subprocess.CompletedProcess:
        log = tmp_path / f"{name}.log"
        with open(log, "w") as err:
            proc = subprocess.Popen(cmd + [f"--config.out_dir={tmp_path / name}"], cwd=ROOT,
                                    env=env, stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
        metrics = tmp_path / name / "metrics.jsonl"
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 7:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "training finished before it could be stopped"
        os.kill(proc.pid, sig)
        proc.wait()
        return subprocess.CompletedProcess(cmd, proc.returncode, "", log.read_text())

    assert interrupted("killed", signal.SIGKILL).returncode == -signal.SIGKILL
    assert len(_metrics(tmp_path / "killed", "step")) < 24
    stopped = interrupted("stopped", signal.SIGTERM)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    step = int(re.search(r"stopped by SIGTERM after step (\d+)", stopped.stderr).group(1))
    assert 7 <= step < 24 and not (tmp_path / "stopped/head").exists()
    assert _metrics(tmp_path / "stopped", "step") == list(range(1, step + 1))
    ckpt = Checkpoints(tmp_path / "stopped/checkpoints")
    assert ckpt.latest_step() == step  # between two save_every steps or on one: no step lost
    ckpt.close()
    for name, lost in (("killed", True), ("stopped", False)):
        resumed = subprocess.run(cmd + [f"--config.out_dir={tmp_path / name}", "--resume"],
                                 cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert "resumed from step" in resumed.stderr
        if not lost:
            assert f"resumed from step {step}" in resumed.stderr
    clean = subprocess.run(cmd + [f"--config.out_dir={tmp_path / 'clean'}"], cwd=ROOT, env=env,
                           capture_output=True, text=True)  # fmt: skip
    assert clean.returncode == 0, clean.stderr[-2000:]
    for name in ("killed", "stopped"):
        np.testing.assert_allclose(_losses(tmp_path / name), _losses(tmp_path / "clean"), rtol=1e-5)


def test_the_sigterm_handler_is_ours_only_around_the_steps(tiny_target_dir, tmp_path, monkeypatch):
    """Inside StopOnSigterm a SIGTERM is only noted (the loop stops after its step); the handler
    before it is put back after. One that comes during the final export stops the run after its
    head is written (Stopped, not a finished run's summary)."""
    import os
    import signal

    from eagle3_jax.errors import Stopped
    from eagle3_jax.training import loop
    from eagle3_jax.training.preemption import StopOnSigterm

    before = signal.getsignal(signal.SIGTERM)
    with StopOnSigterm() as stop:
        assert not stop.due(3)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.due(4)
    assert signal.getsignal(signal.SIGTERM) == before

    real = loop.export_head

    def export_head(path, *a, **k):
        os.kill(os.getpid(), signal.SIGTERM)  # the notice, while the final head is written
        return real(path, *a, **k)

    monkeypatch.setattr(loop, "export_head", export_head)
    tc = _cfg(tiny_target_dir, tmp_path, "--config.max_steps=2", "--config.export_every=0")
    with pytest.raises(Stopped, match=r"during the last step \(2\): the run finished"):
        train(tc, progress=False)
    assert (tmp_path / "run/head/config.json").is_file()
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.slow  # ~40-75 s on 2 cores; CI runs it (make test-slow)
def test_a_run_on_a_mesh_matches_one_device(tiny_target_dir, tmp_path):
    """train() on a 2 x 4 mesh of simulated devices: same losses as on one device, and it resumes."""
    one = _cfg(
        tiny_target_dir,
        tmp_path,
        "--config.max_steps=4",
        "--config.save_every=2",
        f"--config.out_dir={tmp_path / 'one'}",
    )
    train(one, progress=False)
    mesh = one.replace(out_dir=str(tmp_path / "mesh"), mesh_data=2, mesh_model=4)
    train(mesh, progress=False, stop_after=3)
    train(mesh, resume=True, progress=False)
    np.testing.assert_allclose(_losses(tmp_path / "mesh"), _losses(tmp_path / "one"), rtol=1e-5)


def test_a_timed_run_stopped_while_calibrating_says_to_start_again(tmp_path, monkeypatch, capsys):
    """SIGTERM during train-timed's calibration: exit status 143 and a line saying the run had not
    started (the calibration is made again), not the resumable run's --resume."""
    from eagle3_jax.cli import timed
    from eagle3_jax.errors import Stopped
    from eagle3_jax.training.preemption import stopped

    def train(tc, progress=True):
        raise stopped(3)

    monkeypatch.setattr(timed, "train", train)
    argv = ["--config=configs/tiny.py", f"--config.out_dir={tmp_path / 'run'}", "--minutes=5"]
    assert timed.main(argv) == Stopped.EXIT_STATUS == 143
    err = capsys.readouterr().err
    assert "while calibrating, before the run itself started" in err and "--resume" not in err


def test_timed_run_fits_max_steps_to_the_budget(tiny_target_dir, tmp_path, capsys):
    from eagle3_jax.cli import timed
    from eagle3_jax.training.timed import plan_steps

    data = _conversations(tmp_path / "data.json")
    args = [
        f"--config={ROOT / 'configs/tiny.py'}",
        f"--config.target={tiny_target_dir}",
        f"--config.data={data}",
        f"--config.out_dir={tmp_path / 'run'}",
        "--config.max_steps=20",
        "--config.epochs=3",
        "--config.batch_size=2",
        # lm_head and norm start as the target's, features online: the step donates the head's
        # params while it reads the target's, so they must not share a buffer
        "--config.head_init=target",
        "--no-progress",
    ]
    # a generous budget: the epochs cap (3 x 6 steps, under max_steps 20) decides
    assert timed.main([*args, "--minutes=30", "--calibrate-steps=8", "--exports=2"]) == 0
    plan = json.loads((tmp_path / "run/timed.json").read_text())
    assert plan["cap_steps"] == 18 and plan["max_steps"] == 18 and plan["seconds_per_step"] > 0
    assert _metrics(tmp_path / "run", "step")[-1] == 18
    assert sorted(p.name for p in (tmp_path / "run/heads").iterdir()) == [
        "step_000006",
        "step_000012",
    ]
    assert (tmp_path / "run/head/config.json").exists()
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 18 and summary["timed"]["max_steps"] == 18
    # a run that already holds checkpoints is refused before any calibration
    assert timed.main([*args, "--minutes=30"]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    # the calibration folder's name taken by a user's folder: refused, left as it was
    mine = tmp_path / "other_calibration" / "notes.txt"
    mine.parent.mkdir()
    mine.write_text("mine")
    other = [a.replace(str(tmp_path / "run"), str(tmp_path / "other")) for a in args]
    assert timed.main([*other, "--minutes=30"]) == 2
    assert "not a training run" in capsys.readouterr().err and mine.read_text() == "mine"
    # max_steps caps below the epochs; 20 steps and two exports: at most two heads before the end
    args = [a.replace("epochs=3", "epochs=0") for a in args]
    args = [a.replace(str(tmp_path / "run"), str(tmp_path / "run2")) for a in args]
    assert timed.main([*args, "--minutes=30", "--calibrate-steps=8", "--exports=2"]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "run2/timed.json").read_text())["max_steps"] == 20
    assert sorted(p.name for p in (tmp_path / "run2/heads").iterdir()) == [
        "step_000007",
        "step_000014",
    ]
    # a budget the calibration alone uses up is an error, not a one-step run
    args = [a.replace(str(tmp_path / "run2"), str(tmp_path / "run3")) for a in args]
    assert timed.main([*args, "--minutes=0.01", "--calibrate-steps=8"]) == 2
    assert "budget" in capsys.readouterr().err and not (tmp_path / "run3/head").exists()
    # the planning itself: the budget decides below the cap, never fewer than one step
    assert plan_steps(100.0, 0.5, cap=1000, safety=0.9) == 180
    assert plan_steps(100.0, 0.5, cap=50) == 50
    assert plan_steps(-5.0, 0.5, cap=50) == 1
    with pytest.raises(Eagle3Error, match="calibration"):
        plan_steps(10.0, 0.0, cap=5)
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(
        "\n".join(
            json.dumps(r)
            for r in (
                {"step": 2, "tokens": 100, "tokens_per_s": 1.0},  # pays compilation: left out
                {"step": 4, "tokens": 200, "tokens_per_s": 100.0},  # 1 s / 2 steps
                {"step": 6, "tokens": 300, "tokens_per_s": 50.0},  # 2 s / 2 steps
            )
        )
    )
    assert timed.seconds_per_step(metrics) == pytest.approx(0.75)
    # a second shape compiled mid-calibration (length buckets) does not count as step time
    recs = [{"step": 2 * i, "tokens": 100 * i, "tokens_per_s": 100.0} for i in range(1, 6)]
    recs[3]["tokens_per_s"] = 100 / 16  # 16 s for that interval's 2 steps
    metrics.write_text("\n".join(json.dumps(r) for r in recs))
    assert timed.seconds_per_step(metrics) == pytest.approx(0.5)
    metrics.write_text(metrics.read_text().splitlines()[0])
    with pytest.raises(Eagle3Error, match="logged steps"):
        timed.seconds_per_step(metrics)


def test_a_run_is_locked_and_resumes_only_on_the_same_inputs(tiny_target_dir, tmp_path):
    """A second run on the same out_dir is refused while the first holds it; --resume after the
    data file was edited at the same path is refused, naming it; restored, it resumes."""
    import os

    from eagle3_jax.checkpoints.atomic import exclusive

    tc = _cfg(tiny_target_dir, tmp_path, "--config.max_steps=4", "--config.save_every=2")
    out = Path(tc.run.out_dir)
    out.mkdir(parents=True)
    with exclusive(out / "process0", "out_dir"):
        with pytest.raises(Eagle3Error, match="another process"):
            train(tc, progress=False)
    train(tc, progress=False, stop_after=2)
    data = Path(tc.corpus.data)
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(Eagle3Error, match="data changed since the run started"):
        train(tc, resume=True, progress=False)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert train(tc, resume=True, progress=False)["steps"] == 4


def test_validate_table_rows():
    """`validate`'s table: a header with acc_0..acc_{n-1}, then one row a set with the depth-3
    chain tau and the replayed tau at depth 3 and at the deepest step."""
    from eagle3_jax.cli.validate import table

    s = {"records": 12, "skipped": 1, "supervised": 300, "acc": [0.9, 0.8, 0.7, 0.6],
         "chain_tau": [1.9, 2.6, 3.1, 3.4], "replay_tau": [1.8, 2.4, 2.9, 3.2]}  # fmt: skip
    lines = table({"sets": {"held": s}}, 4).splitlines()
    assert lines[0].startswith("| set | records (skipped) | supervised | acc_0 | acc_1 | acc_2")
    assert "chain tau d3 | replayed tau d3 | replayed tau d4 |" in lines[0]
    assert lines[1] == "|---" * 10 + "|"
    assert lines[2] == (
        "| held | 12 (1) | 300 | 0.900 | 0.800 | 0.700 | 0.600 | 3.10 | 2.90 | 3.20 |"
    )
