"""AppendEvents, AppendIdempotent and AppendRecords: the events section is stored as it
arrived (AppendRecords' keys and headers beside it)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from headwater.protocols.kimberlite import messages as m

if TYPE_CHECKING:
    from headwater.server.kimberlite.listener import KimberliteConnection
    from headwater.storage.batch import EventColumns


async def append_events(
    conn: KimberliteConnection, request: m.Request, payload: m.AppendEventsRequest
) -> m.ResponsePayload:
    return await _append(conn, request, payload.stream_id, payload.events, None)


async def append_idempotent(
    conn: KimberliteConnection, request: m.Request, payload: m.AppendIdempotentRequest
) -> m.ResponsePayload:
    producer = (payload.producer_id, payload.sequence)
    return await _append(conn, request, payload.stream_id, payload.events, producer)


async def append_records(
    conn: KimberliteConnection, request: m.Request, payload: m.AppendRecordsRequest
) -> m.ResponsePayload:
    # decode_request checked that each column is empty or one entry per event.
    columns: EventColumns = {}
    if payload.keys:
        columns["keys"] = payload.keys
    if any(payload.headers):
        columns["headers"] = [
            tuple((name.encode(), value) for name, value in headers) for headers in payload.headers
        ]
    return await _append(conn, request, payload.stream_id, payload.events, None, columns)


async def _append(
    conn: KimberliteConnection,
    request: m.Request,
    stream_id: int,
    events: m.EventBatch,
    producer: tuple[int, int] | None,
    columns: EventColumns | None = None,
) -> m.ResponsePayload:
    started = time.perf_counter()
    cluster = conn.server.cluster
    if cluster is not None:
        # In a cluster only the leader of partition 0 takes Kimberlite appends: others
        # answer NotLeader (retryable), its message naming the leader's addresses.
        name = conn.api.stream_name(request.tenant_id, stream_id)
        cluster.view.check_leader(request.tenant_id, name, 0)
    columns = columns or {}
    if producer is not None:
        columns["producer"] = producer
    info = await conn.api.append_encoded(
        request.tenant_id,
        stream_id,
        events.section,
        events.count,
        value_bytes=events.event_bytes,
        **columns,
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
