"""One exception root for headwater.

Every engine failure a client can see is a :class:`HeadwaterError` subclass whose
``code`` is the Kimberlite error code (spec/PROTOCOLS.md §1); the other front ends map
these codes onto their own wire errors. The SDKs' own failures (the server cannot be
reached, the connection broke, no answer in time) are ``ClientError`` subclasses under
the same root, with code 0 (:mod:`headwater.client.errors`). Two further families stay
off the wire and outside the root: :class:`ProtocolError` (the peer misbehaved: bad
bytes) and :class:`UsageError` (the API was misused by our own caller).

Every error's ``name`` is one :class:`ErrorName`: the same name in the SDKs' exceptions,
the CLI's ``headwater: error: <name>: ...`` line and the HTTP error JSON, whatever wire
the error came over (docs/errors.md lists them all, with each protocol's code). The
ConvergeDB wire's own upper-case names (``KIND_NOT_FOUND``) stay readable as aliases.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import ClassVar


class ErrorName(StrEnum):
    """The one set of error names (docs/errors.md).

    The first sixteen are the Kimberlite error codes 0..15 (spec/PROTOCOLS.md §1);
    ``KindNotFound`` and ``EntityNotFound`` refine TableNotFound (code 6: a kind is a
    table, an entity its row); the ConvergeDB-only ones are that wire's errors without a
    Kimberlite counterpart; the last are the SDKs' own failures (never on a wire)."""

    # Kimberlite codes 0..15
    UNKNOWN = "Unknown"
    INTERNAL_ERROR = "InternalError"
    INVALID_REQUEST = "InvalidRequest"
    AUTHENTICATION_FAILED = "AuthenticationFailed"
    TENANT_NOT_FOUND = "TenantNotFound"
    STREAM_NOT_FOUND = "StreamNotFound"
    TABLE_NOT_FOUND = "TableNotFound"
    QUERY_PARSE_ERROR = "QueryParseError"
    QUERY_EXECUTION_ERROR = "QueryExecutionError"
    POSITION_AHEAD = "PositionAhead"
    STREAM_ALREADY_EXISTS = "StreamAlreadyExists"
    INVALID_OFFSET = "InvalidOffset"
    STORAGE_ERROR = "StorageError"
    PROJECTION_LAG = "ProjectionLag"
    RATE_LIMITED = "RateLimited"
    NOT_LEADER = "NotLeader"
    # TableNotFound, more precisely
    KIND_NOT_FOUND = "KindNotFound"
    ENTITY_NOT_FOUND = "EntityNotFound"
    # ConvergeDB only
    BAD_FRAME = "BadFrame"
    UNSUPPORTED_VERSION = "UnsupportedVersion"
    NOT_CONNECTED = "NotConnected"
    SOURCE_CONFLICT = "SourceConflict"
    NO_FREE_SOURCE = "NoFreeSource"
    READ_ONLY = "ReadOnly"
    SCHEMA_CONFLICT = "SchemaConflict"
    SCHEMA_INCOMPATIBLE = "SchemaIncompatible"
    BAD_FIELD_DATA = "BadFieldData"
    LIMIT_EXCEEDED = "LimitExceeded"
    SUBSCRIPTION_OVERFLOW = "SubscriptionOverflow"
    RESERVED_NAME = "ReservedName"
    NO_EPOCH = "NoEpoch"
    # InvalidRequest, more precisely: idempotent producers and transactions
    OUT_OF_ORDER_SEQUENCE = "OutOfOrderSequence"
    PRODUCER_FENCED = "ProducerFenced"
    INVALID_TXN_STATE = "InvalidTxnState"
    # the SDKs' own (headwater.client.errors)
    CLIENT_ERROR = "ClientError"
    SERVER_UNAVAILABLE = "ServerUnavailable"
    CONNECTION_LOST = "ConnectionLost"
    REQUEST_TIMEOUT = "RequestTimeout"
    EVENT_TOO_LARGE = "EventTooLarge"
    SUBSCRIPTION_CLOSED = "SubscriptionClosed"
    CLIENT_CLOSED = "ClientClosed"

    @classmethod
    def parse(cls, text: str) -> ErrorName | None:
        """The name ``text`` means: one of ours, or a ConvergeDB wire name
        (``KIND_NOT_FOUND``, ``AUTH_FAILED``, ``INTERNAL`` ...); None when neither."""
        try:
            return cls(text)
        except ValueError:
            return CONVERGEDB_ALIASES.get(text)


