"""AppendEvents and AppendIdempotent: the events section is stored as it arrived."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from headwater.protocols.kimberlite import messages as m

if TYPE_CHECKING:
    from headwater.server.kimberlite.listener import KimberliteConnection


async def append_events(
    conn: KimberliteConnection, request: m.Request, payload: m.AppendEventsRequest
) -> m.ResponsePayload:
    return await _append(conn, request, payload.stream_id, payload.events, None)


async def append_idempotent(
    conn: KimberliteConnection, request: m.Request, payload: m.AppendIdempotentRequest
) -> m.ResponsePayload:
    producer = (payload.producer_id, payload.sequence)
    return await _append(conn, request, payload.stream_id, payload.events, producer)


async def _append(
    conn: KimberliteConnection,
    request: m.Request,
    stream_id: int,
    events: m.EventBatch,
    producer: tuple[int, int] | None,
) -> m.ResponsePayload:
    started = time.perf_counter()
    info = await conn.api.append_encoded(
        request.tenant_id,
        stream_id,
        events.section,
        events.count,
        value_bytes=events.event_bytes,
        producer=producer,
    )
    name = conn.api.stream_name(request.tenant_id, stream_id)
    conn.metrics.record_append(
        "kimberlite",
        request.tenant_id,
        name,
        info.count,
        events.event_bytes,
        time.perf_counter() - started,
    )
    return m.AppendEventsResponse(info.base_offset, info.count)
