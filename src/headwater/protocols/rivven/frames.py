"""Rivven framing: ``u32 BE length | u8 format | u32 BE correlation id | payload``.

The length counts everything after itself (format byte, correlation id and payload) and
is at most :data:`MAX_FRAME` (10 MiB, Rivven's ``MAX_MESSAGE_SIZE``). The decoder checks
it as soon as its four bytes arrive, so a length field claiming 4 GiB is refused before a
byte of body is kept. The body is then cut off whole and split by :func:`parse_frame`;
a body too short for its format byte and correlation id is an error of that one frame
(the lengths still delimit the stream, so the next frame is read normally), as in Rivven.

What a failure means for the connection:

- an oversized length: :class:`FrameTooLargeError`, sticky (the stream cannot be
  resynchronised without reading the claimed bytes): answer, then close;
- a short body: :class:`ShortFrameError`, answer and carry on.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from headwater.engine.kinds.reader import Buffer
from headwater.errors import ProtocolError, UsageError
from headwater.protocols._stream import LengthPrefixedDecoder

LENGTH = struct.Struct(">I")
LENGTH_SIZE = LENGTH.size  # 4
WIRE_HEADER = struct.Struct(">BI")  # format, correlation id
WIRE_HEADER_SIZE = WIRE_HEADER.size  # 5
MAX_FRAME = 10 * 1024 * 1024
"""Largest value of the length field: format + correlation id + payload (10 MiB)."""
MAX_CORRELATION_ID = 0xFFFF_FFFF


class WireFormat(IntEnum):
    """The format byte: how the payload is serialised."""

    POSTCARD = 0x00
    """Rivven's Rust-only serde format: refused here with a clear error."""
    PROTOBUF = 0x01
    """``rivven.proto`` (the only format headwater decodes)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame's body: the format byte as sent (not necessarily a known
    :class:`WireFormat`), the correlation id and the payload."""

    format: int
    correlation_id: int
    payload: bytes


class FrameError(ProtocolError):
    """The bytes are not valid Rivven framing."""


class FrameTooLargeError(FrameError):
    """A length field over the limit: the connection must close (after an answer)."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds the {limit}-byte limit")
        self.length = length
        self.limit = limit


class ShortFrameError(FrameError):
    """A frame body shorter than the format byte and correlation id: that frame alone is
    bad, the stream is still in step."""

    def __init__(self, length: int) -> None:
        super().__init__(
            f"frame of {length} bytes is too short for its format byte and correlation id"
        )
        self.length = length


class FrameTooLarge(UsageError):
    """A frame to send would be over the limit: the sender must answer otherwise."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"a {length}-byte frame exceeds the {limit}-byte limit")
        self.length = length
        self.limit = limit


def encode_frame(
    wire_format: int, correlation_id: int, payload: Buffer, *, max_frame: int = MAX_FRAME
) -> bytes:
    """One frame around ``payload``; raises :class:`FrameTooLarge` past ``max_frame``."""
    if not 0 <= correlation_id <= MAX_CORRELATION_ID:
        raise UsageError(f"correlation id {correlation_id} is not a u32")
    if not 0 <= wire_format <= 0xFF:
        raise UsageError(f"format {wire_format} is not a byte")
    length = WIRE_HEADER_SIZE + memoryview(payload).nbytes
    if length > max_frame:
        raise FrameTooLarge(length, max_frame)
    return LENGTH.pack(length) + WIRE_HEADER.pack(wire_format, correlation_id) + payload


def parse_frame(body: bytes) -> Frame:
    """Split a frame body (what follows the length); raises :class:`ShortFrameError`."""
    if len(body) < WIRE_HEADER_SIZE:
        raise ShortFrameError(len(body))
    wire_format, correlation_id = WIRE_HEADER.unpack_from(body)
    return Frame(wire_format, correlation_id, body[WIRE_HEADER_SIZE:])


class FrameDecoder(LengthPrefixedDecoder[FrameError]):
    """Incremental decoder: :meth:`feed` bytes, then take frame bodies in order
    (``for body in decoder``); an oversized length is raised once its four bytes are in,
    and again on every later call (see :class:`~headwater.protocols._stream.IncrementalDecoder`).
    """

    __slots__ = ()
    length_field = LENGTH

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        super().__init__(max_frame)

    def _length_error(self, length: int) -> FrameError:
        return FrameTooLargeError(length, self.max_payload)
