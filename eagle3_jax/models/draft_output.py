"""The draft head's output layer, in its three forms (docs/draft_vocab.md): its own lm_head over the
Vd draft ids (EAGLE-3), the target's frozen output embedding over the full vocabulary
(lm_head_source="target": FR-Spec's source head), and SpecVocab's low-rank speculator, which picks
the rows whose exact logits are computed.

`head_logits` gives a hidden state's logits, `draft_topk` a drafted row's k best tokens as target
ids (the one place a row becomes candidates), `attach_target_head` hands a head that reads the
target's output embedding that embedding (every loader calls it).
"""

from __future__ import annotations

import math
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
    row (a static top-k), exact logits are computed for those only from the target's output
    embedding (`candidate_logits`), and the log-softmax runs over the candidates; no exact
    full-vocab logits exist.
    """
    if not cfg.speculator_rank:
        score, ids = topk_log_probs(head_logits(params, hidden_XD, cfg), k)
        return score, draft_to_target_ids(ids, vocab)
    normed, cand = speculator_candidates(params, hidden_XD, cfg)
    exact = candidate_logits(normed, cand, _out_embed(params))
    score, j = topk_log_probs(exact, k)
    return score, jnp.take_along_axis(cand, j, axis=-1).astype(jnp.int32)


def topk_log_probs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest log-probabilities of each row of logits [..., V] and their indices, without
    a [..., V] log-softmax written out: the top k of the logits themselves, then
    (x - max) - log(sum(exp(x - max))) for those k alone, the same operations in the same order
    as `jax.nn.log_softmax`, so each score is bit for bit the value it would have given. The
    order can differ from top_k(log_softmax) only where two logits that differ round to one
    log-probability (it then kept the lower index; here the larger logit wins)."""
    top, idx = jax.lax.top_k(logits, k)
    shift = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(logits - shift), axis=-1, keepdims=True))
    return (top - shift) - lse, idx


def speculator_candidates(
    params: Params, hidden_XD: jax.Array, cfg: DraftConfig
) -> tuple[jax.Array, jax.Array]:
    """SpecVocab's candidates of each drafted row: (the normed hidden state [..., D], the
    `spec_candidates` ids [..., K] its speculator scores highest, best first)."""
    normed = rms_norm(hidden_XD, params["final_norm"], cfg.rms_norm_eps)
    _, cand = jax.lax.top_k(speculator_logits(params, normed), cfg.spec_candidates)
    return normed, cand


def union_capacity(rows: int, k: int, vocab_size: int) -> int:
    """The static size of the shared candidate set of `rows` sibling rows of K candidates each:
    K (1 + log2 rows), rounded up to a multiple of 64, at most rows x K and V.

    Siblings of one tree level read the same context, so their candidate sets overlap: measured
    with the study's SpecVocab head (SmolLM2-135M, K = 2,048, MT-bench answers), the union of 2
    rows holds 1.31 K ids on average (largest seen 1.83 K), of 4 rows 1.65 K (2.55 K), of 10
    rows 2.09 K (3.43 K), against this capacity's 2 K, 3 K and 4.32 K. A union that does not fit
    falls back to the per-row gather (`candidate_logits`), so the capacity sets the cost only."""
    want = -(-int(k * (1 + math.log2(max(rows, 1)))) // 64) * 64
    return min(rows * k, vocab_size, want)


def candidate_logits(normed_XD: jax.Array, cand_XK: jax.Array, embed_VD: jax.Array) -> jax.Array:
    """Exact logits [..., K] (fp32) of each row's candidates: normed . embed[cand].

    Rows [B, D] (the tree's root) or [B, 1, D] (a chain): each row's K rows of the output
    embedding gathered and multiplied. Sibling rows [B, R, D] (a tree level): their candidates
    deduplicated (a mark per vocabulary id, counted) into one set of `union_capacity` ids, that
    set's embedding rows gathered once and multiplied by every sibling, each row's K logits picked
    out of the product: the same dot products (equal within fp32 summation order) for fewer bytes
    read, since siblings share most candidates. A level whose union does not fit takes the per-row
    gather (a `lax.cond`: one branch runs)."""
    per_row = lambda: _gathered_logits(normed_XD, cand_XK, embed_VD)  # noqa: E731
    if normed_XD.ndim < 3:
        return per_row()
    r, k, d = cand_XK.shape[-2], cand_XK.shape[-1], normed_XD.shape[-1]
    cap = union_capacity(r, k, embed_VD.shape[0])
    if cap >= r * k:
        return per_row()
    lead, v = cand_XK.shape[:-2], embed_VD.shape[0]
    flat = cand_XK.reshape(-1, r * k)  # [B, R K]
    b = jnp.arange(flat.shape[0])[:, None]
    seen = jnp.zeros((flat.shape[0], v), jnp.int32).at[b, flat].set(1)  # the level's ids, marked
    rank = jnp.cumsum(seen, axis=-1, dtype=jnp.int32)  # [B, V]: an id's place in the set, + 1
    place = jnp.take_along_axis(rank, flat, axis=-1) - 1  # each candidate's place

    def shared() -> jax.Array:
        union = jnp.zeros((flat.shape[0], cap), flat.dtype).at[b, place].set(flat, mode="drop")
        rows = jnp.take(embed_VD, union, axis=0).astype(normed_XD.dtype)  # [B, U, D]
        z = jnp.einsum(
            "brd,bud->bru", normed_XD.reshape(-1, r, d), rows, preferred_element_type=jnp.float32
        )
        return jnp.take_along_axis(z, place.reshape(-1, r, k), axis=-1).reshape(*lead, r, k)

    return jax.lax.cond(jnp.max(rank[:, -1]) <= cap, shared, per_row)


def _gathered_logits(normed_XD, cand_XK, embed_VD) -> jax.Array:
    rows = jnp.take(embed_VD, cand_XK, axis=0).astype(normed_XD.dtype)  # [..., K, D]
    return jnp.einsum("...d,...kd->...k", normed_XD, rows, preferred_element_type=jnp.float32)


def draft_to_target_ids(draft_ids: jax.Array, vocab: DraftVocab) -> jax.Array:
    """Maps draft-vocab ids to target-vocab ids through d2t offsets (same shape and dtype)."""
    d2t = jnp.asarray(vocab.d2t, dtype=draft_ids.dtype)
    return draft_ids + d2t[draft_ids]
