"""Continue the shipped SmolLM2 head on new first turns answered on this CPU: what new data buys.

(Measured from the GPU head, the shipped head until commit 6a4a2ae; run today it continues the
shipped Vd 16,384 head, which already read the first 1,600 of these conversations.)

The GPU head (configs/smollm2_135m_gpu.py) read its 4,452 conversations 16 times and its
tau curve flattened (benchmarks/results/tau_curve_gpu): rereading stopped paying. This config
continues it (`init_head`: same draft vocabulary, same shapes) on 8,114 conversations it has never
seen, data/smollm2_135m_regenerated_cpu2.jsonl.gz (first user turns of the full ShareGPT V3 file,
none in the shipped data nor in Spec-Bench, MT-bench or GSM8K, answered greedily by SmolLM2 on
this CPU; 2.10M tokens, 1.63M of them answers), and validates on the 270 random held-out
answers of the same prompts (data/smollm2_135m_regenerated_heldout.jsonl.gz).

  python train.py --config=configs/smollm2_135m_cpu2.py            # 360 steps, 87 min here
  python train.py --config=configs/smollm2_135m_cpu2.py --resume   # after an interruption

Recipe: a lower peak rate than the shipped run (2e-4 against 1e-3: the head is trained, this
only adds data), batch 4 (on 2 cores a step of 4 x ~300 tokens takes ~15 s with the target's
features online; more updates per minute than batch 16), length buckets of 128 (every record is
at most 397 tokens; median 298), 360 steps: 1,440 conversations, about a sixth of the new data
(one pass would take ~8 hours here; scripts/device_job.py does the whole thing on a lent GPU).
A head exported every 90 steps gives the curve of tau against new tokens read.

Result (BENCHMARKS.md, "What new data buys"): 371,932 tokens read; held-out acc_0 0.650 -> 0.661,
MT-bench answers 0.546 -> 0.553, MT-bench replayed chain d3 tau 1.87-1.89 across the exports (1.89
shipped, 1.89 final). Not shipped.
"""

import json
from pathlib import Path

from eagle3_jax.training.config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
HEAD = ROOT / "eagle3_jax" / "heads" / "smollm2_135m_instruct"  # continued: its Vd and mapping


def get_config() -> TrainConfig:
    shipped = load_config(ROOT / "configs" / "smollm2_135m_gpu.py")
    return shipped.replace(
        data=str(ROOT / "data" / "smollm2_135m_regenerated_cpu2.jsonl.gz"),
        init_head=str(HEAD),
        draft_vocab_size=json.loads((HEAD / "config.json").read_text())["draft_vocab_size"],
        lr=2e-4,
        warmup_ratio=0.02,
        epochs=0,
        max_steps=360,
        batch_size=4,
        length_bucket=128,
        out_dir="runs/smollm2_135m_cpu2",
        save_every=25,
        keep_checkpoints=2,
        export_every=90,
        log_every=5,
        val_data=str(ROOT / "data" / "smollm2_135m_regenerated_heldout.jsonl.gz"),
        val_every=100,
        val_conversations=100,
    )
