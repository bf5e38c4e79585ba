"""Streams as Kiwi sources: one :class:`StreamFeed` per (tenant, stream, partition) with
subscribers, shared by all of them. A subscriber of a stream is a subscriber of every
partition the stream has when it subscribes, and its RESULTs carry each event's real
partition, offset, key and timestamp.

A feed holds one engine subscription from the live end, with credit it keeps topped up
(Kiwi has no credit). Each commit wakes that one subscription, which reads the log once;
the feed encodes each event once as a RESULT (framed once, for the sessions that take
frames) and hands the same messages to every subscriber's session
(:class:`~headwater.protocols.kiwi.fanout.Fanout` says which part goes to a subscriber
that joined while the feed was behind). A session never blocks: its
own bounded queues decide what a slow subscriber loses (LAG), so one stalled browser
costs the feed, the engine and the other subscribers nothing.

The feed ends with its last subscriber; when the engine subscription ends (the stream was
deleted, the server stops) every subscriber gets SUBSCRIPTION_CLOSED.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from headwater.api import MAX_CREDITS, RESUME, CloseReason, ReadResult, StreamInfo, Subscription
from headwater.protocols.kiwi.fanout import Fanout
from headwater.protocols.kiwi.frames import text_frame
from headwater.protocols.kiwi.results import batch_results
from headwater.server.kiwi.session import Detach, KiwiSession

if TYPE_CHECKING:
    from headwater.server.kiwi.gateway import Gateway

log = logging.getLogger("headwater.kiwi")

CLOSE_MESSAGES = {
    CloseReason.SERVER_SHUTDOWN: "the server is shutting down",
    CloseReason.STREAM_DELETED: "the stream was deleted",
    CloseReason.BACKPRESSURE_TIMEOUT: "the subscriber fell too far behind",
    CloseReason.PROTOCOL_ERROR: "the subscription failed on the server",
}

FeedKey = tuple[int, int, int]  # (tenant, stream, partition)


def feed_key(stream: StreamInfo, partition: int) -> FeedKey:
    return (stream.tenant_id, stream.stream_id, partition)


class StreamFeed:
    def __init__(self, gateway: Gateway, stream: StreamInfo, partition: int = 0) -> None:
        self.gateway = gateway
        self.stream = stream
        self.partition = partition
        self.source_id = stream.name
        self.key = feed_key(stream, partition)
        self.fanout: Fanout[KiwiSession] = Fanout()
        self.closed = False
        self.api = gateway.server.api
        self.subscription: Subscription = self.api.subscribe(
            stream.tenant_id,
            stream.stream_id,
            RESUME,
            MAX_CREDITS,
            None,
            None,
            self._on_close,
            deliver_read=self._deliver_read,
            partition=partition,
        )

    def attach(self, session: KiwiSession) -> Detach:
        """``session`` gets the events committed from now on."""
        end = self.api.readable_end(self.stream.tenant_id, self.stream.stream_id, self.partition)
        self.fanout.add(session, end)

        def detach() -> None:
            if self.fanout.remove(session) and not self.fanout:
                self.close()

        return detach

    def close(self) -> None:
        """The last subscriber left: end the engine subscription."""
        if self.closed:
            return
        self._forget()
        self.api.unsubscribe(self.subscription, CloseReason.CLIENT_CANCELLED)

    async def _deliver_read(self, sub: Subscription, result: ReadResult) -> None:
        if sub.credits < MAX_CREDITS // 2:
            self.api.grant(sub, MAX_CREDITS - sub.credits)
        first = result.first_offset
        if first is None:
            return
        routes = self.fanout.route(first, result.end_offset, lambda: _offsets(result))
        if not routes:
            return
        source_id = self.source_id
        # Encoded once for every subscriber; framed once for those that take frames
        # (packing connections take the bare messages and frame them as they write).
        messages: list[bytes] = []
        for span in result.spans:
            messages += batch_results(source_id, span.batch, span.start, span.stop, self.partition)
        frames: list[bytes] | None = None
        delivered, value_bytes = 0, 0
        for session, index in routes:
            if session.packed:
                shared = messages
            else:
                if frames is None:
                    frames = [text_frame(message) for message in messages]
                shared = frames
            try:
                if index == 0:
                    session.deliver(source_id, shared)
                    delivered += result.count
                    value_bytes += result.value_bytes
                else:  # joined while the feed was behind: from its start offset on
                    session.deliver(source_id, shared[index:])
                    delivered += len(shared) - index
                    value_bytes += sum(len(e.value) for e in list(result.events())[index:])
            except Exception:
                # One broken connection must not end the feed for the others.
                log.exception("delivering %s to a Kiwi session failed", source_id)
                self.fanout.remove(session)
                session.source_closed(source_id, CLOSE_MESSAGES[CloseReason.PROTOCOL_ERROR])
        self.gateway.metrics.record_read("kiwi", self.key[0], source_id, delivered, value_bytes)
        if not self.fanout:
            self.close()

    def _on_close(self, sub: Subscription, reason: CloseReason) -> None:
        self._forget()
        if reason is CloseReason.CLIENT_CANCELLED:
            return
        message = CLOSE_MESSAGES.get(reason, "the source ended")
        siblings = [
            feed
            for key, feed in self.gateway.feeds.items()
            if key[:2] == self.key[:2] and feed is not self
        ]
        for session in list(self.fanout):
            session.source_closed(self.source_id, message)
            # The source is closed for the session: the stream's other partitions stop
            # delivering to it too.
            for feed in siblings:
                if feed.fanout.remove(session) and not feed.fanout:
                    feed.close()

    def _forget(self) -> None:
        self.closed = True
        if self.gateway.feeds.get(self.key) is self:
            del self.gateway.feeds[self.key]


def _offsets(result: ReadResult) -> list[int]:
    return [event.offset for event in result.events()]


def attach_stream(gateway: Gateway, session: KiwiSession, stream: StreamInfo) -> Detach:
    """Subscribe ``session`` to every partition of ``stream`` through each partition's
    feed (started on first use)."""
    detaches: list[Detach] = []
    for partition in range(stream.partitions):
        key = feed_key(stream, partition)
        feed = gateway.feeds.get(key)
        if feed is None or feed.closed:
            feed = gateway.feeds[key] = StreamFeed(gateway, stream, partition)
        detaches.append(feed.attach(session))
    if len(detaches) == 1:
        return detaches[0]

    def detach() -> None:
        for one in detaches:
            one()

    return detach
