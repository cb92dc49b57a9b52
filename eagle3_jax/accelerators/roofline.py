"""What a plain decode step and a speculative round cost on a device, counted from the shapes.

A roofline model of the programs `decoding/plain.py` (`decode_step`) and `decoding/speculative.py`
(`round_step`, the eagle3 drafter, greedy, verify threshold 0) run, with no device work: bytes
moved and FLOPs per phase, from a TargetConfig, a DraftConfig, a TreeConfig, the batch B, the
cache size S and the parameters' dtype.

What is counted (per program; `Phase` fields):
  weights: every weight matrix the phase multiplies by, read once (the embedding only as the rows
    gathered, unless it is the tied output layer); of a mixture-of-experts layer, the router and
    only the experts the forward's tokens touch (`experts`: k at one token, nearly all E for a
    60-token tree), unless the dispatch is dense;
  kv: the KV cache read and written. Attention reads the WHOLE static buffer (`slots`) whatever
    the current length (the mask hides the rest), so S is the buffer size `plan_shape` picks, not
    the tokens so far. A verification also writes a float32 copy of V for its float32 p.V
    product (`models/layers.attention`, exact for <= 64 queries) and reads it back;
  activations: the tensors between fusions (norms, projections, residuals, MLP; a per-layer
    element count in `_layer_act_elems`), the float32 attention scores and probabilities (four
    passes over [B, H, T, S + T]), logits in float32 (written and read again by the top-k or the
    argmax), aux features;
  flops: 2 x rows x weights for every product, plus QK and p.V; elementwise work is left out.
    A routed layer's: the router and k experts a token (k / E of running every expert).
    `fp32_flops` are the products XLA runs at float32 precision: p.V of a verification or a
    draft step (`Precision.HIGHEST`), and a one-query step's multiply-and-sum attention. On a GPU
    they run on the CUDA cores (67 TFLOP/s on an H100, not 989), on a TPU as 6 bf16 passes.
  serial_iters: small dependent steps: the ceil(log2 N) boolean squarings that give
    `select_tree` its ancestor masks (tree._depth_and_mask; until 2026-12 a serial loop over the
    nodes, and acceptance's another: 2 N), charged at `Device.loop_iter_s` each.

Time of a phase = max(bytes / bandwidth, flops / peak + fp32_flops / fp32 peak) + loops +
collectives; a program's time = the sum of its phases (they are data dependent, so one's memory
traffic cannot hide under another's compute) + `Device.launch_s` once (each is one jitted
program). With `chips` > 1 (tensor parallel over the model axis) bytes and FLOPs split evenly and
each layer pays two all-reduces of `Device.allreduce_s`; a routed layer's experts are split by
expert (expert parallelism), so its expert bytes are charged as the busiest chip's.
"""

from __future__ import annotations

import dataclasses
import math

from eagle3_jax.accelerators.experts import ROUTED, Routing, busiest_chip
from eagle3_jax.accelerators.specs import Device
from eagle3_jax.config import DraftConfig, TargetConfig
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.models.draft_output import union_capacity
from eagle3_jax.models.layers import EXACT_QUERIES

# ----------------------------------------------------------------------------- phases and programs


@dataclasses.dataclass(frozen=True)
class Phase:
    """One sequential part of a program: bytes moved and FLOPs (see the module docstring)."""

    name: str
    weights: float = 0.0
    kv: float = 0.0
    activations: float = 0.0
    flops: float = 0.0
    fp32_flops: float = 0.0
    serial_iters: int = 0
    allreduces: int = 0
    layers: int = 0  # decoder layers run (for a per-layer host overhead)

    @property
    def bytes(self) -> float:
        return self.weights + self.kv + self.activations

    def time_s(self, dev: Device, chips: int = 1) -> float:
        mem = self.bytes / (dev.hbm_bw * chips)
        comp = self.flops / (dev.matmul_flops * chips) + self.fp32_flops / (dev.fp32_flops * chips)
        coll = self.allreduces * dev.allreduce_s if chips > 1 else 0.0
        return max(mem, comp) + self.serial_iters * dev.loop_iter_s + coll

    def __add__(self, other: Phase) -> Phase:
        return Phase(
            self.name,
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)[1:]),
        )


