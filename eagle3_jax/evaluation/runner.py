"""Runs methods over benchmark questions, resumably, and writes records, summary, report, plots.

Layout of OUT:
  config.json     the configuration fingerprint; another configuration in the same OUT is refused
  records.jsonl   one line per finished (question, method, seed), appended as soon as it finishes
  results.json    every record of this run's questions + the summary
  report.md       the paper-shaped table (rows = methods, columns = tasks, cells "tau / speedup")
  *.png           tau_per_task, speedup_per_task, acceptance_by_depth

On several processes (every process runs the same command; docs/multihost.md) the one-process
run's batches are dealt out in turn: process p runs batches p, p + P, ... (every method on each),
with the target on its own devices (`--mesh` is each process's mesh over them), into
`records.part{p}of{P}.jsonl`; process 0 then appends those records to records.jsonl in the
one-process order and writes results.json, report.md and the plots, once. A killed run's shards
are folded into records.jsonl when it is resumed.

This module plans the batches and runs them; the options and methods are `options`'s, the
fingerprint `fingerprint`'s, records.jsonl and its shards `records`'s, one method over one batch
of questions `batch`'s.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from eagle3_jax import distributed
from eagle3_jax.checkpoints import resolve_target
from eagle3_jax.checkpoints.atomic import exclusive
from eagle3_jax.checkpoints.heads import draft_vocab_sizes
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation.batch import Models, run_questions
from eagle3_jax.evaluation.fingerprint import check_config, fingerprint
from eagle3_jax.evaluation.options import (
    EvalOptions,
    num_seeds,
    parse_draft_vocab_specs,
    parse_drafts,
    parse_methods,
)
from eagle3_jax.evaluation.questions import load_questions
from eagle3_jax.evaluation.records import (
    fold_shards,
    load_records,
    merge_shards,
    record_key,
    shard_path,
)
from eagle3_jax.evaluation.report import write_outputs


def plan(pending, batch_size: int) -> list[tuple[int, list]]:
    """The one-process run's batches, in its order: (seed, questions) for each."""
    units = []
    for seed in sorted({s for s, _ in pending}):
        qs = [q for s, q in pending if s == seed]
        units += [(seed, qs[b : b + batch_size]) for b in range(0, len(qs), batch_size)]
    return units


def run_eval(opts: EvalOptions) -> dict:
    """The whole evaluation: returns the summary and writes everything under opts.out."""

    if opts.batch_size < 1:
        raise Eagle3Error(f"--batch-size {opts.batch_size} < 1")
    if opts.max_new_tokens < 1:
        raise Eagle3Error(f"--max-new-tokens {opts.max_new_tokens} < 1")
    if opts.seeds is not None and opts.seeds < 1:
        raise Eagle3Error(f"--seeds {opts.seeds} < 1")
    sampling = Sampling(opts.temperature, 0, 1.0)
    questions = load_questions(opts.bench, opts.questions)
    drafts = parse_drafts(opts.drafts)
    methods = parse_methods(opts.methods, drafts, opts.baseline)
    if not methods:
        raise Eagle3Error("no method to run: --no-baseline needs pld or eagle3 in --methods")
    if opts.replay and (not opts.baseline or opts.temperature != 0):
        raise Eagle3Error(
            "--replay replays greedy decoding over vanilla's answers: it needs temperature 0 "
            "and vanilla (drop --no-baseline)"
        )
    unused = set(drafts) - {m.draft for m in methods}
    if unused:
        raise Eagle3Error(f"--draft {', '.join(sorted(unused))} is used by no method")
    requests = parse_draft_vocab_specs(opts.draft_vocab, drafts)
    cuts = draft_vocab_sizes(drafts, requests)
    out = Path(opts.out)
    if out.exists() and not out.is_dir():
        raise Eagle3Error(f"--out {out} is a file: give a directory")
    target_path = str(Path(resolve_target(opts.target)).resolve())
    config = fingerprint(opts, target_path, drafts, methods, cuts)
    out.mkdir(parents=True, exist_ok=True)
    count, me = distributed.share()
    # a second harness on the same --out is refused at once (process 0 holds --out's own lock)
    lock = out if me == 0 else out / f".process{me}"
    first = distributed.primary_first("eval: config") if count > 1 else None
    with exclusive(lock, "--out"):
        with first or contextlib.nullcontext():
            # process 0 first: it writes config.json, folds a killed run's shards and repairs a
            # torn line; then every process reads the same records, so all plan alike
            check_config(out, config)
            if me == 0:
                fold_shards(out)
            records = load_records(out / "records.jsonl")
        return _run_locked(opts, out, questions, methods, drafts, requests, cuts, sampling,
                           records, (count, me))  # fmt: skip


