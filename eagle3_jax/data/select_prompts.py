"""Choosing new training prompts: first user turns not yet answered, not repeated, not held out.

  python -m eagle3_jax select-prompts SHAREGPT.json [MORE.json ...] --out prompts.jsonl.gz \
      --exclude data/smollm2_135m_regenerated.jsonl.gz,data/smollm2_135m_regenerated_more.jsonl.gz

A prompt is kept when its conversation id is not in an --exclude file, its text (case and runs of
whitespace folded) is not the prompt of an --exclude record or of an earlier kept prompt, it is not
an evaluation question (any turn of Spec-Bench, MT-bench or the GSM8K test set, exactly or as a
substring of the prompt), and it fits --max-prompt-tokens under the target's chat template. The
output is ShareGPT JSONL (one human turn per record), the input of `eagle3_jax.data.regenerate`.

With --conversations the whole conversations are written instead (every turn, the original
answers; role/content JSONL), selected the same way by their first user turn, with every user
turn checked against the evaluation sets and no --exclude by id (answered prompts still count as
repeated text only when --exclude is given): training text written by another model, whose labels
the training step takes from the target itself (EAGLE-1's fixed-dataset setting).
"""

from __future__ import annotations

import re
from collections import Counter

from eagle3_jax.evaluation.questions import load_questions


def fold(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def held_out_texts(benches: tuple[str, ...] = ("spec_bench", "mt_bench", "gsm8k")) -> set[str]:

    return {fold(t) for b in benches for q in load_questions(b) for t in q.turns}


def held_out_matcher(held_out: set[str]):
    """folded text -> whether it is an evaluation question: equal, or, for held-out texts of 40+
    characters, inside it (a pasted question with an instruction around it)."""
    long_held = [h for h in held_out if len(h) >= 40]

    def is_held(folded: str) -> bool:
        return folded in held_out or any(h in folded for h in long_held)

    return is_held


def clip_turns(messages: list[dict], max_chars: int) -> list[dict]:
    """The turns up to the one that would pass `max_chars` in all (the first two always kept)."""
    if not max_chars:
        return list(messages)
    out, total = [], 0
    for m in messages:
        if len(out) >= 2 and total + len(m["content"]) > max_chars:
            break
        out.append(m)
        total += len(m["content"])
    return out


def select(
    prompts: list[tuple[str, str]],
    exclude: list[tuple[str, str]],
    held_out: set[str],
    n_tokens=None,
    max_prompt_tokens: int = 256,
) -> tuple[list[tuple[str, str]], Counter]:
    """(kept prompts, counts of the reasons others were dropped)."""
    ids = {pid for pid, _ in exclude}
    seen = {fold(t) for _, t in exclude}
    is_held = held_out_matcher(held_out)
    kept, why = [], Counter()
    for pid, text in prompts:
        f = fold(text)
        if pid in ids:
            why["already answered"] += 1
        elif f in seen:
            why["repeated text"] += 1
        elif is_held(f):
            why["evaluation question"] += 1
        elif n_tokens is not None and n_tokens(text) > max_prompt_tokens:
            why["too long"] += 1
        else:
            kept.append((pid, text))
            seen.add(f)
            ids.add(pid)
    return kept, why
