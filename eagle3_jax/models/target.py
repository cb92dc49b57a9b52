"""The frozen target model: a functional decoder (Llama / Mistral / Qwen2 / Qwen3 / OLMo 2 /
Gemma 3's text model, and the mixture-of-experts Qwen3-MoE / Mixtral / gpt-oss / OLMoE).

Parameters are a plain pytree:
  {"embed": [V, D], "final_norm": [D], "lm_head": [D, V] (absent when tied),
   "layers": [per-layer dict] (a list: unrolled, fastest decode on CPU) or one dict of
             [L, ...]-stacked arrays (scanned: fast compiles, the layout for training on pods)}
Per layer: attn_norm, mlp_norm [D]; wq [D, H*K], wk/wv [D, G*K], wo [H*K, D]; optional bq/bk/bv;
optional q_norm/k_norm ([K] for Qwen3 and Gemma 3, [H*K]/[G*K] for OLMo 2 and OLMoE); w_gate/w_up [D, F],
w_down [F, D]; Gemma 3's sandwich norms add post_attn_norm and post_mlp_norm [D] (its norms are
x * (1 + w), so they start at zero); gpt-oss adds the output projection's bias bo [D] and the
attention sinks, sinks [H] (a logit per query head in each softmax's denominator).
Decoding on an accelerator fuses them at load (`fuse_projections`): wqkv [D, G*(R+2)*K] (each kv
head's R query heads, then its key and value head; R = H / G) and w_gate_up [D, F*2] (each
intermediate unit's gate and up column side by side), so a layer runs two products where it ran
five; a layer holds one form or the other, and `_layer` reads whichever it has.

A routed (mixture-of-experts) layer, `cfg.is_moe_layer(i)`, holds instead of w_gate/w_up/w_down
router [D, E] and its experts' we_gate/we_up [E, D, F'], we_down [E, F', D] (F' =
cfg.moe_intermediate_size; the expert weights are never fused). `_moe` computes it as transformers
does: router logits and their softmax in fp32, the top k (`jax.lax.top_k`, which takes the lowest
expert index first among equal probabilities; torch.topk's order at an exact tie is its own, see
`route`), renormalised where cfg.norm_topk_prob (Mixtral's softmax over the top-k logits is the
same thing; gpt-oss takes the top k of the logits first, `cfg.router_topk_logits`). gpt-oss's
layers (cfg.moe_bias) add router_bias [E] and be_gate/be_up [E, F'], be_down [E, D], and its
experts run the clamped SwiGLU (`expert_activation`).

Three dispatches (cfg.moe_dispatch, chosen by `backends.moe_dispatch_wanted`; `moe_path` says
which computation a forward of n tokens runs). Dense: every expert runs on every token and a
[B, T, E] weight matrix, zero for the experts a token was not routed to, scales each expert's
activations before the down projection, which contracts the expert axis with the intermediate
one: exact (an unrouted expert adds an exact zero), shape-static, E / k times the routed FLOPs,
and it reads every expert. Gathered (a forward whose n k (token, expert) pairs are few beside E,
cfg.moe_gather_pairs: a decode step, a short chain): each pair's matrices taken from the weights, so a
step reads its k experts, not all E. Ragged (larger forwards on a TPU): the pairs sorted by
expert and multiplied expert by expert (`jax.lax.ragged_dot`, the grouped product of maxtext's moe.py),
k experts' FLOPs a token. All three are static in shape (no recompilation as the routing
changes, which speculative rounds need). On a mesh (logical axis "experts" over the model axis:
expert parallelism) no expert's weights move: dense, each device runs its own experts on every
token and the contraction over experts becomes a partial sum XLA all-reduces; gathered or ragged
(cfg.moe_mesh, `_moe_on_mesh`), each device runs the pairs of its own rows routed to its own
experts under `jax.shard_map` and the partial sums are all-reduced.

`forward` runs T new tokens against a static-shape KV cache under an explicit attention mask and
returns logits, the final (normed) hidden state and the EAGLE-3 auxiliary hidden states.

Sliding windows are the layers' own: the caller's mask is plain causal (or a tree's), and
`forward` intersects it with the window for the layers `cfg.is_sliding_layer` names (Mistral's
every layer, Gemma 3's local ones, each with its own RoPE), counting positions: cached slot s
holds position s, as every caller lays its cache out. A tree verification's nodes thus each see
their own window of the cache (and of the tree), exact where the tree crosses it. Stacked layers
of both kinds (Gemma 3) scan with a per-layer flag choosing the RoPE tables and mask.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from eagle3_jax.config import TargetConfig, rope_inv_freq
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models.layers import (
    ACTIVATIONS,
    apply_rope,
    cached_attention,
    dense,
    dense_t,
    kv_shapes,
    rms_norm,
    rope_cos_sin,
    slot_major_keys,
    swiglu,
)
from eagle3_jax.sharding import Rules, mesh_of, named, spec_for

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, mapped to the mesh in sharding.py
    init: str  # "normal" | "ones" | "zeros"


def _is_moe(cfg: TargetConfig, layer: int | None) -> bool:
    """Whether layer `layer` is routed; None: the kind every layer shares, refused where they
    differ (a stacked layout or one spec for all layers cannot describe both kinds)."""
    if layer is not None:
        return cfg.is_moe_layer(layer)
    if cfg.mixed_layers:
        raise Eagle3Error(
            f"this {cfg.family} target mixes routed (mixture-of-experts) layers {cfg.moe_layers} "
            "with dense-MLP ones, so its layers cannot be stacked [L, ...] for a scan: keep "
            "the unrolled (list) layout"
        )
    return bool(cfg.moe_layers)


def layer_param_specs(cfg: TargetConfig, layer: int | None = None) -> dict[str, ParamSpec]:
    """Layer `layer`'s parameters (None: those every layer shares, see `_is_moe`)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    hk, gk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    one = _norm_init(cfg)
    specs = {
        "attn_norm": ParamSpec((d,), (None,), one),
        "mlp_norm": ParamSpec((d,), (None,), one),
        "wq": ParamSpec((d, hk), ("embed", "heads"), "normal"),
        "wk": ParamSpec((d, gk), ("embed", "kv_heads"), "normal"),
        "wv": ParamSpec((d, gk), ("embed", "kv_heads"), "normal"),
        "wo": ParamSpec((hk, d), ("heads", "embed"), "normal"),
    }
    if _is_moe(cfg, layer):
        e, fe = cfg.num_experts, cfg.moe_intermediate_size
        specs.update(
            router=ParamSpec((d, e), ("embed", None), "normal"),  # every device routes
            we_gate=ParamSpec((e, d, fe), ("experts", "embed", "expert_mlp"), "normal"),
            we_up=ParamSpec((e, d, fe), ("experts", "embed", "expert_mlp"), "normal"),
            we_down=ParamSpec((e, fe, d), ("experts", "expert_mlp", "embed"), "normal"),
        )
        if cfg.moe_bias:
            specs.update(
                router_bias=ParamSpec((e,), (None,), "zeros"),
                be_gate=ParamSpec((e, fe), ("experts", "expert_mlp"), "zeros"),
                be_up=ParamSpec((e, fe), ("experts", "expert_mlp"), "zeros"),
                be_down=ParamSpec((e, d), ("experts", "embed"), "zeros"),
            )
    else:
        specs.update(
            w_gate=ParamSpec((d, f), ("embed", "mlp"), "normal"),
            w_up=ParamSpec((d, f), ("embed", "mlp"), "normal"),
            w_down=ParamSpec((f, d), ("mlp", "embed"), "normal"),
        )
    if cfg.attention_bias:
        specs["bq"] = ParamSpec((hk,), ("heads",), "zeros")
        specs["bk"] = ParamSpec((gk,), ("kv_heads",), "zeros")
        specs["bv"] = ParamSpec((gk,), ("kv_heads",), "zeros")
    if cfg.attention_out_bias:
        specs["bo"] = ParamSpec((d,), ("embed",), "zeros")
    if cfg.attention_sinks:
        specs["sinks"] = ParamSpec((cfg.num_heads,), ("heads",), "normal")
    if cfg.qk_norm == "head":
        specs["q_norm"] = ParamSpec((cfg.head_dim,), (None,), one)
        specs["k_norm"] = ParamSpec((cfg.head_dim,), (None,), one)
    elif cfg.qk_norm == "full":
        specs["q_norm"] = ParamSpec((hk,), ("heads",), one)
        specs["k_norm"] = ParamSpec((gk,), ("kv_heads",), one)
    if cfg.norm_placement == "sandwich":
        specs["post_attn_norm"] = ParamSpec((d,), (None,), one)
        specs["post_mlp_norm"] = ParamSpec((d,), (None,), one)
    return specs


