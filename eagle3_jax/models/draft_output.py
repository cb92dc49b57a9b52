"""The draft head's output layer, in its three forms (docs/draft_vocab.md): its own lm_head over the
Vd draft ids (EAGLE-3), the target's frozen output embedding over the full vocabulary
(lm_head_source="target": FR-Spec's source head), and SpecVocab's low-rank speculator, which picks
the rows whose exact logits are computed.

`head_logits` gives a hidden state's logits, `draft_topk` a drafted row's k best tokens as target
ids (the one place a row becomes candidates), `attach_target_head` hands a head that reads the
target's output embedding that embedding (every loader calls it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from eagle3_jax.config import DraftConfig
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models.layers import dense, dense_t, rms_norm
from eagle3_jax.vocab import DraftVocab

Params = dict[str, Any]


def head_logits(
    params: Params, hidden_BTD: jax.Array, cfg: DraftConfig, out_dtype=jnp.float32
) -> jax.Array:
    """Draft logits [..., Vd] from the pre-norm midlayer output: the head's own lm_head, or (for
    lm_head_source="target") the attached target output embedding over the full vocabulary.

    fp32 by default whatever the parameters' dtype, as the target's (models.target.lm_head): bf16
    logits tie often, and the draft's top-k and cumulative scores (the tree, adaptive
    verification) rank by them. `out_dtype=None` gives the product in the parameters' dtype:
    training's choice, whose backward products then stay in that dtype too (an fp32 result would
    carry an fp32 gradient into both of them)."""
    normed = rms_norm(hidden_BTD, params["final_norm"], cfg.rms_norm_eps)
    if cfg.lm_head_source == "own":
        return dense(normed, params["lm_head"], out_dtype, policy=cfg.products)
    # [V, D] stored out-by-in: a few rows as a row reduction where the policy says (dense_t)
    embed = _out_embed(params).astype(normed.dtype)
    return dense_t(normed, embed, out_dtype, policy=cfg.products)


def _out_embed(params: Params) -> jax.Array:
    if "out_embed" not in params:
        raise Eagle3Error(
            "this head reads the target's output embedding: attach it first "
            "(models.draft_output.attach_target_head, done by every loader)"
        )
    return params["out_embed"]


def target_output_embedding(target_params: Params, tcfg) -> jax.Array:
    """The target's output embedding [V, D]: its input embedding when tied, else lm_head^T."""
    return target_params["embed"] if tcfg.tie_word_embeddings else target_params["lm_head"].T


def attach_target_head(params: Params, cfg: DraftConfig, target_params: Params, tcfg) -> Params:
    """params plus "out_embed" [V, D] = the target's output embedding, for heads that read it.

    Tied targets share their embedding array (no copy); others pass lm_head transposed (XLA
    reads it through the transpose inside the einsum). Heads with their own lm_head are returned
    unchanged.
    """
    if not cfg.uses_target_head:
        return params
    out = target_output_embedding(target_params, tcfg)
    if tuple(out.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise Eagle3Error(
            f"the target's output embedding is {tuple(out.shape)}, the head needs "
            f"[{cfg.vocab_size}, {cfg.hidden_size}]: the head was trained for another target"
        )
    return {**params, "out_embed": out}


def speculator_logits(params: Params, normed_XD: jax.Array) -> jax.Array:
    """SpecVocab's approximate logits over the full vocabulary: (h A) B, rank r = d/8 typically."""
    return (normed_XD @ params["spec_a"].astype(normed_XD.dtype)) @ params["spec_b"].astype(
        normed_XD.dtype
    )


def draft_topk(
    params: Params, hidden_XD: jax.Array, cfg: DraftConfig, vocab: DraftVocab, k: int
) -> tuple[jax.Array, jax.Array]:
    """The k best next tokens of each drafted row: (log-probs fp32 [..., k], target ids [..., k]).

    Own or full-vocabulary heads: log-softmax over the draft vocabulary, top k, mapped to target
    ids. SpecVocab (speculator_rank > 0): approximate logits pick `spec_candidates` candidates per
    row (a static top-k), exact logits are computed for those only from the gathered rows of the
    target's output embedding, and the log-softmax runs over the candidates; no exact full-vocab
    logits exist.
    """
    if not cfg.speculator_rank:
        lp = jax.nn.log_softmax(head_logits(params, hidden_XD, cfg), axis=-1)
        score, ids = jax.lax.top_k(lp, k)
        return score, draft_to_target_ids(ids, vocab)
    normed = rms_norm(hidden_XD, params["final_norm"], cfg.rms_norm_eps)
    _, cand = jax.lax.top_k(speculator_logits(params, normed), cfg.spec_candidates)  # [..., K]
    rows = jnp.take(_out_embed(params), cand, axis=0).astype(normed.dtype)  # [..., K, D]
    exact = jnp.einsum("...d,...kd->...k", normed, rows, preferred_element_type=jnp.float32)
    score, j = jax.lax.top_k(jax.nn.log_softmax(exact, axis=-1), k)
    return score, jnp.take_along_axis(cand, j, axis=-1).astype(jnp.int32)


def draft_to_target_ids(draft_ids: jax.Array, vocab: DraftVocab) -> jax.Array:
    """Maps draft-vocab ids to target-vocab ids through d2t offsets (same shape and dtype)."""
    d2t = jnp.asarray(vocab.d2t, dtype=draft_ids.dtype)
    return draft_ids + d2t[draft_ids]
