#!/usr/bin/env python
"""The draft-vocabulary study, end to end and resumable: train, cut, measure, report.

  .venv/bin/python benchmarks/vocab_study.py                      # the SmolLM2 study (issue 33)
  .venv/bin/python benchmarks/vocab_study.py --grid configs/vocab_study_olmo2_1b.py \
      --config.target=/ckpt/OLMo-2-0425-1B-Instruct --config.data=/data/prompts.jsonl  # a GPU

`--config.FIELD=VALUE` overrides the grid's base TrainConfig (every cell), as `ablate` takes it.
What the flags leave open comes from the grid: FR-Spec/VocabTrim sizes = its EAGLE-3 cells'
vocabularies, the reference = its first EAGLE-3 cell, the trees = its tree (plus this machine's
default tree on a CPU), replay on a CPU backend only.

Each cell of the grid is a group: the cell and the heads cut from it (FR-Spec from the target's
output layer, VocabTrim from a full own lm_head). Groups are measured one after another, each to
the end, and a measured group's results are kept under RESULTS/groups/CELL (RESULTS: --publish,
else --out), stamped with what decides them (the cell's training config, the target, the
questions, the trees, the counts' corpora): they stand without the heads, so a fresh machine
with them committed goes on with the next cell, and the report needs no head at all. Rerun the
same command after any stop; each stage resumes or skips what is done. Per group:
  1. its cell is trained (`python -m eagle3_jax ablate --config GRID --cells CELL`: one feature
     store, the same data in the same order, the same step budget for every cell);
  2. token counts, where it cuts heads: FR-Spec's from --frspec-corpus (a general corpus, every
     role), VocabTrim's from target-generated text (the answers the heads were trained on);
  3. its FR-Spec or VocabTrim heads at every --sizes (`python -m eagle3_jax vocab trim`);
  4. drafting time per step of its heads at each tree's top-k, and per round of the tree
     (benchmarks/draft_cost.py), timed in turns with a calibration head (the grid's init_trunk:
     the same files on every machine), by which the report puts every group's times on one scale;
  5. one harness run per tree (--trees; `cpu` is decode.py's default tree on this machine) of
     plain decoding and its heads, interleaved per question, each head at its own vocabulary: on
     an accelerator every tree decodes for real (τ and speedup); on a CPU the `cpu` tree does, and
     at the other trees each head is replayed over plain decoding's greedy answers (`eval
     --replay`: the same τ as decoding, draft-only rounds; their speed is stage 4's drafting
     time; untimed, they run --replay-batch-size questions a batch). Every speedup is over the
     group's own plain decoding, and heads of different groups are paired question by question;
  6. SpecVocab's speculator recall on held-out answers (benchmarks/speculator_recall.py).
Then 7, the report (eagle3_jax.evaluation.study) from every group's results: the paper-shaped
table, per-question paired intervals against --reference, drafting time per step and per round,
training curves, plots. With --publish DIR: report.md, summary.json, the plots and the curves go
there beside the groups (the study's committed results).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import jax

from eagle3_jax.ablation.config import load_ablation, trained_head
from eagle3_jax.ablation.status import cell_status, running_line, status_lines, store_line
from eagle3_jax.checkpoints import (
    files_digest,
    load_target_config,
    resolve_target,
    target_digest,
)
from eagle3_jax.checkpoints.atomic import exclusive, made_from, record_inputs
from eagle3_jax.data.conversations import read_conversations
from eagle3_jax.errors import Eagle3Error, Stopped
from eagle3_jax.evaluation import study
from eagle3_jax.evaluation.fingerprint import head_digest
from eagle3_jax.evaluation.options import _parse_tree, default_tree_shape, shape_text
from eagle3_jax.evaluation.questions import load_questions
from eagle3_jax.evaluation.records import read_results
from eagle3_jax.training.config import apply_overrides

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SHARED = ROOT.parent / "shared/data"
CALIBRATION = "calibration"  # the head every group's drafting times are timed beside


def run(cmd: list[str]) -> None:
    """One stage, as a subprocess. A SIGTERM to this driver is passed on to it (a training stage
    then checkpoints the step in progress and stops; `locked` ends the study with its status)."""
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    procs, noticed = [], []

    def forward(*_):
        noticed.append(True)
        for p in procs:
            p.send_signal(signal.SIGTERM)

    here = threading.current_thread() is threading.main_thread()  # where handlers can be set
    if here:  # set before the stage starts: a signal in between is passed on as it starts
        previous = signal.signal(signal.SIGTERM, forward)
    try:
        procs.append(subprocess.Popen(cmd, cwd=ROOT))
        if noticed:
            procs[0].send_signal(signal.SIGTERM)
        code = procs[0].wait()
    finally:
        if here:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    if code:
        raise subprocess.CalledProcessError(code, cmd)


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """(the study's flags, the grid's `--config.FIELD=VALUE` overrides)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--grid", default=str(ROOT / "configs/vocab_study_smollm2.py"))
    ap.add_argument(
        "--frspec-corpus", default=None,
        help="FR-Spec's counts (every role): default the ShareGPT sample in ../shared/data, else "
        "data/sharegpt_conversations.jsonl.gz (shipped)",
    )  # fmt: skip
    ap.add_argument(
        "--generated", default=None,
        help="target-generated text for VocabTrim's counts (default: the answers the grid "
        "regenerated, else its training data, which is then the target's own answers)",
    )  # fmt: skip
    ap.add_argument(
        "--sizes", default=None,
        help="FR-Spec and VocabTrim sizes (default: the grid's EAGLE-3 cells' vocabularies)",
    )  # fmt: skip
    ap.add_argument(
        "--reference", default=None,
        help="the head others are paired with (default: the grid's first EAGLE-3 cell)",
    )  # fmt: skip
    ap.add_argument(
        "--trees", default=None,
        help="space-separated tree shapes; cpu = decode's default here (default: the grid's "
        "tree, and cpu on a CPU backend)",
    )  # fmt: skip
    ap.add_argument(
        "--replay", choices=("auto", "yes", "no"), default="auto",
        help="measure the non-cpu trees by replay (auto: on a CPU backend, where verifying "
        "large trees for real costs hours; on accelerators every tree decodes for real)",
    )  # fmt: skip
    ap.add_argument("--bench", default="spec_bench")
    ap.add_argument(
        "--questions", type=int, default=20,
        help="per category (Spec-Bench: 20 gives all 80 MT-bench questions and 20 of each task)",
    )  # fmt: skip
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument(
        "--replay-batch-size", type=int, default=8,
        help="questions per batch of a replayed (untimed) run; runs that time decoding keep "
        "batch 1 (greedy outputs, target passes and acceptance are the same at any batch)",
    )  # fmt: skip
    ap.add_argument("--mesh", default=None, help="the harness's --mesh DATAxMODEL")
    ap.add_argument(
        "--round-cost", default=str(ROOT / "benchmarks/results/round_cost_h200"),
        help="the methods' rounds timed on an accelerator (scripts/device_job.py round-cost "
        "--head ...): every results.json under this folder goes into the report",
    )  # fmt: skip
    ap.add_argument("--out", default=str(ROOT / "runs/vocab_study_eval"))
    ap.add_argument("--publish", default=None, help="copy the report and results here")
    ap.add_argument(
        "--skip-train", action="store_true",
        help="stage 1 off: every cell still to measure has its head, trained under the cell's "
        "config (its cell.json, checked before any work)",
    )  # fmt: skip
    ap.add_argument(
        "--status", action="store_true",
        help="print where the study stands (cells, stages, harness records) and start nothing",
    )  # fmt: skip
    args, rest = ap.parse_known_args(argv)
    bad = [a for a in rest if not a.startswith("--config.")]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    return args, rest


