"""Ripple messages (spec/PROTOCOLS.md §4) and their bin_prot codecs.

Each OCaml type of the contract is a frozen dataclass here; its wire form is declared
once with the :mod:`.bin_prot` combinators, fields in the contract's order::

    handshake          = {source_worker_id: string; output_schemas: (string * schema) list;
                          protocol_version: int}
    schema             = {name: string; version: int; fields: field list; doc: string option}
    field              = {field_name: string; field_type: field_type}
    field_type         = String | Int | Int64 | Float | Bool                    (tags 0..4)
    schema_negotiation = {ok: bool; errors: string list}
    delta_msg          = {source_output: string; key: string; delta_bytes: string;
                          sequence_no: int; watermark_ns: int64 option}
    delta              = Set of record | Patch of patch list | Remove           (tags 0..2)
    patch              = Field_set of {field_name: string; value: sexp}
                       | Field_remove of {field_name: string}
                       | Map_set of {key: string; value: sexp}
                       | Map_remove of {key: string}                          (tags 0..3)
    sexp               = Atom of string | List of sexp list                     (tags 0..1)
    heartbeat          = {worker_id: string; timestamp_ns: int64; load: float}
    checkpoint_request = {checkpoint_id: string; epoch: int}
    checkpoint_ack     = {checkpoint_id: string; worker_id: string; epoch: int;
                          last_sequence_no: int}

headwater's one extension (docs/protocols/ripple.md, "Handshake auth extension"): a
Handshake envelope with flag bit 0 set (:data:`FLAG_HANDSHAKE_AUTH`) carries, right after
the handshake record, ``handshake_auth = {token: string option; tenant: int option}``
(:class:`HandshakeAuth`, as ``Handshake.auth``). Without the flag the payload is exactly
the contract's handshake record; every other flag, and any flag on another message, is
still refused.

Strings are UTF-8 text in Python (a non-UTF-8 string is a decode error) except the two
that carry opaque bytes: ``delta_msg.key`` and ``delta_msg.delta_bytes`` are ``bytes``.

A ``record`` (the argument of ``Set``) has no fixed type: it is the output schema's fields
in order, each encoded by its field type (String -> string, Int -> int, Int64 -> int64,
Float -> float, Bool -> bool). Hence :func:`encode_record` / :func:`decode_record` and
:func:`encode_delta` / :func:`decode_delta` take the schema. ``delta_msg.delta_bytes`` is
the bin_prot of a ``delta`` under the schema the envelope's fingerprint names.

A ``Field_set`` value is an atom holding the field's text form (:func:`text_of_value`:
``"150.5"``, ``"42"``, ``"true"``); :func:`value_of_sexp` parses it back for a field type.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from enum import IntEnum
from functools import lru_cache
from typing import Any, TypeAlias, cast

from headwater.errors import UsageError

from . import bin_prot as bp
from .bin_prot import Buffer, Codec, DecodeError, Reader, Writer
from .envelope import (
    ZERO_FINGERPRINT,
    Envelope,
    MessageType,
    encode_envelope,
    fingerprint,
)

PROTOCOL_VERSION = 1
"""The ``protocol_version`` a Handshake must carry (the envelope's version byte too)."""
MAX_SEXP_DEPTH = bp.MAX_DEPTH
"""Deepest sexp nesting accepted (and encoded): a decoder bound, not a contract rule."""
MAX_SCHEMA_FIELDS = 1024
"""Most fields a schema may declare on the wire (a decoder bound: an entity kind holds at
most 64, so no accepted schema comes near it)."""
MAX_OUTPUTS = 1024
"""Most outputs one Handshake may declare (a decoder bound)."""


class UnknownMessageTypeError(DecodeError):
    """An intact envelope whose type byte is not a :class:`MessageType`."""


class UnsupportedFlagsError(DecodeError):
    """An intact envelope with flag bits set that it may not carry (all are reserved but
    :data:`FLAG_HANDSHAKE_AUTH` on a Handshake; a flag could change how the payload must
    be read, so it is refused rather than ignored)."""


FLAG_HANDSHAKE_AUTH = 0x01
"""Envelope flag of a Handshake whose payload is followed by a ``handshake_auth`` record."""


# --- schemas -------------------------------------------------------------------------


class FieldType(IntEnum):
    STRING = 0
    INT = 1
    INT64 = 2
    FLOAT = 3
    BOOL = 4


@dataclass(frozen=True, slots=True)
class Field:
    field_name: str
    field_type: FieldType


@dataclass(frozen=True, slots=True)
class Schema:
    name: str
    version: int
    fields: tuple[Field, ...]
    doc: str | None = None
    _index: dict[str, Field] = dataclass_field(
        init=False, repr=False, compare=False, hash=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        index: dict[str, Field] = {}
        for declared in self.fields:
            index.setdefault(declared.field_name, declared)  # the first declaration wins
        object.__setattr__(self, "_index", index)

    @property
    def fingerprint(self) -> bytes:
        """``"<name>/v<version>"`` zero-padded to 32 bytes (UsageError when too long)."""
        return fingerprint(self.name, self.version)

    def field(self, name: str) -> Field | None:
        """The field called ``name`` (the first one, should it be declared twice)."""
        return self._index.get(name)

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.field_name for f in self.fields)


def schema_problems(schema: Schema) -> list[str]:
    """Why ``schema`` cannot be used on the wire (empty when it can)."""
    problems = []
    try:
        fingerprint(schema.name, schema.version)
    except UsageError as exc:
        problems.append(f"schema {schema.name!r}: {exc}")
    names = Counter(f.field_name for f in schema.fields)
    for name in sorted(n for n, count in names.items() if count > 1):
        problems.append(f"schema {schema.name!r}: field {name!r} is declared twice")
    if "" in names:
        problems.append(f"schema {schema.name!r}: a field has an empty name")
    return problems


def check_backward(reader: Schema, writer: Schema) -> list[str]:
    """Can data written with ``writer`` be read as ``reader``? Empty list: yes.

    The accepted change is appending fields: ``writer`` must start with every field of
    ``reader``, same names, types and order, and may add more after them.
    """
    errors = []
    if reader.name != writer.name:
        errors.append(f"schema name {writer.name!r} is not {reader.name!r}")
    for i, expected in enumerate(reader.fields):
        if i >= len(writer.fields):
            errors.append(f"missing field {expected.field_name}")
            continue
        got = writer.fields[i]
        if got.field_name != expected.field_name:
            errors.append(f"field {i} is {got.field_name!r}, expected {expected.field_name!r}")
        elif got.field_type != expected.field_type:
            errors.append(
                f"field {got.field_name} changed type from {expected.field_type.name}"
                f" to {got.field_type.name}"
            )
    return errors


# --- sexp and patches ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Atom:
    text: str


@dataclass(frozen=True, slots=True)
class SexpList:
    items: tuple[Sexp, ...] = ()


Sexp: TypeAlias = Atom | SexpList


@dataclass(frozen=True, slots=True)
class FieldSet:
    field_name: str
    value: Sexp


@dataclass(frozen=True, slots=True)
class FieldRemove:
    field_name: str


@dataclass(frozen=True, slots=True)
class MapSet:
    key: str
    value: Sexp


@dataclass(frozen=True, slots=True)
class MapRemove:
    key: str


PatchOp: TypeAlias = FieldSet | FieldRemove | MapSet | MapRemove

FieldValue: TypeAlias = str | int | float | bool
"""A record field's value: String -> str, Int/Int64 -> int, Float -> float, Bool -> bool."""
Value: TypeAlias = FieldValue | Sexp
"""A state entry in the delta algebra: a typed field value, or a sexp kept as sent."""


@dataclass(frozen=True, slots=True)
class Set:
    """Replace the whole state with ``values`` (on the wire: the schema's record)."""

    values: Mapping[str, Value]


@dataclass(frozen=True, slots=True)
class Patch:
    """Apply ``ops`` in order to the state (creating it from ``{}`` when absent)."""

    ops: tuple[PatchOp, ...] = ()


@dataclass(frozen=True, slots=True)
class Remove:
    """The entity is gone."""


Delta: TypeAlias = Set | Patch | Remove


def _write_sexp(w: Writer, value: Sexp, depth: int = 0) -> None:
    if depth >= MAX_SEXP_DEPTH:
        raise UsageError(f"sexp nested deeper than {MAX_SEXP_DEPTH} levels")
    if type(value) is Atom:
        w.tag(0)
        w.string(value.text)
    elif type(value) is SexpList:
        w.tag(1)
        items = value.items
        w.nat0(len(items))
        for item in items:
            _write_sexp(w, item, depth + 1)
    else:
        raise UsageError(f"{type(value).__name__} is not a sexp")


def _read_sexp(r: Reader) -> Sexp:
    r.enter("sexp", MAX_SEXP_DEPTH)
    try:
        if r.tag("sexp", 2) == 0:
            return Atom(r.string("sexp atom"))
        return SexpList(tuple(_read_sexp(r) for _ in range(r.count("sexp list", 2))))
    finally:
        r.leave()


SEXP: Codec[Sexp] = Codec("sexp", _write_sexp, _read_sexp, 2)

PATCH_OP: Codec[PatchOp] = bp.variant(
    "patch",
    (FieldSet, bp.record(FieldSet, ("field_name", bp.STRING), ("value", SEXP))),
    (FieldRemove, bp.record(FieldRemove, ("field_name", bp.STRING))),
    (MapSet, bp.record(MapSet, ("key", bp.STRING), ("value", SEXP))),
    (MapRemove, bp.record(MapRemove, ("key", bp.STRING))),
)
PATCH_OPS: Codec[tuple[PatchOp, ...]] = bp.list_of(PATCH_OP)


# --- records -------------------------------------------------------------------------

_INT_TEXT = re.compile(r"[+-]?[0-9]+")
_FLOAT_TEXT = re.compile(
    r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|nan|inf|infinity)",
    re.IGNORECASE,
)
_MAX_NUMBER_TEXT = 400
"""Longest atom parsed as a number (bounds the work; 400 digits is far past any value)."""


