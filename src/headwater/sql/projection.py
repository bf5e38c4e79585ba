"""Stream projections: each stream's committed events as Arrow record batches, sealed
ones memory-mapped from files beside the log and the unsealed tail in memory.

A projection follows its stream's log incrementally. Every commit notification raises
its target; at most one catch-up runs per stream, in a worker thread, so a burst of
commits becomes one catch-up. Commits do not start a catch-up at once: the first commit
after a round arms a timer of ``CATCH_UP_DELAY`` seconds and the round then takes
everything committed meanwhile (a round costs one to two milliseconds of CPU whatever
its size, part of it holding the GIL against the event loop, so a round per single-event
commit was most of a busy server's CPU and the tail of its append latency; at 0.1 s
rounds still showed in the p99 of single-event appends, at 0.5 s much less:
docs/benchmarks.md). While the stream is being written hard (a commit within the last
``CATCH_UP_QUIET``, or appends waiting for their fsync) that round waits for the writes
to pause, up to ``CATCH_UP_MAX_DELAY`` or a backlog of ``BACKLOG_ROWS``: a round run
beside a Kafka produce held the GIL against the loop answering it (librdkafka's
produce round trip, worst 100 ms window, 146-302 ms with them against 51-79 ms with the
rounds after the produce, docs/benchmarks.md). Anyone who needs the projection now
starts it at once: a Query (read your writes), a range read, a QueryAt that finds it
behind (:meth:`StreamProjection.request_catch_up`), so no query ever sees less than it
did.
A catch-up reads stored batches from the projection's next offset and builds the
columns in bulk from the batch headers and values sections, never decoding events one
by one in Python:

* ``offset`` / ``position``: numpy over the whole round (each piece's base offset and
  first position repeated, plus a ``0..n`` range; offset deltas are honoured for sparse
  batches), so the Python work is per stored batch, not per column and batch;
* ``ts``: each batch's timestamp repeated (microseconds, DuckDB ``TIMESTAMP``);
* ``data``: each value's span in the values sections (past its ``u64`` length), or in a
  Kafka-form batch's records, read for all of a round's Kafka batches at once by numpy
  (:func:`headwater.storage.kafka_batch.sections_values`: no Python object per record),
  cut out in one Arrow ``take`` (:func:`spans_array`);
* ``json``: the very same offsets and bytes as an Arrow ``arrow.json`` string array whose
  validity is DuckDB's ``json_valid`` over the chunk, so events that are not JSON (or not
  UTF-8) are NULL and no bytes are copied twice; DuckDB is not asked when no event
  starts with a byte JSON text can start with (:func:`may_be_json`).

Chunks are immutable; a query captures the tuple of chunks and the position it reads at,
so later catch-ups never disturb it. Small trailing chunks are merged binary-counter
style (amortised O(log n) copies per row) so a slow trickle of commits does not leave
thousands of tiny batches for every query to scan.

Sealed files (:mod:`headwater.sql.sealed`): a chunk that reaches ``SEAL_ROWS`` rows or
``SEAL_BYTES`` of data is written, in the round that built it, to an Arrow IPC file
beside the stream's log and replaced by the same rows memory-mapped from that file; the
chunks before it are merged into the same file, so the files follow each other in
offset order and only the unsealed tail is held in memory (below a seal per stream;
past ``TAIL_BUDGET_BYTES`` for all streams together the largest tails are sealed early,
into smaller files: :meth:`StreamTables._keep_tails_in_budget`).
A query's snapshot is the mapped files plus the tail, cut at its position and at the
log's start offset (zero-copy: DuckDB scans the mapped pages, which the kernel caches
and reclaims). Retention deletes a file once the log's start has passed its last
offset; deleting the stream deletes its directory with the log. Compaction rewrites
the log, never a sealed file: SQL keeps seeing the events a file holds, as it kept
seeing projected chunks before files existed, while what is replayed from the log (the
tail after a restart, a rebuilt file) reads the log as compaction left it.

At start (:func:`open_files`, in the projection's first task) the files are opened and
checked against their names, without reading their rows; the projection continues
after the last one and replays only the tail, so the time to ready does not grow with
the data. A damaged file is deleted and its offsets rebuilt from the log by the normal
catch-up; files after such a gap wait, parked, until the catch-up reaches them, and
coverage (below) never claims a position whose events are not all projected.

Coverage: ``covered`` is a tenant log position such that every event of this stream with
a smaller position is projected. Positions grow with offsets inside a stream, so after
projecting up to the last event at position q, ``covered >= q + 1``; and when the
projection has consumed everything below the stream's committed offset, every position
below the tenant's committed head (read before that offset) is covered, because each of
those events was committed, hence below the committed offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from headwater.errors import CorruptBatchError
from headwater.sql.duck import Database
from headwater.sql.sealed import (
    SCHEMA,
    TS_TYPE,
    SealedFileError,
    SealedMeta,
    json_column,
    list_sealed,
    open_sealed,
    projection_directory,
    remove_temporaries,
    write_sealed,
)
from headwater.storage import kafka_batch
from headwater.storage.batch import BOUNDS_FROM

if TYPE_CHECKING:
    import duckdb

    from headwater.engine.engine import Stream
    from headwater.storage.batch import Batch
    from headwater.storage.log import PartitionLog

log = logging.getLogger(__name__)

ROUND_ROWS = 65_536  # events per catch-up round
# Values-section bytes per catch-up round, and the data bytes that seal a chunk. A
# round's batches, the chunk built from them, DuckDB's json_valid over it and the merges
# of small chunks up to a seal all stand in memory at once, for each of the projection
# threads: with 32 MiB rounds and 64 MiB seals, appends of 1 KiB events took RssAnon to
# 496 MiB against a 300 MiB memory_mib; with these, 239 MiB
# (tests/integration/test_memory_budget.py). Rows cap a chunk too (SEAL_ROWS).
ROUND_BYTES = 8 << 20
# A round's log reads: one read (a pooled buffer, storage/segment.py) holds a whole
# round of ROUND_BYTES and the stored headers around its values, so its Kafka batches
# are read where they lie. At the log's default 1 MiB a round came from eight reads and
# its batches were first joined into a fresh 8 MiB bytes (2,000 page faults a round).
ROUND_READ = ROUND_BYTES + (1 << 20)
SEAL_ROWS = 65_536  # a chunk this large (in rows or in data bytes) is never merged again
SEAL_BYTES = 16 << 20
# All streams' unsealed tails together: past this the largest tails are sealed early
# (small files), so memory does not grow with the number of streams written to.
TAIL_BUDGET_BYTES = 256 << 20
RETRY_SECONDS = 1.0
CATCH_UP_DELAY = 0.5  # seconds from a commit to the catch-up round nobody asked for
# ...which waits while commits come closer together than this or appends wait for
# their fsync (the stream is being written hard: the round would take the GIL from the
# loop acknowledging them)...
CATCH_UP_QUIET = 0.1
# ...but never longer than this from that first commit, nor past a backlog of this many
# rows (it stays in the log: waiting costs no memory; a query then has more to catch up).
CATCH_UP_MAX_DELAY = 2.0
BACKLOG_ROWS = 16 * ROUND_ROWS
_JSON_VALID_SQL = "SELECT coalesce(json_valid(try(decode(data))), false) AS v FROM hw_chunk"
# The first bytes of text DuckDB's json_valid can accept (whitespace, an object, array,
# string, number, true, false, null, NaN, Infinity, inf, nan; tests/unit/sql pins it to
# DuckDB's verdict): a chunk whose every event starts otherwise (binary, Avro or
# protobuf payloads, Confluent's schema-registry framing) holds no JSON, and DuckDB is
# not asked.
JSON_FIRST_BYTES = b' \t\n\r"-0123456789INfint[{'
_MAY_START_JSON = np.zeros(256, np.bool_)
_MAY_START_JSON[list(JSON_FIRST_BYTES)] = True


@dataclass(frozen=True, slots=True)
class Chunk:
    """One immutable record batch of a projection and the positions it spans."""

    batch: pa.RecordBatch
    min_position: int
    max_position: int
    monotonic: bool  # positions strictly increase with the row (always, in practice)
    first_offset: int
    last_offset: int
    path: Path | None = None  # the sealed file the batch is mapped from

    @property
    def rows(self) -> int:
        return int(self.batch.num_rows)

    @property
    def small(self) -> bool:
        """Still merged with its neighbours (see :meth:`ChunkBuilder.extend`); a chunk
        that is not is sealed: written to a file and mapped from it."""
        if self.path is not None:
            return False
        values = self.batch.column(3).buffers()[2]
        return self.rows < SEAL_ROWS and (values is None or values.size < SEAL_BYTES)

    @property
    def meta(self) -> SealedMeta:
        return SealedMeta(
            self.rows,
            self.first_offset,
            self.last_offset,
            self.min_position,
            self.max_position,
            self.monotonic,
        )

    @classmethod
    def open(cls, path: Path) -> Chunk:
        """The chunk of a sealed file, mapped (SealedFileError when it is unusable)."""
        batch, meta = open_sealed(path)
        return cls(
            batch,
            meta.min_position,
            meta.max_position,
            meta.monotonic,
            meta.first_offset,
            meta.last_offset,
            path,
        )


@dataclass(frozen=True, slots=True)
class _Piece:
    batch: Batch
    start: int
    stop: int

    @property
    def end_offset(self) -> int:
        """The offset after the piece's last event."""
        if self.stop == self.batch.count:
            return self.batch.last_offset + 1
        return (
            self.batch.base_offset + self.stop
            if self.batch.dense
            else int(self.batch.offsets()[self.stop])
        )


