"""A small raw Kimberlite test client.

Deliberately not an SDK: one blocking TCP socket, the sans-I/O
:class:`~headwater.protocols.kimberlite.ClientConnection` to number, frame and decode, and
helpers to send hand-made bytes, so the integration tests pin the wire behaviour of the
real server process (tests/integration/test_kimberlite_server.py).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
import zlib
from collections.abc import Callable, Iterable, Sequence

from headwater.protocols.kimberlite import (
    AppendEventsRequest,
    AppendEventsResponse,
    ClientConnection,
    CreateStreamRequest,
    CreateStreamResponse,
    ErrorResponse,
    EventBatch,
    HandshakeResponse,
    QueryAtRequest,
    QueryAtResponse,
    QueryRequest,
    QueryResponse,
    ReadEventsRequest,
    ReadEventsResponse,
    RequestPayload,
    Response,
    ResponsePayload,
    SubscriptionClosedResponse,
    SubscriptionEventsResponse,
)

HEADER = struct.Struct(">IHII")  # magic, version, payload_len, crc32
MAGIC = 0x56444220


# ---- the client ----------------------------------------------------------------------------


class ConnectionClosed(AssertionError):
    """The server closed the connection while a response was awaited."""


class RawClient:
    """One Kimberlite connection. Responses that arrive while waiting for another one are
    kept (in arrival order) until asked for, so pushes and out-of-order answers are never
    lost."""

    def __init__(
        self,
        port: int,
        tenant_id: int = 0,
        *,
        handshake: bool = True,
        token: str | None = None,
        timeout: float = 15.0,
    ) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = ClientConnection(tenant_id)
        self.timeout = timeout
        self.pending: list[Response] = []
        self.eof = False
        self.raw_received = bytearray()  # every byte the server sent
        self.handshake_response: HandshakeResponse | None = None
        if handshake:
            reply = self.call_payload(self.conn.handshake(token))
            assert isinstance(reply, HandshakeResponse), reply
            self.handshake_response = reply

    # -- sending --

    def send(self, payload: RequestPayload, *, tenant_id: int | None = None) -> int:
        request_id, data = self.conn.send_request(payload, tenant_id=tenant_id)
        self.sock.sendall(data)
        return request_id

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def next_id(self) -> int:
        return self.conn.next_request_id()

    # -- receiving --

    def _fill(self, deadline: float) -> bool:
        """Read once (until ``deadline``); False on timeout. Sets ``eof`` at end of input."""
        if self.eof:
            return False
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(1 << 20)
        except TimeoutError:
            return False
        except (ConnectionResetError, BrokenPipeError):
            data = b""
        finally:
            self.sock.settimeout(self.timeout)
        if not data:
            self.eof = True
            return False
        self.raw_received += data
        self.pending.extend(self.conn.receive_data(data))
        return True

    def take(
        self, match: Callable[[Response], bool], timeout: float | None = None
    ) -> Response | None:
        """The first received response satisfying ``match`` (removed from the queue),
        reading as needed; None when none came within ``timeout`` or the connection
        closed."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            for i, response in enumerate(self.pending):
                if match(response):
                    del self.pending[i]
                    return response
            if not self._fill(deadline) and (self.eof or time.monotonic() >= deadline):
                return None

    def response(self, request_id: int, timeout: float | None = None) -> Response:
        """The next response carrying ``request_id`` (pushes included)."""
        found = self.take(lambda r: r.request_id == request_id, timeout)
        if found is None:
            if self.eof:
                raise ConnectionClosed(f"connection closed before response {request_id}")
            raise AssertionError(f"no response to request {request_id} in time")
        return found

    def reply(self, request_id: int, timeout: float | None = None) -> ResponsePayload:
        """The answer to ``request_id``: its first response that is not a push."""
        found = self.take(
            lambda r: (
                r.request_id == request_id and not isinstance(r.payload, SubscriptionEventsResponse)
            ),
            timeout,
        )
        if found is None:
            if self.eof:
                raise ConnectionClosed(f"connection closed before the answer to {request_id}")
            raise AssertionError(f"no answer to request {request_id} in time")
        return found.payload

    def call_payload(
        self, sent: tuple[int, bytes], timeout: float | None = None
    ) -> ResponsePayload:
        request_id, data = sent
        self.sock.sendall(data)
        return self.reply(request_id, timeout)

    def call(
        self,
        payload: RequestPayload,
        *,
        tenant_id: int | None = None,
        timeout: float | None = None,
    ) -> ResponsePayload:
        return self.reply(self.send(payload, tenant_id=tenant_id), timeout)

    def next_response(self, timeout: float | None = None) -> Response | None:
        return self.take(lambda r: True, timeout)

    def drain(self, duration: float) -> list[Response]:
        """Everything that arrives within ``duration`` seconds (and what was queued)."""
        deadline = time.monotonic() + duration
        while self._fill(deadline):
            pass
        out, self.pending = self.pending, []
        return out

    def wait_closed(self, timeout: float = 10.0) -> list[Response]:
        """Read until the server closes the connection; the responses read meanwhile."""
        deadline = time.monotonic() + timeout
        while not self.eof:
            if not self._fill(deadline) and not self.eof:
                raise AssertionError(f"the server did not close the connection in {timeout}s")
        out, self.pending = self.pending, []
        return out

    def closed_by_server(self, timeout: float = 10.0) -> bool:
        try:
            self.wait_closed(timeout)
        except AssertionError:
            return False
        return True

    # -- closing --

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def abort(self) -> None:
        """Close abruptly: RST instead of FIN, as a dying process's socket may."""
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- frames by hand -------------------------------------------------------------------------


