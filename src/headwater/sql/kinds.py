"""Entity kinds as SQL tables: ``(entity_id, version, <fields>..., entity_key)``, current
and as of a tenant log position; and each kind's changelog as ``hw_changes_<kind>``:
``(entity_id, version, deleted, <fields>..., entity_key)``, one row per change in log
order. ``entity_key`` is the id as people write it (``lab-1``; ``0x`` + hex for an id
that is no short text key: headwater.entity_keys), so ``WHERE entity_key = 'lab-1'``
finds what the CLI and the SDK call lab-1; it comes last so the contract's columns
(spec/PROTOCOLS.md §1) keep their places.

The kind engine moves each kind's committed state forward only when a window is
durable, which is also when the window's positions stop being in flight; so a kind's
table always covers the tenant's committed head. A query at or after the kind's last
change reads the committed state as it is when the query starts (the hot set in memory
and the kind's store on disk, read in a worker thread a chunk at a time into Arrow
batches: no Python object per entity is held); a QueryAt older than that
replays the kind's changelog up to the position (records removed by compaction are
gone: an as-of read that old sees only what compaction kept).

The changes table is what a streaming reader polls (``WHERE version >= start``) every
trigger, so it keeps the changelog decoded per segment and decodes only what was appended
since the last query; a segment rewritten by compaction is decoded again. The ``hw_``
prefix is reserved, so no stream or kind can take a changes table's name.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from headwater.engine.kinds import EntityState, KindsEngine, KindState
from headwater.engine.kinds.codec import codec_for
from headwater.engine.kinds.fields import FieldSpec, FieldType
from headwater.engine.kinds.state import SEQUENCE_KEY, Committed
from headwater.engine.names import changes_table_name
from headwater.entity_keys import key_text
from headwater.sql.tables import SqlTable
from headwater.storage.log import PartitionLog
from headwater.storage.segment import Segment

# A decoded changelog nobody queried for this long is dropped (memory goes back).
CHANGES_IDLE_SECONDS = 300.0
TABLE_CHUNK = 8192  # entities decoded into Arrow at a time

ARROW_TYPES: dict[FieldType, pa.DataType] = {
    FieldType.BOOL: pa.bool_(),
    FieldType.U8: pa.uint8(),
    FieldType.U16: pa.uint16(),
    FieldType.U32: pa.uint32(),
    FieldType.U64: pa.uint64(),
    FieldType.I8: pa.int8(),
    FieldType.I16: pa.int16(),
    FieldType.I32: pa.int32(),
    FieldType.I64: pa.int64(),
    FieldType.F32: pa.float32(),
    FieldType.F64: pa.float64(),
    FieldType.STRING: pa.string(),
    FieldType.BYTES: pa.binary(),
    FieldType.TIMESTAMP: pa.timestamp("ns", tz="UTC"),
}


KIND_COLUMNS = ("entity_id", "version", "entity_key")


def column_names(fields: Sequence[FieldSpec], own: tuple[str, ...] = KIND_COLUMNS) -> list[str]:
    """The fields' columns, in field order: a field's name, or ``field_`` before it (as
    often as it takes) where it would clash with one of the table's ``own`` columns or an
    earlier field's column (SQL names are case-insensitive: fields ``a`` and ``A`` are
    ``a`` and ``field_A``; ``version`` and ``field_version``, ``field_version`` and
    ``field_field_version``). In field order, so a migration's appended fields never
    rename the columns before them."""
    taken = set(own)
    names = []
    for field in fields:
        name = field.name
        while name.lower() in taken:
            name = f"field_{name}"
        taken.add(name.lower())
        names.append(name)
    return names


CHANGES_COLUMNS = ("entity_id", "version", "deleted", "entity_key")


def changes_schema(fields: Sequence[FieldSpec]) -> pa.Schema:
    """``entity_id``, ``version`` (the change's tenant log position), ``deleted`` (the
    entity is gone; its fields are NULL), then the fields, then ``entity_key``."""
    columns = [
        pa.field("entity_id", pa.string()),
        pa.field("version", pa.int64()),
        pa.field("deleted", pa.bool_()),
    ]
    columns += [
        pa.field(name, ARROW_TYPES[f.type])
        for name, f in zip(column_names(fields, CHANGES_COLUMNS), fields, strict=True)
    ]
    return pa.schema([*columns, pa.field("entity_key", pa.string())])


def kind_schema(fields: Sequence[FieldSpec]) -> pa.Schema:
    # PROTOCOLS.md §1: entity_id is VARCHAR, the 32-byte id in lowercase hex.
    columns = [pa.field("entity_id", pa.string()), pa.field("version", pa.int64())]
    columns += [
        pa.field(name, ARROW_TYPES[f.type])
        for name, f in zip(column_names(fields), fields, strict=True)
    ]
    return pa.schema([*columns, pa.field("entity_key", pa.string())])


def build_table_streamed(
    fields: tuple[FieldSpec, ...], kind_id: int, items: Iterator[tuple[bytes, Committed]]
) -> pa.Table:
    """:func:`build_table` of committed entities given in id order, a chunk at a time."""
    tables = [build_table(fields, [])]
    while chunk := list(itertools.islice(items, TABLE_CHUNK)):
        states = [EntityState(kind_id, eid, *committed, fields) for eid, committed in chunk]
        tables.append(build_table(fields, states))
    return pa.concat_tables(tables)


def build_table(fields: Sequence[FieldSpec], states: Sequence[EntityState]) -> pa.Table:
    """An Arrow table of entity states, rows ordered by entity id."""
    ordered = sorted(states, key=lambda s: s.entity_id)
    schema = kind_schema(fields)
    columns: list[list[object]] = [
        [s.entity_id.hex() for s in ordered],
        [s.version for s in ordered],
    ]
    for i, _ in enumerate(fields):
        columns.append([s.values[i] if i < len(s.values) else None for s in ordered])
    columns.append([key_text(s.entity_id) for s in ordered])
    return pa.Table.from_arrays(
        [pa.array(col, type=schema.field(i).type) for i, col in enumerate(columns)],
        schema=schema,
    )


class KindTable:
    """One kind as a table (see the module docstring)."""

    def __init__(self, state: KindState) -> None:
        self.state = state

    @property
    def name(self) -> str:
        return self.state.info.name

    def covered_position(self, head: int) -> int:
        return head

    @property
    def history_from(self) -> int:
        return 0  # nothing removes a kind's history

    @property
    def error(self) -> str | None:
        return None

    @property
    def damage(self) -> str | None:
        return None  # a kind's table is its state in memory, not a projection of a log

    def request_catch_up(self) -> None:
        return None

    def snapshot(self, position: int) -> Callable[[], pa.Table]:
        state = self.state
        fields = state.info.fields
        if position >= state.applied_position:
            items = state.frozen_items()
            kind_id = state.info.kind_id
            return lambda: build_table_streamed(fields, kind_id, items())
        kind_id = state.info.kind_id
        plog = state.log
        upto = plog.committed_offset

        def replay() -> pa.Table:
            found: dict[bytes, EntityState] = {}
            for event in plog.events(plog.start_offset, upto):
                if event.position >= position:
                    break
                key = event.key
                if key is None or key == SEQUENCE_KEY:
                    continue
                if event.tombstone:
                    found.pop(key, None)
                    continue
                record = bytes(memoryview(event.value)[8:])
                found[key] = EntityState(kind_id, key, event.position, 0, record, fields)
            return build_table(fields, list(found.values()))

        return replay


class _SegmentChanges:
    """What of one segment is decoded: its changes below ``upto`` (an offset)."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.upto = segment.base_offset
        self.batches: list[pa.RecordBatch] = []


