"""decode.py end to end on a tiny checkpoint: records, methods agree, one-line errors."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers import load_script

from eagle3_jax import cpu_tuning
from eagle3_jax.checkpoints.eagle_format import save_draft
from eagle3_jax.checkpoints.hf import load_hf
from eagle3_jax.config import PLAIN_PRODUCTS, default_dtype
from eagle3_jax.decoding.tree import ACCELERATOR_TREE, TreeConfig, default_tree
from eagle3_jax.models import draft as drf
from eagle3_jax.vocab import identity

ROOT = Path(__file__).resolve().parents[1]
decode_cli = load_script("decode.py")

PROMPTS = ["w5 w6 w7 w8 w5 w6 w7", "w40 w41 w12"]


def run(*argv):
    return decode_cli.decode_main(decode_cli.parse_args(list(argv)))


@pytest.fixture(scope="module")
def head_dir(tiny_target_dir, tmp_path_factory):
    _, cfg = load_hf(tiny_target_dir)
    dcfg = drf.DraftConfig.from_target(cfg)
    d = tmp_path_factory.mktemp("head")
    save_draft(
        d,
        drf.init_params(dcfg, jax.random.PRNGKey(3), scale=0.2),
        dcfg,
        identity(cfg.vocab_size),
        dtype="float32",
    )
    return d


def _records(path):
    return json.loads(Path(path).read_text())


def test_vanilla_json_records(tiny_target_dir, tmp_path):
    out = tmp_path / "o.json"
    args = ["--target", str(tiny_target_dir), "--max-new-tokens", "12", "--json", str(out)]
    for p in PROMPTS:
        args += ["--prompt", p]
    assert run(*args) == 0
    recs = _records(out)
    assert [r["id"] for r in recs] == ["0", "1"]
    for r in recs:
        assert set(r) >= {
            "id",
            "prompt_ids",
            "output_ids",
            "text",
            "new_tokens",
            "target_forwards",
            "wall_time_s",
            "tau",
            "finish_reason",
        }
        assert r["prompt_ids"][0] == 1 and r["prompt_ids"][-1] == 1  # the chat template was applied
        assert r["new_tokens"] == len(r["output_ids"]) <= 12 and r["tau"] == 1.0


@pytest.mark.parametrize("method", ["eagle3", "pld"])
def test_speculative_methods_reproduce_vanilla(method, tiny_target_dir, head_dir, tmp_path):
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(
        "\n".join(
            json.dumps({"question_id": i, "turns": [p, "ignored"]}) for i, p in enumerate(PROMPTS)
        )
    )
    common = [
        "--target",
        str(tiny_target_dir),
        "--prompt-file",
        str(qfile),
        "--max-new-tokens",
        "20",
        "--batch-size",
        "2",
    ]
    assert run(*common, "--json", str(tmp_path / "v.json")) == 0
    extra = ["--draft", str(head_dir)] if method == "eagle3" else []
    assert (
        run(
            *common,
            "--method",
            method,
            *extra,
            "--top-k",
            "2",
            "--depth",
            "3",
            "--total-tokens",
            "6",
            "--json",
            str(tmp_path / "s.json"),
            "--compare-plain",
        )
        == 0
    )
    van, sp = _records(tmp_path / "v.json"), _records(tmp_path / "s.json")
    assert [r["output_ids"] for r in sp] == [r["output_ids"] for r in van]
    assert all(len(r["acceptance_by_depth"]) == 3 and r["target_forwards"] >= 1 for r in sp)
    # --compare-plain decoded the same batch plainly in the same run
    assert all(r["identical_to_plain"] and r["plain_tokens_per_s"] > 0 for r in sp)
    for r in sp:
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["plain_tokens_per_s"])


def test_method_defaults():
    from eagle3_jax.cli.decode_flags import resolve_method
    from eagle3_jax.heads import DEFAULT_HEAD

    def resolved(*argv):
        args = decode_cli.parse_args(list(argv))
        resolve_method(args)
        return args.method, args.draft

    assert resolved("--target", "t") == ("vanilla", None)
    assert resolved("--target", "t", "--draft", "h") == ("eagle3", "h")
    assert resolved("--target", "t", "--method", "pld") == ("pld", None)
    assert resolved() == ("eagle3", str(DEFAULT_HEAD))  # the embedded target's shipped head
    assert resolved("--method", "vanilla") == ("vanilla", None)


def test_tree_defaults_follow_the_backend():
    from eagle3_jax.cli.decode_flags import tree_of as _tree

    cpu, gpu = default_tree("cpu"), default_tree("gpu")
    assert cpu == TreeConfig(top_k=2, depth=3, total_tokens=4, verify_threshold=0.3)
    assert gpu == TreeConfig(top_k=10, depth=8, total_tokens=60) == default_tree("tpu")
    # given fields win; an unset total is capped at what the tree holds: top_k 1 is a chain
    assert default_tree("gpu", top_k=1) == TreeConfig(top_k=1, depth=8, total_tokens=9)
    assert default_tree("gpu", top_k=1, depth=3) == TreeConfig(top_k=1, depth=3, total_tokens=4)
    assert default_tree("gpu", top_k=4, depth=4) == TreeConfig(top_k=4, depth=4, total_tokens=53)
    assert default_tree("cpu", verify_threshold=0.0).verify_threshold == 0.0
    for t in (cpu, gpu, default_tree("gpu", top_k=1), default_tree("gpu", top_k=3, depth=2)):
        t.validate(8192)
    # decode.py leaves the shape flags unset, so the tests' backend (the CPU) decides
    assert _tree(decode_cli.parse_args([])) == cpu
    args = decode_cli.parse_args(["--top-k", "1", "--depth", "5", "--verify-threshold", "0"])
    assert _tree(args) == TreeConfig(top_k=1, depth=5, total_tokens=6)


@pytest.mark.parametrize(
    "backend",
    [pytest.param("gpu", marks=pytest.mark.gpu), pytest.param("tpu", marks=pytest.mark.tpu)],
)
def test_an_accelerator_decodes_with_the_accelerator_defaults(backend):
    """On the accelerator itself (elsewhere the test means nothing): with no flags decode.py
    takes the reporting tree, bf16 parameters and plain products, the defaults the test above
    checks by the backend's name."""
    from eagle3_jax.cli.decode_flags import tree_of as _tree

    assert jax.default_backend() == backend
    assert _tree(decode_cli.parse_args([])) == default_tree(backend) == ACCELERATOR_TREE
    assert default_dtype() == jnp.bfloat16
    assert cpu_tuning.policy_for() == PLAIN_PRODUCTS


