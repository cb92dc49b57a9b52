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
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import heapq
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from eagle3_jax import cpu_tuning, distributed
from eagle3_jax.checkpoints import load_target, resolve_target, target_digest
from eagle3_jax.checkpoints.atomic import exclusive, write_text_atomic
from eagle3_jax.checkpoints.heads import draft_vocab_sizes, load_head, parse_draft_vocab
from eagle3_jax.compile_cache import release_if_crowded
from eagle3_jax.config import default_dtype
from eagle3_jax.decoding.generate import DecodeOptions, Generation, generate_ids
from eagle3_jax.decoding.replay import replay_ids
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.decoding.tree import TreeConfig, default_tree
from eagle3_jax.errors import Eagle3Error, differing_keys
from eagle3_jax.evaluation import metrics
from eagle3_jax.evaluation.questions import BENCHES, Question, load_questions
from eagle3_jax.evaluation.report import write_outputs
from eagle3_jax.prompts import encode_chat
from eagle3_jax.sharding import make_mesh, parse_mesh

TIMING_KEYS = ("wall_time_s", "tokens_per_s", "batch_wall_time_s", "replay_time_s")


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A method to evaluate: `label` names it in records and reports."""

    label: str
    kind: str  # vanilla | pld | eagle3
    tree: tuple = (1, 1, 1)  # top_k, depth, total_tokens[, verify_threshold]
    draft: str | None = None  # a draft name (eagle3 only)


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """Everything one evaluation run needs (the command-line flags)."""

    out: Path
    target: str | None = None
    drafts: tuple[str, ...] = ()
    methods: str | None = None
    bench: str = "spec_bench"
    questions: int | None = None
    temperature: float = 0.0
    max_new_tokens: int = 256
    seeds: int | None = None
    batch_size: int = 1
    dtype: str | None = None
    progress: bool = True
    baseline: bool = True  # run vanilla too (speedup, exactness); False: tau only
    draft_vocab: tuple[str, ...] = ()  # --draft-vocab [NAME=]auto|full|N; unnamed: every draft
    mesh: str | None = None  # --mesh DATAxMODEL; records do not depend on it (not fingerprinted)
    replay: bool = False  # speculative methods' τ replayed over vanilla's answers (decoding.replay)


def parse_drafts(specs: Sequence[str]) -> dict[str, str]:
    """`PATH` or `name=PATH` (repeatable) -> {name: absolute path}; a bare PATH is named by its
    directory name."""
    out: dict[str, str] = {}
    for s in specs:
        name, sep, path = s.partition("=")
        if not sep or "/" in name or not name:
            name, path = Path(s).name or s, s
        if name in out:
            raise Eagle3Error(
                f"two drafts are named {name!r}: give them names with --draft NAME=PATH"
            )
        out[name] = str(Path(path).expanduser().resolve())
    return out


def parse_draft_vocab_specs(specs: Sequence[str], drafts: dict[str, str]) -> dict[str, object]:
    """--draft-vocab values (`auto`, `full`, `N`, or `NAME=` one of these for one draft; later
    ones win) -> {draft name: request}; drafts not named keep "auto" (decode.py's default)."""
    out: dict[str, object] = {n: "auto" for n in drafts}
    for text in specs:
        name, sep, value = text.rpartition("=")
        if sep and name not in drafts:
            raise Eagle3Error(
                f"--draft-vocab {text!r}: no draft named {name!r} (have {', '.join(drafts)})"
            )
        req = parse_draft_vocab(value)
        out.update({name: req} if sep else dict.fromkeys(drafts, req))
    return out


def _parse_tree(text: str, where: str) -> tuple:
    """`K,D,T` or `K,D,T,THRESHOLD` (adaptive verification) -> (k, d, t[, threshold])."""
    parts = text.split(",")
    try:
        if len(parts) not in (3, 4):
            raise ValueError
        shape = tuple(int(x) for x in parts[:3]) + tuple(float(x) for x in parts[3:])
    except ValueError:
        raise Eagle3Error(
            f"method {where!r}: the tree shape must be TOP_K,DEPTH,TOTAL[,VERIFY_THRESHOLD]"
        ) from None

    TreeConfig(*shape).validate(10**9)
    return shape


def default_tree_shape() -> tuple:
    """A bare `eagle3` (or `pld`): decode.py's default tree on this backend, as a shape tuple."""

    t = default_tree()
    shape = (t.top_k, t.depth, t.total_tokens)
    return shape + ((t.verify_threshold,) if t.verify_threshold > 0 else ())


def shape_text(tree: tuple) -> str:
    """(2, 3, 4, 0.3) -> "2,3,4,0.3": a tree shape as --methods writes it."""
    return ",".join(str(x) if isinstance(x, int) else f"{x:g}" for x in tree)


def parse_methods(
    text: str | None, drafts: dict[str, str], baseline: bool = True
) -> list[MethodSpec]:
    """A comma list of `vanilla`, `pld[:k,d,t]`, `eagle3[:k,d,t][@draft]` -> specs, vanilla first
    (run unless baseline is False: speedup and exactness are measured against it). A bare
    `eagle3` with several drafts runs each draft. A bare `eagle3` or `pld` is labelled with the
    shape it resolves to on this backend (`eagle3:2,3,4,0.3` on a CPU), so records and reports
    of a CPU and an accelerator run never share a label for different trees."""
    if text is None:
        text = "vanilla,pld" + (",eagle3" if drafts else "")
    # commas separate methods, except inside a tree shape ("eagle3:4,4,16,.3,pld")
    joined = [x.strip() for x in re.split(r",(?!\s*\.?\d)", text) if x.strip()]
    if not baseline and "vanilla" in joined:
        raise Eagle3Error("--no-baseline skips vanilla: drop it from --methods")
    specs = [MethodSpec("vanilla", "vanilla", (1, 1, 1))] if baseline else []
    for it in joined:
        head, _, name = it.partition("@")
        kind, colon, shape = head.partition(":")
        if kind not in ("vanilla", "pld", "eagle3"):
            raise Eagle3Error(f"unknown method {it!r}: use vanilla, pld[:k,d,t], eagle3[:k,d,t]")
        if kind == "vanilla":
            continue
        tree = _parse_tree(shape, it) if colon else default_tree_shape()
        if kind == "pld":  # a chain of the shape's depth (a bare pld's threshold does not apply)
            if name:
                raise Eagle3Error(f"method {it!r}: pld takes no draft")
            if colon and len(tree) > 3:
                raise Eagle3Error(f"method {it!r}: a verify threshold needs a draft (eagle3)")
            chain = (1, tree[1], tree[1] + 1)
            specs.append(MethodSpec(head if colon else f"pld:{shape_text(chain)}", "pld", chain))
            continue
        if not drafts:
            raise Eagle3Error(f"method {it!r} needs --draft PATH (an EAGLE-3 head)")
        if name and name not in drafts:
            raise Eagle3Error(f"method {it!r}: no draft named {name!r} (have {', '.join(drafts)})")
        names = [name] if name else list(drafts)
        if not colon:
            head = f"eagle3:{shape_text(tree)}"
        for n in names:
            label = head if len(drafts) == 1 else f"{head}@{n}"
            specs.append(MethodSpec(label, "eagle3", tree, n))
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise Eagle3Error(f"methods repeat: {', '.join(labels)}")
    return specs


def head_digest(path: str | Path) -> str:
    """sha256 (16 hex digits) of a head's files (config, weights, vocab_order.json): a head
    replaced at the same path is another head."""

    path = Path(path)
    h = hashlib.sha256()
    names = ["config.json", "vocab_order.json", "pytorch_model.bin"]
    for f in sorted(path.glob("*.safetensors")) + [path / n for n in names]:
        if f.is_file():
            h.update(f.name.encode())
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    h.update(block)
    return h.hexdigest()[:16]


def fingerprint(
    opts: EvalOptions, target_path: str, drafts: dict[str, str], methods, cuts=None
) -> dict:
    """What makes records comparable; --questions is left out so a run can be extended. Heads are
    named by path and by their files' digest, the target by its files' (`target_digest`), the
    questions by their file's; `cuts` ({draft: ids kept}) is recorded only when a
    draft is cut."""
    bench = opts.bench if opts.bench in BENCHES else str(Path(opts.bench).resolve())
    qfile = Path(BENCHES.get(opts.bench, opts.bench))
    extra = {"draft_vocab": dict(cuts)} if cuts else {}
    # what decides the records besides the flags: the target's files and the questions' text
    extra["target_digest"] = target_digest(target_path)
    extra["questions_digest"] = hashlib.sha256(qfile.read_bytes()).hexdigest()[:16]
    if drafts:
        extra["draft_digests"] = {n: head_digest(p) for n, p in drafts.items()}
    if opts.replay:
        extra["replay"] = True
    return {
        "target": target_path,
        "drafts": drafts,
        "methods": [dataclasses.asdict(m) for m in methods],
        "bench": bench,
        "temperature": opts.temperature,
        "max_new_tokens": opts.max_new_tokens,
        "seeds": num_seeds(opts),
        "batch_size": opts.batch_size,
        "dtype": opts.dtype,
        **extra,
    }


def num_seeds(opts: EvalOptions) -> int:
    return opts.seeds if opts.seeds is not None else (1 if opts.temperature == 0 else 5)


def check_config(out: Path, config: dict) -> None:
    """Writes OUT/config.json, or refuses an OUT that holds another configuration."""
    path = out / "config.json"
    config = json.loads(json.dumps(config))  # tuples -> lists, as stored
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError as e:
            raise Eagle3Error(f"{path} is not valid JSON: {e}; use another --out") from e
        if old != config:
            diff = differing_keys(old, config)
            hint = (
                " (a bare eagle3 or pld takes decode.py's default tree of this backend, which "
                "differs between CPUs and accelerators; a run labels it with its shape, e.g. "
                "eagle3:2,3,4,0.3)"
                if "methods" in diff
                else ""
            )
            if "draft_vocab" in diff:
                hint += (
                    " (the drafts are cut differently: --draft-vocab, whose default auto cuts a "
                    "head on a CPU when its vocab_order.json names a cpu_size)"
                )
            if {"target_digest", "questions_digest"} & set(diff):
                hint += (
                    " (the target's files or the question file changed since the run started, "
                    "or the run predates their fingerprints)"
                )
            if "draft_digests" in diff:
                hint += (
                    " (a head's files are not those this run started with, or the run predates "
                    "heads' fingerprints)"
                )
            raise Eagle3Error(
                f"{out} holds results of another configuration (differs in {', '.join(diff)})"
                f"{hint}: use another --out, or the same flags to resume"
            )
        return
    if out.is_dir() and any(not p.name.endswith(".lock") for p in out.iterdir()):
        raise Eagle3Error(
            f"{out} already holds files that are not an evaluation run (no config.json): use a "
            "new or empty --out (nothing there was changed)"
        )
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(config, indent=2) + "\n")


