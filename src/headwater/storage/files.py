"""A bounded set of open segment files (``[limits] open_files``).

A server with thousands of streams cannot keep a descriptor open per segment: the
process's ``ulimit -n`` (often 1024) would be reached long before the streams are. Every
segment file is opened through one :class:`FileCache` per engine, which keeps at most
``capacity`` of them open and closes the least recently used one when another is needed,
reopening it on its next use. The active segment of an idle stream is closed like any
other and reopened for its next append.

A descriptor is only used while *pinned* (``with cache.pinned(handle) as fd``): a pinned
file is never closed under its user, so a descriptor number is never reused for another
file while a read or write is still on it. Pins last one system call or one scan, so the
open count may pass ``capacity`` by at most the number of operations running at that
moment (the worker threads plus the event loop); the next release closes the surplus.
Room is made *before* a file is opened (the least recently used one closed first), so a
(re)open never holds ``capacity + 1`` descriptors even for an instant: with thousands of
streams every reopen is such an instant, and a process counted at one of them (or sized
to ``ulimit -n``) would see the bound passed.

Linux reports a writeback error to an ``fsync`` on any descriptor of the file, one opened
after the write included, so closing a written file before its ``fdatasync`` loses no
durability (the sync reopens it).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

from headwater.errors import StorageError

DEFAULT_OPEN_FILES = 512


class SegmentFile:
    """One file the cache may open and close: its path, how to open it, and (while open)
    its descriptor."""

    __slots__ = ("closed", "fd", "path", "pins", "retired")

    def __init__(self, path: Path, fd: int = -1) -> None:
        self.path = path
        self.fd = fd
        self.pins = 0
        # No longer reopened from its path (deleted, or replaced by a compacted file):
        # the descriptor it still holds is the only way to the old bytes.
        self.retired = False
        # Closed for good (FileCache.close): the last pin's release closes the descriptor.
        # A retired file that is not closed stays open between pins, for its readers.
        self.closed = False

    def __repr__(self) -> str:
        return f"SegmentFile({self.path.name}, fd={self.fd}, pins={self.pins})"


class FileCache:
    """At most ``capacity`` segment files open at once (None: no bound), least recently
    used closed first. Thread-safe; one per engine (all its streams share it)."""

    def __init__(
        self, capacity: int | None = DEFAULT_OPEN_FILES, *, read_only: bool = False
    ) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError("open_files must be at least 1")
        self.capacity = capacity
        # Files opened for reading only (headwater check: a snapshot, a read-only mount).
        self._mode = os.O_RDONLY if read_only else os.O_RDWR
        self._lock = threading.Lock()
        # Open files, least recently used first.
        self._open: OrderedDict[SegmentFile, None] = OrderedDict()
        self.opens = 0  # files opened (first opens and reopens): for metrics and tests
        self.evictions = 0

    @property
    def open_count(self) -> int:
        return len(self._open)

    def create(self, path: Path) -> SegmentFile:
        """Create ``path`` (it must not exist) and hold it open."""
        handle = SegmentFile(path)
        with self._lock:
            self._make_room()
            handle.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            self._added(handle)
        return handle

    def handle(self, path: Path) -> SegmentFile:
        """An existing file, opened on first use."""
        return SegmentFile(path)

    @contextlib.contextmanager
    def pinned(self, handle: SegmentFile) -> Iterator[int]:
        """The file's descriptor, open (reopened if it was closed) and not closed by
        anyone until the block ends."""
        fd = self.pin(handle)
        try:
            yield fd
        finally:
            self.unpin(handle)

    def pin(self, handle: SegmentFile) -> int:
        """:meth:`pinned` without the context manager, for the append and read paths
        (a generator-based ``with`` costs as much as the rest of a small append): every
        ``pin`` must be followed by one :meth:`unpin`, in a ``finally``."""
        with self._lock:
            if handle.fd >= 0:
                handle.pins += 1
                if not handle.retired:
                    self._open.move_to_end(handle)
                return handle.fd
            if handle.retired:
                raise StorageError(f"{handle.path.name} was removed (retention or compaction)")
            self._make_room()
            handle.fd = os.open(handle.path, self._mode)
            handle.pins += 1
            self._added(handle)
            return handle.fd

    def unpin(self, handle: SegmentFile) -> None:
        with self._lock:
            handle.pins -= 1
            if handle.retired:
                if handle.closed and handle.pins == 0 and handle.fd >= 0:
                    self._close(handle)
            elif self.capacity is not None and len(self._open) > self.capacity:
                self._evict()

    def retire(self, handle: SegmentFile) -> None:
        """Keep ``handle`` open, outside the bound, until :meth:`close`: its path is about
        to be deleted or to name another file, and readers that still hold the segment
        must keep reading the old bytes."""
        with self._lock:
            if handle.retired:
                return
            if handle.fd < 0:
                handle.fd = os.open(handle.path, os.O_RDWR)
                self.opens += 1
            else:
                self._open.pop(handle, None)
            handle.retired = True

    def close(self, handle: SegmentFile) -> None:
        """Close for good (the segment is closed); a pinned file closes when released."""
        with self._lock:
            handle.retired = handle.closed = True
            self._open.pop(handle, None)
            if handle.pins == 0 and handle.fd >= 0:
                self._close(handle)

    def _added(self, handle: SegmentFile) -> None:
        """Count ``handle``, just opened after :meth:`_make_room` (lock held)."""
        self.opens += 1
        self._open[handle] = None

    def _make_room(self) -> None:
        """Before an open: close least recently used unpinned files until one more fits
        (lock held). When every open file is pinned the open goes past the bound, and the
        release of a pin closes the surplus (:meth:`unpin`)."""
        if self.capacity is not None and len(self._open) >= self.capacity:
            self._evict(self.capacity - 1)

    def _evict(self, keep: int | None = None) -> None:
        """Close least recently used unpinned files until at most ``keep`` (default:
        ``capacity``) are open (lock held)."""
        assert self.capacity is not None
        excess = len(self._open) - (self.capacity if keep is None else keep)
        for handle in list(self._open):
            if excess <= 0:
                return
            if handle.pins:
                continue
            self._close(handle)
            self.evictions += 1
            excess -= 1

    def _close(self, handle: SegmentFile) -> None:
        self._open.pop(handle, None)
        fd, handle.fd = handle.fd, -1
        os.close(fd)