@dataclasses.dataclass(frozen=True)
class Program:
    """One jitted program: its phases, run in order."""

    name: str
    phases: tuple[Phase, ...]

    def total(self) -> Phase:
        out = Phase(self.name)
        for p in self.phases:
            out = out + p
        return dataclasses.replace(out, name=self.name)

    @property
    def bytes(self) -> float:
        return self.total().bytes

    @property
    def flops(self) -> float:
        """All FLOPs (matrix-unit and float32 ones)."""
        t = self.total()
        return t.flops + t.fp32_flops

    def time_s(self, dev: Device, chips: int = 1, layer_overhead_s: float = 0.0) -> float:
        """Roofline time of the phases + one launch. `layer_overhead_s`: a host-side cost per
        decoder layer per forward (a framework that launches each layer's kernels from Python,
        as the papers' PyTorch code does; 0 for our one-program round)."""
        extra = layer_overhead_s * sum(p.layers for p in self.phases)
        return sum(p.time_s(dev, chips) for p in self.phases) + dev.launch_s + extra

    def breakdown_s(self, dev: Device, chips: int = 1) -> dict[str, float]:
        return {p.name: p.time_s(dev, chips) for p in self.phases}


# ----------------------------------------------------------------------------- counting


def _attention_weights(tcfg: TargetConfig) -> int:
    """Parameters of one target layer's attention and norms (projections, biases, q/k norms,
    gpt-oss's sinks)."""
    d = tcfg.hidden_size
    hk, gk = tcfg.num_heads * tcfg.head_dim, tcfg.num_kv_heads * tcfg.head_dim
    n = d * hk + 2 * d * gk + hk * d + 2 * d
    if tcfg.attention_bias:
        n += hk + 2 * gk
    if tcfg.attention_out_bias:
        n += d
    if tcfg.attention_sinks:
        n += tcfg.num_heads
    if tcfg.qk_norm == "head":
        n += 2 * tcfg.head_dim
    elif tcfg.qk_norm == "full":
        n += hk + gk
    return n


def expert_weights(tcfg: TargetConfig) -> int:
    """Parameters of one expert (its gate, up and down projections, and their biases where
    `moe_bias`)."""
    d, fe = tcfg.hidden_size, tcfg.moe_intermediate_size
    return 3 * d * fe + (2 * fe + d if tcfg.moe_bias else 0)


def _router_weights(tcfg: TargetConfig) -> int:
    e = tcfg.num_experts
    return tcfg.hidden_size * e + (e if tcfg.moe_bias else 0)


def _layer_weights(tcfg: TargetConfig, layer: int) -> int:
    """Parameters of one target layer: attention, norms, and its MLP (a dense SwiGLU, or a routed
    layer's router [D, E] and all E experts)."""
    d = tcfg.hidden_size
    if tcfg.is_moe_layer(layer):
        mlp = _router_weights(tcfg) + tcfg.num_experts * expert_weights(tcfg)
    else:
        mlp = 3 * d * tcfg.intermediate_size
    return _attention_weights(tcfg) + mlp


def target_params(tcfg: TargetConfig) -> int:
    """All target parameters (embedding, layers, final norm, untied output layer)."""
    vd = tcfg.vocab_size * tcfg.hidden_size
    return (
        vd * (1 if tcfg.tie_word_embeddings else 2)
        + sum(_layer_weights(tcfg, i) for i in range(tcfg.num_layers))
        + tcfg.hidden_size
    )


def draft_params(dcfg: DraftConfig) -> int:
    """The head's own parameters (fc, the midlayer, final norm, and its output layer: an lm_head
    over Vd, none for a head that reads the target's output embedding, plus SpecVocab's
    speculator [d, r] and [r, V])."""
    d, f = dcfg.hidden_size, dcfg.intermediate_size
    hk, gk = dcfg.num_heads * dcfg.head_dim, dcfg.num_kv_heads * dcfg.head_dim
    layer = 2 * d * hk + 2 * 2 * d * gk + hk * d + 3 * d * f + 3 * d
    own = d * dcfg.draft_vocab_size if dcfg.lm_head_source == "own" else 0
    speculator = dcfg.speculator_rank * (d + dcfg.vocab_size)
    return dcfg.feature_size * d + layer + d + own + speculator