def load_records(path: Path) -> list[dict]:
    """Finished records; a line cut short by an interruption is dropped (and the file repaired)."""
    if not path.exists():
        return []
    # not splitlines: U+2028 and other separators may sit raw inside JSON strings
    lines = [x for x in path.read_text(encoding="utf-8").split("\n") if x]
    good, seen = [], set()
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or record_key(rec) in seen:
            continue
        seen.add(record_key(rec))
        good.append(rec)
    if len(good) != len(lines):
        path.write_text("".join(json.dumps(r) + "\n" for r in good), encoding="utf-8")
    return good


def record_key(rec: dict) -> tuple[str, str, int]:
    return str(rec["question_id"]), rec["method"], int(rec["seed"])


def process_mesh(text: str | None):
    """`--mesh DATAxMODEL` over this process's own devices: with several processes each runs
    its own batches, so its mesh spans only its devices; with one, `parse_mesh`."""
    mesh = parse_mesh(text)
    if mesh is None or jax.process_count() == 1:
        return mesh
    data, model = mesh.shape["data"], mesh.shape["model"]
    local = jax.local_devices()
    if data * model > len(local):
        raise Eagle3Error(
            f"--mesh {text}: each of the {jax.process_count()} processes runs its own questions "
            f"on its own {len(local)} devices; give DATAxMODEL within them"
        )
    return make_mesh(data, model, local)


