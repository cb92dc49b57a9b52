"""Every command line of eagle3_jax, one thin module each, run as `python -m eagle3_jax COMMAND`.

  decode          generate: plain, prompt lookup or EAGLE-3 (`decode.py` in a checkout)
  train           train a draft head from a config (`train.py` in a checkout)
  train-timed     train within a wall-clock budget (fits max_steps to the minutes a machine is lent)
  eval            the evaluation harness: methods x benchmarks, resumable, one report
  ablate          an ablation grid: heads trained from one feature store, one table
  validate        a head's TTT accuracy and replayed tau on held-out conversations
  regenerate      answer prompts with the target itself (training data)
  select-prompts  choose new training prompts (not answered, not repeated, not held out)
  vocab           draft-vocabulary methods: count, trim (FR-Spec, VocabTrim), extend, order
  export          convert a head between the official and vLLM speculators layouts
  serve           an OpenAI-compatible server: continuous batching over fixed slots

Each module's `main(argv) -> int` parses its flags, calls the library and returns the exit status:
0, or 2 with one line on stderr for bad input (`Eagle3Error`).
"""

from __future__ import annotations

import importlib
import sys

from eagle3_jax import backends

COMMANDS = {
    "decode": "decode",
    "train": "train",
    "train-timed": "timed",
    "eval": "eval",
    "ablate": "ablate",
    "validate": "validate",
    "regenerate": "regenerate",
    "select-prompts": "select_prompts",
    "vocab": "vocab",
    "export": "export",
    "serve": "serve",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}: use one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    backends.set_xla_flags()  # before any command starts a backend
    module = importlib.import_module(f"eagle3_jax.cli.{COMMANDS[name]}")
    return module.main(rest)
