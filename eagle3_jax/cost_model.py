"""What a plain decode step and a speculative round cost on a device, counted from the shapes.

A roofline model of the programs `decoding/plain.py` (`decode_step`) and `decoding/speculative.py`
(`round_step`, the eagle3 drafter, greedy, verify threshold 0) run, with no device work: bytes
moved and FLOPs per phase, from a TargetConfig, a DraftConfig, a TreeConfig, the batch B, the
cache size S and the parameters' dtype.

What is counted (per program; `Phase` fields):
  weights: every weight matrix the phase multiplies by, read once (the embedding only as the rows
    gathered, unless it is the tied output layer);
  kv: the KV cache read and written. Attention reads the WHOLE static buffer (`slots`) whatever
    the current length (the mask hides the rest), so S is the buffer size `plan_shape` picks, not
    the tokens so far. A verification also writes a float32 copy of V for its float32 p.V
    product (`models/layers.attention`, exact for <= 64 queries) and reads it back;
  activations: the tensors between fusions (norms, projections, residuals, MLP; a per-layer
    element count in `_layer_act_elems`), the float32 attention scores and probabilities (four
    passes over [B, H, T, S + T]), logits in float32 (written and read again by the top-k or the
    argmax), aux features;
  flops: 2 x rows x weights for every product, plus QK and p.V; elementwise work is left out.
    `fp32_flops` are the products XLA runs at float32 precision: p.V of a verification or a
    draft step (`Precision.HIGHEST`), and a one-query step's multiply-and-sum attention. On a GPU
    they run on the CUDA cores (67 TFLOP/s on an H100, not 989), on a TPU as 6 bf16 passes.
  serial_iters: iterations of small sequential loops: `select_tree`'s and `_propagate`'s
    fori_loops over the tree's nodes (2 x (total_tokens - 1) per round, chains included),
    charged at `Device.loop_iter_s` each.

Time of a phase = max(bytes / bandwidth, flops / peak + fp32_flops / fp32 peak) + loops +
collectives; a program's time = the sum of its phases (they are data dependent, so one's memory
traffic cannot hide under another's compute) + `Device.launch_s` once (each is one jitted
program). With `chips` > 1 (tensor parallel over the model axis) bytes and FLOPs split evenly and
each layer pays two all-reduces of `Device.allreduce_s`.

The acceptance model (`Acceptance`) turns a tree shape into τ: SpecInfer/Sequoia's positional
model, where the target's next token is the draft's i-th ranked candidate with probability p_i =
p1 * decay**(i - 1), independently at every depth; the tree is grown as the drafter grows it
(top-k children, the k best nodes expanded per level, the best total_tokens - 1 of the pool kept),
scoring nodes by path probability, and τ = 1 + the sum of the kept nodes' path probabilities.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np

from eagle3_jax.config import DraftConfig, RopeConfig, TargetConfig, TreeConfig

# ----------------------------------------------------------------------------- devices


@dataclasses.dataclass(frozen=True)
class Device:
    """Published peaks of one chip; the last three fields are our assumptions (stated in
    `source`), not vendor figures."""

    name: str
    hbm_bw: float  # bytes/s
    matmul_flops: float  # FLOP/s of products in the parameters' dtype (bf16 dense; fp32 on CPUs)
    fp32_flops: float  # FLOP/s of products at full float32 precision
    hbm_bytes: float
    launch_s: float = 20e-6  # per jitted program (dispatch + first kernel)
    loop_iter_s: float = 5e-6  # per iteration of a small on-device while loop
    allreduce_s: float = 10e-6  # per all-reduce of an activation across chips (chips > 1)
    source: str = ""


DEVICES: dict[str, Device] = {
    # https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 3.35 TB/s HBM3, 80 GB, BF16 Tensor
    # Core 1,979 TFLOPS with sparsity = 989 dense, FP32 67 TFLOPS)
    "H100": Device(
        "H100 SXM", 3.35e12, 989e12, 67e12, 80e9, 20e-6, 5e-6, 10e-6,
        "nvidia.com/en-us/data-center/h100 (SXM)",
    ),
    # https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: 4.8 TB/s HBM3e, 141 GB, BF16 1,979
    # TFLOPS with sparsity = 989 dense, FP32 67 TFLOPS)
    "H200": Device(
        "H200 SXM", 4.8e12, 989e12, 67e12, 141e9, 20e-6, 5e-6, 10e-6,
        "nvidia.com/en-us/data-center/h200 (SXM)",
    ),
    # https://cloud.google.com/tpu/docs/v5e (819 GBps HBM2, 16 GiB, 197 TFLOPs bf16); no float32
    # matrix unit: a HIGHEST-precision f32 product is 6 bf16 passes
    "TPU v5e": Device(
        "TPU v5e", 819e9, 197e12, 197e12 / 6, 16 * 2**30, 20e-6, 1e-6, 10e-6,
        "cloud.google.com/tpu/docs/v5e",
    ),
    # https://cloud.google.com/tpu/docs/v5p (2,765 GBps HBM2e, 95 GiB, 459 TFLOPs bf16)
    "TPU v5p": Device(
        "TPU v5p", 2765e9, 459e12, 459e12 / 6, 95 * 2**30, 20e-6, 1e-6, 10e-6,
        "cloud.google.com/tpu/docs/v5p",
    ),
}  # fmt: skip

# Our CPU measurements' machines (2-core VMs, BENCHMARKS.md): an ASSUMED ~20 GB/s and ~100 GFLOP/s
# fp32 (2 cores x AVX2/AVX-512 FMA at a sustained fraction of peak), no vendor figure.
CPU_2CORE = Device("2-core CPU (assumed)", 20e9, 100e9, 100e9, 16e9, 50e-6, 1e-6, 0.0, "assumption")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Exactness bound of `models/layers.attention`: up to this many queries p.V runs in float32.
EXACT_QUERIES = 64

# ----------------------------------------------------------------------------- configs


def _target(**kw) -> TargetConfig:
    return TargetConfig(**kw)


# Published config.json sizes (the Hugging Face model cards' config files).
TARGETS: dict[str, TargetConfig] = {
    # meta-llama/Llama-3.1-8B-Instruct
    "llama31_8b": _target(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rope=RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192),
    ),
    # allenai/OLMo-2-1124-7B-Instruct
    "olmo2_7b": _target(
        family="olmo2", vocab_size=100352, hidden_size=4096, intermediate_size=11008,
        num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, qk_norm="full",
        norm_placement="post", rope=RopeConfig(500000.0),
    ),
    # allenai/OLMo-2-0425-1B-Instruct
    "olmo2_1b": _target(
        family="olmo2", vocab_size=100352, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=16, num_kv_heads=16, head_dim=128, qk_norm="full",
        norm_placement="post", rope=RopeConfig(500000.0),
    ),
    # Qwen/Qwen3-4B (tied embeddings)
    "qwen3_4b": _target(
        family="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm="head",
        tie_word_embeddings=True, rope=RopeConfig(1000000.0),
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct (our CPU target; tied embeddings)
    "smollm2_135m": _target(
        family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True,
        rope=RopeConfig(100000.0),
    ),
}  # fmt: skip

DRAFT_VOCAB = 32000  # the published EAGLE-3 heads' Vd (and configs/*.py)


def draft_for(tcfg: TargetConfig, draft_vocab: int = DRAFT_VOCAB) -> DraftConfig:
    """An EAGLE-3 head sized like the target (as the published heads are), Vd draft ids."""
    return DraftConfig.from_target(tcfg, draft_vocab_size=min(draft_vocab, tcfg.vocab_size))


# ----------------------------------------------------------------------------- counting


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


def _layer_weights(tcfg: TargetConfig) -> int:
    """Parameters of one target layer (projections, MLP, norms, biases)."""
    d, f = tcfg.hidden_size, tcfg.intermediate_size
    hk, gk = tcfg.num_heads * tcfg.head_dim, tcfg.num_kv_heads * tcfg.head_dim
    n = d * hk + 2 * d * gk + hk * d + 3 * d * f + 2 * d
    if tcfg.attention_bias:
        n += hk + 2 * gk
    if tcfg.qk_norm == "head":
        n += 2 * tcfg.head_dim
    elif tcfg.qk_norm == "full":
        n += hk + gk
    return n


def target_params(tcfg: TargetConfig) -> int:
    """All target parameters (embedding, layers, final norm, untied output layer)."""
    vd = tcfg.vocab_size * tcfg.hidden_size
    return (
        vd * (1 if tcfg.tie_word_embeddings else 2)
        + tcfg.num_layers * _layer_weights(tcfg)
        + tcfg.hidden_size
    )


def draft_params(dcfg: DraftConfig) -> int:
    """The head's own parameters (fc, the midlayer, final norm, lm_head over Vd)."""
    d, f = dcfg.hidden_size, dcfg.intermediate_size
    hk, gk = dcfg.num_heads * dcfg.head_dim, dcfg.num_kv_heads * dcfg.head_dim
    layer = 2 * d * hk + 2 * 2 * d * gk + hk * d + 3 * d * f + 3 * d
    return dcfg.feature_size * d + layer + d + d * dcfg.draft_vocab_size


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


