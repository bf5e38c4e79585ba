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
import time
from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import crc32c

from headwater.errors import CorruptBatchError
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
# 32 MiB for readers' chunks and the pages held while they are sent, and room for the
# direct read-ahead's chunks (READ_AHEAD_CHUNKS below, 11 MiB each): at 32 MiB in all it
# overflowed during a cold read and every chunk was a fresh buffer, faulted in and zeroed.
READ_BUFFERS = ReadBuffers(64 << 20)
# O_DIRECT wants the file position, the length and the memory aligned to the device's
# logical block; a page covers every block size in use.
DIRECT_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass
class DirectReads:
    """Whether a sequential reader's chunk that is not in the page cache is read around
    it (O_DIRECT), and how many were (for tests and the benchmarks)."""

    enabled: bool = _O_DIRECT != 0
    count: int = 0
    bytes: int = 0
    read_ahead: int = 0  # chunks read ahead in the background ...
    read_ahead_hits: int = 0  # ... and reads served from them


DIRECT_READS = DirectReads()


def _read(fd: int, length: int, pos: int) -> bytes | bytearray | memoryview:
    nowait = getattr(_nowait, "on", False) and _RWF_NOWAIT != 0
    if nowait and length >= POOLED_READ and cached_share(fd, pos, length) < 1.0:
        # A large chunk not wholly cached: the read below would copy the part that is
        # and give up, and a no-wait read of a missing page still starts the kernel's
        # read-ahead there, filling the cache a direct read would have gone around.
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


def cached_share(fd: int, pos: int, length: int) -> float:
    """The share of the pages of ``[pos, pos + length)`` that are in the page cache
    (mincore over a mapping that is never touched: it reads nothing in, where a no-wait
    read of a missing page starts the kernel's read-ahead there). 1.0 when it cannot
    tell."""
    start = pos - pos % mmap.PAGESIZE
    size = pos + length - start
    if size <= 0:
        return 1.0
    address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if address is None or address == _MAP_FAILED:
        return 1.0
    try:
        pages = -(-size // mmap.PAGESIZE)
        vector = ctypes.create_string_buffer(pages)
        if _libc.mincore(address, size, vector) != 0:
            return 1.0
    finally:
        _libc.munmap(address, size)
    return 1.0 - vector.raw.count(0) / pages


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


# Direct read-ahead: a direct read returns only when its request is done, so one after
# another leaves this disk idle while each chunk is checked and handed over (a buffered
# read has the kernel's read-ahead for that). After a page's direct chunk, the chunk
# after it is read in the background; the next page starts a little before where this
# chunk ended (in the batch the page was cut in), so its buffer keeps room in front for
# that head, read when the page asks. At most READ_AHEAD_CHUNKS are held server-wide.
# Chunks are read ahead only for a Segment object, whose bytes below its reader's end
# never change (a truncated or compacted segment is a new object).
READ_AHEAD_CHUNKS = 2
READ_AHEAD_FROM = 4 << 20  # started by a direct read at least this large: a page's first
READ_AHEAD_CHUNK = 8 << 20
_READ_AHEAD_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="direct-read-ahead")


