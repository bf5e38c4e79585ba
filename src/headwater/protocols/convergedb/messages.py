"""ConvergeDB messages: one frozen dataclass per payload, and their byte encoding.

Payloads are little-endian, fixed width: ``str16`` is a u16 length then UTF-8,
``entity_id`` is 32 raw bytes, ``metadata`` is a u16 length then raw bytes and
``field_data`` a u32 length then raw bytes (decoded against a schema with
:mod:`.fields`, which the codec does not know). Each message class has ``opcode``,
``encode() -> bytes`` (the payload) and ``decode(payload)``; :class:`Frame` pairs a
message with its stream_id and does the framing.

Decoders never trust a length: every count is checked against the bytes that remain
before anything is sliced or looped over, a payload must be consumed exactly, and flag
bytes with bits the protocol does not define are refused. Anything malformed raises
:class:`~.codes.DecodeError` (or a subclass naming a more precise ERROR code). Encoders
raise :class:`~headwater.errors.UsageError` for values the wire cannot carry.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache
from typing import Annotated, ClassVar, Self, TypeAlias, TypeVar, get_args, overload

from headwater.engine.kinds.reader import BoundedReader, Buffer, as_view
from headwater.errors import UsageError
from headwater.protocols._layout import U8, U16, U64, Declared, Fixed, Variable, lenient

from .codes import (
    CLIENT_OPCODES,
    DEFAULT_LIVENESS_MS,
    ENTITY_ID_SIZE,
    MAX_FIELDS,
    MAX_SOURCE_ID,
    NO_SOURCE,
    DecodeError,
    ErrorCode,
    LimitExceededError,
    Opcode,
)
from .fields import (
    FieldSpec,
    FieldType,
    FieldValue,
    SchemaLike,
    decode_fields,
    decode_present_fields,
    decode_record,
    encode_fields,
    encode_present_fields,
)
from .frames import RawFrame, encode_frame

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_MAX16 = 0xFFFF
T = TypeVar("T")
_MAX32 = 0xFFFF_FFFF


class Change(IntEnum):
    """STATE's change byte."""

    CREATED = 0
    UPDATED = 1
    BOOTSTRAP = 2
    QUERY = 3


# --- field helpers ---------------------------------------------------------------------


def _reader(payload: Buffer) -> BoundedReader:
    return BoundedReader(as_view(payload), DecodeError)


def _put_str16(out: list[Buffer], text: str, what: str) -> None:
    data = text.encode()  # UnicodeEncodeError is turned into UsageError by encode()
    if len(data) > _MAX16:
        raise UsageError(f"{what}: {len(data)} bytes exceed the {_MAX16}-byte str16 limit")
    out.append(_U16.pack(len(data)))
    out.append(data)


def _put_blob16(out: list[Buffer], data: bytes, what: str) -> None:
    if len(data) > _MAX16:
        raise UsageError(f"{what}: {len(data)} bytes exceed the {_MAX16}-byte limit")
    out.append(_U16.pack(len(data)))
    out.append(bytes(data))


def _put_blob32(out: list[Buffer], data: bytes, what: str) -> None:
    if len(data) > _MAX32:
        raise UsageError(f"{what}: {len(data)} bytes exceed the u32 length limit")
    out.append(_U32.pack(len(data)))
    out.append(bytes(data))


def _entity(entity_id: bytes, what: str) -> bytes:
    if len(entity_id) != ENTITY_ID_SIZE:
        raise UsageError(f"an entity_id is {ENTITY_ID_SIZE} bytes, not {len(entity_id)}")
    return bytes(entity_id)


def _put_entity(out: list[Buffer], entity_id: bytes) -> None:
    out.append(_entity(entity_id, "entity_id"))


def _read_str16(r: BoundedReader, what: str) -> str:
    return r.text(r.u16(f"{what} length"), what)


def _read_blob16(r: BoundedReader, what: str) -> bytes:
    return r.take(r.u16(f"{what} length"), what)


def _read_blob32(r: BoundedReader, what: str) -> bytes:
    return r.take(r.u32(f"{what} length"), what)


def _read_entity(r: BoundedReader) -> bytes:
    return r.take(ENTITY_ID_SIZE, "entity_id")


def _read_flags(r: BoundedReader, defined: int, what: str) -> int:
    flags = r.u8(what)
    if flags & ~defined:
        raise DecodeError(f"{what} {flags:#04x} sets undefined bits")
    return flags


def _checked(
    code: str, allowed: Container[int], refused: str, unusable: str, kind: Callable[[int], T]
) -> Fixed[T]:
    """A fixed-width field whose value must be one of ``allowed``, as ``kind``: reading
    another raises DecodeError(``refused``), writing one UsageError(``unusable``), both
    formatted with ``value`` and ``what`` (the field's name)."""

    def load(r: BoundedReader, value: int, what: str, at: int) -> T:
        if value not in allowed:
            raise DecodeError(refused.format(value=value, what=what))
        return kind(value)

    def dump(value: int, what: str) -> int:
        if value not in allowed:
            raise UsageError(unusable.format(value=value, what=what))
        return value

    return Fixed(code, load=load, dump=dump)


