"""scripts/device_job.py and its steps (scripts/device_steps/): the GGUF travels in parts and is
joined exactly, or refused; every subcommand parses as before."""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_job.py"


@pytest.fixture(scope="module")
def dj():
    spec = importlib.util.spec_from_file_location("device_job", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def c(dj):
    """device_steps.common: the paths and helpers every step reads (patch them here)."""
    return dj.c


def test_parts_join_back_exactly_and_a_damaged_part_is_refused(c, tmp_path):
    data = bytes(range(256)) * 1000 + b"tail"  # 256,004 bytes: a short last part
    src = tmp_path / "model.gguf"
    src.write_bytes(data)
    parts = c.split_file(src, tmp_path / "parts", 100_000, "gguf")
    assert [p.stat().st_size for p in parts] == [100_000, 100_000, 56_004]
    out = c.join_parts(parts, tmp_path / "joined" / "model.gguf", c.sha256(src))
    assert out.read_bytes() == data
    parts[1].write_bytes(b"x" + parts[1].read_bytes()[1:])
    with pytest.raises(SystemExit, match="sha256"):
        c.join_parts(parts, tmp_path / "again.gguf", c.sha256(src))
    assert not (tmp_path / "again.gguf").exists()
    assert not (tmp_path / "again.gguf.tmp").exists()


def test_run_refuses_until_every_part_is_there(dj, c, tmp_path, monkeypatch, capsys):
    device = tmp_path / ".device"
    monkeypatch.setattr(c, "DEVICE", device)
    monkeypatch.setattr(c, "TURNS", tmp_path / "runs" / "turns" / "regenerated_turns.jsonl")
    monkeypatch.setattr(c, "TRAIN_OUT", tmp_path / "runs" / "turns" / "train")
    (device / "p1").mkdir(parents=True)
    (device / "p1" / "gguf.part1").write_bytes(b"b")
    (device / "p1" / "manifest.json").write_text(
        '{"name": "m.gguf", "size": 2, "sha256": "0", "parts": 2}'
    )
    monkeypatch.setattr(c, "FULL_CONVERSATIONS", device / "conv" / "c.jsonl.gz")
    assert dj.transfer.check(None) == 0
    assert "missing [0]" in capsys.readouterr().out
    args = argparse.Namespace(out=str(tmp_path / "out"), target=None, no_install=True, minutes=1.0)
    assert dj.turns.run(args) == 1
    log = (tmp_path / "runs" / "turns" / "device_log.txt").read_text()
    assert "missing parts [0]" in log
    # the logs are packed even when the job stops early
    assert (tmp_path / "out" / "results.tar.gz").exists()
    # so does the tree bench, and its log still comes back
    monkeypatch.setattr(c, "BENCH_OUT", tmp_path / "runs" / "turns" / "gpu_trees")
    bench = argparse.Namespace(out=str(tmp_path / "out"), target=None, no_install=True, minutes=1.0)
    assert dj.turns.bench(bench) == 1
    import tarfile

    with tarfile.open(tmp_path / "out" / "bench.tar.gz") as t:
        assert t.getnames() == ["device_log.txt"]


def test_results_come_back_in_parts_and_unpack_restores_them(dj, c, tmp_path, monkeypatch):
    turns = tmp_path / "runs" / "turns" / "regenerated_turns.jsonl"
    train = tmp_path / "runs" / "turns" / "train"
    monkeypatch.setattr(c, "TURNS", turns)
    monkeypatch.setattr(c, "TRAIN_OUT", train)
    monkeypatch.setattr(c, "PART_MIB", 1 / 16)  # 64 KiB parts
    (train / "head").mkdir(parents=True)
    weights = bytes(range(256)) * 600  # 150 KiB: three parts
    (train / "head" / "model.safetensors").write_bytes(weights)
    (train / "metrics.jsonl").write_text('{"step": 1}\n')
    turns.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "cut')  # a partial last record
    out = tmp_path / "out"
    out.mkdir()
    n = dj.turns.pack_results(out, c.Log(turns.parent / "device_log.txt"))
    names = sorted(p.name for p in out.iterdir())
    assert n == len(names) == 5 and names[:3] == [f"head.tar.part{i}" for i in range(3)]
    assert all(p.stat().st_size <= 64 * 1024 for p in out.iterdir())
    back = tmp_path / "back"
    assert dj.transfer.unpack(argparse.Namespace(files_at=str(out), dest=str(back))) == 0
    assert (back / "head" / "model.safetensors").read_bytes() == weights
    assert (back / "regenerated_turns.jsonl").read_bytes() == b'{"id": "a"}\n{"id": "b"}\n'
    assert (back / "results" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # never into a folder that holds something (an earlier result, a dry run's head)
    with pytest.raises(SystemExit, match="not empty"):
        dj.transfer.unpack(argparse.Namespace(files_at=str(out), dest=str(back)))
    # packing again (after the answers, then at the end) replaces the earlier parts
    (train / "head" / "model.safetensors").write_bytes(b"small")
    n = dj.turns.pack_results(out, c.Log(turns.parent / "device_log.txt"))
    assert n == 3 == len([p for p in out.iterdir() if ".part" in p.name]) + 1


def test_complete_records_of_a_cut_off_json_array(dj):
    recs = [{"id": "a", "conversations": []}, {"id": "b, ]", "x": [1, {"y": "]"}]}]
    whole = json.dumps(recs, indent=1)
    assert dj.transfer.complete_records(whole) == recs
    cut = whole[: whole.index('"x"') + 6]  # inside the second record
    assert dj.transfer.complete_records(cut) == recs[:1]
    assert dj.transfer.complete_records("[]") == []
    assert dj.transfer.complete_records("[\n") == []


def test_parts_are_sized_to_fit_a_call_with_the_working_tree(dj, c):
    """Every device call sends the working tree with its carry, 64 MiB at most: the GGUF's parts
    take what the tree and the wheels (carried with the last part) leave; a tree that leaves too
    little, or an asked size that does not fit, is refused with the sizes named."""
    mib, part_size = c.MIB, dj.transfer.part_size
    assert part_size(34 * mib, 2 * mib, 5 * mib) == 27 * mib  # 64 - 1 margin - 34 - 2
    assert part_size(34 * mib, 2 * mib, 5 * mib, part_mib=20) == 20 * mib
    with pytest.raises(SystemExit, match=r"--part-mib 30: .* at most 27\.0"):
        part_size(34 * mib, 2 * mib, 5 * mib, part_mib=30)
    for bad in (0, -1, 0.5):  # no parts, or one part of the whole file
        with pytest.raises(SystemExit, match="at least 1 MiB"):
            part_size(34 * mib, 2 * mib, 5 * mib, part_mib=bad)
    with pytest.raises(SystemExit, match=r"working tree \(60\.0 MiB\) leaves 1\.0 MiB"):
        part_size(60 * mib, 2 * mib, 0)
    with pytest.raises(SystemExit, match=r"first call's carry"):
        part_size(50 * mib, 2 * mib, 20 * mib)


def test_the_tracked_tree_leaves_room_for_the_gguf(dj, c):
    """The repository itself must leave the device job room: at least a sixth of the 94 MiB
    GGUF per call, so that it travels in at most six parts plus the wheels' call (four until the
    shipped head grew to 16,384 ids: each part is a call of a short lease)."""
    if not (c.ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing travels from here")
    tree = dj.transfer._travelling_bytes()
    assert c.CALL_LIMIT - c.CALL_MARGIN - tree - 1 * c.MIB >= 94 * c.MIB / 6, tree / c.MIB


def test_every_subcommand_parses_as_before_and_reaches_its_step(dj, monkeypatch):
    """The dispatcher keeps each subcommand's flags and defaults and hands them to its step."""
    seen = {}
    for mod, name in [
        (dj.transfer, "pack"), (dj.transfer, "check"), (dj.turns, "run"), (dj.turns, "bench"),
        (dj.transfer, "unpack"),
    ]:  # fmt: skip
        monkeypatch.setattr(mod, name, lambda a, name=name: seen.setdefault(name, a) and 0)
    dj.main(["pack", "--part-mib", "12", "--shipped-conversations"])
    assert seen["pack"].part_mib == 12 and seen["pack"].shipped_conversations
    dj.main(["check"])
    assert "check" in seen
    dj.main(["run", "--minutes", "9", "--limit", "3", "--train-arg=--x=1", "--no-install"])
    r = seen["run"]
    assert (r.minutes, r.regen_minutes, r.reserve_s, r.batch_size, r.chunk) == (9, 4, 40, 512, 512)
    assert (r.max_batch_tokens, r.max_new_tokens, r.buckets, r.extend_vocab) == (
        262144, 256, "256,512", 16384,
    )  # fmt: skip
    assert r.limit == 3 and r.train_arg == ["--x=1"] and r.no_install and not r.no_train
    assert r.config.endswith("configs/smollm2_135m_turns.py")
    dj.main(["bench", "--dtype", "float32", "--questions", "2"])
    b = seen["bench"]
    assert (b.minutes, b.dtype, b.questions, b.max_new_tokens) == (4.0, "float32", 2, 64)
    assert b.methods == "vanilla,eagle3:2,3,4,eagle3:4,4,16,eagle3:10,8,60"
    dj.main(["unpack", "/x"])
    assert seen["unpack"].files_at == "/x" and seen["unpack"].dest.endswith("runs/device_result")
