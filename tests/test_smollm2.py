"""The real embedded default: SmolLM2-135M-Instruct from the GGUF, against transformers' own GGUF load."""

import numpy as np
import pytest
import torch

from eagle3_jax.checkpoints import default_gguf_path, load_target
from eagle3_jax.decoding import plain
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.prompts import encode_chat

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
]


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM

    target = load_target(None)
    g = default_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32)
    return target, ref.eval()


def test_greedy_is_token_identical_to_transformers(smollm2):
    target, ref = smollm2
    ids = [encode_chat(target.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    ours = plain.generate(target.params, target.cfg, ids, 48, pad_id=2)
    for p, got in zip(ids, ours.output_ids):
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([p]), max_new_tokens=48, do_sample=False, pad_token_id=2
            )
        assert got == out[0, len(p) :].tolist()


def test_config_and_tokenizer_of_the_default(smollm2):
    target, _ = smollm2
    cfg = target.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.rope.theta == 100000.0 and cfg.eos_token_ids == (2,)
    assert cfg.default_aux_layer_ids() == (2, 15, 27)
    ids = encode_chat(target.tokenizer, [{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids[-4:] == target.tokenizer("<|im_start|>assistant\n")["input_ids"]
    assert np.isfinite(np.asarray(target.params["embed"][:10])).all()


@pytest.mark.parametrize("draft_vocab", ["auto", "full"])
def test_the_shipped_head_speculates_exactly_and_accepts(smollm2, draft_vocab):
    """The head make demo uses, on the real target, as it loads on this backend (auto: cut to
    its vocab_order.json's cpu_size on a CPU) and whole: the same tokens as plain decoding, and
    more than one token per target forward (a random head of this shape gives tau ~1.0)."""
    import jax

    from eagle3_jax.checkpoints.heads import load_head
    from eagle3_jax.decoding.generate import DecodeOptions, generate_ids
    from eagle3_jax.heads import default_head

    target, _ = smollm2
    head = load_head(str(default_head()), target, None, draft_vocab)
    cut = draft_vocab == "auto" and jax.default_backend() == "cpu"
    assert head.cfg.draft_vocab_size == (8192 if cut else 16384)
    ids = [encode_chat(target.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    want = plain.generate(target.params, target.cfg, ids, 48, pad_id=2).output_ids
    tree = TreeConfig(top_k=1, depth=3, total_tokens=4)
    # summed per row as metrics.tau_of counts them: the prefill's token and pass left out
    new = rounds = 0
    for p, ref in zip(ids, want):
        got = generate_ids(target, head, [p], DecodeOptions("eagle3", 48, tree, pad_id=2))
        assert got.output_ids[0] == ref
        new, rounds = new + len(ref) - 1, rounds + got.target_forwards[0] - 1
    assert new / rounds > 1.1, new / rounds


def test_the_vocab_study_grid_reads_the_default_target_s_vocabulary():
    """configs/vocab_study_smollm2.py on the converted default: the target's vocabulary comes from
    its own config (49,152, not a tokenizer's or a head's), so the full-vocabulary cells are the
    whole vocabulary, the reduced ones EAGLE-3, and FR-Spec/VocabTrim are cut at their sizes. (A
    study run once read the size elsewhere and called every full cell 'reduced'.)"""
    import sys
    from pathlib import Path

    from eagle3_jax.ablation.config import load_ablation
    from eagle3_jax.checkpoints import load_target_config, resolve_target
    from eagle3_jax.evaluation import study

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    import vocab_study

    grid = load_ablation(str(root / "configs/vocab_study_smollm2.py"))
    vocab = load_target_config(resolve_target(grid.base.corpus.target or None)).vocab_size
    assert vocab == 49152
    heads = {c.name: study.head_of_cell(c.name, c.overrides, vocab) for c in grid.cells}
    assert {n: (h.family, h.vocab) for n, h in heads.items()} == {
        "eagle3_vd8192": ("eagle3", 8192),
        "eagle3_vd16384": ("eagle3", 16384),
        "target_lm_head": ("target_lm_head", None),
        "specvocab_noaux": ("specvocab", None),
        "specvocab": ("specvocab", None),
        "full_vocab": ("full", None),
    }
    args, _ = vocab_study.parse_args([])
    sizes, reference = vocab_study.from_heads(args, list(heads.values()))
    assert (sizes, reference) == ([8192, 16384], "eagle3_vd8192")
    cut = {n: list(vocab_study.group_heads(h, sizes)) for n, h in heads.items()}
    assert cut["target_lm_head"] == [("frspec_8192", "frspec", 8192),
                                     ("frspec_16384", "frspec", 16384)]  # fmt: skip
    assert [n for n, _, _ in cut["full_vocab"]] == ["vocabtrim_8192", "vocabtrim_16384"]
    assert not cut["eagle3_vd8192"] and not cut["specvocab"]