def shard_path(out: Path, index: int, count: int) -> Path:
    """Where process `index` of `count` writes its records before process 0 merges them."""
    return out / f"records.part{index}of{count}.jsonl"


def _complete_lines(path: Path) -> list[bytes]:
    """The complete lines of a file (a write cut short by a kill is dropped), split at b"\\n"
    only (U+2028 and friends sit raw inside JSON strings)."""
    data = path.read_bytes()
    return [line + b"\n" for line in data[: data.rfind(b"\n") + 1].split(b"\n")[:-1]]


def fold_shards(out: Path) -> None:
    """Appends the records a killed multi-process run left in its shards to records.jsonl (a
    repeated record is dropped by `load_records`), then removes the shards."""
    shards = sorted(out.glob("records.part*of*.jsonl"))
    if not shards:
        return
    rec_path = out / "records.jsonl"
    if rec_path.exists():
        load_records(rec_path)  # a torn last line goes before anything is appended
    with rec_path.open("ab") as f:
        for shard in shards:
            f.write(b"".join(_complete_lines(shard)))
    load_records(rec_path)
    for shard in shards:
        shard.unlink()


def merge_shards(out: Path, count: int, order: dict) -> None:
    """Process 0: appends the processes' records to records.jsonl in the one-process order
    (`order`: record key -> its place in the plan; each shard is in that order already), then
    removes the shards."""
    shards = [shard_path(out, i, count) for i in range(count)]
    streams = [
        ((order[record_key(json.loads(line))], line) for line in _complete_lines(p)) for p in shards
    ]
    with (out / "records.jsonl").open("ab") as f:
        for _, line in heapq.merge(*streams, key=lambda x: x[0]):
            f.write(line)
    for p in shards:
        p.unlink()


