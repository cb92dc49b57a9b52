"""The fusion ablation at a budget where heads are trained (issue 62): does fusing low, middle and
high layers pay once the heads reach the shipped head's held-out acc_0 (0.65)?

  # on a lent GPU, call after call (docs/gpu_recipe.md, "The trained fusion ablation"):
  python3 scripts/device_job.py fusion-ablation --minutes 9 --out $OUT
  # the driver itself (a CPU would take days a cell):
  .venv/bin/python benchmarks/fusion_ablation_trained.py --publish \
      benchmarks/results/fusion_ablation_trained

configs/fusion_ablation_smollm2.py (1.15M tokens, cosine to zero) left every cell at held-out
acc_0 ~0.40 and could not tell "fusion does not matter" from "not trained enough". Here five
heads are trained FROM SCRATCH (random trunk, lm_head from the target's output rows, Vd 8,192) on
the same records in the same order, one factor changed from EAGLE-3's recipe each:

  low_mid_high   EAGLE-3: the inputs to target layers (2, 15, 27) of 30, TTT 7. It is also the
                 "TTT 7" cell of the TTT series (7 is our default): no separate ttt_7 cell
  top_layer      id 30 alone (the final normed state the LM head reads: EAGLE-1/2's feature)
  four_layers    (2, 10, 20, 27)
  ttt_1          (2, 15, 27), one TTT step (plain next-token training, EAGLE-2's)
  ttt_3          (2, 15, 27), three TTT steps

The budget: 2,400 steps of 16 records (max_len 1,024, two shapes 512/1,024), about 20M tokens
read a cell, past the 19.3M at which the shipped GPU head read held-out acc_0 0.65. The learning
rate is constant after a 2 % warmup (`schedule="constant"`), so the head exported at step B is
the head a run of B steps gives: each cell is measured with the harness at budgets 300, 600,
1,200 and 2,400 steps (~2.5M, 5M, 10M, 20M tokens; doubling, so "at which budget do the cells
part" is read off one run a cell), and validated on 100 held-out conversations every 150 steps
(held-out acc_0 and replayed chain tau against tokens: the curve the report plots). Every head is
measured on all 80 MT-bench questions and Spec-Bench's six tasks at 20 questions each, replayed
at EAGLE-3's reporting tree (10/8/60), 256 new tokens a turn, each paired question by question
against low_mid_high at the same budget.

Sizing (docs/gpu_recipe.md): on one H200 a training step of 16 x 512 tokens with online target
features took 0.069 s (benchmarks/results/gpu_training/device_log_regenerated.txt); 16 x up to
1,024 here, ~0.15 s on an H200 and ~0.2 s on an H100, so 2,400 steps are 6-8 minutes a cell with
its validations, one device call. The features are computed online (`online_features`): a
six-layer bfloat16 store is ~7 KB a token, ~70 GB for the ~10M distinct tokens, more than a
device's 64 GB disk, and the 135M target's forward costs the GPU little beside the head's TTT.

The data: the target's own answers to every user turn of the 12,786 ShareGPT V3 conversations
`scripts/device_job.py pack` selects (no turn from MT-bench, Spec-Bench or GSM8K:
`select_prompts.held_out_texts`; the 270 held-out prompts left out), answered in context on the
device before any cell trains (`regenerate --all-turns`, runs/turns/regenerated_turns.jsonl,
~12 minutes of an H200), then the 8,114 first turns answered on a CPU; `repeated_ids="first"`
drops a first-turn record whose conversation the multi-turn file holds. About 10M distinct
tokens, so 20M tokens read is two passes. Every cell reads the same records in the same order.
"""

from pathlib import Path

from eagle3_jax.ablation.config import AblationConfig, Cell
from eagle3_jax.training.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TURNS = ROOT / "runs" / "turns" / "regenerated_turns.jsonl"  # answered on the device
CPU2 = ROOT / "data" / "smollm2_135m_regenerated_cpu2.jsonl.gz"  # 8,114 first turns, CPU
HELD_OUT = ROOT / "data" / "smollm2_135m_regenerated_heldout.jsonl.gz"
STEPS = 2400
BUDGETS = (300, 600, 1200, STEPS)
LMH = (2, 15, 27)


def get_config() -> AblationConfig:
    base = load_config(ROOT / "configs/smollm2_135m.py").replace(
        data=f"{TURNS},{CPU2}",
        repeated_ids="first",
        epochs=0,
        max_steps=STEPS,
        batch_size=16,
        max_len=1024,
        length_bucket=512,
        lr=1e-3,  # the 1.15M-token grid's peak, held
        schedule="constant",
        warmup_ratio=0.02,
        feature_layers=(2, 10, 15, 20, 27, 30),
        head_init="target",
        draft_vocab_size=8192,
        save_every=150,
        keep_checkpoints=1,
        export_every=300,
        log_every=10,
        val_data=str(HELD_OUT),
        val_every=150,
        val_conversations=100,
    )
    return AblationConfig(
        base=base,
        cells=(
            Cell("low_mid_high", {"aux_layer_ids": LMH}),
            Cell("top_layer", {"aux_layer_ids": (30,)}),
            Cell("four_layers", {"aux_layer_ids": (2, 10, 20, 27)}),
            Cell("ttt_1", {"aux_layer_ids": LMH, "ttt_steps": 1}),
            Cell("ttt_3", {"aux_layer_ids": LMH, "ttt_steps": 3}),
        ),
        out_dir="runs/fusion_ablation_trained",
        bench="mt_bench",
        questions=None,
        benches=(("mt_bench", None), ("spec_bench", 20)),
        budgets=BUDGETS,
        online_features=True,
        max_new_tokens=256,
        tree=(10, 8, 60),
        evaluate=False,
    )
