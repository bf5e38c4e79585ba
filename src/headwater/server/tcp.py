"""The asyncio TCP listener every binary front end (Kimberlite, ConvergeDB, Ripple)
shares: bind, count connections (and subscriptions) in /metrics, and stop in order.

A front end gives a factory of its connections (asyncio protocols) and the set they
enter while open. Stopping: stop accepting, run the front end's ``drain`` (answers still
owed go out), close every connection, run ``finish`` (state saved once no connection
can change it), then wait for the server to close.

Each connection keeps to ``[limits]`` through a :class:`ConnectionGuard` (connections,
handshake and idle timeouts, bytes held before auth), written once here for every
binary protocol."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, cast

from headwater.engine.kinds.reader import Buffer
from headwater.protocols._connection import Close, Reject, Reply, ServerConnection
from headwater.server.app import Listener
from headwater.server.limits import ConnectionLimits
from headwater.server.metrics import metrics_for
from headwater.server.tls import Listening, listen

if TYPE_CHECKING:
    from headwater.server.app import Server


log = logging.getLogger("headwater.limits")

REFUSAL_LINGER_S = 2.0  # how long a refused peer may take to read the last word


class Connection(Protocol):
    def close(self) -> None: ...


class Buffering(Protocol):
    @property
    def buffered_bytes(self) -> int:
        """Bytes received and held: a frame not yet whole."""
        ...

    def discard(self) -> None:
        """The connection ended: free what it held."""
        ...


class GuardedConnection(Connection, Protocol):
    """What a connection kept by a :class:`ConnectionGuard` shows it."""

    transport: asyncio.Transport | None

    @property
    def protocol(self) -> Buffering:
        """The connection's sans-I/O protocol state."""
        ...

    def refusal(self, limit: str, message: str) -> bytes:
        """The protocol's framed last word naming ``limit`` (b"": none)."""
        ...

    def busy(self) -> bool:
        """Whether the connection is in use while quiet (subscriptions, requests in
        flight): the idle timeout waits."""
        ...


