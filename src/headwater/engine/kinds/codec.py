"""Fast paths for a kind's records: one ``struct`` for schemas of fixed-width fields.

ASSERTs of numeric kinds are the hot path (BATCH frames of thousands): decoding each
field through the general decoder costs more than the rest of the write. A schema whose
fields are all fixed-width numbers (no bool: its byte must be checked to be 0 or 1, no
strings or bytes) is decoded and encoded with one precompiled ``struct``; the values are
exactly what the general decoder of :mod:`.fields` gives, which every other
schema (and any record that is not complete) still goes through.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache
from itertools import chain

import numpy as np

from headwater.engine.kinds.fields import (
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
        self._columns: np.dtype[np.void] | None = None
        if fields and all(c is not None for c in codes):
            self.fixed = struct.Struct("<" + "".join(c for c in codes if c is not None))
            # The record as unsigned integers of each field's width: compared bitwise.
            self._columns = np.dtype(
                [(f"f{i}", f"<u{_WIDTHS[f.type]}") for i, f in enumerate(fields)]
            )

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

    def changed_fields(self, new: Sequence[bytes], old: Sequence[bytes]) -> list[int]:
        """For each pair of whole records: bit i set where field i's encoded bytes differ.

        Bytes, not values: a NaN rewritten with the same bits is no change, and 0.0 after
        -0.0 is one (what a reader of the records sees). Fixed-width schemas compare every
        pair at once, one numpy column per field."""
        if not new:
            return []
        fixed = self.fixed
        if fixed is not None and set(map(len, chain(new, old))) == {fixed.size}:
            changed: list[int] = self.changed_masks(b"".join(new), b"".join(old)).tolist()
            return changed
        return [self._changed_pair(n, o) for n, o in zip(new, old, strict=True)]

    def changed_masks(self, new: bytes, old: bytes) -> np.ndarray:
        """:meth:`changed_fields` of a fixed-width schema's records given joined: two
        runs of whole records of equal count, as a uint64 array."""
        columns = self._columns
        assert columns is not None, "changed_masks needs a fixed-width schema"
        a = np.frombuffer(new, dtype=columns)
        b = np.frombuffer(old, dtype=columns)
        masks = np.zeros(len(a), dtype=np.uint64)
        for i, name in enumerate(columns.names or ()):
            masks |= (a[name] != b[name]).astype(np.uint64) << np.uint64(i)
        return masks

    def _changed_pair(self, new: bytes, old: bytes) -> int:
        a, b = self.field_bytes(new), self.field_bytes(old)
        mask = 0
        for i in range(len(self.fields)):
            # A record shorter than the schema (written before a migration) lacks the
            # later fields: they count as changed.
            if i >= len(a) or i >= len(b) or a[i] != b[i]:
                mask |= 1 << i
        return mask

    def field_bytes(self, record: bytes) -> list[bytes]:
        """A record cut into its fields' encoded bytes (as many fields as it holds)."""
        out: list[bytes] = []
        pos, end = 0, len(record)
        for spec in self.fields:
            if pos >= end:
                break
            width = _WIDTHS.get(spec.type)
            if width is None:  # string / bytes: u16 length, then the data
                width = 2 + int.from_bytes(record[pos : pos + 2], "little")
            out.append(record[pos : pos + width])
            pos += width
        return out


_WIDTHS = {
    FieldType.BOOL: 1,
    FieldType.U8: 1,
    FieldType.U16: 2,
    FieldType.U32: 4,
    FieldType.U64: 8,
    FieldType.I8: 1,
    FieldType.I16: 2,
    FieldType.I32: 4,
    FieldType.I64: 8,
    FieldType.TIMESTAMP: 8,
    FieldType.F32: 4,
    FieldType.F64: 8,
}


@lru_cache(maxsize=4096)
def codec_for(fields: tuple[FieldSpec, ...]) -> RecordCodec:
    return RecordCodec(fields)
