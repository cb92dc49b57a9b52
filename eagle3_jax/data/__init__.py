"""Training data for EAGLE-3 heads: chat files, target-regenerated answers, loss masks, batches.

Flow: read_conversations (ShareGPT / role-content) -> first_user_turns -> regenerate (the target
answers, resumable JSONL) -> read_conversations again -> build_dataset (chat template +
assistant-only loss mask, fixed [N, L] arrays) -> save / load (.npz) -> token_counts (draft
vocabulary) and batches (seeded, resumable, per-host slices).

`eagle3_jax.data.regenerate` (a command, `python -m eagle3_jax regenerate`) is not imported
here: a module run with -m that its package had already imported runs twice over (runpy warns).
"""

from eagle3_jax.data.conversations import Conversation, first_user_turns, read_conversations
from eagle3_jax.data.dataset import (
    Batch,
    TokenizedDataset,
    batches,
    build_dataset,
    steps_per_epoch,
    token_counts,
)
from eagle3_jax.data.dataset import load as load_dataset
from eagle3_jax.data.dataset import save as save_dataset
from eagle3_jax.data.masks import UnrenderableConversation, tokenize_conversation

__all__ = [
    "Batch",
    "Conversation",
    "TokenizedDataset",
    "UnrenderableConversation",
    "batches",
    "build_dataset",
    "first_user_turns",
    "load_dataset",
    "read_conversations",
    "save_dataset",
    "steps_per_epoch",
    "token_counts",
    "tokenize_conversation",
]
