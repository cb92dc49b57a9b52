"""The server's incremental text (serving/detokenize.py) equals decoding every id so far, after each
push, for the three kinds of decoder our targets have: byte-level BPE (Llama 3, Qwen, SmolLM2),
SentencePiece-style BPE with byte fallback (Llama 2, Mistral) and a word-level one that cleans
up spaces before punctuation (the tests' tiny tokenizer). The ids are random, so characters split
over tokens, invalid bytes, special tokens and clean-ups across a push's boundary all occur."""

from __future__ import annotations

import random

import pytest
from conftest import write_tiny_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from eagle3_jax.checkpoints import load_tokenizer
from eagle3_jax.serving.detokenize import IncrementalText

CORPUS = [
    "Le café coûte 3 € . Tokyo 東京 は 大きい 🚀🚀 , isn't it ? naïve — ok .",
    "the quick brown fox jumps over the lazy dog ' s tail ! ( really ) 12.5 %",
] * 40


def _byte_level():
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tk.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>")


def _sentencepiece():
    tk = Tokenizer(models.BPE(byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    specials = ["</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>")


def _word_level(tmp_path):
    write_tiny_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    # words and punctuation the decoder's clean-up joins (" ." -> ".", " ' s" -> "'s")
    tok.add_tokens([".", ",", "'", "s", "?", "n't"])
    return tok


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece", "word_level"])
def test_incremental_text_equals_decoding_all_ids(kind, tmp_path):
    tok = {"byte_level": _byte_level, "sentencepiece": _sentencepiece,
           "word_level": lambda: _word_level(tmp_path)}[kind]()  # fmt: skip
    rng = random.Random(0)
    if kind == "word_level":  # its words, and the punctuation its clean-up joins
        words = [f"w{i}" for i in range(3, 97)] + [".", ",", "'", "s", "?", "n't"] * 8
        natural = tok(" ".join(rng.choice(words) for _ in range(300)))["input_ids"]
    else:
        natural = tok(" ".join(CORPUS[:6]))["input_ids"]
    vocab = len(tok)
    costs = []  # ids decoded by each push of real text
    for trial in range(60):
        # real text (characters split over tokens) or any ids at all (invalid bytes, specials)
        ids = (natural[rng.randrange(len(natural)) :] if trial % 2 else
               [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))])  # fmt: skip
        text = _Counting(tok)
        at = 0
        while at < len(ids):
            step = rng.choice([1, 1, 2, 3, 5])
            before = text.decoded
            got = text.push(ids[at : at + step])
            at += step
            assert got == tok.decode(ids[:at], skip_special_tokens=True), (kind, trial, at)
            if trial % 2:
                costs.append(text.decoded - before)
    # a push decodes a few ids, not all so far (the texts run to hundreds of ids)
    big = sum(c > 40 for c in costs) / len(costs)
    assert big < 0.05


class _Counting(IncrementalText):
    decoded = 0

    def _decode(self, ids):
        self.decoded += len(ids)
        return super()._decode(ids)


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece", "word_level"])
def test_a_completion_decoded_after_its_prompt_is_what_it_adds(kind, tmp_path):
    """With the prompt as context, a completion's text is what it adds to the prompt's text
    (decoding prompt + completion, less the prompt's): the space a SentencePiece or WordPiece
    decoder strips from a text's first word stays on the completion's."""
    tok = {"byte_level": _byte_level, "sentencepiece": _sentencepiece,
           "word_level": lambda: _word_level(tmp_path)}[kind]()  # fmt: skip
    text = "the quick brown fox jumps over the lazy dog" if kind != "word_level" else (
        "w5 w9 w33 w41 w7 w12 w60 w3 w77 w20")  # fmt: skip
    ids = tok(text)["input_ids"]
    checked = 0
    for cut in range(1, len(ids)):
        prompt, head = ids[:cut], tok.decode(ids[:cut], skip_special_tokens=True)
        whole = tok.decode(ids, skip_special_tokens=True)
        completion = IncrementalText(tok, context=prompt)
        for i in ids[cut:]:
            completion.push([i])
        assert completion.ids == ids[cut:]
        if whole.startswith(head) and not head.endswith("\ufffd"):
            assert completion.text == whole[len(head) :], (kind, cut)
            checked += 1
    assert checked >= len(ids) // 2
    if kind != "byte_level":  # alone, the first word loses its space
        alone = IncrementalText(tok)
        alone.push(ids[3:])
        assert not alone.text.startswith(" ")
        completion = IncrementalText(tok, context=ids[:3])
        assert completion.push(ids[3:]).startswith(" ")


def test_without_a_tokenizer_the_text_is_empty():
    text = IncrementalText(None)
    assert text.push([5, 6]) == "" and text.ids == [5, 6]
