"""PostgreSQL codec properties: every message round-trips, a session's bytes mean the
same in any split, values survive the text and binary formats, statements split as
written."""

from __future__ import annotations

import datetime
import decimal
import struct

import duckdb
from hypothesis import given, settings
from hypothesis import strategies as st

from headwater.protocols.postgres import messages as m
from headwater.protocols.postgres import statements as stm
from headwater.protocols.postgres import types as t
from headwater.protocols.postgres.connection import (
    Authenticate,
    DescribeStatement,
    QueryOutcome,
    RunQuery,
    ServerConnection,
)

names = st.text(st.characters(exclude_characters="\0", codec="utf-8"), max_size=20)
oids = st.integers(0, 2**32 - 1)
formats = st.lists(st.sampled_from([0, 1]), max_size=4).map(tuple)

frontend = st.one_of(
    st.builds(m.Query, names),
    st.builds(m.Parse, names, names, st.lists(oids, max_size=5).map(tuple)),
    st.builds(
        m.Bind,
        names,
        names,
        formats,
        st.lists(st.none() | st.binary(max_size=20), max_size=5).map(tuple),
        formats,
    ),
    st.builds(m.Describe, st.sampled_from(["S", "P"]), names),
    st.builds(m.Execute, names, st.integers(0, 2**31 - 1)),
    st.builds(m.Close, st.sampled_from(["S", "P"]), names),
    st.just(m.Sync()),
    st.just(m.Flush()),
    st.just(m.Terminate()),
)


@given(frontend)
def test_frontend_messages_round_trip(msg: m.FrontendMessage) -> None:
    data = m.encode_frontend(msg)
    assert int.from_bytes(data[1:5], "big") == len(data) - 1
    assert m.decode_frontend(data[:1], data[5:]) == msg


columns = st.builds(
    m.Column,
    names,
    oids,
    st.integers(-1, 32767),
    st.integers(-(2**31), 2**31 - 1),
    st.sampled_from([0, 1]),
    oids,
    st.integers(-(2**15), 2**15 - 1),
)


@given(st.lists(columns, max_size=6))
def test_row_description_round_trips(cols: list[m.Column]) -> None:
    data = m.encode_row_description(cols)
    [decoded] = m.split_backend(data)
    assert decoded.type == "T" and decoded.fields["columns"] == cols


@given(st.lists(st.none() | st.binary(max_size=30), max_size=8))
def test_data_row_round_trips(values: list[bytes | None]) -> None:
    [decoded] = m.split_backend(m.encode_data_row(values))
    assert decoded.fields["values"] == values


@given(st.sampled_from(["ERROR", "FATAL"]), st.from_regex(r"[0-9A-Z]{5}", fullmatch=True), names)
def test_error_round_trips(severity: str, sqlstate: str, text: str) -> None:
    [decoded] = m.split_backend(m.encode_error(m.ErrorFields(severity, sqlstate, text)))
    assert decoded.fields == {"S": severity, "V": severity, "C": sqlstate, "M": text}


@given(st.dictionaries(names.filter(bool), names, max_size=5))
def test_startup_round_trips(parameters: dict[str, str]) -> None:
    data = m.encode_startup(parameters)
    assert m.decode_startup(data[4:]) == m.StartupMessage(m.PROTOCOL_VERSION, parameters)


# ---- a session in any split ------------------------------------------------------------

SESSION = b"".join(
    [
        m.encode_startup({"user": "u", "database": "0"}),
        m.encode_frontend(m.Query("SET headwater.as_of = 3; SELECT 1; SHOW headwater.as_of")),
        m.encode_frontend(m.Parse("s1", "SELECT $1::INT AS n", (t.INT4,))),
        m.encode_frontend(m.Bind("", "s1", (0,), (b"41",), (1,))),
        m.encode_frontend(m.Describe("P", "")),
        m.encode_frontend(m.Execute("", 0)),
        m.encode_frontend(m.Sync()),
        m.encode_frontend(m.Query("BEGIN; SELECT broken; SELECT 2")),
        m.encode_frontend(m.Query("ROLLBACK")),
        m.encode_frontend(m.Terminate()),
    ]
)


def run_session(chunks: list[bytes]) -> bytes:
    """Everything the server sends for ``chunks``, answering as a shell would: the
    query ``SELECT broken`` fails, every other returns one row."""
    conn = ServerConnection(auth="trust")
    out = bytearray()
    for chunk in chunks:
        conn.feed(chunk)
        while (event := conn.next_event()) is not None:
            if isinstance(event, Authenticate):
                out += conn.accept(7, 8)
            elif isinstance(event, RunQuery):
                if "broken" in event.sql:
                    out += conn.fail("42703", "no column broken")
                else:
                    value = event.parameters[0] if event.parameters else 1
                    out += conn.complete(event, QueryOutcome(["n"], ["INTEGER"], [[value]]))
            elif isinstance(event, DescribeStatement):
                out += conn.describe_statement(event.prepared, None)
            else:
                out += getattr(event, "data", b"")
    return bytes(out)


WHOLE = run_session([SESSION])


def test_the_session_answers_as_postgresql_would() -> None:
    kinds = [msg.type for msg in m.split_backend(WHOLE)]
    assert kinds[0] == "R" and "K" in kinds
    answers = [(msg.type, msg.fields) for msg in m.split_backend(WHOLE)[kinds.index("K") :]]
    tags = [f["tag"] for kind, f in answers if kind == "C"]
    assert tags == ["SET", "SELECT 1", "SHOW", "SELECT 1", "BEGIN", "ROLLBACK"]
    statuses = [f["status"] for kind, f in answers if kind == "Z"]
    assert statuses == ["I", "I", "I", "E", "I"]
    assert [f["C"] for kind, f in answers if kind == "E"] == ["42703"]  # SELECT 2 dropped
    rows = [f["values"] for kind, f in answers if kind == "D"]
    assert rows == [[b"1"], [b"3"], [(41).to_bytes(4, "big")]]  # the portal asked binary


