"""The draft vocabulary: which Vd of the target's V token ids the draft head can propose.

EAGLE-3 stores the mapping as two buffers next to the head's weights (not trainable):
  d2t  int  [Vd]  offsets, target_id = draft_id + d2t[draft_id]
  t2d  bool [V]   True where a target id belongs to the draft vocabulary
The draft ids are the chosen target ids in ascending order, so `target_ids(vocab)` is strictly
increasing and `target_logits[..., target_ids(vocab)]` lines up column by column with the draft
logits (this is what the training loss relies on when it renormalises the target over the subset).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from eagle3_jax.errors import Eagle3Error


@dataclasses.dataclass(frozen=True, eq=False)
class DraftVocab:
    """d2t [Vd] int offsets and t2d [V] bool membership (host numpy or device arrays)."""

    d2t: np.ndarray
    t2d: np.ndarray

    @property
    def draft_size(self) -> int:
        return int(self.d2t.shape[0])

    @property
    def target_size(self) -> int:
        return int(self.t2d.shape[0])

    @property
    def is_identity(self) -> bool:
        """Vd == V and every draft id is its own target id (checkpoints then omit d2t/t2d)."""
        return self.draft_size == self.target_size and not np.any(np.asarray(self.d2t))


# A pytree, so a decode step can take the mapping as a jit argument instead of baking it in.
jax.tree_util.register_dataclass(DraftVocab, data_fields=["d2t", "t2d"], meta_fields=[])


def identity(vocab_size: int) -> DraftVocab:
    """The full target vocabulary (Vd == V): every offset zero, every id present."""
    return DraftVocab(np.zeros((vocab_size,), np.int64), np.ones((vocab_size,), np.bool_))


def target_ids(vocab: DraftVocab) -> np.ndarray:
    """[Vd] int64 target id of each draft id (strictly ascending for a valid mapping)."""
    d2t = np.asarray(vocab.d2t).astype(np.int64)
    return np.arange(d2t.shape[0], dtype=np.int64) + d2t


def from_target_ids(ids, vocab_size: int) -> DraftVocab:
    """The mapping whose draft vocabulary is the given target ids (sorted ascending here)."""
    used = np.unique(np.asarray(ids, dtype=np.int64))
    if used.size != np.asarray(ids).size:
        raise Eagle3Error("draft vocabulary ids contain duplicates: pass each target id once")
    if used.size and (used[0] < 0 or used[-1] >= vocab_size):
        raise Eagle3Error(
            f"draft vocabulary ids must lie in 0..{vocab_size - 1} (the target vocab)"
        )
    t2d = np.zeros((vocab_size,), np.bool_)
    t2d[used] = True
    return DraftVocab(used - np.arange(used.size, dtype=np.int64), t2d)


def build_from_counts(counts_V, draft_vocab_size: int) -> DraftVocab:
    """The Vd most frequent target ids (counts over loss_mask == 1 tokens), sorted ascending.

    Ties in count go to the lower id (the official code breaks them by first appearance in the data,
    which a histogram no longer knows). When fewer than Vd ids have a nonzero count, the set is
    padded with the smallest ids of 0..Vd-1 not already in it, as SpecForge's
    `process_token_dict_to_mappings` does (EAGLE's own `scandata` does not pad and would produce a
    d2t shorter than Vd).

    Args:
      counts_V: [V] non-negative token counts.
      draft_vocab_size: Vd, 1 <= Vd <= V.
    """
    counts = np.asarray(counts_V)
    if counts.ndim != 1:
        raise Eagle3Error(
            f"token counts must be one count per target id ([V]), got shape {counts.shape}"
        )
    v, vd = counts.shape[0], int(draft_vocab_size)
    if not 1 <= vd <= v:
        raise Eagle3Error(f"draft vocab size {vd} must be between 1 and the target vocab size {v}")
    if np.any(counts < 0):
        raise Eagle3Error("token counts must be non-negative: pass occurrence counts per target id")
    seen = np.flatnonzero(counts > 0)
    if seen.size >= vd:
        # Stable sort of -count: equal counts keep ascending id order.
        order = np.argsort(-counts[seen], kind="stable")
        used = seen[order[:vd]]
    else:
        pad = np.setdiff1d(np.arange(vd, dtype=np.int64), seen)[: vd - seen.size]
        used = np.concatenate([seen, pad])
    return from_target_ids(used, v)


def check(
    vocab: DraftVocab, vocab_size: int, draft_vocab_size: int, where: str = "draft vocab"
) -> None:
    """Refuses a mapping of the wrong sizes or an inconsistent d2t/t2d pair (before any compute)."""
    d2t, t2d = np.asarray(vocab.d2t), np.asarray(vocab.t2d)
    if d2t.ndim != 1 or d2t.shape[0] != draft_vocab_size:
        raise Eagle3Error(
            f"{where}: d2t has shape {d2t.shape}, expected [{draft_vocab_size}] "
            "(draft_vocab_size): the mapping belongs to another head; rebuild or "
            "reload it"
        )
    if t2d.ndim != 1 or t2d.shape[0] != vocab_size:
        raise Eagle3Error(
            f"{where}: t2d has shape {t2d.shape}, expected [{vocab_size}] (the "
            "target vocab size): the mapping was built for another target vocabulary"
        )
    if not np.issubdtype(d2t.dtype, np.integer):
        raise Eagle3Error(f"{where}: d2t must hold integer offsets, got dtype {d2t.dtype}")
    if t2d.dtype != np.bool_:
        if not (np.issubdtype(t2d.dtype, np.integer) and np.isin(t2d, (0, 1)).all()):
            raise Eagle3Error(f"{where}: t2d must be a boolean mask, got dtype {t2d.dtype}")
        t2d = t2d.astype(np.bool_)
    ids = np.arange(d2t.shape[0], dtype=np.int64) + d2t.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise Eagle3Error(
            f"{where}: d2t maps draft ids outside the target vocab 0..{vocab_size - 1}"
        )
    if np.any(np.diff(ids) <= 0):
        raise Eagle3Error(
            f"{where}: d2t target ids are not strictly ascending: d2t must be "
            "offsets (target = draft + d2t[draft]) over target ids sorted ascending"
        )
    if int(t2d.sum()) != draft_vocab_size:
        raise Eagle3Error(
            f"{where}: t2d marks {int(t2d.sum())} target ids, expected "
            f"{draft_vocab_size}: d2t and t2d come from different mappings"
        )
    if not t2d[ids].all():
        raise Eagle3Error(
            f"{where}: t2d is not True at the target ids d2t names: d2t and t2d come "
            "from different mappings; rebuild them together"
        )
