"""A partition log: an ordered list of segments with append, read, sync, roll,
retention and key compaction.

Thread model: one writer at a time (appends take ``_lock`` for the few microseconds of a
``pwrite``); readers look up positions under the lock and ``pread`` outside it; ``sync``
snapshots what is dirty under the lock and runs ``fdatasync`` outside it, so readers and
writers never wait for the disk. Compaction and retention run in worker threads.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Unpack

from headwater.errors import CorruptBatchError, OffsetRemoved, StorageError, UsageError
from headwater.storage.batch import (
    ATTR_CONTROL,
    ATTR_TRANSACTIONAL,
    HEADER_SIZE,
    Batch,
    Event,
    EventColumns,
    build_batch,
    encode_values,
    marker_commits,
    peek_length,
)
from headwater.storage.compression import FRAME_BYTES, check_compression, encode_frame
from headwater.storage.files import FileCache
from headwater.storage.kafka_batch import section_header, stamp_log_append_time
from headwater.storage.producers import (
    AbortedTxn,
    ProducerEntry,
    ProducerTable,
    load_snapshot,
    now_ms,
    remove_snapshots_from,
    write_snapshot,
)
from headwater.storage.segment import POOLED_READ, Segment, segment_name

log = logging.getLogger(__name__)

GRAVEYARD_SECONDS = 30.0
# The most one read takes from a segment at a time: an 8 MiB answer with its batches'
# headers and lengths fits one chunk (a larger one reads a second).
MAX_READ_CHUNK = 9 << 20
# The attributes of a batch a reader may not be shown (PartitionLog.hidden).
_MAYBE_HIDDEN = ATTR_CONTROL | ATTR_TRANSACTIONAL


@dataclass(frozen=True)
class SyncPolicy:
    """When an append is acknowledged: after fdatasync (``fsync``, the default), when
    written with an fdatasync at least every ``interval_ms`` (``interval``), or when
    written with no fsync at all (``none``)."""

    kind: str = "fsync"
    interval_ms: int = 0

    @classmethod
    def parse(cls, text: str) -> SyncPolicy:
        text = text.strip()
        if text in ("fsync", "none"):
            return cls(text)
        if text.startswith("interval:"):
            try:
                ms = int(text.split(":", 1)[1])
            except ValueError:
                ms = -1
            if 0 < ms < 1 << 63:
                return cls("interval", ms)
        raise ValueError(f"sync policy must be fsync, none or interval:<ms>, not {text!r}")

    def __str__(self) -> str:
        return f"interval:{self.interval_ms}" if self.kind == "interval" else self.kind


@dataclass(frozen=True)
class LogConfig:
    segment_bytes: int = 128 << 20
    segment_ms: int | None = 7 * 86_400_000
    retention_ms: int | None = None
    retention_bytes: int | None = None
    cleanup_policy: str = "delete"  # or "compact"
    delete_retention_ms: int = 86_400_000
    producer_expiry_ms: int = 86_400_000  # idle idempotent producers are forgotten after
    index_interval_bytes: int = 4096
    sync: SyncPolicy = field(default_factory=SyncPolicy)
    # Sealed segments are rewritten as compressed frames ("zstd", "lz4") by maintenance;
    # the active segment is always plain.
    compression: str = "none"

    def __post_init__(self) -> None:
        if not (HEADER_SIZE * 2 <= self.segment_bytes <= 1 << 31):
            raise ValueError("segment_bytes must be between 128 bytes and 2 GiB")
        if self.cleanup_policy not in ("delete", "compact"):
            raise ValueError("cleanup_policy must be 'delete' or 'compact'")
        check_compression(self.compression)


@dataclass(frozen=True)
class AppendInfo:
    base_offset: int
    count: int
    first_position: int
    timestamp_ms: int

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.count


@dataclass
class ReadSpan:
    """Events [start, stop) (indexes within ``batch``) of one stored batch."""

    batch: Batch
    start: int
    stop: int
    records: tuple[int, int] | None = None  # [lo, hi) in the values section, when partial

    def values_chunk(self) -> memoryview:
        """The span's values, still in stored ``u64 len | bytes`` form."""
        section = self.batch.values_section()
        if self.records is None:
            return section
        return section[self.records[0] : self.records[1]]


@dataclass
class ReadResult:
    spans: list[ReadSpan]
    count: int
    value_bytes: int
    next_offset: int | None  # offset after the last event returned; None at the end
    end_offset: int = 0  # offset after the last event returned (the from offset if none)

    @property
    def first_offset(self) -> int | None:
        if not self.spans:
            return None
        span = self.spans[0]
        return (
            span.batch.offsets()[span.start]
            if not span.batch.dense
            else (span.batch.base_offset + span.start)
        )

    def values_chunks(self) -> list[memoryview]:
        return [span.values_chunk() for span in self.spans]

    def events(self) -> Iterator[Event]:
        for span in self.spans:
            events = span.batch.events(span.start)
            for _ in range(span.stop - span.start):
                yield next(events)


@dataclass
class CompressionResult:
    segments_compressed: int = 0
    bytes_before: int = 0
    bytes_after: int = 0


@dataclass
class CompactionResult:
    segments_rewritten: int = 0
    segments_removed: int = 0  # emptied, and not the first (PartitionLog.compact)
    events_removed: int = 0
    bytes_before: int = 0
    bytes_after: int = 0


@dataclass(frozen=True)
class SyncPlan:
    """One sync of a log (:meth:`PartitionLog.plan_sync`): everything below ``target``
    is durable once the segments ``sealed`` since the last sync, the active segment's
    file ``fd`` (pinned open until the sync ends) and, when ``dir_changes``, the
    directory are synced. ``cuts``: the log's count of cuts when planned (a cut since
    makes the sync durable for nothing)."""

    target: int
    cuts: int
    active: Segment
    fd: int
    sealed: list[Segment]
    dir_changes: int

    @property
    def file_only(self) -> bool:
        """Only the active segment's data to sync: one fdatasync of ``fd``."""
        return not self.sealed and not self.dir_changes


