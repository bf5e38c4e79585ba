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

import io
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kio.schema.request_header.v1.header import RequestHeader as RequestHeaderV1
from kio.schema.request_header.v2.header import RequestHeader as RequestHeaderV2
from kio.serial.writers import write_unsigned_varint
from kio.static.primitive import i16, i32, uvarint
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
LONG_FRAME = 64 * 1024  # from this size a frame's chunks are kept apart, joined once


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
    return b"".join(encode_response_chunks(correlation_id, response))


PLACEHOLDER_BYTES = 16
"""The size of a placeholder for :func:`encode_response_chunks`."""


def encode_response_chunks(
    correlation_id: int,
    response: ResponsePayload,
    spliced: Mapping[bytes, Sequence[Buffer]] | None = None,
) -> list[Buffer]:
    """:func:`encode_response`'s frame as buffers to write in order. A bytes field of
    ``response`` (a Fetch answer's records) may hold a placeholder: a key of
    ``spliced``, :data:`PLACEHOLDER_BYTES` bytes found nowhere else in the message
    (random ones). The frame then has the buffers the key maps to in that field's
    place, with their length, and they are not copied: a Fetch answer's megabytes of
    stored batches were copied four times to make one frame. UsageError when a
    placeholder is not in the message once, as the value of a bytes field."""
    header = response.__header_schema__(correlation_id=i32(correlation_id))
    message = encode_entity(header) + encode_entity(response)
    if not spliced:
        return [_framed(message)]
    flexible = response.__flexible__
    held = _bytes_length(PLACEHOLDER_BYTES, flexible)  # a placeholder's own length field
    chunks: list[Buffer] = [b""]  # the frame's size goes first, once it is known
    size = len(message)
    at = 0
    for pos, token in sorted((message.find(token), token) for token in spliced):
        start = pos - len(held)
        if (
            len(token) != PLACEHOLDER_BYTES
            or start < at
            or message[start:pos] != held
            or message.find(token, pos + 1) >= 0
        ):
            raise UsageError("a placeholder must stand once in the answer, as a bytes value")
        buffers = spliced[token]
        length = sum(memoryview(b).nbytes for b in buffers)
        prefix = _bytes_length(length, flexible)
        chunks += (message[at:start], prefix, *buffers)
        size += len(prefix) + length - len(held) - PLACEHOLDER_BYTES
        at = pos + PLACEHOLDER_BYTES
    chunks.append(message[at:])
    chunks[0] = _size(size)
    return chunks


def _bytes_length(length: int, flexible: bool) -> bytes:
    """The length field of a bytes value: compact (an unsigned varint of length + 1) in
    a flexible version, int32 before."""
    if not flexible:
        return _size(length)
    out = io.BytesIO()
    write_unsigned_varint(out, uvarint(length + 1))
    return out.getvalue()


def decode_response(api_key: int, api_version: int, body: Buffer) -> tuple[int, ResponsePayload]:
    """(correlation id, response) of a response frame ``body`` (what a client reads)."""
    payload_type = response_type(api_key, api_version)
    header, offset = decode_entity(payload_type.__header_schema__, body)
    response = decode_exact(payload_type, memoryview(body)[offset:])
    return int(header.correlation_id), response


def _framed(message: bytes) -> bytes:
    return _size(len(message)) + message


def _size(size: int) -> bytes:
    if size > 0x7FFF_FFFF:
        raise UsageError(f"a {size}-byte message does not fit Kafka's int32 size")
    return SIZE.pack(size)


class FrameDecoder(LengthPrefixedDecoder[FrameError]):
    """Incremental decoder of size-prefixed frames: :meth:`feed` bytes, then take frame
    bodies in order (``for body in decoder``). A bad size is raised once its four bytes
    are in, and again on every later call."""

    __slots__ = ("_held", "_parts")
    length_field = SIZE
    min_length = FIXED_HEADER_BYTES

    def __init__(self, max_request: int = MAX_REQUEST) -> None:
        super().__init__(max_request)
        # A long frame's bytes as they come (the first part holds its size), joined once
        # when whole: appended to one buffer and then copied out, a 1 MB Produce was
        # copied twice, into memory freshly mapped each time (server/memory.py).
        self._parts: list[Buffer] = []
        self._held = 0

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer) + self._held

    @property
    def at_boundary(self) -> bool:
        return not self._buffer and not self._parts

    def discard(self) -> None:
        super().discard()
        self._parts, self._held = [], 0

    def feed(self, data: Buffer) -> None:
        if self._error is not None:
            return
        if self._parts:
            # Kept as it came when the caller cannot change it (bytes, as asyncio gives).
            self._parts.append(data if isinstance(data, bytes) else bytes(data))
            self._held += len(data)
            return
        super().feed(data)
        if self._length >= LONG_FRAME and len(self._buffer) < self.head_size + self._length:
            self._parts, self._held = [self._buffer], len(self._buffer)
            self._buffer = bytearray()

    def next_item(self) -> bytes | None:
        if self._parts and self._error is None:
            return self._joined()
        return super().next_item()

    def _joined(self) -> bytes | None:
        """The long frame's body once all of it is in, copied out of its parts once;
        what came after it is kept as the buffer's start."""
        length = self._length
        if self._held < self.head_size + length:
            return None
        views: list[memoryview] = []
        need = length
        rest: memoryview | None = None
        for index, part in enumerate(self._parts):
            view = memoryview(part)[self.head_size :] if index == 0 else memoryview(part)
            if view.nbytes >= need:
                views.append(view[:need])
                rest = view[need:]
                break
            views.append(view)
            need -= view.nbytes
        body = b"".join(views)
        later = self._parts[index + 1 :]
        self._parts, self._held = [], 0
        self._buffer = bytearray(rest if rest is not None else b"")
        for part in later:
            self._buffer += part
        self._length = -1
        return body

    def _fail(self, error: FrameError) -> FrameError:
        self._parts, self._held = [], 0
        return super()._fail(error)

    def _length_error(self, length: int) -> FrameError:
        return FrameSizeError(length, self.max_payload)
