"""The subscribers of one stream partition that share one reader: who gets which part of
each read.

The gateway reads a stream partition once for all of its Kiwi subscribers and encodes
each event once; every subscriber then takes the same frames into its own connection,
whose queues (ring buffer, outbox, LAG) stay its own. Subscriptions start live, at the
partition's end when they join, but the shared reader may still be behind that point
(events committed but not read yet), so a read can begin before a newcomer's start: the
newcomer gets only the part from its start offset on. Once a read reaches past its start,
the subscriber is live and gets every later read whole.

Pure bookkeeping: the shell passes the first and end offsets of each read and, only when
a subscriber joined after the first event of the read, the offsets of its events.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Generic, TypeVar

from headwater.errors import UsageError

S = TypeVar("S", bound=Hashable)


class Fanout(Generic[S]):
    def __init__(self) -> None:
        self._live: dict[S, None] = {}  # insertion-ordered set
        self._joining: dict[S, int] = {}  # subscriber -> first offset it gets

    def __len__(self) -> int:
        return len(self._live) + len(self._joining)

    def __contains__(self, subscriber: object) -> bool:
        return subscriber in self._live or subscriber in self._joining

    def __iter__(self) -> Iterator[S]:
        yield from list(self._live)
        yield from list(self._joining)

    def add(self, subscriber: S, start_offset: int) -> None:
        """``subscriber`` gets the events from ``start_offset`` on (the partition's end
        when it subscribes: the reader is never past it)."""
        if subscriber in self:
            raise UsageError("already a subscriber of this partition")
        if start_offset < 0:
            raise UsageError("an offset is never negative")
        self._joining[subscriber] = start_offset

    def remove(self, subscriber: S) -> bool:
        """Stop delivering to ``subscriber``; False when it was not a subscriber."""
        if subscriber in self._live:
            del self._live[subscriber]
            return True
        return self._joining.pop(subscriber, None) is not None

    def route(
        self, first_offset: int, end_offset: int, offsets: Callable[[], Sequence[int]]
    ) -> list[tuple[S, int]]:
        """Who gets a read of the events from ``first_offset`` (the first event's offset)
        to before ``end_offset``: ``(subscriber, index)`` pairs, each subscriber taking the
        read's events from ``index`` on. ``offsets`` gives the offsets of the read's events,
        ascending; it is called only when a joining subscriber's start falls after the
        first event (the reader was behind when it joined)."""
        out = [(subscriber, 0) for subscriber in self._live]
        if not self._joining:
            return out
        event_offsets: Sequence[int] | None = None
        for subscriber, start in list(self._joining.items()):
            if start >= end_offset:
                continue  # everything read so far is from before it subscribed
            if start <= first_offset:
                index = 0
            else:
                if event_offsets is None:
                    event_offsets = offsets()
                index = bisect_left(event_offsets, start)
                if index == len(event_offsets):
                    index = -1  # the read ends with offsets compacted away: nothing for it
            if index >= 0:
                out.append((subscriber, index))
            del self._joining[subscriber]
            self._live[subscriber] = None
        return out
