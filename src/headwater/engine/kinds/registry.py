"""The kind registry of one tenant: CREATE_KIND / GET_KIND semantics, persisted.

Rules (spec/PROTOCOLS.md §2): an identical CREATE_KIND returns the existing kind;
appending fields migrates it (schema_version + 1); any other difference is a schema
conflict. At most 64 fields. Kind names share the tenant's namespace with streams and
follow the common name rules (reserved prefixes ``convergedb_`` and ``hw_``).

The registry is one JSON file per tenant, ``tenants/<id>/kinds/kinds.json``, replaced
atomically on every change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from headwater.engine.kinds.errors import (
    BadName,
    KindLimitExceeded,
    KindNotFound,
    ReservedName,
    SchemaConflict,
    SchemaIncompatible,
)
from headwater.engine.kinds.fields import MAX_FIELDS, FieldSpec, FieldType
from headwater.engine.kinds.model import KindInfo
from headwater.engine.names import RESERVED_PREFIXES, check_name
from headwater.errors import InvalidRequest
from headwater.storage.metadata import read_json, write_json_atomic

REGISTRY_FILE = "kinds.json"
MAX_KIND_ID = 0xFFFF

_Kind = TypeVar("_Kind")


def known_kind(kinds: Mapping[int, _Kind], kind_id: int) -> _Kind:
    """``kinds[kind_id]`` (a kind's definition, or its state); KindNotFound when the
    tenant has no kind ``kind_id``."""
    try:
        return kinds[kind_id]
    except KeyError:
        raise KindNotFound(f"kind {kind_id} does not exist") from None


def normal_fields(fields: Sequence[tuple[str, int]]) -> tuple[FieldSpec, ...]:
    """Checked ``FieldSpec`` tuple: at most 64 fields, known types, valid unique names."""
    if len(fields) > MAX_FIELDS:
        raise KindLimitExceeded(f"a kind has at most {MAX_FIELDS} fields, not {len(fields)}")
    out: list[FieldSpec] = []
    seen: set[str] = set()
    for name, code in fields:
        try:
            field_type = FieldType(code)
        except ValueError:
            raise BadName(f"field {name!r}: unknown type code {code}") from None
        try:
            check_name(name, internal=True)
        except InvalidRequest as exc:
            raise BadName(f"field name: {exc.message}") from None
        if name in seen:
            raise BadName(f"field {name!r} appears twice")
        seen.add(name)
        out.append(FieldSpec(name, field_type))
    return tuple(out)


class KindRegistry:
    """Kinds of one tenant by id and by name (loop thread only)."""

    def __init__(self, tenant_id: int, directory: Path) -> None:
        self.tenant_id = tenant_id
        self.directory = directory
        self.by_id: dict[int, KindInfo] = {}
        self.by_name: dict[str, int] = {}
        self.next_kind_id = 1

    @classmethod
    def load(cls, tenant_id: int, directory: Path) -> KindRegistry:
        registry = cls(tenant_id, directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / REGISTRY_FILE
        if path.exists():
            data = read_json(path)
            registry.next_kind_id = int(data.get("next_kind_id", 1))
            for entry in data.get("kinds", []):
                kind = KindInfo.from_json(tenant_id, entry)
                registry.by_id[kind.kind_id] = kind
                registry.by_name[kind.name] = kind.kind_id
        return registry

    def save(self) -> None:
        """Write the registry (call in a worker thread or at start-up)."""
        data = {
            "next_kind_id": self.next_kind_id,
            "kinds": [k.to_json() for _, k in sorted(self.by_id.items())],
        }
        write_json_atomic(self.directory / REGISTRY_FILE, data)

    def kind(self, kind_id: int) -> KindInfo:
        return known_kind(self.by_id, kind_id)

    def kinds(self) -> list[KindInfo]:
        return [k for _, k in sorted(self.by_id.items())]

    def resolve(self, name: str, fields: Sequence[tuple[str, int]] = ()) -> KindInfo:
        """GET_KIND: by name; with fields, they must be a prefix of the kind's schema."""
        kind_id = self.by_name.get(name)
        if kind_id is None:
            raise KindNotFound(f"kind {name!r} does not exist")
        kind = self.by_id[kind_id]
        if fields:
            wanted = normal_fields(fields)
            if kind.fields[: len(wanted)] != wanted:
                raise SchemaIncompatible(
                    f"the fields given are not a prefix of kind {name!r}'s schema "
                    f"({_describe(kind.fields)})"
                )
        return kind

    def plan_create(
        self,
        name: str,
        fields: Sequence[tuple[str, int]],
        *,
        event_stream: bool = False,
        internal: bool = False,
        taken_names: frozenset[str] | set[str] = frozenset(),
    ) -> tuple[KindInfo, bool]:
        """What CREATE_KIND would do: ``(kind, changed)``. ``changed`` is False for an
        identical definition (nothing to store). Raises for a conflict; changes nothing —
        :meth:`install` does, once the caller has persisted it."""
        if not internal and name.startswith(RESERVED_PREFIXES):
            raise ReservedName(f"the prefixes convergedb_ and hw_ are reserved: {name!r}")
        try:
            check_name(name, internal=True)
        except InvalidRequest as exc:
            raise BadName(exc.message) from None
        specs = normal_fields(fields)
        kind_id = self.by_name.get(name)
        if kind_id is None:
            if name in taken_names:
                raise SchemaConflict(f"{name!r} is already the name of a stream")
            if self.next_kind_id > MAX_KIND_ID:
                raise KindLimitExceeded(f"a tenant has at most {MAX_KIND_ID} kinds")
            kind = KindInfo(
                self.tenant_id, self.next_kind_id, name, specs, event_stream, 1, internal
            )
            return kind, True
        old = self.by_id[kind_id]
        if old.event_stream != event_stream:
            raise SchemaConflict(
                f"kind {name!r} is {'an' if old.event_stream else 'not an'} event stream"
            )
        if specs == old.fields:
            return old, False
        if len(specs) > len(old.fields) and specs[: len(old.fields)] == old.fields:
            migrated = KindInfo(
                self.tenant_id,
                kind_id,
                name,
                specs,
                event_stream,
                old.schema_version + 1,
                old.internal,
            )
            return migrated, True
        raise SchemaConflict(
            f"kind {name!r} has fields ({_describe(old.fields)}); only appending fields is a "
            "migration"
        )

    def install(self, kind: KindInfo) -> None:
        self.by_id[kind.kind_id] = kind
        self.by_name[kind.name] = kind.kind_id
        self.next_kind_id = max(self.next_kind_id, kind.kind_id + 1)


def _describe(fields: Sequence[FieldSpec]) -> str:
    return ", ".join(f"{f.name}:{f.type.name.lower()}" for f in fields) or "no fields"
