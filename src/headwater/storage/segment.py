"""One segment of a partition log: a ``.log`` of batches plus its two sparse indexes.

Files are named by the zero-padded base offset (``00000000000000000000.log``). The offset
index (``.index``) holds ``u32 relative offset | u32 file position`` entries, one for the
first batch and then one whenever ``index_interval_bytes`` have been written since the last
entry, so a lookup is a binary search and a short scan. The time index (``.timeindex``)
holds ``i64 max timestamp | u32 relative offset`` entries whenever a batch raises the
segment's maximum timestamp. Index files are derived data: a missing or damaged one is
rebuilt from the ``.log``.

A sealed segment of a stream with ``compression`` holds compressed frames of batches
(``compression.py``) instead of bare batches: every reader here walks *units*, a batch
or a frame told apart by the magic byte, and a frame yields the batches it holds. Index
entries of a compressed segment point at frames.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import struct
import sys
import threading
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import crc32c

from headwater.errors import CorruptBatchError, StorageError
from headwater.storage.batch import HEADER, HEADER_SIZE, Batch, peek_length
from headwater.storage.compression import decode_frame, is_frame
from headwater.storage.files import FileCache, SegmentFile

log = logging.getLogger(__name__)

INDEX_ENTRY = struct.Struct("<II")
INDEX_TRAILER = struct.Struct("<4sIQ")  # magic, CRC-32C of the entries, .log size
INDEX_MAGIC = b"HWIX"
TIME_ENTRY = struct.Struct("<qI")
SCAN_CHUNK = 8 << 20
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
NAME_DIGITS = 20


class WouldBlock(Exception):
    """A read in no-wait mode needed the disk: retry it where blocking is allowed."""


_nowait = threading.local()


@contextlib.contextmanager
def no_wait() -> Iterator[None]:
    """Within this block, reads on this thread only take what is in the page cache
    (``preadv`` with ``RWF_NOWAIT``) and raise :class:`WouldBlock` instead of waiting for
    the disk. The event loop reads hot data this way without a hop to a worker thread."""
    previous = getattr(_nowait, "on", False)
    _nowait.on = True
    try:
        yield
    finally:
        _nowait.on = previous


class ReadBuffers:
    """Large read buffers kept for reuse. A fresh multi-MiB buffer per read costs more
    than the read (the server's malloc maps and unmaps every block over 256 KiB, so each
    one is page-faulted in and zeroed again); a buffer is reused once nothing refers to
    it any more: no batch, memoryview or transport write still holds a view of it.
    At most ``max_bytes`` are kept; reads past that take a buffer of their own, which
    is freed as usual."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buffers: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, length: int) -> bytearray:
        """A buffer of at least ``length`` bytes that nobody else refers to."""
        with self._lock:
            buffers = self._buffers
            idle = None
            for i in range(len(buffers)):
                # Referents of an idle buffer: the list slot and getrefcount's argument.
                if sys.getrefcount(buffers[i]) == 2:
                    # Not one far too big: a reader keeping a batch keeps all of it.
                    if length <= len(buffers[i]) <= 4 * length:
                        return buffers[i]
                    idle = i
            size = -(-length // BUFFER_ROUND) * BUFFER_ROUND
            held = sum(map(len, buffers))
            if held + size > self.max_bytes and idle is not None:
                held -= len(buffers.pop(idle))  # make room: an idle one of the wrong size
            buffer = bytearray(size)
            if held + size <= self.max_bytes:
                buffers.append(buffer)
            return buffer

    def held_bytes(self) -> int:
        with self._lock:
            return sum(map(len, self._buffers))


BUFFER_ROUND = 1 << 20
# Reads of at least this much go through the pool; smaller ones are cheap to allocate
# and must not pin a big buffer (a batch kept by a reader keeps its buffer alive).
POOLED_READ = 1 << 20
# 32 MiB for readers' chunks and the pages held while they are sent.
READ_BUFFERS = ReadBuffers(32 << 20)
# O_DIRECT wants the file position, the length and the memory aligned to the device's
# logical block; a page covers every block size in use.
DIRECT_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass
class DirectReads:
    """Whether a unit larger than a reader's chunk and not in the page cache is read
    around it (O_DIRECT), how many were, and how many cold chunks a sequential reader
    read through the cache, dropped behind it (for tests and the benchmarks)."""

    enabled: bool = _O_DIRECT != 0
    count: int = 0
    bytes: int = 0
    sequential: int = 0  # a sequential reader's cold chunks, read through the page cache


DIRECT_READS = DirectReads()


def _read(fd: int, length: int, pos: int) -> bytes | bytearray | memoryview:
    nowait = getattr(_nowait, "on", False) and _RWF_NOWAIT != 0
    if nowait and length >= POOLED_READ and cached_share(fd, pos, length) < 1.0:
        # A large chunk not wholly cached: the read below would copy the part that is
        # and give up, and a no-wait read of a missing page still starts the kernel's
        # read-ahead there, filling the cache outside a reader's run (which drops it).
        raise WouldBlock
    if length < POOLED_READ:
        if not nowait:
            return os.pread(fd, length, pos)
        buf: bytearray | memoryview = bytearray(length)
    else:
        buf = memoryview(READ_BUFFERS.take(length))[:length]
    try:
        got = os.preadv(fd, [buf], pos, _RWF_NOWAIT if nowait else 0)
    except BlockingIOError:
        raise WouldBlock from None
    except OSError as exc:
        if nowait and exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return os.pread(fd, length, pos)  # filesystem without RWF_NOWAIT
        raise
    if got < length:
        if nowait and pos + got < os.fstat(fd).st_size:
            # Short: either the end of the file or a part not cached; let a thread decide.
            raise WouldBlock
        if isinstance(buf, memoryview):
            return buf[:got]
        del buf[got:]
    return buf


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _CachestatRange(ctypes.Structure):
    _fields_ = (("off", ctypes.c_uint64), ("len", ctypes.c_uint64))


class _Cachestat(ctypes.Structure):
    _fields_ = tuple(
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    )


# cachestat(2) (Linux 6.5; the same number on every architecture) counts a range's
# cached pages a folio at a time in one call; mincore needs a mapping and looks up every
# 4 KiB page (about 0.15-0.3 ms per 9 MiB chunk, asked once or twice per chunk a reader
# reads). Cleared when the kernel (or a seccomp filter) refuses it: mincore then.
_SYS_CACHESTAT = 451
_libc.syscall.restype = ctypes.c_long
_cachestat_works = sys.platform == "linux"


def cached_share(fd: int, pos: int, length: int) -> float:
    """The share of the pages of ``[pos, pos + length)`` that are in the page cache
    (cachestat, else mincore over a mapping that is never touched: neither reads
    anything in, where a no-wait read of a missing page starts the kernel's read-ahead
    there). 1.0 when it cannot tell."""
    global _cachestat_works
    start = pos - pos % mmap.PAGESIZE
    size = pos + length - start
    if size <= 0:
        return 1.0
    pages = -(-size // mmap.PAGESIZE)
    if _cachestat_works:
        span, stat = _CachestatRange(start, size), _Cachestat()
        if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) == 0:
            cached: int = stat.nr_cache
            return min(cached, pages) / pages
        if ctypes.get_errno() not in (errno.ENOSYS, errno.EPERM):
            return 1.0  # a descriptor it cannot look into (a pipe, say): as mincore would
        _cachestat_works = False
    address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if address is None or address == _MAP_FAILED:
        return 1.0
    try:
        vector = ctypes.create_string_buffer(pages)
        if _libc.mincore(address, size, vector) != 0:
            return 1.0
    finally:
        _libc.munmap(address, size)
    return (pages - vector.raw.count(0)) / pages


def _aligned_view(size: int) -> memoryview:
    """A pooled buffer's ``size`` bytes starting at a :data:`DIRECT_ALIGN` boundary."""
    buffer = READ_BUFFERS.take(size + DIRECT_ALIGN)
    shift = -ctypes.addressof(ctypes.c_char.from_buffer(buffer)) % DIRECT_ALIGN
    return memoryview(buffer)[shift : shift + size]


def _preadv_direct(fd: int, view: memoryview, start: int) -> int | None:
    """``view`` (aligned) read from ``start`` (aligned) of ``fd`` with O_DIRECT: the bytes
    read, or None where the file system refuses O_DIRECT (tmpfs).

    The descriptor is reopened through /proc/self/fd, so it is the same file even if it
    was renamed or unlinked since (compaction, retention); O_DIRECT on ``fd`` itself
    would change every reader sharing it. Dirty pages of the range are written back by
    the kernel before a direct read, so recently appended bytes read the same."""
    try:
        direct_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | _O_DIRECT)
    except OSError:
        return None
    try:
        got = os.preadv(direct_fd, [view], start)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise
    finally:
        os.close(direct_fd)
    DIRECT_READS.count += 1
    DIRECT_READS.bytes += got
    return got