def _run_locked(opts, out, questions, methods, drafts, requests, cuts, sampling, records,
                share) -> dict:  # fmt: skip
    count, me = share
    rec_path = out / "records.jsonl"
    done = {record_key(r) for r in records}
    seeds = list(range(num_seeds(opts)))
    pending = [
        (s, q)
        for s in seeds
        for q in questions
        if any((q.id, m.label, s) not in done for m in methods)
    ]
    cats = len({q.category for q in questions})
    print(  # (by every process: each names the run it joins)
        f"eval: {opts.bench}, {len(questions)} questions ({cats} categories"
        + (f", the first {opts.questions} of each" if opts.questions else "")
        + f"), {len(methods)} methods, {len(seeds)} seed(s); {len(pending)} questions to run"
        + "".join(f"; draft {n} cut to its first {k} ids (--draft-vocab)" for n, k in cuts.items()),
        file=sys.stderr,
    )
    units = plan(pending, opts.batch_size)
    mine = units[me::count]  # this process's batches
    if count == 1:
        if mine:
            models = Models.load(opts, drafts, requests)
            _run_pending(models, methods, mine, sampling, opts, rec_path, records, done)
        return write_outputs(out, records, questions, methods, seeds, opts)
    order = {}  # record key -> its place in the one-process run's records.jsonl
    for seed, batch in units:
        for m in methods:
            for q in batch:
                if (q.id, m.label, seed) not in done:
                    order[(str(q.id), m.label, seed)] = len(order)
    try:
        sink = shard_path(out, me, count)
        sink.write_bytes(b"")
        if mine:
            models = Models.load(opts, drafts, requests)
            _run_pending(models, methods, mine, sampling, opts, sink, records, done, me == 0)
    except BaseException as e:  # the others finish their shares, then stop naming this process
        distributed.all_gather("eval: run", distributed.failure(e), wait=False)
        raise
    distributed.check_gathered(distributed.all_gather("eval: run", len(mine)))

    def finish() -> dict:
        merge_shards(out, count, order)
        return write_outputs(out, load_records(rec_path), questions, methods, seeds, opts)

    return distributed.from_primary("eval: report", finish)  # written by process 0 alone


def _run_pending(models, methods, units, sampling, opts, rec_path, records, done,
                 show: bool = True) -> None:  # fmt: skip
    from tqdm import tqdm

    bar = tqdm(
        total=sum(len(batch) for _, batch in units),
        unit="q",
        desc="eval",
        file=sys.stderr,
        disable=not opts.progress or not show,
        dynamic_ncols=True,
    )
    with bar, rec_path.open("a", encoding="utf-8") as f:
        for seed, batch in units:
            for m in methods:  # interleaved: vanilla, then each method, on the same questions
                todo = [q for q in batch if (q.id, m.label, seed) not in done]
                if not todo:
                    continue
                answers = None  # --replay: vanilla's records of these questions (run first)
                if opts.replay and m.kind != "vanilla":
                    base = {record_key(r): r for r in records if r["method"] == "vanilla"}
                    answers = [base[(str(q.id), "vanilla", seed)] for q in todo]
                for rec in run_questions(models, m, todo, sampling, seed, opts.max_new_tokens,
                                         answers):  # fmt: skip
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    records.append(rec)
                    done.add(record_key(rec))
            bar.update(len(batch))
