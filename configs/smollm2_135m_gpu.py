"""EAGLE-3 head for the embedded SmolLM2-135M-Instruct, trained on one GPU in a few minutes.

The same head as configs/smollm2_135m.py (Vd 8192, aux layers 2/15/27, TTT 7, lm_head from the
target's output embedding), trained on all the regenerated data with the target's features computed
online in the step, larger batches and one compiled shape (no length buckets: on a GPU a padded
row costs little, a new shape costs a compilation).

  python -m eagle3_jax.training.timed --config=configs/smollm2_135m_gpu.py --minutes=5
  python train.py --config=configs/smollm2_135m_gpu.py --config.max_steps=N   # the same run again

(timed.py fits max_steps to the budget and writes it to out_dir/timed.json; the model card of
eagle3_jax/heads/smollm2_135m_instruct gives the N, machine and wall time of the shipped head.)

Data: three files, 4,453 conversations: the CPU regeneration of configs/smollm2_135m.py (720, the
first user turns of the first 2,000 ShareGPT V3 records that fit 256 tokens), its continuation
(924 more from those 2,000) and data/smollm2_135m_regenerated_gpu.jsonl.gz: the other ShareGPT
prompts of ../shared/data/sharegpt/ (records 2,000-4,999 of the V3 sample and the sg_90k sample),
deduplicated by text against each other and the first two files, none from Spec-Bench, MT-bench or
GSM8K, at most 256 prompt tokens, answered by SmolLM2 on the GPU (greedy, 256 new tokens at most;
data/README.md).
"""

from pathlib import Path

from eagle3_jax.training.config import TrainConfig

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
        target=None,
        data=DATA,
        regenerate=False,
        num_conversations=0,
        max_len=512,
        length_bucket=0,
        draft_vocab_size=8192,
        ttt_steps=7,
        head_init="target",
        lr=1e-3,
        warmup_ratio=0.02,
        epochs=16,  # a cap: timed.py plans max_steps from the measured step time
        batch_size=16,
        grad_accum=1,
        param_dtype="float32",
        compute_dtype="float32",
        features="online",
        out_dir="runs/smollm2_135m_gpu",
        save_every=250,
        keep_checkpoints=2,
        log_every=20,
    )
