"""Benchmark questions: Spec-Bench, MT-bench, GSM8K (shipped) or any FastChat question.jsonl."""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Iterable
from pathlib import Path

from eagle3_jax.errors import Eagle3Error

DATA_DIR = Path(__file__).resolve().parent / "data"
BENCHES = {
    "spec_bench": DATA_DIR / "spec_bench" / "question.jsonl.gz",
    "mt_bench": DATA_DIR / "mt_bench" / "question.jsonl",
    "gsm8k": DATA_DIR / "gsm8k" / "test.jsonl.gz",
}
MT_BENCH_CATEGORIES = frozenset(
    ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
)
# Spec-Bench's task order (the paper's columns)
SPEC_BENCH_TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclasses.dataclass(frozen=True)
class Question:
    """One benchmark question: an id, its task (a report column) and its user turns."""

    id: str
    task: str
    turns: tuple[str, ...]
    category: str = ""  # FastChat category (MT-bench's 8 subcategories are one task)


def task_of(category: str | None) -> str:
    """The report task for a FastChat category: MT-bench's 8 subcategories are one task."""
    if not category:
        return "all"
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


# the fields a question record may hold, and the JSON types each takes (a wrong one is refused,
# naming the file, the record and the field, never turned into a question by str())
FIELD_TYPES = {
    "turns": (list,),
    "question": (str,),  # GSM8K: one turn
    "prompt": (str,),  # one turn, as decode.py's prompt files write it
    "category": (str,),
    "question_id": (str, int),
    "id": (str, int),
}
_JSON_NAMES = {str: "a string", int: "an integer", list: "a list", dict: "an object",
               bool: "true/false", float: "a number"}  # fmt: skip


def _json_type(value) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


def check_fields(rec: dict, where: str) -> None:
    """Each known field of a record has its type (None counts as absent); `where` names the file,
    the line and the record."""
    for name, types in FIELD_TYPES.items():
        value = rec.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            want = " or ".join(_JSON_NAMES[t] for t in types)
            raise Eagle3Error(f"{where}: field `{name}` is {_json_type(value)}; give {want}")
    for k, turn in enumerate(rec.get("turns") or []):
        if not isinstance(turn, str):
            raise Eagle3Error(
                f"{where}: field `turns` item {k} is {_json_type(turn)}; give a list of strings"
            )


def parse_record(rec: dict, n: int, where: str, default_task: str | None = None) -> Question:
    """A FastChat (`turns`) or GSM8K (`question`) JSON record, or one `prompt`, -> Question.
    `n` is its line, `where` the file (and record) named by a refusal."""
    check_fields(rec, f"{where}:{n}")
    turns = rec.get("turns")
    for single in ("question", "prompt"):
        if turns is None and rec.get(single) is not None:
            turns = [rec[single]]
    if not turns:
        raise Eagle3Error(f"{where}:{n} has no `turns` list of strings (or `question` string)")
    if not all(t.strip() for t in turns):
        raise Eagle3Error(f"{where}:{n} has an empty turn")
    qid = rec.get("question_id", rec.get("id", n))
    task = default_task or task_of(rec.get("category"))
    return Question(str(qid), task, tuple(turns), str(rec.get("category") or task))


def read_questions(path: str | Path, default_task: str | None = None) -> list[Question]:
    """All records of a JSON Lines question file (or the same gzipped, `.gz`: how the larger
    shipped ones travel), in file order."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if path.name.endswith(".gz"):
            raw = gzip.decompress(raw)
        lines = raw.decode("utf-8").split("\n")  # not splitlines: U+2028 in text
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise Eagle3Error(f"cannot read question file {path}: {e}") from e
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise Eagle3Error(f"{path}:{n} is not valid JSON: {e}") from e
        if not isinstance(rec, dict):
            raise Eagle3Error(f"{path}:{n} is not a JSON object")
        check_fields(rec, f"{path}:{n} (record {len(out) + 1})")
        out.append(parse_record(rec, n, str(path), default_task))
    if not out:
        raise Eagle3Error(f"question file {path} holds no questions")
    ids = [q.id for q in out]
    if len(set(ids)) != len(ids):
        raise Eagle3Error(f"question file {path} repeats question ids")
    return out


def limit_per_task(questions: list[Question], n: int | None) -> list[Question]:
    """The first `n` questions of each category (file order kept); all when n is None. A task is
    its own category except MT-bench, whose 8 subcategories each give n (a stratified subset)."""
    if n is None:
        return list(questions)
    if n < 1:
        raise Eagle3Error(f"--questions {n} < 1")
    seen: dict[str, int] = {}
    out = []
    for q in questions:
        group = q.category or q.task
        if seen.get(group, 0) < n:
            seen[group] = seen.get(group, 0) + 1
            out.append(q)
    return out


def load_questions(bench: str, n: int | None = None) -> list[Question]:
    """`spec_bench`, `mt_bench`, `gsm8k` or a FastChat question.jsonl path; first `n` per task."""
    if bench in BENCHES:
        qs = read_questions(BENCHES[bench], default_task="gsm8k" if bench == "gsm8k" else None)
    else:
        if not Path(bench).is_file():
            raise Eagle3Error(
                f"--bench {bench!r} is neither one of {', '.join(BENCHES)} nor a question.jsonl file"
            )
        qs = read_questions(bench)
    return limit_per_task(qs, n)


def task_order(tasks: Iterable[str]) -> list[str]:
    """The distinct tasks (or categories) named: Spec-Bench's in its order first, then the others
    in order of appearance."""
    present = list(dict.fromkeys(tasks))
    known = [t for t in SPEC_BENCH_TASKS if t in present]
    return known + [t for t in present if t not in known]
