"""A query can read its tenant's tables and append with INSERT INTO a stream; nothing
else: no UPDATE/DELETE/DDL, no files, no settings, no Python variables."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlkit import running

from headwater.errors import (
    HeadwaterError,
    QueryExecutionError,
    QueryParseError,
    TableNotFound,
)

REFUSED = [
    ("UPDATE s SET data = 'x'", QueryExecutionError, "append-only"),
    ("DELETE FROM s", QueryExecutionError, "append-only"),
    ("DROP TABLE s", QueryExecutionError, "DROP"),
    ("DROP VIEW s", QueryExecutionError, "DROP"),
    ("CREATE TABLE t (a INT)", QueryExecutionError, "CREATE"),
    ("CREATE TEMP VIEW v AS SELECT 1", QueryExecutionError, "CREATE"),
    ("ALTER TABLE s RENAME TO t", QueryExecutionError, "ALTER"),
    ("TRUNCATE s", QueryExecutionError, "append-only"),
    ("COPY s TO '{dir}/out.csv'", QueryExecutionError, "COPY"),
    ("COPY (SELECT 1) TO '{dir}/out.csv'", QueryExecutionError, "COPY"),
    ("EXPORT DATABASE '{dir}/export'", QueryExecutionError, "EXPORT"),
    ("ATTACH '{dir}/other.db' AS other", QueryExecutionError, "ATTACH"),
    ("DETACH memory", QueryExecutionError, "DETACH"),
    ("INSTALL httpfs", QueryExecutionError, "not allowed"),
    ("LOAD httpfs", QueryExecutionError, "not allowed"),
    ("SET enable_external_access = true", QueryExecutionError, "SET"),
    ("RESET lock_configuration", QueryExecutionError, "not allowed"),
    ("PRAGMA enable_profiling", QueryExecutionError, "PRAGMA"),
    ("CALL pragma_version()", QueryExecutionError, "CALL"),
    ("CHECKPOINT", QueryExecutionError, "not allowed"),
    ("BEGIN TRANSACTION", QueryExecutionError, "TRANSACTION"),
    ("EXPLAIN ANALYZE DELETE FROM s", QueryExecutionError, "EXPLAIN"),
    ("INSERT OR REPLACE INTO s (data) VALUES ('x')", QueryExecutionError, "append-only"),
    ("INSERT INTO s (data) VALUES ('x') RETURNING *", QueryExecutionError, "RETURNING"),
    ("SELECT 1; DELETE FROM s", QueryParseError, "exactly one"),
    ("SELECT 1; SELECT 2", QueryParseError, "exactly one"),
    ("", QueryParseError, "empty"),
    ("SELECT * FROM read_csv('{dir}/secret.csv')", QueryExecutionError, "disabled"),
    ("SELECT * FROM read_text('{dir}/secret.csv')", QueryExecutionError, "disabled"),
    ("SELECT * FROM '{dir}/secret.csv'", QueryExecutionError, ""),
    ("SELECT * FROM glob('{dir}/*')", QueryExecutionError, "disabled"),
    ("SELECT * FROM sniff_csv('{dir}/secret.csv')", QueryExecutionError, "disabled"),
]


def test_refused_statements_change_nothing(tmp_path: Path) -> None:
    secret = tmp_path / "secret.csv"
    secret.write_text("a,b\n1,2\n")

    async def main() -> None:
        async with running(tmp_path / "data") as (engine, sql):
            s = await engine.create_stream(0, "s")
            await engine.append(0, s.stream_id, [b'{"a": 1}', b"raw"])
            before = (await sql.query(0, "SELECT * FROM s")).rows
            for text, error, fragment in REFUSED:
                query = text.format(dir=tmp_path)
                with pytest.raises(error) as caught:
                    await sql.query(0, query)
                assert fragment in caught.value.message, (query, caught.value.message)
            # Settings stay locked down even for statements DuckDB parses as reads.
            settings = await sql.query(
                0,
                "SELECT current_setting('enable_external_access'), "
                "current_setting('lock_configuration'), "
                "current_setting('python_enable_replacements')",
            )
            assert settings.rows == [[False, True, False]]
            assert (await sql.query(0, "SELECT * FROM s")).rows == before
            assert [e.value for e in await engine.read_events(0, s.stream_id, 0)] == [
                b'{"a": 1}',
                b"raw",
            ]
            assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "secret.csv"]

    asyncio.run(main())


def test_python_variables_are_not_tables(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            s = await engine.create_stream(0, "s")
            await engine.append(0, s.stream_id, [b"x"])
            # Names of locals in the service's worker frames (Arrow tables among them).
            for name in ("snapshots", "table", "parsed", "values", "cur", "self"):
                with pytest.raises((TableNotFound, QueryExecutionError, QueryParseError)):
                    await sql.query(0, f"SELECT * FROM {name}")

    asyncio.run(main())


def test_parse_error_carries_duckdbs_message(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            await engine.create_stream(0, "s")
            with pytest.raises(QueryParseError) as caught:
                await sql.query(0, "SELEC 1 FROM s")
            assert 'syntax error at or near "SELEC"' in caught.value.message
            with pytest.raises(QueryParseError) as caught:
                await sql.query_at(0, "SELECT (1", [], 0)
            assert "syntax error" in caught.value.message
            with pytest.raises(TableNotFound) as missing:
                await sql.query(0, "SELECT * FROM nope")
            assert "nope" in missing.value.message
            with pytest.raises(QueryExecutionError) as runtime:
                await sql.query(0, "SELECT 1 / 0 = 1, 'x'::INT")
            assert "Could not convert" in runtime.value.message
            with pytest.raises(QueryExecutionError):
                await sql.query(0, "SELECT no_such_column FROM s")
            with pytest.raises(HeadwaterError):
                await sql.query(0, "SELECT $1", [object()])

    asyncio.run(main())


def test_text_beyond_ascii_before_a_table_name(tmp_path: Path) -> None:
    """DuckDB's token offsets count UTF-8 bytes: 'é' before FROM s once cut the table
    name wrong (TableNotFound), and an INSERT's rows out of the wrong place."""

    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            await engine.create_stream(0, "trades")
            inserted = await sql.query(
                0, 'INSERT /* ünïcødé */ INTO trades (json) VALUES (\'{"city": "Zürich"}\')'
            )
            assert inserted.rows[0][0] == 1
            result = await sql.query(
                0, "SELECT 'éééééé' AS x, json->>'city' AS city, count(*) FROM trades GROUP BY 1, 2"
            )
            assert result.rows == [["éééééé", "Zürich", 1]]

    asyncio.run(main())
