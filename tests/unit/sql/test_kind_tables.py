"""Kinds as SQL tables: every field type as a column, current and as of a position."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from headwater.engine.engine import Engine, EngineConfig
from headwater.engine.kinds import KindsConfig, KindsEngine, assert_op, patch_op, retract_op
from headwater.entity_keys import entity_id
from headwater.protocols.convergedb.fields import FieldType
from headwater.sql.kinds import KindTables
from headwater.sql.service import SqlService

ALL_TYPES = [(f"c_{t.name.lower()}", t) for t in FieldType] + [("Version", FieldType.U8)]


@contextlib.asynccontextmanager
async def kind_sql(
    tmp_path: Path, config: EngineConfig | None = None
) -> AsyncIterator[tuple[KindsEngine, SqlService]]:
    """An engine with kinds (windows flushed by hand) and SQL over them."""
    engine = await Engine.open(tmp_path, config or EngineConfig(maintenance_interval_ms=0))
    kinds = await KindsEngine.open(engine, KindsConfig(coalesce_ms=60_000))
    sql = SqlService(engine)
    sql.add_source(KindTables(kinds))
    sql.start()
    try:
        yield kinds, sql
    finally:
        await sql.close()
        await kinds.close()
        await engine.close()


def test_kind_table_current_and_as_of(tmp_path: Path) -> None:
    async def main() -> None:
        async with kind_sql(tmp_path) as (kinds, sql):
            tk = kinds.tenant(0)
            kind = await tk.create_kind("everything", ALL_TYPES)
            src = tk.connect("w")
            values = [True, 1, 2, 3, 4, -1, -2, -3, -4, 1.5, 2.5, "s", b"b", 1_000, 7]
            src.apply([assert_op(kind, b"\x01" * 32, values), assert_op(kind, b"\x02" * 32, [])])
            await tk.flush()
            first = tk.get(kind.kind_id, b"\x01" * 32)
            assert first is not None
            src.apply([patch_op(kind, b"\x01" * 32, {11: "t"}), retract_op(kind, b"\x02" * 32)])
            await tk.flush()
            now = await sql.query(0, "SELECT * FROM everything")
            assert now.columns[:3] == ["entity_id", "version", "c_bool"]
            # entity_key after the fields, so the contract's columns keep their places.
            assert now.columns[-2:] == ["field_Version", "entity_key"]
            assert len(now.rows) == 1 and now.rows[0][13] == "t"
            row = list(now.rows[0])
            # As SQL answers carry them: blobs in hex, floats as text, timestamps in ns.
            assert row[0] == ("01" * 32) and row[1] > first.version
            # The contract's column type (PROTOCOLS.md §1): lowercase hex VARCHAR.
            hex_id = await sql.query(
                0, f"SELECT typeof(entity_id) FROM everything WHERE entity_id = '{'01' * 32}'"
            )
            assert [list(r) for r in hex_id.rows] == [["VARCHAR"]]
            assert row[2:11] == values[:9]
            assert [float(row[11]), float(row[12]), row[13], row[14]] == [1.5, 2.5, "t", "62"]
            assert getattr(row[15], "ns", None) == 1_000 and row[16] == 7
            # The first window wrote eid 1 at first.version and eid 2 right after it.
            query = "SELECT c_string, version FROM everything ORDER BY entity_id"
            at = [(await sql.query_at(0, query, [], first.version + n)).rows for n in (0, 1, 2)]
            assert [[list(r) for r in rows] for rows in at] == [
                [],
                [["s", first.version]],
                [["s", first.version], ["", first.version + 1]],
            ]

    asyncio.run(main())


def test_changes_table_lists_every_change_in_log_order(tmp_path: Path) -> None:
    """``hw_changes_<kind>``: one row per change, deletions flagged with NULL fields, a
    field named like a changes column renamed, as-of reads cut exactly."""

    async def main() -> None:
        async with kind_sql(tmp_path) as (kinds, sql):
            tk = kinds.tenant(0)
            kind = await tk.create_kind("dev", [("temp", FieldType.F64), ("deleted", FieldType.U8)])
            a, b = b"\x0a" * 32, b"\x0b" * 32
            src = tk.connect("w")
            src.apply([assert_op(kind, a, [1.5, 1]), assert_op(kind, b, [2.5, 0])])
            await tk.flush()
            src.apply([patch_op(kind, a, {0: 3.5})])
            await tk.flush()
            src.apply([retract_op(kind, b)])
            await tk.flush()
            result = await sql.query(0, "SELECT * FROM hw_changes_dev ORDER BY version")
            assert result.columns == [
                "entity_id",
                "version",
                "deleted",
                "temp",
                "field_deleted",
                "entity_key",
            ]
            rows = [list(r) for r in result.rows]
            assert [(r[0], r[2], r[3], r[4]) for r in rows] == [
                ("0a" * 32, False, "1.5", 1),
                ("0b" * 32, False, "2.5", 0),
                ("0a" * 32, False, "3.5", 1),
                ("0b" * 32, True, None, None),
            ]
            versions = [r[1] for r in rows]
            assert versions == sorted(versions) and len(set(versions)) == 4
            # Each upsert's version is the entity's version in the kind table.
            current = await sql.query(0, "SELECT version FROM dev")
            assert [list(r) for r in current.rows] == [[versions[2]]]
            # As of the retraction's position: everything before it, nothing after.
            before = await sql.query_at(0, "SELECT version FROM hw_changes_dev", [], versions[3])
            assert sorted(r[0] for r in before.rows) == versions[:3]
            since = await sql.query(
                0, "SELECT count(*) FROM hw_changes_dev WHERE version >= ?", [versions[2]]
            )
            assert since.rows[0][0] == 2

    asyncio.run(main())


def test_entity_key_column_is_the_id_as_people_write_it(tmp_path: Path) -> None:
    """``entity_key`` shows a short text key as its text (what the CLI and the SDK show)
    and any other id as ``0x`` + hex, in the kind table and its changes table alike; a
    field named entity_key keeps its value under ``field_entity_key``."""

    async def main() -> None:
        async with kind_sql(tmp_path) as (kinds, sql):
            tk = kinds.tenant(0)
            kind = await tk.create_kind("labs", [("entity_key", FieldType.I64)])
            lab, raw = entity_id("lab-1"), b"\xff" * 32
            src = tk.connect("w")
            src.apply([assert_op(kind, lab, [1]), assert_op(kind, raw, [2])])
            await tk.flush()
            for table in ("labs", "hw_changes_labs"):
                found = await sql.query(
                    0,
                    f"SELECT entity_id, field_entity_key FROM {table} WHERE entity_key = ?",
                    ["lab-1"],
                )
                assert [list(r) for r in found.rows] == [[lab.hex(), 1]]
                keys = await sql.query(0, f"SELECT entity_key FROM {table} ORDER BY entity_id")
                assert [r[0] for r in keys.rows] == ["lab-1", "0x" + raw.hex()]

    asyncio.run(main())


def test_renamed_field_columns_never_take_another_fields_name(tmp_path: Path) -> None:
    """``version`` is the table's column, so the field ``version`` is ``field_version``;
    a field named ``field_version`` once lost that name to it (and became DuckDB's
    ``field_version_1``): each field's column now comes in field order, a migration's
    appended fields never renaming those before them."""

    async def main() -> None:
        async with kind_sql(tmp_path) as (kinds, sql):
            tk = kinds.tenant(0)
            fields = [("version", FieldType.I64), ("field_version", FieldType.STRING)]
            kind = await tk.create_kind("vfv", [*fields, ("a", FieldType.I64)])
            src = tk.connect("w")
            src.apply([assert_op(kind, entity_id("k1"), [7, "seven", 1])])
            await tk.flush()
            wider = await tk.create_kind(
                "vfv", [*fields, ("a", FieldType.I64), ("A", FieldType.I64)]
            )
            src.apply([assert_op(wider, entity_id("k1"), [7, "seven", 1, 2])])
            await tk.flush()
            for table in ("vfv", "hw_changes_vfv"):
                rows = await sql.query(
                    0, f"SELECT field_version, field_field_version, a, field_A FROM {table}"
                )
                assert [list(r) for r in rows.rows][-1] == [7, "seven", 1, 2]
            columns = (await sql.query(0, "SELECT * FROM vfv")).columns
            assert columns == [
                "entity_id",
                "version",
                "field_version",
                "field_field_version",
                "a",
                "field_A",
                "entity_key",
            ]

    asyncio.run(main())


def test_changes_table_follows_appends_compaction_and_migration(tmp_path: Path) -> None:
    """The decoded changelog is kept between queries: what is appended after a query,
    what compaction rewrites and fields a migration appends all show in the next one."""

    async def main() -> None:
        config = EngineConfig(maintenance_interval_ms=0, segment_bytes=600)
        query = "SELECT entity_id, version, n FROM hw_changes_cnt ORDER BY version"
        async with kind_sql(tmp_path, config) as (kinds, sql):
            tk = kinds.tenant(0)
            kind = await tk.create_kind("cnt", [("n", FieldType.I64)])
            src = tk.connect("w")
            ids = [bytes([i]) * 32 for i in range(3)]
            seen: list[list[object]] = []
            for n in range(12):
                src.apply([assert_op(kind, ids[n % 3], [n])])
                await tk.flush()
                rows = [list(r) for r in (await sql.query(0, query)).rows]
                assert rows[: len(seen)] == seen and len(rows) == n + 1
                assert rows[-1][0] == ids[n % 3].hex() and rows[-1][2] == n
                seen = rows
            state = tk.kinds[kind.kind_id]
            assert len(state.log.segments) > 2  # small segments: some are sealed
            removed = await kinds.run_maintenance()
            assert removed > 0
            after = [list(r) for r in (await sql.query(0, query)).rows]
            # Compaction keeps each entity's last change (and the active segment whole).
            assert len(after) < len(seen)
            assert {tuple(r) for r in after} <= {tuple(r) for r in seen}
            assert after[-3:] == seen[-3:]
            last = {r[0]: r[2] for r in seen}
            assert {r[0]: r[2] for r in after} == last
            # A migration appends a field: every row has the column, old rows its default.
            kind2 = await tk.create_kind("cnt", [("n", FieldType.I64), ("tag", FieldType.STRING)])
            src.apply([assert_op(kind2, ids[0], [99, "x"])])
            await tk.flush()
            rows = (await sql.query(0, "SELECT n, tag FROM hw_changes_cnt ORDER BY version")).rows
            assert [list(r) for r in rows][-2:] == [[11, ""], [99, "x"]]

    asyncio.run(main())
