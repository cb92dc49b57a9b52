"""A head as decoding uses it: loaded, checked against its target, and cut to fewer draft ids.

`vocab_order.json` is our extension beside the official files (their loaders never read it): the
head's draft ids in the order to keep them when it is cut to fewer at load (`cut_size`), and the
size decode.py cuts to on the CPU by default, where the output layer's cost is paid row by row.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from eagle3_jax import vocab as vocab_lib
from eagle3_jax.checkpoints.atomic import write_text_atomic
from eagle3_jax.checkpoints.eagle_format import load_draft, read_head_tensors, vocab_from_tensors
from eagle3_jax.checkpoints.head_config import read_head_config
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models.draft import param_shardings
from eagle3_jax.models.draft_output import attach_target_head
from eagle3_jax.vocab import DraftVocab
from eagle3_jax.vocab.methods import trim_head

# Our extension, beside the official files (their loaders never read it): the head's draft ids in
# the order to keep them when it is cut to fewer at load (`cut_size`), and the size decode.py cuts
# to on the CPU by default, where the output layer's cost is paid row by row.
VOCAB_ORDER_FILE = "vocab_order.json"


def read_vocab_order(path: str | os.PathLike, vocab: DraftVocab) -> dict[str, Any] | None:
    """The head's `vocab_order.json`, checked against its draft ids: {"order": [Vd] int64 target
    ids, the first to keep first; "cpu_size": int or None; "about": str}. None if it has none."""
    f = Path(path) / VOCAB_ORDER_FILE
    if not f.is_file():
        return None
    try:
        meta = json.loads(f.read_text())
    except ValueError as e:
        raise Eagle3Error(f"{f} is not valid JSON: {e}") from e
    have = vocab_lib.target_ids(vocab)
    try:
        order = np.asarray(meta["order"], dtype=np.int64)
    except (KeyError, TypeError, ValueError):
        raise Eagle3Error(f'{f}: needs "order", a list of the head\'s draft token ids') from None
    if order.shape != have.shape or not np.array_equal(np.sort(order), have):
        dup = order.size - np.unique(order).size
        raise Eagle3Error(
            f'{f}: "order" must list each of the head\'s {have.size} draft ids once (it lists '
            f"{order.size} ids, {np.setdiff1d(order, have).size} of them not the head's, {dup} "
            "repeated): the file belongs to another head"
        )
    cpu = meta.get("cpu_size")
    if cpu is not None and (type(cpu) is not int or not 1 <= cpu <= have.size):
        raise Eagle3Error(f'{f}: "cpu_size" {cpu!r} must be an integer in 1..{have.size}')
    return {"order": order, "cpu_size": cpu, "about": str(meta.get("about", ""))}


def read_head_vocab(path: str | os.PathLike) -> DraftVocab:
    """The draft vocabulary of the head at path (its config.json sizes and d2t/t2d) alone."""
    path = Path(path)
    hf = read_head_config(path)
    try:
        v = int(hf["vocab_size"])
    except (KeyError, TypeError, ValueError):
        raise Eagle3Error(f"{path}/config.json lacks vocab_size: not an EAGLE-3 config") from None
    sizes = types.SimpleNamespace(
        vocab_size=v, draft_vocab_size=int(hf.get("draft_vocab_size") or v)
    )
    return vocab_from_tensors(read_head_tensors(path), sizes, str(path))


def write_vocab_order(
    path: str | os.PathLike, order, cpu_size: int | None = None, about: str = ""
) -> None:
    """Writes `vocab_order.json` into a head directory, atomically (`read_vocab_order` checks it
    against the head when it is read)."""
    meta = {"about": about, "cpu_size": cpu_size, "order": [int(i) for i in order]}
    write_text_atomic(Path(path) / VOCAB_ORDER_FILE, json.dumps(meta) + "\n")


def cut_size(request, path: str | os.PathLike, vocab: DraftVocab, backend: str):
    """`--draft-vocab` -> (how many draft ids to keep, in the order of `vocab_order.json`, or None
    for all of them; the order). `request`: "full" (all), "auto" (the head's `cpu_size` on the
    CPU backend, all elsewhere or when it names none) or an int N."""
    size = vocab.draft_size
    if request in (None, "full") or request == size:
        return None, None
    meta = read_vocab_order(path, vocab)
    if request == "auto":
        if backend != "cpu" or meta is None or meta["cpu_size"] in (None, size):
            return None, None
        return meta["cpu_size"], meta["order"]
    if not isinstance(request, int) or not 1 <= request <= size:
        raise Eagle3Error(
            f"--draft-vocab {request!r}: give auto, full or a size in 1..{size} (the head's Vd)"
        )
    if meta is None:
        raise Eagle3Error(
            f"--draft-vocab {request}: the head {path} has no {VOCAB_ORDER_FILE} saying which of "
            f"its {size} ids to keep; cut it by token counts instead (python -m "
            "eagle3_jax vocab trim --counts C.npy --size N) or use --draft-vocab full"
        )
    return request, meta["order"]


def parse_draft_vocab(text: str):
    """The --draft-vocab flag's text -> "auto", "full" or a positive int."""
    if text in ("auto", "full"):
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise Eagle3Error(f"--draft-vocab {text!r}: give auto, full or a positive number of ids")
    return n


class Head(NamedTuple):
    """A loaded EAGLE-3 head: its params pytree, config, draft vocabulary (d2t/t2d) and its own
    embedding [V, D] when the checkpoint carries one (else None: the target's is used)."""

    params: Any
    cfg: Any
    vocab: DraftVocab
    embed: Any = None


def load_head(path, target, dtype=None, draft_vocab="full", mesh=None) -> Head:
    """The head at path as a `Head` (params, cfg, vocab, embed), checked against the target (load_draft
    runs check_compatible when given the target's config); the head multiplies a few rows as the
    target does (its config's `products`).

    draft_vocab: "full" (every draft id), "auto" (decode.py's default: on the CPU the size the
    head's vocab_order.json names, if any) or N: the head cut to the first N ids of its
    vocab_order.json, exactly the head ``python -m eagle3_jax vocab trim`` would write for those ids."""
    kw = {} if dtype is None else {"dtype": dtype}
    params, cfg, vocab, embed = load_draft(path, target.cfg, **kw)
    cfg = dataclasses.replace(cfg, products=target.cfg.products)
    n, order = cut_size(draft_vocab, path, vocab, jax.default_backend())
    if n is not None:
        ids = np.sort(order[:n])
        params, cfg, vocab = trim_head(params, cfg, vocab, target.params, target.cfg, ids)
    if mesh is not None:  # laid out as the target is: matrices over `model`, the rest replicated
        params = jax.tree.map(jax.device_put, params, param_shardings(cfg, mesh))
        if embed is not None:
            embed = jax.device_put(embed, NamedSharding(mesh, PartitionSpec()))
    params = attach_target_head(params, cfg, target.params, target.cfg)
    return Head(params, cfg, vocab, embed)


def draft_vocab_sizes(drafts: dict[str, str], requests: dict[str, object]) -> dict[str, int]:
    """{name: draft ids kept} of each draft --draft-vocab cuts ({name: request}, default "auto"),
    from the heads' vocabularies alone (before any weights are loaded)."""
    out = {}
    for name, path in drafts.items():
        req = requests.get(name, "auto")
        if req != "full":
            n, _ = cut_size(req, path, read_head_vocab(path), jax.default_backend())
            if n is not None:
                out[name] = n
    return out