CONVERGEDB_ALIASES: dict[str, ErrorName] = {
    # ConvergeDB's ERROR code names (spec/PROTOCOLS.md §2) -> ours. The entities SDK
    # called its errors by these before the names were made one (kept as ``wire_name``).
    "BAD_FRAME": ErrorName.BAD_FRAME,
    "UNSUPPORTED_VERSION": ErrorName.UNSUPPORTED_VERSION,
    "NOT_CONNECTED": ErrorName.NOT_CONNECTED,
    "AUTH_FAILED": ErrorName.AUTHENTICATION_FAILED,
    "SOURCE_CONFLICT": ErrorName.SOURCE_CONFLICT,
    "NO_FREE_SOURCE": ErrorName.NO_FREE_SOURCE,
    "READ_ONLY": ErrorName.READ_ONLY,
    "KIND_NOT_FOUND": ErrorName.KIND_NOT_FOUND,
    "SCHEMA_CONFLICT": ErrorName.SCHEMA_CONFLICT,
    "SCHEMA_INCOMPATIBLE": ErrorName.SCHEMA_INCOMPATIBLE,
    "ENTITY_NOT_FOUND": ErrorName.ENTITY_NOT_FOUND,
    "BAD_FIELD_DATA": ErrorName.BAD_FIELD_DATA,
    "LIMIT_EXCEEDED": ErrorName.LIMIT_EXCEEDED,
    "SUBSCRIPTION_OVERFLOW": ErrorName.SUBSCRIPTION_OVERFLOW,
    "INTERNAL": ErrorName.INTERNAL_ERROR,
    "RESERVED_NAME": ErrorName.RESERVED_NAME,
    "NO_EPOCH": ErrorName.NO_EPOCH,
}


class HeadwaterError(Exception):
    """Root of every error headwater raises on purpose."""

    code: ClassVar[int] = 0
    name: ClassVar[ErrorName] = ErrorName.UNKNOWN
    retryable: ClassVar[bool] = False

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.name)
        self.message = message or self.name


class UnknownError(HeadwaterError):
    code, name = 0, ErrorName.UNKNOWN


class InternalError(HeadwaterError):
    code, name, retryable = 1, ErrorName.INTERNAL_ERROR, True


class InvalidRequest(HeadwaterError):
    code, name = 2, ErrorName.INVALID_REQUEST


class AuthenticationFailed(HeadwaterError):
    code, name = 3, ErrorName.AUTHENTICATION_FAILED


class TenantForbidden(AuthenticationFailed):
    """A known token that does not grant the tenant asked for (HTTP answers 403)."""


class TenantNotFound(HeadwaterError):
    code, name = 4, ErrorName.TENANT_NOT_FOUND


class StreamNotFound(HeadwaterError):
    code, name = 5, ErrorName.STREAM_NOT_FOUND


class StreamQuotaExceeded(InvalidRequest):
    """A tenant already has ``[limits] max_streams_per_tenant`` streams: a create is
    refused until one is deleted. InvalidRequest on the wire (not retryable: waiting does
    not lift it); the front ends count it as that limit's refusal."""

    limit: ClassVar[str] = "max_streams_per_tenant"


class AppendTooLarge(InvalidRequest):
    """An append carrying more than MAX_APPEND_BYTES (4 MiB) of events. InvalidRequest
    on the wire; the Kafka and Rivven front ends answer MESSAGE_TOO_LARGE, as Kafka does
    for a record over its limit."""


class BatchTooLarge(InvalidRequest):
    """An append whose stored batch would not fit one segment of its stream
    (``segment_bytes``): a batch never spans segments. InvalidRequest on the wire;
    Kafka's front end answers RECORD_LIST_TOO_LARGE, as Kafka does."""


class TableNotFound(HeadwaterError):
    code, name = 6, ErrorName.TABLE_NOT_FOUND


class QueryParseError(HeadwaterError):
    code, name = 7, ErrorName.QUERY_PARSE_ERROR


class QueryExecutionError(HeadwaterError):
    code, name = 8, ErrorName.QUERY_EXECUTION_ERROR


class PositionAhead(HeadwaterError):
    code, name = 9, ErrorName.POSITION_AHEAD


class StreamAlreadyExists(HeadwaterError):
    code, name = 10, ErrorName.STREAM_ALREADY_EXISTS


class InvalidOffset(HeadwaterError):
    code, name = 11, ErrorName.INVALID_OFFSET


class OffsetRemoved(InvalidOffset):
    """Retention removed the offset a read started at: the log starts at ``start``."""

    def __init__(self, offset: int, start: int, where: str = "the log") -> None:
        super().__init__(f"offset {offset} was removed by retention; {where} starts at {start}")
        self.offset = offset
        self.start = start


class StorageError(HeadwaterError):
    code, name, retryable = 12, ErrorName.STORAGE_ERROR, True


class CorruptBatchError(StorageError):
    """A stored batch failed its CRC or structure check; it is never served."""


class NotEnoughReplicas(StorageError):
    """An acknowledged append in a cluster refused before anything was stored: fewer
    in-sync replicas than min_insync_replicas (Kafka: NOT_ENOUGH_REPLICAS); retryable.
    ``reason`` is Kafka's name for it, which every front end shows (docs/cluster.md)."""

    reason: ClassVar[str] = "NOT_ENOUGH_REPLICAS"


