"""Errors of the entities SDK.

A ConvergeDB ERROR from the server raises the :class:`EntityError` subclass of its code
(``KindNotFound`` for KIND_NOT_FOUND ...); ``name`` is the wire name, ``ref_opcode`` the
request it answers. Failures of the connection itself are the SDK's usual classes from
:mod:`headwater.errors` (``ServerUnavailable``, ``ConnectionLost``, ``RequestTimeout``,
``ClientClosed``), under the same root :class:`~headwater.errors.HeadwaterError`. A call
the client refuses before sending anything (a write on a read-only connection, a value of
the wrong type) raises :class:`~headwater.errors.UsageError` or :class:`ReadOnly`.
"""

from __future__ import annotations

from typing import ClassVar

from headwater.errors import HeadwaterError
from headwater.protocols.convergedb.codes import ErrorCode, Opcode


class EntityError(HeadwaterError):
    """An ERROR the ConvergeDB server answered (or, for :class:`ReadOnly`, would)."""

    cdb_code: ClassVar[int] = ErrorCode.INTERNAL
    name: ClassVar[str] = "INTERNAL"

    def __init__(self, message: str = "", ref_opcode: int = 0) -> None:
        super().__init__(message)
        self.ref_opcode = ref_opcode

    @property
    def request(self) -> str:
        """The name of the request the error answers (``ASSERT``, ``QUERY``...)."""
        try:
            return Opcode(self.ref_opcode).name
        except ValueError:
            return f"opcode {self.ref_opcode:#06x}"


class BadFrame(EntityError):
    """The server could not read a request (a client bug, or a bad kind name)."""

    cdb_code, name = ErrorCode.BAD_FRAME, "BAD_FRAME"


class UnsupportedVersion(EntityError):
    cdb_code, name = ErrorCode.UNSUPPORTED_VERSION, "UNSUPPORTED_VERSION"


class NotConnected(EntityError):
    cdb_code, name = ErrorCode.NOT_CONNECTED, "NOT_CONNECTED"


class AuthFailed(EntityError):
    """The token is unknown and the server requires one."""

    cdb_code, name = ErrorCode.AUTH_FAILED, "AUTH_FAILED"


class SourceConflict(EntityError):
    """The source id asked for is held by another live connection."""

    cdb_code, name = ErrorCode.SOURCE_CONFLICT, "SOURCE_CONFLICT"


class NoFreeSource(EntityError):
    """All 64 source slots of the tenant are taken."""

    cdb_code, name = ErrorCode.NO_FREE_SOURCE, "NO_FREE_SOURCE"


class ReadOnly(EntityError):
    """A write (or CREATE_KIND, or an epoch) on a read-only connection."""

    cdb_code, name = ErrorCode.READ_ONLY, "READ_ONLY"


class KindNotFound(EntityError):
    cdb_code, name = ErrorCode.KIND_NOT_FOUND, "KIND_NOT_FOUND"


class SchemaConflict(EntityError):
    """CREATE_KIND that changes an existing kind other than by appending fields."""

    cdb_code, name = ErrorCode.SCHEMA_CONFLICT, "SCHEMA_CONFLICT"


class SchemaIncompatible(EntityError):
    """The declared fields are not a prefix of the kind's schema."""

    cdb_code, name = ErrorCode.SCHEMA_INCOMPATIBLE, "SCHEMA_INCOMPATIBLE"


class EntityNotFound(EntityError):
    cdb_code, name = ErrorCode.ENTITY_NOT_FOUND, "ENTITY_NOT_FOUND"


class BadFieldData(EntityError):
    cdb_code, name = ErrorCode.BAD_FIELD_DATA, "BAD_FIELD_DATA"


class LimitExceeded(EntityError):
    cdb_code, name = ErrorCode.LIMIT_EXCEEDED, "LIMIT_EXCEEDED"


class SubscriptionOverflow(EntityError):
    """The subscriber fell 4,096 notifications behind; the server closed the connection."""

    cdb_code, name = ErrorCode.SUBSCRIPTION_OVERFLOW, "SUBSCRIPTION_OVERFLOW"


class Internal(EntityError):
    cdb_code, name, retryable = ErrorCode.INTERNAL, "INTERNAL", True


class ReservedName(EntityError):
    """Kind names starting with ``convergedb_`` or ``hw_`` are the server's."""

    cdb_code, name = ErrorCode.RESERVED_NAME, "RESERVED_NAME"


class NoEpoch(EntityError):
    """SOURCE_EPOCH_END without an open epoch (e.g. the connection was lost inside it)."""

    cdb_code, name = ErrorCode.NO_EPOCH, "NO_EPOCH"


ERRORS_BY_CODE: dict[int, type[EntityError]] = {
    cls.cdb_code: cls
    for cls in (
        BadFrame,
        UnsupportedVersion,
        NotConnected,
        AuthFailed,
        SourceConflict,
        NoFreeSource,
        ReadOnly,
        KindNotFound,
        SchemaConflict,
        SchemaIncompatible,
        EntityNotFound,
        BadFieldData,
        LimitExceeded,
        SubscriptionOverflow,
        Internal,
        ReservedName,
        NoEpoch,
    )
}


def error_for(code: int, ref_opcode: int, message: str) -> EntityError:
    """The exception for an ERROR frame (unknown codes: a plain EntityError)."""
    cls = ERRORS_BY_CODE.get(code)
    if cls is None:
        error = EntityError(f"error code {code}: {message}", ref_opcode)
        return error
    return cls(message or cls.name, ref_opcode)
