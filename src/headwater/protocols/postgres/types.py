"""PostgreSQL types: which OID a DuckDB result column travels as, how a value is written
in the text and binary formats, and how a Bind parameter is read.

Result values arrive as the SQL layer gives them to every front end (None, int, str,
bool, or a timestamp as nanoseconds since the epoch, UTC; doubles and blobs in their
canonical text: ``repr`` and lowercase hex) together with DuckDB's name of the column's
type, and leave in PostgreSQL's own formats. Types without a PostgreSQL counterpart
(lists, structs, maps, intervals, times) travel as ``text`` in DuckDB's text form.
"""

from __future__ import annotations

import datetime
import decimal
import json
import math
import re
import struct
import uuid
from collections.abc import Callable
from typing import Any

from .messages import MessageError

BOOL = 16
BYTEA = 17
NAME = 19
INT8 = 20
INT2 = 21
INT4 = 23
TEXT = 25
OID = 26
JSON = 114
FLOAT4 = 700
FLOAT8 = 701
UNKNOWN = 705
BPCHAR = 1042
VARCHAR = 1043
DATE = 1082
TIMESTAMP = 1114
TIMESTAMPTZ = 1184
NUMERIC = 1700
UUID = 2950
JSONB = 3802

SIZES = {BOOL: 1, INT2: 2, INT4: 4, INT8: 8, OID: 4, FLOAT4: 4, FLOAT8: 8, DATE: 4}
SIZES |= {TIMESTAMP: 8, TIMESTAMPTZ: 8, UUID: 16}

DUCKDB_TYPES = {
    "BOOLEAN": BOOL,
    "TINYINT": INT2,
    "SMALLINT": INT2,
    "UTINYINT": INT2,
    "INTEGER": INT4,
    "USMALLINT": INT4,
    "BIGINT": INT8,
    "UINTEGER": INT8,
    "UBIGINT": NUMERIC,
    "HUGEINT": NUMERIC,
    "UHUGEINT": NUMERIC,
    "FLOAT": FLOAT4,
    "DOUBLE": FLOAT8,
    "VARCHAR": TEXT,
    "BLOB": BYTEA,
    "DATE": DATE,
    "TIMESTAMP": TIMESTAMP,
    "TIMESTAMP_S": TIMESTAMP,
    "TIMESTAMP_MS": TIMESTAMP,
    "TIMESTAMP_NS": TIMESTAMP,
    "TIMESTAMP WITH TIME ZONE": TIMESTAMPTZ,
    "JSON": JSON,
    "UUID": UUID,
}


def oid_for_duckdb(type_name: str) -> int:
    """The OID a column of DuckDB type ``type_name`` (``str(DuckDBPyType)``) travels as."""
    name = type_name.upper()
    if name.startswith("DECIMAL"):
        return NUMERIC
    return DUCKDB_TYPES.get(name, TEXT)


def oid_for_value(value: object) -> int:
    """The OID of a column known only by a value (a result without DuckDB types)."""
    if isinstance(value, bool):
        return BOOL
    if isinstance(value, int):
        return INT8
    if isinstance(value, float):
        return FLOAT8
    if isinstance(value, bytes):
        return BYTEA
    return TEXT


_EPOCH_2000_US = 946_684_800_000_000  # 2000-01-01 in microseconds since 1970
_EPOCH_2000_DAYS = 10_957
_UNIX = datetime.datetime(1970, 1, 1)
_DATE_2000 = datetime.date(2000, 1, 1)


def _timestamp_text(ns: int, with_zone: bool) -> str:
    micros = ns // 1000  # PostgreSQL keeps microseconds
    moment = _UNIX + datetime.timedelta(microseconds=micros)
    text = moment.strftime("%Y-%m-%d %H:%M:%S")
    if moment.microsecond:
        text += f".{moment.microsecond:06d}".rstrip("0")
    return text + ("+00" if with_zone else "")


# DuckDB's text for a date or timestamp outside what the SQL layer hands as a value (a
# year past 9999, BC, or a timestamp past int64 nanoseconds): "10000-01-01",
# "0044-03-15 (BC)", "2300-01-01 00:00:00.5", "290308-12-22 (BC) 00:00:00", "...+00".
_DUCKDB_MOMENT = re.compile(
    r"(\d+)-(\d\d)-(\d\d)( \(BC\))?"
    r"(?: (\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?(?:([+-])(\d\d)(?::(\d\d))?)?)?"
)
_INFINITE_DAYS = {"infinity": (1 << 31) - 1, "-infinity": -(1 << 31)}
_INFINITE_MICROS = {"infinity": (1 << 63) - 1, "-infinity": -(1 << 63)}


