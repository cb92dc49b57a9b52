"""What a model holds in HBM per device, counted from the shapes.

For the roofline (`roofline`, `predict`): the bytes that stay resident while decoding (weights of
the target and the head, both KV caches) and the chips (a power of two, tensor parallel) whose
memory holds them with headroom.

For the exported programs (`lowering.memory`): `Memory`, the bytes per device of one program
(parameters, KV caches, other state, the largest transient working set), and the activations
counted from the shapes of a verification, a prefill and a TTT step, split over a (data, model)
mesh as `sharding.spec_for` splits them. XLA's own memory analysis would need a compile for the
target backend; these are counted instead.
"""

from __future__ import annotations

import dataclasses

from eagle3_jax.accelerators.roofline import draft_params, target_params
from eagle3_jax.accelerators.specs import HBM_BYTES, Device
from eagle3_jax.config import DraftConfig, TargetConfig

# ----------------------------------------------------------------------------- the roofline's


def kv_bytes(tcfg: TargetConfig, batch: int, slots: int, dtype_bytes: int = 2) -> int:
    return 2 * tcfg.num_layers * batch * tcfg.num_kv_heads * tcfg.head_dim * slots * dtype_bytes


def resident_bytes(
    tcfg: TargetConfig, dcfg: DraftConfig, batch: int, slots: int, dtype_bytes: int = 2
) -> int:
    """Weights (target + head) and both KV caches: what must stay in HBM while decoding. A head
    that reads an untied target's output embedding holds lm_head transposed beside it
    (`attach_target_head` makes that copy once, outside the jitted programs)."""
    dkv = 2 * batch * dcfg.num_kv_heads * dcfg.head_dim * slots * dtype_bytes
    untied = dcfg.uses_target_head and not tcfg.tie_word_embeddings
    copy = tcfg.vocab_size * tcfg.hidden_size if untied else 0
    return (
        (target_params(tcfg) + draft_params(dcfg) + copy) * dtype_bytes
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


# ----------------------------------------------------------------------------- an exported program's


def _div(n: int, mesh_axis: int) -> int:
    """How many ways a dimension of size n is split over a mesh axis (1 where it does not divide,
    as `sharding.spec_for` replicates it)."""
    return mesh_axis if n % mesh_axis == 0 else 1


def _mlp_width(tcfg: TargetConfig, model: int) -> int:
    """A token's MLP intermediates per device: a dense layer's F over model, or a routed layer's
    E x F' (`models.target._moe`'s dense dispatch runs every expert on every token; an upper
    bound for the gathered and ragged ones, k x F' a token) with the experts over model. A
    target with routed layers is sized by them (the wider, at real sizes)."""
    if tcfg.num_experts:
        return tcfg.num_experts // _div(tcfg.num_experts, model) * tcfg.moe_intermediate_size
    return tcfg.intermediate_size // _div(tcfg.intermediate_size, model)


@dataclasses.dataclass
class Memory:
    """Bytes per device of one program at one setup (decimal GB in `row`)."""

    params: int  # target weights (+ head, embedding shared) as laid out
    kv_cache: int  # target + draft caches (decoding) or 0
    state: int  # everything else the program holds across calls (opt state, token buffers)
    activations: int  # the largest transient working set, counted from shapes

    @property
    def total(self) -> int:
        return self.params + self.kv_cache + self.state + self.activations

    def fits(self) -> dict[str, bool]:
        return {d: self.total <= cap for d, cap in HBM_BYTES.items()}


def verify_activations(
    tcfg: TargetConfig, dcfg: DraftConfig, batch: int, nodes: int, slots: int, mesh
) -> int:
    """A verification of `nodes` tokens per row, per device, from shapes: the fp32 logits
    [B, N, V] (vocab over model), every layer's new K/V [B, N, G, K] (held until the path is
    chosen), the aux features [B, N, 3D], and one layer's largest transients (fp32 scores and
    probabilities [B, H, N, S + N], the MLP's gate/up/product [B, N, F], a routed layer's
    [B, N, E, F'])."""
    data, model = mesh
    b = batch // _div(batch, data)
    v = tcfg.vocab_size // _div(tcfg.vocab_size, model)
    g = tcfg.num_kv_heads // _div(tcfg.num_kv_heads, model)
    h = tcfg.num_heads // _div(tcfg.num_heads, model)
    f = _mlp_width(tcfg, model)
    logits = b * nodes * v * 4
    new_kv = tcfg.num_layers * 2 * b * nodes * g * tcfg.head_dim * 2
    aux = b * nodes * dcfg.feature_size * 2
    layer = 2 * b * h * nodes * (slots + nodes) * 4 + 3 * b * nodes * f * 2
    return logits + new_kv + aux + layer


def prefill_activations(tcfg: TargetConfig, batch: int, t: int, slots: int, mesh) -> int:
    """A prefill of t tokens per row, per device: the residual stream and aux features [B, T, D]
    and one layer's transients (scores and probabilities [B, H, T, S]: p.V is bf16 above 64
    queries, so fp32 scores and bf16 probabilities; the MLP [B, T, F] x 3)."""
    data, model = mesh
    b = batch // _div(batch, data)
    h = tcfg.num_heads // _div(tcfg.num_heads, model)
    f = _mlp_width(tcfg, model)
    stream = b * t * tcfg.hidden_size * 2 * 5  # residual, normed, attention out, aux x 3 (bf16)
    layer = b * h * t * slots * (4 + 2) + 3 * b * t * f * 2
    return stream + layer


def train_activations(
    tcfg: TargetConfig, dcfg: DraftConfig, batch: int, t: int, steps: int, mesh
) -> int:
    """A TTT step, per device: the target's fp32 logits [B, T, V] (the teacher), its aux features,
    one target layer's transients, and per TTT step what the backward keeps without remat: the
    step-0 block's scores and probabilities [B, H, T, T] (fp32 + bf16), the draft logits and
    log-softmax [B, T, Vd] fp32, the MLP [B, T, F] x 3, the layer's inputs [B, T, 2D]."""
    data, model = mesh
    b = batch // _div(batch, data)
    v = tcfg.vocab_size // _div(tcfg.vocab_size, model)
    h = tcfg.num_heads // _div(tcfg.num_heads, model)
    dh = dcfg.num_heads // _div(dcfg.num_heads, model)
    f = _mlp_width(tcfg, model)
    df = dcfg.intermediate_size // _div(dcfg.intermediate_size, model)  # the head's, dense
    vd = dcfg.draft_vocab_size // _div(dcfg.draft_vocab_size, model)
    teacher = b * t * v * 4 + b * t * dcfg.feature_size * 2
    target_layer = b * h * t * t * (4 + 2) + 3 * b * t * f * 2
    per_step = b * dh * t * t * (4 + 2) + 2 * b * t * vd * 4 + 3 * b * t * df * 2
    per_step += b * t * 2 * dcfg.hidden_size * 2 * 2
    return teacher + max(target_layer, steps * per_step)
