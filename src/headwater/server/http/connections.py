"""The HTTP listener's connections kept within ``[limits]``.

aiohttp runs one :class:`aiohttp.web.RequestHandler` (an asyncio protocol) per
connection; :class:`LimitedServer` makes each one a :class:`LimitedRequestHandler`, which

- counts the connection in the server's :class:`~headwater.server.limits.ConnectionLimits`
  together with every TCP listener's (``max_connections``): past it, the client is
  answered ``503`` with a JSON error before anything it sent is read, and closed;
- closes a connection whose request line and headers are not complete within
  ``handshake_timeout_s`` of its first byte (or of the connection, for the first
  request) with ``408``: a slowloris client trickling its headers holds a connection
  that long and no longer;
- closes a keep-alive connection idle for ``idle_timeout_s`` (aiohttp's
  ``keepalive_timeout``), counted.

A WebSocket upgrade (``/ws``) is one of these connections until it closes, so it is
counted the same way; once upgraded, its idleness is the Kiwi gateway's business.

The handler reads a few of aiohttp's RequestHandler attributes (``_request_count``,
``_waiter``, ``_upgraded``, ``_force_close``) and wraps ``_process_keepalive``: aiohttp
offers no hook for "headers complete" or "closed for idleness". They exist in every
aiohttp release headwater supports (3.9 to 3.14), and tests/integration/
test_http_limits.py drives each limit against a real server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import _ErrInfo

from headwater.errors import HeadwaterError, InvalidRequest, RateLimited
from headwater.server.http.app import error_body, error_response
from headwater.server.limits import ConnectionLimits

log = logging.getLogger("headwater.http")

LISTENER = "http"
# How long a refused connection (503) keeps reading, and discarding, what the client
# sends before it is closed: closing with unread bytes would reset the connection and
# could destroy the 503 before the client read it.
REFUSAL_LINGER_S = 1.0
# At shutdown, a connection whose client has read nothing of its answer for this long
# is closed instead of waited for (aiohttp would wait its shutdown timeout, twice).
UNREAD_AT_STOP_S = 1.0


def peer_address(transport: asyncio.BaseTransport | None) -> str:
    """``host:port`` of the client, for log lines."""
    peer: Any = None if transport is None else transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)


def raw_error_response(status: HTTPStatus, error: HeadwaterError) -> bytes:
    """A whole ``Connection: close`` HTTP/1.1 response with the API's JSON error body,
    for answers written straight to the transport (no request object exists)."""
    body = json.dumps(
        error_body(error.code, error.name, error.message, error.retryable),
        separators=(",", ":"),
    ).encode()
    retry = "Retry-After: 1\r\n" if error.retryable else ""
    head = (
        f"HTTP/1.1 {status.value} {status.phrase}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{retry}"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def parse_error_reason(message: str) -> str:
    """The gist of aiohttp's parse error, without the bytes it quotes: those are the
    client's request line or a header, which may hold ``?token=`` or an
    ``Authorization`` header, and tokens are never logged (nor is a multi-line message
    one log line). ``"Invalid header value char:\n\n  b'Authorization: ...'"`` becomes
    ``"Invalid header value char"``."""
    first = message.strip().split("\n", 1)[0]
    return re.split(r"""[:'"`]""", first, maxsplit=1)[0].strip()


class LimitedRequestHandler(web.RequestHandler):
    """aiohttp's connection protocol with admission, a header deadline and counted idle
    closes (see the module docstring)."""

    def __init__(
        self,
        manager: web.Server,
        *,
        connection_limits: ConnectionLimits,
        loop: asyncio.AbstractEventLoop,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self.connection_limits = connection_limits
        self.handshake_timeout_s = connection_limits.config.handshake_timeout_s
        self.admitted = False
        self.peer = "?"
        self.refused_transport: asyncio.Transport | None = None
        self.header_deadline: asyncio.TimerHandle | None = None
        self.requests_at_deadline = 0

    # ---- admission ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Kept for log lines: once a client has reset the connection, aiohttp's
        # request.remote no longer knows who it was.
        self.peer = peer_address(transport)
        if not self.connection_limits.admit(LISTENER):
            self._refuse(transport)  # type: ignore[arg-type]
            return
        self.admitted = True
        super().connection_made(transport)
        self._start_header_deadline()

    def _refuse(self, transport: asyncio.Transport) -> None:
        limit = self.connection_limits.config.max_connections
        log.warning(
            "http: refused %s: %d connections are open (limits.max_connections)",
            peer_address(transport),
            limit,
        )
        transport.write(
            raw_error_response(
                HTTPStatus.SERVICE_UNAVAILABLE,
                RateLimited(
                    f"the server has {limit} connections open (limits.max_connections);"
                    " try again later"
                ),
            )
        )
        if transport.can_write_eof():
            transport.write_eof()
        self.refused_transport = transport
        self._loop.call_later(REFUSAL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return  # a refused client's request: discarded unread
        super().data_received(data)
        if self._messages and isinstance(error := self._messages[-1][0], _ErrInfo):
            # A parse error (always the last message queued): its traceback holds the
            # frames of this call and the parser's, so this handler, its parser and
            # the TLS transport would form a cycle freed only by a collection. It is
            # the client's error, logged as one line without it (handle_error).
            error.exc.__traceback__ = None
        if self.header_deadline is not None:
            if self._request_count != self.requests_at_deadline or self._upgraded:
                self.header_deadline.cancel()  # a request's headers are complete
                self.header_deadline = None
        elif data and self._waiter is not None and not self._upgraded:
            # The first bytes of the next request on a kept-alive connection.
            self._start_header_deadline()

    def eof_received(self) -> None:
        if self.refused_transport is not None:
            self.refused_transport.close()  # the client read the 503 and left

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.admitted:
            return
        self.admitted = False
        self.connection_limits.release()
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None
        super().connection_lost(exc)
        # Requests parsed and never served (the client left first) hold this handler
        # through their payloads and errors: gone with the connection, not at a GC.
        self._messages.clear()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse (a request line or header
        too long, bad framing, not HTTP at all): the client's error, so one warning line
        with its address and a JSON 400, not aiohttp's logged traceback."""
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        reason = parse_error_reason(message or (str(exc) if exc is not None else ""))
        reason = reason or HTTPStatus(status).phrase
        log.warning("http: bad request from %s: %s", peer_address(self.transport), reason)
        if request.writer.output_size > 0:  # as aiohttp: too late for another answer
            raise ConnectionError("a response was sent already; closing")
        response = error_response(InvalidRequest(f"bad HTTP request: {reason}"))
        response.set_status(status)
        response.force_close()
        return response

    # ---- shutdown -------------------------------------------------------------------

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        """aiohttp's graceful end of the connection, but a client that reads nothing
        of its answer is not waited for: its handler waits on a full write buffer, and
        the stop would wait out the timeout for it (about 21 s with two such clients),
        as the binary front ends let their unread answers go."""
        watch = asyncio.ensure_future(self._close_if_unread())
        try:
            await super().shutdown(timeout)
        finally:
            watch.cancel()

    async def _close_if_unread(self) -> None:
        # Closing already (a WebSocket's close frame sent) does not end it either: a
        # transport closes once its buffer is out, which needs the client to read.
        last = -1
        while (transport := self.transport) is not None:
            size = transport.get_write_buffer_size()
            if self.writing_paused and size == last:
                log.warning(
                    "http: closed %s at shutdown: it read nothing sent to it for %gs",
                    self.peer,
                    UNREAD_AT_STOP_S,
                )
                transport.abort()
                return
            last = size
            await asyncio.sleep(UNREAD_AT_STOP_S)

    # ---- slow headers and idle connections ----------------------------------------

    def _start_header_deadline(self) -> None:
        self.requests_at_deadline = self._request_count
        self.header_deadline = self._loop.call_later(
            self.handshake_timeout_s, self._header_deadline_passed
        )

    def _header_deadline_passed(self) -> None:
        self.header_deadline = None
        transport = self.transport
        # Still waiting for a request whose headers never completed (not serving one:
        # a handler running or an unread body being drained ends on its own).
        if (
            transport is None
            or self._request_count != self.requests_at_deadline
            or self._waiter is None
            or self._upgraded
        ):
            return
        self.connection_limits.refused("handshake_timeout_s", LISTENER)
        log.warning(
            "http: closed %s: no complete request headers within %gs (limits.handshake_timeout_s)",
            peer_address(transport),
            self.handshake_timeout_s,
        )
        transport.write(
            raw_error_response(
                HTTPStatus.REQUEST_TIMEOUT,
                InvalidRequest(f"no complete request headers within {self.handshake_timeout_s:g}s"),
            )
        )
        self.force_close()

    def _process_keepalive(self) -> None:
        was_open = not self._force_close
        super()._process_keepalive()
        if was_open and self._force_close:  # aiohttp closed it: idle past keepalive_timeout
            self.connection_limits.refused("idle_timeout_s", LISTENER)


class LimitedServer(web.Server):
    """aiohttp's connection manager, making :class:`LimitedRequestHandler` connections."""

    def __init__(self, made: web.Server, connection_limits: ConnectionLimits) -> None:
        # Everything the application's own server was made with: its request handler and
        # factory, and the runner's handler arguments (keepalive_timeout, header limits).
        super().__init__(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            **made._kwargs,
        )
        self.connection_limits = connection_limits

    def __call__(self) -> web.RequestHandler:
        return LimitedRequestHandler(
            self, connection_limits=self.connection_limits, loop=self._loop, **self._kwargs
        )


class LimitedAppRunner(web.AppRunner):
    """An :class:`aiohttp.web.AppRunner` whose connections are :class:`LimitedServer`'s."""

    def __init__(
        self, app: web.Application, connection_limits: ConnectionLimits, **kwargs: Any
    ) -> None:
        super().__init__(app, **kwargs)
        self.connection_limits = connection_limits

    async def _make_server(self) -> web.Server:
        return LimitedServer(await super()._make_server(), self.connection_limits)