def _int_range(field_type: FieldType) -> tuple[int, int]:
    if field_type is FieldType.INT:
        return bp.INT_MIN, bp.INT_MAX
    return bp.INT64_MIN, bp.INT64_MAX


def check_value(field_type: FieldType, value: object, what: str = "value") -> FieldValue:
    """``value`` if it is a valid value of ``field_type`` (UsageError otherwise)."""
    if field_type is FieldType.STRING:
        if isinstance(value, str):
            return value
    elif field_type is FieldType.BOOL:
        if isinstance(value, bool):
            return value
    elif field_type is FieldType.FLOAT:
        if isinstance(value, float | int) and not isinstance(value, bool):
            return float(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        low, high = _int_range(field_type)
        if low <= value <= high:
            return value
        raise UsageError(f"{what} {value} does not fit {field_type.name}")
    raise UsageError(f"{what} {value!r} is not a {field_type.name} value")


def text_of_value(field_type: FieldType, value: FieldValue) -> str:
    """The text form a Field_set atom carries: ``"150.5"``, ``"42"``, ``"true"``, text.

    Floats use Python's shortest round-tripping repr (``"1.0"``, ``"inf"``, ``"nan"``).
    """
    checked = check_value(field_type, value)
    if field_type is FieldType.BOOL:
        return "true" if checked else "false"
    if field_type is FieldType.FLOAT:
        return repr(float(checked))
    return str(checked)


def value_of_sexp(field_type: FieldType, value: Sexp, what: str = "Field_set value") -> FieldValue:
    """Parse a Field_set atom as ``field_type`` (DecodeError when it is not one).

    Accepted: Int/Int64 decimal digits with an optional sign, in range; Float any decimal
    or exponent form, ``nan``, ``inf``, ``infinity`` (signed, any case); Bool exactly
    ``true`` / ``false``; String any atom. A list is never a field value.
    """
    if not isinstance(value, Atom):
        raise DecodeError(f"{what}: a list is not a {field_type.name} value")
    text = value.text
    if field_type is FieldType.STRING:
        return text
    if field_type is FieldType.BOOL:
        if text in ("true", "false"):
            return text == "true"
    elif len(text) > _MAX_NUMBER_TEXT:
        pass
    elif field_type is FieldType.FLOAT:
        if _FLOAT_TEXT.fullmatch(text):
            return float(text)
    elif _INT_TEXT.fullmatch(text):
        number = int(text)
        low, high = _int_range(field_type)
        if low <= number <= high:
            return number
    raise DecodeError(f"{what}: {text[:40]!r} is not a {field_type.name} value")


_FIELD_CODECS: dict[FieldType, Codec[Any]] = {
    FieldType.STRING: bp.STRING,
    FieldType.INT: bp.INT,
    FieldType.INT64: bp.INT64,
    FieldType.FLOAT: bp.FLOAT,
    FieldType.BOOL: bp.BOOL,
}


@lru_cache(maxsize=256)
def record_codec(schema: Schema) -> Codec[Mapping[str, Value]]:
    """The bin_prot codec of ``schema``'s record: its fields in order.

    Encoding wants a mapping with exactly the schema's fields (UsageError otherwise);
    decoding gives a dict in field order.
    """
    names = schema.field_names
    parts = tuple((f.field_name, f.field_type, _FIELD_CODECS[f.field_type]) for f in schema.fields)
    label = f"{schema.name} record"

    def write(w: Writer, values: Mapping[str, Value]) -> None:
        if not isinstance(values, Mapping):
            raise UsageError(f"{label} must be a mapping, not {type(values).__name__}")
        if len(values) != len(names) or any(name not in values for name in names):
            missing = [n for n in names if n not in values]
            extra = [k for k in values if k not in names]
            raise UsageError(f"{label}: missing fields {missing}, unknown fields {extra}")
        for name, field_type, codec in parts:
            codec.write(w, check_value(field_type, values[name], f"{label}.{name}"))

    def read(r: Reader) -> Mapping[str, Value]:
        values: dict[str, Value] = {}
        for name, _, codec in parts:
            try:
                values[name] = codec.read(r)
            except DecodeError as exc:
                raise exc.within(f"{label}.{name}") from None
        return values

    return Codec(label, write, read, sum(c.min_size for _, _, c in parts))


def encode_record(schema: Schema, values: Mapping[str, FieldValue]) -> bytes:
    return record_codec(schema).encode(values)


def decode_record(schema: Schema, data: Buffer) -> dict[str, FieldValue]:
    return cast("dict[str, FieldValue]", record_codec(schema).decode(data))


@lru_cache(maxsize=256)
def delta_codec(schema: Schema) -> Codec[Delta]:
    """``Set of record | Patch of patch list | Remove`` for ``schema``'s record."""
    records = record_codec(schema)
    sets: Codec[Set] = bp.mapped(records, Set, lambda s: s.values, "Set")
    patches: Codec[Patch] = bp.mapped(PATCH_OPS, Patch, lambda p: p.ops, "Patch")
    codec: Codec[Delta] = bp.variant("delta", (Set, sets), (Patch, patches), (Remove, None))
    return codec


def encode_delta(schema: Schema, delta: Delta) -> bytes:
    return delta_codec(schema).encode(delta)


def decode_delta(schema: Schema, data: Buffer) -> Delta:
    return delta_codec(schema).decode(data)


# --- messages ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HandshakeAuth:
    """headwater's Handshake extension: the worker's credential and the tenant it writes
    to (None: the lowest tenant the credential grants, as ConvergeDB's CONNECT). The
    token is left out of the repr, so a logged Handshake never shows it."""

    token: str | None = dataclass_field(default=None, repr=False)
    tenant: int | None = None


@dataclass(frozen=True, slots=True)
class Handshake:
    source_worker_id: str
    output_schemas: tuple[tuple[str, Schema], ...]
    protocol_version: int = PROTOCOL_VERSION
    # Not part of the contract's record: sent after it, under FLAG_HANDSHAKE_AUTH.
    auth: HandshakeAuth | None = None


@dataclass(frozen=True, slots=True)
class SchemaNegotiation:
    ok: bool
    errors: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DeltaMsg:
    source_output: str
    key: bytes
    delta_bytes: bytes
    sequence_no: int
    watermark_ns: int | None = None

    def delta(self, schema: Schema) -> Delta:
        """``delta_bytes`` decoded under ``schema`` (DecodeError when they do not fit)."""
        return decode_delta(schema, self.delta_bytes)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    worker_id: str
    timestamp_ns: int
    load: float


@dataclass(frozen=True, slots=True)
class CheckpointRequest:
    checkpoint_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class CheckpointAck:
    checkpoint_id: str
    worker_id: str
    epoch: int
    last_sequence_no: int


Message: TypeAlias = (
    Handshake | DeltaMsg | CheckpointRequest | CheckpointAck | Heartbeat | SchemaNegotiation
)

FIELD_TYPE: Codec[FieldType] = bp.enumeration(FieldType, "field_type")
FIELD: Codec[Field] = bp.record(Field, ("field_name", bp.STRING), ("field_type", FIELD_TYPE))
SCHEMA: Codec[Schema] = bp.record(
    Schema,
    ("name", bp.STRING),
    ("version", bp.INT),
    ("fields", bp.list_of(FIELD, MAX_SCHEMA_FIELDS)),
    ("doc", bp.option(bp.STRING)),
)


def _handshake(
    source_worker_id: str, output_schemas: tuple[tuple[str, Schema], ...], protocol_version: int
) -> Handshake:
    return Handshake(source_worker_id, output_schemas, protocol_version)


# The contract's record: Handshake's fields but ``auth``, which travels after it under
# FLAG_HANDSHAKE_AUTH (hence a constructor instead of the class, whose init has ``auth``).
HANDSHAKE: Codec[Handshake] = bp.record(
    _handshake,
    ("source_worker_id", bp.STRING),
    ("output_schemas", bp.list_of(bp.pair(bp.STRING, SCHEMA), MAX_OUTPUTS)),
    ("protocol_version", bp.INT),
    name="Handshake",
)
HANDSHAKE_AUTH: Codec[HandshakeAuth] = bp.record(
    HandshakeAuth, ("token", bp.option(bp.STRING)), ("tenant", bp.option(bp.INT))
)
SCHEMA_NEGOTIATION: Codec[SchemaNegotiation] = bp.record(
    SchemaNegotiation, ("ok", bp.BOOL), ("errors", bp.list_of(bp.STRING))
)
DELTA_MSG: Codec[DeltaMsg] = bp.record(
    DeltaMsg,
    ("source_output", bp.STRING),
    ("key", bp.BYTES),
    ("delta_bytes", bp.BYTES),
    ("sequence_no", bp.INT),
    ("watermark_ns", bp.option(bp.INT64)),
)
HEARTBEAT: Codec[Heartbeat] = bp.record(
    Heartbeat, ("worker_id", bp.STRING), ("timestamp_ns", bp.INT64), ("load", bp.FLOAT)
)
CHECKPOINT_REQUEST: Codec[CheckpointRequest] = bp.record(
    CheckpointRequest, ("checkpoint_id", bp.STRING), ("epoch", bp.INT)
)
CHECKPOINT_ACK: Codec[CheckpointAck] = bp.record(
    CheckpointAck,
    ("checkpoint_id", bp.STRING),
    ("worker_id", bp.STRING),
    ("epoch", bp.INT),
    ("last_sequence_no", bp.INT),
)

MESSAGE_CODECS: dict[MessageType, Codec[Any]] = {
    MessageType.HANDSHAKE: HANDSHAKE,
    MessageType.DELTA: DELTA_MSG,
    MessageType.CHECKPOINT_REQUEST: CHECKPOINT_REQUEST,
    MessageType.CHECKPOINT_ACK: CHECKPOINT_ACK,
    MessageType.HEARTBEAT: HEARTBEAT,
    MessageType.SCHEMA_NEGOTIATION: SCHEMA_NEGOTIATION,
}
MESSAGE_TYPES: dict[type[Any], MessageType] = {
    Handshake: MessageType.HANDSHAKE,
    DeltaMsg: MessageType.DELTA,
    CheckpointRequest: MessageType.CHECKPOINT_REQUEST,
    CheckpointAck: MessageType.CHECKPOINT_ACK,
    Heartbeat: MessageType.HEARTBEAT,
    SchemaNegotiation: MessageType.SCHEMA_NEGOTIATION,
}


def message_type_of(message: Message) -> MessageType:
    try:
        return MESSAGE_TYPES[type(message)]
    except KeyError:
        raise UsageError(f"{type(message).__name__} is not a Ripple message") from None


def flags_of(message: Message) -> int:
    """The envelope flags ``message`` travels with: FLAG_HANDSHAKE_AUTH for a Handshake
    carrying ``auth``, else 0."""
    return FLAG_HANDSHAKE_AUTH if isinstance(message, Handshake) and message.auth is not None else 0


def encode_payload(message: Message) -> bytes:
    """The bin_prot payload of ``message`` (no envelope); a Handshake's ``auth`` follows
    its record (and needs :func:`flags_of` in the envelope)."""
    codec = MESSAGE_CODECS[message_type_of(message)]
    if not (isinstance(message, Handshake) and message.auth is not None):
        return codec.encode(message)
    w = Writer()
    codec.write(w, message)
    HANDSHAKE_AUTH.write(w, message.auth)
    return w.getvalue()


def decode_payload(message_type: int, payload: Buffer, flags: int = 0) -> Message:
    """The message of type ``message_type`` filling ``payload`` (DecodeError otherwise);
    ``flags`` from its envelope (UnsupportedFlagsError for any it may not carry)."""
    try:
        kind = MessageType(message_type)
    except ValueError:
        raise UnknownMessageTypeError(f"unknown message type {message_type}") from None
    if not flags:
        message: Message = MESSAGE_CODECS[kind].decode(payload)
        return message
    if kind is not MessageType.HANDSHAKE or flags != FLAG_HANDSHAKE_AUTH:
        raise UnsupportedFlagsError(f"reserved flags {flags:#04x} are set on a {kind.name}")
    r = Reader(payload)
    handshake = HANDSHAKE.read(r)
    auth = HANDSHAKE_AUTH.read(r)
    r.finish("handshake_auth")
    return Handshake(
        handshake.source_worker_id, handshake.output_schemas, handshake.protocol_version, auth
    )


def encode_message(
    message: Message,
    *,
    sequence: int,
    timestamp_ns: int = 0,
    fingerprint: bytes | None = None,
) -> bytes:
    """``message`` in a complete envelope.

    A DeltaMsg needs the ``fingerprint`` of its output's schema (UsageError without one);
    every other message carries zeros and refuses anything else.
    """
    kind = message_type_of(message)
    if kind is MessageType.DELTA:
        if fingerprint is None or fingerprint == ZERO_FINGERPRINT:
            raise UsageError("a Delta envelope needs its output schema's fingerprint")
    elif fingerprint not in (None, ZERO_FINGERPRINT):
        raise UsageError(f"a {kind.name} envelope carries a zero fingerprint")
    return encode_envelope(
        kind,
        encode_payload(message),
        sequence=sequence,
        timestamp_ns=timestamp_ns,
        fingerprint=fingerprint or ZERO_FINGERPRINT,
        flags=flags_of(message),
    )


def decode_message(envelope: Envelope) -> Message:
    """The message an intact envelope carries.

    DecodeError subclasses: :class:`UnsupportedFlagsError` (flags byte not 0, but for
    FLAG_HANDSHAKE_AUTH on a Handshake),
    :class:`UnknownMessageTypeError`, or a plain :class:`DecodeError` when the payload is
    not exactly one value of the type's bin_prot form. The fingerprint is not looked at
    (the connection compares a Delta's before calling this).
    """
    return decode_payload(envelope.message_type, envelope.payload, envelope.flags)
