"""Training-free draft-vocabulary methods: token counts, FR-Spec, VocabTrim and extended heads.

  python -m eagle3_jax.vocab_tools count --corpus FILE [--corpus FILE ...] [--roles all] --out C.npy
  python -m eagle3_jax.vocab_tools trim --draft HEAD --counts C.npy --size 8192 --out NEW_HEAD
  python -m eagle3_jax.vocab_tools trim --draft HEAD --like OTHER_HEAD --out NEW_HEAD
  python -m eagle3_jax.vocab_tools extend --draft HEAD --counts C.npy --size 16384 --out NEW_HEAD
  python -m eagle3_jax.vocab_tools order --draft HEAD --counts C.npy [--first OLD_HEAD] [--cpu-size N]
  python -m eagle3_jax.vocab_tools trim --draft HEAD --size N --out NEW_HEAD   # by HEAD's order

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

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from eagle3_jax.errors import Eagle3Error

ROLES = ("assistant", "user", "all")


def read_corpus(path: str | Path, roles: str = "assistant") -> list[str]:
    """Documents of a corpus file (see the module docstring)."""
    from eagle3_jax.data.conversations import read_conversations

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

    from eagle3_jax import vocab as vocab_lib
    from eagle3_jax.models import draft as drf

    if cfg.speculator_rank:
        raise Eagle3Error(
            "a SpecVocab head chooses its candidates per row: trimming it would discard the "
            "speculator; trim a head with its own or the target's lm_head instead"
        )
    ids = np.asarray(ids, np.int64)
    if cfg.lm_head_source == "target":  # FR-Spec: rows of the target's output embedding
        out = drf.attach_target_head(params, cfg, target_params, tcfg)["out_embed"]
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

    from eagle3_jax import vocab as vocab_lib
    from eagle3_jax.models import draft as drf

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
    out_VD = drf.target_output_embedding(target_params, tcfg)

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


OVERWRITE_HELP = (
    "replace --out if it is a head eagle3_jax wrote (a folder of anything else is never replaced)"
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m eagle3_jax.vocab_tools",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("count", help="token counts of a corpus")
    c.add_argument("--target", default=None, help="tokenizer's model (default: embedded SmolLM2)")
    c.add_argument("--corpus", action="append", required=True)
    c.add_argument("--roles", default="assistant", choices=ROLES)
    c.add_argument("--out", required=True, help="counts .npy")
    t = sub.add_parser("trim", help="FR-Spec / VocabTrim: a head over a subset of its ids")
    t.add_argument("--target", default=None)
    t.add_argument("--draft", required=True, help="head directory (full or reduced vocabulary)")
    t.add_argument("--counts", help=".npy from `count` (with --size)")
    t.add_argument(
        "--size",
        type=int,
        help="Vd of the new head: the most frequent of its ids (without --counts: the first of "
        "its vocab_order.json)",
    )
    t.add_argument("--like", help="keep exactly the draft ids of this head instead")
    t.add_argument("--no-force-eos", action="store_true", help="do not force EOS ids in")
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    t.add_argument("--out", required=True, help="new head directory")
    t.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    o = sub.add_parser("order", help="write HEAD/vocab_order.json: which ids a cut keeps")
    o.add_argument("--target", default=None)
    o.add_argument("--draft", required=True, help="head directory (reduced vocabulary)")
    o.add_argument("--counts", required=True, help=".npy from `count`")
    o.add_argument("--first", help="the head this one was grown from: its ids come first")
    o.add_argument("--cpu-size", type=int, help="decode.py's default cut on the CPU")
    e = sub.add_parser("extend", help="a larger draft vocabulary for a trained reduced head")
    e.add_argument("--target", default=None)
    e.add_argument("--draft", required=True, help="reduced-vocabulary head directory")
    e.add_argument("--counts", required=True, help=".npy from `count`")
    e.add_argument("--size", type=int, required=True, help="Vd of the new head")
    e.add_argument("--ridge", type=float, default=1e-3, help="relative ridge of the row map")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    e.add_argument("--out", required=True, help="new head directory")
    e.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    args = p.parse_args(argv)
    try:
        from eagle3_jax.checkpoints import load_target
        from eagle3_jax.checkpoints.atomic import check_destination

        if args.cmd == "trim" and args.like and (args.counts or args.size):
            raise Eagle3Error("trim takes --like HEAD or --counts C.npy --size N, not both")
        if args.cmd in ("trim", "extend"):  # before any work: never over a user's files
            sources = [args.draft] + ([args.like] if getattr(args, "like", None) else [])
            check_destination(args.out, args.overwrite, sources, what="--out")

        target = load_target(args.target)
        v = target.cfg.vocab_size
        if args.cmd == "count":
            docs = [d for f in args.corpus for d in read_corpus(f, args.roles)]
            counts = count_tokens(target.tokenizer, docs, v)
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            np.save(out, counts)
            meta = {"corpus": args.corpus, "roles": args.roles, "documents": len(docs)}
            meta["tokens"] = int(counts.sum())
            meta["distinct"] = int((counts > 0).sum())
            out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
            print(json.dumps(meta))
            return 0
        from eagle3_jax.checkpoints.eagle_format import load_draft, save_draft
        from eagle3_jax.vocab import target_ids

        params, cfg, vocab, embed = load_draft(args.draft, target.cfg)

        def write_trimmed(ids, what: str) -> int:
            new_p, new_cfg, new_vocab = trim_head(
                params, cfg, vocab, target.params, target.cfg, ids
            )
            save_draft(
                args.out, new_p, new_cfg, new_vocab, args.dtype, embed, args.overwrite, sources
            )
            method = "FR-Spec" if cfg.lm_head_source == "target" else "VocabTrim"
            print(f"{method}: wrote {args.out} ({what})")
            return 0

        if args.cmd == "order":
            from eagle3_jax.checkpoints.eagle_format import write_vocab_order

            if cfg.speculator_rank:
                raise Eagle3Error(
                    "a SpecVocab head chooses its candidates per row: it cannot be cut, so an "
                    "order is of no use to it"
                )
            counts = _load_counts(args.counts, v)
            have = target_ids(vocab)
            first = None if not args.first else target_ids(load_draft(args.first, target.cfg)[2])
            if args.cpu_size is not None and not 1 <= args.cpu_size <= have.size:
                raise Eagle3Error(f"--cpu-size {args.cpu_size}: give 1..{have.size}, the head's Vd")
            eos = tuple(target.cfg.eos_token_ids)
            order = order_ids(have, counts, first, eos)
            about = f"draft ids by descending count in {args.counts}" + (
                f", the {first.size} of {args.first} first" if first is not None else ""
            )
            about += f"; EOS {sorted(set(eos) & set(have.tolist()))} first in its group"
            write_vocab_order(args.draft, order, args.cpu_size, about)
            print(f"wrote {args.draft}/vocab_order.json ({about}; cpu_size {args.cpu_size})")
            return 0
        if args.cmd == "trim" and args.like:
            ids = target_ids(load_draft(args.like, target.cfg)[2])
            return write_trimmed(
                ids, f"Vd {cfg.draft_vocab_size} -> {ids.size}, the ids of {args.like}"
            )
        if args.cmd == "trim" and args.counts is None and args.size is not None:
            from eagle3_jax.checkpoints.eagle_format import VOCAB_ORDER_FILE, read_vocab_order

            meta = read_vocab_order(args.draft, vocab)
            if meta is None:
                raise Eagle3Error(
                    f"trim --size without --counts keeps the first ids of the head's "
                    f"{VOCAB_ORDER_FILE}, and {args.draft} has none: give --counts C.npy (or "
                    "write one with `vocab_tools order`)"
                )
            if not 1 <= args.size < vocab.draft_size:
                raise Eagle3Error(
                    f"--size {args.size}: give 1..{vocab.draft_size - 1} (the head's Vd is "
                    f"{vocab.draft_size})"
                )
            ids = np.sort(meta["order"][: args.size])
            return write_trimmed(ids, f"Vd {args.size}, the first of its {VOCAB_ORDER_FILE}")
        if args.counts is None or args.size is None:
            raise Eagle3Error(f"{args.cmd} needs --counts C.npy and --size N")
        counts = _load_counts(args.counts, v)
        if args.cmd == "extend":
            old = tuple(int(i) for i in target_ids(vocab))
            if args.size <= len(old):
                raise Eagle3Error(
                    f"--size {args.size} does not grow the head's draft vocabulary (Vd {len(old)})"
                )
            ids = top_ids(counts, args.size, old + tuple(target.cfg.eos_token_ids))
            new_p, new_cfg, new_vocab, fit = extend_head(
                params, cfg, vocab, target.params, target.cfg, ids, args.ridge
            )
            save_draft(
                args.out, new_p, new_cfg, new_vocab, args.dtype, embed, args.overwrite, sources
            )
            cover = [float(counts[i].sum() / max(counts.sum(), 1)) for i in (list(old), ids)]
            print(
                f"extended: wrote {args.out} (Vd {len(old)} -> {ids.size}; counted tokens "
                f"covered {cover[0]:.1%} -> {cover[1]:.1%}; row map residual "
                f"{fit['held_out_residual']:.3f} on held-out rows, {fit['residual']:.3f} fitted)"
            )
            return 0
        forced = () if args.no_force_eos else tuple(target.cfg.eos_token_ids)
        rank = counts
        if not vocab.is_identity:  # a reduced head: the most frequent of its own ids
            have = target_ids(vocab)
            if args.size > have.size:
                raise Eagle3Error(
                    f"--size {args.size} exceeds the head's draft vocabulary (Vd {have.size}): "
                    "trim keeps a subset of its ids (extend grows a reduced head)"
                )
            rank = np.full(v, -1, np.int64)  # below every count: never chosen over a head id
            rank[have] = counts[have]
            absent = sorted(set(forced) - set(have.tolist()))
            if absent:  # no row to keep: the source head cannot draft them either
                print(f"note: EOS id(s) {absent} are not in the head's draft vocabulary: left "
                      "out", file=sys.stderr)  # fmt: skip
            forced = tuple(i for i in forced if i not in absent)
        ids = top_ids(rank, args.size, forced)
        cover = float(counts[ids].sum() / max(counts.sum(), 1))
        return write_trimmed(ids, f"Vd {ids.size}, {cover:.1%} of counted tokens")
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _load_counts(path: str, v: int) -> np.ndarray:
    counts = np.load(path)
    if counts.shape != (v,):
        raise Eagle3Error(
            f"counts {path} have shape {counts.shape}, the target's vocabulary "
            f"is {v}: count with the same target's tokenizer"
        )
    return counts


if __name__ == "__main__":
    sys.exit(main())
