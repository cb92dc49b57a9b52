"""MXFP4 expert weights, as gpt-oss's hub checkpoints store them, dequantised on the host.

A matrix of R output rows and C = G * 32 inputs is stored as `blocks` [..., R, G, 16] uint8 (32
FP4 E2M1 values per block of one row, two to a byte, the low nibble first) and `scales`
[..., R, G] uint8 (one E8M0 exponent per block: the block's values times 2^(s - 127)).
`dequantize` follows transformers' `integrations.mxfp4.convert_moe_packed_tensors` (the same
lookup table and order, `ldexp` by the unbiased exponent, and the same [..., C, R] result, inputs
by outputs), in float32, where every value is exact up to the exponent range's overflow.
`Mxfp4Experts` wraps one projection's [E, R, G, 16] blocks as an [E, C, R'] array (R' the rows
chosen, e.g. gpt-oss's interleaved gate or up rows) that dequantises only the experts and rows
an index asks for, so each device of a mesh decodes only its own experts (`sharding.put`) and no
host holds a whole layer's experts in float32."""

from __future__ import annotations

import numpy as np

# FP4 E2M1: sign bit, two exponent bits, one mantissa bit (transformers' FP4_VALUES)
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
SCALE_BIAS = 127  # E8M0: the block's factor is 2^(s - 127)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., R, G, 16] uint8 and scales [..., R, G] uint8 -> float32 [..., G * 32, R]:
    value j of block g of row r is FP4_VALUES[nibble] * 2^(s - 127), byte j // 2's low nibble
    for even j and its high nibble for odd j; the last two axes swapped, as transformers'
    convert_moe_packed_tensors returns them (gpt-oss's gate_up_proj [E, D, 2F] and down_proj
    [E, F, D])."""
    blocks = np.asarray(blocks, np.uint8)
    scales = np.asarray(scales).astype(np.int32) - SCALE_BIAS
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)
    values = values.reshape(*scales.shape, blocks.shape[-1] * 2)  # [..., R, G, 32]
    with np.errstate(over="ignore"):  # 6 * 2^128 is inf, as in transformers' ldexp
        values = np.ldexp(values, scales[..., None]).astype(np.float32)
    out = values.reshape(*scales.shape[:-1], scales.shape[-1] * values.shape[-1])
    return np.swapaxes(out, -1, -2)


class Mxfp4Experts:
    """One projection's experts, blocks [E, R, G, 16] and scales [E, R, G] (memory maps), seen
    as a float32 array [E, G * 32, R'] of rows `rows` (a slice of R: all, or gpt-oss's gate
    rows 0::2 / up rows 1::2), dequantised where indexed: experts and rows outside the index
    are never decoded."""

    def __init__(self, blocks: np.ndarray, scales: np.ndarray, rows: slice = slice(None)):
        if blocks.ndim != 4 or blocks.shape[:-1] != scales.shape:
            raise ValueError(
                f"MXFP4 experts need blocks [E, R, G, 16] and scales [E, R, G]: got "
                f"{blocks.shape} and {scales.shape}"
            )
        e, r, g, b = blocks.shape
        self.blocks, self.scales = blocks, scales
        self.rows = np.arange(r)[rows]
        self.shape = (e, g * b * 2, len(self.rows))
        self.dtype = np.dtype(np.float32)
        self.ndim = 3

    def __getitem__(self, idx) -> np.ndarray:
        """Slices (what `sharding.put` passes) over [E, inputs, rows]."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        idx = idx + (slice(None),) * (3 - len(idx))
        experts = range(self.shape[0])[idx[0]]
        rows = self.rows[idx[2]]
        return np.stack(
            [dequantize(self.blocks[e][rows], self.scales[e][rows])[idx[1]] for e in experts]
        )

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)
