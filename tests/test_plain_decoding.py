"""Plain decoding: token-identical to transformers' generate; batching; sampling; compile counts."""

import numpy as np
import pytest
from conftest import FAMILIES
from helpers import hf_greedy

from eagle3_jax.checkpoints.hf import load_hf
from eagle3_jax.decoding import plain
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.errors import Eagle3Error


def _prompts(v, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, v, size=n))) for n in lengths]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_generate(family, hf_checkpoint):
    model, path = hf_checkpoint(family)
    params, cfg = load_hf(path)
    prompts = _prompts(cfg.vocab_size, [5, 11, 8])
    res = plain.generate(params, cfg, prompts, 20, eos_ids=())
    for p, got in zip(prompts, res.output_ids):
        assert got == hf_greedy(model, p, 20)
    assert res.finish_reasons == ["max_tokens"] * 3
    assert res.target_forwards == 20


def test_batch_rows_stop_independently_and_match_batch_one(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    params, cfg = load_hf(path)
    prompts = _prompts(cfg.vocab_size, [4, 9, 13, 6], seed=3)
    single = [plain.generate(params, cfg, [p], 16, eos_ids=()).output_ids[0] for p in prompts]
    eos = single[1][
        5
    ]  # row 1 must stop at its 6th token; the others keep going or stop on their own
    batch = plain.generate(params, cfg, prompts, 16, eos_ids=(eos,))
    for got, ref in zip(batch.output_ids, single):
        expect = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert got == expect
    assert batch.finish_reasons[1] == "eos"


def test_sampling_is_seeded_and_respects_top_k(hf_checkpoint):
    _, path = hf_checkpoint("qwen3")
    params, cfg = load_hf(path)
    prompts = _prompts(cfg.vocab_size, [7])
    s = Sampling(temperature=1.0, top_k=1)
    greedy = plain.generate(params, cfg, prompts, 12, eos_ids=()).output_ids
    assert plain.generate(params, cfg, prompts, 12, s, seed=5, eos_ids=()).output_ids == greedy
    hot = Sampling(temperature=1.5)
    a = plain.generate(params, cfg, prompts, 12, hot, seed=1, eos_ids=()).output_ids
    b = plain.generate(params, cfg, prompts, 12, hot, seed=1, eos_ids=()).output_ids
    c = plain.generate(params, cfg, prompts, 12, hot, seed=2, eos_ids=()).output_ids
    assert a == b and a != c


def test_one_compilation_per_shape_bucket(hf_checkpoint):
    _, path = hf_checkpoint("mistral")
    params, cfg = load_hf(path)
    before = plain.decode_loop._cache_size(), plain.prefill._cache_size()
    for n in (3, 10, 17, 30):  # all in the same prompt bucket
        plain.generate(params, cfg, _prompts(cfg.vocab_size, [n], seed=n), 9, eos_ids=())
    after = plain.decode_loop._cache_size(), plain.prefill._cache_size()
    assert after[0] - before[0] <= 1 and after[1] - before[1] <= 1


def test_bad_requests_are_refused(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    params, cfg = load_hf(path)
    with pytest.raises(Eagle3Error, match="empty prompt"):
        plain.generate(params, cfg, [[]], 4)
    with pytest.raises(Eagle3Error, match="exceeds the context"):
        plain.generate(params, cfg, [[5] * 250], 10)
