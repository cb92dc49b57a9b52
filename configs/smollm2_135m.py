"""EAGLE-3 head for the embedded SmolLM2-135M-Instruct, trained on a 2-core CPU.

This recipe made the head shipped before the GPU-trained one (configs/smollm2_135m_gpu.py; the
CPU head is in git history, its results in BENCHMARKS.md "The previous head"). It stays the
recipe for a CPU budget, and the base of the ablation and vocabulary grids.

Recipe:
  .venv/bin/python train.py --config=configs/smollm2_135m.py --precompute-features
  .venv/bin/python train.py --config=configs/smollm2_135m.py          # add --resume after a stop

Data: data/smollm2_135m_regenerated.jsonl.gz ships with the project: first user turns of the
ShareGPT V3 sample (shortest first; none from Spec-Bench, MT-bench or GSM8K), each answered by
SmolLM2 itself (greedy, its chat template, at most 256 new tokens). To rebuild it from ShareGPT:
  .venv/bin/python train.py --config=configs/smollm2_135m.py --precompute-features \
      --config.data=../shared/data/sharegpt/ShareGPT_V3_unfiltered_cleaned_split_first5000.json \
      --config.regenerate=true --config.num_conversations=2000
(answers are written, resumably, to out_dir/regenerated.jsonl; greedy, so the same text again).

Batch 1 at lr 1e-3 (two epochs, 1440 steps): at this budget more, smaller updates learn far faster
per token than batch 8 at 3e-4 (the recipe sweep in
docs/experiments/2026-11-29-ablation-grid-160-conversations.md). Vd 8192 keeps the head's
lm_head at a sixth of the target's. The target's features are computed
once (offline, ~2.4 GB float32 for 4 layers), length-bucketed batches skip the padding, and the
head's lm_head starts from the target's output embedding (head_init=target) so a short CPU run
does not spend its budget learning the output projection from noise.
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


def get_config() -> TrainConfig:
    return TrainConfig(
        corpus=CorpusConfig(
            target=None,
            data=str(ROOT / "data/smollm2_135m_regenerated.jsonl.gz"),
            regenerate=False,
            regen_max_new_tokens=256,
            regen_batch_size=64,  # XLA:CPU: a 64-row step costs ~1.8x an 8-row one
            num_conversations=0,
            max_len=512,
            length_bucket=64,
        ),
        store=StoreConfig(
            features="offline",
            features_dir="runs/smollm2_135m/features",
        ),
        head=HeadConfig(
            draft_vocab_size=8192,
            ttt_steps=7,
            head_init="target",
        ),
        optim=OptimConfig(
            lr=1e-3,
            warmup_ratio=0.015,
            epochs=2,
            batch_size=1,  # on a CPU budget the number of updates decides (recipe_smollm2.py)
            grad_accum=1,
        ),
        compute=ComputeConfig(
            param_dtype="float32",
            compute_dtype="float32",
        ),
        run=RunConfig(
            out_dir="runs/smollm2_135m",
            save_every=60,
            export_every=180,
            log_every=10,
        ),
    )
