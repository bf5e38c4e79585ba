"""The asyncio shell of the Ripple front end (127.0.0.1:7403): pipeline workers publish
deltas into entity kinds (spec/PROTOCOLS.md §4, docs/protocols/ripple.md).

Each connection is one worker holding one source slot in its tenant's kinds (as a
ConvergeDB writer does), so a Remove clears only its own bit. The worker's credential
comes first: the token in headwater's Handshake extension (FLAG_HANDSHAKE_AUTH) goes
through the one auth rule (EngineAPI.authenticate), and the worker writes to the tenant
it names (or the lowest its token grants, 0 without one). With ``[auth] required`` a
worker without a valid credential is refused before it can create, migrate or write a
kind or take a source slot. The Handshake's outputs
are checked against the kinds of the same names: a kind is created when absent and
migrated when the schema appends fields; anything else is refused with the reasons.
A Delta becomes an assert (Set), patch (Patch) or retract (Remove) of the entity whose
id is the key (UTF-8 bytes zero-padded to 32, or their SHA-256 when longer).

Per (worker, output) two sequence numbers are kept: the last *received*, which drops
redelivered deltas (a jump counts as a gap), and the last *durable*: a connection
advances it when the coalescing window holding its deltas is committed, in the order
it wrote into them. Only durable numbers are saved (write-temp, fsync, rename: at
every checkpoint and when the listener stops) and acknowledged, so no checkpoint
covers a write the kinds lost. When a window of a connection fails, the worker's
received numbers go back to its durable ones and the connection is closed (its
Checkpoint_requests unanswered): the worker reconnects and resends what it has not had
acknowledged, and the resend is applied. A connection's end rewinds the same way, as
its last windows may still fail. A delta applied twice (a resend of a write already
durable, or after a crash between checkpoints) changes nothing: Set, Patch and Remove
give the same state applied twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import weakref
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from headwater.api import Principal
from headwater.engine.kinds import (
    KindInfo,
    KindNotFound,
    KindsError,
    Source,
    TenantKinds,
    Window,
    WriteOp,
    assert_op,
    patch_op,
    retract_op,
)
from headwater.engine.kinds.fields import FieldType, default_value
from headwater.errors import AuthenticationFailed, NotEnoughReplicas, NotLeader, TenantNotFound
from headwater.protocols.ripple import connection as rc
from headwater.protocols.ripple import messages as rm
from headwater.protocols.ripple.bin_prot import DecodeError
from headwater.server.app import Listener
from headwater.server.metrics import metrics_for
from headwater.server.tcp import ConnectionGuard, start_tcp_listener
from headwater.server.tls import peer_common_name
from headwater.storage.metadata import read_json, write_json_atomic

if TYPE_CHECKING:
    from headwater.server.app import Server

log = logging.getLogger("headwater.ripple")

KIND_TYPES = {
    rm.FieldType.STRING: FieldType.STRING,
    rm.FieldType.INT: FieldType.I64,
    rm.FieldType.INT64: FieldType.I64,
    rm.FieldType.FLOAT: FieldType.F64,
    rm.FieldType.BOOL: FieldType.BOOL,
}


def entity_id_for(key: bytes) -> bytes:
    """§4: the key's bytes zero-padded to 32, or their SHA-256 when longer."""
    return key.ljust(32, b"\0") if len(key) <= 32 else hashlib.sha256(key).digest()


STATES: weakref.WeakKeyDictionary[Server, RippleStates] = weakref.WeakKeyDictionary()
"""The Ripple state of each running server (for the HTTP API)."""


class RippleError(Exception):
    """A delta the kind cannot take; the worker is told why and disconnected."""


