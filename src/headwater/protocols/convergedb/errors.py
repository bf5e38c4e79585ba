"""The kind engine's errors as ConvergeDB ERROR codes."""

from __future__ import annotations

from headwater.engine.kinds.errors import ErrorKind, error_kind_of

from .codes import ErrorCode

ERROR_CODES: dict[ErrorKind, ErrorCode] = {
    ErrorKind.INTERNAL: ErrorCode.INTERNAL,
    ErrorKind.BAD_REQUEST: ErrorCode.BAD_FRAME,
    ErrorKind.KIND_NOT_FOUND: ErrorCode.KIND_NOT_FOUND,
    ErrorKind.SCHEMA_CONFLICT: ErrorCode.SCHEMA_CONFLICT,
    ErrorKind.SCHEMA_INCOMPATIBLE: ErrorCode.SCHEMA_INCOMPATIBLE,
    ErrorKind.ENTITY_NOT_FOUND: ErrorCode.ENTITY_NOT_FOUND,
    ErrorKind.BAD_FIELD_DATA: ErrorCode.BAD_FIELD_DATA,
    ErrorKind.LIMIT_EXCEEDED: ErrorCode.LIMIT_EXCEEDED,
    ErrorKind.RESERVED_NAME: ErrorCode.RESERVED_NAME,
    ErrorKind.SOURCE_CONFLICT: ErrorCode.SOURCE_CONFLICT,
    ErrorKind.NO_FREE_SOURCE: ErrorCode.NO_FREE_SOURCE,
    ErrorKind.READ_ONLY: ErrorCode.READ_ONLY,
    ErrorKind.NO_EPOCH: ErrorCode.NO_EPOCH,
    ErrorKind.SUBSCRIPTION_OVERFLOW: ErrorCode.SUBSCRIPTION_OVERFLOW,
}
"""Every engine error kind has its ERROR code."""


def error_code_for(exc: BaseException) -> ErrorCode:
    """The ERROR code a server answers with for any exception the engine raised."""
    return ERROR_CODES[error_kind_of(exc)]
