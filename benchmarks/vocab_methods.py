#!/usr/bin/env python
"""The draft-vocabulary comparison on one bench, in one run: EAGLE-3 reduced, full vocabulary,
FR-Spec, VocabTrim and SpecVocab (and the target-lm_head head FR-Spec is cut from).

  .venv/bin/python benchmarks/vocab_methods.py [--grid configs/vocab_smollm2.py] \
      [--frspec-corpus FILE] [--size 8192] [--bench spec_bench --questions 1]

Stages, each resumable (rerun the same command after a stop):
  1. the grid's heads are trained (python -m eagle3_jax ablate on --grid: one feature store, same
     data, order and step budget);
  2. token counts: FR-Spec's from --frspec-corpus (every role; default the ShareGPT sample, human
     and ChatGPT text, as a general corpus), VocabTrim's from target-generated text (the
     regenerated answers the heads were trained on);
  3. FR-Spec and VocabTrim heads of Vd --size are cut from the target-lm_head and full heads;
  4. one harness run: vanilla and every head, interleaved per question (tau, throughput, speedup
     per task, exactness);
  5. drafting time per step of every head (benchmarks/draft_cost.py);
  6. SpecVocab's speculator recall on held-out answers (benchmarks/speculator_recall.py).
Writes OUT/report.md (the harness table + drafting times) beside the harness's own outputs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--grid", default=str(ROOT / "configs/vocab_smollm2.py"))
    ap.add_argument(
        "--frspec-corpus",
        default=str(
            ROOT.parent / "shared/data/sharegpt/ShareGPT_V3_unfiltered_cleaned_split_first5000.json"
        ),
    )
    ap.add_argument(
        "--generated", default=str(ROOT / "data/smollm2_135m_regenerated.jsonl.gz"),
        help="target-generated text for VocabTrim's counts",
    )  # fmt: skip
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--bench", default="spec_bench")
    ap.add_argument("--questions", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--tree", default="1,4,5")
    ap.add_argument("--out", default=str(ROOT / "runs/vocab_methods"))
    args = ap.parse_args()

    from eagle3_jax.ablation import load_ablation

    grid = load_ablation(args.grid)
    cells = (
        Path(grid.out_dir if Path(grid.out_dir).is_absolute() else ROOT / grid.out_dir) / "cells"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run([PY, "-m", "eagle3_jax", "ablate", "--config", args.grid])  # 1
    heads = {c.name: cells / c.name / "head" for c in grid.cells}
    counts = {"frspec": out / "counts_frspec.npy", "vocabtrim": out / "counts_generated.npy"}
    if not counts["frspec"].exists():  # 2
        run([PY, "-m", "eagle3_jax", "vocab", "count", "--corpus", args.frspec_corpus,
             "--roles", "all", "--out", str(counts["frspec"])])  # fmt: skip
    if not counts["vocabtrim"].exists():
        run([PY, "-m", "eagle3_jax", "vocab", "count", "--corpus", args.generated,
             "--roles", "assistant", "--out", str(counts["vocabtrim"])])  # fmt: skip
    derived = {"frspec": ("target_lm_head", "frspec"), "vocabtrim": ("full_vocab", "vocabtrim")}
    for name, (src, cnt) in derived.items():  # 3
        dst = out / "heads" / name
        if not (dst / "config.json").exists():
            run([PY, "-m", "eagle3_jax", "vocab", "trim", "--draft", str(heads[src]),
                 "--counts", str(counts[cnt]), "--size", str(args.size), "--out", str(dst)])  # fmt: skip
        heads[name] = dst
    drafts = [f"{n}={p}" for n, p in heads.items()]
    ev = [PY, "-m", "eagle3_jax", "eval", "--methods", f"vanilla,eagle3:{args.tree}",
          "--bench", args.bench, "--questions", str(args.questions),
          "--max-new-tokens", str(args.max_new_tokens), "--out", str(out / "eval")]  # fmt: skip
    for d in drafts:
        ev += ["--draft", d]
    run(ev)  # 4
    cost = out / "draft_cost.json"
    if not cost.exists():  # 5
        cmd = [PY, "benchmarks/draft_cost.py", "--out", str(cost)]
        for d in drafts:
            cmd += ["--draft", d]
        run(cmd)
    recall = out / "speculator_recall.json"
    spec_heads = [c.name for c in grid.cells if c.overrides.get("speculator_rank")]
    if spec_heads and not recall.exists():  # 6
        cmd = [PY, "benchmarks/speculator_recall.py", "--out", str(recall)]
        for name in spec_heads:
            cmd += ["--draft", f"{name}={heads[name]}"]
        run(cmd)
    report = (out / "eval" / "report.md").read_text()
    rows = json.loads(cost.read_text())["rows"]
    lines = [report, "## Drafting time per step (ms, one draft step: layer + output top-k)", ""]
    rcols = [k for k in rows[0] if k.startswith("step_ms_") or k.startswith("output_ms_")]
    lines.append("| head | output layer | " + " | ".join(rcols) + " |")
    lines.append("|" + " --- |" * (2 + len(rcols)))
    for r in rows:
        lines.append(
            f"| {r['head']} | {r['kind']} | " + " | ".join(f"{r[c]:.2f}" for c in rcols) + " |"
        )
    if recall.exists():
        lines += ["", "## SpecVocab speculator recall (held-out answers, first draft step)", ""]
        lines.append(recall.with_suffix(".md").read_text())
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
