"""Kafka framing: ``int32 size | request header | request body``, and the same for
responses (``int32 size | response header | response body``).

The size counts the bytes after itself. A request header is v1 (api key, api version,
correlation id, client id as a legacy nullable string) for a version that is not
flexible and v2 (v1 plus tagged fields) for one that is; a response header is v0 (the
correlation id) or v1 (plus tagged fields), except ApiVersions, whose answer always has
header v0 so a client can read it whatever version it asked for. kio's classes carry
their header class (``__header_schema__``).

The decoder refuses a size below the 8 bytes of the header's fixed fields or above the
limit (Kafka's ``socket.request.max.bytes``, 100 MiB by default) as soon as its four
bytes are in, before any body byte is kept: Kafka closes such a connection, and so does
headwater.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kio.schema.request_header.v1.header import RequestHeader as RequestHeaderV1
from kio.schema.request_header.v2.header import RequestHeader as RequestHeaderV2
from kio.static.primitive import i16, i32
from kio.static.protocol import RequestPayload, ResponsePayload

from headwater.engine.kinds.reader import Buffer
from headwater.errors import ProtocolError, UsageError
from headwater.protocols._stream import LengthPrefixedDecoder

from .apis import request_type, response_type
from .schema import decode_entity, decode_exact, encode_entity

SIZE = struct.Struct(">i")
SIZE_BYTES = SIZE.size
FIXED_HEADER = struct.Struct(">hhi")  # api key, api version, correlation id
FIXED_HEADER_BYTES = FIXED_HEADER.size
MAX_REQUEST = 100 * 1024 * 1024
"""Largest request body (Kafka's default ``socket.request.max.bytes``: 104,857,600)."""


class FrameError(ProtocolError):
    """The bytes are not valid Kafka framing: the connection must close."""


class FrameSizeError(FrameError):
    def __init__(self, size: int, limit: int) -> None:
        if size < FIXED_HEADER_BYTES:
            message = f"request size {size} is below the {FIXED_HEADER_BYTES}-byte header"
        else:
            message = f"request of {size} bytes exceeds the {limit}-byte limit"
        super().__init__(message)
        self.size = size
        self.limit = limit


@dataclass(frozen=True, slots=True)
class FixedHeader:
    """The first three header fields, readable whatever the API and version."""

    api_key: int
    api_version: int
    correlation_id: int


def read_fixed_header(body: Buffer) -> FixedHeader:
    """The api key, version and correlation id at the head of a request ``body``."""
    api_key, api_version, correlation_id = FIXED_HEADER.unpack_from(body)
    return FixedHeader(api_key, api_version, correlation_id)


def decode_request_body(
    fixed: FixedHeader, body: Buffer
) -> tuple[RequestHeaderV1 | RequestHeaderV2, RequestPayload]:
    """The header and request of a frame ``body`` whose API version is supported.
    Raises :class:`~.schema.SchemaDecodeError` when the bytes do not decode.

    Bytes after the request are ignored, as Kafka's parser ignores them: librdkafka 2.16
    sends a Metadata v13 for every topic with 3 zero bytes after the message, and
    Kafka serves it."""
    payload_type = request_type(fixed.api_key, fixed.api_version)
    header_type = RequestHeaderV2 if payload_type.__flexible__ else RequestHeaderV1
    header: RequestHeaderV1 | RequestHeaderV2
    header, offset = decode_entity(header_type, body)
    request, _end = decode_entity(payload_type, memoryview(body)[offset:])
    return header, request


def encode_request(
    correlation_id: int, request: RequestPayload, client_id: str | None = "headwater"
) -> bytes:
    """One framed request (what a client sends)."""
    header_type = RequestHeaderV2 if request.__flexible__ else RequestHeaderV1
    header = header_type(
        request_api_key=i16(request.__api_key__),
        request_api_version=i16(request.__version__),
        correlation_id=i32(correlation_id),
        client_id=client_id,
    )
    return _framed(encode_entity(header) + encode_entity(request))


def encode_response(correlation_id: int, response: ResponsePayload) -> bytes:
    """One framed response with the header its API and version take."""
    header = response.__header_schema__(correlation_id=i32(correlation_id))
    return _framed(encode_entity(header) + encode_entity(response))


def decode_response(api_key: int, api_version: int, body: Buffer) -> tuple[int, ResponsePayload]:
    """(correlation id, response) of a response frame ``body`` (what a client reads)."""
    payload_type = response_type(api_key, api_version)
    header, offset = decode_entity(payload_type.__header_schema__, body)
    response = decode_exact(payload_type, memoryview(body)[offset:])
    return int(header.correlation_id), response


def _framed(message: bytes) -> bytes:
    if len(message) > 0x7FFF_FFFF:
        raise UsageError(f"a {len(message)}-byte message does not fit Kafka's int32 size")
    return SIZE.pack(len(message)) + message


class FrameDecoder(LengthPrefixedDecoder[FrameError]):
    """Incremental decoder of size-prefixed frames: :meth:`feed` bytes, then take frame
    bodies in order (``for body in decoder``). A bad size is raised once its four bytes
    are in, and again on every later call."""

    __slots__ = ()
    length_field = SIZE
    min_length = FIXED_HEADER_BYTES

    def __init__(self, max_request: int = MAX_REQUEST) -> None:
        super().__init__(max_request)

    def _length_error(self, length: int) -> FrameError:
        return FrameSizeError(length, self.max_payload)
