"""The EAGLE-3 paper's ablations on the embedded SmolLM2-135M-Instruct, sized for a 2-core CPU.

  .venv/bin/python -m eagle3_jax ablate --config configs/ablate_smollm2.py

One factor at a time around the default head (aux layers (2, 15, 27) of 30, TTT 7, no feature
loss, Vd 8192): which layers to fuse (the top layer alone, four layers, all low, all high), the TTT
length (1, 3), the EAGLE-1/2 feature-regression loss, and a larger draft vocabulary. Every cell
trains for the same steps on the same records in the same order from one feature store (11
layers incl. the final state), then decodes the same MT-bench questions with the same chain.
Training recipe: batch 1 at lr 1e-3, the fastest learner per token of configs/recipe_smollm2.py
(at batch 8 and lr 3e-4 the default cell ended at acc_0 0.05 and tau 1.01: nothing could differ).
Results: docs/experiments/2026-11-29-ablation-grid-160-conversations.md; the table lands in
runs/ablate_smollm2/report.md.
"""

from pathlib import Path

from eagle3_jax.ablation.config import AblationConfig, Cell
from eagle3_jax.training.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def get_config() -> AblationConfig:
    base = load_config(ROOT / "configs/smollm2_135m.py").replace(
        num_conversations=160,  # exactly the records 160 steps x batch 1 read, once
        epochs=0,
        batch_size=1,
        lr=1e-3,
        max_steps=160,  # ~5 min a cell (TTT 7) on 2 cores
        save_every=80,
        export_every=0,
        log_every=1,  # every step scored before its update: acc_i = mean over the last 40 records
    )
    return AblationConfig(
        base=base,
        cells=(
            Cell("default"),  # (2, 15, 27): low, middle, high
            Cell("top_layer_only", {"aux_layer_ids": (29,)}),  # input to the last layer
            Cell("four_layers", {"aux_layer_ids": (2, 10, 20, 27)}),
            Cell("all_low", {"aux_layer_ids": (1, 2, 3)}),
            Cell("all_high", {"aux_layer_ids": (26, 27, 28)}),
            Cell("ttt_1", {"ttt_steps": 1}),
            Cell("ttt_3", {"ttt_steps": 3}),
            Cell("feature_loss", {"feature_loss_weight": 1.0}),
            Cell("vd_16384", {"draft_vocab_size": 16384}),
        ),
        out_dir="runs/ablate_smollm2",
        bench="mt_bench",
        questions=1,  # per category: 8 questions, 2 turns each
        max_new_tokens=64,
        tree=(1, 4, 5),
        acc_records=40,  # acc_i: the last 40 records of each cell, each scored before its update
    )