def output_layer(
    dcfg: DraftConfig,
    rows: int,
    dtype_bytes: int = 2,
    fused_gather: bool = False,
    batch: int = 1,
) -> tuple[int, int, int]:
    """`draft_topk` on `rows` sibling rows (1: a chain or the root; top-k: a tree level) of each
    of `batch` sequences -> (weight elements read, activation bytes, FLOPs).

    An lm_head over Vd (own, or the target's output embedding when Vd = V): every row's logits in
    float32, written, read and written by the log-softmax, read by the top-k. SpecVocab: the
    speculator's approximate logits (n A) B over V in the parameters' dtype, written and read by
    the top-k of `spec_candidates` K; then the candidates' rows of the target's output embedding,
    as `draft_output.candidate_logits` gathers them: per row ([rows, K, d]) or, for siblings
    whose shared set is smaller, once per level (`union_capacity` U rows: a mark per vocabulary
    id written, counted and read, [U, d] gathered, every sibling's U logits in float32 written and
    its K picked); gathered rows are written then read by the product (the gather reads rows,
    not the matrix); exact logits over the candidates in float32. `fused_gather`: the lower bound
    where the gather feeds the product directly, each gathered row read once and never written.
    Not counted: a level whose union overflows (one sequence's is enough: the test covers the
    batch) takes the per-row gather, and choosing the branch may cost a GPU a read of the
    predicate by the host per level; a device run of `round-cost --head specvocab` measures both."""
    d, db, n = dcfg.hidden_size, dtype_bytes, batch * rows
    if not n:
        return 0, 0, 0
    if not dcfg.speculator_rank:
        vd = dcfg.draft_vocab_size
        return d * vd, 4 * n * vd * 4, 2 * n * d * vd
    r, v, k = dcfg.speculator_rank, dcfg.vocab_size, dcfg.spec_candidates
    cap = union_capacity(rows, k, v)
    passes = 1 if fused_gather else 3
    acts = 2 * n * v * db + 4 * n * k * 4
    if cap < rows * k:  # one shared gather per level
        acts += 3 * batch * v * 4 + passes * batch * cap * d * db + n * (cap + k) * 4
        return r * (d + v), acts, 2 * n * (r * (d + v) + cap * d)
    acts += passes * n * k * d * db
    return r * (d + v), acts, 2 * n * (r * (d + v) + k * d)


def _layer_act_elems(d: int, f: int, hk: int, gk: int, in_width: int) -> int:
    """Elements one token moves between fusions in one decoder layer (reads + writes):
    norm in/out (2 in_width), q/k/v input read 3x and outputs written, RoPE reads and writes q and k,
    attention output written and read by o_proj, o_proj output, residual add (3 d), MLP norm (2 d),
    gate/up input read 2x, outputs written (2 f), SwiGLU reads 2 f and writes f, down reads f and
    writes d, residual add (3 d)."""
    return (
        2 * in_width
        + 3 * in_width
        + (hk + 2 * gk)
        + 2 * (hk + gk)
        + 2 * hk
        + d
        + 3 * d
        + 2 * d
        + 2 * d
        + 2 * f
        + 3 * f
        + f
        + d
        + 3 * d
    )


def _attention(
    b, h, g, k, t, s, db, *, own: bool, mixed: bool = False
) -> tuple[float, float, float, float]:
    """(kv bytes, activation bytes, matrix-unit flops, fp32 flops) of one layer's attention of
    t queries over s cached slots (+ t own entries joined when `own`, a verification). `mixed`:
    as accelerators run a target with bf16 weights (`backends.attention_wanted`: mixed attention,
    the same mathematics as a GPU's flash-decoding kernel): both products on the matrix units,
    fp32 scores written and read, probabilities in the weights' dtype; else exact attention."""
    kv = 2 * b * g * k * s * db  # K and V read once
    keys = s + (t if own else 0)
    qk = 2 * b * h * t * keys * k
    pv = 2 * b * h * t * keys * k
    if mixed:  # scores fp32 written + read, probabilities in the weights' dtype
        return kv, b * h * t * keys * (8 + 2 * db), qk + pv, 0.0
    scores = 4 * b * h * t * keys * 4  # fp32 scores written, read, probs written, read
    if t == 1:  # multiply-and-sum in float32 (vector units) for both products
        return kv, scores, 0.0, qk + pv
    if t <= EXACT_QUERIES:  # p.V in float32 at HIGHEST: a bf16 V is converted (written + read)
        return kv + (2 * b * g * s * k * 4 if db < 4 else 0), scores, qk, pv
    return kv, scores, qk + pv, 0.0


