"""scripts/device_job.py and its steps (scripts/device_steps/): the GGUF travels in parts and is
joined exactly, or refused; every subcommand parses as before; `round-cost` times the programs
beside the cost model's predictions within its deadline."""

import argparse
import json
import re

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def dj():
    return load_script("scripts/device_job.py")


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
    """The repository itself must leave the device job room: at least a seventh of the 94 MiB
    GGUF per call, so that it travels in at most seven parts plus the wheels' call (each part is a
    call of a short lease: four until the shipped head grew to 16,384 ids, six until the
    vocabulary study's and fusion ablation's results, ~1.5 MB, were on their way)."""
    if not (c.ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing travels from here")
    tree = dj.transfer._travelling_bytes()
    assert c.CALL_LIMIT - c.CALL_MARGIN - tree - 1 * c.MIB >= 94 * c.MIB / 7, tree / c.MIB


def test_every_subcommand_parses_as_before_and_reaches_its_step(dj, monkeypatch):
    """The dispatcher keeps each subcommand's flags and defaults and hands them to its step."""
    seen = {}
    for mod, name in [
        (dj.transfer, "pack"), (dj.transfer, "check"), (dj.turns, "run"), (dj.turns, "bench"),
        (dj.transfer, "unpack"), (dj.round_cost, "step"), (dj.study, "step"),
    ]:  # fmt: skip
        key = "study" if mod is dj.study else name
        monkeypatch.setattr(mod, name, lambda a, key=key: seen.setdefault(key, a) and 0)
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
    dj.main(["round-cost", "--batches", "1,8", "--trees", "chain"])
    rc = seen["step"]
    assert (rc.target, rc.batches, rc.trees, rc.minutes, rc.predict_device) == (
        "llama31_8b", "1,8", "chain", 8.0, "h200",
    )  # fmt: skip
    assert dj.round_cost.forward(rc)[:6] == [
        "--target", "llama31_8b", "--head", "eagle3", "--prompt", "1024",
    ]  # fmt: skip
    dj.main(["vocab-study", "--minutes", "9"])
    vs = seen["study"]
    assert (vs.minutes, vs.questions, vs.max_new_tokens, vs.reserve_s) == (9, 20, 256, 30.0)
    assert vs.grid.endswith("configs/vocab_study_smollm2.py") and vs.study_arg == []
    del seen["study"]
    dj.main(["fusion-ablation", "--minutes", "9"])
    fa = seen["study"]
    assert fa.grid.endswith("configs/fusion_ablation_trained_smollm2.py") and fa.questions is None
    assert dj.study.command(fa)[1:] == [
        "benchmarks/fusion_ablation_trained.py", "--grid", fa.grid,
        "--out", str(dj.c.ROOT / "runs/fusion_ablation_trained_device"),
        "--publish", str(dj.c.ROOT / "runs/fusion_ablation_trained_device/published"),
    ]  # fmt: skip
    del seen["step"]  # comma lists: kept in order, once each, spaces dropped
    dj.main(["round-cost", "--target", "olmo2_7b, olmo2_1b", "--head", "eagle3,specvocab,eagle3"])
    assert (seen["step"].target, seen["step"].head) == ("olmo2_7b,olmo2_1b", "eagle3,specvocab")
    for bad in (["--trees", "10/8/60,wide"], ["--batches", "0"], ["--target", "llama3"],
                ["--head", "fr-spec"], ["--head", "eagle3,fr-spec"], ["--target", ","]):  # fmt: skip
        with pytest.raises(SystemExit):
            dj.main(["round-cost", *bad])


TINY = ["--target", "tiny", "--prompt", "16", "--new", "16", "--batches", "1,2"]


# batch 1 alone in the default suite (the round program built and timed, the ratios); both
# batches (15-17 s: a subprocess compiling the toy's programs) with the slow suite
@pytest.mark.parametrize("batches", ["1", pytest.param("1,2", marks=pytest.mark.slow)])
def test_round_cost_times_each_program_beside_its_prediction(dj, tmp_path, monkeypatch, batches):
    """The step on the CPU with the toy target (a subprocess, as on the device): every program
    measured, next to the cost model's prediction; the ratios and the table; unpack keeps it."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache"))
    out = tmp_path / "out"
    argv = ["round-cost", *TINY[:-1], batches, "--trees", "chain", "--warmup", "1", "--reps", "2"]
    assert dj.main([*argv, "--minutes", "4", "--out", str(out)]) == 0
    folder = out / "round_cost"
    assert {p.name for p in folder.iterdir()} >= {
        "results.json", "report.md", "round_timing.log", "device_log.txt",
    }  # fmt: skip
    res = json.loads((folder / "results.json").read_text())
    assert res["target"] == "tiny" and res["predicted_for"] == "H200 SXM" and not res["skipped"]
    rows = res["rows"]
    sizes = [int(b) for b in batches.split(",")]
    assert [(r["batch"], r["program"], r["tree"]) for r in rows] == [
        (b, program, tree) for b in sizes
        for program, tree in (("plain step", None), ("round", "chain 1/8/9"))
    ]  # fmt: skip
    for r in rows:
        assert r["reps"] == 2 and 0 < r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert r["predicted_ms"] > 0 and r["slots"] == r["model_slots"] == 256
        assert r["kernels"] > 0 and r["unknown_trips"] == 0
        assert r["measured_over_predicted"] == pytest.approx(r["median_ms"] / r["predicted_ms"])
    for q, (plain, rnd) in zip(res["ratios"], [rows[i : i + 2] for i in range(0, len(rows), 2)],
                               strict=True):  # fmt: skip
        assert q["measured"] == pytest.approx(rnd["median_ms"] / plain["median_ms"])
        assert q["predicted"] == pytest.approx(rnd["predicted_ms"] / plain["predicted_ms"])
        assert q["speedup_measured"] == pytest.approx(q["tau_model"] / q["measured"])
    report = (folder / "report.md").read_text()
    assert report.count("| round | eagle3 | chain 1/8/9 |") == len(sizes)
    assert "speedup at τ" in report
    back = tmp_path / "back"
    assert dj.transfer.unpack(argparse.Namespace(files_at=str(out), dest=str(back))) == 0
    assert (back / "round_cost" / "report.md").read_text() == report


def test_round_timing_skips_what_its_deadline_cannot_hold(dj, tmp_path, monkeypatch):
    """Before each program the estimate is checked against what is left: a deadline too short
    to compile skips the programs, naming what each needed and what was left; one too short for
    the weights skips everything. results.json and the table still come out."""
    from device_steps import round_timing as rt

    # estimates with the weights cheaper than a program (the toy's come in ~1 s)
    for what, s in {"init": 20.0, "plain": 40.0, "10/8/60": 90.0, "chain": 70.0}.items():
        monkeypatch.setitem(rt.COMPILE_S, what, s)
    out = tmp_path / "short"
    assert rt.main([*TINY, "--reps", "2", "--out", str(out), "--deadline-s", "25"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["rows"] == [] and len(res["skipped"]) == 6  # plain and two trees, two batches
    for line, (b, what) in zip(res["skipped"], [
        (1, "plain step"), (1, "round 10/8/60, eagle3 head"),
        (1, "round chain 1/8/9, eagle3 head"), (2, "plain step"),
        (2, "round 10/8/60, eagle3 head"), (2, "round chain 1/8/9, eagle3 head"),
    ]):  # fmt: skip
        m = re.fullmatch(
            # what is left goes below zero where making the weights took longer than the
            # deadline (a loaded machine): still a skip, named
            rf"tiny batch {b} {what}: needs ~(\d+) s \(compile ~\d+ s, 5 calls\), (-?\d+) s left",
            line,
        )
        assert m and int(m[1]) > int(m[2]), line
    report = (out / "report.md").read_text()
    assert "nothing measured" in report and f"- {res['skipped'][0]}" in report
    out = tmp_path / "shorter"
    assert rt.main([*TINY, "--out", str(out), "--deadline-s", "5"]) == 0
    (line,) = json.loads((out / "results.json").read_text())["skipped"]
    assert re.fullmatch(r"tiny: the weights need ~20 s, -?\d s left", line), line


def test_launches_counts_each_kernel_of_a_call(dj):
    """The static kernel count of a compiled program: linear in a loop's trip count (its body
    once a trip), a conditional's dearer branch, nothing for parameters and tuples."""
    import jax
    import jax.numpy as jnp
    from device_steps.round_timing import launches

    def hlo(trips, branch=True):
        def f(x):
            y = jax.lax.fori_loop(0, trips, lambda i, c: jnp.tanh(c @ x) + i, x)
            if not branch:
                return y
            return jax.lax.cond(y.sum() > 0, lambda: jnp.exp(y * 2) @ x, lambda: y - 1)

        return jax.jit(f).lower(jnp.ones((4, 4))).compile().as_text()

    n5, n10, n20 = (launches(hlo(t))["kernels"] for t in (5, 10, 20))
    assert n10 - n5 > 0 and n20 - n10 == 2 * (n10 - n5)  # the body, once a trip
    assert launches(hlo(5))["unknown_trips"] == 0
    assert launches(hlo(5, branch=False))["kernels"] < n5  # the branch's kernels count
    assert launches(jax.jit(lambda x: x).lower(jnp.ones(3)).compile().as_text())["kernels"] <= 1


