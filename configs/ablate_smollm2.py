"""The EAGLE-3 paper's ablations on the embedded SmolLM2-135M-Instruct, sized for a 2-core CPU.

  .venv/bin/python -m eagle3_jax.ablate --config configs/ablate_smollm2.py

One factor at a time around the default head (aux layers (2, 15, 27) of 30, TTT 7, no feature
loss, Vd 8192): which layers to fuse (the top layer alone, four layers, all low, all high), the TTT
length (1, 3), the EAGLE-1/2 feature-regression loss, and a larger draft vocabulary. Every cell
trains for the same steps on the same records in the same order from one feature store (11
layers incl. the final state), then decodes the same MT-bench questions with the same chain.
The table lands in runs/ablate_smollm2/report.md (not measured yet on this CPU).
"""

import dataclasses
from pathlib import Path

from eagle3_jax.ablation import AblationConfig, Cell
from eagle3_jax.training.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def get_config() -> AblationConfig:
    base = dataclasses.replace(
        load_config(ROOT / "configs/smollm2_135m.py"),
        num_conversations=160,  # exactly the records 20 steps x batch 8 read
        epochs=0,
        max_steps=20,  # ~5 min a cell at ~14 s a step (TTT 7) on 2 cores: the grid fits an hour
        save_every=10,
        export_every=0,
        log_every=1,  # every step scored before its update: acc_i = mean of the last 5 (unseen)
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
        acc_window=5,
    )
