"""The asyncio entities client: :func:`connect_async` and :class:`AsyncEntityClient`.

One ConvergeDB connection per client, as a writer (a *source*, one of the tenant's 64
slots) or read-only. What it does for its caller:

* **Buffered writes.** ``assert_``/``patch``/``retract`` encode the value at once (a
  wrong type raises there, nothing is sent) and append the op to a buffer. The buffer is
  sent ``linger`` seconds after its first op, or as soon as it holds ``batch_ops`` ops,
  as BATCH frames (a single op as its own frame), each on a stream id so the server ACKs
  it once durable. A batch the server refuses is remembered and raised by the next
  :meth:`~AsyncEntityClient.flush` (BATCH is all or nothing on the server).
* **flush()** sends the buffer, then a HEARTBEAT on a stream id: its ACK means every
  earlier write of this connection is durable and visible to readers.
* **Epochs**: ``async with client.epoch() as epoch`` begins a source epoch and ends it
  on a clean exit; ``epoch.retracted`` is how many entities the server retracted.
* **Reconnects.** When the connection breaks, the client reconnects (exponential backoff
  with jitter) with the *same source id*, so within the liveness deadline it keeps its
  entities. Batches that were not ACKed yet are sent again (at least once: they may
  have been applied already; asserts, patches and retracts are safe to repeat from one
  source). An open epoch is abandoned by the server (nothing retracted); ending it
  raises :class:`~.errors.NoEpoch`. Subscriptions subscribe again (see
  :class:`ResubscribeMode`).
* **Liveness**: a HEARTBEAT goes out whenever the connection has been silent for a
  third of the liveness deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import ssl
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from headwater.client._core import batching
from headwater.client._core.session import Connecting, Resumable, Session, same_parameters_as
from headwater.client._core.tls import PathLike, client_context
from headwater.client.errors import ClientClosed, ConnectionLost, ServerUnavailable
from headwater.errors import HeadwaterError, UsageError
from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.codes import (
    DEFAULT_LIVENESS_MS,
    MAX_PAYLOAD,
    NO_SOURCE,
    ErrorCode,
    Opcode,
)
from headwater.protocols.convergedb.fields import FieldSpec, FieldType

from ._connection import CdbConnection, NotSent
from .errors import (
    EntityError,
    NoEpoch,
    ReadOnly,
    SourceConflict,
    SubscriptionOverflow,
    error_for,
)
from .schema import (
    Entity,
    EntityEvent,
    FieldInfo,
    KeyLike,
    Kind,
    dataclass_fields,
    entity_id,
    kind_name_of,
    schema_fields,
)

DEFAULT_SERVER = "127.0.0.1:7402"
DEFAULT_PORT = 7402
DEFAULT_TIMEOUT = 30.0
DEFAULT_LINGER = 0.002
DEFAULT_BATCH_OPS = 1000
DEFAULT_BUFFER_BYTES = 8 << 20
BATCH_PAYLOAD_BYTES = 1 << 20  # a BATCH is closed at this size (the frame limit is 16 MiB)
MAX_BATCH_OPS = 0xFFFF
MAX_IN_FLIGHT_BATCHES = 1024  # unacknowledged batches before sending waits (stream ids)

T = TypeVar("T")
_C = TypeVar("_C")
_Q = TypeVar("_Q")
_A = TypeVar("_A", bound=m.Ack | m.KindAck | m.EpochEndAck | m.State)

HEARTBEAT_FLOOR_S = 0.05  # the quickest heartbeat (the server checks deadlines as often)
HEARTBEAT_CEILING_S = 30.0  # the slowest: well inside the server's idle_timeout_s
MIN_LIVENESS_MS = round(3 * HEARTBEAT_FLOOR_S * 1000)
MAX_U32 = 0xFFFF_FFFF


class ResubscribeMode(enum.Enum):
    """What a subscription does when its connection comes back after a break.

    ``FULL``: subscribe again with bootstrap; the current state of every entity comes
    again (highest version wins, so nothing is delivered twice), and entities deleted
    while the connection was down are reported as deleted. ``LIVE_ONLY``: subscribe again
    without bootstrap; changes made while the connection was down are missed.
    """

    FULL = "full"
    LIVE_ONLY = "live_only"


def _describe(op: m.WriteOp) -> str:
    return f"{op.opcode.name} (kind {op.kind_id}, entity 0x{op.entity_id.hex()[:16]}...)"


def _op_size(op: m.WriteOp) -> int:
    data = getattr(op, "field_data", b"")
    return 1 + 2 + 32 + 8 + 4 + len(data) + 2 + len(op.metadata)


@dataclass(slots=True)
class _Sent:
    """A batch on the wire, kept until its ACK (resent after a reconnect)."""

    ops: list[m.WriteOp]
    future: asyncio.Future[m.Message] | None = None
    attempts: int = 0


@dataclass(slots=True)
class _EpochState:
    conn: CdbConnection | None = None


class AsyncEntityClient(Session[CdbConnection, "AsyncEntitySubscription[Any]"]):
    """A ConvergeDB client for asyncio. Make one with :func:`connect_async`."""

    service = "ConvergeDB"
    listener = "convergedb"
    default_port = DEFAULT_PORT
    refused_hint = "is `headwater serve` running with the ConvergeDB listener?"
    closed_message = "the entities client is closed"
    # SourceConflict: the server has not yet noticed the old connection end.
    retry_on = (ServerUnavailable, SourceConflict)

    def __init__(
        self,
        server: str = DEFAULT_SERVER,
        *,
        token: str | None = None,
        name: str = "",
        source_id: int | None = None,
        read_only: bool = False,
        liveness_ms: int = 0,
        timeout: float | None = DEFAULT_TIMEOUT,
        reconnect: bool = True,
        reconnect_attempts: int = 10,
        backoff_base: float = 0.05,
        backoff_max: float = 2.0,
        linger: float = DEFAULT_LINGER,
        batch_ops: int = DEFAULT_BATCH_OPS,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        tls: bool | ssl.SSLContext = False,
        ca: PathLike | None = None,
        cert: PathLike | None = None,
        key: PathLike | None = None,
    ) -> None:
        """``tls``, ``ca``, ``cert``, ``key``: TLS and mutual TLS, as
        :class:`headwater.AsyncClient` takes them."""
        super().__init__(
            server,
            timeout,
            reconnect,
            reconnect_attempts,
            backoff_base,
            backoff_max,
            tls=client_context(tls, ca, cert, key),
        )
        if liveness_ms and not MIN_LIVENESS_MS <= liveness_ms <= MAX_U32:
            raise UsageError(
                f"liveness_ms is 0 (the server's default) or {MIN_LIVENESS_MS}..{MAX_U32},"
                f" not {liveness_ms}: the client heartbeats at most every"
                f" {HEARTBEAT_FLOOR_S * 1000:g} ms, three times a deadline"
            )
        self.token = token or ""
        self.name = name
        self.requested_source = source_id
        self.read_only = read_only
        self.liveness_ms = liveness_ms
        self.linger = linger
        self.batch_ops = max(1, min(batch_ops, MAX_BATCH_OPS))
        self.buffer_bytes = buffer_bytes
        self.source_id: int | None = None
        """The source slot the server granted (None when read-only)."""
        self.resent_batches = 0
        # The write buffer is filled from any thread (the blocking client encodes in the
        # caller's thread) and emptied on the loop.
        self._buffer_lock = threading.Lock()
        self._buffer: list[m.WriteOp] = []
        self._buffered_bytes = 0
        self._send_scheduled = False
        self._sent: dict[int, _Sent] = {}  # sequence -> batch awaiting its ACK
        self._next_batch = 0
        self._errors: list[EntityError | ConnectionLost] = []
        self._epoch = _EpochState()
        self._kinds: dict[str, Kind[Any]] = {}

    # ---- lifecycle ----------------------------------------------------------------------

    async def close(self, *, flush: bool = True) -> None:
        """Send what is buffered (``flush``: and wait until it is durable), unsubscribe and
        close the connection."""
        if self._closed:
            return
        failed: Exception | None = None
        try:
            if flush and (self._buffer or self._sent or self._errors):
                try:
                    await asyncio.wait_for(self.flush(), self.timeout)
                except Exception as exc:
                    failed = exc  # raised once the client is closed: writes were lost
        finally:
            await self._shut()
        if failed is not None:
            raise failed

    # ---- connecting ---------------------------------------------------------------------

    async def _open(self) -> CdbConnection:
        """One connection attempt, CONNECT included."""
        conn = await self._dial(lambda: CdbConnection(self._on_lost, self._on_async_error))
        # After the first CONNECT, ask for the slot we were given: within the liveness
        # deadline the server hands it back with its entities.
        source = self.source_id if self.source_id is not None else self.requested_source
        message = m.Connect(self.name, self.token, source, self.read_only, self.liveness_ms)
        reply = await self._greet(conn, lambda c: c.request(message), "CONNECT", m.ConnectAck)
        conn.source_id = reply.source_id
        self.source_id = None if reply.source_id == NO_SOURCE else reply.source_id
        # Liveness: a HEARTBEAT whenever the connection was silent for a third of the
        # deadline, and at least every HEARTBEAT_CEILING_S: the server closes a
        # connection silent for [limits] idle_timeout_s (300 s by default), whatever
        # its deadline (a week's would have lost its slot and open epoch after 300 s).
        deadline_s = (self.liveness_ms or DEFAULT_LIVENESS_MS) / 1000
        interval = min(max(HEARTBEAT_FLOOR_S, deadline_s / 3), HEARTBEAT_CEILING_S)
        self._keep_alive(conn, interval, lambda c: c.send(m.Heartbeat()), when_idle=True)
        return conn

    def _error_of(self, reply: object) -> HeadwaterError | None:
        if isinstance(reply, m.ErrorMessage):
            return error_for(reply.code, reply.ref_opcode, reply.message)
        return None

    def _connected(self, conn: CdbConnection) -> None:
        self._resend(conn)  # the batches the old connection left unacknowledged

    def _unfinished(self) -> bool:
        return bool(self._sent or self._buffer)

    def _lost_for_good(self, conn: CdbConnection) -> None:
        if self._sent:
            self._errors.append(
                ConnectionLost(
                    f"{len(self._sent)} batches were in flight when the connection was "
                    f"lost ({conn.close_reason}); they may or may not have been applied",
                    maybe_applied=True,
                )
            )
            self._sent.clear()

    async def _recovered(self) -> None:
        if self._buffer:
            await self._send_buffer()

    def _recovery_failed(self, exc: BaseException) -> None:
        if isinstance(exc, EntityError | ConnectionLost):
            self._errors.append(exc)

    def _on_async_error(self, error: m.ErrorMessage) -> None:
        # Only fire-and-forget requests fail on stream 0; this client sends none but
        # liveness HEARTBEATs, so this is the server refusing something it cannot tie
        # to a request: keep it for the next flush.
        self._errors.append(error_for(error.code, error.ref_opcode, error.message))

    # ---- requests -----------------------------------------------------------------------

    async def _call(
        self, message: m.ClientMessage, expect: type[_A], *, safe: bool, ack: bool = False
    ) -> _A:
        """Send a request and return its reply (an ERROR raises its EntityError).

        ``safe`` requests (reads) are sent again on a new connection when the old one
        breaks; the others raise ConnectionLost with ``maybe_applied``.
        """
        return await self._exchange(
            lambda conn: conn.request(message, ack=ack), message.opcode.name, expect, safe=safe
        )

    # ---- kinds --------------------------------------------------------------------------

    async def create_kind(
        self, cls: type[T], name: str | None = None, *, event_stream: bool = False
    ) -> Kind[T]:
        """Create the kind the dataclass ``cls`` declares (a no-op when it exists with the
        same fields; fields appended to the dataclass migrate it). The name is ``name``,
        else ``cls.__kind__``, else the class name."""
        kind_name, fields, specs = _declared(cls, name)
        reply = await self._call(
            m.CreateKind(kind_name, specs, event_stream), m.KindAck, safe=False
        )
        return self._bind(kind_name, cls, fields, reply, event_stream)

    async def get_kind(self, cls: type[T], name: str | None = None) -> Kind[T]:
        """The existing kind ``cls`` reads and writes: its fields must be a prefix of the
        kind's (SchemaIncompatible otherwise; KindNotFound when there is no such kind)."""
        kind_name, fields, specs = _declared(cls, name)
        reply = await self._call(m.GetKind(kind_name, specs), m.KindAck, safe=True)
        return self._bind(kind_name, cls, fields, reply, False)

    async def kind_from_schema(
        self,
        name: str,
        specs: Sequence[tuple[str, int]],
        *,
        create: bool = False,
        event_stream: bool = False,
    ) -> Kind[dict[str, Any]]:
        """A kind read and written as dicts of field values, from ``(name, type)`` pairs
        (e.g. :func:`~.catalog.describe_kind_async`'s ``specs``): resolved with GET_KIND,
        or with ``create`` made by CREATE_KIND."""
        fields = schema_fields(specs)
        wire = [FieldSpec(n, FieldType(t)) for n, t in specs]
        request: m.ClientMessage = (
            m.CreateKind(name, wire, event_stream) if create else m.GetKind(name, wire)
        )
        reply = await self._call(request, m.KindAck, safe=not create)
        return self._bind(name, dict, fields, reply, event_stream)

    def _bind(
        self, name: str, cls: type[_C], fields: Any, reply: m.KindAck, event_stream: bool
    ) -> Kind[_C]:
        kind = Kind(
            name,
            reply.kind_id,
            reply.schema_version,
            reply.field_count,
            cls,
            fields,
            event_stream,
        )
        self._kinds[name] = kind
        return kind

    # ---- writes -------------------------------------------------------------------------

    def _check_writer(self) -> None:
        if self._closed:
            raise ClientClosed("the entities client is closed")
        if self.read_only:
            raise ReadOnly(
                "this client connected read-only: connect as a source (read_only=False) to "
                "assert, patch or retract",
                Opcode.ASSERT,
            )

    def buffer_assert(self, kind: Kind[T], key: KeyLike, value: T, metadata: bytes = b"") -> bool:
        """Encode and buffer an ASSERT (any thread); True when the buffer is full."""
        self._check_writer()
        op = m.Assert(kind.kind_id, entity_id(key), kind.encode(value), bytes(metadata))
        return self._buffer_op(op)

    def buffer_patch(
        self,
        kind: Kind[Any],
        key: KeyLike,
        changes: Mapping[str, Any],
        metadata: bytes = b"",
    ) -> bool:
        self._check_writer()
        mask, data = kind.encode_patch(changes)
        op = m.Patch(kind.kind_id, entity_id(key), mask, data, bytes(metadata))
        return self._buffer_op(op)

    def buffer_retract(self, kind: Kind[Any], key: KeyLike, metadata: bytes = b"") -> bool:
        self._check_writer()
        return self._buffer_op(m.Retract(kind.kind_id, entity_id(key), bytes(metadata)))

    def _buffer_op(self, op: m.WriteOp) -> bool:
        loop = self._loop
        if loop is None:
            raise UsageError("the entities client is not connected yet")
        with self._buffer_lock:
            self._buffer.append(op)
            self._buffered_bytes += _op_size(op)
            full = self._buffered_bytes >= self.buffer_bytes
            now = len(self._buffer) % self.batch_ops == 0
            kick = now or not self._send_scheduled
            self._send_scheduled = True
        if kick:
            loop.call_soon_threadsafe(self._schedule_send, now)
        return full

    def _schedule_send(self, now: bool) -> None:
        if self._closed:
            return
        if now or self.linger <= 0:
            self._spawn(self._send_buffer())
        else:
            assert self._loop is not None
            self._loop.call_later(self.linger, lambda: self._spawn(self._send_buffer()))

    async def _send_buffer(self) -> None:
        """Send every buffered op as batches, each ACKed once durable."""
        while True:
            with self._buffer_lock:
                if not self._buffer:
                    self._send_scheduled = False
                    return
            try:
                conn = await self._ensure()
                await conn.writable()
                if len(self._sent) >= MAX_IN_FLIGHT_BATCHES:
                    await self._await_acks(conn)
                    continue
            except NotSent:
                continue
            except (ServerUnavailable, ConnectionLost, ClientClosed, EntityError) as exc:
                with self._buffer_lock:
                    dropped = len(self._buffer)
                    self._buffer.clear()
                    self._buffered_bytes = 0
                    self._send_scheduled = False
                self._errors.append(
                    ConnectionLost(f"{dropped} buffered writes were not sent: {exc}")
                    if not isinstance(exc, EntityError)
                    else exc
                )
                return
            with self._buffer_lock:
                ops, self._buffer = self._buffer, []
                self._buffered_bytes = 0
                self._send_scheduled = False
            # No await from here on: batches leave in the order the ops were made.
            for chunk in _chunks(ops, self.batch_ops):
                seq = self._next_batch
                self._next_batch += 1
                sent = _Sent(chunk)
                self._sent[seq] = sent
                self._transmit(conn, seq, sent)
            return

    async def _await_acks(self, conn: CdbConnection) -> None:
        """Backpressure: wait until the server ACKs a batch (or the connection breaks)."""
        futures = [s.future for s in self._sent.values() if s.future is not None]
        if futures:
            await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
        elif not conn.usable:
            raise NotSent()

    def _transmit(self, conn: CdbConnection, seq: int, sent: _Sent) -> None:
        message: m.ClientMessage = sent.ops[0] if len(sent.ops) == 1 else m.Batch(sent.ops)
        try:
            _, future = conn.request(message, ack=True)
        except NotSent:
            return  # stays in _sent: the reconnect sends it again
        sent.future = future
        sent.attempts += 1
        future.add_done_callback(lambda f: self._batch_done(seq, sent, f))

    def _batch_done(self, seq: int, sent: _Sent, future: asyncio.Future[m.Message]) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # Lost: kept in _sent for the reconnect to resend
        if self._sent.get(seq) is not sent or sent.future is not future:
            return
        del self._sent[seq]
        reply = future.result()
        if isinstance(reply, m.ErrorMessage):
            error = error_for(reply.code, reply.ref_opcode, reply.message)
            what = _describe(sent.ops[0])
            if len(sent.ops) > 1:
                what = f"a BATCH of {len(sent.ops)} writes (the first: {what})"
            error.message = f"{what} was refused, nothing of it applied: {reply.message}"
            error.args = (error.message,)
            self._errors.append(error)

    def _resend(self, conn: CdbConnection) -> None:
        for seq in sorted(self._sent):
            sent = self._sent[seq]
            if sent.future is not None and not sent.future.done():
                continue  # in flight on this very connection
            self.resent_batches += 1
            self._transmit(conn, seq, sent)

    async def assert_(
        self, kind: Kind[T], key: KeyLike, value: T, *, metadata: bytes = b""
    ) -> None:
        """Buffer an ASSERT: this source holds the entity and sets every field."""
        if self.buffer_assert(kind, key, value, metadata):
            await self.drain()

    async def patch(
        self,
        kind: Kind[Any],
        key: KeyLike,
        changes: Mapping[str, Any] | None = None,
        *,
        metadata: bytes = b"",
        **fields: Any,
    ) -> None:
        """Buffer a PATCH of the named fields (``changes`` and/or keyword arguments)."""
        if self.buffer_patch(kind, key, {**(changes or {}), **fields}, metadata):
            await self.drain()

    async def retract(self, kind: Kind[Any], key: KeyLike, *, metadata: bytes = b"") -> None:
        """Buffer a RETRACT: this source no longer holds the entity."""
        if self.buffer_retract(kind, key, metadata):
            await self.drain()

    async def drain(self) -> None:
        """Hand the buffer to the connection now (waiting while the socket is full)."""
        await self._send_buffer()

    async def flush(self) -> None:
        """Return once every write made before the call is durable and visible to
        readers; raise the first write the server refused since the last flush."""
        while True:
            await self._send_buffer()
            waiting = [s.future for s in self._sent.values() if s.future is not None]
            try:
                await self._call(m.Heartbeat(), m.Ack, safe=True, ack=True)
            except ConnectionLost:
                if self.reconnect and not self._closed:
                    continue
                raise
            # The batch ACKs come before the barrier's; wait for them all the same (a
            # batch resent after a reconnect has a new future: loop again for it).
            if waiting:
                await asyncio.gather(*waiting, return_exceptions=True)
            if not self._sent and not self._buffer:
                break
            if not self.reconnect:
                break
        self._raise_errors()

    def _raise_errors(self) -> None:
        if not self._errors:
            return
        first, more = self._errors[0], len(self._errors) - 1
        self._errors.clear()
        if more:
            first.add_note(f"{more} more write error(s) since the last flush were dropped")
        raise first

    # ---- epochs -------------------------------------------------------------------------

    def epoch(self) -> AsyncEpoch:
        """``async with client.epoch() as epoch:`` re-assert what this source still holds;
        on a clean exit the server retracts every entity of this source not asserted or
        patched inside the block (``epoch.retracted`` counts them). An exception leaves
        the epoch open and retracts nothing (the next epoch starts over)."""
        return AsyncEpoch(self)

    async def begin_epoch(self) -> None:
        self._check_writer()
        await self._send_buffer()
        await self._call(m.SourceEpochBegin(), m.Ack, safe=False, ack=True)
        self._epoch.conn = self._conn

    async def end_epoch(self) -> int:
        """End the open epoch; returns how many entities the server retracted."""
        self._check_writer()
        await self._send_buffer()
        started = self._epoch.conn
        self._epoch.conn = None
        if started is None or started is not self._conn:
            raise NoEpoch(
                "the connection was lost inside the epoch, so the server abandoned it and "
                "retracted nothing; run the epoch again",
                Opcode.SOURCE_EPOCH_END,
            )
        reply = await self._call(m.SourceEpochEnd(), m.EpochEndAck, safe=False, ack=True)
        await self.flush()
        return reply.retracted_count

    # ---- reads --------------------------------------------------------------------------

    async def get(self, kind: Kind[T], key: KeyLike) -> Entity[T] | None:
        """The entity's committed state, or None when it does not exist."""
        try:
            reply = await self._call(m.Query(kind.kind_id, entity_id(key)), m.State, safe=True)
        except EntityError as exc:
            if exc.cdb_code == ErrorCode.ENTITY_NOT_FOUND:
                return None
            raise
        return _entity(kind, reply)

    async def scan(self, kind: Kind[T]) -> list[Entity[T]]:
        """Every live entity of the kind, by entity id (a bootstrap, then unsubscribe)."""
        sub = self.subscribe(kind, bootstrap=True)
        async with sub:
            await sub.wait_bootstrapped()
            entities = list(sub.view.values())
        return sorted(entities, key=lambda e: e.entity_id)

    def subscribe(
        self,
        kind: Kind[T],
        *,
        bootstrap: bool = True,
        resubscribe: ResubscribeMode = ResubscribeMode.FULL,
        include_previous: bool = False,
        events: bool = False,
    ) -> AsyncEntitySubscription[T]:
        """A subscription to the kind's changes: ``async for entity in sub`` (start it
        with ``async with`` or :meth:`AsyncEntitySubscription.start`).

        ``include_previous``: an ``updated`` change carries the value before it
        (``entity.previous``). ``events``: on an event-stream kind, every write comes as
        an :class:`~.schema.EntityEvent` (``async for event in sub.events()``) instead of
        as changes; the bootstrap still comes as changes. On other kinds the server
        ignores ``events`` and sends changes."""
        return AsyncEntitySubscription(
            self, kind, bootstrap, resubscribe, include_previous=include_previous, events=events
        )


