"""Sans-I/O Rivven connections: bytes in, events out; responses in, bytes out.

:class:`ServerConnection` turns received bytes into :class:`RequestFrame` events for the
engine and answers on its own everything the protocol answers without it: the version
Handshake, frames in Rivven's postcard format, frames too short to read, payloads that
do not decode or break a limit (each an error answer, the connection stays open: the
length prefixes still delimit the stream) and an oversized frame (an error answer, then
close). :class:`ClientConnection` numbers and frames requests and matches answers to them
by correlation id, so requests may be pipelined. Neither does any I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import Message

from headwater.engine.kinds.reader import Buffer
from headwater.errors import ProtocolError, UsageError
from headwater.protocols import _connection
from headwater.protocols._connection import Close as Close

from . import messages as m
from . import rivven_pb2 as pb
from .frames import (
    MAX_CORRELATION_ID,
    MAX_FRAME,
    FrameDecoder,
    FrameTooLargeError,
    ShortFrameError,
    WireFormat,
    encode_frame,
    parse_frame,
)

POSTCARD_REFUSAL = (
    "headwater speaks Rivven's protobuf format (0x01) only; postcard (0x00) is not accepted"
)


@dataclass(frozen=True, slots=True)
class RequestFrame:
    """A decoded, checked request for the engine to answer with ``correlation_id``."""

    correlation_id: int
    request: pb.Request

    @property
    def operation(self) -> str:
        """The name of the request's operation (``"publish"``, ``"consume"``...)."""
        operation = self.request.WhichOneof("request_type")
        assert operation is not None  # decode_request refuses a Request without one
        return operation


@dataclass(frozen=True, slots=True)
class ResponseFrame:
    """An answer the client received. ``correlation_id`` 0 with an error answers no
    request in particular: the server refused something it could not attribute (a
    frame it could not read)."""

    correlation_id: int
    response: pb.Response
    wire_format: WireFormat

    @property
    def kind(self) -> str:
        kind = self.response.WhichOneof("response_type")
        assert kind is not None  # decode_response refuses a Response without one
        return kind


class _Answered:
    """Reply's and Reject's ``answer`` under the name a ResponseFrame gives it, ``response``."""

    __slots__ = ()
    answer: pb.Response

    @property
    def response(self) -> pb.Response:
        return self.answer


class Reply(_Answered, _connection.Reply[pb.Response]):
    """An answer the connection produced itself; send ``data`` and carry on."""

    __slots__ = ()


class Reject(_Answered, _connection.Reject[pb.Response]):
    """Send ``data`` (the connection's last answer), then close."""

    __slots__ = ()


ServerEvent = RequestFrame | Reply | Reject | Close


def _with_header(response: pb.Response, correlation_id: int) -> pb.Response:
    response.header.version = m.PROTOCOL_VERSION
    response.header.correlation_id = correlation_id
    return response


