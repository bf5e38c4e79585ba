"""Entity kinds: live multi-writer state (ConvergeDB's model, spec/PROTOCOLS.md §2).

Public API (loop thread unless noted)::

    kinds = await KindsEngine.open(engine, KindsConfig())
    tk = kinds.tenant(tenant_id)                      # TenantKinds
    kind = await tk.create_kind("sensor", [("temp", FieldType.F64)], event_stream=False)
    kind = tk.get_kind("sensor", fields=())           # by name; fields must be a prefix
    source = tk.connect("writer-a", source_id=None, deadline_ms=0, on_dead=callback)
    window = tk.apply(source, [assert_op(kind, eid, [21.5]), patch_op(kind, eid, {0: 1.0}),
                               retract_op(kind, eid)])  # checked, then applied
    await window.durable()                            # ACK point of a write
    await tk.barrier()                                # HEARTBEAT with a stream id
    tk.begin_epoch(source); count, window = tk.end_epoch(source)
    tk.get(kind_id, eid) -> EntityState | None        # committed state (QUERY)
    tk.scan(kind_id) -> Iterator[EntityState]         # bootstrap / SQL
    sub = tk.subscribe(kind_id, include_previous=False, events=False)
    notes = await sub.next_batch()                    # StateChange / EventNote lists
    source.touch(); source.disconnect()
    await kinds.close()

Field types, values and the record encoding are in :mod:`.fields`; errors carry an
:class:`ErrorKind` that each front end maps to its own wire errors. Nothing here knows a
wire format: each front end turns its messages into these ops (ConvergeDB's codec decodes
a BATCH of whole records into one :class:`AssertRecords`).

The values, ops and errors are imported at once; the engine itself (asyncio, storage,
numpy) only when first asked for, so a codec can use the types without loading it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from headwater._lazy import lazy_getattr
from headwater.engine.kinds.errors import (
    BadFieldData,
    BadName,
    EntityNotFound,
    ErrorKind,
    KindLimitExceeded,
    KindNotFound,
    KindsError,
    NoEpoch,
    NoFreeSource,
    ReadOnlySource,
    ReservedName,
    SchemaConflict,
    SchemaIncompatible,
    SourceConflict,
    SubscriptionOverflow,
    error_kind_of,
)
from headwater.engine.kinds.fields import FieldSpec, FieldType, FieldValue
from headwater.engine.kinds.model import (
    AssertOp,
    AssertRecords,
    ChangeType,
    EntityState,
    EventNote,
    KindInfo,
    KindsConfig,
    Notification,
    PatchOp,
    RetractOp,
    StateChange,
    StateColumns,
    WindowNotes,
    WriteOp,
)
from headwater.engine.kinds.ops import assert_op, patch_op, retract_op

if TYPE_CHECKING:
    from headwater.engine.kinds.service import KindsEngine, TenantKinds
    from headwater.engine.kinds.sources import PRESENCE_KIND, Source, presence_entity_id
    from headwater.engine.kinds.state import KindState
    from headwater.engine.kinds.subscriptions import KindSubscription
    from headwater.engine.kinds.windows import Window

_LOADED_LATER = {
    "KindsEngine": "service",
    "TenantKinds": "service",
    "PRESENCE_KIND": "sources",
    "Source": "sources",
    "presence_entity_id": "sources",
    "KindState": "state",
    "KindSubscription": "subscriptions",
    "Window": "windows",
}


__getattr__ = lazy_getattr(__name__, _LOADED_LATER)


__all__ = [
    "PRESENCE_KIND",
    "AssertOp",
    "AssertRecords",
    "BadFieldData",
    "BadName",
    "ChangeType",
    "EntityNotFound",
    "EntityState",
    "ErrorKind",
    "EventNote",
    "FieldSpec",
    "FieldType",
    "FieldValue",
    "KindInfo",
    "KindLimitExceeded",
    "KindNotFound",
    "KindState",
    "KindSubscription",
    "KindsConfig",
    "KindsEngine",
    "KindsError",
    "NoEpoch",
    "NoFreeSource",
    "Notification",
    "PatchOp",
    "ReadOnlySource",
    "ReservedName",
    "RetractOp",
    "SchemaConflict",
    "SchemaIncompatible",
    "Source",
    "SourceConflict",
    "StateChange",
    "StateColumns",
    "SubscriptionOverflow",
    "TenantKinds",
    "Window",
    "WindowNotes",
    "WriteOp",
    "assert_op",
    "error_kind_of",
    "patch_op",
    "presence_entity_id",
    "retract_op",
]
