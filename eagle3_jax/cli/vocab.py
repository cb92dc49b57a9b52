"""`python -m eagle3_jax vocab`: the draft-vocabulary methods of `eagle3_jax.vocab.methods`.


  python -m eagle3_jax vocab count --corpus FILE [--corpus FILE ...] [--roles all] --out C.npy
  python -m eagle3_jax vocab trim --draft HEAD --counts C.npy --size 8192 --out NEW_HEAD
  python -m eagle3_jax vocab trim --draft HEAD --like OTHER_HEAD --out NEW_HEAD
  python -m eagle3_jax vocab extend --draft HEAD --counts C.npy --size 16384 --out NEW_HEAD
  python -m eagle3_jax vocab order --draft HEAD --counts C.npy [--first OLD_HEAD] [--cpu-size N]
  python -m eagle3_jax vocab trim --draft HEAD --size N --out NEW_HEAD   # by HEAD's order

What each does: eagle3_jax/vocab/methods.py and docs/draft_vocab.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from eagle3_jax.checkpoints import load_target
from eagle3_jax.checkpoints.atomic import check_destination
from eagle3_jax.checkpoints.eagle_format import load_draft, save_draft
from eagle3_jax.checkpoints.heads import VOCAB_ORDER_FILE, read_vocab_order, write_vocab_order
from eagle3_jax.config import DTYPES
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.vocab import target_ids
from eagle3_jax.vocab.methods import (
    ROLES,
    count_tokens,
    extend_head,
    load_counts,
    order_ids,
    read_corpus,
    top_ids,
    trim_head,
)

OVERWRITE_HELP = (
    "replace --out if it is a head eagle3_jax wrote (a folder of anything else is never replaced)"
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m eagle3_jax vocab",
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
    _head_output_flags(t)
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
    _head_output_flags(e)
    return p.parse_args(argv)


def _head_output_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--out", required=True, help="new head directory")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


class _Source(NamedTuple):
    """The head a command reads (`load_draft`'s four) and the paths --out must not touch."""

    params: dict
    cfg: object
    vocab: object
    embed: object
    paths: list


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.cmd == "trim" and args.like and (args.counts or args.size):
            raise Eagle3Error("trim takes --like HEAD or --counts C.npy --size N, not both")
        sources = []
        if args.cmd in ("trim", "extend"):  # before any work: never over a user's files
            sources = [args.draft] + ([args.like] if getattr(args, "like", None) else [])
            check_destination(args.out, args.overwrite, sources, what="--out")
        target = load_target(args.target)
        if args.cmd == "count":
            return _count(args, target)
        head = _Source(*load_draft(args.draft, target.cfg), sources)
        if args.cmd == "order":
            return _order(args, target, head)
        if args.cmd == "trim" and (args.like or (args.counts is None and args.size is not None)):
            return _trim_to_known_ids(args, target, head)
        if args.counts is None or args.size is None:
            raise Eagle3Error(f"{args.cmd} needs --counts C.npy and --size N")
        counts = load_counts(args.counts, target.cfg.vocab_size)
        if args.cmd == "extend":
            return _extend(args, target, head, counts)
        return _trim_by_counts(args, target, head, counts)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _count(args, target) -> int:
    docs = [d for f in args.corpus for d in read_corpus(f, args.roles)]
    counts = count_tokens(target.tokenizer, docs, target.cfg.vocab_size)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, counts)
    meta = {"corpus": args.corpus, "roles": args.roles, "documents": len(docs)}
    meta["tokens"] = int(counts.sum())
    meta["distinct"] = int((counts > 0).sum())
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta))
    return 0


def _write_trimmed(args, target, head: _Source, ids, what: str) -> int:
    new_p, new_cfg, new_vocab = trim_head(
        head.params, head.cfg, head.vocab, target.params, target.cfg, ids
    )
    save_draft(
        args.out, new_p, new_cfg, new_vocab, args.dtype, head.embed, args.overwrite, head.paths
    )
    method = "FR-Spec" if head.cfg.lm_head_source == "target" else "VocabTrim"
    print(f"{method}: wrote {args.out} ({what})")
    return 0


