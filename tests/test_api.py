"""The public API (eagle3_jax/__init__.py): what a notebook user types, and the README's example."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax.models import draft as drf
from eagle3_jax.vocab import from_target_ids

README = Path(__file__).resolve().parents[1] / "README.md"


def test_public_names_are_documented():
    doc = e3.__doc__
    for name in e3.__all__:
        assert name in doc, f"{name} is public but not listed in eagle3_jax's docstring"
        assert getattr(e3, name).__doc__, f"{name} has no docstring"


def test_generate_is_exact_for_every_method(tiny_target_dir, tmp_path):
    target = e3.load_target(str(tiny_target_dir))
    dcfg = drf.DraftConfig.from_target(target.cfg, draft_vocab_size=60)
    params = drf.init_params(dcfg, jax.random.PRNGKey(0), scale=0.1)
    vocab = from_target_ids(np.arange(3, 63), dcfg.vocab_size)
    e3.save_head(tmp_path / "head", params, dcfg, vocab, "float32")
    head = e3.load_head(tmp_path / "head", target)
    assert isinstance(head, e3.Head) and head.cfg.draft_vocab_size == 60
    prompts = ["w5 w6 w7 w5 w6", [40, 41, 12, 40, 41]]
    plain = e3.generate(target, prompts, 12, method="vanilla")
    assert plain.tau == pytest.approx(1.0) and plain.acceptance_rates == []
    for method in ("eagle3", "pld"):
        out = e3.generate(target, prompts, 12, head=head, method=method,
                          tree=e3.default_tree(top_k=2, depth=3, total_tokens=6))  # fmt: skip
        assert out.output_ids == plain.output_ids, method
        assert out.texts == plain.texts and out.tau >= 1.0
        assert out.accept_hist.shape == (2, 4)
    assert e3.generate(target, prompts, 12, head=head).method == "eagle3"
    with pytest.raises(e3.Eagle3Error, match="needs a head"):
        e3.generate(target, prompts, 4, method="eagle3")
    with pytest.raises(e3.Eagle3Error, match="method 'beam'"):
        e3.generate(target, prompts, 4, method="beam")


def readme_example() -> str:
    text = README.read_text()
    section = text[text.index("## Python API") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_is_short():
    assert len(readme_example().strip().splitlines()) <= 12


@pytest.mark.slow
def test_readme_example_runs(capsys):
    """The README's Python example, as written, on the embedded default and its shipped head."""
    exec(compile(readme_example(), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()
