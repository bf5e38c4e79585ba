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

A transaction marker (coordinator -> the partition's leader, Kafka's WriteTxnMarkers
for one partition, docs/cluster.md): ``{"kind": "txn_marker", "tenant", "stream",
"partition", "producer_id", "epoch", "commit"}`` (commit: true, abort: false). The
answer, once the leader's in-sync replicas hold the marker (or the transaction was not
open there): ``{"error"}`` (null, or why not: the coordinator retries). A frame without
``kind`` is a fetch.

The handshake (cluster/peers.py), before anything else on a connection: the listener
sends ``{"kind": "challenge", "nonce"}`` (32 random bytes, hex); the connecting node
answers ``{"kind": "hello", "node", "proof"}``, proof the hex HMAC-SHA256 of the nonce
under the cluster's ``[cluster] secret`` ("" without one); the listener answers
``{"error"}``: null, or why it refuses (``"unauthorized"``, ``"max_connections"``,
``"handshake_timeout_s"``), and then closes.
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

CHALLENGE = "challenge"  # handshake frames' "kind"
HELLO = "hello"
UNAUTHORIZED = "unauthorized"
NOT_LEADER = "not_leader"
TXN_MARKER = "txn_marker"  # a frame's "kind": a transaction marker request
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
        return cls(**_fields(cls, header, "fetch"))


@dataclass(frozen=True)
class TxnMarker:
    """A coordinator's request: write ``producer_id``'s commit (or abort) marker at
    ``epoch`` on ``tenant``/``stream``/``partition``, of which the receiver is leader."""

    tenant: int
    stream: str
    partition: int
    producer_id: int
    epoch: int
    commit: bool

    def encode(self) -> bytes:
        return encode({"kind": TXN_MARKER, **dataclasses.asdict(self)})

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> TxnMarker:
        """ProtocolError naming the first field missing or not of its type."""
        return cls(**_fields(cls, header, "txn_marker"))


def _fields(cls: type, header: dict[str, Any], what: str) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        value = header.get(field.name)
        kind = {"str": str, "bool": bool}.get(str(field.type), int)
        # bool is an int in Python: an int field refuses it, a bool field wants one.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ProtocolError(f"{what} field {field.name!r} must be {kind.__name__}")
        values[field.name] = value
    return values


class FrameReader:
    """Cuts frames out of the bytes a connection receives."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self._max_frame_bytes = max_frame_bytes  # a listener takes only small requests

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= PREFIX.size:
            length, header_length = PREFIX.unpack_from(self._buffer)
            if length > self._max_frame_bytes or not length >= 4 or header_length > length - 4:
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
