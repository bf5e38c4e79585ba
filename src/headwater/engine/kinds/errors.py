"""Errors of the entity-kind engine.

Each class names the ConvergeDB ERROR code a front end answers with (``cdb_code``) and,
through :class:`~headwater.errors.HeadwaterError`, a Kimberlite code for the others.
"""

from __future__ import annotations

from typing import ClassVar

from headwater.errors import HeadwaterError, InvalidRequest
from headwater.protocols.convergedb.codes import ErrorCode


class KindsError(InvalidRequest):
    """A request the kind engine refuses; nothing was applied."""

    cdb_code: ClassVar[ErrorCode] = ErrorCode.INTERNAL


class KindNotFound(KindsError):
    cdb_code = ErrorCode.KIND_NOT_FOUND


class SchemaConflict(KindsError):
    cdb_code = ErrorCode.SCHEMA_CONFLICT


class SchemaIncompatible(KindsError):
    cdb_code = ErrorCode.SCHEMA_INCOMPATIBLE


class EntityNotFound(KindsError):
    cdb_code = ErrorCode.ENTITY_NOT_FOUND


class BadFieldData(KindsError):
    cdb_code = ErrorCode.BAD_FIELD_DATA


class KindLimitExceeded(KindsError):
    cdb_code = ErrorCode.LIMIT_EXCEEDED


class ReservedName(KindsError):
    cdb_code = ErrorCode.RESERVED_NAME


class BadName(KindsError):
    cdb_code = ErrorCode.BAD_FRAME


class SourceConflict(KindsError):
    cdb_code = ErrorCode.SOURCE_CONFLICT


class NoFreeSource(KindsError):
    cdb_code = ErrorCode.NO_FREE_SOURCE


class ReadOnlySource(KindsError):
    cdb_code = ErrorCode.READ_ONLY


class NoEpoch(KindsError):
    cdb_code = ErrorCode.NO_EPOCH


class SubscriptionOverflow(KindsError):
    """A live subscriber fell 4,096 notifications behind; the subscription is over."""

    cdb_code = ErrorCode.SUBSCRIPTION_OVERFLOW


def cdb_code_for(exc: BaseException) -> ErrorCode:
    """The ConvergeDB ERROR code for any exception the engine raised."""
    if isinstance(exc, KindsError):
        return exc.cdb_code
    if isinstance(exc, HeadwaterError) and isinstance(exc, InvalidRequest):
        return ErrorCode.BAD_FRAME
    return ErrorCode.INTERNAL