class NotEnoughReplicasAfterAppend(NotEnoughReplicas):
    """Stored at the leader, then the ISR fell below min_insync_replicas before the
    in-sync replicas confirmed it (Kafka: NOT_ENOUGH_REPLICAS_AFTER_APPEND): a plain
    retry may store it twice (an idempotent one is recognised)."""

    reason = "NOT_ENOUGH_REPLICAS_AFTER_APPEND"

    def __init__(self, message: str = "") -> None:
        # Said first, whatever the cause: the only way most wires tell it from the
        # refusal before the write (the same code), and a plain retry stores it twice.
        super().__init__(f"stored on the leader, unconfirmed: {message}")


class ReplicationTimedOut(NotEnoughReplicas):
    """Stored at the leader, not confirmed by the in-sync replicas in time (Kafka:
    REQUEST_TIMED_OUT): as after NotEnoughReplicasAfterAppend, a plain retry may store
    it twice."""

    reason = "REQUEST_TIMED_OUT"

    def __init__(self, message: str = "") -> None:
        super().__init__(f"stored on the leader, unconfirmed: {message}")


class ProjectionLag(HeadwaterError):
    code, name, retryable = 13, ErrorName.PROJECTION_LAG, True


class RateLimited(HeadwaterError):
    code, name, retryable = 14, ErrorName.RATE_LIMITED, True


class NotLeader(HeadwaterError):
    """This node does not lead the partition. ``leader``: the leader's node id and each
    of its listeners' ``host:port`` by name (``kafka``, ``http`` ...) when one is known,
    for front ends that can carry it beside the message (HTTP's JSON body)."""

    code, name, retryable = 15, ErrorName.NOT_LEADER, True

    def __init__(self, message: str = "", leader: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.leader = leader

    def address_of(self, listener: str) -> str | None:
        """The leader's ``host:port`` for ``listener`` (``rivven``, ``kimberlite`` ...):
        from ``leader``, else from the message, which names each listener as
        ``<name> <host>:<port>`` (Kimberlite's wire has no other place for it)."""
        if self.leader is not None:
            address = self.leader.get(listener)
            return address if isinstance(address, str) else None
        found = re.search(rf"\b{re.escape(listener)} (\S+:\d+)", self.message)
        return None if found is None else found.group(1).rstrip(",")


class KindNotFound(TableNotFound):
    """No entity kind of that name (code 6 on Kimberlite and HTTP: a kind is a table)."""

    name = ErrorName.KIND_NOT_FOUND


class EntityNotFound(TableNotFound):
    """The kind has no live entity of that id (code 6: a missing row)."""

    name = ErrorName.ENTITY_NOT_FOUND


class OutOfOrderSequence(InvalidRequest):
    """An idempotent producer's sequence skips ahead of (or falls behind the remembered
    window of) what the partition has stored: a batch between was lost. Nothing of it is
    stored; the producer must start over with a new producer id or epoch."""

    name = ErrorName.OUT_OF_ORDER_SEQUENCE


class ProducerFenced(InvalidRequest):
    """The producer's epoch is older than the one the server knows for its producer id:
    a newer instance (same transactional id) took over, or its transaction was aborted
    on timeout. The zombie's write is refused; it must stop."""

    name = ErrorName.PRODUCER_FENCED


class InvalidTxnState(InvalidRequest):
    """A transactional operation that does not fit the transaction's state: an unknown
    transactional id or producer, a commit of a transaction already ending, an append of
    a producer that has no transactional id."""

    name = ErrorName.INVALID_TXN_STATE


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


# The classes a name alone picks beyond the codes' own: TableNotFound's and
# InvalidRequest's refinements.
_NAMED: list[type[HeadwaterError]] = [
    *ERRORS_BY_CODE.values(),
    KindNotFound,
    EntityNotFound,
    OutOfOrderSequence,
    ProducerFenced,
    InvalidTxnState,
]
ERRORS_BY_NAME: dict[str, type[HeadwaterError]] = {cls.name: cls for cls in _NAMED}


def error_for_code(code: int, message: str, name: str | None = None) -> HeadwaterError:
    """The exception a client raises for a wire error code (unknown codes -> Unknown);
    ``name`` (the HTTP error JSON carries one) picks a finer class of the same code."""
    by_name = ERRORS_BY_NAME.get(name) if name is not None else None
    if by_name is not None and by_name.code == code:
        return by_name(message)
    return ERRORS_BY_CODE.get(code, UnknownError)(message)


class ProtocolError(Exception):
    """The peer sent bytes that break the protocol; the connection cannot be trusted."""


class UsageError(Exception):
    """Our own caller misused an API (a programming error, never the peer's fault)."""
