"""The draft-vocabulary study on Qwen3-4B (d 2,560): configs/vocab_study_paper.py's
four cells on configs/qwen3_4b.py's recipe (one 8-chip host; one GPU with --config.mesh_data=1).

  python benchmarks/vocab_study.py --grid configs/vocab_study_qwen3_4b.py \\
      --config.target=CKPT --config.data=PROMPTS --publish benchmarks/results/vocab_study_qwen3_4b
"""

import sys
from pathlib import Path

from eagle3_jax.training.config import load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "configs"))
from vocab_study_paper import paper_grid  # noqa: E402


def get_config():
    return paper_grid(load_config(ROOT / "configs/qwen3_4b.py"), "qwen3_4b", hidden_size=2560)
