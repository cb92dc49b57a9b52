"""Learning rate x batch size for the embedded SmolLM2 head at a fixed token budget (CPU).

  .venv/bin/python -m eagle3_jax ablate --config configs/recipe_smollm2.py --no-eval

Every cell reads the same 160 regenerated records once (27,459 tokens, 19,959 of them supervised
answer tokens): batch 8 for 20 steps, batch 2 for 80 or batch 1 for 160, at lr 3e-4 (the first
shipped head's recipe), 1e-3 or 3e-3. (The order differs with the batch size: length buckets group
32 batches' worth of records.) A CPU run is far below any critical batch size, so more, smaller
updates per token should learn faster; this grid measures by how much (progressive validation:
acc_i over each cell's last 40 records, each scored before the update that sees it). It shares
the feature store of configs/ablate_smollm2.py (link runs/recipe_smollm2/features to it, or let
it precompute).
"""

from pathlib import Path

from eagle3_jax.ablation.config import AblationConfig, Cell
from eagle3_jax.training.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def get_config() -> AblationConfig:
    base = load_config(ROOT / "configs/smollm2_135m.py").replace(
        num_conversations=160,
        epochs=0,
        batch_size=8,
        lr=3e-4,
        max_steps=20,
        save_every=10,
        export_every=0,
        log_every=1,
    )
    return AblationConfig(
        base=base,
        cells=(
            Cell("b8_lr3e-4"),
            Cell("b8_lr1e-3", {"lr": 1e-3}),
            Cell("b2_lr3e-4", {"batch_size": 2, "max_steps": 80, "save_every": 40}),
            Cell("b2_lr1e-3", {"batch_size": 2, "max_steps": 80, "save_every": 40, "lr": 1e-3}),
            Cell("b2_lr3e-3", {"batch_size": 2, "max_steps": 80, "save_every": 40, "lr": 3e-3}),
            Cell("b1_lr1e-3", {"batch_size": 1, "max_steps": 160, "save_every": 80, "lr": 1e-3}),
        ),
        out_dir="runs/recipe_smollm2",
        evaluate=False,
        acc_records=40,  # the last 40 records of every cell, each scored before its update
    )
