"""PostgreSQL v3 wire vectors (docs/protocols/postgres.md; PostgreSQL's "Message
Formats" chapter): exact bytes in, exact bytes out, through the sans-I/O connection.

The SCRAM exchange is RFC 7677's own example (user "user", password "pencil"), so the
server's proof check and signature are checked against the standard's numbers, not
against this code's own arithmetic.
"""

from __future__ import annotations

import base64
import struct

import pytest

from headwater.protocols.postgres import messages as m
from headwater.protocols.postgres import types as t
from headwater.protocols.postgres.auth import ScramError, TokenKeys
from headwater.protocols.postgres.connection import (
    Authenticate,
    CancelRequested,
    Close,
    DescribeStatement,
    QueryOutcome,
    Reject,
    Reply,
    RunQuery,
    ServerConnection,
    TlsRequested,
)

STARTUP = (
    b"\x00\x00\x00\x36"  # length 54
    b"\x00\x03\x00\x00"  # protocol 3.0
    b"user\x00alice\x00database\x0042\x00application_name\x00psql\x00\x00"
)


def events(conn: ServerConnection, data: bytes) -> list[object]:
    """The events ``data`` completes, pulled as the shell pulls them: up to one that
    needs an answer (the connection decides what follows from that answer)."""
    conn.feed(data)
    out: list[object] = []
    while (event := conn.next_event()) is not None:
        out.append(event)
        if isinstance(event, RunQuery | Authenticate | DescribeStatement):
            break
    return out


def trusted() -> ServerConnection:
    conn = ServerConnection(auth="trust")
    [auth] = events(conn, STARTUP)
    assert isinstance(auth, Authenticate)
    conn.accept(1234, 5678)
    return conn


def test_startup_message_bytes() -> None:
    assert len(STARTUP) == 54
    assert m.encode_startup({"user": "alice", "database": "42", "application_name": "psql"}) == (
        STARTUP
    )
    assert m.decode_startup(STARTUP[4:]) == m.StartupMessage(
        196608, {"user": "alice", "database": "42", "application_name": "psql"}
    )


def test_ssl_and_gssenc_requests_are_declined_with_n() -> None:
    conn = ServerConnection(auth="trust")
    assert m.encode_ssl_request() == b"\x00\x00\x00\x08\x04\xd2\x16\x2f"
    assert events(conn, m.encode_ssl_request()) == [TlsRequested()]
    assert conn.decline_tls() == b"N"
    gssenc = b"\x00\x00\x00\x08\x04\xd2\x16\x30"
    [reply] = events(conn, gssenc)
    assert isinstance(reply, Reply) and reply.data == b"N"
    [auth] = events(conn, STARTUP)  # the client goes on in plain text
    assert auth == Authenticate(
        "alice", None, {"user": "alice", "database": "42", "application_name": "psql"}
    )


def test_cancel_request() -> None:
    conn = ServerConnection(auth="trust")
    data = b"\x00\x00\x00\x10\x04\xd2\x16\x2e\x00\x00\x04\xd2\x00\x00\x16\x2e"
    assert m.encode_cancel_request(1234, 5678) == data
    assert events(conn, data) == [CancelRequested(1234, 5678)]
    assert conn.closed


def test_accept_sends_ok_settings_key_and_ready() -> None:
    conn = ServerConnection(auth="trust")
    events(conn, STARTUP)
    data = conn.accept(1234, 5678)
    assert data.startswith(b"R\x00\x00\x00\x08\x00\x00\x00\x00")  # AuthenticationOk
    assert b"S\x00\x00\x00\x19client_encoding\x00UTF8\x00" in data
    assert b"S\x00\x00\x00\x18server_version\x0016.0\x00" in data
    assert b"S\x00\x00\x00\x1aapplication_name\x00psql\x00" in data
    assert data.endswith(
        b"K\x00\x00\x00\x0c\x00\x00\x04\xd2\x00\x00\x16\x2e"  # BackendKeyData
        b"Z\x00\x00\x00\x05I"  # ReadyForQuery, idle
    )


def test_cleartext_password() -> None:
    conn = ServerConnection(auth="password")
    [ask] = events(conn, STARTUP)
    assert isinstance(ask, Reply) and ask.data == b"R\x00\x00\x00\x08\x00\x00\x00\x03"
    [auth] = events(conn, b"p\x00\x00\x00\x0bs3cret\x00")
    assert isinstance(auth, Authenticate) and auth.token == "s3cret"
    refusal = conn.refuse("28P01", "unknown token")
    assert refusal == (
        b"E\x00\x00\x00\x4bSFATAL\x00VFATAL\x00C28P01\x00"
        b'Mpassword authentication failed for user "alice"\x00\x00'
    )
    assert conn.closed