def target_forward(
    tcfg: TargetConfig,
    batch: int,
    tokens: float,
    slots: int,
    dtype_bytes: int = 2,
    *,
    verify: bool = False,
    aux_layers: int = 0,
    name: str = "target",
    routing: Routing = ROUTED,
    chips: int = 1,
) -> Phase:
    """One target forward of `tokens` new tokens per row against a `slots`-slot cache, logits for
    every token. verify=False: a decode step (new K/V written in place into the cache first);
    verify=True: a tree verification (cache only read, new K/V returned and the own entries
    joined in the softmax: `target.forward(mask_new=...)`).

    A routed (mixture-of-experts) layer reads its router and the experts its b x tokens tokens
    touch (`routing.touched`: the uniform expectation or a measured count; all E under a dense
    dispatch), and runs `routing.experts_per_token` experts per token. With the experts split
    over `chips` chips the bytes charged are `chips` x the busiest chip's (`experts.busiest_chip`),
    so the even split `Phase.time_s` makes gives the busiest chip's time."""
    b, t, db = batch, tokens, dtype_bytes
    d, f, v = tcfg.hidden_size, tcfg.intermediate_size, tcfg.vocab_size
    h, g, k = tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim
    hk, gk = h * k, g * k
    n_layers = tcfg.num_layers
    n_moe = len(tcfg.moe_layers)
    n_dense = n_layers - n_moe
    e, fe = tcfg.num_experts, tcfg.moe_intermediate_size
    # multiplied weights per token: attention, dense MLPs, output layer; routers and the experts
    # each token runs
    mat = n_layers * (d * hk + 2 * d * gk + hk * d) + n_dense * 3 * d * f + d * v
    weights = target_params(tcfg) - v * d * (0 if tcfg.tie_word_embeddings else 1)
    # ^ every parameter except the input embedding table, of which only b * t rows are read
    if n_moe:
        per_token = routing.experts_per_token(tcfg)
        mat += n_moe * (_router_weights(tcfg) + per_token * expert_weights(tcfg))
        read = chips * busiest_chip(e, routing.touched(tcfg, b * t), chips)
        weights += n_moe * (read - e) * expert_weights(tcfg)  # the touched experts, not all
    kv_l, scores_l, mm_l, f32_l = _attention(b, h, g, k, t, slots, db, own=verify, mixed=db < 4)
    kv = n_layers * (kv_l + 2 * b * t * gk * db)  # + the new entries written
    acts = n_dense * b * t * _layer_act_elems(d, f, hk, gk, d) * db + n_layers * scores_l
    if n_moe:  # the MLP's intermediates are each token's experts'; fp32 router logits and probs
        wide = routing.experts_per_token(tcfg) * fe
        acts += n_moe * b * t * (_layer_act_elems(d, wide, hk, gk, d) * db + 4 * e * 4)
    acts += b * t * d * db  # embedding rows gathered
    acts += 2 * b * t * v * 4  # fp32 logits written, read by sampling / acceptance
    acts += 2 * b * t * aux_layers * d * db  # aux features concatenated and read
    return Phase(
        name,
        weights=weights * db,
        kv=kv,
        activations=acts,
        flops=2 * b * t * mat + n_layers * mm_l,
        fp32_flops=n_layers * f32_l,
        allreduces=2 * n_layers + 1,
        layers=n_layers,
    )


def draft_forward(
    dcfg: DraftConfig,
    batch: int,
    rows: int,
    slots: int,
    dtype_bytes: int = 2,
    *,
    target_features: bool,
    logit_rows: int,
    name: str = "draft",
    fused_gather: bool = False,
) -> Phase:
    """One `draft.forward` of `rows` positions per row (fc applied to target features when
    `target_features`) against the draft's cache of `slots` slots, then `draft_topk` on
    `logit_rows` rows per row (`output_layer`: an lm_head over Vd, or SpecVocab's speculator and
    candidates)."""
    b, t, db = batch, rows, dtype_bytes
    d, f = dcfg.hidden_size, dcfg.intermediate_size
    h, g, k = dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim
    hk, gk = h * k, g * k
    layer = 2 * d * hk + 2 * 2 * d * gk + hk * d + 3 * d * f
    fc = dcfg.feature_size * d if target_features else 0
    head, head_acts, head_flops = output_layer(dcfg, logit_rows, db, fused_gather, b)
    kv_l, scores_l, mm_l, f32_l = _attention(b, h, g, k, t, slots, db, own=False)
    acts = b * t * _layer_act_elems(d, f, hk, gk, 2 * d) * db + scores_l
    acts += b * t * d * db  # embedding rows
    if target_features:
        acts += b * t * (dcfg.feature_size + d) * db  # fc reads the features, writes [.., D]
    acts += head_acts
    return Phase(
        name,
        weights=(layer + fc + head + 4 * d) * db,
        kv=kv_l + 2 * b * t * gk * db,
        activations=acts,
        flops=2 * b * t * (layer + fc) + head_flops + mm_l,
        fp32_flops=f32_l,
        allreduces=3 if logit_rows else 2,
        layers=1,
    )


