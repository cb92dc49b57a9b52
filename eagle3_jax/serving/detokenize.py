"""A request's text as its tokens arrive, without decoding all of them again each time.

Decoding every id so far at each round costs O(n) a round, O(n^2) a request: 0.19 ms for 1,024
SmolLM2 ids, and a server of 16 rows of 2,048-token answers would spend more of each round on
the event loop than a GPU spends on the round. `IncrementalText` keeps the text of the ids up
to an anchor and decodes only a few ids before the anchor and those after it: the new text is
what decoding [anchor - CONTEXT, n) adds to decoding [anchor - CONTEXT, anchor). The context
ids give a tokenizer's decoder what it reads across a boundary (a leading space, the bytes of a
character split over tokens). The anchor moves to the end whenever the text there is whole (no
U+FFFD of a character still incomplete); where the window's decoding does not start with the
context's (a decoder that rewrote across the boundary, such as a clean-up of " ." to "."), the
whole ids are decoded instead, so the text is always `tokenizer.decode(ids,
skip_special_tokens=True)`.
"""

from __future__ import annotations

CONTEXT = 6  # ids decoded before the anchor for the decoder's context


class IncrementalText:
    """The decoded text of ids pushed so far (`text`); `push` returns it. Without a tokenizer
    the text stays empty (a server given token ids alone).

    `context`: ids before the first pushed (a prompt's), decoded with them but not part of the
    text, so a completion's text is what it adds to its prompt's: a SentencePiece or WordPiece
    decoder gives a completion's first word its space, as it would in the whole text (the
    prompt's last CONTEXT ids are kept; none if their text ends inside a character)."""

    def __init__(self, tokenizer, context: list[int] = ()):
        self.tokenizer = tokenizer
        self._ids: list[int] = []  # the context's kept ids, then those pushed
        self._full = ""  # their text
        self._anchor = 0  # _ids[:anchor] decode to self._base
        self._base = ""
        self._context, self._skip = 0, 0  # the context's ids and characters
        if context and tokenizer is not None:
            self.push(list(context)[-CONTEXT:])
            if self._full.endswith("\ufffd"):  # a character the completion would finish
                self.__init__(tokenizer)
            else:
                self._context, self._skip = len(self._ids), len(self._full)

    @property
    def ids(self) -> list[int]:
        return self._ids[self._context :]

    @property
    def text(self) -> str:
        return self._full[self._skip :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int]) -> str:
        self._ids += new_ids
        if self.tokenizer is None or not new_ids:
            return self.text
        ids = self._ids
        start = max(0, self._anchor - CONTEXT)
        before = self._decode(ids[start : self._anchor]) if start < self._anchor else ""
        window = self._decode(ids[start:])
        # (context that decodes to nothing, such as special tokens, gives the decoder none: a
        # SentencePiece decoder would strip the window's first space)
        # (the context may start inside a character the base has whole: its U+FFFD aside)
        if (before and window.startswith(before) and self._base.endswith(before.lstrip("\ufffd"))
                or start == 0 and window.startswith(before)):  # fmt: skip
            self._full = self._base + window[len(before) :]
        else:
            self._full = self._decode(ids)
        if not self._full.endswith("\ufffd"):
            self._anchor, self._base = len(ids), self._full
        return self.text