def plan(pending, batch_size: int) -> list[tuple[int, list]]:
    """The one-process run's batches, in its order: (seed, questions) for each."""
    units = []
    for seed in sorted({s for s, _ in pending}):
        qs = [q for s, q in pending if s == seed]
        units += [(seed, qs[b : b + batch_size]) for b in range(0, len(qs), batch_size)]
    return units


class Models:
    """The loaded target and drafts ({name: (params, cfg, vocab, embed)}), and one generation call
    per method."""

    def __init__(self, target, drafts: dict[str, tuple]):
        self.target, self.drafts = target, drafts

    @classmethod
    def load(cls, opts: EvalOptions, drafts: dict[str, str], vocab_requests=None) -> Models:
        """The target of opts and each {name: path} head, checked against it (and cut as
        {name: --draft-vocab request} says; "auto" when not named)."""

        dtype = default_dtype(opts.dtype)
        mesh = process_mesh(opts.mesh)
        target = load_target(opts.target, dtype=dtype, mesh=mesh)
        # this machine's few-row products (measured once per CPU), for the target and its heads
        products = cpu_tuning.policy_for()
        target = target._replace(cfg=dataclasses.replace(target.cfg, products=products))
        req = vocab_requests or {}
        return cls(
            target,
            {n: load_head(p, target, dtype, req.get(n, "auto"), mesh) for n, p in drafts.items()},
        )

    def generate(self, m: MethodSpec, ids, sampling, seed: int, max_new: int) -> Generation:
        """One batch of token-id prompts with method m (`generate_ids`); each call first runs a
        warm-up generation (compilation), excluded from the time."""

        release_if_crowded()  # many methods x prompt lengths: keep under the kernel's map limit
        opts = DecodeOptions(m.kind, max_new, TreeConfig(*m.tree), sampling, seed)
        head = self.drafts[m.draft] if m.draft else None
        return generate_ids(self.target, head, ids, opts, warmup=True)

    def replay(self, m: MethodSpec, ids, answers, max_new: int) -> Generation:
        """Method m's greedy generation replayed over the target's greedy `answers` (`replay_ids`:
        its τ and acceptance; no timing)."""

        release_if_crowded()
        opts = DecodeOptions(m.kind, max_new, TreeConfig(*m.tree))
        head = self.drafts[m.draft] if m.draft else None
        return replay_ids(self.target, head, ids, answers, opts)