def _days_since_2000(year: int, month: int, day: int) -> int:
    """Days from 2000-01-01 to a proleptic Gregorian date of any year (0 is 1 BC),
    where Python's date stops at 1..9999 (H. Hinnant's days_from_civil)."""
    y = year - (month <= 2)
    era = y // 400
    year_of_era = y - era * 400
    day_of_year = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146_097 + day_of_era - 719_468 - _EPOCH_2000_DAYS


def _moment_micros(text: str) -> tuple[int, int]:
    """DuckDB's date or timestamp text as (days since 2000-01-01, microseconds into the
    day, less any zone offset); ValueError for anything else."""
    match = _DUCKDB_MOMENT.fullmatch(text)
    if match is None:
        raise ValueError(f"not a date or timestamp: {text!r}")
    year, month, day, bc, hour, minute, second, fraction, sign, zh, zm = match.groups()
    days = _days_since_2000(1 - int(year) if bc else int(year), int(month), int(day))
    micros = 0
    if hour is not None:
        micros = ((int(hour) * 60 + int(minute)) * 60 + int(second)) * 1_000_000
        micros += int((fraction or "")[:6].ljust(6, "0"))
        if sign is not None:
            offset = (int(zh) * 60 + int(zm or 0)) * 60_000_000
            micros -= offset if sign == "+" else -offset
    return days, micros


def _date_binary(value: object) -> bytes:
    if isinstance(value, datetime.date):
        return struct.pack(">i", value.toordinal() - _DATE_2000.toordinal())
    text = str(value)
    infinite = _INFINITE_DAYS.get(text)
    return struct.pack(">i", infinite if infinite is not None else _moment_micros(text)[0])