# RFC 7677, section 3.
RFC_CLIENT_FIRST = "n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
RFC_SERVER_NONCE = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
RFC_SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
RFC_SERVER_FIRST = (
    "r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
)
RFC_CLIENT_FINAL = (
    "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
    "p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
)
RFC_SERVER_FINAL = "v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="


def test_scram_sha_256_rfc7677_vector() -> None:
    keys = TokenKeys(["other-token", "pencil"], salt=RFC_SALT)
    exchange = keys.exchange(RFC_SERVER_NONCE)
    assert exchange.client_first(RFC_CLIENT_FIRST) == RFC_SERVER_FIRST
    assert exchange.client_final(RFC_CLIENT_FINAL) == ("pencil", RFC_SERVER_FINAL)


def test_scram_proof_of_no_token_is_refused() -> None:
    keys = TokenKeys(["other-token"], salt=RFC_SALT)
    exchange = keys.exchange(RFC_SERVER_NONCE)
    exchange.client_first(RFC_CLIENT_FIRST)
    with pytest.raises(ScramError) as refused:
        exchange.client_final(RFC_CLIENT_FINAL)
    assert refused.value.sqlstate == "28P01"


def _sasl_initial(data: str) -> bytes:
    body = b"SCRAM-SHA-256\x00" + struct.pack(">i", len(data)) + data.encode()
    return m.message(b"p", body)


def test_scram_through_the_connection() -> None:
    keys = TokenKeys(["pencil"], salt=RFC_SALT)
    conn = ServerConnection(auth="scram-sha-256", keys=keys)
    [mechanisms] = events(conn, STARTUP)
    assert isinstance(mechanisms, Reply)
    assert mechanisms.data == b"R\x00\x00\x00\x17\x00\x00\x00\x0aSCRAM-SHA-256\x00\x00"
    # libpq sends an empty user name in SCRAM (the start-up packet carries the user).
    [server_first] = events(conn, _sasl_initial("n,,n=,r=rOprNGfwEbeRWgbNEkqO"))
    assert isinstance(server_first, Reply)
    kind, text = struct.unpack(">i", server_first.data[5:9])[0], server_first.data[9:]
    assert kind == m.AUTH_SASL_CONTINUE
    assert text.startswith(b"r=rOprNGfwEbeRWgbNEkqO") and b",s=W22ZaJ0SNY7soEsUEjb6gQ==," in text


def test_wrong_scram_proof_is_fatal_28p01() -> None:
    keys = TokenKeys(["pencil"], salt=RFC_SALT)
    conn = ServerConnection(auth="scram-sha-256", keys=keys)
    events(conn, STARTUP)
    [server_first] = events(conn, _sasl_initial(RFC_CLIENT_FIRST))
    assert isinstance(server_first, Reply)
    nonce = server_first.data[9:].decode().split(",")[0][2:]
    bogus = f"c=biws,r={nonce},p=" + base64.b64encode(b"\x00" * 32).decode()
    [refused] = events(conn, m.message(b"p", bogus.encode()))
    assert isinstance(refused, Reject)
    assert refused.answer.sqlstate == "28P01" and refused.answer.severity == "FATAL"
    assert m.split_backend(refused.data)[0].fields["C"] == "28P01"


def test_row_description_and_data_row_bytes() -> None:
    columns = [m.Column("n", t.INT8, 8), m.Column("s", t.TEXT)]
    assert m.encode_row_description(columns) == (
        b"T\x00\x00\x00\x2e\x00\x02"
        b"n\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x14\x00\x08\xff\xff\xff\xff\x00\x00"
        b"s\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x19\xff\xff\xff\xff\xff\xff\x00\x00"
    )
    assert m.encode_data_row([b"42", None]) == (
        b"D\x00\x00\x00\x10\x00\x02\x00\x00\x00\x0242\xff\xff\xff\xff"
    )


def test_error_response_bytes() -> None:
    fields = m.ErrorFields("ERROR", "42P01", "no table t")
    assert m.encode_error(fields) == (
        b"E\x00\x00\x00\x26SERROR\x00VERROR\x00C42P01\x00Mno table t\x00\x00"
    )