class DecodedChangelog:
    """One kind's changelog decoded to Arrow, segment by segment (see the module
    docstring). Built in query worker threads, hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fields: tuple[FieldSpec, ...] = ()
        self._segments: dict[int, _SegmentChanges] = {}
        self.last_used = time.monotonic()

    def table(
        self, plog: PartitionLog, fields: tuple[FieldSpec, ...], upto: int, position: int
    ) -> pa.Table:
        """The changes at offsets below ``upto`` and positions below ``position``."""
        schema = changes_schema(fields)
        with self._lock:
            if fields != self._fields:  # a migration appended fields: decode anew
                self._fields, self._segments = fields, {}
            kept: dict[int, _SegmentChanges] = {}
            batches: list[pa.RecordBatch] = []
            for segment in list(plog.segments):
                entry = self._segments.get(segment.base_offset)
                if entry is None or entry.segment is not segment:  # new, or compacted
                    entry = _SegmentChanges(segment)
                stop = min(segment.next_offset, upto)
                if entry.upto < stop:
                    batch = _decode_changes(plog, fields, schema, entry.upto, stop)
                    if batch.num_rows:
                        entry.batches.append(batch)
                    entry.upto = stop
                kept[segment.base_offset] = entry
                batches += entry.batches
            self._segments = kept
        table = pa.Table.from_batches(batches, schema=schema)
        # Changes are in position order; the cut keeps an as-of read exact.
        if table.num_rows and table.column("version")[-1].as_py() >= position:
            table = table.filter(pc.less(table.column("version"), position))
        return table


def _decode_changes(
    plog: PartitionLog,
    fields: tuple[FieldSpec, ...],
    schema: pa.Schema,
    start: int,
    stop: int,
) -> pa.RecordBatch:
    codec = codec_for(fields)
    ids: list[str] = []
    keys: list[str] = []
    versions: list[int] = []
    deleted: list[bool] = []
    records: list[tuple[object, ...] | None] = []
    for event in plog.events(start, stop):
        key = event.key
        if key is None or key == SEQUENCE_KEY:
            continue
        ids.append(key.hex())
        keys.append(key_text(key))
        versions.append(event.position)
        deleted.append(event.tombstone)
        records.append(None if event.tombstone else codec.decode_assert(bytes(event.value[8:])))
    columns: list[list[object]] = [ids, versions, deleted]  # type: ignore[list-item]
    for i in range(len(fields)):
        columns.append([None if r is None else r[i] for r in records])
    columns.append(keys)  # type: ignore[arg-type]
    return pa.RecordBatch.from_arrays(
        [pa.array(col, type=schema.field(i).type) for i, col in enumerate(columns)],
        schema=schema,
    )


class KindChangesTable(KindTable):
    """One kind's changelog as the table ``hw_changes_<kind>``; it covers what the
    kind's table covers."""

    def __init__(self, state: KindState, decoded: DecodedChangelog) -> None:
        super().__init__(state)
        self.decoded = decoded

    @property
    def name(self) -> str:
        return changes_table_name(self.state.info.name)

    def snapshot(self, position: int) -> Callable[[], pa.Table]:
        state = self.state
        fields, plog, decoded = state.info.fields, state.log, self.decoded
        upto = plog.committed_offset
        decoded.last_used = time.monotonic()
        return lambda: decoded.table(plog, fields, upto, position)