_OUTSIDE = f"{{what}} {{value}} is outside 0..{MAX_SOURCE_ID}"
_SOURCE: Fixed[int] = _checked("B", range(MAX_SOURCE_ID + 1), _OUTSIDE, _OUTSIDE, int)
"""A source slot, 0..63."""


def _acked(allowed: Container[int], unusable: str = "") -> Fixed[Opcode]:
    """An ACK's u16 acked_opcode, one of ``allowed`` for its class (``unusable`` says what
    to use instead when encoding another)."""
    return _checked("H", allowed, "ACK of opcode {value:#06x} with this body", unusable, Opcode)


Entity: TypeAlias = Annotated[bytes, Fixed(f"{ENTITY_ID_SIZE}s", dump=_entity)]
Str16: TypeAlias = Annotated[str, Variable(_read_str16, _put_str16)]
Blob16: TypeAlias = Annotated[bytes, Variable(_read_blob16, _put_blob16)]
Blob32: TypeAlias = Annotated[bytes, Variable(_read_blob32, _put_blob32)]


def _check_u16(value: int, what: str) -> None:
    if not 0 <= value <= _MAX16:
        raise UsageError(f"{what} {value} is not a u16")


class _Message(Declared):
    """What every message has: ``opcode``, ``encode()`` and ``decode()``; its fields
    declare their wire types (see :mod:`headwater.protocols._layout`) unless the class
    writes its own ``_write`` / ``_read``."""

    __slots__ = ()
    opcode: ClassVar[Opcode]

    def encode(self) -> bytes:
        """The payload bytes (no header)."""
        out: list[Buffer] = []
        try:
            self._write(out)
        except (struct.error, UnicodeEncodeError, OverflowError, TypeError) as exc:
            raise UsageError(f"cannot encode {type(self).__name__}: {exc}") from None
        return b"".join(out)

    @classmethod
    def decode(cls, payload: Buffer) -> Self:
        """Decode exactly one payload of this message type; raises DecodeError."""
        r = _reader(payload)
        message = cls._read(r)
        r.finish(cls.__name__)
        return message


@dataclass(frozen=True, slots=True)
class _KindOnly(_Message):
    """A message whose payload is a u16 kind_id."""

    kind_id: U16


# --- client -> server ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Connect(_Message):
    """CONNECT: u8 flags (bit0 source_id given, bit1 read-only), u8 source_id,
    u32 liveness_deadline_ms, str16 name, str16 auth_token. Answered by ConnectAck."""

    opcode: ClassVar[Opcode] = Opcode.CONNECT
    name: str = ""
    auth_token: str = ""
    source_id: int | None = None
    """The source slot asked for (0..63), None to let the server pick a free one."""
    read_only: bool = False
    liveness_deadline_ms: int = 0
    """0 means the default, 30,000 ms (see :attr:`deadline_ms`)."""

    FLAG_SOURCE_ID: ClassVar[int] = 0x01
    FLAG_READ_ONLY: ClassVar[int] = 0x02

    @property
    def deadline_ms(self) -> int:
        """The liveness deadline in effect."""
        return self.liveness_deadline_ms or DEFAULT_LIVENESS_MS

    def _write(self, out: list[Buffer]) -> None:
        flags = self.FLAG_READ_ONLY if self.read_only else 0
        source = 0
        if self.source_id is not None:
            if not 0 <= self.source_id <= MAX_SOURCE_ID:
                raise UsageError(f"source_id {self.source_id} is outside 0..{MAX_SOURCE_ID}")
            flags |= self.FLAG_SOURCE_ID
            source = self.source_id
        out.append(struct.pack("<BBI", flags, source, self.liveness_deadline_ms))
        _put_str16(out, self.name, "name")
        _put_str16(out, self.auth_token, "auth_token")

    @classmethod
    def _read(cls, r: BoundedReader) -> Self:
        flags = _read_flags(r, cls.FLAG_SOURCE_ID | cls.FLAG_READ_ONLY, "CONNECT flags")
        source: int | None = r.u8("source_id")
        if not flags & cls.FLAG_SOURCE_ID:
            source = None  # the byte means nothing without its flag
        elif source is not None and source > MAX_SOURCE_ID:
            raise DecodeError(f"source_id {source} is outside 0..{MAX_SOURCE_ID}")
        deadline = r.u32("liveness_deadline_ms")
        name = _read_str16(r, "name")
        token = _read_str16(r, "auth_token")
        return cls(name, token, source, bool(flags & cls.FLAG_READ_ONLY), deadline)


