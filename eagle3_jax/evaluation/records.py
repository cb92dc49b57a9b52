"""An evaluation run's records on disk: records.jsonl (one line per finished question, method and
seed, appended as each finishes; a torn last line is dropped when it is read), the shards the
processes of a multi-process run write and process 0 merges, and results.json, or the same
gzipped (how the runs under benchmarks/results are committed). Read by the harness when it
resumes, by validation (replayed answers) and by the benchmarks; depends on nothing else in the
package."""

from __future__ import annotations

import gzip
import heapq
import json
from pathlib import Path

from eagle3_jax.errors import Eagle3Error

TIMING_KEYS = ("wall_time_s", "tokens_per_s", "batch_wall_time_s", "replay_time_s")


def read_results(path: str | Path) -> dict:
    """An evaluation run's results.json, or the same gzipped (results.json.gz: how the runs under
    benchmarks/results are committed, a tenth of the size)."""
    path = Path(path)
    if not path.is_file():
        raise Eagle3Error(f"evaluation results {path} do not exist")
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            res = json.load(f)
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as e:  # BadGzipFile is an OSError
        raise Eagle3Error(f"cannot read evaluation results {path}: {e}") from e
    if not isinstance(res, dict) or "records" not in res or "config" not in res:
        raise Eagle3Error(f"{path} is not an evaluation results.json (no config and records)")
    return res


def read_jsonl(path: str | Path) -> list[dict]:
    """A JSONL file's complete records, read only: [] when there is none, a line cut short (a
    file being written, or an interrupted writer's) left out. For logs such as metrics.jsonl and
    validation.jsonl (or the same gzipped: how large logs are committed); a harness run's
    records are `load_records`'."""
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if path.name.endswith(".gz") else raw).decode("utf-8")
    out = []
    for line in text.split("\n"):  # not splitlines: see below
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def load_records(path: Path) -> list[dict]:
    """Finished records; a line cut short by an interruption is dropped (and the file repaired)."""
    if not path.exists():
        return []
    # not splitlines: U+2028 and other separators may sit raw inside JSON strings
    lines = [x for x in path.read_text(encoding="utf-8").split("\n") if x]
    good, seen = [], set()
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or record_key(rec) in seen:
            continue
        seen.add(record_key(rec))
        good.append(rec)
    if len(good) != len(lines):
        path.write_text("".join(json.dumps(r) + "\n" for r in good), encoding="utf-8")
    return good


def record_key(rec: dict) -> tuple[str, str, int]:
    return str(rec["question_id"]), rec["method"], int(rec["seed"])


def shard_path(out: Path, index: int, count: int) -> Path:
    """Where process `index` of `count` writes its records before process 0 merges them."""
    return out / f"records.part{index}of{count}.jsonl"


def _complete_lines(path: Path) -> list[bytes]:
    """The complete lines of a file (a write cut short by a kill is dropped), split at b"\\n"
    only (U+2028 and friends sit raw inside JSON strings)."""
    data = path.read_bytes()
    return [line + b"\n" for line in data[: data.rfind(b"\n") + 1].split(b"\n")[:-1]]


def fold_shards(out: Path) -> None:
    """Appends the records a killed multi-process run left in its shards to records.jsonl (a
    repeated record is dropped by `load_records`), then removes the shards."""
    shards = sorted(out.glob("records.part*of*.jsonl"))
    if not shards:
        return
    rec_path = out / "records.jsonl"
    if rec_path.exists():
        load_records(rec_path)  # a torn last line goes before anything is appended
    with rec_path.open("ab") as f:
        for shard in shards:
            f.write(b"".join(_complete_lines(shard)))
    load_records(rec_path)
    for shard in shards:
        shard.unlink()


def merge_shards(out: Path, count: int, order: dict) -> None:
    """Process 0: appends the processes' records to records.jsonl in the one-process order
    (`order`: record key -> its place in the plan; each shard is in that order already), then
    removes the shards."""
    shards = [shard_path(out, i, count) for i in range(count)]
    streams = [
        ((order[record_key(json.loads(line))], line) for line in _complete_lines(p)) for p in shards
    ]
    with (out / "records.jsonl").open("ab") as f:
        for _, line in heapq.merge(*streams, key=lambda x: x[0]):
            f.write(line)
    for p in shards:
        p.unlink()