# ----------------------------------------------------------------------------- the two programs


def plain_step(
    tcfg: TargetConfig,
    batch: int,
    slots: int,
    dtype_bytes: int = 2,
    routing: Routing = ROUTED,
    chips: int = 1,
) -> Program:
    """`plain.decode_step`: one token per row through the target, logits, sampling (`routing`,
    `chips`: a routed layer's experts, as `target_forward`)."""
    step = target_forward(
        tcfg, batch, 1, slots, dtype_bytes, name="step", routing=routing, chips=chips
    )
    return Program("plain_step", (step,))


def spec_round(
    tcfg: TargetConfig,
    dcfg: DraftConfig,
    tree: TreeConfig,
    batch: int,
    slots: int,
    dtype_bytes: int = 2,
    verify_tokens: float | None = None,
    fused_gather: bool = False,
    routing: Routing = ROUTED,
    chips: int = 1,
) -> Program:
    """`speculative.round_step` with the eagle3 drafter, greedy, verify threshold 0
    (`fused_gather`: SpecVocab's candidate rows counted as `output_layer`'s lower bound):
    pending: last round's accepted path K/V ([B, depth + 1] per layer) written into the cache;
    encode: draft forward over the depth + 1 encode pairs (fc on target features), lm_head on
      the one row that roots the tree;
    expand_2 .. expand_depth: draft forward over top_k rows (its own features), lm_head on them;
    verify: the target over total_tokens tokens (or `verify_tokens`: a mean verified size, for
      the adaptive threshold; a MoE target's experts are then those of the mean size, which
      over-counts them a little, the count being concave in the size) with the 3 aux layers, a
      routed layer's experts as `routing` and `chips` say (`target_forward`);
    bookkeeping: pool top-k, select_tree's and acceptance's loops over the nodes, the path's K/V
      gathered."""
    b, db = batch, dtype_bytes
    e = tree.depth + 1
    dslots = slots + tree.tree_slots
    gk = tcfg.num_kv_heads * tcfg.head_dim
    path_kv = 2 * tcfg.num_layers * b * e * gk * db
    phases = [Phase("pending", kv=2 * path_kv)]  # read the pending buffer, write into the cache
    phases.append(
        draft_forward(
            dcfg,
            b,
            e,
            dslots,
            db,
            target_features=True,
            logit_rows=1,
            name="draft_encode",
            fused_gather=fused_gather,
        )
    )
    for lvl in range(2, tree.depth + 1):
        phases.append(
            draft_forward(
                dcfg,
                b,
                tree.top_k,
                dslots,
                db,
                target_features=False,
                logit_rows=tree.top_k,
                name=f"draft_expand_{lvl}",
                fused_gather=fused_gather,
            )
        )
    n1 = tree.total_tokens if verify_tokens is None else verify_tokens
    verify = target_forward(
        tcfg, b, n1, slots, db, verify=True, aux_layers=dcfg.n_aux, name="verify",
        routing=routing, chips=chips,
    )  # fmt: skip
    phases.append(verify)
    n = tree.total_tokens - 1
    pool = tree.pool_size
    book = Phase(
        "bookkeeping",
        kv=path_kv,  # the accepted path's K/V gathered from the verification's new entries
        activations=b * (3 * pool * 4 + 3 * (n + 1) ** 2 + 8 * (n + 1) * 4),
        serial_iters=max(n, 1).bit_length(),  # tree._depth_and_mask's squarings
    )
    phases.append(book)
    return Program("round", tuple(phases))


def draft_steps(prog: Program) -> int:
    """Draft forwards in a round (encode + expansions = tree depth)."""
    return sum(1 for p in prog.phases if p.name.startswith("draft_"))


def slots_for(context: int, tree: TreeConfig | None = None, bucket: int = 256) -> int:
    """The static cache size `plain.plan_shape` picks for `context` tokens (prompt + new): a
    round adds the tree's round slots + 1; rounded up to the slot bucket (256)."""
    extra = 0 if tree is None else tree.round_slots + 1
    return bucket * math.ceil((context + extra) / bucket)
