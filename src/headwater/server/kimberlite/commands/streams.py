"""CreateStream, DeleteStream and ListStreams."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headwater.protocols.kimberlite import messages as m

if TYPE_CHECKING:
    from headwater.server.kimberlite.listener import KimberliteConnection


async def create(
    conn: KimberliteConnection, request: m.Request, payload: m.CreateStreamRequest
) -> m.ResponsePayload:
    info = await conn.api.create_stream(request.tenant_id, payload.name)
    return m.CreateStreamResponse(info.stream_id)


async def delete(
    conn: KimberliteConnection, request: m.Request, payload: m.DeleteStreamRequest
) -> m.ResponsePayload:
    await conn.api.delete_stream(request.tenant_id, payload.stream_id)
    return m.StreamDeletedResponse(payload.stream_id)


async def list_streams(
    conn: KimberliteConnection, request: m.Request, payload: m.ListStreamsRequest
) -> m.ResponsePayload:
    return m.StreamsResponse(
        [
            m.StreamInfo(s.stream_id, s.name, s.next_offset, s.size_bytes, s.created_ns)
            for s in conn.api.list_streams(request.tenant_id)
        ]
    )
