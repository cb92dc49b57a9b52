"""A two-cell grid on a tiny target, for tests and smoke runs (pass the target and data):

  .venv/bin/python -m eagle3_jax ablate --config configs/ablate_tiny.py \
      --config.target=PATH --config.data=FILE --out runs/ablate_tiny
"""

from pathlib import Path

from eagle3_jax.ablation.config import AblationConfig, Cell
from eagle3_jax.training.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def get_config() -> AblationConfig:
    base = load_config(ROOT / "configs/tiny.py")
    return AblationConfig(
        base=base,
        cells=(
            Cell("default"),  # the target's (2, L//2, L-3)
            Cell(
                "top_layer_only", {"aux_layer_ids": (5,), "ttt_steps": 2}
            ),  # input to the last layer
        ),
        out_dir="runs/ablate_tiny",
        bench="mt_bench",
        questions=1,
        max_new_tokens=8,
        tree=(2, 2, 4),
    )
