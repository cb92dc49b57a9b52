"""Prompts: chat templating and prompt files (plain lines, FastChat / Spec-Bench question.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from eagle3_jax.errors import Eagle3Error


class Prompt(NamedTuple):
    id: str
    text: str


def encode_chat(tokenizer, messages: list[dict[str, str]], chat_template: bool = True) -> list[int]:
    """Token ids of a conversation ready for the assistant's turn (the target's own chat template)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    text = "\n".join(m["content"] for m in messages)
    return [int(i) for i in tokenizer(text)["input_ids"]]


def read_prompt_file(path: str | Path) -> list[Prompt]:
    """One prompt per line, or JSONL records: FastChat `turns` (first turn), `prompt`, `question`."""
    path = Path(path)
    try:
        # "\n" only: str.splitlines would also cut at U+2028, raw inside JSON strings
        lines = path.read_text(encoding="utf-8").split("\n")
    except OSError as e:
        raise Eagle3Error(f"cannot read prompt file {path}: {e}") from e
    except UnicodeDecodeError as e:
        raise Eagle3Error(
            f"prompt file {path} is not UTF-8 text (byte {e.start}): save it as UTF-8"
        ) from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise Eagle3Error(f"{path}:{n} is not valid JSON: {e}") from e
            if not isinstance(rec, dict):
                raise Eagle3Error(f"{path}:{n} is JSON but not an object")
            turns = rec.get("turns")
            if turns is not None and not (isinstance(turns, list) and turns):
                raise Eagle3Error(f"{path}:{n}: `turns` must be a non-empty list of strings")
            text = (turns or [None])[0] or rec.get("prompt") or rec.get("question")
            if not text:
                raise Eagle3Error(f"{path}:{n} has no `turns`, `prompt` or `question` field")
            if not isinstance(text, str):
                raise Eagle3Error(
                    f"{path}:{n}: the prompt is a {type(text).__name__}, not a string"
                )
            pid = rec.get("question_id", rec.get("id", n))
            prompts.append(Prompt(str(pid), text))
        else:
            prompts.append(Prompt(str(n), line))
    if not prompts:
        raise Eagle3Error(f"prompt file {path} holds no prompts")
    return prompts
