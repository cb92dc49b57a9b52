"""EAGLE-3 head for Qwen3-4B on an accelerator host (8 chips: data 4 x model 2).

Launch:
  python train.py --config=configs/qwen3_4b.py --config.target=/ckpt/Qwen3-4B \
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
            target="/ckpt/Qwen3-4B",
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
            mesh_data=4,
            mesh_model=2,
        ),
        run=RunConfig(
            out_dir="runs/qwen3_4b",
            save_every=1000,
            log_every=20,
        ),
    )