class ConnectionGuard:
    """One client connection's share of ``[limits]``, for the binary listeners.

    The connection makes one (``ConnectionGuard(limits, listener, self)``) and in
    ``connection_made`` calls :meth:`admit` (False: the
    connection was refused by ``max_connections``, do nothing more), :meth:`received`
    from ``data_received`` (the one per-read cost after auth: a clock read),
    :meth:`authenticated` once the peer's handshake or CONNECT is accepted, and
    :meth:`release` from ``connection_lost``.

    One timer per connection: before auth it fires at ``handshake_timeout_s``; after,
    at ``idle_timeout_s`` past the last bytes received, re-armed instead of closing
    while the connection is ``busy()``. Each refusal sends the protocol's last word
    (the connection's ``refusal(limit, message)``: its error frame), closes, logs one
    warning line with the peer's address and is counted in /metrics."""

    __slots__ = (
        "_admitted",
        "_config",
        "_connection",
        "_limits",
        "_loop",
        "_timer",
        "_transport",
        "authed",
        "last_received",
        "listener",
        "peer",
    )

    def __init__(
        self, limits: ConnectionLimits, listener: str, connection: GuardedConnection
    ) -> None:
        self._limits = limits
        self._config = limits.config
        self.listener = listener
        self._connection = connection
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._admitted = False
        self.authed = False
        self.peer = "?"
        self.last_received = self._loop.time()

    def admit(self, transport: asyncio.Transport) -> bool:
        """Count the connection; False when ``max_connections`` are open (it was told
        so and is being closed)."""
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        if not self._limits.admit(self.listener):
            self._refuse(
                "max_connections",
                f"the server has {self._config.max_connections} connections open"
                " (limits.max_connections): try again later",
                counted=True,
            )
            return False
        self._admitted = True
        self._timer = self._loop.call_at(
            self.last_received + self._config.handshake_timeout_s, self._expired
        )
        return True

    def received(self) -> bool:
        """Bytes arrived and were processed. Before auth, what the connection holds for
        the peer (a partial frame, answers it has not read) must stay within
        ``max_pending_bytes``; False: it did not, the connection is closing."""
        self.last_received = self._loop.time()
        if self.authed:
            return True
        transport = self._transport
        unread = transport.get_write_buffer_size() if transport is not None else 0
        pending = self._connection.protocol.buffered_bytes + unread
        if pending <= self._config.max_pending_bytes:
            return True
        self._refuse(
            "max_pending_bytes",
            f"{pending} bytes held before authentication, over limits.max_pending_bytes"
            f" ({self._config.max_pending_bytes})",
        )
        return False

    def upgraded(self, transport: asyncio.Transport) -> None:
        """The connection moved onto ``transport`` (TLS started on its own wire): the
        last word of a refusal goes there."""
        self._transport = transport

    def authenticated(self) -> None:
        """The peer's handshake (or CONNECT) was accepted: the idle timeout applies."""
        if self.authed or not self._admitted:
            return
        self.authed = True
        self._rearm(self._loop.time() + self._config.idle_timeout_s)

    def release(self) -> None:
        """The connection ended (``connection_lost``): its partial frame is freed now,
        not when the cyclic GC reaches the connection (``tune_gc`` makes that rare: 3,000
        connections refused at ``max_pending_bytes`` held ~1.25 MiB each until then)."""
        self._connection.protocol.discard()
        # Likewise the transport: under TLS it holds a 256 KiB read buffer and the
        # TLS state, which the connection's cycle would keep until a collection.
        self._connection.transport = None
        self._transport = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._admitted:
            self._admitted = False
            self._limits.release()

    def _rearm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if not self._admitted:
            return
        config = self._config
        if not self.authed:
            self._refuse(
                "handshake_timeout_s",
                f"no accepted handshake within {config.handshake_timeout_s:g} s"
                " (limits.handshake_timeout_s)",
            )
            return
        now = self._loop.time()
        deadline = self.last_received + config.idle_timeout_s
        if now < deadline:
            self._rearm(deadline)
        elif self._connection.busy():
            self._rearm(now + config.idle_timeout_s)
        else:
            self._refuse(
                "idle_timeout_s",
                f"nothing received for {config.idle_timeout_s:g} s and no subscription"
                " (limits.idle_timeout_s)",
                warn=False,
            )

    def _refuse(
        self, limit: str, message: str, *, counted: bool = False, warn: bool = True
    ) -> None:
        if not counted:
            self._limits.refused(limit, self.listener)
        (log.warning if warn else log.info)("%s %s: closing: %s", self.listener, self.peer, message)
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        data = self._connection.refusal(limit, message)
        if data:
            transport.write(data)
        self._connection.close()
        # A peer that reads nothing must not hold its socket open through the last word.
        # The timer holds the transport: release() cancels it once the connection is gone.
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(REFUSAL_LINGER_S, transport.abort)


