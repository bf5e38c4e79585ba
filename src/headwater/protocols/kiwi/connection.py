"""The sans-I/O state of one Kiwi WebSocket connection: subscriptions, pull-mode ring
buffers, lag accounting and the bounded outbox of messages waiting for the socket.

The application (the asyncio shell) drives it:

- :func:`~.messages.parse_command` turns a received message into a command (or a
  :class:`~.messages.KiwiProtocolError`: close the socket with its code);
- for SUBSCRIBE it resolves the source itself and calls :meth:`KiwiConnection.subscribe`
  or :meth:`KiwiConnection.reject_subscribe`; UNSUBSCRIBE and REQUEST are decided here
  (:meth:`KiwiConnection.unsubscribe`, :meth:`KiwiConnection.request`);
- a source's events come in through :meth:`KiwiConnection.deliver`, an ended source
  through :meth:`KiwiConnection.close_subscription`;
- whenever the socket can take more, it writes :meth:`KiwiConnection.take_outgoing`.

Every reply is queued when its command is handled, so it goes out before any RESULT the
command releases. The outbox holds at most ``send_capacity`` messages counted against
events: a push-mode event that finds it full is dropped, and a pull-mode event stays in
its ring buffer until there is room. Replies and notices are never dropped; the shell
stops reading commands while the outbox is full, so they stay bounded too.

Lag (per subscription) counts the events lost since the last delivery: push events
dropped at the full outbox and pull events overwritten in (or, past its capacity, never
entering) the ring buffer. When a loss brings lag to ``lag_notice_threshold`` or beyond,
a LAG notice with the lag is queued where the gap is; while that notice is still waiting
in the outbox, further losses update its count instead of queueing another. A delivery
resets lag to zero.

Results handed to :meth:`deliver` are opaque messages (the shell frames them once for
every connection); the messages this class makes itself pass through ``frame``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from headwater.errors import UsageError
from headwater.protocols.kiwi import messages as m
from headwater.protocols.kiwi.messages import Mode

DEFAULT_BUFFER_CAPACITY = 1024
DEFAULT_LAG_NOTICE_THRESHOLD = 1
DEFAULT_SEND_CAPACITY = 1024


def _unframed(payload: bytes) -> bytes:
    return payload


@dataclass(slots=True)
class _LagNotice:
    """A LAG notice waiting in the outbox; its count is final once it is taken."""

    source_id: str
    count: int
    taken: bool = False


@dataclass(slots=True)
class KiwiSubscription:
    source_id: str
    mode: Mode
    ring: deque[bytes]
    requested: int = 0
    lag: int = 0
    notice: _LagNotice | None = None
    delivered: int = 0
    lost: int = 0


@dataclass
class KiwiConnection:
    buffer_capacity: int = DEFAULT_BUFFER_CAPACITY
    lag_notice_threshold: int = DEFAULT_LAG_NOTICE_THRESHOLD
    send_capacity: int = DEFAULT_SEND_CAPACITY
    frame: Callable[[bytes], bytes] = _unframed
    subscriptions: dict[str, KiwiSubscription] = field(default_factory=dict)
    lost_events: int = 0  # every subscription's losses, for metrics

    def __post_init__(self) -> None:
        for name in ("buffer_capacity", "lag_notice_threshold", "send_capacity"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be at least 1")
        self._outbox: deque[bytes | _LagNotice] = deque()
        self._notices_queued = 0  # LAG notices in the outbox (frames to build on taking)

    # ---- commands ---------------------------------------------------------------------

    def subscribe(self, source_id: str, mode: Mode) -> KiwiSubscription:
        """Accept a SUBSCRIBE the application resolved: queue SUBSCRIBE_OK."""
        if source_id in self.subscriptions:
            raise UsageError(f"{source_id!r} is already subscribed; check subscribed()")
        sub = KiwiSubscription(source_id, mode, deque(maxlen=self.buffer_capacity))
        self.subscriptions[source_id] = sub
        self._queue(m.subscribe_ok(source_id))
        return sub

    def subscribed(self, source_id: str) -> bool:
        return source_id in self.subscriptions

    def reject_subscribe(self, source_id: str, error: str) -> None:
        self._queue(m.subscribe_error(source_id, error))

    def unsubscribe(self, source_id: str) -> bool:
        """UNSUBSCRIBE: True (UNSUBSCRIBE_OK queued) when there was a subscription to end,
        False (UNSUBSCRIBE_ERROR queued) otherwise."""
        if self.subscriptions.pop(source_id, None) is None:
            self._queue(m.unsubscribe_error(source_id, "not subscribed to this source"))
            return False
        self._queue(m.unsubscribe_ok(source_id))
        return True

    def request(self, source_id: str, n: int) -> bool:
        """REQUEST: add ``n`` to a pull subscription's outstanding count (REQUEST_OK),
        then release what its buffer holds; REQUEST_ERROR without a pull subscription."""
        sub = self.subscriptions.get(source_id)
        if sub is None:
            self._queue(m.request_error(source_id, "not subscribed to this source"))
            return False
        if sub.mode is not Mode.PULL:
            self._queue(m.request_error(source_id, "REQUEST needs a pull subscription"))
            return False
        if n < 1:
            raise UsageError("a request is for at least one event")
        sub.requested += n
        self._queue(m.request_ok(source_id, n))
        self._release(sub)
        return True

    # ---- source side ------------------------------------------------------------------

    def deliver(self, source_id: str, results: Sequence[bytes]) -> None:
        """New events of a source, in order (ignored without a subscription: a source
        may still be delivering what it read before an UNSUBSCRIBE)."""
        sub = self.subscriptions.get(source_id)
        if sub is None or not results:
            return
        room = self._room()
        if sub.mode is Mode.PUSH:
            taken = min(room, len(results))
            if taken:
                self._outbox.extend(results[:taken] if taken < len(results) else results)
                self._delivered(sub, taken)
            if taken < len(results):
                self._lose(sub, len(results) - taken)
            return
        ring = sub.ring
        # What already waits goes first, as far as credit and room allow: a full ring
        # took the new events over its oldest, which the room could have sent (lost).
        self._release(sub)
        room = self._room()
        rest: Sequence[bytes] = results
        if sub.requested and not ring and room:
            taken = min(sub.requested, room, len(results))
            self._outbox.extend(results[:taken])
            sub.requested -= taken
            self._delivered(sub, taken)
            rest = results[taken:]
        if rest:
            overflow = len(ring) + len(rest) - self.buffer_capacity
            ring.extend(rest)  # a full ring drops its oldest: maxlen
            if overflow > 0:
                self._lose(sub, overflow)
            self._release(sub)

    def push_now(self, source_id: str, count: int) -> bool:
        """Whether ``count`` new events of ``source_id`` may skip the outbox and go
        straight to the socket: a push subscription, nothing queued before them (so they
        are written in order) and no more than the outbox would take. True counts them
        as delivered, and the caller writes them; False: :meth:`deliver` them. A fan-out
        hands every commit to each subscriber, and a subscriber keeping up is this case."""
        sub = self.subscriptions.get(source_id)
        if (
            sub is None
            or sub.mode is not Mode.PUSH
            or self._outbox
            or not 0 < count <= self.send_capacity
            # A pull subscription with requests and buffered events is released into
            # the outbox at the next take: after these, in deliver()'s order too.
            or any(other.requested and other.ring for other in self.subscriptions.values())
        ):
            return False
        self._delivered(sub, count)
        return True

    def close_subscription(self, source_id: str, message: str) -> bool:
        """The source ended (or went away): queue SUBSCRIPTION_CLOSED; False when there
        was no such subscription."""
        if self.subscriptions.pop(source_id, None) is None:
            return False
        self._queue(m.subscription_closed(source_id, message))
        return True

    def close_all(self, message: str) -> list[str]:
        """Close every subscription (server shutdown); returns their source ids."""
        closed = list(self.subscriptions)
        for source_id in closed:
            self.close_subscription(source_id, message)
        return closed

    # ---- socket side ------------------------------------------------------------------

    @property
    def backlog(self) -> int:
        """Messages waiting for the socket."""
        return len(self._outbox)

    @property
    def full(self) -> bool:
        return len(self._outbox) >= self.send_capacity

    def take_outgoing(self) -> list[bytes]:
        """Everything queued, in order; then pull subscriptions with outstanding requests
        refill the emptied outbox from their buffers, and that is taken too."""
        out = self._take()
        for sub in self.subscriptions.values():
            if sub.requested and sub.ring:
                self._release(sub)
        if self._outbox:
            out += self._take()
        return out

    # ---- internals --------------------------------------------------------------------

    def _queue(self, payload: bytes) -> None:
        self._outbox.append(self.frame(payload))

    def _room(self) -> int:
        return max(0, self.send_capacity - len(self._outbox))

    def _take(self) -> list[bytes]:
        if not self._notices_queued:
            # Only frames: taken in one copy, not a step per message (a fan-out takes
            # every commit's messages from each subscriber's outbox).
            frames = cast(list[bytes], list(self._outbox))
            self._outbox.clear()
            return frames
        self._notices_queued = 0
        out: list[bytes] = []
        frame = self.frame
        for item in self._outbox:
            if isinstance(item, bytes):
                out.append(item)
            else:
                item.taken = True
                out.append(frame(m.lag_notice(item.source_id, item.count)))
        self._outbox.clear()
        return out

    def _release(self, sub: KiwiSubscription) -> None:
        n = min(sub.requested, len(sub.ring), self._room())
        if n <= 0:
            return
        ring = sub.ring
        outbox = self._outbox
        for _ in range(n):
            outbox.append(ring.popleft())
        sub.requested -= n
        self._delivered(sub, n)

    @staticmethod
    def _delivered(sub: KiwiSubscription, count: int) -> None:
        sub.delivered += count
        sub.lag = 0
        sub.notice = None  # a later loss starts a new notice, after these events

    def _lose(self, sub: KiwiSubscription, count: int) -> None:
        sub.lag += count
        sub.lost += count
        self.lost_events += count
        if sub.lag < self.lag_notice_threshold:
            return
        notice = sub.notice
        if notice is not None and not notice.taken:
            notice.count = sub.lag
            return
        sub.notice = _LagNotice(sub.source_id, sub.lag)
        self._outbox.append(sub.notice)
        self._notices_queued += 1
