"""Several JAX processes on this machine, as a pod or a SLURM job runs them: a localhost coordinator
(`eagle3_jax.distributed` reads JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID),
JAX's CPU collectives (gloo, jax's default on CPU) and 2 host-platform devices per process, so
the global mesh has 4 devices (2 data x 2 model); decoding takes 4 per process, an 8-device
2 data x 4 model mesh. Every worker asserts `jax.process_count() == 2`, so a run that falls back
to one process fails."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PROCESSES = 2
DEVICES = 2  # per process

# the command line (eagle3_jax.cli), then the check that it really ran as one of two processes
CLI_WORKER = (
    "import sys, jax; from eagle3_jax.cli import main; rc = main(sys.argv[1:]); "
    "assert jax.process_count() == 2, jax.process_count(); sys.exit(rc)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def xla_flags(devices: int) -> str:
    """This session's XLA_FLAGS (conftest: the tests' optimisation level, so the processes compile
    as this one compiles its reference) with `devices` simulated CPU devices. Defined here, not in
    helpers.py: the workers import this module as tests.test_multihost."""
    kept = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    return " ".join([f"--xla_force_host_platform_device_count={devices}", *kept])


def _env(port: int, pid: int, devices: int = DEVICES, **extra) -> dict:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": xla_flags(devices),
        "EAGLE3_JAX_COMPILATION_CACHE": "0",
        "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
        "JAX_NUM_PROCESSES": str(PROCESSES),
        "JAX_PROCESS_ID": str(pid),
        "EAGLE3_JAX_DISTRIBUTED_TIMEOUT": "120",
        **extra,
    }
    return env


def _launch(
    code: str, args: list[str], logs: Path, devices: int = DEVICES, **extra
) -> list[subprocess.Popen]:
    """The same command on every process (as on every worker of a pod), `devices` CPU devices
    each, logs in logs.{i}."""
    port = _free_port()
    procs = []
    for i in range(PROCESSES):
        with open(f"{logs}.{i}", "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code, *args],
                    cwd=ROOT,
                    env=_env(port, i, devices, **extra),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def _wait(procs, logs: Path, timeout: float = 600, expect: int = 0) -> None:
    deadline = time.time() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1, deadline - time.time()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, p in enumerate(procs):
        assert p.returncode == expect, Path(f"{logs}.{i}").read_text()[-3000:]


def _conversations(path: Path, n: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        q = " ".join(f"w{x}" for x in rng.integers(3, 97, 6))
        a = " ".join(f"w{x}" for x in rng.integers(3, 97, 14))
        turns = [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        recs.append({"id": f"c{seed}_{i}", "conversations": turns})
    path.write_text(json.dumps(recs))
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _head(run: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(run / "head" / "model.safetensors")


# ---------------------------------------------------------------------------------------------
# joining a cluster


def test_an_unreachable_coordinator_ends_with_one_line(tmp_path):
    """A worker whose coordinator never comes up, and a coordinator whose peers never join, each
    end with exit status 2 and one line naming the address, within the timeout (not a hang, and
    not JAX's abort with a C++ stack trace)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "eagle3_jax", "train", "--config=configs/tiny.py"]
    t0 = time.time()
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=_env(port + k, pid, EAGLE3_JAX_DISTRIBUTED_TIMEOUT="3"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k, pid in enumerate((1, 0))  # two different ports: neither meets the other
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    elapsed = time.time() - t0
    for k, (p, (out, err)) in enumerate(zip(procs, outs)):
        lines = [x for x in err.splitlines() if x.strip()]
        assert p.returncode == 2, err[-2000:]
        assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
        assert f"localhost:{port + k}" in lines[0]
        assert out == ""
    assert "cannot reach the JAX coordinator" in outs[0][1]
    assert "was not joined by all 2 processes" in outs[1][1]
    assert elapsed < 60  # 3 s of waiting, plus starting Python and JAX twice on 2 busy cores


JOIN_WORKER = """
import sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import multihost_utils
from eagle3_jax import distributed
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.sharding import make_mesh
from eagle3_jax.training.step import global_batch, process_rows, replicate

assert distributed.initialize() and distributed.initialize()  # joins once; a second call is a no-op
pid = jax.process_index()
assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
out = Path(sys.argv[1])
with distributed.primary_first("write"):  # process 0 writes, the other reads after it
    if pid == 0:
        (out / "made.txt").write_text("by 0")
    assert (out / "made.txt").read_text() == "by 0"
try:  # process 0 failing there: the other process gets its message, it does not wait forever
    with distributed.primary_first("fail"):
        if pid == 0:
            raise Eagle3Error("no training data here")
    raise AssertionError("primary_first did not raise")
except Eagle3Error as e:
    assert "no training data here" in str(e), e
# one decision for all: process 0 computes, every process gets its value (or its error)
assert distributed.from_primary("plan", lambda: {"steps": 7 if pid == 0 else -1}) == {"steps": 7}
try:
    distributed.from_primary("bad plan", lambda: (_ for _ in ()).throw(Eagle3Error("no budget")))
    raise AssertionError("from_primary did not raise")
except Eagle3Error as e:
    assert "no budget" in str(e), e
glob = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
for data, model, want in ((2, 2, slice(4 * pid, 4 * pid + 4)), (4, 1, slice(4 * pid, 4 * pid + 4)),
                          (1, 4, slice(0, 8))):
    mesh = make_mesh(data, model)
    rows = process_rows(mesh, 8)
    assert rows == want, (data, model, rows)
    x = global_batch({"x": glob[rows]}, mesh, 8)["x"]  # this process's rows only
    assert x.shape == (8, 3) and not x.is_fully_addressable
    total = jax.jit(lambda a, w: (a * w).sum(), out_shardings=jax.NamedSharding(mesh, jax.P()))(
        x, replicate(np.float32(2.0), mesh))
    assert float(total) == 2 * glob.sum()
    back = multihost_utils.process_allgather(x, tiled=True)
    np.testing.assert_array_equal(back, glob)
distributed.barrier("done")
print("ok", pid)
"""


def test_two_processes_join_and_build_global_batches(tmp_path):
    """Two processes join through the environment variables; process 0 writes first and its
    failure reaches the other; each reads only its rows of a global batch (which rows follows the
    mesh: half of them on 2 x 2 and 4 x 1, all on 1 x 4), and the arrays they build together are
    the global batch."""
    logs = tmp_path / "join.log"
    procs = _launch(JOIN_WORKER, [str(tmp_path)], logs)
    _wait(procs, logs, timeout=240)
    for i in range(PROCESSES):
        assert f"ok {i}" in Path(f"{logs}.{i}").read_text()


# ---------------------------------------------------------------------------------------------
# data jobs and the evaluation harness, split between the processes

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["w5 w6 w7 w8 w5 w6 w7", "w9 w10 w11"]},
    {"question_id": 2, "category": "qa", "turns": ["w40 w41 w12"]},
    {"question_id": 3, "category": "qa", "turns": ["w20 w21 w22 w20 w21"]},
]
# plain products on every process and in the reference (the CPU probes' choice could differ)
PRODUCTS = {"EAGLE3_JAX_ROW_PRODUCTS": "0", "EAGLE3_JAX_LOGIT_REDUCE": "0"}


