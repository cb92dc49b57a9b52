"""EAGLE-3 head for OLMo-2-0425-1B-Instruct (the SpecVocab paper's small target), one 8-chip host.

Launch:
  python train.py --config=configs/olmo2_1b.py --config.target=/ckpt/OLMo-2-0425-1B-Instruct \
      --config.data=/data/sharegpt_ultrachat.jsonl
Paper hyperparameters: lr 5e-5, 1.5 % warmup, TTT 7, bf16, max length 2048, Vd 32000.
"""

from eagle3_jax.training.config import TrainConfig
from eagle3_jax.training.config_groups import (
    ComputeConfig,
    CorpusConfig,
    HeadConfig,
    OptimConfig,
    RunConfig,
)


def get_config() -> TrainConfig:
    return TrainConfig(
        corpus=CorpusConfig(
            target="/ckpt/OLMo-2-0425-1B-Instruct",
            data="/data/sharegpt_ultrachat.jsonl",
            regen_max_new_tokens=2048,
            regen_batch_size=64,
            max_len=2048,
        ),
        head=HeadConfig(
            draft_vocab_size=32000,
            ttt_steps=7,
        ),
        optim=OptimConfig(
            lr=5e-5,
            warmup_ratio=0.015,
            epochs=10,
            batch_size=16,
        ),
        compute=ComputeConfig(
            param_dtype="bfloat16",
            compute_dtype="bfloat16",
            mesh_data=8,
            mesh_model=1,
        ),
        run=RunConfig(
            out_dir="runs/olmo2_1b",
            save_every=1000,
            log_every=20,
        ),
    )
