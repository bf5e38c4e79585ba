"""Errors of the entities SDK.

A ConvergeDB ERROR from the server raises the :class:`EntityError` subclass of its code
(``KindNotFound`` for KIND_NOT_FOUND ...); ``name`` is headwater's one name for the error
(:class:`~headwater.errors.ErrorName`, the same on every surface: ``KindNotFound``),
``wire_name`` ConvergeDB's (``KIND_NOT_FOUND``, what ``name`` was before the names were
made one), ``cdb_code`` its code and ``ref_opcode`` the request it answers. The errors
the streams SDK has too are its subclasses as well: ``except AuthenticationFailed``,
``except InternalError`` and ``except TableNotFound`` catch them from either SDK.

Failures of the connection itself are the SDK's usual classes from
:mod:`headwater.client.errors` (``ServerUnavailable``, ``ConnectionLost``,
``RequestTimeout``, ``ClientClosed``), under the same root
:class:`~headwater.errors.HeadwaterError`. A call the client refuses before sending
anything (a write on a read-only connection, a value of the wrong type) raises
:class:`~headwater.errors.UsageError` or :class:`ReadOnly`.
"""

from __future__ import annotations

from typing import ClassVar

from headwater.errors import (
    AuthenticationFailed,
    ErrorName,
    HeadwaterError,
    InternalError,
)
from headwater.errors import EntityNotFound as _EntityNotFound
from headwater.errors import KindNotFound as _KindNotFound
from headwater.protocols.convergedb.codes import ErrorCode, Opcode


class EntityError(HeadwaterError):
    """An ERROR the ConvergeDB server answered (or, for :class:`ReadOnly`, would)."""

    # The base class itself answers an ERROR code this SDK does not know.
    cdb_code: ClassVar[int] = 0
    name: ClassVar[ErrorName] = ErrorName.UNKNOWN

    def __init__(self, message: str = "", ref_opcode: int = 0) -> None:
        super().__init__(message)
        self.ref_opcode = ref_opcode
        self.wire_code = self.cdb_code  # the code received (differs for an unknown one)

    @property
    def wire_name(self) -> str:
        """ConvergeDB's name of the error code (``KIND_NOT_FOUND``), or ``code N`` for a
        code the protocol does not define."""
        try:
            return ErrorCode(self.wire_code).name
        except ValueError:
            return f"code {self.wire_code}"

    @property
    def request(self) -> str:
        """The name of the request the error answers (``ASSERT``, ``QUERY``...)."""
        try:
            return Opcode(self.ref_opcode).name
        except ValueError:
            return f"opcode {self.ref_opcode:#06x}"


class BadFrame(EntityError):
    """The server could not read a request (a client bug, or a bad kind name)."""

    cdb_code, name = ErrorCode.BAD_FRAME, ErrorName.BAD_FRAME


class UnsupportedVersion(EntityError):
    cdb_code, name = ErrorCode.UNSUPPORTED_VERSION, ErrorName.UNSUPPORTED_VERSION


class NotConnected(EntityError):
    cdb_code, name = ErrorCode.NOT_CONNECTED, ErrorName.NOT_CONNECTED


class AuthFailed(EntityError, AuthenticationFailed):
    """The token is unknown and the server requires one."""

    cdb_code, name = ErrorCode.AUTH_FAILED, ErrorName.AUTHENTICATION_FAILED


class SourceConflict(EntityError):
    """The source id asked for is held by another live connection."""

    cdb_code, name = ErrorCode.SOURCE_CONFLICT, ErrorName.SOURCE_CONFLICT


class NoFreeSource(EntityError):
    """All 64 source slots of the tenant are taken."""

    cdb_code, name = ErrorCode.NO_FREE_SOURCE, ErrorName.NO_FREE_SOURCE


class ReadOnly(EntityError):
    """A write (or CREATE_KIND, or an epoch) on a read-only connection."""

    cdb_code, name = ErrorCode.READ_ONLY, ErrorName.READ_ONLY


class KindNotFound(EntityError, _KindNotFound):
    cdb_code, name = ErrorCode.KIND_NOT_FOUND, ErrorName.KIND_NOT_FOUND


class SchemaConflict(EntityError):
    """CREATE_KIND that changes an existing kind other than by appending fields."""

    cdb_code, name = ErrorCode.SCHEMA_CONFLICT, ErrorName.SCHEMA_CONFLICT


class SchemaIncompatible(EntityError):
    """The declared fields are not a prefix of the kind's schema."""

    cdb_code, name = ErrorCode.SCHEMA_INCOMPATIBLE, ErrorName.SCHEMA_INCOMPATIBLE


class EntityNotFound(EntityError, _EntityNotFound):
    cdb_code, name = ErrorCode.ENTITY_NOT_FOUND, ErrorName.ENTITY_NOT_FOUND


class BadFieldData(EntityError):
    cdb_code, name = ErrorCode.BAD_FIELD_DATA, ErrorName.BAD_FIELD_DATA


class LimitExceeded(EntityError):
    cdb_code, name = ErrorCode.LIMIT_EXCEEDED, ErrorName.LIMIT_EXCEEDED


class SubscriptionOverflow(EntityError):
    """The subscriber fell 4,096 notifications behind; the server closed the connection."""

    cdb_code, name = ErrorCode.SUBSCRIPTION_OVERFLOW, ErrorName.SUBSCRIPTION_OVERFLOW


class Internal(EntityError, InternalError):
    cdb_code, name = ErrorCode.INTERNAL, ErrorName.INTERNAL_ERROR


class ReservedName(EntityError):
    """Kind names starting with ``convergedb_`` or ``hw_`` are the server's."""

    cdb_code, name = ErrorCode.RESERVED_NAME, ErrorName.RESERVED_NAME


class NoEpoch(EntityError):
    """SOURCE_EPOCH_END without an open epoch (e.g. the connection was lost inside it)."""

    cdb_code, name = ErrorCode.NO_EPOCH, ErrorName.NO_EPOCH


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
        error.wire_code = code
        return error
    return cls(message or cls.name, ref_opcode)
