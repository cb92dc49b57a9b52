"""The tokenized training set: fixed-size arrays, one .npz file, and a resumable batch order.

Shapes (N records, L = max_len, b = per-host batch):
  input_ids [N, L] int32  chat-templated ids, right-padded with pad_id
  loss_mask [N, L] int8   1 on assistant answer tokens and their end-of-turn token
  lengths   [N]    int32  real tokens per record
Every record has the same L, so a training step compiles once.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from eagle3_jax.data.conversations import Conversation, Message
from eagle3_jax.data.masks import UnrenderableConversation, tokenize_conversation
from eagle3_jax.errors import Eagle3Error

FORMAT = "eagle3_jax.data/1"


@dataclasses.dataclass(frozen=True, eq=False)
class TokenizedDataset:
    input_ids: np.ndarray  # [N, L] int32
    loss_mask: np.ndarray  # [N, L] int8
    lengths: np.ndarray  # [N] int32
    pad_id: int
    skipped: int = 0  # conversations dropped while building (empty mask, template refused them)

    @property
    def num_records(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_len(self) -> int:
        return int(self.input_ids.shape[1])


def _pad_id(tokenizer) -> int:
    for tid in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if tid is not None:
            return int(tid)
    return 0


def build_dataset(
    tokenizer,
    conversations: Sequence[Conversation | list[Message]],
    max_len: int,
    progress: bool = True,
) -> TokenizedDataset:
    """Tokenizes and masks every conversation (see masks.tokenize_conversation) into fixed arrays.

    Records whose mask is empty after truncation, or that the chat template refuses, are skipped and
    counted in `skipped`. Raises Eagle3Error when no record has an assistant token.
    """
    if max_len < 2:
        raise Eagle3Error(f"max_len {max_len} < 2: give room for a prompt and an answer token")
    pad_id = _pad_id(tokenizer)
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    skipped = 0
    for conv in tqdm(
        conversations, desc="tokenizing", unit="conv", disable=not progress, dynamic_ncols=True
    ):
        messages = conv.messages if isinstance(conv, Conversation) else conv
        try:
            ids, mask = tokenize_conversation(tokenizer, messages, max_len)
        except UnrenderableConversation:
            skipped += 1
            continue
        if not mask.any():
            skipped += 1
            continue
        rows.append((ids, mask))
    if not rows:
        raise Eagle3Error(
            f"no assistant tokens in any of the {len(conversations)} conversations "
            f"(max_len {max_len}): the data needs assistant answers (regenerate them "
            "from the prompts) or a larger max_len"
        )
    input_ids = np.full((len(rows), max_len), pad_id, np.int32)
    loss_mask = np.zeros((len(rows), max_len), np.int8)
    lengths = np.zeros((len(rows),), np.int32)
    for n, (ids, mask) in enumerate(rows):
        input_ids[n, : ids.size] = ids
        loss_mask[n, : mask.size] = mask
        lengths[n] = ids.size
    return TokenizedDataset(input_ids, loss_mask, lengths, pad_id, skipped)


def save(ds: TokenizedDataset, path: str | Path) -> Path:
    """Writes the dataset to one .npz, atomically (a crash never leaves a half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:  # a file object: np.savez would append ".npz" to a name
            np.savez(
                f,
                format=np.array(FORMAT),
                input_ids=ds.input_ids,
                loss_mask=ds.loss_mask,
                lengths=ds.lengths,
                pad_id=np.int64(ds.pad_id),
                skipped=np.int64(ds.skipped),
            )
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load(path: str | Path) -> TokenizedDataset:
    """Reads a dataset written by `save`; Eagle3Error if the file is missing or not one."""
    path = Path(path)
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise Eagle3Error(f"cannot read dataset {path} ({e}): rebuild it with build_dataset") from e
    with z:
        if "format" not in z.files or str(z["format"]) != FORMAT:
            raise Eagle3Error(f"{path} is not an eagle3_jax dataset ({FORMAT}): rebuild it")
        ds = TokenizedDataset(
            z["input_ids"], z["loss_mask"], z["lengths"], int(z["pad_id"]), int(z["skipped"])
        )
    return ds


def token_counts(ds: TokenizedDataset, vocab_size: int) -> np.ndarray:
    """[V] int64 count of each target id where loss_mask == 1 (for vocab.build_from_counts)."""
    ids = ds.input_ids[ds.loss_mask == 1]
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise Eagle3Error(
            f"dataset holds token id {int(ids.max())} outside the target "
            f"vocabulary of {vocab_size}: it was built with another tokenizer; "
            "rebuild it"
        )
    return np.bincount(ids, minlength=vocab_size).astype(np.int64)


class Batch(NamedTuple):
    step: int  # global step this batch belongs to
    epoch: int
    input_ids: np.ndarray  # [b, L] int32
    loss_mask: np.ndarray  # [b, L] int8
    lengths: np.ndarray  # [b] int32
    rows: np.ndarray  # [b] dataset record indices (offline features are looked up by these)


def steps_per_epoch(ds: TokenizedDataset, batch_size: int) -> int:
    """Full global batches per epoch (the remainder is dropped: every step has one shape)."""
    return ds.num_records // batch_size


def epoch_order(
    num_records: int,
    seed: int,
    epoch: int,
    lengths: np.ndarray | None = None,
    batch_size: int = 1,
    group: int = 32,
) -> np.ndarray:
    """[N] permutation for one epoch, a function of (seed, epoch) only: resuming needs no replay.

    With `lengths`, records of similar length are batched together (so a batch can be cut to its
    longest record): the shuffled order is split into windows of group x batch_size records, each
    window sorted by length, and the resulting batches (consecutive runs of batch_size) shuffled.
    Batches stay random in content and order; only their length spread shrinks.
    """
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(num_records)
    if lengths is None:
        return perm
    window = batch_size * group
    for lo in range(0, num_records, window):
        w = perm[lo : lo + window]
        perm[lo : lo + window] = w[np.argsort(lengths[w], kind="stable")]
    nb = num_records // batch_size
    order = perm[: nb * batch_size].reshape(nb, batch_size)[rng.permutation(nb)].reshape(-1)
    return np.concatenate([order, perm[nb * batch_size :]])


def bucket_length(longest: int, bucket: int, max_len: int) -> int:
    """`longest` rounded up to a multiple of `bucket`, at most max_len (bucket 0: max_len)."""
    if bucket <= 0:
        return max_len
    return min(max_len, -(-max(int(longest), 1) // bucket) * bucket)


def batches(
    ds: TokenizedDataset,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    num_steps: int | None = None,
    length_bucket: int = 0,
) -> Iterator[Batch]:
    """Shuffled batches, epoch after epoch, from `start_step` (same order as a run from step 0).

    batch_size is the GLOBAL batch; with process_count > 1 each host yields its own contiguous
    slice of it (b = batch_size / process_count rows), so the hosts together see each global batch
    exactly once. Stops after `num_steps` batches when given, else runs forever.

    length_bucket > 0 groups records of similar length (`epoch_order`) and cuts each batch to its
    longest GLOBAL row rounded up to a multiple of length_bucket: far less padding, and at most
    max_len / length_bucket shapes to compile. 0 keeps every batch at max_len.
    """
    if batch_size < 1 or batch_size % process_count:
        raise Eagle3Error(
            f"batch size {batch_size} must be a positive multiple of the {process_count} processes"
        )
    if not 0 <= process_index < process_count:
        raise Eagle3Error(f"process index {process_index} outside 0..{process_count - 1}")
    per_epoch = steps_per_epoch(ds, batch_size)
    if per_epoch == 0:
        raise Eagle3Error(
            f"batch size {batch_size} exceeds the {ds.num_records} records: lower "
            "the batch size or add data"
        )
    local = batch_size // process_count
    step, order, order_epoch = start_step, None, -1
    while num_steps is None or step < start_step + num_steps:
        epoch, k = divmod(step, per_epoch)
        if epoch != order_epoch:
            lengths = ds.lengths if length_bucket > 0 else None
            order = epoch_order(ds.num_records, seed, epoch, lengths, batch_size)
            order_epoch = epoch
        glob = order[k * batch_size : (k + 1) * batch_size]
        t = bucket_length(ds.lengths[glob].max(), length_bucket, ds.max_len)
        rows = glob[process_index * local : (process_index + 1) * local]
        yield Batch(
            step, epoch, ds.input_ids[rows, :t], ds.loss_mask[rows, :t], ds.lengths[rows], rows
        )
        step += 1


def batch_arrays(batch) -> dict[str, np.ndarray]:
    """A Batch as the training step takes it: input_ids [B, T] int32, loss_mask [B, T] float32 and
    attention_mask [B, T] int32 (1 on each record's first `lengths` positions)."""
    t = batch.input_ids.shape[1]
    return {
        "input_ids": batch.input_ids.astype(np.int32),
        "loss_mask": batch.loss_mask.astype(np.float32),
        "attention_mask": (np.arange(t)[None, :] < batch.lengths[:, None]).astype(np.int32),
    }
