#!/usr/bin/env python
"""The draft-vocabulary study, end to end and resumable: train, cut, measure, report.

  .venv/bin/python benchmarks/vocab_study.py                      # the SmolLM2 study (issue 33)
  .venv/bin/python benchmarks/vocab_study.py --grid configs/vocab_study_olmo2_1b.py \
      --config.target=/ckpt/OLMo-2-0425-1B-Instruct --config.data=/data/prompts.jsonl  # a GPU

`--config.FIELD=VALUE` overrides the grid's base TrainConfig (every cell), as `ablate` takes it.
What the flags leave open comes from the grid: FR-Spec/VocabTrim sizes = its EAGLE-3 cells'
vocabularies, the reference = its first EAGLE-3 cell, the trees = its tree (plus this machine's
default tree on a CPU), replay on a CPU backend only.

Stages (rerun the same command after any stop; each stage resumes or skips what is done):
  1. the grid's heads are trained (`python -m eagle3_jax ablate --config GRID`: one feature store,
     the same data in the same order, the same step budget for every cell);
  2. token counts: FR-Spec's from --frspec-corpus (a general corpus, every role), VocabTrim's from
     target-generated text (the regenerated answers the heads were trained on);
  3. FR-Spec and VocabTrim heads at every --sizes, cut from the target-lm_head and full-vocabulary
     cells (`python -m eagle3_jax vocab trim`);
  4. drafting time per step of every head at each tree's top-k, and per round of the tree
     (benchmarks/draft_cost.py);
  5. one harness run per tree (--trees; `cpu` is decode.py's default tree on this machine):
     plain decoding and every head, interleaved per question, each head at its own vocabulary;
     on an accelerator every tree decodes for real (τ and speedup); on a CPU the `cpu` tree does,
     and at the other trees each head is replayed over plain decoding's greedy answers (`eval
     --replay`: the same τ as decoding, draft-only rounds, so ten heads at the 60-node tree cost
     hours less; their speed is stage 4's drafting time; untimed, they run --replay-batch-size
     questions a batch);
  6. SpecVocab's speculator recall on held-out answers (benchmarks/speculator_recall.py);
  7. the report (eagle3_jax.evaluation.study): the paper-shaped table, per-question paired
     intervals against --reference, drafting time per step and per round, training curves, plots.
     With --publish DIR: report.md, summary.json, the plots, draft costs, the curves and one
     results.json.gz per tree are copied there (the study's committed results).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import jax

from eagle3_jax.ablation.config import load_ablation
from eagle3_jax.ablation.status import cell_status, running_line, status_lines
from eagle3_jax.checkpoints import files_digest
from eagle3_jax.checkpoints.atomic import exclusive, made_from, record_inputs
from eagle3_jax.data.conversations import read_conversations
from eagle3_jax.errors import Eagle3Error, Stopped
from eagle3_jax.evaluation import study
from eagle3_jax.evaluation.fingerprint import head_digest
from eagle3_jax.evaluation.options import _parse_tree, default_tree_shape, shape_text
from eagle3_jax.evaluation.questions import load_questions
from eagle3_jax.training.config import apply_overrides

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SHARED = ROOT.parent / "shared/data"


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
    ap.add_argument("--skip-train", action="store_true", help="the grid's heads exist: stage 1 off")
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
    generated = args.generated or (
        str(root / "shared" / "regenerated.jsonl") if corpus.regenerate else corpus.data
    )
    shared = SHARED / "sharegpt/ShareGPT_V3_unfiltered_cleaned_split_first5000.json"
    frspec = args.frspec_corpus or str(
        shared if shared.exists() else ROOT / "data/sharegpt_conversations.jsonl.gz"
    )
    return dict(trees=trees, replay=replay, generated=generated, frspec=frspec)


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
    grid = load_ablation(args.grid)
    grid = dataclasses.replace(grid, base=apply_overrides(grid.base, overrides))
    root = grid_root(grid)
    out = Path(args.out)
    have = lambda paths: (  # noqa: E731
        ", ".join(p.name for p in paths if not p.name.endswith(".inputs.json")) or "none yet"
    )
    evals = {p.name.removeprefix("eval_"): p for p in sorted(out.glob("eval_*")) if p.is_dir()}
    return [
        running_line(out, "study"),
        *status_lines(cell_status(grid, root), {}),
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


def study_stages(args: argparse.Namespace, overrides: list[str], out: Path) -> None:
    grid = load_ablation(args.grid)
    grid = dataclasses.replace(grid, base=apply_overrides(grid.base, overrides))
    root = grid_root(grid)
    st = settings(args, grid, root)
    model = []  # the target (and dtype) every stage that loads one reads
    if grid.base.corpus.target:
        model += ["--target", str(grid.base.corpus.target)]
    if not args.skip_train:  # 1
        run([PY, "-m", "eagle3_jax", "ablate", "--config", args.grid, "--no-eval",
             "--no-progress", *overrides])  # fmt: skip
    vocab_size = json.loads((root / "cells" / grid.cells[0].name / "head/config.json").read_text())[
        "vocab_size"
    ]
    heads = [study.head_of_cell(c.name, c.overrides, vocab_size) for c in grid.cells]
    paths = {c.name: root / "cells" / c.name / "head" for c in grid.cells}
    counts = {"frspec": out / "counts_frspec.npy", "vocabtrim": out / "counts_generated.npy"}
    for family, corpus, roles in (("frspec", st["frspec"], "all"),
                                  ("vocabtrim", st["generated"], "assistant")):  # fmt: skip
        made(counts[family], {"corpus": files_digest(corpus.split(",")), "roles": roles},  # 2
             lambda c=corpus, r=roles, f=family: run(
                 [PY, "-m", "eagle3_jax", "vocab", "count", "--corpus", c, "--roles", r,
                  "--out", str(counts[f]), *model[:2]]))  # fmt: skip
    sources = {h.family: h.name for h in heads if h.family in ("target_lm_head", "full")}
    sizes, reference = from_heads(args, heads)
    for size in sizes:  # 3
        for family, src in (("frspec", "target_lm_head"), ("vocabtrim", "full")):
            if src not in sources:
                continue
            name = f"{family}_{size}"
            dst = out / "heads" / name
            made(dst, {"source": head_digest(paths[sources[src]]), "size": size,
                       "counts": files_digest([counts[family]])},
                 lambda s=sources[src], f=family, n=size, d=dst: run(
                     [PY, "-m", "eagle3_jax", "vocab", "trim", "--draft", str(paths[s]),
                      "--counts", str(counts[f]), "--size", str(n), "--out", str(d), *model[:2]]))  # fmt: skip
            heads.append(
                study.StudyHead(name, family, size, f"cut from {sources[src]}", vocab_size)
            )
            paths[name] = dst
    drafts = [f"{h.name}={paths[h.name]}" for h in heads]
    digests = {h.name: head_digest(paths[h.name]) for h in heads}
    trees = tree_shapes(st["trees"])
    costs, runs = {}, {}
    for name, shape in trees.items():
        cost = out / f"draft_cost_{name}.json"
        cmd = [PY, "benchmarks/draft_cost.py", "--out", str(cost), "--top-k", str(shape[0]),
               "--rows", ",".join(dict.fromkeys(["1", str(shape[0])])),
               "--tree", shape_text(shape), *model]  # fmt: skip
        for d in drafts:
            cmd += ["--draft", d]
        timing = {"round": "timed whole", "timing": "heads in turns"}
        made(cost, {"heads": digests, "tree": list(shape), **timing}, lambda c=cmd: run(c))  # 4
        costs[name] = {r["head"]: r for r in json.loads(cost.read_text())["rows"]}
        ev = [PY, "-m", "eagle3_jax", "eval", "--methods", f"vanilla,eagle3:{shape_text(shape)}",
              "--bench", args.bench, "--questions", str(args.questions), "--draft-vocab", "full",
              "--max-new-tokens", str(args.max_new_tokens), "--no-progress",
              "--out", str(out / f"eval_{name}"), *model]  # fmt: skip
        if grid.dtype:
            ev += ["--dtype", grid.dtype]
        if args.mesh:
            ev += ["--mesh", args.mesh]
        if st["replay"] and name != "cpu":  # τ only: each head replayed over vanilla's answers
            ev += ["--replay", "--batch-size", str(args.replay_batch_size)]
        for d in drafts:
            ev += ["--draft", d]
        run(ev)  # 5 (resumes from its records)
        runs[name] = json.loads((out / f"eval_{name}" / "results.json").read_text())
    recall = out / "speculator_recall.json"
    spec_heads = [h.name for h in heads if h.family == "specvocab"]
    if spec_heads:  # 6
        held_out = grid.base.run.val_data.split(",")[0]  # never trained on
        n = min(40, len(read_conversations(held_out)[0])) if held_out else 0
        ks = [k for k in (64, 256, 1024, 2048) if k < vocab_size] or [max(vocab_size // 4, 1)]
        cmd = [PY, "benchmarks/speculator_recall.py", "--out", str(recall), *model,
               "--k", ",".join(map(str, ks))]  # fmt: skip
        if n:
            cmd += ["--data", str(held_out), "--records", f"0:{n}"]
        for name in spec_heads:
            cmd += ["--draft", f"{name}={paths[name]}"]
        made(recall, {"heads": {n: digests[n] for n in spec_heads}}, lambda: run(cmd))
    curves = {c.name: study.read_curve(root / "cells" / c.name) for c in grid.cells}  # 7
    timed = [
        json.loads(p.read_text()) for p in sorted(Path(args.round_cost).glob("*/results.json"))
    ]
    text, summary = study.report(runs, heads, reference, costs, curves, timed)
    if recall.exists():
        text += "\n## SpecVocab speculator recall (held-out answers, first draft step)\n\n"
        text += recall.with_suffix(".md").read_text()
    (out / "report.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    pngs = study.plot(summary, curves, out)
    print(text)
    if args.publish:
        pub = Path(args.publish)
        pub.mkdir(parents=True, exist_ok=True)
        for p in [out / "report.md", out / "summary.json", *pngs, *out.glob("draft_cost_*.json")]:
            shutil.copy2(p, pub / p.name)
        for name in trees:
            with gzip.open(pub / f"results_{name}.json.gz", "wt") as f:
                f.write((out / f"eval_{name}" / "results.json").read_text())
        for c in grid.cells:
            (pub / "curves").mkdir(exist_ok=True)
            (pub / "curves" / f"{c.name}.json").write_text(json.dumps(curves[c.name]) + "\n")
        print(f"published to {pub}")


if __name__ == "__main__":
    sys.exit(main())