def _attention(b, h, g, k, t, s, db, *, own: bool) -> tuple[float, float, float, float]:
    """(kv bytes, activation bytes, matrix-unit flops, fp32 flops) of one layer's attention of
    t queries over s cached slots (+ t own entries joined when `own`, a verification)."""
    kv = 2 * b * g * k * s * db  # K and V read once
    keys = s + (t if own else 0)
    qk = 2 * b * h * t * keys * k
    pv = 2 * b * h * t * keys * k
    scores = 4 * b * h * t * keys * 4  # fp32 scores written, read, probs written, read
    if t == 1:  # multiply-and-sum in float32 (vector units) for both products
        return kv, scores, 0.0, qk + pv
    if t <= EXACT_QUERIES:  # p.V in float32 at HIGHEST: a bf16 V is converted (written + read)
        return kv + (2 * b * g * s * k * 4 if db < 4 else 0), scores, qk, pv
    return kv, scores, qk + pv, 0.0


def target_forward(
    tcfg: TargetConfig,
    batch: int,
    tokens: int,
    slots: int,
    dtype_bytes: int = 2,
    *,
    verify: bool = False,
    aux_layers: int = 0,
    name: str = "target",
) -> Phase:
    """One target forward of `tokens` new tokens per row against a `slots`-slot cache, logits for
    every token. verify=False: a decode step (new K/V written in place into the cache first);
    verify=True: a tree verification (cache only read, new K/V returned and the own entries
    joined in the softmax: `target.forward(mask_new=...)`)."""
    b, t, db = batch, tokens, dtype_bytes
    d, f, v = tcfg.hidden_size, tcfg.intermediate_size, tcfg.vocab_size
    h, g, k = tcfg.num_heads, tcfg.num_kv_heads, tcfg.head_dim
    hk, gk = h * k, g * k
    n_layers = tcfg.num_layers
    mat = n_layers * (d * hk + 2 * d * gk + hk * d + 3 * d * f) + d * v  # multiplied weights
    weights = (target_params(tcfg) - v * d * (0 if tcfg.tie_word_embeddings else 1)) * db
    # ^ every parameter except the input embedding table, of which only b * t rows are read
    kv_l, scores_l, mm_l, f32_l = _attention(b, h, g, k, t, slots, db, own=verify)
    kv = n_layers * (kv_l + 2 * b * t * gk * db)  # + the new entries written
    acts = n_layers * (b * t * _layer_act_elems(d, f, hk, gk, d) * db + scores_l)
    acts += b * t * d * db  # embedding rows gathered
    acts += 2 * b * t * v * 4  # fp32 logits written, read by sampling / acceptance
    acts += 2 * b * t * aux_layers * d * db  # aux features concatenated and read
    return Phase(
        name,
        weights=weights,
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
) -> Phase:
    """One `draft.forward` of `rows` positions per row (fc applied to target features when
    `target_features`) against the draft's cache of `slots` slots, then `draft_topk` on
    `logit_rows` rows per row: the lm_head over Vd, log-softmax and top-k in float32."""
    b, t, db = batch, rows, dtype_bytes
    d, f, vd = dcfg.hidden_size, dcfg.intermediate_size, dcfg.draft_vocab_size
    h, g, k = dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim
    hk, gk = h * k, g * k
    layer = 2 * d * hk + 2 * 2 * d * gk + hk * d + 3 * d * f
    fc = dcfg.feature_size * d if target_features else 0
    head = d * vd if logit_rows else 0
    kv_l, scores_l, mm_l, f32_l = _attention(b, h, g, k, t, slots, db, own=False)
    acts = b * t * _layer_act_elems(d, f, hk, gk, 2 * d) * db + scores_l
    acts += b * t * d * db  # embedding rows
    if target_features:
        acts += b * t * (dcfg.feature_size + d) * db  # fc reads the features, writes [.., D]
    acts += 4 * b * logit_rows * vd * 4  # fp32 logits written; log-softmax read + write; top-k read
    return Phase(
        name,
        weights=(layer + fc + head + 4 * d) * db,
        kv=kv_l + 2 * b * t * gk * db,
        activations=acts,
        flops=2 * b * (t * (layer + fc) + logit_rows * head) + mm_l,
        fp32_flops=f32_l,
        allreduces=3 if logit_rows else 2,
        layers=1,
    )