class RippleState:
    """What outlives a connection, per tenant: sequence numbers, source slots,
    watermarks, heartbeats, counters."""

    def __init__(self, tenant_id: int, path: Path, live: set[RippleConnection]) -> None:
        self.tenant_id = tenant_id
        self.path = path
        # Received: drops redeliveries. Durable: what the table saves and checkpoints ack.
        self.tracker = rc.SequenceTracker()
        self.durable: dict[tuple[str, str], int] = {}
        self.slots: dict[str, int] = {}  # worker id -> its source slot in the tenant's kinds
        if path.exists():
            for entry in read_json(path).get("sequences", []):
                key = (str(entry["worker"]), str(entry["output"]))
                self.durable[key] = int(entry["last"])
                self.tracker.observe(key, int(entry["last"]))
            self.slots = {str(w): int(slot) for w, slot in read_json(path).get("slots", {}).items()}
        self.tracker.duplicates = self.tracker.gaps = 0
        self.watermarks: dict[tuple[str, str], int] = {}
        self.heartbeats: dict[str, tuple[float, float]] = {}  # worker -> (when, load)
        self.applied = 0
        self.live = live  # every tenant's connections (the listener's)
        self.writing: set[RippleConnection] = set()  # those with windows not yet settled
        self._saving = asyncio.Lock()

    def workers(self) -> list[dict[str, Any]]:
        """Every worker seen: its slot, connection, last heartbeat and outputs (the HTTP
        API's /api/ripple/workers)."""
        connected = {
            c.protocol.worker_id for c in self.live if c.source is not None and c.state is self
        }
        outputs: dict[str, list[dict[str, Any]]] = {}
        # Those durable but no longer received too: a connection's end rewinds the
        # received numbers to the durable ones (none yet: forgotten) before its last
        # windows commit and make theirs durable.
        received = dict(cast(list[tuple[tuple[str, str], int]], self.tracker.items()))
        for (worker, output), durable in self.durable.items():
            received.setdefault((worker, output), durable)
        for (worker, output), last in received.items():
            outputs.setdefault(worker, []).append(
                {
                    "output": output,
                    "last_sequence_no": last,
                    "durable_sequence_no": self.durable.get((worker, output), 0),
                    "watermark_ns": self.watermarks.get((worker, output)),
                }
            )
        names = sorted(set(self.slots) | set(outputs) | set(self.heartbeats))
        result = []
        for worker in names:
            beat = self.heartbeats.get(worker)
            result.append(
                {
                    "tenant_id": self.tenant_id,
                    "worker_id": worker,
                    "connected": worker in connected,
                    "source_id": self.slots.get(worker),
                    "last_heartbeat": None if beat is None else round(beat[0], 3),
                    "load": None if beat is None else beat[1],
                    "outputs": sorted(outputs.get(worker, []), key=lambda o: o["output"]),
                }
            )
        return result

    def forget(self, worker: str) -> None:
        """Forget the sequence numbers ``worker`` had applied (to be saved): what they
        made is gone, so its deltas are to be applied again when they come back."""
        for known in [k for k in self.durable if k[0] == worker]:
            del self.durable[known]
        for received, _ in self.tracker.items():
            if isinstance(received, tuple) and received[0] == worker:
                self.tracker.rewind(received, None)

    async def save(self) -> None:
        """Write the table (temp file, fsync, rename) in a worker thread: an fsync on the
        event loop would stall every connection. Saves run one at a time, each writing
        the table as it was when it started, so the file never goes back in time."""
        async with self._saving:
            for connection in list(self.writing):
                connection.settle()  # windows done whose callbacks have not run yet
            entries = [
                {"worker": worker, "output": output, "last": last}
                for (worker, output), last in self.durable.items()
            ]
            table = {"sequences": entries, "slots": dict(self.slots)}
            await asyncio.get_running_loop().run_in_executor(None, self._write, table)

    def _write(self, table: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, table)


