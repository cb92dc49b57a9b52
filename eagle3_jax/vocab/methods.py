"""Training-free draft-vocabulary methods: token counts, FR-Spec, VocabTrim and extended heads
(the command line: `python -m eagle3_jax vocab`).
`count` tokenises a corpus with the target's tokenizer and counts every token id ([V] int64 .npy).
A corpus is a ShareGPT / role-content conversation file (.json/.jsonl, optionally .gz; `--roles`
picks whose messages count: `assistant` (default), `user` or `all`) or plain text (.txt, one
document per line).

`trim` derives an ordinary reduced-vocabulary head from a full-vocabulary one:
  * FR-Spec (arXiv 2502.14856): the source head reads the TARGET's output embedding
    (lm_head_source="target"); the new head's lm_head is the target's rows of the `size` most
    frequent ids of a corpus the user names (FR-Spec counts a pretraining corpus);
  * VocabTrim (arXiv 2506.22694): the source head has its own full-vocabulary lm_head; the new
    head keeps its columns of the `size` most frequent ids (best counted on target-GENERATED text).
Both force the target's end-of-sequence ids into the set (FR-Spec does; a draft that cannot
propose EOS cannot finish a turn early). A reduced head trims too, to a subset of its own ids:
the most frequent of them by the counts (its EOS ids forced in where it has them), or with
`--like` exactly the ids of another head (trimming an extended head `--like` the head it was
grown from gives that head's vocabulary back, its rows as the extended head's training left
them). The result is a plain EAGLE-3 head in the official
format (Vd = size, d2t/t2d), usable by decode.py and the harness like any other; it is lossless
because the target still verifies over its full vocabulary.

`order` writes the head's `vocab_order.json` (beside the official files; official loaders ignore
it): its draft ids in the order to keep them when it is cut to fewer, by descending count, the
ids of `--first` (the head it was grown from) ahead of the rest, so that a head grown by
`extend` cuts back to exactly the head it came from. With it a head is cut when it is loaded
(`decode.py --draft-vocab N`, the harness's `--draft-vocab`, or `trim --size N` without counts
to write the cut copy), and `--cpu-size N` makes N `decode.py`'s default on the CPU, where the
output layer's rows cost most (the shipped SmolLM2 head: 8,192 of its 16,384 ids).

`extend` grows a trained reduced-vocabulary head the other way, without training: its draft
vocabulary becomes its own ids plus the most frequent others of the counts (EOS forced in), up to
`size`. The head's trained lm_head rows stay as they are; each new id's row is the target's output
embedding row of that id mapped by the linear map that best takes the target's rows to the head's
trained rows (ridge least squares over the head's own vocabulary; fit on 80 % of the rows first
to report how well the map predicts rows it did not see). The map, not the target's rows as they
are: training moves a head's rows away from the target's (the shipped SmolLM2 head keeps a mean
cosine of 0.80 with them) and pushes rare tokens down, so raw target rows, even rescaled, outscore
the trained ones and the head drafts them everywhere (acc_0 0.67 -> 0.15 on held-out text); the
map predicts a trained row with 32 % residual (a scale alone: 60 %). Only heads whose lm_head
started as, and so stays comparable to, the target's output embedding make sense here
(`head_init="target"`, the SmolLM2 head's recipe).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eagle3_jax import vocab as vocab_lib
from eagle3_jax.data.conversations import read_conversations
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft_output

ROLES = ("assistant", "user", "all")


def read_corpus(path: str | Path, roles: str = "assistant") -> list[str]:
    """Documents of a corpus file (see the module docstring)."""

    path = Path(path)
    if roles not in ROLES:
        raise Eagle3Error(f"--roles {roles!r}: use one of {', '.join(ROLES)}")
    if not path.is_file():
        raise Eagle3Error(f"corpus file {path} does not exist")
    if path.suffix == ".txt":
        return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    convs, _ = read_conversations(path)
    want = {"assistant": ("assistant",), "user": ("user",), "all": ("user", "assistant", "system")}
    return [m["content"] for c in convs for m in c.messages if m["role"] in want[roles]]


def count_tokens(tokenizer, docs: list[str], vocab_size: int, batch: int = 256) -> np.ndarray:
    """[V] int64 occurrences of each token id over the documents (no special tokens added)."""
    counts = np.zeros((vocab_size,), np.int64)
    for i in range(0, len(docs), batch):
        enc = tokenizer(docs[i : i + batch], add_special_tokens=False)["input_ids"]
        for ids in enc:
            ids = np.asarray(ids, np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise Eagle3Error(
                    f"the tokenizer produced ids outside the target vocabulary 0..{vocab_size - 1}"
                )
            counts += np.bincount(ids, minlength=vocab_size)
    return counts


def top_ids(counts_V: np.ndarray, size: int, forced: tuple[int, ...] = ()) -> np.ndarray:
    """The `size` most frequent ids (ties to the lower id), `forced` ids always in, ascending."""
    counts = np.asarray(counts_V)
    v = counts.shape[0]
    if not 1 <= size <= v:
        raise Eagle3Error(f"size {size} must be between 1 and the vocabulary size {v}")
    forced = sorted({int(i) for i in forced if 0 <= int(i) < v})
    if len(forced) > size:
        raise Eagle3Error(f"size {size} is smaller than the {len(forced)} forced ids")
    order = np.argsort(-counts, kind="stable")
    rest = order[~np.isin(order, forced)][: size - len(forced)]
    return np.sort(np.concatenate([np.asarray(forced, np.int64), rest.astype(np.int64)]))


def order_ids(
    have: np.ndarray,
    counts_V: np.ndarray,
    first: np.ndarray | None = None,
    forced: tuple[int, ...] = (),
) -> np.ndarray:
    """The head's draft ids `have` (target ids) by descending count, ties to the lower id; the ids
    of `first` (a subset of `have`) ahead of all others, and within each of those two groups the
    `forced` ids (EOS: a cut that keeps any of a group keeps them) ahead of the rest."""
    have = np.asarray(have, np.int64)
    ahead = np.zeros(have.shape, bool) if first is None else np.isin(have, first)
    if first is not None and ahead.sum() != np.unique(first).size:
        raise Eagle3Error(
            f"--first: {np.unique(first).size - ahead.sum()} of its {np.unique(first).size} ids "
            "are not the head's: it is not the head this one was grown from"
        )
    pinned = np.isin(have, np.asarray(forced, np.int64))
    counts = np.asarray(counts_V).astype(np.int64)[have]
    # lexsort: the last key is the primary one
    return have[np.lexsort((have, -counts, ~pinned, ~ahead))]


def trim_head(params, cfg, vocab, target_params, tcfg, ids: np.ndarray):
    """(params, cfg, vocab) of the reduced head over target ids `ids` (ascending): a subset of
    the source head's draft ids (all V for a full-vocabulary head)."""
    import dataclasses

    import jax.numpy as jnp

    if cfg.speculator_rank:
        raise Eagle3Error(
            "a SpecVocab head chooses its candidates per row: trimming it would discard the "
            "speculator; trim a head with its own or the target's lm_head instead"
        )
    ids = np.asarray(ids, np.int64)
    if cfg.lm_head_source == "target":  # FR-Spec: rows of the target's output embedding
        out = draft_output.attach_target_head(params, cfg, target_params, tcfg)["out_embed"]
        lm = jnp.take(out, jnp.asarray(ids), axis=0).T
    else:  # VocabTrim: the head's own columns (of a reduced head: those of the kept ids)
        have = vocab_lib.target_ids(vocab)
        missing = np.setdiff1d(ids, have)
        if missing.size:
            raise Eagle3Error(
                f"{missing.size} of the {ids.size} ids to keep are not in the head's draft "
                f"vocabulary (Vd {have.size}): trim keeps a subset of a head's ids (extend "
                "grows a reduced head)"
            )
        lm = jnp.take(params["lm_head"], jnp.asarray(np.searchsorted(have, ids)), axis=1)
    new_cfg = dataclasses.replace(
        cfg, draft_vocab_size=int(ids.size), lm_head_source="own", speculator_rank=0
    )
    new_params = {k: v for k, v in params.items() if k not in ("out_embed", "lm_head")}
    new_params["lm_head"] = lm.astype(params["final_norm"].dtype)
    return new_params, new_cfg, vocab_lib.from_target_ids(ids, cfg.vocab_size)


