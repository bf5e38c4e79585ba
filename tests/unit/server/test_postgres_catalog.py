"""The postgres listener's catalog rewrite (server/postgres/catalog.py) run in DuckDB
over a registered table, as the SQL layer registers a stream's snapshot."""

from __future__ import annotations

from collections.abc import Iterator

import duckdb
import pyarrow as pa
import pytest

from headwater.protocols.postgres.connection import DEFAULT_SETTINGS
from headwater.server.postgres.catalog import rewrite


@pytest.fixture
def cur() -> Iterator[duckdb.DuckDBPyConnection]:
    with duckdb.connect(":memory:") as conn:
        cur = conn.cursor()
        amounts = pa.array([1.5]).cast(pa.decimal128(18, 3))
        cur.register("trades", pa.table({"offset": pa.array([7], pa.int64()), "amount": amounts}))
        yield cur


def run(cur: duckdb.DuckDBPyConnection, sql: str) -> list[tuple[object, ...]]:
    return cur.sql(rewrite(sql, DEFAULT_SETTINGS)).fetchall()


def test_statements_without_the_catalog_pass_untouched() -> None:
    for sql in ("SELECT 1", 'SELECT "offset" FROM trades -- a comment', "SELECT 'array'"):
        assert rewrite(sql, DEFAULT_SETTINGS) is sql


def test_columns_carry_the_wire_types(cur: duckdb.DuckDBPyConnection) -> None:
    rows = run(
        cur,
        "SELECT a.attname, t.typname, a.atttypmod FROM pg_catalog.pg_attribute a "
        "JOIN pg_catalog.pg_class c ON a.attrelid = c.oid "
        "JOIN pg_catalog.pg_type t ON t.oid = a.atttypid "
        "WHERE c.relname = 'trades' ORDER BY a.attnum",
    )
    # numeric(18,3): PostgreSQL's typmod is (precision << 16 | scale) + 4
    assert rows == [("offset", "int8", -1), ("amount", "numeric", (18 << 16 | 3) + 4)]


def test_a_statement_with_its_own_ctes_keeps_them(cur: duckdb.DuckDBPyConnection) -> None:
    sql = (
        "WITH t AS (SELECT relname FROM pg_catalog.pg_class) "
        "SELECT t.relname, n.nspname FROM t, pg_catalog.pg_namespace n WHERE n.oid = 2200"
    )
    assert run(cur, sql) == [("trades", "main")]


def test_casts_functions_and_settings(cur: duckdb.DuckDBPyConnection) -> None:
    assert run(cur, "SELECT 'trades'::regclass = (SELECT oid FROM pg_catalog.pg_class)") == [
        (True,)
    ]
    assert run(cur, "SELECT 'int8'::pg_catalog.regtype, 'nothing'::regclass") == [(20, None)]
    assert run(cur, "SELECT quote_ident('a'), quote_ident('Ab\"c'), parse_ident('m.t')") == [
        ("a", '"Ab""c"', ["m", "t"])
    ]
    assert run(cur, "SELECT array_lower([], 1), array_upper([5, 6], 1)") == [(None, 2)]
    assert run(cur, "SELECT current_setting('search_path'), current_setting('TimeZone')") == [
        ("main", "UTC")
    ]
    # A scalar function in FROM is one row; its alias names the column.
    assert run(cur, "SELECT s[2] FROM string_to_array('a,b', ',') s") == [("b",)]


def test_psql_spellings_and_a_stable_oid(cur: duckdb.DuckDBPyConnection) -> None:
    """What psql's \\d sends: OPERATOR(pg_catalog.~), COLLATE pg_catalog.default,
    ::pg_catalog.text, pg_catalog functions; the oid it answers finds the table again in
    a later statement (on a new cursor, as the SQL layer uses one per statement)."""
    [(oid, name)] = run(
        cur,
        "SELECT c.oid, c.relname::pg_catalog.text FROM pg_catalog.pg_class c "
        "WHERE c.relname OPERATOR(pg_catalog.~) '^(trades)$' COLLATE pg_catalog.default "
        "AND pg_catalog.pg_table_is_visible(c.oid)",
    )
    assert name == "trades"
    later = cur.cursor()
    later.register("trades", pa.table({"offset": pa.array([7], pa.int64())}))
    assert later.sql(
        rewrite(
            "SELECT pg_catalog.format_type(a.atttypid, a.atttypmod), "
            "pg_catalog.array_to_string(['x'], ',') FROM pg_catalog.pg_attribute a "
            f"WHERE a.attrelid = '{oid}'",
            DEFAULT_SETTINGS,
        )
    ).fetchall() == [("bigint", "x")]


def test_text_beyond_ascii_before_the_catalog(cur: duckdb.DuckDBPyConnection) -> None:
    """DuckDB's token offsets count UTF-8 bytes, not characters."""
    assert run(cur, "SELECT 'ünï' AS u, relname FROM pg_catalog.pg_class -- é") == [
        ("ünï", "trades")
    ]


def test_sqlalchemy_spellings(cur: duckdb.DuckDBPyConnection) -> None:
    """CAST(x AS REGCLASS) of a literal or a parameter (a name or an oid), a call
    translated to a constant that keeps its parameters (DuckDB refuses unused ones) and
    current_setting of a parameter, as SQLAlchemy's reflection sends them."""
    sql = (
        "SELECT CAST('trades' AS REGCLASS) = c.oid, CAST($1 AS REGCLASS) = c.oid,"
        " CAST($2 AS REGCLASS), pg_catalog.pg_get_constraintdef(c.oid, $3),"
        " current_setting($4::VARCHAR), CAST(c.relname AS pg_catalog.name)"
        " FROM pg_catalog.pg_class c"
    )
    params = ["main.trades", 5, True, "search_path"]
    assert cur.sql(rewrite(sql, DEFAULT_SETTINGS), params=params).fetchall() == [
        (True, True, 5, None, "main", "trades")
    ]


def test_session_names(cur: duckdb.DuckDBPyConnection) -> None:
    """current_database() and current_user are the names given, each column named as
    PostgreSQL names it; a column label that is one of these words is left alone."""
    sql = "SELECT current_database(), current_user AS u, 1 AS current_user, session_user"
    rel = cur.sql(rewrite(sql, DEFAULT_SETTINGS, user="me", database="acme"))
    assert rel.columns == ["current_database", "u", "current_user", "session_user"]
    assert rel.fetchall() == [("acme", "me", 1, "me")]
