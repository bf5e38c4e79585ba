"""Read-ahead for sequential readers: the next page of a read that stopped at its byte or
event budget is read while the reader is handling this one.

A reader paging through old data (ReadEvents from offset 0) asks for page n + 1 only
once it has page n; without read-ahead the server's read of the next page (the disk, the
copy) and the client's handling of this one take turns. A page started here is handed
to the next read of exactly the same arguments from the offset this one stopped at. It
is only served when it too stopped at its budget: a page cut by the budget below the
end is what a fresh read would answer (what is stored below the end does not change), a
page that reached the end may be short of events stored since. At most ``limit`` pages
are held server-wide (the oldest dropped first) and none longer than ``max_age_s``, so
the read-ahead is bounded: a page is at most one read chunk (storage/log.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any

from headwater.storage.log import ReadResult

ReadKey = tuple[Any, ...]


class ReadAhead:
    def __init__(self, limit: int = 2, max_age_s: float = 2.0) -> None:
        self.limit = limit
        self.max_age_s = max_age_s
        self._pages: OrderedDict[ReadKey, tuple[float, asyncio.Task[ReadResult]]] = OrderedDict()
        self.served = 0  # pages handed to a read (for tests and metrics)

    def __len__(self) -> int:
        return len(self._pages)

    async def take(self, key: ReadKey) -> ReadResult | None:
        """The page read ahead for ``key`` if there is one still good to serve."""
        entry = self._pages.pop(key, None)
        if entry is None:
            return None
        started, task = entry
        if time.monotonic() - started > self.max_age_s:
            task.cancel()
            return None
        try:
            result = await task
        except Exception:
            return None  # read again: the fresh read raises what it must
        if result.next_offset is None:
            return None  # it reached the end: more may be stored by now
        self.served += 1
        return result

    def start(self, key: ReadKey, read: Callable[[], Coroutine[Any, Any, ReadResult]]) -> None:
        if key in self._pages:
            return
        while len(self._pages) >= self.limit:
            _, (_, oldest) = self._pages.popitem(last=False)
            oldest.cancel()
        task = asyncio.ensure_future(read())
        task.add_done_callback(_retrieve)
        self._pages[key] = (time.monotonic(), task)

    def close(self) -> None:
        for _, task in self._pages.values():
            task.cancel()
        self._pages.clear()


def _retrieve(task: asyncio.Task[ReadResult]) -> None:
    # A page nobody takes may have failed (a segment removed by retention meanwhile):
    # the read that wanted it reads again and gets the error; nothing to log here.
    if not task.cancelled():
        task.exception()
