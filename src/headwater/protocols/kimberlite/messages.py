"""Kimberlite messages: every request and response payload, and their byte encoding.

Encoding (docs/protocols/kimberlite.md): little-endian fixed-width integers; bool is one
byte (0 or 1); String and Vec<T> are a u64 count then the items; Vec<u8> is raw bytes
after its u64 length; Option<T> is a u32 tag (0 None, 1 Some) then T; enums are a u32
discriminant then the variant's fields.

Decoders never trust a length: every count is checked against the bytes that remain
before anything is sliced, allocated or looped over, so a frame of at most 16 MiB costs
at most work proportional to its size. Anything malformed raises :class:`DecodeError`.
Encoders raise :class:`~headwater.errors.UsageError` for values the wire cannot carry
(an integer out of its field's range, an unencodable string).

Event batches (AppendEvents, AppendIdempotent, ReadEvents, SubscriptionEvents) travel as
``Vec<Vec<u8>>``: a u64 count then ``u64 len | bytes`` per event. That records section is
byte for byte the values section the storage layer keeps (``headwater.storage.batch``),
so :class:`EventBatch` carries it undecoded and the read/push encoders accept stored
sections as chunks without touching the events inside.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Annotated, ClassVar, Self, TypeAlias, TypeVar, get_args

from headwater.engine.kinds.reader import BoundedReader, as_view
from headwater.engine.kinds.reader import Buffer as Buffer
from headwater.errors import HeadwaterError, ProtocolError, UsageError, error_for_code
from headwater.protocols._layout import (
    I64,
    U16,
    U32,
    U64,
    Declared,
    Fixed,
    Variable,
    Wire,
    lenient,
    record,
)
from headwater.storage.batch import encode_values, value_spans

PROTOCOL_VERSION = 1
MAX_EVENTS = 10_000
"""Most events one AppendEvents / AppendIdempotent may carry."""
MAX_APPEND_BYTES = 4 * 1024 * 1024
"""Most event bytes (the sum of the event lengths) one append may carry."""
RESUME_GROUP_OFFSET = 2**64 - 1
"""Subscribe.from_offset meaning "resume from the consumer group's position"."""

RIPPLE_CAPABILITY = "ripple:"
"""Handshake capability prefix: ``ripple:<port>`` is the server's Ripple listener, on the
host the client reached (absent when that listener is off)."""
HTTP_CAPABILITY = "http:"
"""Handshake capability prefix: ``http:<port>`` is the server's HTTP API (bulk Arrow reads
of a stream), on the host the client reached (absent when that listener is off)."""


def advertised_port(capabilities: Sequence[str], prefix: str) -> int | None:
    """The port a Handshake advertises under ``prefix`` (e.g. ``ripple:``), or None.
    Unknown or malformed capabilities are ignored, as clients must."""
    for capability in capabilities:
        if capability.startswith(prefix):
            text = capability[len(prefix) :]
            if text.isdigit() and 0 < int(text) < 65536:
                return int(text)
    return None


def ripple_port(capabilities: Sequence[str]) -> int | None:
    """The Ripple port a Handshake advertises, or None."""
    return advertised_port(capabilities, RIPPLE_CAPABILITY)


def http_port(capabilities: Sequence[str]) -> int | None:
    """The HTTP API port a Handshake advertises, or None."""
    return advertised_port(capabilities, HTTP_CAPABILITY)


U64_MAX = 2**64 - 1

_E = TypeVar("_E", bound=IntEnum)
_T = TypeVar("_T")
_P = TypeVar("_P", bound="_Payload")

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_REQUEST_HEAD = struct.Struct("<QQI")  # id, tenant_id, discriminant
_RESPONSE_HEAD = struct.Struct("<QI")  # request_id, discriminant
_TAG_U64 = struct.Struct("<IQ")
_TAG_I64 = struct.Struct("<Iq")
_TAG_BOOL = struct.Struct("<IB")
_NONE = b"\x00\x00\x00\x00"  # Option None / QueryValue Null: a zero u32 tag
_SOME = b"\x01\x00\x00\x00"


class DecodeError(ProtocolError):
    """A frame's payload is not a well-formed Kimberlite message.

    The frame itself was intact (its CRC matched), so the connection can answer with an
    InvalidRequest error: ``request_id`` is the id read from the payload's first 8 bytes,
    or None when even that was missing.
    """

    def __init__(self, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id


class RequestLimitError(DecodeError):
    """A well-formed append outside the protocol's limits (no events, more than
    MAX_EVENTS events, more than MAX_APPEND_BYTES of event bytes): InvalidRequest."""


# --- enums ---------------------------------------------------------------------------


class DataClass(IntEnum):
    PHI = 0
    NON_PHI = 1
    DEIDENTIFIED = 2


class Placement(IntEnum):
    GLOBAL = 0
    REGIONAL = 1


class CloseReason(IntEnum):
    CLIENT_CANCELLED = 0
    SERVER_SHUTDOWN = 1
    STREAM_DELETED = 2
    BACKPRESSURE_TIMEOUT = 3
    PROTOCOL_ERROR = 4


class ErrorCode(IntEnum):
    """Kimberlite error codes; the same numbers as ``HeadwaterError.code``."""

    UNKNOWN = 0
    INTERNAL_ERROR = 1
    INVALID_REQUEST = 2
    AUTHENTICATION_FAILED = 3
    TENANT_NOT_FOUND = 4
    STREAM_NOT_FOUND = 5
    TABLE_NOT_FOUND = 6
    QUERY_PARSE_ERROR = 7
    QUERY_EXECUTION_ERROR = 8
    POSITION_AHEAD = 9
    STREAM_ALREADY_EXISTS = 10
    INVALID_OFFSET = 11
    STORAGE_ERROR = 12
    PROJECTION_LAG = 13
    RATE_LIMITED = 14
    NOT_LEADER = 15

    @property
    def retryable(self) -> bool:
        return self in _RETRYABLE


_RETRYABLE = frozenset(
    {
        ErrorCode.INTERNAL_ERROR,
        ErrorCode.STORAGE_ERROR,
        ErrorCode.PROJECTION_LAG,
        ErrorCode.RATE_LIMITED,
        ErrorCode.NOT_LEADER,
    }
)


# --- query values --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timestamp:
    """A Timestamp query value: nanoseconds since the Unix epoch (a bare int is BigInt)."""

    ns: int


QueryValue: TypeAlias = bool | int | str | Timestamp | None
"""Null -> None, BigInt -> int, Text -> str, Boolean -> bool, Timestamp -> Timestamp."""
QueryParam: TypeAlias = QueryValue
"""Parameters share the value encoding (discriminants 0..4)."""


# --- event batches -------------------------------------------------------------------


class EventBatch:
    """``count`` events encoded as the wire's records section: ``u64 len | bytes`` each.

    Decoders produce batches whose section is a memoryview into the frame's payload (no
    copy) and has been checked to hold exactly ``count`` records. Constructing one
    directly trusts the caller the same way; :meth:`of` builds one from plain values.
    """

    __slots__ = ("_bounds", "count", "section")
    __hash__ = None  # type: ignore[assignment]  # holds a buffer; compared by content

    def __init__(
        self, count: int, section: bytes | memoryview, bounds: list[int] | None = None
    ) -> None:
        self.count = count
        self.section = section
        self._bounds = bounds  # record boundaries, when a decoder already walked them

    def spans(self) -> list[int]:
        """``count + 1`` byte positions: record i is ``section[spans[i]:spans[i+1]]``
        (its 8-byte length, then its value)."""
        if self._bounds is None:
            self._bounds = value_spans(self.section, self.count)
        return self._bounds

    @classmethod
    def of(cls, events: Sequence[bytes]) -> EventBatch:
        return cls(len(events), encode_values(events))

    def values(self) -> list[bytes]:
        """The events as separate ``bytes`` objects (copies)."""
        section = self.section
        bounds = self.spans()
        return [bytes(section[bounds[i] + 8 : bounds[i + 1]]) for i in range(self.count)]

    @property
    def event_bytes(self) -> int:
        """Sum of the event lengths (what MAX_APPEND_BYTES limits)."""
        return len(self.section) - 8 * self.count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.values())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EventBatch):
            return NotImplemented
        return self.count == other.count and self.section == other.section

    def __repr__(self) -> str:
        return f"EventBatch(count={self.count}, section_bytes={len(self.section)})"


# --- reading -------------------------------------------------------------------------


class _Reader(BoundedReader):
    """The bounded reader with Kimberlite's compound types on top: String, Vec counts,
    Option tags, query values and event batches."""

    __slots__ = ()

    def string(self, what: str) -> str:
        return self.text(self.u64(f"{what} length"), what)

    def count(self, min_item_bytes: int, what: str) -> int:
        """A Vec's u64 count, refused when the items cannot fit in what remains."""
        return self.fits(self.u64(f"{what} count"), min_item_bytes, what)

    def option(self, what: str) -> bool:
        tag = self.u32(f"{what} option tag")
        if tag > 1:
            raise DecodeError(f"{what}: option tag {tag} is neither 0 nor 1")
        return tag == 1

    def events(self, what: str, trailers: Sequence[int] = (0,)) -> EventBatch:
        """A Vec<Vec<u8>> kept as its raw records section.

        value_spans wants the exact section, so the section's end is found from the size
        of the fields after it: ``trailers`` lists the possible sizes, likeliest first
        (a records section has one end, so at most one candidate can fit).
        """
        count = self.count(8, what)
        start = self.pos
        problem = "records do not fill their section"
        for trailer in trailers:
            end = self.end - trailer
            if end < start:
                continue
            section = self.buf[start:end]
            try:
                bounds = value_spans(section, count)
            except ValueError as exc:
                problem = str(exc)
                continue
            if bounds[-1] != len(section):  # the records must fill the section exactly
                continue
            self.pos = end
            return EventBatch(count, section, bounds)
        raise DecodeError(f"{what}: {problem}")

    def value(self, what: str) -> QueryValue:
        kind = self.u32(what)
        if kind == 0:
            return None
        if kind == 1:
            return self.i64(what)
        if kind == 2:
            return self.string(what)
        if kind == 3:
            byte = self.u8(what)
            if byte > 1:
                raise DecodeError(f"{what}: bool byte {byte} is neither 0 nor 1")
            return byte == 1
        if kind == 4:
            return Timestamp(self.i64(what))
        raise DecodeError(f"{what}: unknown discriminant {kind}")


