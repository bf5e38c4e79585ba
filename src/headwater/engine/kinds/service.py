"""The kind engine: per-tenant kinds, multi-source entity state, coalesced durable
windows, source epochs, liveness and subscriptions (spec/PROTOCOLS.md §2).

How a write travels:

1. ``TenantKinds.apply(source, ops)`` checks every op first (an op that does not fit
   fails the whole call and nothing is applied), then applies the ops, grouped by
   partition (one partition per kind), to the *working* state: the open window over the
   window being flushed over the committed state. Rules: ASSERT sets the source's bit
   and replaces the fields; PATCH sets the bit and updates the present fields (creating
   the entity with defaults); RETRACT clears the bit; no bit left = deleted.
2. The open window is flushed ``coalesce_ms`` (20 ms) after its first write: every
   entity whose net state changed gets the next tenant log position as its version and
   one record in its kind's changelog (a compacted partition log: key = entity id, value
   = u64 source_set + field_data, a tombstone for a deletion), one append per kind, then
   one group commit (fdatasync) per changelog for the whole window.
3. Once durable, the committed state (what QUERY, scans, bootstrap and SQL read) moves
   on, each subscriber gets the window's net changes (and EVENTs for event-stream
   kinds), and the window's waiters (ACKed writes, HEARTBEAT barriers) are released.

Restart rebuilds the committed state from the changelogs (the last record per entity
wins; compaction keeps them small), so it is identical to the state before.

Everything here runs on the asyncio loop thread; file work runs in the engine's workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import operator
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias, cast

import numpy as np

from headwater.engine.kinds.codec import RecordCodec, codec_for
from headwater.engine.kinds.errors import (
    KindNotFound,
    NoEpoch,
    NoFreeSource,
    ReadOnlySource,
    SourceConflict,
)
from headwater.engine.kinds.fields import (
    MAX_SOURCE_ID,
    FieldSpec,
    FieldType,
    FieldValue,
    decode_fields,
    default_value,
    encode_fields,
    encode_present_fields,
)
from headwater.engine.kinds.model import (
    OP_ASSERT,
    OP_PATCH,
    OP_RETRACT,
    AssertOp,
    AssertRecords,
    ChangeType,
    EntityState,
    EventNote,
    KindInfo,
    KindsConfig,
    PatchOp,
    RetractOp,
    StateColumns,
    WindowNotes,
    WriteOp,
)
from headwater.engine.kinds.registry import KindRegistry
from headwater.engine.kinds.subscriptions import KindSubscription
from headwater.errors import StorageError
from headwater.storage.group_commit import GroupCommitter
from headwater.storage.log import LogConfig, PartitionLog

if TYPE_CHECKING:
    from headwater.engine.engine import Engine, Tenant

log = logging.getLogger(__name__)

PRESENCE_KIND = "convergedb_connections"
PRESENCE_FIELDS = (
    FieldSpec("source_id", FieldType.U8),
    FieldSpec("name", FieldType.STRING),
    FieldSpec("connected_at", FieldType.TIMESTAMP),
    FieldSpec("liveness_deadline_ms", FieldType.U32),
)
SEQUENCE_KEY = b"hw_event_sequence"  # changelog key of an event kind's next sequence
_SOURCE_SET = struct.Struct("<Q")
KINDS_DIR = "kinds"


def presence_entity_id(source_id: int) -> bytes:
    """The ``convergedb_connections`` entity of a source: its id byte, then 31 zeros."""
    return bytes([source_id]) + bytes(31)


# ---- working state ----------------------------------------------------------------------


@dataclass(slots=True)
class _Work:
    """An entity as the open window leaves it (values None: absent)."""

    source_set: int
    values: list[FieldValue] | None
    metadata: bytes = b""
    record: bytes | None = None  # ``values`` encoded, when an ASSERT brought it


_Asserted: TypeAlias = tuple[int, bytes]
"""A window entry left by an ASSERT of a whole record with no metadata, the bulk of all
writes: ``(source_set, record)``, no object. Any other op on the entity in the same
window turns it into a :class:`_Work`."""

_Entry: TypeAlias = "_Work | _Asserted"

_Committed: TypeAlias = tuple[int, int, bytes]
"""A committed entity: ``(version, source_set, record)``, the record of every field."""


@dataclass(slots=True)
class _EventDraft:
    entity_id: bytes
    op: int
    source_id: int
    values: Sequence[FieldValue] | Mapping[int, FieldValue] | None
    metadata: bytes


class Window:
    """One coalescing window of one tenant; ``await window.durable()`` waits for it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.entities: dict[int, dict[bytes, _Entry]] = {}
        self.events: dict[int, list[_EventDraft]] = {}
        self.done: asyncio.Future[None] = loop.create_future()
        self.scheduled = False
        self.ops = 0

    @property
    def empty(self) -> bool:
        return self.ops == 0

    async def durable(self) -> None:
        """Return once everything in this window is durable and visible to readers."""
        await asyncio.shield(self.done)


@dataclass(slots=True)
class _FlushPlan:
    """What a window writes for one kind, and what readers and subscribers get once it
    is durable (the net changes as columns: see :class:`StateColumns`)."""

    state: KindState
    fields: tuple[FieldSpec, ...]  # the schema the records were made for
    first: int  # the version (tenant log position) of the first change
    entity_ids: list[bytes]
    changes: list[int]
    source_sets: list[int]
    records: list[bytes]
    previous: list[bytes | None]
    metadata: list[bytes] | None
    log_values: list[bytes]
    deleted: list[int]  # indexes of DELETED changes
    next_sequence: int
    notes: list[EventNote] = field(default_factory=list)
    applied: int = 0
    values_section: bytes | None = None  # log_values already encoded (columnar plans)
    changed_fields: list[int] | None = None  # known already (columnar plans)


