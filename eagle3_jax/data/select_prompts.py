"""Choosing new training prompts: first user turns not yet answered, not repeated, not held out.

  python -m eagle3_jax.data.select_prompts SHAREGPT.json [MORE.json ...] --out prompts.jsonl.gz \
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

import argparse
import gzip
import json
import re
import sys
from collections import Counter
from pathlib import Path

from eagle3_jax.data.conversations import first_user_turns, read_conversations, unique_ids
from eagle3_jax.errors import Eagle3Error


def fold(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def held_out_texts(benches: tuple[str, ...] = ("spec_bench", "mt_bench", "gsm8k")) -> set[str]:
    from eagle3_jax.evaluation.questions import load_questions

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("files", nargs="+", help="ShareGPT / role-content files, in order")
    p.add_argument("--out", required=True, help="ShareGPT JSONL (.gz to compress)")
    p.add_argument("--exclude", default="", help="comma list of answered files to skip")
    p.add_argument("--target", default=None, help="whose chat template counts the tokens")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--conversations", action="store_true", help="write whole conversations")
    p.add_argument(
        "--max-chars",
        type=int,
        default=0,
        help="--conversations: end each before the turn that would pass this many characters "
        "(the first two turns always kept; 0 = whole); a 512-token window reads ~2,000",
    )
    args = p.parse_args(argv)
    try:
        from eagle3_jax.checkpoints import load_tokenizer, resolve_target
        from eagle3_jax.prompts import encode_chat

        tok = load_tokenizer(resolve_target(args.target))
        convs = []
        for f in args.files:
            convs += read_conversations(f)[0]
        convs = unique_ids(convs)  # an id repeated across files names one conversation each
        prompts = first_user_turns(convs)
        exclude = first_user_turns(read_conversations(args.exclude)[0]) if args.exclude else []
        # a cheap bound first: no prompt reaches 16 characters per token, so longer ones are
        # dropped untokenised (the tokenizer is slow on pasted documents)
        limit = args.max_prompt_tokens

        def n_tokens(text: str) -> int:
            if len(text) > 16 * limit:
                return limit + 1
            return len(encode_chat(tok, [{"role": "user", "content": text}]))

        held = held_out_texts()
        if args.conversations:
            is_held = held_out_matcher(held)
            bad = {
                c.id
                for c in convs
                for m in c.messages
                if m["role"] == "user" and is_held(fold(m["content"]))
            }
            n_bad = sum(pid in bad for pid, _ in prompts)
            prompts = [(pid, t) for pid, t in prompts if pid not in bad]
            kept, why = select(prompts, [("", t) for _, t in exclude], set(), n_tokens, limit)
            why["evaluation question"] += n_bad
        else:
            kept, why = select(prompts, exclude, held, n_tokens, limit)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    by_id = {c.id: c for c in convs}
    lines = []
    for pid, text in kept:
        if args.conversations:
            msgs = clip_turns(by_id[pid].messages, args.max_chars)
            if not any(m["role"] == "assistant" for m in msgs):
                why["no answer"] += 1
                continue
            rec = {"id": pid, "messages": msgs}
        else:
            rec = {"id": pid, "conversations": [{"from": "human", "value": text}]}
        lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
    data = "".join(lines).encode("utf-8")
    # .gz without a time stamp or file name in its header: the same selection, the same bytes
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(gzip.compress(data, mtime=0) if out.suffix == ".gz" else data)
    print(json.dumps({"kept": len(kept) - why["no answer"], "read": len(prompts), **why}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