def test_draft_vocab_auto_cuts_a_head_with_a_cpu_size(tiny_target_dir, head_dir, tmp_path, capsys):
    """decode.py's default --draft-vocab auto loads a head whose vocab_order.json names a
    cpu_size cut to it on the CPU (and says so, and decodes plain decoding's tokens),
    --draft-vocab full whole (a whole head's exactness: test_speculative_methods_reproduce_vanilla)."""
    import shutil

    import numpy as np

    from eagle3_jax.checkpoints.heads import write_vocab_order

    ordered = tmp_path / "ordered"
    shutil.copytree(head_dir, ordered)
    v = json.loads((head_dir / "config.json").read_text())["vocab_size"]
    write_vocab_order(ordered, np.arange(v)[::-1], cpu_size=10)
    common = ["--target", str(tiny_target_dir), "--draft", str(ordered), "--prompt", "w5 w6 w7",
              "--max-new-tokens", "12", "--top-k", "2", "--depth", "3", "--total-tokens", "6"]  # fmt: skip
    cpu = jax.default_backend() == "cpu"
    for extra, vd in ((["--compare-plain"], 10 if cpu else v), (["--draft-vocab", "full"], v)):
        capsys.readouterr()
        assert run(*common, *extra) == 0
        out = capsys.readouterr()
        loaded = next(x for x in out.err.splitlines() if x.startswith("loaded"))
        assert f"(Vd {vd}" in loaded and (f"of its {v}" in loaded) == (vd != v), loaded
        assert ("outputs identical" in out.out) == ("--compare-plain" in extra)


