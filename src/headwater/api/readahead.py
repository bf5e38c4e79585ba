"""Read-ahead for sequential readers: the next pages of a read that stopped at its byte
or event budget are read while the reader is handling this one.

A reader paging through old data (ReadEvents from offset 0) asks for page n + 1 only
once it has page n; without read-ahead the server's read of the next page (the disk, the
copy) and the client's handling of this one take turns. A page started here is handed
to the next read of exactly the same arguments from the offset this one stopped at. It
is only served when it too stopped at its budget: a page cut by the budget below the
end is what a fresh read would answer (what is stored below the end does not change), a
page that reached the end may be short of events stored since.

A reader's pages can be read ahead ``depth`` deep (``follow``): its next page is
read in a worker thread together with the page after it, which that thread reads as
soon as the first is done, while the loop sends a page and the client handles it; a page
taken with the one after it already read starts the next such read. Started only once
the reader took its page, from the loop, the next read began after the loop had sent
that page (the thread waited for the GIL): the disk idled about a third of a cold read.
At most ``limit`` pages are held server-wide and none served after ``max_age_s``: a page
is at most one read chunk (storage/log.py). When room is needed, a page read ahead by
a chain goes before one a reader asked for, so many readers each keep the page after
the one they are reading.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from headwater.storage.log import ReadResult

# A page's key: the read's arguments, the offset it starts at last.
ReadKey = tuple[Any, ...]
# A page at an offset, and the page after it when that is read too (None: it is not).
Pages = tuple[Awaitable[ReadResult], Awaitable[ReadResult] | None]
ReadAt = Callable[[int], Pages]


@dataclass
class _Page:
    started: float
    task: asyncio.Future[ReadResult]
    follow: ReadAt | None  # reads the pages after this one, from the offset it stops at
    then: Awaitable[ReadResult] | None  # the page after this one, already being read
    chained: bool  # read ahead by a chain, not asked for by a read


class ReadAhead:
    def __init__(self, limit: int = 2, max_age_s: float = 2.0, depth: int = 2) -> None:
        self.limit = limit
        self.max_age_s = max_age_s
        self.depth = depth
        self._pages: OrderedDict[ReadKey, _Page] = OrderedDict()
        self.served = 0  # pages handed to a read (for tests and metrics)
        self.chained = 0  # pages a chain read ahead (for tests and metrics)

    def __len__(self) -> int:
        return len(self._pages)

    def room(self) -> bool:
        """Whether one more page may be held (asked from worker threads too)."""
        return len(self._pages) < self.limit

    async def take(self, key: ReadKey) -> ReadResult | None:
        """The page read ahead for ``key`` if there is one still good to serve."""
        page = self._pages.pop(key, None)
        if page is None:
            return None
        if time.monotonic() - page.started > self.max_age_s:
            page.task.cancel()
            return None
        try:
            # Shielded: a page let go (the thread did not read it) is cancelled, which
            # must not cancel this read, only send it to read afresh.
            result = await asyncio.shield(page.task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            return None
        except Exception:
            return None  # read again: the fresh read raises what it must
        if result.next_offset is None:
            return None  # it reached the end: more may be stored by now
        self.served += 1
        # A chain that stopped at its depth goes on from the page after this one.
        after_key = (*key[:-1], result.next_offset)
        after = self._pages.get(after_key)
        if after is not None and after.task.done():
            self._follow(after_key, after)
        return result

    def start(
        self,
        key: ReadKey,
        read: Callable[[], Awaitable[ReadResult]] | None = None,
        follow: ReadAt | None = None,
    ) -> None:
        """Read the page of ``key`` (its last element is the offset it starts at) with
        ``read``, or with ``follow`` at that offset, which reads the pages after it too,
        up to ``depth`` ahead of the reader."""
        if key in self._pages:
            return
        while len(self._pages) >= self.limit:
            self._drop_one()
        if read is not None:
            self._add(key, (read(), None), follow, chained=False)
        elif follow is not None:
            self._add(key, follow(key[-1]), follow, chained=False)

    def _add(self, key: ReadKey, pages: Pages, follow: ReadAt | None, *, chained: bool) -> None:
        task = asyncio.ensure_future(pages[0])
        page = _Page(time.monotonic(), task, follow, pages[1], chained)
        self._pages[key] = page
        task.add_done_callback(_retrieve)
        if follow is not None:
            task.add_done_callback(lambda _: self._follow(key, page))

    def _follow(self, key: ReadKey, page: _Page) -> None:
        """Hold the page after ``page`` (done, held or taken), or start reading it, if
        ``page`` stopped at its budget and the reader's pages and the server's leave
        room, taking none; otherwise the page after it is let go."""
        then, page.then = page.then, None
        task, follow = page.task, page.follow
        next_offset = None
        if not task.cancelled() and task.exception() is None:
            next_offset = task.result().next_offset
        reader = key[:-1]
        next_key = (*reader, next_offset)
        if (
            follow is None
            or next_offset is None
            or next_key in self._pages
            or sum(1 for k in self._pages if k[:-1] == reader) >= self.depth
            or not self.room()
        ):
            if then is not None:
                asyncio.ensure_future(then).cancel()
            return
        self.chained += 1
        self._add(
            next_key,
            (then, None) if then is not None else follow(next_offset),
            follow,
            chained=True,
        )

    def _drop_one(self) -> None:
        # The newest page a chain read ahead, else the oldest page.
        victim = next((k for k in reversed(self._pages) if self._pages[k].chained), None)
        if victim is None:
            victim = next(iter(self._pages))
        self._pages.pop(victim).task.cancel()

    def close(self) -> None:
        for page in self._pages.values():
            page.task.cancel()
            if page.then is not None:
                asyncio.ensure_future(page.then).cancel()
        self._pages.clear()


def _retrieve(task: asyncio.Future[ReadResult]) -> None:
    # A page nobody takes may have failed (a segment removed by retention meanwhile):
    # the read that wanted it reads again and gets the error; nothing to log here.
    if not task.cancelled():
        task.exception()