def without_nagle(transport: asyncio.BaseTransport) -> None:
    """Turn off Nagle's delay on ``transport``'s socket: the binary protocols' answers
    are small and latency-bound."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TaskPerRequestConnection(asyncio.Protocol):
    """The connection shell of the binary front ends that run each request as its own
    task (Kimberlite, Kafka, Rivven): a slow request never holds up the next one on the
    same connection. Reading pauses at ``max_inflight`` requests in flight and resumes
    at half; after the peer's EOF the connection closes once the last answer is out.

    A front end calls :meth:`_start` with each decoded request's handler coroutine,
    :meth:`_close_when_answered` from ``eof_received``, :meth:`_end` with the protocol's
    Reject or Close, and writes with :meth:`_write`; ``tasks`` is what its listener's
    drain waits for (:func:`finish_in_flight`), with :meth:`inline_answered` when
    ``inline`` requests are in flight: a request answered from a callback instead of a
    task of its own (:meth:`_began_inline`, :meth:`_answered_inline`) counts as one.
    :class:`ServerConnectionShell` adds the transport callbacks for a protocol built on
    ``protocols._connection``."""

    max_inflight: ClassVar[int] = 1024  # requests per connection before reading pauses
    guard: ConnectionGuard  # the front end makes it in its __init__

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.inline = 0  # requests in flight without a task: a callback answers them
        self._inline_answered: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._stopping = False  # the listener stops: reading stays paused
        self._eof = False
        self.closed = False

    def _set_transport(self, transport: asyncio.BaseTransport) -> asyncio.Transport:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        return self.transport

    def busy(self) -> bool:
        """Requests in flight keep the idle timeout waiting (see :class:`ConnectionGuard`)."""
        return bool(self.tasks or self.inline)

    def _start(self, handling: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(handling)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        self._pause_if_full()

    def _began_inline(self) -> None:
        """A request is in flight without a task: :meth:`_answered_inline` follows its
        answer."""
        self.inline += 1
        self._pause_if_full()

    def _answered_inline(self) -> None:
        self.inline -= 1
        if not self.inline and self._inline_answered is not None:
            if not self._inline_answered.done():
                self._inline_answered.set_result(None)
            self._inline_answered = None
        self._request_done()

    def inline_answered(self) -> asyncio.Future[None]:
        """Done once no request is in flight without a task (a listener's drain)."""
        if not self.inline:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        if self._inline_answered is None:
            self._inline_answered = asyncio.get_running_loop().create_future()
        return self._inline_answered

    def stop_reading(self) -> None:
        """The listener stops: nothing more is read, so a request arriving during its
        drain is not started (a Kimberlite append was stored, then its connection closed
        before its answer: the client was told it may or may not have been applied)."""
        self._stopping = True
        if self.transport is not None and not self.closed and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def _pause_if_full(self) -> None:
        in_flight = len(self.tasks) + self.inline
        if in_flight >= self.max_inflight and not self._reading_paused and self.transport:
            self._reading_paused = True
            self.transport.pause_reading()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._request_done()

    def _request_done(self) -> None:
        in_flight = len(self.tasks) + self.inline
        if self._eof and not in_flight:
            self.close()
            return
        if (
            self._reading_paused
            and not self._stopping
            and in_flight <= self.max_inflight // 2
            and self.transport
        ):
            self._reading_paused = False
            if not self.closed:
                self.transport.resume_reading()

    def _close_when_answered(self) -> None:
        """The peer sends no more but may still read: answer what it sent, then close."""
        self._eof = True
        if not self.tasks and not self.inline:
            self.close()

    def _end(self, event: Reject[Any] | Close) -> None:
        """The peer broke the protocol: one warning line, then a Reject's last word is
        sent before closing, a Close closes at once."""
        # On the front end's own logger (headwater.kimberlite...), as its other lines.
        listener = self.guard.listener
        logging.getLogger(f"headwater.{listener}").warning(
            "%s %s: closing: %s", listener, self.guard.peer, event.reason
        )
        if isinstance(event, Reject):
            self._write(event.data)
            self.close()
        else:
            self.close(abort=True)

    def _write(self, data: bytes) -> None:
        if data and self.transport is not None and not self.closed:
            self.transport.write(data)

    def write_chunks(self, chunks: Iterable[Buffer]) -> None:
        """Write buffers in order, none copied into one (uvloop sends them together)."""
        if self.transport is not None and not self.closed:
            self.transport.writelines(chunks)

    def close(self, *, abort: bool = False) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            if abort:
                self.transport.abort()
            else:
                self.transport.close()


ProtocolT = TypeVar("ProtocolT", bound=ServerConnection[Any, Any])


class ServerConnectionShell(TaskPerRequestConnection, Generic[ProtocolT]):
    """The transport callbacks of a request-per-task front end whose sans-I/O
    ``protocol`` is a ``protocols._connection.ServerConnection`` (Kimberlite, Rivven).

    The front end's ``__init__`` makes its ``protocol``, its ``guard`` and the set of
    open ``_connections``; this shell admits, registers and releases the connection,
    feeds the protocol and starts :meth:`_handle` (the front end's) for each request it
    decodes, writes the protocol's own replies and ends the connection on its Reject or
    Close. The hooks :meth:`_connected`, :meth:`_disconnected`, :meth:`_replied` and
    :meth:`_ending` add a front end's own steps."""

    protocol: ProtocolT
    _connections: set[Any]

    # ---- transport callbacks --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.guard.admit(self._set_transport(transport)):
            return
        without_nagle(transport)
        self._connected()
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.guard.release()
        self._connections.discard(self)
        self._disconnected()

    def data_received(self, data: bytes) -> None:
        for event in self.protocol.receive_data(data):
            if isinstance(event, Reply):
                self._replied(event.answer)
                self._write(event.data)
            elif isinstance(event, Reject | Close):
                self._end(event)
                return
            elif not self._answer_inline(event):
                self._start(self._handle(event))
        self.guard.received()

    def eof_received(self) -> bool | None:
        self.protocol.receive_eof()
        self._ending()
        self._close_when_answered()
        return True

    # ---- what a front end adds --------------------------------------------------------

    async def _handle(self, request: Any) -> None:
        """Answer one request the protocol decoded (a task of its own)."""
        raise NotImplementedError

    def _answer_inline(self, request: Any) -> bool:
        """Answer ``request`` without a task of its own if the front end can (it calls
        :meth:`_began_inline`); False: :meth:`_handle` runs as a task."""
        return False

    def _connected(self) -> None:
        """The connection was admitted (before it joins the open ones)."""

    def _disconnected(self) -> None:
        """The connection is gone (already released and out of the open ones)."""

    def _replied(self, answer: Any) -> None:
        """The protocol answered the peer itself (``answer`` is written next)."""

    def _ending(self) -> None:
        """The peer sent its EOF; answers to what it sent still go out."""


DRAIN_TIMEOUT_S = 10.0  # how long a stopping listener waits for requests in flight


async def finish_in_flight(tasks: Collection[asyncio.Future[Any]]) -> None:
    """A listener's ``drain``: let requests already received finish (an append in flight
    gets its answer) before the connections close, for at most ``DRAIN_TIMEOUT_S``."""
    if tasks:
        _, running = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT_S)
        if running:
            log.warning(
                "stopping: %d requests still running after %.0f s; "
                "their connections close without an answer",
                len(running),
                DRAIN_TIMEOUT_S,
            )


