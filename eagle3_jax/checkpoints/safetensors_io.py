"""A minimal safetensors reader/writer over numpy memory maps (bf16 via ml_dtypes; no torch needed)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from eagle3_jax.errors import Eagle3Error

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of one file as read-only memory-mapped arrays (nothing is copied until used)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise Eagle3Error(f"cannot read safetensors file {path}: {e}") from e
    header.pop("__metadata__", None)
    base = 8 + n
    out = {}
    if not header:
        return out
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise Eagle3Error(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        want = int(np.prod(info["shape"], dtype=np.int64)) * dtype.itemsize
        if end - start != want or base + end > mm.size:
            raise Eagle3Error(
                f"{path} is truncated or corrupt: tensor {name} needs bytes {base + start}.."
                f"{base + end} of a {mm.size}-byte file (an interrupted copy or download?)"
            )
        raw = mm[base + start : base + end]
        out[name] = raw.view(dtype).reshape(info["shape"])
    return out


def write_safetensors(
    path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
    """Writes atomically (temporary file, then rename), so a crash never leaves a half file."""
    path = Path(path)
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(np.asarray(tensors[name]))
        if a.dtype not in _NAMES:
            raise Eagle3Error(f"cannot write tensor {name} of dtype {a.dtype}")
        header[name] = {
            "dtype": _NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        arrays.append(a)
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, path)
