"""Headwater's internal replication protocol: a follower fetching from a partition's
leader (docs/cluster.md, "Replication"). Pure: bytes in, frames out.

One TCP connection per follower and leader, request then answer, in turn. Every frame::

    u32 frame_length      the bytes after this field
    u32 header_length
    header                JSON object (UTF-8)
    data                  the rest: stored batches, byte for byte (answers only)

A fetch (follower -> leader): ``{"tenant", "stream", "partition", "offset"`` (the
follower's end), ``"epoch"`` (its latest leader epoch, -1: none), ``"replica"`` (its
node id), ``"max_bytes"}``. The answer: ``{"error"`` (null, ``"not_leader"``,
``"unknown_partition"``), ``"leader_epoch"``, ``"hw"`` (high watermark), ``"leader_end"``,
``"diverging"`` (null, or ``[epoch, end_offset]``: the follower's log parted from the
leader's; it truncates to ``min(end_offset, its own end of that epoch)`` and fetches
again, Kafka's OffsetForLeaderEpoch folded into the fetch as KIP-595 does),
``"epochs"`` (the leader's ``[[epoch, start_offset], ...]``)``}`` and the batches from
``offset``.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from typing import Any

from headwater.errors import ProtocolError

PREFIX = struct.Struct(">II")
MAX_FRAME_BYTES = 64 << 20  # a fetch answer holds at most max_bytes of batches plus one
MAX_HEADER_BYTES = 64 << 10

NOT_LEADER = "not_leader"
UNKNOWN_PARTITION = "unknown_partition"


@dataclass(frozen=True)
class Frame:
    header: dict[str, Any]
    data: bytes = b""


def encode(header: dict[str, Any], data: bytes = b"") -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return PREFIX.pack(4 + len(raw) + len(data), len(raw)) + raw + data


@dataclass(frozen=True)
class Fetch:
    """A follower's fetch: batches of ``tenant``/``stream``/``partition`` from
    ``offset`` (its end), its latest leader ``epoch`` (-1: none), sent by ``replica``."""

    tenant: int
    stream: str
    partition: int
    offset: int
    epoch: int
    replica: int
    max_bytes: int

    def encode(self) -> bytes:
        return encode(dataclasses.asdict(self))

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> Fetch:
        """ProtocolError naming the first field missing or not of its type."""
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            value = header.get(field.name)
            kind = str if field.type == "str" else int
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ProtocolError(f"fetch field {field.name!r} must be {kind.__name__}")
            values[field.name] = value
        return cls(**values)


class FrameReader:
    """Cuts frames out of the bytes a connection receives."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= PREFIX.size:
            length, header_length = PREFIX.unpack_from(self._buffer)
            if length > MAX_FRAME_BYTES or not length >= 4 or header_length > length - 4:
                raise ProtocolError(f"bad replication frame: length {length}")
            if header_length > MAX_HEADER_BYTES:
                raise ProtocolError(f"replication header of {header_length} bytes")
            if len(self._buffer) < 4 + length:
                break
            raw = bytes(self._buffer[PREFIX.size : PREFIX.size + header_length])
            data = bytes(self._buffer[PREFIX.size + header_length : 4 + length])
            del self._buffer[: 4 + length]
            try:
                header = json.loads(raw)
            except ValueError as exc:
                raise ProtocolError(f"replication header is not JSON: {exc}") from None
            if not isinstance(header, dict):
                raise ProtocolError("replication header must be a JSON object")
            frames.append(Frame(header, data))
        return frames