def _chats(path: Path, n: int) -> Path:
    """Conversations of 1 to 3 user turns (--all-turns answers each in context)."""
    rng = np.random.default_rng(7)
    recs = []
    for i in range(n):
        turns = []
        for _ in range(1 + i % 3):
            turns += [{"from": "human", "value": " ".join(f"w{x}" for x in rng.integers(3, 97, 4))},
                      {"from": "gpt", "value": "w5 w6"}]  # fmt: skip
        recs.append({"id": f"t{i}", "conversations": turns})
    path.write_text(json.dumps(recs))
    return path


def _records_dataset(n: int = 10, t: int = 16):
    import types

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, t + 1, n)
    ids = rng.integers(3, 97, (n, t)).astype(np.int32)
    ids[np.arange(t)[None] >= lengths[:, None]] = 0
    return types.SimpleNamespace(input_ids=ids, lengths=lengths, num_records=n)


def data_jobs(target: str, inputs: Path, out: Path) -> None:
    """Regeneration (first turns, then every turn) and feature precompute, as the command lines
    run them: called alike by every process of a run, or by one process."""
    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.cli import main
    from eagle3_jax.training import features

    common = ["--target", target, "--batch-size", "2", "--max-new-tokens", "6", "--no-progress"]
    assert main(["regenerate", str(inputs / "prompts.json"), str(out / "first.jsonl"), *common,
                 "--max-prompt-tokens", "12"]) == 0  # fmt: skip
    assert main(["regenerate", str(inputs / "chats.json"), str(out / "turns.jsonl"), *common,
                 "--all-turns", "--max-len", "40", "--chunk", "2"]) == 0  # fmt: skip
    features.precompute(load_target(target), _records_dataset(), (1, 2, 3), out / "features",
                        3, False, 4, dtype="bfloat16")  # fmt: skip


def harness_job(target: str, inputs: Path, out: Path, mesh: str | None = None) -> None:
    """`python -m eagle3_jax eval` on the tiny target (vanilla and prompt lookup)."""
    from eagle3_jax.cli import main

    assert main(["eval", "--target", target, "--bench", str(inputs / "q.jsonl"),
                 "--methods", "vanilla,pld:1,3,4", "--max-new-tokens", "8",
                 "--out", str(out / "eval"), "--no-progress",
                 *(["--mesh", mesh] if mesh else [])]) == 0  # fmt: skip


DATA_WORKER = """
import sys
from pathlib import Path
import jax
from eagle3_jax import distributed
assert distributed.initialize() and jax.process_count() == 2
from tests import test_multihost
job = getattr(test_multihost, sys.argv[1])  # the same function the one-process reference runs
job(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), *sys.argv[5:])
print("ok", jax.process_index())
"""


def _untimed(rec: dict) -> dict:
    from eagle3_jax.evaluation.records import TIMING_KEYS

    rec = {k: v for k, v in rec.items() if k not in TIMING_KEYS}
    rec["turns"] = [{k: v for k, v in t.items() if k not in TIMING_KEYS} for t in rec["turns"]]
    return rec