# --- field wires ---------------------------------------------------------------------
#
# How each field type travels; a payload class declares its fields with these and
# _layout compiles its encoder and decoder (runs of fixed-width fields in one struct).


def _bool(byte: int, what: str) -> bool:
    if byte > 1:
        raise DecodeError(f"{what}: bool byte {byte} is neither 0 nor 1")
    return byte == 1


def _enum(enum: type[_E]) -> Fixed[_E]:
    """An enum as its u32 discriminant."""

    def load(r: BoundedReader, value: int, what: str, at: int) -> _E:
        try:
            return enum(value)
        except ValueError:
            raise DecodeError(f"{what}: unknown discriminant {value}") from None

    return Fixed("I", load=load)


def _put_string(out: list[Buffer], text: str, what: str = "") -> None:
    data = text.encode()
    out.append(_U64.pack(len(data)))
    out.append(data)


def _put_value(out: list[Buffer], value: QueryValue, what: str = "") -> None:
    # bool before int: bool is an int subclass.
    if value is None:
        out.append(_NONE)
    elif isinstance(value, bool):
        out.append(_TAG_BOOL.pack(3, value))
    elif isinstance(value, int):
        out.append(_TAG_I64.pack(1, value))
    elif isinstance(value, str):
        data = value.encode()
        out.append(_TAG_U64.pack(2, len(data)))
        out.append(data)
    elif isinstance(value, Timestamp):
        out.append(_TAG_I64.pack(4, value.ns))
    else:
        raise UsageError(f"{type(value).__name__} is not a Kimberlite query value")


