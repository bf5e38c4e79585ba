"""Subscribe, SubscribeCredit and Unsubscribe: credit-based push from the log."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headwater.api import CloseReason, Subscription
from headwater.errors import InvalidRequest
from headwater.protocols.kimberlite import messages as m

VALUE_LENGTH_BYTES = 8  # a push's value records are u64 length | bytes (a Push's chunks)

if TYPE_CHECKING:
    from headwater.engine.subscriptions import Push
    from headwater.server.kimberlite.listener import KimberliteConnection


async def subscribe(
    conn: KimberliteConnection, request: m.Request, payload: m.SubscribeRequest
) -> m.ResponsePayload:
    subscribe_id = request.id
    limit = conn.server.config.limits.max_subscriptions_per_connection
    if len(conn.session.subscriptions) >= limit:
        conn.server.limits.refused("max_subscriptions_per_connection", "kimberlite")
        raise InvalidRequest(
            f"this connection has {limit} subscriptions, the most"
            " limits.max_subscriptions_per_connection allows: unsubscribe one first"
        )

    # Pushes are reads too (headwater_events_read_total): a subscriber's were not counted.
    counted = conn.metrics.read_counter(
        request.tenant_id, conn.api.stream_name(request.tenant_id, payload.stream_id)
    )

    async def deliver(sub: Subscription, pushes: list[Push]) -> None:
        # A whole read: every push framed, handed to the transport in one writelines,
        # then one wait for the transport to take more.
        conn.write_chunks(
            conn.protocol.send_subscription_pushes(subscribe_id, sub.subscription_id, pushes)
        )
        events = sum(push.event_count for push in pushes)
        stored = sum(len(chunk) for push in pushes for chunk in push.chunks)
        counted(events, stored - VALUE_LENGTH_BYTES * events)  # values without their u64
        await conn.drained()

    def on_close(sub: Subscription, reason: CloseReason) -> None:
        conn.session.subscriptions.pop(sub.subscription_id, None)
        if sub.subscription_id in conn.session.cancelling:
            return  # Unsubscribe answers for itself, with its own request id
        conn.send(
            subscribe_id,
            m.SubscriptionClosedResponse(sub.subscription_id, m.CloseReason(int(reason))),
        )

    sub = conn.api.subscribe(
        request.tenant_id,
        payload.stream_id,
        payload.from_offset,
        payload.initial_credits,
        payload.consumer_group,
        deliver,
        on_close,
        # Each read waits for the connection's turn and the read-answer budget, and is
        # held until written: a peer that does not read holds one read, not one per
        # subscription (each read 4 MiB at once: +335 MB for 80 of them).
        read_room=conn.answers.turn,
    )
    conn.session.subscriptions[sub.subscription_id] = (sub, request.tenant_id)
    return m.SubscribeResponse(sub.subscription_id, sub.next_offset, sub.credits)


def _owned(conn: KimberliteConnection, request: m.Request, subscription_id: int) -> Subscription:
    entry = conn.session.subscriptions.get(subscription_id)
    if entry is None or entry[1] != request.tenant_id:
        raise InvalidRequest(f"no subscription {subscription_id} on this connection")
    return entry[0]


async def credit(
    conn: KimberliteConnection, request: m.Request, payload: m.SubscribeCreditRequest
) -> m.ResponsePayload:
    sub = _owned(conn, request, payload.subscription_id)
    balance = conn.api.grant(sub, payload.additional_credits)
    return m.SubscriptionCreditResponse(sub.subscription_id, balance)


async def unsubscribe(
    conn: KimberliteConnection, request: m.Request, payload: m.UnsubscribeRequest
) -> m.ResponsePayload:
    sub = _owned(conn, request, payload.subscription_id)
    conn.session.cancelling.add(sub.subscription_id)
    conn.api.unsubscribe(sub, CloseReason.CLIENT_CANCELLED)
    conn.session.cancelling.discard(sub.subscription_id)
    return m.SubscriptionClosedResponse(sub.subscription_id, m.CloseReason.CLIENT_CANCELLED)
