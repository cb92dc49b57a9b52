"""python -m eagle3_jax eval: method specs, the shipped benchmarks, an end-to-end tiny run,
resuming, refusals (the metrics' arithmetic: tests/test_metrics.py)."""

import gzip
import json

import jax
import pytest
from helpers import load_script

from eagle3_jax.checkpoints.eagle_format import save_draft
from eagle3_jax.checkpoints.hf import load_hf
from eagle3_jax.cli.eval import main
from eagle3_jax.evaluation.questions import load_questions
from eagle3_jax.evaluation.records import TIMING_KEYS
from eagle3_jax.models import draft as drf
from eagle3_jax.vocab import identity

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["w5 w6 w7 w8 w5 w6 w7", "w9 w10 w11"]},
    {"question_id": 2, "category": "qa", "turns": ["w40 w41 w12"]},
    {"question_id": 3, "category": "qa", "turns": ["w20 w21 w22 w20 w21"]},
]
METHODS = "vanilla,pld:1,3,4,eagle3:2,3,6"


def test_method_specs_take_an_optional_verify_threshold():
    from eagle3_jax.errors import Eagle3Error
    from eagle3_jax.evaluation.options import parse_methods

    specs = parse_methods("eagle3:2,3,4,eagle3:2,3,4,0.3,pld", {"h": "/x"})
    assert [(s.label, s.tree) for s in specs] == [
        ("vanilla", (1, 1, 1)),
        ("eagle3:2,3,4", (2, 3, 4)),
        ("eagle3:2,3,4,0.3", (2, 3, 4, 0.3)),
        ("pld:1,3,4", (1, 3, 4)),  # a bare pld: a chain as deep as the CPU's default tree
    ]
    # a bare eagle3 is decode.py's default tree on this backend (tests run on the CPU), and its
    # label says which: a CPU run and an accelerator run never share a label for two trees
    (bare,) = parse_methods("eagle3", {"h": "/x"}, baseline=False)
    assert (bare.label, bare.tree) == ("eagle3:2,3,4,0.3", (2, 3, 4, 0.3))
    two = parse_methods("eagle3", {"a": "/x", "b": "/y"}, baseline=False)
    assert [s.label for s in two] == ["eagle3:2,3,4,0.3@a", "eagle3:2,3,4,0.3@b"]
    with pytest.raises(Eagle3Error, match="repeat"):  # the same method written twice
        parse_methods("eagle3,eagle3:2,3,4,0.3", {"h": "/x"})
    assert parse_methods("eagle3:2,3,4,.3", {"h": "/x"}, baseline=False)[0].tree == (2, 3, 4, 0.3)
    for bad in ("eagle3:2,3,4,1.5", "eagle3:2,3", "eagle3:2,3,4,x"):
        with pytest.raises(Eagle3Error, match="method|threshold"):
            parse_methods(bad, {"h": "/x"})


def test_shipped_benchmarks():
    spec = load_questions("spec_bench")
    assert len(spec) == 480
    assert sum(q.task == "mt_bench" for q in spec) == 80
    assert {q.task for q in spec} == {
        "mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"
    }  # fmt: skip
    # first N per category: MT-bench's 8 subcategories each give N (a stratified subset)
    two = load_questions("spec_bench", 2)
    assert len(two) == 5 * 2 + 8 * 2 and sum(q.task == "mt_bench" for q in two) == 16
    assert len({q.category for q in load_questions("mt_bench", 1)}) == 8
    assert all(len(q.turns) == 2 for q in load_questions("mt_bench"))
    gsm = load_questions("gsm8k", 3)
    assert len(gsm) == 3 and gsm[0].task == "gsm8k"


def test_a_gzipped_question_file_reads_as_the_plain_one(tmp_path):
    """A user's question.jsonl.gz (as the two larger shipped files travel) gives the plain
    file's questions; a file that is not gzip is refused naming it."""
    import gzip

    from eagle3_jax.errors import Eagle3Error

    plain = tmp_path / "question.jsonl"
    plain.write_text("\n".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"q{i}"]})
                               for i in range(3)) + "\n")  # fmt: skip
    packed = tmp_path / "question.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert load_questions(str(packed)) == load_questions(str(plain))
    fake = tmp_path / "fake.jsonl.gz"
    fake.write_text("not gzip")
    with pytest.raises(Eagle3Error, match="cannot read question file .*fake.jsonl.gz"):
        load_questions(str(fake))


