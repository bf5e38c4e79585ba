"""Kafka messages as kio's typed classes, read by a bounded decoder of our own.

`kio <https://pypi.org/project/kio/>`_ generates one frozen dataclass per API, version and
nested struct from Kafka's own message definitions (``clients/src/main/resources/common/
message/*.json``), with each field's Kafka type, tag and flexibility in its metadata, and
writes them with every rule of the wire (compact and legacy strings, arrays and bytes,
nullable structs, tagged fields written only when they differ from their default).

kio's own reader (native code) is not used: it reserves room for an array from the
array's length field before reading an element, so 5 bytes claiming 2^32 elements make it
ask the allocator for 32 GiB and abort the whole process. The reader here is compiled
from the same dataclasses: scalars, strings and bytes go through kio's native primitive
readers (each checks its length against the bytes left before copying), and arrays,
structs and tagged fields are walked here, an array's length checked against the bytes
left (every element takes at least one byte) before a single element is read. Any
failure is a :class:`SchemaDecodeError`, never an allocation the input did not pay for.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import MISSING, Field, fields
from functools import cache
from typing import Any, Protocol, TypeAlias, TypeVar, cast

from kio._kio_native import (
    get_reader,
    read_compact_array_length,
    read_int8,
    read_legacy_array_length,
    read_nullable_legacy_string,
    read_unsigned_varint,
)
from kio.serial import entity_writer
from kio.serial._implicit_defaults import get_tagged_field_default
from kio.serial._introspect import (
    EntityField,
    EntityTupleField,
    PrimitiveField,
    PrimitiveTupleField,
    classify_field,
    get_field_tag,
    get_schema_field_type,
    is_optional,
)
from kio.serial.errors import SerialError
from kio.static.protocol import Entity

from headwater.engine.kinds.reader import Buffer
from headwater.errors import ProtocolError

E = TypeVar("E", bound=Entity)

FieldReader: TypeAlias = Callable[[memoryview, int, int], tuple[Any, int]]
"""Reads one value from ``view`` at ``offset``, never past ``end``: (value, new offset)."""


class SchemaDecodeError(ProtocolError):
    """The bytes do not decode as the message they were sent as."""


class _NativeReader(Protocol):
    def __call__(self, buffer: Buffer, offset: int, /) -> tuple[Any, int]: ...


def _native(reader: _NativeReader) -> FieldReader:
    """A kio primitive reader bounded by ``end`` (it only knows the buffer's end)."""

    def read(view: memoryview, offset: int, end: int) -> tuple[Any, int]:
        value, size = reader(view[:end], offset)
        return value, offset + size

    return read


def _records(flexible: bool) -> FieldReader:
    """A nullable records field (a Produce's record batches): a view of the request's
    bytes, not a copy of them (kio's readers take only read-only buffers, so those
    bytes cannot change: a frame is ``bytes``). The batches are checked and written
    from the view: the copy cost a page-faulted buffer the size of the batches, about
    a tenth of the event loop's time under a Kafka produce."""

    def read(view: memoryview, offset: int, end: int) -> tuple[Any, int]:
        if flexible:  # compact: length + 1 as an unsigned varint, 0 for null
            stored, size = read_unsigned_varint(view[:end], offset)
            offset += size
            length = stored - 1
        else:  # an int32 length, -1 for null
            if end - offset < 4:
                raise SchemaDecodeError("records: length runs past the end")
            length = int.from_bytes(view[offset : offset + 4], "big", signed=True)
            offset += 4
        if length == -1:
            return None, offset
        if length < 0 or length > end - offset:
            raise SchemaDecodeError(f"records: {length} bytes in {end - offset} remaining")
        return view[offset : offset + length], offset + length

    return read


def _array(item: FieldReader, flexible: bool, nullable: bool, what: str) -> FieldReader:
    length_reader = read_compact_array_length if flexible else read_legacy_array_length

    def read(view: memoryview, offset: int, end: int) -> tuple[Any, int]:
        length, size = length_reader(view[:end], offset)
        offset += size
        if length is None or length < 0:
            if not nullable:
                raise SchemaDecodeError(f"{what}: null array where one is required")
            return None, offset
        if length > end - offset:  # every element takes at least one byte
            raise SchemaDecodeError(
                f"{what}: array of {length} elements in {end - offset} remaining bytes"
            )
        items: list[Any] = []
        append = items.append
        for _ in range(length):
            value, offset = item(view, offset, end)
            append(value)
        return tuple(items), offset

    return read


def _nullable_struct(inner: FieldReader) -> FieldReader:
    # KIP-893: a nullable struct is an int8 marker (-1 null, 1 present) then the struct.
    def read(view: memoryview, offset: int, end: int) -> tuple[Any, int]:
        marker, size = read_int8(view[:end], offset)
        offset += size
        if marker < 0:
            return None, offset
        return inner(view, offset, end)

    return read


def _field_reader(entity_type: type[Entity], field: Field[Any], is_tag: bool) -> FieldReader:
    flexible: bool = entity_type.__flexible__
    what = f"{entity_type.__name__}.{field.name}"
    optional = False if is_tag else is_optional(field)
    field_class = classify_field(field)
    if entity_type.__name__ == "RequestHeader" and field.name == "client_id":
        # Kafka keeps the header's client id a legacy string even in header v2.
        return _native(read_nullable_legacy_string)
    item: FieldReader
    match field_class:
        case PrimitiveField():
            if optional and get_schema_field_type(field) == "records":
                return _records(flexible)
            item = _native(get_reader(get_schema_field_type(field), flexible, optional))
            return item
        case PrimitiveTupleField():
            item = _native(get_reader(get_schema_field_type(field), flexible, False))
        case EntityField(nested):
            item = _entity_reader(nested)
            return _nullable_struct(item) if optional else item
        case EntityTupleField(nested):
            item = _entity_reader(nested)
    return _array(item, flexible, optional, what)


@cache
def _entity_reader(entity_type: type[Entity]) -> FieldReader:
    """The reader of one struct: its fields in order, then (flexible) its tagged fields,
    unknown tags skipped as Kafka requires."""
    flexible: bool = entity_type.__flexible__
    plain: list[tuple[str, FieldReader]] = []
    tagged: dict[int, tuple[str, FieldReader]] = {}
    defaults: dict[str, Any] = {}
    for field in fields(cast(Any, entity_type)):
        tag = get_field_tag(field)
        reader = _field_reader(entity_type, field, tag is not None)
        if tag is None:
            plain.append((field.name, reader))
        else:
            tagged[int(tag)] = (field.name, reader)
            if field.default is MISSING:
                defaults[field.name] = get_tagged_field_default(field)
    name = entity_type.__name__

    def read(view: memoryview, offset: int, end: int) -> tuple[Any, int]:
        values: dict[str, Any] = {}
        for field_name, reader in plain:
            values[field_name], offset = reader(view, offset, end)
        if flexible:
            values.update(defaults)
            count, size = read_unsigned_varint(view[:end], offset)
            offset += size
            # Kafka's own parser takes tags in any order; so does this one. Each tag
            # reads at least two bytes or fails, so a huge count cannot spin.
            for _ in range(count):
                tag, size = read_unsigned_varint(view[:end], offset)
                offset += size
                length, size = read_unsigned_varint(view[:end], offset)
                offset += size
                if length > end - offset:
                    raise SchemaDecodeError(f"{name}: tagged field {tag} runs past the end")
                known = tagged.get(tag)
                if known is not None:
                    field_name, reader = known
                    values[field_name], after = reader(view, offset, offset + length)
                    if after != offset + length:
                        raise SchemaDecodeError(f"{name}: tagged field {tag} has extra bytes")
                offset += length
        return entity_type(**values), offset

    return read


def decode_entity(entity_type: type[E], data: Buffer, offset: int = 0) -> tuple[E, int]:
    """``entity_type`` read from ``data`` at ``offset``: (value, offset after it).
    Raises :class:`SchemaDecodeError` on bytes that do not decode as it."""
    view = memoryview(data)
    try:
        value, after = _entity_reader(entity_type)(view, offset, view.nbytes)
    except SchemaDecodeError:
        raise
    except (SerialError, ValueError, TypeError, OverflowError) as exc:
        # kio's readers raise SerialError; an unknown error code or a value its
        # type refuses raises ValueError or TypeError.
        raise SchemaDecodeError(f"{entity_type.__name__}: {exc}") from None
    return cast(E, value), after


def decode_exact(entity_type: type[E], data: Buffer) -> E:
    """``entity_type`` filling ``data`` exactly (trailing bytes are an error, as in
    Kafka's own parser)."""
    value, end = decode_entity(entity_type, data)
    if end != memoryview(data).nbytes:
        raise SchemaDecodeError(
            f"{entity_type.__name__}: {memoryview(data).nbytes - end} bytes after the message"
        )
    return value


def encode_entity(entity: Entity) -> bytes:
    """The wire bytes of ``entity`` (kio's writer)."""
    buffer = io.BytesIO()
    entity_writer(type(entity))(buffer, entity)
    return buffer.getvalue()
