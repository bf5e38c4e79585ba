"""Entity kinds as Kiwi sources: a live kind subscription per (session, kind) whose
net changes become RESULTs ``{sourceType "entity", entityId, change, version, fields}``.

The kind engine's buffer never fills while the session keeps taking batches (the
session itself never blocks: it sheds what its peer cannot take), so an overflow means
the loop was starved; the subscription then ends with SUBSCRIPTION_CLOSED.
"""

from __future__ import annotations

import asyncio
import logging

from headwater.engine.kinds import (
    ChangeType,
    KindInfo,
    StateChange,
    SubscriptionOverflow,
    TenantKinds,
)
from headwater.engine.kinds.codec import codec_for
from headwater.protocols.kiwi.frames import text_frame
from headwater.protocols.kiwi.results import entity_result
from headwater.server.kiwi.session import Detach, KiwiSession

log = logging.getLogger("headwater.kiwi")

CHANGES = {
    ChangeType.CREATED: "created",
    ChangeType.UPDATED: "updated",
    ChangeType.DELETED: "deleted",
}


def attach_kind(
    session: KiwiSession, tenant_kinds: TenantKinds, kind: KindInfo, source_id: str
) -> Detach:
    kind_id = kind.kind_id
    live = tenant_kinds.subscribe(kind_id)

    def result_frame(change: StateChange) -> bytes:
        if change.change is ChangeType.DELETED:
            fields: dict[str, object] = {}
        else:
            specs = tenant_kinds.kind(kind_id).fields  # the schema may have grown since
            values = codec_for(specs).decode_assert(change.record)
            fields = {spec.name: value for spec, value in zip(specs, values, strict=False)}
        message = entity_result(
            source_id, change.entity_id, CHANGES[change.change], change.version, fields
        )
        return message if session.packed else text_frame(message)

    async def pump() -> None:
        try:
            while True:
                notes = await live.next_batch()
                if not notes:
                    session.source_closed(source_id, "the kind is no longer available")
                    return
                frames = [result_frame(n) for n in notes if isinstance(n, StateChange)]
                session.deliver(source_id, frames)
        except SubscriptionOverflow:
            session.source_closed(source_id, "the subscriber fell too far behind")
        except Exception:
            log.exception("kind subscription %s failed", source_id)
            session.source_closed(source_id, "the subscription failed on the server")

    task = asyncio.get_running_loop().create_task(pump())

    def detach() -> None:
        live.close()
        task.cancel()

    return detach