@dataclass(frozen=True, slots=True)
class _WriteOp(_Message):
    """What every write op (ASSERT, RETRACT, PATCH) starts with: u16 kind_id, entity_id."""

    kind_id: U16
    entity_id: Entity

    @property
    def key(self) -> tuple[int, bytes]:
        """``(kind_id, entity_id)``: what the engine partitions writes by."""
        return self.kind_id, self.entity_id


@dataclass(frozen=True, slots=True)
class Assert(_WriteOp):
    """ASSERT: u16 kind_id, entity_id, u32 fd_len + field_data (fields 0..k-1),
    u16 meta_len + metadata. Sets the writer's source bit and replaces the fields."""

    opcode: ClassVar[Opcode] = Opcode.ASSERT
    field_data: Blob32 = b""
    metadata: Blob16 = b""

    MIN_SIZE: ClassVar[int] = 2 + ENTITY_ID_SIZE + 4 + 2

    @classmethod
    def of(
        cls,
        schema: SchemaLike,
        kind_id: int,
        entity_id: bytes,
        values: Sequence[FieldValue],
        metadata: bytes = b"",
    ) -> Self:
        """Encode ``values`` (fields 0..len(values)-1 of ``schema``) into an ASSERT."""
        return cls(kind_id, entity_id, encode_fields(schema, values), metadata)

    def fields(self, schema: SchemaLike) -> list[FieldValue]:
        """Every field's new value: the sent prefix, defaults after it."""
        return decode_fields(schema, self.field_data, complete=True)


@dataclass(frozen=True, slots=True)
class Retract(_WriteOp):
    """RETRACT: u16 kind_id, entity_id, u16 meta_len + metadata. Clears the writer's bit."""

    opcode: ClassVar[Opcode] = Opcode.RETRACT
    metadata: Blob16 = b""

    MIN_SIZE: ClassVar[int] = 2 + ENTITY_ID_SIZE + 2


@dataclass(frozen=True, slots=True)
class Patch(_WriteOp):
    """PATCH: u16 kind_id, entity_id, u64 presence_mask, u32 fd_len + field_data (exactly
    the fields whose bit is set), u16 meta_len + metadata."""

    opcode: ClassVar[Opcode] = Opcode.PATCH
    presence_mask: U64
    field_data: Blob32 = b""
    metadata: Blob16 = b""

    MIN_SIZE: ClassVar[int] = 2 + ENTITY_ID_SIZE + 8 + 4 + 2

    @classmethod
    def of(
        cls,
        schema: SchemaLike,
        kind_id: int,
        entity_id: bytes,
        values: Mapping[int, FieldValue],
        metadata: bytes = b"",
    ) -> Self:
        """Encode ``{field ordinal: value}`` into a PATCH."""
        mask, data = encode_present_fields(schema, values)
        return cls(kind_id, entity_id, mask, data, metadata)

    def fields(self, schema: SchemaLike) -> dict[int, FieldValue]:
        """``{field ordinal: new value}`` for the fields present."""
        return decode_present_fields(schema, self.presence_mask, self.field_data)


WriteOp: TypeAlias = Assert | Retract | Patch
"""A BATCH sub-op."""
_SUB_OPS: dict[int, type[WriteOp]] = {
    Opcode.ASSERT: Assert,
    Opcode.RETRACT: Retract,
    Opcode.PATCH: Patch,
}


@dataclass(frozen=True, slots=True)
class Query(_Message):
    """QUERY: u16 kind_id, entity_id. Answered by STATE (change 3) or ENTITY_NOT_FOUND."""

    opcode: ClassVar[Opcode] = Opcode.QUERY
    kind_id: U16
    entity_id: Entity


@dataclass(frozen=True, slots=True)
class Subscribe(_Message):
    """SUBSCRIBE: u16 kind_id, u8 flags (bit0 bootstrap, bit1 include_previous,
    bit2 events)."""

    opcode: ClassVar[Opcode] = Opcode.SUBSCRIBE
    kind_id: int
    bootstrap: bool = False
    include_previous: bool = False
    events: bool = False
    """EVENT frames of an event-stream kind instead of STATE/DELETED."""

    FLAG_BOOTSTRAP: ClassVar[int] = 0x01
    FLAG_INCLUDE_PREVIOUS: ClassVar[int] = 0x02
    FLAG_EVENTS: ClassVar[int] = 0x04

    def _write(self, out: list[Buffer]) -> None:
        flags = (
            (self.FLAG_BOOTSTRAP if self.bootstrap else 0)
            | (self.FLAG_INCLUDE_PREVIOUS if self.include_previous else 0)
            | (self.FLAG_EVENTS if self.events else 0)
        )
        out.append(struct.pack("<HB", self.kind_id, flags))

    @classmethod
    def _read(cls, r: BoundedReader) -> Self:
        kind_id = r.u16("kind_id")
        flags = _read_flags(r, 0x07, "SUBSCRIBE flags")
        return cls(
            kind_id,
            bool(flags & cls.FLAG_BOOTSTRAP),
            bool(flags & cls.FLAG_INCLUDE_PREVIOUS),
            bool(flags & cls.FLAG_EVENTS),
        )