def _columnar_changes(
    state: KindState, entities: dict[bytes, _Entry], first: int
) -> _FlushPlan | None:
    """:meth:`TenantKinds._net_changes` for the common window, in columns: a fixed-width
    kind whose entries are all whole records (``(source_set, record)`` tuples, as BATCHes
    of ASSERTs leave them) of entities that are all new or all committed already. The
    comparison with the committed state, the changed fields and the changelog values are
    numpy over the joined records instead of a Python loop per entity. None when the
    window is not of that shape (the general pass then handles it)."""
    codec = state.codec
    fixed = codec.fixed
    n = len(entities)
    if fixed is None or n == 0:
        return None
    entries = cast(list[tuple[int, bytes]], list(entities.values()))
    if set(map(type, entries)) != {tuple}:  # a _Work entry: the general pass
        return None
    eids = list(entities)
    befores = list(map(state.committed.get, eids))
    missing = befores.count(None)
    if missing not in (0, n):
        return None
    size = fixed.size
    set_list: list[int] = list(map(_FIRST, entries))
    records: list[bytes] = list(map(_SECOND, entries))
    new = b"".join(records)
    if len(new) != n * size:  # records never exceed the schema's size: all whole
        return None
    sets = np.fromiter(set_list, np.uint64, n)
    if missing == n:
        changes = [int(ChangeType.CREATED)] * n
        previous: list[bytes | None] = [None] * n
        changed = [(1 << len(codec.fields)) - 1] * n
        source_sets = set_list
    else:
        committed = cast(list[_Committed], befores)  # none missing
        old_records: list[bytes] = list(map(_RECORD_OF, committed))
        old = b"".join(old_records)
        if len(old) != n * size:  # a record from before a migration appended fields
            return None
        masks = codec.changed_masks(new, old)
        old_sets = np.fromiter(map(_SOURCE_SET_OF, committed), np.uint64, n)
        keep = (masks != 0) | (sets != old_sets)
        if keep.all():
            source_sets = set_list
        else:  # some end as they were committed: no version, no notification
            kept = keep.tolist()
            eids = list(compress(eids, kept))
            records = list(compress(records, kept))
            old_records = list(compress(old_records, kept))
            source_sets = list(compress(set_list, kept))
            masks, sets = masks[keep], sets[keep]
            new = b"".join(records)
        changes = [int(ChangeType.UPDATED)] * len(eids)
        previous = list(old_records)
        changed = masks.tolist()
    rows = np.empty(len(eids), dtype=_log_layout(size))
    rows["length"] = _SOURCE_SET.size + size
    rows["source_set"] = sets
    rows["record"] = np.frombuffer(new, dtype=f"V{size}")
    return _FlushPlan(
        state,
        state.info.fields,
        first,
        eids,
        changes,
        source_sets,
        records,
        previous,
        None,
        [],
        [],
        state.next_sequence,
        values_section=rows.tobytes(),
        changed_fields=changed,
    )


_FIRST: Callable[[tuple[int, bytes]], int] = operator.itemgetter(0)  # of window entries
_SECOND: Callable[[tuple[int, bytes]], bytes] = operator.itemgetter(1)
# Of a committed (version, source_set, record).
_RECORD_OF: Callable[[_Committed], bytes] = operator.itemgetter(2)
_SOURCE_SET_OF: Callable[[_Committed], int] = operator.itemgetter(1)


@functools.lru_cache(maxsize=64)
def _log_layout(record_size: int) -> np.dtype[np.void]:
    """A changelog value in its values section: ``u64 len | u64 source_set | record``."""
    return np.dtype([("length", "<u8"), ("source_set", "<u8"), ("record", f"V{record_size}")])


def _changed_fields(codec: RecordCodec, columns: StateColumns) -> list[int]:
    """The changed_fields column of a window's changes: every field for CREATED, none
    for DELETED, the fields whose bytes differ for UPDATED (all at once)."""
    everything = (1 << len(codec.fields)) - 1
    changes, records, previous = columns.changes, columns.records, columns.previous
    created, deleted = int(ChangeType.CREATED), int(ChangeType.DELETED)
    if deleted in changes:
        updated = [i for i, c in enumerate(changes) if c == ChangeType.UPDATED]
        out = [everything if c == created else 0 for c in changes]
        news = [records[i] for i in updated]
        olds = [previous[i] or b"" for i in updated]
        for i, mask in zip(updated, codec.changed_fields(news, olds), strict=True):
            out[i] = mask
        return out
    # A created entity is compared with itself (no bit), then gets every bit.
    olds = [r if p is None else p for r, p in zip(records, previous, strict=True)]
    masks = codec.changed_fields(records, olds)
    if created in changes:
        return [everything if c == created else m for c, m in zip(changes, masks, strict=True)]
    return masks


# ---- kinds --------------------------------------------------------------------------


