#!/usr/bin/env python
"""tau against training tokens: every head a training run exported (`export_every`), decoded greedily
on the same questions with the same tree.

  .venv/bin/python benchmarks/tau_curve.py --run runs/smollm2_135m --bench mt_bench --questions 2 \
      --tree 1,4,5 --max-new-tokens 128 --out benchmarks/results/tau_curve

Heads are read from RUN/heads/step_*/ and RUN/head/ (the final one), each with training.json (step,
tokens seen). Greedy outputs do not depend on the head, so every head answers the same prompts
(MT-bench turn 2 is conditioned on the model's own turn-1 answer, as in the harness). Per head one
line is appended to OUT/curve.jsonl (resumable: heads already there are skipped); then a table is
printed and OUT/curve.json and OUT/tau_curve.png are written. Only tau is measured (no timing), so
the run may share the machine with other work.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def heads_of(run: Path) -> list[tuple[int, int, Path]]:
    """(step, tokens, path) of every exported head of a run, by step."""
    found = []
    for d in [*sorted((run / "heads").glob("step_*")), run / "head"]:
        info = d / "training.json"
        if (d / "config.json").is_file() and info.is_file():
            t = json.loads(info.read_text())
            found.append((int(t["step"]), int(t["tokens"]), d))
    return sorted(set(found))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run", required=True, help="a train.py out_dir with exported heads")
    p.add_argument("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--bench", default="mt_bench")
    p.add_argument("--questions", type=int, default=2, help="per task (category)")
    p.add_argument("--tree", default="1,4,5", help="top_k,depth,total_tokens")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--steps", default=None, help="comma list: only the heads of these steps")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/tau_curve"))
    args = p.parse_args(argv)

    from tqdm import tqdm

    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.checkpoints.heads import load_head
    from eagle3_jax.decoding.sampling import Sampling
    from eagle3_jax.evaluation import metrics
    from eagle3_jax.evaluation.batch import Models, run_questions
    from eagle3_jax.evaluation.options import MethodSpec
    from eagle3_jax.evaluation.questions import load_questions
    from eagle3_jax.evaluation.report import strict_json

    run, out = Path(args.run), Path(args.out)
    heads = heads_of(run)
    if args.steps:
        keep = {int(x) for x in args.steps.split(",")}
        heads = [h for h in heads if h[0] in keep]
    if not heads:
        print(f"error: no exported heads (with training.json) under {run}", file=sys.stderr)
        return 2
    tree = tuple(int(x) for x in args.tree.split(","))
    questions = load_questions(args.bench, args.questions)
    out.mkdir(parents=True, exist_ok=True)
    curve_path = out / "curve.jsonl"
    rows = (
        [json.loads(x) for x in curve_path.read_text().splitlines()] if curve_path.exists() else []
    )
    setup = {
        "run": str(run.resolve()),
        "bench": args.bench,
        "questions": args.questions,
        "tree": list(tree),
        "max_new_tokens": args.max_new_tokens,
    }
    rows = [r for r in rows if r["setup"] == setup]
    done = {r["head"] for r in rows}
    todo = [h for h in heads if str(h[2].resolve()) not in done]

    if todo:
        target = load_target(args.target)
        for step, tokens, path in tqdm(todo, desc="heads"):
            models = Models(target, {"h": load_head(path, target)})
            m = MethodSpec("eagle3", "eagle3", tree, "h")
            recs = []
            for q in questions:
                recs += run_questions(models, m, [q], Sampling(), 0, args.max_new_tokens)
            per_task = {}
            for r in recs:
                per_task.setdefault(r["task"], []).append(r)
            row = strict_json(
                {
                    "setup": setup,
                    "head": str(path.resolve()),
                    "step": step,
                    "tokens": tokens,
                    "tau": metrics.tau(recs),
                    "tau_by_task": {k: metrics.tau(v) for k, v in per_task.items()},
                    "acceptance_by_depth": metrics.acceptance_by_depth(recs),
                    "new_tokens": sum(r["new_tokens"] for r in recs),
                }
            )
            with open(curve_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            rows.append(row)

    rows.sort(key=lambda r: r["step"])
    print(f"tau on {args.bench} ({len(questions)} questions, tree {args.tree}, greedy)")
    print(f"{'step':>7} {'tokens':>10} {'tau':>6}  alpha by depth")
    for r in rows:
        alphas = " ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_by_depth"] or [])
        print(f"{r['step']:>7} {r['tokens']:>10} {r['tau']:>6.2f}  {alphas}")
    (out / "curve.json").write_text(json.dumps(rows, indent=1) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["tokens"] / 1e6 for r in rows], [r["tau"] for r in rows], "o-")
    ax.set_xlabel("training tokens seen (millions)")
    ax.set_ylabel(f"tau ({args.bench}, tree {args.tree})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "tau_curve.png", dpi=120)
    print(f"wrote {out / 'curve.json'} and {out / 'tau_curve.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