def test_round_cost_table(dj):
    """The table: each program measured beside its prediction, the ratio rows, each other head's
    round against EAGLE-3's, the skips."""
    row = {"target": "olmo2_7b", "batch": 1, "program": "plain step", "head": None, "tree": None,
           "median_ms": 3.5, "p10_ms": 3.4, "p90_ms": 3.71, "predicted_ms": 3.21,
           "measured_over_predicted": 3.5 / 3.21}  # fmt: skip
    rnd = {**row, "program": "round", "head": "eagle3", "tree": "10/8/60", "median_ms": 12.0,
           "p10_ms": 11.5, "p90_ms": 13.0, "predicted_ms": 5.92,
           "measured_over_predicted": 12 / 5.92}  # fmt: skip
    ratio = {"target": "olmo2_7b", "batch": 1, "head": "eagle3", "tree": "10/8/60",
             "measured": 12 / 3.5, "predicted": 5.92 / 3.21, "tau_model": 6.5,
             "speedup_measured": 6.5 * 3.5 / 12, "speedup_predicted": 6.5 * 3.21 / 5.92}  # fmt: skip
    over = {"target": "olmo2_7b", "batch": 1, "head": "specvocab", "tree": "10/8/60",
            "measured": 1.0123, "predicted": 0.98}  # fmt: skip
    skip = "olmo2_7b batch 8 round chain 1/8/9, eagle3 head: needs ~80 s (compile ~70 s, 23 calls), 31 s left"
    text = dj.round_cost.table(
        {"rows": [row, rnd], "ratios": [ratio], "over_eagle3": [over], "skipped": [skip]}
    )
    assert "| olmo2_7b | 1 | plain step | - | - | 3.5 [3.4-3.71] | 3.21 | 1.09 |" in text
    assert "| olmo2_7b | 1 | round | eagle3 | 10/8/60 | 12.0 [11.5-13.0] | 5.92 | 2.03 |" in text
    assert "| olmo2_7b | 1 | eagle3 | 10/8/60 | 3.43 | 1.84 | 6.50 | 1.90 | 3.52 |" in text
    assert "| olmo2_7b | 1 | specvocab | 10/8/60 | 1.012 | 0.980 |" in text
    assert text.endswith(f"- {skip}\n")


