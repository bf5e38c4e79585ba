"""A partition log's compaction held at the rename of a rewritten segment, and who came
for the log's rewrite lock meanwhile: for the tests of what may run beside a rewrite (a
cut, a close, a stream's delete)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from headwater.storage.log import PartitionLog
from headwater.storage.segment import Segment
from waiting import wait_until


class SeenLock:
    """The log's rewrite lock, noting which threads came to take it."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.takers: list[threading.Thread] = []

    def __enter__(self) -> None:
        self.takers.append(threading.current_thread())
        self.lock.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.lock.release()

    def came_for(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` came to take the lock (or ended without it)."""
        return thread in self.takers or not thread.is_alive()


class HeldRewrite:
    """``plog``'s rewrite lock seen (``lock``, a :class:`SeenLock` by default) and its
    compaction held before the rename of its first rewritten segment: ``at_rename`` is
    set there, and it goes on once ``go_on`` is."""

    def __init__(self, plog: PartitionLog, lock: SeenLock | None = None) -> None:
        self.plog = plog
        self.lock = lock if lock is not None else SeenLock(plog._rewrite_lock)
        plog._rewrite_lock = self.lock  # type: ignore[assignment]
        self.at_rename, self.go_on = threading.Event(), threading.Event()
        replace = plog._replace_segment

        def held_replace(seg: Segment, rewritten: Path) -> Segment:
            self.at_rename.set()
            assert self.go_on.wait(30), "the test never let the compaction go on"
            return replace(seg, rewritten)

        plog._replace_segment = held_replace  # type: ignore[method-assign]

    def beside(self, compaction: threading.Thread, target: Callable[[], object]) -> None:
        """With ``compaction`` held at its rename, run ``target`` in a thread; once it
        came for the rewrite lock (or ended: it took none), let the compaction go on,
        and wait for both to end."""
        assert self.at_rename.wait(30), "the compaction never rewrote a segment"
        other = threading.Thread(target=target)
        other.start()
        wait_until(lambda: self.lock.came_for(other))
        self.go_on.set()
        compaction.join(30)
        other.join(30)
        assert not compaction.is_alive() and not other.is_alive()
