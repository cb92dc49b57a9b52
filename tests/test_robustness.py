"""Issue 34's four classes, each tried as a user would meet it, through the command line.

Every case builds a situation in a fresh folder, runs one command (its `main(argv)`), and checks
what the README promises: exit status 2, one line on stderr naming the problem, and every file
that was there before byte-identical afterwards (nothing deleted, nothing rewritten; lock files,
our own bookkeeping, aside). The classes, the data-loss one first:

1. writing over what we did not create (a user's folder or file, the source itself);
2. resuming or reusing with other inputs (another target, data, question file or setting);
3. a second writer on an output another process is writing;
4. bad input: truncated weights, undecodable or mistyped files, impossible settings, an
   output that cannot be written.

The library-level checks behind them (atomic directories, the feature store's exact resume, the
lock itself) are in tests/test_safety.py.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import shutil
from pathlib import Path

import jax
import pytest

from eagle3_jax.checkpoints.atomic import exclusive

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def head(tiny_target_dir, tmp_path_factory):
    from eagle3_jax.checkpoints.eagle_format import save_draft
    from eagle3_jax.checkpoints.hf import load_hf
    from eagle3_jax.models import draft as drf
    from eagle3_jax.vocab import identity

    _, cfg = load_hf(tiny_target_dir)
    dcfg = drf.DraftConfig.from_target(cfg)
    d = tmp_path_factory.mktemp("robust") / "head"
    save_draft(d, drf.init_params(dcfg, jax.random.PRNGKey(3), scale=0.2), dcfg,
               identity(cfg.vocab_size), dtype="float32")  # fmt: skip
    return d


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and not p.name.endswith(".lock")
    }


def _user_folder(tmp: Path, name: str = "mine") -> Path:
    d = tmp / name
    d.mkdir()
    (d / "thesis.tex").write_text("three years of work")
    return d


def _questions(tmp: Path) -> Path:
    q = tmp / "questions.jsonl"
    q.write_text(json.dumps({"question_id": 0, "category": "qa", "turns": ["w5 w6 w7"]}) + "\n")
    return q


def _prompts(tmp: Path) -> Path:
    p = tmp / "prompts.jsonl"
    p.write_text(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "w5 w6"}]})
                 + "\n")  # fmt: skip
    return p


def _conversations(path: Path, n: int = 8) -> Path:
    turns = [[{"from": "human", "value": f"w{5 + i} w{6 + i}"},
              {"from": "gpt", "value": " ".join(f"w{j}" for j in range(10 + i, 20 + i))}]
             for i in range(n)]  # fmt: skip
    path.write_text("".join(json.dumps({"id": str(i), "conversations": c}) + "\n"
                            for i, c in enumerate(turns)))  # fmt: skip
    return path


def _train_args(env, tmp: Path, **fields) -> list[str]:
    fields.setdefault("data", _conversations(tmp / "train.jsonl"))
    args = ["--config", str(ROOT / "configs/tiny.py"), f"--config.target={env['target']}"]
    return args + [f"--config.{k}={v}" for k, v in fields.items()] + ["--no-progress"]


def _eval_args(env, q: Path, out: Path) -> list[str]:
    return ["--target", str(env["target"]), "--bench", str(q), "--methods", "vanilla",
            "--max-new-tokens", "3", "--out", str(out), "--no-progress"]  # fmt: skip


def _run(cli: str, argv: list[str]) -> int:
    return importlib.import_module(f"eagle3_jax.cli.{cli}").main(argv)


# ---- 1. never over what we did not create --------------------------------------------------


def _trim(env, tmp, out):
    return ["trim", "--target", str(env["target"]), "--draft", str(env["head"]), "--counts",
            str(tmp / "c.npy"), "--size", "4", "--out", str(out)]  # fmt: skip


DATA_LOSS = {
    "vocab trim --out . (the current folder, holding a user's files)": lambda env, tmp: (
        "vocab", _trim(env, tmp, _user_folder(tmp).parent), "did not write"),
    "vocab trim --out . around the source head": lambda env, tmp: (
        "vocab", _trim(env, tmp, env["head"].parent), "inside or around"),
    "vocab trim with a counts file that is not there": lambda env, tmp: (
        "vocab", _trim(env, tmp, tmp / "new"), "c.npy cannot be read"),
    "vocab trim --out the source head": lambda env, tmp: (
        "vocab", _trim(env, tmp, env["head"]), "inside or around"),
    "vocab trim --out a user's folder": lambda env, tmp: (
        "vocab", _trim(env, tmp, _user_folder(tmp)), "did not write"),
    "export --out a user's folder": lambda env, tmp: (
        "export", ["--draft", str(env["head"]), "--out", str(_user_folder(tmp))], "did not write"),
    "train out_dir a user's folder": lambda env, tmp: (
        "train", _train_args(env, tmp, out_dir=_user_folder(tmp)), "not a training run"),
    "train --precompute-features into a user's folder": lambda env, tmp: (
        "train", [*_train_args(env, tmp, out_dir=tmp / "run", features_dir=_user_folder(tmp)),
                  "--precompute-features"], "did not write"),
    "eval --out a user's folder": lambda env, tmp: (
        "eval", _eval_args(env, _questions(tmp), _user_folder(tmp)), "not an evaluation run"),
    "ablate --out a user's folder": lambda env, tmp: (
        "ablate", ["--config", str(ROOT / "configs/ablate_tiny.py"), "--out",
                   str(_user_folder(tmp)), f"--config.target={env['target']}", "--no-progress"],
        "not an ablation run"),
    "regenerate into a file it did not write": lambda env, tmp: (
        "regenerate", [str(_prompts(tmp)), str(_user_folder(tmp) / "thesis.tex"),
                       "--target", str(env["target"]), "--no-progress"],
        "not written by this command"),
}  # fmt: skip


# ---- 2. never resumed or reused with other inputs -----------------------------------------


def _regenerated_then_other_setting(env, tmp):
    argv = [str(_prompts(tmp)), str(tmp / "answers.jsonl"), "--target", str(env["target"]),
            "--max-new-tokens", "3", "--no-progress"]  # fmt: skip
    assert _run("regenerate", argv) == 0
    return "regenerate", [*argv[:-2], "5", "--no-progress"], "max_new_tokens"


def _evaluated_then_question_edited(env, tmp):
    q, out = _questions(tmp), tmp / "eval"
    assert _run("eval", _eval_args(env, q, out)) == 0
    q.write_text(q.read_text().replace("w5 w6 w7", "w8 w9"))
    return "eval", _eval_args(env, q, out), "question file changed"


def _precomputed_then_other_data(env, tmp, new_out_dir: bool):
    mine = _conversations(tmp / "data.jsonl")
    argv = _train_args(env, tmp, data=mine, out_dir=tmp / "run", features_dir=tmp / "feats")
    assert _run("train", [*argv, "--precompute-features"]) == 0
    lines = mine.read_text().splitlines()
    mine.write_text("\n".join(lines[1:] + lines[:1]) + "\n")  # the same records, another order
    if new_out_dir:  # a fresh tokenisation: the store itself sees other records
        argv = [*argv, f"--config.out_dir={tmp / 'run2'}"]
        return "train", [*argv, "--precompute-features"], "records"
    return "train", [*argv, "--precompute-features"], "dataset.npz was made from other inputs"


MIXING = {
    "regenerate resumed with another --max-new-tokens": _regenerated_then_other_setting,
    "eval resumed after its question file was edited": _evaluated_then_question_edited,
    "an out_dir's tokenised data reused for other data": lambda env, tmp: (
        _precomputed_then_other_data(env, tmp, new_out_dir=False)
    ),
    "a feature store reused for other data": lambda env, tmp: _precomputed_then_other_data(
        env, tmp, new_out_dir=True
    ),
}


# ---- 3. one writer per output -------------------------------------------------------------


def _held(path: Path, cli: str, argv: list[str], said: str = "another process"):
    """`cli argv` run while this process holds the lock the command takes on `path` (a folder
    locks `path/.lock`, anything else `path.lock`, as `exclusive` does)."""
    return cli, argv, said, exclusive(path)


def _folder(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


LOCKS = {
    "train into an out_dir being trained": lambda env, tmp: _held(
        _folder(tmp / "run") / "process0", "train", _train_args(env, tmp, out_dir=tmp / "run")),
    "eval into an --out being evaluated": lambda env, tmp: _held(
        _folder(tmp / "eval"), "eval", _eval_args(env, _questions(tmp), tmp / "eval")),
    "regenerate into a file being written": lambda env, tmp: _held(
        tmp / "answers.jsonl", "regenerate", [str(_prompts(tmp)), str(tmp / "answers.jsonl"),
                                              "--target", str(env["target"]), "--no-progress"]),
    "ablate into an out_dir being run": lambda env, tmp: _held(
        _folder(tmp / "grid"), "ablate", ["--config", str(ROOT / "configs/ablate_tiny.py"), "--out",
                                 str(tmp / "grid"), f"--config.target={env['target']}"]),
}  # fmt: skip


# ---- 4. bad input is one line ---------------------------------------------------------------


def _truncated(src: Path, tmp: Path, name: str) -> Path:
    dst = tmp / name
    shutil.copytree(src, dst)
    w = next(dst.glob("*.safetensors"))
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    return dst


def _decode(env, *extra) -> list[str]:
    return ["--target", str(env["target"]), "--prompt", "w5 w6", "--max-new-tokens", "3",
            "--no-chat-template", *extra]  # fmt: skip


BAD_INPUT = {
    "a truncated head": lambda env, tmp: (
        "decode", _decode(env, "--draft", str(_truncated(env["head"], tmp, "head"))),
        "truncated"),
    "a truncated target": lambda env, tmp: (
        "decode", ["--target", str(_truncated(env["target"], tmp, "target")), "--prompt", "w5",
                   "--no-chat-template"], "truncated"),
    "a prompt file that is not UTF-8": lambda env, tmp: (
        "decode", [*_decode(env)[:2], "--prompt-file", str(_bytes(tmp / "p.txt", b"w5 \xff\xfe"))],
        "UTF-8"),
    "a question field of the wrong type": lambda env, tmp: (
        "eval", _eval_args(env, _bytes(tmp / "q.jsonl", b'{"question_id": 0, "turns": "w5"}\n'),
                           tmp / "eval"), "`turns`"),
    "a non-finite setting": lambda env, tmp: (
        "decode", _decode(env, "--temperature", "nan"), "--temperature"),
    "a context the model cannot hold": lambda env, tmp: (
        "decode", _decode(env, "--max-context", "100000000"), "--max-context"),
    "a --json path that cannot be written": lambda env, tmp: (
        "decode", _decode(env, "--json", str(_bytes(tmp / "afile", b"x") / "out.json")),
        "--json"),
    "an out_dir that is a file": lambda env, tmp: (
        "train", _train_args(env, tmp, out_dir=_bytes(tmp / "afile", b"x")), "is a file"),
}  # fmt: skip


def _bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ---- the one check every case gets: exit 2, one line, every file as it was ----------------


CLASSES = {  # the four classes above, in order: their ids name a case's class
    "written-over": DATA_LOSS,
    "other-inputs": MIXING,
    "second-writer": LOCKS,
    "bad-input": BAD_INPUT,
}
CASES = [(cls, name) for cls, table in CLASSES.items() for name in table]


@pytest.mark.parametrize("cls, name", CASES, ids=[f"{cls}/{name}" for cls, name in CASES])
def test_refused_in_one_line_changing_nothing(cls, name, tiny_target_dir, head, tmp_path, capsys,
                                              monkeypatch):  # fmt: skip
    case = CLASSES[cls][name]
    monkeypatch.chdir(tmp_path)
    env = {"target": tiny_target_dir, "head": head}
    cli, argv, said, *held = case(env, tmp_path)
    before = {**_snapshot(tmp_path), **{f"head/{k}": v for k, v in _snapshot(head).items()}}
    capsys.readouterr()
    with held[0] if held else contextlib.nullcontext():
        rc = _run(cli, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, f"exit status {rc}, stderr {err}"
    assert len(err) == 1 and said in err[0], err
    after = {**_snapshot(tmp_path), **{f"head/{k}": v for k, v in _snapshot(head).items()}}
    assert {k: after.get(k) for k in before} == before  # nothing deleted or rewritten
