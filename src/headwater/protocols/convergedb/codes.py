"""ConvergeDB numbers and exceptions: opcodes, error codes, limits.

The limits on kinds (64 fields, sources 0..63, 32-byte entity ids) are the kind engine's
(:mod:`headwater.engine.kinds.fields`); the wire gives each field and source one bit.

Two exception families, as everywhere in headwater:

- :class:`~headwater.errors.ProtocolError` subclasses when the peer sent bad bytes. Each
  carries the ERROR ``code`` the server answers with. :class:`DecodeError` (and its
  subclasses) means one frame's payload is bad while the framing is intact, so the
  connection can answer and carry on; ``frames.FrameError`` means the byte stream itself
  is broken (answer, then close).
- :class:`~headwater.errors.UsageError` when our own caller asked for something the wire
  cannot carry (an out-of-range integer, a 33-byte entity id, a 70 KiB string...).
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar

from headwater.engine.kinds.fields import ENTITY_ID_SIZE as ENTITY_ID_SIZE
from headwater.engine.kinds.fields import MAX_FIELDS as MAX_FIELDS
from headwater.engine.kinds.fields import MAX_SOURCE_ID as MAX_SOURCE_ID
from headwater.errors import ProtocolError

VERSION = 1
"""The protocol version in every frame header."""
MAX_PAYLOAD = 16 * 1024 * 1024
"""Largest payload one frame may carry (16 MiB)."""
NO_SOURCE = 0xFF
"""The source_id a CONNECT ACK carries for a read-only connection."""
DEFAULT_LIVENESS_MS = 30_000
"""What a CONNECT liveness_deadline_ms of 0 means."""


class Opcode(IntEnum):
    # client -> server
    CONNECT = 0x01
    ASSERT = 0x02
    RETRACT = 0x03
    QUERY = 0x04
    SUBSCRIBE = 0x05
    UNSUBSCRIBE = 0x06
    HEARTBEAT = 0x07
    PATCH = 0x08
    SOURCE_EPOCH_BEGIN = 0x09
    SOURCE_EPOCH_END = 0x0A
    BATCH = 0x0B
    CREATE_KIND = 0x10
    GET_KIND = 0x11
    # server -> client
    STATE = 0x81
    DELETED = 0x82
    BOOTSTRAP_BEGIN = 0x83
    BOOTSTRAP_END = 0x84
    ACK = 0x85
    ERROR = 0x86
    EVENT = 0x87

    @property
    def from_client(self) -> bool:
        return self < 0x80


CLIENT_OPCODES = frozenset(op for op in Opcode if op.from_client)
SERVER_OPCODES = frozenset(op for op in Opcode if not op.from_client)
WRITE_OPCODES = frozenset(
    {
        Opcode.ASSERT,
        Opcode.RETRACT,
        Opcode.PATCH,
        Opcode.BATCH,
        Opcode.SOURCE_EPOCH_BEGIN,
        Opcode.SOURCE_EPOCH_END,
        Opcode.CREATE_KIND,
    }
)
"""Requests a read-only connection may not send (answered with ERROR READ_ONLY)."""
REPLY_OPCODES = frozenset(
    {
        Opcode.CONNECT,
        Opcode.QUERY,
        Opcode.SUBSCRIBE,
        Opcode.UNSUBSCRIBE,
        Opcode.CREATE_KIND,
        Opcode.GET_KIND,
    }
)
"""Requests that are always answered (the others only when their stream_id is non-zero)."""


class ErrorCode(IntEnum):
    BAD_FRAME = 1
    UNSUPPORTED_VERSION = 2
    NOT_CONNECTED = 3
    AUTH_FAILED = 4
    SOURCE_CONFLICT = 5
    NO_FREE_SOURCE = 6
    READ_ONLY = 7
    KIND_NOT_FOUND = 8
    SCHEMA_CONFLICT = 9
    SCHEMA_INCOMPATIBLE = 10
    ENTITY_NOT_FOUND = 11
    BAD_FIELD_DATA = 12
    LIMIT_EXCEEDED = 13
    SUBSCRIPTION_OVERFLOW = 14
    INTERNAL = 15
    RESERVED_NAME = 16
    NO_EPOCH = 17


class DecodeError(ProtocolError):
    """A frame's payload is malformed; the frame itself was intact.

    ``code`` is the ERROR code to answer with (on the frame's stream_id, with the frame's
    opcode as ref_opcode); the connection stays usable.
    """

    code: ClassVar[ErrorCode] = ErrorCode.BAD_FRAME

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class FieldDataError(DecodeError):
    """field_data does not match the kind's schema (BAD_FIELD_DATA)."""

    code = ErrorCode.BAD_FIELD_DATA


class LimitExceededError(DecodeError):
    """A well-formed payload beyond a protocol limit, e.g. more than 64 fields
    (LIMIT_EXCEEDED)."""

    code = ErrorCode.LIMIT_EXCEEDED


class UnexpectedFrameError(ProtocolError):
    """A well-formed frame the client did not expect: a server opcode on a stream the
    client never opened, an ACK for another request, a client opcode from the server."""