@dataclass(frozen=True, slots=True)
class Unsubscribe(_KindOnly):
    """UNSUBSCRIBE: u16 kind_id. Answered by ACK."""

    opcode: ClassVar[Opcode] = Opcode.UNSUBSCRIBE


@dataclass(frozen=True, slots=True)
class Heartbeat(_Message):
    """HEARTBEAT: empty. stream_id 0: liveness only; non-zero: a write barrier (ACK)."""

    opcode: ClassVar[Opcode] = Opcode.HEARTBEAT


@dataclass(frozen=True, slots=True)
class SourceEpochBegin(_Message):
    """SOURCE_EPOCH_BEGIN: empty; spans every kind of this source."""

    opcode: ClassVar[Opcode] = Opcode.SOURCE_EPOCH_BEGIN


@dataclass(frozen=True, slots=True)
class SourceEpochEnd(_Message):
    """SOURCE_EPOCH_END: empty. Answered (non-zero stream_id) by EpochEndAck."""

    opcode: ClassVar[Opcode] = Opcode.SOURCE_EPOCH_END


class AssertRun(Sequence[Assert]):
    """The sub-ops of a BATCH that holds only ASSERTs of one kind, each with field_data of
    one length and no metadata: the usual BATCH of a writer, recognised and decoded in one
    pass (:meth:`Batch._read`) into ``(entity_id, field_data)`` pairs. It is a sequence of
    :class:`Assert` like any other ``Batch.ops``; an ``Assert`` is made only when asked
    for, so a consumer that takes ``pairs`` builds no object per op."""

    __slots__ = ("kind_id", "pairs")

    def __init__(self, kind_id: int, pairs: Sequence[tuple[bytes, bytes]]) -> None:
        self.kind_id = kind_id
        self.pairs = pairs

    @property
    def field_data_size(self) -> int:
        return len(self.pairs[0][1]) if self.pairs else 0

    def __len__(self) -> int:
        return len(self.pairs)

    @overload
    def __getitem__(self, index: int) -> Assert: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Assert, ...]: ...
    def __getitem__(self, index: int | slice) -> Assert | tuple[Assert, ...]:
        if isinstance(index, slice):
            return tuple(Assert(self.kind_id, e, d) for e, d in self.pairs[index])
        entity_id, field_data = self.pairs[index]
        return Assert(self.kind_id, entity_id, field_data)

    def __iter__(self) -> Iterator[Assert]:
        kind_id = self.kind_id
        return (Assert(kind_id, e, d) for e, d in self.pairs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, AssertRun):
            return self.kind_id == other.kind_id and list(self.pairs) == list(other.pairs)
        if isinstance(other, Sequence):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"AssertRun(kind_id={self.kind_id}, {len(self.pairs)} ops)"


@lru_cache(maxsize=256)
def _assert_run_layout(fd_len: int) -> struct.Struct:
    """One ASSERT sub-op with ``fd_len`` bytes of field_data and no metadata, skipping all
    but entity_id and field_data."""
    return struct.Struct(f"<3x{ENTITY_ID_SIZE}s4x{fd_len}s2x")


def _read_assert_run(buf: memoryview | bytes, pos: int, end: int, count: int) -> AssertRun | None:
    """The sub-ops in ``buf[pos:end]`` as an AssertRun, when they are ``count`` ASSERTs of
    one kind with field_data of one length and no metadata, filling the span exactly;
    else None (the sub-op by sub-op reader then decodes them, with its exact errors)."""
    if count == 0 or end - pos < _ASSERT_HEAD.size or buf[pos] != _OP_ASSERT:
        return None
    _, kind_id, _, fd_len = _ASSERT_HEAD.unpack_from(buf, pos)
    stride = _ASSERT_HEAD.size + fd_len + 2
    if count * stride != end - pos:
        return None
    run = buf[pos:end]
    # Every sub-op's fixed bytes, one column at a time (C speed): op_type, kind_id,
    # fd_len and meta_len must equal the first sub-op's.
    kind = _U16.pack(kind_id)
    length = _U32.pack(fd_len)
    for offset, expected in (
        (0, _OP_ASSERT),
        (1, kind[0]),
        (2, kind[1]),
        (3 + ENTITY_ID_SIZE, length[0]),
        (4 + ENTITY_ID_SIZE, length[1]),
        (5 + ENTITY_ID_SIZE, length[2]),
        (6 + ENTITY_ID_SIZE, length[3]),
        (stride - 2, 0),
        (stride - 1, 0),
    ):
        if run[offset::stride] != bytes((expected,)) * count:
            return None
    return AssertRun(kind_id, list(_assert_run_layout(fd_len).iter_unpack(run)))


