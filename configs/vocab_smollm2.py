"""The draft-vocabulary comparison's trained heads on the embedded SmolLM2-135M-Instruct: one data
set, one step budget, one feature store, four output layers.

  .venv/bin/python -m eagle3_jax.ablate --config configs/vocab_smollm2.py

Cells: the EAGLE-3 reduced head (Vd 8192), a full-vocabulary head with its own lm_head (VocabTrim's
source), a head on the target's frozen output embedding (FR-Spec's source) and SpecVocab (the same
plus a rank-72 = d/8 speculator, auxiliary loss weight 0.1). benchmarks/vocab_methods.py then
derives the FR-Spec and VocabTrim heads and measures all six in one harness run (runs/vocab_methods/
report.md; not measured yet on this CPU). Full-vocabulary cells recompute each TTT step in the
backward pass (remat): their [B, T, 49152] logits would not fit 24 GB seven times over.
"""

import dataclasses
from pathlib import Path

from eagle3_jax.ablation import AblationConfig, Cell
from eagle3_jax.training.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def get_config() -> AblationConfig:
    base = dataclasses.replace(
        load_config(ROOT / "configs/smollm2_135m.py"),
        num_conversations=400,
        epochs=0,
        max_steps=30,
        save_every=10,
        export_every=0,
        log_every=5,
    )
    full = {"draft_vocab_size": 49152, "remat": True}
    return AblationConfig(
        base=base,
        cells=(
            Cell("eagle3_vd8192"),
            Cell("full_vocab", full),
            Cell("target_lm_head", {**full, "lm_head_source": "target"}),
            Cell("specvocab", {**full, "lm_head_source": "target", "speculator_rank": 72}),
        ),
        out_dir="runs/vocab_smollm2",
        bench="mt_bench",
        questions=1,
        max_new_tokens=96,
        tree=(1, 4, 5),
    )
