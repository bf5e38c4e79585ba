"""What every SDK client does above its connection, whatever the protocol.

A :class:`Session` holds at most one :class:`~.link.Link` and

* connects: one TCP connection and the protocol's greeting (Handshake, CONNECT), with
  its auth token; failures raise :class:`~headwater.client.errors.ServerUnavailable`;
* reconnects when the connection broke: exponential backoff with jitter, at most
  ``reconnect_attempts`` attempts, one round at a time. Callers that waited for a round
  that failed get its error instead of starting another (no reconnect storm);
* sends requests and waits for their answers: a request that never reached a socket is
  sent on the next connection; one in flight when the connection broke is sent again
  when it is ``safe`` to repeat, else raises ConnectionLost with ``maybe_applied``; an
  error answer raises its exception and is retried first when it is ``retryable`` and
  the request safe;
* recovers subscriptions (:class:`Resumable`) on the new connection, or fails them when
  reconnecting is off or failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import random
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Hashable
from typing import Any, ClassVar, Generic, ParamSpec, Self, TypeVar, cast

from headwater.errors import HeadwaterError, NotLeader, ProtocolError

from ..errors import ClientClosed, ConnectionLost, RequestTimeout, ServerUnavailable
from .link import Link, Lost, NotSent, reason

L = TypeVar("L", bound=Link[Any, Any])
T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")
C = TypeVar("C", bound="Session[Any, Any]")

Post = Callable[[L], tuple[Hashable, "asyncio.Future[Any]"]]
"""Frame and write a request on a connection: ``(key, future of its answer)``."""


class Resumable(Generic[L]):
    """What every SDK subscription shares: its state (``new``, then live, ``detached``
    while the connection is gone, ``closed`` or ``failed``), its place among the
    session's subscriptions, and what becomes of it when the connection goes away.
    Subclasses subscribe (``start``, ``_resubscribe``) and unsubscribe (``_unsubscribe``)."""

    live_state: ClassVar[str] = "live"

    def __init__(self, client: Any) -> None:
        self._client = client
        self._state = "new"
        self._error: BaseException | None = None
        self._conn: L | None = None
        self.resubscribes = 0

    @property
    def closed(self) -> bool:
        return self._state in ("closed", "failed")

    @property
    def state(self) -> str:
        return self._state

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> Self:
        raise NotImplementedError

    async def close(self) -> None:
        """Unsubscribe (best effort, bounded); nothing more is delivered."""
        if self.closed:
            return
        conn, was = self._conn, self._state
        self._state = "closed"
        self._client._subscriptions.discard(self)
        self._wake()
        if conn is not None and was == self.live_state:
            await self._unsubscribe(conn)

    async def _unsubscribe(self, conn: L) -> None:
        """Tell the server (best effort) and drop the route on ``conn``."""
        raise NotImplementedError

    async def _drain(
        self, take: Callable[[], Awaitable[list[T] | None]], *, unsubscribe: bool
    ) -> AsyncIterator[T]:
        """What ``take`` gets, batch after batch, until the subscription closes (``take``
        answers None, or nothing once closed); with ``unsubscribe`` it closes when the
        loop ends."""
        await self.start()
        try:
            while True:
                batch = await take()
                if not batch:
                    if batch is None or self.closed:
                        return
                    continue
                for item in batch:
                    yield item
        finally:
            if unsubscribe:
                await self.close()

    # ---- the connection's end (called by the session) -------------------------------

    def _orphaned_by(self, conn: L) -> bool:
        """It lives on ``conn``, which is gone."""
        return self._conn is conn

    def _detach(self) -> None:
        """The connection is gone: subscribe again on the next one."""
        self._state = "detached"

    async def _resubscribe(self) -> None:
        raise NotImplementedError

    def _fail(self, exc: BaseException) -> None:
        """The subscription ends with ``exc`` (raised to whoever consumes it)."""
        if self.closed:
            return
        self._state = "failed"
        self._error = exc
        self._client._subscriptions.discard(self)
        self._wake()

    def _wake(self) -> None:
        """Wake whoever waits for what the subscription receives."""


S = TypeVar("S", bound=Resumable[Any])


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Seconds to wait before reconnect ``attempt`` (1, 2, ...): exponential from
    ``base`` up to ``cap``, with jitter so that many clients do not retry in step."""
    delay: float = min(cap, base * (2 ** max(0, attempt - 1)))
    return delay * random.uniform(0.5, 1.0)


