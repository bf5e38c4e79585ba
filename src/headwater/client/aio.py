"""The asyncio client: :func:`connect_async` and :class:`AsyncClient`.

One TCP connection carries every request of a client; concurrent coroutines share it and
their requests are in flight together, matched to their answers by request id.

Failures, and what the client does about them:

* An Error response raises the matching ``headwater.errors`` class. When the error is
  ``retryable`` and the request is safe to repeat (reads, queries, listing, sync,
  subscribing, idempotent appends) it is retried up to ``retries`` times with
  exponential backoff and jitter first.
* When the connection breaks, the next request reconnects (exponential backoff and
  jitter, at most ``reconnect_attempts`` attempts, then :class:`ServerUnavailable`).
  Requests that were in flight are repeated when safe; the others (append, create,
  delete) raise :class:`ConnectionLost` with ``maybe_applied=True``: the server may have
  applied them and the client never resends them behind the caller's back. A request
  that had not been written yet is simply sent on the new connection.
* Subscriptions re-subscribe on the new connection from the next offset they have not
  received, so no event is skipped and none is delivered twice.

Connecting, reconnecting, retrying and request matching are the connection core's
(:mod:`headwater.client._core`), shared with the entities SDK and the Ripple worker; this module
adds the Kimberlite requests and subscriptions.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import functools
import ssl
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Iterable,
    Mapping,
    Sequence,
)
from typing import Literal, TypeVar

from headwater.errors import (
    HeadwaterError,
    NotLeader,
    ProtocolError,
    StreamAlreadyExists,
    StreamNotFound,
    UsageError,
)
from headwater.protocols.kimberlite import messages as m
from headwater.protocols.kimberlite.connection import ClientConnection

from ._connection import Connection, NotSent
from ._core import batching
from ._core.session import Connecting, Resumable, Session, parse_server, same_parameters_as
from ._core.session import backoff_delay as backoff_delay
from ._core.tls import PathLike, client_context
from .errors import ConnectionLost, EventTooLarge, SubscriptionClosed
from .results import (
    AppendResult,
    Event,
    QueryResult,
    RawReadResult,
    ReadResult,
    datetime_to_timestamp,
)

DEFAULT_SERVER = "127.0.0.1:7401"
DEFAULT_PORT = 7401
DEFAULT_TIMEOUT = 30.0
DEFAULT_CREDITS = 1000
DEFAULT_READ_BYTES = 1 << 20
MAX_CREDITS = (1 << 32) - 1

StreamRef = str | int
"""A stream by name (resolved through ListStreams, cached) or by id."""
EventLike = bytes | bytearray | memoryview | str
"""An event value: bytes, or text (sent as UTF-8)."""
StartOffset = int | Literal["latest", "resume", "earliest"]
"""Where a subscription starts: an offset, "earliest" (0), "latest" (only new events) or
"resume" (the consumer group's acknowledged position; needs ``group``)."""

_T = TypeVar("_T")
_R = TypeVar("_R", bound=m.ResponsePayload)


def to_event_bytes(event: EventLike) -> bytes:
    if isinstance(event, str):
        return event.encode()
    if isinstance(event, bytes):
        return event
    if isinstance(event, bytearray | memoryview):
        return bytes(event)
    raise TypeError(f"an event is bytes or str, not {type(event).__name__}")


HeadersLike = Mapping[str, EventLike] | Iterable[tuple[str, EventLike]]
"""An event's headers: a mapping or (name, value) pairs (a name may repeat in pairs)."""
RECORDS_CAPABILITY = "records"
"""The Handshake capability of servers that take AppendRecords (keys and headers)."""


def to_headers(headers: HeadersLike) -> tuple[tuple[str, bytes], ...]:
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    return tuple((str(name), to_event_bytes(value)) for name, value in pairs)


def _append_events(events: list[bytes], stream_id: int) -> m.RequestPayload:
    return m.AppendEventsRequest(stream_id, m.EventBatch.of(events))


def _append_records(
    events: list[bytes],
    keys: Sequence[bytes | None],
    headers: Sequence[tuple[tuple[str, bytes], ...]],
    stream_id: int,
) -> m.RequestPayload:
    return m.AppendRecordsRequest(stream_id, keys, headers, m.EventBatch.of(events))


def split_events(values: Sequence[bytes]) -> list[list[bytes]]:
    """Split events into appends within the protocol's limits (10,000 events and 4 MiB
    of event bytes each), keeping their order. Raises :class:`EventTooLarge` for an
    event that no append can carry, before anything is sent."""
    return batching.batches(values, len, m.MAX_EVENTS, m.MAX_APPEND_BYTES, too_large=_too_large)


def _too_large(index: int, size: int) -> EventTooLarge:
    return EventTooLarge(
        f"event {index} is {size:,} bytes; one event may be at most "
        f"{m.MAX_APPEND_BYTES:,} bytes (4 MiB). Nothing was appended."
    )


def to_query_param(value: object) -> m.QueryParam:
    """A Python value as a Kimberlite query parameter (datetime becomes Timestamp)."""
    if value is None or isinstance(value, bool | int | str | m.Timestamp):
        return value
    if isinstance(value, _dt.datetime):
        return datetime_to_timestamp(value)
    raise TypeError(
        f"a {type(value).__name__} cannot be a query parameter: the Kimberlite wire carries "
        "None, int, str, bool and Timestamp/datetime (pass str(value) and CAST it in SQL)"
    )


class _Scan:
    """Where a scan is: the stream it reads (by name until the first page, then by
    id), the offset it reads next (None once it is done) and how many events it may
    still yield (None: no limit). The blocking and asyncio clients page through a
    stream with it."""

    __slots__ = ("left", "offset", "target")

    def __init__(self, stream: StreamRef, from_offset: int, limit: int | None) -> None:
        self.target = stream
        self.left = limit
        self.offset: int | None = from_offset if limit is None or limit > 0 else None

    async def next_page(self, client: AsyncClient, max_bytes: int) -> list[Event]:
        """Read the page at :attr:`offset` (not None) and :meth:`take` it."""
        assert self.offset is not None
        page = await client.read(self.target, self.offset, max_bytes)
        # The later pages by the id the first was read from: a stream deleted and made
        # again under its name meanwhile ends the scan (StreamNotFound) rather than
        # going on in the new one.
        self.target = await client.stream_id(self.target)
        return self.take(page)

    def take(self, page: ReadResult) -> list[Event]:
        """The events of ``page`` to yield; moves on to the next page (or the end). A
        page may be empty yet not the last: its offset was in a hole of the stream
        (compaction, an aborted transaction) and the scan goes on where the server
        says the next event is."""
        events = page.events if self.left is None else page.events[: self.left]
        if self.left is not None:
            self.left -= len(events)
        # An empty page that does not move on would be asked again for ever.
        stuck = not events and (self.offset is None or page.next_offset <= self.offset)
        done = page.at_end or stuck or (self.left is not None and self.left <= 0)
        self.offset = None if done else page.next_offset
        return events


def _retrieve(future: asyncio.Future[m.ResponsePayload]) -> None:
    """Done-callback for answers nobody awaits: mark their exception as seen."""
    if not future.cancelled():
        future.exception()


class AsyncClient(Session[Connection, "AsyncSubscription"]):
    """A headwater client for asyncio. Make one with :func:`connect_async`."""

    default_port = DEFAULT_PORT

    def __init__(
        self,
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
        tls: bool | ssl.SSLContext = False,
        ca: PathLike | None = None,
        cert: PathLike | None = None,
        key: PathLike | None = None,
    ) -> None:
        """``tls=True`` connects over TLS, verifying the server against the system's CAs,
        or against the CA file ``ca`` (which implies TLS); ``cert`` and ``key`` present a
        client certificate (mutual TLS); ``tls`` may also be an ``ssl.SSLContext``."""
        super().__init__(
            server,
            timeout,
            reconnect,
            reconnect_attempts,
            backoff_base,
            backoff_max,
            retries,
            tls=client_context(tls, ca, cert, key),
        )
        self.token = token
        self.tenant = tenant
        self.server_version: int | None = None
        self.capabilities: tuple[str, ...] = ()
        self.authenticated = False
        self._next_id = 1
        self._names: dict[str, int] = {}

    # ---- connecting -----------------------------------------------------------------------

    async def _open(self) -> Connection:
        """One connection attempt, handshake included."""
        if self._conn is not None:
            self._next_id = max(self._next_id, self._conn.last_id + 1)
        codec = ClientConnection(self.tenant, first_request_id=self._next_id)
        conn = await self._dial(lambda: Connection(codec, self._on_lost))
        reply = await self._greet(
            conn,
            lambda c: c.send(m.HandshakeRequest(auth_token=self.token)),
            "Handshake",
            m.HandshakeResponse,
        )
        self.server_version = reply.server_version
        self.capabilities = tuple(reply.capabilities)
        self.authenticated = reply.authenticated
        return conn

    def _error_of(self, reply: object) -> HeadwaterError | None:
        return reply.to_exception() if isinstance(reply, m.ErrorResponse) else None

    def _on_lost(self, conn: Connection, exc: BaseException | None) -> None:
        self._next_id = max(self._next_id, conn.last_id + 1)
        super()._on_lost(conn, exc)

    # ---- requests -------------------------------------------------------------------------

    async def _request(
        self,
        payload: m.RequestPayload,
        expect: type[_R],
        *,
        safe: bool,
        route: AsyncSubscription | None = None,
        on_sent: Callable[[Connection, Hashable], None] | None = None,
    ) -> _R:
        """Send a request and return its answer, retrying when that is safe."""
        what = type(payload).__name__.removesuffix("Request")
        return await self._exchange(
            lambda conn: conn.send(payload, route), what, expect, safe=safe, on_sent=on_sent
        )

    async def _request_on(
        self, conn: Connection, payload: m.RequestPayload, timeout: float = 5.0
    ) -> m.ResponsePayload | None:
        """Best effort on one given connection: the answer, or None when it failed."""
        reply: m.ResponsePayload | None = await self._best_effort(
            conn, lambda c: c.send(payload), timeout
        )
        return reply

    def _grant(self, conn: Connection, subscription_id: int, credits: int) -> bool:
        """Fire-and-forget SubscribeCredit (its answer only confirms the balance)."""
        try:
            _, future = conn.send(m.SubscribeCreditRequest(subscription_id, credits))
        except NotSent:
            return False
        future.add_done_callback(_retrieve)
        return True

    # ---- streams --------------------------------------------------------------------------

    async def create_stream(
        self,
        name: str,
        *,
        data_class: m.DataClass = m.DataClass.NON_PHI,
        placement: m.Placement = m.Placement.GLOBAL,
        exist_ok: bool = False,
    ) -> int:
        """Create a stream; returns its id. StreamAlreadyExists when the name is taken,
        unless ``exist_ok``: then the existing stream's id (a script that creates its
        streams can run again). A stream that exists is taken as it is: Kimberlite's
        ListStreams does not carry data class or placement, so they are not compared."""
        try:
            # With exist_ok a create is safe to repeat: a retry that finds the stream
            # made by the attempt the connection lost lands in the except below.
            reply = await self._request(
                m.CreateStreamRequest(name, data_class, placement),
                m.CreateStreamResponse,
                safe=exist_ok,
            )
        except StreamAlreadyExists:
            if not exist_ok:
                raise
            return await self.stream_id(name, refresh=True)
        self._names[name] = reply.stream_id
        return reply.stream_id

    async def list_streams(self) -> list[m.StreamInfo]:
        """Every stream of the tenant (and refresh the name -> id cache)."""
        reply = await self._request(m.ListStreamsRequest(), m.StreamsResponse, safe=True)
        streams = list(reply.streams)
        self._names = {info.name: info.stream_id for info in streams}
        return streams

    async def stream_info(self, stream: StreamRef) -> m.StreamInfo:
        """One stream's StreamInfo (by name or id); StreamNotFound when there is none."""
        for info in await self.list_streams():
            if info.name == stream or (
                isinstance(stream, int)
                and not isinstance(stream, bool)
                and info.stream_id == stream
            ):
                return info
        raise StreamNotFound(f"no stream {stream!r}")

    async def stream_id(self, stream: StreamRef, *, refresh: bool = False) -> int:
        """The id of a stream name (cached; looked up with ListStreams when unknown)."""
        if isinstance(stream, int) and not isinstance(stream, bool):
            return stream
        if not isinstance(stream, str):
            raise TypeError(f"a stream is a name or an id, not {type(stream).__name__}")
        if not refresh:
            cached = self._names.get(stream)
            if cached is not None:
                return cached
        await self.list_streams()
        found = self._names.get(stream)
        if found is None:
            raise StreamNotFound(f"no stream named {stream!r}")
        return found

    async def _with_stream(self, stream: StreamRef, op: Callable[[int], Awaitable[_T]]) -> _T:
        """Run ``op(stream_id)``; when a cached id turns out stale (the stream was
        deleted and made again), look the name up again and retry once."""
        was_cached = isinstance(stream, str) and stream in self._names
        stream_id = await self.stream_id(stream)
        try:
            return await op(stream_id)
        except StreamNotFound as exc:
            if not was_cached or getattr(exc, "appended_batches", None):
                raise
            assert isinstance(stream, str)
            self._names.pop(stream, None)
            try:
                fresh = await self.stream_id(stream)
            except StreamNotFound:
                raise exc from None
            if fresh == stream_id:
                raise
            return await op(fresh)

    async def delete_stream(self, stream: StreamRef) -> None:
        """Delete a stream (by name or id) and everything in it."""

        async def op(stream_id: int) -> None:
            await self._request(
                m.DeleteStreamRequest(stream_id), m.StreamDeletedResponse, safe=False
            )
            self._names = {n: i for n, i in self._names.items() if i != stream_id}

        await self._with_stream(stream, op)

    # ---- appends and reads ----------------------------------------------------------------

    async def append(
        self,
        stream: StreamRef,
        events: Iterable[EventLike],
        *,
        max_in_flight: int = 8,
        keys: Sequence[EventLike | None] | None = None,
        headers: Sequence[HeadersLike] | None = None,
    ) -> AppendResult:
        """Append events in order; returns ``(first_offset, count)``.

        More than 10,000 events or 4 MiB are split over several AppendEvents, pipelined
        (up to ``max_in_flight`` at once) on one connection. One event over 4 MiB raises
        :class:`EventTooLarge` before anything is sent. When a part fails, no later part
        is sent; the exception's ``appended_batches`` lists the parts that were stored.

        ``keys`` (a key or None per event) and ``headers`` (a mapping or (name, value)
        pairs per event) are stored with the events: they travel as AppendRecords, which
        a server advertises as the capability "records" (UsageError before anything is
        sent when it does not, or when a column is not one entry per event).
        """
        values = [to_event_bytes(e) for e in events]
        if not values:
            raise ValueError("append needs at least one event")
        key_column = header_column = None
        if keys is not None:
            key_column = [None if k is None else to_event_bytes(k) for k in keys]
        if headers is not None:
            header_column = [to_headers(h) for h in headers]
        for name, column in (("keys", key_column), ("headers", header_column)):
            if column is not None and len(column) != len(values):
                raise UsageError(f"{len(column)} {name} for {len(values)} events: one per event")
        batches = split_events(values)
        if key_column is None and header_column is None:
            parts: list[Callable[[int], m.RequestPayload]] = [
                functools.partial(_append_events, batch) for batch in batches
            ]
        else:
            if RECORDS_CAPABILITY not in await self._capabilities():
                raise UsageError(
                    f"the server at {self.address} does not take event keys or headers "
                    f"(no {RECORDS_CAPABILITY!r} capability)"
                )
            parts = []
            start = 0
            for batch in batches:
                end = start + len(batch)
                part_keys = key_column[start:end] if key_column is not None else ()
                part_headers = header_column[start:end] if header_column is not None else ()
                parts.append(functools.partial(_append_records, batch, part_keys, part_headers))
                start = end
        return await self._following_leader(
            lambda: self._with_stream(
                stream, lambda sid: self._append_batches(sid, parts, max(1, max_in_flight))
            )
        )

    async def _following_leader(self, append: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``append``; refused with NotLeader before any part was stored (a
        cluster's follower, docs/cluster.md), run it again at the leader the refusal
        names (or here again after a pause while none is named), up to ``retries``."""
        attempt = 0
        while True:
            try:
                return await append()
            except NotLeader as exc:
                if getattr(exc, "appended_batches", None) or attempt >= self.retries:
                    raise
                attempt += 1
                self.retried += 1
                if not self._follow_leader(exc):
                    await asyncio.sleep(self._backoff(attempt))

    def _follow_leader(self, error: NotLeader) -> bool:
        moved = super()._follow_leader(error)
        if moved:
            self._names.clear()  # stream ids are each node's own: look names up there
        return moved

    async def _capabilities(self) -> tuple[str, ...]:
        """The Handshake's capabilities (connecting first when not connected yet)."""
        if not self.capabilities:
            await self._ensure()
        return self.capabilities

    async def _append_batches(
        self, stream_id: int, batches: list[Callable[[int], m.RequestPayload]], max_in_flight: int
    ) -> AppendResult:
        results: list[tuple[int, int] | None] = [None] * len(batches)
        errors: list[tuple[int, BaseException]] = []
        slots = asyncio.Semaphore(max_in_flight)
        waiters: list[asyncio.Task[None]] = []
        loop = asyncio.get_running_loop()

        async def finish(
            index: int,
            conn: Connection,
            request_id: Hashable,
            future: asyncio.Future[m.ResponsePayload],
        ) -> None:
            try:
                reply = await self._answer(conn, request_id, future, "AppendEvents", safe=False)
                if isinstance(reply, m.ErrorResponse):
                    raise reply.to_exception()
                if not isinstance(reply, m.AppendEventsResponse):
                    raise ProtocolError(f"headwater answered AppendEvents with {reply!r}")
                results[index] = (reply.first_offset, reply.count)
            except BaseException as exc:
                errors.append((index, exc))
            finally:
                slots.release()

        pinned: Connection | None = None
        try:
            for index, batch in enumerate(batches):
                await slots.acquire()
                if errors:
                    slots.release()
                    break
                post = functools.partial(Connection.send, payload=batch(stream_id))
                try:
                    # Every part goes on one connection, so the parts stay in order.
                    conn, request_id, future = await self._send(post, pinned=pinned)
                except BaseException as exc:
                    slots.release()
                    errors.append((index, exc))
                    break
                pinned = conn
                waiters.append(loop.create_task(finish(index, conn, request_id, future)))
        finally:
            if waiters:
                await asyncio.gather(*waiters, return_exceptions=True)
        if errors:
            first_error = min(errors, key=lambda item: item[0])[1]
            done = [r for r in results if r is not None]
            first_error.appended_batches = done  # type: ignore[attr-defined]
            if len(batches) > 1:
                first_error.add_note(
                    f"{len(done)} of {len(batches)} parts of this append were stored: {done}"
                )
            raise first_error
        stored = [r for r in results if r is not None]
        return AppendResult(stored[0][0], sum(c for _, c in stored), stored)

    async def append_idempotent(
        self, stream: StreamRef, producer_id: int, sequence: int, events: Iterable[EventLike]
    ) -> AppendResult:
        """Append once per ``(producer_id, sequence)``: a repeat returns the original
        offsets and appends nothing, so this is retried on connection loss and on
        retryable errors. One call is one request (at most 10,000 events / 4 MiB)."""
        values = [to_event_bytes(e) for e in events]
        if not values:
            raise ValueError("append_idempotent needs at least one event")
        if len(split_events(values)) > 1:
            raise ValueError(
                f"an idempotent append is one request: at most {m.MAX_EVENTS:,} events and "
                f"{m.MAX_APPEND_BYTES:,} bytes; use one sequence number per part"
            )
        batch = m.EventBatch.of(values)

        async def op(stream_id: int) -> AppendResult:
            reply = await self._request(
                m.AppendIdempotentRequest(stream_id, producer_id, sequence, batch),
                m.AppendEventsResponse,
                safe=True,
            )
            return AppendResult(
                reply.first_offset, reply.count, [(reply.first_offset, reply.count)]
            )

        return await self._with_stream(stream, op)

    async def read(
        self, stream: StreamRef, from_offset: int = 0, max_bytes: int = DEFAULT_READ_BYTES
    ) -> ReadResult:
        """Events from ``from_offset`` until ``max_bytes`` of values (at least one event
        when there is one); it unpacks as ``events, next_offset``. The server answers
        consecutive offsets from ``from_offset``, ending before a hole in the
        stream's offsets (compaction, an aborted transaction); from inside a hole the
        answer is no events and ``next_offset`` the first offset after it, ``at_end``
        only when no event follows (docs/protocols/kimberlite.md)."""
        raw = await self.read_batch(stream, from_offset, max_bytes)
        values = raw.events.values()
        events = [Event(from_offset + i, value) for i, value in enumerate(values)]
        return ReadResult(events, raw.next_offset, raw.at_end)

    async def read_batch(
        self, stream: StreamRef, from_offset: int = 0, max_bytes: int = DEFAULT_READ_BYTES
    ) -> RawReadResult:
        """Like :meth:`read`, but the events stay in their wire form (an
        :class:`~headwater.protocols.kimberlite.EventBatch` over the answer's bytes), for
        bulk consumers that convert a whole page at once (e.g. into Arrow)."""

        async def op(stream_id: int) -> RawReadResult:
            reply = await self._request(
                m.ReadEventsRequest(stream_id, from_offset, max_bytes),
                m.ReadEventsResponse,
                safe=True,
            )
            at_end = reply.next_offset is None
            next_offset = from_offset + reply.events.count if at_end else reply.next_offset
            assert next_offset is not None
            return RawReadResult(from_offset, reply.events, next_offset, at_end)

        return await self._with_stream(stream, op)

    async def scan(
        self,
        stream: StreamRef,
        from_offset: int = 0,
        *,
        limit: int | None = None,
        max_bytes: int = DEFAULT_READ_BYTES,
    ) -> AsyncIterator[Event]:
        """Every event from ``from_offset`` to the current end (or ``limit`` events)."""
        scan = _Scan(stream, from_offset, limit)
        while scan.offset is not None:
            for event in await scan.next_page(self, max_bytes):
                yield event

    # ---- SQL ------------------------------------------------------------------------------

    async def query(self, sql: str, *params: object) -> QueryResult:
        """Run SQL (DuckDB dialect) seeing every event acknowledged before it."""
        reply = await self._request(
            m.QueryRequest(sql, [to_query_param(p) for p in params]), m.QueryResponse, safe=True
        )
        return QueryResult(reply.columns, reply.rows)

    async def query_at(self, sql: str, position: int, *params: object) -> QueryResult:
        """Run SQL over exactly the first ``position`` positions of the tenant log."""
        reply = await self._request(
            m.QueryAtRequest(sql, [to_query_param(p) for p in params], position),
            m.QueryAtResponse,
            safe=True,
        )
        return QueryResult(reply.columns, reply.rows)

    async def sync(self) -> bool:
        """Make everything the tenant wrote durable (fsync), whatever the sync policy."""
        reply = await self._request(m.SyncRequest(), m.SyncResponse, safe=True)
        return reply.success

    # ---- subscriptions --------------------------------------------------------------------

    def subscribe(
        self,
        stream: StreamRef,
        from_offset: StartOffset = 0,
        *,
        credits: int = DEFAULT_CREDITS,
        group: str | None = None,
    ) -> AsyncSubscription:
        """A live subscription (started by ``async with``, ``async for`` or ``start()``).

        ``credits`` is the flow-control window: at most that many events are pushed
        ahead of what the caller consumed; more credit is granted automatically when the
        balance falls below half. With ``group`` the consumer group's durable position
        advances only past events the caller has finished with (it asked for the next
        one), so delivery is at-least-once; ``from_offset="resume"`` continues it. The
        position moves when the caller has finished with every event received: the
        Kimberlite grant that carries it acknowledges all the server has sent, so an
        event on its way at that moment is acknowledged before it arrives (and not
        delivered again if the consumer dies before finishing it). Where that matters,
        :class:`~headwater.client.consumer.AsyncConsumer` commits exact offsets.
        """
        return AsyncSubscription(self, stream, from_offset, credits, group)


_LIVE = ("active", "detached")


class AsyncSubscription(Resumable[Connection]):
    """Events of one stream as they are appended, with automatic credit refill."""

    live_state = "active"

    def __init__(
        self,
        client: AsyncClient,
        stream: StreamRef,
        from_offset: StartOffset,
        credits: int,
        group: str | None,
    ) -> None:
        if not 1 <= credits <= MAX_CREDITS:
            raise ValueError(f"credits must be 1..{MAX_CREDITS}, not {credits}")
        if isinstance(from_offset, str):
            if from_offset not in ("latest", "resume", "earliest"):
                raise ValueError(
                    f"from_offset is an offset, 'earliest', 'latest' or 'resume', "
                    f"not {from_offset!r}"
                )
            if from_offset == "resume" and group is None:
                raise ValueError("from_offset='resume' continues a consumer group: pass group=")
        elif from_offset < 0:
            raise ValueError("from_offset must be >= 0")
        super().__init__(client)
        self._client: AsyncClient = client
        self.stream = stream
        self.group = group
        self.credits = credits
        self._from = from_offset
        self.stream_id: int | None = None
        self.subscription_id: int | None = None
        self.start_offset: int | None = None
        self.next_offset: int | None = None
        """The next offset this subscription will receive (where it re-subscribes)."""
        self._buffer: deque[Event] = deque()
        self._ready: asyncio.Event | None = None
        self._unconsumed = 0  # server-side balance + events buffered here
        self._handed = 0  # group subscriptions: events handed out, not yet finished
        self._unacknowledged = 0  # group subscriptions: finished, no grant since
        self._request_id: Hashable | None = None
        self._starting: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return (
            f"AsyncSubscription(stream={self.stream!r}, state={self._state}, "
            f"next_offset={self.next_offset})"
        )

    # ---- starting -------------------------------------------------------------------------

    async def start(self) -> AsyncSubscription:
        """Subscribe (once); raises the server's error (e.g. StreamNotFound)."""
        if self._starting is None:
            if self._state != "new":
                return self
            self._starting = asyncio.get_running_loop().create_task(self._first_subscribe())
        await asyncio.shield(self._starting)  # a failed start raises its error every time
        return self

    async def _first_subscribe(self) -> None:
        self._state = "subscribing"
        client = self._client
        client._subscriptions.add(self)  # on the loop: the client closes it with itself
        try:
            if self.group is not None and self._from == "latest":
                info = await client.stream_info(self.stream)
                self.stream_id, from_offset = info.stream_id, info.next_offset
                await self._subscribe(from_offset, self.credits)
            else:
                if self._from == "earliest":
                    from_offset = 0
                elif isinstance(self._from, str):
                    # "latest" without a group: the server starts at the end;
                    # "resume" with a group: at the group's acknowledged position.
                    from_offset = m.RESUME_GROUP_OFFSET
                else:
                    from_offset = self._from

                async def subscribe(stream_id: int) -> None:
                    self.stream_id = stream_id
                    await self._subscribe(from_offset, self.credits)

                # A name cached for a stream since deleted and made again: looked up again.
                await client._with_stream(self.stream, subscribe)
        except BaseException as exc:
            if not self.closed:
                self._state = "failed"
            client._subscriptions.discard(self)
            raise exc

    async def _subscribe(self, from_offset: int, initial: int) -> None:
        assert self.stream_id is not None

        def sent(conn: Connection, request_id: Hashable) -> None:
            self._conn, self._request_id = conn, request_id
            # Pushes may arrive before this coroutine sees the reply: count the balance
            # from the moment the request goes out.
            self._unconsumed = initial + len(self._buffer)

        reply = await self._client._request(
            m.SubscribeRequest(self.stream_id, from_offset, initial, self.group),
            m.SubscribeResponse,
            safe=True,
            route=self,
            on_sent=sent,
        )
        if self.closed:  # closed while subscribing: undo
            if self._conn is not None:
                self._conn.routes.pop(self._request_id or 0, None)
                await self._client._request_on(
                    self._conn, m.UnsubscribeRequest(reply.subscription_id)
                )
            return
        self.subscription_id = reply.subscription_id
        if self.start_offset is None:
            self.start_offset = reply.start_offset
        if self.next_offset is None or reply.start_offset > self.next_offset:
            self.next_offset = reply.start_offset
        self._state = "active"
        self._consumed(0)  # events taken while (re)subscribing may already call for credit
        self._wake()

    # ---- the connection's end (called by the client) -------------------------------------

    def _orphaned_by(self, conn: Connection) -> bool:
        return self._conn is conn and self._state in _LIVE

    async def _resubscribe(self) -> None:
        if self._state != "detached":
            return
        assert self.next_offset is not None
        self.resubscribes += 1
        await self._subscribe(self.next_offset, max(0, self.credits - len(self._buffer)))

    # ---- pushes (called by the connection) -----------------------------------------------

    def _wake(self) -> None:
        if self._ready is not None:
            self._ready.set()

    def _on_notification(self, payload: m.ResponsePayload) -> None:
        if isinstance(payload, m.SubscriptionEventsResponse):
            self._on_events(payload)
        elif isinstance(payload, m.SubscriptionClosedResponse):
            self._on_closed(payload)

    def _on_events(self, payload: m.SubscriptionEventsResponse) -> None:
        if self._state in ("closed", "failed"):
            return
        values = payload.events.values()
        start = payload.start_offset
        skip = 0
        if self.next_offset is not None and start < self.next_offset:
            skip = min(len(values), self.next_offset - start)  # already received
        self._buffer.extend(Event(start + i, values[i]) for i in range(skip, len(values)))
        end = start + len(values)
        if self.next_offset is None or end > self.next_offset:
            self.next_offset = end
        self._wake()

    def _on_closed(self, payload: m.SubscriptionClosedResponse) -> None:
        if self._state in ("closed", "failed"):
            return
        reason = payload.reason
        name = self.stream if isinstance(self.stream, str) else f"id {self.stream}"
        if reason == m.CloseReason.SERVER_SHUTDOWN:
            if self._client.reconnect:
                self._detach()
            else:
                self._fail(ConnectionLost("the server shut down and reconnect is off"))
        elif reason == m.CloseReason.BACKPRESSURE_TIMEOUT:
            self._detach()
            self._client._spawn(self._client._recover([self]))
        elif reason == m.CloseReason.STREAM_DELETED:
            self._fail(StreamNotFound(f"stream {name} was deleted"))
        elif reason == m.CloseReason.CLIENT_CANCELLED:
            self._state = "closed"
            self._wake()
        else:
            self._fail(
                SubscriptionClosed(
                    f"the server closed the subscription to {name} ({reason.name})", int(reason)
                )
            )

    # ---- consuming ------------------------------------------------------------------------

    def _consumed(self, count: int) -> None:
        self._unconsumed -= count
        self._unacknowledged += count
        if self._state != "active":
            return
        if self.group is not None:
            # A grant acknowledges everything the server sent before it, so a group
            # grants only once every event received has been handed out and finished
            # with, and then even a grant of nothing, which only acknowledges: a group
            # whose stream is quiet (its credit never runs out) still moves on.
            if self._buffer or self._handed or not self._unacknowledged:
                return
        elif self._unconsumed >= (self.credits + 1) // 2:
            return
        grant = self.credits - self._unconsumed
        conn, subscription_id = self._conn, self.subscription_id
        if grant < 0 or (grant == 0 and self.group is None):
            return
        if conn is None or subscription_id is None:
            return
        if self._client._grant(conn, subscription_id, grant):
            self._unconsumed += grant
            self._unacknowledged = 0

    async def _next_batch(
        self, max_events: int | None = None, timeout: float | None = None
    ) -> list[Event] | None:
        """Buffered events (waiting for some); [] on timeout; None once closed."""
        await self.start()
        if self._handed:
            # The caller is back for more: it has finished with the previous batch.
            finished, self._handed = self._handed, 0
            self._consumed(finished)
        if self._ready is None:
            self._ready = asyncio.Event()
        ready = self._ready
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._buffer:
            if self._error is not None:
                raise self._error
            if self._state == "closed":
                return None
            ready.clear()
            if deadline is None:
                await ready.wait()
            else:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return []
                try:
                    await asyncio.wait_for(ready.wait(), remaining)
                except TimeoutError:
                    return []
        buffer = self._buffer
        n = len(buffer) if max_events is None else max(1, min(max_events, len(buffer)))
        batch = [buffer.popleft() for _ in range(n)]
        if self.group is None:
            self._consumed(n)
        else:
            self._handed = n  # acknowledged once the caller asks for more
        return batch

    async def next_batch(
        self, max_events: int | None = None, timeout: float | None = None
    ) -> list[Event]:
        """The events received so far (at most ``max_events``), waiting for at least one;
        [] when ``timeout`` passes first or the subscription is closed."""
        batch = await self._next_batch(max_events, timeout)
        return batch or []

    async def next(self, timeout: float | None = None) -> Event | None:
        """One event, or None on timeout / once closed."""
        batch = await self._next_batch(1, timeout)
        return batch[0] if batch else None

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._drain(self._next_batch, unsubscribe=True)

    async def close(self) -> None:
        """Unsubscribe; nothing more is delivered."""
        if not self.closed:
            self._buffer.clear()
        await super().close()

    async def _unsubscribe(self, conn: Connection) -> None:
        subscription_id = self.subscription_id
        if subscription_id is not None:
            conn.routes.pop(self._request_id or 0, None)
            if conn.usable:
                await self._client._request_on(conn, m.UnsubscribeRequest(subscription_id))


@same_parameters_as(AsyncClient)
def connect_async(client: AsyncClient) -> Connecting[AsyncClient]:
    """Connect to a headwater server (Kimberlite, default 127.0.0.1:7401); the parameters
    are :class:`AsyncClient`'s. Either ``hw = await connect_async(...)`` (close it with
    ``await hw.close()``) or ``async with connect_async(...) as hw:`` (closed at the end
    of the block).

    Raises :class:`ServerUnavailable` at once when nothing answers there.
    """
    return Connecting(client)


__all__ = [
    "DEFAULT_SERVER",
    "AsyncClient",
    "AsyncSubscription",
    "EventLike",
    "StartOffset",
    "StreamRef",
    "connect_async",
    "parse_server",
    "split_events",
]