def _inputs(d: Path) -> Path:
    inputs = d / "inputs"
    inputs.mkdir()
    _conversations(inputs / "prompts.json", 7, 3)
    _chats(inputs / "chats.json", 6)
    (inputs / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return inputs


def _both(job: str, target, d: Path, monkeypatch, *more: str) -> tuple[Path, Path]:
    """`job` on two processes and, meanwhile, on this one (the reference): their out dirs."""
    from tests import test_multihost

    inputs, two, one, logs = _inputs(d), d / "two", d / "one", d / f"{job}.log"
    t0 = time.time()
    procs = _launch(DATA_WORKER, [job, str(target), str(inputs), str(two), *more], logs, **PRODUCTS)
    for k, v in PRODUCTS.items():
        monkeypatch.setenv(k, v)
    getattr(test_multihost, job)(str(target), inputs, one)
    _wait(procs, logs, timeout=300)
    print(f"{job} on two processes and on one: {time.time() - t0:.0f} s")
    return two, one


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if not p.name.endswith(".lock"))


@pytest.mark.slow  # 17-19 s; two processes joining and batching stay in the default suite
def test_data_jobs_on_two_processes_equal_one(tiny_target_dir, tmp_path, monkeypatch):
    """Two processes split regeneration (first turns, and every turn in context) and the feature
    precompute: the answers are one process's byte for byte, and the feature store (process 0's
    features.json naming the two shards) reads as one process's, bit for bit; no shard of the
    answers is left behind."""
    from eagle3_jax.training.features import META, OfflineFeatures

    two, one = _both("data_jobs", tiny_target_dir, tmp_path, monkeypatch)
    for name in ("first.jsonl", "turns.jsonl"):
        assert (two / name).read_bytes() == (one / name).read_bytes(), name
        assert len(_lines(one / name)) > 2
    assert _files(two) == _files(one)  # no shard is left
    meta_two = json.loads((two / "features" / META).read_text())
    meta_one = json.loads((one / "features" / META).read_text())
    assert meta_two.pop("shards") == ["shard0", "shard1"] and "shards" not in meta_one
    assert meta_two == meta_one
    ds = _records_dataset()
    rows = np.random.default_rng(1).permutation(ds.num_records)
    for length in (None, 8):
        got = OfflineFeatures(two / "features", ds, (3, 1)).batch(rows, length)
        want = OfflineFeatures(one / "features", ds, (3, 1)).batch(rows, length)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.slow  # ~60-120 s on 2 busy cores
def test_the_harness_on_two_processes_equals_one(tiny_target_dir, tmp_path, monkeypatch):
    """Two processes split the harness's questions (each on `--mesh 1x2` over its own devices):
    process 0 writes the one records.jsonl, the one process's records in its order, and the one
    results.json and report; no shard is left behind."""
    two, one = _both("harness_job", tiny_target_dir, tmp_path, monkeypatch, "1x2")
    two, one = two / "eval", one / "eval"
    got = [_untimed(r) for r in _lines(two / "records.jsonl")]
    want = [_untimed(r) for r in _lines(one / "records.jsonl")]
    assert len(want) == 3 * 2 and got == want
    assert _files(two) == _files(one)
    res = json.loads((two / "results.json").read_text())
    assert [_untimed(r) for r in res["records"]] == [
        _untimed(r) for r in json.loads((one / "results.json").read_text())["records"]
    ]


@pytest.mark.slow  # ~2-3 min on 2 busy cores
def test_training_with_regeneration_on_two_processes_equals_one(tiny_target_dir, tmp_path):
    """train with regenerate=True on 2 processes: the processes answer the prompts together
    (split, merged by process 0) before process 0 tokenises them, and the answers and the
    losses equal one process's."""
    from eagle3_jax.training.config import load_config
    from eagle3_jax.training.loop import train

    overrides = [
        f"--config.target={tiny_target_dir}",
        f"--config.data={_conversations(tmp_path / 'data.json', 12, 0)}",
        "--config.regenerate=True", "--config.regen_max_new_tokens=6",
        "--config.regen_batch_size=2", "--config.max_steps=4",
        "--config.mesh_data=2", "--config.mesh_model=2",
    ]  # fmt: skip
    one, two, logs = tmp_path / "one", tmp_path / "two", tmp_path / "regen.log"
    args = ["--config=configs/tiny.py", "--no-progress", *overrides]
    procs = _launch(CLI_WORKER, _train_args(args, two), logs)
    one_run = load_config(ROOT / "configs/tiny.py", [*overrides, f"--config.out_dir={one}"])
    train(one_run, progress=False)
    _wait(procs, logs)
    got = (two / "regenerated.jsonl").read_bytes()
    assert got == (one / "regenerated.jsonl").read_bytes() and got.count(b"\n") == 12
    assert not list(two.glob("regenerated.jsonl.part*"))
    a, b = _lines(two / "metrics.jsonl"), _lines(one / "metrics.jsonl")
    assert [m["step"] for m in a] == [1, 2, 3, 4]
    np.testing.assert_allclose([m["loss"] for m in a], [m["loss"] for m in b], rtol=1e-5)


