"""Nothing a user has is lost: destinations we did not write are refused, and the feature store
resumes exactly after an interruption and is reused only for the inputs it was computed from."""

from __future__ import annotations

import types

import numpy as np
import pytest

from eagle3_jax.checkpoints.atomic import (
    MARKER,
    atomic_directory,
    check_destination,
    written_by_us,
)
from eagle3_jax.errors import Eagle3Error


def test_destinations_we_did_not_write_are_refused_and_left_alone(tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep me")
    with pytest.raises(Eagle3Error, match="did not write"):
        with atomic_directory(user, overwrite=True) as tmp:
            (tmp / "x").write_text("new")
    assert (user / "notes.txt").read_text() == "keep me" and not (user / "x").exists()
    afile = tmp_path / "f"
    afile.write_text("a file")
    with pytest.raises(Eagle3Error, match="not a directory"):
        check_destination(afile)
    # ours: refused without overwrite, replaced with it; an empty directory is taken over
    ours = tmp_path / "ours"
    with atomic_directory(ours) as tmp:
        (tmp / "a").write_text("1")
    assert written_by_us(ours) and (ours / MARKER).is_file()
    with pytest.raises(Eagle3Error, match="--overwrite"):
        check_destination(ours)
    with atomic_directory(ours, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in ours.iterdir()) == sorted([MARKER, "b"])
    (tmp_path / "empty").mkdir()
    check_destination(tmp_path / "empty")
    # never equal to, inside or around an input
    for dest in (ours, ours / "sub", tmp_path):
        with pytest.raises(Eagle3Error, match="inside or around"):
            check_destination(dest, overwrite=True, sources=[ours])
    # an error inside the block leaves the old directory as it was and no temporary behind
    with pytest.raises(RuntimeError):
        with atomic_directory(ours, overwrite=True) as tmp:
            (tmp / "c").write_text("3")
            raise RuntimeError("killed")
    assert sorted(p.name for p in ours.iterdir()) == sorted([MARKER, "b"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "f", "mine", "ours"]


def test_vocab_tools_never_writes_over_its_source_or_a_users_folder(tiny_target_dir, tmp_path,
                                                                      capsys, monkeypatch):  # fmt: skip
    from eagle3_jax.cli.vocab import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("mine")
    argv = ["trim", "--target", str(tiny_target_dir), "--draft", "head", "--counts", "c.npy",
            "--size", "4"]  # fmt: skip
    for out, msg in ((".", "inside or around"), ("head", "inside or around"),
                     ("keep.txt", "not a directory")):  # fmt: skip
        assert main(argv + ["--out", out]) == 2
        assert msg in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "mine"


def _dataset(n=10, t=16, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, t + 1, n)
    ids = rng.integers(3, 97, (n, t)).astype(np.int32)
    ids[np.arange(t)[None] >= lengths[:, None]] = 0
    return types.SimpleNamespace(input_ids=ids, lengths=lengths, num_records=n)


def _read(path, layers):
    from eagle3_jax.training.features import OfflineFeatures

    ds = _dataset()
    f = OfflineFeatures(path, ds, layers)
    return f.batch(np.arange(ds.input_ids.shape[0]))


def test_feature_store_resumes_exactly_and_checks_its_inputs(tiny_target_dir, tmp_path,
                                                             monkeypatch):  # fmt: skip
    from eagle3_jax.ablation.status import store_line
    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.training import features

    target = load_target(str(tiny_target_dir))
    ds, layers = _dataset(), (1, 2, 3)
    ref = features.precompute(target, ds, layers, tmp_path / "ref", 3, False, 4)
    want = _read(ref, layers)
    # killed after two batches (each batch checkpointed), then run again: the same arrays
    calls = {"n": 0}
    real = features.bucket_length

    def dies_after_two(*a):
        calls["n"] += 1
        if calls["n"] > 2:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(features, "bucket_length", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        features.precompute(target, ds, layers, tmp_path / "f", 3, False, 4, checkpoint_seconds=0)
    assert (tmp_path / "f.partial" / features.PROGRESS).is_file()
    # what --status of the study scripts says of it: the batches done, of the plan's
    assert store_line(tmp_path / "f") == "feature store: being built (2 of 4 batches done)"
    calls["n"] = -100  # the resumed run computes the remaining batches only
    out = features.precompute(target, ds, layers, tmp_path / "f", 3, False, 4)
    assert calls["n"] == -100 + 2  # 4 batches of 3 over 10 records, 2 were done
    got = _read(out, layers)
    assert store_line(out) == "feature store: ready"
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    # a finished or partial store is not reused for other inputs, and names what differs
    other = _dataset(seed=1)
    with pytest.raises(Eagle3Error, match="records"):
        features.precompute(target, other, layers, out, 3, False, 4)
    # a features_dir holding a user's files is refused, the files untouched
    user = tmp_path / "user"
    user.mkdir()
    (user / "data.bin").write_bytes(b"x")
    with pytest.raises(Eagle3Error, match="did not write"):
        features.precompute(target, ds, layers, user, 3, False, 4)
    assert (user / "data.bin").read_bytes() == b"x"


def test_bfloat16_feature_store_is_the_float32_one_rounded(tiny_target_dir, tmp_path):
    import ml_dtypes

    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.training import features

    target = load_target(str(tiny_target_dir))
    ds, layers = _dataset(), (2,)
    f32 = _read(features.precompute(target, ds, layers, tmp_path / "a", 4, False, 4), layers)
    b16 = features.precompute(target, ds, layers, tmp_path / "b", 4, False, 4, dtype="bfloat16")
    assert (b16 / "hidden.npy").stat().st_size < (tmp_path / "a" / "hidden.npy").stat().st_size
    got = _read(b16, layers)
    for k in f32:
        rounded = f32[k].astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(got[k], rounded)
        assert got[k].dtype == np.float32


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    import os

    from eagle3_jax.checkpoints.atomic import exclusive, holder

    (tmp_path / "run").mkdir()
    assert holder(tmp_path / "run") is None  # never locked
    with exclusive(tmp_path / "run", "--out"):
        assert holder(tmp_path / "run") == str(os.getpid())  # what --status says
        with pytest.raises(Eagle3Error, match=f"pid {os.getpid()}"):
            with exclusive(tmp_path / "run", "--out"):
                pass
    assert holder(tmp_path / "run") is None  # released with its holder; asking took nothing
    with exclusive(tmp_path / "run"):
        pass
    with exclusive(tmp_path / "answers.jsonl"):  # a file: the lock sits beside it
        assert (tmp_path / "answers.jsonl.lock").is_file()


def test_regeneration_resumes_only_with_the_same_target_and_settings(tiny_target_dir, tmp_path):
    import os

    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.data.regenerate import regenerate

    target = load_target(str(tiny_target_dir))
    prompts = [("a", "w5 w6 w7"), ("b", "w8 w9")]
    out = tmp_path / "answers.jsonl"
    regenerate(target, prompts[:1], out, max_new_tokens=4, progress=False)
    with pytest.raises(Eagle3Error, match="differs in max_new_tokens"):
        regenerate(target, prompts, out, max_new_tokens=8, progress=False)
    assert regenerate(target, prompts, out, max_new_tokens=4, progress=False).resumed == 1
    # the target's weights replaced at the same path: another model, refused
    other = tmp_path / "target"
    other.mkdir()
    for f in tiny_target_dir.iterdir():
        (other / f.name).symlink_to(f)
    t2 = load_target(str(other))
    w = next(other.glob("*.safetensors"))
    regenerate(t2, prompts, tmp_path / "b.jsonl", max_new_tokens=4, progress=False)
    w.unlink()
    w.write_bytes(next(tiny_target_dir.glob("*.safetensors")).read_bytes())
    os.utime(w, ns=(1, 1))
    with pytest.raises(Eagle3Error, match="differs in target"):
        regenerate(t2, prompts, tmp_path / "b.jsonl", max_new_tokens=4, progress=False)
    # a file this command did not write is never appended to
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"id": "x"}\n')
    with pytest.raises(Eagle3Error, match="not written by this command"):
        regenerate(target, prompts, mine, max_new_tokens=4, progress=False)
    assert mine.read_text() == '{"id": "x"}\n'


def test_the_harness_refuses_a_users_folder_and_a_changed_target(tiny_target_dir, tmp_path):
    from eagle3_jax.evaluation.fingerprint import check_config

    user = tmp_path / "report"
    user.mkdir()
    (user / "notes.md").write_text("mine")
    with pytest.raises(Eagle3Error, match="not an evaluation run"):
        check_config(user, {"a": 1})
    assert sorted(p.name for p in user.iterdir()) == ["notes.md"]
    run = tmp_path / "run"
    check_config(run, {"target_digest": "1", "questions_digest": "q"})
    with pytest.raises(Eagle3Error, match="target's files or the question file changed"):
        check_config(run, {"target_digest": "2", "questions_digest": "q"})


def test_an_ablation_grid_refuses_a_second_writer_and_a_users_folder(tmp_path):
    import dataclasses
    from pathlib import Path

    from eagle3_jax.ablation.config import load_ablation
    from eagle3_jax.ablation.runner import run_ablation
    from eagle3_jax.checkpoints.atomic import exclusive

    root = Path(__file__).resolve().parents[1]
    ac = load_ablation(root / "configs/ablate_tiny.py")
    busy = dataclasses.replace(ac, out_dir=str(tmp_path / "grid"))
    (tmp_path / "grid").mkdir()
    with exclusive(tmp_path / "grid"):
        with pytest.raises(Eagle3Error, match="another process"):
            run_ablation(busy, progress=False)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine/thesis.tex").write_text("keep")
    with pytest.raises(Eagle3Error, match="not an ablation run"):
        run_ablation(dataclasses.replace(ac, out_dir=str(tmp_path / "mine")), progress=False)
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["thesis.tex"]


def test_training_never_writes_into_a_users_folder(tiny_target_dir, tmp_path):
    from pathlib import Path

    from eagle3_jax.training.config import load_config
    from eagle3_jax.training.loop import train

    root = Path(__file__).resolve().parents[1]
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("keep")
    tc = load_config(root / "configs/tiny.py", [f"--config.target={tiny_target_dir}",
                                                  f"--config.out_dir={mine}"])  # fmt: skip
    with pytest.raises(Eagle3Error, match="not a training run"):
        train(tc, progress=False)
    assert sorted(p.name for p in mine.iterdir()) == ["chapter1.tex"]


@pytest.mark.parametrize(
    "record, field, said",
    [
        ({"question_id": 1, "turns": "a single string"}, "turns", "is a string; give a list"),
        ({"question_id": 1, "turns": ["fine", 7]}, "turns", "item 1 is an integer"),
        ({"question_id": 1, "turns": ["fine"], "category": ["writing"]}, "category", "is a list"),
        ({"question_id": 1, "question": {"text": "x"}}, "question", "is an object"),
        ({"question_id": 1, "prompt": 42}, "prompt", "is an integer; give a string"),
        ({"question_id": True, "turns": ["fine"]}, "question_id", "true/false"),
    ],
)
def test_question_fields_of_the_wrong_type_are_one_line(tmp_path, capsys, record, field, said):
    """A question file's record whose field has the wrong JSON type is refused before any work:
    one line naming the file, the line and record number, and the field; exit 2."""
    import json

    from eagle3_jax.cli import eval as eval_cli
    from eagle3_jax.evaluation.questions import read_questions

    path = tmp_path / "questions.jsonl"
    good = {"question_id": 0, "category": "qa", "turns": ["w5 w6"]}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(record) + "\n")
    with pytest.raises(Eagle3Error, match=rf"questions.jsonl:3 \(record 2\): field `{field}`"):
        read_questions(path)
    out = tmp_path / "eval"
    argv = ["--bench", str(path), "--target", str(tmp_path / "absent"), "--out", str(out)]
    assert eval_cli.main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(path) in err and f"`{field}`" in err and said in err
    assert not out.exists()
    # the same fields with their types are read: a `prompt` is a one-turn question
    path.write_text(json.dumps(good) + "\n" + json.dumps({"id": "p", "prompt": "w7"}) + "\n")
    assert [q.turns for q in read_questions(path)] == [("w5 w6",), ("w7",)]


def test_a_second_feature_precompute_is_refused_naming_the_holder(tmp_path, capsys):
    """`train --precompute-features` holds a lock beside its features_dir: a second one into the
    same store gets one line naming the holder's pid, exit 2, before any work; the lock never
    sits inside the store's folder (a user's empty folder there stays empty)."""
    import os
    from pathlib import Path

    from eagle3_jax.cli import train as train_cli
    from eagle3_jax.training.prepare import store_lock

    root = Path(__file__).resolve().parents[1]
    feats, run = tmp_path / "feats", tmp_path / "run"
    feats.mkdir()
    argv = ["--config", str(root / "configs/tiny.py"), "--precompute-features", "--no-progress",
            f"--config.features_dir={feats}", f"--config.out_dir={run}"]  # fmt: skip
    with store_lock(feats):
        assert train_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert (
        f"features_dir {feats} is being precomputed by another process (pid {os.getpid()})" in err
    )
    assert list(feats.iterdir()) == [] and not run.exists()
    assert (tmp_path / ".feats.process0.lock").is_file()  # one per process of a run
    with store_lock(feats):  # released with its holder
        pass