def _declared(
    cls: type[Any], name: str | None
) -> tuple[str, tuple[FieldInfo, ...], list[FieldSpec]]:
    """What the dataclass ``cls`` declares as a kind: its name (``name``, else
    ``cls.__kind__``, else the class name), its fields and their wire specs."""
    fields = dataclass_fields(cls)
    return name or kind_name_of(cls), fields, [FieldSpec(f.name, f.type) for f in fields]


def _chunks(ops: list[m.WriteOp], max_ops: int) -> list[list[m.WriteOp]]:
    chunks = batching.batches(ops, _op_size, max_ops, BATCH_PAYLOAD_BYTES)
    assert all(sum(map(_op_size, c)) < MAX_PAYLOAD for c in chunks)
    return chunks


_CHANGES = {
    m.Change.CREATED: "created",
    m.Change.UPDATED: "updated",
    m.Change.BOOTSTRAP: "bootstrap",
    m.Change.QUERY: "query",
}


def _entity(kind: Kind[T], state: m.State) -> Entity[T]:
    return Entity(
        kind.name,
        state.entity_id,
        state.version,
        kind.decode(state.field_data),
        _CHANGES[m.Change(state.change)],
        state.source_set,
        state.changed_fields,
        None if state.previous is None else kind.decode(state.previous),
        state.metadata,
    )


