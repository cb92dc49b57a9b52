"""The draft-vocabulary study at the SpecVocab paper's own setting, for an accelerator: one grid per
target (configs/vocab_study_olmo2_1b.py, _qwen3_4b.py, _llama31_8b.py call `paper_grid`).

  python benchmarks/vocab_study.py --grid configs/vocab_study_olmo2_1b.py \
      --config.target=/ckpt/OLMo-2-0425-1B-Instruct --config.data=/data/prompts.jsonl \
      --publish benchmarks/results/vocab_study_olmo2_1b

Four heads, each trained from scratch (random trunk, output rows from the target's) on the same
prompts answered by the target itself (regenerate=True: the training answers are the target's
own, as the paper's), in the same order, for the same steps: what differs is the output layer.

  eagle3_vd32000   EAGLE-3's reduced vocabulary (32k most frequent answer tokens)
  specvocab        the target's frozen output embedding behind a rank d/8 speculator, aux 0.1
  target_lm_head   the target's frozen output embedding (FR-Spec's source: cut by the study)
  full_vocab       an own lm_head over every id (VocabTrim's source: cut by the study)

The study script then cuts FR-Spec and VocabTrim heads at 32k, measures every head at EAGLE-3's
reporting tree (10/8/60) on Spec-Bench (all 80 MT-bench questions, 20 of each other task), for
real on an accelerator (τ and speedup), and writes the paper-shaped report.

Sizing: the shared feature store holds 3 layers x d per training token (bfloat16); at the
defaults below (4,000 conversations of at most 2,048 tokens) that is about 4000 x 1000 x 3 x d x 2
bytes: ~50 GB at d = 2,048 (OLMo 2 1B), ~60 GB at 2,560 (Qwen3 4B), ~100 GB at 4,096 (Llama-3.1-8B).
Shrink num_conversations (--config.num_conversations=N) where the disk is smaller.
"""

from __future__ import annotations

from eagle3_jax.ablation.config import AblationConfig, Cell
from eagle3_jax.training.config import TrainConfig

FULL = 1 << 30  # a draft vocabulary at least the target's: every id


def paper_grid(
    base: TrainConfig,
    name: str,
    hidden_size: int,
    draft_vocab_size: int = 32000,
    tree: tuple[int, int, int] = (10, 8, 60),
    dtype: str | None = "bfloat16",
) -> AblationConfig:
    """The four cells on `base` (a target's training config), out_dir runs/vocab_study_NAME."""
    out = f"runs/vocab_study_{name}"
    base = base.replace(
        regenerate=True,
        num_conversations=base.corpus.num_conversations or 4000,
        head_init="target",
        feature_dtype="bfloat16",
        out_dir=out,
    )
    full = {"draft_vocab_size": FULL}
    spec = {**full, "lm_head_source": "target", "speculator_rank": max(hidden_size // 8, 1)}
    return AblationConfig(
        base=base,
        cells=(
            Cell(f"eagle3_vd{draft_vocab_size}", {"draft_vocab_size": draft_vocab_size}),
            Cell("specvocab", spec),
            Cell("target_lm_head", {**full, "lm_head_source": "target"}),
            Cell("full_vocab", full),
        ),
        out_dir=out,
        bench="spec_bench",
        questions=20,
        max_new_tokens=256,
        tree=tree,
        evaluate=False,  # benchmarks/vocab_study.py measures every head in one harness run
        dtype=dtype,
    )