def _read_direct(fd: int, length: int, pos: int) -> memoryview | None:
    """``length`` bytes at ``pos`` read with O_DIRECT into a pooled buffer, the disk's
    data copied by the device straight into it; None where the file system refuses
    O_DIRECT, to be read through the page cache instead."""
    start = pos - pos % DIRECT_ALIGN
    skip = pos - start
    view = _aligned_view(-(-(skip + length) // DIRECT_ALIGN) * DIRECT_ALIGN)
    got = _preadv_direct(fd, view, start)
    if got is None:
        return None
    return view[skip : max(skip, min(got, skip + length))]


# A sequential reader's cold chunks are read through the page cache, and what it was
# handed is dropped behind it. On the test machine's disk a direct read returns only when
# its request is done, so direct reads one after another (even with the next read
# ahead in a thread) left the disk idle while each chunk was checked and sent: about
# 0.6 of a buffered sequential read. A buffered read has the kernel's read-ahead, which
# keeps reading meanwhile (the file is marked sequential: twice the device's window).
# So that a stream read once neither fills the page cache nor evicts what other readers
# keep hot, the pages a reader went past are dropped (POSIX_FADV_DONTNEED) at its next
# read. A *run* is one reader going on through one segment: its next read starts within
# the range of its last. At most COLD_RUNS are followed; a run that reached its
# segment's end is dropped whole when another begins (its reader went on to the next).
COLD_RUNS = 8
# A range's DONTNEED leaves a large folio straddling its end (the page cache holds
# folios of up to a few MiB): each drop starts this much before where the last ended.
FOLIO_MARGIN = 8 << 20


@dataclass
class _ColdRun:
    seg: Segment
    first: int  # where the run began (a page boundary)
    dropped: int  # the pages from ``first`` below this were dropped (see FOLIO_MARGIN)
    last: int  # where the latest read began: one read is kept behind the reader
    end: int  # where the furthest read asked ends: the next read starts below it


_cold_runs: deque[_ColdRun] = deque()
_cold_runs_lock = threading.Lock()


def _drop_pages(seg: Segment, start: int, end: int) -> None:
    """Drop ``seg``'s page cache over ``[start, end)``."""
    if end > start:
        with contextlib.suppress(OSError, StorageError), seg.files.pinned(seg.file) as fd:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)


def _read_sequential(
    seg: Segment, fd: int, length: int, pos: int
) -> bytes | bytearray | memoryview | None:
    """``[pos, pos + length)`` if it goes on with a cold run of ``seg`` or starts one
    (mostly not cached), read through the page cache, with the pages the reader was
    handed before its previous read dropped; None for any other read."""
    done: list[_ColdRun] = []
    with _cold_runs_lock:
        run = next((r for r in _cold_runs if r.seg is seg and r.dropped <= pos <= r.end), None)
        if run is not None:
            # Read-ahead threads may read a reader's pages out of turn, and pages being
            # read are not dropped: drop up to where the read before this one began.
            drop_from = max(run.first, run.dropped - FOLIO_MARGIN)
            if pos > run.last:
                run.dropped, run.last = max(run.dropped, run.last - run.last % mmap.PAGESIZE), pos
            run.end = max(run.end, pos + length)
            drop_to = run.dropped
    if run is None:
        if getattr(_nowait, "on", False) or cached_share(fd, pos, length) >= 0.5:
            return None
        # Marked sequential: the kernel's read-ahead window for this file is doubled.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        drop_from = drop_to = start = pos - pos % mmap.PAGESIZE
        with _cold_runs_lock:
            done = [r for r in _cold_runs if r.end >= r.seg.size]
            for r in done:
                _cold_runs.remove(r)
            _cold_runs.append(_ColdRun(seg, start, start, pos, pos + length))
            if len(_cold_runs) > COLD_RUNS:
                done.append(_cold_runs.popleft())
    data = _read(fd, length, pos)
    if drop_to > drop_from:
        os.posix_fadvise(fd, drop_from, drop_to - drop_from, os.POSIX_FADV_DONTNEED)
    for r in done:
        _drop_pages(r.seg, r.first, r.end)
    DIRECT_READS.sequential += 1
    return data


def _read_chunk(fd: int, length: int, pos: int) -> tuple[bytes | bytearray | memoryview, bool]:
    """A unit larger than a reader's chunk, read whole, and whether it was read around the
    page cache.

    Mostly not in the page cache, it is read with O_DIRECT: one read, no page cache fill,
    no copy out of it, and nothing evicted that other readers keep hot (a sequential
    reader's chunks go through the cache instead, dropped behind it: _read_sequential).
    Cached data, and any read on the event loop (no-wait), go through the page cache.
    The bytes are the same either way, and every batch's CRC is checked on them."""
    if (
        DIRECT_READS.enabled
        and length >= POOLED_READ
        and not getattr(_nowait, "on", False)
        and cached_share(fd, pos, length) < 0.5
    ):
        data = _read_direct(fd, length, pos)
        if data is not None:
            return data, True
    return _read(fd, length, pos), False


def segment_name(base_offset: int, suffix: str) -> str:
    return f"{base_offset:0{NAME_DIGITS}d}{suffix}"


@dataclass
class ScanReport:
    """What a full scan of one segment found."""

    path: Path
    batches: int = 0
    events: int = 0
    valid_bytes: int = 0
    file_bytes: int = 0
    errors: list[str] = field(default_factory=list)


_I64 = struct.Struct("<q")
_U32_MAX = 0xFFFFFFFF
# Entries are read in place as native u32 words where those are the files' (little-endian)
# u32s; elsewhere the files are read and their words swapped into arrays.
_MAP_INDEXES = sys.byteorder == "little" and array("I").itemsize == 4
_map_failures = 0  # mappings refused (vm.max_map_count reached, say): files read instead


def _default_mapped_index_limit() -> int:
    """Sealed indexes kept open at once: an eighth of ``vm.max_map_count`` (two
    mappings each: a quarter of the process's mappings), leaving the rest to the heap,
    threads, libraries and DuckDB."""
    try:
        max_map_count = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        max_map_count = 65530  # Linux's default
    return max(16, max_map_count // 8)


# The process's open sealed indexes (not retired), oldest first: at most
# ``mapped_index_limit``. Opening another closes the oldest not looked up since the
# last pass over it (a second chance, CLOCK: a lookup sets ``touched`` and takes no
# lock). Retired ones are held outside the bound until closed. ``_maps_lock`` guards
# every index's opening and closing and this table.
mapped_index_limit = _default_mapped_index_limit()
_open_indexes: OrderedDict[SealedIndex, None] = OrderedDict()
_maps_lock = threading.Lock()


def set_mapped_index_limit(limit: int) -> None:
    """Keep at most ``limit`` sealed indexes mapped (two mappings each)."""
    global mapped_index_limit
    if limit < 1:
        raise ValueError("the mapped index limit must be at least 1")
    with _maps_lock:
        mapped_index_limit = limit
        _evict_indexes()


def mapped_index_count() -> int:
    """Sealed indexes open now within the bound (retired ones are not counted)."""
    with _maps_lock:
        return len(_open_indexes)


def _evict_indexes(keep: int | None = None) -> None:
    """Close indexes, oldest first, until at most ``keep`` (default: the limit) are open
    (lock held); one looked up since the last pass goes to the back once instead."""
    keep = mapped_index_limit if keep is None else keep
    spared = 0
    while len(_open_indexes) > keep:
        index, _ = _open_indexes.popitem(last=False)
        if index.touched and spared < len(_open_indexes):
            index.touched = False
            _open_indexes[index] = None
            spared += 1
        else:
            index._close_entries()


class _MapRefused(OSError):
    """mmap(2) refused a mapping (ENOMEM past vm.max_map_count, say)."""


def _words(entries: memoryview) -> memoryview:
    """The u32 words of little-endian ``entries``, in place where they are native."""
    if _MAP_INDEXES:
        return entries.cast("I")
    words = array("I", entries.tobytes())
    if sys.byteorder != "little":
        words.byteswap()
    return memoryview(words)


def _map_file(path: Path) -> tuple[memoryview, int, int]:
    """``path`` mapped read-only: a view of its bytes, the mapping's address and size.
    The descriptor is closed at once (a mapping does not need it; Python's ``mmap``
    would keep a duplicate open per mapping, two per sealed segment). FileNotFoundError
    when it is missing, ValueError when empty, _MapRefused when the mapping is refused."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise ValueError(f"{path.name} is empty")
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address is None or address == _MAP_FAILED:
            err = ctypes.get_errno()
            raise _MapRefused(err, f"mmap of {path.name}: {os.strerror(err)}")
    finally:
        os.close(fd)
    view = memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")
    return view, address, size


class _IndexEntries:
    """One opening of a sealed segment's two index files: views of their entries (in
    the files' mappings, or in ``bytes`` read from them where mapping was refused) and
    the mappings under them. The offset index is read as u32 words (relative offset,
    position); the time index's 12-byte entries as u32 words too: every third word is a
    relative offset, and the two words before it a timestamp's low and high halves."""

    __slots__ = (
        "_maps",
        "_views",
        "first_ms",
        "index_raw",
        "last_ms",
        "mapped",
        "positions",
        "rel_offsets",
        "time_count",
        "time_high",
        "time_low",
        "time_raw",
        "time_rel",
        "trailers",
    )

    def __init__(self, index_path: Path, time_path: Path) -> None:
        self._maps: list[tuple[int, int]] = []
        self._views: list[memoryview] = []
        self.mapped = True
        self.trailers: list[bytes] = []  # each file's trailer: magic, CRC, .log size
        try:
            self.index_raw = self._open(index_path, INDEX_ENTRY.size)
            words = self._keep(_words(self.index_raw))
            count = len(words) // 2
            self.rel_offsets = self._keep(words[0 : 2 * count : 2])
            self.positions = self._keep(words[1 : 2 * count : 2])
            self.time_raw = self._open(time_path, TIME_ENTRY.size)
            times = self._keep(_words(self.time_raw))
            count = len(self.time_raw) // TIME_ENTRY.size
            self.time_low = self._keep(times[0 : 3 * count : 3])
            self.time_high = self._keep(times[1 : 3 * count : 3])
            self.time_rel = self._keep(times[2 : 3 * count : 3])
            self.time_count = count
            self.first_ms = self.timestamp(0) if count else -1
            self.last_ms = self.timestamp(count - 1) if count else -1
        except BaseException:
            self.close()
            raise

    def _keep(self, view: memoryview) -> memoryview:
        self._views.append(view)
        return view

    def _open(self, path: Path, entry_size: int) -> memoryview:
        """The entries of one file (its trailer cut off, kept in ``trailers``)."""
        global _map_failures
        view: memoryview | None = None
        if _MAP_INDEXES:
            try:
                view, address, size = _map_file(path)
            except FileNotFoundError:
                raise ValueError(f"{path.name} is missing") from None
            except _MapRefused as exc:
                _map_failures += 1
                if _map_failures == 1:
                    log.warning("index files are read into memory, not mapped: %s", exc)
            else:
                self._maps.append((address, size))
                self._keep(view)
        if view is None:
            self.mapped = False
            try:
                view = self._keep(memoryview(path.read_bytes()))
            except FileNotFoundError:
                raise ValueError(f"{path.name} is missing") from None
        if len(view) < INDEX_TRAILER.size or (len(view) - INDEX_TRAILER.size) % entry_size:
            raise ValueError(f"{path.name} has a bad size")
        end = len(view) - INDEX_TRAILER.size
        self.trailers.append(view[end:].tobytes())
        return self._keep(view[:end])

    def close(self) -> None:
        """Release every view, then unmap. A view still exported elsewhere (none is
        handed out) keeps its mapping: leaked, never unmapped under a reader."""
        views, self._views = self._views, []
        try:
            for view in reversed(views):
                view.release()
        except BufferError:
            log.error("an index view is still in use: its mapping is left in place")
            return
        maps, self._maps = self._maps, []
        for address, size in maps:
            _libc.munmap(address, size)

    def sizes(self) -> tuple[int, int]:
        return len(self.index_raw), len(self.time_raw)

    def entry(self, i: int) -> tuple[int, int]:
        """The ``i``-th offset index entry: (relative offset, position)."""
        return int(self.rel_offsets[i]), int(self.positions[i])

    def position_for(self, rel_offset: int) -> int:
        """Position of the indexed unit at or before ``rel_offset`` (0 before all)."""
        i = bisect_right(self.rel_offsets, rel_offset) - 1
        return int(self.positions[i]) if i >= 0 else 0

    def unit_start_at_or_below(self, position: int) -> int:
        """The last indexed unit start at or before ``position``; -1 when none is."""
        i = bisect_right(self.positions, position) - 1
        return int(self.positions[i]) if i >= 0 else -1

    def position_for_timestamp(self, timestamp_ms: int) -> int:
        """Position to scan from for the first batch with max timestamp at least
        ``timestamp_ms``; -1 when no entry reaches it."""
        i = self.time_index_of(timestamp_ms)
        if i >= self.time_count:
            return -1
        return self.position_for(int(self.time_rel[i]))

    def time_index_of(self, timestamp_ms: int) -> int:
        """The first time entry whose timestamp is at least ``timestamp_ms``
        (bisect_left). Timestamps rise entry by entry and are never negative (an entry is
        made only when a batch raises the segment's maximum, which starts at -1), so
        they order as (high word, low word) pairs of u32s: searched in C over the words
        in place, no key function called per probe (three times slower)."""
        first_ms, last_ms = self.first_ms, self.last_ms
        if timestamp_ms <= first_ms:
            return 0
        if timestamp_ms > last_ms:
            return self.time_count
        if first_ms < 0:  # not written by this code: search the timestamps themselves
            stamps = range(self.time_count)
            return bisect_left(stamps, timestamp_ms, key=self.timestamp)
        high, low = timestamp_ms >> 32, timestamp_ms & _U32_MAX
        lo, hi = 0, self.time_count
        if first_ms >> 32 != last_ms >> 32:  # else every entry has this high word
            lo = bisect_left(self.time_high, high)
            hi = bisect_right(self.time_high, high, lo)
        return bisect_left(self.time_low, low, lo, hi)

    def timestamp(self, i: int) -> int:
        """The ``i``-th time entry's timestamp."""
        stamp: int = _I64.unpack_from(self.time_raw, i * TIME_ENTRY.size)[0]
        return stamp


class SealedIndex:
    """A sealed segment's two index files, searched where they lie.

    The files are mapped read-only on a segment's first lookup (or, where a mapping is
    refused, read into ``bytes``) and searched in place (:class:`_IndexEntries`), so
    lookups answer exactly what the arrays of the same entries answer. At most
    ``mapped_index_limit`` indexes are open at once (each is two of the process's
    ``vm.max_map_count`` mappings, 65530 by default): opening another closes an old one,
    opened again on its next lookup. What a segment's checks need (entry counts, first
    and last entries) is kept apart, without the files.

    Lifetime: entries are closed (evicted, or the segment closed) under ``_maps_lock``
    by releasing every view of them first, then unmapping. A lookup reads the mapping
    only through those views, and CPython checks a view's release, under the GIL, on
    every access: a lookup racing a close gets ValueError, never unmapped memory (the
    munmap comes after the releases), and :meth:`search` then looks up again under the
    lock, reopening the files (or, closed for good, answering None: the segment answers
    "from the start"). A view exported elsewhere cannot be released: its mapping is
    leaked rather than unmapped (none is handed out). This leans on the GIL: a
    free-threaded build would need a use count here.

    SIGBUS: a page of a mapping faults SIGBUS if its file is cut short underneath. Index
    files are never changed in place: they are written whole to a temporary file and
    renamed over (``Segment.write_index_files``: sealing, recovery's rebuild, compression)
    or unlinked (an active segment's at open, retention, compaction, compression,
    truncation); a mapping keeps the inode it was made of, so neither reaches it.
    ``headwater check`` and backups only read them. A retired segment (deleted or
    replaced: its paths may name another segment's files next) keeps the entries it holds
    open when retired and never reopens its paths; a segment reopens only files with the
    sizes and trailers (CRC of the entries) it first read. An I/O error on a page (a
    failing disk) faults as any mapped read would: that is not guarded."""

    __slots__ = (
        "_entries",
        "broken",
        "closed",
        "count",
        "first_ms",
        "first_position",
        "first_rel",
        "index_path",
        "last_ms",
        "last_position",
        "last_rel",
        "log_size",
        "mapped",
        "retired",
        "sizes",
        "time_count",
        "time_path",
        "touched",
        "trailers",
    )

    def __init__(self, index_path: Path, time_path: Path, log_size: int, *, check: bool) -> None:
        """Read both files once; ValueError unless they have whole entries and
        (``check``) their trailers vouch for them: CRC-32C of the entries, the .log's
        size. They are opened again on the first lookup."""
        self.index_path, self.time_path, self.log_size = index_path, time_path, log_size
        self._entries: _IndexEntries | None = None
        self.closed = self.retired = self.touched = False
        self.broken = False  # the files could not be reopened: no lookup is answered
        entries = _IndexEntries(index_path, time_path)
        try:
            self.mapped = entries.mapped
            paths = (index_path, time_path)
            raws = (entries.index_raw, entries.time_raw)
            for raw, trailer, path in zip(raws, entries.trailers, paths, strict=True):
                magic, crc, size = INDEX_TRAILER.unpack(trailer)
                if magic != INDEX_MAGIC or size != log_size:
                    raise ValueError(f"{path.name} does not match its log")
                if check and crc != crc32c.crc32c(raw):
                    raise ValueError(f"{path.name} does not match its log")
            # What the files are known by when they are opened again: sizes, and trailers
            # (the entries' CRC and the .log's size).
            self.sizes, self.trailers = entries.sizes(), entries.trailers
            self.count = len(entries.positions)
            self.time_count = entries.time_count
            self.first_ms, self.last_ms = entries.first_ms, entries.last_ms
            self.first_rel = self.last_rel = self.first_position = self.last_position = 0
            if self.count:
                self.first_rel, self.first_position = entries.entry(0)
                self.last_rel, self.last_position = entries.entry(self.count - 1)
        finally:
            entries.close()  # opened again, lazily, by the first lookup

    def __len__(self) -> int:
        return self.count

    def search(self, method: Callable[[_IndexEntries, int], int], arg: int) -> int | None:
        """``method(entries, arg)``; None when the index is closed or its files cannot
        be reopened. Lock-free while the entries are open (see the class's Lifetime)."""
        entries = self._entries
        if entries is not None:
            self.touched = True
            try:
                return method(entries, arg)
            except ValueError:  # closed under us: again, under the lock
                pass
        with _maps_lock:
            entries = self._open_entries()
            return None if entries is None else method(entries, arg)

    def _open_entries(self) -> _IndexEntries | None:
        """The entries, opened again if they were closed (lock held)."""
        entries = self._entries
        if entries is not None or self.closed or self.broken or self.retired:
            return entries
        entries = self._reopen()
        if entries is not None:
            _evict_indexes(mapped_index_limit - 1)  # room first: this one is not evicted
            self._entries = entries
            self.touched = True
            _open_indexes[self] = None
        return entries

    def _reopen(self) -> _IndexEntries | None:
        """The files opened again (lock held), if they are still the ones first read."""
        try:
            entries = _IndexEntries(self.index_path, self.time_path)
        except (OSError, ValueError) as exc:
            self.broken = True
            log.warning("index of %s cannot be reopened: %s", self.index_path.name, exc)
            return None
        if entries.sizes() != self.sizes or entries.trailers != self.trailers:
            entries.close()
            self.broken = True
            log.warning("index of %s changed underneath: not used", self.index_path.name)
            return None
        return entries

    def retire(self) -> None:
        """The files are about to be deleted or replaced: entries open now (the segment
        was looked up lately: a reader may still be on it) stay open, outside the bound,
        until :meth:`close`; closed ones are never opened again (their paths may name
        another segment's files), and the segment answers lookups "from the start". None
        is opened here: retention may retire thousands of segments at once."""
        with _maps_lock:
            if self.retired or self.closed:
                return
            _open_indexes.pop(self, None)
            self.retired = True

    def close(self) -> None:
        """Close for good (idempotent): the views released, then the files unmapped."""
        with _maps_lock:
            if self.closed:
                return
            self.closed = True
            _open_indexes.pop(self, None)
            self._close_entries()

    def _close_entries(self) -> None:
        entries, self._entries = self._entries, None
        if entries is not None:
            entries.close()

    def entries(self) -> list[tuple[int, int]]:
        """(relative offset, position) of every offset index entry."""
        with _maps_lock:  # held: nothing closes the entries while they are listed
            entries = self._open_or_fail()
            offsets, positions = entries.rel_offsets.tolist(), entries.positions.tolist()
        return list(zip(offsets, positions, strict=True))

    def time_entries(self) -> list[tuple[int, int]]:
        """(timestamp, relative offset) of every time index entry."""
        with _maps_lock:
            return list(TIME_ENTRY.iter_unpack(self._open_or_fail().time_raw))

    def _open_or_fail(self) -> _IndexEntries:
        entries = self._open_entries()
        if entries is None:
            raise ValueError(f"index of {self.index_path.name} is closed or unreadable")
        return entries

    def __del__(self) -> None:
        # Unreferenced: in no table and searched by no one, so no lock is needed (and
        # taking one here could deadlock a collection run while it is held).
        with contextlib.suppress(Exception):  # at interpreter exit the module may be gone
            self._close_entries()


class Segment:
    """A segment file and its indexes: arrays in memory while it is written (the active
    segment, or one being built or checked), its mapped index files once it is sealed
    (``sealed_index``; the arrays are then empty). Its ``.log`` is opened through
    ``files`` (a bounded set of open files shared by many segments): use the descriptor
    only inside ``with segment.pinned() as fd``."""

    def __init__(
        self,
        directory: Path,
        base_offset: int,
        index_interval_bytes: int,
        files: FileCache | None = None,
    ) -> None:
        self.directory = directory
        self.files = files if files is not None else FileCache(None)
        self.base_offset = base_offset
        self.index_interval_bytes = index_interval_bytes
        self.log_path = directory / segment_name(base_offset, ".log")
        self.index_path = directory / segment_name(base_offset, ".index")
        self.time_index_path = directory / segment_name(base_offset, ".timeindex")
        self.size = 0
        self.next_offset = base_offset
        self.event_count = 0
        self.first_timestamp_ms: int | None = None
        self.max_timestamp_ms = -1
        self.index_offsets = array("Q")
        self.index_positions = array("Q")
        self.time_timestamps = array("q")
        self.time_offsets = array("Q")
        # A sealed segment's index files, searched in place; None while the arrays hold
        # the index. Set before the arrays are emptied: a lookup reads the arrays first.
        self.sealed_index: SealedIndex | None = None
        self._bytes_since_index = 0
        self.compressed = False  # holds compressed frames (set by the scan or index load)
        self.file: SegmentFile = self.files.handle(self.log_path)

    def pinned(self) -> contextlib.AbstractContextManager[int]:
        """The ``.log``'s descriptor, kept open until the block ends."""
        return self.files.pinned(self.file)

    def retire(self) -> None:
        """Keep the current ``.log`` and index open until :meth:`close`: they are about
        to be deleted or replaced, and readers holding this segment still read them."""
        self.files.retire(self.file)
        if self.sealed_index is not None:
            self.sealed_index.retire()

    # ---- opening -------------------------------------------------------------------
    # A segment is constructed, then given a new file (create) or opened from the one on
    # disk (open_tail, open_sealed); each answers the segment itself.

    def create(self) -> Segment:
        """A new, empty segment file."""
        self.file = self.files.create(self.log_path)
        return self

    def open_tail(self) -> Segment:
        """Open the active segment after a possible crash: check every batch's CRC,
        truncate a torn or corrupt tail, and rebuild both indexes from what remains."""
        with self.pinned() as fd:
            report = self._scan_file(fd, verify=True, stop_at_error=True)
            file_size = os.fstat(fd).st_size
            if report.valid_bytes < file_size:
                log.warning(
                    "truncating %s from %d to %d bytes: %s (its events from offset %d on)",
                    self.log_path,
                    file_size,
                    report.valid_bytes,
                    "; ".join(report.errors) or "torn tail",
                    self.next_offset,
                )
                os.ftruncate(fd, report.valid_bytes)
                os.fsync(fd)
        # The active segment's indexes live in memory; files appear when it is sealed.
        self.index_path.unlink(missing_ok=True)
        self.time_index_path.unlink(missing_ok=True)
        return self

    def open_sealed(self, *, indexed: bool = True) -> Segment:
        """Open a sealed segment from its index, rebuilding the index if it is damaged
        or missing; ``indexed=False``: it has none yet (a compaction's rewrite), built
        without a warning."""
        with self.pinned() as fd:
            self.size = os.fstat(fd).st_size
            if not self._load_index():
                if indexed:
                    log.warning("rebuilding index of %s", self.log_path)
                self._reset_index()
                report = self._scan_file(fd, verify=True, stop_at_error=False)
                for error in report.errors:
                    log.error("sealed segment %s: %s", self.log_path, error)
                self.size = os.fstat(fd).st_size
                self.write_index_files(sync=True)
                self.map_index_files()
        return self

    def _reset_index(self) -> None:
        self.size = 0
        self.next_offset = self.base_offset
        self.event_count = 0
        self.first_timestamp_ms = None
        self.max_timestamp_ms = -1
        for arr in (self.index_offsets, self.index_positions):
            del arr[:]
        del self.time_timestamps[:]
        del self.time_offsets[:]
        if self.sealed_index is not None:
            self.sealed_index.close()
            self.sealed_index = None
        self._bytes_since_index = 0

    def drop_index(self) -> None:
        """Let the in-memory index go, for a segment only walked from its start from here
        on (a reader that looks nothing up: its reads are then cut at no entry)."""
        self.index_offsets, self.index_positions = array("Q"), array("Q")
        self.time_timestamps, self.time_offsets = array("q"), array("Q")

    def map_index_files(self) -> None:
        """Search the index files just written (sealing) where they lie and let the
        arrays go: a sealed segment's index then costs file pages the kernel can
        reclaim, not heap. Left on the arrays if the files cannot be opened."""
        try:
            index = SealedIndex(self.index_path, self.time_index_path, self.size, check=False)
        except (ValueError, OSError) as exc:
            log.warning("index of %s kept in memory: %s", self.log_path, exc)
            return
        self.sealed_index = index  # first: a lookup that read the arrays before uses them
        self.drop_index()

    def _load_index(self) -> bool:
        """Open both index files (:class:`SealedIndex`); False unless their trailers
        vouch for them (CRC of the entries and the size of the .log they describe) and
        the batches after the last entry run exactly to the end of the file."""
        try:
            index = SealedIndex(self.index_path, self.time_index_path, self.size, check=True)
        except ValueError:
            return False
        if not self._check_index(index):
            index.close()
            return False
        self.sealed_index = index
        return True

    def _check_index(self, index: SealedIndex) -> bool:
        if self.size == 0:
            return len(index) == 0
        if len(index) == 0 or index.first_position != 0:
            return False
        try:
            first, first_length = self._read_unit_at(0)
            if first[0].base_offset != self.base_offset + index.first_rel:
                return False
            self.compressed = first[0].length != first_length
            self.first_timestamp_ms = first[0].first_timestamp_ms
            pos = index.last_position
            expected = self.base_offset + index.last_rel
            while pos < self.size:
                unit, length = self._read_unit_at(pos)
                if expected >= 0 and unit[0].base_offset != expected:
                    return False
                expected = -1
                self.next_offset = unit[-1].next_offset
                for batch in unit:
                    self.max_timestamp_ms = max(self.max_timestamp_ms, batch.max_timestamp_ms)
                pos += length
        except CorruptBatchError:
            return False
        if index.time_count:
            self.max_timestamp_ms = max(self.max_timestamp_ms, index.last_ms)
        self.event_count = -1  # unknown without a full scan; only used for reports
        return pos == self.size

    def _scan(self, *, verify: bool, stop_at_error: bool) -> ScanReport:
        """Walk every batch from the start, indexing each one; returns what was found.

        Reads the file in large chunks and walks batch headers in memory, so a log of
        small batches costs few system calls."""
        with self.pinned() as fd:
            return self._scan_file(fd, verify=verify, stop_at_error=stop_at_error)

    def _scan_file(self, fd: int, *, verify: bool, stop_at_error: bool) -> ScanReport:
        report = ScanReport(path=self.log_path, file_bytes=os.fstat(fd).st_size)
        end = report.file_bytes
        pos = 0  # file position of the next batch
        buf = memoryview(b"")
        buf_start = 0  # file position of buf[0]
        while pos < end:
            off = pos - buf_start
            avail = len(buf) - off
            need = HEADER_SIZE
            if avail >= 4:
                need = max(HEADER_SIZE, min(peek_length(buf, off), end - pos))
            if avail < need:
                buf = memoryview(os.pread(fd, min(max(SCAN_CHUNK, need), end - pos), pos))
                buf_start, off, avail = pos, 0, len(buf)
            length = peek_length(buf, off) if avail >= 4 else 0
            try:
                if avail < HEADER_SIZE:
                    raise CorruptBatchError(f"torn batch header at byte {pos}")
                if length < HEADER_SIZE or pos + length > end:
                    raise CorruptBatchError(f"torn or corrupt batch at byte {pos}")
                unit = _unit(buf[off : off + length], verify=verify)
                if unit[0].base_offset < self.next_offset:
                    raise CorruptBatchError(
                        f"batch at byte {pos} has offset {unit[0].base_offset}, "
                        f"expected at least {self.next_offset}"
                    )
            except CorruptBatchError as exc:
                report.errors.append(str(exc))
                if stop_at_error:
                    break
                # A bad batch in a sealed segment: skip it by its length when that can
                # be trusted, so later batches stay reachable; the bad one is not indexed.
                if length < HEADER_SIZE or pos + length > end:
                    break
                pos += length
                continue
            self._index_unit(unit, pos, length)
            report.batches += len(unit)
            report.events += sum(batch.count for batch in unit)
            pos += length
            report.valid_bytes = pos
        self.size = report.valid_bytes if stop_at_error else end
        return report

    def index_bytes(self) -> tuple[bytes, bytes]:
        """Both index files' contents (entries plus trailer) for the current .log size."""
        base = self.base_offset
        index = b"".join(INDEX_ENTRY.pack(o - base, p) for o, p in self.index_entries())
        times = b"".join(TIME_ENTRY.pack(t, o - base) for t, o in self.time_entries())
        return _with_trailer(index, self.size), _with_trailer(times, self.size)

    def index_entries(self) -> list[tuple[int, int]]:
        """(offset, file position) of every offset index entry, wherever they are held."""
        offsets, positions = self.index_offsets, self.index_positions
        index = self.sealed_index
        if index is not None:
            return [(self.base_offset + rel, pos) for rel, pos in index.entries()]
        return list(zip(offsets, positions, strict=True))

    def time_entries(self) -> list[tuple[int, int]]:
        """(max timestamp, offset) of every time index entry, wherever they are held."""
        stamps, offsets = self.time_timestamps, self.time_offsets
        index = self.sealed_index
        if index is not None:
            return [(ts, self.base_offset + rel) for ts, rel in index.time_entries()]
        return list(zip(stamps, offsets, strict=True))

    def write_index_files(self, *, sync: bool) -> None:
        """Write both index files whole (temp file + rename). Done when a segment is
        sealed; the fsync may be left to the next log sync."""
        index, times = self.index_bytes()
        for path, data in ((self.index_path, index), (self.time_index_path, times)):
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as f:
                f.write(data)
                if sync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)

    # ---- writing -------------------------------------------------------------------

    def _index_unit(self, unit: list[Batch], pos: int, length: int) -> None:
        """Index the batch, or the frame of batches, of ``length`` bytes at ``pos``: an
        offset index entry can only point at a unit's start, time entries name batches."""
        if not self.index_offsets or self._bytes_since_index >= self.index_interval_bytes:
            self.index_offsets.append(unit[0].base_offset)
            self.index_positions.append(pos)
            self._bytes_since_index = 0
        self._bytes_since_index += length
        if len(unit) > 1 or (unit and unit[0].length != length):
            self.compressed = True
        for batch in unit:
            if batch.max_timestamp_ms > self.max_timestamp_ms:
                self.max_timestamp_ms = batch.max_timestamp_ms
                self.time_timestamps.append(batch.max_timestamp_ms)
                self.time_offsets.append(batch.base_offset)
            if self.first_timestamp_ms is None:
                self.first_timestamp_ms = batch.first_timestamp_ms
            self.event_count += batch.count
        self.next_offset = unit[-1].next_offset

    def append(self, data: bytes, batch_header: Batch) -> int:
        """Write one encoded batch at the end; returns its file position."""
        pos = self.size
        fd = self.files.pin(self.file)
        try:
            written = os.pwrite(fd, data, pos)
            if written != len(data):  # disk full or similar: leave no torn batch behind
                os.ftruncate(fd, pos)
                raise OSError(f"short write to {self.log_path}: {written} of {len(data)} bytes")
        finally:
            self.files.unpin(self.file)
        self.size = pos + len(data)
        self._index_unit([batch_header], pos, len(data))
        return pos

    def sync_index_files(self) -> None:
        for path in (self.index_path, self.time_index_path):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # ---- reading -------------------------------------------------------------------

    def _read_unit_at(
        self, pos: int, *, verify: bool = True, sequential: bool = False
    ) -> tuple[list[Batch], int]:
        """The batch, or the frame's batches, at ``pos``, and the unit's length in the file
        (``sequential``: met by a sequential reader, whose cold run it goes on with)."""
        with self.pinned() as fd:
            head = _read(fd, HEADER_SIZE, pos)
            if len(head) < HEADER_SIZE:
                raise CorruptBatchError(f"truncated batch header at byte {pos} of {self.log_path}")
            length = peek_length(head)
            if length < HEADER_SIZE:
                raise CorruptBatchError(f"bad batch length at byte {pos} of {self.log_path}")
            # A unit larger than a reader's chunk is read whole: in the reader's cold run,
            # or directly when cold.
            data = _read_sequential(self, fd, length, pos) if sequential else None
            if data is None:
                data, _ = _read_chunk(fd, length, pos)
        if len(data) < length:
            raise CorruptBatchError(f"truncated batch at byte {pos} of {self.log_path}")
        return _unit(memoryview(data), verify=verify), length

    # The arrays are read before ``sealed_index``: sealing sets it before it empties them.

    def position_for(self, offset: int) -> int:
        """File position of the indexed batch at or before ``offset`` (binary search)."""
        offsets, positions = self.index_offsets, self.index_positions
        index = self.sealed_index
        if index is not None:
            found = index.search(_IndexEntries.position_for, offset - self.base_offset)
            # None: closed (its .log is closed too) or unreadable: from the start, always
            # a batch's start.
            return 0 if found is None else found
        i = bisect_right(offsets, offset) - 1
        return int(positions[i]) if i >= 0 else 0

    def position_for_timestamp(self, timestamp_ms: int) -> int | None:
        """File position from which to scan for the first batch with max ts >= timestamp."""
        stamps, offsets = self.time_timestamps, self.time_offsets
        index = self.sealed_index
        if index is not None:
            found = index.search(_IndexEntries.position_for_timestamp, timestamp_ms)
            if found is None:  # closed or unreadable: from the start
                return 0
            return None if found < 0 else found
        i = bisect_left(stamps, timestamp_ms)
        if i >= len(stamps):
            return None
        return self.position_for(int(offsets[i]))

    def _unit_end_below(self, pos: int, want: int) -> int:
        """``want`` cut back to the end of the last whole unit it covers from ``pos`` when
        the offset index knows one there (an entry every 4 KiB by default: each unit of
        a large reader's chunk): the part of a unit after it would be read, copied and
        left, and read again by the next chunk (with 8 MiB pages over 1 MB batches a
        tenth of what a sequential reader read). At least half of ``want`` is kept, so a
        sparse index never turns one read into many small ones, and at least a pooled
        read (one just under it would allocate and page in a buffer of its own)."""
        if want <= POOLED_READ:
            return want
        index = self.sealed_index
        if index is not None:
            found = index.search(_IndexEntries.unit_start_at_or_below, pos + want)
            start = -1 if found is None else found  # None: closed or unreadable
        else:
            positions = self.index_positions
            i = bisect_right(positions, pos + want) - 1
            start = int(positions[i]) if i >= 0 else -1
        if start < pos + max(want // 2, POOLED_READ):
            return want  # no unit start in [pos + max(want / 2, 1 MiB), pos + want]
        return start - pos

    def batches_from(
        self,
        pos: int,
        end: int,
        chunk: int | Callable[[], int] = 1 << 20,
        stop_offset: int = 1 << 64,
    ) -> Iterator[Batch]:
        """Checked batches from file position ``pos`` up to ``end`` (exclusive) and below
        ``stop_offset``, read in chunks so a scan of many small batches costs few system
        calls. ``chunk``: the size of each read, or a function asked before each read
        (a reader that needs only a little more reads only a little more)."""
        while pos < end:
            asked = chunk() if callable(chunk) else chunk
            want = min(max(asked, HEADER_SIZE), end - pos)
            if want < end - pos:  # a read to ``end`` ends at a batch's end already
                want = self._unit_end_below(pos, want)
            fd = self.files.pin(self.file)
            try:
                # A large reader's read, also the short one at the segment's end (which
                # ends its run there).
                data = _read_sequential(self, fd, want, pos) if asked >= POOLED_READ else None
                if data is None:
                    data = _read(fd, want, pos)
                    ahead = min(want, end - pos - want)
                    # Bounded read-ahead: a sequential reader's next chunk is read from
                    # the disk while this one is answered (into the page cache). Not
                    # asked when it is all cached already: the kernel would look up
                    # every page of it to find that out (about 0.1 ms per 9 MiB).
                    if (
                        want >= POOLED_READ
                        and ahead > 0
                        and not (_cachestat_works and cached_share(fd, pos + want, ahead) == 1.0)
                    ):
                        os.posix_fadvise(fd, pos + want, ahead, os.POSIX_FADV_WILLNEED)
            finally:
                self.files.unpin(self.file)
            view = memoryview(data)
            consumed = 0
            while consumed + HEADER_SIZE <= len(view):
                length = peek_length(view, consumed)
                if length < HEADER_SIZE:
                    raise CorruptBatchError(f"bad batch length at byte {pos + consumed}")
                if consumed + length > len(view):
                    break
                unit = _unit(view[consumed : consumed + length])
                yield from unit
                consumed += length
                if unit[-1].next_offset >= stop_offset:
                    return  # the caller wants nothing past this: do not even read it
            if consumed == 0:
                # The next unit is larger than the chunk: read exactly that unit.
                unit, length = self._read_unit_at(pos, sequential=True)
                if pos + length > end:
                    raise CorruptBatchError(f"batch at byte {pos} runs past the segment end")
                yield from unit
                if unit[-1].next_offset >= stop_offset:
                    return
                consumed = length
            pos += consumed

    def close(self) -> None:
        with _cold_runs_lock:
            for run in [r for r in _cold_runs if r.seg is self]:
                _cold_runs.remove(run)
        self.files.close(self.file)
        if self.sealed_index is not None:
            self.sealed_index.close()  # readers of a closed segment fail at its .log

    def delete_files(self) -> None:
        for path in (self.log_path, self.index_path, self.time_index_path):
            path.unlink(missing_ok=True)

    def __repr__(self) -> str:
        return f"Segment({self.log_path.name}, size={self.size}, next={self.next_offset})"


def _unit(view: memoryview, *, verify: bool = True) -> list[Batch]:
    """The batches of one stored unit, exactly ``view``: a bare batch or a frame."""
    if is_frame(view):
        if getattr(_nowait, "on", False):
            # Decompressing is CPU work (about a millisecond a frame, a read may cross
            # dozens): done in a worker thread, never on the event loop.
            raise WouldBlock
        return decode_frame(view, verify=verify)
    return [Batch(view, verify=verify)]


def _with_trailer(entries: bytes, log_size: int) -> bytes:
    return entries + INDEX_TRAILER.pack(INDEX_MAGIC, crc32c.crc32c(entries), log_size)


def read_header_fields(data: bytes) -> tuple[int, ...]:
    """Header fields of a raw batch (for reports and tests)."""
    return HEADER.unpack_from(data)
