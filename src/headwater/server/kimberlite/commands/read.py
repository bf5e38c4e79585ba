"""ReadEvents: stored batches go back to the socket without decoding each event."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headwater.protocols.kimberlite import messages as m

if TYPE_CHECKING:
    from headwater.server.kimberlite.listener import KimberliteConnection

# A response must fit in one 16 MiB frame: leave room for 8-byte lengths and the header.
MAX_READ_BYTES = 12 << 20


async def read_events(
    conn: KimberliteConnection, request: m.Request, payload: m.ReadEventsRequest
) -> None:
    max_events = max(1, (MAX_READ_BYTES // 8) - 1)
    # The answer's bytes are the server's until the client has read them
    # (limits.read_answers_mib): it reads no more than it was given room for.
    async with conn.answers.turn(max(min(payload.max_bytes, MAX_READ_BYTES), 1)) as room:
        result = await conn.api.read(
            request.tenant_id,
            payload.stream_id,
            payload.from_offset,
            max(room, 1),  # none only when the server is stopping: the first event
            max_events=max_events,
            read_ahead=True,  # readers page from an offset on: the next page is read meanwhile
            # The answer carries no offsets: the client counts them from from_offset, so a
            # hole (compaction's, an aborted transaction's) ends it
            # (docs/protocols/kimberlite.md).
            contiguous=True,
        )
        conn.metrics.record_read(
            "kimberlite",
            request.tenant_id,
            conn.api.stream_name(request.tenant_id, payload.stream_id),
            result.count,
            result.value_bytes,
        )
        conn.write_chunks(
            conn.protocol.send_read_events(
                request.id, result.count, result.values_chunks(), result.next_offset
            )
        )