def _put_events(out: list[Buffer], events: EventBatch, what: str = "") -> None:
    out.append(_U64.pack(events.count))
    out.append(events.section)


def _put_option_u64(out: list[Buffer], value: int | None) -> None:
    out.append(_NONE if value is None else _TAG_U64.pack(1, value))


def _option(wire: Wire[_T]) -> Wire[_T | None]:
    """Option<T>: a u32 tag (0 None, 1 Some) then T."""

    def read(r: _Reader, what: str) -> _T | None:
        return wire.read(r, what) if r.option(what) else None

    def write(out: list[Buffer], value: _T | None, what: str) -> None:
        if value is None:
            out.append(_NONE)
        else:
            out.append(_SOME)
            wire.write(out, value, what)

    return Variable(read, write)


def _vec(wire: Wire[_T], min_item_bytes: int, item: str = "") -> Wire[Sequence[_T]]:
    """Vec<T>: a u64 count, checked against the bytes left, then the items (read under
    the label ``item`` when given, else the field's)."""

    def read(r: _Reader, what: str) -> list[_T]:
        label = item or what
        return [wire.read(r, label) for _ in range(r.count(min_item_bytes, what))]

    def write(out: list[Buffer], values: Sequence[_T], what: str) -> None:
        out.append(_U64.pack(len(values)))
        for value in values:
            wire.write(out, value, what)

    return Variable(read, write)


