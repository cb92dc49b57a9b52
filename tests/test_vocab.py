"""eagle3_jax/vocab: the draft-vocabulary mapping (DraftVocab: d2t/t2d), built from token counts
(ties to the lower id, padded with low ids as SpecForge does), from target ids, or the identity;
its checks. The methods that choose the ids (FR-Spec, VocabTrim, extended heads):
tests/test_vocab_methods.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax import vocab as vocab_lib
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft_output


def test_build_from_counts_top_ids_sorted_with_ties_to_the_lower_id():
    counts = np.array([0, 5, 9, 1, 9, 0, 3, 5, 2, 0])
    voc = vocab_lib.build_from_counts(counts, 4)
    # 2 and 4 (9), then 1 and 7 tie at 5: both fit; 6 (3) does not.
    np.testing.assert_array_equal(vocab_lib.target_ids(voc), [1, 2, 4, 7])
    np.testing.assert_array_equal(voc.d2t, [1, 1, 2, 4])
    np.testing.assert_array_equal(np.flatnonzero(voc.t2d), [1, 2, 4, 7])
    voc3 = vocab_lib.build_from_counts(counts, 3)  # tie at 5 broken toward id 1
    np.testing.assert_array_equal(vocab_lib.target_ids(voc3), [1, 2, 4])
    vocab_lib.check(voc, 10, 4)


def test_build_from_counts_pads_with_low_ids_like_specforge():
    counts = np.zeros(12, np.int64)
    counts[[9, 2, 11]] = [4, 1, 7]
    voc = vocab_lib.build_from_counts(counts, 6)
    # 3 seen ids + the smallest of 0..5 not already used (0, 1, 3).
    np.testing.assert_array_equal(vocab_lib.target_ids(voc), [0, 1, 2, 3, 9, 11])
    vocab_lib.check(voc, 12, 6)
    np.testing.assert_array_equal(
        vocab_lib.target_ids(vocab_lib.build_from_counts(np.zeros(5), 3)), [0, 1, 2]
    )
    with pytest.raises(Eagle3Error, match="between 1 and the target vocab size 5"):
        vocab_lib.build_from_counts(np.ones(5), 6)
    with pytest.raises(Eagle3Error, match="non-negative"):
        vocab_lib.build_from_counts(np.array([1, -1, 2]), 2)


def test_vocab_check_and_identity():
    vocab_lib.check(vocab_lib.identity(7), 7, 7)
    assert vocab_lib.identity(7).is_identity
    with pytest.raises(Eagle3Error, match="outside the target vocab"):
        vocab_lib.check(vocab_lib.DraftVocab(np.array([0, 0, 5]), np.ones(6, bool)), 6, 3)
    with pytest.raises(Eagle3Error, match="duplicates"):
        vocab_lib.from_target_ids([1, 1, 2], 5)
    # The mapping is a pytree: a jitted step can take it as an argument.
    voc = vocab_lib.from_target_ids([1, 4, 6], 8)
    f = jax.jit(draft_output.draft_to_target_ids)
    np.testing.assert_array_equal(f(jnp.array([[0, 2, 1]], jnp.int32), voc), [[1, 6, 4]])