def plain_step(tcfg: TargetConfig, batch: int, slots: int, dtype_bytes: int = 2) -> Program:
    """`plain.decode_step`: one token per row through the target, logits, sampling."""
    return Program("plain_step", (target_forward(tcfg, batch, 1, slots, dtype_bytes, name="step"),))


def spec_round(
    tcfg: TargetConfig,
    dcfg: DraftConfig,
    tree: TreeConfig,
    batch: int,
    slots: int,
    dtype_bytes: int = 2,
    verify_tokens: float | None = None,
) -> Program:
    """`speculative.round_step` with the eagle3 drafter, greedy, verify threshold 0:
    pending: last round's accepted path K/V ([B, depth + 1] per layer) written into the cache;
    encode: draft forward over the depth + 1 encode pairs (fc on target features), lm_head on
      the one row that roots the tree;
    expand_2 .. expand_depth: draft forward over top_k rows (its own features), lm_head on them;
    verify: the target over total_tokens tokens (or `verify_tokens`: a mean verified size, for
      the adaptive threshold) with the 3 aux layers;
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
            dcfg, b, e, dslots, db, target_features=True, logit_rows=1, name="draft_encode"
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
            )
        )
    n1 = tree.total_tokens if verify_tokens is None else verify_tokens
    verify = target_forward(
        tcfg, b, n1, slots, db, verify=True, aux_layers=dcfg.n_aux, name="verify"
    )
    phases.append(verify)
    n = tree.total_tokens - 1
    pool = tree.pool_size
    book = Phase(
        "bookkeeping",
        kv=path_kv,  # the accepted path's K/V gathered from the verification's new entries
        activations=b * (3 * pool * 4 + 3 * (n + 1) ** 2 + 8 * (n + 1) * 4),
        serial_iters=2 * n,
    )
    phases.append(book)
    return Program("round", tuple(phases))


def draft_steps(prog: Program) -> int:
    """Draft forwards in a round (encode + expansions = tree depth)."""
    return sum(1 for p in prog.phases if p.name.startswith("draft_"))


# ----------------------------------------------------------------------------- sizes in HBM


def kv_bytes(tcfg: TargetConfig, batch: int, slots: int, dtype_bytes: int = 2) -> int:
    return 2 * tcfg.num_layers * batch * tcfg.num_kv_heads * tcfg.head_dim * slots * dtype_bytes


def resident_bytes(
    tcfg: TargetConfig, dcfg: DraftConfig, batch: int, slots: int, dtype_bytes: int = 2
) -> int:
    """Weights (target + head) and both KV caches: what must stay in HBM while decoding."""
    dkv = 2 * batch * dcfg.num_kv_heads * dcfg.head_dim * slots * dtype_bytes
    return (
        (target_params(tcfg) + draft_params(dcfg)) * dtype_bytes
        + kv_bytes(tcfg, batch, slots, dtype_bytes)
        + dkv
    )


def chips_needed(
    dev: Device, tcfg: TargetConfig, dcfg: DraftConfig, batch: int, slots: int, db: int = 2
) -> int:
    """The smallest power of two of chips whose HBM holds 1.15x the resident bytes (headroom for
    activations and the runtime), tensor parallel."""
    need = 1.15 * resident_bytes(tcfg, dcfg, batch, slots, db)
    chips = 1
    while chips * dev.hbm_bytes < need:
        chips *= 2
    return chips


def slots_for(context: int, tree: TreeConfig | None = None, bucket: int = 256) -> int:
    """The static cache size `plain.plan_shape` picks for `context` tokens (prompt + new): a
    round adds the tree's round slots + 1; rounded up to the slot bucket (256)."""
    extra = 0 if tree is None else tree.round_slots + 1
    return bucket * math.ceil((context + extra) / bucket)


