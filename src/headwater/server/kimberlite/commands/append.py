"""AppendEvents, AppendIdempotent and AppendRecords: the events section is stored as it
arrived (AppendRecords' keys and headers beside it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from headwater.protocols.kimberlite import messages as m

if TYPE_CHECKING:
    from headwater.errors import HeadwaterError
    from headwater.server.kimberlite.listener import KimberliteConnection
    from headwater.storage.batch import EventColumns
    from headwater.storage.log import AppendInfo

    AppendThen = Callable[..., None]


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
    return _answer(conn, request, stream_id, events, info, started)


def append_events_inline(
    conn: KimberliteConnection,
    request: m.Request,
    payload: m.AppendEventsRequest,
    append_then: AppendThen,
) -> None:
    """AppendEvents outside a cluster and without quotas, answered from its
    acknowledgement (``append_then``: the API's ``append_encoded_then``) rather than by a
    task of its own: a lone writer's append takes no task, no future and two loop turns
    fewer. Raises as :func:`append_events` does before anything is written."""
    started = time.perf_counter()
    events = payload.events

    def acknowledged(info: AppendInfo | None, error: HeadwaterError | None) -> None:
        try:
            if info is None:
                assert error is not None
                conn.send(request.id, conn.error_response(request, error))
            else:
                conn.send(
                    request.id, _answer(conn, request, payload.stream_id, events, info, started)
                )
        finally:
            conn._answered_inline()

    append_then(
        request.tenant_id,
        payload.stream_id,
        events.section,
        events.count,
        acknowledged,
        value_bytes=events.event_bytes,
    )
    conn._began_inline()


def _answer(
    conn: KimberliteConnection,
    request: m.Request,
    stream_id: int,
    events: m.EventBatch,
    info: AppendInfo,
    started: float,
) -> m.AppendEventsResponse:
    """An acknowledged append's answer, recorded in the metrics."""
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
