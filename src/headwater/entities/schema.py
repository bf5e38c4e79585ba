"""Kinds declared as dataclasses: field types, entity keys and values.

A dataclass's fields, in declaration order, are the kind's fields (ConvergeDB type codes,
spec/PROTOCOLS.md §2):

============================  ===========  ======================================
annotation                    field type   Python value
============================  ===========  ======================================
``bool``                      bool         bool
``int``                       i64          int
``float``                     f64          float
``str``                       string       str (at most 65,535 UTF-8 bytes)
``bytes``                     bytes        bytes (at most 65,535)
``datetime.datetime``         timestamp    aware datetime (naive ones are UTC)
``U8 U16 U32 U64``            u8..u64      int
``I8 I16 I32 I64``            i8..i64      int
``F32``                       f32          float
``Timestamp``                 timestamp    int, nanoseconds since the Unix epoch
``Annotated[T, FieldType.X]``  X           as T
============================  ===========  ======================================

ConvergeDB has no nulls: a field the writer leaves out takes its zero value (False, 0,
0.0, "", b"", the Unix epoch), so ``Optional[...]`` and ``X | None`` are refused.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Generic, TypeAlias, TypeVar

from headwater.entity_keys import KeyLike as KeyLike
from headwater.entity_keys import entity_id as entity_id
from headwater.entity_keys import key_text as key_text
from headwater.entity_keys import parse_key as parse_key
from headwater.errors import UsageError
from headwater.protocols.convergedb.codes import MAX_FIELDS
from headwater.protocols.convergedb.fields import (
    FieldSpec,
    FieldType,
    FieldValue,
    decode_prefix,
    default_value,
    encode_fields,
    encode_present_fields,
)

T = TypeVar("T")

U8: TypeAlias = Annotated[int, FieldType.U8]
U16: TypeAlias = Annotated[int, FieldType.U16]
U32: TypeAlias = Annotated[int, FieldType.U32]
U64: TypeAlias = Annotated[int, FieldType.U64]
I8: TypeAlias = Annotated[int, FieldType.I8]
I16: TypeAlias = Annotated[int, FieldType.I16]
I32: TypeAlias = Annotated[int, FieldType.I32]
I64: TypeAlias = Annotated[int, FieldType.I64]
F32: TypeAlias = Annotated[float, FieldType.F32]
F64: TypeAlias = Annotated[float, FieldType.F64]
Timestamp: TypeAlias = Annotated[int, FieldType.TIMESTAMP]
"""A timestamp field read and written as integer nanoseconds since the Unix epoch."""

_PLAIN: dict[Any, FieldType] = {
    bool: FieldType.BOOL,
    int: FieldType.I64,
    float: FieldType.F64,
    str: FieldType.STRING,
    bytes: FieldType.BYTES,
    _dt.datetime: FieldType.TIMESTAMP,
}
# Which Python type may carry each field type (Annotated[T, X] must agree).
_CARRIERS: dict[FieldType, tuple[Any, ...]] = {
    FieldType.BOOL: (bool,),
    FieldType.F32: (float,),
    FieldType.F64: (float,),
    FieldType.STRING: (str,),
    FieldType.BYTES: (bytes,),
    FieldType.TIMESTAMP: (int, _dt.datetime),
}
_INTEGERS = frozenset(
    {
        FieldType.U8,
        FieldType.U16,
        FieldType.U32,
        FieldType.U64,
        FieldType.I8,
        FieldType.I16,
        FieldType.I32,
        FieldType.I64,
    }
)

TYPE_NAMES: dict[str, FieldType] = {t.name.lower(): t for t in FieldType} | {
    "string": FieldType.STRING,
    "str": FieldType.STRING,
    "int": FieldType.I64,
    "float": FieldType.F64,
    "double": FieldType.F64,
    "ts": FieldType.TIMESTAMP,
}
"""Type names the CLI accepts in ``name:type`` (``u8``, ``i64``, ``f64``, ``string``...)."""

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)


def type_name(field_type: int) -> str:
    """``u8``, ``i64``, ``string``, ``timestamp``...: the name the CLI and docs use."""
    return FieldType(field_type).name.lower()


def parse_type(text: str) -> FieldType:
    """A field type by name (``i64``, ``string``...) or code (``9``)."""
    key = text.strip().lower()
    if key.isdigit():
        try:
            return FieldType(int(key))
        except ValueError:
            pass
    elif key in TYPE_NAMES:
        return TYPE_NAMES[key]
    names = ", ".join(sorted(t.name.lower() for t in FieldType))
    raise UsageError(f"unknown field type {text!r}: expected one of {names}")


@dataclass(frozen=True, slots=True)
class FieldInfo:
    """One field of a declared kind: its wire name and type, and how Python sees it."""

    name: str
    type: FieldType
    as_datetime: bool = False  # a timestamp read and written as datetime


def _field_type(owner: str, name: str, annotation: Any) -> FieldInfo:
    where = f"{owner}.{name}"
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        base, *extra = typing.get_args(annotation)
        codes = [x for x in extra if isinstance(x, FieldType)]
        if len(codes) != 1:
            raise UsageError(
                f"{where}: Annotated[...] needs exactly one headwater FieldType, e.g. "
                "Annotated[int, FieldType.U8] (or use the aliases U8, I32, F32, Timestamp...)"
            )
        code = codes[0]
        carriers = _CARRIERS.get(code, (int,))
        if base not in carriers:
            raise UsageError(f"{where}: a {code.name} field cannot be declared as {base!r}")
        return FieldInfo(name, code, as_datetime=base is _dt.datetime)
    if origin in (typing.Union, types.UnionType):
        raise UsageError(
            f"{where}: {annotation!r} cannot be a kind field: ConvergeDB has no nulls "
            "(a field left out takes its zero value), so Optional / unions do not map"
        )
    plain = _PLAIN.get(annotation)
    if plain is None:
        supported = "bool, int, float, str, bytes, datetime, or U8..U64, I8..I64, F32, Timestamp"
        raise UsageError(f"{where}: type {annotation!r} does not map to a field type ({supported})")
    return FieldInfo(name, plain, as_datetime=plain is FieldType.TIMESTAMP)


def dataclass_fields(cls: type[Any]) -> tuple[FieldInfo, ...]:
    """The kind fields a dataclass declares, in order (UsageError when one does not map)."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise UsageError(f"a kind is declared as a dataclass, not {cls!r}")
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except NameError as exc:
        raise UsageError(f"cannot resolve the annotations of {cls.__name__}: {exc}") from None
    fields = tuple(
        _field_type(cls.__name__, f.name, hints[f.name])
        for f in dataclasses.fields(cls)
        if f.init or f.name in hints
    )
    if not fields:
        raise UsageError(f"{cls.__name__} declares no fields")
    if len(fields) > MAX_FIELDS:
        raise UsageError(f"{cls.__name__}: a kind has at most {MAX_FIELDS} fields")
    return fields


