"""Entity field values: the types, the limits and the record encoding of the kind engine.

A kind's schema is an ordered list of ``(name, type)`` fields (:class:`FieldSpec`, or
plain tuples). A record is the encoded values of the fields present, in field-ordinal
order, with nothing between them:

=====  =========  ===================================  ==================
code   type       encoding                             Python value
=====  =========  ===================================  ==================
1      bool       1 byte, 0 or 1                       bool
2..5   u8..u64    1/2/4/8 bytes LE, unsigned           int
6..9   i8..i64    1/2/4/8 bytes LE, two's complement   int
10     f32        4 bytes IEEE 754 LE                  float
11     f64        8 bytes IEEE 754 LE                  float
12     string     u16 length + UTF-8                   str
13     bytes      u16 length + raw bytes               bytes
14     timestamp  i64 LE, ns since the Unix epoch      int
=====  =========  ===================================  ==================

The engine stores and hands out records in this encoding (a changelog value is a source
set and a record), and ConvergeDB carries it as its ``field_data`` unchanged, so a write
off the wire is stored, and a STATE sent on, without re-encoding. Which fields are present
depends on the use: a whole record holds every field, an ASSERT a prefix (fields 0..k-1,
the rest take their zero/empty default), a PATCH or an EVENT exactly the fields whose bit
is set in a presence mask.

Decoders raise ``error`` (the engine's :class:`~.errors.BadFieldData` unless a codec
passes its own) for data that does not match the schema; encoders raise
:class:`~headwater.errors.UsageError` for values the type cannot carry.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from enum import IntEnum
from typing import NamedTuple, TypeAlias

from headwater.engine.kinds.errors import BadFieldData
from headwater.engine.kinds.reader import BoundedReader, Buffer, as_view
from headwater.errors import UsageError

MAX_FIELDS = 64
"""Most fields an entity kind may have (one bit each in a presence mask / changed_fields)."""
MAX_SOURCE_ID = 63
"""Writer source ids are 0..63 (one bit each in a source set)."""
ENTITY_ID_SIZE = 32
"""An entity id is 32 raw bytes."""
MAX_STR16 = 0xFFFF
"""Longest string or bytes value, in bytes (its length is a u16)."""

ErrorFactory: TypeAlias = Callable[[str], Exception]
"""What a decoder raises for data that does not fit the schema (it gets the message)."""


class FieldType(IntEnum):
    BOOL = 1
    U8 = 2
    U16 = 3
    U32 = 4
    U64 = 5
    I8 = 6
    I16 = 7
    I32 = 8
    I64 = 9
    F32 = 10
    F64 = 11
    STRING = 12
    BYTES = 13
    TIMESTAMP = 14


class FieldSpec(NamedTuple):
    """One field of a kind's schema (a plain ``(name, type)`` tuple works as well)."""

    name: str
    type: FieldType


FieldValue: TypeAlias = bool | int | float | str | bytes
SchemaLike: TypeAlias = Sequence[tuple[str, int]]
"""A kind's fields in ordinal order: FieldSpec or ``(name, type code)`` pairs."""

_FIXED: dict[FieldType, struct.Struct] = {
    FieldType.U8: struct.Struct("<B"),
    FieldType.U16: struct.Struct("<H"),
    FieldType.U32: struct.Struct("<I"),
    FieldType.U64: struct.Struct("<Q"),
    FieldType.I8: struct.Struct("<b"),
    FieldType.I16: struct.Struct("<h"),
    FieldType.I32: struct.Struct("<i"),
    FieldType.I64: struct.Struct("<q"),
    FieldType.TIMESTAMP: struct.Struct("<q"),
    FieldType.F32: struct.Struct("<f"),
    FieldType.F64: struct.Struct("<d"),
}
_FLOATS = frozenset({FieldType.F32, FieldType.F64})
_U16 = struct.Struct("<H")

_DEFAULTS: dict[FieldType, FieldValue] = {
    FieldType.BOOL: False,
    FieldType.F32: 0.0,
    FieldType.F64: 0.0,
    FieldType.STRING: "",
    FieldType.BYTES: b"",
}


def default_value(field_type: int) -> FieldValue:
    """The zero/empty value a field takes when an ASSERT leaves it out."""
    return _DEFAULTS.get(FieldType(field_type), 0)


def field_types(schema: SchemaLike) -> list[FieldType]:
    """The schema's type codes, checked (UsageError for an unknown code or >64 fields)."""
    if len(schema) > MAX_FIELDS:
        raise UsageError(f"a kind has at most {MAX_FIELDS} fields, not {len(schema)}")
    try:
        return [FieldType(spec[1]) for spec in schema]
    except ValueError as exc:
        raise UsageError(f"bad schema: {exc}") from None


def default_values(schema: SchemaLike) -> list[FieldValue]:
    return [default_value(t) for t in field_types(schema)]


# --- encoding --------------------------------------------------------------------------


