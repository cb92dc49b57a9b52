"""The EAGLE-3 draft head: fc fusion of target features, one decoder "midlayer", lm_head over Vd.

Parameters are a plain pytree, matrices laid out [in, out] (x @ W):
  {"fc": [n_aux*Ht, D], "final_norm": [D], "lm_head": [D, Vd],
   "layer": {hidden_norm, input_norm, post_attn_norm [D]; wq [2D, H*K], wk/wv [2D, G*K],
             wo [H*K, D]; w_gate/w_up [D, F], w_down [F, D]}}
The token embedding is the TARGET's ([V, D]) and is passed to `forward` as an argument, never stored
here (it is frozen and, for a 128k vocabulary, the largest tensor in sight). The d2t/t2d vocabulary
mapping is not trainable either and lives in `eagle3_jax.vocab.DraftVocab`.

One step (`forward`) takes token ids and a feature per position: either the concatenated target
features (n_aux*Ht wide: fc is applied) or the draft's own previous output (D wide: fc is skipped),
decided statically from the shape, as the official code decides it at run time. The output layer
(own lm_head, the target's embedding, SpecVocab's speculator; logits and top-k) is
`models.draft_output`'s.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.config import PLAIN_PRODUCTS, DraftConfig, ProductPolicy, rope_inv_freq
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models.draft_output import head_logits, target_output_embedding
from eagle3_jax.models.layers import (
    apply_rope,
    cached_attention,
    dense,
    kv_shapes,
    rms_norm,
    rope_cos_sin,
    swiglu,
)
from eagle3_jax.models.target import ParamSpec
from eagle3_jax.sharding import Rules, named
from eagle3_jax.vocab import target_ids

Params = dict[str, Any]


# ----------------------------------------------------------------------------- parameters


def layer_param_specs(cfg: DraftConfig) -> dict[str, ParamSpec]:
    d, f = cfg.hidden_size, cfg.intermediate_size
    hk, gk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "hidden_norm": ParamSpec((d,), (None,), "ones"),
        "input_norm": ParamSpec((d,), (None,), "ones"),
        "post_attn_norm": ParamSpec((d,), (None,), "ones"),
        # q/k/v read [embedding half ; feature half], hence 2D inputs.
        "wq": ParamSpec((2 * d, hk), ("embed", "heads"), "normal"),
        "wk": ParamSpec((2 * d, gk), ("embed", "kv_heads"), "normal"),
        "wv": ParamSpec((2 * d, gk), ("embed", "kv_heads"), "normal"),
        "wo": ParamSpec((hk, d), ("heads", "embed"), "normal"),
        "w_gate": ParamSpec((d, f), ("embed", "mlp"), "normal"),
        "w_up": ParamSpec((d, f), ("embed", "mlp"), "normal"),
        "w_down": ParamSpec((f, d), ("mlp", "embed"), "normal"),
    }


def param_specs(cfg: DraftConfig) -> dict[str, Any]:
    """ParamSpecs in the shape of the params pytree (init, checks and shardings derive from it)."""
    d = cfg.hidden_size
    specs = {
        "fc": ParamSpec((cfg.feature_size, d), (None, "embed"), "normal"),
        "layer": layer_param_specs(cfg),
        "final_norm": ParamSpec((d,), (None,), "ones"),
    }
    if cfg.lm_head_source == "own":
        specs["lm_head"] = ParamSpec((d, cfg.draft_vocab_size), ("embed", "draft_vocab"), "normal")
    if cfg.speculator_rank:
        r = cfg.speculator_rank
        specs["spec_a"] = ParamSpec((d, r), ("embed", None), "normal")
        specs["spec_b"] = ParamSpec((r, cfg.vocab_size), (None, "draft_vocab"), "normal")
    return specs


def _flat_specs(cfg: DraftConfig) -> dict[str, ParamSpec]:
    specs = param_specs(cfg)
    flat = {k: v for k, v in specs.items() if k != "layer"}
    flat.update({f"layer.{k}": v for k, v in specs["layer"].items()})
    return flat


def init_params(cfg: DraftConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
    """Random parameters: normal(0, scale) matrices, unit norms."""
    leaves, treedef = jax.tree.flatten(param_specs(cfg))

    def make(spec: ParamSpec, k: jax.Array) -> jax.Array:
        if spec.init == "ones":
            return jnp.ones(spec.shape, dtype)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, dtype)
        return (scale * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)

    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(leaves, keys)])


def init_output_from_target(
    params: Params, target_params: Params, tcfg, vocab, cfg: DraftConfig
) -> Params:
    """A copy of `params` whose final_norm is the target's and whose lm_head column c is the
    target's output embedding of token vocab.d2t[c] + c (its own row for the draft vocabulary).

    At initialisation the head then reads its hidden state the way the target reads its own, so
    a short run starts from "predict the next token from a target-like feature" instead of noise
    (the Medusa-style start; the official EAGLE-3 trainer starts lm_head from random).
    """

    if tcfg.hidden_size != cfg.hidden_size:
        raise Eagle3Error(
            f"cannot start the head's lm_head from the target: hidden sizes differ "
            f"({cfg.hidden_size} vs {tcfg.hidden_size})"
        )
    ids = jnp.asarray(target_ids(vocab))
    out_VD = target_output_embedding(target_params, tcfg)
    lm_DC = jnp.take(out_VD, ids, axis=0).T
    new = dict(params)
    new["lm_head"] = lm_DC.astype(params["lm_head"].dtype)
    new["final_norm"] = target_params["final_norm"].astype(params["final_norm"].dtype)
    return new


def init_speculator_svd(params: Params, target_params: Params, tcfg, cfg: DraftConfig) -> Params:
    """A copy of `params` whose SpecVocab speculator is the best rank-r approximation of the
    target's output embedding: with out_VD = U S V^T (truncated to r), spec_a = V sqrt(S) [D, r]
    and spec_b = sqrt(S) U^T [r, V], so (h A) B = h (out_VD)_r^T, the target's own logits for
    `h` through an r-dimensional bottleneck (Eckart-Young). Training then adapts it to the head.
    """
    if not cfg.speculator_rank:
        raise Eagle3Error("init_speculator_svd: this head has no speculator (speculator_rank 0)")
    out_VD = target_output_embedding(target_params, tcfg)
    w = np.asarray(out_VD, np.float64)
    # SVD of the small Gram side: out^T out = V S^2 V^T ([D, D]), then U S = out V
    evals, evecs = np.linalg.eigh(w.T @ w)
    order = np.argsort(evals)[::-1][: cfg.speculator_rank]
    s = np.sqrt(np.maximum(evals[order], 0.0))
    v_Dr = evecs[:, order]
    us_Vr = w @ v_Dr  # = U S
    root = np.sqrt(np.maximum(s, 1e-12))
    new = dict(params)
    new["spec_a"] = jnp.asarray(v_Dr * root, params["spec_a"].dtype)
    new["spec_b"] = jnp.asarray((us_Vr / root).T, params["spec_b"].dtype)
    return new


def check_params(params: Params, cfg: DraftConfig) -> None:
    """Refuses missing, unexpected or wrongly shaped parameters with one message naming them."""
    specs = _flat_specs(cfg)
    if not isinstance(params, dict) or not isinstance(params.get("layer"), dict):
        raise Eagle3Error("draft params must be a dict with a 'layer' dict (see models/draft.py)")
    flat = {k: v for k, v in params.items() if k not in ("layer", "out_embed")}
    flat.update({f"layer.{k}": v for k, v in params["layer"].items()})
    problems = [f"{n} missing" for n in specs if n not in flat]
    problems += [f"{n} unexpected" for n in flat if n not in specs]
    problems += [
        f"{n} has shape {tuple(flat[n].shape)}, expected {s.shape}"
        for n, s in specs.items()
        if n in flat and tuple(flat[n].shape) != s.shape
    ]
    if problems:
        raise Eagle3Error(
            f"draft params do not match the DraftConfig: {'; '.join(problems[:4])}"
            f"{' ...' if len(problems) > 4 else ''}: load the head that config "
            "describes"
        )


def param_shardings(cfg: DraftConfig, mesh, rules=None) -> Params:
    """NamedShardings matching `init_params(cfg)`, derived from the same ParamSpecs."""

    rules = rules or Rules()
    return jax.tree.map(lambda s: named(mesh, s.axes, s.shape, rules), param_specs(cfg))


def num_params(params: Params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))


# ----------------------------------------------------------------------------- KV cache


def make_cache(cfg: DraftConfig, batch: int, slots: int, dtype=jnp.float32) -> dict[str, jax.Array]:
    """The draft's own static-shape KV cache {"k": [B, G, K, S], "v": [B, G, S, K]} (the layout of
    `layers.kv_shapes`), allocated separately."""
    ks, vs = kv_shapes(batch, slots, cfg.num_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(ks, dtype), "v": jnp.zeros(vs, dtype)}


def cache_sharding(cfg: DraftConfig, mesh, batch: int, rules=None) -> dict[str, Any]:
    """Batch over data, kv heads over model, each where it divides (else replicated)."""

    rules = rules or Rules()
    s = named(
        mesh,
        ("batch", "kv_heads", None, None),
        (batch, cfg.num_kv_heads, 1, 1),
        rules,
    )
    return {"k": s, "v": s}


# ----------------------------------------------------------------------------- forward


class Output(NamedTuple):
    hidden: jax.Array  # [B, T, D] pre-norm midlayer output: the next step's feature
    logits: jax.Array | None  # [B, T, Vd] = lm_head(final_norm(hidden))
    cache: dict[str, jax.Array] | None


def fuse(params: Params, aux_BTF: jax.Array, policy: ProductPolicy = PLAIN_PRODUCTS) -> jax.Array:
    """fc: concatenated target features [B, T, n_aux*Ht] -> [B, T, D] (no bias)."""
    return dense(aux_BTF.astype(params["fc"].dtype), params["fc"], policy=policy)


def project_qkv(
    p: Params,
    emb_BTD: jax.Array,
    h_BTD: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    cfg: DraftConfig,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The layer up to attention: q [B, T, H, K], k/v [B, T, G, K], RoPE applied to q and k.

    Shared by `midlayer` and the training-time-test loss (which attends differently), so the layer
    math lives in one place.
    """
    b, t, _ = h_BTD.shape
    eps = cfg.rms_norm_eps
    # The embedding half comes first in the concat.
    x = jnp.concatenate(
        [rms_norm(emb_BTD, p["input_norm"], eps), rms_norm(h_BTD, p["hidden_norm"], eps)], axis=-1
    )
    pol = cfg.products
    q = dense(x, p["wq"], policy=pol).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = dense(x, p["wk"], policy=pol).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = dense(x, p["wv"], policy=pol).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def finish_layer(p: Params, h_BTD: jax.Array, attn_BTHK: jax.Array, cfg: DraftConfig) -> jax.Array:
    """The layer after attention: o_proj onto the residual h (the feature BEFORE hidden_norm), then
    the SwiGLU MLP block. Returns the pre-norm output [B, T, D]."""
    b, t, _ = h_BTD.shape
    h = h_BTD + dense(attn_BTHK.reshape(b, t, -1), p["wo"], policy=cfg.products)
    with jax.named_scope("mlp"):
        x = rms_norm(h, p["post_attn_norm"], cfg.rms_norm_eps)
        h = h + swiglu(x, p["w_gate"], p["w_up"], p["w_down"], policy=cfg.products)
    return h


