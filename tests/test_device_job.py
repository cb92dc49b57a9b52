"""scripts/device_job.py: the GGUF travels in parts and is joined exactly, or refused."""

import argparse
import importlib.util
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
    assert dj.check(None) == 0
    assert "missing [0]" in capsys.readouterr().out
    args = argparse.Namespace(out=str(tmp_path / "out"), target=None, no_install=True, minutes=1.0)
    assert dj.run(args) == 1
    log = (tmp_path / "runs" / "turns" / "device_log.txt").read_text()
    assert "missing parts [0]" in log
    # the logs are packed even when the job stops early
    assert (tmp_path / "out" / "logs.tar.gz").exists()
