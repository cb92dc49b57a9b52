"""EAGLE-3 head for the embedded SmolLM2-135M-Instruct trained on one GPU: the first stage of the
shipped head (and the shipped head itself until commit 6a4a2ae; since then grown to 16,384 ids
and trained on a CPU, configs/smollm2_135m_vd16k_cpu.py).

The same head as configs/smollm2_135m.py (Vd 8192, aux layers 2/15/27, TTT 7, lm_head from the
target's output embedding), trained on all the regenerated data for 16 epochs, with the target's
features computed online in the step, batch 16 and one compiled shape (no length buckets: on a GPU
a padded row costs little, a new shape costs a compilation).

  python train.py --config=configs/smollm2_135m_gpu.py                       # 16 epochs, 4,448 steps
  python -m eagle3_jax train-timed --config=configs/smollm2_135m_gpu.py --minutes=8

(timed.py fits max_steps to a wall-clock budget, at most the 16 epochs, and writes its plan to
out_dir/timed.json.) That head: 4,448 steps, 19.3M tokens read, 5.1 minutes of training on
one H200 (0.069 s a step; the job, from the GGUF to the exported head, took 7.4 minutes with the
regeneration of the third file); BENCHMARKS.md has its measurements and the device log, the
model card of eagle3_jax/heads/smollm2_135m_instruct the stages after it.

Data: three files, 4,452 conversations (data/README.md): the CPU regeneration of
configs/smollm2_135m.py (720: first user turns of the first 2,000 ShareGPT V3 records that fit 256
tokens), its continuation (924) and data/smollm2_135m_regenerated_gpu.jsonl.gz (2,808: the other
ShareGPT prompts of ../shared/data/sharegpt/, deduplicated by text, none from Spec-Bench, MT-bench
or GSM8K, answered by SmolLM2 on the GPU, greedy, 256 new tokens at most). That head read
4,451 of them: the JSON Lines reader of that day (fixed since) dropped x2koHPp_9, whose text
holds U+2028.
"""

from pathlib import Path

from eagle3_jax.training.config import TrainConfig
from eagle3_jax.training.config_groups import (
    ComputeConfig,
    CorpusConfig,
    HeadConfig,
    OptimConfig,
    RunConfig,
    StoreConfig,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = ",".join(
    str(ROOT / "data" / f)
    for f in (
        "smollm2_135m_regenerated.jsonl.gz",
        "smollm2_135m_regenerated_more.jsonl.gz",
        "smollm2_135m_regenerated_gpu.jsonl.gz",
    )
)


def get_config() -> TrainConfig:
    return TrainConfig(
        corpus=CorpusConfig(
            target=None,
            data=DATA,
            regenerate=False,
            num_conversations=0,
            max_len=512,
            length_bucket=0,
        ),
        store=StoreConfig(
            features="online",
        ),
        head=HeadConfig(
            draft_vocab_size=8192,
            ttt_steps=7,
            head_init="target",
        ),
        optim=OptimConfig(
            lr=1e-3,
            warmup_ratio=0.02,
            epochs=16,  # a cap: timed.py plans max_steps from the measured step time
            batch_size=16,
            grad_accum=1,
        ),
        compute=ComputeConfig(
            param_dtype="float32",
            compute_dtype="float32",
        ),
        run=RunConfig(
            out_dir="runs/smollm2_135m_gpu",
            save_every=250,
            keep_checkpoints=2,
            log_every=20,
        ),
    )
