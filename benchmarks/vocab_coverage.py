#!/usr/bin/env python
"""How much of a target's text a draft vocabulary can propose at all.

  .venv/bin/python benchmarks/vocab_coverage.py --counts C.npy \
      --text mt_bench=benchmarks/results/reporting_tree_mt_bench_80/results.json.gz \
      --text heldout=data/smollm2_135m_regenerated_heldout.jsonl.gz [--draft NAME=HEAD ...]
  (a --text may list several files: NAME=FILE,FILE)

A reduced draft vocabulary (EAGLE-3's Vd, FR-Spec, VocabTrim) can never draft a token outside
it, so its coverage of the target's answers caps every acceptance rate. For each text set (the
answers of an evaluation run's results.json, or a regenerated data file's `output_ids`), the
share of answer tokens inside each head's draft vocabulary (default: the shipped head) and inside
the `--sizes` most frequent ids of `--counts` (`python -m eagle3_jax vocab count`). Prints
a table, writes benchmarks/results/vocab_coverage.json (or --out). No model is run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3_jax.errors import Eagle3Error  # noqa: E402


def _flat(ids) -> list[int]:
    """output_ids of one record: a list of ids, or one list per turn."""
    if ids and isinstance(ids[0], list):
        return [t for turn in ids for t in turn]
    return list(ids or [])


def answer_tokens(path: str | Path) -> np.ndarray:
    """Every answer token id of an evaluation results.json[.gz] (one method's records: the outputs
    of all methods are the same greedy text) or of a JSON Lines data file with `output_ids`
    (first turns) or `turn_output_ids` (`regenerate --all-turns`)."""
    path = Path(path)
    if not path.is_file():
        raise Eagle3Error(f"text file {path} does not exist")
    if path.name.endswith((".json", ".json.gz")):  # an evaluation run's results (.jsonl: data)
        from eagle3_jax.evaluation.records import read_results

        records = read_results(path)["records"]
        first = records[0]["method"] if records else None
        rows = [r["output_ids"] for r in records if r["method"] == first]
    else:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            lines = f.read().split("\n")
        recs = [json.loads(line) for line in lines if line.strip()]
        rows = [r.get("output_ids", r.get("turn_output_ids")) for r in recs]
    toks = np.asarray([t for r in rows for t in _flat(r)], np.int64)
    if not toks.size:
        raise Eagle3Error(f"{path} holds no answer token ids (output_ids / turn_output_ids)")
    return toks


def coverage(tokens: np.ndarray, ids: np.ndarray, vocab_size: int) -> float:
    """Share of `tokens` inside the id set `ids`."""
    member = np.zeros((vocab_size,), bool)
    member[np.asarray(ids, np.int64)] = True
    return float(member[tokens].mean()) if tokens.size else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", action="append", required=True, help="NAME=FILE[,FILE], repeatable")
    ap.add_argument("--draft", action="append", default=None, help="NAME=HEAD, repeatable")
    ap.add_argument("--counts", default=None, help=".npy of `python -m eagle3_jax vocab count`")
    ap.add_argument("--sizes", default="8192,16384,24576,32768")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/vocab_coverage.json"))
    args = ap.parse_args(argv)
    from eagle3_jax.checkpoints.eagle_format import load_draft
    from eagle3_jax.heads import default_head
    from eagle3_jax.vocab import target_ids

    heads = {}
    for spec in args.draft or [f"shipped={default_head()}"]:
        name, _, path = spec.rpartition("=")
        _, cfg, vocab, _ = load_draft(path)
        heads[name or Path(path).name] = target_ids(vocab)
        v = cfg.vocab_size
    counts = np.load(args.counts) if args.counts else None
    if counts is not None and counts.shape != (v,):
        raise Eagle3Error(f"counts {args.counts} have shape {counts.shape}, the vocabulary is {v}")
    sizes = [int(s) for s in args.sizes.split(",") if s] if counts is not None else []
    order = np.argsort(-counts, kind="stable") if counts is not None else None
    cols = [f"head {n} (Vd {ids.size})" for n, ids in heads.items()]
    cols += [f"top {s} of counts" for s in sizes]
    table = {}
    for spec in args.text:
        name, _, path = spec.rpartition("=")
        toks = np.concatenate([answer_tokens(f) for f in path.split(",")])
        row = {"tokens": int(toks.size), "distinct": int(np.unique(toks).size)}
        for col, ids in zip(cols, [*heads.values(), *[order[:s] for s in sizes]]):
            row[col] = coverage(toks, ids, v)
        table[name or Path(path).name] = row
    print("| text | tokens | distinct | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for name, row in table.items():
        cells = [f"{row[c]:.1%}" for c in cols]
        print(f"| {name} | {row['tokens']:,} | {row['distinct']:,} | " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"texts": args.text, "drafts": args.draft, "counts": args.counts, "sizes": sizes}
    out.write_text(json.dumps({"config": meta, "coverage": table}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
