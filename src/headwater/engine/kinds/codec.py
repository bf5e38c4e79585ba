"""Fast paths for a kind's records: one ``struct`` for schemas of fixed-width fields.

ASSERTs of numeric kinds are the hot path (BATCH frames of thousands): decoding each
field through the general decoder costs more than the rest of the write. A schema whose
fields are all fixed-width numbers (no bool: its byte must be checked to be 0 or 1, no
strings or bytes) is decoded and encoded with one precompiled ``struct``; the values are
exactly what :mod:`headwater.protocols.convergedb.fields` gives, which every other
schema (and any record that is not complete) still goes through.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache

from headwater.protocols.convergedb.fields import (
    FieldSpec,
    FieldType,
    FieldValue,
    decode_fields,
    encode_fields,
)

_CODES = {
    FieldType.U8: "B",
    FieldType.U16: "H",
    FieldType.U32: "I",
    FieldType.U64: "Q",
    FieldType.I8: "b",
    FieldType.I16: "h",
    FieldType.I32: "i",
    FieldType.I64: "q",
    FieldType.TIMESTAMP: "q",
    FieldType.F32: "f",
    FieldType.F64: "d",
}


class RecordCodec:
    """Encode and decode whole records of one schema."""

    def __init__(self, fields: tuple[FieldSpec, ...]) -> None:
        self.fields = fields
        codes = [_CODES.get(f.type) for f in fields]
        self.fixed: struct.Struct | None = None
        if fields and all(c is not None for c in codes):
            self.fixed = struct.Struct("<" + "".join(c for c in codes if c is not None))

    def decode_assert(self, data: bytes) -> tuple[FieldValue, ...]:
        """ASSERT field_data (a prefix) -> every field's value, defaults filled in."""
        fixed = self.fixed
        if fixed is not None and len(data) == fixed.size:
            values: tuple[FieldValue, ...] = fixed.unpack(data)
            return values
        return tuple(decode_fields(self.fields, data, complete=True))

    def encode(self, values: Sequence[FieldValue]) -> bytes:
        """Every field's value -> field_data."""
        fixed = self.fixed
        if fixed is not None and len(values) == len(self.fields):
            try:
                return fixed.pack(*values)
            except struct.error:
                pass  # out of range or wrong type: let the general encoder say which
        return encode_fields(self.fields, values)

    def is_complete(self, data: bytes) -> bool:
        """Whether ASSERT field_data already holds every field (it is then the record)."""
        return self.fixed is not None and len(data) == self.fixed.size


@lru_cache(maxsize=4096)
def codec_for(fields: tuple[FieldSpec, ...]) -> RecordCodec:
    return RecordCodec(fields)
