"""`python -m eagle3_jax select-prompts`: choose new training prompts (not yet answered, not
repeated, not held out).

  python -m eagle3_jax select-prompts SHAREGPT.json [MORE.json ...] --out prompts.jsonl.gz \
      --exclude data/smollm2_135m_regenerated.jsonl.gz,data/smollm2_135m_regenerated_more.jsonl.gz

What it does, and every flag: `--help` and eagle3_jax/data/select_prompts.py.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from eagle3_jax.checkpoints import load_tokenizer, resolve_target
from eagle3_jax.data.conversations import first_user_turns, read_conversations, unique_ids
from eagle3_jax.data.select_prompts import (
    clip_turns,
    fold,
    held_out_matcher,
    held_out_texts,
    select,
)
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.prompts import encode_chat


def parse_args(argv=None) -> argparse.Namespace:
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
    return p.parse_args(argv)


def choose(args: argparse.Namespace):
    """-> (conversations read, their first user turns, the kept (id, text) pairs, the counts of
    why the others were dropped)."""
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
    if not args.conversations:
        return convs, prompts, *select(prompts, exclude, held, n_tokens, limit)
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
    return convs, prompts, kept, why


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        convs, prompts, kept, why = choose(args)
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
