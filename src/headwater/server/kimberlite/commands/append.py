"""AppendEvents and AppendIdempotent: the events section is stored as it arrived."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headwater.protocols.kimberlite import messages as m

if TYPE_CHECKING:
    from headwater.server.kimberlite.listener import KimberliteConnection


async def append_events(
    conn: KimberliteConnection, request: m.Request, payload: m.AppendEventsRequest
) -> m.ResponsePayload:
    events = payload.events
    info = await conn.engine.append_encoded(
        request.tenant_id,
        payload.stream_id,
        events.section,
        events.count,
        value_bytes=events.event_bytes,
    )
    return m.AppendEventsResponse(info.base_offset, info.count)


async def append_idempotent(
    conn: KimberliteConnection, request: m.Request, payload: m.AppendIdempotentRequest
) -> m.ResponsePayload:
    events = payload.events
    info = await conn.engine.append_encoded(
        request.tenant_id,
        payload.stream_id,
        events.section,
        events.count,
        value_bytes=events.event_bytes,
        producer=(payload.producer_id, payload.sequence),
    )
    return m.AppendEventsResponse(info.base_offset, info.count)
