"""Which target layers to fuse, at a budget where the curves are measured (issue 33 item 3).

  .venv/bin/python -m eagle3_jax ablate --config configs/fusion_ablation_smollm2.py   # resumable

Four heads trained FROM SCRATCH (random trunk, lm_head from the target's output rows:
head_init="target") on the same 4,800 regenerated conversations in the same order (1,200 steps at
batch 4, lr 1e-3, each conversation read once; never an evaluation set), one factor changed from
EAGLE-3's recipe each:

  low_mid_high   EAGLE-3: the inputs to target layers (2, 15, 27) of 30
  top_layer      the top layer alone: the last layer's output after the final norm (id 30, what
                 the LM head reads), EAGLE-1/2's feature
  four_layers    (2, 10, 20, 27)
  ttt_3          (2, 15, 27) with a shorter training-time test (3 steps instead of 7)

A head is exported every 100 steps and validated on 100 held-out conversations (acc_i and the
replayed chain tau), so each cell has a curve against tokens read; the report's paired intervals
come from the harness run on the exported heads (docs/ablations.md gives the command). One feature
store (bfloat16) serves every cell.
"""

from pathlib import Path

from eagle3_jax.ablation.config import AblationConfig, Cell
from eagle3_jax.training.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def get_config() -> AblationConfig:
    base = load_config(ROOT / "configs/smollm2_135m.py").replace(
        data=str(ROOT / "data/smollm2_135m_regenerated_cpu2.jsonl.gz"),
        # exactly the records 1,200 steps x batch 4 read, once. 400 steps (1,600 records) left a
        # head from scratch at held-out acc_0 0.20 and replayed chain tau 1.21 at step 150, still
        # climbing; at the 3 s a step measured alone, 1,200 steps fit the ~1.5 h a cell the grid
        # was sized for (docs/ablations.md).
        num_conversations=4800,
        epochs=0,
        batch_size=4,
        lr=1e-3,
        warmup_ratio=0.02,
        max_steps=1200,
        length_bucket=128,
        feature_dtype="bfloat16",
        feature_layers=(2, 10, 15, 20, 27, 30),
        head_init="target",
        draft_vocab_size=8192,
        save_every=50,
        keep_checkpoints=2,
        export_every=100,
        log_every=5,
        val_data=str(ROOT / "data/smollm2_135m_regenerated_heldout.jsonl.gz"),
        val_every=100,
        val_conversations=100,
    )
    return AblationConfig(
        base=base,
        cells=(
            Cell("low_mid_high", {"aux_layer_ids": (2, 15, 27)}),
            Cell("top_layer", {"aux_layer_ids": (30,)}),
            Cell("four_layers", {"aux_layer_ids": (2, 10, 20, 27)}),
            Cell("ttt_3", {"aux_layer_ids": (2, 15, 27), "ttt_steps": 3}),
        ),
        out_dir="runs/fusion_ablation",
        bench="mt_bench",
        questions=None,
        max_new_tokens=256,
        tree=(10, 8, 60),
        evaluate=False,
    )
