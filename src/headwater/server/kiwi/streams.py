"""Streams as Kiwi sources: one engine subscription per (session, stream), from the live
end, with credit the gateway keeps topped up (Kiwi has no credit: the session's own
queues decide what a slow subscriber loses)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headwater.engine.engine import Stream
from headwater.engine.subscriptions import MAX_CREDITS, RESUME, CloseReason, Subscription
from headwater.server.kiwi.session import Detach, KiwiSession
from headwater.storage.log import ReadResult

if TYPE_CHECKING:
    from headwater.server.kiwi.gateway import Gateway

CLOSE_MESSAGES = {
    CloseReason.SERVER_SHUTDOWN: "the server is shutting down",
    CloseReason.STREAM_DELETED: "the stream was deleted",
    CloseReason.BACKPRESSURE_TIMEOUT: "the subscriber fell too far behind",
    CloseReason.PROTOCOL_ERROR: "the subscription failed on the server",
}


def attach_stream(gateway: Gateway, session: KiwiSession, stream: Stream) -> Detach:
    subscriptions = gateway.server.subscriptions
    source_id = stream.name
    tenant_id = stream.tenant.tenant_id

    async def deliver_read(sub: Subscription, result: ReadResult) -> None:
        if sub.credits < MAX_CREDITS // 2:
            subscriptions.grant(sub, MAX_CREDITS - sub.credits)
        session.deliver(source_id, gateway.stream_frames(stream, result))
        gateway.metrics.record_read("kiwi", tenant_id, source_id, result.count, result.value_bytes)

    def on_close(sub: Subscription, reason: CloseReason) -> None:
        if reason is not CloseReason.CLIENT_CANCELLED:
            session.source_closed(source_id, CLOSE_MESSAGES.get(reason, "the source ended"))

    sub = subscriptions.subscribe(
        tenant_id,
        stream.stream_id,
        RESUME,
        MAX_CREDITS,
        None,
        None,
        on_close,
        deliver_read=deliver_read,
    )

    def detach() -> None:
        subscriptions.close(sub, CloseReason.CLIENT_CANCELLED)

    return detach
