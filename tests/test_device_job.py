"""scripts/device_job.py: the GGUF travels in parts and is joined exactly, or refused."""

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


def test_parts_join_back_exactly_and_a_damaged_part_is_refused(dj, tmp_path):
    data = bytes(range(256)) * 1000 + b"tail"  # 256,004 bytes: a short last part
    src = tmp_path / "model.gguf"
    src.write_bytes(data)
    parts = dj.split_file(src, tmp_path / "parts", 100_000, "gguf")
    assert [p.stat().st_size for p in parts] == [100_000, 100_000, 56_004]
    out = dj.join_parts(parts, tmp_path / "joined" / "model.gguf", dj.sha256(src))
    assert out.read_bytes() == data
    parts[1].write_bytes(b"x" + parts[1].read_bytes()[1:])
    with pytest.raises(SystemExit, match="sha256"):
        dj.join_parts(parts, tmp_path / "again.gguf", dj.sha256(src))
    assert not (tmp_path / "again.gguf").exists()
    assert not (tmp_path / "again.gguf.tmp").exists()


def test_run_refuses_until_every_part_is_there(dj, tmp_path, monkeypatch, capsys):
    device = tmp_path / ".device"
    monkeypatch.setattr(dj, "DEVICE", device)
    monkeypatch.setattr(dj, "TURNS", tmp_path / "runs" / "turns" / "regenerated_turns.jsonl")
    monkeypatch.setattr(dj, "TRAIN_OUT", tmp_path / "runs" / "turns" / "train")
    (device / "p1").mkdir(parents=True)
    (device / "p1" / "gguf.part1").write_bytes(b"b")
    (device / "p1" / "manifest.json").write_text(
        '{"name": "m.gguf", "size": 2, "sha256": "0", "parts": 2}'
    )
    monkeypatch.setattr(dj, "FULL_CONVERSATIONS", device / "conv" / "c.jsonl.gz")
    assert dj.check(None) == 0
    assert "missing [0]" in capsys.readouterr().out
    args = argparse.Namespace(out=str(tmp_path / "out"), target=None, no_install=True, minutes=1.0)
    assert dj.run(args) == 1
    log = (tmp_path / "runs" / "turns" / "device_log.txt").read_text()
    assert "missing parts [0]" in log
    # the logs are packed even when the job stops early
    assert (tmp_path / "out" / "results.tar.gz").exists()
    # so does the tree bench, and its log still comes back
    monkeypatch.setattr(dj, "BENCH_OUT", tmp_path / "runs" / "turns" / "gpu_trees")
    bench = argparse.Namespace(out=str(tmp_path / "out"), target=None, no_install=True, minutes=1.0)
    assert dj.bench(bench) == 1
    import tarfile

    with tarfile.open(tmp_path / "out" / "bench.tar.gz") as t:
        assert t.getnames() == ["device_log.txt"]


def test_results_come_back_in_parts_and_unpack_restores_them(dj, tmp_path, monkeypatch):
    turns = tmp_path / "runs" / "turns" / "regenerated_turns.jsonl"
    train = tmp_path / "runs" / "turns" / "train"
    monkeypatch.setattr(dj, "TURNS", turns)
    monkeypatch.setattr(dj, "TRAIN_OUT", train)
    monkeypatch.setattr(dj, "PART_MIB", 1 / 16)  # 64 KiB parts
    (train / "head").mkdir(parents=True)
    weights = bytes(range(256)) * 600  # 150 KiB: three parts
    (train / "head" / "model.safetensors").write_bytes(weights)
    (train / "metrics.jsonl").write_text('{"step": 1}\n')
    turns.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "cut')  # a partial last record
    out = tmp_path / "out"
    out.mkdir()
    n = dj.pack_results(out, dj.Log(turns.parent / "device_log.txt"))
    names = sorted(p.name for p in out.iterdir())
    assert n == len(names) == 5 and names[:3] == [f"head.tar.part{i}" for i in range(3)]
    assert all(p.stat().st_size <= 64 * 1024 for p in out.iterdir())
    back = tmp_path / "back"
    assert dj.unpack(argparse.Namespace(files_at=str(out), dest=str(back))) == 0
    assert (back / "head" / "model.safetensors").read_bytes() == weights
    assert (back / "regenerated_turns.jsonl").read_bytes() == b'{"id": "a"}\n{"id": "b"}\n'
    assert (back / "results" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # never into a folder that holds something (an earlier result, a dry run's head)
    with pytest.raises(SystemExit, match="not empty"):
        dj.unpack(argparse.Namespace(files_at=str(out), dest=str(back)))
    # packing again (after the answers, then at the end) replaces the earlier parts
    (train / "head" / "model.safetensors").write_bytes(b"small")
    n = dj.pack_results(out, dj.Log(turns.parent / "device_log.txt"))
    assert n == 3 == len([p for p in out.iterdir() if ".part" in p.name]) + 1


def test_complete_records_of_a_cut_off_json_array(dj):
    recs = [{"id": "a", "conversations": []}, {"id": "b, ]", "x": [1, {"y": "]"}]}]
    whole = json.dumps(recs, indent=1)
    assert dj.complete_records(whole) == recs
    cut = whole[: whole.index('"x"') + 6]  # inside the second record
    assert dj.complete_records(cut) == recs[:1]
    assert dj.complete_records("[]") == [] and dj.complete_records("[\n") == []


def test_parts_are_sized_to_fit_a_call_with_the_working_tree(dj):
    """Every device call sends the working tree with its carry, 64 MiB at most: the GGUF's parts
    take what the tree and the wheels (carried with the last part) leave; a tree that leaves too
    little, or an asked size that does not fit, is refused with the sizes named."""
    mib = dj.MIB
    assert dj.part_size(34 * mib, 2 * mib, 5 * mib) == 27 * mib  # 64 - 1 margin - 34 - 2
    assert dj.part_size(34 * mib, 2 * mib, 5 * mib, part_mib=20) == 20 * mib
    with pytest.raises(SystemExit, match=r"--part-mib 30: .* at most 27\.0"):
        dj.part_size(34 * mib, 2 * mib, 5 * mib, part_mib=30)
    for bad in (0, -1, 0.5):  # no parts, or one part of the whole file
        with pytest.raises(SystemExit, match="at least 1 MiB"):
            dj.part_size(34 * mib, 2 * mib, 5 * mib, part_mib=bad)
    with pytest.raises(SystemExit, match=r"working tree \(60\.0 MiB\) leaves 1\.0 MiB"):
        dj.part_size(60 * mib, 2 * mib, 0)
    with pytest.raises(SystemExit, match=r"first call's carry"):
        dj.part_size(50 * mib, 2 * mib, 20 * mib)


def test_the_tracked_tree_leaves_room_for_the_gguf(dj):
    """The repository itself must leave the device job room: at least a sixth of the 94 MiB
    GGUF per call, so that it travels in at most six parts plus the wheels' call (four until the
    shipped head grew to 16,384 ids: each part is a call of a short lease)."""
    if not (dj.ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing travels from here")
    tree = dj._travelling_bytes()
    assert dj.CALL_LIMIT - dj.CALL_MARGIN - tree - 1 * dj.MIB >= 94 * dj.MIB / 6, tree / dj.MIB