@dataclass(frozen=True, slots=True)
class Batch(_Message):
    """BATCH: u16 op_count, then op_count sub-ops, each ``u8 op_type`` (0x02 ASSERT,
    0x03 RETRACT, 0x08 PATCH) followed by that single op's payload layout.

    Decoded, ``ops`` is an :class:`AssertRun` when every sub-op is an ASSERT of one kind
    with field_data of one length and no metadata, else a tuple."""

    opcode: ClassVar[Opcode] = Opcode.BATCH
    ops: Sequence[WriteOp] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.ops, AssertRun):
            object.__setattr__(self, "ops", tuple(self.ops))

    def _write(self, out: list[Buffer]) -> None:
        if len(self.ops) > _MAX16:
            raise UsageError(f"{len(self.ops)} sub-ops; a BATCH holds at most {_MAX16}")
        out.append(_U16.pack(len(self.ops)))
        for op in self.ops:
            if type(op) not in _SUB_OP_TYPES:
                raise UsageError(f"{type(op).__name__} cannot be a BATCH sub-op")
            out.append(_U8.pack(op.opcode))
            op._write(out)

    @classmethod
    def _read(cls, r: BoundedReader) -> Self:
        count = r.u16("op_count")
        smallest = 1 + Retract.MIN_SIZE
        if count > r.remaining // smallest:
            raise DecodeError(f"{count} sub-ops cannot fit in the {r.remaining} bytes left")
        run = _read_assert_run(r.buf, r.pos, r.end, count)
        if run is not None:
            r.pos = r.end
            return cls(run)
        ops: list[WriteOp] = []
        append = ops.append
        buf, end = r.buf, r.end
        assert_head, u16_from = _ASSERT_HEAD.unpack_from, _U16.unpack_from
        for i in range(count):
            pos = r.pos
            # ASSERTs are the bulk of any BATCH: one unpack for the fixed head, slices
            # for the rest. Anything short or unusual takes the checked path below,
            # which gives the exact error.
            if end - pos >= _ASSERT_HEAD.size and buf[pos] == _OP_ASSERT:
                _, kind_id, entity_id, fd_len = assert_head(buf, pos)
                data_at = pos + _ASSERT_HEAD.size
                meta_at = data_at + fd_len
                if meta_at + 2 <= end:
                    meta_len = u16_from(buf, meta_at)[0]
                    meta_end = meta_at + 2 + meta_len
                    if meta_end <= end:
                        field_data = bytes(buf[data_at:meta_at])
                        metadata = bytes(buf[meta_at + 2 : meta_end]) if meta_len else b""
                        append(Assert(kind_id, entity_id, field_data, metadata))
                        r.pos = meta_end
                        continue
            op_type = r.u8("op_type")
            sub = _SUB_OPS.get(op_type)
            if sub is None:
                raise DecodeError(f"sub-op {i}: op_type {op_type:#04x} is not 0x02, 0x03 or 0x08")
            append(sub._read(r))
        return cls(ops)


_SUB_OP_TYPES = frozenset(_SUB_OPS.values())
_OP_ASSERT = int(Opcode.ASSERT)
# op_type, kind_id, entity_id, fd_len: the fixed head of an ASSERT sub-op
_ASSERT_HEAD = struct.Struct(f"<BH{ENTITY_ID_SIZE}sI")


def _write_kind(
    out: list[Buffer], name: str, event_stream: bool, fields: Sequence[FieldSpec]
) -> None:
    if len(fields) > MAX_FIELDS:
        raise UsageError(f"a kind has at most {MAX_FIELDS} fields, not {len(fields)}")
    _put_str16(out, name, "name")
    out.append(struct.pack("<BB", 1 if event_stream else 0, len(fields)))
    for spec in fields:
        _put_str16(out, spec.name, "field name")
        out.append(_U8.pack(spec.type))


def _read_kind(r: BoundedReader) -> tuple[str, bool, list[FieldSpec]]:
    name = _read_str16(r, "name")
    flags = _read_flags(r, 0x01, "kind flags")
    count = r.u8("field_count")
    if count > MAX_FIELDS:
        raise LimitExceededError(f"{count} fields; a kind has at most {MAX_FIELDS}")
    fields = []
    for i in range(count):
        field_name = _read_str16(r, f"field {i} name")
        code = r.u8(f"field {i} type")
        try:
            field_type = FieldType(code)
        except ValueError:
            raise DecodeError(f"field {i} ({field_name!r}): unknown type code {code}") from None
        fields.append(FieldSpec(field_name, field_type))
    return name, bool(flags & 1), fields


def _normal_fields(fields: Sequence[tuple[str, int]]) -> tuple[FieldSpec, ...]:
    try:
        return tuple(FieldSpec(name, FieldType(code)) for name, code in fields)
    except ValueError as exc:
        raise UsageError(f"bad field list: {exc}") from None


