"""A minimal TensorBoard event-file writer (scalars only), so metrics show in TensorBoard without
TensorFlow: TFRecord framing with masked CRC-32C around hand-encoded `Event` protobufs."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

_POLY = 0x82F63B78
_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ _POLY if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, wire: int, payload: bytes) -> bytes:
    return _varint((num << 3) | wire) + payload


def _len_field(num: int, data: bytes) -> bytes:
    return _field(num, 2, _varint(len(data)) + data)


def _event(
    wall: float, step: int, summary: bytes | None = None, version: str | None = None
) -> bytes:
    msg = _field(1, 1, struct.pack("<d", wall)) + _field(2, 0, _varint(step))
    if version is not None:
        msg += _len_field(3, version.encode())
    if summary is not None:
        msg += _len_field(5, summary)
    return msg


class SummaryWriter:
    """Appends scalar summaries to `events.out.tfevents.*` in `logdir`."""

    def __init__(self, logdir: str | Path):
        path = Path(logdir)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self._f = open(self.path, "ab")
        self._write(_event(time.time(), 0, version="brain.Event:2"))

    def _write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._f.write(
            header
            + struct.pack("<I", _masked(crc32c(header)))
            + data
            + struct.pack("<I", _masked(crc32c(data)))
        )
        self._f.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        summary = b"".join(
            _len_field(1, _len_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", float(v))))
            for tag, v in values.items()
        )
        self._write(_event(time.time(), step, summary=summary))

    def close(self) -> None:
        self._f.close()


def read_scalars(path: str | Path) -> list[tuple[int, dict[str, float]]]:
    """Parses an event file written by SummaryWriter (tests; checks the CRCs)."""
    data = Path(path).read_bytes()
    out, i = [], 0
    while i < len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        assert struct.unpack_from("<I", data, i + 8)[0] == _masked(crc32c(data[i : i + 8]))
        rec = data[i + 12 : i + 12 + n]
        assert struct.unpack_from("<I", data, i + 12 + n)[0] == _masked(crc32c(rec))
        i += 16 + n
        out.append(_parse_event(rec))
    return [(s, v) for s, v in out if v]


def _read_varint(b: bytes, i: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        x = b[i]
        i += 1
        n |= (x & 0x7F) << shift
        shift += 7
        if not x & 0x80:
            return n, i


def _fields(b: bytes):
    i = 0
    while i < len(b):
        key, i = _read_varint(b, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _read_varint(b, i)
        elif wire == 1:
            v, i = b[i : i + 8], i + 8
        elif wire == 5:
            v, i = b[i : i + 4], i + 4
        else:
            n, i = _read_varint(b, i)
            v, i = b[i : i + n], i + n
        yield num, v


def _parse_event(rec: bytes) -> tuple[int, dict[str, float]]:
    step, values = 0, {}
    for num, v in _fields(rec):
        if num == 2:
            step = v
        elif num == 5:
            for _, val in _fields(v):
                f = dict(_fields(val))
                values[f[1].decode()] = struct.unpack("<f", f[2])[0]
    return step, values
