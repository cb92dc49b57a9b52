"""EAGLE-3 head for Llama-3.1-8B-Instruct on an accelerator pod (the paper's recipe).

Launch on one host with 8 chips (tensor parallel 4 x data parallel 2), target on local disk:
  python train.py --config=configs/llama31_8b.py --config.target=/ckpt/Llama-3.1-8B-Instruct \
      --config.data=/data/sharegpt_ultrachat.jsonl
Multi-host: the same command on every host (jax.distributed.initialize() runs when launched so).

Hyperparameters: AdamW (0.9, 0.95), wd 0, lr 5e-5, 1.5 % warmup then cosine, clip 0.5, TTT 7,
bf16 compute, max length 2048, Vd 32000 (the published head's draft vocabulary).
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
            target="/ckpt/Llama-3.1-8B-Instruct",
            data="/data/sharegpt_ultrachat.jsonl",
            regenerate=True,
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
            grad_accum=1,
        ),
        compute=ComputeConfig(
            param_dtype="bfloat16",
            compute_dtype="bfloat16",
            mesh_data=2,
            mesh_model=4,
        ),
        run=RunConfig(
            out_dir="runs/llama31_8b",
            save_every=1000,
            log_every=20,
        ),
    )