@dataclass(frozen=True, slots=True)
class _KindDefinition(_Message):
    """A kind's name, fields and event_stream flag: CREATE_KIND's payload and GET_KIND's."""

    name: str
    fields: Sequence[FieldSpec] = ()
    event_stream: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", _normal_fields(self.fields))

    def _write(self, out: list[Buffer]) -> None:
        _write_kind(out, self.name, self.event_stream, self.fields)

    @classmethod
    def _read(cls, r: BoundedReader) -> Self:
        name, event_stream, fields = _read_kind(r)
        return cls(name, fields, event_stream)


@dataclass(frozen=True, slots=True)
class CreateKind(_KindDefinition):
    """CREATE_KIND: str16 name, u8 flags (bit0 event_stream), u8 field_count, then per
    field str16 name + u8 type. Answered by KindAck."""

    opcode: ClassVar[Opcode] = Opcode.CREATE_KIND


@dataclass(frozen=True, slots=True)
class GetKind(_KindDefinition):
    """GET_KIND: CREATE_KIND's layout. No fields: resolve by name; otherwise the fields
    must be a prefix of the kind's schema (else SCHEMA_INCOMPATIBLE). Answered by KindAck."""

    opcode: ClassVar[Opcode] = Opcode.GET_KIND


# --- server -> client ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class State(_Message):
    """STATE: u16 kind_id, entity_id, u8 change, u64 version, u64 source_set,
    u64 changed_fields, u32 fd_len + field_data (every field), [u32 prev_len + previous
    field_data: only for change UPDATED on an include_previous subscription],
    u16 meta_len + metadata.

    The optional previous section is recognised from the bytes alone (see the decoder),
    so decoding needs no subscription context.
    """

    opcode: ClassVar[Opcode] = Opcode.STATE
    kind_id: int
    entity_id: bytes
    change: Change
    version: int
    source_set: int
    changed_fields: int
    field_data: bytes = b""
    previous: bytes | None = None
    """The previous field_data (UPDATED under include_previous), else None."""
    metadata: bytes = b""

    def fields(self, schema: SchemaLike) -> list[FieldValue]:
        return decode_record(schema, self.field_data)

    def previous_fields(self, schema: SchemaLike) -> list[FieldValue] | None:
        return None if self.previous is None else decode_record(schema, self.previous)

    def _write(self, out: list[Buffer]) -> None:
        change = Change(self.change)
        out.append(_U16.pack(self.kind_id))
        _put_entity(out, self.entity_id)
        out.append(struct.pack("<BQQQ", change, self.version, self.source_set, self.changed_fields))
        _put_blob32(out, self.field_data, "field_data")
        if self.previous is not None:
            if change is not Change.UPDATED:
                raise UsageError(f"a {change.name} STATE carries no previous field_data")
            _put_blob32(out, self.previous, "previous field_data")
        _put_blob16(out, self.metadata, "metadata")

    @classmethod
    def _read(cls, r: BoundedReader) -> Self:
        kind_id, entity_id = r.u16("kind_id"), _read_entity(r)
        code = r.u8("change")
        try:
            change = Change(code)
        except ValueError:
            raise DecodeError(f"unknown STATE change {code}") from None
        version, source_set = r.u64("version"), r.u64("source_set")
        changed = r.u64("changed_fields")
        field_data = _read_blob32(r, "field_data")
        previous = None
        if change is Change.UPDATED:
            # Either "u16 meta_len + metadata" ends the payload exactly, or a previous
            # section comes first. Both cannot fit: with a previous section the u16 read
            # here is the low half of prev_len P, and 2 + (P mod 2^16) < 6 + P + meta_len.
            meta_len = r.peek_u16()
            if meta_len is None or r.remaining != 2 + meta_len:
                previous = _read_blob32(r, "previous field_data")
        metadata = _read_blob16(r, "metadata")
        return cls(
            kind_id, entity_id, change, version, source_set, changed, field_data, previous, metadata
        )


_STATE_HEAD = struct.Struct("<H32sBQQQI")  # kind_id .. changed_fields, fd_len
_CHANGES = frozenset(int(c) for c in Change)


def _state_change(code: int) -> Change:
    try:
        return Change(code)
    except ValueError:
        raise UsageError(f"unknown STATE change {code!r}") from None


@lru_cache(maxsize=256)
def state_payload_layout(fd_len: int) -> struct.Struct:
    """A whole STATE payload with ``fd_len`` bytes of field_data, no previous record and
    no metadata: kind_id, entity_id, change, version, source_set, changed_fields, fd_len,
    field_data, meta_len (0). One ``pack`` per notification."""
    return struct.Struct(_STATE_HEAD.format + f"{fd_len}sH")


