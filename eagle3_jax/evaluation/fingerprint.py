"""An evaluation run's fingerprint: what makes its records comparable (the flags that decide them,
the target's, the heads' and the questions' files), kept as OUT/config.json; a run in the same
OUT under another fingerprint is refused, naming what differs, and the same one resumes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from eagle3_jax.checkpoints import target_digest
from eagle3_jax.checkpoints.atomic import write_text_atomic
from eagle3_jax.errors import Eagle3Error, differing_keys
from eagle3_jax.evaluation.options import EvalOptions, num_seeds
from eagle3_jax.evaluation.questions import BENCHES


def head_digest(path: str | Path) -> str:
    """sha256 (16 hex digits) of a head's files (config, weights, vocab_order.json): a head
    replaced at the same path is another head."""

    path = Path(path)
    h = hashlib.sha256()
    names = ["config.json", "vocab_order.json", "pytorch_model.bin"]
    for f in sorted(path.glob("*.safetensors")) + [path / n for n in names]:
        if f.is_file():
            h.update(f.name.encode())
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    h.update(block)
    return h.hexdigest()[:16]


def fingerprint(
    opts: EvalOptions, target_path: str, drafts: dict[str, str], methods, cuts=None
) -> dict:
    """What makes records comparable; --questions is left out so a run can be extended. Heads are
    named by path and by their files' digest, the target by its files' (`target_digest`), the
    questions by their file's; `cuts` ({draft: ids kept}) is recorded only when a
    draft is cut."""
    bench = opts.bench if opts.bench in BENCHES else str(Path(opts.bench).resolve())
    qfile = Path(BENCHES.get(opts.bench, opts.bench))
    extra = {"draft_vocab": dict(cuts)} if cuts else {}
    # what decides the records besides the flags: the target's files and the questions' text
    extra["target_digest"] = target_digest(target_path)
    extra["questions_digest"] = hashlib.sha256(qfile.read_bytes()).hexdigest()[:16]
    if drafts:
        extra["draft_digests"] = {n: head_digest(p) for n, p in drafts.items()}
    if opts.replay:
        extra["replay"] = True
    return {
        "target": target_path,
        "drafts": drafts,
        "methods": [dataclasses.asdict(m) for m in methods],
        "bench": bench,
        "temperature": opts.temperature,
        "max_new_tokens": opts.max_new_tokens,
        "seeds": num_seeds(opts),
        "batch_size": opts.batch_size,
        "dtype": opts.dtype,
        **extra,
    }


def check_config(out: Path, config: dict) -> None:
    """Writes OUT/config.json, or refuses an OUT that holds another configuration."""
    path = out / "config.json"
    config = json.loads(json.dumps(config))  # tuples -> lists, as stored
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError as e:
            raise Eagle3Error(f"{path} is not valid JSON: {e}; use another --out") from e
        if old != config:
            diff = differing_keys(old, config)
            hint = (
                " (a bare eagle3 or pld takes decode.py's default tree of this backend, which "
                "differs between CPUs and accelerators; a run labels it with its shape, e.g. "
                "eagle3:2,3,4,0.3)"
                if "methods" in diff
                else ""
            )
            if "draft_vocab" in diff:
                hint += (
                    " (the drafts are cut differently: --draft-vocab, whose default auto cuts a "
                    "head on a CPU when its vocab_order.json names a cpu_size)"
                )
            if {"target_digest", "questions_digest"} & set(diff):
                hint += (
                    " (the target's files or the question file changed since the run started, "
                    "or the run predates their fingerprints)"
                )
            if "draft_digests" in diff:
                hint += (
                    " (a head's files are not those this run started with, or the run predates "
                    "heads' fingerprints)"
                )
            raise Eagle3Error(
                f"{out} holds results of another configuration (differs in {', '.join(diff)})"
                f"{hint}: use another --out, or the same flags to resume"
            )
        return
    if out.is_dir() and any(not p.name.endswith(".lock") for p in out.iterdir()):
        raise Eagle3Error(
            f"{out} already holds files that are not an evaluation run (no config.json): use a "
            "new or empty --out (nothing there was changed)"
        )
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(config, indent=2) + "\n")
