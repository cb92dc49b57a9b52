"""The fusion / TTT / feature-loss grid for Llama-3.1-8B-Instruct on an 8-chip host (or a pod):
the cells of the (archived) configs/ablate_smollm2.py grid, on the paper's recipe
(configs/llama31_8b.py, mesh 2 data x 4 model, bf16). The top layer alone is what
configs/fusion_ablation_smollm2.py calls it: the last layer's output after the final norm (id 32,
what the LM head reads, EAGLE-1/2's feature; its head runs only in eagle3_jax, docs/interop.md),
not the input to the last layer that the 160-conversation grid used.

  python -m eagle3_jax ablate --config configs/ablate_llama31_8b_pod.py \
      --config.target=/ckpt/Llama-3.1-8B-Instruct --config.data=/data/sharegpt_ultrachat.jsonl

Features for the union of the cells' layers are precomputed once (float32 .npy memory maps:
plan 4 bytes x 4096 x tokens per layer; the cells' 10 layers and the final hidden state at 20M
tokens are ~3.6 TB, so size num_conversations to the disk). Multi-host: run the same command on
every host.
"""

from pathlib import Path

from eagle3_jax.ablation.config import AblationConfig, Cell
from eagle3_jax.training.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def get_config() -> AblationConfig:
    base = load_config(ROOT / "configs/llama31_8b.py").replace(
        num_conversations=20000,
        epochs=2,
        length_bucket=256,
        save_every=500,
    )
    return AblationConfig(
        base=base,
        cells=(
            Cell("default"),  # (2, 16, 29) of 32
            Cell("top_layer", {"aux_layer_ids": (32,)}),
            Cell("four_layers", {"aux_layer_ids": (2, 11, 21, 29)}),
            Cell("all_low", {"aux_layer_ids": (1, 2, 3)}),
            Cell("all_high", {"aux_layer_ids": (28, 29, 30)}),
            Cell("ttt_1", {"ttt_steps": 1}),
            Cell("ttt_3", {"ttt_steps": 3}),
            Cell("feature_loss", {"feature_loss_weight": 1.0}),
            Cell("vd_64000", {"draft_vocab_size": 64000}),
        ),
        out_dir="runs/ablate_llama31_8b",
        bench="spec_bench",
        questions=10,
        max_new_tokens=512,
        tree=(10, 8, 60),  # EAGLE-3's reporting tree (its depth 7 counts steps after the first)
    )
