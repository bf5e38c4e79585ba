"""Values the kind engine hands out and takes in: kinds, entity states, write ops and
notifications. All immutable; field values are the Python values of
:mod:`.fields`, and records are encoded as it says."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TypeAlias, overload

from headwater.engine.kinds.errors import BadFieldData
from headwater.engine.kinds.fields import (
    ENTITY_ID_SIZE,
    MAX_SOURCE_ID,
    FieldSpec,
    FieldType,
    FieldValue,
)

Key: TypeAlias = tuple[int, bytes]
"""``(kind_id, entity_id)``."""

ALL_SOURCES = (1 << (MAX_SOURCE_ID + 1)) - 1

# In a cluster a kind's changelog is partition 0 of this internal stream (its name
# after the prefix; hw_ is reserved, so no user stream or kind takes it): see .replicated.
CHANGELOG_PREFIX = "hw_kind_"


def changelog_stream(kind_name: str) -> str:
    """The replicated stream whose partition 0 is the kind's changelog."""
    return CHANGELOG_PREFIX + kind_name


def kind_of_changelog(stream: str) -> str | None:
    """The kind whose changelog ``stream`` names, None for any other stream."""
    return stream[len(CHANGELOG_PREFIX) :] if stream.startswith(CHANGELOG_PREFIX) else None


@dataclass(frozen=True, slots=True)
class KindInfo:
    """One kind of one tenant: its id, name, schema and whether it is an event stream."""

    tenant_id: int
    kind_id: int
    name: str
    fields: tuple[FieldSpec, ...]
    event_stream: bool = False
    schema_version: int = 1
    internal: bool = False  # the presence kind: written by headwater only

    @property
    def field_count(self) -> int:
        return len(self.fields)

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.kind_id,
            "name": self.name,
            "fields": [[f.name, int(f.type)] for f in self.fields],
            "event_stream": self.event_stream,
            "schema_version": self.schema_version,
            "internal": self.internal,
        }

    @classmethod
    def from_json(cls, tenant_id: int, data: Mapping[str, object]) -> KindInfo:
        raw_fields = data["fields"]
        assert isinstance(raw_fields, list)
        return cls(
            tenant_id,
            int(str(data["id"])),
            str(data["name"]),
            tuple(FieldSpec(str(n), FieldType(int(t))) for n, t in raw_fields),
            bool(data.get("event_stream", False)),
            int(str(data.get("schema_version", 1))),
            bool(data.get("internal", False)),
        )


@dataclass(slots=True, eq=False, repr=False)
class EntityState:
    """An entity as readers see it: committed (durable) and with its version.

    ``record`` is the encoded field_data of every field, as STATE frames carry it; the
    engine keeps only that (and the version and source set) and decodes ``values`` when a
    reader asks for them. Equal when the decoded values are (not the record bytes).
    """

    kind_id: int
    entity_id: bytes
    version: int
    source_set: int
    record: bytes
    fields: tuple[FieldSpec, ...]
    _values: tuple[FieldValue, ...] | None = field(default=None, init=False)

    @property
    def values(self) -> tuple[FieldValue, ...]:
        """Every field's value (a record written under an older schema, shorter, gets the
        newer fields' defaults)."""
        if self._values is None:
            from headwater.engine.kinds.codec import codec_for

            self._values = codec_for(self.fields).decode_assert(self.record)
        return self._values

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EntityState):
            return NotImplemented
        return (
            self.kind_id == other.kind_id
            and self.entity_id == other.entity_id
            and self.version == other.version
            and self.source_set == other.source_set
            and self.values == other.values
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"EntityState(kind_id={self.kind_id}, entity_id={self.entity_id.hex()}, "
            f"version={self.version}, source_set={self.source_set:#x}, values={self.values!r})"
        )


# ---- write ops ------------------------------------------------------------------------


@dataclass(slots=True)  # not frozen: built per entity per write, frozen init costs 4x
class AssertOp:
    """Set the writer's source bit and replace every field with ``values`` (all of them:
    a prefix must be completed with defaults, as :func:`~.ops.assert_op` does)."""

    kind_id: int
    entity_id: bytes
    values: tuple[FieldValue, ...]
    metadata: bytes = b""
    record: bytes | None = None
    """``values`` already encoded (every field), when the caller has it: saves a re-encode."""

    @property
    def key(self) -> Key:
        return self.kind_id, self.entity_id


@dataclass(frozen=True, slots=True)
class PatchOp:
    """Set the writer's bit and update the fields in ``values`` (ordinal -> value); an
    absent entity is created with defaults first."""

    kind_id: int
    entity_id: bytes
    values: Mapping[int, FieldValue]
    metadata: bytes = b""

    @property
    def key(self) -> Key:
        return self.kind_id, self.entity_id


@dataclass(frozen=True, slots=True)
class RetractOp:
    """Clear the writer's bit; the entity is deleted when no source holds it."""

    kind_id: int
    entity_id: bytes
    metadata: bytes = b""

    @property
    def key(self) -> Key:
        return self.kind_id, self.entity_id


@dataclass(slots=True)
class AssertRecords:
    """ASSERTs of one kind, each of a whole record and with no metadata (a BATCH as a
    codec may decode it), applied as ``(entity_id, record)`` pairs without an op object
    per entity. Only for kinds that are not event streams, with records already checked to
    fit the schema."""

    kind_id: int
    pairs: Sequence[tuple[bytes, bytes]]


