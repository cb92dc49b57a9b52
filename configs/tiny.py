"""A tiny setup for tests and smoke runs: a few conversations, short sequences, a handful of steps.

Launch (tests pass `--config.target` pointing at a tiny random checkpoint and `--config.data`):
  .venv/bin/python train.py --config=configs/tiny.py --config.target=PATH --config.data=FILE
"""

from eagle3_jax.training.config import TrainConfig
from eagle3_jax.training.config_groups import CorpusConfig, HeadConfig, OptimConfig, RunConfig


def get_config() -> TrainConfig:
    return TrainConfig(
        corpus=CorpusConfig(
            target=None,
            data="",
            regenerate=False,
            max_len=64,
        ),
        head=HeadConfig(
            draft_vocab_size=64,
            ttt_steps=3,
        ),
        optim=OptimConfig(
            lr=3e-3,
            warmup_ratio=0.1,
            max_steps=20,
            batch_size=4,
        ),
        run=RunConfig(
            out_dir="runs/tiny",
            save_every=5,
            log_every=1,
            export_dtype="float32",
        ),
    )