class PartitionLog:
    """One ordered log of batches in one directory."""

    def __init__(self, directory: Path, config: LogConfig, files: FileCache | None = None) -> None:
        self.directory = directory
        self.config = config
        # Where segment files are opened: the engine's one bounded set for all its logs.
        self.files = files if files is not None else FileCache(None)
        self.segments: list[Segment] = []
        self._lock = threading.RLock()
        # Held while a compaction rewrites a segment, from its first read to the swap,
        # and by what removes segments (a cut, retention): the rename of a rewritten
        # file must not land where a cut removed or shortened that segment meanwhile
        # (it would undo the cut on disk, and the tail would write to the unlinked file).
        # Taken before ``_lock``.
        self._rewrite_lock = threading.Lock()
        # Damage already logged: a reader and its read-ahead meet the same batch, and
        # one ERROR line per damaged place is what an operator needs.
        self._corruption_logged: set[str] = set()
        # In a cluster (docs/cluster.md): the partition's high watermark, where every
        # reader stops (the SQL projection, subscriptions and reads alike) and nothing
        # else; None on a single node, whose readers read to the committed end.
        self.readable_limit: Callable[[], int] | None = None
        # Sealed segments (base offsets) not yet fsynced since sealing. The active segment
        # is fsynced by every sync. Entries leave only when a sync of them succeeded, so
        # syncs may run concurrently and each one is complete on its own.
        self._dirty: set[int] = set()
        self._dir_changes = 0  # directory entries created or removed
        self._dir_synced = 0  # ... of which an fsync of the directory has covered
        self._synced_once = False
        # Truncations so far: a sync that started before one must not raise the durable
        # offset to the end it saw, which the cut may have removed.
        self._cuts = 0
        self._graveyard: list[tuple[float, Segment]] = []
        self.durable_offset = 0
        self.failed: str | None = None
        self.closed = False
        self.producers = ProducerTable()
        self._unstable_position = (-1, 0)  # (offset, position) of the last looked up
        # Where the last read cut a batch: (batch identity, event index, record position).
        self._cut_hint: tuple[tuple[int, bytes], int, int] = ((-1, b""), 0, 0)

    # ---- open / close ---------------------------------------------------------------

    @classmethod
    def open(
        cls, directory: Path, config: LogConfig | None = None, files: FileCache | None = None
    ) -> PartitionLog:
        """Open (creating if needed) and recover a partition log; its segment files are
        opened through ``files`` (default: a set of its own, unbounded)."""
        plog = cls(directory, config or LogConfig(), files)
        directory.mkdir(parents=True, exist_ok=True)
        for leftover in directory.glob("*.cleaned"):
            leftover.unlink()  # a compaction that did not finish: the original is intact
        for leftover in directory.glob("*.tmp"):
            leftover.unlink()
        bases = sorted(int(p.name[:-4]) for p in directory.glob("*.log") if p.name[:-4].isdigit())
        interval = plog.config.index_interval_bytes
        for i, base in enumerate(bases):
            seg = Segment(directory, base, interval, plog.files)
            plog.segments.append(seg.open_tail() if i == len(bases) - 1 else seg.open_sealed())
            previous = plog.segments[-2] if i else None
            # Retention removes the oldest segments only: a hole is a file removed.
            if (
                previous is not None
                and plog.config.cleanup_policy == "delete"
                and base > previous.next_offset
            ):
                log.error(
                    "%s: offsets %d..%d are in no segment (a segment file removed?): "
                    "reads go on after them; run headwater check",
                    directory,
                    previous.next_offset,
                    base - 1,
                )
        # An empty tail left by a crash right after a roll is harmless; an empty log
        # gets its first segment now.
        if not plog.segments:
            plog.segments.append(Segment(directory, 0, interval, plog.files).create())
            fsync_directory(directory)
        plog.durable_offset = plog.end_offset
        plog._load_producers()
        return plog

    def _load_producers(self) -> None:
        snap_offset, table = load_snapshot(self.directory, self.end_offset)
        for batch in self.batches(max(snap_offset, self.start_offset)):
            if batch.producer is not None:
                table.observe(batch)
        self.producers = table

    def close(self) -> None:
        # After a segment's rewrite under way (not into a closed log's files).
        with self._rewrite_lock, self._lock:
            if self.closed:
                return
            if self.failed is None:
                self.sync()
                self._snapshot_producers(self.end_offset)
            for seg in self.segments:
                seg.close()
            for _, seg in self._graveyard:
                seg.close()
            self._graveyard.clear()
            self.closed = True

    # ---- properties -----------------------------------------------------------------

    @property
    def active(self) -> Segment:
        return self.segments[-1]

    @property
    def start_offset(self) -> int:
        return self.segments[0].base_offset

    @property
    def end_offset(self) -> int:
        """Offset the next appended event will take."""
        return self.active.next_offset

    @property
    def committed_offset(self) -> int:
        """Events below this offset are acknowledged under the sync policy and readable."""
        if self.config.sync.kind == "fsync":
            return self.durable_offset
        return self.end_offset

    @property
    def size_bytes(self) -> int:
        return sum(seg.size for seg in self.segments)

    @property
    def last_position(self) -> int | None:
        """Tenant log position after the last stored event (None when empty)."""
        for seg in reversed(self.segments):
            if seg.size:
                pos = seg.position_for(seg.next_offset - 1)
                last = None
                for batch in seg.batches_from(pos, seg.size):
                    last = batch
                if last is not None:
                    return int(last.first_position + last.last_offset - last.base_offset + 1)
        return None

    # ---- append ---------------------------------------------------------------------

    def append(
        self,
        values: Sequence[bytes],
        *,
        first_position: int,
        timestamp_ms: int | None = None,
        **columns: Unpack[EventColumns],
    ) -> AppendInfo:
        return self.append_encoded(
            encode_values(values),
            len(values),
            first_position=first_position,
            timestamp_ms=timestamp_ms,
            **columns,
        )

    def append_encoded(
        self,
        values_section: bytes | memoryview,
        count: int,
        *,
        first_position: int,
        timestamp_ms: int | None = None,
        **columns: Unpack[EventColumns],
    ) -> AppendInfo:
        """Append ``count`` events whose values are already in stored form: one batch,
        one CRC, one write, at most one index entry. With ``producer`` (id, sequence) the
        append is idempotent: check it first with :meth:`check_producer`. A control batch
        (a transaction marker) skips the sequence check: its sequence is unused.

        With ``kafka`` the section is a checked Kafka batch from its CRC on, stored as it
        is (Kafka form): its timestamps are its own, or without ``timestamp_ms`` (a
        LogAppendTime stream) the log's clock, stamped into it as Kafka's broker does."""
        producer = columns.get("producer")
        epoch = columns.get("producer_epoch")
        control = bool(columns.get("control"))
        if count < 1:
            raise UsageError("append needs at least one event")
        try:
            commits = marker_commits(values_section) if control else False
        except ValueError as exc:
            raise UsageError(f"a control batch holds one marker: {exc}") from None
        ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        max_ts = None
        if columns.get("kafka"):
            if timestamp_ms is None:
                values_section = stamp_log_append_time(values_section, ts)
            kafka_header = section_header(values_section)
            ts, max_ts = kafka_header.first_timestamp, kafka_header.max_timestamp
        with self._lock:
            self._check_writable()
            if (
                producer is not None
                and not control
                and self.producers.check(*producer, epoch) is not None
            ):
                raise UsageError("duplicate producer sequence: check_producer() first")
            base = self.end_offset
            data = build_batch(
                values_section,
                count,
                base_offset=base,
                first_position=first_position,
                timestamp_ms=ts,
                max_timestamp_ms=max_ts,
                **columns,
            )
            if len(data) > self.config.segment_bytes:
                raise UsageError("batch larger than a segment")
            self._maybe_roll(len(data), ts)
            seg = self.active
            try:
                seg.append(data, Batch(memoryview(data), verify=False))
            except OSError as exc:
                raise StorageError(f"write failed: {exc}") from exc
            if producer is not None:
                if control:
                    self.producers.end(producer[0], epoch or 0, commits, base, ts)
                else:
                    step = count if columns.get("kafka") else 1  # Kafka numbers records
                    self.producers.record(producer[0], producer[1], base, count, ts, epoch, step)
                    if columns.get("transactional"):
                        self.producers.begin(producer[0], base)
            return AppendInfo(base, count, first_position, ts)

    def append_stored(self, data: bytes | memoryview) -> int:
        """Append batches exactly as another replica of this partition stored them (a
        follower copying its leader): each is checked (length, CRC, sections) and must
        start at this log's end; its bytes are written as they are, header and tenant
        log position included. Returns the new end offset. Nothing of a run is written
        unless every batch of it checks."""
        view = memoryview(data)
        checked: list[Batch] = []
        expected = self.end_offset
        pos = 0
        while pos < len(view):
            if len(view) - pos < HEADER_SIZE:
                raise CorruptBatchError("a replicated run ends inside a batch header")
            length = peek_length(view, pos)
            if length < HEADER_SIZE or pos + length > len(view):
                raise CorruptBatchError(f"a replicated batch's length {length} is wrong")
            batch = Batch(view[pos : pos + length])
            if batch.base_offset != expected:
                raise UsageError(
                    f"a replicated batch starts at {batch.base_offset}, not at {expected}"
                )
            if length > self.config.segment_bytes:
                raise UsageError("batch larger than a segment")
            checked.append(batch)
            expected = batch.next_offset
            pos += length
        with self._lock:
            self._check_writable()
            if checked and checked[0].base_offset != self.end_offset:
                raise UsageError("the log moved while a replicated run was checked")
            for batch in checked:
                self._maybe_roll(batch.length, batch.first_timestamp_ms)
                try:
                    self.active.append(bytes(batch.buffer), batch)
                except OSError as exc:
                    raise StorageError(f"write failed: {exc}") from exc
                self.producers.observe(batch)
            return self.end_offset

    def truncate_to(self, offset: int) -> int:
        """Drop every event at or past ``offset`` (a replica's tail that its leader does
        not have). The cut falls on a stored unit's start: a batch (or compressed frame)
        holding ``offset`` goes whole, so the log may end below ``offset``. Returns the
        new end offset."""
        with self._rewrite_lock, self._lock:
            self._check_writable()
            if offset >= self.end_offset:
                return self.end_offset
            self._cuts += 1
            while len(self.segments) > 1 and self.segments[-1].base_offset >= offset:
                gone = self.segments.pop()
                gone.retire()
                gone.delete_files()
                self._graveyard.append((time.monotonic(), gone))
                self._dirty.discard(gone.base_offset)
                self._dir_changes += 1
            seg = self.segments[-1]
            cut = pos = seg.position_for(offset)
            while pos < seg.size:
                unit, length = seg._read_unit_at(pos, verify=False)
                if unit[-1].next_offset > offset:
                    break
                pos += length
                cut = pos
            with seg.pinned() as fd:
                os.ftruncate(fd, cut)
                os.fsync(fd)
            seg.close()
            self._dirty.discard(seg.base_offset)
            tail = Segment(
                self.directory, seg.base_offset, self.config.index_interval_bytes, self.files
            ).open_tail()
            self.segments[-1] = tail
            self.durable_offset = min(self.durable_offset, tail.next_offset)
            remove_snapshots_from(self.directory, tail.next_offset)
            self._unstable_position = (-1, 0)
            self._cut_hint = ((-1, b""), 0, 0)
            self._load_producers()
            return self.end_offset

    def check_producer(
        self, producer_id: int, sequence: int, epoch: int | None = None
    ) -> ProducerEntry | None:
        """Where a retried idempotent append was stored, or None when it is new
        (OutOfOrderSequence, ProducerFenced: see :meth:`ProducerTable.check`)."""
        with self._lock:
            return self.producers.check(producer_id, sequence, epoch)

    def has_open_transaction(self, producer_id: int) -> bool:
        """Whether the producer has transactional batches here not yet ended by a
        marker."""
        with self._lock:
            return producer_id in self.producers.ongoing

    def open_transactions(self) -> dict[int, int]:
        """The producers with a transaction open here, each with its latest epoch."""
        with self._lock:
            table = self.producers
            return {pid: table.epochs.get(pid, 0) for pid in table.ongoing}

    def first_unstable_position(self) -> int | None:
        """Tenant log position of the oldest open transaction's first batch here; None
        when no transaction is open (or its first batch is not committed yet). Every
        event at or past the last stable offset has a position at least this."""
        with self._lock:
            unstable = self.producers.first_unstable_offset()
            if unstable is None or unstable >= self.committed_offset:
                return None
            if self._unstable_position[0] == unstable:
                return self._unstable_position[1]
        for batch in self._stored_batches(unstable, None, 64 << 10):
            position = int(batch.first_position)
            self._unstable_position = (unstable, position)
            return position
        return None

    @property
    def last_stable_offset(self) -> int:
        """read_committed readers stop here: the first offset of the oldest open
        transaction, or the committed offset when none is open (Kafka's LSO); never below
        the log's start (retention may remove an open transaction's first batches, and a
        reader at the end must not be sent below what is kept)."""
        with self._lock:
            unstable = self.producers.first_unstable_offset()
            committed = self.committed_offset
            if unstable is None:
                stable = committed
            else:
                stable = min(max(unstable, self.segments[0].base_offset), committed)
        limit = self.readable_limit
        return stable if limit is None else min(stable, limit())

    @property
    def readable_offset(self) -> int:
        """read_uncommitted readers stop here: the committed end, or in a cluster the
        high watermark below it."""
        committed = self.committed_offset
        limit = self.readable_limit
        return committed if limit is None else min(committed, limit())

    def _check_writable(self) -> None:
        if self.closed:
            raise StorageError("log is closed")
        if self.failed is not None:
            raise StorageError(f"log failed earlier and accepts no writes: {self.failed}")

    def _maybe_roll(self, incoming: int, now_ms: int) -> None:
        seg = self.active
        if seg.size == 0:
            return
        too_big = seg.size + incoming > self.config.segment_bytes
        first_ts = seg.first_timestamp_ms
        too_old = (
            self.config.segment_ms is not None
            and first_ts is not None
            and now_ms - first_ts >= self.config.segment_ms
        )
        if too_big or too_old:
            try:
                self.roll()
            except OSError as exc:  # e.g. no space for the next segment's file
                raise StorageError(f"starting a new segment failed: {exc}") from exc

    def roll(self) -> None:
        """Seal the active segment and start a new one at the log end."""
        with self._lock:
            seg = self.active
            if seg.size == 0:
                return
            seg.write_index_files(sync=False)
            seg.map_index_files()  # sealed: its index costs no heap from here on
            self._dirty.add(seg.base_offset)  # its indexes get fsynced on the next sync
            new = Segment(
                self.directory, seg.next_offset, self.config.index_interval_bytes, self.files
            ).create()
            self.segments.append(new)
            self._dir_changes += 1
            # Even an empty table is worth a file: recovery then scans only from here.
            self._snapshot_producers(new.base_offset)

    def _snapshot_producers(self, offset: int) -> None:
        self.producers.expire(now_ms() - self.config.producer_expiry_ms)
        self.producers.prune_aborted(self.start_offset)
        write_snapshot(self.directory, offset, self.producers)

    # ---- durability -----------------------------------------------------------------

    def sync(self) -> int:
        """fdatasync everything written so far; returns the offset now durable.

        Safe to call from any thread, and several at once (a disk may flush several in
        parallel faster than one after another); writers keep writing meanwhile.
        """
        return self.sync_planned(self.plan_sync())

    def plan_sync(self) -> SyncPlan | None:
        """What a sync of everything written so far has to do (None: nothing, the log is
        closed or nothing was written since the last sync). The active segment's file
        stays open for it until :meth:`end_sync`, whoever does the I/O."""
        with self._lock:
            if self.closed:
                return None
            target = self.end_offset
            active = self.active
            # Segments sealed since the last sync (after a roll): most syncs have none,
            # and skip the walk over every segment.
            sealed = (
                [s for s in self.segments if s.base_offset in self._dirty and s is not active]
                if self._dirty
                else []
            )
            dir_changes = self._dir_changes
            if (
                self._synced_once
                and target == self.durable_offset
                and not sealed
                and dir_changes <= self._dir_synced
            ):
                # Nothing written since the last sync: spare an idle log's file a reopen
                # (closing thousands of idle streams would reopen each to fsync nothing).
                # Not before the first sync: what recovery found may still be unsynced.
                return None
            # Pinned under the lock: a truncation that replaces the active segment
            # meanwhile closes its file only once this sync lets go of it.
            fd = active.files.pin(active.file)  # no generator-based with: once per sync
            return SyncPlan(
                target,
                self._cuts,
                active,
                fd,
                sealed,
                dir_changes if dir_changes > self._dir_synced else 0,
            )

    def sync_planned(self, plan: SyncPlan | None) -> int:
        """``plan``'s I/O in this thread, then :meth:`end_sync`: the offset now durable."""
        if plan is None:
            return self.durable_offset
        error: OSError | None = None
        try:
            for seg in plan.sealed:
                with seg.pinned() as sealed_fd:
                    os.fdatasync(sealed_fd)
                seg.sync_index_files()  # sealed: its index must survive as written
            os.fdatasync(plan.fd)
            if plan.dir_changes:
                fsync_directory(self.directory)
        except OSError as exc:
            error = exc
        return self.end_sync(plan, error)

    def end_sync(self, plan: SyncPlan, error: OSError | None) -> int:
        """``plan``'s I/O is done (``error``: it failed): the offset now durable. A
        failure fails the log: StorageError now, and for every write after it."""
        plan.active.files.unpin(plan.active.file)
        if error is not None:
            # After a failed fsync the page cache state is unknown (fsyncgate): refuse
            # further writes rather than acknowledge data that may be gone.
            with self._lock:
                self.failed = f"fsync failed: {error}"
            raise StorageError(self.failed) from error
        with self._lock:
            if self.failed is not None:
                # Another sync failed meanwhile: the kernel reports an fsync error once,
                # so this one's success says nothing of the data it did not keep.
                raise StorageError(self.failed)
            self._synced_once = True
            for seg in plan.sealed:
                self._dirty.discard(seg.base_offset)
            self._dir_synced = max(self._dir_synced, plan.dir_changes)
            if plan.cuts == self._cuts:  # else the log was cut meanwhile: the next sync covers it
                self.durable_offset = max(self.durable_offset, plan.target)
            return self.durable_offset

    # ---- reads ----------------------------------------------------------------------

    def _segment_index(self, offset: int) -> int:
        bases = [s.base_offset for s in self.segments]
        return max(bisect_right(bases, offset) - 1, 0)

    def batches(
        self,
        from_offset: int,
        upto: int | None = None,
        chunk: int = 1 << 20,
        *,
        committed_only: bool = False,
    ) -> Iterator[Batch]:
        """Checked batches holding events at or after ``from_offset`` and below ``upto``
        (default: the committed offset). Bad batches raise CorruptBatchError. Every
        batch as stored, markers included, unless ``committed_only``: what a
        read_committed reader sees (below the last stable offset, without markers and
        aborted transactions' batches)."""
        if committed_only:
            return self._committed_batches(from_offset, upto, chunk)
        return self._stored_batches(from_offset, upto, chunk)

    def _committed_batches(self, from_offset: int, upto: int | None, chunk: int) -> Iterator[Batch]:
        stable = self.last_stable_offset
        end = stable if upto is None else min(upto, stable)
        for batch in self._stored_batches(from_offset, end, chunk):
            if not self.hidden(batch, committed_only=True):
                yield batch

    def hidden(self, batch: Batch, *, committed_only: bool) -> bool:
        """Whether a reader never sees ``batch``: a marker, or (read_committed) a batch
        of an aborted transaction, found in the aborted-transactions index."""
        if batch.control:
            return True
        if committed_only and batch.transactional and batch.producer is not None:
            return self.producers.is_aborted(batch.producer[0], batch.base_offset)
        return False

    def _stored_batches(
        self,
        from_offset: int,
        upto: int | None,
        chunk: int | Callable[[], int],
        *,
        strict: bool = False,
    ) -> Iterator[Batch]:
        end = self.committed_offset if upto is None else upto
        with self._lock:
            # With the segments it reads: retention may have run since the caller looked.
            if strict and from_offset < self.segments[0].base_offset:
                raise OffsetRemoved(from_offset, self.segments[0].base_offset)
            if from_offset >= end:
                return
            segments = list(self.segments)
            i = self._segment_index(from_offset)
        for seg in segments[i:]:
            with self._lock:
                pos = seg.position_for(from_offset) if seg is segments[i] else 0
                seg_end = seg.size
            if seg.base_offset >= end:
                return
            try:
                for batch in seg.batches_from(pos, seg_end, chunk, stop_offset=end):
                    if batch.base_offset >= end:
                        return
                    if batch.last_offset < from_offset:
                        continue
                    yield batch
            except CorruptBatchError as exc:
                where = f"{seg.log_path}: {exc}"
                if where not in self._corruption_logged:
                    self._corruption_logged.add(where)
                    log.error("%s", where)
                raise CorruptBatchError(f"{seg.log_path.name}: {exc}") from None

    def read(
        self,
        from_offset: int,
        max_bytes: int = 1 << 20,
        *,
        max_events: int | None = None,
        upto: int | None = None,
        committed_only: bool = True,
        kafka: bool = False,
        contiguous: bool = False,
        strict: bool = False,
    ) -> ReadResult:
        """Committed events from ``from_offset``, stopping before the sum of value lengths
        would pass ``max_bytes`` (always at least one event when one exists). Whole
        batches are returned as stored; only the first and last may be cut. Markers
        are never returned; ``committed_only`` (read_committed, the default) also stops
        at the last stable offset and leaves out aborted transactions' batches, and
        read_uncommitted (False) returns them. Batches left out still move
        ``end_offset`` (and ``next_offset``) past them, so a reader does not stall.

        ``kafka``: read as a Kafka fetch does: whole batches only (a Kafka-form batch is
        never decoded; the first may start before ``from_offset``, the client skips
        what it did not ask for), markers included, and read_committed stops at the
        last stable offset but returns aborted batches (the fetch lists the aborted
        transactions: :meth:`aborted_transactions`; the client drops them).

        ``contiguous``: the answer's events are exactly the offsets ``from_offset,
        from_offset + 1, ...`` (for a reader whose answer carries no offsets, Kimberlite's
        ReadEvents): it ends before the first hole (events removed by compaction, a
        hidden batch) and ``next_offset`` is the offset after its last event; when
        ``from_offset`` itself is in a hole, no events and ``next_offset`` the first
        offset present after it.

        ``strict``: OffsetRemoved when retention removed ``from_offset`` (checked with the
        segments the read takes, so a removal racing it is seen), for a reader that must
        not be answered from a later offset; otherwise the read starts at the log's start."""
        if from_offset < 0:
            raise UsageError("offsets are non-negative")
        limit = self.last_stable_offset if committed_only else self.readable_offset
        if kafka:
            committed_only = False
        if upto is not None:
            limit = min(limit, upto)
        skipped_to: int | None = None
        spans: list[ReadSpan] = []
        count = value_bytes = 0
        next_offset: int | None = None
        budget_events = max_events if max_events is not None else 1 << 62
        if not strict:
            from_offset = max(from_offset, self.start_offset)
        # Read about as much as the answer needs, in one chunk: a small read must not
        # copy a megabyte, and a large one must not read a second chunk for its last batch.
        full_chunk = min(max(max_bytes + max_bytes // 8, 64 << 10), MAX_READ_CHUNK)

        def chunk() -> int:
            # After the first chunk, about what the rest of the answer needs: a page that
            # wants a little of one more batch reads that batch, not a whole chunk the
            # next page reads again (with 8 MiB pages over 1 MB batches every other page
            # read 18 MiB). At least a pooled read: a cold one is dropped behind the reader.
            rest = max_bytes - value_bytes
            return min(full_chunk, max(rest + rest // 8, POOLED_READ))

        contiguous = contiguous and not kafka
        expected = from_offset  # with ``contiguous``: the offset the next event must have
        stored = self._stored_batches(from_offset, limit, chunk, strict=strict)
        # The count as it is when a damaged batch is met (late binding wanted).
        for batch in _intact_prefix(stored, lambda: count > 0):  # noqa: B023
            # Only a marker or a transaction's batch may be hidden: most batches are
            # neither, told by one test of their attributes.
            if (
                not kafka
                and batch.attributes & _MAYBE_HIDDEN
                and self.hidden(batch, committed_only=committed_only)
            ):
                if contiguous:
                    if count:
                        break  # a hole: the answer ends before it
                    continue  # from_offset is in it: the next event shown says where to go on
                skipped_to = batch.next_offset
                continue
            skipped_to = None
            if contiguous:
                start, first, run_stop = batch.run_at(from_offset)
                if first != expected:  # a hole before this batch's first event wanted
                    if not count:
                        next_offset = first
                    break
                expected = first + (run_stop - start)
            else:
                start = batch.index_of(from_offset)
                run_stop = batch.count
            n_avail = batch.count - start
            if kafka:
                whole_bytes = batch.payload_bytes
                if count and value_bytes + whole_bytes > max_bytes:
                    break
                spans.append(ReadSpan(batch, start, batch.count))
                count += n_avail
                value_bytes += whole_bytes
                next_offset = batch.next_offset
                if value_bytes >= max_bytes:
                    break
                continue
            whole_bytes = len(batch.values_section()) - 8 * batch.count
            if (
                start == 0
                and value_bytes + whole_bytes <= max_bytes
                and n_avail <= budget_events
                and run_stop == batch.count
            ):
                spans.append(ReadSpan(batch, 0, batch.count))
                count += batch.count
                value_bytes += whole_bytes
                budget_events -= batch.count
                next_offset = batch.next_offset
            else:
                hint = self._cut_hint
                stop, lo, hi, size = batch.take_values(
                    start,
                    max_bytes - value_bytes,
                    min(budget_events, run_stop - start),
                    at_least_one=count == 0,
                    start_pos=hint[2] if hint[:2] == (batch.identity, start) else None,
                )
                if stop < batch.count:
                    # A sequential reader's next read starts here: spare it the walk.
                    self._cut_hint = (batch.identity, stop, hi)
                value_bytes += size
                count += stop - start
                budget_events -= stop - start
                if stop > start:
                    spans.append(ReadSpan(batch, start, stop, (lo, hi)))
                    if contiguous:  # the offset after the last event taken
                        next_offset = batch.offset_at(stop - 1) + 1
                    else:
                        next_offset = (
                            batch.offset_at(stop) if stop < batch.count else batch.next_offset
                        )
                if stop < batch.count:
                    break
            if value_bytes >= max_bytes or budget_events <= 0:
                break
        if skipped_to is not None:
            next_offset = skipped_to
        end_offset = from_offset if next_offset is None else next_offset
        if next_offset is not None and next_offset >= limit:
            next_offset = None
        return ReadResult(spans, count, value_bytes, next_offset, end_offset)

    def aborted_transactions(self, start: int, end: int) -> list[AbortedTxn]:
        """Aborted transactions with batches in ``[start, end)``, by first offset (what
        a Kafka read_committed fetch of that range lists)."""
        with self._lock:
            return self.producers.aborted_between(start, end)

    def events(self, from_offset: int = 0, upto: int | None = None) -> Iterator[Event]:
        """Decoding iterator over committed events from ``from_offset``."""
        for batch in self.batches(max(from_offset, self.start_offset), upto):
            for event in batch.events(batch.index_of(from_offset)):
                if upto is not None and event.offset >= upto:
                    return
                yield event

    def offset_for_timestamp(self, timestamp_ms: int) -> int | None:
        """Offset of the first batch whose timestamp is at or after ``timestamp_ms``; in a
        batch of Kafka form (a timestamp per record), of its first record at or after it,
        as Kafka answers."""
        with self._lock:
            segments = list(self.segments)
        committed = self.committed_offset
        for seg in segments:
            if seg.max_timestamp_ms < timestamp_ms:
                continue
            pos = seg.position_for_timestamp(timestamp_ms)
            if pos is None:
                continue
            for batch in seg.batches_from(pos, seg.size):
                if batch.base_offset >= committed:
                    return None
                if batch.max_timestamp_ms >= timestamp_ms:
                    stamps = batch.timestamps()
                    if stamps is None:
                        return int(batch.base_offset)
                    first = next(i for i, ts in enumerate(stamps) if ts >= timestamp_ms)
                    return int(batch.offsets()[first])
        return None

    def offset_of_max_timestamp(self) -> tuple[int, int] | None:
        """(offset, timestamp) of the first record with the log's largest timestamp, as
        Kafka's ListOffsets answers MAX_TIMESTAMP (-3); None for an empty log."""
        with self._lock:
            latest = max((seg.max_timestamp_ms for seg in self.segments), default=-1)
        if latest < 0:
            return None
        offset = self.offset_for_timestamp(latest)
        return None if offset is None else (offset, latest)

    # ---- retention and compaction ---------------------------------------------------

    def enforce_retention(self, now_ms: int | None = None) -> int:
        """Delete whole sealed segments past the age or size limit; returns how many."""
        now = int(time.time() * 1000) if now_ms is None else now_ms
        cfg = self.config
        removed = 0
        with self._rewrite_lock, self._lock:
            total = self.size_bytes
            while len(self.segments) > 1:
                oldest = self.segments[0]
                # Emptied by compaction (kept as the log's start): it holds no events and
                # goes with the sealed segment after it.
                judged = oldest if oldest.size or len(self.segments) < 3 else self.segments[1]
                if judged.next_offset > self.durable_offset and cfg.sync.kind == "fsync":
                    break  # never drop what is not yet durable behind it
                expired = cfg.retention_ms is not None and (
                    judged.max_timestamp_ms >= 0
                    and now - judged.max_timestamp_ms > cfg.retention_ms
                )
                oversize = cfg.retention_bytes is not None and total > cfg.retention_bytes
                if not (expired or oversize):
                    break
                self._remove(oldest)
                total -= oldest.size
                removed += 1
            if removed:
                self._dir_changes += 1
            self._bury()
        return removed

    def _remove(self, seg: Segment) -> None:
        """Take a sealed segment out of the log and delete its files, under both locks
        (retention, compaction). Readers holding it keep its bytes until it is buried."""
        self.segments.remove(seg)
        seg.retire()
        seg.delete_files()
        self._graveyard.append((time.monotonic(), seg))

    def _bury(self) -> None:
        # Readers may still hold a deleted segment for a moment; close its file later.
        now = time.monotonic()
        keep = []
        for when, seg in self._graveyard:
            if now - when > GRAVEYARD_SECONDS:
                seg.close()
            else:
                keep.append((when, seg))
        self._graveyard = keep

    def compact(self, now_ms: int | None = None) -> CompactionResult:
        """Keep only the latest event per key in sealed segments; tombstones go too once
        they have been in the log ``delete_retention_ms``: their segment was last
        written before that, whatever time their producer gave them (Kafka's rule
        before KIP-534: a consumer that read a key's value has that long to see its
        delete). Each segment is rewritten to a temporary file, fsynced and renamed
        over the original, so a crash at any point loses nothing; the rewrite keeps
        the segment's modification time, so a rewrite does not restart the wait."""
        now = int(time.time() * 1000) if now_ms is None else now_ms
        result = CompactionResult()
        with self._lock:
            # Only segments that are wholly committed and stable: an unsynced event may
            # not decide which value of a key survives (a power loss could still take it
            # away), nor may an event of a transaction still open.
            upto = self.last_stable_offset
            sealed = [s for s in self.segments[:-1] if s.next_offset <= upto]
            cuts = self._cuts
        if not sealed:
            return result
        # The latest value per key among what read_committed readers see: an aborted
        # transaction's event never supersedes a key's value (and is itself removed).
        latest: dict[bytes, int] = {}
        try:
            for batch in self.batches(self.start_offset, upto, committed_only=True):
                for event in batch.events():
                    if event.key is not None:
                        latest[event.key] = event.offset
        except StorageError:
            if not self.closed:
                raise
            return result  # closed meanwhile (its segments' files too): nothing to rewrite
        horizon = now - self.config.delete_retention_ms
        for seg in sealed:
            with self._rewrite_lock:
                with self._lock:
                    if self._cuts != cuts or self.closed:
                        # Cut meanwhile: ``latest`` may name events the cut removed, whose
                        # keys' older values are latest again. The next compaction looks
                        # afresh. (Closed: nothing more to rewrite.)
                        break
                    if self._index_of(seg) is None:
                        continue  # removed by retention meanwhile
                rewritten = self._compact_segment(seg, latest, horizon, result)
                if rewritten is not None:
                    self._swap(seg, rewritten)
        result.segments_removed = self._remove_emptied()
        return result

    def _remove_emptied(self) -> int:
        """Remove the sealed segments compaction emptied, but the first, whose base
        offset is the log's start: kept, an empty .log and two indexes a rewrite piled
        up with every write (74 of 75 segments for 5 keys), and they held back time
        retention. The offsets between segments become a compacted log's holes, as
        those inside one are."""
        with self._rewrite_lock, self._lock:
            emptied = [s for s in self.segments[1:-1] if s.size == 0]
            for seg in emptied:
                self._remove(seg)
            if emptied:
                self._dir_changes += 1
        return len(emptied)

    def _index_of(self, seg: Segment) -> int | None:
        """Where ``seg`` is in :attr:`segments`, None when it is gone (retention, a cut)."""
        return next((k for k, s in enumerate(self.segments) if s is seg), None)

    def _swap(self, seg: Segment, new: Segment) -> None:
        """Put the rewritten ``new`` in ``seg``'s place, its files already renamed and
        fsynced: under the rewrite lock, so ``seg`` is still there. Only this takes the
        log lock, which appends wait on, so they never wait on a rewrite's fsyncs."""
        with self._lock:
            i = self._index_of(seg)
            assert i is not None  # what removes segments waits for the rewrite lock
            self.segments[i] = new
            self._graveyard.append((time.monotonic(), seg))

    def _compact_segment(
        self,
        seg: Segment,
        latest: dict[bytes, int],
        horizon_ms: int,
        result: CompactionResult,
    ) -> Segment | None:
        written = seg.log_path.stat()
        tombstones_due = written.st_mtime_ns // 1_000_000 < horizon_ms
        removed = 0
        for batch in seg.batches_from(0, seg.size):
            removed += sum(
                1
                for event in batch.events()
                if (event.key is not None and latest.get(event.key) != event.offset)
                or (event.tombstone and tombstones_due)
            )
        if removed == 0:
            return None
        cleaned = seg.log_path.with_name(seg.log_path.name + ".cleaned")
        # Written batch by batch as the segment is read: compaction holds one read chunk,
        # never the whole rewritten segment.
        with open(cleaned, "wb") as f:
            for data in self._compacted_batches(seg, latest, tombstones_due):
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        result.segments_rewritten += 1
        result.events_removed += removed
        result.bytes_before += seg.size
        new = self._replace_segment(seg, cleaned)
        # A segment emptied by compaction still marks where its offsets began.
        new.next_offset = max(new.next_offset, seg.next_offset)
        result.bytes_after += new.size
        return new

    def _compacted_batches(
        self, seg: Segment, latest: dict[bytes, int], tombstones_due: bool
    ) -> Iterator[bytes]:
        for batch in seg.batches_from(0, seg.size):
            kept: list[Event] = []
            for event in batch.events():
                if event.key is not None and latest.get(event.key) != event.offset:
                    continue
                if event.tombstone and tombstones_due:
                    continue
                kept.append(event)
            if len(kept) == batch.count:
                yield bytes(batch.buffer)
            elif kept:
                yield build_batch(
                    encode_values([e.value for e in kept]),
                    len(kept),
                    base_offset=batch.base_offset,
                    first_position=batch.first_position,
                    timestamp_ms=batch.first_timestamp_ms,
                    max_timestamp_ms=batch.max_timestamp_ms,
                    keys=[e.key for e in kept],
                    tombstones=[e.tombstone for e in kept],
                    headers=[e.headers for e in kept],
                    deltas=[e.offset - batch.base_offset for e in kept],
                    producer=batch.producer,
                    producer_epoch=batch.producer_epoch,
                    transactional=batch.transactional,
                    control=batch.control,
                )

    def _rename_over(self, seg: Segment, rewritten: Path) -> None:
        """Rename the fsynced file ``rewritten`` over ``seg``'s ``.log``, durably. It
        keeps the segment's modification time: when it was last appended to, which
        compaction reads as its tombstones' age."""
        written = seg.log_path.stat()
        os.utime(rewritten, ns=(written.st_atime_ns, written.st_mtime_ns))
        # Readers holding it keep the old bytes and index (retired before the files go:
        # its paths are the new segment's next).
        seg.retire()
        # Drop the old indexes first: a crash between here and the rename leaves the
        # new .log with no index (rebuilt on open), never a mismatched one.
        seg.index_path.unlink(missing_ok=True)
        seg.time_index_path.unlink(missing_ok=True)
        os.replace(rewritten, seg.log_path)
        fsync_directory(self.directory)

    def _replace_segment(self, seg: Segment, rewritten: Path) -> Segment:
        """Put the fsynced file ``rewritten`` in place of ``seg``'s ``.log`` and open it."""
        self._rename_over(seg, rewritten)
        return Segment(
            self.directory, seg.base_offset, seg.index_interval_bytes, self.files
        ).open_sealed(indexed=False)

    # ---- compression ------------------------------------------------------------------

    def compress(self) -> CompressionResult:
        """Rewrite every sealed, committed, plain segment as compressed frames of the
        log's ``compression`` (nothing when it is "none"). Each segment is written to a
        temporary file, fsynced and renamed over the original like a compaction, so a crash
        leaves the plain segment or the compressed one, whole; readers holding the old
        segment keep reading it. Batches, their CRCs, offsets and timestamps are unchanged."""
        result = CompressionResult()
        codec = self.config.compression
        if codec == "none":
            return result
        with self._lock:
            upto = self.committed_offset
            plain = [
                s
                for s in self.segments[:-1]
                if s.next_offset <= upto and not s.compressed and s.size
            ]
        for seg in plain:
            if self.closed:
                break  # closed meanwhile (its segments' files too): nothing more to rewrite
            rewritten = seg.log_path.with_name(seg.log_path.name + ".compressing.tmp")
            # The new segment's indexes are built as its frames are written, so putting
            # it in place takes a rename and two small files, not a rescan.
            new = Segment(self.directory, seg.base_offset, seg.index_interval_bytes, self.files)
            # Frame by frame as the segment is read: one frame and one read chunk in memory.
            try:
                with open(rewritten, "wb") as f:
                    group: list[Batch] = []
                    group_bytes = 0
                    for batch in seg.batches_from(0, seg.size):
                        group.append(batch)
                        group_bytes += batch.length
                        if group_bytes >= FRAME_BYTES:
                            new.size += self._write_frame(f, new, codec, group)
                            group, group_bytes = [], 0
                    if group:
                        new.size += self._write_frame(f, new, codec, group)
                    f.flush()
                    os.fsync(f.fileno())
            except (StorageError, OSError):
                if not self.closed:
                    raise
                # Closed meanwhile: the segment's file is closed, a deleted stream's
                # directory may be gone.
                rewritten.unlink(missing_ok=True)
                break
            new.compressed = True
            new.next_offset = max(new.next_offset, seg.next_offset)
            with self._rewrite_lock:
                with self._lock:
                    gone = self._index_of(seg) is None or self.closed
                if gone:  # removed by retention meanwhile, or closed
                    # Closed: a deleted stream's directory may be gone with the file.
                    rewritten.unlink(missing_ok=True)
                    new.close()
                    continue
                self._rename_over(seg, rewritten)
                new.write_index_files(sync=True)
                new.map_index_files()
                self._swap(seg, new)
            result.segments_compressed += 1
            result.bytes_before += seg.size
            result.bytes_after += new.size
            log.info(
                "compressed %s with %s: %d -> %d bytes",
                seg.log_path.name,
                codec,
                seg.size,
                new.size,
            )
        return result

    @staticmethod
    def _write_frame(f: BinaryIO, seg: Segment, codec: str, group: list[Batch]) -> int:
        """Write one frame of ``group`` at the end of ``f`` and index it in ``seg``."""
        frame = encode_frame(codec, group)
        seg._index_unit(group, seg.size, len(frame))
        f.write(frame)
        return len(frame)

    # ---- deletion -------------------------------------------------------------------

    def delete(self) -> None:
        """Close and remove the whole log directory, after a segment's rewrite under way
        (as :meth:`close`: its rename must not land in a directory being removed)."""
        with self._rewrite_lock, self._lock:
            for seg in self.segments:
                seg.close()
            for _, seg in self._graveyard:  # their retired .log and mapped index files
                seg.close()
            self._graveyard.clear()
            self.closed = True
        shutil.rmtree(self.directory, ignore_errors=True)

    def describe(self) -> dict[str, object]:
        with self._lock:
            return {
                "start_offset": self.start_offset,
                "end_offset": self.end_offset,
                "committed_offset": self.committed_offset,
                "segments": len(self.segments),
                "size_bytes": self.size_bytes,
                "segment_files": [segment_name(s.base_offset, ".log") for s in self.segments],
            }


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _intact_prefix(batches: Iterator[Batch], served: Callable[[], bool]) -> Iterator[Batch]:
    """``batches`` up to a damaged one: CorruptBatchError as they raise it, unless
    ``served()`` (the read has events to answer with), then the end. A page reaching a
    damaged batch answers the intact events before it, and the next read, from the
    damaged batch, fails: as a Kafka fetch returns the valid batches before a bad one."""
    try:
        yield from batches
    except CorruptBatchError:
        if not served():
            raise
