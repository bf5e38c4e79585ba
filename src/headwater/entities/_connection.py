"""One TCP connection of the entities client: bytes to and from the ConvergeDB codec.

Requests are framed by :class:`~headwater.protocols.convergedb.ClientConnection`, which
allocates their stream ids and checks every reply against what was sent. A reply
resolves its request's future; notifications (STATE, DELETED, BOOTSTRAP_*, EVENT and a
subscription's ERROR) go to the subscription routed on their stream; an ERROR on stream
0 (a fire-and-forget request failed) goes to ``on_error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Protocol, cast

from headwater.errors import ProtocolError
from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.connection import ClientConnection


class Route(Protocol):
    """What a subscription offers the connection for its notifications."""

    def _on_notification(self, message: m.Message) -> None: ...


class NotSent(Exception):
    """The connection was already gone: the request never reached the socket."""


class Lost(Exception):
    """Set on the futures of requests in flight when the connection goes away."""


def is_reply(message: m.Message) -> bool:
    """ACKs, ERRORs and a QUERY's STATE answer a request; the rest are notifications."""
    if isinstance(message, m.State):
        return message.change == m.Change.QUERY
    return isinstance(message, m.Ack | m.ConnectAck | m.KindAck | m.EpochEndAck | m.ErrorMessage)


class CdbConnection(asyncio.Protocol):
    def __init__(
        self,
        on_lost: Callable[[CdbConnection, BaseException | None], None],
        on_error: Callable[[m.ErrorMessage], None],
    ) -> None:
        self.codec = ClientConnection()
        self.on_lost = on_lost
        self.on_error = on_error
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future[m.Message]] = {}
        self.routes: dict[int, Route] = {}
        self.closed = False
        self.close_reason: str | None = None
        self.source_id: int | None = None
        self.last_send = 0.0
        self._writable = asyncio.Event()
        self._writable.set()

    # ---- transport callbacks ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._writable.set()
        if self.close_reason is None:
            self.close_reason = str(exc) if exc else "the server closed the connection"
        pending = list(self.pending.values())
        self.pending.clear()
        for future in pending:
            if not future.done():
                future.set_exception(Lost(self.close_reason))
        self.on_lost(self, exc)

    def eof_received(self) -> bool | None:
        if self.close_reason is None:
            self.close_reason = "the server closed the connection"
        return False

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.codec.receive_data(data)
        except ProtocolError as exc:
            self.close_reason = f"the server sent invalid bytes ({exc})"
            self.abort()
            return
        for frame in frames:
            self._dispatch(frame)

    def _dispatch(self, frame: m.Frame) -> None:
        message, stream_id = frame.message, frame.stream_id
        if stream_id == 0:
            if isinstance(message, m.ErrorMessage):
                self.on_error(message)
            return
        if is_reply(message):
            future = self.pending.pop(stream_id, None)
            if future is not None:
                if not future.done():
                    future.set_result(message)
                return
        route = self.routes.get(stream_id)
        if route is not None:
            if isinstance(message, m.ErrorMessage):
                del self.routes[stream_id]  # the server ended the subscription
            route._on_notification(message)

    # ---- output -----------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        transport = self.transport
        return not self.closed and transport is not None and not transport.is_closing()

    async def writable(self) -> None:
        """Wait until the transport takes more bytes; NotSent when the connection died."""
        if not self._writable.is_set():
            await self._writable.wait()
        if not self.usable:
            raise NotSent()

    def send(
        self, message: m.ClientMessage, *, ack: bool = False, route: Route | None = None
    ) -> tuple[int, asyncio.Future[m.Message] | None]:
        """Frame and write one request; its future (None on stream 0) gets the reply or
        :class:`Lost`."""
        if not self.usable:
            raise NotSent()
        assert self.transport is not None
        stream_id, data = self.codec.send(message, ack=ack)
        future: asyncio.Future[m.Message] | None = None
        if stream_id:
            future = asyncio.get_running_loop().create_future()
            self.pending[stream_id] = future
        if route is not None:
            self.routes[stream_id] = route
        self.transport.write(data)
        self.last_send = asyncio.get_running_loop().time()
        return stream_id, future

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