def _timestamp_binary(value: object) -> bytes:
    if isinstance(value, int):  # nanoseconds since 1970 (the SQL layer's Timestamp)
        return struct.pack(">q", value // 1000 - _EPOCH_2000_US)
    text = str(value)
    infinite = _INFINITE_MICROS.get(text)
    if infinite is not None:
        return struct.pack(">q", infinite)
    days, micros = _moment_micros(text)
    return struct.pack(">q", days * 86_400_000_000 + micros)


def _bc_text(value: object) -> bytes:
    """A date or timestamp's text as PostgreSQL writes it: DuckDB's "(BC)" after the
    date is PostgreSQL's " BC" at the end."""
    text = str(value)
    if "(BC)" in text:
        text = text.replace(" (BC)", "") + " BC"
    return text.encode()


def _float_text(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return repr(value)


def result_value(oid: int, value: object) -> object:
    """A SQL-layer result value as this module encodes it for ``oid`` (floats from their
    text, blobs from hex); others pass through."""
    if value is None:
        return None
    if oid in (FLOAT4, FLOAT8) and isinstance(value, str):
        return float(value)
    if oid == BYTEA and isinstance(value, str):
        return bytes.fromhex(value)
    return value


def encode_text(oid: int, value: object) -> bytes:
    """``value`` in PostgreSQL's text format for ``oid``."""
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if oid in (TIMESTAMP, TIMESTAMPTZ):
        if isinstance(value, int):
            return _timestamp_text(value, oid == TIMESTAMPTZ).encode()
        return _bc_text(value)
    if isinstance(value, float):
        return _float_text(value).encode()
    if isinstance(value, bytes):
        return b"\\x" + value.hex().encode()
    return str(value).encode()


def _numeric_binary(text: str) -> bytes:
    """NUMERIC's binary form: base-10000 digits with weight, sign and display scale."""
    number = decimal.Decimal(text)
    if number.is_nan():
        return struct.pack(">hhHh", 0, 0, 0xC000, 0)
    if number.is_infinite():
        return struct.pack(">hhHh", 0, 0, 0xD000 if number > 0 else 0xF000, 0)
    sign = number.is_signed() and number != 0
    # copy_abs, not abs(): abs() rounds to the context's 28 digits (a DECIMAL(38) lost
    # its last ten).
    integer, _, fraction = format(number.copy_abs(), "f").partition(".")
    scale = len(fraction)
    integer = integer.lstrip("0")
    integer = integer.rjust((len(integer) + 3) // 4 * 4, "0")
    fraction = fraction.ljust((len(fraction) + 3) // 4 * 4, "0")
    groups = [int(integer[i : i + 4]) for i in range(0, len(integer), 4)]
    weight = len(groups) - 1
    groups += [int(fraction[i : i + 4]) for i in range(0, len(fraction), 4)]
    while groups and groups[0] == 0:  # leading zero groups (a pure fraction)
        groups.pop(0)
        weight -= 1
    while groups and groups[-1] == 0:
        groups.pop()
    if not groups:
        weight = 0
    head = struct.pack(">hhHh", len(groups), weight, 0x4000 if sign else 0, scale)
    return head + b"".join(struct.pack(">H", g) for g in groups)


def encode_binary(oid: int, value: object) -> bytes:
    """``value`` in PostgreSQL's binary format for ``oid``; types without one of ours
    (text and everything travelling as text) as UTF-8."""
    if oid == BOOL:
        return b"\x01" if value else b"\x00"
    if oid in (INT2, INT4, INT8):
        code = {INT2: ">h", INT4: ">i", INT8: ">q"}[oid]
        return struct.pack(code, int(str(value)))
    if oid in (FLOAT4, FLOAT8):
        return struct.pack(">f" if oid == FLOAT4 else ">d", float(str(value)))
    if oid == BYTEA and isinstance(value, bytes):
        return value
    if oid in (TIMESTAMP, TIMESTAMPTZ):
        # The SQL layer's nanoseconds, or DuckDB's text past them (infinity, a far
        # year, BC): PostgreSQL's binary form is int64 microseconds from 2000 either way.
        return _timestamp_binary(value)
    if oid == DATE:
        return _date_binary(value)
    if oid == NUMERIC:
        return _numeric_binary(str(value))
    if oid == UUID:
        return uuid.UUID(str(value)).bytes
    if oid == JSONB:
        return b"\x01" + str(value).encode()
    return encode_text(oid, value)


_FLOAT_WORDS = {"inf": b"Infinity", "-inf": b"-Infinity", "nan": b"NaN"}
_HEX_PREFIX = b"\\x"

Encoder = Callable[[object], bytes]


def _int_text(value: object) -> bytes:
    return b"%d" % value  # type: ignore[str-format]


def _str_text(value: object) -> bytes:
    return value.encode() if isinstance(value, str) else str(value).encode()


def _float_value_text(value: object) -> bytes:
    if isinstance(value, str):  # the SQL layer's shortest round-trip text: PostgreSQL's
        return _FLOAT_WORDS.get(value) or value.encode()
    return _float_text(float(str(value))).encode()


def _bytea_value_text(value: object) -> bytes:
    if isinstance(value, str):  # the SQL layer's lowercase hex
        return _HEX_PREFIX + value.encode()
    return encode_text(BYTEA, value)


_TEXT_ENCODERS: dict[int, Encoder] = {
    INT2: _int_text,
    INT4: _int_text,
    INT8: _int_text,
    OID: _int_text,
    TEXT: _str_text,
    VARCHAR: _str_text,
    JSON: _str_text,
    DATE: _bc_text,
    NUMERIC: _str_text,
    UUID: _str_text,
    FLOAT4: _float_value_text,
    FLOAT8: _float_value_text,
    BYTEA: _bytea_value_text,
}


def column_encoder(oid: int, binary: bool) -> Encoder:
    """How a column of ``oid`` writes a SQL-layer value that is not NULL (chosen once
    per result: the per-value work of a DataRow)."""
    if not binary:
        encoder = _TEXT_ENCODERS.get(oid)
        if encoder is not None:
            return encoder
        return lambda value: encode_text(oid, result_value(oid, value))
    return lambda value: encode_binary(oid, result_value(oid, value))


# ---- parameters --------------------------------------------------------------------


def _bool_text(text: str) -> bool:
    word = text.strip().lower()
    if word in ("t", "true", "y", "yes", "on", "1"):
        return True
    if word in ("f", "false", "n", "no", "off", "0"):
        return False
    raise ValueError(f"invalid input syntax for type boolean: {text!r}")


def _bytea_text(text: str) -> bytes:
    if text.startswith("\\x"):
        return bytes.fromhex(text[2:])
    return text.encode("latin-1")  # escape format: only plain bytes taken


def _timestamp_param(text: str) -> datetime.datetime:
    text = text.strip().replace("T", " ")
    if text.endswith(("+00", "-00")) or (
        len(text) > 3 and text[-3] in "+-" and ":" not in text[-3:]
    ):
        text += ":00"  # PostgreSQL's short zone offset
    return datetime.datetime.fromisoformat(text)


_TEXT_PARAMS: dict[int, Callable[[str], object]] = {
    BOOL: _bool_text,
    INT2: int,
    INT4: int,
    INT8: int,
    OID: int,
    FLOAT4: float,
    FLOAT8: float,
    NUMERIC: decimal.Decimal,
    BYTEA: _bytea_text,
    DATE: datetime.date.fromisoformat,
    TIMESTAMP: _timestamp_param,
    TIMESTAMPTZ: _timestamp_param,
}


def _numeric_from_binary(data: bytes) -> decimal.Decimal:
    ndigits, weight, sign, scale = struct.unpack_from(">hhHh", data)
    if sign == 0xC000:
        return decimal.Decimal("NaN")
    if sign in (0xD000, 0xF000):
        return decimal.Decimal("Infinity" if sign == 0xD000 else "-Infinity")
    groups = struct.unpack_from(f">{ndigits}H", data, 8)
    # Built as an integer and an exponent, then read from text: exact, where Decimal's
    # arithmetic rounds to the context's 28 digits.
    coefficient = 0
    for g in groups:
        coefficient = coefficient * 10_000 + g
    exponent = 4 * (weight - ndigits + 1)
    if exponent > -scale:
        coefficient *= 10 ** (exponent + scale)
    elif exponent < -scale:
        coefficient //= 10 ** (-scale - exponent)
    return decimal.Decimal(f"{'-' if sign == 0x4000 else ''}{coefficient}e{-scale}")


_BINARY_PARAMS: dict[int, Callable[[bytes], object]] = {
    BOOL: lambda b: struct.unpack(">?", b)[0],
    INT2: lambda b: struct.unpack(">h", b)[0],
    INT4: lambda b: struct.unpack(">i", b)[0],
    INT8: lambda b: struct.unpack(">q", b)[0],
    OID: lambda b: struct.unpack(">I", b)[0],
    FLOAT4: lambda b: struct.unpack(">f", b)[0],
    FLOAT8: lambda b: struct.unpack(">d", b)[0],
    BYTEA: bytes,
    TEXT: lambda b: b.decode(),
    VARCHAR: lambda b: b.decode(),
    BPCHAR: lambda b: b.decode(),
    NAME: lambda b: b.decode(),
    UNKNOWN: lambda b: b.decode(),
    JSON: lambda b: b.decode(),
    JSONB: lambda b: b[1:].decode() if b[:1] == b"\x01" else _fail("jsonb version"),
    UUID: lambda b: str(uuid.UUID(bytes=b)),
    NUMERIC: _numeric_from_binary,
    DATE: lambda b: _DATE_2000 + datetime.timedelta(days=struct.unpack(">i", b)[0]),
    TIMESTAMP: lambda b: (
        datetime.datetime(2000, 1, 1) + datetime.timedelta(microseconds=struct.unpack(">q", b)[0])
    ),
    TIMESTAMPTZ: lambda b: (
        datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)
        + datetime.timedelta(microseconds=struct.unpack(">q", b)[0])
    ),
}


def _fail(what: str) -> Any:
    raise ValueError(f"unsupported {what}")


def decode_parameter(oid: int, binary: bool, data: bytes | None) -> object:
    """A Bind parameter as a Python value DuckDB binds; MessageError 22P02 (text) or
    22P03 (binary) when the bytes are not a value of ``oid``."""
    if data is None:
        return None
    try:
        if binary:
            decode_binary = _BINARY_PARAMS.get(oid)
            if decode_binary is None:
                raise MessageError(
                    f"binary format for parameter type {oid} is not supported", "0A000"
                )
            return decode_binary(data)
        text = data.decode()
        decode_text = _TEXT_PARAMS.get(oid)
        if oid in (JSONB, JSON):
            json.loads(text)  # checked here: DuckDB takes it as text
        return text if decode_text is None else decode_text(text)
    except (ValueError, struct.error, ArithmeticError, UnicodeDecodeError) as exc:
        state = "22P03" if binary else "22P02"
        raise MessageError(f"invalid parameter of type {oid}: {exc}", state) from None
