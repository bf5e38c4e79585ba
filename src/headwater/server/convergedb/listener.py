"""The asyncio shell of the ConvergeDB front end (127.0.0.1:7402).

Frames are handled in arrival order, one connection at a time, by plain calls into the
kind engine: writes apply at once (they are checked first, a BATCH as a whole), and an
ACK that waits for durability is sent from a callback of the write's window, so a
connection keeps streaming while its windows commit. Only CREATE_KIND waits (for the
registry to be persisted); reading pauses meanwhile, so later frames see the new kind.

Subscriptions: the live subscription is registered before a bootstrap scans the state.
Live notifications go out from a pump task that waits whenever the socket's write buffer
is full; the engine keeps at most ``live_buffer`` (4,096) notifications behind a pump,
past that the subscriber gets ERROR SUBSCRIPTION_OVERFLOW and is disconnected. The
bootstrap is read from the state at the socket's pace (backpressure, no buffer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, cast

from headwater.engine.kinds import (
    KindSubscription,
    Source,
    SubscriptionOverflow,
    TenantKinds,
    Window,
)
from headwater.errors import AuthenticationFailed, HeadwaterError, InternalError
from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.codes import NO_SOURCE, ErrorCode, Opcode
from headwater.protocols.convergedb.connection import Close, Reject, Reply, ServerConnection
from headwater.protocols.convergedb.errors import error_code_for
from headwater.protocols.convergedb.notifications import encode_window
from headwater.protocols.convergedb.ops import from_wire
from headwater.protocols.convergedb.replies import bootstrap_frames, kind_ack, query_state
from headwater.server.app import Listener
from headwater.server.metrics import metrics_for
from headwater.server.tcp import ConnectionGuard, start_tcp_listener, without_nagle

if TYPE_CHECKING:
    from headwater.server.app import Server

log = logging.getLogger("headwater.convergedb")

OVERFLOW_LINGER_S = 10.0  # how long an overflowed subscriber may take to read its ERROR
BOOTSTRAP_CHUNK = 256  # bootstrap STATEs written between waits for the socket


class _Subscription:
    def __init__(self, stream_id: int, sub: KindSubscription) -> None:
        self.stream_id = stream_id
        self.sub = sub
        self.tasks: list[asyncio.Task[None]] = []


def _failure(window: Window) -> HeadwaterError | None:
    """Why the finished ``window`` failed, as the error its writers are answered with
    (e.g. in a cluster, replicas that did not confirm); None when it is durable."""
    exc = window.failure()
    if exc is None or isinstance(exc, HeadwaterError):
        return exc
    return InternalError("the write could not be made durable")


class ConvergeConnection(asyncio.Protocol):
    def __init__(self, server: Server, connections: set[ConvergeConnection]) -> None:
        self.server = server
        self.protocol = ServerConnection()
        self.metrics = metrics_for(server)
        self.transport: asyncio.Transport | None = None
        self.tenant: TenantKinds | None = None
        self.source: Source | None = None
        self.subscriptions: dict[int, _Subscription] = {}  # kind_id ->
        self.tasks: set[asyncio.Task[None]] = set()
        # The windows this connection wrote into since the last HEARTBEAT barrier,
        # oldest first. A tenant's windows commit in order, so only the last two can be
        # unfinished: a finished one is noted (``_lost``) and dropped as the next comes.
        self._windows: deque[Window] = deque()
        # The first write of this connection lost since a barrier last said so: a
        # fire-and-forget write (stream 0) is told of no other way.
        self._lost: HeadwaterError | None = None
        self.peer = "?"
        self._connections = connections
        self._writable = asyncio.Event()
        self._writable.set()
        self._blocked = False
        self.closed = False
        self.guard = ConnectionGuard(server.limits, "convergedb", self)

    # ---- transport callbacks --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        if not self.guard.admit(self.transport):
            return
        without_nagle(self.transport)
        self.peer = self.guard.peer
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.guard.release()
        self._connections.discard(self)
        self._writable.set()
        for entry in list(self.subscriptions.values()):
            self._end_subscription(entry)
        self.subscriptions.clear()
        if self.source is not None:
            self.source.disconnect()
        for task in list(self.tasks):
            task.cancel()

    def pause_writing(self) -> None:
        # A client that does not read its answers is not read from either: what it
        # sends waits in the kernel, not here as answers (a 44-byte QUERY can answer
        # megabytes). Frames already received wait in the decoder (one read's worth);
        # the peer's EOF is read after them, as reading resumes only to take them up.
        self._writable.clear()
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._writable.set()
        if self.closed or self.transport is None:
            return
        if not self._blocked:
            self.transport.resume_reading()
            self._process()

    def data_received(self, data: bytes) -> None:
        if self.source is not None:
            self.source.touch()
        self.protocol.feed(data)
        self._process()
        self.guard.received()

    def eof_received(self) -> bool | None:
        # The peer sends no more but may still read: let the ACKs of what it wrote go
        # out (one window at most), then close.
        for event in self.protocol.receive_eof():
            if isinstance(event, Close):
                self.close(abort=True)
                return None
        tenant = self.tenant

        async def finish() -> None:
            with contextlib.suppress(Exception):
                if tenant is not None:
                    await tenant.barrier()
                await asyncio.sleep(0)  # the ACK callbacks of the window run first
            self.close()

        self._spawn(finish())
        return True

    def _process(self) -> None:
        while not self._blocked and not self.closed and self._writable.is_set():
            event = self.protocol.next_event()
            if event is None:
                return
            if isinstance(event, m.Frame):
                waiting = self._handle_frame(event)
                if waiting is not None:
                    self._block_on(waiting)
            elif isinstance(event, Reply):
                self.write(event.data)
            elif isinstance(event, Reject):
                log.warning("rejecting %s: %s", self.peer, event.reason)
                self.write(event.data)
                self.close()
            elif isinstance(event, Close):
                log.warning("closing %s: %s", self.peer, event.reason)
                self.close(abort=True)

    def _block_on(self, waiting: Awaitable[None]) -> None:
        self._blocked = True
        if self.transport is not None:
            self.transport.pause_reading()

        async def run() -> None:
            try:
                await waiting
            finally:
                self._blocked = False
                # Writing paused meanwhile: resume_writing reads on.
                if not self.closed and self.transport is not None and self._writable.is_set():
                    self.transport.resume_reading()
                    self._process()

        self._spawn(run())

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # ---- requests -------------------------------------------------------------------

    def _handle_frame(self, frame: m.Frame) -> Awaitable[None] | None:
        msg, stream = frame.message, frame.stream_id
        try:
            if isinstance(msg, m.Connect):
                self._connect(stream, msg)
                return None
            tenant = self.tenant
            if tenant is None:  # a refused CONNECT: frames behind it were let through
                self.error(stream, ErrorCode.NOT_CONNECTED, msg.opcode, "CONNECT must come first")
                return None
            if isinstance(msg, m.Assert | m.Patch | m.Retract):
                self._write_ops(tenant, stream, msg.opcode, [msg])
            elif isinstance(msg, m.Batch):
                self._write_ops(tenant, stream, msg.opcode, msg.ops)
            elif isinstance(msg, m.Heartbeat):
                if stream:
                    # What this connection wrote before it is the barrier's now, taken
                    # as the frame is read (a later write is the next barrier's).
                    self._spawn(self._barrier(tenant, stream, *self._take_written()))
            elif isinstance(msg, m.Query):
                self._query(tenant, stream, msg)
            elif isinstance(msg, m.Subscribe):
                self._subscribe(tenant, stream, msg)
            elif isinstance(msg, m.Unsubscribe):
                entry = self.subscriptions.pop(msg.kind_id, None)
                if entry is not None:
                    self._end_subscription(entry)
                self.send(stream, m.Ack(Opcode.UNSUBSCRIBE))
            elif isinstance(msg, m.SourceEpochBegin):
                tenant.begin_epoch(self._source())
                if stream:
                    self.send(stream, m.Ack(Opcode.SOURCE_EPOCH_BEGIN))
            elif isinstance(msg, m.SourceEpochEnd):
                count, window = tenant.end_epoch(self._source())
                self._wrote(window)  # its retractions are this connection's writes
                if stream:
                    self._ack_when(window, stream, m.EpochEndAck(count), Opcode.SOURCE_EPOCH_END)
            elif isinstance(msg, m.CreateKind):
                return self._create_kind(tenant, stream, msg)
            elif isinstance(msg, m.GetKind):
                self.send(stream, kind_ack(Opcode.GET_KIND, tenant.get_kind(msg.name, msg.fields)))
        except HeadwaterError as exc:
            self._fail(stream, msg.opcode, exc)
        except Exception as exc:
            log.exception("%s failed for %s", msg.opcode.name, self.peer)
            self._fail(stream, msg.opcode, InternalError(f"internal error: {exc}"))
        return None

    def _fail(self, stream: int, opcode: int, exc: HeadwaterError) -> None:
        self.metrics.record_error("convergedb", exc)
        self.error(stream, error_code_for(exc), opcode, exc.message)

    def _source(self) -> Source:
        assert self.source is not None
        return self.source

    def _connect(self, stream: int, msg: m.Connect) -> None:
        api = self.server.api
        try:
            principal = api.authenticate(msg.auth_token or None)
        except AuthenticationFailed:
            self.error(stream, ErrorCode.AUTH_FAILED, Opcode.CONNECT, "unknown auth token")
            return
        try:
            tenant = api.kinds(principal.default_tenant)
            source = tenant.connect(
                msg.name,
                source_id=msg.source_id,
                read_only=msg.read_only,
                deadline_ms=msg.deadline_ms,  # 0 means the contract's 30,000 ms
                on_dead=self._source_dead,
            )
        except HeadwaterError as exc:
            self._fail(stream, Opcode.CONNECT, exc)
            return
        self.tenant, self.source = tenant, source
        self.guard.authenticated()
        self.send(stream, m.ConnectAck(NO_SOURCE if source.source_id is None else source.source_id))

    def _source_dead(self) -> None:
        log.info("%s: source silent past its liveness deadline, closing", self.peer)
        self.close()

    def _write_ops(
        self,
        tenant: TenantKinds,
        stream: int,
        opcode: Opcode,
        ops: Sequence[m.WriteOp],
    ) -> None:
        engine_ops = from_wire(ops, tenant.kind)
        window = tenant.apply(self._source(), engine_ops)
        self._wrote(window)
        if stream:
            self._ack_when(window, stream, m.Ack(opcode), opcode)

    def _ack_when(self, window: Window, stream: int, ack: m.Message, opcode: Opcode) -> None:
        def done(_: asyncio.Future[None]) -> None:
            failed = _failure(window)
            if failed is None:
                self.send(stream, ack)
            else:
                self.error(stream, error_code_for(failed), opcode, failed.message)

        if window.done.done():
            done(window.done)
        else:
            window.done.add_done_callback(done)

    def _wrote(self, window: Window) -> None:
        """Note that this connection wrote into ``window``."""
        if not self._windows or self._windows[-1] is not window:
            self._note_finished()
            self._windows.append(window)

    def _note_finished(self) -> None:
        """Drop the finished windows of :attr:`_windows`, noting the first that failed."""
        windows = self._windows
        while windows and windows[0].done.done():
            lost = _failure(windows.popleft())
            if lost is not None and self._lost is None:
                self._lost = lost

    def _take_written(self) -> tuple[list[Window], HeadwaterError | None]:
        """The windows this connection wrote into since the last barrier, and the first
        of its writes noted lost since: a new barrier's to answer for, each barrier for
        its own (a loss is not told to a barrier sent before the write, nor twice)."""
        self._note_finished()
        windows, lost = list(self._windows), self._lost
        self._windows.clear()
        self._lost = None
        return windows, lost

    async def _barrier(
        self,
        tenant: TenantKinds,
        stream: int,
        windows: list[Window],
        lost: HeadwaterError | None,
    ) -> None:
        """HEARTBEAT on a non-zero stream: ACK once everything written before it is
        durable; an ERROR instead when a write of this connection before it (and after
        the last barrier) was lost: the tenant's newest window can be durable after one
        that failed. ``windows`` and ``lost`` are from :meth:`_take_written`."""
        try:
            await tenant.barrier()
        except HeadwaterError as exc:
            self.error(
                stream, error_code_for(exc), Opcode.HEARTBEAT, f"barrier failed: {exc.message}"
            )
            return
        except Exception as exc:
            self.error(stream, ErrorCode.INTERNAL, Opcode.HEARTBEAT, f"barrier failed: {exc}")
            return
        # A tenant's windows finish in order, so these are finished; waited for anyway.
        unfinished = [w.done for w in windows if not w.done.done()]
        if unfinished:
            await asyncio.wait(unfinished)
        for window in windows:
            if lost is not None:
                break
            lost = _failure(window)
        if lost is not None:
            self.error(
                stream, error_code_for(lost), Opcode.HEARTBEAT, f"barrier failed: {lost.message}"
            )
        else:
            self.send(stream, m.Ack(Opcode.HEARTBEAT))

    async def _create_kind(self, tenant: TenantKinds, stream: int, msg: m.CreateKind) -> None:
        try:
            kind = await tenant.create_kind(msg.name, msg.fields, event_stream=msg.event_stream)
        except HeadwaterError as exc:
            self._fail(stream, Opcode.CREATE_KIND, exc)
            return
        except Exception as exc:
            log.exception("CREATE_KIND failed")
            self._fail(stream, Opcode.CREATE_KIND, InternalError(str(exc)))
            return
        self.send(stream, kind_ack(Opcode.CREATE_KIND, kind))

    def _query(self, tenant: TenantKinds, stream: int, msg: m.Query) -> None:
        kind = tenant.kind(msg.kind_id)
        state = tenant.get(msg.kind_id, msg.entity_id)
        if state is None:
            self.error(stream, ErrorCode.ENTITY_NOT_FOUND, Opcode.QUERY, "no such entity")
            return
        self.send(stream, query_state(kind, state))

    # ---- limits ---------------------------------------------------------------------

    def refusal(self, limit: str, message: str) -> bytes:
        return self.protocol.send_error(0, ErrorCode.LIMIT_EXCEEDED, Opcode.CONNECT, message)

    def busy(self) -> bool:
        return bool(self.subscriptions or self.tasks)

    # ---- subscriptions --------------------------------------------------------------

    def _subscribe(self, tenant: TenantKinds, stream: int, msg: m.Subscribe) -> None:
        if msg.kind_id in self.subscriptions:
            text = f"kind {msg.kind_id} is already subscribed on this connection"
            self.error(stream, ErrorCode.BAD_FRAME, Opcode.SUBSCRIBE, text)
            return
        limit = self.server.config.limits.max_subscriptions_per_connection
        if len(self.subscriptions) >= limit:
            self.server.limits.refused("max_subscriptions_per_connection", "convergedb")
            text = (
                f"this connection has {limit} subscriptions, the most"
                " limits.max_subscriptions_per_connection allows: unsubscribe one first"
            )
            self.error(stream, ErrorCode.LIMIT_EXCEEDED, Opcode.SUBSCRIBE, text)
            return
        sub = tenant.subscribe(
            msg.kind_id, include_previous=msg.include_previous, events=msg.events
        )  # live first: the bootstrap scan below then misses nothing
        entry = _Subscription(stream, sub)
        self.subscriptions[msg.kind_id] = entry
        self.send(stream, m.Ack(Opcode.SUBSCRIBE))
        entry.tasks.append(self._spawn(self._pump(entry)))
        if msg.bootstrap:
            entry.tasks.append(self._spawn(self._bootstrap(tenant, entry)))

    async def _pump(self, entry: _Subscription) -> None:
        sub, stream = entry.sub, entry.stream_id
        include_previous = sub.include_previous
        try:
            while not self.closed:
                windows = await sub.next_windows()
                if not windows:
                    return
                if self.transport is None or self.closed:
                    return
                self.transport.writelines(
                    [encode_window(stream, notes, include_previous) for notes in windows]
                )
                await self._writable.wait()
        except SubscriptionOverflow as exc:
            log.info("%s: subscription overflow, disconnecting", self.peer)
            self.metrics.record_error("convergedb", exc)
            self.error(stream, ErrorCode.SUBSCRIPTION_OVERFLOW, Opcode.SUBSCRIBE, exc.message)
            transport = self.transport
            self.close()  # the ERROR goes out first if the peer reads at all
            if transport is not None:
                asyncio.get_running_loop().call_later(OVERFLOW_LINGER_S, transport.abort)

    async def _bootstrap(self, tenant: TenantKinds, entry: _Subscription) -> None:
        kind_id, stream = entry.sub.kind_id, entry.stream_id
        kind = tenant.kind(kind_id)
        self.send(stream, m.BootstrapBegin(kind_id))
        batch: list[bytes] = []
        for frame in bootstrap_frames(stream, kind, tenant.scan(kind_id)):
            batch.append(frame)
            if len(batch) >= BOOTSTRAP_CHUNK:
                if self.closed or self.transport is None:
                    return
                self.transport.writelines(batch)
                batch = []
                await asyncio.sleep(0)  # let writers and live pushes run between chunks
                await self._writable.wait()
        if not self.closed and self.transport is not None:
            self.transport.writelines(batch)
            self.send(stream, m.BootstrapEnd(kind_id))

    def _end_subscription(self, entry: _Subscription) -> None:
        entry.sub.close()
        for task in entry.tasks:
            task.cancel()

    # ---- output ---------------------------------------------------------------------

    def send(self, stream: int, message: m.Message) -> None:
        self.write(self.protocol.send(stream, message))

    def error(self, stream: int, code: int, ref_opcode: int, text: str) -> None:
        self.write(self.protocol.send_error(stream, code, ref_opcode, text[:1000]))

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def close(self, *, abort: bool = False) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self._writable.set()
            if abort:
                self.transport.abort()
            else:
                self.transport.close()


async def start_convergedb(server: Server, host: str, port: int) -> Listener:
    connections: set[ConvergeConnection] = set()

    async def drain() -> None:
        with contextlib.suppress(Exception):
            await server.api.flush_kinds()  # pending ACKs go out before the sockets close
        await asyncio.sleep(0)  # and the transports take them

    return await start_tcp_listener(
        server,
        "convergedb",
        host,
        port,
        lambda: ConvergeConnection(server, connections),
        connections,
        subscriptions=lambda: sum(len(c.subscriptions) for c in connections),
        drain=drain,
    )