def tree_shapes(text: str) -> dict[str, tuple]:
    """'10,8,60 cpu' -> {'10-8-60': (10, 8, 60), 'cpu': decode's default shape here}."""
    out = {}
    for t in text.split():
        out[t if t == "cpu" else t.replace(",", "-")] = (
            default_tree_shape() if t == "cpu" else _parse_tree(t, t)
        )
    return out


def made(path: Path, inputs: dict, make) -> None:
    """make() unless `path` was made from these inputs already; a `path` made from others is
    refused, naming what differs (a resumed study never mixes old and new artefacts)."""
    if not made_from(path, inputs, what="study artefact"):
        make()
        record_inputs(path, inputs)


def main(argv=None) -> int:
    args, overrides = parse_args(argv)
    if args.status:
        print("\n".join(status(args, overrides)))
        return 0
    return locked(
        Path(args.out), "vocabulary study", lambda out: study_stages(args, overrides, out)
    )


def locked(out: Path, what: str, stages) -> int:
    """stages(out) under out's lock: 0 when they finish; a bad input is one line and exit
    status 2; a failed stage (which printed its own message) its exit status."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive(out, what=what):
            stages(out)
    except (Eagle3Error, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:  # the stage printed its own message
        if e.returncode in (Stopped.EXIT_STATUS, -signal.SIGTERM):
            print(
                f"stopped by SIGTERM in a stage, where it resumes: run the same command again "
                f"to go on ({' '.join(e.cmd)})",
                file=sys.stderr,
            )
            return Stopped.EXIT_STATUS
        print(f"error: stage failed (exit {e.returncode}): {' '.join(e.cmd)}", file=sys.stderr)
        return e.returncode
    return 0


def settings(args: argparse.Namespace, grid, root: Path) -> dict:
    """What the flags leave to the grid: the trees and which are replayed, the counts'
    corpora (the sizes and the reference follow from the heads: `from_heads`)."""
    cpu = jax.default_backend() == "cpu"
    trees = args.trees or ",".join(map(str, grid.tree)) + (" cpu" if cpu else "")
    replay = args.replay == "yes" or (args.replay == "auto" and cpu)
    corpus = grid.base.corpus
    regenerated = str(root / "shared" / "regenerated.jsonl") if corpus.regenerate else None
    generated = args.generated or regenerated or corpus.data
    shared = SHARED / "sharegpt/ShareGPT_V3_unfiltered_cleaned_split_first5000.json"
    frspec = args.frspec_corpus or str(
        shared if shared.exists() else ROOT / "data/sharegpt_conversations.jsonl.gz"
    )
    return dict(trees=trees, replay=replay, generated=generated, frspec=frspec,
                regenerated=regenerated)  # fmt: skip


def from_heads(args: argparse.Namespace, heads: list) -> tuple[list[int], str]:
    """(FR-Spec/VocabTrim sizes, reference head): the flags', else the grid's EAGLE-3 heads'
    vocabularies and the first of them (the grid's first head without one)."""
    reduced = [h for h in heads if h.family == "eagle3"]
    sizes = args.sizes.split(",") if args.sizes else [h.vocab for h in reduced]
    reference = args.reference or (reduced[0].name if reduced else heads[0].name)
    return [int(n) for n in sizes if n], reference


def grid_root(grid) -> Path:
    """The folder a grid's cells train in: its out_dir, relative to the repository."""
    return Path(grid.out_dir if Path(grid.out_dir).is_absolute() else ROOT / grid.out_dir)


def status(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """Where the study stands: its cells' training, the stages' artefacts under --out and each
    harness run's records (read only; the run may be going on beside)."""
    grid = load_grid(args.grid, overrides)
    root = grid_root(grid)
    out = Path(args.out)
    have = lambda paths: (  # noqa: E731
        ", ".join(p.name for p in paths if not p.name.endswith(".inputs.json")) or "none yet"
    )
    evals = {  # one harness run per tree and group: eval_TREE/CELL
        f"{p.parent.name.removeprefix('eval_')} {p.name}": p
        for p in sorted(out.glob("eval_*/*"))
        if p.is_dir()
    }
    groups = Path(args.publish or out) / "groups"
    measured = [c.name for c in kept_groups(grid, groups)]
    return [
        running_line(out, "study"),
        store_line(root / "features"),
        *status_lines(cell_status(grid, root), {}),
        f"groups measured ({groups}): {', '.join(measured) or 'none yet'}",
        f"token counts: {have(sorted(out.glob('counts_*.npy')))}",
        f"cut heads: {have(sorted((out / 'heads').glob('*')))}",
        f"draft costs: {have(sorted(out.glob('draft_cost_*.json')))}",
        *(
            status_lines([], evals, load_questions(args.bench, args.questions))
            if evals
            else ["harness: not started"]
        ),
        f"report: {'written' if (out / 'report.md').exists() else 'not yet'}",
    ]


def corpus_identity(corpus: str, regenerated: bool) -> str:
    """A counts corpus's identity across machines: its files' content, or for the answers the
    grid regenerates (made by stage 1, from what `cell_key` holds) just that."""
    if regenerated:
        return "the grid's regenerated answers"
    h = hashlib.sha256()
    for p in corpus.split(","):
        h.update(Path(p).read_bytes())
    return h.hexdigest()[:16]


def cell_key(grid, cell) -> dict:
    """What decides a cell's head: its whole training config but the run's bookkeeping (where it
    writes, how often it checkpoints, logs and validates), paths relative to the repository."""
    cfg = dataclasses.asdict(grid.base.replace(**cell.overrides))
    cfg["run"] = {"export_dtype": cfg["run"]["export_dtype"]}
    key = {"cell": cell.name, "overrides": dict(cell.overrides), "config": cfg}
    # as its stamp reads back (tuples as lists)
    return json.loads(json.dumps(key, sort_keys=True, default=str).replace(str(ROOT) + "/", ""))


def pending_groups(grid, results: Path, common: dict, what: str) -> list[tuple]:
    """(cell, its folder under `results`, its stamp) of each cell not measured yet, in the
    grid's order; all checked first, so that a group kept from other inputs is refused before
    hours of work (`made_from`)."""
    pending = []
    for cell in grid.cells:
        gdir = results / cell.name
        key = {**cell_key(grid, cell), **common}
        if made_from(gdir, key, what=f"{what} group"):
            print(f"{what}: group {cell.name} measured already ({gdir})", file=sys.stderr)
        else:
            pending.append((cell, gdir, key))
    return pending


def group_heads(cell_head, sizes: list[int]) -> list[tuple[str, str, int]]:
    """(name, family, size) of the heads cut from a cell: FR-Spec from the target's output
    layer, VocabTrim from a full own lm_head, at every size."""
    cut = {"target_lm_head": "frspec", "full": "vocabtrim"}.get(cell_head.family)
    return [(f"{cut}_{n}", cut, n) for n in sizes] if cut else []


def load_grid(path: str, overrides: list[str]):
    """The grid with `--config.FIELD=VALUE` applied to its base (every cell)."""
    grid = load_ablation(path)
    return dataclasses.replace(grid, base=apply_overrides(grid.base, overrides))


def so_far(text: str, grid, kept: list, what: str) -> str:
    """A report of the `kept` cells, saying after its title how many of the grid's are in and
    which are still to come (unchanged when all are)."""
    if len(kept) == len(grid.cells):
        return text
    left = ", ".join(c.name for c in grid.cells if c not in kept)
    line = f"{what} measured so far: {len(kept)} of {len(grid.cells)} (still to come: {left})."
    return text.replace("\n\n", f"\n\n{line}\n\n", 1)


def kept_groups(grid, results: Path) -> list:
    """The grid's cells whose group is kept under `results`: its folder and its stamp
    (`publish_group`)."""
    return [
        c
        for c in grid.cells
        if (results / c.name).is_dir() and (results / f"{c.name}.inputs.json").is_file()
    ]


def study_stages(args: argparse.Namespace, overrides: list[str], out: Path) -> None:
    """The report (7) of the groups kept so far, then per cell not yet measured (a group: the cell
    and the heads cut from it) stages 1-6, its results kept under RESULTS/groups/CELL (RESULTS:
    --publish, else --out) and stamped with what decides them, and the report again. A group's
    results stand without its heads: a fresh machine that has them (committed) goes on with the
    next cell."""
    grid = load_grid(args.grid, overrides)
    root = grid_root(grid)
    st = settings(args, grid, root)
    model = []  # the target (and dtype) every stage that loads one reads
    if grid.base.corpus.target:
        model += ["--target", str(grid.base.corpus.target)]
    target = resolve_target(grid.base.corpus.target or None)
    tcfg = load_target_config(target)
    vocab_size = tcfg.vocab_size
    cell_heads = {c.name: study.head_of_cell(c.name, c.overrides, vocab_size) for c in grid.cells}
    sizes, reference = from_heads(args, list(cell_heads.values()))
    counts = {  # family: (the counts' file, its corpus, the roles counted); made by stage 2
        "frspec": (out / "counts_frspec.npy", st["frspec"], "all"),
        "vocabtrim": (out / "counts_generated.npy", st["generated"], "assistant"),
    }
    trees = tree_shapes(st["trees"])
    calibration = grid.base.head.init_trunk or None  # the same files on every machine
    results = Path(args.publish or out) / "groups"
    common = {
        "target": target_digest(target, times=False),
        "counts": {
            f: [corpus_identity(c, c == st["regenerated"]), roles]
            for f, (_, c, roles) in counts.items()
        },
        "sizes": sizes,
        "trees": {n: list(t) for n, t in trees.items()},
        "replay": st["replay"],
        "bench": args.bench,
        "questions": args.questions,
        "max_new_tokens": args.max_new_tokens,
        "replay_batch_size": args.replay_batch_size,
        "calibration": calibration and head_digest(calibration),
        "dtype": grid.dtype,
    }
    pending = pending_groups(grid, results, common, "study")
    if args.skip_train:  # every head there, trained under its cell's config, before any work
        for cell, _, _ in pending:
            trained_head(grid, cell, root, tcfg)
    report_stage(args, out, grid, results, cell_heads, sizes, reference, trees)  # 7, of those kept
    for cell, gdir, key in pending:
        group_stages(args, overrides, out, grid, cell, cell_heads[cell.name], sizes, counts,
                     trees, st, model, calibration, vocab_size, common["target"],
                     files_digest([target]))  # fmt: skip
        files = {}
        for t in trees:
            files[f"results_{t}.json.gz"] = out / f"eval_{t}" / cell.name / "results.json"
            files[f"draft_cost_{t}.json"] = out / f"draft_cost_{t}_{cell.name}.json"
        for suffix in (".json", ".md"):
            files[f"speculator_recall{suffix}"] = out / f"speculator_recall_{cell.name}{suffix}"
        publish_group(files, root / "cells" / cell.name, gdir, key)
        report_stage(args, out, grid, results, cell_heads, sizes, reference, trees)


def group_stages(args, overrides, out, grid, cell, head, sizes, counts, trees, st, model,
                 calibration, vocab_size, target_key, target_files) -> None:  # fmt: skip
    """One group's stages: its cell trained (1), its cuts (3), its heads' drafting time beside
    the calibration head (4), one harness run per tree of plain decoding and its heads (5), and
    SpecVocab's speculator recall (6), all under --out. Each stage's output is stamped with the
    digests of what it read: the heads, the calibration head, the data; the target's identity
    (`target_key`) for the timings, its files (`target_files`: weights and tokenizer, by name,
    size and time) for what its weights or tokenizer decide (the counts, the recall)."""
    root = grid_root(grid)
    if not args.skip_train:  # 1
        run([PY, "-m", "eagle3_jax", "ablate", "--config", args.grid, "--cells", cell.name,
             "--no-eval", "--no-progress", *overrides])  # fmt: skip
    paths = {cell.name: root / "cells" / cell.name / "head"}
    for name, family, size in group_heads(head, sizes):
        npy, corpus, roles = counts[family]
        made(npy, {"corpus": files_digest(corpus.split(",")), "roles": roles,  # 2
                   "target": target_files},
             lambda: run([PY, "-m", "eagle3_jax", "vocab", "count", "--corpus", corpus,
                          "--roles", roles, "--out", str(npy), *model[:2]]))  # fmt: skip
        dst = out / "heads" / name  # 3
        made(dst, {"source": head_digest(paths[cell.name]), "size": size,
                   "counts": files_digest([npy])},
             lambda: run(
                 [PY, "-m", "eagle3_jax", "vocab", "trim", "--draft", str(paths[cell.name]),
                  "--counts", str(npy), "--size", str(size), "--out", str(dst),
                  *model[:2]]))  # fmt: skip
        paths[name] = dst
    drafts = [f"{n}={p}" for n, p in paths.items()]
    digests = {n: head_digest(p) for n, p in paths.items()}
    for name, shape in trees.items():
        cost = out / f"draft_cost_{name}_{cell.name}.json"
        cmd = [PY, "benchmarks/draft_cost.py", "--out", str(cost), "--top-k", str(shape[0]),
               "--rows", ",".join(dict.fromkeys(["1", str(shape[0])])),
               "--tree", shape_text(shape), *model]  # fmt: skip
        for d in drafts + ([f"{CALIBRATION}={calibration}"] if calibration else []):
            cmd += ["--draft", d]
        timed = {"heads": digests, "calibration": calibration and head_digest(calibration),
                 "target": target_key, "tree": list(shape), "round": "timed whole",
                 "timing": "heads in turns"}  # fmt: skip
        made(cost, timed, lambda c=cmd: run(c))  # 4
        ev = [PY, "-m", "eagle3_jax", "eval", "--methods", f"vanilla,eagle3:{shape_text(shape)}",
              "--bench", args.bench, "--questions", str(args.questions), "--draft-vocab", "full",
              "--max-new-tokens", str(args.max_new_tokens), "--no-progress",
              "--out", str(out / f"eval_{name}" / cell.name), *model]  # fmt: skip
        if grid.dtype:
            ev += ["--dtype", grid.dtype]
        if args.mesh:
            ev += ["--mesh", args.mesh]
        if st["replay"] and name != "cpu":  # τ only: each head replayed over vanilla's answers
            ev += ["--replay", "--batch-size", str(args.replay_batch_size)]
        for d in drafts:
            ev += ["--draft", d]
        run(ev)  # 5 (resumes from its records)
    if head.family == "specvocab":  # 6
        recall = out / f"speculator_recall_{cell.name}.json"
        held_out = grid.base.run.val_data.split(",")[0]  # never trained on
        n = min(40, len(read_conversations(held_out)[0])) if held_out else 0
        ks = [k for k in (64, 256, 1024, 2048) if k < vocab_size] or [max(vocab_size // 4, 1)]
        cmd = [PY, "benchmarks/speculator_recall.py", "--out", str(recall), *model,
               "--k", ",".join(map(str, ks)), "--draft", f"{cell.name}={paths[cell.name]}"]  # fmt: skip
        if n:
            cmd += ["--data", str(held_out), "--records", f"0:{n}"]
        stamp = {"heads": {cell.name: digests[cell.name]}, "target": target_files,
                 "data": held_out and files_digest([held_out]), "records": n, "k": ks}  # fmt: skip
        made(recall, stamp, lambda: run(cmd))


def publish_group(files: dict[str, Path], cell_dir: Path, gdir: Path, key: dict) -> None:
    """A measured group's results into `gdir`, whole or not at all: `files` (name in the group
    -> the file it copies; a name ending in .gz is its file gzipped), then its cell's held-out
    curve and config from `cell_dir` (the metrics gzipped). Its stamp (`key`) is written before
    the folder takes its name, so a stop in between leaves a stamp without a group (measured
    again), never a group without a stamp (refused by `made_from`)."""
    tmp = gdir.with_name(gdir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)  # ours: a publish cut short
    tmp.mkdir(parents=True)
    files = {**files, "metrics.jsonl.gz": cell_dir / "metrics.jsonl"}
    for f in ("validation.jsonl", "train_config.json", "cell.json"):
        files[f] = cell_dir / f
    for name, src in files.items():
        if not src.exists():
            continue
        if name.endswith(".gz"):
            with gzip.open(tmp / name, "wb") as f:
                f.write(src.read_bytes())
        else:
            shutil.copy2(src, tmp / name)
    record_inputs(gdir, key)
    tmp.rename(gdir)


def read_group(gdir: Path) -> dict:
    """A published group: {"runs": tree -> results, "costs": tree -> rows by head, "recall":
    markdown or None, "curve": its held-out curve}."""
    runs = {p.name[len("results_") : -len(".json.gz")]: read_results(p)
            for p in sorted(gdir.glob("results_*.json.gz"))}  # fmt: skip
    costs = {
        p.stem.removeprefix("draft_cost_"): {
            r["head"]: r for r in json.loads(p.read_text())["rows"]
        }
        for p in sorted(gdir.glob("draft_cost_*.json"))
        if not p.name.endswith(".inputs.json")
    }
    md = gdir / "speculator_recall.md"
    return {"runs": runs, "costs": costs, "recall": md.read_text() if md.exists() else None,
            "curve": study.read_curve(gdir)}  # fmt: skip


def report_stage(args, out, grid, results, cell_heads, sizes, reference, trees) -> None:
    """7: the report from the groups' published results (no head needed), into --out, and with
    --publish beside the groups; made after each group, of the groups kept so far."""
    kept = kept_groups(grid, results)
    if not kept:
        return
    groups = {c.name: read_group(results / c.name) for c in kept}
    heads = []
    for c in kept:
        heads.append(cell_heads[c.name])
        for name, family, size in group_heads(cell_heads[c.name], sizes):
            heads.append(study.StudyHead(name, family, size, f"cut from {c.name}",
                                         cell_heads[c.name].target_vocab))  # fmt: skip
    names = list(groups)
    runs = {t: study.merge_groups([g["runs"][t] for g in groups.values()], names) for t in trees}
    costs = {
        t: study.calibrated_costs([g["costs"][t] for g in groups.values()], CALIBRATION, names)
        for t in trees
    }
    # each cell's curve as first published (a cell retrained on a fresh machine validates its
    # last step only: `cell_curve`)
    curves = {c.name: cell_curve(results.parent, c.name, groups[c.name]["curve"]
                                 if c.name in groups else [])
              for c in grid.cells}  # fmt: skip
    timed = [
        json.loads(p.read_text()) for p in sorted(Path(args.round_cost).glob("*/results.json"))
    ]
    text, summary = study.report(runs, heads, reference, costs, curves, timed)
    text = so_far(text, grid, kept, "Groups")
    summary["groups"] = [c.name for c in kept]
    recalls = [g["recall"] for g in groups.values() if g["recall"]]
    if recalls:
        text += "\n## SpecVocab speculator recall (held-out answers, first draft step)\n\n"
        text += "\n".join(recalls)
    (out / "report.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    pngs = study.plot(summary, curves, out)
    print(text)
    if args.publish:
        pub = Path(args.publish)
        for p in [out / "report.md", out / "summary.json", *pngs]:
            shutil.copy2(p, pub / p.name)
        (pub / "curves").mkdir(exist_ok=True)
        for name, curve in curves.items():
            (pub / "curves" / f"{name}.json").write_text(json.dumps(curve) + "\n")
        print(f"published to {pub}")


def cell_curve(pub: Path, name: str, group_curve: list[dict]) -> list[dict]:
    """A cell's held-out curve: the one committed beside the study (PUB/NAME, from its first
    training) where that holds more points than the group's own run, else the group's."""
    first = study.read_curve(pub / name) if (pub / name).is_dir() else []
    return first if len(first) > len(group_curve) else group_curve


if __name__ == "__main__":
    sys.exit(main())