def run_questions(
    models: Models, m: MethodSpec, batch: Sequence[Question], sampling, seed: int, max_new: int,
    answers: Sequence[dict] | None = None,
) -> list[dict]:  # fmt: skip
    """Every turn of a batch of questions with one method; turn t+1 is conditioned on the model's
    own answer to turn t (chat template history). Both turns are timed and counted. `answers`
    (vanilla's records of the batch): the method is replayed over their answers, turn by turn
    (`replay_ids`): its records say `replayed`, decoding's time in them is 0 and the replay's
    own is `replay_time_s`."""

    tok = models.target.tokenizer
    history: list[list[dict[str, str]]] = [[] for _ in batch]
    turns: list[list[dict]] = [[] for _ in batch]
    for t in range(max(len(q.turns) for q in batch)):
        active = [i for i, q in enumerate(batch) if len(q.turns) > t]
        for i in active:
            history[i].append({"role": "user", "content": batch[i].turns[t]})
        ids = [encode_chat(tok, history[i]) for i in active]
        if answers is None:
            res = models.generate(m, ids, sampling, seed, max_new)
        else:
            res = models.replay(m, ids, [answers[i]["output_ids"][t] for i in active], max_new)
        wall = res.wall_time_s
        for i, pids, row in zip(active, ids, res.rows()):
            out, text = row.output_ids, row.text
            history[i].append({"role": "assistant", "content": text})
            turns[i].append(
                {
                    "prompt_tokens": len(pids),
                    "output_ids": out,
                    "text": text,
                    "new_tokens": len(out),
                    "target_forwards": row.target_forwards,
                    "finish_reason": row.finish_reason,
                    "accept_hist": row.accept_hist,
                    "verified_tokens": row.verified_tokens,  # tree tokens over its rounds
                    "wall_time_s": wall / len(active),  # this row's share of the batch
                    "batch_wall_time_s": wall,
                }
            )
            if answers is not None:  # not decoding's time: the replay's own, apart
                turns[i][-1].update(wall_time_s=0.0, batch_wall_time_s=0.0,
                                    replay_time_s=wall / len(active))  # fmt: skip
    recs = []
    for q, ts in zip(batch, turns):
        hists = [x["accept_hist"] for x in ts if x["accept_hist"] is not None]
        rec = {
            "question_id": q.id,
            "task": q.task,
            "method": m.label,
            "seed": seed,
            "num_generations": len(ts),
            "new_tokens": sum(x["new_tokens"] for x in ts),
            "target_forwards": sum(x["target_forwards"] for x in ts),
            "wall_time_s": sum(x["wall_time_s"] for x in ts),
            "output_ids": [x["output_ids"] for x in ts],
            "accept_hist": np.sum(hists, axis=0).tolist() if hists else None,
            "verified_tokens": (
                sum(x["verified_tokens"] for x in ts)
                if all(x.get("verified_tokens") is not None for x in ts)
                else None
            ),
            "turns": ts,
        }
        if answers is not None:
            rec["replayed"] = True
            rec["replay_time_s"] = sum(x["replay_time_s"] for x in ts)
        rec["tau"] = metrics.tau([rec])
        rec["tokens_per_s"] = metrics.throughput([rec])
        if hists:
            rec["acceptance_by_depth"] = metrics.acceptance_by_depth([rec])
        recs.append(rec)
    return recs


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