@pytest.mark.slow  # ~60-80 s on 2 busy cores
def test_train_precompute_features_on_two_processes_equals_one(tiny_target_dir, tmp_path):
    """`train --precompute-features` with regenerate=True on 2 processes: the answers
    (regenerated.jsonl), the token dataset and the feature store equal one process's."""
    from eagle3_jax.cli import main
    from eagle3_jax.data import dataset as dsm
    from eagle3_jax.training.features import OfflineFeatures

    args = [
        "train", "--precompute-features", "--config=configs/tiny.py", "--no-progress",
        f"--config.target={tiny_target_dir}",
        f"--config.data={_conversations(tmp_path / 'data.json', 9, 0)}",
        "--config.regenerate=True", "--config.regen_max_new_tokens=6",
        "--config.regen_batch_size=2", "--config.feature_dtype=bfloat16",
    ]  # fmt: skip
    runs = {n: (tmp_path / n, tmp_path / f"{n}_features") for n in ("one", "two")}
    where = lambda n: [f"--config.out_dir={runs[n][0]}", f"--config.features_dir={runs[n][1]}"]  # noqa: E731
    logs = tmp_path / "pre.log"
    procs = _launch(CLI_WORKER, [*args, *where("two")], logs)
    assert main([*args, *where("one")]) == 0
    _wait(procs, logs)
    (one, fone), (two, ftwo) = runs["one"], runs["two"]
    got = (two / "regenerated.jsonl").read_bytes()
    assert got == (one / "regenerated.jsonl").read_bytes() and got.count(b"\n") == 9
    a, b = dsm.load(two / "dataset.npz"), dsm.load(one / "dataset.npz")
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    layers = tuple(json.loads((fone / "features.json").read_text())["layers"])
    rows = np.arange(b.num_records)
    x, y = (
        OfflineFeatures(ftwo, a, layers).batch(rows),
        OfflineFeatures(fone, b, layers).batch(rows),
    )
    for k in y:
        np.testing.assert_array_equal(x[k], y[k], err_msg=k)


FAIL_WORKER = """
import sys
from pathlib import Path
import jax
from eagle3_jax import distributed
assert distributed.initialize() and jax.process_count() == 2
from eagle3_jax.checkpoints import load_target
from eagle3_jax.data import regenerate as regen
from eagle3_jax.data.conversations import first_user_turns, read_conversations
from eagle3_jax.errors import Eagle3Error

target, prompts = load_target(sys.argv[1]), first_user_turns(read_conversations(sys.argv[2])[0])
if jax.process_index() == 1:  # its first batch fails
    def broken(*a, **k):
        raise Eagle3Error("disk full")
    regen._answer = broken
try:
    regen.regenerate(target, prompts, Path(sys.argv[3]), max_new_tokens=6, batch_size=2,
                     progress=False)
except Eagle3Error as e:
    print("stopped:", e)
    sys.exit(3)
"""


@pytest.mark.slow  # ~30-60 s on 2 busy cores
def test_a_process_that_fails_stops_the_other_and_its_work_is_resumed(tiny_target_dir, tmp_path):
    """Process 1 fails in its first batch: it exits with its error, process 0 answers its own
    batches and then stops naming process 1 (no hang); a resumed run (here one process) folds
    process 0's shard in, answers the rest, and holds an uninterrupted run's records."""
    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.data.conversations import first_user_turns, read_conversations
    from eagle3_jax.data.regen_output import shard_path
    from eagle3_jax.data.regenerate import regenerate

    data = _conversations(tmp_path / "prompts.json", 7, 3)
    out, logs = tmp_path / "answers.jsonl", tmp_path / "fail.log"
    procs = _launch(FAIL_WORKER, [str(tiny_target_dir), str(data), str(out)], logs)
    for p in procs:
        p.wait(timeout=300)
    text = [Path(f"{logs}.{i}").read_text() for i in range(PROCESSES)]
    assert [p.returncode for p in procs] == [3, 3], text
    assert "stopped: process 1 stopped: disk full" in text[0] and "stopped: disk full" in text[1]
    assert len(_lines(shard_path(out, 0, 2))) == 4  # batches 0 and 2 of 4, kept
    assert not out.exists()  # nothing merged
    target = load_target(str(tiny_target_dir))
    prompts = first_user_turns(read_conversations(data)[0])
    stats = regenerate(target, prompts, out, max_new_tokens=6, batch_size=2, progress=False)
    assert (stats.resumed, stats.answered) == (4, 3)
    ref = tmp_path / "ref.jsonl"
    regenerate(target, prompts, ref, max_new_tokens=6, batch_size=2, progress=False)
    assert sorted(out.read_text().splitlines()) == sorted(ref.read_text().splitlines())
    assert not list(tmp_path.glob("answers.jsonl.part*"))