class KindTables:
    """The table source of every tenant's kinds: each kind's state and its changelog."""

    def __init__(self, kinds: KindsEngine) -> None:
        self.kinds = kinds
        self._decoded: dict[tuple[int, int], DecodedChangelog] = {}
        self._swept = time.monotonic()

    def start(self) -> None:
        return None

    def tables(self, tenant_id: int) -> list[SqlTable]:
        tenant = self.kinds.tenants.get(tenant_id)
        if tenant is None:
            return []
        tables: list[SqlTable] = []
        for state in tenant.kinds.values():
            tables.append(KindTable(state))
            tables.append(KindChangesTable(state, self._changelog(tenant_id, state)))
        return tables

    def _changelog(self, tenant_id: int, state: KindState) -> DecodedChangelog:
        now = time.monotonic()
        if now - self._swept > CHANGES_IDLE_SECONDS / 10:
            self._swept = now
            idle = now - CHANGES_IDLE_SECONDS
            for stale in [k for k, d in self._decoded.items() if d.last_used < idle]:
                del self._decoded[stale]
        key = (tenant_id, state.info.kind_id)
        decoded = self._decoded.get(key)
        if decoded is None:
            decoded = self._decoded[key] = DecodedChangelog()
        return decoded

    async def close(self) -> None:
        return None
