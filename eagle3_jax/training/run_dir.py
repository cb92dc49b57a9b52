"""A training run's out_dir and what keeps it one run: refusing a folder that is not a run, the
records of its config (train_config.json) and inputs (inputs.json) that a resume is checked
against, the resume from its last checkpoint, and the heads it exports."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils

from eagle3_jax import distributed
from eagle3_jax.checkpoints import files_digest, resolve_target, target_digest
from eagle3_jax.checkpoints.eagle_format import save_draft
from eagle3_jax.checkpoints.heads import VOCAB_ORDER_FILE, read_vocab_order
from eagle3_jax.errors import Eagle3Error, differing_keys
from eagle3_jax.training.checkpoint import Checkpoints
from eagle3_jax.training.config import TrainConfig, flatten

# fields that may change between a run and its resume (train_config.json leaves them out)
RESUMABLE = (
    "max_steps",
    "save_every",
    "log_every",
    "keep_checkpoints",
    "export_every",
    "val_data",
    "val_every",
    "val_conversations",
)


# what a run (or the ablation runner, or train-timed, before it) writes into its out_dir: a folder
# holding none of these and something else is a user's, never trained into
RUN_FILES = ("train_config.json", "inputs.json", "checkpoints", "dataset.npz", "vocab.npz",
             "metrics.jsonl", "cell.json", "timed.json", "regenerated.jsonl")  # fmt: skip
INPUTS = "inputs.json"  # what the run's results depend on beyond its config: the files' digests


def check_out_dir(out: Path) -> None:
    """Refuses an out_dir that is a file, or a folder holding something else than a run
    (`RUN_FILES`): a user's, never trained into."""
    if out.exists() and not out.is_dir():
        raise Eagle3Error(f"out_dir {out} is a file: give a directory")
    if (
        out.is_dir()
        and not any((out / n).exists() for n in RUN_FILES)
        and any(not p.name.startswith(".") and not p.name.endswith(".lock") for p in out.iterdir())
    ):
        raise Eagle3Error(
            f"out_dir {out} holds files that are not a training run: use a new or empty one "
            "(nothing there was changed)"
        )


def run_inputs(tc: TrainConfig) -> dict[str, str]:
    """Digests of the target's files, the data and validation files and any head the run starts
    from (by name, size and modification time: `files_digest`)."""
    split = lambda text: [p for p in text.split(",") if p]  # noqa: E731
    out = {"target": target_digest(resolve_target(tc.corpus.target))}
    for name, paths in (("data", split(tc.corpus.data)), ("val_data", split(tc.run.val_data)),
                        ("init_head", split(tc.head.init_head)),
                        ("init_trunk", split(tc.head.init_trunk))):  # fmt: skip
        if paths:
            out[name] = files_digest(paths)
    return out


def check_inputs(tc: TrainConfig, out: Path, resuming: bool) -> None:
    """Records the run's inputs (`INPUTS`), or refuses to resume when one of them changed since
    the run started, naming it. A run from before this record is resumed and recorded."""
    path = out / INPUTS
    now = run_inputs(tc)
    if resuming and path.exists():
        saved = json.loads(path.read_text())
        diff = differing_keys(saved, now)
        if diff:
            raise Eagle3Error(
                f"--resume, but {', '.join(diff)} changed since the run started (files replaced or "
                "edited at the same path): restore them, or start a new out_dir"
            )
    distributed.barrier("inputs read")
    if distributed.is_primary():
        path.write_text(json.dumps(now, indent=1) + "\n")


def check_run_config(tc: TrainConfig, out: Path, resuming: bool) -> None:
    """Refuses to resume a run under another config than its train_config.json (in either
    layout, `flatten`), naming the fields; then records the config (`RESUMABLE` left out)."""
    path = out / "train_config.json"
    if resuming:
        diff = config_changes(json.loads(path.read_text()), tc)
        if diff:
            raise Eagle3Error(
                f"--resume with a different config ({', '.join(diff)}): resume with the "
                "run's own config, or start a new out_dir"
            )
    check_inputs(tc, out, resuming=resuming)
    distributed.barrier("config read")  # before process 0 writes it
    if distributed.is_primary():
        path.write_text(json.dumps(tc.record(RESUMABLE), indent=1))


def config_changes(saved: dict, tc: TrainConfig) -> list[str]:
    """The fields in which a run's saved train_config.json (nested by group, or the flat layout
    written before the groups) differs from `tc`, leaving out the `RESUMABLE` ones. A field
    the saved record lacks (added to TrainConfig since, e.g. `schedule`) counts as its default."""
    now, saved = flatten(tc.record(RESUMABLE)), flatten(saved)
    defaults = flatten(TrainConfig().record(RESUMABLE))
    saved = {**{k: defaults[k] for k in now.keys() - saved.keys() if k in defaults}, **saved}
    return differing_keys(saved, now)


def restore(ckpt: Checkpoints, state, total: int, out: Path) -> tuple[Any, int, int]:
    """(state, first step, tokens seen) of the run's last checkpoint."""
    state, saved_meta = ckpt.restore(state)
    start = int(state.step)
    if start > total:
        raise Eagle3Error(
            f"{out} holds a checkpoint at step {start}, past this run's {total} steps: "
            "raise max_steps (or epochs) to continue it, or start a new out_dir"
        )
    print(f"resumed from step {start}", file=sys.stderr)
    return state, start, int(saved_meta.get("tokens_seen", 0))


def export_head(path: Path, state, dcfg, vocab, tc: TrainConfig, step: int, tokens: int) -> Path:
    """The head at this step in the official format, plus training.json (step, tokens seen).
    Across processes every process gathers the parameters, process 0 alone writes the head, and
    every process returns once it is written."""

    if jax.process_count() > 1:
        params = multihost_utils.process_allgather(state.params, tiled=True)
        if distributed.is_primary():
            _write_head(path, params, dcfg, vocab, tc, step, tokens)
        distributed.barrier(f"export {path}")
        return path
    return _write_head(path, jax.device_get(state.params), dcfg, vocab, tc, step, tokens)


def _write_head(path: Path, params, dcfg, vocab, tc: TrainConfig, step: int, tokens: int) -> Path:
    save_draft(path, params, dcfg, vocab, dtype=tc.run.export_dtype)
    init_head = tc.head.init_head
    if init_head:  # a continued head keeps its ids, so their order, checked against them:
        try:  # never export a head its own order file makes unloadable
            if read_vocab_order(init_head, vocab) is not None:
                shutil.copyfile(Path(init_head) / VOCAB_ORDER_FILE, path / VOCAB_ORDER_FILE)
        except Eagle3Error as e:
            print(f"note: {VOCAB_ORDER_FILE} of init_head not copied: {e}", file=sys.stderr)
    # last: a head with its training.json was written whole (a resumed run exports one without)
    (path / "training.json").write_text(json.dumps({"step": step, "tokens": tokens}) + "\n")
    return path
