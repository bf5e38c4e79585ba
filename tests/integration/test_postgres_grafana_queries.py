"""What Grafana's PostgreSQL data source sends, run through the postgres listener.

Grafana itself is not installed here (it is in neither Debian, PyPI nor npm), so these
are its statements, copied from its source (github.com/grafana/grafana, 2026):

* the connection check ("Save & test"): ``Ping``, which pgx (the default driver) sends
  as the simple query ``-- ping`` and lib/pq as ``;``
  (pkg/tsdb/grafana-postgresql-datasource/pgx/handler_checkhealth.go);
* the query editor's lists, public/app/plugins/datasource/grafana-postgresql-datasource/
  postgresMetaQuery.ts: ``getVersion``, ``getTimescaleDBVersion``, ``showTables()``,
  ``showTables(schema)`` and ``getSchema(table)`` (the column list);
* a time series panel's query with the macros expanded as
  pkg/tsdb/grafana-postgresql-datasource/macros.go expands them: ``$__timeGroupAlias``
  (``floor(extract(epoch from col)/secs)*secs AS "time"``), ``$__timeFilter``
  (``col BETWEEN '<RFC 3339 from>' AND '<RFC 3339 to>'``), ``$__time``,
  ``$__timeFrom()`` / ``$__timeTo()``.

Each runs the ways Grafana's drivers send it: the extended protocol (pgx; also with the
statement described before it runs, as pgx's statement cache does) and the simple one
(lib/pq, and pgx's ping).
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from kimberlite_raw import RawClient, create_stream
from servers import AUTH_CONFIG, LOCAL, Server, serving

TOKEN = "s3cret"  # the token servers.AUTH_CONFIG grants tenant 0
CONFIG = AUTH_CONFIG

# postgresMetaQuery.ts, as written there (${...} filled in by the functions below).
GET_VERSION = "SELECT current_setting('server_version_num')::int/100 as version"
GET_TIMESCALEDB_VERSION = "SELECT extversion FROM pg_extension WHERE extname = 'timescaledb'"
SCHEMA_CONSTRAINT = """
          quote_ident(table_schema) IN (
          SELECT
            CASE WHEN trim(s[i]) = '"$user"' THEN user ELSE trim(s[i]) END
          FROM
            generate_series(
              array_lower(string_to_array(current_setting('search_path'),','),1),
              array_upper(string_to_array(current_setting('search_path'),','),1)
            ) as i,
            string_to_array(current_setting('search_path'),',') s
          )"""


def show_tables(schema: str | None = None) -> str:
    if schema:
        schema_part = "'" + schema.replace("'", "''") + "'"
        return f"""SELECT quote_ident(table_name) AS "table"
      FROM information_schema.tables
      WHERE quote_ident(table_schema) = {schema_part}
      ORDER BY 1"""
    return f"""SELECT
    CASE WHEN {SCHEMA_CONSTRAINT}
      THEN quote_ident(table_name)
      ELSE quote_ident(table_schema) || '.' || quote_ident(table_name)
    END AS "table"
    FROM information_schema.tables
    WHERE quote_ident(table_schema) NOT IN ('information_schema',
                             'pg_catalog',
                             '_timescaledb_cache',
                             '_timescaledb_catalog',
                             '_timescaledb_internal',
                             '_timescaledb_config',
                             'timescaledb_information',
                             'timescaledb_experimental')
    ORDER BY CASE WHEN {SCHEMA_CONSTRAINT} THEN 0 ELSE 1 END, 1"""


def get_schema(table: str) -> str:
    table_part = "'" + table.replace("'", "''") + "'"
    return f"""SELECT quote_ident(column_name) AS "column", data_type AS "type"
    FROM information_schema.columns
    WHERE
      CASE WHEN array_length(parse_ident({table_part}),1) = 2
        THEN quote_ident(table_schema) = (parse_ident({table_part}))[1]
          AND quote_ident(table_name) = (parse_ident({table_part}))[2]
        ELSE quote_ident(table_name) = {table_part}
          AND {SCHEMA_CONSTRAINT}
      END"""


def rfc3339nano(moment: datetime.datetime) -> str:
    """Go's time.RFC3339Nano of a UTC time, as macros.go formats the time range."""
    text = moment.strftime("%Y-%m-%dT%H:%M:%S")
    if moment.microsecond:
        text += f".{moment.microsecond:06d}".rstrip("0")
    return text + "Z"


def expand_macros(sql: str, start: datetime.datetime, end: datetime.datetime) -> str:
    """macros.go's expansions of the macros a time series panel uses."""
    return (
        sql.replace("$__timeGroupAlias(ts, '1m')", 'floor(extract(epoch from ts)/60)*60 AS "time"')
        .replace("$__timeFilter(ts)", f"ts BETWEEN '{rfc3339nano(start)}' AND '{rfc3339nano(end)}'")
        .replace("$__time(ts)", 'ts AS "time"')
        .replace("$__timeFrom()", f"'{rfc3339nano(start)}'")
        .replace("$__timeTo()", f"'{rfc3339nano(end)}'")
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("postgres_grafana"),
        config=CONFIG,
        listen={"postgres": LOCAL},
        clean_log=True,
    )


