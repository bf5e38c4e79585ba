"""Subscriptions to a kind: a bounded live buffer filled by the engine, drained by a
front end.

The engine pushes each window's notifications right after the window is durable and the
state readers see has moved on, so a subscription registered before a bootstrap scan
misses nothing (the scan may repeat what a live notification said: highest version
wins). A live buffer holds at most ``capacity`` notifications; a push that would pass it
ends the subscription with :class:`~.errors.SubscriptionOverflow` instead of waiting:
one slow reader never holds back writers or other readers. Bootstrap is not buffered:
the front end reads it from the state at its own pace (backpressure).

The limit counts notifications waiting behind a reader that is busy (its socket is not
taking more): a reader waiting in :meth:`KindSubscription.next_batch` takes a whole
window at once, however large.

The buffer keeps each window's notifications as the one sequence the engine pushed to
every subscriber (:meth:`KindSubscription.next_windows`), so a front end can encode a
window once and frame the same bytes for every subscriber.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence

from headwater.engine.kinds.errors import SubscriptionOverflow
from headwater.engine.kinds.model import Notification


class KindSubscription:
    """A live subscription to one kind (create it with ``TenantKinds.subscribe``)."""

    def __init__(
        self,
        kind_id: int,
        *,
        include_previous: bool,
        events: bool,
        capacity: int,
        on_close: Callable[[KindSubscription], None],
    ) -> None:
        self.kind_id = kind_id
        self.include_previous = include_previous
        self.events = events
        self.capacity = capacity
        self.buffer: deque[Sequence[Notification]] = deque()  # windows, as pushed
        self.buffered = 0  # notifications in ``buffer``
        self.overflowed = False
        self.closed = False
        self.waiting = False  # the reader is blocked in next_batch, ready for more
        self._wake = asyncio.Event()
        self._on_close = on_close

    def push(self, notes: Sequence[Notification]) -> None:
        """Engine side: add a window's notifications, or overflow."""
        if self.closed or not notes:
            return
        if self.waiting and not self.buffer:
            # The reader is waiting for this very push: it takes the whole window at
            # once, so a window larger than the buffer never fails a reader keeping up.
            self.buffer.append(notes)
            self.buffered += len(notes)
            self._wake.set()
            return
        if self.buffered + len(notes) > self.capacity:
            self.overflowed = True
            self.take_buffered()  # the reader is told at once, not after the backlog
            self.close()
            return
        self.buffer.append(notes)
        self.buffered += len(notes)
        self._wake.set()

    def take_buffered(self) -> list[Notification]:
        """Everything buffered, now (empty when nothing is)."""
        notes = [note for window in self.buffer for note in window]
        self.buffer.clear()
        self.buffered = 0
        return notes

    async def next_batch(self) -> list[Notification]:
        """Everything buffered (waits while empty). Raises SubscriptionOverflow after an
        overflow and returns [] once the subscription is closed otherwise."""
        return [note for window in await self.next_windows() for note in window]

    async def next_windows(self) -> list[Sequence[Notification]]:
        """:meth:`next_batch`, as the sequences the engine pushed (one per window, the
        same object for every subscriber of the kind)."""
        while not self.buffer:
            if self.overflowed:
                raise SubscriptionOverflow(
                    f"the subscriber fell {self.capacity} notifications behind"
                )
            if self.closed:
                return []
            self._wake.clear()
            self.waiting = True
            try:
                await self._wake.wait()
            finally:
                self.waiting = False
        windows = list(self.buffer)
        self.buffer.clear()
        self.buffered = 0
        return windows

    def close(self) -> None:
        """Stop delivering; wakes a waiting :meth:`next_batch`."""
        if not self.closed:
            self.closed = True
            self._on_close(self)
        self._wake.set()