def _events(*trailers: int) -> Wire[EventBatch]:
    """Vec<Vec<u8>> kept as its records section (see :meth:`_Reader.events`)."""
    if trailers == (0,):  # the records end the payload (the appends: no wrapper)
        return Variable(_Reader.events, _put_events)
    return Variable(lambda r, what: r.events(what, trailers), _put_events)


def _read_bytes(r: _Reader, what: str) -> bytes:
    return r.take(r.u64(f"{what} length"), what)


def _put_bytes(out: list[Buffer], data: bytes, what: str = "") -> None:
    out.append(_U64.pack(len(data)))
    out.append(data)


def _read_header(r: _Reader, what: str) -> tuple[str, bytes]:
    return r.string(f"{what} name"), _read_bytes(r, f"{what} value")


def _put_header(out: list[Buffer], header: tuple[str, bytes], what: str = "") -> None:
    _put_string(out, header[0])
    _put_bytes(out, header[1])


_STRING: Wire[str] = Variable(_Reader.string, _put_string)
_BYTES: Wire[bytes] = Variable(_read_bytes, _put_bytes)
_VALUES = _vec(Variable(_Reader.value, _put_value), 4)

Bool: TypeAlias = Annotated[bool, Fixed("B", load=lambda r, byte, what, at: _bool(byte, what))]
Str: TypeAlias = Annotated[str, _STRING]
OptStr: TypeAlias = Annotated[str | None, _option(_STRING)]
OptU64: TypeAlias = Annotated[int | None, _option(Fixed[int]("Q"))]
Strs: TypeAlias = Annotated[Sequence[str], _vec(_STRING, 8)]
Values: TypeAlias = Annotated[Sequence[QueryValue], _VALUES]
Rows: TypeAlias = Annotated[Sequence[Sequence[QueryValue]], _vec(_VALUES, 8, "row")]
Events: TypeAlias = Annotated[EventBatch, _events(0)]
Header: TypeAlias = tuple[str, bytes]
"""An event header: its name (UTF-8) and value (bytes)."""
Keys: TypeAlias = Annotated[Sequence[bytes | None], _vec(_option(_BYTES), 4, "key")]
Headers: TypeAlias = Annotated[
    Sequence[Sequence[Header]], _vec(_vec(Variable(_read_header, _put_header), 16), 8, "headers")
]


# --- payloads ------------------------------------------------------------------------
#
# Each payload class knows its discriminant; its fields, in wire order, say how they
# travel (field types above), which gives its _write and _read.


class _Payload(Declared):
    __slots__ = ()
    discriminant: ClassVar[int]