def midlayer(
    p: Params,
    emb_BTD: jax.Array,
    h_BTD: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    mask: jax.Array,
    cfg: DraftConfig,
    kv: tuple[jax.Array, jax.Array] | None = None,
    write_B: jax.Array | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """The one decoder layer over x = [input_norm(emb) ; hidden_norm(h)] with residual h.

    Returns the pre-norm output [B, T, D] and the updated (k, v) cache when one is given.
    """
    q, k, v = project_qkv(p, emb_BTD, h_BTD, cos, sin, cfg)
    o, kv = cached_attention(q, k, v, kv, write_B, mask)
    return finish_layer(p, h_BTD, o, cfg), kv


def forward(
    params: Params,
    embed_VD: jax.Array,
    tokens_BT: jax.Array,
    feat_BTX: jax.Array,
    positions_BT: jax.Array,
    mask: jax.Array,
    cfg: DraftConfig,
    cache: dict[str, jax.Array] | None = None,
    write_B: jax.Array | None = None,
    compute_logits: bool = True,
    target_features: bool | None = None,
) -> Output:
    """One draft step over T positions.

    Args:
      embed_VD: the target's token embedding [V, D] (frozen; a head with D != Ht brings its own).
      tokens_BT: int [B, T] target-vocab token ids (the token FOLLOWING each feature's position).
      feat_BTX: [B, T, n_aux*Ht] target features (fc applied) or [B, T, D] draft outputs (fc
        skipped).
      positions_BT: int [B, T] RoPE positions (the draft's own RoPE config).
      mask: bool [B, T, S] over cache slots after this call's writes (cache given), else [B, T, T].
      cache: from `make_cache`; row b's new K/V go to slots write_B[b] .. write_B[b] + T - 1.
    Returns:
      Output(hidden [B, T, D] pre-norm output feeding the next step, logits [B, T, Vd], new cache).
    """
    width = feat_BTX.shape[-1]
    if target_features is None:
        if cfg.feature_size == cfg.hidden_size:
            # one aux layer with Ht == D (the EAGLE-1/2-style ablation): width cannot decide
            raise Eagle3Error("n_aux * Ht == D: pass target_features=True/False to draft.forward")
        target_features = width == cfg.feature_size
    if target_features and width == cfg.feature_size:
        h = fuse(params, feat_BTX, cfg.products)
    elif not target_features and width == cfg.hidden_size:
        h = feat_BTX.astype(params["fc"].dtype)
    else:
        raise Eagle3Error(
            f"draft feature width {width} is neither n_aux*Ht = {cfg.feature_size} "
            f"(target features) nor D = {cfg.hidden_size} (draft output): check aux "
            "ids and target_hidden_size against the target"
        )
    if tuple(embed_VD.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise Eagle3Error(
            f"embedding has shape {tuple(embed_VD.shape)}, the draft needs "
            f"[{cfg.vocab_size}, {cfg.hidden_size}] ([V, D]): pass the target's "
            "embedding, or the head's own when its hidden size differs"
        )
    if cache is not None and write_B is None:
        raise Eagle3Error("draft forward got a cache but no write_B: pass the slot offsets per row")
    emb = embed_VD[tokens_BT].astype(h.dtype)
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    cos, sin = rope_cos_sin(positions_BT, inv_freq, cfg.rope.attention_factor)
    kv = None if cache is None else (cache["k"], cache["v"])
    with jax.named_scope("draft_midlayer"):
        h, kv = midlayer(params["layer"], emb, h, cos, sin, mask, cfg, kv, write_B)
    logits = head_logits(params, h, cfg) if compute_logits else None
    return Output(h, logits, None if kv is None else {"k": kv[0], "v": kv[1]})