def same_parameters_as(make: Callable[P, T]) -> Callable[[Callable[[T], R]], Callable[P, R]]:
    """Decorator: the function takes the parameters of ``make`` (a client class, a
    coroutine function) and is called with what ``make`` returns for them, e.g.
    ``connect(server, token=...)`` builds the client and connects it. Its signature, for
    type checkers and ``help()``, is ``make``'s."""

    def decorate(body: Callable[[T], R]) -> Callable[P, R]:
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            return body(make(*args, **kwargs))

        async def call_async(*args: P.args, **kwargs: P.kwargs) -> Any:
            return await cast(Awaitable[Any], body(make(*args, **kwargs)))

        wrapper: Any = call_async if inspect.iscoroutinefunction(body) else call
        functools.update_wrapper(wrapper, body)
        returns = inspect.signature(body).return_annotation
        wrapper.__signature__ = inspect.signature(make).replace(return_annotation=returns)
        return cast(Callable[P, R], wrapper)

    return decorate


class Connecting(Generic[C]):
    """What an SDK's ``connect_async(...)`` returns: await it for the connected client
    (``client = await connect_async(...)``), or enter it
    (``async with connect_async(...) as client:``: connected on entry, closed on exit, as
    ``with connect(...)`` is for the blocking client). A coroutine can only be awaited, so
    ``connect_async`` returns this instead of being one."""

    __slots__ = ("client",)

    def __init__(self, client: C) -> None:
        self.client = client

    def __await__(self) -> Generator[Any, None, C]:
        return self._connect().__await__()

    async def _connect(self) -> C:
        await self.client._ensure()
        return self.client

    async def __aenter__(self) -> C:
        return await self.client.__aenter__()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.client.__aexit__(*exc_info)