def test_a_feature_store_named_by_the_earlier_target_hash_is_reused_not_rebuilt(
    tiny_target_dir, tmp_path, monkeypatch
):
    """A store names its target by the target's files (`target_digest`, what every other reuse
    check uses; it reads no weight, so a target spread over hosts digests too). Stores written
    before recorded a hash of the config and sampled weights: a finished one whose hash, computed
    now, matches is reused (nothing recomputed) and relabelled with the digest, the old hash kept
    beside it; a partial one resumes where it stopped; another target's store is refused."""
    from eagle3_jax.checkpoints import load_target, target_digest
    from eagle3_jax.errors import Eagle3Error
    from eagle3_jax.training import features
    from eagle3_jax.training.features import META, PROGRESS, OfflineFeatures

    target = load_target(str(tiny_target_dir))
    ds, layers = _records_dataset(), (1, 2)
    store = features.precompute(target, ds, layers, tmp_path / "f", 3, False, 4)
    want = OfflineFeatures(store, ds, layers).batch(np.arange(ds.num_records))
    meta = json.loads((store / META).read_text())
    old = features.legacy_target_fingerprint(target)
    assert meta["inputs"]["target"] == target_digest(tiny_target_dir) != old
    meta["inputs"]["target"] = old  # the store as the earlier version wrote it
    (store / META).write_text(json.dumps(meta))
    stamp = (store / "hidden.npy").stat().st_mtime_ns

    def never(*a, **k):
        raise AssertionError("recomputed")

    with monkeypatch.context() as m:
        m.setattr(features, "target_features", never)
        assert features.precompute(target, ds, layers, store, 3, False, 4) == store
    now = json.loads((store / META).read_text())
    assert now["inputs"]["target"] == target_digest(tiny_target_dir)
    assert now["legacy_target_fingerprint"] == old
    assert (store / "hidden.npy").stat().st_mtime_ns == stamp
    meta["inputs"]["target"] = "0123456789abcdef"  # another target's hash: refused
    (store / META).write_text(json.dumps(meta))
    with pytest.raises(Eagle3Error, match="target differ"):
        features.precompute(target, ds, layers, store, 3, False, 4)

    # a partial store of the earlier version, killed after two of its four batches, resumes
    calls = {"n": 0}
    real = features.bucket_length

    def counted(*a):
        calls["n"] += 1
        if calls["n"] > 2:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(features, "bucket_length", counted)
    with pytest.raises(KeyboardInterrupt):
        features.precompute(target, ds, layers, tmp_path / "p", 3, False, 4, checkpoint_seconds=0)
    progress = tmp_path / "p.partial" / PROGRESS
    state = json.loads(progress.read_text())
    progress.write_text(json.dumps({"inputs": {**state["inputs"], "target": old},
                                    "done_batches": state["done_batches"]}))  # fmt: skip
    calls["n"] = -100
    out = features.precompute(target, ds, layers, tmp_path / "p", 3, False, 4)
    assert calls["n"] == -100 + 2  # only the two batches left
    got = OfflineFeatures(out, ds, layers).batch(np.arange(ds.num_records))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


# ---------------------------------------------------------------------------------------------
# decoding on one mesh over both processes


@pytest.fixture(scope="module")
def decode_head(tiny_target_dir, tmp_path_factory):
    """A tiny random EAGLE-3 head for the tiny target (as tests/test_cli.py builds it)."""
    import jax

    from eagle3_jax.checkpoints.eagle_format import save_draft
    from eagle3_jax.checkpoints.hf import load_hf
    from eagle3_jax.models import draft as drf
    from eagle3_jax.vocab import identity

    _, cfg = load_hf(tiny_target_dir)
    dcfg = drf.DraftConfig.from_target(cfg)
    d = tmp_path_factory.mktemp("decode_head")
    params = drf.init_params(dcfg, jax.random.PRNGKey(3), scale=0.2)
    save_draft(d, params, dcfg, identity(cfg.vocab_size), dtype="float32")
    return d


DECODE_PROMPTS = ["w5 w6 w7 w8 w5 w6 w7", "w40 w41 w12", "w20 w21 w22 w20 w21", "w9 w10"]
# the command line once per argument list (JSON), in one process (as run twice by hand)
DECODE_WORKER = """
import json, sys, jax
from eagle3_jax.cli import main
for argv in json.loads(sys.argv[1]):
    assert main(argv) == 0, argv
    assert jax.process_count() == 2, jax.process_count()
"""


def _decode_runs(target, head, out: Path, *more: str) -> list[list[str]]:
    """EAGLE-3 with the head (and plain decoding beside it), then prompt lookup, which accepts
    drafted tokens from these repetitive outputs where the random head accepts none."""
    common = ["decode", "--target", str(target), "--max-new-tokens", "10", "--batch-size", "2",
              "--compare-plain", *more, *[a for p in DECODE_PROMPTS for a in ("--prompt", p)]]  # fmt: skip
    tree = ["--top-k", "2", "--depth", "3", "--total-tokens", "6"]
    return [
        [*common, "--draft", str(head), *tree, "--json", str(out / "eagle3.json")],
        [*common, "--method", "pld", "--depth", "3", "--json", str(out / "pld.json")],
    ]


