"""The draft-vocabulary study on OLMo-2-0425-1B-Instruct (the SpecVocab paper's small target, d 2,048):
configs/vocab_study_paper.py's four cells on configs/olmo2_1b.py's recipe (one 8-chip host; one GPU
with --config.mesh_data=1).

  python benchmarks/vocab_study.py --grid configs/vocab_study_olmo2_1b.py \\
      --config.target=CKPT --config.data=PROMPTS --publish benchmarks/results/vocab_study_olmo2_1b
"""

import sys
from pathlib import Path

from eagle3_jax.training.config import load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "configs"))
from vocab_study_paper import paper_grid  # noqa: E402


def get_config():
    return paper_grid(load_config(ROOT / "configs/olmo2_1b.py"), "olmo2_1b", hidden_size=2048)