class _ReadAhead:
    """``[start, end)`` of ``seg`` being read directly in the background into ``view``,
    which covers the file from ``base`` (``room`` bytes before ``start``, for the head of
    a batch cut at ``start``, filled when a reader asks); ``filled_from``: where the
    bytes in ``view`` begin. ``limit``: the end of what its reader may read."""

    def __init__(self, seg: Segment, start: int, limit: int, room: int) -> None:
        self.seg = seg
        self.start = start
        self.end = min(start + READ_AHEAD_CHUNK, limit)
        self.limit = limit
        self.room = room
        self.base = start - room
        span = -(-(self.end - start) // DIRECT_ALIGN) * DIRECT_ALIGN
        self.view = _aligned_view(room + span)
        self.filled_from = start
        self.lock = threading.Lock()
        self.read: Future[int | None] = _READ_AHEAD_THREAD.submit(
            self._read, self.view[room:], start
        )

    def _read(self, view: memoryview, start: int) -> int | None:
        with self.seg.files.pinned(self.seg.file) as fd:
            return _preadv_direct(fd, view, start)

    def read_end(self) -> int:
        """Where the bytes read end (waiting for the read); ``start`` if it failed (the
        reader's own read reports it) or the file system refused O_DIRECT."""
        try:
            got = self.read.result()
        except Exception:  # any failure: the reader reads for itself and meets it there
            return self.start
        return self.start if got is None else min(self.start + got, self.end)

    def take(self, pos: int, length: int, before: _ReadAhead | None) -> memoryview | None:
        """``[pos, pos + length)`` or its start up to :attr:`end`, the head in front of
        ``start`` copied from ``before`` (the chunk ending at ``start``) or read now."""
        aligned = pos - pos % DIRECT_ALIGN
        end = self.read_end()
        if pos >= end:
            return None
        with self.lock:
            if aligned < self.filled_from:
                head = self.view[aligned - self.base : self.filled_from - self.base]
                if (
                    before is not None
                    and before.start <= aligned
                    and before.read_end() >= self.filled_from
                ):
                    head[:] = before.view[aligned - before.base : self.filled_from - before.base]
                else:
                    with self.seg.files.pinned(self.seg.file) as fd:
                        if _preadv_direct(fd, head, aligned) != len(head):
                            return None
                self.filled_from = aligned
        DIRECT_READS.read_ahead_hits += 1
        return self.view[pos - self.base : min(pos + length, end) - self.base]


_read_aheads: deque[_ReadAhead] = deque(maxlen=READ_AHEAD_CHUNKS)
_read_aheads_lock = threading.Lock()


def _take_read_ahead(seg: Segment, pos: int, length: int) -> memoryview | None:
    """``[pos, pos + length)`` of ``seg``, or its start, if it was read ahead: from the
    last chunk whose room or bytes hold ``pos`` (the longest answer). A read from the
    newest chunk read ahead of ``seg`` starts the read of the chunk after it."""
    with _read_aheads_lock:
        chunks = [ahead for ahead in _read_aheads if ahead.seg is seg]
    for i in range(len(chunks) - 1, -1, -1):
        ahead = chunks[i]
        if not ahead.base <= pos - pos % DIRECT_ALIGN or pos >= ahead.end:
            continue
        before = chunks[i - 1] if i and chunks[i - 1].end == ahead.start else None
        data = ahead.take(pos, length, before)
        if data is None:
            return None
        if i == len(chunks) - 1 and ahead.end < ahead.limit:
            _start_read_ahead(seg, ahead.end, ahead.limit, ahead.room)
        return data
    return None


def _start_read_ahead(seg: Segment, start: int, limit: int, room: int) -> None:
    """Read up to ``READ_AHEAD_CHUNK`` bytes of ``seg`` from ``start`` (not past
    ``limit``) in the background, dropping the oldest chunk held."""
    with _read_aheads_lock:
        if any(a.seg is seg and a.start == start for a in _read_aheads):
            return
        _read_aheads.append(_ReadAhead(seg, start, limit, room))
    DIRECT_READS.read_ahead += 1
    # Let the read-ahead thread take the GIL and start its read now, not after this
    # thread's switch interval.
    time.sleep(0)


def _read_chunk(fd: int, length: int, pos: int) -> tuple[bytes | bytearray | memoryview, bool]:
    """A sequential reader's next chunk, and whether it was read around the page cache.

    A large chunk mostly not in the page cache is read with O_DIRECT: old data read
    once (ReadEvents or a subscription from offset 0, a bootstrap) costs the server no
    page cache fill and no copy out of it, about two thirds of its CPU for such a read,
    and does not evict what other readers keep hot. Cached data, and any read on the
    event loop (no-wait), go through the page cache as before. The bytes are the same
    either way, and every batch's CRC is checked on them as on any read."""
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


class Segment:
    """A segment file with in-memory copies of its indexes. Its ``.log`` is opened
    through ``files`` (a bounded set of open files shared by many segments): use the
    descriptor only inside ``with segment.pinned() as fd``."""

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
        self._bytes_since_index = 0
        self.compressed = False  # holds compressed frames (set by the scan or index load)
        self.file: SegmentFile = self.files.handle(self.log_path)

    def pinned(self) -> contextlib.AbstractContextManager[int]:
        """The ``.log``'s descriptor, kept open until the block ends."""
        return self.files.pinned(self.file)

    def retire(self) -> None:
        """Keep the current ``.log`` open until :meth:`close`: it is about to be deleted
        or replaced, and readers holding this segment still read it."""
        self.files.retire(self.file)

    # ---- opening -------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        directory: Path,
        base_offset: int,
        index_interval_bytes: int,
        files: FileCache | None = None,
    ) -> Segment:
        seg = cls(directory, base_offset, index_interval_bytes, files)
        seg.file = seg.files.create(seg.log_path)
        return seg

    @classmethod
    def open_tail(
        cls,
        directory: Path,
        base_offset: int,
        index_interval_bytes: int,
        files: FileCache | None = None,
    ) -> Segment:
        """Open the active segment after a possible crash: check every batch's CRC,
        truncate a torn or corrupt tail, and rebuild both indexes from what remains."""
        seg = cls(directory, base_offset, index_interval_bytes, files)
        with seg.pinned() as fd:
            report = seg._scan_file(fd, verify=True, stop_at_error=True)
            file_size = os.fstat(fd).st_size
            if report.valid_bytes < file_size:
                log.warning(
                    "truncating %s from %d to %d bytes: %s",
                    seg.log_path,
                    file_size,
                    report.valid_bytes,
                    "; ".join(report.errors) or "torn tail",
                )
                os.ftruncate(fd, report.valid_bytes)
                os.fsync(fd)
        # The active segment's indexes live in memory; files appear when it is sealed.
        seg.index_path.unlink(missing_ok=True)
        seg.time_index_path.unlink(missing_ok=True)
        return seg

    @classmethod
    def open_sealed(
        cls,
        directory: Path,
        base_offset: int,
        index_interval_bytes: int,
        files: FileCache | None = None,
    ) -> Segment:
        """Open a sealed segment from its index, rebuilding the index if it is damaged."""
        seg = cls(directory, base_offset, index_interval_bytes, files)
        with seg.pinned() as fd:
            seg.size = os.fstat(fd).st_size
            if not seg._load_index():
                log.warning("rebuilding index of %s", seg.log_path)
                seg._reset_index()
                report = seg._scan_file(fd, verify=True, stop_at_error=False)
                for error in report.errors:
                    log.error("sealed segment %s: %s", seg.log_path, error)
                seg.size = os.fstat(fd).st_size
                seg.write_index_files(sync=True)
        return seg

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
        self._bytes_since_index = 0

    def _load_index(self) -> bool:
        """Load both index files; False unless their trailers vouch for them (CRC of the
        entries and the size of the .log they describe) and the batches after the last
        entry run exactly to the end of the file."""
        try:
            raw = _read_index_file(self.index_path, INDEX_ENTRY.size, self.size)
            raw_time = _read_index_file(self.time_index_path, TIME_ENTRY.size, self.size)
        except ValueError:
            return False
        if self.size == 0:
            return not raw
        if not raw:
            return False
        for rel, pos in INDEX_ENTRY.iter_unpack(raw):
            self.index_offsets.append(self.base_offset + rel)
            self.index_positions.append(pos)
        for ts, rel in TIME_ENTRY.iter_unpack(raw_time):
            self.time_timestamps.append(ts)
            self.time_offsets.append(self.base_offset + rel)
        if self.index_positions[0] != 0:
            return False
        try:
            first, first_length = self._read_unit_at(0)
            if first[0].base_offset != self.index_offsets[0]:
                return False
            self.compressed = first[0].length != first_length
            self.first_timestamp_ms = first[0].first_timestamp_ms
            pos = int(self.index_positions[-1])
            expected = int(self.index_offsets[-1])
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
        if self.time_timestamps:
            self.max_timestamp_ms = max(self.max_timestamp_ms, self.time_timestamps[-1])
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
        index = b"".join(
            INDEX_ENTRY.pack(o - self.base_offset, p)
            for o, p in zip(self.index_offsets, self.index_positions, strict=True)
        )
        times = b"".join(
            TIME_ENTRY.pack(t, o - self.base_offset)
            for t, o in zip(self.time_timestamps, self.time_offsets, strict=True)
        )
        return _with_trailer(index, self.size), _with_trailer(times, self.size)

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

    def _read_unit_at(self, pos: int, *, verify: bool = True) -> tuple[list[Batch], int]:
        """The batch, or the frame's batches, at ``pos``, and the unit's length in the file."""
        with self.pinned() as fd:
            head = _read(fd, HEADER_SIZE, pos)
            if len(head) < HEADER_SIZE:
                raise CorruptBatchError(f"truncated batch header at byte {pos} of {self.log_path}")
            length = peek_length(head)
            if length < HEADER_SIZE:
                raise CorruptBatchError(f"bad batch length at byte {pos} of {self.log_path}")
            # A unit larger than a reader's chunk is read whole: directly too when cold.
            data, _ = _read_chunk(fd, length, pos)
        if len(data) < length:
            raise CorruptBatchError(f"truncated batch at byte {pos} of {self.log_path}")
        return _unit(memoryview(data), verify=verify), length

    def position_for(self, offset: int) -> int:
        """File position of the indexed batch at or before ``offset`` (binary search)."""
        i = bisect_right(self.index_offsets, offset) - 1
        return int(self.index_positions[i]) if i >= 0 else 0

    def position_for_timestamp(self, timestamp_ms: int) -> int | None:
        """File position from which to scan for the first batch with max ts >= timestamp."""
        i = bisect_left(self.time_timestamps, timestamp_ms)
        if i >= len(self.time_timestamps):
            return None
        return self.position_for(int(self.time_offsets[i]))

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
            want = min(max(chunk() if callable(chunk) else chunk, HEADER_SIZE), end - pos)
            data: bytes | bytearray | memoryview | None = None
            if _read_aheads and want >= POOLED_READ and not getattr(_nowait, "on", False):
                # Not on the event loop: taking it may wait for the disk.
                data = _take_read_ahead(self, pos, want)
            fd = self.files.pin(self.file)
            try:
                if data is not None:
                    direct = True
                else:
                    data, direct = _read_chunk(fd, want, pos)
                    if direct and want >= READ_AHEAD_FROM and pos + len(data) < end:
                        # Read on from here; each chunk keeps room in front for the head
                        # of a batch cut at its start (a quarter of a page).
                        ahead = pos + len(data) - (pos + len(data)) % DIRECT_ALIGN
                        room = -(-(want // 4) // DIRECT_ALIGN) * DIRECT_ALIGN
                        _start_read_ahead(self, ahead, end, room)
                if want >= POOLED_READ and pos + want < end and not direct:
                    # Bounded read-ahead: a sequential reader's next chunk is read from
                    # the disk while this one is answered (into the page cache only).
                    # Not after a direct read: its next chunk is read directly too.
                    ahead = min(want, end - pos - want)
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
                unit, length = self._read_unit_at(pos)
                if pos + length > end:
                    raise CorruptBatchError(f"batch at byte {pos} runs past the segment end")
                yield from unit
                if unit[-1].next_offset >= stop_offset:
                    return
                consumed = length
            pos += consumed

    def close(self) -> None:
        self.files.close(self.file)

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


def _read_index_file(path: Path, entry_size: int, log_size: int) -> bytes:
    """The entries of an index file whose trailer checks out; ValueError otherwise."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{path.name} is missing") from None
    if len(data) < INDEX_TRAILER.size or (len(data) - INDEX_TRAILER.size) % entry_size:
        raise ValueError(f"{path.name} has a bad size")
    entries = data[: -INDEX_TRAILER.size]
    magic, crc, size = INDEX_TRAILER.unpack_from(data, len(entries))
    if magic != INDEX_MAGIC or crc != crc32c.crc32c(entries) or size != log_size:
        raise ValueError(f"{path.name} does not match its log")
    return entries


def read_header_fields(data: bytes) -> tuple[int, ...]:
    """Header fields of a raw batch (for reports and tests)."""
    return HEADER.unpack_from(data)
