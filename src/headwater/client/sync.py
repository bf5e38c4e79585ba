"""The blocking client: :func:`connect` and :class:`Client`.

A :class:`Client` runs an :class:`~headwater.client.aio.AsyncClient` on its own event-loop
thread and waits for each call. Calls from several threads are pipelined on the client's
one connection (each call is its own request in flight), and everything the async client
does about errors, retries and reconnects holds here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Coroutine, Iterable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from headwater.protocols.kimberlite.messages import DataClass, Placement, StreamInfo, http_port

from .aio import (
    DEFAULT_CREDITS,
    DEFAULT_READ_BYTES,
    DEFAULT_SERVER,
    DEFAULT_TIMEOUT,
    AsyncClient,
    AsyncSubscription,
    EventLike,
    StartOffset,
    StreamRef,
)
from .errors import ClientClosed, ServerUnavailable
from .results import AppendResult, Event, QueryResult, RawReadResult, ReadResult

if TYPE_CHECKING:
    import pyarrow as pa

_T = TypeVar("_T")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class _LoopThread:
    """An event loop running forever on a daemon thread."""

    def __init__(self) -> None:
        self.loop = _new_loop()
        self.stopped = False
        self.thread = threading.Thread(target=self._main, name="headwater-client", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> Future[_T]:
        if self.stopped:
            coro.close()
            raise ClientClosed("the client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: stop the coroutine too
            raise

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        if threading.current_thread() is self.thread:
            self.loop.call_soon(self.loop.stop)
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_cancel_tasks(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


async def _cancel_tasks() -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


def _finalize(inner: AsyncClient, runner: _LoopThread) -> None:
    """Close a client that was dropped without close()."""
    if runner.stopped:
        return
    with contextlib.suppress(BaseException):
        runner.submit(inner.close()).result(5)
    runner.stop()


class Client:
    """A blocking headwater client. Make one with :func:`connect`; use it as a context
    manager or call :meth:`close`."""

    def __init__(self, inner: AsyncClient, runner: _LoopThread) -> None:
        self._inner = inner
        self._runner = runner
        self._finalizer = weakref.finalize(self, _finalize, inner, runner)

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return self._runner.run(coro)

    # ---- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Unsubscribe, close the connection and stop the client's thread."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._runner.stopped or self._inner.closed

    @property
    def address(self) -> str:
        return self._inner.address

    @property
    def tenant(self) -> int:
        return self._inner.tenant

    @property
    def capabilities(self) -> tuple[str, ...]:
        return self._inner.capabilities

    @property
    def authenticated(self) -> bool:
        return self._inner.authenticated

    @property
    def reconnects(self) -> int:
        """How many times the client reconnected."""
        return self._inner.reconnects

    @property
    def retried(self) -> int:
        """How many requests were retried (retryable errors, lost connections)."""
        return self._inner.retried

    def read_arrow(
        self, stream: str, start: int = 0, end: int | None = None
    ) -> Iterator[pa.RecordBatch]:
        """Offsets [start, end) of ``stream`` as Arrow record batches (``offset, position,
        ts, data``) from the server's HTTP API, whose port the Handshake advertised: a
        bulk read with no work per event (see :mod:`headwater.client.arrow`)."""
        port = http_port(self.capabilities)
        if port is None:
            raise ServerUnavailable(
                f"the server at {self.address} does not advertise an HTTP API (http:<port>)"
            )
        from .arrow import read_arrow  # pyarrow loads only for those who use it

        inner = self._inner
        return read_arrow(
            inner.host, port, stream, start, end, token=inner.token, tenant=inner.tenant
        )

    @property
    def aio(self) -> AsyncClient:
        """The underlying async client (it runs on this client's loop thread)."""
        return self._inner

    def submit(self, coro: Coroutine[Any, Any, _T]) -> Future[_T]:
        """Run a coroutine of :attr:`aio` on the client's loop without waiting, e.g.
        ``client.submit(client.aio.append("s", events))``: many such futures are
        pipelined on the one connection."""
        return self._runner.submit(coro)

    # ---- streams ----------------------------------------------------------------------------

    def create_stream(
        self,
        name: str,
        *,
        data_class: DataClass = DataClass.NON_PHI,
        placement: Placement = Placement.GLOBAL,
    ) -> int:
        """Create a stream; returns its id (StreamAlreadyExists when the name is taken)."""
        return self._run(
            self._inner.create_stream(name, data_class=data_class, placement=placement)
        )

    def list_streams(self) -> list[StreamInfo]:
        return self._run(self._inner.list_streams())

    def stream_info(self, stream: StreamRef) -> StreamInfo:
        return self._run(self._inner.stream_info(stream))

    def stream_id(self, stream: StreamRef, *, refresh: bool = False) -> int:
        return self._run(self._inner.stream_id(stream, refresh=refresh))

    def delete_stream(self, stream: StreamRef) -> None:
        self._run(self._inner.delete_stream(stream))

    # ---- appends and reads ------------------------------------------------------------------

    def append(
        self, stream: StreamRef, events: Iterable[EventLike], *, max_in_flight: int = 8
    ) -> AppendResult:
        """Append events in order (split over the protocol's limits); returns
        ``(first_offset, count)``."""
        values = list(events)
        return self._run(self._inner.append(stream, values, max_in_flight=max_in_flight))

    def append_idempotent(
        self, stream: StreamRef, producer_id: int, sequence: int, events: Iterable[EventLike]
    ) -> AppendResult:
        values = list(events)
        return self._run(self._inner.append_idempotent(stream, producer_id, sequence, values))

    def read(
        self, stream: StreamRef, from_offset: int = 0, max_bytes: int = DEFAULT_READ_BYTES
    ) -> ReadResult:
        return self._run(self._inner.read(stream, from_offset, max_bytes))

    def read_batch(
        self, stream: StreamRef, from_offset: int = 0, max_bytes: int = DEFAULT_READ_BYTES
    ) -> RawReadResult:
        """Like :meth:`read`, events left in wire form (see ``AsyncClient.read_batch``)."""
        return self._run(self._inner.read_batch(stream, from_offset, max_bytes))

    def scan(
        self,
        stream: StreamRef,
        from_offset: int = 0,
        *,
        limit: int | None = None,
        max_bytes: int = DEFAULT_READ_BYTES,
    ) -> Iterator[Event]:
        """Every event from ``from_offset`` to the current end (or ``limit`` events)."""
        offset, left = from_offset, limit
        while left is None or left > 0:
            result = self.read(stream, offset, max_bytes)
            events = result.events if left is None else result.events[:left]
            yield from events
            if left is not None:
                left -= len(events)
            if result.at_end or not result.events:
                return
            offset = result.next_offset

    # ---- SQL --------------------------------------------------------------------------------

    def query(self, sql: str, *params: object) -> QueryResult:
        return self._run(self._inner.query(sql, *params))

    def query_at(self, sql: str, position: int, *params: object) -> QueryResult:
        return self._run(self._inner.query_at(sql, position, *params))

    def sync(self) -> bool:
        return self._run(self._inner.sync())

    # ---- subscriptions ----------------------------------------------------------------------

    def subscribe(
        self,
        stream: StreamRef,
        from_offset: StartOffset = 0,
        *,
        credits: int = DEFAULT_CREDITS,
        group: str | None = None,
    ) -> Subscription:
        """A live subscription: iterate it (``for event in sub``) or use it in a
        ``with`` block; it unsubscribes when the block or the loop ends."""
        return Subscription(
            self, self._inner.subscribe(stream, from_offset, credits=credits, group=group)
        )


class Subscription:
    """Blocking view of an :class:`~headwater.client.aio.AsyncSubscription`."""

    def __init__(self, client: Client, inner: AsyncSubscription) -> None:
        self._client = client
        self._inner = inner

    def __repr__(self) -> str:
        return repr(self._inner).replace("AsyncSubscription", "Subscription", 1)

    def start(self) -> Subscription:
        self._client._run(self._inner.start())
        return self

    def __enter__(self) -> Subscription:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Event]:
        try:
            while True:
                batch = self._client._run(self._inner._next_batch())
                if batch is None:
                    return
                yield from batch
        finally:
            self.close()

    def next_batch(
        self, max_events: int | None = None, timeout: float | None = None
    ) -> list[Event]:
        """Events received so far (waiting for at least one); [] on timeout or once
        closed."""
        return self._client._run(self._inner.next_batch(max_events, timeout))

    def next(self, timeout: float | None = None) -> Event | None:
        return self._client._run(self._inner.next(timeout))

    def close(self) -> None:
        if self._inner.closed or self._client._runner.stopped:
            return
        self._client._run(self._inner.close())

    @property
    def closed(self) -> bool:
        return self._inner.closed

    @property
    def stream_id(self) -> int | None:
        return self._inner.stream_id

    @property
    def subscription_id(self) -> int | None:
        return self._inner.subscription_id

    @property
    def start_offset(self) -> int | None:
        return self._inner.start_offset

    @property
    def next_offset(self) -> int | None:
        return self._inner.next_offset

    @property
    def resubscribes(self) -> int:
        return self._inner.resubscribes


def connect(
    server: str = DEFAULT_SERVER,
    *,
    token: str | None = None,
    tenant: int = 0,
    timeout: float | None = DEFAULT_TIMEOUT,
    reconnect: bool = True,
    retries: int = 5,
    reconnect_attempts: int = 10,
    backoff_base: float = 0.05,
    backoff_max: float = 2.0,
) -> Client:
    """Connect to a headwater server (Kimberlite, default 127.0.0.1:7401).

    Raises :class:`~headwater.client.ServerUnavailable` at once when nothing answers.
    """
    inner = AsyncClient(
        server,
        token=token,
        tenant=tenant,
        timeout=timeout,
        reconnect=reconnect,
        retries=retries,
        reconnect_attempts=reconnect_attempts,
        backoff_base=backoff_base,
        backoff_max=backoff_max,
    )
    runner = _LoopThread()
    try:
        runner.run(inner._ensure())
    except BaseException:
        runner.stop()
        raise
    return Client(inner, runner)