def test_simple_query_round() -> None:
    conn = trusted()
    got = events(conn, b"Q\x00\x00\x00\x1cSELECT 1 AS n, 'x' AS s\x00")
    assert isinstance(got[0], Reply)  # the query is taken; its statements follow
    run = got[1]
    assert run == RunQuery("SELECT 1 AS n, 'x' AS s", [], None, None, describe_only=False)
    assert isinstance(run, RunQuery)
    data = conn.complete(run, QueryOutcome(["n", "s"], ["INTEGER", "VARCHAR"], [[1, "x"]]))
    assert data == (
        m.encode_row_description([m.Column("n", t.INT4, 4), m.Column("s", t.TEXT)])
        + b"D\x00\x00\x00\x10\x00\x02\x00\x00\x00\x011\x00\x00\x00\x01x"
        + b"C\x00\x00\x00\x0dSELECT 1\x00"
    )
    [ready] = events(conn, b"")
    assert isinstance(ready, Reply) and ready.data == b"Z\x00\x00\x00\x05I"


def test_error_drops_the_rest_of_a_simple_query() -> None:
    conn = trusted()
    got = events(conn, m.encode_frontend(m.Query("SELECT nope; SET a = 1; SELECT 2")))
    run = got[1]
    assert isinstance(run, RunQuery)
    error = conn.fail("42703", "no column nope")
    assert m.split_backend(error)[0].fields["C"] == "42703"
    [ready] = events(conn, b"")  # SET and SELECT 2 are dropped, as PostgreSQL does
    assert isinstance(ready, Reply) and ready.data == b"Z\x00\x00\x00\x05I"
    assert conn.settings.get("a") is None


def test_extended_protocol_with_binary_parameter_and_result() -> None:
    conn = trusted()
    data = b"".join(
        m.encode_frontend(msg)
        for msg in (
            m.Parse("", "SELECT $1::BIGINT + 1 AS n", (t.INT8,)),
            m.Bind("", "", (1,), (struct.pack(">q", 41),), (1,)),
            m.Describe("P", ""),
            m.Execute("", 0),
            m.Sync(),
        )
    )
    got = events(conn, data)
    assert [type(e) for e in got] == [Reply, Reply, RunQuery]
    assert got[0].data == b"1\x00\x00\x00\x04" and got[1].data == b"2\x00\x00\x00\x04"
    describe = got[2]
    assert isinstance(describe, RunQuery) and describe.parameters == [41]
    assert describe.describe_only
    outcome = QueryOutcome(["n"], ["BIGINT"], [[42]])
    assert conn.complete(describe, outcome) == m.encode_row_description(
        [m.Column("n", t.INT8, 8, format=1)]
    )
    rows, ready = events(conn, b"")  # Execute answers from the described portal
    assert isinstance(rows, Reply)
    assert rows.data == (
        b"D\x00\x00\x00\x12\x00\x01\x00\x00\x00\x08"
        + struct.pack(">q", 42)
        + b"C\x00\x00\x00\x0dSELECT 1\x00"
    )
    assert isinstance(ready, Reply) and ready.data == b"Z\x00\x00\x00\x05I"


def test_extended_error_skips_to_sync() -> None:
    conn = trusted()
    data = b"".join(
        m.encode_frontend(msg)
        for msg in (
            m.Parse("", "SELECT $1::INT", (t.INT4,)),
            m.Bind("", "", (), (b"not a number",), ()),
            m.Execute("", 0),
            m.Sync(),
        )
    )
    parse, bind, skipped, ready = events(conn, data)
    assert isinstance(parse, Reply) and parse.data == m.PARSE_COMPLETE
    assert isinstance(bind, Reply)
    error = m.split_backend(bind.data)[0]
    assert error.type == "E" and error.fields["C"] == "22P02"
    assert isinstance(skipped, Reply) and skipped.data == b""  # Execute ignored
    assert isinstance(ready, Reply) and ready.data == b"Z\x00\x00\x00\x05I"


def test_transaction_status_in_ready_for_query() -> None:
    conn = trusted()
    got = events(conn, m.encode_frontend(m.Query("BEGIN")))
    assert [e.data for e in got if isinstance(e, Reply)] == [
        b"",
        b"C\x00\x00\x00\x0aBEGIN\x00",
        b"Z\x00\x00\x00\x05T",
    ]
    got = events(conn, m.encode_frontend(m.Query("SELECT broken")))
    run = got[1]
    assert isinstance(run, RunQuery)
    conn.fail("42703", "no column")
    [ready] = events(conn, b"")
    assert isinstance(ready, Reply) and ready.data == b"Z\x00\x00\x00\x05E"
    got = events(conn, m.encode_frontend(m.Query("SELECT 1")))
    assert m.split_backend(got[1].data)[0].fields["C"] == "25P02"  # type: ignore[union-attr]
    got = events(conn, m.encode_frontend(m.Query("ROLLBACK")))
    assert got[-1].data == b"Z\x00\x00\x00\x05I"  # type: ignore[union-attr]