# ----------------------------------------------------------------------------- acceptance


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Positional acceptance (SpecInfer/Sequoia's model): the target's next token is the draft's
    top-1 with probability p1, its rank-i candidate (i >= 2) with probability
    (1 - p1) * cover * (1 - ratio) * ratio**(i - 2), whatever the depth and the path: `cover` is
    how often the draft's lower ranks hold the token when its top-1 misses, `ratio` how fast that
    mass falls with rank. Assumptions: independence across depths (no drift of the draft with
    depth), no per-round variation of confidence (so no model of the adaptive threshold), and a
    draft whose ranking is what the tree builder sees (its scores rank nodes as their acceptance
    probabilities do)."""

    p1: float
    cover: float
    ratio: float
    label: str = ""

    def rank_probs(self, k: int) -> np.ndarray:
        p = np.zeros(k)
        p[0] = self.p1
        if k > 1:
            rest = (1 - self.p1) * self.cover * (1 - self.ratio)
            p[1:] = rest * self.ratio ** np.arange(k - 1, dtype=np.float64)
        return p

    def tau(self, tree: TreeConfig) -> float:
        """Expected tokens per round (accepted + bonus) for the tree the drafter grows: top_k
        children of the root, the top_k best new nodes expanded at each further level, the best
        total_tokens - 1 nodes of the pool verified; τ = 1 + their path probabilities' sum."""
        k, n = tree.top_k, tree.total_tokens - 1
        p = self.rank_probs(k)
        pool = list(p)
        exp = p
        for _ in range(2, tree.depth + 1):
            children = (exp[:, None] * p[None, :]).ravel()
            pool.extend(children)
            exp = np.sort(children)[::-1][:k]
        return 1.0 + float(sum(heapq.nlargest(n, pool)))

    def scaled_to(self, tree: TreeConfig, tau: float, label: str = "") -> Acceptance:
        """A stronger (or weaker) head: the same cover and ratio, p1 chosen so that
        tau(tree) = tau (bisection)."""
        lo, hi = 1e-4, 0.9999
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if dataclasses.replace(self, p1=mid).tau(tree) < tau:
                lo = mid
            else:
                hi = mid
        return Acceptance(round(0.5 * (lo + hi), 4), self.cover, self.ratio, label or self.label)


# τ of the GPU head (the Vd 8,192 head trained on one H200) on SmolLM2-135M-Instruct, MT-bench,
# greedy, 128 new tokens, every node verified (benchmarks/results/*/report.md):
# (top_k, depth, total_tokens) -> τ. One head, so the shape's effect is not mixed with another's.
SMOLLM2_TAUS: dict[tuple[int, int, int], float] = {
    (1, 3, 4): 1.865,  # chain d3: 1.84 (gpu_head_mt_bench), 1.89 (gpu_head_mt_bench_80)
    (1, 4, 5): 1.90,  # gpu_head_mt_bench
    (1, 6, 7): 1.92,  # gpu_head_mt_bench
    (2, 3, 4): 1.96,  # reporting_tree_mt_bench_80, adaptive_mt_bench_80
    (2, 4, 8): 2.185,  # 2.15 (gpu_head_mt_bench), 2.22 (gpu_head_mt_bench_80)
    (4, 4, 16): 2.39,  # gpu_head_mt_bench
    (10, 8, 60): 2.95,  # reporting_tree_mt_bench_80
}
# the shipped head (Vd 16,384): τ 3.019 at the reporting tree (vocab16k_trained_cpu_600) and 1.69
# at the CPU default with θ 0.3, verifying 2.2 tokens a round on average (cpu_default_400_vs_600_*)
SHIPPED_TAU_REPORTING = 3.019
SHIPPED_TAU_CPU_DEFAULT = 1.69
SHIPPED_VERIFIED_CPU_DEFAULT = 2.2
REPORTING_TREE = TreeConfig(top_k=10, depth=8, total_tokens=60)
CPU_DEFAULT_TREE = TreeConfig(top_k=2, depth=3, total_tokens=4, verify_threshold=0.3)
# EAGLE-3 on Llama-3.1-8B-Instruct, MT-bench, at its reporting tree: τ ~6-7 (the paper); we take
# the middle
EAGLE3_LLAMA_TAU = 6.5


def fit_acceptance(
    taus: dict[tuple[int, int, int], float] = SMOLLM2_TAUS, label: str = "SmolLM2 GPU head"
) -> Acceptance:
    """Least squares in τ over a (p1, cover, ratio) grid."""
    trees = [(TreeConfig(k, d, n), t) for (k, d, n), t in taus.items()]
    best = None
    for p1 in np.linspace(0.30, 0.70, 21):
        for cover in np.linspace(0.10, 1.0, 19):
            for ratio in np.linspace(0.10, 0.95, 18):
                a = Acceptance(float(p1), float(cover), float(ratio))
                err = sum((a.tau(tr) - t) ** 2 for tr, t in trees)
                if best is None or err < best[0]:
                    best = (err, a)
    a = best[1]
    return Acceptance(round(a.p1, 4), round(a.cover, 4), round(a.ratio, 4), label)


# the fit of SMOLLM2_TAUS (`fit_acceptance()`: rms error 0.05 τ), stored so nothing refits it
SMOLLM2_ACCEPTANCE = Acceptance(0.5, 0.65, 0.7, "SmolLM2 GPU head")


def rms_error(acc: Acceptance, taus: dict[tuple[int, int, int], float] = SMOLLM2_TAUS) -> float:
    errs = [acc.tau(TreeConfig(k, d, n)) - t for (k, d, n), t in taus.items()]
    return float(np.sqrt(np.mean(np.square(errs))))


def llama_acceptance(tau: float = EAGLE3_LLAMA_TAU) -> Acceptance:
    """EAGLE-3's Llama-3.1-8B head: SmolLM2's rank profile with p1 raised until the reporting
    tree reads `tau`."""
    return SMOLLM2_ACCEPTANCE.scaled_to(REPORTING_TREE, tau, f"EAGLE-3 Llama-3.1-8B (τ {tau})")


# ----------------------------------------------------------------------------- predictions


@dataclasses.dataclass(frozen=True)
class Prediction:
    device: str
    target: str
    tree: TreeConfig
    batch: int
    context: int
    chips: int
    plain_s: float
    round_s: float
    tau: float

    @property
    def ratio(self) -> float:
        """Round time in plain steps."""
        return self.round_s / self.plain_s

    @property
    def speedup(self) -> float:
        return self.tau * self.plain_s / self.round_s


def predict(
    dev: Device,
    target: str | TargetConfig,
    tree: TreeConfig,
    tau: float,
    batch: int = 1,
    context: int = 2048,
    dtype_bytes: int = 2,
    dcfg: DraftConfig | None = None,
    chips: int | None = None,
    layer_overhead_s: float = 0.0,
) -> Prediction:
    """Plain step and round times on `dev` at τ `tau`, for `context` tokens (prompt + new): each
    program's cache is the static size `plan_shape` gives it (`slots_for`), read whole."""
    tcfg = TARGETS[target] if isinstance(target, str) else target
    dcfg = dcfg or draft_for(tcfg)
    slots, rslots = slots_for(context), slots_for(context, tree)
    if chips is None:
        chips = chips_needed(dev, tcfg, dcfg, batch, rslots, dtype_bytes)
    plain = plain_step(tcfg, batch, slots, dtype_bytes).time_s(dev, chips, layer_overhead_s)
    rnd = spec_round(tcfg, dcfg, tree, batch, rslots, dtype_bytes).time_s(
        dev, chips, layer_overhead_s
    )
    name = target if isinstance(target, str) else tcfg.family
    return Prediction(dev.name, name, tree, batch, context, chips, plain, rnd, tau)


def tree_grid() -> list[TreeConfig]:
    """Chains of depth 1-8 and trees of top-k 2-10, depth 3-8, 8-128 nodes (valid ones)."""
    trees = [TreeConfig(1, d, d + 1) for d in range(1, 9)]
    for k in (2, 4, 6, 8, 10):
        for d in (3, 4, 5, 6, 8):
            for n in (8, 16, 24, 32, 48, 60, 64, 96, 128):
                t = TreeConfig(k, d, n)
                if n <= t.pool_size + 1:
                    trees.append(t)
    return trees


def best_tree(
    dev: Device,
    target: str,
    acc: Acceptance,
    batch: int = 1,
    context: int = 2048,
    trees: list[TreeConfig] | None = None,
) -> Prediction:
    """The tree of the grid with the highest predicted speedup at τ = acc.tau(tree)."""
    preds = [predict(dev, target, t, acc.tau(t), batch, context) for t in (trees or tree_grid())]
    return max(preds, key=lambda p: p.speedup)


def implied_tau(pred: Prediction, speedup: float) -> float:
    """The τ at which the model's round/plain ratio gives `speedup`."""
    return speedup * pred.ratio


# ----------------------------------------------------------------------------- CPU check


def cpu_verify_ratio(
    tokens: int = 4,
    slots: int = 512,
    dev: Device = CPU_2CORE,
    few_row_rate: float | None = None,
) -> dict[str, float]:
    """A `tokens`-token target forward over a 1-token one on SmolLM2-135M in float32 with a
    `slots`-slot cache holding 320 tokens (benchmarks/verify_cost.py's measurement: new K/V
    written into the cache, then attended), three ways:
      roofline: max(bytes / bw, flops / peak), as for accelerators;
      serial: bytes / bw + flops / peak (XLA:CPU's few-row products do not overlap streaming the
        weights with the arithmetic);
      few_row: serial with the products of 2+ rows at `few_row_rate` FLOP/s (default: the rate
        that reproduces 1.4x, returned as `rate_for_1.4x`)."""
    tcfg = TARGETS["smollm2_135m"]
    one = target_forward(tcfg, 1, 1, slots, 4)
    many = target_forward(tcfg, 1, tokens, slots, 4)
    t1_roof, tn_roof = one.time_s(dev), many.time_s(dev)

    def serial(p: Phase, rate: float) -> float:
        return p.bytes / dev.hbm_bw + (p.flops + p.fp32_flops) / rate

    t1 = serial(one, dev.matmul_flops)
    out = {
        "one_token_ms_roofline": 1e3 * t1_roof,
        "roofline": tn_roof / t1_roof,
        "serial": serial(many, dev.matmul_flops) / t1,
        "weights_mb": one.weights / 1e6,
        "flops_per_token_g": (one.flops + one.fp32_flops) / 1e9,
    }
    # the few-row rate at which the serial model gives 1.4x
    lo, hi = 1e9, 1e13
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        if serial(many, mid) / t1 > 1.4:
            lo = mid
        else:
            hi = mid
    out["rate_for_1.4x_gflops"] = math.sqrt(lo * hi) / 1e9
    if few_row_rate:
        out["few_row"] = serial(many, few_row_rate) / t1
    return out


__all__ = [
    "CPU_2CORE",
    "CPU_DEFAULT_TREE",
    "SMOLLM2_ACCEPTANCE",
    "llama_acceptance",
    "rms_error",
    "DEVICES",
    "EAGLE3_LLAMA_TAU",
    "REPORTING_TREE",
    "SMOLLM2_TAUS",
    "TARGETS",
    "Acceptance",
    "Device",
    "Phase",
    "Prediction",
    "Program",
    "best_tree",
    "chips_needed",
    "cpu_verify_ratio",
    "draft_for",
    "draft_forward",
    "fit_acceptance",
    "implied_tau",
    "plain_step",
    "predict",
    "spec_round",
    "target_forward",
    "tree_grid",
]