@pytest.mark.slow  # over the default suite's time on 2 busy cores (measured in the commit)
def test_decode_on_a_mesh_over_two_processes_equals_one_device(
    tiny_target_dir, decode_head, tmp_path, monkeypatch
):
    """`decode --mesh 2x4` on 2 processes of 4 devices each (the target and head tensor-parallel
    over each process's 4 devices, each batch's rows over the 2 processes): EAGLE-3, prompt
    lookup and plain decoding give the tokens, target passes and acceptance of one device;
    process 0 alone prints the answers and writes --json."""
    from eagle3_jax.cli import main

    two, one, logs = tmp_path / "two", tmp_path / "one", tmp_path / "decode.log"
    two.mkdir(), one.mkdir()
    t0 = time.time()
    runs = json.dumps(_decode_runs(tiny_target_dir, decode_head, two, "--mesh", "2x4"))
    procs = _launch(DECODE_WORKER, [runs], logs, devices=4, **PRODUCTS)
    for k, v in PRODUCTS.items():
        monkeypatch.setenv(k, v)
    for argv in _decode_runs(tiny_target_dir, decode_head, one):
        assert main(argv) == 0
    _wait(procs, logs, timeout=500)
    print(f"decode on two processes and on one: {time.time() - t0:.0f} s")
    for name in ("eagle3.json", "pld.json"):
        got, want = json.loads((two / name).read_text()), json.loads((one / name).read_text())
        assert len(want) == 4
        for key in ("id", "output_ids", "target_forwards", "accept_hist", "identical_to_plain"):
            assert [r[key] for r in got] == [r[key] for r in want], (name, key)
        assert all(r["identical_to_plain"] for r in got)
    accepted = [sum(r["accept_hist"][1:]) for r in json.loads((two / "pld.json").read_text())]
    assert sum(accepted) > 0  # rounds that accepted drafted tokens, not only the root
    out = [Path(f"{logs}.{i}").read_text() for i in range(PROCESSES)]
    assert out[0].count("### [") == 8 and out[0].count("wrote 4 records") == 2
    assert "### [" not in out[1] and "wrote" not in out[1], out[1][-2000:]


def test_decode_on_two_processes_needs_a_mesh_over_both(tiny_target_dir, tmp_path):
    """On several processes decode runs each batch on one mesh over all of them: a mesh over
    fewer devices (or none) is one line and exit status 2 on every process, before the load."""
    logs = tmp_path / "part.log"
    base = ["decode", "--target", str(tiny_target_dir), "--method", "vanilla", "--prompt", "w5"]
    code = CLI_WORKER.replace("sys.exit(rc)", "print('rc', rc)")
    _wait(_launch(code, [*base, "--mesh", "1x4"], logs, devices=4), logs, timeout=200)
    for i in range(PROCESSES):
        text = Path(f"{logs}.{i}").read_text()
        errors = [x for x in text.splitlines() if x.startswith("error:")]
        assert "rc 2" in text and len(errors) == 1, text[-2000:]
        assert "--mesh 1x4 covers 4 of the 8 devices of 2 processes" in errors[0]


# ---------------------------------------------------------------------------------------------
# training


@pytest.fixture(scope="module")
def setup(tiny_target_dir, tmp_path_factory):
    """Data, the common arguments, and the one-process run on a 2 x 2 mesh every run is held to."""
    from eagle3_jax.training.config import load_config
    from eagle3_jax.training.loop import train

    d = tmp_path_factory.mktemp("multihost")
    args = [
        "--config=configs/tiny.py",
        "--no-progress",
        f"--config.target={tiny_target_dir}",
        f"--config.data={_conversations(d / 'data.json', 12, 0)}",
        f"--config.val_data={_conversations(d / 'held.json', 4, 5)}",
        "--config.val_every=2",
        "--config.max_steps=16",
        "--config.save_every=2",
        "--config.export_every=4",
        "--config.mesh_data=2",
        "--config.mesh_model=2",
    ]
    one = d / "one"
    overrides = [a for a in args if a.startswith("--config.")] + [f"--config.out_dir={one}"]
    train(load_config(ROOT / "configs/tiny.py", overrides), progress=False)
    return d, args, one


def _train_args(args: list[str], out: Path, *more: str) -> list[str]:
    return ["train", *args, f"--config.out_dir={out}", *more]


def _training_until(args: list[str], run: Path, logs: Path, steps: int) -> list:
    """Both processes training into `run`, returned once its metrics.jsonl holds `steps` steps
    (every process still running)."""
    procs = _launch(CLI_WORKER, _train_args(args, run), logs)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 400
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            break
        time.sleep(0.02)
    assert all(p.poll() is None for p in procs), "a process ended before it could be stopped"
    return procs


def _same_validation(run: Path, one: Path) -> None:
    got, want = _lines(run / "validation.jsonl"), _lines(one / "validation.jsonl")
    assert [v["step"] for v in got] == list(range(2, 17, 2))  # written once: no step twice
    for g, w in zip(got, want):
        np.testing.assert_allclose(g["val_xent_0"], w["val_xent_0"], rtol=1e-5)