class KindState:
    """One kind of one tenant: its committed entities, changelog and subscribers."""

    def __init__(self, info: KindInfo, plog: PartitionLog, committer: GroupCommitter) -> None:
        self.info = info
        self.codec = codec_for(info.fields)
        self.committed: dict[bytes, _Committed] = {}
        self.log = plog
        self.committer = committer
        self.next_sequence = 0
        self.subscribers: list[KindSubscription] = []
        self.applied_position = 0  # every change of this kind below it is committed

    def entity(self, entity_id: bytes) -> EntityState | None:
        """The committed state of an entity, None when absent."""
        committed = self.committed.get(entity_id)
        if committed is None:
            return None
        return self.entity_state(entity_id, committed)

    def entity_state(self, entity_id: bytes, committed: _Committed) -> EntityState:
        version, source_set, record = committed
        return EntityState(
            self.info.kind_id, entity_id, version, source_set, record, self.info.fields
        )

    def scan_entities(self) -> Iterator[EntityState]:
        """Every committed entity, each as it is when reached."""
        committed = self.committed
        for eid in list(committed):
            current = committed.get(eid)
            if current is not None:
                yield self.entity_state(eid, current)

    def whole_record(self, record: bytes) -> bytes:
        """A record written under an older (shorter) schema, with the newer fields'
        defaults appended; a record of the current schema as it is."""
        fixed = self.codec.fixed
        if fixed is not None and len(record) == fixed.size:
            return record
        fields = self.info.fields
        return encode_fields(fields, decode_fields(fields, record, complete=True))

    def load(self) -> None:
        """Rebuild the committed state from the changelog (worker thread, at open)."""
        committed = self.committed
        unpack_set = _SOURCE_SET.unpack_from
        whole = self.whole_record
        for event in self.log.events(self.log.start_offset):
            self.applied_position = event.position + 1
            key = event.key
            if key is None:
                continue
            if key == SEQUENCE_KEY:
                self.next_sequence = unpack_set(event.value)[0]
                continue
            if event.tombstone:
                committed.pop(key, None)
                continue
            value = event.value
            committed[key] = (event.position, unpack_set(value)[0], whole(bytes(value[8:])))

    def migrate(self, info: KindInfo) -> None:
        """Fields were appended: committed entities take the new fields' defaults."""
        added_fields = info.fields[len(self.info.fields) :]
        added = encode_fields(added_fields, [default_value(f.type) for f in added_fields])
        self.info = info
        self.codec = codec_for(info.fields)
        committed = self.committed
        for eid, (version, source_set, record) in list(committed.items()):
            committed[eid] = (version, source_set, record + added)


# ---- sources ------------------------------------------------------------------------


class Source:
    """A writer's slot (0..63) or a read-only reader (``source_id`` None).

    Call :meth:`touch` whenever the peer is heard from; :meth:`disconnect` when its
    connection ends (the liveness deadline then decides the fate of its entities).
    """

    def __init__(
        self,
        tenant: TenantKinds,
        source_id: int | None,
        name: str,
        deadline_ms: int,
        on_dead: Callable[[], None] | None,
    ) -> None:
        self.tenant = tenant
        self.source_id = source_id
        self.name = name
        self.deadline_ms = deadline_ms
        self.on_dead = on_dead
        self.connected = True
        self.last_seen = time.monotonic()
        self.connected_at_ns = time.time_ns()

    @property
    def read_only(self) -> bool:
        return self.source_id is None

    @property
    def bit(self) -> int:
        if self.source_id is None:
            raise ReadOnlySource("a read-only connection cannot write")
        return 1 << self.source_id

    def touch(self) -> None:
        self.last_seen = time.monotonic()

    def apply(self, ops: Sequence[WriteOp]) -> Window:
        return self.tenant.apply(self, ops)

    def disconnect(self) -> None:
        self.tenant.disconnect(self)


# ---- a tenant's kinds -----------------------------------------------------------------