_OPS = {Opcode.ASSERT: "assert", Opcode.PATCH: "patch", Opcode.RETRACT: "retract"}


def _event(kind: Kind[Any], event: m.Event) -> EntityEvent:
    return EntityEvent(
        kind.name,
        event.entity_id,
        _OPS[Opcode(event.op)],
        event.source_id,
        event.sequence,
        kind.decode_present(event.presence_mask, event.field_data),
        event.presence_mask,
        event.metadata,
    )


class AsyncEpoch:
    """A source epoch as an async context manager (see :meth:`AsyncEntityClient.epoch`)."""

    def __init__(self, client: AsyncEntityClient) -> None:
        self._client = client
        self.retracted: int | None = None

    async def __aenter__(self) -> AsyncEpoch:
        await self._client.begin_epoch()
        return self

    async def __aexit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.retracted = await self._client.end_epoch()


@dataclass(slots=True)
class _Bootstrap:
    seen: set[bytes] = field(default_factory=set)
    full_again: bool = False  # a re-bootstrap after a reconnect: report deletions missed


class AsyncEntitySubscription(Resumable[CdbConnection], Generic[T]):
    """Changes of one kind, highest version first-class.

    Every notification is applied to :attr:`view` (entity id -> latest Entity) only when
    its version is higher than what the subscription has seen for that entity, so the
    bootstrap racing live changes, and a bootstrap repeated after a reconnect, deliver
    each state at most once and never go back in time. Iterating yields the accepted
    changes: Entity objects whose ``change`` is ``bootstrap``, ``created``, ``updated``
    or ``deleted`` (``value`` None).

    With ``events`` on an event-stream kind, the server sends each write as an EVENT
    instead of a change: :meth:`events` yields them as :class:`~.schema.EntityEvent` in
    the kind's sequence order. They do not touch :attr:`view` (an op is not a state), so
    the view then holds the bootstrap only. EVENTs sent while the connection was down are
    not sent again after a reconnect: the gap shows in ``sequence``.
    """

    def __init__(
        self,
        client: AsyncEntityClient,
        kind: Kind[T],
        bootstrap: bool,
        resubscribe: ResubscribeMode,
        *,
        include_previous: bool = False,
        events: bool = False,
    ) -> None:
        super().__init__(client)  # states: new, live, detached, closed, failed
        self._client: AsyncEntityClient = client
        self.kind = kind
        self.bootstrap = bootstrap
        self.resubscribe_mode = resubscribe
        self.include_previous = include_previous
        self.events_requested = events
        self.view: dict[bytes, Entity[T]] = {}
        self._versions: dict[bytes, int] = {}  # deleted entities too, until bootstrap end
        self._queue: deque[Entity[T]] = deque()
        self._wakeup = asyncio.Event()
        self._events: deque[EntityEvent] = deque()
        self._events_wakeup = asyncio.Event()
        self._bootstrapped = asyncio.Event()
        self._bootstrap: _Bootstrap | None = None
        self._stream_id = 0

    def __repr__(self) -> str:
        return (
            f"<AsyncEntitySubscription kind={self.kind.name} state={self._state} "
            f"entities={len(self.view)}>"
        )

    async def start(self) -> AsyncEntitySubscription[T]:
        if self._state == "new":
            self._client._subscriptions.add(self)
            try:
                await self._subscribe(resubscribe=False)
            except BaseException:
                self._client._subscriptions.discard(self)
                self._state = "failed"
                raise
        return self

    async def _subscribe(self, *, resubscribe: bool) -> None:
        client = self._client
        if self.closed:
            return
        full = self.bootstrap if not resubscribe else self.resubscribe_mode is ResubscribeMode.FULL
        message = m.Subscribe(
            self.kind.kind_id,
            bootstrap=full,
            include_previous=self.include_previous,
            events=self.events_requested,
        )

        def post(conn: CdbConnection) -> tuple[int, asyncio.Future[m.Message]]:
            try:
                return conn.request(message, route=self)
            except UsageError as exc:
                raise UsageError(
                    f"kind {self.kind.name} already has a subscription on this client: {exc}"
                ) from None

        def sent(conn: CdbConnection, stream_id: Hashable) -> None:
            assert isinstance(stream_id, int)
            self._conn, self._stream_id = conn, stream_id
            self._bootstrap = _Bootstrap(full_again=resubscribe) if full else None

        await client._exchange(post, "SUBSCRIBE", m.Ack, safe=True, on_sent=sent)
        if self._state in ("new", "detached"):
            self._state = "live"
        if resubscribe:
            self.resubscribes += 1
        if not full:
            self._bootstrapped.set()

    # ---- notifications ------------------------------------------------------------------

    def _on_notification(self, message: m.Message) -> None:
        if self._state not in ("live", "new", "detached"):
            return
        if isinstance(message, m.State):
            self._accept(message.entity_id, message.version, lambda: _entity(self.kind, message))
        elif isinstance(message, m.Deleted):
            self._accept(
                message.entity_id,
                message.version,
                lambda: Entity(self.kind.name, message.entity_id, message.version, None, "deleted"),
            )
        elif isinstance(message, m.Event):
            self._events.append(_event(self.kind, message))
            self._events_wakeup.set()
        elif isinstance(message, m.BootstrapBegin):
            pass
        elif isinstance(message, m.BootstrapEnd):
            self._end_bootstrap()
        elif isinstance(message, m.ErrorMessage):
            error = error_for(message.code, message.ref_opcode, message.message)
            if isinstance(error, SubscriptionOverflow) and self._client.reconnect:
                return  # the server closes the connection next: we resubscribe after it
            self._fail(error)

    def _accept(self, eid: bytes, version: int, make: Callable[[], Entity[T]]) -> None:
        if self._bootstrap is not None:
            self._bootstrap.seen.add(eid)
        if version <= self._versions.get(eid, -1):
            return  # stale: a newer state (or the deletion) is already known
        entity = make()
        self._versions[eid] = version
        if entity.value is None:
            self.view.pop(eid, None)
        else:
            self.view[eid] = entity
        self._queue.append(entity)
        self._wakeup.set()

    def _end_bootstrap(self) -> None:
        boot, self._bootstrap = self._bootstrap, None
        if boot is not None and boot.full_again:
            # Entities we knew that neither the new bootstrap nor a live change since the
            # resubscribe mentioned were deleted while the connection was down.
            for eid in [e for e in self.view if e not in boot.seen]:
                old = self.view.pop(eid)
                self._queue.append(Entity(self.kind.name, eid, old.version, None, "deleted"))
                self._wakeup.set()
        # Tombstones only guard against bootstrap states older than a deletion.
        self._versions = {eid: self._versions[eid] for eid in self.view}
        self._bootstrapped.set()
        self._wakeup.set()

    # ---- the connection's end (called by the client) -----------------------------------

    def _detach(self) -> None:
        if self._state in ("live", "new"):
            self._state = "detached"
            self._conn = None

    async def _resubscribe(self) -> None:
        await self._subscribe(resubscribe=True)

    def _wake(self) -> None:
        self._bootstrapped.set()
        self._wakeup.set()
        self._events_wakeup.set()

    # ---- consuming ----------------------------------------------------------------------

    async def wait_bootstrapped(self, timeout: float | None = None) -> None:
        """Return once the bootstrap is complete (:attr:`view` holds every entity)."""
        await asyncio.wait_for(self._bootstrapped.wait(), timeout)
        if self._error is not None and not self._queue:
            raise self._error

    @property
    def bootstrapped(self) -> bool:
        return self._bootstrapped.is_set()

    async def next_batch(self, timeout: float | None = None) -> list[Entity[T]]:
        """The changes accepted so far (waiting for one); [] on timeout or once closed.
        A subscription the server ended raises its error once the changes before it are
        taken."""
        return await self._take(self._queue, self._wakeup, timeout)

    async def _take(
        self, queue: deque[_Q], wakeup: asyncio.Event, timeout: float | None
    ) -> list[_Q]:
        """Everything in ``queue`` (waiting on ``wakeup`` while it is empty)."""
        if not queue:
            if self._state == "failed" and self._error is not None:
                raise self._error
            if self._state == "closed":
                return []
            wakeup.clear()
            try:
                await asyncio.wait_for(wakeup.wait(), timeout)
            except TimeoutError:
                return []
        taken = list(queue)
        queue.clear()
        if not taken and self._state == "failed" and self._error is not None:
            raise self._error
        return taken

    async def next(self, timeout: float | None = None) -> Entity[T] | None:
        """The next accepted change, None on timeout or once closed."""
        if not self._queue:
            self._queue.extend(await self.next_batch(timeout))
        return self._queue.popleft() if self._queue else None

    def __aiter__(self) -> AsyncIterator[Entity[T]]:
        return self._drain(self.next_batch, unsubscribe=False)

    async def next_events(self, timeout: float | None = None) -> list[EntityEvent]:
        """The EVENTs received so far (waiting for one); [] on timeout or once closed. A
        subscription the server ended raises its error once the events before it are
        taken."""
        return await self._take(self._events, self._events_wakeup, timeout)

    def events(self) -> AsyncIterator[EntityEvent]:
        """``async for event in sub.events()``: the EVENTs of an event-stream kind
        subscribed with ``events=True``, until the subscription is closed."""
        return self._drain(self.next_events, unsubscribe=False)

    async def _unsubscribe(self, conn: CdbConnection) -> None:
        if not conn.usable:
            return
        with contextlib.suppress(UsageError):
            unsubscribe = m.Unsubscribe(self.kind.kind_id)
            await self._client._best_effort(conn, lambda c: c.request(unsubscribe))
        conn.routes.pop(self._stream_id, None)


@same_parameters_as(AsyncEntityClient)
def connect_async(client: AsyncEntityClient) -> Connecting[AsyncEntityClient]:
    """Connect to the ConvergeDB listener (default 127.0.0.1:7402) as a source (a writer
    slot: ``source_id`` or the lowest free one) or ``read_only``; the parameters are
    :class:`AsyncEntityClient`'s. ``client = await connect_async(...)``, or
    ``async with connect_async(...) as client:`` (flushed and closed at the end)."""
    return Connecting(client)