def _norm_init(cfg: TargetConfig) -> str:
    """A norm weight's identity: 1, or 0 where the norm multiplies by (1 + w) (Gemma)."""
    return "zeros" if cfg.norm_unit_offset else "ones"


FUSED_QKV = ("wq", "wk", "wv")
FUSED_GATE_UP = ("w_gate", "w_up")


def fused_layer_specs(
    cfg: TargetConfig, qkv: bool = True, gate_up: bool = True, layer: int | None = None
):
    """`layer_param_specs` with q/k/v (and their biases) and gate/up fused as `fuse_projections`
    lays them out. Both fused matrices keep the sharded axis major (kv heads; intermediate units),
    so a contiguous split over the model axis gives each device whole heads and units, the same
    ones the unfused matrices give it, where the axis divides (fuse_projections checks). A routed
    layer has no gate/up to fuse: its experts stay as they are."""
    specs = layer_param_specs(cfg, layer)
    gate_up = gate_up and "w_gate" in specs
    d, f, k = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    width = cfg.num_kv_heads * (cfg.num_heads // cfg.num_kv_heads + 2) * k
    if qkv:
        for n in FUSED_QKV:
            del specs[n]
        specs["wqkv"] = ParamSpec((d, width), ("embed", "kv_heads"), "normal")
        if cfg.attention_bias:
            for n in ("bq", "bk", "bv"):
                del specs[n]
            specs["bqkv"] = ParamSpec((width,), ("kv_heads",), "zeros")
    if gate_up:
        for n in FUSED_GATE_UP:
            del specs[n]
        specs["w_gate_up"] = ParamSpec((d, 2 * f), ("embed", "mlp"), "normal")
    return specs


def fusable(cfg: TargetConfig, mesh=None, rules=None) -> tuple[bool, bool]:
    """Whether q/k/v and gate/up can be fused on `mesh` with every device keeping its own heads
    and units: where the model axis divides the kv heads (the intermediate size). A fused matrix
    whose sharded axis does not divide would be replicated (`sharding.spec_for`), undoing the
    tensor parallelism the unfused ones keep, so such a matrix stays unfused."""
    if mesh is None:
        return True, True
    rules = rules or Rules()
    size = lambda logical: mesh.shape.get(rules.mesh_axis(logical), 1)  # noqa: E731
    return (
        cfg.num_kv_heads % size("kv_heads") == 0,
        cfg.intermediate_size % size("mlp") == 0,
    )


def _fuse_qkv(w_q, w_k, w_v, cfg: TargetConfig):
    """[..., H*K], [..., G*K], [..., G*K] -> [..., G*(R+2)*K]: per kv head, its R query heads
    (HF orders query heads so that head h reads kv head h // R), its key, its value."""
    g, k = cfg.num_kv_heads, cfg.head_dim
    r = cfg.num_heads // g
    lead = w_q.shape[:-1]
    parts = (w_q.reshape(*lead, g, r, k), w_k.reshape(*lead, g, 1, k), w_v.reshape(*lead, g, 1, k))
    return jnp.concatenate(parts, axis=-2).reshape(*lead, g * (r + 2) * k)


def _fuse_gate_up(w_gate, w_up):
    """[..., F] twice -> [..., F*2]: unit f's gate and up columns side by side."""
    return jnp.stack([w_gate, w_up], axis=-1).reshape(*w_gate.shape[:-1], -1)


def fuse_layer(p: Params, cfg: TargetConfig, qkv: bool = True, gate_up: bool = True) -> Params:
    """One layer's parameters (or [L, ...]-stacked ones) with q/k/v and gate/up fused."""
    p = dict(p)
    if qkv and "wq" in p:
        p["wqkv"] = _fuse_qkv(*(p.pop(n) for n in FUSED_QKV), cfg)
        if cfg.attention_bias:
            p["bqkv"] = _fuse_qkv(*(p.pop(n) for n in ("bq", "bk", "bv")), cfg)
    if gate_up and "w_gate" in p:
        p["w_gate_up"] = _fuse_gate_up(*(p.pop(n) for n in FUSED_GATE_UP))
    return p


def fuse_projections(params: Params, cfg: TargetConfig, mesh=None) -> Params:
    """params with each layer's q/k/v and gate/up fused (`fused_layer_specs`), where `fusable` on
    `mesh` (the parameters' own when None: `sharding.mesh_of`), laid out on the mesh as
    `param_shardings(fused=...)` says. Layer by layer, the unfused matrices of a layer deleted as
    soon as its fused ones exist, so the device holds at most one layer twice (an 8B target's
    q/k/v and gate/up are 10 GB in bf16): the caller must not use the unfused params afterwards."""
    mesh = mesh if mesh is not None else mesh_of(params)
    qkv, gate_up = fusable(cfg, mesh)
    if not (qkv or gate_up):
        return params
    layers = params["layers"]
    stacked = not isinstance(layers, list)
    out_sh = None
    if mesh is not None:
        out_sh = param_shardings(cfg, mesh, stacked=stacked, fused=(qkv, gate_up))["layers"]
    fuse = functools.partial(fuse_layer, cfg=cfg, qkv=qkv, gate_up=gate_up)
    jits: dict[bool, Any] = {}  # one program per kind of layer (dense MLP, routed)

    def fuse_one(lp: Params, sh) -> Params:
        moe = "router" in lp
        if moe not in jits:
            jits[moe] = jax.jit(fuse, out_shardings=sh)
        new = jax.block_until_ready(jits[moe](lp))
        for name in set(lp) - set(new):
            if isinstance(lp[name], jax.Array):
                lp[name].delete()
        return new

    if stacked:
        return {**params, "layers": fuse_one(layers, out_sh)}
    shs = out_sh or [None] * len(layers)
    return {**params, "layers": [fuse_one(lp, sh) for lp, sh in zip(layers, shs)]}


def top_param_specs(cfg: TargetConfig) -> dict[str, ParamSpec]:
    specs = {
        "embed": ParamSpec((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), "normal"),
        "final_norm": ParamSpec((cfg.hidden_size,), (None,), _norm_init(cfg)),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec(
            (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), "normal"
        )
    return specs


def check_params(params: Params, cfg: TargetConfig) -> None:
    """Asserts every parameter's shape against the config (loaders call this)."""
    for name, spec in top_param_specs(cfg).items():
        assert params[name].shape == spec.shape, (name, params[name].shape, spec.shape)
    layers = params["layers"]
    if not isinstance(layers, list):
        specs = fused_layer_specs(cfg, "wqkv" in layers, "w_gate_up" in layers)
        for name, spec in specs.items():
            shape = layers[name].shape
            assert tuple(shape) == (cfg.num_layers,) + spec.shape, (name, shape, spec.shape)
        return
    assert len(layers) == cfg.num_layers, ("layers", len(layers), cfg.num_layers)
    for i, lp in enumerate(layers):
        specs = fused_layer_specs(cfg, "wqkv" in lp, "w_gate_up" in lp, layer=i)
        for name, spec in specs.items():
            assert name in lp, (i, name, "missing")
            assert tuple(lp[name].shape) == spec.shape, (i, name, lp[name].shape, spec.shape)


def init_params(
    cfg: TargetConfig, key: jax.Array, dtype=jnp.float32, stacked: bool = False, scale: float = 0.02
) -> Params:
    """Random parameters (tests, benchmarks): normal(0, scale) matrices, unit norms, zero biases."""

    def make(spec: ParamSpec, k: jax.Array, lead: tuple[int, ...] = ()) -> jax.Array:
        shape = lead + spec.shape
        if spec.init == "ones":
            return jnp.ones(shape, dtype)
        if spec.init == "zeros":
            return jnp.zeros(shape, dtype)
        return (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    k_top, k_layers = jax.random.split(key)
    top = top_param_specs(cfg)
    params: Params = {
        n: make(s, k) for (n, s), k in zip(top.items(), jax.random.split(k_top, len(top)))
    }
    if stacked:
        lspecs = layer_param_specs(cfg)
        ks = jax.random.split(k_layers, len(lspecs))
        params["layers"] = {
            n: make(s, k, (cfg.num_layers,)) for (n, s), k in zip(lspecs.items(), ks)
        }
    else:
        params["layers"] = []
        for i, lk in enumerate(jax.random.split(k_layers, cfg.num_layers)):
            lspecs = layer_param_specs(cfg, i)
            ks = jax.random.split(lk, len(lspecs))
            params["layers"].append({n: make(s, k) for (n, s), k in zip(lspecs.items(), ks)})
    return params


def stack_layers(params: Params) -> Params:
    """List-of-layers params -> [L, ...]-stacked params (for lax.scan). Every layer must hold
    the same parameters: a target mixing routed and dense-MLP layers (Qwen3-MoE's
    mlp_only_layers) is refused."""
    layers = params["layers"]
    if not isinstance(layers, list):
        return params
    kinds = {tuple(sorted(lp)) for lp in layers}
    if len(kinds) > 1:
        moe = [i for i, lp in enumerate(layers) if "router" in lp]
        raise Eagle3Error(
            "the target's layers hold different parameters "
            + (
                f"(layers {moe} are mixture-of-experts, the others dense MLPs)"
                if 0 < len(moe) < len(layers)
                else "(some fused, some not)"
            )
            + ", so they cannot be stacked [L, ...] for a scan: keep the unrolled (list) layout"
        )
    return {**params, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}


def unstack_layers(params: Params) -> Params:
    if isinstance(params["layers"], list):
        return params
    n = jax.tree.leaves(params["layers"])[0].shape[0]
    return {**params, "layers": [jax.tree.map(lambda x: x[i], params["layers"]) for i in range(n)]}


# ----------------------------------------------------------------------------- KV cache


def make_cache(
    cfg: TargetConfig,
    batch: int,
    slots: int,
    dtype=jnp.float32,
    stacked: bool = False,
    mesh=None,
) -> dict[str, Any]:
    """Static-shape KV cache, per layer K [B, G, K, S] and V [B, G, S, K] (`layers.kv_shapes`),
    allocated separately so both can be donated. With a mesh it is laid out there explicitly
    (`cache_sharding`: batch over data, kv heads over model): allocated inside a jit from zeros
    and left to sharding propagation, it came out replicated, a whole cache per device."""
    ks, vs = kv_shapes(batch, slots, cfg.num_kv_heads, cfg.head_dim, slot_major_keys(cfg.attention))
    if stacked:
        cache = {
            "k": jnp.zeros((cfg.num_layers,) + ks, dtype),
            "v": jnp.zeros((cfg.num_layers,) + vs, dtype),
        }
    else:
        cache = {
            "k": [jnp.zeros(ks, dtype) for _ in range(cfg.num_layers)],
            "v": [jnp.zeros(vs, dtype) for _ in range(cfg.num_layers)],
        }
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(
        cache, cache_sharding(cfg, mesh, batch, stacked=stacked)
    )


# ----------------------------------------------------------------------------- forward


class Output(NamedTuple):
    logits: jax.Array | None  # [B, T, V] or [B, P, V] when logits_idx is given
    hidden: jax.Array  # [B, T, D] final hidden state (after the final norm: what lm_head reads)
    aux: jax.Array | None  # [B, T, n_aux * D] concatenated aux hidden states, in the order asked
    cache: dict[str, Any] | None


class _Site(NamedTuple):
    """What one kind of layer's attention reads (full attention, or a sliding window): RoPE
    tables [B, T, 1, K] and the masks (`forward`'s mask and mask_new, windowed or not)."""

    cos: jax.Array
    sin: jax.Array
    mask: jax.Array
    mask_new: jax.Array | None


def _sites(positions_BT, mask, mask_new, cfg: TargetConfig, cached: bool) -> dict[bool, _Site]:
    """{sliding: _Site} for each kind of layer cfg has (True: a sliding-window layer). The
    window counts positions: a query at p sees keys at positions > p - window, where a cached slot
    s holds position s (`cached`) and a cache-less call's or a tree's keys are its own tokens."""
    tables: dict[Any, tuple[jax.Array, jax.Array]] = {}
    out = {}
    for sliding in sorted({cfg.is_sliding_layer(i) for i in range(cfg.num_layers)}):
        rope = cfg.sliding_rope if sliding and cfg.sliding_rope is not None else cfg.rope
        if rope not in tables:
            inv_freq = rope_inv_freq(rope, cfg.head_dim)
            tables[rope] = rope_cos_sin(positions_BT, inv_freq, rope.attention_factor)
        m, m_new = mask, mask_new
        if sliding:
            lo = positions_BT[:, :, None] - cfg.sliding_window
            keys = jnp.arange(mask.shape[-1])[None, None, :] if cached else positions_BT[:, None]
            m = mask & (keys > lo)
            if mask_new is not None:
                m_new = mask_new & (positions_BT[:, None, :] > lo)
        out[sliding] = _Site(*tables[rope], m, m_new)
    return out


def _layer(
    p: Params,
    h_BTD: jax.Array,
    kv: tuple[jax.Array, jax.Array] | None,
    write_B: jax.Array | None,
    site: _Site,
    cfg: TargetConfig,
    sliding: bool | None,
    cache_rows: jax.Array | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """One decoder layer; `site` its kind's RoPE and masks, `sliding` whether it is a
    sliding-window layer (None: either, a scan over layers of both kinds); `cache_rows`:
    `forward`'s."""
    b, t, _ = h_BTD.shape
    norm = functools.partial(rms_norm, eps=cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset)
    pre = cfg.norm_placement in ("pre", "sandwich")
    x = norm(h_BTD, p["attn_norm"]) if pre else h_BTD
    pol = cfg.products
    if "wqkv" in p:
        qkv = dense(x, p["wqkv"], policy=pol)
        q, k, v = _split_qkv(qkv + p["bqkv"] if cfg.attention_bias else qkv, cfg)
    else:
        q, k, v = (dense(x, p[n], policy=pol) for n in ("wq", "wk", "wv"))
        if cfg.attention_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if cfg.qk_norm == "full":
        q, k = norm(q, p["q_norm"]), norm(k, p["k_norm"])
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm == "head":
        q, k = norm(q, p["q_norm"]), norm(k, p["k_norm"])
    q, k = apply_rope(q, site.cos, site.sin), apply_rope(k, site.cos, site.sin)
    # a verification crossing a sliding window gives its nodes different cached ranges
    one_range = sliding is False or t == 1
    att, kv = cached_attention(
        q, k, v, kv, write_B, site.mask, site.mask_new, cfg.attention, one_range,
        cfg.attention_scale, p.get("sinks"), cache_rows,
    )  # fmt: skip
    o = dense(att.reshape(b, t, -1), p["wo"], policy=pol)
    if cfg.attention_out_bias:
        o = o + p["bo"]
    if "router" in p:
        mlp = functools.partial(_moe, cfg=cfg)
    else:
        mlp = functools.partial(_mlp, pol=pol, activation=cfg.mlp_activation)
    if cfg.norm_placement == "sandwich":  # Gemma 3: each block's input and output normed
        h_BTD = h_BTD + norm(o, p["post_attn_norm"])
        h_BTD = h_BTD + norm(mlp(p, norm(h_BTD, p["mlp_norm"])), p["post_mlp_norm"])
    elif pre:
        h_BTD = h_BTD + o
        x = norm(h_BTD, p["mlp_norm"])
        h_BTD = h_BTD + mlp(p, x)
    else:
        h_BTD = h_BTD + norm(o, p["attn_norm"])
        h_BTD = h_BTD + norm(mlp(p, h_BTD), p["mlp_norm"])
    return h_BTD, kv


def _split_qkv(qkv: jax.Array, cfg: TargetConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A fused projection [B, T, G*(R+2)*K] -> q [B, T, H*K], k and v [B, T, G*K], each in the
    unfused projections' column order."""
    b, t, _ = qkv.shape
    g, k = cfg.num_kv_heads, cfg.head_dim
    r = cfg.num_heads // g
    x = qkv.reshape(b, t, g, r + 2, k)
    return (
        x[:, :, :, :r].reshape(b, t, g * r * k),
        x[:, :, :, r].reshape(b, t, g * k),
        x[:, :, :, r + 1].reshape(b, t, g * k),
    )


def _mlp(p: Params, x: jax.Array, pol, activation: str = "silu") -> jax.Array:
    """The gated MLP (SwiGLU, or Gemma's GeGLU) from separate gate/up matrices or the fused one
    ([D, F*2], gate and up of a unit side by side)."""
    if "w_gate_up" not in p:
        return swiglu(x, p["w_gate"], p["w_up"], p["w_down"], policy=pol, activation=activation)
    gu = dense(x, p["w_gate_up"], policy=pol)
    gu = gu.reshape(*gu.shape[:-1], -1, 2)
    return dense(ACTIVATIONS[activation](gu[..., 0]) * gu[..., 1], p["w_down"], policy=pol)


def route(
    router_DE: jax.Array, x_BTD: jax.Array, cfg: TargetConfig, bias_E: jax.Array | None = None
):
    """The router of a mixture-of-experts layer, for x [..., D] (here [B, T, D]) ->
    (top_idx_BTk int32, top_w_BTk fp32, weights_BTE fp32): each token's k chosen experts, best
    first, their weights, and the same weights scattered over all E experts (zero for the
    unchosen). Softmax and top k are on fp32 probabilities as in transformers
    (Qwen3MoeTopKRouter, MixtralTopKRouter); the logits are accumulated in fp32 where transformers
    rounds them to the weights' dtype first (the same in fp32). Equal probabilities go to the
    lowest expert index (`jax.lax.top_k`); torch.topk promises no order there and on the CPU
    does not always take the lowest, so at an exact tie the two can route differently
    (tests/test_moe.py builds one; docs/design.md, "Mixture-of-experts targets").

    gpt-oss (GptOssTopKRouter): `bias_E` is added to the logits, and with
    cfg.router_topk_logits the top k is taken of the logits and the softmax over those k only
    (the same weights as a renormalised top k of the full softmax, up to rounding, but chosen
    from the logits themselves, as transformers chooses them)."""
    logits_BTE = jnp.matmul(x_BTD, router_DE, preferred_element_type=jnp.float32)
    if bias_E is not None:
        logits_BTE = logits_BTE + bias_E.astype(jnp.float32)
    if cfg.router_topk_logits:
        top_logits, top_idx = jax.lax.top_k(logits_BTE, cfg.num_experts_per_tok)
        top_w = jax.nn.softmax(top_logits, axis=-1)
    else:
        probs_BTE = jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1)
        top_w, top_idx = jax.lax.top_k(probs_BTE, cfg.num_experts_per_tok)
        if cfg.norm_topk_prob:
            top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    onehot_BTkE = jax.nn.one_hot(top_idx, cfg.num_experts, dtype=jnp.float32)
    weights_BTE = jnp.einsum("...k,...ke->...e", top_w, onehot_BTkE)
    return top_idx, top_w, weights_BTE


MOE_DISPATCHES = ("dense", "gather", "ragged")


def moe_split(cfg: TargetConfig, batch: int) -> tuple[int, int]:
    """Over how many devices a routed forward of `batch` rows splits its rows and its experts
    under cfg.moe_mesh (`_moe_on_mesh`): the data axis where it divides the batch and the
    model axis where the parameters' layout splits the experts (`sharding.spec_for`), else 1."""
    mesh = cfg.moe_mesh
    if mesh is None:
        return 1, 1
    data = mesh.shape["data"]
    return (data if batch % data == 0 else 1), (
        mesh.shape["model"] if _expert_specs(cfg)["we_gate"][0] == "model" else 1
    )


def moe_path(cfg: TargetConfig, tokens: int, batch: int = 1) -> str:
    """Which computation a routed layer of `cfg` runs for a forward of `tokens` tokens in `batch`
    rows (static): "dense" (every expert on every token), "gather" (each (token, expert) pair's
    expert weights gathered, while a device's n k pairs are at most cfg.moe_gather_pairs x its
    experts: a step or a short chain reads only its chosen experts) or "ragged" (the pairs sorted
    by expert through `jax.lax.ragged_dot`), by `cfg.moe_dispatch`: "dense" always dense,
    "gather" gathered or dense, "ragged" gathered or ragged. Under cfg.moe_mesh a device counts
    its own rows' pairs and its own experts (`moe_split`)."""
    if cfg.moe_dispatch not in MOE_DISPATCHES:
        raise Eagle3Error(
            f"moe_dispatch {cfg.moe_dispatch!r}: choose one of {', '.join(MOE_DISPATCHES)}"
        )
    if cfg.moe_dispatch == "dense":
        return "dense"
    rows, experts = moe_split(cfg, batch)
    pairs = tokens // rows * cfg.num_experts_per_tok
    if pairs <= cfg.moe_gather_pairs * (cfg.num_experts // experts):
        return "gather"
    return "ragged" if cfg.moe_dispatch == "ragged" else "dense"


def _moe(p: Params, x_BTD: jax.Array, cfg: TargetConfig) -> jax.Array:
    """A routed SwiGLU MLP. Dense (`moe_path`; the module docstring): every expert on every
    token, each expert's activations scaled by the token's weight for it (zero unless routed)
    before one down projection that sums over experts and intermediate units. With experts
    sharded over the model axis the products stay on each device's experts and the sum over
    experts is a partial sum XLA all-reduces. gpt-oss's biases (cfg.moe_bias): the gate and up
    biases join each expert's products, and each expert's down bias is weighted like its output
    (a [B, T, E] x [E, D] product, zero for the unrouted). Gathered or ragged: `_moe_pairs`."""
    idx_BTk, w_BTk, weights_BTE = route(p["router"], x_BTD, cfg, p.get("router_bias"))
    b, t = x_BTD.shape[:2]
    path = moe_path(cfg, b * t, b)
    if path != "dense" and cfg.moe_mesh is not None:
        return _moe_on_mesh(p, x_BTD, idx_BTk, w_BTk, cfg, path)
    if path != "dense":
        return _moe_pairs(p, x_BTD, idx_BTk, w_BTk, cfg, path)
    gate_BTEF = jnp.einsum("btd,edf->btef", x_BTD, p["we_gate"])
    up_BTEF = jnp.einsum("btd,edf->btef", x_BTD, p["we_up"])
    if cfg.moe_bias:
        gate_BTEF, up_BTEF = gate_BTEF + p["be_gate"], up_BTEF + p["be_up"]
    act_BTEF = expert_activation(gate_BTEF, up_BTEF, cfg)
    w_BTE = weights_BTE.astype(act_BTEF.dtype)
    out_BTD = jnp.einsum("btef,efd->btd", act_BTEF * w_BTE[..., None], p["we_down"])
    if cfg.moe_bias:
        out_BTD = out_BTD + jnp.einsum("bte,ed->btd", w_BTE, p["be_down"])
    return out_BTD


# a routed layer's expert parameters, the ones expert parallelism splits (`_moe_on_mesh`)
EXPERT_PARAMS = ("we_gate", "we_up", "we_down", "be_gate", "be_up", "be_down")


def _expert_specs(cfg: TargetConfig) -> dict[str, PartitionSpec]:
    """Each expert parameter's partition spec on cfg.moe_mesh, as the loaders lay it out
    (`sharding.spec_for` over `layer_param_specs`: the experts over the model axis where it
    divides them, else whole on every device)."""
    specs = layer_param_specs(cfg, cfg.moe_layers[0])
    return {
        name: spec_for(spec.axes, spec.shape, cfg.moe_mesh, Rules())
        for name, spec in specs.items()
        if name in EXPERT_PARAMS
    }


def _moe_on_mesh(
    p: Params, x_BTD: jax.Array, idx_BTk: jax.Array, w_BTk: jax.Array, cfg: TargetConfig, path: str
) -> jax.Array:
    """The gathered or ragged dispatch on cfg.moe_mesh, each device on its own rows and its own
    experts (`jax.shard_map`): the rows over the data axis where it divides the batch, the
    experts where the parameters are split over the model axis (expert parallelism). A device
    runs `_moe_pairs` on the (token, expert) pairs routed to its experts (the others add an
    exact zero) and the partial sums are all-reduced over the model axis, the one collective
    the dense dispatch's contraction over experts also pays: no expert weights move, and a
    device's gather reads its pairs' experts, its ragged product its own experts' FLOPs. Without
    this GSPMD would have to partition a gather or a sort across devices (a sort spanning the
    batch, or every device gathering every expert)."""
    specs = _expert_specs(cfg)
    rows, _ = moe_split(cfg, x_BTD.shape[0])
    row = PartitionSpec("data" if rows > 1 else None)
    axis = specs["we_gate"][0]  # "model" (of any size) or None: the experts whole everywhere

    def local(x, idx, w, experts):
        e = experts["we_gate"].shape[0]
        first = 0 if axis is None else jax.lax.axis_index(axis) * e
        out = _moe_pairs(experts, x, idx - first, w, cfg, path, local_experts=e)
        return out if axis is None else jax.lax.psum(out, axis)

    run = jax.shard_map(
        local, mesh=cfg.moe_mesh, in_specs=(row, row, row, specs), out_specs=row
    )  # fmt: skip
    return run(x_BTD, idx_BTk, w_BTk, {name: p[name] for name in specs})


def _moe_pairs(
    p: Params,
    x_BTD: jax.Array,
    idx_BTk: jax.Array,
    w_BTk: jax.Array,
    cfg: TargetConfig,
    path: str,
    local_experts: int | None = None,
) -> jax.Array:
    """The routed MLP run only on each token's k chosen experts, P = B x T x k (token, expert)
    pairs: each pair's gate/up/down products with its own expert's weights, the pair's output
    weighted by the router and the k outputs of a token summed in top-k order. "gather": the
    pairs' expert matrices taken from the weights ([P, D, F'], a few experts' bytes: a decode
    step reads k experts of E, not all of them); "ragged": the pairs sorted by expert and each
    expert's run of pairs multiplied by its matrices (`jax.lax.ragged_dot`, the grouped product
    maxtext's and MegaBlocks' MoE layers use: k experts' FLOPs a token), then put back in token
    order. Both do the same arithmetic per pair (sums over D, then F'), so a verification routed
    one way and a step the other differ only in the products' summation order.
    `local_experts`: a device's share of the experts under `_moe_on_mesh` (p holds those, and
    idx counts from the device's first): a pair routed outside [0, local_experts) gathers
    expert 0 or sorts after every group (ragged_dot leaves rows past its groups zero) and its
    output is replaced by zero."""
    b, t, d = x_BTD.shape
    k = cfg.num_experts_per_tok
    experts = cfg.num_experts if local_experts is None else local_experts
    x_PD = jnp.repeat(x_BTD.reshape(b * t, d), k, axis=0)
    e_P = idx_BTk.reshape(-1)
    mine_P = None if local_experts is None else (e_P >= 0) & (e_P < experts)
    if mine_P is not None:  # gather: expert 0's rows; ragged: after every group
        e_P = jnp.where(mine_P, e_P, 0 if path == "gather" else experts)
    if path == "gather":

        def product(a_PX, w_EXY):
            return jnp.einsum("px,pxy->py", a_PX, w_EXY.at[e_P].get(mode="promise_in_bounds"))
    else:
        order_P = jnp.argsort(e_P, stable=True)
        e_P, x_PD = e_P[order_P], x_PD[order_P]
        sizes_E = jnp.bincount(e_P, length=experts).astype(jnp.int32)  # drops e_P == experts
        e_P = jnp.minimum(e_P, experts - 1)  # the biases' rows of the pairs past every group

        def product(a_PX, w_EXY):
            return jax.lax.ragged_dot(a_PX, w_EXY, sizes_E)

    gate_PF, up_PF = product(x_PD, p["we_gate"]), product(x_PD, p["we_up"])
    if cfg.moe_bias:
        gate_PF, up_PF = gate_PF + p["be_gate"][e_P], up_PF + p["be_up"][e_P]
    out_PD = product(expert_activation(gate_PF, up_PF, cfg), p["we_down"])
    if cfg.moe_bias:
        out_PD = out_PD + p["be_down"][e_P]
    if path != "gather":  # back to token order: row p of the sorted output went to order_P[p]
        back_P = jnp.zeros_like(order_P).at[order_P].set(jnp.arange(order_P.shape[0]))
        out_PD = out_PD[back_P]
    if mine_P is not None:
        out_PD = jnp.where(mine_P[:, None], out_PD, jnp.zeros_like(out_PD))
    out_BTkD = out_PD.reshape(b, t, k, d)
    return jnp.einsum("btk,btkd->btd", w_BTk.astype(out_BTkD.dtype), out_BTkD)


def expert_activation(gate: jax.Array, up: jax.Array, cfg: TargetConfig) -> jax.Array:
    """An expert's gated activation: SwiGLU, silu(gate) * up; or, where cfg.swiglu_limit is set,
    gpt-oss's clamped variant as transformers' GptOssExperts._apply_gate computes it: the gate
    clamped above at the limit, up clamped to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    if cfg.swiglu_limit is None:
        return jax.nn.silu(gate) * up
    limit = cfg.swiglu_limit
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))


def forward(
    params: Params,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    mask: jax.Array,
    cfg: TargetConfig,
    cache: dict[str, Any] | None = None,
    write_B: jax.Array | None = None,
    aux_ids: tuple[int, ...] = (),
    logits_idx_BP: jax.Array | None = None,
    compute_logits: bool = True,
    mask_new: jax.Array | None = None,
    cache_rows: jax.Array | None = None,
) -> Output:
    """Runs T new tokens through the decoder.

    Args:
      tokens_BT, positions_BT: int32 [B, T] token ids and RoPE positions (tree depth offsets allowed).
      mask: bool [B, T, S] over cache slots after this call's writes (cache given), else [B, T, T]:
        causal (a tree's), without the sliding window, which the layers apply (module docstring).
      cache: from `make_cache`; the new K/V of row b go to slots write_B[b] .. write_B[b] + T - 1.
      aux_ids: HF `hidden_states` indices to capture (i < L: input to layer i; L: final normed state).
      logits_idx_BP: optional [B, P] token indices whose logits are computed (saves the lm_head cost).
      mask_new: bool [B, T, T], with a cache: the cache is only read (`mask` then covers its S
        slots as they are) and the T new tokens attend to each other under mask_new; the returned
        cache holds just the new entries ([B, T, G, K] per layer), for the caller to write where
        it wants (a tree verification keeps only the accepted path's). write_B is unused.
      cache_rows: int [B], with mask_new: the cache holds C >= B rows and the call's row b reads
        its row cache_rows[b] (distinct), in place (`layers.rows_attention`): a round over the
        busy slots of a serving state (decoding/slots.py).
    """
    if cache_rows is not None and (cache is None or mask_new is None):
        raise ValueError("cache_rows reads a cache: give the cache and mask_new")
    sites = _sites(positions_BT, mask, mask_new, cfg, cached=cache is not None)
    h = embed_tokens(params, tokens_BT, cfg)
    captured: dict[int, jax.Array] = {}
    layers = params["layers"]
    new_k, new_v = [], []
    if isinstance(layers, list):
        for i, lp in enumerate(layers):
            if i in aux_ids:
                captured[i] = h
            kv = None if cache is None else (cache["k"][i], cache["v"][i])
            sliding = cfg.is_sliding_layer(i)
            with jax.named_scope(f"layer_{i}"):
                h, kv = _layer(lp, h, kv, write_B, sites[sliding], cfg, sliding, cache_rows)
            if kv is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
        new_cache = None if cache is None else {"k": new_k, "v": new_v}
    else:
        h, new_cache, captured = _scan_layers(
            layers, h, cache, write_B, sites, cfg, aux_ids, cache_rows
        )
    hidden = rms_norm(h, params["final_norm"], cfg.rms_norm_eps, cfg.norm_unit_offset)
    if cfg.num_layers in aux_ids:
        captured[cfg.num_layers] = hidden
    aux = jnp.concatenate([captured[i] for i in aux_ids], axis=-1) if aux_ids else None
    logits = None
    if compute_logits:
        x = (
            hidden
            if logits_idx_BP is None
            else jnp.take_along_axis(hidden, logits_idx_BP[..., None], 1)
        )
        logits = lm_head(params, x, cfg)
    return Output(logits, hidden, aux, new_cache)


def embed_tokens(params: Params, tokens_BT: jax.Array, cfg: TargetConfig) -> jax.Array:
    """The decoder's input [B, T, D]: the embedding rows, times sqrt(D) where cfg.scale_embeddings
    (Gemma 3), the scale rounded to fp32 and then to the embedding's dtype and the product in
    that dtype, as transformers' Gemma3TextScaledWordEmbedding computes it."""
    h = params["embed"][tokens_BT]
    if cfg.scale_embeddings:
        h = h * jnp.asarray(np.float32(cfg.hidden_size**0.5), h.dtype)
    return h


def lm_head(params: Params, hidden: jax.Array, cfg: TargetConfig) -> jax.Array:
    """Logits [..., V], fp32 whatever the parameters' dtype, from final normed hidden states (tied
    embeddings read the embedding), soft-capped where cfg.final_logit_softcapping is set. bf16
    logits tie often (one bf16 step at a logit of 16-32 is 0.125) and a one-step change flips a
    greedy choice; fp32 ones make greedy decoding, and a speculative round's acceptance, far less
    sensitive to the order of the products' sums."""
    if cfg.tie_word_embeddings:
        # hidden . embed^T without transposing the [V, D] embedding: a few rows (a tree
        # verification) as a row reduction where cfg.products says, which cpu_tuning measures per
        # CPU (layers.dense_t)
        logits = dense_t(
            hidden, params["embed"], jnp.float32, weight_left=True, policy=cfg.products
        )
    else:
        logits = jnp.matmul(hidden, params["lm_head"], preferred_element_type=jnp.float32)
    cap = cfg.final_logit_softcapping
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def _scan_layers(layers, h, cache, write_B, sites: dict[bool, _Site], cfg, aux_ids,
                 cache_rows=None):  # fmt: skip
    """Stacked layers: one lax.scan per segment between aux capture points. Where the target has
    layers of both kinds (Gemma 3), each step picks its kind's RoPE tables and masks by a
    scanned per-layer flag."""
    bounds = sorted({0, cfg.num_layers, *[i for i in aux_ids if i < cfg.num_layers]})
    flags = np.asarray([cfg.is_sliding_layer(i) for i in range(cfg.num_layers)])
    mixed = len(sites) > 1

    def site_of(flag) -> tuple[_Site, bool | None]:
        if not mixed:
            (sliding,) = sites
            return sites[sliding], sliding
        return jax.tree.map(lambda a, b: jnp.where(flag, a, b), sites[True], sites[False]), None

    captured, ks, vs = {}, [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if lo in aux_ids:
            captured[lo] = h
        seg = jax.tree.map(lambda x: x[lo:hi], layers)
        seg_flags = jnp.asarray(flags[lo:hi])
        if cache is None:

            def body(h, xs):
                lp, flag = xs
                site, sliding = site_of(flag)
                return _layer(lp, h, None, None, site, cfg, sliding)[0], None

            h, _ = jax.lax.scan(body, h, (seg, seg_flags))
        else:

            def body_c(h, xs):
                lp, k, v, flag = xs
                site, sliding = site_of(flag)
                h, (k, v) = _layer(lp, h, (k, v), write_B, site, cfg, sliding, cache_rows)
                return h, (k, v)

            h, (k, v) = jax.lax.scan(
                body_c, h, (seg, cache["k"][lo:hi], cache["v"][lo:hi], seg_flags)
            )
            ks.append(k)
            vs.append(v)
    new_cache = None if cache is None else {"k": jnp.concatenate(ks), "v": jnp.concatenate(vs)}
    return h, new_cache, captured


@functools.partial(jax.jit, static_argnames=("cfg", "aux_ids"))
def full_forward(params: Params, tokens_BT: jax.Array, cfg: TargetConfig, aux_ids=()) -> Output:
    """Causal forward over whole sequences without a cache (tests, training features)."""
    b, t = tokens_BT.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    q = jnp.arange(t)
    mask = q[None, :] <= q[:, None]
    return forward(
        params, tokens_BT, positions, jnp.broadcast_to(mask, (b, t, t)), cfg, aux_ids=aux_ids
    )


def num_params(params: Params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def param_shardings(
    cfg: TargetConfig, mesh, rules=None, stacked: bool = False, fused=(False, False)
) -> Params:
    """NamedShardings matching `init_params(cfg, stacked=...)`, derived from the same ParamSpecs;
    `fused` = (q/k/v, gate/up) for parameters fused by `fuse_projections`."""

    rules = rules or Rules()
    out: Params = {n: named(mesh, s.axes, s.shape, rules) for n, s in top_param_specs(cfg).items()}
    if stacked:
        lspecs = fused_layer_specs(cfg, *fused)
        out["layers"] = {
            n: named(mesh, (None,) + s.axes, (cfg.num_layers,) + s.shape, rules)
            for n, s in lspecs.items()
        }
    else:
        out["layers"] = [
            {n: named(mesh, s.axes, s.shape, rules) for n, s in specs.items()}
            for specs in (fused_layer_specs(cfg, *fused, layer=i) for i in range(cfg.num_layers))
        ]
    return out


def cache_sharding(cfg: TargetConfig, mesh, batch: int, rules=None, stacked: bool = False):
    """KV cache shardings (K [.., B, G, K, S], V [.., B, G, S, K]): batch over data, kv heads over
    model, each where it divides (else replicated)."""

    rules = rules or Rules()
    axes = ("batch", "kv_heads", None, None)
    shape = (batch, cfg.num_kv_heads, 1, 1)
    if stacked:
        s = named(mesh, (None,) + axes, (cfg.num_layers,) + shape, rules)
        return {"k": s, "v": s}
    s = named(mesh, axes, shape, rules)
    return {"k": [s] * cfg.num_layers, "v": [s] * cfg.num_layers}