@pytest.fixture(scope="module")
def stream(server: Server) -> str:
    """A stream with 3 events of sym A and 2 of B, appended now (ts is the append time)."""
    name = f"grafana_{uuid.uuid4().hex[:8]}"
    with RawClient(server.port, 0, token=TOKEN) as client:
        create_stream(client, name)
    with psycopg.connect(dsn(server), autocommit=True) as conn:
        values = ", ".join(f'(\'{{"sym": "{s}", "px": {i}}}\')' for i, s in enumerate("AABAB"))
        conn.execute(f"INSERT INTO {name} (json) VALUES {values}")
    return name


def dsn(server: Server) -> str:
    port = server.ports["postgres"]
    return f"host=127.0.0.1 port={port} user=grafana password={TOKEN} dbname=0 sslmode=disable"


def both_protocols(server: Server, sql: str) -> list[tuple[object, ...]]:
    """``sql``'s rows through the extended protocol (pgx), also described before it runs
    (pgx's statement cache), checked equal to the simple protocol's (lib/pq)."""
    with psycopg.connect(dsn(server), autocommit=True) as conn:
        cursor = conn.execute(sql)
        extended = cursor.fetchall()
        columns = [column.name for column in cursor.description or []]
        # pgx's default (cache statement) mode: Parse and Describe first, then Execute.
        pgconn = conn.pgconn
        assert pgconn.prepare(b"grafana", sql.encode()).status == psycopg.pq.ExecStatus.COMMAND_OK
        described = pgconn.describe_prepared(b"grafana")
        assert described.status == psycopg.pq.ExecStatus.COMMAND_OK, described.error_message
        assert [described.fname(i).decode() for i in range(described.nfields)] == columns
        assert pgconn.exec_prepared(b"grafana", []).ntuples == len(extended)
    with psycopg.connect(dsn(server), autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:
        simple = conn.cursor().execute(sql).fetchall()
    assert simple == extended
    return extended


@pytest.mark.parametrize("ping", ["-- ping", ";"])
def test_connection_check(server: Server, ping: str) -> None:
    """Save & test: the ping is a simple query with no statement in it."""
    with psycopg.connect(dsn(server), autocommit=True) as conn:
        result = conn.pgconn.exec_(ping.encode())
        assert result.status == psycopg.pq.ExecStatus.EMPTY_QUERY, result.error_message
        assert conn.execute("SELECT 1").fetchall() == [(1,)]


def test_version_and_timescaledb_check(server: Server) -> None:
    assert both_protocols(server, GET_VERSION) == [(1600,)]
    assert both_protocols(server, GET_TIMESCALEDB_VERSION) == []  # no TimescaleDB


def test_table_list(server: Server, stream: str) -> None:
    """Unqualified names: the tables' schema (main) is on the session's search_path."""
    tables = [row[0] for row in both_protocols(server, show_tables())]
    assert stream in tables
    assert all("." not in table and not table.startswith("pg_") for table in tables)
    assert stream in [row[0] for row in both_protocols(server, show_tables("main"))]
    assert both_protocols(server, show_tables("elsewhere")) == []


def test_column_list(server: Server, stream: str) -> None:
    # quote_ident quotes keywords, as PostgreSQL's does: offset is reserved in DuckDB too.
    expected = {
        ('"offset"', "bigint"),
        ('"position"', "bigint"),
        ("ts", "timestamp without time zone"),
        ("data", "bytea"),
        ("json", "json"),
    }
    assert set(both_protocols(server, get_schema(stream))) == expected
    assert set(both_protocols(server, get_schema(f"main.{stream}"))) == expected
    assert both_protocols(server, get_schema("no_such_table")) == []
    # The query builder writes the names as it got them: they read back.
    names = ", ".join(column for column, _ in sorted(expected))
    assert len(both_protocols(server, f"SELECT {names} FROM {stream}")) == 5


def test_time_series_with_the_macros_expanded(server: Server, stream: str) -> None:
    now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
    panel = (
        "SELECT $__timeGroupAlias(ts, '1m'), json->>'sym' AS metric, count(*) AS value "
        f"FROM {stream} WHERE $__timeFilter(ts) GROUP BY 1, 2 ORDER BY 1, 2"
    )
    hour = datetime.timedelta(hours=1)
    rows = both_protocols(server, expand_macros(panel, now - hour, now + hour))
    # Every event falls in the range; they were appended within a minute or two.
    assert sum(int(value) for _, _, value in rows) == 5
    by_sym: dict[object, int] = {}
    for bucket, sym, value in rows:
        assert float(bucket) % 60 == 0
        assert abs(float(bucket) - now.replace(tzinfo=datetime.UTC).timestamp()) < 3600
        by_sym[sym] = by_sym.get(sym, 0) + int(value)
    assert by_sym == {"A": 3, "B": 2}
    # A range before the events holds none of them: the filter is applied.
    assert both_protocols(server, expand_macros(panel, now - 3 * hour, now - 2 * hour)) == []
    table = expand_macros(
        f"SELECT $__time(ts), json->>'sym' AS sym FROM {stream} "
        'WHERE ts >= $__timeFrom() AND ts <= $__timeTo() ORDER BY 1, "offset"',
        now - hour,
        now + hour,
    )
    rows = both_protocols(server, table)
    assert [sym for _, sym in rows] == ["A", "A", "B", "A", "B"]
    assert all(isinstance(moment, datetime.datetime) for moment, _ in rows)