def kind_name_of(cls: type[Any]) -> str:
    """``cls.__kind__`` when the class sets it, else the class name."""
    name = getattr(cls, "__kind__", None)
    return name if isinstance(name, str) else cls.__name__


# ---- entity keys -----------------------------------------------------------------------
# One rule for every surface (headwater.entity_keys): the SDK, the CLI, HTTP and SQL.

# ---- kinds ------------------------------------------------------------------------------


def to_wire(info: FieldInfo, value: Any) -> FieldValue:
    if info.type is FieldType.TIMESTAMP and isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.UTC)
        delta = value - _EPOCH
        ns: int = (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000
        return ns
    if info.type in (FieldType.F32, FieldType.F64) and type(value) is int:
        try:
            return float(value)
        except OverflowError:
            raise UsageError(
                f"field {info.name}: {value} is past what a {info.type.name} holds"
            ) from None
    # Anything else goes to the codec as is: it refuses a value its type cannot carry.
    return typing.cast(FieldValue, value)


def from_wire(info: FieldInfo, value: FieldValue) -> Any:
    if info.as_datetime and isinstance(value, int):
        return _EPOCH + _dt.timedelta(microseconds=value // 1000)
    return value


@dataclass(frozen=True, slots=True)
class Kind(Generic[T]):
    """A kind the server knows, bound to the dataclass that reads and writes it.

    ``fields`` are the dataclass's fields, a prefix of the kind's (``field_count`` may be
    larger when another writer appended fields: they keep their values on PATCH and take
    their defaults on ASSERT).
    """

    name: str
    kind_id: int
    schema_version: int
    field_count: int
    cls: type[T]
    fields: tuple[FieldInfo, ...]
    event_stream: bool = False

    @property
    def specs(self) -> list[FieldSpec]:
        return [FieldSpec(f.name, f.type) for f in self.fields]

    def encode(self, value: T) -> bytes:
        """ASSERT field_data for a dataclass instance (UsageError for a wrong type)."""
        if self.cls is dict:  # a kind read without a dataclass: values are dicts
            if not isinstance(value, Mapping):
                raise UsageError(f"kind {self.name} takes dicts, not {type(value).__name__}")
            unknown = set(value) - {f.name for f in self.fields}
            if unknown:
                raise UsageError(f"kind {self.name} has no field(s) {', '.join(sorted(unknown))}")
            items = [value.get(f.name, default_value(f.type)) for f in self.fields]
        elif isinstance(value, self.cls):
            items = [getattr(value, f.name) for f in self.fields]
        else:
            raise UsageError(
                f"kind {self.name} takes {self.cls.__name__} values, not {type(value).__name__}"
            )
        return encode_fields(
            self.specs, [to_wire(f, v) for f, v in zip(self.fields, items, strict=True)]
        )

    def encode_patch(self, changes: Mapping[str, Any]) -> tuple[int, bytes]:
        """PATCH ``(presence_mask, field_data)`` for ``{field name: value}``."""
        if not changes:
            raise UsageError("a patch changes at least one field")
        by_name = {f.name: (i, f) for i, f in enumerate(self.fields)}
        values: dict[int, FieldValue] = {}
        for name, value in changes.items():
            found = by_name.get(name)
            if found is None:
                known = ", ".join(by_name)
                raise UsageError(f"kind {self.name} has no field {name!r} (fields: {known})")
            values[found[0]] = to_wire(found[1], value)
        return encode_present_fields(self.specs, values)

    def decode(self, field_data: bytes) -> T:
        """A dataclass instance from a STATE's field_data (fields past ours are skipped)."""
        values = decode_prefix(self.specs, field_data)
        kwargs = {f.name: from_wire(f, v) for f, v in zip(self.fields, values, strict=True)}
        if self.cls is dict:
            return typing.cast(T, kwargs)
        return self.cls(**kwargs)

    def decode_present(self, presence_mask: int, field_data: bytes) -> dict[str, Any]:
        """``{field name: value}`` of an EVENT's (or PATCH's) present fields. Present
        fields past ours (appended by a migration this dataclass does not know) come
        after ours in field_data and are skipped."""
        present = [f for i, f in enumerate(self.fields) if presence_mask >> i & 1]
        values = decode_prefix([FieldSpec(f.name, f.type) for f in present], field_data)
        return {f.name: from_wire(f, v) for f, v in zip(present, values, strict=True)}


class _Keyed:
    """What an entity's state and an op on it share: the entity id, shown as a key."""

    __slots__ = ()
    entity_id: bytes

    @property
    def key(self) -> str:
        """The entity id as :func:`key_text` shows it."""
        return key_text(self.entity_id)


@dataclass(frozen=True, slots=True, repr=False)
class Entity(_Keyed, Generic[T]):
    """An entity's committed state (QUERY, scan) or a change to it (subscriptions).

    ``value`` is None for a deletion. ``change`` is ``created``, ``updated``,
    ``bootstrap``, ``query`` or ``deleted``; ``version`` strictly increases per entity.
    """

    kind: str
    entity_id: bytes
    version: int
    value: T | None
    change: str
    source_set: int = 0
    changed_fields: int = 0
    previous: T | None = None
    """The value before an ``updated`` change, on a subscription with
    ``include_previous``; None otherwise."""
    metadata: bytes = b""
    """The metadata of the last write in the change's window (live changes only: the
    server never stores metadata, so QUERY and bootstrap states have none)."""

    def __repr__(self) -> str:
        return (
            f"Entity(kind={self.kind!r}, key={self.key!r}, version={self.version}, "
            f"change={self.change!r}, value={self.value!r})"
        )

    @property
    def deleted(self) -> bool:
        return self.value is None

    @property
    def sources(self) -> list[int]:
        """The source ids that assert the entity."""
        return [i for i in range(64) if self.source_set >> i & 1]


@dataclass(frozen=True, slots=True, repr=False)
class EntityEvent(_Keyed):
    """One write to an event-stream kind, as an EVENT delivers it (a subscription with
    ``events=True``): every ASSERT, PATCH and RETRACT, even one that changed nothing.

    ``op`` is ``assert``, ``patch`` or ``retract``; ``fields`` maps the name of each
    field the op carried to its value (an assert: every field; a patch: the patched
    ones; a retract: none). ``sequence`` counts the kind's ops from 0, without gaps.
    """

    kind: str
    entity_id: bytes
    op: str
    source_id: int
    sequence: int
    fields: dict[str, Any]
    presence_mask: int = 0
    metadata: bytes = b""

    def __repr__(self) -> str:
        return (
            f"EntityEvent(kind={self.kind!r}, key={self.key!r}, op={self.op!r}, "
            f"source_id={self.source_id}, sequence={self.sequence}, fields={self.fields!r})"
        )


def schema_fields(specs: Sequence[tuple[str, int]]) -> tuple[FieldInfo, ...]:
    """FieldInfo for a schema the server described (a kind read as dicts)."""
    return tuple(
        FieldInfo(name, FieldType(code), FieldType(code) is FieldType.TIMESTAMP)
        for name, code in specs
    )