def test_as_of_setting() -> None:
    conn = trusted()
    events(conn, m.encode_frontend(m.Query("SET headwater.as_of = 17")))
    got = events(conn, m.encode_frontend(m.Query("SELECT count(*) FROM trades")))
    assert isinstance(got[1], RunQuery) and got[1].as_of == 17
    conn.complete(got[1], QueryOutcome(["n"], ["BIGINT"], [[0]]))
    events(conn, b"")  # ReadyForQuery
    got = events(conn, m.encode_frontend(m.Query("SET headwater.as_of TO 'yesterday'")))
    assert m.split_backend(got[1].data)[0].fields["C"] == "22023"  # type: ignore[union-attr]
    events(conn, m.encode_frontend(m.Query("RESET headwater.as_of")))
    assert conn.as_of is None


@pytest.mark.parametrize(
    ("data", "sqlstate"),
    [
        (b"\x00\x00\x00\x08\x00\x02\x00\x00", "0A000"),  # protocol 2.0
        (b"\x00\x00\x00\x04", "08P01"),  # a length below the minimum
        (b"\x00\x10\x00\x00", "08P01"),  # a 1 MiB start-up packet: refused before read
        (b"\x00\x00\x00\x09\x00\x03\x00\x00\x00", "28000"),  # no user
    ],
)
def test_bad_startup_is_fatal(data: bytes, sqlstate: str) -> None:
    conn = ServerConnection(auth="trust")
    [reject] = events(conn, data)
    assert isinstance(reject, Reject) and reject.answer.sqlstate == sqlstate
    assert m.split_backend(reject.data)[0].fields["S"] == "FATAL"


def test_unknown_message_type_after_startup_is_fatal() -> None:
    conn = trusted()
    [reject] = events(conn, b"?\x00\x00\x00\x04")
    assert isinstance(reject, Reject) and reject.answer.sqlstate == "08P01"
    assert events(conn, m.encode_frontend(m.Sync())) == []  # nothing after the last word


def test_terminate_closes() -> None:
    conn = trusted()
    [close] = events(conn, b"X\x00\x00\x00\x04")
    assert isinstance(close, Close) and conn.closed


@pytest.mark.parametrize(
    ("oid", "value", "text", "binary"),
    [
        (t.BOOL, True, b"t", b"\x01"),
        (t.INT2, 7, b"7", b"\x00\x07"),
        (t.INT4, -2, b"-2", b"\xff\xff\xff\xfe"),
        (t.INT8, 1 << 40, b"1099511627776", struct.pack(">q", 1 << 40)),
        (t.FLOAT8, 2.5, b"2.5", struct.pack(">d", 2.5)),
        (t.FLOAT8, float("inf"), b"Infinity", struct.pack(">d", float("inf"))),
        (t.BYTEA, b"\xde\xad", b"\\xdead", b"\xde\xad"),
        (t.TEXT, "hé", "hé".encode(), "hé".encode()),
        # 2000-01-01 00:00:01.5 UTC as nanoseconds since 1970
        (
            t.TIMESTAMP,
            946_684_801_500_000_000,
            b"2000-01-01 00:00:01.5",
            struct.pack(">q", 1_500_000),
        ),
        (t.TIMESTAMPTZ, 946_684_800_000_000_000, b"2000-01-01 00:00:00+00", struct.pack(">q", 0)),
        (t.DATE, "2000-01-03", b"2000-01-03", struct.pack(">i", 2)),
        (
            t.NUMERIC,
            "-12345.678",
            b"-12345.678",
            struct.pack(">hhHhHHH", 3, 1, 0x4000, 3, 1, 2345, 6780),
        ),
        (t.NUMERIC, "0.0001", b"0.0001", struct.pack(">hhHhH", 1, -1, 0, 4, 1)),
    ],
)
def test_value_formats(oid: int, value: object, text: bytes, binary: bytes) -> None:
    assert t.encode_text(oid, value) == text
    assert t.encode_binary(oid, value) == binary
    expected = value
    if oid in (t.TIMESTAMP, t.TIMESTAMPTZ, t.DATE, t.NUMERIC, t.TEXT):
        return  # parameters of these come back as datetime, date, Decimal: see properties
    assert t.decode_parameter(oid, True, binary) == expected
    assert t.decode_parameter(oid, False, text) == expected


