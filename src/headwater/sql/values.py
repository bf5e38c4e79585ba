"""SQL parameter and result values (spec/PROTOCOLS.md §1, QueryParam / QueryValue).

A query result value is ``None``, ``int`` (BigInt), ``str`` (Text), ``bool`` or a
:class:`Timestamp`; every other SQL type travels as Text in its canonical text form:
doubles as Python's shortest round-trip ``repr``, blobs as lowercase hex, and everything
else (decimals, dates, intervals, lists, structs, JSON, ...) as DuckDB's own text cast.
This module is independent of every wire protocol: codecs convert at their boundary.

:func:`json_value` is the JSON form (the HTTP API's): numeric SQL values are JSON
numbers whenever the number's JSON text reads back as exactly the SQL value in an IEEE
double (what JavaScript and most JSON parsers read numbers into), and their exact text
as a JSON string otherwise, so no reader rounds a value silently: integers beyond
±(2^53 - 1), decimals with more digits than a double holds, and NaN / Infinity /
-Infinity (which JSON has no number for) are strings.
"""

from __future__ import annotations

import datetime
import decimal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb
import pyarrow as pa

from headwater.errors import InvalidRequest

I64_MIN = -(1 << 63)
I64_MAX = (1 << 63) - 1
_EPOCH = datetime.datetime(1970, 1, 1)
_NS_PER_UNIT = {"s": 1_000_000_000, "ms": 1_000_000, "us": 1_000, "ns": 1}


@dataclass(frozen=True, slots=True)
class Timestamp:
    """A point in time: nanoseconds since the Unix epoch (UTC), a signed 64-bit value."""

    ns: int

    def __post_init__(self) -> None:
        if not I64_MIN <= self.ns <= I64_MAX:
            raise InvalidRequest(f"timestamp {self.ns} ns is outside the 64-bit range")

    def to_text(self) -> str:
        """``YYYY-MM-DD HH:MM:SS.fffffffff`` (UTC), exact to the nanosecond."""
        seconds, nanos = divmod(self.ns, 1_000_000_000)
        moment = _EPOCH + datetime.timedelta(seconds=seconds)
        return f"{moment:%Y-%m-%d %H:%M:%S}.{nanos:09d}"


QueryValue = None | int | str | bool | Timestamp
JsonValue = None | int | float | str | bool
QueryParam = None | int | str | bool | Timestamp | datetime.datetime


@dataclass(frozen=True)
class QueryResult:
    """Column names and rows of QueryValues."""

    columns: list[str]
    rows: list[list[QueryValue]]
    # DuckDB's name of each column's type (``str(DuckDBPyType)``: ``DECIMAL(18,3)``,
    # ``JSON`` ...), for front ends that declare types (the PostgreSQL wire); empty for
    # an INSERT's answer.
    types: list[str] = field(default_factory=list)


def to_duckdb_param(value: object) -> object:
    """A query parameter as DuckDB binds it (a Timestamp keeps its nanoseconds)."""
    if value is None or isinstance(
        value, bool | int | str | float | bytes | decimal.Decimal | datetime.date
    ):
        return value  # datetime.datetime is a date too
    if isinstance(value, Timestamp):
        return duckdb.TimestampNanosecondValue(value.to_text())
    raise InvalidRequest(f"unsupported query parameter type {type(value).__name__}")


TextCast = Callable[[pa.ChunkedArray], list[Any]]
"""Renders a result column as DuckDB text (runs one small DuckDB query over it)."""


def _wide_int(value: Any) -> QueryValue:
    if value is None:
        return None
    number = int(value)
    return number if I64_MIN <= number <= I64_MAX else str(number)