def _int(value: int) -> pa.Scalar:
    """An int64 scalar: a bare Python int makes pyarrow try (and fail, without numpy) an
    import on every compute call."""
    return pa.scalar(value, pa.int64())


def read_round(
    plog: PartitionLog, from_offset: int, upto: int, *, committed_only: bool = True
) -> tuple[list[_Piece], int]:
    """Stored batches holding events in [from_offset, upto), at most one round's worth;
    returns them and the offset the next round starts at. Only what read_committed
    readers see: ``upto`` is cut at the last stable offset, and transaction markers and
    aborted transactions' batches are left out (never projected). ``committed_only``
    false: what read_uncommitted readers see (open and aborted transactions' batches
    too, up to the committed offset; never markers)."""
    pieces: list[_Piece] = []
    rows = size = 0
    upto = min(upto, plog.last_stable_offset if committed_only else plog.readable_offset)
    batches = plog.batches(from_offset, upto, ROUND_READ, committed_only=committed_only)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return pieces, upto
        except CorruptBatchError:
            if not pieces:
                raise
            # The intact batches before a damaged one are projected (range reads serve
            # them); the next round, starting at the damaged batch, fails.
            return pieces, pieces[-1].end_offset
        if batch.control:
            continue
        start = batch.index_of(from_offset) if batch.base_offset < from_offset else 0
        stop = batch.index_of(upto) if batch.last_offset >= upto else batch.count
        if stop <= start:
            continue
        n = stop - start
        # A Kafka-form batch counts its stored records (decoding it here to size the
        # round decoded it twice, per record in Python: 20% of a Kafka produce's CPU).
        section = batch.payload_bytes + 8 * batch.count
        if pieces and (rows >= ROUND_ROWS or size + section > ROUND_BYTES):
            first = batch.base_offset + start if batch.dense else batch.offsets()[start]
            return pieces, int(first)
        if pieces and rows + n > ROUND_ROWS:
            # Cut inside the batch: a full round is ROUND_ROWS (= SEAL_ROWS) rows and
            # its chunk is sealed as built. Ending before the batch, every round came
            # out a little short, and its chunk was merged (every column copied) with
            # the next before it was sealed. (A first batch over a round is taken
            # whole, as a single commit is projected in one round.)
            stop = start + ROUND_ROWS - rows
            pieces.append(_Piece(batch, start, stop))
            after = batch.base_offset + stop if batch.dense else batch.offsets()[stop]
            return pieces, int(after)
        pieces.append(_Piece(batch, start, stop))
        rows += n
        size += section


