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

from typing import Any, ClassVar

from headwater.errors import (
    CONVERGEDB_ALIASES,
    AuthenticationFailed,
    ErrorName,
    HeadwaterError,
    InternalError,
)
from headwater.errors import EntityNotFound as _EntityNotFound
from headwater.errors import KindNotFound as _KindNotFound
from headwater.protocols.convergedb.codes import ErrorCode, Opcode

ERRORS_BY_CODE: dict[int, type[EntityError]] = {}
"""The class of each ERROR code, filled as the classes below are defined."""


class EntityError(HeadwaterError):
    """An ERROR the ConvergeDB server answered (or, for :class:`ReadOnly`, would)."""

    # The base class itself answers an ERROR code this SDK does not know.
    cdb_code: ClassVar[int] = 0
    name: ClassVar[ErrorName] = ErrorName.UNKNOWN

    def __init_subclass__(cls, code: ErrorCode | None = None, **kwargs: Any) -> None:
        """``class X(EntityError, code=ErrorCode.X)``: the class of that ERROR code,
        named as :data:`~headwater.errors.CONVERGEDB_ALIASES` maps the code's name."""
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.cdb_code, cls.name = code, CONVERGEDB_ALIASES[code.name]
            ERRORS_BY_CODE[code] = cls

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


class BadFrame(EntityError, code=ErrorCode.BAD_FRAME):
    """The server could not read a request (a client bug, or a bad kind name)."""


class UnsupportedVersion(EntityError, code=ErrorCode.UNSUPPORTED_VERSION):
    """The server does not speak the protocol version the client asked for."""


class NotConnected(EntityError, code=ErrorCode.NOT_CONNECTED):
    """A request before CONNECT was answered."""


class AuthFailed(EntityError, AuthenticationFailed, code=ErrorCode.AUTH_FAILED):
    """The token is unknown and the server requires one."""


class SourceConflict(EntityError, code=ErrorCode.SOURCE_CONFLICT):
    """The source id asked for is held by another live connection."""


class NoFreeSource(EntityError, code=ErrorCode.NO_FREE_SOURCE):
    """All 64 source slots of the tenant are taken."""


class ReadOnly(EntityError, code=ErrorCode.READ_ONLY):
    """A write (or CREATE_KIND, or an epoch) on a read-only connection."""


class KindNotFound(EntityError, _KindNotFound, code=ErrorCode.KIND_NOT_FOUND):
    """No kind of that id or name in the tenant."""


class SchemaConflict(EntityError, code=ErrorCode.SCHEMA_CONFLICT):
    """CREATE_KIND that changes an existing kind other than by appending fields."""


class SchemaIncompatible(EntityError, code=ErrorCode.SCHEMA_INCOMPATIBLE):
    """The declared fields are not a prefix of the kind's schema."""


class EntityNotFound(EntityError, _EntityNotFound, code=ErrorCode.ENTITY_NOT_FOUND):
    """The kind has no live entity of that id."""


class BadFieldData(EntityError, code=ErrorCode.BAD_FIELD_DATA):
    """A field's bytes do not decode as the kind's schema declares it."""


class LimitExceeded(EntityError, code=ErrorCode.LIMIT_EXCEEDED):
    """A request over one of the server's limits (a batch's size, a name's length)."""


class SubscriptionOverflow(EntityError, code=ErrorCode.SUBSCRIPTION_OVERFLOW):
    """The subscriber fell 4,096 notifications behind; the server closed the connection."""


class Internal(EntityError, InternalError, code=ErrorCode.INTERNAL):
    """The server failed while answering (retryable)."""


class ReservedName(EntityError, code=ErrorCode.RESERVED_NAME):
    """Kind names starting with ``convergedb_`` or ``hw_`` are the server's."""


class NoEpoch(EntityError, code=ErrorCode.NO_EPOCH):
    """SOURCE_EPOCH_END without an open epoch (e.g. the connection was lost inside it)."""


def error_for(code: int, ref_opcode: int, message: str) -> EntityError:
    """The exception for an ERROR frame (unknown codes: a plain EntityError)."""
    cls = ERRORS_BY_CODE.get(code)
    if cls is None:
        error = EntityError(f"error code {code}: {message}", ref_opcode)
        error.wire_code = code
        return error
    return cls(message or cls.name, ref_opcode)