def _timestamps(column: pa.ChunkedArray, text: TextCast) -> list[QueryValue]:
    unit = column.type.unit
    factor = _NS_PER_UNIT[unit]
    raw = column.cast(pa.int64()).to_pylist()
    out: list[QueryValue] = []
    fallback: list[Any] | None = None
    for i, value in enumerate(raw):
        if value is None:
            out.append(None)
            continue
        ns = value * factor
        if I64_MIN <= ns <= I64_MAX:
            out.append(Timestamp(ns))
        else:  # 'infinity' or far outside the nanosecond range: its text form
            if fallback is None:
                fallback = text(column)
            out.append(fallback[i])
    return out


def column_values(column: pa.ChunkedArray, type_id: str, text: TextCast) -> list[QueryValue]:
    """Convert one result column (as DuckDB exported it to Arrow) to QueryValues.

    ``type_id`` is DuckDB's type id for the column (``DuckDBPyType.id``)."""
    t = column.type
    if pa.types.is_null(t):
        return [None] * len(column)
    if type_id == "uhugeint":
        # Exported as a signed 128-bit decimal: 2**127 and above arrive wrapped negative.
        return [
            _wide_int(v if v is None or v >= 0 else int(v) + (1 << 128)) for v in column.to_pylist()
        ]
    if type_id in ("hugeint", "ubigint"):
        return [_wide_int(v) for v in column.to_pylist()]
    if pa.types.is_boolean(t) or pa.types.is_integer(t):
        values: list[QueryValue] = column.to_pylist()
        return values
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return list(column.to_pylist())
    if isinstance(t, pa.ExtensionType) and pa.types.is_string(t.storage_type):
        return list(column.cast(t.storage_type).to_pylist())
    if pa.types.is_float64(t):
        return [None if v is None else repr(v) for v in column.to_pylist()]
    if type_id == "blob" and (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        return [None if v is None else v.hex() for v in column.to_pylist()]
    if pa.types.is_timestamp(t):
        return _timestamps(column, text)
    return list(text(column))


def rows_from_columns(columns: Sequence[list[QueryValue]], num_rows: int) -> list[list[QueryValue]]:
    if not columns:
        return [[] for _ in range(num_rows)]
    return [list(row) for row in zip(*columns, strict=True)]


# Integers up to this magnitude are exact in a double (JavaScript's MAX_SAFE_INTEGER).
MAX_SAFE_INTEGER = (1 << 53) - 1
_INTEGER_TYPES = frozenset(
    {
        "TINYINT",
        "SMALLINT",
        "INTEGER",
        "BIGINT",
        "HUGEINT",
        "UTINYINT",
        "USMALLINT",
        "UINTEGER",
        "UBIGINT",
        "UHUGEINT",
        "BIGNUM",
        "VARINT",
    }
)
_FLOAT_TYPES = frozenset({"FLOAT", "DOUBLE"})
# JSON has no number for these: the names JavaScript's Number() and Python's float() read.
_NOT_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _json_integer(number: int) -> JsonValue:
    return number if -MAX_SAFE_INTEGER <= number <= MAX_SAFE_INTEGER else str(number)


def json_value(value: QueryValue, sql_type: str) -> JsonValue:
    """A query value in JSON (see the module docstring); ``sql_type`` is DuckDB's name of
    the column's type (``QueryResult.types``: ``DOUBLE``, ``DECIMAL(18,3)`` ...), or ""
    when unknown (the value is then taken as it is). Timestamps are their text form."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, Timestamp):
        return value.to_text()
    if isinstance(value, int):
        return _json_integer(value)
    if sql_type in _INTEGER_TYPES:  # beyond 64 bits: its text
        return _json_integer(int(value))
    if sql_type in _FLOAT_TYPES:  # the shortest text that reads back as the value
        number = float(value)
        if number != number or number in (float("inf"), float("-inf")):
            return _NOT_FINITE[repr(number)]
        return number
    if sql_type.startswith("DECIMAL"):
        exact = decimal.Decimal(value)
        number = float(exact)
        return number if decimal.Decimal(repr(number)) == exact else value
    return value