async def start_tcp_listener(
    server: Server,
    name: str,
    host: str,
    port: int,
    make_connection: Callable[[], asyncio.Protocol],
    connections: Collection[Connection],
    *,
    subscriptions: Callable[[], int] | None = None,
    drain: Callable[[], Awaitable[None]] | None = None,
    finish: Callable[[], Awaitable[None]] | None = None,
    starttls: bool = False,
) -> Listener:
    """``starttls``: the protocol asks for TLS on its own wire (PostgreSQL's SSLRequest)
    and the connection upgrades itself, so the port is bound plain even under ``[tls]``."""
    if starttls:
        tcp: Listening = await asyncio.get_running_loop().create_server(
            make_connection, host, port, reuse_address=True
        )
    else:
        tcp = await listen(server, name, make_connection, host, port)
    bound = int(tcp.sockets[0].getsockname()[1])
    metrics = metrics_for(server)
    metrics.add_connections_source(name, lambda: len(connections))
    if subscriptions is not None:
        metrics.add_subscriptions_source(name, subscriptions)

    async def stop() -> None:
        tcp.close()  # stop accepting
        for conn in list(connections):  # and start no request the drain would not wait for
            if isinstance(conn, TaskPerRequestConnection):
                conn.stop_reading()
        if drain is not None:
            await drain()
        for conn in list(connections):
            conn.close()
        if finish is not None:
            await finish()
        await tcp.wait_closed()

    return Listener(name, bound, stop)
