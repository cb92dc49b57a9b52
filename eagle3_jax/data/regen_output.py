"""A regeneration's output file, kept resumable and shared: claimed with the settings that decide
its answers (`<out>.meta.json`, `claim`), resumed by record id (a torn last line cut away,
`prepare_resume`), appended and flushed record by record (`append`), and across processes written
in shards that process 0 merges into it in the one-process order (`share_out`, `merge_shards`;
a killed run's shards are folded in first, `fold_shards`). What is regenerated is
`eagle3_jax.data.regenerate`'s."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import heapq
import json
import os
from pathlib import Path
from typing import NamedTuple

from eagle3_jax import distributed
from eagle3_jax.checkpoints import target_digest
from eagle3_jax.checkpoints.atomic import exclusive, write_text_atomic
from eagle3_jax.errors import Eagle3Error, differing_keys


class RegenStats(NamedTuple):
    answered: int  # answered in this run
    skipped: int  # prompts too long for max_prompt_tokens / the context
    resumed: int  # already answered in out_path before this run
    hit_max_tokens: int  # answers of this run cut off at max_new_tokens


def prepare_resume(path: Path) -> set[str]:
    """Ids already in `path`; a partial last line (interrupted write) is truncated away.

    Lines that are not valid JSON (cannot happen with our writer, whose writes end in a newline)
    are ignored, so their prompts are answered again.
    """
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with open(path, "r+b") as f:  # appending after a partial line would corrupt the next record
            f.truncate(keep)
    ids = set()
    for line in data[:keep].decode("utf-8", errors="replace").split("\n"):  # not splitlines:
        # U+2028 and friends occur raw inside JSON strings
        try:
            ids.add(str(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            continue
    return ids


def shard_path(out_path: Path, index: int, count: int) -> Path:
    """Where process `index` of `count` writes its answers before process 0 merges them."""
    return out_path.with_name(f"{out_path.name}.part{index}of{count}")


def _lines(path: Path):
    """(id, the line's bytes) of each complete record line of a JSONL file (split at b"\\n"
    only: U+2028 and friends occur raw inside JSON strings)."""
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                return  # a write cut short by a kill
            try:
                yield str(json.loads(line)["id"]), line
            except (ValueError, KeyError, TypeError):
                continue


def fold_shards(out_path: Path) -> int:
    """Appends to `out_path` the records that the shards of a killed multi-process run hold and
    it lacks (in shard order), then removes the shards; returns how many. Idempotent: a kill
    between the append and the removal leaves records that the next fold skips."""
    shards = sorted(
        Path(p) for p in glob.glob(glob.escape(str(out_path)) + ".part*of*") if Path(p).is_file()
    )
    if not shards:
        return 0
    have = prepare_resume(out_path)
    added = 0
    with open(out_path, "ab") as f:
        for shard in shards:
            for rid, line in _lines(shard):
                if rid not in have:
                    have.add(rid)
                    f.write(line)
                    added += 1
        f.flush()
        os.fsync(f.fileno())
    for shard in shards:
        shard.unlink()
    return added


def merge_shards(out_path: Path, count: int, order: dict[str, int]) -> None:
    """Process 0: appends the `count` processes' shards to `out_path` in the one-process order
    (`order`: record id -> its place in the plan; each shard is already in that order, so a
    streaming merge), byte for byte, then removes them."""
    shards = [shard_path(out_path, i, count) for i in range(count)]
    streams = [((order[rid], line) for rid, line in _lines(p)) for p in shards]
    with open(out_path, "ab") as f:
        for _, line in heapq.merge(*streams, key=lambda x: x[0]):
            f.write(line)
        f.flush()
        os.fsync(f.fileno())
    for p in shards:
        p.unlink()


def claim(out_path: Path, target, sampling, seed: int, settings: dict) -> None:
    """Writes what decides the answers beside `out_path` (`<out>.meta.json`: the target's files,
    the generation settings), or refuses to add to a file answered with other ones, naming what
    differs, or to a file this command did not write."""
    meta_path = out_path.with_name(out_path.name + ".meta.json")
    want = {"target": target_digest(target.path), "sampling": dataclasses.asdict(sampling),
            "seed": seed, **settings}  # fmt: skip
    want = json.loads(json.dumps(want))
    if meta_path.exists():
        try:
            have = json.loads(meta_path.read_text())
        except ValueError as e:
            raise Eagle3Error(f"{meta_path} is not valid JSON: {e}; write to a new path") from e
        diff = differing_keys(have, want)
        if diff:
            raise Eagle3Error(
                f"{out_path} holds answers made with other settings (differs in "
                f"{', '.join(diff)}): resume with the same target and flags, or write to a new "
                "path"
            )
        return
    if out_path.exists() and out_path.stat().st_size > 0:
        raise Eagle3Error(
            f"{out_path} already exists and was not written by this command (no "
            f"{meta_path.name} beside it): write to a new path (nothing there was changed)"
        )
    write_text_atomic(meta_path, json.dumps(want, indent=1) + "\n")


def append(f, records: list[dict]) -> None:
    """Appends records as JSON lines, flushed to disk before the next batch (resumable)."""
    f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    f.flush()
    os.fsync(f.fileno())


def share_out(out_path: Path, target, sampling, seed: int, settings: dict, run) -> RegenStats:
    """Claims out_path and runs `run(done ids, (processes, index))` on this process's share of
    the work (`distributed.share`): the whole of it with one process; with several, each
    answers its units into its shard and process 0 merges them. `run` returns this process's
    stats and the plan's record order; the stats returned are the run's, summed over processes."""
    count, me = distributed.share()
    # process 0 holds out_path's own lock, so a one-process run on the same file is refused too
    lock = out_path if me == 0 else out_path.with_name(f"{out_path.name}.process{me}")
    first = distributed.primary_first("regenerate: claim") if count > 1 else None
    with exclusive(lock):
        with first or contextlib.nullcontext():
            # process 0 first: it writes the settings, folds a killed run's shards and cuts a
            # torn last line; then every process reads the same answered ids, so all plan alike
            claim(out_path, target, sampling, seed, settings)
            if me == 0:
                fold_shards(out_path)
            done = prepare_resume(out_path)
        try:
            stats, order = run(done, (count, me))
        except BaseException as e:
            if count > 1:  # the others finish their shares, then stop naming this process
                distributed.all_gather("regenerate: answered", distributed.failure(e), wait=False)
            raise
        if count == 1:
            return stats
        parts = distributed.check_gathered(
            distributed.all_gather("regenerate: answered", list(stats))
        )
        with distributed.primary_first("regenerate: merge"):
            if me == 0:
                merge_shards(out_path, count, order)
    return RegenStats(*(sum(p[i] for p in parts) for i in range(len(RegenStats._fields))))
