"""Kinds as SQL tables: every field type as a column, current and as of a position."""

from __future__ import annotations

import asyncio
from pathlib import Path

from headwater.engine.engine import Engine, EngineConfig
from headwater.engine.kinds import KindsConfig, KindsEngine, assert_op, patch_op, retract_op
from headwater.protocols.convergedb.fields import FieldType
from headwater.sql.kinds import KindTables
from headwater.sql.service import SqlService

ALL_TYPES = [(f"c_{t.name.lower()}", t) for t in FieldType] + [("Version", FieldType.U8)]


def test_kind_table_current_and_as_of(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, EngineConfig(maintenance_interval_ms=0))
        kinds = await KindsEngine.open(engine, KindsConfig(coalesce_ms=60_000))
        sql = SqlService(engine)
        sql.add_source(KindTables(kinds))
        sql.start()
        try:
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
            assert now.columns[-1] == "field_Version"
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
        finally:
            await sql.close()
            await kinds.close()
            await engine.close()

    asyncio.run(main())