@dataclass(frozen=True, slots=True)
class HandshakeRequest(_Payload):
    discriminant: ClassVar[int] = 0
    client_version: U16 = PROTOCOL_VERSION
    auth_token: OptStr = None


@dataclass(frozen=True, slots=True)
class CreateStreamRequest(_Payload):
    discriminant: ClassVar[int] = 1
    name: Str
    data_class: Annotated[DataClass, _enum(DataClass)] = DataClass.NON_PHI
    placement: Annotated[Placement, _enum(Placement)] = Placement.GLOBAL


@dataclass(frozen=True, slots=True)
class AppendEventsRequest(_Payload):
    discriminant: ClassVar[int] = 2
    stream_id: U64
    events: Events


@dataclass(frozen=True, slots=True)
class QueryRequest(_Payload):
    discriminant: ClassVar[int] = 3
    sql: Str
    params: Values = ()


@dataclass(frozen=True, slots=True)
class QueryAtRequest(_Payload):
    discriminant: ClassVar[int] = 4
    sql: Str
    params: Values
    position: U64


@dataclass(frozen=True, slots=True)
class ReadEventsRequest(_Payload):
    discriminant: ClassVar[int] = 5
    stream_id: U64
    from_offset: U64
    max_bytes: U64


@dataclass(frozen=True, slots=True)
class SubscribeRequest(_Payload):
    discriminant: ClassVar[int] = 6
    stream_id: U64
    from_offset: U64
    initial_credits: U32
    consumer_group: OptStr = None


@dataclass(frozen=True, slots=True)
class SyncRequest(_Payload):
    discriminant: ClassVar[int] = 7


@dataclass(frozen=True, slots=True)
class SubscribeCreditRequest(_Payload):
    discriminant: ClassVar[int] = 8
    subscription_id: U64
    additional_credits: U32


@dataclass(frozen=True, slots=True)
class UnsubscribeRequest(_Payload):
    discriminant: ClassVar[int] = 9
    subscription_id: U64


@dataclass(frozen=True, slots=True)
class AppendIdempotentRequest(_Payload):
    discriminant: ClassVar[int] = 10
    stream_id: U64
    producer_id: U64
    sequence: U64
    events: Events


@dataclass(frozen=True, slots=True)
class DeleteStreamRequest(_Payload):
    discriminant: ClassVar[int] = 11
    stream_id: U64


@dataclass(frozen=True, slots=True)
class ListStreamsRequest(_Payload):
    discriminant: ClassVar[int] = 12


@dataclass(frozen=True, slots=True)
class AppendRecordsRequest(_Payload):
    """headwater's addition (capability "records"): AppendEvents with a key and headers
    per event. ``keys`` and ``headers`` are each empty (none) or one entry per event; the
    events come last so their section ends the payload, as in AppendEvents. Answered by
    AppendEvents (3)."""

    discriminant: ClassVar[int] = 13
    stream_id: U64
    keys: Keys
    headers: Headers
    events: Events


RequestPayload: TypeAlias = (
    HandshakeRequest
    | CreateStreamRequest
    | AppendEventsRequest
    | QueryRequest
    | QueryAtRequest
    | ReadEventsRequest
    | SubscribeRequest
    | SyncRequest
    | SubscribeCreditRequest
    | UnsubscribeRequest
    | AppendIdempotentRequest
    | DeleteStreamRequest
    | ListStreamsRequest
    | AppendRecordsRequest
)

REQUEST_TYPES: tuple[type[RequestPayload], ...] = get_args(RequestPayload)
"""Request payload classes, indexed by discriminant."""


@dataclass(frozen=True, slots=True)
class ErrorResponse(_Payload):
    discriminant: ClassVar[int] = 0
    code: Annotated[int, Fixed("H", load=lenient(ErrorCode))]
    """An :class:`ErrorCode` when known; codes from 16 up (reserved) stay plain ints."""
    message: Str

    @classmethod
    def from_exception(cls, exc: HeadwaterError) -> Self:
        return cls(exc.code, exc.message)

    def to_exception(self) -> HeadwaterError:
        """The headwater exception for this error (unknown codes become UnknownError)."""
        return error_for_code(self.code, self.message)