def encode_state_payload(
    kind_id: int,
    entity_id: bytes,
    change: int,
    version: int,
    source_set: int,
    changed_fields: int,
    field_data: bytes,
    previous: bytes | None = None,
    metadata: bytes = b"",
) -> bytes:
    """``State(...).encode()`` without building the message: one precompiled struct for
    the fixed part (the notification hot path: every change of every window). Values the
    wire cannot carry go through :class:`State`, which raises its UsageError."""
    if (
        len(entity_id) == ENTITY_ID_SIZE
        and change in _CHANGES
        and len(field_data) <= _MAX32
        and len(metadata) <= _MAX16
        and (previous is None or (change == Change.UPDATED and len(previous) <= _MAX32))
    ):
        try:
            head = _STATE_HEAD.pack(
                kind_id, entity_id, change, version, source_set, changed_fields, len(field_data)
            )
        except struct.error:
            pass  # out of range: State says which value
        else:
            if previous is None:
                return b"".join((head, field_data, _U16.pack(len(metadata)), metadata))
            prev_len, meta_len = _U32.pack(len(previous)), _U16.pack(len(metadata))
            return b"".join((head, field_data, prev_len, previous, meta_len, metadata))
    checked = State(
        kind_id,
        entity_id,
        _state_change(change),
        version,
        source_set,
        changed_fields,
        field_data,
        previous,
        metadata,
    )
    return checked.encode()


@dataclass(frozen=True, slots=True)
class Deleted(_Message):
    """DELETED: u16 kind_id, entity_id, u64 version, u16 meta_len + metadata."""

    opcode: ClassVar[Opcode] = Opcode.DELETED
    kind_id: U16
    entity_id: Entity
    version: U64
    metadata: Blob16 = b""


@dataclass(frozen=True, slots=True)
class BootstrapBegin(_KindOnly):
    """BOOTSTRAP_BEGIN: u16 kind_id."""

    opcode: ClassVar[Opcode] = Opcode.BOOTSTRAP_BEGIN


@dataclass(frozen=True, slots=True)
class BootstrapEnd(_KindOnly):
    """BOOTSTRAP_END: u16 kind_id."""

    opcode: ClassVar[Opcode] = Opcode.BOOTSTRAP_END


_BODY_ACKS = frozenset(
    {Opcode.CONNECT, Opcode.CREATE_KIND, Opcode.GET_KIND, Opcode.SOURCE_EPOCH_END}
)
_PLAIN_ACKS = CLIENT_OPCODES - _BODY_ACKS


_ACK_OF_CONNECT = _acked({Opcode.CONNECT})
_ACK_OF_EPOCH_END = _acked({Opcode.SOURCE_EPOCH_END})


@dataclass(frozen=True, slots=True)
class Ack(_Message):
    """ACK with an empty body: u16 acked_opcode (any request but CONNECT, CREATE_KIND,
    GET_KIND and SOURCE_EPOCH_END, whose ACKs have their own classes)."""

    opcode: ClassVar[Opcode] = Opcode.ACK
    acked_opcode: Annotated[
        Opcode, _acked(_PLAIN_ACKS, "an ACK of {value!r} carries a body: use its class")
    ]


@dataclass(frozen=True, slots=True)
class ConnectAck(_Message):
    """ACK of CONNECT: u16 0x0001, u8 source_id (0xFF for a read-only connection)."""

    opcode: ClassVar[Opcode] = Opcode.ACK
    acked_opcode: ClassVar[Opcode] = Opcode.CONNECT
    source_id: int

    @property
    def read_only(self) -> bool:
        return self.source_id == NO_SOURCE

    def _write(self, out: list[Buffer]) -> None:
        if not (0 <= self.source_id <= MAX_SOURCE_ID or self.source_id == NO_SOURCE):
            raise UsageError(f"source_id {self.source_id} is neither 0..63 nor 0xFF")
        out.append(struct.pack("<HB", Opcode.CONNECT, self.source_id))

    @classmethod
    def _read(cls, r: BoundedReader) -> Self:
        _ACK_OF_CONNECT.read(r, "acked_opcode")
        source = r.u8("source_id")
        if source > MAX_SOURCE_ID and source != NO_SOURCE:
            raise DecodeError(f"source_id {source} is neither 0..63 nor 0xFF")
        return cls(source)


@dataclass(frozen=True, slots=True)
class KindAck(_Message):
    """ACK of CREATE_KIND / GET_KIND: u16 acked_opcode, u16 kind_id, u16 schema_version,
    u8 field_count."""

    opcode: ClassVar[Opcode] = Opcode.ACK
    acked_opcode: Annotated[
        Opcode,
        _acked(
            {Opcode.CREATE_KIND, Opcode.GET_KIND},
            "a KindAck acknowledges CREATE_KIND or GET_KIND, not {value!r}",
        ),
    ]
    kind_id: U16
    schema_version: U16
    field_count: U8


@dataclass(frozen=True, slots=True)
class EpochEndAck(_Message):
    """ACK of SOURCE_EPOCH_END: u16 0x000A, u32 retracted_count."""

    opcode: ClassVar[Opcode] = Opcode.ACK
    acked_opcode: ClassVar[Opcode] = Opcode.SOURCE_EPOCH_END
    retracted_count: int

    def _write(self, out: list[Buffer]) -> None:
        out.append(struct.pack("<HI", Opcode.SOURCE_EPOCH_END, self.retracted_count))

    @classmethod
    def _read(cls, r: BoundedReader) -> Self:
        _ACK_OF_EPOCH_END.read(r, "acked_opcode")
        return cls(r.u32("retracted_count"))