class TenantKinds:
    """Every kind, entity, source and subscription of one tenant."""

    def __init__(self, owner: KindsEngine, tenant: Tenant, registry: KindRegistry) -> None:
        self.owner = owner
        self.engine_tenant = tenant
        self.tenant_id = tenant.tenant_id
        self.registry = registry
        self.kinds: dict[int, KindState] = {}
        self.sources: dict[int, Source] = {}  # slot -> holder (connected or in grace)
        # The working state's bit index: source -> kind -> entity ids it holds.
        self.source_entities: dict[int, dict[int, set[bytes]]] = {}
        # Open epochs: source -> kind -> entity ids not re-asserted or patched since BEGIN.
        self.epochs: dict[int, dict[int, set[bytes]]] = {}
        self._loop = asyncio.get_running_loop()
        self._pending = Window(self._loop)
        self._flushing: Window | None = None
        self._flush_task: asyncio.Task[None] | None = None
        self._flush_due = False
        # CREATE_KIND picks the next kind id, then awaits the changelog's opening and the
        # registry's save: one at a time, or two kinds would get one id.
        self._create_lock = asyncio.Lock()
        self.windows_flushed = 0
        self.changes_committed = 0
        self.closed = False

    @property
    def config(self) -> KindsConfig:
        return self.owner.config

    # ---- kinds ------------------------------------------------------------------------

    def kind(self, kind_id: int) -> KindInfo:
        """The kind's current definition; KindNotFound when unknown."""
        return self.registry.kind(kind_id)

    def kind_state(self, kind_id: int) -> KindState:
        state = self.kinds.get(kind_id)
        if state is None:
            raise KindNotFound(f"kind {kind_id} does not exist")
        return state

    def list_kinds(self) -> list[KindInfo]:
        return self.registry.kinds()

    def get_kind(self, name: str, fields: Sequence[tuple[str, int]] = ()) -> KindInfo:
        """GET_KIND: by name; ``fields``, when given, must be a prefix of the schema
        (SchemaIncompatible otherwise)."""
        return self.registry.resolve(name, fields)

    async def create_kind(
        self,
        name: str,
        fields: Sequence[tuple[str, int]],
        *,
        event_stream: bool = False,
        internal: bool = False,
    ) -> KindInfo:
        """CREATE_KIND: identical = the existing kind; appended fields = migration
        (schema_version + 1); anything else SchemaConflict; ReservedName for the reserved
        prefixes; KindLimitExceeded past 64 fields. Persisted before it returns."""
        async with self._create_lock:
            return await self._create_kind(name, fields, event_stream, internal)

    async def _create_kind(
        self, name: str, fields: Sequence[tuple[str, int]], event_stream: bool, internal: bool
    ) -> KindInfo:
        taken = set(self.engine_tenant.by_name)
        kind, changed = self.registry.plan_create(
            name, fields, event_stream=event_stream, internal=internal, taken_names=taken
        )
        if not changed:
            return kind
        loop = asyncio.get_running_loop()
        state = self.kinds.get(kind.kind_id)
        if state is None:
            state = await loop.run_in_executor(self.owner.executor, self.owner.open_kind, kind)
        self.registry.install(kind)
        try:
            await loop.run_in_executor(self.owner.executor, self.registry.save)
        except BaseException:
            log.exception("saving the kind registry failed")
            raise
        if kind.kind_id in self.kinds:
            state.migrate(kind)
            # Records asserted into the open window were whole for the old schema.
            entries = self._pending.entities.get(kind.kind_id, {})
            for eid, entry in entries.items():
                if type(entry) is tuple:
                    entries[eid] = (entry[0], state.whole_record(entry[1]))
        else:
            self.kinds[kind.kind_id] = state
            state.committer.start()
            self.engine_tenant.reserved_names.add(kind.name)
            self.owner.fire_kind_created(self, state)
        log.info(
            "kind %s (tenant %d, id %d) v%d",
            name,
            self.tenant_id,
            kind.kind_id,
            kind.schema_version,
        )
        return kind

    # ---- sources ------------------------------------------------------------------------

    def connect(
        self,
        name: str = "",
        *,
        source_id: int | None = None,
        read_only: bool = False,
        deadline_ms: int = 0,
        on_dead: Callable[[], None] | None = None,
    ) -> Source:
        """CONNECT: a read-only reader, the slot asked for (SourceConflict while a live
        connection holds it; a slot in its grace period is taken over with its
        entities), or the lowest free slot (NoFreeSource when all 64 are taken)."""
        deadline = deadline_ms or self.config.default_liveness_ms
        if read_only:
            return Source(self, None, name, deadline, on_dead)
        if source_id is None:
            free = [s for s in range(MAX_SOURCE_ID + 1) if s not in self.sources]
            if not free:
                raise NoFreeSource("all 64 source slots of the tenant are taken")
            source_id = free[0]
        elif not 0 <= source_id <= MAX_SOURCE_ID:
            raise SourceConflict(f"source_id {source_id} is outside 0..{MAX_SOURCE_ID}")
        else:
            holder = self.sources.get(source_id)
            if holder is not None and holder.connected:
                raise SourceConflict(f"source {source_id} is held by a live connection")
        source = Source(self, source_id, name, deadline, on_dead)
        self.sources[source_id] = source
        self._write_presence(source, present=True)
        return source

    def disconnect(self, source: Source) -> None:
        """The source's connection ended: its epoch is abandoned, its presence entity
        goes, and its entities stay until its liveness deadline passes."""
        if not source.connected:
            return
        source.connected = False
        if self.closed:  # shutting down: the restart takes care of presence and liveness
            return
        if source.source_id is None or self.sources.get(source.source_id) is not source:
            return
        self.epochs.pop(source.source_id, None)
        self._write_presence(source, present=False)

    def _write_presence(self, source: Source, *, present: bool) -> None:
        kind_id = self.registry.by_name.get(PRESENCE_KIND)
        if kind_id is None or source.source_id is None:
            return
        eid = presence_entity_id(source.source_id)
        op: WriteOp
        if present:
            values = (
                source.source_id,
                source.name[:1000],
                source.connected_at_ns,
                min(source.deadline_ms, 0xFFFF_FFFF),
            )
            op = AssertOp(kind_id, eid, values)
        else:
            op = RetractOp(kind_id, eid)
        self._apply_ops(source.source_id, [op], internal=True)

    def check_liveness(self, now: float) -> list[Source]:
        """Retract for every source silent past its deadline; returns the dead."""
        dead = [s for s in self.sources.values() if (now - s.last_seen) * 1000 > s.deadline_ms]
        for source in dead:
            assert source.source_id is not None
            log.info(
                "source %d (%s) of tenant %d is dead", source.source_id, source.name, self.tenant_id
            )
            was_connected = source.connected
            self.disconnect(source)
            self.retract_source(source.source_id)
            del self.sources[source.source_id]
            if was_connected and source.on_dead is not None:
                try:
                    source.on_dead()
                except Exception:
                    log.exception("on_dead callback failed")
        return dead

    def retract_source(self, source_id: int) -> int:
        """Clear ``source_id``'s bit from every entity it holds; returns how many."""
        held = self.source_entities.get(source_id, {})
        ops: list[WriteOp] = [RetractOp(k, e) for k, eids in held.items() for e in eids]
        self._apply_ops(source_id, ops, internal=True)
        return len(ops)

    def _held(self, source_id: int, kind_id: int) -> set[bytes]:
        """The entity ids of one kind that the working state says ``source_id`` holds."""
        by_kind = self.source_entities.get(source_id)
        if by_kind is None:
            by_kind = self.source_entities[source_id] = {}
        held = by_kind.get(kind_id)
        if held is None:
            held = by_kind[kind_id] = set()
        return held

    # ---- epochs -----------------------------------------------------------------------

    def begin_epoch(self, source: Source) -> Window:
        """SOURCE_EPOCH_BEGIN: remember the entities this source holds (of every kind);
        an epoch already open is abandoned."""
        sid = self._writer(source)
        presence = self.registry.by_name.get(PRESENCE_KIND)
        held = self.source_entities.get(sid, {})
        self.epochs[sid] = {k: set(eids) for k, eids in held.items() if k != presence}
        return self._pending

    def end_epoch(self, source: Source) -> tuple[int, Window]:
        """SOURCE_EPOCH_END: retract what was not re-asserted or patched since BEGIN;
        ``(retracted_count, window)``. NoEpoch without an open epoch."""
        sid = self._writer(source)
        stale = self.epochs.pop(sid, None)
        if stale is None:
            raise NoEpoch("SOURCE_EPOCH_END without an open epoch")
        held = self.source_entities.get(sid, {})
        ops: list[WriteOp] = [
            RetractOp(kind_id, eid)
            for kind_id, eids in stale.items()
            for eid in eids & held.get(kind_id, set())
        ]
        self._apply_ops(sid, ops)
        return len(ops), self._window_for_ack()

    def _writer(self, source: Source) -> int:
        if source.source_id is None:
            raise ReadOnlySource("a read-only connection cannot write")
        if self.sources.get(source.source_id) is not source:
            raise SourceConflict(f"source {source.source_id} was taken over")
        return source.source_id

    # ---- writes -----------------------------------------------------------------------

    def apply(self, source: Source, ops: Sequence[WriteOp]) -> Window:
        """Apply write ops as ``source`` (all checked before any applies; grouped by
        partition, each partition's ops in order); returns the window they are in."""
        sid = self._writer(source)
        if self.closed:
            raise StorageError("the server is shutting down")
        for op in ops:
            state = self.kinds.get(op.kind_id)
            if state is None:
                raise KindNotFound(f"kind {op.kind_id} does not exist")
            if state.info.internal:
                raise ReadOnlySource(f"kind {state.info.name!r} is written by headwater only")
        if len({op.kind_id for op in ops}) > 1:
            ops = sorted(ops, key=lambda op: op.kind_id)  # stable: order kept per kind
        self._apply_ops(sid, ops)
        return self._window_for_ack()

    def _window_for_ack(self) -> Window:
        """The window whose durability makes the writes applied so far durable: the open
        one when it holds anything; else the one being flushed; else (writes that changed
        nothing on a quiet tenant) one already done, so their ACK is not held forever."""
        if not self._pending.empty:
            return self._pending
        if self._flushing is not None:
            return self._flushing
        done = Window(self._loop)
        done.done.set_result(None)
        return done

    def _apply_ops(self, sid: int, ops: Sequence[WriteOp], *, internal: bool = False) -> None:
        if not ops:
            return
        bit = 1 << sid
        window = self._pending
        flushing = self._flushing
        epoch = None if internal else self.epochs.get(sid)
        last_kind = -1
        entities: dict[bytes, _Entry] = {}
        held: set[bytes] = set()
        stale: set[bytes] | None = None
        state: KindState | None = None
        for op in ops:
            kind_id = op.kind_id
            if kind_id != last_kind:
                state = self.kinds[kind_id]
                entities = window.entities.setdefault(kind_id, {})
                held = self._held(sid, kind_id)
                stale = None if epoch is None else epoch.get(kind_id)
                last_kind = kind_id
            assert state is not None
            if type(op) is AssertRecords:
                self._apply_records(state, op.pairs, bit, entities, flushing, held, stale)
                window.ops += len(op.pairs)
                continue
            assert not isinstance(op, AssertRecords)
            eid = op.entity_id
            entry = entities.get(eid)
            if type(op) is AssertOp and op.record is not None and not op.metadata:
                # A whole record and no metadata: the entry is a plain tuple.
                if entry is None:
                    source_set = self._source_set(state, flushing, eid)
                elif type(entry) is tuple:
                    source_set = entry[0]
                else:
                    assert isinstance(entry, _Work)
                    source_set = entry.source_set
                entities[eid] = (source_set | bit, op.record)
                held.add(eid)
                if stale is not None:
                    stale.discard(eid)
                window.ops += 1
                if state.info.event_stream:
                    window.events.setdefault(kind_id, []).append(
                        _EventDraft(eid, OP_ASSERT, sid, op.values, op.metadata)
                    )
                continue
            if entry is None:
                work = self._working(state, flushing, eid)
                if isinstance(op, RetractOp) and not work.source_set & bit:
                    # Retracting what this source does not hold changes nothing, but an
                    # event-stream kind still delivers the op.
                    if state.info.event_stream:
                        self._note_event(window, kind_id, eid, OP_RETRACT, sid, op.metadata)
                    continue
                entities[eid] = work
            elif type(entry) is tuple:
                work = entities[eid] = self._as_work(state, entry)
            else:
                assert isinstance(entry, _Work)
                work = entry
            if isinstance(op, AssertOp):
                work.values = list(op.values)
                work.record = op.record
                work.source_set |= bit
                held.add(eid)
                if stale is not None:
                    stale.discard(eid)
            elif isinstance(op, PatchOp):
                if work.values is None:
                    work.values = [default_value(f.type) for f in state.info.fields]
                for i, value in op.values.items():
                    work.values[i] = value
                work.record = None
                work.source_set |= bit
                held.add(eid)
                if stale is not None:
                    stale.discard(eid)
            else:
                if not work.source_set & bit:
                    if state.info.event_stream:
                        self._note_event(window, kind_id, eid, OP_RETRACT, sid, op.metadata)
                    continue
                work.source_set &= ~bit
                held.discard(eid)
                if not work.source_set:
                    work.values = None
            work.metadata = op.metadata
            window.ops += 1
            if state.info.event_stream:
                window.events.setdefault(kind_id, []).append(
                    _EventDraft(
                        eid,
                        OP_ASSERT
                        if isinstance(op, AssertOp)
                        else OP_PATCH
                        if isinstance(op, PatchOp)
                        else OP_RETRACT,
                        sid,
                        op.values if not isinstance(op, RetractOp) else None,
                        op.metadata,
                    )
                )
        if not window.scheduled and window.ops:
            window.scheduled = True
            self._loop.call_later(self.config.coalesce_ms / 1000, self._window_due)

    @staticmethod
    def _apply_records(
        state: KindState,
        pairs: Sequence[tuple[bytes, bytes]],
        bit: int,
        entities: dict[bytes, _Entry],
        flushing: Window | None,
        held: set[bytes],
        stale: set[bytes] | None,
    ) -> None:
        """ASSERTs of whole records with no metadata, the hot path: per entity, only the
        source set it had is looked up and a ``(source_set, record)`` tuple stored. Only
        entities the source did not hold yet join ``held`` (which holds exactly those
        whose working source set has the source's bit): re-asserting is the common case."""
        committed = state.committed.get
        earlier = None if flushing is None else flushing.entities.get(state.info.kind_id)
        current = entities.get
        fresh: list[bytes] = []
        for eid, record in pairs:
            entry = current(eid)
            if entry is None:
                prior = None if earlier is None else earlier.get(eid)
                if prior is None:
                    before = committed(eid)
                    source_set = 0 if before is None else before[1]
                elif type(prior) is tuple:
                    source_set = prior[0]
                else:
                    assert isinstance(prior, _Work)
                    source_set = prior.source_set
            elif type(entry) is tuple:
                source_set = entry[0]
            else:
                assert isinstance(entry, _Work)
                source_set = entry.source_set
            if not source_set & bit:
                fresh.append(eid)
            entities[eid] = (source_set | bit, record)
        held.update(fresh)
        if stale:
            stale.difference_update([eid for eid, _ in pairs])

    @staticmethod
    def _note_event(
        window: Window, kind_id: int, eid: bytes, op: int, sid: int, metadata: bytes
    ) -> None:
        """An op of an event-stream kind that changes no state: only its EVENT."""
        window.events.setdefault(kind_id, []).append(_EventDraft(eid, op, sid, None, metadata))
        window.ops += 1

    @staticmethod
    def _as_work(state: KindState, entry: _Asserted) -> _Work:
        source_set, record = entry
        return _Work(source_set, list(state.codec.decode_assert(record)), record=record)

    @staticmethod
    def _source_set(state: KindState, flushing: Window | None, eid: bytes) -> int:
        """The entity's source set as the window being flushed, else the committed state,
        leaves it."""
        if flushing is not None:
            prior = flushing.entities.get(state.info.kind_id, {}).get(eid)
            if prior is not None:
                return prior[0] if type(prior) is tuple else prior.source_set  # type: ignore[union-attr]
        committed = state.committed.get(eid)
        return 0 if committed is None else committed[1]

    @classmethod
    def _working(cls, state: KindState, flushing: Window | None, eid: bytes) -> _Work:
        if flushing is not None:
            prior = flushing.entities.get(state.info.kind_id, {}).get(eid)
            if type(prior) is tuple:
                return cls._as_work(state, prior)
            if prior is not None:
                assert isinstance(prior, _Work)
                values = None if prior.values is None else list(prior.values)
                return _Work(prior.source_set, values, record=prior.record)
        committed = state.committed.get(eid)
        if committed is None:
            return _Work(0, None)
        return cls._as_work(state, (committed[1], committed[2]))

    async def barrier(self) -> None:
        """Return once every write applied before the call is durable and visible."""
        if not self._pending.empty:
            await self._pending.durable()
        elif self._flushing is not None:
            await self._flushing.durable()

    # ---- reads --------------------------------------------------------------------------

    def get(self, kind_id: int, entity_id: bytes) -> EntityState | None:
        """The committed state of an entity (what QUERY answers), None when absent."""
        return self.kind_state(kind_id).entity(entity_id)

    def scan(self, kind_id: int) -> Iterator[EntityState]:
        """Every committed entity of a kind, each read as it is when reached (so an
        entity changed meanwhile comes out newer; one deleted meanwhile is skipped)."""
        return self.kind_state(kind_id).scan_entities()

    def subscribe(
        self, kind_id: int, *, include_previous: bool = False, events: bool = False
    ) -> KindSubscription:
        """Register a live subscription now (before any bootstrap :meth:`scan`)."""
        state = self.kind_state(kind_id)

        def remove(sub: KindSubscription) -> None:
            with contextlib.suppress(ValueError):
                state.subscribers.remove(sub)

        sub = KindSubscription(
            kind_id,
            include_previous=include_previous,
            events=events and state.info.event_stream,
            capacity=self.config.live_buffer,
            on_close=remove,
        )
        state.subscribers.append(sub)
        return sub

    # ---- flushing -----------------------------------------------------------------------

    def _window_due(self) -> None:
        if self.closed:
            return
        self._flush_due = True
        if self._flush_task is None:
            self._flush_task = self._loop.create_task(self._flush_loop())

    async def _flush_loop(self) -> None:
        try:
            while self._flush_due:
                self._flush_due = False
                await self.flush()
        finally:
            self._flush_task = None

    async def flush(self) -> None:
        """Make the open window durable and visible now (one flush at a time)."""
        while self._flushing is not None:
            await asyncio.shield(self._flushing.done)
        window = self._pending
        if window.empty:
            return
        self._pending = Window(self._loop)
        self._flushing = window
        try:
            await self._flush_window(window)
        except BaseException as exc:
            log.exception("flushing a window of tenant %d failed", self.tenant_id)
            if not window.done.done():
                window.done.set_exception(
                    exc if isinstance(exc, Exception) else RuntimeError("flush cancelled")
                )
                window.done.exception()  # retrieved: waiters may be gone
            raise
        finally:
            self._flushing = None
        window.done.set_result(None)

    async def _flush_window(self, window: Window) -> None:
        tenant = self.engine_tenant
        plans: list[_FlushPlan] = []
        commits = []
        claimed: list[int] = []
        try:
            for kind_id in set(window.entities) | set(window.events):
                state = self.kinds[kind_id]
                entities = window.entities.get(kind_id, {})
                drafts = window.events.get(kind_id, [])
                # Positions are claimed below, once the count is known; nothing can claim
                # in between (no await), so the versions handed out here are the claim's.
                first = tenant.next_position
                plan = None if drafts else _columnar_changes(state, entities, first)
                if plan is None:
                    plan = self._net_changes(state, entities, first)
                count = len(plan.entity_ids) + (1 if drafts else 0)
                if count == 0:
                    continue
                claimed.append(tenant.claim_positions(count))
                assert claimed[-1] == first
                keys: list[bytes | None] = list(plan.entity_ids)
                values_out = plan.log_values
                if drafts:
                    plan.notes, plan.next_sequence = self._event_notes(state, drafts)
                    keys.append(SEQUENCE_KEY)
                    values_out.append(_SOURCE_SET.pack(plan.next_sequence))
                if plan.values_section is not None:
                    info = state.log.append_encoded(
                        plan.values_section, count, first_position=first, keys=keys
                    )
                else:
                    tombstones = [not v for v in values_out] if plan.deleted else None
                    info = state.log.append(
                        values_out, first_position=first, keys=keys, tombstones=tombstones
                    )
                plan.applied = first + count
                commits.append(state.committer.committed(info.next_offset))
                plans.append(plan)
            if commits:
                await asyncio.gather(*commits)
        finally:
            for first in claimed:
                tenant.release_positions(first)
        for plan in plans:
            self._commit(plan)
        self.windows_flushed += 1

    @staticmethod
    def _net_changes(state: KindState, entities: dict[bytes, _Entry], first: int) -> _FlushPlan:
        """One pass over a kind's window entries: the net change of each entity (none when
        it ends as it was committed), as columns, with its changelog value. Change i gets
        version ``first + i``."""
        info = state.info
        fields = info.fields
        nfields = len(fields)
        encode = state.codec.encode
        committed = state.committed.get
        pack_set = _SOURCE_SET.pack
        ids: list[bytes] = []
        changes: list[int] = []
        source_sets: list[int] = []
        records: list[bytes] = []
        previous: list[bytes | None] = []
        log_values: list[bytes] = []
        metadata: list[bytes] | None = None
        deleted: list[int] = []
        created, updated = int(ChangeType.CREATED), int(ChangeType.UPDATED)
        for eid, entry in entities.items():
            before = committed(eid)
            meta = b""
            if type(entry) is tuple:
                source_set, record = entry
            else:
                assert isinstance(entry, _Work)
                values = entry.values
                meta = entry.metadata
                if values is None:
                    if before is None:
                        continue  # created and deleted within the window: no trace
                    if metadata is None and meta:
                        metadata = [b""] * len(ids)
                    deleted.append(len(ids))
                    ids.append(eid)
                    changes.append(int(ChangeType.DELETED))
                    source_sets.append(0)
                    records.append(b"")
                    previous.append(None)
                    log_values.append(b"")
                    if metadata is not None:
                        metadata.append(meta)
                    continue
                record_or_none = entry.record
                if len(values) < nfields:
                    # written before a migration appended fields: they take defaults
                    values.extend(default_value(f.type) for f in fields[len(values) :])
                    record_or_none = None
                record = encode(values) if record_or_none is None else record_or_none
                source_set = entry.source_set
            if before is None:
                changes.append(created)
                previous.append(None)
            elif before[1] == source_set and before[2] == record:
                continue  # as it was: no version, no notification
            else:
                changes.append(updated)
                previous.append(before[2])
            if metadata is None and meta:
                metadata = [b""] * len(ids)
            ids.append(eid)
            source_sets.append(source_set)
            records.append(record)
            log_values.append(pack_set(source_set) + record)
            if metadata is not None:
                metadata.append(meta)
        return _FlushPlan(
            state,
            fields,
            first,
            ids,
            changes,
            source_sets,
            records,
            previous,
            metadata,
            log_values,
            deleted,
            state.next_sequence,
        )

    @staticmethod
    def _event_notes(state: KindState, drafts: list[_EventDraft]) -> tuple[list[EventNote], int]:
        """An event-stream kind's EVENTs for the window's ops; the next sequence after."""
        fields = state.info.fields
        codec = state.codec
        everything = (1 << len(fields)) - 1
        seq = state.next_sequence
        notes: list[EventNote] = []
        for d in drafts:
            if d.op == OP_ASSERT:
                assert isinstance(d.values, Sequence)
                full = list(d.values)
                full += [default_value(f.type) for f in fields[len(full) :]]
                mask, data = everything, codec.encode(full)
            elif d.op == OP_PATCH:
                assert isinstance(d.values, Mapping)
                mask, data = encode_present_fields(fields, d.values)
            else:
                mask, data = 0, b""
            notes.append(
                EventNote(
                    state.info.kind_id, d.entity_id, d.op, d.source_id, seq, mask, data, d.metadata
                )
            )
            seq += 1
        return notes, seq

    def _commit(self, plan: _FlushPlan) -> None:
        """The window is durable: readers see its state, subscribers get its changes."""
        state = plan.state
        ids, records, previous = plan.entity_ids, plan.records, plan.previous
        if state.info.fields != plan.fields:
            # The kind migrated while this window was being written: pad what it wrote.
            records[:] = [state.whole_record(r) if r else r for r in records]
            previous[:] = [None if p is None else state.whole_record(p) for p in previous]
        first = plan.first
        versions = range(first, first + len(ids))
        entries = zip(versions, plan.source_sets, records, strict=True)
        state.committed.update(zip(ids, entries, strict=True))
        for i in plan.deleted:
            del state.committed[ids[i]]
        state.applied_position = plan.applied
        state.next_sequence = plan.next_sequence
        self.changes_committed += len(ids)
        if state.subscribers:
            codec = state.codec
            changes_of = functools.partial(_changed_fields, codec)
            state_notes = StateColumns(
                state.info.kind_id,
                first,
                ids,
                plan.changes,
                plan.source_sets,
                records,
                previous,
                plan.metadata,
                changes_of,
                plan.changed_fields if state.info.fields == plan.fields else None,
            )
            event_notes = WindowNotes(plan.notes)
            for sub in list(state.subscribers):
                sub.push(event_notes if sub.events else state_notes)

    async def close(self) -> None:
        self.closed = True
        try:
            if self._flush_task is not None:
                await self._flush_task
            await self.flush()
        except Exception:
            log.exception("the last window of tenant %d was not written", self.tenant_id)
        for state in self.kinds.values():
            for sub in list(state.subscribers):
                sub.close()
            await state.committer.aclose()
            state.log.close()