_I64_MAX = (1 << 63) - 1
_MAX_MS = _I64_MAX // 1000  # the largest time in ms whose us fit in 64 bits


def micros(ms: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Timestamps in ms as the ``ts`` column's us. A producer may store any 64-bit
    time (nanoseconds taken for ms, 2**62): one past what us hold is DuckDB's
    ``infinity`` (or ``-infinity``), never an overflow that stops the projection."""
    us = ms * 1000
    beyond = (ms > _MAX_MS) | (ms < -_MAX_MS)
    if beyond.any():
        us[beyond] = np.where(ms[beyond] > 0, _I64_MAX, -_I64_MAX)
    return us


def piece_columns(
    pieces: Sequence[_Piece],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, pa.Array]:
    """The offset, position and timestamp (µs) columns (numpy int64) and the data column
    (Arrow binary) of stored batch pieces, column by column in bulk: Python work per
    piece is a few integers (numpy builds the columns), so a round of many single-event
    commits costs little more than one of a single large batch. Kafka-form pieces have
    their values and timestamps read for all of them at once
    (:func:`kafka_batch.sections_values`: numpy over the records, no Python object per
    record)."""
    counts: list[int] = []
    firsts: list[int] = []
    position_deltas: list[int] = []
    stamps_ms: list[int] = []
    sparse: list[tuple[int, list[int]]] = []  # (row, offsets) of pieces with gaps
    stamped: list[tuple[int, np.ndarray]] = []  # (row, ms) of pieces stamped per event
    kafka = _kafka_spans(pieces)
    kafka_index = 0
    direct = kafka is not None and len(kafka.firsts) == len(pieces) + 1
    sections: list[bytes | memoryview] = []
    value_starts: list[np.ndarray] = []
    value_ends: list[np.ndarray] = []
    singles: list[int] = []  # value starts of one-event pieces, not yet in an array
    single_ends: list[int] = []
    shift = 0
    rows = 0
    for piece in pieces:
        batch = piece.batch
        n = piece.stop - piece.start
        if batch.dense:
            firsts.append(batch.base_offset + piece.start)
        else:
            listed = batch.offsets()[piece.start : piece.stop]
            sparse.append((rows, listed))
            firsts.append(listed[0])
        counts.append(n)
        position_deltas.append(batch.first_position - batch.base_offset)
        stamps_ms.append(batch.first_timestamp_ms)
        if batch.kafka_section is not None and kafka is not None:
            first = kafka.firsts[kafka_index] + piece.start
            kafka_index += 1
            stamped.append((rows, kafka.timestamps[first : first + n]))
            starts = kafka.starts[first : first + n]
            ends = kafka.ends[first : first + n]
            if direct:  # every piece is of Kafka form: the spans index the records read
                value_starts.append(starts)
                value_ends.append(ends)
                rows += n
                continue
            lo, hi = int(starts[0]), int(ends[-1])
            sections.append(memoryview(kafka.body)[lo:hi])
        else:
            # A large batch's bounds come from numpy (no step per value); small ones walked.
            large = batch.count >= BOUNDS_FROM
            record = batch.value_bounds_array() if large else batch.value_bounds()
            lo, hi = int(record[piece.start]), int(record[piece.stop])
            sections.append(batch.values_section()[lo:hi])
            if n == 1:  # the value after its u64 length
                singles.append(shift + 8)
                single_ends.append(shift + hi - lo)
                shift += hi - lo
                rows += n
                continue
            bounds = np.asarray(record[piece.start : piece.stop + 1], np.int64)
            starts, ends = bounds[:-1] + 8, bounds[1:]
        if singles:
            value_starts.append(np.array(singles, np.int64))
            value_ends.append(np.array(single_ends, np.int64))
            singles, single_ends = [], []
        value_starts.append(starts + (shift - lo))
        value_ends.append(ends + (shift - lo))
        shift += hi - lo
        rows += n
    if singles or not value_starts:
        value_starts.append(np.array(singles, np.int64))
        value_ends.append(np.array(single_ends, np.int64))
    # Row i of piece k: offset firsts[k] + (i - first row of k), unless the piece is
    # sparse (its offsets are written over).
    piece_rows = np.array(counts, np.int64)
    piece_start = np.cumsum(piece_rows) - piece_rows
    offsets = np.repeat(np.array(firsts, np.int64) - piece_start, piece_rows)
    offsets += np.arange(rows, dtype=np.int64)
    for row, listed in sparse:
        offsets[row : row + len(listed)] = listed
    positions = offsets + np.repeat(np.array(position_deltas, np.int64), piece_rows)
    stamps = np.repeat(np.array(stamps_ms, np.int64), piece_rows)
    for row, per_event in stamped:
        stamps[row : row + len(per_event)] = per_event
    stamps = micros(stamps)
    if direct and kafka is not None:
        body: bytes | memoryview = kafka.body
    else:
        body = sections[0] if len(sections) == 1 else b"".join(sections)
    data = spans_array(body, np.concatenate(value_starts), np.concatenate(value_ends))
    return offsets, positions, stamps, data


def _kafka_spans(pieces: Sequence[_Piece]) -> kafka_batch.ValueSpans | None:
    """The values and timestamps of the Kafka-form pieces' batches, read together."""
    sections = [s for p in pieces if (s := p.batch.kafka_section) is not None]
    if not sections:
        return None
    try:
        return kafka_batch.sections_values(sections)
    except kafka_batch.KafkaRecordsError as exc:
        raise CorruptBatchError(f"a Kafka-form batch does not read: {exc}") from None


def spans_array(body: bytes | memoryview, starts: np.ndarray, ends: np.ndarray) -> pa.Array:
    """An Arrow binary array of ``body[starts[i]:ends[i]]`` (spans ascending, not
    overlapping), copied out in one kernel: the spans and the gaps between them are
    one array's items, of which every other one is taken."""
    rows = len(starts)
    bounds = np.empty(2 * rows + 1, np.int32)
    bounds[0] = 0
    bounds[1::2] = starts
    bounds[2::2] = ends
    items = pa.Array.from_buffers(
        pa.binary(), 2 * rows, [None, pa.py_buffer(bounds), pa.py_buffer(body)]
    )
    return items.take(pa.array(np.arange(1, 2 * rows, 2, dtype=np.int64)))


def may_be_json(data: pa.Array) -> bool:
    """Whether an event of ``data`` (Arrow binary) may be JSON text: one that starts
    with a byte JSON text can start with (:data:`JSON_FIRST_BYTES`; an empty event is
    not JSON)."""
    rows = len(data)
    _, offsets_buffer, values_buffer = data.buffers()
    if not rows or values_buffer is None or not values_buffer.size:
        return False
    bounds = np.frombuffer(offsets_buffer, np.int32, rows + 1, data.offset * 4)
    starts = bounds[:-1]
    first = np.frombuffer(values_buffer, np.uint8)[np.minimum(starts, values_buffer.size - 1)]
    return bool((_MAY_START_JSON[first] & (bounds[1:] > starts)).any())


class ChunkBuilder:
    """Builds chunks; each worker thread keeps its own DuckDB cursor for ``json_valid``."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._local = threading.local()
        self._cursors: list[duckdb.DuckDBPyConnection] = []
        self._lock = threading.Lock()

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        cur: duckdb.DuckDBPyConnection | None = getattr(self._local, "cursor", None)
        if cur is None:
            cur = self._db.new_cursor()
            self._local.cursor = cur
            with self._lock:
                self._cursors.append(cur)
        return cur

    def close(self) -> None:
        with self._lock:
            cursors, self._cursors = self._cursors, []
        for cur in cursors:
            self._db.release(cur)

    def json_validity(self, data: pa.Array) -> pa.Buffer | None:
        """Validity bitmap of the events that are JSON text (None when all are)."""
        if not may_be_json(data):
            return pa.py_buffer(bytes((len(data) + 7) // 8))  # none is
        cur = self._cursor()
        cur.register("hw_chunk", pa.table({"data": data}))
        try:
            result = cur.sql(_JSON_VALID_SQL).to_arrow_table()
        finally:
            cur.unregister("hw_chunk")
        chunks = result.column(0).chunks
        valid = chunks[0] if len(chunks) == 1 else pa.concat_arrays(chunks)
        if valid.null_count:
            valid = pc.fill_null(valid, False)
        if valid.true_count == len(valid):
            return None
        if valid.offset:
            valid = pc.invert(pc.invert(valid))  # a fresh array: its bitmap starts at bit 0
        return valid.buffers()[1]

    def build(self, pieces: Sequence[_Piece]) -> Chunk:
        """One chunk from stored batch pieces (see :func:`piece_columns`), with the
        events that are JSON text found by DuckDB."""
        offsets, positions, stamps, data = piece_columns(pieces)
        return self._chunk(
            pa.array(offsets),
            pa.array(positions),
            pa.Array.from_buffers(TS_TYPE, len(data), [None, pa.py_buffer(stamps)]),
            data,
            self.json_validity(data),
        )

    def _chunk(
        self,
        offsets: pa.Array,
        positions: pa.Array,
        stamps: pa.Array,
        data: pa.Array,
        json_valid: pa.Buffer | None,
    ) -> Chunk:
        rows = len(data)
        json = json_column(data, json_valid)
        batch = pa.RecordBatch.from_arrays([offsets, positions, stamps, data, json], schema=SCHEMA)
        bounds = pc.min_max(positions)
        monotonic = rows < 2 or pc.min(pc.pairwise_diff(positions)).as_py() > 0
        return Chunk(
            batch,
            bounds["min"].as_py(),
            bounds["max"].as_py(),
            monotonic,
            offsets[0].as_py(),
            offsets[-1].as_py(),
        )

    def merge(self, chunks: Sequence[Chunk]) -> Chunk:
        """One chunk holding the rows of ``chunks``; data and json keep sharing bytes."""
        batches = [c.batch for c in chunks]

        def column(i: int) -> pa.Array:
            return pa.concat_arrays([b.column(i) for b in batches])

        valid = pa.concat_arrays([pc.is_valid(b.column(4).storage) for b in batches])
        bitmap = None if valid.true_count == len(valid) else valid.buffers()[1]
        return self._chunk(column(0), column(1), column(2), column(3), bitmap)

    def extend(self, tail: Sequence[Chunk], new: Chunk) -> list[Chunk]:
        """``tail + [new]`` with small trailing chunks merged (a binary counter)."""
        out = [*tail, new]
        while len(out) >= 2 and out[-1].small and out[-2].small and out[-2].rows <= out[-1].rows:
            out[-2:] = [self.merge(out[-2:])]
        return out


def table_at(chunks: Sequence[Chunk], position: int, start_offset: int = 0) -> pa.Table:
    """The rows of ``chunks`` whose tenant log position is below ``position`` and whose
    offset is not below ``start_offset`` (where retention has moved the log's start).
    Zero-copy, unless a chunk's positions were ever out of order."""
    batches: list[pa.RecordBatch] = []
    for chunk in chunks:
        if chunk.last_offset < start_offset or chunk.min_position >= position:
            continue
        batch = chunk.batch
        if chunk.first_offset < start_offset:  # offsets always ascend within a chunk
            expired = pc.sum(pc.less(batch.column(0), _int(start_offset))).as_py()
            batch = batch.slice(expired)
        if chunk.max_position >= position:
            below = pc.less(batch.column(1), _int(position))
            if chunk.monotonic:
                batch = batch.slice(0, pc.sum(below).as_py())
            else:
                batch = batch.filter(below)
        batches.append(batch)
    return pa.Table.from_batches(batches, SCHEMA)


RANGE_SCHEMA = SCHEMA.remove(4)  # offset, position, ts, data: what a range read serves


def range_batches(chunks: Sequence[Chunk], start: int, end: int) -> list[pa.RecordBatch]:
    """The rows of ``chunks`` with offsets in [start, end) as record batches of
    :data:`RANGE_SCHEMA`, zero-copy slices (offsets ascend within and across chunks)."""
    out: list[pa.RecordBatch] = []
    for chunk in chunks:
        if chunk.last_offset < start:
            continue
        if chunk.first_offset >= end:
            break
        batch = chunk.batch.drop_columns(["json"])
        offsets = batch.column(0).to_numpy()
        lo = 0 if chunk.first_offset >= start else int(offsets.searchsorted(start))
        hi = batch.num_rows if chunk.last_offset < end else int(offsets.searchsorted(end))
        if hi > lo:
            out.append(batch.slice(lo, hi - lo))
    return out


@dataclass(frozen=True, slots=True)
class _RoundResult:
    tail: list[Chunk]
    replaced: int
    next_offset: int
    max_position: int | None
    gap_closed: bool = False  # the round reached the first parked run


@dataclass(frozen=True, slots=True)
class _Opened:
    """A projection's sealed files as found at start (see :func:`open_files`)."""

    prefix: list[Chunk]  # contiguous from the start of the log
    parked: list[list[Chunk]]  # runs after a gap the log still has events in


def has_events(plog: PartitionLog, lo: int, hi: int) -> bool:
    """Whether the log holds an event with an offset in [lo, hi)."""
    for batch in plog.batches(max(lo, plog.start_offset), hi):
        start = batch.index_of(lo) if batch.base_offset < lo else 0
        stop = batch.index_of(hi) if batch.last_offset >= hi else batch.count
        if stop > start:
            return True
    return False


def open_files(directory: Path, plog: PartitionLog) -> _Opened:
    """Open the sealed files of a projection (worker thread): each is checked (see
    :func:`headwater.sql.sealed.open_sealed`) and one that is damaged, holds offsets the
    log no longer has (retention, or a log cut back by recovery) or overlaps the one
    before is deleted. Files that follow the start of the log without a gap of logged
    events are the prefix the projection continues from; the rest wait, parked, until
    the catch-up has rebuilt the gap before them. Only footers and schema metadata are
    read, so opening takes the same time whatever the data size."""
    directory.mkdir(exist_ok=True)
    remove_temporaries(directory)
    start, end = plog.start_offset, plog.end_offset
    prefix: list[Chunk] = []
    parked: list[list[Chunk]] = []
    cursor = 0  # the first offset no kept file accounts for
    for first, last, path in list_sealed(directory):
        problem = None
        if last < start:
            problem = "below the start of the log (retention)"
        elif last >= end:
            problem = f"beyond the end of the log ({end})"
        elif first < cursor:
            problem = "overlaps the file before it"
        if problem is None:
            try:
                chunk = Chunk.open(path)
            except SealedFileError as exc:
                problem = str(exc)
        if problem is not None:
            if last >= start:
                log.warning("projection file %s dropped, rebuilt from the log: %s", path, problem)
            path.unlink(missing_ok=True)
            continue
        if has_events(plog, cursor, first):
            parked.append([chunk])
        elif parked:
            parked[-1].append(chunk)
        else:
            prefix.append(chunk)
        cursor = last + 1
    return _Opened(prefix, parked)


class StreamProjection:
    """The projection of one partition of a stream (``partition-<n>/`` into
    ``projection-<n>/``); a stream's SQL table is its partitions' projections together
    (:class:`headwater.sql.tables.StreamTable`). Every attribute is owned by the loop
    thread."""

    def __init__(
        self,
        stream: Stream,
        builder: ChunkBuilder,
        executor: Executor,
        on_progress: Callable[[], None],
        partition: int = 0,
    ) -> None:
        self.stream = stream
        self.partition = partition
        self.plog = stream.partition_logs[partition]
        self.committer = stream.committers[partition]
        self.name = stream.name
        self.tenant_id = stream.tenant.tenant_id
        self.directory = projection_directory(stream.directory, partition)
        self._chunks: tuple[Chunk, ...] = ()
        self._tail_bytes = 0
        self.opened = False  # the sealed files are open (the first task does it)
        self._parked: list[list[Chunk]] = []  # sealed runs past a gap being rebuilt
        self._seal_tail = False  # seal the in-memory tail now, however small
        self.next_offset = 0
        self.covered = 0
        self.paused = False
        self.closed = False
        self.error: str | None = None
        self.damage: str | None = None  # the last round met a batch that does not read
        self._builder = builder
        self._executor = executor
        self._on_progress = on_progress
        self._target = 0
        self._retry_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._urgent = False  # someone waits for the projection: no delay
        self._timer: asyncio.TimerHandle | None = None
        self._first_commit_at = 0.0  # loop time of the first commit the timer waits for
        self._last_commit_at = 0.0
        self._loop = asyncio.get_running_loop()
        # The log's start when last looked at, and where QueryAt is exact from: opened
        # after retention removed rows, when is not known, so from now on.
        self._seen_start = self.plog.start_offset
        self.history_from = stream.tenant.committed_position + 1 if self._seen_start else 0
        self.committer.add_listener(self._on_commit)
        self.request_catch_up()

    # ---- coverage and snapshots (loop thread) -----------------------------------------

    @property
    def rows(self) -> int:
        return sum(c.rows for c in self.chunks)

    def covered_position(self, head: int) -> int:
        """Every event of this stream below the returned position is projected. ``head``
        is the tenant's committed position, read before this call. Past an open
        transaction's first event nothing is covered until it ends (QueryAt stays exact:
        a commit cannot add rows below a position already answered)."""
        if self.next_offset >= self.plog.last_stable_offset and head > self.covered:
            unstable = self.plog.first_unstable_position()
            self.covered = head if unstable is None else max(self.covered, min(head, unstable))
        return self.covered

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return self._chunks

    @chunks.setter
    def chunks(self, chunks: tuple[Chunk, ...]) -> None:
        # The tail's size is kept with the chunks: the tail budget reads every
        # projection's, so it must not cost a walk over each one's chunks.
        self._chunks = chunks
        self._tail_bytes = sum(
            c.batch.column(3).nbytes + 24 * c.rows for c in chunks if c.path is None
        )

    @property
    def tail_bytes(self) -> int:
        """Memory held by the unsealed chunks (their data; ``json`` shares it)."""
        return self._tail_bytes

    def seal_tail(self) -> None:
        """Write the in-memory tail to a sealed file now (the tail budget is exceeded)."""
        if any(c.path is None for c in self.chunks):
            self._seal_tail = True
            self._kick()

    @property
    def files(self) -> list[Path]:
        """The sealed files the projection maps (parked ones included)."""
        chunks = [*self.chunks, *(c for run in self._parked for c in run)]
        return [c.path for c in chunks if c.path is not None]

    def snapshot(self, position: int) -> Callable[[], pa.Table]:
        self._expire()
        chunks = self.chunks
        start = self.plog.start_offset
        if start > self._seen_start:
            # Rows retention removed were in answers at every position up to the head:
            # those positions would now answer without them, so QueryAt refuses them.
            self._seen_start = start
            self.history_from = self.stream.tenant.committed_position + 1
        return lambda: table_at(chunks, position, start)

    def _expire(self) -> None:
        """Retention moved the log's start past whole chunks: free them and delete their
        files (a query still reading one keeps its mapping until it is done)."""
        start = self.plog.start_offset
        expired = [c for c in self.chunks if c.last_offset < start]
        if not expired and not (self._parked and self._parked[0][0].last_offset < start):
            return
        self.chunks = tuple(c for c in self.chunks if c.last_offset >= start)
        for run in self._parked:
            expired += [c for c in run if c.last_offset < start]
        self._parked = [
            kept for run in self._parked if (kept := [c for c in run if c.last_offset >= start])
        ]
        for chunk in expired:
            if chunk.path is not None:
                with contextlib.suppress(OSError):
                    chunk.path.unlink()

    # ---- catch-up ----------------------------------------------------------------------

    def _on_commit(self, committed_offset: int) -> None:
        # Up to the last stable offset: an open transaction's events wait for its end.
        stable = min(committed_offset, self.plog.last_stable_offset)
        if stable > self._target:
            self._target = stable
        self._last_commit_at = self._loop.time()
        self._arm()

    def _arm(self) -> None:
        """Start a round for the backlog now if it is large, else arm the timer."""
        if self._target - self.next_offset >= BACKLOG_ROWS:
            self._kick()  # waiting longer only makes a query's catch-up longer
        elif self._timer is None and self._task is None:
            self._first_commit_at = self._loop.time()
            self._timer = self._loop.call_later(CATCH_UP_DELAY, self._timer_fired)

    def _timer_fired(self) -> None:
        self._timer = None
        now = self._loop.time()
        left = self._first_commit_at + CATCH_UP_MAX_DELAY - now
        if left > 0 and (now - self._last_commit_at < CATCH_UP_QUIET or self._fsync_due()):
            # Written hard: look again once the writes may have paused.
            self._timer = self._loop.call_later(min(CATCH_UP_QUIET, left), self._timer_fired)
            return
        self._kick()

    def _fsync_due(self) -> bool:
        """Appends written and waiting for their fsync: the stream is being written even
        when its commits are far apart (a loaded machine leaves the server off its core
        for tens of milliseconds: with the commits' spacing alone, at 50 ms, the rounds
        still ran inside a Kafka produce at load 4.8)."""
        return self.committer.policy.kind == "fsync" and (
            self.plog.end_offset > self.plog.durable_offset
        )

    def request_catch_up(self) -> None:
        """Project everything committed, starting now (queries and reads call this)."""
        if self.closed:
            return
        self._target = max(self._target, self.plog.last_stable_offset)
        self._urgent = True
        self._kick()

    def pause(self) -> None:
        """Stop projecting after the round in flight (for tests and operations)."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self.request_catch_up()

    def _kick(self) -> None:
        if self.closed or self.paused or self._task is not None:
            return
        if self.error is not None and self._loop.time() < self._retry_at:
            return  # failed recently: the retry is scheduled
        if self.next_offset >= self._target and not self._seal_tail:
            self._urgent = False
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._task = self._loop.create_task(self._run())

    def _more(self, first: bool) -> bool:
        """Another round now? The first always; then only while someone waits or a full
        round's worth is committed (later commits have armed, or will arm, the timer): a
        catch-up, once started, takes the backlog in rounds back to back."""
        if self.closed or self.paused:
            return False
        if self._seal_tail:
            return True
        if self.next_offset >= self._target:
            return False
        return first or self._urgent or self._target - self.next_offset >= ROUND_ROWS

    async def _run(self) -> None:
        first = True
        try:
            if not self.opened:
                opened = await self._loop.run_in_executor(
                    self._executor, open_files, self.directory, self.plog
                )
                if self.closed:
                    return
                self._install_opened(opened)
            while self._more(first):
                first = False
                small = 0
                while small < len(self.chunks) and self.chunks[-1 - small].small:
                    small += 1
                tail = self.chunks[len(self.chunks) - small :]
                gap_end = self._parked[0][0].first_offset if self._parked else None
                upto = self._target if gap_end is None else min(self._target, gap_end)
                seal_tail, self._seal_tail = self._seal_tail, False
                result = await self._loop.run_in_executor(
                    self._executor, self._round, self.next_offset, upto, tail, gap_end, seal_tail
                )
                if self.closed:
                    return
                self._install(result)
            self.error = self.damage = None
            if self.next_offset >= self._target:
                self._urgent = False
        except Exception as exc:
            if self.closed:
                return
            error = f"{type(exc).__name__}: {exc}"
            if error != self.error:
                log.exception("projecting stream %s (tenant %d) failed", self.name, self.tenant_id)
            self.error = error
            if isinstance(exc, CorruptBatchError):
                self.damage = f"stream {self.name}: {exc}"
                self._on_progress()  # the tenant's waiting queries stop waiting for it
            self._retry_at = self._loop.time() + RETRY_SECONDS
            self._loop.call_later(RETRY_SECONDS, self._kick)
        finally:
            self._task = None
            if not self.closed and self.error is None and self.next_offset < self._target:
                self._arm()  # committed during the round

    def _round(
        self,
        from_offset: int,
        upto: int,
        tail: Sequence[Chunk],
        gap_end: int | None,
        seal_tail: bool = False,
    ) -> _RoundResult:
        """Worker thread: read and build one round, and seal what has grown full. When
        the round reaches ``gap_end`` (a parked run's first offset) everything built is
        sealed, so the files stay in offset order with only the tail in memory; so it is
        with ``seal_tail`` (the tails of all streams have outgrown their budget)."""
        pieces, next_offset = read_round(self.plog, from_offset, upto)
        gap_closed = gap_end is not None and next_offset >= gap_end
        max_position = None
        new_tail = list(tail)
        if pieces:
            chunk = self._builder.build(pieces)
            new_tail = self._builder.extend(tail, chunk)
            max_position = chunk.max_position
        new_tail = self._seal(new_tail, everything=gap_closed or seal_tail)
        return _RoundResult(new_tail, len(tail), next_offset, max_position, gap_closed)

    def _seal(self, chunks: list[Chunk], *, everything: bool) -> list[Chunk]:
        """Write the chunks up to the last full one (all of them with ``everything``) as
        one sealed file and map it in their place."""
        full = [i for i, c in enumerate(chunks) if c.path is None and (everything or not c.small)]
        if not full:
            return chunks
        cut = full[-1] + 1
        merged = chunks[0] if cut == 1 else self._builder.merge(chunks[:cut])
        plog = self.plog
        if merged.last_offset >= plog.durable_offset:
            # Under sync "none" or "interval" committed events may not be on disk yet; a
            # file must never outlive the log events it holds (a power loss could give
            # their offsets to other events), so the log is made durable first.
            plog.sync()
        path = write_sealed(self.directory, merged.batch, merged.meta)
        return [Chunk.open(path), *chunks[cut:]]

    def _install_opened(self, opened: _Opened) -> None:
        self.opened = True
        self.chunks = tuple(opened.prefix)
        self._parked = opened.parked
        if opened.prefix:
            self.next_offset = opened.prefix[-1].last_offset + 1
            self.covered = max(c.max_position for c in opened.prefix) + 1
        if opened.parked:
            log.info(
                "projection of stream %s (tenant %d): rebuilding offsets %d..%d from the log",
                self.name,
                self.tenant_id,
                self.next_offset,
                opened.parked[0][0].first_offset - 1,
            )
        self._expire()
        self._on_progress()

    def _install(self, result: _RoundResult) -> None:
        kept = self.chunks[: len(self.chunks) - result.replaced]
        self.chunks = kept + tuple(result.tail)
        self.next_offset = max(self.next_offset, result.next_offset)
        if result.max_position is not None and result.max_position + 1 > self.covered:
            self.covered = result.max_position + 1
        if result.gap_closed and self._parked:
            run = self._parked.pop(0)
            self.chunks += tuple(run)
            self.next_offset = max(self.next_offset, run[-1].last_offset + 1)
            self.covered = max(self.covered, max(c.max_position for c in run) + 1)
        self._expire()
        self.covered_position(self.stream.tenant.committed_position)
        self._on_progress()

    async def close(self) -> None:
        self.closed = True
        self.committer.remove_listener(self._on_commit)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task = self._task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