def test_errors_are_one_line(tiny_target_dir, head_dir, tmp_path, capsys):
    eagle = ["--target", str(tiny_target_dir), "--draft", str(head_dir)]
    cases = [
        (eagle + ["--draft-vocab", "3"], "has no vocab_order.json"),
        (eagle + ["--draft-vocab", "some"], "give auto, full or a positive number"),
        (["--target", str(tmp_path / "missing")], "does not exist"),
        (["--target", str(tiny_target_dir), "--method", "eagle3"], "needs --draft"),
        (["--target", str(tiny_target_dir), "--prompt", "w5 " * 300], "exceeds the context"),
        (["--target", str(tiny_target_dir), "--prompt", "  "], "is empty"),
        (["--target", str(tiny_target_dir), "--method", "pld", "--depth", "0"], "depth 0 < 1"),
        (  # a total the default top-k and depth cannot hold names the defaults it met
            ["--target", str(tiny_target_dir), "--method", "pld", "--total-tokens", "60"],
            "--top-k --depth took this backend's default tree (--top-k 2 --depth 3",
        ),
        (["--target", str(tiny_target_dir), "--compare-plain"], "--compare-plain"),
        (
            ["--target", str(tiny_target_dir), "--method", "eagle3", "--draft", str(tmp_path)],
            "config.json",
        ),
    ]
    for argv, msg in cases:
        assert run(*argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("error: ") and msg in err, err


def test_chat_streams_and_keeps_history(tiny_target_dir, head_dir, monkeypatch, capsys):
    lines = iter(["w5 w6 w7", "w9 w10", ""])
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    assert (
        run(
            "--target",
            str(tiny_target_dir),
            "--chat",
            "--method",
            "eagle3",
            "--draft",
            str(head_dir),
            "--max-new-tokens",
            "8",
        )
        == 0
    )
    err = capsys.readouterr().err
    assert err.count("tokens/s, tau") == 2


def test_a_difference_names_its_token_and_the_dtype():
    """--compare-plain's DIFFERENT says from which token, and below fp32 why greedy outputs can
    part (a verification's sums run in another order than a decode step's)."""
    import types

    import jax.numpy as jnp

    from eagle3_jax.cli.decode import _why_different

    bf16 = types.SimpleNamespace(params={"embed": jnp.zeros((2, 2), jnp.bfloat16)})
    f32 = types.SimpleNamespace(params={"embed": jnp.zeros((2, 2), jnp.float32)})
    msg = _why_different([5, 6, 7], [5, 6, 8, 9], bf16)
    assert (
        msg.startswith(" from new token 2 (0-based) (bfloat16 parameters")
        and "--dtype float32" in msg
    )
    assert _why_different([5, 6, 7], [5, 6, 8], f32) == " from new token 2 (0-based)"
    assert (
        _why_different([5, 6], [5, 6, 7], f32) == " from new token 2 (0-based)"
    )  # one stopped earlier


@pytest.mark.parametrize(
    "extra, msg",
    [
        (["--temperature", "nan"], "--temperature nan: give a finite number"),
        (["--verify-threshold", "inf"], "--verify-threshold inf"),
        (["--max-context", "100000"], "is more than"),
        (["--json", "/nonexistent_dir/x.json"], "does not exist"),
        (["--batch-size", "0"], "--batch-size 0"),
        (["--frequency-penalty", "3"], "frequency_penalty 3.0 outside [-2, 2]"),
        (["--prefill-chunk", "100"], "--prefill-chunk 100: give a multiple of 64"),
    ],
    ids=[
        "nan-temperature",
        "inf-threshold",
        "context-too-long",
        "json-unwritable",
        "batch-0",
        "frequency-penalty-3",
        "prefill-chunk-100",
    ],  # fmt: skip
)
def test_bad_settings_are_one_line_before_any_work(tiny_target_dir, capsys, extra, msg):
    argv = ["--target", str(tiny_target_dir), "--method", "vanilla", "--prompt", "w5 w6",
            "--max-new-tokens", "3", *extra]  # fmt: skip
    assert run(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert msg in err[-1] and err[-1].startswith("error:")


def test_bad_prompt_files_and_truncated_weights_are_one_line(tiny_target_dir, head_dir, tmp_path,
                                                             capsys):  # fmt: skip
    import shutil

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe w5")
    typed = tmp_path / "typed.jsonl"
    typed.write_text('{"prompt": 5}\n')
    base = ["--target", str(tiny_target_dir), "--max-new-tokens", "3"]
    for f, msg in ((bad, "not UTF-8"), (typed, "not a string")):
        assert run(*base, "--method", "vanilla", "--prompt-file", str(f)) == 2
        assert msg in capsys.readouterr().err
    cut = tmp_path / "cut_head"
    shutil.copytree(head_dir, cut)
    w = cut / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    assert run(*base, "--draft", str(cut), "--prompt", "w5 w6") == 2
    assert "truncated or corrupt" in capsys.readouterr().err


def test_ignore_eos_leaves_the_options_no_end():
    """--ignore-eos: the options every batch, --compare-plain's plain decoding and the chat
    decode with hold no end-of-sequence id (None: the target's own); decoding with none is what
    the exactness tests run, and the slow test below runs it end to end."""
    from eagle3_jax.cli import decode_flags

    for flags, eos in (([], None), (["--ignore-eos"], ())):
        args = decode_flags.parse_args(["--target", "t", "--method", "vanilla", *flags])
        assert decode_flags.decode_options(args, 64).eos_ids == eos
    # --prefill-chunk reaches the same options (tests/test_chunked_prefill.py decodes with it)
    for flags, chunk in (([], 0), (["--prefill-chunk", "128"], 128)):
        args = decode_flags.parse_args(["--target", "t", "--method", "vanilla", *flags])
        assert decode_flags.decode_options(args, 64).prefill_chunk == chunk


@pytest.mark.slow  # 15-18 s: three decodes of the tiny target, two with --compare-plain
def test_ignore_eos_decodes_past_the_end_of_sequence(tiny_target_dir, head_dir, tmp_path):
    """A target whose end-of-sequence id is a token it emits after others: decoding stops there
    ("eos"); with --ignore-eos, EAGLE-3 and --compare-plain's plain decoding both go on to
    --max-new-tokens and give the tokens of a target whose end never comes."""
    import shutil

    base = ["--max-new-tokens", "12", "--prompt", "w3"]  # the tiny target: 69 69 80 29 80 29 ..
    assert run("--target", str(tiny_target_dir), *base, "--json", str(tmp_path / "a.json")) == 0
    (full,) = _records(tmp_path / "a.json")
    assert full["finish_reason"] == "max_tokens", "the tiny target emitted its end: pick another"
    ids = full["output_ids"]
    end = next((i for i in range(1, len(ids)) if ids[i] not in ids[:i]), None)
    assert end is not None, f"the tiny target repeats one token: {ids}"
    ended = tmp_path / "ended"
    shutil.copytree(tiny_target_dir, ended)
    hf = json.loads((ended / "config.json").read_text())
    (ended / "config.json").write_text(json.dumps({**hf, "eos_token_id": ids[end]}))
    spec = ["--target", str(ended), "--draft", str(head_dir), *base, "--top-k", "2", "--depth",
            "3", "--total-tokens", "6", "--compare-plain"]  # fmt: skip
    assert run(*spec, "--json", str(tmp_path / "b.json")) == 0
    (stopped,) = _records(tmp_path / "b.json")
    assert stopped["finish_reason"] == "eos" and stopped["output_ids"] == ids[: end + 1]
    assert run(*spec, "--ignore-eos", "--json", str(tmp_path / "c.json")) == 0
    (past,) = _records(tmp_path / "c.json")
    assert past["finish_reason"] == "max_tokens" and past["output_ids"] == ids
    assert past["identical_to_plain"]


def test_json_records_are_written_as_prompts_finish(tiny_target_dir, tmp_path):
    out = tmp_path / "out.json"
    argv = ["--target", str(tiny_target_dir), "--method", "vanilla", "--prompt", "w5 w6",
            "--prompt", "w7 w8 w9", "--max-new-tokens", "3", "--json", str(out)]  # fmt: skip
    assert run(*argv) == 0
    assert [r["id"] for r in json.loads(out.read_text())] == ["0", "1"]


def test_decoding_on_a_mesh_equals_one_device(tiny_target_dir, head_dir, tmp_path):
    """--mesh 2x4 on 8 simulated devices (the target and head tensor-parallel over 4, the batch
    over 2): the same tokens as one device, greedy, for EAGLE-3 and plain decoding."""
    base = ["--target", str(tiny_target_dir), "--draft", str(head_dir), "--max-new-tokens", "10",
            "--batch-size", "2", "--top-k", "2", "--depth", "3", "--total-tokens", "6",
            "--compare-plain"] + [a for p in PROMPTS for a in ("--prompt", p)]  # fmt: skip
    assert run(*base, "--json", str(tmp_path / "one.json")) == 0
    assert run(*base, "--mesh", "2x4", "--json", str(tmp_path / "mesh.json")) == 0
    one, mesh = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "mesh.json"))
    assert [r["output_ids"] for r in mesh] == [r["output_ids"] for r in one]
    assert [r["target_forwards"] for r in mesh] == [r["target_forwards"] for r in one]
    assert run(*base, "--mesh", "4x4") == 2  # 16 devices: one line, exit 2