def test_duckdb_types_map_to_oids() -> None:
    assert [
        t.oid_for_duckdb(name)
        for name in (
            "BOOLEAN",
            "SMALLINT",
            "INTEGER",
            "BIGINT",
            "HUGEINT",
            "FLOAT",
            "DOUBLE",
            "DECIMAL(18,3)",
            "VARCHAR",
            "BLOB",
            "DATE",
            "TIMESTAMP",
            "TIMESTAMP WITH TIME ZONE",
            "JSON",
            "INTEGER[]",
        )
    ] == [
        t.BOOL,
        t.INT2,
        t.INT4,
        t.INT8,
        t.NUMERIC,
        t.FLOAT4,
        t.FLOAT8,
        t.NUMERIC,
        t.TEXT,
        t.BYTEA,
        t.DATE,
        t.TIMESTAMP,
        t.TIMESTAMPTZ,
        t.JSON,
        t.TEXT,
    ]


def test_newer_minor_version_and_options_are_negotiated_down() -> None:
    conn = ServerConnection(auth="trust")
    startup = m.encode_startup({"user": "u", "_pq_.foo": "1"}, protocol=0x00030002)
    [auth] = events(conn, startup)
    assert isinstance(auth, Authenticate)
    data = conn.accept(1, 2)
    # NegotiateProtocolVersion: newest minor 0, one option not recognised; then AuthOk.
    assert data.startswith(
        b"v\x00\x00\x00\x15\x00\x00\x00\x00\x00\x00\x00\x01_pq_.foo\x00"
        b"R\x00\x00\x00\x08\x00\x00\x00\x00"
    )


def test_tenant_is_chosen_at_connect_time_only() -> None:
    conn = ServerConnection(auth="trust")
    events(conn, m.encode_startup({"user": "u", "options": "-c headwater.tenant=42"}))
    assert conn.settings["headwater.tenant"] == "42"
    conn.accept(1, 2)
    got = events(conn, m.encode_frontend(m.Query("SET headwater.tenant = 7")))
    assert m.split_backend(got[1].data)[0].fields["C"] == "55P02"  # type: ignore[union-attr]
    got = events(conn, m.encode_frontend(m.Query("SET headwater.as_of = 5; DISCARD ALL")))
    assert conn.as_of is None and conn.settings["headwater.tenant"] == "42"


def test_savepoints_and_rollback_to_recover_a_failed_block() -> None:
    conn = trusted()
    got = events(conn, m.encode_frontend(m.Query("BEGIN; SAVEPOINT sp; SELECT broken")))
    assert [e.data for e in got[1:3]] == [  # type: ignore[union-attr]
        b"C\x00\x00\x00\x0aBEGIN\x00",
        b"C\x00\x00\x00\x0eSAVEPOINT\x00",
    ]
    assert isinstance(got[3], RunQuery)
    conn.fail("42703", "no column broken")
    [ready] = events(conn, b"")
    assert ready.data == b"Z\x00\x00\x00\x05E"  # type: ignore[attr-defined]
    got = events(conn, m.encode_frontend(m.Query("ROLLBACK TO SAVEPOINT sp")))
    assert [e.data for e in got[1:]] == [  # type: ignore[union-attr]
        b"C\x00\x00\x00\x0dROLLBACK\x00",
        b"Z\x00\x00\x00\x05T",
    ]


def test_pg_type_lookup_finds_no_type() -> None:
    conn = trusted()
    sql = "SELECT typname AS name, oid FROM pg_type t WHERE t.oid = to_regtype($1)"
    data = b"".join(
        m.encode_frontend(msg)
        for msg in (
            m.Parse("", sql, (t.TEXT,)),
            m.Bind("", "", (), (b"hstore",), ()),
            m.Describe("P", ""),
            m.Execute("", 0),
            m.Sync(),
        )
    )
    replies = events(conn, data)
    answers = m.split_backend(b"".join(e.data for e in replies))  # type: ignore[attr-defined]
    assert [a.type for a in answers] == ["1", "2", "T", "C", "Z"]
    names = [c.name for c in answers[2].fields["columns"]]
    assert names == ["name", "oid", "array_oid", "regtype", "delimiter"]
    assert answers[3].fields["tag"] == "SELECT 0"


def test_infinite_timestamps_in_both_formats() -> None:
    # The SQL layer gives DuckDB's text for timestamps outside the nanosecond range.
    for oid in (t.TIMESTAMP, t.TIMESTAMPTZ):
        assert t.encode_text(oid, "infinity") == b"infinity"
        assert t.encode_binary(oid, "infinity") == b"\x7f\xff\xff\xff\xff\xff\xff\xff"
        assert t.encode_binary(oid, "-infinity") == b"\x80\x00\x00\x00\x00\x00\x00\x00"
