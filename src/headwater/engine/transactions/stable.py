"""Where a tenant's read_committed view ends: the position of its oldest open
transaction's first event."""

from __future__ import annotations

from headwater.engine.engine import Engine


def stable_position(engine: Engine, tenant_id: int, position: int) -> int:
    """``position``, or the position of the first event of the oldest transaction still
    open in any partition of the tenant if that is lower: a read_committed view of the
    tenant log (SQL's ``query``) is complete below it, and nothing at or past it can be
    answered exactly until that transaction ends."""
    for stream in engine.tenant(tenant_id).streams.values():
        if stream.deleted:
            continue
        for plog in stream.partition_logs:
            unstable = plog.first_unstable_position()
            if unstable is not None and unstable < position:
                position = unstable
    return position
