"""scripts/crosscheck_official.py and its steps (scripts/crosscheck/), the parts that run
without the official checkout: the head check the official loader needs, the config copy that
fixes it, the tree mapping, the round-by-round comparison, and a worker that imports no jax."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import load_script

from eagle3_jax.checkpoints.safetensors_io import write_safetensors
from eagle3_jax.heads import DEFAULT_HEAD


@pytest.fixture(scope="module")
def xc():
    return load_script("scripts/crosscheck_official.py")


def _head(path: Path, config: dict, embed: bool = False) -> Path:
    path.mkdir()
    tensors = {"fc.weight": np.zeros((4, 12), np.float32)}
    if embed:
        tensors["embed_tokens.weight"] = np.zeros((10, 4), np.float32)
    write_safetensors(path / "model.safetensors", tensors)
    (path / "config.json").write_text(json.dumps({"hidden_size": 4, **config}))
    return path


def test_the_official_loaders_random_embedding_case_is_detected(xc, tmp_path):
    bad = _head(tmp_path / "bad", {"target_hidden_size": 4})
    assert "RANDOM" in xc.official_embedding_issue(bad)
    assert xc.official_embedding_issue(_head(tmp_path / "ok", {})) is None
    own = _head(tmp_path / "own", {"target_hidden_size": 4}, embed=True)
    assert xc.official_embedding_issue(own) is None
    wide = _head(tmp_path / "wide", {"target_hidden_size": 8})
    assert "width" in xc.official_embedding_issue(wide)


def test_the_config_copy_drops_the_key_and_keeps_the_weights(xc, tmp_path):
    bad = _head(tmp_path / "bad", {"target_hidden_size": 4, "vocab_size": 10})
    fixed = xc.fixed_config_copy(bad, tmp_path / "fixed")
    assert json.loads((fixed / "config.json").read_text()) == {"hidden_size": 4, "vocab_size": 10}
    assert (fixed / "model.safetensors").read_bytes() == (bad / "model.safetensors").read_bytes()
    assert "target_hidden_size" in json.loads((bad / "config.json").read_text())  # untouched
    assert xc.official_embedding_issue(fixed) is None
    with pytest.raises(SystemExit, match="fitting embedding"):
        xc.fixed_config_copy(_head(tmp_path / "wide", {"target_hidden_size": 8}), tmp_path / "w")


def test_the_shipped_head_fits_the_official_loader(xc):
    """Its config.json lets the official cnets.Model copy the target's embedding, and it names
    the layers the official Llama code feeds a draft of SmolLM2 (30 layers)."""
    assert xc.official_embedding_issue(DEFAULT_HEAD) is None
    cfg = json.loads((DEFAULT_HEAD / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == xc.official_aux_ids(30)


def test_tree_mapping(xc):
    assert xc.official_tree(10, 8, 60) == {"top_k": 10, "depth": 7, "total_token": 60}


def test_round_by_round_comparison(xc):
    # ours: prefill token + rounds emitting 3, 1, 2 (cut at the limit: the official round went on)
    ours = {"tokens": [5, 6, 7, 8, 9, 10, 11], "emitted": [3, 1, 2], "cut": True}
    same = xc.compare(ours, {"tokens": [5, 6, 7, 8, 9, 10, 11, 12, 13], "accepted": [2, 0, 4]})
    assert same["first_round_that_differs"] is None and same["identical_outputs"]
    assert (same["rounds_ours"], same["rounds_official"]) == (3, 3)
    assert same["tau_ours"] == same["tau_official"] == 2.0
    # the official run accepts less in round 2: one more round for the same tokens
    slow = xc.compare(ours, {"tokens": [5, 6, 7, 8, 9, 10, 11, 12], "accepted": [2, 0, 0, 1, 3]})
    assert slow["first_round_that_differs"] == 3 and slow["identical_outputs"]
    assert slow["rounds_official"] == 4 and slow["tau_official"] == 6 / 4
    other = xc.compare(ours, {"tokens": [5, 6, 7, 0, 9, 10, 11], "accepted": [1, 1, 1, 1]})
    assert other["first_round_that_differs"] == 1 and other["first_token_that_differs"] == 3
    table = xc.format_table([{"id": "p", "comparison": slow}])
    assert "3/4" in table and "round 3" in table


def test_prompt_file(xc, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"id": "x", "prompt": "b"}\n')
    assert xc.read_prompts(str(f)) == [("1", "a"), ("x", "b")]
    assert [pid for pid, _ in xc.read_prompts(None)] == ["explain", "code", "list"]


def test_the_official_worker_needs_no_jax(tmp_path):
    """--official-python may name an interpreter without jax or eagle3_jax: the script and its
    steps import the standard library alone until our side runs (`python -S`: no site-packages)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts/crosscheck_official.py"
    res = subprocess.run(
        [sys.executable, "-S", str(script), "--official-worker", "job.json", "out.json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert "No such file or directory: 'job.json'" in res.stderr, res.stderr[-500:]