@dataclass(frozen=True, slots=True)
class HandshakeResponse(_Payload):
    discriminant: ClassVar[int] = 1
    server_version: U16
    authenticated: Bool
    capabilities: Strs


@dataclass(frozen=True, slots=True)
class CreateStreamResponse(_Payload):
    discriminant: ClassVar[int] = 2
    stream_id: U64


@dataclass(frozen=True, slots=True)
class AppendEventsResponse(_Payload):
    discriminant: ClassVar[int] = 3
    first_offset: U64
    count: U32


@dataclass(frozen=True, slots=True)
class QueryResponse(_Payload):
    discriminant: ClassVar[int] = 4
    columns: Strs
    rows: Rows


@dataclass(frozen=True, slots=True)
class QueryAtResponse(_Payload):
    """Same body as :class:`QueryResponse`, its own discriminant."""

    discriminant: ClassVar[int] = 5
    columns: Strs
    rows: Rows


@dataclass(frozen=True, slots=True)
class ReadEventsResponse(_Payload):
    discriminant: ClassVar[int] = 6
    events: Events
    next_offset: OptU64

    @classmethod
    def _read(cls, r: BoundedReader) -> Self:
        assert isinstance(r, _Reader)
        # next_offset is a u32 tag (None) or a tag and a u64 (Some): 4 or 12 bytes.
        some_tag = r.end - 12 >= r.pos and r.buf[r.end - 12 : r.end - 8] == _SOME
        events = r.events("events", (12, 4) if some_tag else (4, 12))
        return cls(events, r.u64("next_offset") if r.option("next_offset") else None)


@dataclass(frozen=True, slots=True)
class SubscribeResponse(_Payload):
    discriminant: ClassVar[int] = 7
    subscription_id: U64
    start_offset: U64
    credits: U32


@dataclass(frozen=True, slots=True)
class SyncResponse(_Payload):
    discriminant: ClassVar[int] = 8
    success: Bool


@dataclass(frozen=True, slots=True)
class SubscriptionEventsResponse(_Payload):
    """Pushed while credits remain; its request_id is the Subscribe's."""

    discriminant: ClassVar[int] = 9
    subscription_id: U64
    start_offset: U64
    events: Annotated[EventBatch, _events(4)]  # then credits_remaining: u32
    credits_remaining: U32


@dataclass(frozen=True, slots=True)
class SubscriptionClosedResponse(_Payload):
    discriminant: ClassVar[int] = 10
    subscription_id: U64
    reason: Annotated[CloseReason, _enum(CloseReason)]


@dataclass(frozen=True, slots=True)
class SubscriptionCreditResponse(_Payload):
    discriminant: ClassVar[int] = 11
    subscription_id: U64
    credits: U32
    """The subscription's credit balance after the grant."""


@dataclass(frozen=True, slots=True)
class StreamDeletedResponse(_Payload):
    discriminant: ClassVar[int] = 12
    stream_id: U64


@dataclass(frozen=True, slots=True)
class StreamInfo(Declared):
    stream_id: U64
    name: Str
    next_offset: U64
    size_bytes: U64
    created_ns: I64

    # u64 stream_id, String name (u64 length at least), u64, u64, i64
    MIN_BYTES: ClassVar[int] = 40


@dataclass(frozen=True, slots=True)
class StreamsResponse(_Payload):
    discriminant: ClassVar[int] = 13
    streams: Annotated[Sequence[StreamInfo], _vec(record(StreamInfo), StreamInfo.MIN_BYTES)]


ResponsePayload: TypeAlias = (
    ErrorResponse
    | HandshakeResponse
    | CreateStreamResponse
    | AppendEventsResponse
    | QueryResponse
    | QueryAtResponse
    | ReadEventsResponse
    | SubscribeResponse
    | SyncResponse
    | SubscriptionEventsResponse
    | SubscriptionClosedResponse
    | SubscriptionCreditResponse
    | StreamDeletedResponse
    | StreamsResponse
)

