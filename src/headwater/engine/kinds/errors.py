"""Errors of the entity-kind engine.

Each class names what went wrong as an :class:`ErrorKind` (``error_kind``), which every
front end maps to its own wire error (ConvergeDB to its ERROR codes); through
:class:`~headwater.errors.HeadwaterError` each also has a Kimberlite code.
"""

from __future__ import annotations

from enum import Enum
from typing import ClassVar

from headwater.errors import InvalidRequest


class ErrorKind(Enum):
    """Why the kind engine refused a request."""

    INTERNAL = "internal"
    BAD_REQUEST = "bad_request"  # e.g. a name that breaks the naming rules
    KIND_NOT_FOUND = "kind_not_found"
    SCHEMA_CONFLICT = "schema_conflict"
    SCHEMA_INCOMPATIBLE = "schema_incompatible"
    ENTITY_NOT_FOUND = "entity_not_found"
    BAD_FIELD_DATA = "bad_field_data"
    LIMIT_EXCEEDED = "limit_exceeded"
    RESERVED_NAME = "reserved_name"
    SOURCE_CONFLICT = "source_conflict"
    NO_FREE_SOURCE = "no_free_source"
    READ_ONLY = "read_only"
    NO_EPOCH = "no_epoch"
    SUBSCRIPTION_OVERFLOW = "subscription_overflow"


class KindsError(InvalidRequest):
    """A request the kind engine refuses; nothing was applied."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.INTERNAL


class KindNotFound(KindsError):
    error_kind = ErrorKind.KIND_NOT_FOUND


class SchemaConflict(KindsError):
    error_kind = ErrorKind.SCHEMA_CONFLICT


class SchemaIncompatible(KindsError):
    error_kind = ErrorKind.SCHEMA_INCOMPATIBLE


class EntityNotFound(KindsError):
    error_kind = ErrorKind.ENTITY_NOT_FOUND


class BadFieldData(KindsError):
    """Values or a record that do not fit the kind's schema."""

    error_kind = ErrorKind.BAD_FIELD_DATA


class KindLimitExceeded(KindsError):
    error_kind = ErrorKind.LIMIT_EXCEEDED


class ReservedName(KindsError):
    error_kind = ErrorKind.RESERVED_NAME


class BadName(KindsError):
    error_kind = ErrorKind.BAD_REQUEST


class SourceConflict(KindsError):
    error_kind = ErrorKind.SOURCE_CONFLICT


class NoFreeSource(KindsError):
    error_kind = ErrorKind.NO_FREE_SOURCE


class ReadOnlySource(KindsError):
    error_kind = ErrorKind.READ_ONLY


class NoEpoch(KindsError):
    error_kind = ErrorKind.NO_EPOCH


class SubscriptionOverflow(KindsError):
    """A live subscriber fell 4,096 notifications behind; the subscription is over."""

    error_kind = ErrorKind.SUBSCRIPTION_OVERFLOW


def error_kind_of(exc: BaseException) -> ErrorKind:
    """What went wrong, for any exception the engine raised: a :class:`KindsError`'s own
    kind, BAD_REQUEST for any other refused request, INTERNAL for the rest."""
    if isinstance(exc, KindsError):
        return exc.error_kind
    if isinstance(exc, InvalidRequest):
        return ErrorKind.BAD_REQUEST
    return ErrorKind.INTERNAL