def frame(payload: bytes, *, magic: int = MAGIC, version: int = 1, crc: int | None = None) -> bytes:
    """A frame around ``payload`` with any header field overridden."""
    checksum = zlib.crc32(payload) if crc is None else crc
    return HEADER.pack(magic, version, len(payload), checksum) + payload


def header(payload_len: int, *, version: int = 1, crc: int = 0) -> bytes:
    """A bare frame header claiming ``payload_len`` bytes (no payload follows)."""
    return HEADER.pack(MAGIC, version, payload_len, crc)


def request_envelope(request_id: int, tenant_id: int, discriminant: int, body: bytes) -> bytes:
    return struct.pack("<QQI", request_id, tenant_id, discriminant) + body


# ---- one-call helpers -------------------------------------------------------------------------


def batch(events: Sequence[bytes]) -> EventBatch:
    return EventBatch.of(list(events))


def expect_error(reply: ResponsePayload, code: int, context: str = "") -> ErrorResponse:
    assert isinstance(reply, ErrorResponse), f"{context}: expected error {code}, got {reply!r}"
    assert reply.code == code, (
        f"{context}: expected error {code}, got {reply.code} {reply.message!r}"
    )
    return reply


def create_stream(client: RawClient, name: str, *, tenant_id: int | None = None) -> int:
    reply = client.call(CreateStreamRequest(name), tenant_id=tenant_id)
    assert isinstance(reply, CreateStreamResponse), reply
    return reply.stream_id


def append(
    client: RawClient, stream_id: int, events: Sequence[bytes], *, tenant_id: int | None = None
) -> AppendEventsResponse:
    reply = client.call(AppendEventsRequest(stream_id, batch(events)), tenant_id=tenant_id)
    assert isinstance(reply, AppendEventsResponse), reply
    assert reply.count == len(events), reply
    return reply


def read(
    client: RawClient,
    stream_id: int,
    from_offset: int = 0,
    max_bytes: int = 1 << 20,
    *,
    tenant_id: int | None = None,
) -> tuple[list[bytes], int | None]:
    reply = client.call(ReadEventsRequest(stream_id, from_offset, max_bytes), tenant_id=tenant_id)
    assert isinstance(reply, ReadEventsResponse), reply
    return reply.events.values(), reply.next_offset


def read_all(
    client: RawClient, stream_id: int, *, tenant_id: int | None = None, max_bytes: int = 1 << 20
) -> list[bytes]:
    out: list[bytes] = []
    offset = 0
    while True:
        events, next_offset = read(client, stream_id, offset, max_bytes, tenant_id=tenant_id)
        out.extend(events)
        if next_offset is None:
            return out
        assert next_offset == offset + len(events), (offset, len(events), next_offset)
        assert events, f"no progress reading at {offset}"
        offset = next_offset


def query(
    client: RawClient,
    sql: str,
    params: Iterable[object] = (),
    *,
    tenant_id: int | None = None,
    timeout: float | None = None,
) -> QueryResponse:
    reply = client.call(QueryRequest(sql, list(params)), tenant_id=tenant_id, timeout=timeout)  # type: ignore[arg-type]
    assert isinstance(reply, QueryResponse), f"{sql}: {reply!r}"
    return reply


def query_at(
    client: RawClient,
    sql: str,
    position: int,
    params: Iterable[object] = (),
    *,
    tenant_id: int | None = None,
) -> ResponsePayload:
    return client.call(QueryAtRequest(sql, list(params), position), tenant_id=tenant_id)  # type: ignore[arg-type]


def rows_of(reply: ResponsePayload) -> list[list[object]]:
    assert isinstance(reply, QueryResponse | QueryAtResponse), reply
    return [list(row) for row in reply.rows]


def pushes(responses: Iterable[Response], subscribe_id: int) -> list[SubscriptionEventsResponse]:
    return [
        r.payload
        for r in responses
        if r.request_id == subscribe_id and isinstance(r.payload, SubscriptionEventsResponse)
    ]


def is_push(response: Response, subscription_id: int | None = None) -> bool:
    payload = response.payload
    if not isinstance(payload, SubscriptionEventsResponse | SubscriptionClosedResponse):
        return False
    return subscription_id is None or payload.subscription_id == subscription_id


def env_seed(name: str, default: int) -> int:
    return int(os.environ.get(name, default))
