"""The draft-vocabulary study on the embedded SmolLM2-135M-Instruct, at a budget where heads train.

  .venv/bin/python -m eagle3_jax ablate --config configs/vocab_study_smollm2.py   # resumable

Every cell starts from the SAME trained trunk (the shipped head's fc, decoder layer and final norm:
init_trunk) with its output layer fresh (own lm_head rows from the target's output embedding, the
frozen target embedding, or SpecVocab's SVD start), and reads the same 1,600 regenerated
conversations in the same order (400 steps at batch 4, the continuation recipe of
configs/smollm2_135m_cpu2.py; never an evaluation set). A head is exported every 50 steps and
validated on held-out conversations, so each method has a curve of acc_i (and replayed tau) against
tokens read. What differs between cells is the output layer alone:

  eagle3_vd8192 / eagle3_vd16384   EAGLE-3's reduced vocabulary, its most frequent answer tokens
  full_vocab                        own lm_head over all 49,152 ids (VocabTrim's source)
  target_lm_head                    the target's frozen output embedding (FR-Spec's source)
  specvocab / specvocab_noaux       + a rank-72 (d/8) speculator, auxiliary loss 0.1 / 0

The trunk was trained with a reduced (Vd 8,192 then 16,384) output layer, which favours the reduced
cells; docs/draft_vocab.md says so beside the table. FR-Spec and VocabTrim heads are derived from
target_lm_head and full_vocab by `python -m eagle3_jax vocab trim` and measured with the rest by
benchmarks/vocab_study.py.
"""

from pathlib import Path

from eagle3_jax.ablation.config import AblationConfig, Cell
from eagle3_jax.training.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def get_config() -> AblationConfig:
    base = load_config(ROOT / "configs/smollm2_135m.py").replace(
        data=str(ROOT / "data/smollm2_135m_regenerated_cpu2.jsonl.gz"),
        num_conversations=1600,  # exactly the records 400 steps x batch 4 read, once
        epochs=0,
        batch_size=4,
        lr=2e-4,
        warmup_ratio=0.02,
        max_steps=400,
        length_bucket=128,
        feature_dtype="bfloat16",  # half the disk and page cache; training reads them as float32
        init_trunk=str(ROOT / "eagle3_jax/heads/smollm2_135m_instruct"),
        head_init="target",
        save_every=25,
        keep_checkpoints=2,
        export_every=50,
        log_every=5,
        val_data=str(ROOT / "data/smollm2_135m_regenerated_heldout.jsonl.gz"),
        val_every=50,
        val_conversations=100,
    )
    full = {"draft_vocab_size": 49152, "remat": True}
    spec = {**full, "lm_head_source": "target", "speculator_rank": 72}
    return AblationConfig(
        base=base,
        cells=(  # cheapest first: benchmarks/vocab_study.py measures and keeps them in turn
            Cell("eagle3_vd8192", {"draft_vocab_size": 8192}),
            Cell("eagle3_vd16384", {"draft_vocab_size": 16384}),
            Cell("target_lm_head", {**full, "lm_head_source": "target"}),
            Cell("specvocab_noaux", {**spec, "speculator_loss_weight": 0.0}),
            Cell("specvocab", spec),
            Cell("full_vocab", full),
        ),
        out_dir="runs/vocab_study",
        bench="mt_bench",
        questions=None,
        max_new_tokens=256,
        tree=(10, 8, 60),
        evaluate=False,  # benchmarks/vocab_study.py measures every head in one harness run
    )