AnyAck: TypeAlias = Ack | ConnectAck | KindAck | EpochEndAck


@dataclass(frozen=True, slots=True)
class ErrorMessage(_Message):
    """ERROR: u16 code, u16 ref_opcode, str16 message.

    ``code`` and ``ref_opcode`` decode to :class:`ErrorCode` / :class:`Opcode` when known
    and stay plain ints otherwise (a BAD_FRAME may name an opcode that does not exist).
    """

    opcode: ClassVar[Opcode] = Opcode.ERROR
    code: Annotated[int, Fixed("H", load=lenient(ErrorCode))]
    ref_opcode: Annotated[int, Fixed("H", load=lenient(Opcode))]
    message: Str16 = ""


_EVENT_OPS = frozenset({Opcode.ASSERT, Opcode.RETRACT, Opcode.PATCH})


@dataclass(frozen=True, slots=True)
class Event(_Message):
    """EVENT: u16 kind_id, entity_id, u8 op (0x02, 0x03, 0x08), u8 source_id,
    u64 sequence, u64 presence_mask, u32 fd_len + field_data (the fields named by
    presence_mask), u16 meta_len + metadata."""

    opcode: ClassVar[Opcode] = Opcode.EVENT
    kind_id: U16
    entity_id: Entity
    op: Annotated[
        Opcode,
        _checked(
            "B",
            _EVENT_OPS,
            "EVENT op {value:#04x} is not 0x02, 0x03 or 0x08",
            "an EVENT's op is ASSERT, RETRACT or PATCH, not {value!r}",
            Opcode,
        ),
    ]
    source_id: Annotated[int, _SOURCE]
    sequence: U64
    presence_mask: U64 = 0
    field_data: Blob32 = b""
    metadata: Blob16 = b""

    def fields(self, schema: SchemaLike) -> dict[int, FieldValue]:
        return decode_present_fields(schema, self.presence_mask, self.field_data)


# --- dispatch --------------------------------------------------------------------------

ClientMessage: TypeAlias = (
    Connect
    | Assert
    | Retract
    | Patch
    | Query
    | Subscribe
    | Unsubscribe
    | Heartbeat
    | SourceEpochBegin
    | SourceEpochEnd
    | Batch
    | CreateKind
    | GetKind
)
ServerMessage: TypeAlias = (
    State
    | Deleted
    | BootstrapBegin
    | BootstrapEnd
    | Ack
    | ConnectAck
    | KindAck
    | EpochEndAck
    | ErrorMessage
    | Event
)
Message: TypeAlias = ClientMessage | ServerMessage

MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.opcode: cls for cls in get_args(Message) if cls.opcode != Opcode.ACK
}
"""Message class per opcode, except ACK (four classes, chosen by acked_opcode)."""

ACK_TYPES: dict[int, type[AnyAck]] = {
    Opcode.CONNECT: ConnectAck,
    Opcode.CREATE_KIND: KindAck,
    Opcode.GET_KIND: KindAck,
    Opcode.SOURCE_EPOCH_END: EpochEndAck,
}
"""ACK classes with a body, by acked_opcode (every other acked opcode: :class:`Ack`)."""


def decode_message(opcode: int, payload: Buffer) -> Message:
    """Decode a payload given its frame's opcode; raises DecodeError."""
    if opcode == Opcode.ACK:
        acked = _reader(payload).peek_u16()
        ack_cls: type[AnyAck] = Ack
        if acked is not None:
            ack_cls = ACK_TYPES.get(acked, Ack)
        return ack_cls.decode(payload)
    cls = MESSAGE_TYPES.get(opcode)
    if cls is None:
        raise DecodeError(f"unknown opcode {opcode:#06x}")
    return cls.decode(payload)


def encode_message(message: Message) -> bytes:
    """The message's payload (same as ``message.encode()``)."""
    return message.encode()


@dataclass(frozen=True, slots=True)
class Frame:
    """A message and the stream_id of the frame carrying it."""

    stream_id: int
    message: Message

    def encode(self) -> bytes:
        """The whole frame: header (with CRC) and payload."""
        _check_u16(self.stream_id, "stream_id")
        return encode_frame(self.stream_id, self.message.opcode, self.message.encode())

    @classmethod
    def decode(cls, raw: RawFrame) -> Frame:
        """Decode a raw frame's payload; raises DecodeError (non-zero header flags
        included: no flag is defined yet)."""
        if raw.flags:
            raise DecodeError(f"header flags {raw.flags:#04x} are reserved and must be 0")
        return cls(raw.stream_id, decode_message(raw.opcode, raw.payload))


def encode(stream_id: int, message: Message) -> bytes:
    """Shorthand for ``Frame(stream_id, message).encode()``."""
    return Frame(stream_id, message).encode()