def test_round_timing_records_a_failed_program_and_runs_the_next(dj, tmp_path, monkeypatch):
    """A program that fails (out of memory at batch 8, say) is named under "failed" with its
    error; the programs after it still run and the table still comes out."""
    from device_steps import round_timing as rt

    def broken(*a, **k):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(rt, "round_program", broken)
    out = tmp_path / "failed"
    argv = [*TINY[:-1], "1", "--warmup", "1", "--reps", "2", "--out", str(out)]
    assert rt.main([*argv, "--deadline-s", "300"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [r["program"] for r in res["rows"]] == ["plain step"] and res["ratios"] == []
    assert res["failed"] == [
        f"tiny batch 1 round {t}, eagle3 head: RuntimeError: RESOURCE_EXHAUSTED: out of memory"
        for t in ("10/8/60", "chain 1/8/9")
    ]
    assert (out / "report.md").read_text().endswith(f"- {res['failed'][-1]}\n")


@pytest.mark.parametrize("cmd", ["vocab-study", "fusion-ablation"])
def test_a_study_step_runs_the_study_and_packs_what_is_done(dj, c, tmp_path, monkeypatch, cmd):
    """`vocab-study` and `fusion-ablation` run their benchmarks/ driver as one phase within the
    call's budget (the target passed as a grid override in dry runs) and pack the published
    report and groups, every cell's curve and the logs into one tarball, also when the phase ran
    out of time (resumable)."""
    import tarfile

    st = dj.study.STUDIES[cmd]
    name = st.name
    root = tmp_path / "repo"
    monkeypatch.setattr(c, "ROOT", root)
    monkeypatch.setattr(dj.study, "grid_root", lambda grid: root / f"runs/{name}")
    monkeypatch.setattr(c, "env", lambda args: {})
    calls = []

    def phase(log, phase_name, cmd, env, timeout_s, log_dir=None):
        calls.append((phase_name, cmd, timeout_s))
        (st.published / "curves").mkdir(parents=True, exist_ok=True)
        (st.published / "report.md").write_text("# study\n")
        (st.published / "curves/a.json").write_text("[]\n")
        cell = root / f"runs/{name}/cells/a"
        cell.mkdir(parents=True, exist_ok=True)
        (cell / "validation.jsonl").write_text('{"step": 50}\n')
        (log_dir / f"{name}.log").write_text("ran\n")
        return -9  # out of time: the next call continues

    monkeypatch.setattr(c, "phase", phase)
    out = tmp_path / "out"
    regen = ["--no-regenerate"] if st.regenerate else []  # its own test below
    assert dj.main([cmd, "--minutes", "2", "--out", str(out), "--target", "/t",
                    "--questions", "3", "--study-arg=--skip-train", *regen]) == 0  # fmt: skip
    ((phase_name, argv, timeout_s),) = calls
    assert phase_name == name and 0 < timeout_s <= 120 - 30
    assert argv[1] == f"benchmarks/{name}.py" and "--skip-train" in argv
    assert argv[argv.index("--questions") + 1] == "3" and argv[-1] == "--config.target=/t"
    assert argv[argv.index("--publish") + 1] == str(root / f"runs/{name}_device/published")
    assert ("--max-new-tokens" in argv) == (cmd == "vocab-study")  # the fusion grid's own
    with tarfile.open(out / f"{name}.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"runs/{name}_device/published/report.md",
            f"runs/{name}_device/published/curves/a.json",
            f"runs/{name}/cells/a/validation.jsonl",
            f"runs/{name}_device/{name}.log"} <= names  # fmt: skip
    with pytest.raises(SystemExit):  # the device tool's 10-minute command limit
        dj.main([cmd, "--minutes", "12", "--out", str(out)])


def test_the_trained_fusion_ablation_answers_every_turn_before_any_cell(
    dj, c, tmp_path, monkeypatch
):
    """`fusion-ablation` (issue 62): the regeneration phase first; the study waits until every
    conversation is answered (the same tokens for every cell); the answers come back gzipped in
    parts with the marker, and a later lease that carries them to .device/turns/ restores them and
    goes straight to the study."""
    import gzip
    import shutil

    root = tmp_path / "repo"
    monkeypatch.setattr(c, "ROOT", root)
    monkeypatch.setattr(c, "DEVICE", root / ".device")
    monkeypatch.setattr(c, "TURNS", root / "runs/turns/regenerated_turns.jsonl")
    monkeypatch.setattr(c, "FULL_CONVERSATIONS", root / ".device/conv/none.jsonl.gz")
    monkeypatch.setattr(dj.study, "grid_root", lambda grid: root / "runs/fat")
    monkeypatch.setattr(c, "env", lambda args: {})
    calls, finish = [], []

    def phase(log, name, cmd, env, timeout_s, log_dir=None):
        calls.append(name)
        if name == "regenerate":
            c.TURNS.parent.mkdir(parents=True, exist_ok=True)
            with open(c.TURNS, "a") as f:
                f.write('{"id": "a"}\n')
            return 0 if finish else -9
        return 0

    monkeypatch.setattr(c, "phase", phase)
    args = ["fusion-ablation", "--minutes", "5", "--target", "/t"]
    assert dj.main([*args, "--out", str(tmp_path / "o1")]) == 0
    assert calls == ["regenerate"]  # stopped midway: no cell trains on part of the data
    assert (tmp_path / "o1/turns/regenerated_turns.jsonl.gz.part0").exists()
    finish.append(True)
    assert dj.main([*args, "--out", str(tmp_path / "o2")]) == 0
    assert calls == ["regenerate", "regenerate", "fusion_ablation_trained"]
    assert (tmp_path / "o2/turns/complete").exists()
    # a fresh machine: the answers carried back, no regeneration
    got = b"".join(p.read_bytes() for p in sorted((tmp_path / "o2/turns").glob("*.part*")))
    shutil.rmtree(root / "runs")
    (root / ".device/turns").mkdir(parents=True)
    for p in (tmp_path / "o2/turns").iterdir():
        shutil.copy2(p, root / ".device/turns" / p.name)
    calls.clear()
    assert dj.main([*args, "--out", str(tmp_path / "o3")]) == 0
    assert calls == ["fusion_ablation_trained"]
    assert c.TURNS.read_bytes() == gzip.decompress(got) == b'{"id": "a"}\n' * 2
    # a regeneration that answers nothing (every conversation too long for the context) ends
    # well but is not complete: no cell trains on no data
    shutil.rmtree(root / "runs")
    shutil.rmtree(root / ".device/turns")
    calls.clear()
    monkeypatch.setattr(c, "phase", lambda log, name, *a, **k: calls.append(name) or 0)
    assert dj.main([*args, "--out", str(tmp_path / "o4")]) == 0
    assert calls == ["regenerate"] and not dj.study.complete_marker().exists()


@pytest.mark.slow  # 13-15 s: with the device steps' other toy runs
def test_round_timing_drafts_with_each_vocabulary_head(dj, tmp_path):
    """--head times each tree's round with every output layer named (the toy's 64 draft ids, its
    full 256 ids, SpecVocab's speculator and 32 candidates) on one target's weights, each beside
    the cost model's prediction for that head, and each other head against EAGLE-3's round."""
    from device_steps import round_timing as rt

    heads = ("eagle3", "target_lm_head", "specvocab")
    out = tmp_path / "heads"
    argv = [*TINY[:-1], "1", "--trees", "chain", "--head", ",".join(heads), "--warmup", "1",
            "--reps", "2", "--out", str(out), "--deadline-s", "300"]  # fmt: skip
    assert rt.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["head"] == ",".join(heads) and not res["failed"] and not res["skipped"]
    rows = [r for r in res["rows"] if r["program"] == "round"]
    assert [r["head"] for r in rows] == list(heads)
    preds = {}
    for head, rnd in zip(heads, rows, strict=True):
        tcfg, dcfg = rt.shapes("tiny", head)
        assert (dcfg.draft_vocab_size == tcfg.vocab_size) == (head != "eagle3")
        assert bool(dcfg.speculator_rank) == (head == "specvocab")
        preds[head] = rt.predictions(tcfg, dcfg, "h200", 1, 32, "chain")["ms"]
        assert rnd["predicted_ms"] == pytest.approx(preds[head]) and rnd["median_ms"] > 0
    assert preds["target_lm_head"] != pytest.approx(preds["eagle3"])  # each head's own
    by_head = {r["head"]: r for r in rows}
    assert [q["head"] for q in res["over_eagle3"]] == ["target_lm_head", "specvocab"]
    for q in res["over_eagle3"]:
        mine, ref = by_head[q["head"]], by_head["eagle3"]
        assert q["measured"] == pytest.approx(mine["median_ms"] / ref["median_ms"])
        assert q["predicted"] == pytest.approx(mine["predicted_ms"] / ref["predicted_ms"])
    assert [q["head"] for q in res["ratios"]] == list(heads)
    report = (out / "report.md").read_text()
    assert "| tiny | 1 | round | specvocab | chain 1/8/9 |" in report
    assert "| tiny | 1 | specvocab | chain 1/8/9 |" in report and "against EAGLE-3's" in report
    # a level's rows share their candidates under the zero speculator: the shared gather runs
    import jax
    import numpy as np

    from eagle3_jax.models import draft_output

    tcfg, dcfg = rt.shapes("tiny", "specvocab")
    x = rt.random_inputs(tcfg, dcfg)
    h = jax.random.normal(jax.random.key(3), (1, 10, dcfg.hidden_size)).astype(jax.numpy.bfloat16)
    _, cand = draft_output.speculator_candidates(x.dparams, h, dcfg)
    assert np.unique(np.asarray(cand)).size == dcfg.spec_candidates
    assert draft_output.union_capacity(10, dcfg.spec_candidates, tcfg.vocab_size) < 10 * 32


def test_round_timing_shapes_every_named_target(dj):
    """Every target --target takes has a shape the programs run with: the loaders' where the
    published config.json is kept (accelerators.specs.REAL_TARGETS), else accelerators.specs'
    own, with plain products either way."""
    from device_steps import round_timing as rt

    round_cost = dj.round_cost

    from eagle3_jax.accelerators import specs
    from eagle3_jax.config import PLAIN_PRODUCTS

    for name in round_cost.TARGETS:
        for head in round_cost.HEADS:
            tcfg, dcfg = rt.shapes(name, head)
            assert tcfg.products == PLAIN_PRODUCTS and dcfg.hidden_size == tcfg.hidden_size
        if name != "tiny":
            assert tcfg.vocab_size == specs.TARGETS[name].vocab_size
            assert tcfg.num_layers == specs.TARGETS[name].num_layers


def test_gpu_speed_parses_and_reaches_its_step(dj, monkeypatch):
    """`gpu-speed`: its defaults (Llama-3.1-8B's shape for kernels and traces, the three targets
    and four batches of the sweep, every phase), the flags each phase is handed, and bad values
    refused before any work."""
    gs, seen = dj.gpu_speed, {}
    monkeypatch.setattr(gs, "step", lambda a: seen.setdefault("step", a) and 0)
    dj.main(["gpu-speed"])
    a = seen["step"]
    assert (a.minutes, a.target, a.targets, a.batches, a.trees, a.variants) == (
        8.0, "llama31_8b", None, "1,8,32,64", "chain,10/8/60,best", "engine,baseline",
    )  # fmt: skip
    assert (a.layers, a.phases, a.plain_steps, a.rounds, a.loop_steps) == (
        "3,5", "kernels,trace,sweep,moe", 10, 3, 16,
    )  # fmt: skip
    assert (a.moe_target, a.moe_tokens, a.moe_layers) == ("qwen3_30b_a3b", "1,8,16,32,60,512", 4)
    assert gs.sweep_targets(a) == ["llama31_8b", "olmo2_7b", "olmo2_1b"]
    words = gs.forward(a)
    assert words[:4] == ["--target", "llama31_8b", "--batches", "1,8,32,64"]
    assert "--targets" not in words and "--minutes" not in words
    cfg = object()
    assert gs.VARIANTS["baseline"].config(cfg) is cfg and gs.VARIANTS["baseline"].params is None
    from eagle3_jax.accelerators.specs import target_config

    engine = gs.VARIANTS["engine"]  # what backends.prepare_target does with bf16 weights
    assert engine.config(target_config("llama31_8b")).attention == "pallas"
    assert engine.params is gs.VARIANTS["fused_projections"].params
    del seen["step"]
    dj.main(["gpu-speed", "--target", "tiny", "--trees", "best, chain,best"])
    assert gs.sweep_targets(seen["step"]) == ["tiny"] and seen["step"].trees == "best,chain"
    for bad in (["--variants", "fast"], ["--trees", "wide"], ["--layers", "2,4"],
                ["--layers", "5,3"], ["--batches", "0"], ["--phases", "profile"],
                ["--targets", "llama3"], ["--moe-target", "mixtral"],
                ["--moe-tokens", "0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            dj.main(["gpu-speed", *bad])


def test_gpu_speed_refuses_a_budget_past_the_tools_limit(dj, tmp_path):
    """--minutes past what the device tool's 600 s command limit holds is refused before work."""
    with pytest.raises(SystemExit, match="at most 9.5"):
        dj.main(["gpu-speed", "--minutes", "12", "--out", str(tmp_path)])
    assert not (tmp_path / "gpu_speed").exists()


def test_gpu_speed_report(dj):
    """The report: each sweep program beside the cost model and its roofline (the best tree
    marked), the kernels per layer, each trace, and what was skipped."""
    row = {"target": "llama31_8b", "batch": 1, "program": "round", "tree": "chain", "best": True,
           "measured_ms": 10.0, "predicted_ms": 5.0, "roofline_ms": 4.0, "plain_steps": 1.5,
           "plain_steps_predicted": 1.4, "tau_model": 5.87, "speedup_measured": 5.87 / 1.5}  # fmt: skip
    per = {"total": 12.0, "launches": 14.0, "by_kind": {"fusion": 9.0, "gemm": 3.0}}
    kern = {"per_layer": per, "fixed": {"total": 50.0, "launches": 80.0},
            "full_model": {"total": 434.0, "launches": 528.0}}  # fmt: skip
    trace = {"trace": {"plain": {"calls": 10, "wall_ms": 80.0, "device_busy_ms": 60.0,
                                 "busy_fraction": 0.75, "events": 5000,
                                 "top": [{"name": "gemm", "share": 0.5}]}},
             "timed": {"plain": {"median_ms": 7.5}}}  # fmt: skip
    moe_row = {
        "tokens": 1,
        "dispatch": "dense",
        "path": "dense",
        "ms_per_layer": 0.5,
        "experts_touched": 8.0,
        "touched_gb_per_layer": 0.075,
        "all_gb_per_layer": 1.2,
    }
    moe = {"shape": {"target": "qwen3_30b_a3b", "experts": 128, "k": 8, "hidden": 2048,
                     "ffn": 768, "layers": 4, "dtype": "bfloat16"},
           "rows": [moe_row, {**moe_row, "dispatch": "ragged", "path": "gather",
                              "ms_per_layer": 0.05}]}  # fmt: skip
    text = dj.gpu_speed.report({
        "programs": [row], "kernels": {"baseline": {"plain": kern}},
        "traces": {"baseline": {"cb_off": trace}}, "skipped": ["olmo2_1b batch 64: no time"],
        "moe": moe,
    })  # fmt: skip
    assert (
        "| llama31_8b | 1 | round | chain (best) | 10 | 5 | 4 | 2.5 | 1.5 (1.4) | 5.87 | 3.91 |"
        in text
    )
    assert "| baseline | plain | 12 (14) | 50 (80) | 434 (528) | fusion 9, gemm 3 |" in text
    assert "| baseline | cb_off | plain | 10 | 7.5 | 80 | 60 | 0.75 | 500 | gemm (50%) |" in text
    assert "| 1 | dense | dense | 0.5 | 1 | 8 | 1.2 | 2400 |" in text  # all 128 experts read
    assert "| 1 | ragged | gather | 0.05 | 0.1 | 8 | 0.075 | 1500 |" in text  # the 8 touched
    assert text.endswith("- olmo2_1b batch 64: no time\n")


@pytest.mark.slow  # 111-170 s on a busy 2-core VM (seven compilations of the toy in four subprocesses)
def test_gpu_speed_runs_every_phase_at_the_toy_shape(dj, tmp_path, monkeypatch):
    """The whole step on the CPU with the toy target: kernels per layer (plain step and chain
    round), both command-buffer traces, the sweep; summary.json in the issue's format, with
    counts and times present and positive. The sweep times the first variant (baseline); the
    engine's (fused projections, the Pallas kernel interpreted here) is counted and traced too."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache"))
    out = tmp_path / "out"
    argv = ["gpu-speed", "--target", "tiny", "--prompt", "16", "--new", "16", "--batches", "1",
            "--trees", "chain", "--reps", "2", "--loop-steps", "4",
            "--variants", "baseline,engine"]  # fmt: skip
    assert dj.main([*argv, "--minutes", "9", "--out", str(out)]) == 0
    folder = out / "gpu_speed"
    assert {p.name for p in folder.iterdir()} >= {
        "summary.json", "report.md", "kernels.json", "sweep.json", "trace_baseline_cb_off.json",
        "trace_baseline_cb_on.json", "device_log.txt", "kernels.log", "sweep.log",
    }  # fmt: skip
    s = json.loads((folder / "summary.json").read_text())
    assert s["device"] == "cpu" and s["real_head"] is None and s["peers"] is None
    assert s["sweep_xla_flags"] is not None  # decoding's own, as the sweep ran with them
    assert not s["skipped"] and not s["failed"], (s["skipped"], s["failed"])
    assert [s["phases"][p]["rc"] for p in ("kernels", "trace", "sweep", "moe")] == [
        [0], [0] * 4, [0], [0],
    ]  # fmt: skip
    # the moe phase: a toy routed layer (16 experts, top 2) under each dispatch, and gathered
    # where 16 tokens' 32 pairs are past what the CPU's dispatch gathers
    moe = {(r["tokens"], r["dispatch"]): r for r in s["moe"]["rows"]}
    every = {(n, d) for n in (1, 8, 16, 32, 60, 512) for d in ("dense", "gather", "ragged")}
    assert set(moe) == every | {(16, "gather_forced")}
    paths = {n: [moe[n, d]["path"] for d in ("dense", "gather", "ragged")] for n in (1, 8, 16)}
    assert paths == {1: ["dense", "gather", "gather"], 8: ["dense", "gather", "gather"],
                     16: ["dense", "dense", "ragged"]}  # fmt: skip
    assert moe[16, "gather_forced"]["path"] == "gather"
    assert all(r["ms_per_layer"] > 0 and r["max_abs_diff_vs_dense"] < 1e-4 for r in moe.values())
    assert set(s["kernels"]) == set(s["traces"]) == {"baseline", "engine"}
    plain, chain = s["programs"]
    assert [(r["target"], r["batch"], r["program"], r["tree"]) for r in (plain, chain)] == [
        ("tiny", 1, "plain", None), ("tiny", 1, "round", "chain"),
    ]  # fmt: skip
    for r in (plain, chain):
        assert r["measured_ms"] > 0 and r["predicted_ms"] > r["roofline_ms"] > 0
        assert r["loop_steps"] == 4 and r["reps"] == 2
    assert chain["plain_steps"] == pytest.approx(chain["measured_ms"] / plain["measured_ms"])
    assert chain["tree_shape"] == "1/8/9" and chain["tau_model"] > 1
    kern = s["kernels"]["baseline"]
    assert set(kern) == {"plain", "chain"}
    for k in kern.values():
        per = k["per_layer"]["launches"]
        assert per > 0 and per == int(per) and k["fixed"]["launches"] > 0
        assert k["full_model"]["launches"] == k["fixed"]["launches"] + 4 * per
    traces = s["traces"]["baseline"]
    for cb, flags in dj.gpu_speed.COMMAND_BUFFERS.items():
        t = traces[cb]
        assert t["xla_flags"].endswith(" ".join(flags)) and not t["refused_flags"]
        assert t["round_tree"] == "chain"
        for prog, calls in (("plain", 10), ("round", 3)):
            assert t["timed"][prog]["median_ms"] > 0 and t["kernels"][prog]["launches"] > 0
            tr = t["trace"][prog]
            assert tr["calls"] == calls and tr["windows"] == 1 and tr["events"] > 0
            assert 0 < tr["device_busy_ms"] <= tr["wall_ms"] and tr["top"]
    # the plain step's kernels at the toy's 4 layers, counted whole, are what the per-layer
    # count at 3 and 5 layers gives
    assert (
        traces["cb_off"]["kernels"]["plain"]["launches"] == kern["plain"]["full_model"]["launches"]
    )
    report = (folder / "report.md").read_text()
    assert "| tiny | 1 | round | chain |" in report and "| baseline | cb_on | round | 3 |" in report


def test_peers_parses_and_reaches_its_step(dj, monkeypatch):
    """`peers`: its defaults (Llama-3.1-8B's shape, batch 1 then 8, both phases, 6 minutes), the
    flags each phase is handed, and bad values refused before any work."""
    pe, seen = dj.peers, {}
    monkeypatch.setattr(pe, "step", lambda a: seen.setdefault("step", a) and 0)
    dj.main(["peers"])
    a = seen["step"]
    assert (a.minutes, a.target, a.batches, a.prompt, a.new, a.reps, a.dtype, a.phases) == (
        6.0, "llama31_8b", "1,8", 1024, 256, 3, "auto", "ours,theirs",
    )  # fmt: skip
    assert pe.forward(a) == [
        "--target", "llama31_8b", "--batches", "1,8", "--prompt", "1024", "--new", "256",
        "--reps", "3", "--dtype", "auto",
    ]  # fmt: skip
    del seen["step"]
    dj.main(["peers", "--target", "tiny", "--batches", "1,2", "--phases", "theirs"])
    assert (seen["step"].batches, seen["step"].phases) == ("1,2", "theirs")
    for bad in (["--target", "olmo2_1b"], ["--batches", "0"], ["--phases", "profile"],
                ["--dtype", "float16"]):  # fmt: skip
        with pytest.raises(SystemExit):
            dj.main(["peers", *bad])


def test_peers_refuses_a_budget_past_the_tools_limit(dj, tmp_path):
    with pytest.raises(SystemExit, match="at most 9.5"):
        dj.main(["peers", "--minutes", "12", "--out", str(tmp_path)])
    assert not (tmp_path / "peers").exists()


@pytest.mark.parametrize("target", ["llama31_8b", "olmo2_7b", "qwen3_4b", "tiny"])
def test_peers_builds_transformers_model_from_our_shape(dj, target):
    """The peer's config.json fields give, through our own loader, the shape ours decodes."""
    from eagle3_jax.config import target_config_from_hf

    ours, _ = dj.gpu_speed.shapes(target)
    theirs = target_config_from_hf(dj.peers.hf_config(target))
    for field in ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "rope", "qk_norm", "norm_placement",
                  "tie_word_embeddings"):  # fmt: skip
        assert getattr(theirs, field) == getattr(ours, field), field


@pytest.mark.parametrize("missing", ["torch", "cuda"])
def test_peers_records_why_transformers_cannot_run(dj, tmp_path, monkeypatch, missing):
    """No torch, or a torch without CUDA where ours ran on a GPU: theirs.json says so
    ("available": false, why), and the summary keeps ours' figure with no ratio."""
    import sys

    pe = dj.peers
    out = tmp_path / "peers"
    out.mkdir()
    ours = {"device": "gpu NVIDIA H100", "platform": "gpu", "dtype": "bfloat16",
            "rows": [{"batch": 1, "tok_s": 100.0}]}  # fmt: skip
    (out / "ours.json").write_text(json.dumps(ours))
    if missing == "torch":
        monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    else:
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = pe.parse_args(["theirs", "--out", str(out), "--deadline-s", "60"])
    res = pe.run_theirs(args)
    assert res["available"] is False and not res["rows"]
    assert ("no torch" if missing == "torch" else "has no CUDA") in res["why"]
    s = pe.write_summary(out, args, {"theirs": {"rc": 0}})
    assert (s["available"], s["ours_tok_s"], s["ratio"]) == (False, 100.0, None)
    assert s["transformers_compile_tok_s"] is None and s["rows"][0]["ours_tok_s"] == 100.0
    assert "theirs: not available: " in (out / "report.md").read_text()


def test_peers_times_eager_torch_when_compiling_fails(dj, tmp_path, monkeypatch):
    """torch.compile failing (no C++ compiler for inductor, say): theirs is timed eager and says
    so, with the error; the summary gives the eager figure and no compiled one."""
    pe = dj.peers
    real = pe._compiled_generate

    def broken(model, dev, compile=True):
        if not compile:
            return real(model, dev, compile=False)

        def gen(ids, new):
            raise RuntimeError("InductorError: no C++ compiler")

        return gen, "compiled"

    monkeypatch.setattr(pe, "_compiled_generate", broken)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    out = tmp_path / "peers"
    out.mkdir()
    (out / "ours.json").write_text(json.dumps({"platform": "cpu", "dtype": "float32",
                                               "rows": [{"batch": 1, "tok_s": 50.0}]}))  # fmt: skip
    args = pe.parse_args(["theirs", "--out", str(out), "--deadline-s", "120", "--target", "tiny",
                          "--prompt", "4", "--new", "4", "--batches", "1", "--reps", "1"])  # fmt: skip
    res = pe.run_theirs(args)
    assert res["available"] and res["compiled"] is False and not res["failed"]
    assert "no C++ compiler" in res["compile_error"] and "disable_compile" in res["recipe"]
    assert res["rows"][0]["tok_s"] > 0 and res["rows"][0]["compiled"] is False
    s = pe.write_summary(out, args, {"theirs": {"rc": 0}})
    assert s["compiled"] is False and s["transformers_compile_tok_s"] is None and s["ratio"] is None
    assert s["ratio_eager"] == pytest.approx(50.0 / s["transformers_eager_tok_s"])
    assert "eager (torch.compile failed)" in (out / "report.md").read_text()


@pytest.mark.slow  # 100-170 s on a busy 2-core VM (torch.compile's inductor on the CPU: most of it)
def test_peers_times_both_engines_at_the_toy_shape(dj, tmp_path, monkeypatch):
    """The whole step on the CPU with the toy target: ours and transformers' static-cache greedy
    generate under torch.compile (compiled, checked by dynamo's graph count), tokens/s of each
    at two batches and the ratio, in summary.json and report.md."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache"))
    out = tmp_path / "out"
    argv = ["peers", "--target", "tiny", "--prompt", "16", "--new", "16", "--batches", "1,2",
            "--reps", "2", "--minutes", "6", "--out", str(out)]  # fmt: skip
    assert dj.main(argv) == 0
    folder = out / "peers"
    assert {p.name for p in folder.iterdir()} >= {
        "summary.json", "report.md", "ours.json", "theirs.json", "device_log.txt", "ours.log",
        "theirs.log",
    }  # fmt: skip
    s = json.loads((folder / "summary.json").read_text())
    assert (s["device"], s["target"], s["batch"], s["prompt"], s["new"]) == (
        "cpu", "tiny", 1, 16, 16,
    )  # fmt: skip
    assert s["available"] and s["compiled"] and s["torch"] and s["dtype"] == "float32"
    assert not s["skipped"] and not s["failed"], (s["skipped"], s["failed"])
    assert [r["batch"] for r in s["rows"]] == [1, 2]
    for r in s["rows"]:
        assert r["ours_tok_s"] > 0 and r["transformers_compile_tok_s"] > 0
        assert r["ratio"] == pytest.approx(r["ours_tok_s"] / r["transformers_compile_tok_s"])
    assert s["ratio"] == s["rows"][0]["ratio"]
    assert s["ours"]["attention"] == "exact" and s["ours"]["fused_projections"] is False
    assert "CompileConfig(fullgraph=True" in s["theirs"]["recipe"]
    for r in s["timings"]["theirs"]:
        assert r["compiled"] and r["graphs"] >= 1 and len(r["walls_s"]) == 2
    report = (folder / "report.md").read_text()
    assert "| 1 |" in report and "torch.compile" in report


TOY_FUSION_GRID = """
from eagle3_jax.ablation.config import AblationConfig, Cell
from eagle3_jax.training.config import load_config


def get_config():
    base = load_config("{root}/configs/tiny.py").replace(
        data="{turns}", max_steps=8, batch_size=2, schedule="constant", save_every=4,
        keep_checkpoints=1, export_every=4, log_every=2, val_data="{val}", val_every=4,
        val_conversations=2,
    )
    return AblationConfig(
        base=base,
        cells=(Cell("low_mid_high", {{"aux_layer_ids": (1, 3, 4)}}),
               Cell("top_layer", {{"aux_layer_ids": (5,), "ttt_steps": 2}})),
        out_dir="{cells}", benches=(("{bench_a}", None), ("{bench_b}", None)), budgets=(4, 8),
        online_features=True, max_new_tokens=6, tree=(2, 2, 4), evaluate=False,
    )
"""


@pytest.mark.slow  # ~2 min on a busy 2-core VM (regenerate, two cells trained, four replays)
def test_the_trained_fusion_ablation_runs_every_phase_at_the_toy_shape(
    dj, c, tiny_target_dir, tmp_path, monkeypatch, capsys
):
    """The whole `fusion-ablation` step on the CPU with the tiny target: every turn of the
    carried conversations answered (--all-turns), then two cells trained on those answers with
    online features and heads exported at two budgets, each budget's head replayed on two
    benches, the budget report with its plot, all packed; a second call redoes nothing."""
    import gzip
    import tarfile

    import numpy as np

    repo = c.ROOT
    root = tmp_path / "repo"  # runs/ and .device/ of a device's checkout; the code is this one's
    root.mkdir()
    (root / "benchmarks").symlink_to(repo / "benchmarks")
    monkeypatch.setattr(c, "ROOT", root)
    monkeypatch.setattr(c, "DEVICE", root / ".device")
    monkeypatch.setattr(c, "TURNS", root / "runs/turns/regenerated_turns.jsonl")
    monkeypatch.setattr(c, "FULL_CONVERSATIONS", root / ".device/conv/none.jsonl.gz")
    monkeypatch.setattr(c, "SHIPPED_CONVERSATIONS", tmp_path / "conv.jsonl.gz")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache"))
    rng = np.random.default_rng(0)

    def words(n):
        return " ".join(f"w{x}" for x in rng.integers(3, 97, n))

    with gzip.open(c.SHIPPED_CONVERSATIONS, "wt") as f:
        for i in range(6):
            turns = [("human", words(5)), ("gpt", words(8)), ("human", words(4)), ("gpt", words(6))]
            conv = [{"from": who, "value": text} for who, text in turns]
            f.write(json.dumps({"id": f"c{i}", "conversations": conv}) + "\n")
    (tmp_path / "val.jsonl").write_text("".join(
        json.dumps({"id": f"v{i}", "conversations": [{"from": "human", "value": words(5)},
                                                     {"from": "gpt", "value": words(8)}]}) + "\n"
        for i in range(2)))  # fmt: skip
    for name, n in (("bench_a", 2), ("bench_b", 3)):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"question_id": i, "category": f"t{i}", "turns": [words(4)]}) + "\n"
            for i in range(n)))  # fmt: skip
    grid = tmp_path / "grid.py"
    grid.write_text(TOY_FUSION_GRID.format(
        root=repo, turns=c.TURNS, val=tmp_path / "val.jsonl",
        cells=root / "runs/fusion_ablation_trained", bench_a=tmp_path / "bench_a.jsonl",
        bench_b=tmp_path / "bench_b.jsonl"))  # fmt: skip
    argv = ["fusion-ablation", "--minutes", "9", "--target", str(tiny_target_dir), "--grid",
            str(grid), "--no-install", "--regen-batch-size", "4", "--regen-max-new-tokens", "12",
            "--study-arg=--batch-size=2"]  # fmt: skip
    assert dj.main([*argv, "--out", str(tmp_path / "o1")]) == 0
    log = (root / "runs/fusion_ablation_trained_device/device_log.txt").read_text()
    assert "regenerate: rc 0" in log and "fusion_ablation_trained: rc 0" in log, log
    assert c.count_lines(c.TURNS) == 6 and (c.TURNS.with_suffix(".complete")).exists()
    assert (tmp_path / "o1/turns/complete").exists()
    pub = root / "runs/fusion_ablation_trained_device/published"
    report = (pub / "report.md").read_text()
    assert "## bench_a (2 questions)" in report and "## bench_b (3 questions)" in report
    assert "| top_layer | layers 5, TTT steps 2 | " in report and "step 8 (" in report
    assert (pub / "tau_vs_tokens.png").stat().st_size > 0
    summary = json.loads((pub / "summary.json").read_text())
    assert summary["budgets"] == [4, 8] and set(summary["benches"]) == {"bench_a", "bench_b"}
    for bench in ("bench_a", "bench_b"):
        for cell in ("low_mid_high", "top_layer"):
            assert (pub / "groups" / cell / f"results_{bench}.json.gz").exists()
    with tarfile.open(tmp_path / "o1/fusion_ablation_trained.tar.gz") as tar:
        names = set(tar.getnames())
    assert "runs/fusion_ablation_trained_device/published/report.md" in names
    # --status reads the same folders: the online features, every cell, each bench's runs
    fat = load_script("benchmarks/fusion_ablation_trained.py")
    home = pub.parent
    assert (
        fat.main(["--grid", str(grid), "--out", str(home), "--publish", str(pub), "--status"]) == 0
    )
    status = capsys.readouterr().out
    assert "features: computed online by each cell" in status
    assert "cell top_layer: trained; held-out at step 8" in status
    assert "harness top_layer bench_b: vanilla 3, " in status and "of 3 questions" in status
    assert "groups measured" in status and status.rstrip().endswith("low_mid_high, top_layer")
    # a second call: nothing answered, trained or replayed again
    stamp = (pub / "groups/top_layer/results_bench_b.json.gz").stat().st_mtime_ns
    study_log = root / "runs/fusion_ablation_trained_device/fusion_ablation_trained.log"
    before = len(study_log.read_text())
    assert dj.main([*argv, "--out", str(tmp_path / "o2")]) == 0
    assert (pub / "groups/top_layer/results_bench_b.json.gz").stat().st_mtime_ns == stamp
    second = study_log.read_text()[before:]
    assert second.count("measured already") == 2 and "\n+ " not in second, second
    assert not (tmp_path / "o2/turns").exists()  # no answers added: none packed again


def test_serving_step_runs_the_in_process_sweep(dj, c, tmp_path, monkeypatch):
    """`serving` runs benchmarks/serving.py --sweep --in-process as one phase within the call's
    budget: the accelerator's slots, levels and measured trees by default, the serve flags
    passed through; more than the tool's 10-minute limit is refused."""
    monkeypatch.setattr(c, "env", lambda args: {})
    calls = []

    def phase(log, name, cmd, env, timeout_s, log_dir=None):
        calls.append((name, cmd, timeout_s, log_dir))
        return 0

    monkeypatch.setattr(c, "phase", phase)
    assert dj.main(["serving", "--minutes", "2", "--out", str(tmp_path), "--target", "/t",
                    "--serve-arg=--method", "--serve-arg=pld"]) == 0  # fmt: skip
    ((name, argv, timeout_s, log_dir),) = calls
    assert name == "serving" and 0 < timeout_s <= 120 - 20 and log_dir == tmp_path / "serving"
    assert argv[1].endswith("benchmarks/serving.py") and argv[2:4] == ["--sweep", "--in-process"]
    assert argv[argv.index("--concurrency") + 1 : argv.index("--requests")] == [
        "1", "4", "8", "16", "32",
    ]  # fmt: skip
    assert argv[argv.index("--serve-args") + 1] == (
        "--slots 16 --max-context 1024 --target /t --method pld"
    )
    assert argv[argv.index("--tree-by-occupancy") + 1] == "auto:10/8/60,4/4/16,1/3/4,plain"
    assert argv[-1] == str(tmp_path / "serving" / "serving.json")
    with pytest.raises(SystemExit):
        dj.main(["serving", "--minutes", "12", "--out", str(tmp_path)])


@pytest.mark.slow  # 36 s on a busy 2-core VM (two engines compiled in a subprocess)
def test_serving_step_at_the_toy_shape(dj, c, tiny_target_dir, tmp_path, monkeypatch):
    """The step's phase for real on the CPU: the tiny target with prompt lookup standing in for
    EAGLE-3, two levels, each run twice by each engine (interleaved); every greedy output of
    both engines equals decoding alone, and each pair's ratio is reported."""
    monkeypatch.setattr(c, "env", lambda args: dict(c.base_env(), JAX_PLATFORMS="cpu"))
    argv = ["serving", "--minutes", "6", "--out", str(tmp_path), "--target", str(tiny_target_dir),
            "--concurrency", "1,2", "--requests", "3", "--max-tokens", "6", "--slots", "2",
            "--max-context", "256", "--serve-arg=--method", "--serve-arg=pld"]  # fmt: skip
    assert dj.main(argv) == 0, (tmp_path / "serving" / "serving.log").read_text()[-3000:]
    out = json.loads((tmp_path / "serving" / "serving.json").read_text())
    assert out["in_process"] and [r["concurrency"] for r in out["table"]] == [1, 2]
    for row in out["table"]:
        for k in ("eagle3", "plain"):
            assert row[k]["equal_to_alone"] == 6 and row[k]["requests"] == 6
            assert len(row[k]["repeats"]) == 2
        assert len(row["pair_speedups"]) == 2
    level = out["runs"]["eagle3"]["levels"][-1]["summary"]
    assert set(level["tree_choice"].values()) <= {"1/8/9", "1/4/5", "1/3/4", "plain"}
    assert sum(level["tree_rounds"].values()) > 0