def _put(out: list[bytes], field_type: FieldType, value: object, what: str) -> None:
    if field_type is FieldType.BOOL:
        if not isinstance(value, bool):
            raise UsageError(f"{what}: a bool field needs a bool, not {type(value).__name__}")
        out.append(b"\x01" if value else b"\x00")
        return
    fixed = _FIXED.get(field_type)
    if fixed is not None:
        if isinstance(value, bool) or not isinstance(
            value, (int, float) if field_type in _FLOATS else int
        ):
            raise UsageError(f"{what}: a {field_type.name} field cannot hold {value!r}")
        try:
            out.append(fixed.pack(value))
        except (struct.error, OverflowError) as exc:
            raise UsageError(f"{what}: {value!r} does not fit {field_type.name} ({exc})") from None
        return
    if field_type is FieldType.STRING:
        if not isinstance(value, str):
            raise UsageError(f"{what}: a string field needs a str, not {type(value).__name__}")
        try:
            data = value.encode()
        except UnicodeEncodeError as exc:
            raise UsageError(f"{what}: not encodable as UTF-8 ({exc.reason})") from None
    else:  # BYTES
        if not isinstance(value, bytes | bytearray | memoryview):
            raise UsageError(f"{what}: a bytes field needs bytes, not {type(value).__name__}")
        data = bytes(value)
    if len(data) > MAX_STR16:
        raise UsageError(f"{what}: {len(data)} bytes exceed the {MAX_STR16}-byte field limit")
    out.append(_U16.pack(len(data)))
    out.append(data)


def encode_fields(schema: SchemaLike, values: Sequence[FieldValue]) -> bytes:
    """The record of fields 0..len(values)-1 (an ASSERT's prefix; all of them: whole)."""
    types = field_types(schema)
    if len(values) > len(types):
        raise UsageError(f"{len(values)} values for a kind of {len(types)} fields")
    out: list[bytes] = []
    for i, value in enumerate(values):
        _put(out, types[i], value, f"field {i} ({schema[i][0]})")
    return b"".join(out)


def presence_mask(indices: Sequence[int] | Mapping[int, object]) -> int:
    """The presence mask naming ``indices`` (field ordinals 0..63)."""
    mask = 0
    for i in indices:
        if not 0 <= i < MAX_FIELDS:
            raise UsageError(f"field ordinal {i} is outside 0..{MAX_FIELDS - 1}")
        mask |= 1 << i
    return mask


def encode_present_fields(
    schema: SchemaLike, values: Mapping[int, FieldValue]
) -> tuple[int, bytes]:
    """``(presence_mask, data)`` for the fields in ``values`` (PATCH, EVENT)."""
    types = field_types(schema)
    out: list[bytes] = []
    for i in sorted(values):
        if not 0 <= i < len(types):
            raise UsageError(f"field ordinal {i} is outside the kind's {len(types)} fields")
        _put(out, types[i], values[i], f"field {i} ({schema[i][0]})")
    return presence_mask(values), b"".join(out)


# --- decoding --------------------------------------------------------------------------


def _get(r: BoundedReader, field_type: FieldType, what: str) -> FieldValue:
    if field_type is FieldType.BOOL:
        byte = r.u8(what)
        if byte > 1:
            raise r.error(f"{what}: bool byte {byte} is neither 0 nor 1")
        return byte == 1
    fixed = _FIXED.get(field_type)
    if fixed is not None:
        value: int | float = fixed.unpack_from(r.buf, r.need(fixed.size, what))[0]
        return value
    n = r.u16(f"{what} length")
    pos = r.need(n, what)
    raw = r.buf[pos : pos + n]
    if field_type is FieldType.BYTES:
        return bytes(raw)
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError as exc:
        raise r.error(f"{what}: invalid UTF-8 ({exc.reason})") from None


def decode_fields(
    schema: SchemaLike,
    data: Buffer,
    *,
    complete: bool = False,
    error: ErrorFactory = BadFieldData,
) -> list[FieldValue]:
    """An ASSERT's record: the values of fields 0..k-1, k <= the kind's field count.

    The data must end exactly after a field. With ``complete`` the missing fields k.. are
    filled with their defaults, giving the full record the ASSERT sets.
    """
    types = field_types(schema)
    r = BoundedReader(as_view(data), error)
    values: list[FieldValue] = []
    while r.remaining:
        i = len(values)
        if i == len(types):
            raise error(f"{r.remaining} bytes of field_data after the kind's {len(types)} fields")
        values.append(_get(r, types[i], f"field {i}"))
    if complete:
        values.extend(default_value(t) for t in types[len(values) :])
    return values


def decode_record(
    schema: SchemaLike, data: Buffer, *, error: ErrorFactory = BadFieldData
) -> list[FieldValue]:
    """A record that must hold every field of the kind (STATE)."""
    values = decode_fields(schema, data, error=error)
    if len(values) != len(schema):
        raise error(f"field_data holds {len(values)} of the kind's {len(schema)} fields")
    return values


def decode_prefix(
    schema: SchemaLike, data: Buffer, *, error: ErrorFactory = BadFieldData
) -> list[FieldValue]:
    """The values of ``schema``'s fields from the start of a longer record.

    A reader that knows only the first k fields of a kind (its schema is a prefix of the
    kind's, e.g. before another writer appended fields) reads a record with it: the k
    values are decoded and the bytes after them, the later fields, are left alone.
    """
    types = field_types(schema)
    r = BoundedReader(as_view(data), error)
    return [_get(r, field_type, f"field {i}") for i, field_type in enumerate(types)]


def decode_present_fields(
    schema: SchemaLike, mask: int, data: Buffer, *, error: ErrorFactory = BadFieldData
) -> dict[int, FieldValue]:
    """PATCH / EVENT data: exactly the fields whose bit is set in ``mask``."""
    types = field_types(schema)
    if mask >> len(types):
        raise error(f"presence_mask {mask:#x} names fields beyond the kind's {len(types)}")
    r = BoundedReader(as_view(data), error)
    values: dict[int, FieldValue] = {}
    for i, field_type in enumerate(types):
        if mask >> i & 1:
            values[i] = _get(r, field_type, f"field {i}")
    r.finish("the present fields")
    return values