def extend_head(params, cfg, vocab, target_params, tcfg, ids: np.ndarray, ridge: float = 1e-3):
    """(params, cfg, vocab, fit) of the head grown to the target ids `ids` (ascending, a strict
    superset of its draft vocabulary; see the module docstring). `fit` reports the map's residual
    (|L - T M| / |L|) on the 20 % of the head's rows held out of a first fit, and on all of them.
    `ridge` is relative: lambda = ridge * mean squared row norm of the target rows used.
    """
    import dataclasses

    import jax.numpy as jnp

    if cfg.speculator_rank or cfg.lm_head_source != "own":
        raise Eagle3Error(
            "extend grows a head's own lm_head: this head reads the target's output embedding "
            "(SpecVocab or a target lm_head) and already drafts over the whole vocabulary"
        )
    if tcfg.hidden_size != cfg.hidden_size:
        raise Eagle3Error(
            f"cannot map the target's output rows into the head: hidden sizes differ "
            f"({cfg.hidden_size} vs {tcfg.hidden_size})"
        )
    old = vocab_lib.target_ids(vocab)
    ids = np.asarray(ids, np.int64)
    missing = np.setdiff1d(old, ids)
    if missing.size:
        raise Eagle3Error(
            f"the new vocabulary leaves out {missing.size} of the head's {old.size} ids: extend "
            "keeps every trained row (use trim to drop ids from a full-vocabulary head)"
        )
    if ids.size <= old.size:
        raise Eagle3Error(
            f"size {ids.size} does not grow the head's draft vocabulary (Vd {old.size})"
        )
    out_VD = draft_output.target_output_embedding(target_params, tcfg)

    def target_rows(ids_N):  # [N, D] float64: the rows are taken before the conversion
        return np.asarray(jnp.take(out_VD, jnp.asarray(ids_N), axis=0), np.float64)

    lm_CD = np.asarray(params["lm_head"], np.float64).T  # [Vd, D]: row c = id old[c]
    t_CD = target_rows(old)

    def fit(rows):
        a = t_CD[rows]
        gram = a.T @ a
        lam = ridge * float(np.trace(gram)) / a.shape[1]
        return np.linalg.solve(gram + lam * np.eye(a.shape[1]), a.T @ lm_CD[rows])

    def residual(m, rows):
        return float(np.linalg.norm(lm_CD[rows] - t_CD[rows] @ m) / np.linalg.norm(lm_CD[rows]))

    perm = np.random.default_rng(0).permutation(old.size)
    held, kept = perm[: old.size // 5], perm[old.size // 5 :]
    fit_stats = {"held_out_residual": residual(fit(kept), held) if held.size else float("nan")}
    m_DD = fit(perm)
    fit_stats["residual"] = residual(m_DD, perm)
    new = np.setdiff1d(ids, old)
    rows = np.empty((ids.size, cfg.hidden_size), np.float64)
    rows[np.searchsorted(ids, old)] = lm_CD
    rows[np.searchsorted(ids, new)] = target_rows(new) @ m_DD
    new_cfg = dataclasses.replace(cfg, draft_vocab_size=int(ids.size))
    new_params = dict(params)
    new_params["lm_head"] = np.asarray(rows.T, np.float32)
    return new_params, new_cfg, vocab_lib.from_target_ids(ids, cfg.vocab_size), fit_stats


def load_counts(path: str, v: int) -> np.ndarray:
    """Token counts from `vocab count` (one per target id), checked against the vocabulary."""
    try:
        counts = np.load(path)
    except (OSError, ValueError) as e:
        raise Eagle3Error(
            f"counts {path} cannot be read ({e.__class__.__name__}): give the .npy that "
            "`vocab count` wrote"
        ) from None
    if counts.shape != (v,):
        raise Eagle3Error(
            f"counts {path} have shape {counts.shape}, the target's vocabulary "
            f"is {v}: count with the same target's tokenizer"
        )
    return counts
