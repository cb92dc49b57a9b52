"""Trained EAGLE-3 heads that ship with the package, in the official format (config.json +
model.safetensors + a model card, README.md).

`smollm2_135m_instruct/` is the head for the embedded default target (SmolLM2-135M-Instruct);
decode.py, `make demo` and the evaluation harness use it when no --draft is given.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_jax.errors import Eagle3Error

HEADS_DIR = Path(__file__).resolve().parent
DEFAULT_HEAD = HEADS_DIR / "smollm2_135m_instruct"


def default_head() -> Path:
    """The shipped head of the embedded default target; a clear error if the install lacks it."""
    if not (DEFAULT_HEAD / "config.json").is_file():
        raise Eagle3Error(
            f"the default EAGLE-3 head is missing from {DEFAULT_HEAD} (a broken install?): "
            "reinstall eagle3_jax, pass --draft PATH, or use --method vanilla"
        )
    return DEFAULT_HEAD
