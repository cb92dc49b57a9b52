"""The draft-vocabulary comparison's trained heads on the embedded SmolLM2-135M-Instruct: one data
set, one step budget, one feature store, one trunk, five cells over four output layers.

  .venv/bin/python -m eagle3_jax ablate --config configs/vocab_smollm2.py

Cells: the EAGLE-3 reduced head (Vd 8192), a full-vocabulary head with its own lm_head (VocabTrim's
source), a head on the target's frozen output embedding (FR-Spec's source), SpecVocab (the same
plus a rank-72 = d/8 speculator, auxiliary loss weight 0.1, SVD start) and SpecVocab without the
auxiliary loss (weight 0: what the loss buys). benchmarks/vocab_methods.py
then derives the FR-Spec and VocabTrim heads and measures all seven in one harness run
(runs/vocab_methods/report.md; results in docs/draft_vocab.md).

A 2-core CPU cannot train five heads from scratch to a useful tau in one session (the first
shipped head took 180 steps for tau 1.15; 20 steps from scratch give ~1.02, where every method
ties). So every cell starts from the SAME trained trunk, the shipped head's fc, decoder layer and
norm (init_trunk; the measured results used the first shipped head, commit f00e4f8), with its
output layer fresh: own lm_head rows from the target's output embedding (head_init=target), the
frozen target embedding, or the speculator's SVD start; then 20 steps on the
same records. What differs between cells is the output layer and its 20 steps of adaptation.
Full-vocabulary cells recompute each TTT step in the backward pass (remat): their [B, T, 49152]
logits would not fit 24 GB seven times over.
"""

from pathlib import Path

from eagle3_jax.ablation.config import AblationConfig, Cell
from eagle3_jax.training.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def get_config() -> AblationConfig:
    base = load_config(ROOT / "configs/smollm2_135m.py").replace(
        num_conversations=160,  # exactly the records 20 steps x batch 8 read: features for no more
        epochs=0,
        batch_size=8,  # the recipe this comparison was measured with (not the head's batch 1)
        lr=3e-4,
        max_steps=20,
        save_every=10,
        init_trunk=str(ROOT / "eagle3_jax/heads/smollm2_135m_instruct"),
        head_init="target",
        export_every=0,
        log_every=5,
    )
    full = {"draft_vocab_size": 49152, "remat": True}
    return AblationConfig(
        base=base,
        cells=(
            Cell("eagle3_vd8192"),
            Cell("full_vocab", full),
            Cell("target_lm_head", {**full, "lm_head_source": "target"}),
            Cell("specvocab", {**full, "lm_head_source": "target", "speculator_rank": 72}),
            # the auxiliary loss measured: the same speculator left at its SVD start, and no
            # auxiliary gradient reaching the layer
            Cell(
                "specvocab_noaux",
                {
                    **full,
                    "lm_head_source": "target",
                    "speculator_rank": 72,
                    "speculator_loss_weight": 0.0,
                },
            ),  # fmt: skip
        ),
        out_dir="runs/vocab_smollm2",
        bench="mt_bench",
        questions=1,
        max_new_tokens=64,
        tree=(1, 4, 5),
        evaluate=False,  # benchmarks/vocab_methods.py measures every head in one harness run
    )