# ---- the engine-wide object -------------------------------------------------------------


@dataclass
class _Hooks:
    kind_created: list[Callable[[TenantKinds, KindState], None]] = field(default_factory=list)


class KindsEngine:
    """Entity kinds of every tenant, on top of an open :class:`Engine`."""

    def __init__(self, engine: Engine, config: KindsConfig) -> None:
        self.engine = engine
        self.config = config
        self.executor = engine.executor
        self.tenants: dict[int, TenantKinds] = {}
        self.hooks = _Hooks()
        self._liveness: asyncio.Task[None] | None = None
        self._maintenance: asyncio.Task[None] | None = None
        self.closed = False

    @classmethod
    async def open(cls, engine: Engine, config: KindsConfig | None = None) -> KindsEngine:
        """Load every tenant's kinds and rebuild their state from the changelogs."""
        kinds = cls(engine, config or KindsConfig())
        loop = asyncio.get_running_loop()
        for tenant in engine.tenants.values():
            await kinds._open_tenant(tenant, loop)
        kinds._liveness = loop.create_task(kinds._liveness_loop())
        interval = engine.config.maintenance_interval_ms
        if interval > 0:
            kinds._maintenance = loop.create_task(kinds._maintenance_loop(interval / 1000))
        return kinds

    async def _open_tenant(self, tenant: Tenant, loop: asyncio.AbstractEventLoop) -> TenantKinds:
        directory = tenant.directory / KINDS_DIR

        def load() -> tuple[KindRegistry, list[KindState]]:
            registry = KindRegistry.load(tenant.tenant_id, directory)
            states = []
            for info in registry.kinds():
                state = self.open_kind(info)
                state.load()
                states.append(state)
            return registry, states

        registry, states = await loop.run_in_executor(self.executor, load)
        tk = TenantKinds(self, tenant, registry)
        for state in states:
            tk.kinds[state.info.kind_id] = state
            state.committer.start()
            tenant.reserved_names.add(state.info.name)
            last = state.log.last_position
            if last is not None:
                tenant.next_position = max(tenant.next_position, last)
            kind_id = state.info.kind_id
            for eid, (_, bits, _) in state.committed.items():
                while bits:
                    low = bits & -bits
                    tk._held(low.bit_length() - 1, kind_id).add(eid)
                    bits ^= low
        self.tenants[tenant.tenant_id] = tk
        await tk.create_kind(PRESENCE_KIND, PRESENCE_FIELDS, internal=True)
        # Nobody is connected after a restart: presence entities from before go, and
        # every source holding entities gets one liveness deadline (its own, which its
        # presence entity kept) to come back.
        presence = tk.kinds[registry.by_name[PRESENCE_KIND]]
        deadlines: dict[int, int] = {}
        for entity in list(presence.scan_entities()):
            sid, _, _, deadline_ms = entity.values
            assert isinstance(sid, int) and isinstance(deadline_ms, int)
            deadlines[sid] = deadline_ms
            bits = entity.source_set
            for holder in range(MAX_SOURCE_ID + 1):
                if bits >> holder & 1:
                    retract = RetractOp(presence.info.kind_id, entity.entity_id)
                    tk._apply_ops(holder, [retract], internal=True)
        for sid, by_kind in tk.source_entities.items():
            if any(by_kind.values()) and sid not in tk.sources:
                deadline = deadlines.get(sid) or self.config.default_liveness_ms
                ghost = Source(tk, sid, "", deadline, None)
                ghost.connected = False
                tk.sources[sid] = ghost
        return tk

    def open_kind(self, info: KindInfo) -> KindState:
        """Open (creating) a kind's changelog; worker thread."""
        tenant = self.engine.tenant(info.tenant_id)
        directory = tenant.directory / KINDS_DIR / str(info.kind_id) / "changelog"
        config = LogConfig(
            segment_bytes=self.engine.config.segment_bytes,
            cleanup_policy="compact",
            delete_retention_ms=self.engine.config.delete_retention_ms,
            sync=self.engine.config.sync,
        )
        plog = PartitionLog.open(Path(directory), config)
        return KindState(info, plog, GroupCommitter(plog, self.executor))

    def fire_kind_created(self, tenant: TenantKinds, state: KindState) -> None:
        for hook in list(self.hooks.kind_created):
            try:
                hook(tenant, state)
            except Exception:
                log.exception("kind_created hook failed")

    def tenant(self, tenant_id: int) -> TenantKinds:
        """A tenant's kinds (TenantNotFound when the engine has no such tenant)."""
        tk = self.tenants.get(tenant_id)
        if tk is None:
            self.engine.tenant(tenant_id)  # raises TenantNotFound
            raise KindNotFound(f"tenant {tenant_id} has no kinds loaded")
        return tk

    async def _liveness_loop(self) -> None:
        interval = self.config.liveness_check_ms / 1000
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for tk in list(self.tenants.values()):
                try:
                    tk.check_liveness(now)
                except Exception:
                    log.exception("liveness check failed")

    async def run_maintenance(self) -> int:
        """Compact every kind changelog once; returns the records removed."""
        removed = 0
        loop = asyncio.get_running_loop()
        for tk in list(self.tenants.values()):
            for state in list(tk.kinds.values()):
                if state.log.closed:
                    continue
                result = await loop.run_in_executor(self.executor, state.log.compact)
                removed += result.events_removed
        return removed

    async def _maintenance_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.run_maintenance()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("kind changelog maintenance failed")

    async def close(self) -> None:
        """Flush every open window, make it durable, close the changelogs."""
        if self.closed:
            return
        self.closed = True
        for task in (self._liveness, self._maintenance):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for tk in self.tenants.values():
            await tk.close()
