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

Wire ops become engine ops with :func:`from_wire` (BATCH: decoded once, checked, applied
grouped by kind, all or nothing).
"""

from headwater.engine.kinds.errors import (
    BadFieldData,
    BadName,
    EntityNotFound,
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
    cdb_code_for,
)
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
from headwater.engine.kinds.ops import assert_op, from_wire, patch_op, retract_op
from headwater.engine.kinds.service import (
    PRESENCE_KIND,
    KindsEngine,
    KindState,
    Source,
    TenantKinds,
    Window,
    presence_entity_id,
)
from headwater.engine.kinds.subscriptions import KindSubscription

__all__ = [
    "PRESENCE_KIND",
    "AssertOp",
    "AssertRecords",
    "BadFieldData",
    "BadName",
    "ChangeType",
    "EntityNotFound",
    "EntityState",
    "EventNote",
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
    "cdb_code_for",
    "from_wire",
    "patch_op",
    "presence_entity_id",
    "retract_op",
]
