"""The postgres listener against real PostgreSQL clients: Debian's psql and psycopg
(docs/protocols/postgres.md).

One server requires tokens (SCRAM-SHA-256): ``s3cret`` grants tenants 0 and 42,
``only42`` grants tenant 42. A second one runs without required auth (trust) and with
small ``[limits]``, each driven past its value.
"""

from __future__ import annotations

import datetime
import decimal
import json
import os
import shutil
import socket
import struct
import subprocess
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import pandas
import psycopg
import pytest
import sqlalchemy
import trustme
from kimberlite_raw import RawClient, create_stream
from limits_clients import counted, read_to_end, refusals
from psycopg import errors as pgerrors
from servers import LOCAL, Server, serving

from headwater.protocols.postgres import messages as m
from waiting import wait_until

TOKEN = "s3cret"
CONFIG = """
[auth]
required = true
[[auth.tokens]]
token = "s3cret"
tenants = [0, 42]
[[auth.tokens]]
token = "only42"
tenants = [42]

[[tenants]]
id = 42
name = "acme"
"""

MAX_CONNECTIONS = 3
HANDSHAKE_TIMEOUT_S = 1.0
IDLE_TIMEOUT_S = 3.0  # longer than any test here holds a connection unused
LIMITS_CONFIG = f"""
[limits]
max_connections = {MAX_CONNECTIONS}
handshake_timeout_s = {HANDSHAKE_TIMEOUT_S}
idle_timeout_s = {IDLE_TIMEOUT_S}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("postgres"),
        config=CONFIG,
        listen={"postgres": LOCAL},
        clean_log=True,
    )


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """No token required (trust), small limits, HTTP on for /metrics."""
    yield from serving(
        tmp_path_factory.mktemp("postgres_open"),
        config=LIMITS_CONFIG,
        listen={"postgres": LOCAL, "http": LOCAL, "kimberlite": ""},
        clean_log=True,
    )


def dsn(server: Server, *, password: str | None = TOKEN, dbname: str = "0") -> str:
    parts = [
        "host=127.0.0.1",
        f"port={server.ports['postgres']}",
        "user=analyst",
        f"dbname={dbname}",
        "sslmode=disable",
        "connect_timeout=15",
    ]
    if password is not None:
        parts.append(f"password={password}")
    return " ".join(parts)


def psql(
    server: Server, *commands: str, password: str = TOKEN, **kw: str
) -> subprocess.CompletedProcess[str]:
    """Run Debian's psql: each command as one ``-c`` (one session), unaligned output."""
    binary = shutil.which("psql")
    assert binary, "psql is missing: `make system-deps` installs Debian's postgresql-client"
    env = {**os.environ, "PGPASSWORD": password, "PGCONNECT_TIMEOUT": "15"}
    args = [binary, "-X", "-A", "-t", "-F", ",", "-v", "ON_ERROR_STOP=1"]
    args += ["-v", "VERBOSITY=verbose"]
    for command in commands:
        args += ["-c", command]
    args.append(dsn(server, password=None, **kw))
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)


def new_stream(server: Server, tenant_id: int = 0) -> str:
    name = f"trades_{uuid.uuid4().hex[:8]}"
    with RawClient(server.port, tenant_id, token=TOKEN) as client:
        create_stream(client, name)
    return name


# ---- psql ----------------------------------------------------------------------------