@pytest.fixture(scope="module")
def setup(tiny_target_dir, tmp_path_factory):
    _, cfg = load_hf(tiny_target_dir)
    dcfg = drf.DraftConfig.from_target(cfg)
    d = tmp_path_factory.mktemp("evalhead")
    head = d / "head"
    save_draft(
        head,
        drf.init_params(dcfg, jax.random.PRNGKey(3), scale=0.2),
        dcfg,
        identity(cfg.vocab_size),
        dtype="float32",
    )
    qfile = d / "q.jsonl"
    qfile.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    return tiny_target_dir, head, qfile


def args(setup, out, *extra):
    target, head, qfile = setup
    return [
        "--target", str(target), "--draft", str(head), "--methods", METHODS,
        "--bench", str(qfile), "--max-new-tokens", "12", "--out", str(out), "--no-progress",
        *extra,
    ]  # fmt: skip


def _records(out):
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def _untimed(r):
    r = {k: v for k, v in r.items() if k not in TIMING_KEYS}
    r["turns"] = [{k: v for k, v in t.items() if k not in TIMING_KEYS} for t in r["turns"]]
    return r


def test_end_to_end_resume_and_refusal(setup, tmp_path, capsys):
    full = tmp_path / "full"
    assert main(args(setup, full)) == 0
    recs = _records(full)
    assert len(recs) == 3 * 3  # questions x methods
    assert {r["method"] for r in recs} == {"vanilla", "pld:1,3,4", "eagle3:2,3,6"}
    two_turn = [r for r in recs if r["question_id"] == "1"]
    assert all(r["num_generations"] == 2 and r["task"] == "mt_bench" for r in two_turn)
    for r in recs:
        assert r["new_tokens"] == sum(len(o) for o in r["output_ids"])
        assert all(len(o) <= 12 for o in r["output_ids"])
        # a turn's tokens are kept once, in output_ids; its counts match them
        assert [t["new_tokens"] for t in r["turns"]] == [len(o) for o in r["output_ids"]]
        assert not any("output_ids" in t for t in r["turns"])
        rounds = r["target_forwards"] - r["num_generations"]
        if r["method"] == "vanilla":
            assert r["tau"] == 1.0 and r["accept_hist"] is None and r["verified_tokens"] is None
        else:
            assert len(r["acceptance_by_depth"]) == 3 and r["tau"] >= 1.0
            per_round = 6 if r["method"] == "eagle3:2,3,6" else 4  # every node, every round
            assert r["verified_tokens"] == per_round * rounds
    # interleaved: every question's methods run vanilla first
    assert [r["method"] for r in recs[:3]] == ["vanilla", "pld:1,3,4", "eagle3:2,3,6"]
    res = json.loads((full / "results.json").read_text())
    assert len(res["records"]) == 9 and res["config"]["max_new_tokens"] == 12
    # the decoded conversations, as training.validate scores a head on them
    from transformers import AutoTokenizer

    from eagle3_jax.training.validate import conversations_from_eval

    tok = AutoTokenizer.from_pretrained(setup[0])
    convs = conversations_from_eval(full / "results.json", tok)
    zipped = tmp_path / "results.json.gz"  # how benchmarks/results commits a run's results
    zipped.write_bytes(gzip.compress((full / "results.json").read_bytes()))
    assert conversations_from_eval(zipped, tok) == convs
    vanilla = [r for r in res["records"] if r["method"] == "vanilla"]
    assert len(convs) == len(vanilla) == 3
    for conv, r in zip(convs, vanilla):
        q = next(q for q in QUESTIONS if str(q["question_id"]) == str(r["question_id"]))
        assert [m["content"] for m in conv[0::2]] == q["turns"]
        assert [m["content"] for m in conv[1::2]] == [
            tok.decode(o, skip_special_tokens=True) for o in r["output_ids"]
        ]
    summ = res["summary"]
    assert summ["tasks"] == ["mt_bench", "qa"]
    for m in summ["methods"]:
        assert summ["by_method"][m]["exactness"] == 1.0  # greedy: every method equals vanilla
        assert summ["by_method"][m]["overall"]["speedup"]["mean"] > 0
    assert summ["by_method"]["vanilla"]["overall"]["speedup"]["mean"] == pytest.approx(1.0)
    report = (full / "report.md").read_text()
    assert "| Method | mt_bench | qa | Overall | Exact |" in report
    assert "| eagle3:2,3,6 |" in report and "α2" in report
    assert "| Method | tokens/s | verified / round |" in report
    for png in ("tau_per_task", "speedup_per_task", "acceptance_by_depth"):
        assert (full / f"{png}.png").read_bytes()[:4] == b"\x89PNG"

    # interrupted: first question per task only, then the rest, plus a torn last line
    part = tmp_path / "part"
    assert main(args(setup, part, "--questions", "1")) == 0
    assert len(_records(part)) == 2 * 3
    with (part / "records.jsonl").open("a") as f:
        f.write('{"question_id": "3", "met')  # an interrupted write
    assert main(args(setup, part)) == 0
    resumed = _records(part)
    keys = [(r["question_id"], r["method"], r["seed"]) for r in resumed]
    assert len(keys) == len(set(keys)) == 9
    srt = lambda rs: sorted(
        (_untimed(r) for r in rs), key=lambda r: (r["question_id"], r["method"])
    )
    assert srt(resumed) == srt(recs)
    # resuming a finished run generates nothing and rewrites the same records
    assert main(args(setup, part)) == 0
    assert len(_records(part)) == 9

    # another configuration in the same OUT is refused, and nothing is written
    capsys.readouterr()
    assert main(args(setup, part, "--max-new-tokens", "8")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "max_new_tokens" in err and "another configuration" in err
    assert len(_records(part)) == 9


def test_tau_curve_over_exported_heads(setup, tmp_path):
    """benchmarks/tau_curve.py: one row per exported head, resumable, tau matches the harness."""
    import shutil

    tc = load_script("benchmarks/tau_curve.py")
    target, head, qfile = setup
    run = tmp_path / "run"
    for step, tokens, name in [(5, 100, "heads/step_000005"), (9, 180, "head")]:
        shutil.copytree(head, run / name)
        (run / name / "training.json").write_text(json.dumps({"step": step, "tokens": tokens}))
    (run / "heads/not_a_head").mkdir()
    out = tmp_path / "curve"
    argv = ["--run", str(run), "--target", str(target), "--bench", str(qfile),
            "--tree", "2,3,6", "--max-new-tokens", "12", "--out", str(out)]  # fmt: skip
    assert tc.main(argv) == 0
    rows = json.loads((out / "curve.json").read_text())
    assert [(r["step"], r["tokens"]) for r in rows] == [(5, 100), (9, 180)]
    assert rows[0]["tau"] == rows[1]["tau"] >= 1.0  # the same head twice
    assert set(rows[0]["tau_by_task"]) == {"mt_bench", "qa"}  # writing is an MT-bench category
    assert (out / "tau_curve.png").stat().st_size > 0
    # the harness on the same head and questions gives the same tau
    assert main(args(setup, tmp_path / "h", "--methods", "eagle3:2,3,6")) == 0
    summary = json.loads((tmp_path / "h/results.json").read_text())
    overall = summary["summary"]["by_method"]["eagle3:2,3,6"]["overall"]
    assert overall["tau"]["mean"] == pytest.approx(rows[0]["tau"])
    assert overall["acceptance_by_depth"] == rows[0]["acceptance_by_depth"]  # NaN written as null
    lines = (out / "curve.jsonl").read_text().splitlines()
    assert tc.main(argv) == 0 and (out / "curve.jsonl").read_text().splitlines() == lines  # resumed


def test_no_baseline_runs_tau_only(setup, tmp_path, capsys):
    out = tmp_path / "nb"
    assert main(args(setup, out, "--methods", "eagle3:2,3,6", "--no-baseline")) == 0
    res = json.loads((out / "results.json").read_text())
    assert {r["method"] for r in res["records"]} == {"eagle3:2,3,6"}
    s = res["summary"]["by_method"]["eagle3:2,3,6"]
    assert s["overall"]["tau"]["mean"] >= 1.0 and s["overall"]["speedup"]["mean"] is None
    assert s["exactness"] is None
    assert "| eagle3:2,3,6 |" in (out / "report.md").read_text()
    assert main(args(setup, tmp_path / "x", "--methods", "vanilla,pld", "--no-baseline")) == 2
    assert "drop it from --methods" in capsys.readouterr().err


def test_a_run_on_a_mesh_records_what_one_device_does(setup, tmp_path):
    """--mesh 2x4 (8 simulated devices) changes where the numbers are computed, not them: the
    same output tokens and target passes as the one-device run (and --mesh is not part of the
    configuration, so either can resume the other)."""
    one, mesh = tmp_path / "one", tmp_path / "mesh"
    extra = ("--methods", "eagle3:2,3,6", "--no-baseline")
    assert main(args(setup, one, *extra)) == 0
    assert main(args(setup, mesh, *extra, "--mesh", "2x4")) == 0
    key = lambda r: (r["question_id"], r["method"])  # noqa: E731
    a, b = sorted(_records(one), key=key), sorted(_records(mesh), key=key)
    assert [_untimed(r) for r in a] == [_untimed(r) for r in b]


def test_the_embedded_target_is_evaluated_with_its_shipped_head():
    from eagle3_jax.cli.eval import drafts_of, parse_args
    from eagle3_jax.heads import default_head

    assert drafts_of(parse_args([])) == (str(default_head()),)
    assert drafts_of(parse_args(["--draft", "h"])) == ("h",)
    assert drafts_of(parse_args(["--target", "t"])) == ()  # another target: no default head


@pytest.mark.slow  # 9-13 s: decode's --draft-vocab auto test stays
def test_draft_vocab_cuts_a_head_with_an_order_and_is_part_of_the_configuration(
    setup, tmp_path, capsys, monkeypatch
):
    """A head whose vocab_order.json names a CPU size runs cut on the CPU by default (as in
    decode.py), recorded in config.json and the report; --draft-vocab full runs it whole, and is
    another configuration for the same OUT, as is the head's files changing under the same path."""
    import shutil

    import numpy as np

    from eagle3_jax.checkpoints.heads import write_vocab_order
    from eagle3_jax.evaluation import batch

    target, head, qfile = setup
    ordered = tmp_path / "ordered"
    shutil.copytree(head, ordered)
    v = json.loads((head / "config.json").read_text())["vocab_size"]
    write_vocab_order(ordered, np.arange(v)[::-1], cpu_size=12)
    loaded = []  # what each run asked load_head for
    real = batch.load_head
    monkeypatch.setattr(batch, "load_head", lambda *a, **k: loaded.append(a[3]) or real(*a, **k))
    run = lambda out, *extra: main(
        ["--target", str(target), "--draft", f"o={ordered}", "--methods", "eagle3:2,3,6",
         "--bench", str(qfile), "--max-new-tokens", "12", "--out", str(out), "--no-progress",
         *extra]
    )  # fmt: skip
    cpu = jax.default_backend() == "cpu"
    assert run(tmp_path / "auto") == 0
    res = json.loads((tmp_path / "auto/results.json").read_text())
    assert res["config"].get("draft_vocab") == ({"o": 12} if cpu else None)
    assert res["summary"]["by_method"]["eagle3:2,3,6"]["exactness"] == 1.0
    if cpu:
        assert "Draft `o` cut to its first 12 ids" in (tmp_path / "auto/report.md").read_text()
    capsys.readouterr()
    if cpu:
        assert run(tmp_path / "auto", "--draft-vocab", "o=full") == 2
        assert "draft_vocab" in capsys.readouterr().err  # and nothing was loaded
    assert run(tmp_path / "full", "--draft-vocab", "o=full") == 0
    assert "draft_vocab" not in json.loads((tmp_path / "full/config.json").read_text())
    assert run(tmp_path / "five", "--draft-vocab", "5") == 0
    assert json.loads((tmp_path / "five/config.json").read_text())["draft_vocab"] == {"o": 5}
    assert loaded == ["auto", "full", 5]
    # the same path, other files: refused, not mixed into the records
    write_vocab_order(ordered, np.arange(v), cpu_size=12)
    capsys.readouterr()
    assert run(tmp_path / "five", "--draft-vocab", "5") == 2
    assert "draft_digests" in capsys.readouterr().err and loaded == ["auto", "full", 5]
    assert run(tmp_path / "x", "--draft-vocab", "p=5") == 2
    assert "no draft named 'p'" in capsys.readouterr().err
    assert run(tmp_path / "y", "--draft-vocab", "0") == 2
    assert "positive number" in capsys.readouterr().err