def parse_server(server: str, default_port: int = 7401) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``; the port defaults to 7401) as ``(host, port)``."""
    text = server.strip()
    if not text:
        return "127.0.0.1", default_port
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not port_text:
        return host or "127.0.0.1", default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad server address {server!r}: expected host:port")
    return host or "127.0.0.1", int(port_text)


def http_headers(token: str | None, tenant: int) -> dict[str, str]:
    """Who asks the HTTP API: the tenant, and the token when there is one."""
    headers = {"X-Headwater-Tenant": str(tenant)}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


class Session(Generic[L, S]):
    """Connecting, reconnecting and requests for one SDK client (see the module)."""

    service: ClassVar[str] = "headwater"
    """Who is at the address, in error messages."""
    default_port: ClassVar[int]
    refused_hint: ClassVar[str] = "is `headwater serve` running there?"
    closed_message: ClassVar[str] = "the client is closed"
    retry_on: ClassVar[tuple[type[BaseException], ...]] = (ServerUnavailable,)
    """What a failed connection attempt raises that the next attempt may not."""
    listener: ClassVar[str] = "kimberlite"
    """The server listener the session speaks to: a NotLeader's hint is looked up by it."""

    def __init__(
        self,
        server: str,
        timeout: float | None,
        reconnect: bool,
        reconnect_attempts: int,
        backoff_base: float,
        backoff_max: float,
        retries: int | None = None,
        *,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """The client's options; ``retries`` (how often a request that is safe to repeat
        is sent again) defaults to ``reconnect_attempts``; ``tls`` (see
        :func:`~.tls.client_context`): connect over TLS."""
        self.host, self.port = parse_server(server, self.default_port)
        self.tls = tls
        self.address = f"{self.host}:{self.port}"
        self.timeout = timeout
        self.reconnect = reconnect
        self.retries = reconnect_attempts if retries is None else retries
        self.reconnect_attempts = max(1, reconnect_attempts)
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        # Counters, handy in tests and for monitoring.
        self.reconnects = 0
        self.retried = 0
        self.redirects = 0  # moves to the leader a NotLeader named (a cluster)
        self._moved = False  # the address changed: the next connection dials it afresh
        self._conn: L | None = None
        self._lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connected_once = False
        self._reconnect_round = 0
        self._reconnect_error: BaseException | None = None
        self._closed = False
        self._subscriptions: set[S] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- what a client says -------------------------------------------------------------

    async def _open(self) -> L:
        """One connection attempt, greeting included (see :meth:`_dial`, :meth:`_greet`)."""
        raise NotImplementedError

    def _error_of(self, reply: Any) -> HeadwaterError | None:
        """The exception an error answer stands for (None: not an error)."""
        return None

    def _connected(self, conn: L) -> None:
        """Called once ``conn`` is the client's connection (e.g. to send again what the
        last one left unanswered)."""

    def _unfinished(self) -> bool:
        """Work that the next connection must finish, even with no subscription."""
        return False

    def _lost_for_good(self, conn: L) -> None:
        """``conn`` broke and reconnect is off."""

    async def _recovered(self) -> None:
        """The new connection is up, before subscriptions subscribe again."""

    def _recovery_failed(self, exc: BaseException) -> None:
        """No new connection: ``exc`` says why."""

    # ---- lifecycle ----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self._ensure()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Unsubscribe every subscription and close the connection."""
        if not self._closed:
            await self._shut()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._conn.usable

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(self.closed_message)

    async def _shut(self) -> None:
        """Close every subscription (bounded), then the connection."""
        try:
            for sub in list(self._subscriptions):
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(sub.close(), 2.0)
        finally:
            self._closed = True
            for task in list(self._tasks):
                task.cancel()
            conn = self._conn
            if conn is not None:
                conn.close()
        await asyncio.sleep(0)

    def _backoff(self, attempt: int) -> float:
        return backoff_delay(attempt, self.backoff_base, self.backoff_max)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        # The coroutine itself becomes the task: a wrapper task cancelled before its first
        # step (the loop stopping) would leave ``coro`` never awaited.
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _keep_alive(
        self, conn: L, interval: float, beat: Callable[[L], None], *, when_idle: bool
    ) -> None:
        """``beat(conn)`` every ``interval`` seconds (``when_idle``: only when nothing
        else was sent meanwhile) for as long as ``conn`` lives."""

        async def run() -> None:
            loop = asyncio.get_running_loop()
            while conn.usable:
                await asyncio.sleep(interval)
                idle = loop.time() - conn.last_send >= interval
                if conn.usable and (idle or not when_idle):
                    with contextlib.suppress(NotSent):
                        beat(conn)

        self._spawn(run())

    # ---- connecting ---------------------------------------------------------------------

    @property
    def _where(self) -> str:
        return f"cannot connect to {self.service} at {self.address}"

    async def _dial(self, factory: Callable[[], L]) -> L:
        """One TCP connection; ServerUnavailable when nothing answers."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    factory,
                    self.host,
                    self.port,
                    ssl=self.tls,
                    server_hostname=self.host if self.tls is not None else None,
                ),
                self.timeout,
            )
        except TimeoutError:
            raise ServerUnavailable(f"{self._where}: timed out after {self.timeout}s") from None
        except OSError as exc:
            raise ServerUnavailable(f"{self._where}: {reason(exc, self.refused_hint)}") from None
        return conn

    async def _greet(self, conn: L, post: Post[L], what: str, expect: type[T]) -> T:
        """Send the greeting and return its answer; an error answer raises its
        exception, anything else (no answer, a broken connection) ServerUnavailable."""
        try:
            _, future = post(conn)
            reply = await asyncio.wait_for(future, self.timeout)
        except TimeoutError:
            conn.abort()
            raise ServerUnavailable(
                f"{self._where}: no answer to {what} within {self.timeout}s"
            ) from None
        except (Lost, NotSent):
            why = conn.close_reason or f"the connection closed during {what}"
            if self.tls is None:
                # A TLS listener closes on a plain client's first bytes.
                why += " (if the server has [tls], connect with tls=True)"
            else:
                # Under TLS 1.3 the server checks the client's certificate after the
                # client's handshake is done, and its alert may not arrive before the close.
                why += " (if the server requires a client certificate, pass cert=)"
            raise ServerUnavailable(f"{self._where}: {why}") from None
        error = self._error_of(reply)
        if error is not None:
            conn.close()
            raise error
        if not isinstance(reply, expect):
            conn.abort()
            raise ServerUnavailable(f"{self._where}: unexpected {type(reply).__name__} to {what}")
        return reply

    async def _ensure(self) -> L:
        """The live connection; (re)connects when there is none."""
        conn = self._conn
        if conn is not None and conn.usable:
            return conn
        self._check_open()
        if self._lock is None:
            self._lock = asyncio.Lock()
        round_seen = self._reconnect_round
        async with self._lock:
            conn = self._conn
            if conn is not None and conn.usable:
                return conn
            self._check_open()
            if round_seen != self._reconnect_round and self._reconnect_error is not None:
                raise self._reconnect_error  # a reconnect failed while we waited: no storm
            if not self._connected_once or self._moved:
                conn = await self._open()
                self._moved = False
            elif not self.reconnect:
                why = (self._conn.close_reason if self._conn else None) or "closed"
                raise ConnectionLost(
                    f"the connection to {self.service} at {self.address} was lost ({why}) "
                    "and reconnect is off"
                )
            else:
                try:
                    conn = await self._reconnect()
                except BaseException as exc:
                    self._reconnect_error = exc
                    raise
                finally:
                    self._reconnect_round += 1
                self._reconnect_error = None
            self._conn = conn
            self._connected_once = True
            self._connected(conn)
            return conn

    async def _reconnect(self) -> L:
        last: BaseException | None = None
        for attempt in range(1, self.reconnect_attempts + 1):
            await asyncio.sleep(self._backoff(attempt))
            self._check_open()
            try:
                conn = await self._open()
            except self.retry_on as exc:
                last = exc
                continue
            self.reconnects += 1
            return conn
        why = "unknown" if last is None else str(last).removeprefix(f"{self._where}: ")
        raise ServerUnavailable(
            f"lost the connection to {self.service} at {self.address} and could not "
            f"reconnect in {self.reconnect_attempts} attempts: {why}"
        )

    def _on_lost(self, conn: L, exc: BaseException | None) -> None:
        """The connection's callback once it is gone (its requests already got Lost)."""
        if self._closed or conn is not self._conn:
            return
        subs = [s for s in self._subscriptions if s._orphaned_by(conn)]
        if not self.reconnect:
            error = ConnectionLost(
                f"the connection to {self.service} at {self.address} was lost "
                f"({conn.close_reason}) and reconnect is off"
            )
            self._lost_for_good(conn)
            for sub in subs:
                sub._fail(error)
            return
        for sub in subs:
            sub._detach()
        if subs or self._unfinished():
            self._spawn(self._recover(subs))

    async def _recover(self, subs: list[S]) -> None:
        try:
            await self._ensure()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            for sub in subs:
                sub._fail(exc)
            self._recovery_failed(exc)
            return
        await self._recovered()
        for sub in subs:
            try:
                await sub._resubscribe()
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                sub._fail(exc)

    # ---- requests -----------------------------------------------------------------------

    async def _send(
        self, post: Post[L], *, pinned: L | None = None
    ) -> tuple[L, Hashable, asyncio.Future[Any]]:
        """Write a request (connecting first if needed); one that never reached a socket
        goes out on the next connection (``pinned``: only on that one)."""
        for _ in range(self.reconnect_attempts + 1):
            conn = pinned if pinned is not None else await self._ensure()
            try:
                await conn.writable()
                key, future = post(conn)
            except NotSent:
                if pinned is not None:
                    raise ConnectionLost(
                        f"the connection to {self.service} at {self.address} was lost "
                        f"({conn.close_reason or 'closed'})",
                        maybe_applied=False,
                    ) from None
                continue
            return conn, key, future
        raise ServerUnavailable(f"{self.service} at {self.address} keeps closing the connection")

    async def _answer(
        self,
        conn: L,
        key: Hashable,
        future: asyncio.Future[T],
        what: str,
        *,
        safe: bool,
        wait: float | None = None,
    ) -> T:
        """The answer to a written request (an error answer included). Raises
        ConnectionLost (the connection broke) or RequestTimeout. ``wait``: seconds the
        server may take beyond the client's timeout (a request it holds open, such as a
        long poll or a group join)."""
        timeout = self.timeout if self.timeout is None or wait is None else self.timeout + wait
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            conn.pending.pop(key, None)
            conn.routes.pop(key, None)
            raise RequestTimeout(
                f"no answer to {what} from {self.service} at {self.address} within {timeout}s"
            ) from None
        except Lost as exc:
            conn.routes.pop(key, None)
            tail = "" if safe else "; it may or may not have been applied"
            raise ConnectionLost(
                f"the connection to {self.service} at {self.address} was lost while {what} "
                f"was in flight ({exc}){tail}",
                maybe_applied=not safe,
            ) from None

    async def _exchange(
        self,
        post: Post[L],
        what: str,
        expect: type[T],
        *,
        safe: bool,
        on_sent: Callable[[L, Any], None] | None = None,
        wait: float | None = None,
    ) -> T:
        """Send a request and return its answer, retrying when that is safe (``wait``:
        see :meth:`_answer`)."""
        attempt = 0
        while True:
            conn, key, future = await self._send(post)
            if on_sent is not None:
                on_sent(conn, key)
            try:
                reply = await self._answer(conn, key, future, what, safe=safe, wait=wait)
            except ConnectionLost:
                if safe and self.reconnect and attempt < self.retries and not self._closed:
                    attempt += 1
                    self.retried += 1
                    await asyncio.sleep(self._backoff(attempt))
                    continue
                raise
            if isinstance(reply, expect):
                return reply
            conn.routes.pop(key, None)
            error = self._error_of(reply)
            if error is None:
                raise ProtocolError(
                    f"{self.service} answered {what} with {type(reply).__name__}, "
                    f"expected {expect.__name__}"
                )
            if isinstance(error, NotLeader) and attempt < self.retries and not self._closed:
                # Refused before anything was stored, so safe to send again: to the leader
                # the answer names (a cluster, docs/cluster.md), or, while none is named
                # (an election), here again after a pause.
                attempt += 1
                self.retried += 1
                if not self._follow_leader(error):
                    await asyncio.sleep(self._backoff(attempt))
                continue
            if error.retryable and safe and attempt < self.retries:
                attempt += 1
                self.retried += 1
                await asyncio.sleep(self._backoff(attempt))
                continue
            raise error

    def _follow_leader(self, error: NotLeader) -> bool:
        """Point the session at the leader ``error`` names for this listener: the next
        request dials it, and the old connection is closed once the answers it owes
        are in (its subscriptions then subscribe again on the new one). False when no
        other address is named."""
        address = error.address_of(self.listener)
        if address is None:
            return False
        host, port = parse_server(address, self.default_port)
        if (host, port) == (self.host, self.port):
            return False
        self.host, self.port, self.address = host, port, f"{host}:{port}"
        self.redirects += 1
        old, self._conn, self._moved = self._conn, None, True
        if old is not None:
            self._spawn(self._retire(old))
        return True

    async def _retire(self, old: L) -> None:
        """Close a connection the session left for a leader, once the requests sent on
        it are answered (or time out); its subscriptions move to the new connection."""
        waiting = list(old.pending.values())
        if waiting:
            await asyncio.wait(waiting, timeout=self.timeout)
        old.close()
        subs = [s for s in self._subscriptions if s._orphaned_by(old)]
        for sub in subs:
            sub._detach()
        if subs:
            await self._recover(subs)

    async def _best_effort(self, conn: L, post: Post[L], timeout: float = 5.0) -> Any | None:
        """A request on one given connection: its answer, or None when it failed."""
        try:
            await conn.writable()
            _, future = post(conn)
        except NotSent:
            return None
        try:
            return await asyncio.wait_for(future, timeout)
        except (TimeoutError, Lost):
            return None
