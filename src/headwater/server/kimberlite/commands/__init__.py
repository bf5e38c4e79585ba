"""One module per Kimberlite command (mini-redis style); ``HANDLERS`` routes payloads.

A handler takes the connection context and the decoded request and returns the response
payload (or ``None`` when it has already written its answer itself, as ReadEvents does
with stored bytes). Engine errors propagate as HeadwaterError and become Error responses.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from headwater.protocols.kimberlite import messages as m

from . import append, handshake, query, read, streams, subscribe, sync

Handler = Callable[[Any, m.Request, Any], Awaitable[m.ResponsePayload | None]]

HANDLERS: dict[type, Handler] = {
    m.HandshakeRequest: handshake.handle,
    m.CreateStreamRequest: streams.create,
    m.DeleteStreamRequest: streams.delete,
    m.ListStreamsRequest: streams.list_streams,
    m.AppendEventsRequest: append.append_events,
    m.AppendIdempotentRequest: append.append_idempotent,
    m.AppendRecordsRequest: append.append_records,
    m.ReadEventsRequest: read.read_events,
    m.QueryRequest: query.query,
    m.QueryAtRequest: query.query_at,
    m.SubscribeRequest: subscribe.subscribe,
    m.SubscribeCreditRequest: subscribe.credit,
    m.UnsubscribeRequest: subscribe.unsubscribe,
    m.SyncRequest: sync.sync,
}