class ServerConnection(_connection.ServerConnection[bytes, ServerEvent]):
    """The server's view of one Rivven connection.

    :meth:`receive_data` returns, in arrival order, the :class:`RequestFrame` events the
    engine must answer (through :meth:`send`, with the same correlation id, in any
    order) and the :class:`Reply` / :class:`Reject` / :class:`Close` events the
    connection decided itself. The Handshake is optional, as in Rivven; one announcing
    another version than :data:`~.messages.PROTOCOL_VERSION` is answered
    ``compatible=false`` and the connection closes.
    """

    __slots__ = ("client_id", "handshake_received", "max_frame")

    def __init__(self, *, max_frame: int = MAX_FRAME) -> None:
        super().__init__(FrameDecoder(max_frame))
        self.max_frame = max_frame
        self.handshake_received = False
        self.client_id = ""

    def _on_broken(self, exc: ProtocolError) -> ServerEvent:
        if isinstance(exc, FrameTooLargeError):
            response = _with_header(m.error_response(m.ErrorCode.MESSAGE_TOO_LARGE, str(exc)), 0)
            return Reject(response, self._frame(0, response), str(exc))
        return Close(str(exc))  # the decoder raises nothing else; a Close is the safe end

    def _on_item(self, body: bytes) -> ServerEvent:
        try:
            frame = parse_frame(body)
        except ShortFrameError as exc:
            return self._error(0, m.ErrorCode.INVALID_REQUEST, str(exc))
        correlation_id = frame.correlation_id
        if frame.format == WireFormat.POSTCARD:
            # Answered in postcard, the one format such a client reads.
            response = m.error_response(m.ErrorCode.INVALID_REQUEST, POSTCARD_REFUSAL)
            text = response.error.message
            data = encode_frame(WireFormat.POSTCARD, correlation_id, m.encode_postcard_error(text))
            return Reply(_with_header(response, correlation_id), data)
        if frame.format != WireFormat.PROTOBUF:
            return self._error(
                correlation_id,
                m.ErrorCode.INVALID_REQUEST,
                f"unknown wire format 0x{frame.format:02x} (0x01 is protobuf)",
            )
        try:
            request = m.decode_request(frame.payload)
        except m.DecodeError as exc:
            return self._error(correlation_id, exc.code, exc.message)
        if request.WhichOneof("request_type") == "handshake":
            return self._handshake(correlation_id, request.handshake)
        return RequestFrame(correlation_id, request)

    def _handshake(self, correlation_id: int, handshake: pb.HandshakeRequest) -> ServerEvent:
        self.handshake_received = True
        self.client_id = handshake.client_id
        response = _with_header(m.handshake_result(handshake.protocol_version), correlation_id)
        data = self._frame(correlation_id, response)
        if response.handshake_result.compatible:
            return Reply(response, data)
        self._closed = True
        return Reject(response, data, response.handshake_result.message)

    def _error(self, correlation_id: int, code: int, message: str) -> Reply:
        response = _with_header(m.error_response(code, message), correlation_id)
        return Reply(response, self._frame(correlation_id, response))

    def _frame(self, correlation_id: int, response: pb.Response, *, own: bool = True) -> bytes:
        """``response`` framed. The connection's own answers (``own``: errors and the
        handshake, a few hundred bytes by construction) go out even under a tiny
        ``max_frame``; the engine's are held to it."""
        return encode_frame(
            WireFormat.PROTOBUF,
            correlation_id,
            response.SerializeToString(deterministic=True),
            max_frame=max(self.max_frame, MAX_FRAME) if own else self.max_frame,
        )

    def send(self, correlation_id: int, response: pb.Response | Message) -> bytes:
        """One framed answer (a Response, or its member message such as a
        PublishResponse) to the request ``correlation_id``, its Header filled in. Raises
        :class:`~.frames.FrameTooLarge` past the frame limit: answer with a smaller
        response (fewer records) or :meth:`send_error`.

        A Response without a Header is not copied: the Header's bytes go in front of
        its own (protobuf merges concatenated messages, and field 1 first is the
        canonical order), so a large Consume answer built in place is serialised once.
        Serialised deterministically (map entries in key order), as every frame of the
        connection is: protobuf leaves map order to the implementation, and the same
        answer should give the same bytes.
        """
        if not isinstance(response, pb.Response):
            response = m.response_of(response)
        elif response.WhichOneof("response_type") is None:
            raise UsageError("the response carries no answer")
        header = pb.Header(version=m.PROTOCOL_VERSION, correlation_id=correlation_id)
        if response.HasField("header"):
            copy = pb.Response()
            copy.CopyFrom(response)
            copy.header.CopyFrom(header)
            payload = copy.SerializeToString(deterministic=True)
        else:
            payload = pb.Response(header=header).SerializeToString()
            payload += response.SerializeToString(deterministic=True)
        return encode_frame(WireFormat.PROTOBUF, correlation_id, payload, max_frame=self.max_frame)

    def send_error(
        self,
        correlation_id: int,
        code: int,
        message: str,
        *,
        details: dict[str, str] | None = None,
    ) -> bytes:
        """A framed ErrorResponse (``message`` prefixed with the code's name, ``details``
        in its details map)."""
        response = m.error_response(code, message)
        if details:
            response.error.details.update(details)
        return self._frame(correlation_id, _with_header(response, correlation_id))


