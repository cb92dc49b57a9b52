"""Train the new rows of the GPU SmolLM2 head grown to 16,384 draft ids, on this CPU: the shipped head.

`python -m eagle3_jax vocab extend` grows the GPU head (Vd 8,192; configs/smollm2_135m_gpu.py, the shipped head
until commit 6a4a2ae: GPU_HEAD below is that directory, `git show 6a4a2ae:eagle3_jax/heads/
smollm2_135m_instruct/config.json` and `.../model.safetensors`) to 16,384 ids without training: the new
rows are the target's output-embedding rows through a ridge-fitted map (BENCHMARKS.md, "A larger
draft vocabulary"). This config continues that head with configs/smollm2_135m_cpu2.py's recipe
(the same new first turns, data/smollm2_135m_regenerated_cpu2.jsonl.gz, lr 2e-4, batch 4), for
300 steps, so the new rows train on answers that use them; the two runs differ only in the head
they start from (and 60 fewer steps here).

  python -m eagle3_jax vocab count --corpus data/smollm2_135m_regenerated.jsonl.gz \
      --corpus data/smollm2_135m_regenerated_more.jsonl.gz \
      --corpus data/smollm2_135m_regenerated_gpu.jsonl.gz \
      --corpus data/smollm2_135m_regenerated_cpu2.jsonl.gz --out runs/vocab16k/counts.npy
  python -m eagle3_jax vocab extend --draft GPU_HEAD \
      --counts runs/vocab16k/counts.npy --size 16384 --out runs/vocab16k/head
  python train.py --config=configs/smollm2_135m_vd16k_cpu.py             # about an hour here
  python train.py --config=configs/smollm2_135m_vd16k_cpu.py --resume    # after an interruption
  python train.py --config=configs/smollm2_135m_vd16k_cpu.py --resume --config.max_steps=400
      # 100 more steps on the next, unseen conversations
  python train.py --config=configs/smollm2_135m_vd16k_cpu.py --resume --config.max_steps=600
      # 200 more: the shipped weights
  python -m eagle3_jax vocab order --draft runs/cpu3_16k/head \
      --counts runs/vocab16k/counts.npy --first GPU_HEAD --cpu-size 8192
      # vocab_order.json: decode.py cuts it to GPU_HEAD's 8,192 ids on a CPU

The shipped head (eagle3_jax/heads/smollm2_135m_instruct, with the vocab_order.json the order
command writes) is this run at step 600; its measurements are in BENCHMARKS.md ("The new rows
trained on this CPU") and the head's README.
"""

from pathlib import Path

from eagle3_jax.training.config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def get_config() -> TrainConfig:
    cpu2 = load_config(ROOT / "configs" / "smollm2_135m_cpu2.py")
    return cpu2.replace(
        init_head="runs/vocab16k/head",  # written by the extend command above (--size 16384)
        draft_vocab_size=16384,
        max_steps=300,
        out_dir="runs/cpu3_16k",
        export_every=100,
        val_every=0,
    )