WriteOp: TypeAlias = AssertOp | PatchOp | RetractOp | AssertRecords

OP_ASSERT, OP_RETRACT, OP_PATCH = 0x02, 0x03, 0x08


def check_entity_id(entity_id: bytes) -> bytes:
    if len(entity_id) != ENTITY_ID_SIZE:
        raise BadFieldData(f"an entity id is {ENTITY_ID_SIZE} bytes, not {len(entity_id)}")
    return entity_id


# ---- notifications --------------------------------------------------------------------


class ChangeType(IntEnum):
    """What happened to an entity over one coalescing window (the net change)."""

    CREATED = 0
    UPDATED = 1
    DELETED = 2


@dataclass(slots=True)  # not frozen: built per entity per write, frozen init costs 4x
class StateChange:
    """The net change of one entity over one window, as subscribers get it.

    ``changed_fields`` has bit i set when field i differs from the previous state (every
    field for CREATED, none for DELETED); ``previous`` is the previous record for UPDATED.
    ``metadata`` is that of the window's last op on the entity (never stored).
    """

    kind_id: int
    entity_id: bytes
    change: ChangeType
    version: int
    source_set: int
    changed_fields: int
    record: bytes
    previous: bytes | None = None
    metadata: bytes = b""


@dataclass(slots=True, eq=False, repr=False)  # each subclass says how it compares
class ChangeColumns:
    """A window's net changes of one kind, one entry per change: what the window's plan
    writes (:class:`~headwater.engine.kinds.commit.FlushPlan`) and, once durable, what
    subscribers get (:class:`StateColumns`). It makes no ``__eq__`` (nor unsets
    ``__hash__``) and no ``__repr__`` of its own: :class:`StateColumns` inherits them, and
    is compared, hashed and shown as the one object it is."""

    entity_ids: list[bytes]
    changes: list[int]
    source_sets: list[int]
    records: list[bytes]
    previous: list[bytes | None]
    metadata: list[bytes] | None


@dataclass(slots=True, eq=False, repr=False)  # a sequence, compared by identity
class StateColumns(ChangeColumns, Sequence[StateChange]):
    """One window's net changes of one kind, as columns: the window flush builds them
    without an object per change, and a front end encodes them without one. As a sequence
    it gives :class:`StateChange` objects, made when asked for.

    Change ``i`` has version ``first_version + i``; ``previous[i]`` is the record before
    an UPDATED change (None otherwise); ``metadata`` is None when no change carries any.
    ``changed_fields`` is computed on first use (a kind nobody subscribes to never pays
    for it). ``derived`` keeps what a front end encoded from the window once: every
    subscriber of the kind gets this same object.
    """

    kind_id: int
    first_version: int
    changed_of: Callable[[StateColumns], list[int]]
    known_changed: list[int] | None = None  # changed_fields if known; else computed once read
    derived: dict[object, object] = field(default_factory=dict, init=False)

    @property
    def changed_fields(self) -> list[int]:
        if self.known_changed is None:
            self.known_changed = self.changed_of(self)
        return self.known_changed

    def __len__(self) -> int:
        return len(self.entity_ids)

    @overload
    def __getitem__(self, index: int) -> StateChange: ...
    @overload
    def __getitem__(self, index: slice) -> list[StateChange]: ...
    def __getitem__(self, index: int | slice) -> StateChange | list[StateChange]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        return StateChange(
            self.kind_id,
            self.entity_ids[index],
            ChangeType(self.changes[index]),
            self.first_version + index,
            self.source_sets[index],
            self.changed_fields[index],
            self.records[index],
            self.previous[index],
            self.metadata[index] if self.metadata is not None else b"",
        )

    def __iter__(self) -> Iterator[StateChange]:
        return (self[i] for i in range(len(self)))


@dataclass(frozen=True, slots=True)
class EventNote:
    """One op on an event-stream kind, delivered as EVENT (``sequence`` is per kind)."""

    kind_id: int
    entity_id: bytes
    op: int  # OP_ASSERT, OP_RETRACT or OP_PATCH
    source_id: int
    sequence: int
    presence_mask: int
    field_data: bytes
    metadata: bytes = b""


Notification: TypeAlias = StateChange | EventNote


class WindowNotes(list[Notification]):
    """One window's notifications of one kind: the same object goes to every subscriber,
    so a front end derives what it needs from it (encoded payloads) once, in ``derived``."""

    __slots__ = ("derived",)

    def __init__(self, notes: Iterable[Notification] = ()) -> None:
        super().__init__(notes)
        self.derived: dict[object, object] = {}


@dataclass(frozen=True)
class KindsConfig:
    """Tunables of the kind engine (TOML ``[convergedb]``, see docs/operations.md)."""

    coalesce_ms: int = 20
    live_buffer: int = 4096
    default_liveness_ms: int = 30_000
    liveness_check_ms: int = 50
    # Entities of one kind kept in memory (the rest are in its store on disk): about
    # 0.75 KiB each with 5 numeric fields, so the default takes ~150 MiB per kind at most.
    hot_entities: int = 200_000
    extra: dict[str, object] = field(default_factory=dict)


def values_tuple(values: Sequence[FieldValue]) -> tuple[FieldValue, ...]:
    return values if isinstance(values, tuple) else tuple(values)