class ClientConnection:
    """The client's view of one Rivven connection (protobuf format).

    Correlation ids are allocated here, increasing from ``first_correlation_id`` (1 by
    default: the server answers 0 to what it cannot attribute) and wrapping past u32
    back to 1. :meth:`receive_data` returns the answers in arrival order, each matched to
    its request; it raises :class:`~headwater.errors.ProtocolError` when the server's
    bytes are invalid or answer no outstanding request, after which the client should
    close.
    """

    __slots__ = ("_decoder", "_next_id", "_pending", "client_id", "max_frame")

    def __init__(
        self,
        client_id: str = "headwater",
        *,
        first_correlation_id: int = 1,
        max_frame: int = MAX_FRAME,
    ) -> None:
        if not 1 <= first_correlation_id <= MAX_CORRELATION_ID:
            raise UsageError("correlation ids are u32 and 0 is reserved for the server")
        self.client_id = client_id
        self.max_frame = max_frame
        self._next_id = first_correlation_id
        self._pending: set[int] = set()
        self._decoder = FrameDecoder(max_frame)

    @property
    def pending(self) -> frozenset[int]:
        """Correlation ids sent and not yet answered."""
        return frozenset(self._pending)

    def _allocate(self) -> int:
        correlation_id = self._next_id
        if correlation_id in self._pending:
            raise UsageError(f"correlation id {correlation_id} is still awaiting its answer")
        self._next_id = correlation_id + 1 if correlation_id < MAX_CORRELATION_ID else 1
        return correlation_id

    def send_request(self, request: pb.Request | Message) -> tuple[int, bytes]:
        """Number and frame a request (a Request, or its operation's message such as a
        PingRequest): ``(correlation_id, bytes to send)``."""
        if isinstance(request, pb.Request):
            if request.WhichOneof("request_type") is None:
                raise UsageError("the request carries no operation")
            message = pb.Request()
            message.CopyFrom(request)
        else:
            message = m.request_of(request)
        correlation_id = self._allocate()
        message.header.version = m.PROTOCOL_VERSION
        message.header.correlation_id = correlation_id
        message.header.client_id = self.client_id
        data = encode_frame(
            WireFormat.PROTOBUF,
            correlation_id,
            message.SerializeToString(deterministic=True),
            max_frame=self.max_frame,
        )
        self._pending.add(correlation_id)
        return correlation_id, data

    def handshake(self) -> tuple[int, bytes]:
        """The version Handshake (optional for the server; sent first by Rivven's own
        client)."""
        return self.send_request(
            pb.HandshakeRequest(protocol_version=m.PROTOCOL_VERSION, client_id=self.client_id)
        )

    def receive_data(self, data: Buffer) -> list[ResponseFrame]:
        """Answers in arrival order; raises ProtocolError on bad bytes."""
        self._decoder.feed(data)
        return [self._answer(body) for body in self._decoder]

    def _answer(self, body: bytes) -> ResponseFrame:
        frame = parse_frame(body)
        correlation_id = frame.correlation_id
        if frame.format == WireFormat.PROTOBUF:
            response = m.decode_response(frame.payload)
            wire_format = WireFormat.PROTOBUF
        elif frame.format == WireFormat.POSTCARD:
            # A Rivven server's connection-level errors can come as postcard.
            message = m.decode_postcard_error(frame.payload)
            error = pb.ErrorResponse(code=m.ErrorCode.UNKNOWN, message=message)
            response = pb.Response(error=error)
            wire_format = WireFormat.POSTCARD
        else:
            raise ProtocolError(f"answer in unknown wire format 0x{frame.format:02x}")
        if correlation_id in self._pending:
            self._pending.discard(correlation_id)
        elif not (correlation_id == 0 and response.WhichOneof("response_type") == "error"):
            raise ProtocolError(f"answer to correlation id {correlation_id}, which is not pending")
        return ResponseFrame(correlation_id, response, wire_format)

    @property
    def at_frame_boundary(self) -> bool:
        return self._decoder.at_boundary
