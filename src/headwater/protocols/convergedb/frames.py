"""ConvergeDB framing: a 12-byte little-endian header, then the payload.

Header (offsets in bytes)::

    0 version u8 (1) | 1 flags u8 (0) | 2 stream_id u16 | 4 opcode u16 |
    6 payload_len u32 (at most 16 MiB) | 10 crc16 u16

``crc16`` is CRC-16/XMODEM of header bytes 0..9; the payload has no checksum.

The decoder refuses a bad header before it keeps a single payload byte: the version byte
is checked as soon as it arrives, the CRC and then the length as soon as the 12 header
bytes are in. A length field of 4 GiB therefore never allocates. Both failures end the
connection, after an ERROR the server sends first (:class:`FrameError` says which).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from headwater.engine.kinds.reader import Buffer
from headwater.errors import ProtocolError, UsageError
from headwater.protocols._stream import IncrementalDecoder

from .codes import MAX_PAYLOAD, VERSION, ErrorCode

HEADER = struct.Struct("<BBHHIH")  # version, flags, stream_id, opcode, payload_len, crc16
HEADER_SIZE = HEADER.size  # 12
_CRC_SPAN = 10
_CHECKED = struct.Struct("<BBHHI")  # the header bytes the CRC covers


# --- CRC-16/XMODEM ---------------------------------------------------------------------
# Polynomial 0x1021, initial value 0, no reflection, no final XOR; check("123456789") =
# 0x31C3. Table-driven: one lookup per byte.


def _crc16_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        table.append(crc & 0xFFFF)
    return tuple(table)


_CRC16_TABLE = _crc16_table()


def crc16_xmodem(data: Buffer, crc: int = 0) -> int:
    """CRC-16/XMODEM of ``data`` (continue a running CRC by passing it as ``crc``)."""
    table = _CRC16_TABLE
    for byte in memoryview(data).cast("B"):
        crc = ((crc << 8) & 0xFFFF) ^ table[(crc >> 8) ^ byte]
    return crc


# --- errors ----------------------------------------------------------------------------


class FrameError(ProtocolError):
    """The byte stream is not valid ConvergeDB framing: send ERROR ``code`` on
    ``stream_id`` with ``ref_opcode``, then close the connection."""

    code: ClassVar[ErrorCode] = ErrorCode.BAD_FRAME

    def __init__(self, message: str, stream_id: int = 0, ref_opcode: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.stream_id = stream_id
        self.ref_opcode = ref_opcode


class BadFrameError(FrameError):
    """Header CRC mismatch or unsupported version: ERROR BAD_FRAME (stream 0,
    ref_opcode 0), then close."""


class FrameTooLargeError(FrameError):
    """payload_len over the limit (in a header whose CRC matched): ERROR LIMIT_EXCEEDED on
    the frame's stream_id with its opcode, then close (the payload is never read)."""

    code = ErrorCode.LIMIT_EXCEEDED


# --- encoding --------------------------------------------------------------------------


def encode_header(stream_id: int, opcode: int, payload_len: int, *, flags: int = 0) -> bytes:
    """The 12 header bytes, CRC included."""
    if payload_len > MAX_PAYLOAD:
        raise UsageError(f"a {payload_len}-byte payload exceeds the {MAX_PAYLOAD}-byte frame limit")
    try:
        checked = _CHECKED.pack(VERSION, flags, stream_id, opcode, payload_len)
    except struct.error as exc:
        raise UsageError(f"cannot encode frame header: {exc}") from None
    return checked + struct.pack("<H", crc16_xmodem(checked))


def encode_frame(stream_id: int, opcode: int, payload: Buffer = b"", *, flags: int = 0) -> bytes:
    """One frame: header then ``payload``."""
    return encode_header(stream_id, opcode, memoryview(payload).nbytes, flags=flags) + payload


def encode_frame_chunks(stream_id: int, opcode: int, chunks: Iterable[Buffer]) -> list[Buffer]:
    """Frame a payload given as chunks without joining them: ``[header, *chunks]``."""
    parts: list[Buffer] = [b""]
    length = 0
    for chunk in chunks:
        length += memoryview(chunk).nbytes
        parts.append(chunk)
    parts[0] = encode_header(stream_id, opcode, length)
    return parts


# --- decoding --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RawFrame:
    """A frame whose header checked out; the payload is not decoded yet."""

    stream_id: int
    opcode: int
    payload: bytes
    flags: int = 0


class FrameDecoder(IncrementalDecoder[RawFrame, FrameError]):
    """Incremental frame decoder: :meth:`feed` bytes, then take frames.

    ``for frame in decoder`` (or :meth:`next_frame` until None) yields each complete frame
    in order, then raises the first :class:`FrameError` found after them (the decoder
    stays dead after it: see :class:`~headwater.protocols._stream.IncrementalDecoder`).
    """

    __slots__ = ("_header",)
    head_size = HEADER_SIZE

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        super().__init__(max_payload)
        self._header = (0, 0, 0)  # flags, stream_id, opcode of a checked header

    next_frame = IncrementalDecoder.next_item
    at_frame_boundary = IncrementalDecoder.at_boundary

    def _item(self, view: memoryview, length: int) -> RawFrame:
        flags, stream_id, opcode = self._header
        return RawFrame(stream_id, opcode, bytes(view[HEADER_SIZE : HEADER_SIZE + length]), flags)

    def _check_header(self) -> bool:
        """Check the header bytes present at the buffer head; True once all passed."""
        buffer = self._buffer
        have = len(buffer)
        if have == 0:
            return False
        if buffer[0] != VERSION:
            self._fail(BadFrameError(f"unsupported protocol version {buffer[0]}"))
            return False
        if have < HEADER_SIZE:
            return False
        _, flags, stream_id, opcode, length, crc = HEADER.unpack_from(buffer)
        with memoryview(buffer) as view:
            expected = crc16_xmodem(view[:_CRC_SPAN])
        if crc != expected:
            self._fail(
                BadFrameError(f"header CRC mismatch: got {crc:#06x}, computed {expected:#06x}")
            )
            return False
        if length > self.max_payload:
            self._fail(
                FrameTooLargeError(
                    f"frame payload of {length} bytes exceeds the {self.max_payload}-byte limit",
                    stream_id,
                    opcode,
                )
            )
            return False
        self._header = (flags, stream_id, opcode)
        self._length = length
        return True
