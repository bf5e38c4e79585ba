"""Kimberlite framing: a 14-byte big-endian header, then the payload.

Header: magic u32 ``0x56444220`` (``b"VDB "``), version u16 = 1, payload_len u32 (at most
16 MiB), crc32 u32 = IEEE CRC-32 of the payload (``zlib.crc32``'s). It is computed with
zlib-ng's crc32 (the same function, folded with PCLMUL: about 50 GiB/s here against the
standard library's 3.5), since every byte a read answers or a client receives passes it.

The decoder checks in the seed's order (magic, version, length, then the CRC once the
payload is in) and checks each header field as soon as its bytes arrive, so a bad or
oversized header is refused before a single payload byte is kept: a length field of
4 GiB never allocates. What a failure means for the connection differs:

- bad magic or CRC: :class:`FatalFrameError`, close at once (the stream cannot be
  trusted, nothing sensible can be said to the peer);
- unsupported version or oversized payload: :class:`RejectFrameError`, whose ``reply``
  is the framed Error(request_id 0, InvalidRequest) to send before closing.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from zlib_ng.zlib_ng import crc32

from headwater.errors import ProtocolError, UsageError
from headwater.protocols._stream import IncrementalDecoder

from .messages import Buffer, ErrorCode, Response, encode_response, error_response

MAGIC = 0x56444220
MAGIC_BYTES = b"VDB "
VERSION = 1
HEADER = struct.Struct(">IHII")  # magic, version, payload_len, crc32
HEADER_SIZE = HEADER.size  # 14
MAX_FRAME = 16 * 1024 * 1024
"""Largest payload a frame may carry (16 MiB)."""

_VERSION_AT = struct.Struct(">H")
_LENGTH_AT = struct.Struct(">I")


class FrameError(ProtocolError):
    """The byte stream is not valid Kimberlite framing; the connection must close."""


class FatalFrameError(FrameError):
    """Bad magic or CRC: close without replying."""


class RejectFrameError(FrameError):
    """Unsupported version or oversized payload: send ``reply``, then close."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.response: Response = error_response(0, ErrorCode.INVALID_REQUEST, message)

    @property
    def reply(self) -> bytes:
        """The framed Error response to send before closing."""
        return encode_frame(encode_response(self.response))


class FrameTooLarge(UsageError):
    """A payload to send is over :data:`MAX_FRAME`: the sender must answer otherwise."""

    def __init__(self, payload_len: int) -> None:
        super().__init__(f"a {payload_len}-byte payload exceeds the {MAX_FRAME}-byte frame limit")
        self.payload_len = payload_len


def frame_header(payload_len: int, crc: int) -> bytes:
    if payload_len > MAX_FRAME:
        raise FrameTooLarge(payload_len)
    return HEADER.pack(MAGIC, VERSION, payload_len, crc)


def encode_frame(payload: Buffer) -> bytes:
    """One frame: header then ``payload``."""
    return frame_header(len(payload), crc32(payload)) + payload


def encode_frame_chunks(chunks: Iterable[Buffer]) -> list[Buffer]:
    """Frame a payload given as chunks without joining them: ``[header, *chunks]``.

    Hand the list to ``writelines`` (no copy), or ``b"".join`` it (one copy).
    """
    parts: list[Buffer] = [b""]
    crc = 0
    length = 0
    for chunk in chunks:
        crc = crc32(chunk, crc)
        length += memoryview(chunk).nbytes
        parts.append(chunk)
    parts[0] = frame_header(length, crc)
    return parts


class FrameDecoder(IncrementalDecoder[bytes, FrameError]):
    """Incremental frame decoder: :meth:`feed` bytes, then take payloads.

    ``for payload in decoder`` (or :meth:`next_payload` until None) yields each complete,
    CRC-checked payload in order, then raises the first framing error found after them
    (the decoder stays dead after it: see :class:`~headwater.protocols._stream.IncrementalDecoder`).
    """

    __slots__ = ("_crc",)
    head_size = HEADER_SIZE

    def __init__(self, max_payload: int = MAX_FRAME) -> None:
        super().__init__(max_payload)
        self._crc = 0  # the CRC from a checked header at the buffer head

    next_payload = IncrementalDecoder.next_item
    at_frame_boundary = IncrementalDecoder.at_boundary

    def _item(self, view: memoryview, length: int) -> bytes:
        payload = bytes(view[HEADER_SIZE : HEADER_SIZE + length])
        if crc32(payload) != self._crc:
            raise self._fail(FatalFrameError(f"frame CRC mismatch ({length}-byte payload)"))
        return payload

    def _check_header(self) -> bool:
        """Check the header fields present at the buffer head; True once all are good."""
        buffer = self._buffer
        have = len(buffer)
        if have == 0:
            return False
        head = min(have, 4)
        if buffer[:head] != MAGIC_BYTES[:head]:
            self._fail(FatalFrameError(f"bad frame magic {bytes(buffer[:head]).hex()}"))
            return False
        if have >= 6:
            (version,) = _VERSION_AT.unpack_from(buffer, 4)
            if version != VERSION:
                self._fail(RejectFrameError(f"unsupported protocol version {version}"))
                return False
        if have >= 10:
            (length,) = _LENGTH_AT.unpack_from(buffer, 6)
            if length > self.max_payload:
                self._fail(
                    RejectFrameError(
                        f"frame payload of {length} bytes exceeds the {self.max_payload}-byte limit"
                    )
                )
                return False
        if have < HEADER_SIZE:
            return False
        _, _, self._length, self._crc = HEADER.unpack_from(buffer)
        return True
