"""Entity kinds as SQL tables: ``(entity_id, version, <fields>...)``, current and as of
a tenant log position.

The kind engine keeps each kind's committed state in memory and moves it forward only
when a window is durable, which is also when the window's positions stop being
in flight; so a kind's table always covers the tenant's committed head. A query at or
after the kind's last change reads the in-memory state; a QueryAt older than that
replays the kind's changelog up to the position (records removed by compaction are
gone: an as-of read that old sees only what compaction kept).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyarrow as pa

from headwater.engine.kinds import EntityState, KindsEngine, KindState
from headwater.engine.kinds.service import SEQUENCE_KEY
from headwater.protocols.convergedb.fields import FieldSpec, FieldType, decode_fields
from headwater.sql.tables import SqlTable

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


def column_name(field_name: str) -> str:
    """A field's column: its name, or ``field_<name>`` where it would clash with
    ``entity_id`` or ``version`` (SQL names are case-insensitive)."""
    if field_name.lower() in ("entity_id", "version"):
        return f"field_{field_name}"
    return field_name


def kind_schema(fields: Sequence[FieldSpec]) -> pa.Schema:
    # PROTOCOLS.md §1: entity_id is VARCHAR, the 32-byte id in lowercase hex.
    columns = [pa.field("entity_id", pa.string()), pa.field("version", pa.int64())]
    columns += [pa.field(column_name(f.name), ARROW_TYPES[f.type]) for f in fields]
    return pa.schema(columns)


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

    def request_catch_up(self) -> None:
        return None

    def snapshot(self, position: int) -> Callable[[], pa.Table]:
        state = self.state
        fields = state.info.fields
        if position >= state.applied_position:
            rows = list(state.committed.values())
            return lambda: build_table(fields, rows)
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
                values = decode_fields(fields, memoryview(event.value)[8:], complete=True)
                found[key] = EntityState(kind_id, key, event.position, 0, tuple(values), b"")
            return build_table(fields, list(found.values()))

        return replay


class KindTables:
    """The table source of every tenant's kinds."""

    def __init__(self, kinds: KindsEngine) -> None:
        self.kinds = kinds

    def start(self) -> None:
        return None

    def tables(self, tenant_id: int) -> list[SqlTable]:
        tenant = self.kinds.tenants.get(tenant_id)
        if tenant is None:
            return []
        return [KindTable(state) for state in tenant.kinds.values()]

    async def close(self) -> None:
        return None