class RippleStates:
    """The listener's state of every tenant its workers wrote to (``DATA_DIR/ripple/
    tenant-<id>.json`` each), and its live connections."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.live: set[RippleConnection] = set()
        self.by_tenant: dict[int, RippleState] = {}
        for path in sorted(directory.glob("tenant-*.json")):
            tenant = path.stem.removeprefix("tenant-")
            if tenant.isdigit():
                self.of(int(tenant))

    def of(self, tenant_id: int) -> RippleState:
        """The tenant's state (read from its file the first time)."""
        state = self.by_tenant.get(tenant_id)
        if state is None:
            path = self.directory / f"tenant-{tenant_id}.json"
            state = self.by_tenant[tenant_id] = RippleState(tenant_id, path, self.live)
        return state

    def workers(self, tenants: frozenset[int] | None = None) -> list[dict[str, Any]]:
        """Every worker seen, of every tenant or of ``tenants``, by tenant then worker id."""
        return [
            worker
            for tenant_id, state in sorted(self.by_tenant.items())
            if tenants is None or tenant_id in tenants
            for worker in state.workers()
        ]


class RippleConnection(asyncio.Protocol):
    def __init__(self, server: Server, states: RippleStates) -> None:
        self.server = server
        self.states = states
        self.live = states.live
        self.protocol = rc.ServerConnection()
        self.transport: asyncio.Transport | None = None
        # Set by an accepted Handshake: the tenant the worker's credential writes to.
        self.state: RippleState | None = None
        self.kinds: TenantKinds | None = None
        self.source: Source | None = None
        self.outputs: dict[str, KindInfo] = {}
        self.keys: list[tuple[str, str]] = []  # (worker, output) of each output
        # The windows holding this connection's deltas, oldest first, each with the last
        # received sequence number of every output when deltas last went into it.
        self.unsettled: deque[tuple[Window, dict[tuple[str, str], int]]] = deque()
        self.failed: str | None = None  # why a window of this connection failed
        self.queue: asyncio.Queue[rc.ServerEvent | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.guard = ConnectionGuard(server.limits, "ripple", self)

    # ---- transport ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if not self.guard.admit(self.transport):
            return
        self.live.add(self)
        self.task = asyncio.get_running_loop().create_task(self._run())

    def data_received(self, data: bytes) -> None:
        for event in self.protocol.receive_data(data):
            self.queue.put_nowait(event)
            if isinstance(event, rc.HandshakeReceived) and self.transport is not None:
                # Nothing after the Handshake is needed before its answer: reading waits,
                # so a worker not yet accepted makes the server hold at most one read.
                self.transport.pause_reading()
        self.guard.received()

    def eof_received(self) -> bool | None:
        for event in self.protocol.receive_eof():
            self.queue.put_nowait(event)
        self.queue.put_nowait(None)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.release()
        self.live.discard(self)
        self.queue.put_nowait(None)
        self._release()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def fence(self) -> None:
        """Give up the worker's slot to a newer connection of the same worker."""
        self._release()
        if self.transport is not None:
            self.transport.abort()

    def _release(self) -> None:
        """The connection no longer speaks for its worker: its received numbers go back
        to the durable ones (its windows still in flight may fail, and the worker resends
        all it has not had acknowledged), and its source slot is left."""
        if self.source is None:
            return
        self.settle()
        self._rewind()
        self.source.disconnect()
        self.source = None

    def _rewind(self) -> None:
        if self.state is not None:
            for key in self.keys:
                self.state.tracker.rewind(key, self.state.durable.get(key))

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    # ---- events, in arrival order ---------------------------------------------------------

    async def _run(self) -> None:
        try:
            while (event := await self.queue.get()) is not None:
                if isinstance(event, rc.HandshakeReceived):
                    await self._handshake(event.handshake)
                    if self.transport is not None:
                        self.transport.resume_reading()  # a no-op once closing
                elif isinstance(event, rc.DeltaReceived):
                    # Deltas already queued behind this one go to the kinds in one call.
                    ops: list[WriteOp] = []
                    try:
                        if (op := self._delta(event)) is not None:
                            ops.append(op)
                        while not self.queue.empty() and isinstance(
                            self.queue._queue[0],  # type: ignore[attr-defined]
                            rc.DeltaReceived,
                        ):
                            queued = self.queue.get_nowait()
                            assert isinstance(queued, rc.DeltaReceived)
                            if (op := self._delta(queued)) is not None:
                                ops.append(op)
                    except (RippleError, KindsError):
                        self._apply(ops)  # the deltas before the refused one stand
                        raise
                    self._apply(ops)
                elif isinstance(event, rc.MessageReceived):
                    await self._message(event.message)
                elif isinstance(event, rc.Reject):
                    log.warning("rejecting a worker from %s: %s", self.peer, event.reason)
                    self._write(event.data)
                    self.close()
                    return
                else:
                    log.warning("closing a worker connection from %s: %s", self.peer, event.reason)
                    self.close()
                    return
        except (RippleError, KindsError, NotLeader, NotEnoughReplicas) as exc:
            # NotLeader, NotEnoughReplicas: an output kind led by another node, or below
            # min ISR, in a cluster (docs/cluster.md, "Entity kinds across the cluster").
            log.info("refusing worker %s: %s", self.protocol.worker_id, exc)
            if not self.protocol.closed:
                with contextlib.suppress(Exception):
                    self._write(self.protocol.send(rm.SchemaNegotiation(False, (str(exc),))))
            self.close()
        except Exception:
            log.exception("ripple connection failed")
        finally:
            # The worker is gone (EOF) or refused: its slot starts its liveness deadline.
            self.close()

    @property
    def peer(self) -> str:
        peer = None if self.transport is None else self.transport.get_extra_info("peername")
        return "?" if not peer else f"{peer[0]}:{peer[1]}"

    def _principal(self, auth: rm.HandshakeAuth | None) -> Principal:
        """Who the worker is, by the one auth rule: the token of its Handshake extension,
        else the client certificate it proved under mutual TLS (its CN mapped by
        ``cert_cn``); neither: anonymous, refused while [auth] required."""
        token = None if auth is None else auth.token
        if token is None:
            common_name = peer_common_name(self.transport)
            return self.server.api.auth.authenticate_certificate(common_name)
        return self.server.api.authenticate(token)

    def _tenant(self, auth: rm.HandshakeAuth | None) -> int:
        """The tenant the worker writes to: the one its extension names, else the lowest
        its credential grants (0 for an anonymous worker). AuthenticationFailed (or
        TenantForbidden) unless the credential allows it; TenantNotFound."""
        principal = self._principal(auth)
        tenant_id = principal.default_tenant if auth is None or auth.tenant is None else auth.tenant
        principal.check_tenant(tenant_id)
        self.server.api.check_tenant(tenant_id)
        return tenant_id

    async def _handshake(self, handshake: rm.Handshake) -> None:
        try:
            # Before anything is created, migrated or connected: a worker whose
            # credential does not hold never touches a kind or a source slot.
            tenant_id = self._tenant(handshake.auth)
        except (AuthenticationFailed, TenantNotFound) as exc:
            log.warning("refusing Ripple worker from %s: %s", self.peer, exc.message)
            self._write(self.protocol.reject_handshake([f"authentication failed: {exc.message}"]))
            self.close()
            return
        self.state = self.states.of(tenant_id)
        self.kinds = kinds = self.server.api.kinds(tenant_id)
        errors: list[str] = []
        outputs: dict[str, KindInfo] = {}
        for name, schema in handshake.output_schemas:
            fields = [(f.field_name, int(KIND_TYPES[f.field_type])) for f in schema.fields]
            try:
                outputs[name] = await self._kind_for(kinds, name, fields)
            except KindsError as exc:
                errors.append(f"output {name}: {exc}")
        if errors:
            self._write(self.protocol.reject_handshake(errors))
            self.close()
            return
        worker = handshake.source_worker_id
        for other in list(self.live):
            # One connection per worker: a new Handshake fences the old connection (its
            # process was restarted, or it reconnected before the old socket's end was seen).
            if (
                other is not self
                and other.state is self.state
                and other.protocol.worker_id == worker
            ):
                other.fence()
        slot = self.state.slots.get(worker)
        if slot is not None and not kinds.holds(slot):
            # Its source was declared dead past its liveness deadline and what it wrote
            # retracted: a replay from its checkpoint must be applied again, not dropped
            # as a redelivery of state that is gone (deltas give the same state twice).
            log.info("Ripple worker %r comes back after its liveness deadline", worker)
            self.state.forget(worker)
            await self.state.save()
        try:
            # A worker keeps its slot across reconnections and restarts, so its Removes
            # clear the bits its earlier connections set.
            self.source = kinds.connect(
                worker,
                source_id=self.state.slots.get(worker),
                deadline_ms=self.server.config.ripple_liveness_ms,
            )
            assert self.source.source_id is not None
            self.state.slots[worker] = self.source.source_id
        except KindsError as exc:
            self._write(self.protocol.reject_handshake([str(exc)]))
            self.close()
            return
        self.outputs = outputs
        self.keys = [(worker, output) for output in outputs]
        self._write(self.protocol.accept_handshake())
        self.guard.authenticated()

    def refusal(self, limit: str, message: str) -> bytes:
        return self.protocol.send(rm.SchemaNegotiation(False, (message,)))

    def busy(self) -> bool:
        return False  # no subscriptions: a worker keeps its link with Heartbeats

    async def _kind_for(
        self, kinds: TenantKinds, name: str, fields: list[tuple[str, int]]
    ) -> KindInfo:
        try:
            existing = kinds.get_kind(name)
        except KindNotFound:
            return await kinds.create_kind(name, fields)
        have = [(f.name, int(f.type)) for f in existing.fields]
        if fields[: len(have)] == have:
            return await kinds.create_kind(name, fields)  # identical, or appended fields
        if have[: len(fields)] == fields:
            return existing  # an older schema: a prefix of the kind's fields
        raise SchemaMismatch(f"fields {fields} do not fit kind {name} with fields {have}")

    def _delta(self, event: rc.DeltaReceived) -> WriteOp | None:
        """The kind write of a delta; None for a redelivery (or after fencing)."""
        if self.source is None or self.state is None or self.failed is not None:
            return None  # fenced, or a window failed: the worker resends
        message = event.message
        worker = self.protocol.worker_id or ""
        key = (worker, message.source_output)
        tracker = self.state.tracker
        op = None
        if not tracker.redelivery(key, message.sequence_no):
            # Built first: a delta refused here (by the listener, or by the kind's
            # check of its values: BadFieldData) is not applied, so nothing of it is
            # counted: neither its number, nor the gap it jumped, nor its watermark.
            kind = self.outputs[message.source_output]
            op = _op(kind, event.schema, entity_id_for(message.key), event.delta)
        if message.watermark_ns is not None:
            self.state.watermarks[key] = message.watermark_ns
        tracker.observe(key, message.sequence_no)
        return op

    def _apply(self, ops: list[WriteOp]) -> None:
        if not ops or self.source is None or self.kinds is None or self.state is None:
            return
        try:
            window = self.kinds.apply(self.source, ops)
        except KindsError:
            # The engine takes a list all or nothing: apply one by one up to the culprit.
            for op in ops:
                self.kinds.apply(self.source, [op])
                self.state.applied += 1
            raise
        self.state.applied += len(ops)
        # Once per batch: the numbers received so far are durable with this window.
        tracker = self.state.tracker
        marks = {key: last for key in self.keys if (last := tracker.last(key))}
        if self.unsettled and self.unsettled[-1][0] is window:
            self.unsettled[-1] = (window, marks)
        else:
            self.unsettled.append((window, marks))
            self.state.writing.add(self)
            window.done.add_done_callback(self._window_done)

    def _window_done(self, _: asyncio.Future[None]) -> None:
        self.settle()

    def settle(self) -> None:
        """Advance the durable numbers over this connection's windows that are done, in
        the order it wrote into them; at the first one that failed, stop for good: a
        later window being durable does not make the lost deltas before it durable."""
        state = self.state
        assert state is not None or not self.unsettled
        while self.unsettled and self.unsettled[0][0].done.done():
            window, marks = self.unsettled.popleft()
            if (exc := window.failure()) is not None:
                self._fail(f"a write of the worker's deltas failed: {str(exc) or 'cancelled'}")
                break
            assert state is not None
            for key, last in marks.items():
                if last > state.durable.get(key, -1):
                    state.durable[key] = last
        if not self.unsettled and state is not None:
            state.writing.discard(self)

    def _fail(self, reason: str) -> None:
        """A window holding this connection's deltas failed: nothing after it counts, no
        checkpoint is acknowledged, and the worker is told and disconnected (if this
        connection still speaks for it) so that it resends from its last checkpoint."""
        self.failed = reason
        self.unsettled.clear()
        if self.source is None:
            return  # gone already: its end rewound the worker's numbers
        log.info("disconnecting worker %s: %s", self.protocol.worker_id, reason)
        self._rewind()
        if not self.protocol.closed:
            with contextlib.suppress(Exception):
                self._write(self.protocol.send(rm.SchemaNegotiation(False, (reason,))))
        self.close()

    async def _message(self, message: rm.Message) -> None:
        if self.state is None or self.kinds is None:
            return  # only after an accepted Handshake (the protocol refuses the rest)
        if isinstance(message, rm.Heartbeat):
            self.state.heartbeats[message.worker_id] = (time.time(), message.load)
            if self.source is not None:
                self.source.touch()
        elif isinstance(message, rm.CheckpointRequest):
            # Everything received before the request: durable and visible (the windows
            # it went into, committed in order), then saved. Never after a failure.
            # The worker's earlier connections (fenced, or ended) first: their windows
            # still in flight hold what it sent on them, and a resuming worker numbers
            # after the ack's last, so the ack must not miss them (their failure rewound
            # the received numbers already: this connection applies the resend).
            worker = self.protocol.worker_id
            earlier = [
                c
                for c in list(self.state.writing)
                if c is not self and c.protocol.worker_id == worker
            ]
            for connection in [*earlier, self]:
                while connection.unsettled and self.failed is None:
                    with contextlib.suppress(Exception):
                        await connection.unsettled[0][0].durable()
                    connection.settle()
            if self.failed is not None:
                return
            await self.state.save()
            durable = self.state.durable
            last = max((durable.get(key, 0) for key in self.keys), default=0)
            worker = self.protocol.worker_id or ""
            ack = rm.CheckpointAck(message.checkpoint_id, worker, message.epoch, last)
            self._write(self.protocol.send(ack))
        # A Checkpoint_ack answers a request of ours (none are sent); Schema_negotiation
        # from a worker carries nothing to act on.


class SchemaMismatch(KindsError):
    """An output's schema neither matches, extends nor prefixes its kind's fields."""


def _op(kind: KindInfo, schema: rm.Schema, entity_id: bytes, delta: rm.Delta) -> WriteOp:
    by_name = {f.name: (i, f.type) for i, f in enumerate(kind.fields)}
    if isinstance(delta, rm.Remove):
        return retract_op(kind, entity_id)
    if isinstance(delta, rm.Set):
        record = [delta.values[f.field_name] for f in schema.fields]
        if not all(isinstance(v, str | int | float) for v in record):
            raise RippleError(f"a Set of {kind.name} carries a value that is not a field value")
        return assert_op(kind, entity_id, cast(list[str | int | float | bool], record))
    values: dict[int, Any] = {}
    for patch in delta.ops:
        if isinstance(patch, rm.FieldSet | rm.FieldRemove) and patch.field_name not in by_name:
            raise RippleError(f"patch of unknown field {patch.field_name!r} of {kind.name}")
        if isinstance(patch, rm.FieldSet):
            ordinal, ftype = by_name[patch.field_name]
            if not isinstance(patch.value, rm.Atom):
                raise RippleError(f"field {patch.field_name}: a list is not a field value")
            values[ordinal] = _parse(patch.value, ftype, patch.field_name)
        elif isinstance(patch, rm.FieldRemove):
            ordinal, ftype = by_name[patch.field_name]
            values[ordinal] = default_value(ftype)
        else:
            raise RippleError(f"kind {kind.name} has no map fields: {type(patch).__name__}")
    return patch_op(kind, entity_id, values)


# A Ripple kind's fields as the protocol's Field_set atoms read them (docs/protocols/
# ripple.md: decimal digits, not Python's int() with its underscores, spaces and other
# scripts' digits); STRING and every other type take the atom's text.
_WIRE_TYPES = {
    FieldType.I64: rm.FieldType.INT64,
    FieldType.F64: rm.FieldType.FLOAT,
    FieldType.BOOL: rm.FieldType.BOOL,
}


def _parse(atom: rm.Atom, ftype: FieldType, name: str) -> Any:
    """A Field_set atom in its field's text form ("150.5", "true")."""
    wire = _WIRE_TYPES.get(ftype)
    if wire is None:
        return atom.text
    try:
        return rm.value_of_sexp(wire, atom, f"field {name}")
    except DecodeError as exc:
        raise RippleError(str(exc)) from None


class _RippleCollector(Collector):
    def __init__(self, states: RippleStates) -> None:
        self.states = states

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        # Worker ids are the workers' own names, so two tenants may both have a "w1".
        watermark = GaugeMetricFamily(
            "headwater_ripple_watermark_ns",
            "Latest event-time watermark per worker and output",
            labels=["tenant", "worker", "output"],
        )
        heartbeat = GaugeMetricFamily(
            "headwater_ripple_heartbeat_seconds",
            "Unix time of each worker's last heartbeat",
            labels=["tenant", "worker"],
        )
        load = GaugeMetricFamily(
            "headwater_ripple_load", "Load each worker last reported", labels=["tenant", "worker"]
        )
        applied = duplicates = gap_count = 0
        for tenant_id, state in sorted(self.states.by_tenant.items()):
            tenant = str(tenant_id)
            for (worker, output), ns in sorted(state.watermarks.items()):
                watermark.add_metric([tenant, worker, output], ns)
            for worker, (when, level) in sorted(state.heartbeats.items()):
                heartbeat.add_metric([tenant, worker], when)
                load.add_metric([tenant, worker], level)
            applied += state.applied
            duplicates += state.tracker.duplicates
            gap_count += state.tracker.gaps
        deltas = CounterMetricFamily(
            "headwater_ripple_deltas", "Deltas received, by outcome", labels=["outcome"]
        )
        deltas.add_metric(["applied"], applied)
        deltas.add_metric(["duplicate"], duplicates)
        gaps = CounterMetricFamily(
            "headwater_ripple_sequence_gaps", "Deltas that arrived after a sequence gap"
        )
        gaps.add_metric([], gap_count)
        yield from (watermark, heartbeat, load, deltas, gaps)


async def start_ripple(server: Server, host: str, port: int) -> Listener:
    states = RippleStates(server.data_dir / "ripple")
    STATES[server] = states
    live = states.live
    metrics_for(server).registry.register(_RippleCollector(states))

    async def finish() -> None:
        # The workers are gone: what they sent is made durable, then the tables saved.
        for tenant_id, state in sorted(states.by_tenant.items()):
            with contextlib.suppress(Exception):
                await server.api.flush_kinds(tenant_id)
                await state.save()

    return await start_tcp_listener(
        server,
        "ripple",
        host,
        port,
        lambda: RippleConnection(server, states),
        live,
        finish=finish,
    )
