"""Entity field values on the wire: ``field_data`` is the kind engine's record encoding.

The type codes, values, limits and the encoding itself are the engine's
(:mod:`headwater.engine.kinds.fields`, where the table of types is): a record the engine
stores is the ``field_data`` of a STATE, and the ``field_data`` of an ASSERT of every
field is stored as it came. Which fields are present depends on the message: ASSERT
carries a prefix (fields 0..k-1, the rest take their zero/empty default), PATCH and EVENT
carry exactly the fields whose bit is set in presence_mask, STATE carries every field.

The decoders here raise :class:`~.codes.FieldDataError` (BAD_FIELD_DATA) for data that
does not match the schema; encoders raise :class:`~headwater.errors.UsageError` for
values the type cannot carry.
"""

from __future__ import annotations

from headwater.engine.kinds import fields as _records
from headwater.engine.kinds.fields import (
    MAX_STR16,
    FieldSpec,
    FieldType,
    FieldValue,
    SchemaLike,
    default_value,
    default_values,
    encode_fields,
    encode_present_fields,
    field_types,
    presence_mask,
)
from headwater.engine.kinds.reader import Buffer

from .codes import FieldDataError

__all__ = [
    "MAX_STR16",
    "FieldSpec",
    "FieldType",
    "FieldValue",
    "SchemaLike",
    "decode_fields",
    "decode_prefix",
    "decode_present_fields",
    "decode_record",
    "default_value",
    "default_values",
    "encode_fields",
    "encode_present_fields",
    "field_types",
    "presence_mask",
]


def decode_fields(schema: SchemaLike, data: Buffer, *, complete: bool = False) -> list[FieldValue]:
    """ASSERT's field_data: the values of fields 0..k-1, k <= the kind's field count.

    The data must end exactly after a field. With ``complete`` the missing fields k.. are
    filled with their defaults, giving the full record the ASSERT sets.
    """
    return _records.decode_fields(schema, data, complete=complete, error=FieldDataError)


def decode_record(schema: SchemaLike, data: Buffer) -> list[FieldValue]:
    """field_data that must hold every field of the kind (STATE)."""
    return _records.decode_record(schema, data, error=FieldDataError)


def decode_prefix(schema: SchemaLike, data: Buffer) -> list[FieldValue]:
    """The values of ``schema``'s fields from the start of a longer STATE's field_data
    (a reader that knows only the first k fields of a kind)."""
    return _records.decode_prefix(schema, data, error=FieldDataError)


def decode_present_fields(schema: SchemaLike, mask: int, data: Buffer) -> dict[int, FieldValue]:
    """PATCH / EVENT field_data: exactly the fields whose bit is set in ``mask``."""
    return _records.decode_present_fields(schema, mask, data, error=FieldDataError)
