"""Rivven payloads: ``rivven.proto``'s Request and Response, decoded and checked.

The typed values are the generated message classes themselves (:mod:`.rivven_pb2`,
imported as ``pb``): one class per message of the schema, so there is one description of
every field, the ``.proto``. This module adds what the schema cannot say:

- decoding that refuses what Rivven refuses (:func:`decode_request`): undecodable bytes,
  a Request with no operation, names over 256 bytes, lists over 10,000 entries, SCRAM
  and password payloads over 64 KiB, a publish without its record, a producer epoch past
  u16, an isolation level other than 0 or 1; each as :class:`DecodeError`, answered with
  an ErrorResponse while the connection stays open;
- the error answers (:class:`ErrorCode`, :func:`error_response`, :func:`error_code_for`);
- the one postcard value headwater speaks, Rivven's ``Response::Error`` (variant 18),
  so a postcard-only Rust client learns why it is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError as ProtobufDecodeError
from google.protobuf.message import Message

from headwater.engine.kinds.reader import Buffer
from headwater.errors import (
    AppendTooLarge,
    AuthenticationFailed,
    BatchTooLarge,
    HeadwaterError,
    InvalidOffset,
    InvalidRequest,
    NotEnoughReplicas,
    NotLeader,
    ProtocolError,
    RateLimited,
    ReplicationTimedOut,
    StreamAlreadyExists,
    StreamNotFound,
    UsageError,
)

from . import rivven_pb2 as pb

PROTOCOL_VERSION = 2
"""The version a Handshake must carry (Rivven's ``PROTOCOL_VERSION``)."""
MAX_NAME_LEN = 256
"""Longest topic, group, transaction, user or mechanism name, in UTF-8 bytes."""
MAX_LIST_LEN = 10_000
"""Most entries of any repeated or map field of a request."""
MAX_AUTH_PAYLOAD = 64 * 1024
"""Longest password or SCRAM message."""

POSTCARD_ERROR_VARIANT = 18
"""``Response::Error``'s position in Rivven's postcard ``Response`` enum."""


class ErrorCode(IntEnum):
    """``ErrorResponse.code``: the schema's ErrorCode values."""

    UNSPECIFIED = pb.ERROR_CODE_UNSPECIFIED
    UNKNOWN = pb.ERROR_CODE_UNKNOWN
    INVALID_REQUEST = pb.ERROR_CODE_INVALID_REQUEST
    TOPIC_NOT_FOUND = pb.ERROR_CODE_TOPIC_NOT_FOUND
    PARTITION_NOT_FOUND = pb.ERROR_CODE_PARTITION_NOT_FOUND
    OFFSET_OUT_OF_RANGE = pb.ERROR_CODE_OFFSET_OUT_OF_RANGE
    NOT_LEADER = pb.ERROR_CODE_NOT_LEADER
    BROKER_NOT_AVAILABLE = pb.ERROR_CODE_BROKER_NOT_AVAILABLE
    REPLICA_NOT_AVAILABLE = pb.ERROR_CODE_REPLICA_NOT_AVAILABLE
    MESSAGE_TOO_LARGE = pb.ERROR_CODE_MESSAGE_TOO_LARGE
    INVALID_TOPIC = pb.ERROR_CODE_INVALID_TOPIC
    INVALID_PARTITION = pb.ERROR_CODE_INVALID_PARTITION
    UNAUTHORIZED = pb.ERROR_CODE_UNAUTHORIZED
    TIMEOUT = pb.ERROR_CODE_TIMEOUT
    QUOTA_EXCEEDED = pb.ERROR_CODE_QUOTA_EXCEEDED


class DecodeError(ProtocolError):
    """A payload that is not a valid message (the frame around it was fine): answer
    with an ErrorResponse of ``code`` and keep the connection."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


# ---- requests -----------------------------------------------------------------------

_NAME_FIELDS = frozenset(
    {
        "topic",
        "topics",
        "name",
        "prefix",
        "consumer_group",
        "group_id",
        "txn_id",
        "username",
        "mechanism",
        "client_id",
        "entity_type",
        "entity_name",
        "quota_key",
        "member_id",
        "instance_id",
        "assignors",
    }
)
"""String fields held to :data:`MAX_NAME_LEN` wherever they occur in a request."""
_AUTH_FIELDS = frozenset({"password", "client_first"})
_SCRAM_MESSAGES = frozenset({"scram_client_first", "scram_client_final"})
_WITH_RECORD = frozenset({"publish", "idempotent_publish", "transactional_publish"})
_U16_MAX = 0xFFFF

_REQUEST_ONEOF = pb.Request.DESCRIPTOR.oneofs_by_name["request_type"]
_RESPONSE_ONEOF = pb.Response.DESCRIPTOR.oneofs_by_name["response_type"]
REQUEST_OPERATIONS: tuple[str, ...] = tuple(field.name for field in _REQUEST_ONEOF.fields)
"""Every operation a Request can carry (the names of ``request_type``'s members)."""
RESPONSE_KINDS: tuple[str, ...] = tuple(field.name for field in _RESPONSE_ONEOF.fields)
_REQUEST_FIELD_BY_TYPE = {
    f.message_type.full_name: f.name for f in _REQUEST_ONEOF.fields if f.message_type is not None
}
_RESPONSE_FIELD_BY_TYPE = {
    f.message_type.full_name: f.name for f in _RESPONSE_ONEOF.fields if f.message_type is not None
}


def _parse(message: Message, payload: Buffer) -> None:
    try:
        message.ParseFromString(bytes(payload))
    except ProtobufDecodeError as exc:
        raise DecodeError(f"payload is not a {message.DESCRIPTOR.name}: {exc}") from None


def decode_request(payload: Buffer) -> pb.Request:
    """A protobuf Request payload, checked (see the module); raises :class:`DecodeError`."""
    request = pb.Request()
    _parse(request, payload)
    operation = request.WhichOneof("request_type")
    if operation is None:
        raise DecodeError("the request carries no operation (request_type unset or unknown)")
    body: Message = getattr(request, operation)
    _check_sizes(body, operation)
    _check_operation(operation, body)
    return request


def _check_sizes(message: Message, path: str) -> None:
    """Every name, list and credential in ``message`` within its limit."""
    for field, value in message.ListFields():
        where = f"{path}.{field.name}"
        if field.is_repeated:
            if len(value) > MAX_LIST_LEN:
                raise DecodeError(f"{where} has {len(value)} entries (at most {MAX_LIST_LEN})")
            if field.type == FieldDescriptor.TYPE_MESSAGE and not _is_map(field):
                for item in value:
                    _check_sizes(item, where)
            elif field.name in _NAME_FIELDS:
                for item in value:
                    _check_length(item, where, MAX_NAME_LEN)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            _check_sizes(value, where)
        elif field.name in _NAME_FIELDS:
            _check_length(value, where, MAX_NAME_LEN)
        elif field.name in _AUTH_FIELDS or (field.name == "message" and path in _SCRAM_MESSAGES):
            _check_length(value, where, MAX_AUTH_PAYLOAD)


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _check_length(value: str | bytes, where: str, limit: int) -> None:
    size = len(value.encode()) if isinstance(value, str) else len(value)
    if size > limit:
        raise DecodeError(f"{where} is {size} bytes (at most {limit})")


def _check_operation(operation: str, body: Any) -> None:
    """What Rivven refuses after decoding, beyond sizes."""
    if operation in _WITH_RECORD and not body.HasField("record"):
        raise DecodeError(f"{operation} carries no record")
    if hasattr(body, "producer_epoch") and body.producer_epoch > _U16_MAX:
        raise DecodeError(f"{operation}.producer_epoch {body.producer_epoch} exceeds {_U16_MAX}")
    if operation == "consume" and body.isolation_level > 1:
        raise DecodeError(
            f"consume.isolation_level {body.isolation_level} is neither 0 (read uncommitted)"
            " nor 1 (read committed)"
        )
    if operation == "authenticate" and body.WhichOneof("mechanism") is None:
        raise DecodeError("authenticate names no mechanism")


_Envelope = TypeVar("_Envelope", pb.Request, pb.Response)


def _carrying(envelope: _Envelope, field_by_type: dict[str, str], body: Message) -> _Envelope:
    """``envelope`` (a Request or Response) with ``body`` in the oneof field of its type."""
    name = field_by_type.get(body.DESCRIPTOR.full_name)
    if name is None:
        what = "request operation" if isinstance(envelope, pb.Request) else "response"
        raise UsageError(f"{body.DESCRIPTOR.name} is not a {what}")
    getattr(envelope, name).CopyFrom(body)
    return envelope


def request_of(body: Message, *, header: pb.Header | None = None) -> pb.Request:
    """The Request carrying ``body`` (a PingRequest, a PublishRequest...)."""
    return _carrying(pb.Request(header=header), _REQUEST_FIELD_BY_TYPE, body)


def operation_of(request: pb.Request) -> tuple[str, Message]:
    """The operation's name and message of a decoded Request."""
    operation = request.WhichOneof("request_type")
    if operation is None:
        raise UsageError("the request carries no operation")
    body: Message = getattr(request, operation)
    return operation, body


# ---- responses ----------------------------------------------------------------------


def decode_response(payload: Buffer) -> pb.Response:
    """A protobuf Response payload; raises :class:`DecodeError` when undecodable or when
    it carries no answer."""
    response = pb.Response()
    _parse(response, payload)
    if response.WhichOneof("response_type") is None:
        raise DecodeError("the response carries no answer (response_type unset or unknown)")
    return response


def response_of(body: Message, *, header: pb.Header | None = None) -> pb.Response:
    """The Response carrying ``body`` (a PublishResponse, an ErrorResponse...)."""
    return _carrying(pb.Response(header=header), _RESPONSE_FIELD_BY_TYPE, body)


def error_response(code: int, message: str) -> pb.Response:
    """An ErrorResponse; the message starts with the code's name (``INVALID_REQUEST:
    ...``), the form Rivven's clients look for, since Rivven itself sends code 1 always."""
    try:
        name = ErrorCode(code).name
    except ValueError:  # a code this schema does not name
        name = ErrorCode.UNKNOWN.name
    return pb.Response(error=pb.ErrorResponse(code=code, message=f"{name}: {message}"))


def handshake_result(client_version: int) -> pb.Response:
    """The answer to a Handshake announcing ``client_version``."""
    compatible = client_version == PROTOCOL_VERSION
    message = (
        "OK"
        if compatible
        else f"Version mismatch: client={client_version}, server={PROTOCOL_VERSION}"
    )
    return pb.Response(
        handshake_result=pb.HandshakeResultResponse(
            server_version=PROTOCOL_VERSION, compatible=compatible, message=message
        )
    )


_ERROR_CODES: tuple[tuple[type[HeadwaterError], ErrorCode], ...] = (
    (StreamNotFound, ErrorCode.TOPIC_NOT_FOUND),
    (StreamAlreadyExists, ErrorCode.INVALID_TOPIC),
    (InvalidOffset, ErrorCode.OFFSET_OUT_OF_RANGE),
    (NotLeader, ErrorCode.NOT_LEADER),
    # acks=all in a cluster: confirmation timed out, or too few in-sync replicas.
    (ReplicationTimedOut, ErrorCode.TIMEOUT),
    (NotEnoughReplicas, ErrorCode.REPLICA_NOT_AVAILABLE),
    (RateLimited, ErrorCode.QUOTA_EXCEEDED),
    (AuthenticationFailed, ErrorCode.UNAUTHORIZED),
    # Over the 4 MiB an append takes, or a segment: as Kafka answers a record too large.
    (AppendTooLarge, ErrorCode.MESSAGE_TOO_LARGE),
    (BatchTooLarge, ErrorCode.MESSAGE_TOO_LARGE),
    (InvalidRequest, ErrorCode.INVALID_REQUEST),
)


def error_code_for(error: HeadwaterError) -> ErrorCode:
    """The ErrorCode a headwater error travels as (UNKNOWN where the schema has none)."""
    for error_class, code in _ERROR_CODES:
        if isinstance(error, error_class):
            return code
    return ErrorCode.UNKNOWN


# ---- records ------------------------------------------------------------------------


def make_record(
    value: bytes,
    *,
    key: bytes | None = None,
    headers: Iterable[tuple[str, bytes]] = (),
    timestamp_ms: int = 0,
) -> pb.Record:
    """A Record; ``key=None`` is no key, ``b""`` an empty one (``has_key`` tells them
    apart on the wire)."""
    return pb.Record(
        key=key or b"",
        has_key=key is not None,
        value=value,
        headers=[pb.RecordHeader(key=name, value=data) for name, data in headers],
        timestamp=timestamp_ms,
    )


def record_key(record: pb.Record | pb.ConsumedRecord) -> bytes | None:
    """The record's key, None when it has none."""
    return record.key if record.has_key else None


# ---- postcard -----------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, at: int, max_bytes: int) -> tuple[int, int]:
    value = 0
    for index in range(max_bytes):
        if at + index >= len(data):
            raise DecodeError("postcard varint runs past the payload")
        byte = data[at + index]
        value |= (byte & 0x7F) << (7 * index)
        if byte < 0x80:
            return value, at + index + 1
    raise DecodeError(f"postcard varint longer than {max_bytes} bytes")


def encode_postcard_error(message: str) -> bytes:
    """Rivven's postcard ``Response::Error { message }``: variant, length, UTF-8."""
    text = message.encode()
    return _varint(POSTCARD_ERROR_VARIANT) + _varint(len(text)) + text


def decode_postcard_error(payload: Buffer) -> str:
    """The message of a postcard ``Response::Error``; any other postcard value raises
    :class:`DecodeError` (headwater decodes no other)."""
    data = bytes(payload)
    variant, at = _read_varint(data, 0, 5)  # a u32 discriminant
    if variant != POSTCARD_ERROR_VARIANT:
        raise DecodeError(f"postcard Response variant {variant} is not Error")
    length, at = _read_varint(data, at, 10)  # a usize length
    if length != len(data) - at:
        raise DecodeError(f"postcard Error message of {length} bytes in {len(data) - at} remaining")
    try:
        return data[at:].decode()
    except UnicodeDecodeError:
        raise DecodeError("postcard Error message is not UTF-8") from None
