"""Reading chat data: ShareGPT (JSON array or JSONL) and role/content JSONL, into one message shape.

Every record becomes a `Conversation(id, messages)` with messages `[{"role", "content"}]`, roles
"system" | "user" | "assistant". Accepted record shapes (per line of JSONL, or per element of one
JSON array):
  {"id": ..., "conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}]}   (ShareGPT)
  {"id": ..., "messages": [{"role": ..., "content": str}]}                            (role/content)
Records that are not objects, lack both lists, hold an unknown role or a non-string text, or are
empty are skipped and counted; the caller reports the count.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, NamedTuple

from eagle3_jax.errors import Eagle3Error

Message = dict[str, str]

# ShareGPT dumps use several names for the answering model (bing/chatgpt in ShareGPT V3).
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


class Conversation(NamedTuple):
    id: str
    messages: list[Message]


def normalize_message(msg: Any) -> Message | None:
    """{"from","value"} or {"role","content"} -> {"role","content"}; None if malformed."""
    if not isinstance(msg, dict):
        return None
    role = msg.get("from", msg.get("role"))
    content = msg.get("value", msg.get("content"))
    if not isinstance(role, str) or not isinstance(content, str):
        return None
    role = ROLES.get(role.strip().lower())
    return None if role is None else {"role": role, "content": content}


def drop_leading_answers(messages: list[Message]) -> list[Message]:
    """Removes assistant turns that come before the first user turn (system turns are kept).

    ShareGPT V3 holds many conversations cut from the middle, starting with an answer to a question
    that is not there; EAGLE's data script drops that first turn too, since nothing prompted it.
    """
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    return [m for i, m in enumerate(messages) if i >= first_user or m["role"] == "system"]


def parse_record(rec: Any, fallback_id: str) -> Conversation | None:
    """One record -> Conversation, or None when it is malformed or holds no text at all."""
    if not isinstance(rec, dict):
        return None
    raw = rec.get("conversations", rec.get("messages"))
    if not isinstance(raw, list):
        return None
    messages = [normalize_message(m) for m in raw]
    if any(m is None for m in messages):
        return None
    messages = drop_leading_answers(messages)
    if not any(m["content"].strip() for m in messages):
        return None
    rid = rec.get("id", rec.get("question_id"))
    return Conversation(fallback_id if rid is None else str(rid), messages)


def _load_records(path: Path) -> tuple[list[Any], int]:
    """The raw records of a JSON array or JSONL file (gzip-compressed when the name ends in .gz),
    and the number of JSONL lines that failed."""
    try:
        if path.suffix == ".gz":
            text = gzip.decompress(path.read_bytes()).decode("utf-8-sig")
        else:
            text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
        raise Eagle3Error(f"cannot read conversation file {path}: {e}") from e
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except ValueError as e:
            raise Eagle3Error(
                f"conversation file {path} is not valid JSON ({e}): fix or re-export "
                "it as one JSON array or as JSON Lines"
            ) from e
        return records, 0
    records, bad = [], 0
    # JSON Lines end in \n only: str.splitlines would also cut at U+2028 and other separators
    # that JSON leaves raw inside strings (ensure_ascii=False), breaking those records
    for line in text.split("\n"):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:  # e.g. the partial last line of an interrupted writer
            bad += 1
    return records, bad


def unique_ids(convs: list[Conversation]) -> list[Conversation]:
    """Renames repeated ids to `id#2`, `id#3`, ... (skipping names already taken, e.g. by an
    earlier renaming in another file): regeneration resumes by id."""
    taken: set[str] = set()
    out = []
    for c in convs:
        new, n = c.id, 1
        while new in taken:
            n += 1
            new = f"{c.id}#{n}"
        taken.add(new)
        out.append(c if new == c.id else c._replace(id=new))
    return out


def first_of_each_id(convs: list[Conversation]) -> list[Conversation]:
    """Keeps the first conversation of each id: a later file that answers the same prompt again
    (first user turns, after a file of whole conversations that starts with them) adds nothing."""
    seen: set[str] = set()
    out = []
    for c in convs:
        if c.id not in seen:
            seen.add(c.id)
            out.append(c)
    return out


REPEATED = ("rename", "first")


def read_conversations(
    path: str | Path, repeated: str = "rename"
) -> tuple[list[Conversation], int]:
    """Reads a ShareGPT / role-content file; returns (conversations, number of skipped records).

    Several files may be given as one comma-separated string ("a.jsonl.gz,b.jsonl.gz"): their
    records are concatenated in that order. Ids come from the record's `id` (or `question_id`),
    else `<file stem>:<record number>`. An id repeated across files becomes `id#2`, ...
    (`repeated="rename"`: every record kept), or only its first record is kept
    (`repeated="first"`: list the file that supersedes the others first); within one file a
    repeated id is always renamed. Raises Eagle3Error when a file cannot be read or parsed, or
    holds no usable record.
    """
    if repeated not in REPEATED:
        raise Eagle3Error(f"repeated ids {repeated!r}: use {' or '.join(REPEATED)}")
    if isinstance(path, str) and "," in path and not Path(path).exists():
        convs, skipped = [], 0
        for part in (p.strip() for p in path.split(",")):
            if not part:
                raise Eagle3Error(f"empty file name in the data list {path!r}")
            c, s = read_conversations(part)
            convs += c
            skipped += s
        if repeated == "first":
            convs = first_of_each_id(convs)
        return unique_ids(convs), skipped
    path = Path(path)
    records, bad = _load_records(path)
    if not isinstance(records, list):
        raise Eagle3Error(
            f"conversation file {path} holds a JSON {type(records).__name__}, not an "
            "array of records: wrap the records in [...] or write one per line"
        )
    convs = [parse_record(r, f"{path.stem}:{n}") for n, r in enumerate(records)]
    kept = [c for c in convs if c is not None]
    skipped = bad + len(convs) - len(kept)
    if not kept:
        raise Eagle3Error(
            f"conversation file {path} holds no usable conversation ({skipped} "
            "malformed or empty records): expected ShareGPT `conversations` or "
            "`messages` records"
        )
    return unique_ids(kept), skipped


def first_user_turns(convs: list[Conversation]) -> list[tuple[str, str]]:
    """(id, text) of each conversation's first non-empty user turn: the prompts to regenerate."""
    out = []
    for c in convs:
        text = next(
            (m["content"] for m in c.messages if m["role"] == "user" and m["content"].strip()), None
        )
        if text is not None:
            out.append((c.id, text))
    return out