def _same_run(run: Path, one: Path) -> None:
    got, want = _lines(run / "metrics.jsonl"), _lines(one / "metrics.jsonl")
    assert [m["step"] for m in got] == list(range(1, 17))  # written once: no line twice
    np.testing.assert_allclose([m["loss"] for m in got], [m["loss"] for m in want], rtol=1e-5)
    assert [m["tokens"] for m in got] == [m["tokens"] for m in want]  # the global batches' tokens
    head, ref = _head(run), _head(one)
    assert sorted(head) == sorted(ref)
    for k in ref:
        np.testing.assert_allclose(head[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow  # ~60-100 s on 2 busy cores
def test_training_on_two_processes_equals_one(setup):
    """train on 2 processes x 2 devices (a 2 x 2 mesh over both): the losses of one process on
    the same mesh and data, one exported head (written by process 0) equal to its head, and the
    held-out validation and metrics written once."""
    d, args, one = setup
    run = d / "two"
    logs = d / "two.log"
    _wait(_launch(CLI_WORKER, _train_args(args, run), logs), logs)
    _same_run(run, one)
    _same_validation(run, one)
    inter = json.loads((run / "heads/step_000004/training.json").read_text())
    assert inter == json.loads((one / "heads/step_000004/training.json").read_text())
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["12", "14", "16"]


@pytest.mark.slow  # ~90-150 s on 2 busy cores
def test_sigkill_of_every_process_then_resume(setup):
    """Both processes killed with SIGKILL after a checkpoint; started again with --resume they
    continue from the last checkpoint to the losses and the head of an uninterrupted run."""
    d, args, one = setup
    run = d / "killed"
    logs = d / "killed.log"
    procs = _training_until(args, run, logs, 5)
    metrics = run / "metrics.jsonl"
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()
    done = len(metrics.read_text().splitlines())
    assert done < 16 and not (run / "head").exists()
    # as if the kill came after the last checkpoint, before its validation and export: the
    # resumed processes make them up together (process 0 decides; both validate and gather)
    last = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    kept = [v for v in _lines(run / "validation.jsonl") if v["step"] < last]
    (run / "validation.jsonl").write_text("".join(json.dumps(v) + "\n" for v in kept))
    (run / f"heads/step_{last:06d}/training.json").unlink(missing_ok=True)
    _wait(_launch(CLI_WORKER, _train_args(args, run, "--resume"), logs), logs)
    for i in range(PROCESSES):  # every process restored the last checkpoint, at step 4 or past it
        resumed = re.search(r"resumed from step (\d+)", Path(f"{logs}.{i}").read_text())
        assert resumed and int(resumed.group(1)) == last and 4 <= last <= done, (i, done)
    _same_run(run, one)
    _same_validation(run, one)
    for step in (4, 8, 12):
        want = json.loads((one / f"heads/step_{step:06d}/training.json").read_text())
        assert json.loads((run / f"heads/step_{step:06d}/training.json").read_text()) == want


@pytest.mark.slow  # ~90-150 s on 2 busy cores
def test_sigterm_to_one_process_stops_both_at_one_step_then_resume(setup):
    """A SIGTERM (a preemption notice) reaching one process of two: JAX's preemption service
    has both stop after the same step, that step's checkpoint saved by both, exit status 143;
    started again with --resume they go on from it to the losses and head of an uninterrupted
    run, having lost no step."""
    d, args, one = setup
    run = d / "preempted"
    logs = d / "preempted.log"
    procs = _training_until(args, run, logs, 3)
    metrics = run / "metrics.jsonl"
    os.kill(procs[1].pid, signal.SIGTERM)  # process 1 only: process 0 learns of it from JAX
    _wait(procs, logs, expect=143)
    steps = set()
    for i in range(PROCESSES):
        said = re.search(r"stopped by SIGTERM after step (\d+)", Path(f"{logs}.{i}").read_text())
        assert said, Path(f"{logs}.{i}").read_text()[-3000:]
        steps.add(int(said.group(1)))
    (stop,) = steps  # the same step in both
    assert 3 <= stop < 16 and not (run / "head").exists()
    assert max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == stop
    assert [m["step"] for m in _lines(metrics)] == list(range(1, stop + 1))  # no step lost
    _wait(_launch(CLI_WORKER, _train_args(args, run, "--resume"), logs), logs)
    for i in range(PROCESSES):
        resumed = re.search(r"resumed from step (\d+)", Path(f"{logs}.{i}").read_text())
        assert resumed and int(resumed.group(1)) == stop
    _same_run(run, one)
    _same_validation(run, one)


def test_a_detected_cluster_fills_what_the_environment_leaves_unset(monkeypatch):
    """Where the JAX_* variables are unset, the detected cluster (SLURM, a TPU pod) names the
    process count, id and coordinator; a one-process job joins nothing, and a cluster that cannot
    answer is named with the variables that would replace it."""
    from eagle3_jax import distributed
    from eagle3_jax.errors import Eagle3Error

    class OneProcess:
        @staticmethod
        def get_process_count():
            return 1

        @staticmethod
        def get_process_id():
            return 0

        @staticmethod
        def get_coordinator_address(timeout_secs, override_coordinator_port):
            return f"node0:{override_coordinator_port or 1234}"

    class Broken(OneProcess):
        @staticmethod
        def get_process_count():
            raise KeyError("SLURM_NTASKS")

    for name in (distributed.ADDRESS, distributed.COUNT, distributed.ID):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "4321")
    assert distributed._from_cluster(OneProcess, None, None, None, 5.0) == ("node0:4321", 1, 0)
    assert distributed._from_cluster(OneProcess, "a:1", 2, 1, 5.0) == ("a:1", 2, 1)
    monkeypatch.setattr(distributed, "detected_cluster", lambda: OneProcess)
    assert distributed.initialize() is False  # one process: nothing to join
    monkeypatch.setattr(distributed, "detected_cluster", lambda: Broken)
    with pytest.raises(Eagle3Error, match="Broken: cannot read .*SLURM_NTASKS.*set JAX_"):
        distributed.initialize()


# ---------------------------------------------------------------------------------------------
# expert parallelism over both processes

EXPERTS_WORKER = """
import dataclasses, json, sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import multihost_utils
from eagle3_jax import distributed
from eagle3_jax.checkpoints.hf import load_hf
from eagle3_jax.decoding import plain
from eagle3_jax.models import target as tgt
from eagle3_jax.sharding import make_mesh
from eagle3_jax.training.step import replicate

assert distributed.initialize() and jax.process_count() == 2 and jax.device_count() == 4
path, out = Path(sys.argv[1]), Path(sys.argv[2])
mesh = make_mesh(1, 4)  # the model axis over both processes' devices
params, cfg = load_hf(path, mesh=mesh)
w = params["layers"][0]["we_gate"]  # [8, D, F']: 2 experts a device, 4 in this process
assert w.sharding.spec[0] == "model" and not w.is_fully_addressable
assert {s.data.shape[0] for s in w.addressable_shards} == {2}
toks = np.asarray(json.loads(sys.argv[3]), np.int32)
logits = tgt.full_forward(params, replicate(toks, mesh), cfg).logits
logits = multihost_utils.process_allgather(logits, tiled=True)
res = plain.generate(params, cfg, toks[:, :8].tolist(), 10, eos_ids=())
# the routed dispatch: each device sorts (a prefill) or gathers (a step) its own experts' pairs
routed = dataclasses.replace(cfg, moe_dispatch="ragged", moe_mesh=mesh, moe_gather_pairs=1.0)
routed_logits = tgt.full_forward(params, replicate(toks, mesh), routed).logits
routed_logits = multihost_utils.process_allgather(routed_logits, tiled=True)
routed_res = plain.generate(params, routed, toks[:, :8].tolist(), 10, eos_ids=())
if jax.process_index() == 0:
    np.save(out / "logits.npy", np.asarray(logits))
    np.save(out / "routed_logits.npy", np.asarray(routed_logits))
    (out / "tokens.json").write_text(json.dumps(res.output_ids))
    (out / "routed_tokens.json").write_text(json.dumps(routed_res.output_ids))
distributed.barrier("done")
print("ok", jax.process_index())
"""


@pytest.mark.slow  # 17 s on 2 busy cores: with the GGUF tests over the default suite's share
def test_experts_sharded_over_two_processes_equal_one(tmp_path):
    """A tiny Qwen3-MoE (8 experts top-2, layers 0, 2 and 3 routed) on a 1x4 mesh over 2 processes x 2
    devices, 2 experts a device and each process holding half of them: its forward's logits
    (1e-5) and greedy decoding's tokens equal one process's on one device, with the dense
    dispatch and with the routed one (`models.target._moe_on_mesh`: each device sorting or
    gathering the pairs routed to its own experts)."""
    from test_moe import tiny_moe_model

    from eagle3_jax.checkpoints.hf import load_hf
    from eagle3_jax.decoding import plain
    from eagle3_jax.models import target as tgt

    model = tiny_moe_model("qwen3_moe")
    ckpt = tmp_path / "qwen3_moe"
    model.save_pretrained(ckpt)
    toks = np.random.default_rng(5).integers(3, 97, (2, 16)).astype(np.int32)
    logs = tmp_path / "experts.log"
    procs = _launch(EXPERTS_WORKER, [str(ckpt), str(tmp_path), json.dumps(toks.tolist())], logs)
    params, cfg = load_hf(ckpt)
    assert cfg.moe_layers == (0, 2, 3) and cfg.num_experts == 8
    ref = np.asarray(tgt.full_forward(params, toks, cfg).logits)
    want = plain.generate(params, cfg, toks[:, :8].tolist(), 10, eos_ids=()).output_ids
    _wait(procs, logs, timeout=300)
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), ref, rtol=1e-5, atol=1e-5)
    assert json.loads((tmp_path / "tokens.json").read_text()) == want
    routed = np.load(tmp_path / "routed_logits.npy")
    np.testing.assert_allclose(routed, ref, rtol=2e-5, atol=2e-5)
    assert json.loads((tmp_path / "routed_tokens.json").read_text()) == want