RESPONSE_TYPES: tuple[type[ResponsePayload], ...] = get_args(ResponsePayload)
"""Response payload classes, indexed by discriminant."""


# --- envelopes -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    id: int
    tenant_id: int
    payload: RequestPayload


@dataclass(frozen=True, slots=True)
class Response:
    request_id: int
    payload: ResponsePayload


def _encoding_guard(what: str, exc: Exception) -> UsageError:
    return UsageError(f"cannot encode {what}: {exc}")


def encode_body(payload: RequestPayload | ResponsePayload) -> bytes:
    """A payload's fields alone: no envelope, no discriminant (as the seed's examples)."""
    out: list[Buffer] = []
    try:
        payload._write(out)
    except (struct.error, UnicodeEncodeError, OverflowError) as exc:
        raise _encoding_guard(type(payload).__name__, exc) from None
    return b"".join(out)


def encode_request_chunks(request: Request) -> list[Buffer]:
    """The request's payload bytes as chunks; event sections are passed through uncopied."""
    payload = request.payload
    try:
        out: list[Buffer] = [
            _REQUEST_HEAD.pack(request.id, request.tenant_id, payload.discriminant)
        ]
        payload._write(out)
    except (struct.error, UnicodeEncodeError, OverflowError) as exc:
        raise _encoding_guard(f"request {request.id} ({type(payload).__name__})", exc) from None
    return out


def encode_request(request: Request) -> bytes:
    return b"".join(encode_request_chunks(request))


def encode_response_chunks(response: Response) -> list[Buffer]:
    """The response's payload bytes as chunks; event sections are passed through uncopied."""
    payload = response.payload
    try:
        out: list[Buffer] = [_RESPONSE_HEAD.pack(response.request_id, payload.discriminant)]
        payload._write(out)
    except (struct.error, UnicodeEncodeError, OverflowError) as exc:
        what = f"response to {response.request_id} ({type(payload).__name__})"
        raise _encoding_guard(what, exc) from None
    return out


def encode_response(response: Response) -> bytes:
    return b"".join(encode_response_chunks(response))


def encode_read_events_response(
    request_id: int, count: int, chunks: Iterable[Buffer], next_offset: int | None
) -> list[Buffer]:
    """A ReadEvents response payload built from already-encoded records.

    ``chunks`` must hold exactly ``count`` ``u64 len | bytes`` records between them (for
    example stored values sections or slices of them); they are not re-checked or copied.
    """
    try:
        out: list[Buffer] = [_RESPONSE_HEAD.pack(request_id, 6), _U64.pack(count)]
        out.extend(chunks)
        _put_option_u64(out, next_offset)
    except struct.error as exc:
        raise _encoding_guard("ReadEventsResponse", exc) from None
    return out


def encode_subscription_events(
    request_id: int,
    subscription_id: int,
    start_offset: int,
    count: int,
    chunks: Iterable[Buffer],
    credits_remaining: int,
) -> list[Buffer]:
    """A SubscriptionEvents push payload built from already-encoded records (see
    :func:`encode_read_events_response` for what ``chunks`` must hold)."""
    try:
        head = struct.pack("<QIQQQ", request_id, 9, subscription_id, start_offset, count)
        out: list[Buffer] = [head]
        out.extend(chunks)
        out.append(_U32.pack(credits_remaining))
    except struct.error as exc:
        raise _encoding_guard("SubscriptionEventsResponse", exc) from None
    return out


def _decode_body(types: tuple[type[_P], ...], side: str, discriminant: int, body: Buffer) -> _P:
    if not 0 <= discriminant < len(types):
        raise DecodeError(f"unknown {side} discriminant {discriminant}")
    reader = _Reader(as_view(body), DecodeError)
    cls = types[discriminant]
    payload = cls._read(reader)
    reader.finish(cls.__name__)
    return payload


def decode_request_body(discriminant: int, body: Buffer) -> RequestPayload:
    """Decode a request payload's fields alone (the inverse of :func:`encode_body`)."""
    return _decode_body(REQUEST_TYPES, "request", discriminant, body)