def _order(args, target, head: _Source) -> int:
    if head.cfg.speculator_rank:
        raise Eagle3Error(
            "a SpecVocab head chooses its candidates per row: it cannot be cut, so an "
            "order is of no use to it"
        )
    counts = load_counts(args.counts, target.cfg.vocab_size)
    have = target_ids(head.vocab)
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


def _trim_to_known_ids(args, target, head: _Source) -> int:
    """trim --like HEAD (its ids), or trim --size N by the head's own vocab_order.json."""
    vocab = head.vocab
    if args.like:
        ids = target_ids(load_draft(args.like, target.cfg)[2])
        what = f"Vd {head.cfg.draft_vocab_size} -> {ids.size}, the ids of {args.like}"
        return _write_trimmed(args, target, head, ids, what)
    meta = read_vocab_order(args.draft, vocab)
    if meta is None:
        raise Eagle3Error(
            f"trim --size without --counts keeps the first ids of the head's "
            f"{VOCAB_ORDER_FILE}, and {args.draft} has none: give --counts C.npy (or "
            "write one with `python -m eagle3_jax vocab order`)"
        )
    if not 1 <= args.size < vocab.draft_size:
        raise Eagle3Error(
            f"--size {args.size}: give 1..{vocab.draft_size - 1} (the head's Vd is "
            f"{vocab.draft_size})"
        )
    ids = np.sort(meta["order"][: args.size])
    return _write_trimmed(
        args, target, head, ids, f"Vd {args.size}, the first of its {VOCAB_ORDER_FILE}"
    )


def _extend(args, target, head: _Source, counts) -> int:
    old = tuple(int(i) for i in target_ids(head.vocab))
    if args.size <= len(old):
        raise Eagle3Error(
            f"--size {args.size} does not grow the head's draft vocabulary (Vd {len(old)})"
        )
    ids = top_ids(counts, args.size, old + tuple(target.cfg.eos_token_ids))
    new_p, new_cfg, new_vocab, fit = extend_head(
        head.params, head.cfg, head.vocab, target.params, target.cfg, ids, args.ridge
    )
    save_draft(
        args.out, new_p, new_cfg, new_vocab, args.dtype, head.embed, args.overwrite, head.paths
    )
    cover = [float(counts[i].sum() / max(counts.sum(), 1)) for i in (list(old), ids)]
    print(
        f"extended: wrote {args.out} (Vd {len(old)} -> {ids.size}; counted tokens "
        f"covered {cover[0]:.1%} -> {cover[1]:.1%}; row map residual "
        f"{fit['held_out_residual']:.3f} on held-out rows, {fit['residual']:.3f} fitted)"
    )
    return 0


def _trim_by_counts(args, target, head: _Source, counts) -> int:
    """FR-Spec / VocabTrim: the --size most frequent of the head's ids (EOS forced in)."""
    forced = () if args.no_force_eos else tuple(target.cfg.eos_token_ids)
    rank = counts
    if not head.vocab.is_identity:  # a reduced head: the most frequent of its own ids
        have = target_ids(head.vocab)
        if args.size > have.size:
            raise Eagle3Error(
                f"--size {args.size} exceeds the head's draft vocabulary (Vd {have.size}): "
                "trim keeps a subset of its ids (extend grows a reduced head)"
            )
        rank = np.full(target.cfg.vocab_size, -1, np.int64)  # below every count: never chosen
        rank[have] = counts[have]
        absent = sorted(set(forced) - set(have.tolist()))
        if absent:  # no row to keep: the source head cannot draft them either
            print(f"note: EOS id(s) {absent} are not in the head's draft vocabulary: left "
                  "out", file=sys.stderr)  # fmt: skip
        forced = tuple(i for i in forced if i not in absent)
    ids = top_ids(rank, args.size, forced)
    cover = float(counts[ids].sum() / max(counts.sum(), 1))
    return _write_trimmed(args, target, head, ids, f"Vd {ids.size}, {cover:.1%} of counted tokens")
