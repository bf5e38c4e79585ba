"""Result values: BigInt, Text, Boolean, Timestamp natively; every other type as Text in
its canonical form (doubles as repr, blobs as lowercase hex, the rest as DuckDB text)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from sqlkit import running

from headwater.errors import InvalidRequest
from headwater.sql import Timestamp
from headwater.sql.values import json_value, to_duckdb_param

CASES: list[tuple[str, object]] = [
    ("42::TINYINT", 42),
    ("-7::INTEGER", -7),
    ("9223372036854775807::BIGINT", 9223372036854775807),
    ("12::UBIGINT", 12),
    ("18446744073709551615::UBIGINT", "18446744073709551615"),
    ("170141183460469231731687303715884105727::HUGEINT", "170141183460469231731687303715884105727"),
    # UHUGEINT arrives from DuckDB as a signed 128-bit decimal: 2**127 and up wrapped.
    ("340282366920938463463374607431768211455::UHUGEINT", str((1 << 128) - 1)),
    ("(1::UHUGEINT << 127)", str(1 << 127)),
    ("7::UHUGEINT", 7),
    ("sum(x) FROM (VALUES (1::BIGINT), (2::BIGINT)) t(x)", 3),
    ("'héllo'", "héllo"),
    ("true", True),
    ("NULL", None),
    ("NULL::INTEGER", None),
    ("1.5::DOUBLE", "1.5"),
    ("0.1::DOUBLE + 0.2::DOUBLE", repr(0.1 + 0.2)),
    ("1e300::DOUBLE * 10", "1e+301"),
    ("'nan'::DOUBLE", "nan"),
    ("'-inf'::DOUBLE", "-inf"),
    ("0.1::FLOAT", "0.1"),
    ("1.50::DECIMAL(10, 2)", "1.50"),
    ("0.0000001::DECIMAL(18, 7)", "0.0000001"),
    ("DATE '2024-02-29'", "2024-02-29"),
    ("'infinity'::DATE", "infinity"),
    ("TIME '12:34:56.5'", "12:34:56.5"),
    # Its UTC offset was lost: DuckDB exports TIMETZ to Arrow as a plain time.
    ("'12:34:56+02'::TIMETZ", "12:34:56+02"),
    ("'23:00:00-05:30'::TIME WITH TIME ZONE", "23:00:00-05:30"),
    ("INTERVAL 3 DAY", "3 days"),
    ("x'00ff10'::BLOB", "00ff10"),
    ("''::BLOB", ""),
    ("'{\"a\": [1, 2]}'::JSON", '{"a": [1, 2]}'),
    ("[1, 2, 3]", "[1, 2, 3]"),
    ("{'a': 1, 'b': 'x'}", "{'a': 1, 'b': x}"),
    ("MAP {'k': 1}", "{k=1}"),
    ("'6f9619ff-8b86-d011-b42d-00c04fc964ff'::UUID", "6f9619ff-8b86-d011-b42d-00c04fc964ff"),
    ("TIMESTAMP '2024-01-02 03:04:05.123456'", Timestamp(1704164645123456000)),
    ("TIMESTAMP_NS '2024-01-02 03:04:05.123456789'", Timestamp(1704164645123456789)),
    ("TIMESTAMP_MS '2024-01-02 03:04:05.123'", Timestamp(1704164645123000000)),
    ("TIMESTAMP_S '2024-01-02 03:04:05'", Timestamp(1704164645000000000)),
    ("TIMESTAMPTZ '2024-01-02 03:04:05+02'", Timestamp(1704157445000000000)),
    ("'infinity'::TIMESTAMP", "infinity"),
    ("TIMESTAMP '3000-01-01 00:00:00'", "3000-01-01 00:00:00"),
]


def test_value_types(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (_engine, sql):
            for expression, expected in CASES:
                result = await sql.query(0, f"SELECT {expression}")
                assert result.rows == [[expected]], expression
                assert type(result.rows[0][0]) is type(expected), expression

    asyncio.run(main())


JSON_CASES: list[tuple[str, object]] = [
    # A JSON number whenever its text reads back as exactly the value in a double ...
    ("42::TINYINT", 42),
    ("9007199254740991::BIGINT", 9007199254740991),
    ("-9007199254740991::BIGINT", -9007199254740991),
    ("1.5::DOUBLE", 1.5),
    ("0.1::DOUBLE + 0.2::DOUBLE", 0.1 + 0.2),
    ("1e300::DOUBLE * 10", 1e301),
    ("0.1::FLOAT", 0.1),
    ("-0.0::DOUBLE", -0.0),
    ("1.50::DECIMAL(10, 2)", 1.5),
    ("123456789012.345::DECIMAL(18, 3)", 123456789012.345),
    ("12::UBIGINT", 12),
    ("12::HUGEINT", 12),
    # ... and its exact text otherwise: nothing is rounded by a reader.
    ("9007199254740992::BIGINT", "9007199254740992"),
    ("9223372036854775807::BIGINT", "9223372036854775807"),
    ("18446744073709551615::UBIGINT", "18446744073709551615"),
    ("-(1::HUGEINT << 100)", str(-(1 << 100))),
    ("12345678901234567.89::DECIMAL(38, 2)", "12345678901234567.89"),
    ("'nan'::DOUBLE", "NaN"),
    ("'inf'::DOUBLE", "Infinity"),
    ("'-inf'::FLOAT", "-Infinity"),
    # Not numbers: as before.
    ("'1.5'", "1.5"),
    ("true", True),
    ("NULL::DOUBLE", None),
    ("TIMESTAMP_NS '2024-01-02 03:04:05.123456789'", "2024-01-02 03:04:05.123456789"),
    ("DATE '2024-02-29'", "2024-02-29"),
]


def test_json_values(tmp_path: Path) -> None:
    """json_value over real results: numbers where a double holds them exactly, text
    otherwise (the HTTP API's rule, docs/http-api.md "SQL")."""

    async def main() -> None:
        async with running(tmp_path) as (_engine, sql):
            for expression, expected in JSON_CASES:
                result = await sql.query(0, f"SELECT {expression}")
                [[value]] = result.rows
                out = json_value(value, result.types[0])
                assert out == expected and type(out) is type(expected), expression
                # What a JSON reader gets back is the value itself.
                assert json.loads(json.dumps(out)) == expected, expression

    asyncio.run(main())


def test_ts_column_is_the_append_time(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            s = await engine.create_stream(0, "s")
            before = time.time_ns() // 1_000_000 * 1_000_000
            await engine.append(0, s.stream_id, [b"a", b"b"])
            await engine.append(0, s.stream_id, [b"c"], timestamp_ms=1_600_000_000_123)
            after = time.time_ns()
            result = await sql.query(0, "SELECT ts FROM s ORDER BY position")
            stamps = [r[0] for r in result.rows]
            assert all(isinstance(t, Timestamp) for t in stamps)
            assert stamps[0] == stamps[1]
            assert isinstance(stamps[0], Timestamp) and before <= stamps[0].ns <= after
            assert stamps[2] == Timestamp(1_600_000_000_123_000_000)

    asyncio.run(main())


def test_many_rows_and_columns_round_trip(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (_engine, sql):
            result = await sql.query(
                0, "SELECT i, i::VARCHAR AS s, i % 2 = 0 AS e FROM range(5000) t(i) ORDER BY i"
            )
            assert result.columns == ["i", "s", "e"]
            assert result.rows == [[i, str(i), i % 2 == 0] for i in range(5000)]
            empty = await sql.query(0, "SELECT 1 AS a WHERE false")
            assert (empty.columns, empty.rows) == (["a"], [])

    asyncio.run(main())


def test_parameter_conversion() -> None:
    assert Timestamp(-1).to_text() == "1969-12-31 23:59:59.999999999"
    assert Timestamp(0).to_text() == "1970-01-01 00:00:00.000000000"
    with pytest.raises(InvalidRequest):
        Timestamp(1 << 63)
    # Floats bind as DOUBLE (the PostgreSQL wire sends them); what DuckDB cannot bind is
    # refused with a message naming the type.
    assert to_duckdb_param(1.5) == 1.5
    with pytest.raises(InvalidRequest, match="unsupported query parameter type complex"):
        to_duckdb_param(1j)
    assert to_duckdb_param("x") == "x"
