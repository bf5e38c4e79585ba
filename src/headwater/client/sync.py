"""The blocking client: :func:`connect` and :class:`Client`.

A :class:`Client` runs an :class:`~headwater.client.aio.AsyncClient` on its own event-loop
thread and waits for each call. Calls from several threads are pipelined on the client's
one connection (each call is its own request in flight), and everything the async client
does about errors, retries and reconnects holds here too. The loop thread and the blocking
halves are :mod:`headwater.client._core.blocking`'s, as for the entities client.
"""

from __future__ import annotations

import ssl
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from headwater.protocols.kimberlite.messages import http_port

from ._core.blocking import Blocking, BlockingSubscription, Inner, LoopThread, blocking
from ._core.session import same_parameters_as
from .aio import (
    DEFAULT_CREDITS,
    DEFAULT_READ_BYTES,
    AsyncClient,
    AsyncSubscription,
    EventLike,
    HeadersLike,
    StartOffset,
    StreamRef,
    _Scan,
)
from .errors import ServerUnavailable
from .results import AppendResult, Event

if TYPE_CHECKING:
    import pyarrow as pa

    from .arrow import HttpApi

_T = TypeVar("_T")


class _HttpTarget(TypedDict):
    """The server's HTTP API (at the port its Handshake advertised) and who asks there:
    what :func:`~.arrow.read_arrow` and :class:`~.arrow.HttpApi` both take."""

    host: str
    port: int
    token: str | None
    tenant: int
    tls: ssl.SSLContext | None


class Client(Blocking[AsyncClient]):
    """A blocking headwater client. Make one with :func:`connect`; use it as a context
    manager or call :meth:`close`."""

    address = Inner[str]()
    tenant = Inner[int]()
    capabilities = Inner[tuple[str, ...]]()
    authenticated = Inner[bool]()
    retried = Inner[int]("How many requests were retried (retryable errors, lost connections).")

    # The asyncio client's calls that block as they are: its streams (create, list,
    # describe, delete), reads and SQL.
    create_stream = blocking(AsyncClient.create_stream)
    list_streams = blocking(AsyncClient.list_streams)
    stream_info = blocking(AsyncClient.stream_info)
    stream_id = blocking(AsyncClient.stream_id)
    delete_stream = blocking(AsyncClient.delete_stream)
    read = blocking(AsyncClient.read)
    read_batch = blocking(AsyncClient.read_batch)
    query = blocking(AsyncClient.query)
    query_at = blocking(AsyncClient.query_at)
    sync = blocking(AsyncClient.sync)

    def read_arrow(
        self,
        stream: str,
        start: int = 0,
        end: int | None = None,
        *,
        partition: int = 0,
        records: bool = False,
        isolation: str | None = None,
    ) -> Iterator[pa.RecordBatch]:
        """Offsets [start, end) of a partition of ``stream`` as Arrow record batches
        (``offset, position, ts, data``; with ``records`` also ``key, headers``, under
        ``isolation``) from the server's HTTP API, whose port the Handshake advertised: a
        bulk read with no work per event (see :mod:`headwater.client.arrow`)."""
        from .arrow import read_arrow  # pyarrow loads only for those who use it

        return read_arrow(
            stream=stream,
            start=start,
            end=end,
            partition=partition,
            records=records,
            isolation=isolation,
            **self._http_target(),
        )

    def http_api(self) -> HttpApi:
        """A keep-alive connection to the server's HTTP API (found through the
        Handshake, as for :meth:`read_arrow`): stream partitions, Arrow appends."""
        from .arrow import HttpApi

        return HttpApi(**self._http_target())

    def _http_target(self) -> _HttpTarget:
        port = http_port(self.capabilities)
        if port is None:
            raise ServerUnavailable(
                f"the server at {self.address} does not advertise an HTTP API (http:<port>)"
            )
        inner = self._inner
        return _HttpTarget(
            host=inner.host, port=port, token=inner.token, tenant=inner.tenant, tls=inner.tls
        )

    def submit(self, coro: Coroutine[Any, Any, _T]) -> Future[_T]:
        """Run a coroutine of :attr:`aio` on the client's loop without waiting, e.g.
        ``client.submit(client.aio.append("s", events))``: many such futures are
        pipelined on the one connection."""
        return self._runner.submit(coro)

    # ---- appends and reads ------------------------------------------------------------------

    def append(
        self,
        stream: StreamRef,
        events: Iterable[EventLike],
        *,
        max_in_flight: int = 8,
        keys: Sequence[EventLike | None] | None = None,
        headers: Sequence[HeadersLike] | None = None,
    ) -> AppendResult:
        """Append events in order (split over the protocol's limits); returns
        ``(first_offset, count)``. ``keys`` and ``headers``: one per event, stored with
        them (see :meth:`AsyncClient.append`)."""
        values = list(events)
        return self._run(
            self._inner.append(
                stream, values, max_in_flight=max_in_flight, keys=keys, headers=headers
            )
        )

    def append_idempotent(
        self, stream: StreamRef, producer_id: int, sequence: int, events: Iterable[EventLike]
    ) -> AppendResult:
        values = list(events)
        return self._run(self._inner.append_idempotent(stream, producer_id, sequence, values))

    def scan(
        self,
        stream: StreamRef,
        from_offset: int = 0,
        *,
        limit: int | None = None,
        max_bytes: int = DEFAULT_READ_BYTES,
    ) -> Iterator[Event]:
        """Every event from ``from_offset`` to the current end (or ``limit`` events)."""
        scan = _Scan(stream, from_offset, limit)
        while scan.offset is not None:
            yield from self._run(scan.next_page(self._inner, max_bytes))

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


class Subscription(BlockingSubscription[AsyncSubscription]):
    """Blocking view of an :class:`~headwater.client.aio.AsyncSubscription`."""

    def __iter__(self) -> Iterator[Event]:
        return self._drain(self._inner._next_batch)

    def next_batch(
        self, max_events: int | None = None, timeout: float | None = None
    ) -> list[Event]:
        """Events received so far (waiting for at least one); [] on timeout or once
        closed."""
        return self._client._run(self._inner.next_batch(max_events, timeout))

    def next(self, timeout: float | None = None) -> Event | None:
        return self._client._run(self._inner.next(timeout))

    stream_id = Inner[int | None]()
    subscription_id = Inner[int | None]()
    start_offset = Inner[int | None]()
    next_offset = Inner[int | None]()


@same_parameters_as(AsyncClient)
def connect(inner: AsyncClient) -> Client:
    """Connect to a headwater server (Kimberlite, default 127.0.0.1:7401); the parameters
    are :class:`~headwater.client.aio.AsyncClient`'s.

    Raises :class:`~headwater.client.ServerUnavailable` at once when nothing answers.
    """
    return Client(inner, LoopThread.connected(inner))
