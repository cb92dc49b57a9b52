"""TensorBoard event files of a run's scalars, written with tensorboardX (no TensorFlow).

tensorboardX is imported where it is used, not at module top: its package imports torch whenever
torch is installed (seconds and hundreds of MB), and `import eagle3_jax` reaches this module
through the training loop, so a decode would pay for it without writing a single event.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path


class SummaryWriter:
    """Appends scalar summaries to `events.out.tfevents.*` in `logdir`, one event per `scalars`
    call, on disk when the call returns (synchronously: a killed run keeps every event it wrote,
    as its metrics.jsonl does; tensorboardX's own SummaryWriter queues events for a thread)."""

    def __init__(self, logdir: str | Path):
        from tensorboardX.event_file_writer import EventsWriter

        path = Path(logdir)
        path.mkdir(parents=True, exist_ok=True)
        self._events = EventsWriter(str(path / "events"))  # events.out.tfevents.TIME.HOST

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        summary = Summary(
            value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()]
        )
        self._events.write_event(Event(wall_time=time.time(), step=step, summary=summary))
        self._events.flush()

    def close(self) -> None:
        self._events.close()


def read_scalars(path: str | Path) -> list[tuple[int, dict[str, float]]]:
    """The (step, {tag: value}) of every event with scalars in a TensorBoard event file, checking
    each record's masked CRC-32C (TFRecord framing: length, its CRC, the Event, its CRC)."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    data = Path(path).read_bytes()
    out, i = [], 0
    while i < len(data):
        header = data[i : i + 8]
        (n,) = struct.unpack("<Q", header)
        record = data[i + 12 : i + 12 + n]
        crcs = struct.unpack_from("<I", data, i + 8) + struct.unpack_from("<I", data, i + 12 + n)
        if crcs != (masked_crc32c(header), masked_crc32c(record)):
            raise ValueError(f"{path}: bad CRC in the record at byte {i}")
        event = Event.FromString(record)
        values = {v.tag: v.simple_value for v in event.summary.value if v.HasField("simple_value")}
        if values:
            out.append((event.step, values))
        i += 16 + n
    return out
