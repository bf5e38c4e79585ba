"""One TCP connection of an SDK client, whatever its protocol.

A :class:`Link` moves bytes between a socket and a sans-I/O codec of
:mod:`headwater.protocols`; its subclass says which codec, and how a decoded message is
routed. Requests are written as soon as they are made, so any number can be in flight:
an answer resolves the future kept under its request's key (a request id, a stream id,
a checkpoint id), a push goes to the route kept under its key (a subscription), and when
the connection goes away every request still waiting gets :class:`Lost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Generic, Protocol, TypeVar, cast

from headwater.errors import ProtocolError

In = TypeVar("In")
"""What the codec decodes from the server's bytes."""
Out = TypeVar("Out")
"""What answers a request (and what a route is given)."""
In_co = TypeVar("In_co", covariant=True)


class Decoder(Protocol[In_co]):
    """The receiving half of a sans-I/O client codec, as every protocol's has it."""

    def receive_data(self, data: bytes) -> Iterable[In_co]: ...


class NotSent(Exception):
    """The connection was already gone: the request never reached the socket."""


class Lost(Exception):
    """Set on the futures of requests in flight when the connection goes away."""


class Route(Protocol):
    """What a subscription offers the connection for its pushes."""

    def _on_notification(self, message: Any) -> None: ...


def reason(exc: BaseException, hint: str = "is `headwater serve` running there?") -> str:
    """A connection failure in a few words, for an error message."""
    if isinstance(exc, ConnectionRefusedError):
        return f"connection refused ({hint})"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: the server's certificate did not verify ({exc.verify_message})"
    if isinstance(exc, ssl.SSLError):
        # e.g. TLSV13_ALERT_CERTIFICATE_REQUIRED: mutual TLS and no client certificate
        return f"TLS: {exc.reason or exc}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[0].lower() + exc.strerror[1:]
    return str(exc) or type(exc).__name__


class Link(asyncio.Protocol, Generic[In, Out]):
    """The asyncio side of one connection over ``codec``; subclasses dispatch (and
    name their codec's own type, for what they send with it)."""

    def __init__(
        self, codec: Decoder[In], on_lost: Callable[[Any, BaseException | None], None]
    ) -> None:
        self.codec = codec
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.pending: dict[Hashable, asyncio.Future[Out]] = {}
        self.routes: dict[Hashable, Route] = {}
        self.closed = False
        self.close_reason: str | None = None
        self.last_send = 0.0
        self._writable = asyncio.Event()
        self._writable.set()
        self._gone = asyncio.Event()

    # ---- what a protocol says -----------------------------------------------------------

    def _decode(self, data: bytes) -> Iterable[In]:
        """The messages ``data`` completes (raises ProtocolError on bad bytes)."""
        return self.codec.receive_data(data)

    def _dispatch(self, message: In) -> None:
        """Hand one decoded message on (see :meth:`_deliver`)."""
        raise NotImplementedError

    # ---- transport callbacks ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._writable.set()
        self._gone.set()
        if self.close_reason is None:
            self.close_reason = reason(exc) if exc else "the connection closed"
        self._fail_pending(Lost(self.close_reason))
        self.routes.clear()
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
            messages = self._decode(data)
        except ProtocolError as exc:
            self.close_reason = f"the server sent invalid bytes ({exc})"
            self.abort()
            return
        for message in messages:
            self._dispatch(message)

    # ---- input --------------------------------------------------------------------------

    def _deliver(
        self,
        key: Hashable,
        message: Out,
        *,
        reply: bool = True,
        push: bool = True,
        final: bool = False,
    ) -> bool:
        """Give ``message`` to the request waiting on ``key`` (when it may be a reply),
        else to the route on ``key`` (when it may be a push; ``final`` ends the route).
        False when nobody took it."""
        if reply:
            future = self.pending.pop(key, None)
            if future is not None:
                if not future.done():
                    future.set_result(message)
                return True
        if not push:
            return False
        route = self.routes.pop(key, None) if final else self.routes.get(key)
        if route is None:
            return False
        route._on_notification(message)
        return True

    def _fail_pending(self, exc: BaseException) -> None:
        pending = list(self.pending.values())
        self.pending.clear()
        for future in pending:
            if not future.done():
                future.set_exception(exc)

    # ---- output -------------------------------------------------------------------------

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

    def _check(self) -> None:
        """NotSent unless a request can be written now (before a codec numbers it)."""
        if not self.usable:
            raise NotSent()

    def _post(self, data: bytes) -> None:
        """Write bytes nobody waits an answer for."""
        if not self.usable:
            raise NotSent()
        assert self.transport is not None
        self.transport.write(data)
        self.last_send = asyncio.get_running_loop().time()

    def _expect(
        self, key: Hashable, data: bytes, route: Route | None = None
    ) -> asyncio.Future[Out]:
        """Write a request whose answer (or Lost) will resolve the returned future; its
        pushes go to ``route``."""
        self._check()
        future: asyncio.Future[Out] = asyncio.get_running_loop().create_future()
        self.pending[key] = future
        if route is not None:
            self.routes[key] = route
        self._post(data)
        return future

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    async def wait_closed(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until the transport has let go, its
        buffered bytes written."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._gone.wait(), timeout)
