"""Token ids and the loss mask of one conversation, found from the target's own chat template.

The mask covers exactly what the target produces in an assistant turn: the answer's tokens and the
closing end-of-turn token (`<|im_end|>` for ChatML). Headers (`<|im_start|>assistant\\n`), system
prompts the template inserts, user turns and the separator after the end-of-turn token stay 0:
supervising template boilerplate instead of answers is a known failure (SpecForge#870).

Spans are located in characters of the template's rendering, then mapped to tokens with the fast
tokenizer's offset mapping; no token offsets are hard-coded, so any template works:
  1. prefix renderings: the assistant turn i starts where `render(messages[:i], gen_prompt=True)`
     ends and stops where `render(messages[:i+1])` ends, when both are prefixes of the full text;
  2. otherwise (templates that rewrite history, e.g. drop earlier reasoning) every message's content
     is found in order in the full text.
Inside a turn, the answer is where its content string occurs (or its stripped form, for templates
that trim), and the end-of-turn token is the first special token after it within the turn.
"""

from __future__ import annotations

import numpy as np

from eagle3_jax.errors import Eagle3Error

Message = dict[str, str]


class UnrenderableConversation(Eagle3Error):
    """The chat template refused this conversation (e.g. roles do not alternate): skip it."""


def render(tokenizer, messages: list[Message], add_generation_prompt: bool) -> str:
    """The chat template's text for `messages` (the tokenizer's own template, nothing added)."""
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja's raise_exception, TemplateError, bad message shapes
        raise UnrenderableConversation(f"chat template failed on this conversation: {e}") from e


def template_ids(tokenizer, messages: list[Message]) -> list[int]:
    """Token ids exactly as apply_chat_template(tokenize=True) gives them (no generation prompt)."""
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    except Exception as e:
        raise UnrenderableConversation(f"chat template failed on this conversation: {e}") from e
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def special_ids(tokenizer) -> frozenset[int]:
    """Ids of all special tokens, including added ones (`<|eot_id|>`, `<|im_end|>`, ...)."""
    ids = set(int(i) for i in getattr(tokenizer, "all_special_ids", []))
    for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return frozenset(ids)


def prefix_turn_bounds(
    tokenizer, messages: list[Message], text: str
) -> list[tuple[int, int]] | None:
    """[lo, hi) character range of each assistant turn, from prefix renderings; None if unstable.

    lo is where the generation prompt ends (the model starts answering there); hi is where the
    rendering of the conversation through that turn ends (separator after end-of-turn included).
    """
    bounds = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            before = render(tokenizer, messages[:i], add_generation_prompt=True)
            through = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        except UnrenderableConversation:  # e.g. templates that reject an empty or user-less prefix
            return None
        stable = text.startswith(before) and text.startswith(through)
        if not stable or len(before) > len(through):
            return None
        bounds.append((len(before), len(through)))
    return bounds


def ordered_turn_bounds(messages: list[Message], text: str) -> list[tuple[int, int]]:
    """Fallback: [lo, hi) of each assistant turn by finding every message's content in order.

    hi is where the next message's content starts (or the end), so the end-of-turn search cannot run
    into the next turn. A turn whose content cannot be found gets an empty range (not supervised).
    """
    cursor = 0
    found: list[tuple[int, int] | None] = []
    for m in messages:
        span = find_content(text, m["content"], cursor, len(text))
        found.append(span)
        if span is not None:
            cursor = span[1]
    bounds = []
    for i, (m, span) in enumerate(zip(messages, found)):
        if m["role"] != "assistant":
            continue
        if span is None:
            bounds.append((0, 0))
            continue
        nxt = next((s[0] for s in found[i + 1 :] if s is not None), len(text))
        bounds.append((span[0], nxt))
    return bounds


def find_content(text: str, content: str, lo: int, hi: int) -> tuple[int, int] | None:
    """Character span of `content` in text[lo:hi] (as given, else stripped); None if absent."""
    for c in (content, content.strip()):
        if c:
            i = text.find(c, lo, hi)
            if i >= 0:
                return i, i + len(c)
    return None


def turn_token_mask(
    offsets_T2: np.ndarray,
    ids_T: np.ndarray,
    specials: frozenset[int],
    content: tuple[int, int],
    hi: int,
) -> np.ndarray:
    """[T] bool: tokens overlapping the content span, plus the first special token after it.

    Args:
      offsets_T2: [T, 2] character (start, end) of each token in the rendered text.
      ids_T: [T] token ids.
      content: (start, end) characters of the answer.
      hi: the turn's end; the end-of-turn token must start before it.
    """
    cs, ce = content
    starts, ends = offsets_T2[:, 0], offsets_T2[:, 1]
    mask = (ends > cs) & (starts < ce)
    is_special = np.isin(ids_T, np.fromiter(specials, np.int64, len(specials)))
    after = np.flatnonzero(is_special & (starts >= ce) & (starts < hi))
    if after.size:
        mask[after[0]] = True
    return mask


def tokenize_conversation(
    tokenizer, messages: list[Message], max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Chat-templated token ids of a conversation and its assistant-only loss mask.

    Args:
      tokenizer: a fast (transformers) tokenizer with a chat template.
      messages: [{"role": "system"|"user"|"assistant", "content": str}].
      max_len: longer conversations are truncated to their first max_len tokens.
    Returns:
      input_ids int32 [T] and loss_mask int8 [T] (1 on answer tokens and their end-of-turn token),
      T <= max_len. A conversation without assistant text has an all-zero mask.
    Raises:
      UnrenderableConversation if the template rejects the conversation (skip that record);
      Eagle3Error if the tokenizer cannot be used at all (no template, not a fast tokenizer).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise Eagle3Error(
            "the target's tokenizer has no chat template: training masks come from "
            "it; use an instruct/chat target or set tokenizer.chat_template"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise Eagle3Error(
            "loss masks need a fast tokenizer (offset mapping): add "
            "tokenizer.json to the target directory"
        )
    text = render(tokenizer, messages, add_generation_prompt=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids_T = np.asarray(enc["input_ids"], np.int64)
    if ids_T.tolist() != template_ids(tokenizer, messages):
        # Offsets would then describe other tokens than the ones the target sees at inference.
        raise Eagle3Error(
            "tokenizing the chat template's text gives other ids than "
            "apply_chat_template(tokenize=True): this tokenizer is not supported for "
            "training masks"
        )
    offsets_T2 = np.asarray(enc["offset_mapping"], np.int64).reshape(-1, 2)
    bounds = prefix_turn_bounds(tokenizer, messages, text)
    if bounds is None:
        bounds = ordered_turn_bounds(messages, text)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    specials = special_ids(tokenizer)
    mask_T = np.zeros(ids_T.shape, bool)
    for content, (lo, hi) in zip(answers, bounds):
        span = find_content(text, content, lo, hi)
        if span is not None:
            mask_T |= turn_token_mask(offsets_T2, ids_T, specials, span, hi)
    return ids_T[:max_len].astype(np.int32), mask_T[:max_len].astype(np.int8)