def test_psql_group_by(server: Server) -> None:
    stream = new_stream(server)
    rows = ", ".join(
        f"('{json.dumps({'sym': sym, 'px': px})}')"
        for sym, px in [("A", 1.5), ("B", 2.0), ("A", 3.0), ("C", 4.0), ("B", 0.5)]
    )
    done = psql(
        server,
        f"INSERT INTO {stream} (json) VALUES {rows}",
        f"SELECT json->>'sym' AS sym, count(*) AS n, sum((json->>'px')::DOUBLE) AS px "
        f"FROM {stream} GROUP BY 1 ORDER BY 1",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["INSERT", "0", "5", "A,2,4.5", "B,2,2.5", "C,1,4.0"]


def test_psql_as_of(server: Server) -> None:
    stream = new_stream(server)
    first = psql(
        server,
        f"INSERT INTO {stream} (data) VALUES ('a'), ('b')",
        f"SELECT max(position) + 1 FROM {stream}",
    )
    assert first.returncode == 0, first.stderr
    position = int(first.stdout.split()[-1])
    more = psql(server, f"INSERT INTO {stream} (data) VALUES ('c'), ('d'), ('e')")
    assert more.returncode == 0, more.stderr
    done = psql(
        server,
        f"SELECT count(*) FROM {stream}",
        f"SET headwater.as_of = {position}",
        f"SELECT count(*), string_agg(data::VARCHAR, '' ORDER BY \"offset\") FROM {stream}",
        "SHOW headwater.as_of",
        "RESET headwater.as_of",
        f"SELECT count(*) FROM {stream}",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["5", "SET", "2,ab", str(position), "RESET", "5"]


def test_reset_all_and_discard_all_reset_every_setting(server: Server) -> None:
    """RESET ALL (a pooler's reset) kept ``headwater.as_of``, so the next client of the
    connection read the past; RESET and DISCARD ALL go back to the settings the session
    started with, the tenant included: RESET headwater.tenant left SHOW saying '' while
    every statement still ran for the connect-time tenant."""
    stream = new_stream(server, tenant_id=42)
    first = psql(
        server,
        f"INSERT INTO {stream} (data) VALUES ('a')",
        f"SELECT max(position) + 1 FROM {stream}",
        f"INSERT INTO {stream} (data) VALUES ('b')",
        dbname="acme",
    )
    assert first.returncode == 0, first.stderr
    position = first.stdout.split()[-4]
    count = f"SELECT count(*) FROM {stream}"
    done = psql(
        server,
        f"SET headwater.as_of = {position}",
        "SET application_name = 'pooled'",
        count,
        "RESET ALL",
        "SHOW headwater.as_of",
        "SHOW application_name",
        count,
        f"SET headwater.as_of = {position}",
        "DISCARD ALL",
        count,
        "RESET headwater.tenant",
        "SHOW headwater.tenant",
        count,
        "RESET ALL",
        "SHOW headwater.tenant",
        dbname="acme",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        *("SET", "SET", "1"),
        *("RESET", "latest", "psql", "2"),  # psql's application_name at start-up
        *("SET", "DISCARD", "ALL", "2"),
        *("RESET", "42", "2"),
        *("RESET", "42"),
    ]
    # A setting given at connect time is that session's default, as in PostgreSQL.
    options = f"options='-c headwater.as_of={position}'"
    with psycopg.connect(f"{dsn(server, dbname='acme')} {options}", autocommit=True) as conn:
        conn.execute("SET headwater.as_of = latest")
        assert conn.execute(count).fetchone() == (2,)
        conn.execute("RESET ALL")
        assert conn.execute("SHOW headwater.as_of").fetchone() == (position,)
        assert conn.execute(count).fetchone() == (1,)
        with pytest.raises(pgerrors.UndefinedObject):
            conn.execute("RESET headwater.nothing")


def test_a_setting_changed_in_a_rolled_back_block_is_undone(server: Server) -> None:
    """PostgreSQL's SET is transactional: a ROLLBACK undoes it, and SET LOCAL lasts to
    the end of its block. Both were kept for the session: an as_of set in a rolled-back
    block (or SET LOCAL for one transaction) went on answering later queries from the
    past, silently stale."""
    stream = new_stream(server, tenant_id=42)
    with psycopg.connect(dsn(server, dbname="acme"), autocommit=True) as conn:
        conn.execute(f"INSERT INTO {stream} (data) VALUES ('a')")
        row = conn.execute(f"SELECT max(position) + 1 FROM {stream}").fetchone()
        assert row is not None
        position = row[0]
        conn.execute(f"INSERT INTO {stream} (data) VALUES ('b')")
        count = f"SELECT count(*) FROM {stream}"
        for ending in ("ROLLBACK", "COMMIT"):
            name = conn.execute("SHOW application_name").fetchone()
            conn.execute("BEGIN")
            conn.execute(f"SET LOCAL headwater.as_of = {position}")
            conn.execute("SET application_name = 'in-block'")
            assert conn.execute(count).fetchone() == (1,)  # as of the position, in it
            conn.execute(ending)
            assert conn.execute("SHOW headwater.as_of").fetchone() == ("latest",)
            assert conn.execute(count).fetchone() == (2,)
            # A plain SET: a COMMIT keeps it, a ROLLBACK undoes it.
            kept = ("in-block",) if ending == "COMMIT" else name
            assert conn.execute("SHOW application_name").fetchone() == kept
        conn.execute("BEGIN")
        conn.execute(f"SET headwater.as_of = {position}")
        with pytest.raises(pgerrors.UndefinedTable):
            conn.execute("SELECT * FROM no_such_table")  # the block fails
        conn.execute("ROLLBACK")
        assert conn.execute(count).fetchone() == (2,)
        conn.execute(f"SET LOCAL headwater.as_of = {position}")  # outside a block: nothing
        assert conn.execute(count).fetchone() == (2,)


def test_psql_wrong_password_then_right_one(server: Server) -> None:
    wrong = psql(server, "SELECT 1", password="not-a-token")
    assert wrong.returncode == 2
    assert 'password authentication failed for user "analyst"' in wrong.stderr
    right = psql(server, "SELECT 1")
    assert (right.returncode, right.stdout.strip()) == (0, "1")
    assert "password authentication failed" in server.log_text()  # one warning line


def test_psql_errors_carry_sqlstates(server: Server) -> None:
    for sql, sqlstate in [
        ("SELECT * FROM no_such_table", "42P01"),
        ("SELEC 1", "42601"),
        ("SET headwater.as_of = 'yesterday'", "22023"),
        ("SET headwater.as_of = 999999999; SELECT 1", "22023"),  # ahead of the log
    ]:
        done = psql(server, sql)
        assert done.returncode == 1, (sql, done.stdout)
        assert f"ERROR:  {sqlstate}:" in done.stderr, (sql, done.stderr)


def test_psql_session_statements(server: Server) -> None:
    done = psql(
        server,
        "SELECT version()",
        "SHOW server_version",
        "SET application_name = 'mine'",
        "SHOW application_name",
        "BEGIN",
        "SELECT 41 + 1",
        "COMMIT",
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("PostgreSQL 16.0") and "headwater" in lines[0]
    assert lines[1:] == ["16.0", "SET", "mine", "BEGIN", "42", "COMMIT"]


def test_escape_strings_in_a_simple_query(server: Server) -> None:
    """An E'...' string's backslash escapes (``E'it\\'s; fine'``, which DuckDB runs) are
    one string when a simple Query is cut into statements: the quote after the
    backslash ended it, so its ``;`` cut the statement ("unterminated string
    literal")."""
    done = psql(server, "SELECT E'it\\'s; fine' AS v, e'\\\\' AS w; SELECT 'x\\' AS y")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["it's; fine,\\", "x\\"]


def test_psql_describe_commands(server: Server) -> None:
    """psql's \\dt, \\dn and \\d <table>: its catalog queries, each several statements
    that look a table up by the oid an earlier one answered."""
    stream = new_stream(server)
    done = psql(server, "\\dt", "\\dn", f"\\d {stream}")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert f"main,{stream},table,headwater" in lines
    assert "main,headwater" in lines
    columns = [line for line in lines if line.count(",") == 4]
    assert columns == [
        "offset,bigint,,,",
        "position,bigint,,,",
        "ts,timestamp without time zone,,,",
        "data,bytea,,,",
        "json,json,,,",
    ]


def test_psql_describe_plus_functions_roles_and_pg_tables(server: Server) -> None:
    """psql's \\d+ <table> (storage, compression, statistics target), \\df (no
    functions), \\du (the one role, the tables' owner), and pg_tables listing the
    tables \\dt lists."""
    stream = new_stream(server)
    done = psql(
        server,
        f"\\d+ {stream}",
        "\\df",
        "\\du",
        f"SELECT schemaname, tablename, tableowner FROM pg_tables WHERE tablename = '{stream}'",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "offset,bigint,,,,plain,,,",
        "position,bigint,,,,plain,,,",
        "ts,timestamp without time zone,,,,plain,,,",
        "data,bytea,,,,extended,,,",
        "json,json,,,,extended,,,",
        "headwater,Cannot login,[]",
        f"main,{stream},headwater",
    ]


def test_current_database_and_user_are_the_ones_connected_with(server: Server) -> None:
    """As PostgreSQL answers: the database and user names of the connection, not
    DuckDB's ("memory", "duckdb"); information_schema's catalog is that database."""
    sql = (
        "SELECT current_database(), current_user, session_user, current_catalog,"
        " (SELECT DISTINCT catalog_name FROM information_schema.schemata)"
    )
    for dbname in ("0", "acme"):
        done = psql(server, sql, dbname=dbname)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [f"{dbname},analyst,analyst,{dbname},{dbname}"]


# ---- psycopg ---------------------------------------------------------------------------


def test_psycopg_simple_protocol(server: Server) -> None:
    stream = new_stream(server)
    with psycopg.connect(dsn(server), autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:
        cur = conn.cursor()
        cur.execute(f"INSERT INTO {stream} (json) VALUES (%s), (%s)", ['{"n": 1}', '{"n": 2}'])
        assert cur.rowcount == 2
        cur.execute(f"SELECT sum((json->>'n')::INT) AS total FROM {stream} WHERE data IS NOT NULL")
        assert cur.fetchall() == [(3,)]
        assert cur.description is not None and cur.description[0].name == "total"


def test_psycopg_extended_protocol_with_parameters(server: Server) -> None:
    stream = new_stream(server)
    with psycopg.connect(dsn(server), autocommit=True) as conn:
        cur = conn.cursor()
        cur.executemany(
            f"INSERT INTO {stream} (json) VALUES (%s)",
            [[json.dumps({"sym": s, "qty": q})] for s, q in [("A", 1), ("B", 2), ("A", 3)]],
        )
        for prepare in (False, True):  # unnamed, then a named prepared statement
            cur.execute(
                f"SELECT count(*), sum((json->>'qty')::INT) FROM {stream} "
                "WHERE json->>'sym' = %s AND (json->>'qty')::INT >= %s",
                ["A", 2],
                prepare=prepare,
            )
            assert cur.fetchall() == [(1, 3)]
        # A statement with a quote and a placeholder-like text inside a string literal.
        cur.execute("SELECT %s || ' it''s $1' AS s", ["x"])
        assert cur.fetchone() == ("x it's $1",)


VALUES = [
    ("%s::BIGINT", 1 << 40),
    ("%s::INTEGER", -7),
    ("%s::SMALLINT", 3),
    ("%s::DOUBLE", 2.5),
    ("%s::VARCHAR", "héllo"),
    ("%s::BOOLEAN", True),
    ("%s::BLOB", b"\x00\xffbytes"),
    ("%s::TIMESTAMP", datetime.datetime(2024, 1, 2, 3, 4, 5, 678901)),
    ("%s::DATE", datetime.date(1999, 12, 31)),
    ("%s::DECIMAL(12,4)", decimal.Decimal("-1234.5678")),
]


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_psycopg_types_round_trip(server: Server, binary: bool) -> None:
    with psycopg.connect(dsn(server), autocommit=True) as conn:
        cur = conn.cursor(binary=binary)
        sql = "SELECT " + ", ".join(f"{cast} AS c{i}" for i, (cast, _) in enumerate(VALUES))
        cur.execute(sql, [value for _, value in VALUES])
        assert cur.fetchone() == tuple(value for _, value in VALUES)
        assert cur.description is not None
        assert [c.type_code for c in cur.description] == [
            20,
            23,
            21,
            701,
            25,
            16,
            17,
            1114,
            1082,
            1700,
        ]
        cur.execute(
            "SELECT TIMESTAMPTZ '2024-05-06 07:08:09.5+00' AS tz, '{\"a\": [1, 2]}'::JSON AS j, "
            "1.5::FLOAT AS f, NULL::INTEGER AS nothing"
        )
        assert cur.fetchone() == (
            datetime.datetime(2024, 5, 6, 7, 8, 9, 500000, tzinfo=datetime.UTC),
            {"a": [1, 2]},
            1.5,
            None,
        )


# Values DuckDB has and Python's types do not (the SQL layer hands them on as DuckDB's
# text), each with the number PostgreSQL's binary format must carry, as a BIGINT:
# microseconds or days from 2000-01-01, computed by DuckDB itself.
_US_2000 = "epoch_us({}) - 946684800000000"
FAR_MOMENTS = [
    ("TIMESTAMP '2300-01-01 00:00:00.5'", _US_2000),
    ("'0044-03-15 (BC) 01:02:03.5'::TIMESTAMP", _US_2000),
    ("TIMESTAMPTZ '9999-12-31 23:00:00-02'", _US_2000),
    ("'infinity'::TIMESTAMP", "9223372036854775807"),
    ("DATE '10000-01-01'", "{} - DATE '2000-01-01'"),
    ("'0044-03-15 (BC)'::DATE", "{} - DATE '2000-01-01'"),
    ("'-infinity'::DATE", "-2147483648"),
]


def test_far_dates_timestamps_and_wide_numbers_in_binary(server: Server) -> None:
    # Each once failed: a far timestamp went out as its text in a binary column, a far
    # date closed the session, DECIMAL(38) and HUGEINT lost digits past the 28th.
    with psycopg.connect(dsn(server), autocommit=True) as conn:
        sql = "SELECT " + ", ".join(
            f"{value}, ({number.format(value)})::BIGINT" for value, number in FAR_MOMENTS
        )
        raw = conn.cursor(binary=True).execute(sql).pgresult
        assert raw is not None
        for i, (value, _) in enumerate(FAR_MOMENTS):
            expected = int.from_bytes(bytes(raw.get_value(0, 2 * i + 1)), signed=True)
            got = bytes(raw.get_value(0, 2 * i))
            assert len(got) == (4 if "DATE" in value else 8), value
            assert int.from_bytes(got, signed=True) == expected, value
        # PostgreSQL's text for BC puts "BC" last.
        text = conn.execute(
            "SELECT '0044-03-15 (BC)'::DATE, '0044-03-15 (BC) 01:02:03'::TIMESTAMP"
        ).pgresult
        assert text is not None
        assert [bytes(text.get_value(0, c)) for c in (0, 1)] == [
            b"0044-03-15 BC",
            b"0044-03-15 01:02:03 BC",
        ]
        wide = "12345678901234567890.123456789012"
        cur = conn.cursor(binary=True)
        cur.execute(
            f"SELECT {wide}::DECIMAL(38,12), 170141183460469231731687303715884105727::HUGEINT"
        )
        assert cur.fetchone() == (
            decimal.Decimal(wide),
            170141183460469231731687303715884105727,
        )
        # A date past what PostgreSQL's int32 days can say fails the statement, not the
        # session.
        with pytest.raises(pgerrors.DatetimeFieldOverflow):
            conn.cursor(binary=True).execute("SELECT '5877641-06-25 (BC)'::DATE")
        assert conn.execute("SELECT 'still here'").fetchone() == ("still here",)


def test_psycopg_error_leaves_the_connection_usable(server: Server) -> None:
    with psycopg.connect(dsn(server)) as conn:  # not autocommit: psycopg sends BEGIN
        with pytest.raises(pgerrors.UndefinedTable):
            conn.execute("SELECT * FROM no_such_table")
        with pytest.raises(pgerrors.InFailedSqlTransaction):
            conn.execute("SELECT 1")
        conn.rollback()
        assert conn.execute("SELECT 1 + %s", [1]).fetchone() == (2,)
        with pytest.raises(pgerrors.SyntaxError):
            conn.execute("SELEC %s", [1])
        conn.rollback()
        assert conn.execute("SELECT 'still here'").fetchone() == ("still here",)


def test_cancel_request_stops_a_running_query(server: Server) -> None:
    with psycopg.connect(dsn(server), autocommit=True) as conn:
        outcome: list[BaseException | None] = []

        def long_query() -> None:
            try:
                conn.execute("SELECT count(*) FROM range(100000000000) a, range(10) b")
            except psycopg.Error as exc:
                outcome.append(exc)
            else:
                outcome.append(None)

        worker = threading.Thread(target=long_query)
        worker.start()

        def cancelled() -> bool:
            # A CancelRequest that arrives before the statement runs cancels nothing
            # (as in PostgreSQL): send one per poll until the statement has ended.
            conn.cancel_safe()
            return bool(outcome)

        wait_until(cancelled, message="the query was never cancelled", interval=0.2)
        worker.join(15)
        assert isinstance(outcome[0], pgerrors.QueryCanceled), outcome
        assert conn.execute("SELECT 'after cancel'").fetchone() == ("after cancel",)


def test_database_name_chooses_the_tenant(server: Server) -> None:
    stream = new_stream(server, tenant_id=42)
    with psycopg.connect(dsn(server, dbname="42"), autocommit=True) as conn:
        assert conn.execute("SHOW headwater.tenant").fetchone() == ("42",)
        assert conn.execute(f"SELECT count(*) FROM {stream}").fetchone() == (0,)
    with (
        psycopg.connect(dsn(server, dbname="0"), autocommit=True) as conn,
        pytest.raises(pgerrors.UndefinedTable),
    ):
        conn.execute(f"SELECT count(*) FROM {stream}")
    # A token for tenant 42 alone lands there without naming it, and may not go elsewhere.
    with psycopg.connect(dsn(server, password="only42", dbname="analyst"), autocommit=True) as conn:
        assert conn.execute("SHOW headwater.tenant").fetchone() == ("42",)
    with pytest.raises(psycopg.OperationalError, match="does not grant tenant 0"):
        psycopg.connect(dsn(server, password="only42", dbname="0"))


def test_a_tenant_is_chosen_by_its_name_and_a_setting_naming_none_is_refused(
    server: Server,
) -> None:
    stream = new_stream(server, tenant_id=42)
    # [[tenants]] name = "acme": the database, or the setting, may name it.
    with psycopg.connect(dsn(server, dbname="acme"), autocommit=True) as conn:
        assert conn.execute("SHOW headwater.tenant").fetchone() == ("42",)
        assert conn.execute(f"SELECT count(*) FROM {stream}").fetchone() == (0,)
    options = "options='-c headwater.tenant=acme'"
    with psycopg.connect(f"{dsn(server)} {options}", autocommit=True) as conn:
        assert conn.execute("SHOW headwater.tenant").fetchone() == ("42",)
    with psycopg.connect(dsn(server, dbname="default"), autocommit=True) as conn:
        assert conn.execute("SHOW headwater.tenant").fetchone() == ("0",)
    # Named, but not granted: refused, not the token's own tenant instead.
    with pytest.raises(psycopg.OperationalError, match="does not grant tenant 0"):
        psycopg.connect(dsn(server, password="only42", dbname="default"))
    # A setting is asked for explicitly: one naming no tenant is an error, where it used
    # to mean the token's lowest tenant without a word.
    options = "options='-c headwater.tenant=acmee'"
    with pytest.raises(psycopg.OperationalError, match="'acmee' names no tenant"):
        psycopg.connect(f"{dsn(server)} {options}")


# ---- what a Describe and a failed block run ---------------------------------------------


def open_stream(server: Server) -> str:
    """A new stream on ``open_server`` (no Kimberlite there: through HTTP)."""
    name = f"trades_{uuid.uuid4().hex[:8]}"
    request = urllib.request.Request(
        f"http://{server.address_of('http')}/api/streams",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=15) as answer:
        assert answer.status in (200, 201)
    return name


class RawSession:
    """A trusted session on ``open_server`` speaking the protocol's messages as given,
    where a client library would add or reorder some (a Bind without an Execute)."""

    def __init__(self, server: Server) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.ports["postgres"]), timeout=15)
        self.buffer = b""
        self.sock.sendall(m.encode_startup({"user": "raw", "database": "0"}))
        self.until_ready()

    def send(self, *messages: m.FrontendMessage) -> list[m.BackendMessage]:
        """Send ``messages`` (end them with Sync): the answers up to ReadyForQuery."""
        self.sock.sendall(b"".join(m.encode_frontend(message) for message in messages))
        return self.until_ready()

    def until_ready(self) -> list[m.BackendMessage]:
        answers: list[m.BackendMessage] = []
        while not answers or answers[-1].type != "Z":
            while len(self.buffer) < 5 or len(self.buffer) < 1 + int.from_bytes(
                self.buffer[1:5], "big"
            ):
                chunk = self.sock.recv(1 << 16)
                assert chunk, f"the server closed the connection after {answers}"
                self.buffer += chunk
            end = 1 + int.from_bytes(self.buffer[1:5], "big")
            answers.append(m.decode_backend(self.buffer[:1], self.buffer[5:end]))
            self.buffer = self.buffer[end:]
        return answers

    def close(self) -> None:
        self.sock.close()


def kinds(answers: list[m.BackendMessage]) -> list[str]:
    """Each answer's type, an ErrorResponse with its SQLSTATE (``E:25P02``)."""
    return [f"E:{a.fields['C']}" if a.type == "E" else a.type for a in answers]


def test_an_insert_in_a_failed_block_is_refused_and_stores_nothing(server: Server) -> None:
    """psycopg outside autocommit: after an error in its block, an INSERT (Parse, Bind,
    Describe of the portal, Execute, Sync) is refused 25P02, as PostgreSQL refuses it,
    and nothing is stored: a client that retries it after ROLLBACK writes it once. (The
    Describe ran it, and stored it, while the answer said it was ignored.)"""
    stream = new_stream(server)
    with psycopg.connect(dsn(server)) as conn:
        with pytest.raises(pgerrors.UndefinedColumn):
            conn.execute(f"SELECT no_such_column FROM {stream}")
        with pytest.raises(pgerrors.InFailedSqlTransaction):
            conn.execute(f"INSERT INTO {stream} (data) VALUES (%s)", ["ghost"])
        conn.rollback()
        inserted = conn.execute(f"INSERT INTO {stream} (data) VALUES (%s)", ["retried"])
        assert inserted.rowcount == 1
        conn.commit()
        rows = conn.execute(f'SELECT data::VARCHAR FROM {stream} ORDER BY "offset"').fetchall()
    assert rows == [("retried",)]


def test_a_comment_before_insert_is_read_as_the_engine_reads_it(server: Server) -> None:
    """A statement is what the SQL layer's parser says it is, comments and all: psql's
    \\gdesc (a Describe, which PostgreSQL never runs) of an INSERT after a comment
    appended its rows, and its execution was answered ``SELECT 1`` and a row (its
    rows_affected, log_offset) instead of ``INSERT 0 n``."""
    stream = new_stream(server)
    binary = shutil.which("psql")
    assert binary
    described = subprocess.run(
        [binary, "-X", "-v", "ON_ERROR_STOP=1", dsn(server, password=None)],
        input=f"/* audit */ INSERT INTO {stream} (data) VALUES ('gdesc') \\gdesc\n",
        env={**os.environ, "PGPASSWORD": TOKEN, "PGCONNECT_TIMEOUT": "15"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert described.returncode == 0, described.stderr
    assert "has no result" in described.stdout, described.stdout
    done = psql(server, f"-- audit\nINSERT INTO {stream} (data) VALUES ('psql')")
    assert (done.returncode, done.stdout.strip()) == (0, "INSERT 0 1"), done.stderr
    with psycopg.connect(dsn(server), autocommit=True) as conn:
        pgconn = conn.pgconn
        for name, sql in [
            (b"audit", f"/* audit */ INSERT INTO {stream} (data) VALUES ('prepared')"),
            (b"line", f"-- x\nINSERT INTO {stream} (data) VALUES ('prepared')"),
        ]:
            assert pgconn.prepare(name, sql.encode()).status == psycopg.pq.ExecStatus.COMMAND_OK
            described_statement = pgconn.describe_prepared(name)
            assert described_statement.status == psycopg.pq.ExecStatus.COMMAND_OK
            assert described_statement.nfields == 0
            done_prepared = pgconn.exec_prepared(name, [])
            assert done_prepared.command_status == b"INSERT 0 1", done_prepared.error_message
            assert done_prepared.ntuples == 0
        for cursor in (conn.cursor(), psycopg.ClientCursor(conn)):  # extended, simple
            cursor.execute(f"/* c */ INSERT INTO {stream} (data) VALUES (%s), (%s)", ["a", "b"])
            assert (cursor.statusmessage, cursor.rowcount) == ("INSERT 0 2", 2)
            assert cursor.description is None
        rows = conn.execute(f'SELECT data::VARCHAR FROM {stream} ORDER BY "offset"').fetchall()
    assert [value for (value,) in rows] == ["psql", "prepared", "prepared", "a", "b", "a", "b"]


def test_a_described_insert_runs_at_execute_only(open_server: Server) -> None:
    """A Describe of an INSERT's portal is NoData (PostgreSQL's answer for an INSERT
    without RETURNING) and runs nothing: a portal closed without an Execute appends
    nothing, one executed appends once. Bind and Describe in a failed block are 25P02."""
    stream = open_stream(open_server)
    insert = f"INSERT INTO {stream} (data) VALUES ($1)"
    session = RawSession(open_server)
    try:
        described = session.send(
            m.Parse("", insert, ()),
            m.Bind("", "", (), (b"described",), ()),
            m.Describe("P", ""),
            m.Close("P", ""),
            m.Sync(),
        )
        assert kinds(described) == ["1", "2", "n", "3", "Z"]
        executed = session.send(
            m.Parse("", insert, ()),
            m.Bind("", "", (), (b"executed",), ()),
            m.Describe("P", ""),
            m.Execute("", 0),
            m.Sync(),
        )
        assert kinds(executed) == ["1", "2", "n", "C", "Z"]
        assert executed[3].fields["tag"] == "INSERT 0 1"
        assert stored(open_server, stream) == ["executed"]
        # A failed block: Bind, and a Describe of a portal bound before the error, are
        # refused; neither stores anything.
        session.send(m.Parse("ins", insert, ()), m.Sync())
        assert kinds(session.send(m.Query("BEGIN; SELECT no_such_column"))) == [
            "C",
            "E:42703",
            "Z",
        ]
        refused = session.send(m.Bind("", "ins", (), (b"bound in E",), ()), m.Sync())
        assert kinds(refused) == ["E:25P02", "Z"]
        assert refused[-1].fields["status"] == "E"
        refused = session.send(m.Describe("S", "ins"), m.Sync())
        assert kinds(refused) == ["E:25P02", "Z"]
        assert kinds(session.send(m.Query("ROLLBACK"))) == ["C", "Z"]
    finally:
        session.close()
    assert stored(open_server, stream) == ["executed"]


def test_a_parameter_number_past_postgresqls_limit_is_refused(open_server: Server) -> None:
    """``SELECT $30000000`` in one ~30-byte Parse held a type per parameter (30 million:
    450 MiB), and its Describe broke the connection (a count of 16 bits packed signed,
    a traceback in the log). A number past 65,535, what Bind and ParameterDescription can
    count (PostgreSQL's limit), is an ERROR; up to it, it is described."""
    session = RawSession(open_server)
    try:
        refused = session.send(m.Parse("big", "SELECT $30000000", ()), m.Sync())
        assert kinds(refused) == ["E:54000", "Z"]
        assert "at most 65535 parameters" in refused[0].fields["M"]
        missing = session.send(m.Describe("S", "big"), m.Sync())
        assert kinds(missing) == ["E:26000", "Z"]  # nothing was kept
        # Past 32,767 (a signed count's end) and within the limit: described.
        described = session.send(
            m.Parse("wide", "SELECT $40000::INTEGER AS n", ()), m.Describe("S", "wide"), m.Sync()
        )
        assert kinds(described)[:2] == ["1", "t"]
        assert len(described[1].fields["oids"]) == 40000
        assert kinds(session.send(m.Query("SELECT 1"))) == ["T", "D", "C", "Z"]
    finally:
        session.close()


def stored(server: Server, stream: str) -> list[str]:
    """The values of ``stream`` on ``open_server``, in order."""
    with psycopg.connect(dsn(server, password=None), autocommit=True) as conn:
        rows = conn.execute(f'SELECT data::VARCHAR FROM {stream} ORDER BY "offset"').fetchall()
    return [value for (value,) in rows]


# ---- trust and limits ------------------------------------------------------------------


def test_trust_without_required_auth(open_server: Server) -> None:
    with psycopg.connect(dsn(open_server, password=None), autocommit=True) as conn:
        assert conn.execute("SELECT 'trusted'").fetchone() == ("trusted",)


def test_max_connections(open_server: Server) -> None:
    before = refusals(open_server)
    held = [psycopg.connect(dsn(open_server, password=None)) for _ in range(MAX_CONNECTIONS)]
    try:
        with pytest.raises(psycopg.OperationalError, match="max_connections"):
            psycopg.connect(dsn(open_server, password=None))
    finally:
        for conn in held:
            conn.close()

    # /metrics is a connection too: read once the held ones are gone.
    def refusal_counted() -> bool:
        try:
            return counted(open_server, before, "max_connections", "postgres") == 1
        except urllib.error.HTTPError as exc:  # 503 while the held ones are still closing
            assert exc.code == 503
            return False

    wait_until(refusal_counted, message="the refusal was not counted in /metrics")
    with psycopg.connect(dsn(open_server, password=None), autocommit=True) as conn:
        assert conn.execute("SELECT 'served'").fetchone() == ("served",)


def test_handshake_timeout(open_server: Server) -> None:
    before = refusals(open_server)
    sock = socket.create_connection(("127.0.0.1", open_server.ports["postgres"]), timeout=15)
    try:
        sock.sendall(m.encode_startup({"user": "slow"})[:10])  # and never the rest
        [error] = m.split_backend(read_to_end(sock))
    finally:
        sock.close()
    assert error.fields["S"] == "FATAL" and error.fields["C"] == "08P01"
    assert "handshake_timeout_s" in error.fields["M"]
    assert counted(open_server, before, "handshake_timeout_s", "postgres") == 1
    test_trust_without_required_auth(open_server)


def test_idle_timeout(open_server: Server) -> None:
    before = refusals(open_server)
    sock = socket.create_connection(("127.0.0.1", open_server.ports["postgres"]), timeout=15)
    try:
        sock.sendall(m.encode_startup({"user": "idle"}))
        data = read_to_end(sock)  # AuthenticationOk ... ReadyForQuery, then nothing sent
    finally:
        sock.close()
    answers = m.split_backend(data)
    kinds = [a.type for a in answers]
    assert kinds[0] == "R" and "Z" in kinds
    error = answers[-1]
    assert (error.type, error.fields["S"], error.fields["C"]) == ("E", "FATAL", "57P05")
    assert "idle_timeout_s" in error.fields["M"]
    assert counted(open_server, before, "idle_timeout_s", "postgres") == 1
    test_trust_without_required_auth(open_server)


def test_oversized_startup_packet_is_refused_before_it_is_read(open_server: Server) -> None:
    sock = socket.create_connection(("127.0.0.1", open_server.ports["postgres"]), timeout=15)
    try:
        sock.sendall(struct.pack(">i", 1 << 30))  # claims 1 GiB
        [error] = m.split_backend(read_to_end(sock))
    finally:
        sock.close()
    assert error.fields["S"] == "FATAL" and error.fields["C"] == "08P01"
    test_trust_without_required_auth(open_server)


# ---- TLS -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    """``[tls]`` with a trustme certificate; yields the server and the CA file."""
    root = tmp_path_factory.mktemp("postgres_tls")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(
        str(root / "server.pem")
    )
    config = CONFIG + f'\n[tls]\ncert = "{root / "server.pem"}"\nkey = "{root / "server.pem"}"\n'
    for server in serving(root / "server", config=config, listen={"postgres": LOCAL}):
        yield server, str(root / "ca.pem")


def test_tls_through_ssl_request(tls_server: tuple[Server, str]) -> None:
    server, ca = tls_server
    secure = dsn(server).replace("sslmode=disable", f"sslmode=verify-full sslrootcert={ca}")
    with psycopg.connect(secure, autocommit=True) as conn:
        assert conn.pgconn.ssl_in_use
        assert conn.execute("SELECT 'over tls'").fetchone() == ("over tls",)
    binary = shutil.which("psql")
    assert binary
    done = subprocess.run(
        [binary, "-X", "-A", "-t", "-c", "SELECT 1 + 1", secure],
        env={**os.environ, "PGPASSWORD": TOKEN},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "2"), done.stderr


def test_plain_text_is_refused_under_tls(tls_server: tuple[Server, str]) -> None:
    server, ca = tls_server
    with pytest.raises(psycopg.OperationalError, match="sslmode=require"):
        psycopg.connect(dsn(server))  # sslmode=disable
    secure = dsn(server).replace("sslmode=disable", f"sslmode=require sslrootcert={ca}")
    with psycopg.connect(secure, autocommit=True) as conn:  # and still serving
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_plain_bytes_after_ssl_request_are_refused(tls_server: tuple[Server, str]) -> None:
    """CVE-2021-23214: bytes pipelined behind the SSLRequest must not be taken as if
    they had come through TLS."""
    server, _ = tls_server
    sock = socket.create_connection(("127.0.0.1", server.ports["postgres"]), timeout=15)
    try:
        sock.sendall(m.encode_ssl_request() + m.encode_startup({"user": "sneaky"}))
        [error] = m.split_backend(read_to_end(sock))
    finally:
        sock.close()
    assert error.fields["C"] == "08P01" and "unencrypted" in error.fields["M"]


# ---- pandas through SQLAlchemy ---------------------------------------------------------


def test_pandas_read_sql_through_sqlalchemy(server: Server) -> None:
    stream = new_stream(server)
    psql(server, f'INSERT INTO {stream} (json) VALUES (\'{{"sym": "A", "qty": 2}}\')')
    # SQLAlchemy's first connect runs version(), current_schema(), SHOW ..., a savepoint
    # and psycopg's pg_type lookup of hstore: each must be answered.
    engine = sqlalchemy.create_engine(
        f"postgresql+psycopg://analyst:{TOKEN}@127.0.0.1:{server.ports['postgres']}/0"
    )
    try:
        frame = pandas.read_sql(
            sqlalchemy.text(
                f"SELECT json->>'sym' AS sym, (json->>'qty')::INT AS qty, ts FROM {stream} "
                "WHERE (json->>'qty')::INT >= :least"
            ),
            engine,
            params={"least": 1},
        )
    finally:
        engine.dispose()
    assert frame[["sym", "qty"]].to_dict("records") == [{"sym": "A", "qty": 2}]
    assert frame["qty"].dtype.kind == "i" and frame["ts"].dtype.kind == "M"


def test_sqlalchemy_reflects_a_stream_and_pandas_reads_it_by_name(server: Server) -> None:
    """SQLAlchemy's PostgreSQL reflection (Table(autoload_with=...), what
    pandas.read_sql_table and read_sql of a table name run): its catalog queries use
    CAST(... AS REGCLASS), pg_get_serial_sequence, json_build_object, pg_sequence,
    pg_opclass, pg_tablespace and current_setting of a parameter."""
    stream = new_stream(server)
    done = psql(server, f"INSERT INTO {stream} (data) VALUES ('a'), ('b')")
    assert done.returncode == 0, done.stderr
    engine = sqlalchemy.create_engine(
        f"postgresql+psycopg://analyst:{TOKEN}@127.0.0.1:{server.ports['postgres']}/0"
    )
    try:
        inspector = sqlalchemy.inspect(engine)
        columns = [(c["name"], str(c["type"])) for c in inspector.get_columns(stream)]
        keys = inspector.get_pk_constraint(stream)
        others = [
            inspector.get_foreign_keys(stream),
            inspector.get_indexes(stream),
            inspector.get_unique_constraints(stream),
            inspector.get_check_constraints(stream),
        ]
        table = sqlalchemy.Table(stream, sqlalchemy.MetaData(), autoload_with=engine)
        by_table = pandas.read_sql_table(stream, engine)
        by_name = pandas.read_sql(stream, engine)
    finally:
        engine.dispose()
    assert columns == [
        ("offset", "BIGINT"),
        ("position", "BIGINT"),
        ("ts", "TIMESTAMP"),
        ("data", "BYTEA"),
        ("json", "JSON"),
    ]
    assert keys == {"name": None, "constrained_columns": []}
    assert others == [[], [], [], []]
    assert [column.name for column in table.columns] == [name for name, _ in columns]
    for frame in (by_table, by_name):
        assert list(frame.columns) == [name for name, _ in columns]
        assert frame["data"].tolist() == [b"a", b"b"]
        assert frame["offset"].tolist() == [0, 1] and frame["ts"].dtype.kind == "M"


def test_describe_a_prepared_statement_before_bind(server: Server) -> None:
    """libpq's PQprepare and PQdescribePrepared (what JDBC-style clients do): the
    parameter types and result columns of a statement never executed."""
    with psycopg.connect(dsn(server), autocommit=True) as conn:
        pgconn = conn.pgconn
        sql = b"SELECT $1::INTEGER + 1 AS n, 'x' AS s -- a trailing comment"
        assert pgconn.prepare(b"s1", sql, [0]).status == psycopg.pq.ExecStatus.COMMAND_OK
        described = pgconn.describe_prepared(b"s1")
        assert described.status == psycopg.pq.ExecStatus.COMMAND_OK
        assert [described.param_type(i) for i in range(described.nparams)] == [25]
        fields = [(described.fname(i), described.ftype(i)) for i in range(described.nfields)]
        assert fields == [(b"n", 23), (b"s", 25)]
        done = pgconn.exec_prepared(b"s1", [b"41"])
        assert (done.ntuples, done.get_value(0, 0), done.get_value(0, 1)) == (1, b"42", b"x")