@settings(max_examples=200)
@given(st.lists(st.integers(0, len(SESSION)), max_size=12))
def test_any_split_gives_the_same_answers(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    chunks = [SESSION[a:b] for a, b in zip([0, *points], [*points, len(SESSION)], strict=True)]
    assert run_session(chunks) == WHOLE


# ---- values ---------------------------------------------------------------------------


@given(st.integers(-(2**63), 2**63 - 1))
def test_int8_both_formats(value: int) -> None:
    for binary, encode in ((True, t.encode_binary), (False, t.encode_text)):
        assert t.decode_parameter(t.INT8, binary, encode(t.INT8, value)) == value


@given(st.floats(allow_nan=False))
def test_float8_both_formats(value: float) -> None:
    for binary, encode in ((True, t.encode_binary), (False, t.encode_text)):
        assert t.decode_parameter(t.FLOAT8, binary, encode(t.FLOAT8, value)) == value


@given(st.decimals(min_value=-(10**20), max_value=10**20, places=6))
def test_numeric_both_formats(value: decimal.Decimal) -> None:
    text = format(value, "f")
    decoded = t.decode_parameter(t.NUMERIC, True, t.encode_binary(t.NUMERIC, text))
    assert decoded == value
    assert t.decode_parameter(t.NUMERIC, False, t.encode_text(t.NUMERIC, text)) == value


@given(st.integers(-(2**63) // 1000 * 1000, 2**63 - 1))
def test_timestamps_keep_microseconds(ns: int) -> None:
    expected = datetime.datetime(1970, 1, 1) + datetime.timedelta(microseconds=ns // 1000)
    for oid in (t.TIMESTAMP, t.TIMESTAMPTZ):
        binary = t.decode_parameter(oid, True, t.encode_binary(oid, ns))
        text = t.decode_parameter(oid, False, t.encode_text(oid, ns))
        assert isinstance(binary, datetime.datetime) and isinstance(text, datetime.datetime)
        assert binary.replace(tzinfo=None) == text.replace(tzinfo=None) == expected


@given(st.dates())
def test_dates_both_formats(value: datetime.date) -> None:
    text = value.isoformat()
    assert t.decode_parameter(t.DATE, True, t.encode_binary(t.DATE, text)) == value
    assert t.decode_parameter(t.DATE, False, t.encode_text(t.DATE, text)) == value


_DUCKDB = duckdb.connect()  # the oracle for its own text of far dates and timestamps


# From the first moment PostgreSQL's int64 microseconds from 2000 can say (DuckDB's
# own start, 290309 BC, is earlier) to DuckDB's last.
@given(st.integers(-(1 << 63) + 946_684_800_000_000, 9_223_372_036_854_775_806))
def test_any_duckdb_timestamp_text_is_its_microseconds_in_binary(us: int) -> None:
    texts = _DUCKDB.execute(
        "SELECT make_timestamp($1::BIGINT)::VARCHAR,"
        " make_timestamp($1::BIGINT)::TIMESTAMPTZ::VARCHAR",
        [us],
    ).fetchall()[0]
    for oid, text in zip((t.TIMESTAMP, t.TIMESTAMPTZ), texts, strict=True):
        assert t.encode_binary(oid, text) == struct.pack(">q", us - 946_684_800_000_000), text


@given(st.integers(-2_147_483_648 + 10_957, 2_147_483_646))
def test_any_duckdb_date_text_is_its_days_in_binary(days: int) -> None:
    (text,) = _DUCKDB.execute(
        "SELECT (DATE '1970-01-01' + $1::INTEGER)::VARCHAR", [days]
    ).fetchall()[0]
    assert t.encode_binary(t.DATE, text) == struct.pack(">i", days - 10_957), text


@given(st.integers(-(10**38) + 1, 10**38 - 1), st.integers(0, 38))
def test_numeric_keeps_all_38_digits_in_binary(digits: int, scale: int) -> None:
    value = decimal.Decimal(f"{digits}e-{scale}")  # exact (scaleb would round to 28 digits)
    text = format(value, "f")
    assert t.decode_parameter(t.NUMERIC, True, t.encode_binary(t.NUMERIC, text)) == value


@given(st.binary(max_size=50))
def test_bytea_both_formats(value: bytes) -> None:
    assert t.decode_parameter(t.BYTEA, True, t.encode_binary(t.BYTEA, value)) == value
    assert t.decode_parameter(t.BYTEA, False, t.encode_text(t.BYTEA, value)) == value


# ---- statements -----------------------------------------------------------------------

words = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True)
quoted = st.text(st.characters(codec="ascii", exclude_characters="\0"), max_size=8).map(
    lambda s: "'" + s.replace("'", "''") + "'"
)
comment = st.text(st.characters(codec="ascii", exclude_characters="\0*/"), max_size=8).map(
    lambda s: "/*" + s + "*/"
)
statement = st.lists(st.one_of(words, quoted, comment), min_size=1, max_size=6).map(
    lambda parts: "SELECT " + " ".join(parts)
)


@given(st.lists(statement, min_size=1, max_size=5))
def test_statements_split_as_written(statements: list[str]) -> None:
    assert stm.split_statements(" ; ".join(statements) + ";") == statements
