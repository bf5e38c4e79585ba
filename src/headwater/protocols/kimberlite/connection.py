"""Sans-I/O Kimberlite connections: bytes in, events out; responses in, bytes out.

:class:`ServerConnection` turns received bytes into decoded requests and answers, on its
own, everything the protocol answers without the engine: requests before the Handshake,
payloads that do not decode, frames that must be rejected. :class:`ClientConnection`
numbers and frames requests and decodes responses. Neither does any I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from headwater.errors import ProtocolError, UsageError
from headwater.protocols import _connection
from headwater.protocols._connection import Close as Close

from .frames import MAX_FRAME, FrameDecoder, RejectFrameError, encode_frame_chunks
from .messages import (
    U64_MAX,
    Buffer,
    DecodeError,
    ErrorCode,
    HandshakeRequest,
    Request,
    RequestPayload,
    Response,
    decode_request,
    decode_response,
    encode_read_events_response,
    encode_request_chunks,
    encode_response_chunks,
    encode_subscription_events,
    error_response,
)


class Reply(_connection.Reply[Response]):
    """An Error response the connection produced itself; send ``data`` and carry on."""

    __slots__ = ()

    @property
    def response(self) -> Response:
        return self.answer


class Reject(_connection.Reject[Response]):
    """Send ``data`` (an Error with request_id 0), then close the connection."""

    __slots__ = ()

    @property
    def response(self) -> Response:
        return self.answer


ServerEvent = Request | Reply | Reject | Close


def _frame(chunks: Iterable[Buffer]) -> bytes:
    return b"".join(encode_frame_chunks(chunks))


class ServerConnection(_connection.ServerConnection[bytes, ServerEvent]):
    """The server's view of one Kimberlite connection.

    :meth:`receive_data` returns, in arrival order, the :class:`Request` objects the
    engine must answer and the :class:`Reply` / :class:`Reject` / :class:`Close` events
    the connection decided itself (a Reject for an unsupported version or an oversized
    frame, a Close for bad magic or CRC). A payload that does not decode inside an intact
    frame gets Error(InvalidRequest) with its request id (0 when unreadable) and the
    connection stays open: the framing can still be trusted.
    """

    __slots__ = ("_handshaken", "enforce_limits")

    def __init__(self, *, max_payload: int = MAX_FRAME, enforce_limits: bool = True) -> None:
        super().__init__(FrameDecoder(max_payload))
        self._handshaken = False
        self.enforce_limits = enforce_limits

    @property
    def handshake_received(self) -> bool:
        return self._handshaken

    def _on_broken(self, exc: ProtocolError) -> ServerEvent:
        if isinstance(exc, RejectFrameError):
            return Reject(exc.response, exc.reply, exc.message)
        return Close(str(exc))

    def _on_item(self, payload: bytes) -> ServerEvent:
        try:
            request = decode_request(payload, enforce_limits=self.enforce_limits)
        except DecodeError as exc:
            return self._reply(exc.request_id or 0, ErrorCode.INVALID_REQUEST, exc.message)
        if not self._handshaken:
            if not isinstance(request.payload, HandshakeRequest):
                return self._reply(
                    request.id, ErrorCode.INVALID_REQUEST, "Handshake must be the first request"
                )
            self._handshaken = True
        return request

    def _reply(self, request_id: int, code: ErrorCode, message: str) -> Reply:
        response = error_response(request_id, code, message)
        return Reply(response, self.send(response))

    def send(self, response: Response) -> bytes:
        """One framed response."""
        return _frame(encode_response_chunks(response))

    def send_chunks(self, response: Response) -> list[Buffer]:
        """One framed response as chunks for ``writelines`` (event sections uncopied)."""
        return encode_frame_chunks(encode_response_chunks(response))

    def send_error(self, request_id: int, code: int, message: str) -> bytes:
        return self.send(error_response(request_id, code, message))

    def send_read_events(
        self, request_id: int, count: int, chunks: Iterable[Buffer], next_offset: int | None
    ) -> list[Buffer]:
        """A framed ReadEvents response from stored ``u64 len | bytes`` records."""
        payload = encode_read_events_response(request_id, count, chunks, next_offset)
        return encode_frame_chunks(payload)

    def send_subscription_pushes(
        self,
        request_id: int,
        subscription_id: int,
        pushes: Iterable[tuple[int, int, Iterable[Buffer], int]],
    ) -> list[Buffer]:
        """Several framed SubscriptionEvents pushes, each ``(start_offset, count, stored
        records, credits_remaining)``, as one list of chunks: a whole read for a single
        ``writelines`` (work per push, none per event; the records stay uncopied)."""
        out: list[Buffer] = []
        for start_offset, count, chunks, credits_remaining in pushes:
            out += encode_frame_chunks(
                encode_subscription_events(
                    request_id, subscription_id, start_offset, count, chunks, credits_remaining
                )
            )
        return out


class ClientConnection:
    """The client's view of one Kimberlite connection.

    Request ids are allocated here, increasing from ``first_request_id`` (1 by default:
    id 0 is what the server uses for errors not tied to a request). :meth:`receive_data`
    raises :class:`~headwater.errors.ProtocolError` when the server's bytes are invalid;
    the client should then close.
    """

    __slots__ = ("_decoder", "_next_id", "tenant_id")

    def __init__(
        self, tenant_id: int = 0, *, first_request_id: int = 1, max_payload: int = MAX_FRAME
    ) -> None:
        if not 0 <= first_request_id <= U64_MAX:
            raise UsageError("request ids are u64")
        self.tenant_id = tenant_id
        self._next_id = first_request_id
        self._decoder = FrameDecoder(max_payload)

    def next_request_id(self) -> int:
        request_id = self._next_id
        if request_id > U64_MAX:
            raise UsageError("request ids exhausted")
        self._next_id = request_id + 1
        return request_id

    def send_request(
        self, payload: RequestPayload, *, tenant_id: int | None = None
    ) -> tuple[int, bytes]:
        """Number and frame a request: ``(request_id, bytes to send)``."""
        request_id = self.next_request_id()
        tenant = self.tenant_id if tenant_id is None else tenant_id
        return request_id, _frame(encode_request_chunks(Request(request_id, tenant, payload)))

    def handshake(self, auth_token: str | None = None) -> tuple[int, bytes]:
        return self.send_request(HandshakeRequest(auth_token=auth_token))

    def receive_data(self, data: Buffer) -> list[Response]:
        """Decoded responses, in arrival order; raises ProtocolError on bad bytes."""
        self._decoder.feed(data)
        return [decode_response(payload) for payload in self._decoder]

    @property
    def at_frame_boundary(self) -> bool:
        return self._decoder.at_frame_boundary
