"""The Ripple envelope: a 59-byte little-endian header, the payload, a CRC-32C trailer.

====== ==== =========================================================================
offset size field
====== ==== =========================================================================
0      4    magic, the ASCII bytes ``RIPP`` (``52 49 50 50``)
4      1    protocol version (1)
5      1    message type (:class:`MessageType`, 0..5)
6      1    flags (reserved, 0)
7      8    sequence number, int64 LE, increasing per sender
15     8    timestamp, int64 LE, event time in ns since the Unix epoch
23     32   schema fingerprint: ``"<schema name>/v<version>"`` zero-padded (Delta only;
            every other message carries 32 zero bytes)
55     4    payload length N, int32 LE, 0 .. :data:`MAX_PAYLOAD`
59     N    payload (bin_prot, see :mod:`.messages`)
59+N   4    CRC-32C (Castagnoli) of bytes 0 .. 59+N-1, uint32 LE
====== ==== =========================================================================

Overhead per message: 59 + 4 = 63 bytes (:data:`OVERHEAD`).

A receiver checks, in this order and before any payload byte is decoded: the magic, the
version, the payload length (from the header, before the payload is buffered: a length
field of 2 GiB never allocates), then, once the whole envelope is in, the CRC. Each
header check happens as soon as its bytes arrive. Failures are
:class:`EnvelopeError` subclasses (:class:`~headwater.errors.ProtocolError`): after one,
the byte stream cannot be trusted and the decoder is dead. The type and flags bytes are
left to the message layer (:func:`.messages.decode_message`), which refuses an unknown
type or a non-zero flags byte in an otherwise intact envelope.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import crc32c as _crc32c

from headwater.errors import ProtocolError, UsageError
from headwater.protocols._stream import IncrementalDecoder

from .bin_prot import INT64_MAX, INT64_MIN, Buffer

MAGIC = b"RIPP"
"""The four magic bytes, ``52 49 50 50`` (the seed's ``0x52495050`` read big-endian)."""
VERSION = 1
HEADER = struct.Struct("<4sBBBqq32si")  # magic, version, type, flags, seq, ts, fp, len
HEADER_SIZE = HEADER.size
CRC = struct.Struct("<I")
CRC_SIZE = CRC.size
OVERHEAD = HEADER_SIZE + CRC_SIZE
FINGERPRINT_SIZE = 32
ZERO_FINGERPRINT = bytes(FINGERPRINT_SIZE)
MAX_PAYLOAD = 16 * 1024 * 1024
"""Largest payload an envelope may carry (16 MiB); checked from the header."""

assert HEADER_SIZE == 59, HEADER_SIZE
assert OVERHEAD == 63, OVERHEAD  # the seed's "total overhead per message: 63 bytes"

_VERSION_AT = 4
_LENGTH_AT = 55
_LENGTH = struct.Struct("<i")


class MessageType(IntEnum):
    """The envelope's type byte (the seed's tags)."""

    HANDSHAKE = 0
    DELTA = 1
    CHECKPOINT_REQUEST = 2
    CHECKPOINT_ACK = 3
    HEARTBEAT = 4
    SCHEMA_NEGOTIATION = 5


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC-32C (Castagnoli, reflected, init and xorout ``0xffffffff``)."""
    result: int = _crc32c.crc32c(data, value)
    return result


# --- errors --------------------------------------------------------------------------


class EnvelopeError(ProtocolError):
    """The byte stream is not valid Ripple envelopes; the connection cannot be trusted."""


class BadMagicError(EnvelopeError):
    """The first four bytes of an envelope are not ``RIPP``."""


class UnsupportedVersionError(EnvelopeError):
    """The version byte is not :data:`VERSION`."""

    def __init__(self, version: int) -> None:
        super().__init__(f"unsupported Ripple protocol version {version}")
        self.version = version


class PayloadLengthError(EnvelopeError):
    """The payload length is negative or above the decoder's limit."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"payload length {length} is outside 0..{limit}")
        self.length = length
        self.limit = limit


class CrcMismatchError(EnvelopeError):
    """The CRC-32C trailer does not match the bytes before it."""


class TruncatedEnvelopeError(EnvelopeError):
    """The input ended inside an envelope."""


class TrailingBytesError(EnvelopeError):
    """:func:`decode_envelope` was given more bytes than one envelope."""


# --- fingerprints --------------------------------------------------------------------


def fingerprint(name: str, version: int) -> bytes:
    """``"<name>/v<version>"`` as UTF-8, zero-padded to 32 bytes.

    UsageError when it does not fit, when ``name`` is empty or holds a NUL (the padding
    would make it ambiguous) or when ``version`` is negative.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UsageError(f"schema name {name!r} cannot make a fingerprint")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise UsageError(f"schema version {version!r} must be a non-negative int")
    text = f"{name}/v{version}".encode()
    if len(text) > FINGERPRINT_SIZE:
        raise UsageError(f"fingerprint {text!r} is longer than {FINGERPRINT_SIZE} bytes")
    return text.ljust(FINGERPRINT_SIZE, b"\x00")


def fingerprint_text(value: bytes) -> str:
    """A fingerprint for humans: the bytes before the padding (non-UTF-8 escaped)."""
    return value.rstrip(b"\x00").decode("utf-8", "backslashreplace")


# --- envelopes -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Envelope:
    """One decoded (or to-be-encoded) envelope; the payload is still bin_prot bytes."""

    message_type: int
    sequence: int
    timestamp_ns: int
    fingerprint: bytes
    payload: bytes
    flags: int = 0
    version: int = VERSION

    def encode(self) -> bytes:
        return encode_envelope(
            self.message_type,
            self.payload,
            sequence=self.sequence,
            timestamp_ns=self.timestamp_ns,
            fingerprint=self.fingerprint,
            flags=self.flags,
            version=self.version,
        )


def _u8(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0xFF:
        raise UsageError(f"{what} {value!r} is not a byte")
    return value


def _i64(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{what} must be an int, not {type(value).__name__}")
    if not INT64_MIN <= value <= INT64_MAX:
        raise UsageError(f"{what} {value} does not fit an int64")
    return value


def encode_envelope(
    message_type: int,
    payload: Buffer,
    *,
    sequence: int,
    timestamp_ns: int = 0,
    fingerprint: bytes = ZERO_FINGERPRINT,
    flags: int = 0,
    version: int = VERSION,
) -> bytes:
    """Header, payload and CRC-32C as one ``bytes``.

    ``version`` other than :data:`VERSION` is only useful to build test vectors.
    """
    size = memoryview(payload).nbytes
    if size > MAX_PAYLOAD:
        raise UsageError(f"a {size}-byte payload exceeds the {MAX_PAYLOAD}-byte limit")
    if not isinstance(fingerprint, bytes) or len(fingerprint) != FINGERPRINT_SIZE:
        raise UsageError(f"a fingerprint is {FINGERPRINT_SIZE} bytes, not {fingerprint!r}")
    head = HEADER.pack(
        MAGIC,
        _u8(version, "version"),
        _u8(message_type, "message type"),
        _u8(flags, "flags"),
        _i64(sequence, "sequence"),
        _i64(timestamp_ns, "timestamp_ns"),
        fingerprint,
        size,
    )
    crc = crc32c(payload, crc32c(head))
    return b"".join((head, payload, CRC.pack(crc)))


class EnvelopeDecoder(IncrementalDecoder[Envelope, EnvelopeError]):
    """Incremental decoder for a byte stream of envelopes (e.g. one TCP connection).

    :meth:`feed` bytes in any split; ``for envelope in decoder`` (or
    :meth:`next_envelope` until None) yields each complete, CRC-checked envelope in
    order, then raises the first :class:`EnvelopeError` found after them (the decoder
    stays dead after it: see :class:`~headwater.protocols._stream.IncrementalDecoder`).
    """

    __slots__ = ()
    head_size = HEADER_SIZE
    tail_size = CRC_SIZE

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        if not 0 <= max_payload <= 0x7FFF_FFFF:
            raise UsageError(f"max_payload {max_payload} is outside 0..2**31-1")
        super().__init__(max_payload)

    next_envelope = IncrementalDecoder.next_item

    def _item(self, view: memoryview, length: int) -> Envelope:
        body_end = HEADER_SIZE + length
        (stored,) = CRC.unpack_from(view, body_end)
        computed = crc32c(view[:body_end])
        if computed != stored:
            raise self._fail(
                CrcMismatchError(
                    f"envelope CRC-32C {stored:08x} does not match the bytes ({computed:08x})"
                )
            )
        _, version, message_type, flags, sequence, timestamp, fp, _ = HEADER.unpack_from(view)
        return Envelope(
            message_type, sequence, timestamp, fp, bytes(view[HEADER_SIZE:body_end]), flags, version
        )

    def finish(self) -> None:
        """Declare the end of input: TruncatedEnvelopeError when it stopped mid-envelope."""
        if self._error is not None:
            raise self._error
        if self._buffer:
            raise self._fail(
                TruncatedEnvelopeError(
                    f"input ended inside an envelope ({len(self._buffer)} bytes held)"
                )
            )

    def _check_header(self) -> bool:
        """Check the header fields present at the buffer head; True once all are good."""
        buffer = self._buffer
        have = len(buffer)
        if have == 0:
            return False
        head = min(have, len(MAGIC))
        if buffer[:head] != MAGIC[:head]:
            self._fail(BadMagicError(f"bad envelope magic {bytes(buffer[:head]).hex(' ')}"))
            return False
        if have > _VERSION_AT and buffer[_VERSION_AT] != VERSION:
            self._fail(UnsupportedVersionError(buffer[_VERSION_AT]))
            return False
        if have < HEADER_SIZE:
            return False
        (length,) = _LENGTH.unpack_from(buffer, _LENGTH_AT)
        if not 0 <= length <= self.max_payload:
            self._fail(PayloadLengthError(length, self.max_payload))
            return False
        self._length = length
        return True


def decode_envelope(data: Buffer, *, max_payload: int = MAX_PAYLOAD) -> Envelope:
    """Exactly one envelope filling ``data`` (EnvelopeError otherwise)."""
    decoder = EnvelopeDecoder(max_payload)
    decoder.feed(data)
    envelope = decoder.next_envelope()
    if envelope is None:
        raise TruncatedEnvelopeError(f"{len(data)} bytes are less than one envelope")
    if decoder.buffered_bytes:
        raise TrailingBytesError(f"{decoder.buffered_bytes} bytes after the envelope")
    return envelope
