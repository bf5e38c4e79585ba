"""One exception root for headwater.

Every engine failure a client can see is a :class:`HeadwaterError` subclass whose
``code`` is the Kimberlite error code (spec/PROTOCOLS.md §1); the other front ends map
these codes onto their own wire errors. The SDKs' own failures (the server cannot be
reached, the connection broke, no answer in time) are ``ClientError`` subclasses under
the same root, with code 0 (:mod:`headwater.client.errors`). Two further families stay
off the wire and outside the root: :class:`ProtocolError` (the peer misbehaved: bad
bytes) and :class:`UsageError` (the API was misused by our own caller).
"""

from __future__ import annotations

from typing import ClassVar


class HeadwaterError(Exception):
    """Root of every error headwater raises on purpose."""

    code: ClassVar[int] = 0
    name: ClassVar[str] = "Unknown"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.name)
        self.message = message or self.name


class UnknownError(HeadwaterError):
    code, name = 0, "Unknown"


class InternalError(HeadwaterError):
    code, name, retryable = 1, "InternalError", True


class InvalidRequest(HeadwaterError):
    code, name = 2, "InvalidRequest"


class AuthenticationFailed(HeadwaterError):
    code, name = 3, "AuthenticationFailed"


class TenantForbidden(AuthenticationFailed):
    """A known token that does not grant the tenant asked for (HTTP answers 403)."""


class TenantNotFound(HeadwaterError):
    code, name = 4, "TenantNotFound"


class StreamNotFound(HeadwaterError):
    code, name = 5, "StreamNotFound"


class StreamQuotaExceeded(InvalidRequest):
    """A tenant already has ``[limits] max_streams_per_tenant`` streams: a create is
    refused until one is deleted. InvalidRequest on the wire (not retryable: waiting does
    not lift it); the front ends count it as that limit's refusal."""

    limit: ClassVar[str] = "max_streams_per_tenant"


class TableNotFound(HeadwaterError):
    code, name = 6, "TableNotFound"


class QueryParseError(HeadwaterError):
    code, name = 7, "QueryParseError"


class QueryExecutionError(HeadwaterError):
    code, name = 8, "QueryExecutionError"


class PositionAhead(HeadwaterError):
    code, name = 9, "PositionAhead"


class StreamAlreadyExists(HeadwaterError):
    code, name = 10, "StreamAlreadyExists"


class InvalidOffset(HeadwaterError):
    code, name = 11, "InvalidOffset"


class StorageError(HeadwaterError):
    code, name, retryable = 12, "StorageError", True


class CorruptBatchError(StorageError):
    """A stored batch failed its CRC or structure check; it is never served."""


class ProjectionLag(HeadwaterError):
    code, name, retryable = 13, "ProjectionLag", True


class RateLimited(HeadwaterError):
    code, name, retryable = 14, "RateLimited", True


class NotLeader(HeadwaterError):
    code, name, retryable = 15, "NotLeader", True


ERRORS_BY_CODE: dict[int, type[HeadwaterError]] = {
    cls.code: cls
    for cls in (
        UnknownError,
        InternalError,
        InvalidRequest,
        AuthenticationFailed,
        TenantNotFound,
        StreamNotFound,
        TableNotFound,
        QueryParseError,
        QueryExecutionError,
        PositionAhead,
        StreamAlreadyExists,
        InvalidOffset,
        StorageError,
        ProjectionLag,
        RateLimited,
        NotLeader,
    )
}


def error_for_code(code: int, message: str) -> HeadwaterError:
    """The exception a client raises for a wire error code (unknown codes -> Unknown)."""
    return ERRORS_BY_CODE.get(code, UnknownError)(message)


class ProtocolError(Exception):
    """The peer sent bytes that break the protocol; the connection cannot be trusted."""


class UsageError(Exception):
    """Our own caller misused an API (a programming error, never the peer's fault)."""