def decode_response_body(discriminant: int, body: Buffer) -> ResponsePayload:
    """Decode a response payload's fields alone (the inverse of :func:`encode_body`)."""
    return _decode_body(RESPONSE_TYPES, "response", discriminant, body)


def decode_request(payload: Buffer, *, enforce_limits: bool = True) -> Request:
    """Decode one frame payload as a Request.

    Decoded event batches are views into ``payload`` (keep it alive and unchanged). With
    ``enforce_limits`` an append outside 1..MAX_EVENTS events or over MAX_APPEND_BYTES
    raises :class:`RequestLimitError`; the event count is checked before the events are
    walked, so an oversized batch costs nothing to refuse.
    """
    reader = _Reader(as_view(payload), DecodeError)
    request_id: int | None = None
    try:
        request_id = reader.u64("request id")
        tenant_id = reader.u64("tenant_id")
        discriminant = reader.u32("request discriminant")
        if discriminant >= len(REQUEST_TYPES):
            raise DecodeError(f"unknown request discriminant {discriminant}")
        cls = REQUEST_TYPES[discriminant]
        if enforce_limits and cls in _APPEND_TYPES:
            _check_append_count(reader, 24 if cls is AppendIdempotentRequest else 8)
        body = cls._read(reader)
        reader.finish(cls.__name__)
        if enforce_limits and isinstance(
            body, AppendEventsRequest | AppendIdempotentRequest | AppendRecordsRequest
        ):
            check_append_limits(body.events)
        if isinstance(body, AppendRecordsRequest):
            check_record_columns(body)
    except DecodeError as exc:
        exc.request_id = request_id
        raise
    return Request(request_id, tenant_id, body)


_APPEND_TYPES = (AppendEventsRequest, AppendIdempotentRequest)


def _check_append_count(reader: _Reader, fields_before_events: int) -> None:
    """Refuse an append's event count before value_spans walks that many events."""
    at = reader.pos + fields_before_events
    if at + 8 <= reader.end:
        count: int = _U64.unpack_from(reader.buf, at)[0]
        if count > MAX_EVENTS:
            raise RequestLimitError(f"{count} events in one append; the limit is {MAX_EVENTS}")


def check_append_limits(events: EventBatch) -> None:
    """Raise :class:`RequestLimitError` unless 1..MAX_EVENTS events of at most
    MAX_APPEND_BYTES event bytes in all."""
    if events.count == 0:
        raise RequestLimitError("an append needs at least one event")
    if events.count > MAX_EVENTS:
        raise RequestLimitError(f"{events.count} events in one append; the limit is {MAX_EVENTS}")
    if events.event_bytes > MAX_APPEND_BYTES:
        raise RequestLimitError(
            f"{events.event_bytes} event bytes in one append; the limit is {MAX_APPEND_BYTES}"
        )


def check_record_columns(body: AppendRecordsRequest) -> None:
    """Raise :class:`RequestLimitError` unless ``keys`` and ``headers`` are each empty or
    one entry per event."""
    for name, column in (("keys", body.keys), ("headers", body.headers)):
        if column and len(column) != body.events.count:
            raise RequestLimitError(
                f"AppendRecords: {len(column)} {name} for {body.events.count} events "
                "(none, or one per event)"
            )


def decode_response(payload: Buffer) -> Response:
    """Decode one frame payload as a Response (event batches are views into it)."""
    reader = _Reader(as_view(payload), DecodeError)
    request_id = reader.u64("request id")
    discriminant = reader.u32("response discriminant")
    if discriminant >= len(RESPONSE_TYPES):
        raise DecodeError(f"unknown response discriminant {discriminant}", request_id)
    cls = RESPONSE_TYPES[discriminant]
    try:
        body = cls._read(reader)
        reader.finish(cls.__name__)
    except DecodeError as exc:
        exc.request_id = request_id
        raise
    return Response(request_id, body)


def error_response(request_id: int, code: int, message: str) -> Response:
    return Response(request_id, ErrorResponse(code, message))
