"""Kafka record batches (v2) as headwater stores them: the bytes of a produced batch
from its CRC to its end, verbatim, compressed or not (docs/storage-format.md, "Kafka
form"). The Kafka CRC-32C covers exactly the bytes after it, so it stays valid; a fetch
puts back the 17 bytes before it (base offset, batch length, partition leader epoch,
magic), which the broker rewrites anyway.

The stored section, big-endian as Kafka has it::

    0  crc                uint32  CRC-32C of bytes [4, end)
    4  attributes         int16   bits 0-2 codec, 3 LogAppendTime, 4 transactional,
                                  5 control
    6  last offset delta  int32
   10  base timestamp     int64
   18  max timestamp      int64
   26  producer id        int64
   34  producer epoch     int16
   36  base sequence      int32
   40  records count      int32
   44  records (compressed as a whole when the codec is not none)

This module is the one place that reads records out of such a section: the log checks
a produced section once (:func:`check_section`: numpy reading every record's fields at
once for a long batch, else aiokafka's compiled reader and numpy over the columns it
reads, the Python walk only for batches neither proves sound), the SQL projection reads
values and timestamps with the same numpy reader (:func:`sections_values`), and every
other reader that wants events rather than Kafka bytes decodes it with
:func:`decode_section`. The protocol module (``protocols.kafka.records``) builds on the
same decompression and record parsing.
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter, itemgetter, length_hint
from typing import NamedTuple

import cramjam
import lz4.frame
import numpy as np
import numpy.typing as npt
import zstandard
from aiokafka.errors import CorruptRecordException
from aiokafka.record.default_records import DefaultRecordBatch
from crc32c import crc32c

SECTION_HEADER = struct.Struct(">Ihiqqqhii")
SECTION_HEADER_SIZE = SECTION_HEADER.size  # 44
PREFIX = struct.Struct(">qiib")  # base offset, batch length, leader epoch, magic
PREFIX_SIZE = PREFIX.size  # 17: where the section starts in a Kafka batch
LENGTH_AFTER = 12  # Kafka's batch length counts the bytes after base offset and itself
MAGIC = 2
ATTR_CODEC = 0x07
ATTR_LOG_APPEND_TIME = 0x08
ATTR_TRANSACTIONAL = 0x10
ATTR_CONTROL = 0x20
_ATTRIBUTES_AT = 4
_MAX_TIMESTAMP_AT = 18
_I16 = struct.Struct(">h")
_I64 = struct.Struct(">q")
_U32 = struct.Struct(">I")

CODEC_NAMES = {1: "GZIP", 2: "SNAPPY", 3: "LZ4", 4: "ZSTD"}


class KafkaRecordsError(ValueError):
    """Records that cannot be read. ``reason``: ``corrupt`` (bad bytes), ``too_large``
    (they inflate past the bound) or ``codec`` (an unknown compression codec)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _corrupt(message: str) -> KafkaRecordsError:
    return KafkaRecordsError("corrupt", message)


@dataclass(frozen=True, slots=True)
class SectionHeader:
    crc: int
    attributes: int
    last_offset_delta: int
    base_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    records_count: int

    @property
    def log_append_time(self) -> bool:
        return bool(self.attributes & ATTR_LOG_APPEND_TIME)

    @property
    def first_timestamp(self) -> int:
        """The first record's timestamp as a reader sees it (with LogAppendTime every
        record has the batch's max timestamp)."""
        return self.max_timestamp if self.log_append_time else self.base_timestamp


def section_header(section: bytes | bytearray | memoryview) -> SectionHeader:
    if len(section) < SECTION_HEADER_SIZE:
        raise _corrupt(f"a Kafka batch section of {len(section)} bytes has no header")
    return SectionHeader(*SECTION_HEADER.unpack_from(section))


def fetch_prefix(base_offset: int, section_length: int, leader_epoch: int = 0) -> bytes:
    """The 17 bytes a stored section needs before it to be a whole Kafka batch."""
    return PREFIX.pack(base_offset, PREFIX_SIZE - LENGTH_AFTER + section_length, leader_epoch, 2)


def stamp_log_append_time(section: bytes | bytearray | memoryview, now_ms: int) -> bytes:
    """``section`` as a LogAppendTime topic stores it: the attribute set, the max
    timestamp the broker's clock, the CRC recomputed (Kafka's broker does the same)."""
    stamped = bytearray(section)
    (attributes,) = _I16.unpack_from(stamped, _ATTRIBUTES_AT)
    _I16.pack_into(stamped, _ATTRIBUTES_AT, attributes | ATTR_LOG_APPEND_TIME)
    _I64.pack_into(stamped, _MAX_TIMESTAMP_AT, now_ms)
    _U32.pack_into(stamped, 0, crc32c(memoryview(stamped)[4:]))
    return bytes(stamped)


def check_section(
    section: bytes | memoryview,
    max_decompressed: int,
    whole: bytes | memoryview | None = None,
    *,
    header: SectionHeader | None = None,
) -> SectionHeader:
    """What Kafka's log validator checks of a produced batch, from the CRC on: the
    CRC-32C, at least one record, a known codec, the records decompressing within
    ``max_decompressed`` to exactly ``records_count`` well-formed records with offset
    deltas 0..n-1 and ``last_offset_delta`` n-1, batch-at-a-time (a long batch by
    numpy, :func:`_reads_by_numpy`, else :func:`_reads_canonically`; the walk for the
    rest); a stored section always decodes
    (:func:`decode_section`). ``whole``: the produced batch ``section`` was cut from
    (its 17-byte prefix first), which the reader then reads in place when the records
    are uncompressed and stamped CreateTime (the usual batch): no copy of the records.
    ``header``: ``section_header(section)`` when the caller has read it already from
    these same bytes (a front end that parsed the produced batch's whole header holds
    it: a subclass of :class:`SectionHeader` with the prefix's fields)."""
    if header is None:
        header = section_header(section)
    actual = crc32c(memoryview(section)[4:])
    if actual != header.crc:
        raise _corrupt(
            f"record batch CRC-32C is {actual:#010x}, its header says {header.crc:#010x}"
        )
    count = header.records_count
    if count <= 0:
        raise KafkaRecordsError("invalid", "record batch has no records")
    if header.last_offset_delta != count - 1:
        raise KafkaRecordsError(
            "invalid", f"last offset delta {header.last_offset_delta} for {count} records"
        )
    records = memoryview(section)[SECTION_HEADER_SIZE:]
    codec = header.attributes & ATTR_CODEC
    if not codec and records.nbytes > max_decompressed:
        raise _too_large(max_decompressed)
    if count >= NUMPY_CHECK_RECORDS:
        # A long batch: numpy reads its records' fields all at once (what the SQL
        # projection reads it with), in place when uncompressed.
        unpacked = decompress(codec, records, max_decompressed) if codec else records
        if _reads_by_numpy(unpacked, header):
            return header
    if (
        whole is not None
        and not header.attributes & (ATTR_CODEC | ATTR_LOG_APPEND_TIME)
        and len(whole) == PREFIX_SIZE + len(section)
        and _reads_canonically(records.nbytes, header, whole)
    ):
        return header
    body = decompress(codec, records, max_decompressed)
    if not _reads_canonically(len(body), header, _reader_batch(body, header)):
        walk_records(body, count)  # the exact verdict (and error) for the rare rest
    return header


NUMPY_CHECK_RECORDS = 256
"""From this many records a produced batch is checked by numpy
(:func:`_reads_by_numpy`), whose cost per batch (tens of numpy calls) is then below
aiokafka's record objects' (about 0.3 µs per record with their garbage collection)."""


def _reads_by_numpy(body: bytes | memoryview, header: SectionHeader) -> bool:
    """Whether numpy reads ``body`` (a batch's records, uncompressed) as exactly
    ``records_count`` records as :func:`parse_records` would, run by run
    (:func:`_batch_runs`, its spans not made): then :func:`walk_records` passes it too.
    False sends the batch to the other checks (headers, values of varying sizes,
    damage). One batch is read by runs at any length: the projection's prediction
    (:func:`_predicted_spans`) gains only over many short batches read together, and
    for one batch of 256-511 records cost 4x the runs' (100 B values)."""
    count = header.records_count
    if count > len(body):
        return False
    try:
        data = memoryview(body).cast("B") if isinstance(body, memoryview) else body
        buf = np.frombuffer(body, np.uint8)
        return _batch_runs(data, buf, 0, len(buf), count, spans=False) is not None
    except IndexError:  # damage the reader missed (the property tests have seen none)
        return False  # ... is the other checks' to judge: never stored unchecked


def sections_pass(
    sections: Sequence[tuple[memoryview, SectionHeader]], max_decompressed: int
) -> list[bool]:
    """Which of a request's produced sections (each with its header, read from it)
    pass :func:`check_section`, found together: True for one that does; False for one
    that :func:`check_section` must judge (it may pass, or fail with its error).

    A Produce to several partitions carries one batch per partition, and the check of
    a long batch costs mostly numpy's fixed cost per call, once per run of equal-sized
    records (:func:`_batch_runs`). Here the runs of all the sections are laid out first
    (in Python, as :func:`_batch_runs` would find them when every row of a run reads
    like its first), then the runs of one layout, across sections, are checked by one
    set of numpy calls (:func:`_runs_pass`). A section is True only when it is
    uncompressed and long (what :func:`check_section` reads by numpy), its CRC and
    counts hold, and each of its rows passes the checks :func:`_batch_runs` makes of
    it: exactly what :func:`check_section` accepts that way."""
    verdicts = [False] * len(sections)
    groups: dict[tuple[_Layout, bytes], list[_Run]] = {}
    for index, (section, header) in enumerate(sections):
        count = header.records_count
        body = section[SECTION_HEADER_SIZE:]
        if (
            count < NUMPY_CHECK_RECORDS
            or header.attributes & ATTR_CODEC
            or header.last_offset_delta != count - 1
            or body.nbytes > max_decompressed
            or crc32c(section[4:]) != header.crc
        ):
            continue
        runs = _planned_runs(index, body, count)
        if runs is None:
            continue
        verdicts[index] = True
        for run in runs:
            groups.setdefault(run.key, []).append(run)
    for runs in groups.values():
        for run, passed in zip(runs, _runs_pass(runs), strict=True):
            if not passed:
                verdicts[run.section] = False
    return verdicts


class _Run(NamedTuple):
    """A planned run of a section's records: ``rows`` records of ``layout`` from byte
    ``pos`` of ``buf``, the first the ``done``-th of its section (:func:`sections_pass`).
    ``key``: the layout and the first row's bytes every row must repeat."""

    section: int
    buf: npt.NDArray[np.uint8]
    pos: int
    rows: int
    done: int
    layout: _Layout
    key: tuple[_Layout, bytes]


def _planned_runs(index: int, body: memoryview, count: int) -> list[_Run] | None:
    """The runs of the ``count`` records of ``body`` as :func:`_batch_runs` finds them
    when every row of a run reads like its first: each run as long as its layout's
    offset delta size allows; None when the layouts do not tile the body (or a run's
    varints do not end within its first 8 bytes: :func:`_batch_runs` reads those
    column by column)."""
    data = body.cast("B")
    buf = np.frombuffer(body, np.uint8)
    end = len(buf)
    runs: list[_Run] = []
    pos = done = 0
    try:
        while done < count:
            layout = _record_layout(data, pos, end, done)
            if (
                layout is None
                or len(runs) == _MAX_RUNS
                or not layout.offset_at + layout.offset_size <= 8 <= layout.size
            ):
                return None
            held = (1 << (7 * layout.offset_size - 1)) - done
            rows = min(count - done, (end - pos) // layout.size, held)
            row = bytes(data[pos : pos + layout.size])
            fixed = bytes(row[c] for c in _head_mask(layout, row[:8])[2])
            runs.append(_Run(index, buf, pos, rows, done, layout, (layout, row[:8] + fixed)))
            done += rows
            pos += rows * layout.size
    except IndexError:  # damage the layout reader missed: check_section's to judge
        return None
    return runs if pos == end else None


def _runs_pass(runs: list[_Run]) -> list[bool]:
    """Whether every row of each of ``runs`` (one layout, one first row's bytes) passes
    :func:`_batch_runs`' checks (see :func:`_head_words`): one mask and compare of all
    their first 8 bytes, one compare per fixed column past them, and their offset
    deltas their indexes in their sections."""
    layout = runs[0].layout
    size = layout.size
    words = np.concatenate(
        [np.ndarray((r.rows,), np.dtype("<u8"), r.buf, r.pos, (size,)) for r in runs]
    )
    head = runs[0].key[1]
    mask, pattern, others = _head_mask(layout, head[:8])
    good = (words & mask) == pattern
    for k, column in enumerate(others):
        values = np.concatenate(
            [np.ndarray((r.rows,), np.uint8, r.buf, r.pos + column, (size,)) for r in runs]
        )
        good &= values == head[8 + k]
    shape = tuple((r.done, r.rows) for r in runs)
    expected = (_run_indexes if len(words) <= _CACHED_ROWS else _run_indexes.__wrapped__)(shape)
    good &= _word_varint(words, layout.offset_at, layout.offset_size) == expected
    if good.all():
        return [True] * len(runs)
    rows = np.array([r.rows for r in runs], np.int64)
    return np.logical_and.reduceat(good, np.cumsum(rows) - rows).tolist()  # type: ignore[no-any-return]


_CACHED_ROWS = 16_384  # 128 KiB of indexes


@functools.lru_cache(maxsize=16)
def _run_indexes(runs: tuple[tuple[int, int], ...]) -> Int64s:
    """The records' indexes in their sections of runs laid end to end, each run
    ``(done, rows)``: ``done .. done + rows - 1``. A producer's batches repeat a few
    shapes (librdkafka's: records 0-63, then 64 on), so each is worked out once; at
    most 16 of at most :data:`_CACHED_ROWS` rows are kept (2 MiB)."""
    indexes = np.concatenate([np.arange(done, done + rows, dtype=np.int64) for done, rows in runs])
    indexes.flags.writeable = False  # shared by every caller
    return indexes


_VARINT_LIMITS = np.array([1 << (7 * i) for i in range(1, 10)], dtype=np.uint64)
_OFFSET = attrgetter("offset")
_TIMESTAMP = attrgetter("timestamp")
_KEY = attrgetter("key")
_VALUE = attrgetter("value")
_HEADERS = attrgetter("headers")
_NAME = itemgetter(0)
_HEADER_VALUE = itemgetter(1)
Int64s = npt.NDArray[np.int64]


def _varint_sizes(values: Int64s) -> Int64s:
    """The bytes of each value's shortest zigzag varint."""
    zigzag = ((values << 1) ^ (values >> 63)).view(np.uint64)
    return 1 + np.searchsorted(_VARINT_LIMITS, zigzag, side="right").astype(np.int64)


def _lengths(fields: list[bytes | None]) -> Int64s:
    """Each field's byte length, -1 for None (a null key or value). All null (keys,
    mostly) and none null (values) are the common cases and the fastest."""
    count = len(fields)
    nulls = fields.count(None)
    if nulls == count:
        return np.full(count, -1, np.int64)
    if nulls == 0:
        return np.fromiter(map(len, fields), np.int64, count)  # type: ignore[arg-type]
    return np.fromiter(map(length_hint, fields, repeat(-1)), np.int64, count)


def _reader_batch(body: bytes, header: SectionHeader) -> bytes:
    """A whole batch of ``body`` (decompressed records) for aiokafka's reader: base
    offset and base timestamp 0, so its offsets and timestamps are the deltas
    themselves; CreateTime, so the timestamps are not the max timestamp."""
    reader_header = SECTION_HEADER.pack(
        0,
        header.attributes & ~(ATTR_CODEC | ATTR_LOG_APPEND_TIME),
        header.last_offset_delta,
        0,
        header.max_timestamp,
        header.producer_id,
        header.producer_epoch,
        header.base_sequence,
        header.records_count,
    )
    return b"".join((fetch_prefix(0, SECTION_HEADER_SIZE + len(body)), reader_header, body))


def _reads_canonically(body_size: int, header: SectionHeader, batch: bytes | memoryview) -> bool:
    """Whether ``batch`` (a whole Kafka batch whose records, uncompressed and stamped
    CreateTime, take ``body_size`` bytes) holds ``records_count`` records that
    aiokafka's compiled reader reads, with offset deltas 0..n-1 and every varint in its
    shortest form (record attributes one byte below 0x80): then :func:`walk_records`
    would pass it too, and every reader (aiokafka's, librdkafka's, Java's int8
    attributes) reads the same records. Batch-at-a-time: one compiled read, then
    columns and numpy; the bytes each record takes are computed from what was read,
    and their sum equals the body's length only when no field took more bytes than its
    shortest encoding. The reader adds the batch's base offset and base timestamp,
    taken off again here (int64 arithmetic, as the reader's). False sends the batch to
    the walk (long varints, damage, a timestamp of -1 among deltas over one byte)."""
    count = header.records_count
    (base_offset,) = _I64.unpack_from(batch)
    (base_timestamp,) = _I64.unpack_from(batch, PREFIX_SIZE + 10)
    try:
        rows = list(DefaultRecordBatch(batch))
        if len(rows) != count:
            return False
        offset_deltas = np.fromiter(map(_OFFSET, rows), np.int64, count) - np.int64(base_offset)
        if not np.array_equal(offset_deltas, _ascending(count)):
            return False
        keys = _lengths(list(map(_KEY, rows)))
        try:  # no tombstone (the usual batch): the lengths in one pass
            values = np.fromiter(map(len, map(_VALUE, rows)), np.int64, count)
        except TypeError:  # len(None)
            values = _lengths(list(map(_VALUE, rows)))
        # Each record's fixed bytes: its attributes and an empty headers count.
        fixed: int | Int64s = 2
        headers_size: int | Int64s = 0
        if any(map(_HEADERS, rows)):  # an empty list is false: most batches stop here
            header_counts = np.fromiter(map(len, map(_HEADERS, rows)), np.int64, count)
            pairs = list(chain.from_iterable(map(_HEADERS, rows)))
            names = np.fromiter(map(len, map(str.encode, map(_NAME, pairs))), np.int64, len(pairs))
            header_values = _lengths(list(map(_HEADER_VALUE, pairs)))
            sizes = (
                _varint_sizes(names)
                + names
                + _varint_sizes(header_values)
                + np.maximum(header_values, 0)
            )
            ends = np.concatenate(([0], np.cumsum(sizes)))
            last = np.cumsum(header_counts)
            headers_size = ends[last] - ends[last - header_counts]
            fixed = 1 + _varint_sizes(header_counts)
    except (CorruptRecordException, UnicodeDecodeError, ValueError, TypeError, OverflowError):
        return False
    # One varint sizing for the keys and values together: per batch, numpy's call
    # overhead weighs as much as its per-record work.
    fields = np.concatenate((keys, values))
    lengths = (
        fixed
        + _ascending_sizes(count)
        + _varint_sizes(fields).reshape(2, count).sum(axis=0)
        + np.maximum(fields, 0).reshape(2, count).sum(axis=0)
        + headers_size
    )
    # Every size counted is at most the bytes the field takes (a varint takes at least
    # its shortest form, and a record's length prefix at least the shortest form of the
    # least length), while the records the reader framed take the whole body: the sum
    # equals the body's length only when every field is in its shortest form. The
    # timestamp deltas counted as one byte each (librdkafka's are a few milliseconds)
    # spare reading them; a batch that does not add up so is sized with them.
    if _framed_size(lengths + 1) == body_size:
        return True
    try:
        # A timestamp of -1 reads as None (aiokafka's "no timestamp"): a TypeError here.
        timestamps = np.fromiter(map(_TIMESTAMP, rows), np.int64, count)
    except (TypeError, OverflowError):
        return False
    timestamp_sizes = _varint_sizes(timestamps - np.int64(base_timestamp))
    if int(timestamp_sizes.max()) >= 10:  # near 64 bits: the walk tells what fits
        return False
    return _framed_size(lengths + timestamp_sizes) == body_size


def _framed_size(lengths: Int64s) -> int:
    """The bytes of records of these lengths, each after its shortest length varint."""
    return int((_varint_sizes(lengths) + lengths).sum())


_ASCENDING = np.arange(1 << 17, dtype=np.int64)
_ASCENDING_SIZES = 1 + np.searchsorted(_VARINT_LIMITS, (_ASCENDING << 1).view(np.uint64), "right")


def _ascending(count: int) -> Int64s:
    """0..count-1 (a read-only view for the usual counts)."""
    return _ASCENDING[:count] if count <= len(_ASCENDING) else np.arange(count, dtype=np.int64)


def _ascending_sizes(count: int) -> Int64s:
    """The varint sizes of the offset deltas 0..count-1."""
    if count <= len(_ASCENDING):
        return _ASCENDING_SIZES[:count]
    return _varint_sizes(np.arange(count, dtype=np.int64))


StoredHeaders = tuple[tuple[bytes, bytes], ...]
Columns = tuple[list[int], list[bytes | None], list[bytes | None], list[StoredHeaders]]
"""A batch's records as columns: timestamps, keys, values (None: a tombstone), headers."""


def decode_section(section: bytes | memoryview) -> Columns:
    """A stored (checked) section's records as columns (timestamps, keys, values,
    headers): the timestamps per record (base timestamp + delta, or the max timestamp
    for LogAppendTime), a null value for a tombstone, header names as UTF-8 bytes and a
    null header value as empty bytes (headwater's headers have no null).

    The records are read by aiokafka's record reader (Cython), about ten times faster
    than :func:`parse_records`; on every batch :func:`check_section` passes the two
    read the same records (tests/property/test_kafka_records.py). The decompression
    is this module's, bounded; aiokafka is handed the records uncompressed."""
    header = section_header(section)
    codec = header.attributes & ATTR_CODEC
    body = decompress(codec, memoryview(section)[SECTION_HEADER_SIZE:])
    rebuilt = b"".join(
        (
            fetch_prefix(0, SECTION_HEADER_SIZE + len(body)),
            bytes(section[:_ATTRIBUTES_AT]),
            _I16.pack(header.attributes & ~ATTR_CODEC),
            bytes(section[_ATTRIBUTES_AT + 2 : SECTION_HEADER_SIZE]),
            body,
        )
    )
    try:
        rows = list(DefaultRecordBatch(rebuilt))
    except (CorruptRecordException, UnicodeDecodeError, ValueError) as exc:
        raise _corrupt(f"records do not read: {exc}") from None
    if len(rows) != header.records_count:
        raise _corrupt(f"{len(rows)} records where the header says {header.records_count}")
    # Columns by map over the rows (C-level calls, not a Python step per record), and
    # the headers walked only when some record has them (an empty list is false).
    stored_headers: list[StoredHeaders] = [()] * len(rows)
    if any(map(_HEADERS, rows)):
        stored_headers = [
            tuple((name.encode(), value or b"") for name, value in row.headers)
            if row.headers
            else ()
            for row in rows
        ]
    return (
        list(map(_TIMESTAMP, rows)),
        list(map(_KEY, rows)),
        list(map(_VALUE, rows)),
        stored_headers,
    )


@dataclass(frozen=True, slots=True)
class ValueSpans:
    """Where the values of a run of sections' records lie, as columns over all their
    records in order: value ``i`` is ``body[starts[i]:ends[i]]`` (a tombstone's span is
    empty; spans ascend and never overlap), stamped ``timestamps[i]`` (ms); section
    ``k``'s records are ``firsts[k]`` to ``firsts[k + 1]``."""

    body: bytes | memoryview
    starts: Int64s
    ends: Int64s
    timestamps: Int64s
    firsts: list[int]


def sections_values(sections: Sequence[bytes | memoryview]) -> ValueSpans:
    """Stored (checked) sections' values and timestamps, for the SQL projection, as
    columns, batch-at-a-time over them all: no Python object per record.

    Their records bytes (decompressed) are laid end to end and every record's start
    is predicted: within a batch a producer's records usually differ only in the bytes
    their offset delta takes (fixed-size values, small timestamp deltas, no headers),
    so each is predicted the size of its batch's first record, give or take that.
    numpy then reads every record's fields at those starts at once and checks each
    record as :func:`parse_records` does (its length varint where predicted, so the
    next record starts where predicted too; attributes one byte; offset deltas 0..n-1;
    key and value within the record; nothing after the last). A batch where anything
    differs (values of varying sizes, headers, long timestamp deltas) is decoded by
    :func:`decode_section` instead. Either way the values and timestamps are
    :func:`parse_records`' (tests/property/test_kafka_records.py)."""
    if not sections:
        return ValueSpans(b"", _NO_SPANS, _NO_SPANS, _NO_SPANS, [0])
    headers = [section_header(section) for section in sections]
    bodies: list[bytes | memoryview] = []
    for section, header in zip(sections, headers, strict=True):
        body = memoryview(section)[SECTION_HEADER_SIZE:]
        codec = header.attributes & ATTR_CODEC
        bodies.append(decompress(codec, body) if codec else body)
    counts = np.array([h.records_count for h in headers], np.int64)
    firsts = np.concatenate(([0], np.cumsum(counts)))
    lengths = np.array([len(body) for body in bodies], np.int64)
    shared = _shared_buffer(bodies)
    whole: bytes | memoryview
    if shared is not None:
        # Uncompressed batches read from one buffer (the log's read chunk) are read
        # where they lie: no copy of them laid end to end.
        whole, body_starts = shared
    else:
        whole = b"".join(bodies)
        body_starts = np.cumsum(lengths) - lengths
    predicted = _spans_at(whole, body_starts, lengths, headers, counts, firsts)
    if predicted is not None and predicted[3].all():
        starts, ends, timestamps, _ = predicted
        return ValueSpans(whole, starts, ends, timestamps, firsts.tolist())
    # Some batches were not as predicted: those are decoded, and the values laid end to
    # end in their place.
    parts: list[bytes | memoryview] = []
    starts_parts: list[Int64s] = []
    ends_parts: list[Int64s] = []
    stamps_parts: list[Int64s] = []
    shift = 0
    for k, records in enumerate(bodies):
        lo, hi = int(firsts[k]), int(firsts[k + 1])
        if predicted is not None and predicted[3][k]:
            starts, ends, timestamps, _ = predicted
            parts.append(records)
            body_at = int(body_starts[k])  # where the spans read it
            starts_parts.append(starts[lo:hi] + (shift - body_at))
            ends_parts.append(ends[lo:hi] + (shift - body_at))
            stamps_parts.append(timestamps[lo:hi])
            size = len(records)
        else:
            stamps, _, values, _ = decode_section(sections[k])
            value_lengths = np.fromiter(map(length_hint, values, repeat(0)), np.int64, hi - lo)
            value_ends = np.cumsum(value_lengths) + shift
            parts.append(b"".join(filter(None, values)))
            starts_parts.append(value_ends - value_lengths)
            ends_parts.append(value_ends)
            try:
                stamps_parts.append(np.array(stamps, np.int64))
            except TypeError:  # aiokafka reads a timestamp of -1 as None ("no timestamp")
                stamps_parts.append(np.array([-1 if t is None else t for t in stamps], np.int64))
            size = int(value_lengths.sum())
        shift += size
    return ValueSpans(
        b"".join(parts),
        np.concatenate(starts_parts),
        np.concatenate(ends_parts),
        np.concatenate(stamps_parts),
        firsts.tolist(),
    )


def _shared_buffer(bodies: Sequence[bytes | memoryview]) -> tuple[memoryview, Int64s] | None:
    """The one buffer every body is a view of and where each starts in it, or None
    (bodies of their own: decompressed, or from different reads)."""
    if not bodies or not all(isinstance(body, memoryview) for body in bodies):
        return None
    views: list[memoryview] = bodies  # type: ignore[assignment]
    owner = views[0].obj
    if any(view.obj is not owner or not view.c_contiguous for view in views):
        return None
    try:
        whole = memoryview(owner).cast("B")
        base = np.frombuffer(whole, np.uint8)
        starts = np.array(
            [np.frombuffer(view, np.uint8).ctypes.data for view in views], np.int64
        ) - np.int64(base.ctypes.data)
    except (TypeError, ValueError):  # not a plain byte buffer
        return None
    ends = starts + np.array([view.nbytes for view in views], np.int64)
    # In order within it (the spans ascend), and where an Arrow binary array's int32
    # offsets reach.
    if (
        (starts < 0).any()
        or (ends > len(base)).any()
        or (starts[1:] < ends[:-1]).any()
        or len(base) >= 1 << 31
    ):
        return None
    return whole, starts


def _predicted_spans(
    joined: bytes | memoryview,
    bodies: Sequence[bytes | memoryview],
    headers: Sequence[SectionHeader],
    counts: Int64s,
    firsts: Int64s,
) -> tuple[Int64s, Int64s, Int64s, npt.NDArray[np.bool_]] | None:
    """:func:`_spans_at` of ``bodies`` laid end to end in ``joined``."""
    lengths = np.array([len(body) for body in bodies], np.int64)
    return _spans_at(joined, np.cumsum(lengths) - lengths, lengths, headers, counts, firsts)


def _spans_at(
    joined: bytes | memoryview,
    body_starts: Int64s,
    lengths: Int64s,
    headers: Sequence[SectionHeader],
    counts: Int64s,
    firsts: Int64s,
) -> tuple[Int64s, Int64s, Int64s, npt.NDArray[np.bool_]] | None:
    """Every record's value span in ``joined`` (batch ``k``'s records at
    ``body_starts[k]``, ``lengths[k]`` bytes, in ascending order) and its timestamp as
    predicted (see :func:`sections_values`), and which batches read exactly so. Each
    batch of :data:`RUNS_FROM` records or more is read run by run
    (:func:`_spans_by_runs`), the shorter ones record by record
    (:func:`_spans_by_records`, in blocks of about :data:`BLOCK_RECORDS` records): a
    round of long batches with one short one among them (a producer's last) is not read
    record by record for its sake."""
    buf = np.frombuffer(joined, np.uint8)
    if not len(buf) or (counts < 1).any() or (counts > lengths).any():
        return None
    long = counts >= RUNS_FROM
    if long.all():
        return _spans_by_runs(joined, buf, body_starts, lengths, headers, counts, firsts)
    short = np.flatnonzero(~long)
    parts = [
        _spans_by_records(
            buf, body_starts[k], lengths[k], [headers[i] for i in k.tolist()], counts[k]
        )
        for k in _blocks(short, counts)
    ]
    by_records: tuple[Int64s, Int64s, Int64s, npt.NDArray[np.bool_]] = (
        np.concatenate([part[0] for part in parts]),
        np.concatenate([part[1] for part in parts]),
        np.concatenate([part[2] for part in parts]),
        np.concatenate([part[3] for part in parts]),
    )
    if not long.any():
        return by_records
    value_starts, value_ends, timestamps, batch_ok = _spans_by_runs(
        joined, buf, body_starts, lengths, headers, counts, firsts, np.flatnonzero(long)
    )
    rows = np.repeat(~long, counts)
    value_starts[rows], value_ends[rows], timestamps[rows] = by_records[:3]
    batch_ok[short] = by_records[3]
    return value_starts, value_ends, timestamps, batch_ok


BLOCK_RECORDS = 8192
"""The records :func:`_spans_by_records` reads at once: its dozens of temporary arrays
(8 bytes a record each) then stay under the server's mmap threshold (256 KiB,
server/memory.py), so they come from the heap and are reused; a projection round's
66,000 records read at once had every temporary mapped, faulted in, zeroed and unmapped
again, 3x the CPU."""


def _blocks(batches: Int64s, counts: Int64s) -> list[Int64s]:
    """``batches`` (indexes into ``counts``, ascending) in consecutive groups of about
    :data:`BLOCK_RECORDS` records."""
    held = counts[batches]
    before = np.cumsum(held) - held
    cuts = np.flatnonzero(np.diff(before // BLOCK_RECORDS)) + 1
    return np.split(batches, cuts)


def _spans_by_records(
    buf: npt.NDArray[np.uint8],
    body_starts: Int64s,
    lengths: Int64s,
    headers: Sequence[SectionHeader],
    counts: Int64s,
) -> tuple[Int64s, Int64s, Int64s, npt.NDArray[np.bool_]]:
    """:func:`_spans_at` record by record: every record's start is predicted from its
    batch's first record's size (give or take the bytes its offset delta takes) and
    all records' fields are read at once (:func:`_read_records`). A batch not as
    predicted has its records' starts found run by run (:func:`_run_starts`: a long
    batch's timestamp deltas take a second byte part way through) and is read again."""
    data = buf.data  # its items Python ints, for _varint
    first_lengths = []
    for start in body_starts.tolist():  # each batch's first record's length (a few bytes)
        try:
            # A length below a record's least (damage) is read as that: no record is
            # predicted to end before it starts.
            first_lengths.append(max(6, _varint(data, start)[0]))  # type: ignore[arg-type]
        except (IndexError, KafkaRecordsError):
            first_lengths.append(6)
    firsts = np.concatenate(([0], np.cumsum(counts)))
    total = int(firsts[-1])
    batch_first = firsts[:-1]
    local = np.arange(total, dtype=np.int64) - np.repeat(batch_first, counts)
    record_lengths = np.repeat(np.array(first_lengths, np.int64) - 1, counts)
    record_lengths += _varint_sizes(local)
    record_sizes = _varint_sizes(record_lengths) + record_lengths
    before = np.cumsum(record_sizes) - record_sizes
    body_ends = body_starts + lengths
    starts = np.repeat(body_starts - before[batch_first], counts) + before
    value_starts, value_ends, timestamps, batch_ok = _read_records(
        buf, starts, local, counts, body_ends, headers
    )
    if batch_ok.all():
        return value_starts, value_ends, timestamps, batch_ok
    again = [
        (k, found)
        for k in np.flatnonzero(~batch_ok).tolist()
        if (found := _run_starts(buf, int(body_starts[k]), int(body_ends[k]), int(counts[k])))
        is not None
    ]
    if again:
        rows = np.concatenate([local[firsts[k] : firsts[k + 1]] for k, _ in again])
        read = _read_records(
            buf,
            np.concatenate([found for _, found in again]),
            rows,
            counts[[k for k, _ in again]],
            body_ends[[k for k, _ in again]],
            [headers[k] for k, _ in again],
        )
        at = 0
        for index, (k, found) in enumerate(again):  # per batch: its rows written over
            lo, hi = int(firsts[k]), int(firsts[k + 1])
            value_starts[lo:hi] = read[0][at : at + len(found)]
            value_ends[lo:hi] = read[1][at : at + len(found)]
            timestamps[lo:hi] = read[2][at : at + len(found)]
            batch_ok[k] = read[3][index]
            at += len(found)
    return value_starts, value_ends, timestamps, batch_ok


RUNS_FROM = 512
"""Batches of at least this many records (librdkafka's, under load) are read run by run
(:func:`_batch_runs`): a few numpy calls per run of equal-sized records instead of a
dozen passes per field over every record. Shorter ones are predicted together, up to
:data:`BLOCK_RECORDS` records at a time, which costs less than a run-by-run read of each
in a Python loop."""


def _spans_by_runs(
    joined: bytes | memoryview,
    buf: npt.NDArray[np.uint8],
    body_starts: Int64s,
    lengths: Int64s,
    headers: Sequence[SectionHeader],
    counts: Int64s,
    firsts: Int64s,
    only: Int64s | None = None,
) -> tuple[Int64s, Int64s, Int64s, npt.NDArray[np.bool_]]:
    """:func:`_spans_at` of long batches, each read by :func:`_batch_runs`: every
    batch, or those ``only`` (the others' rows left 0 and not ok)."""
    total = int(firsts[-1])
    value_starts = np.zeros(total, np.int64)
    value_ends = np.zeros(total, np.int64)
    timestamps = np.zeros(total, np.int64)
    batch_ok = np.zeros(len(headers), np.bool_)
    data = memoryview(joined).cast("B") if isinstance(joined, memoryview) else joined
    for k in range(len(headers)) if only is None else only.tolist():
        header = headers[k]
        body_start = int(body_starts[k])
        body_end = body_start + int(lengths[k])
        read = _batch_runs(data, buf, body_start, body_end, int(counts[k]))
        if read is None:
            continue
        lo, hi = int(firsts[k]), int(firsts[k + 1])
        value_starts[lo:hi], value_ends[lo:hi], deltas = read
        if header.log_append_time:
            timestamps[lo:hi] = header.max_timestamp
        else:
            timestamps[lo:hi] = deltas + header.base_timestamp
        batch_ok[k] = True
    return value_starts, value_ends, timestamps, batch_ok


_MAX_VARINT = 9  # bytes; longer ones (a tenth may overflow 64 bits) are the walk's


def _batch_runs(
    data: bytes | memoryview,
    buf: npt.NDArray[np.uint8],
    pos: int,
    end: int,
    count: int,
    spans: bool = True,
) -> tuple[Int64s, Int64s, Int64s] | None:
    """The value spans and timestamp deltas of a batch's ``count`` records laid from
    ``pos`` to ``end`` of ``buf`` (``data``'s bytes), or None when they do not read
    exactly as :func:`parse_records` reads them (the caller's other checks judge those).

    Run by run: the first record of a run is read field by field, which gives its
    layout (where each varint and the key and value are, each varint's size); the
    records after it are taken as rows of that size, one 2-D view, and a row belongs to
    the run when its length, key length, value length and header count are the first
    row's bytes, its attributes one byte, and its timestamp and offset delta varints
    end where the first row's do (then every field of the row is where the first row
    has it, and the row parses as that record does); its offset delta must be its index.
    The first row that differs starts the next run (a librdkafka batch has two or
    three: its offset and timestamp deltas take a byte more part way through); a run
    is looked for only among the rows whose index its offset delta's size can hold. A
    run that a differing row ends within :data:`_MIN_RUN` rows gives up (None): values
    of varying sizes, whose every run would cost passes over the rest of the batch;
    but not when that row differs only in its timestamp or offset delta's size.

    Without ``spans`` (a produced batch's check) the same verdict, three empty arrays
    for the spans: the values' spans and timestamps are not made."""
    starts_parts: list[Int64s] = []
    ends_parts: list[Int64s] = []
    deltas_parts: list[Int64s] = []
    done = 0
    after: _Layout | None = None  # the next run's layout, when read already
    for _ in range(_MAX_RUNS):
        layout = after or _record_layout(data, pos, end, done)
        if layout is None:
            return None
        size = layout.size
        # An offset delta (zigzag) of n bytes holds indexes below 2**(7n - 1): the
        # rows past those have a longer one and end the run anyway.
        held = (1 << (7 * layout.offset_size - 1)) - done
        rows = min(count - done, (end - pos) // size, held)
        grid = buf[pos : pos + rows * size].reshape(rows, size)
        if layout.offset_at + layout.offset_size <= 8 <= size:  # see _head_words
            good, stamps, offsets = _head_words(buf, grid, pos, layout, spans)
        else:
            good = grid[:, layout.timestamp_at - 1] < 0x80  # attributes: one byte
            first = grid[0]
            for column in layout.fixed_columns():
                good &= grid[:, column] == first[column]
            stamps = _column_varints(grid, layout.timestamp_at, layout.timestamp_size, good)
            offsets = _column_varints(grid, layout.offset_at, layout.offset_size, good)
        good &= offsets == np.arange(done, done + rows, dtype=np.int64)
        run = rows if good.all() else int(np.argmin(good))
        after = None
        if run < min(_MIN_RUN, rows):
            # A row within the first few differs: values of varying sizes, unless only
            # its timestamp or offset delta takes another byte (a timestamp delta passing
            # 63 ms just after the offset delta's 64th record, a sound batch of 3 runs).
            after = _record_layout(data, pos + run * size, end, done + run)
            if after is None or not after.wider_deltas_of(layout):
                return None
        if spans:
            first_value = pos + layout.value_at + size * np.arange(run, dtype=np.int64)
            starts_parts.append(first_value)
            ends_parts.append(first_value + max(layout.value_length, 0))
            deltas_parts.append(stamps[:run])
        done += run
        pos += run * size
        if done == count:
            if pos != end:
                return None  # bytes after the last record
            if not spans:
                return _NO_SPANS, _NO_SPANS, _NO_SPANS
            if len(starts_parts) == 1:
                return starts_parts[0], ends_parts[0], deltas_parts[0]
            return (
                np.concatenate(starts_parts),
                np.concatenate(ends_parts),
                np.concatenate(deltas_parts),
            )
    return None  # sizes vary more than a few runs: decoded instead


_NO_SPANS: Int64s = np.zeros(0, np.int64)


class _Layout(NamedTuple):
    """Where a record's fields are, from its start (see :func:`_record_layout`)."""

    size: int
    timestamp_at: int  # the attributes byte is just before it
    timestamp_size: int
    offset_at: int
    offset_size: int
    key_length_size: int  # the key length varint starts after the offset delta
    value_length_at: int
    value_at: int
    value_length: int  # -1: null

    def wider_deltas_of(self, other: _Layout) -> bool:
        """Whether this layout is ``other``'s but for the size of its timestamp or
        offset delta: the same bytes after the offset delta, the same value length."""
        return (
            (self.timestamp_size, self.offset_size) != (other.timestamp_size, other.offset_size)
            and self.size - self.offset_at - self.offset_size
            == other.size - other.offset_at - other.offset_size
            and self.value_length == other.value_length
        )

    def head_fixed(self) -> list[int]:
        """:meth:`fixed_columns` but the header count's (after the value)."""
        key_length_at = self.offset_at + self.offset_size
        return [
            *range(self.timestamp_at - 1),
            *range(key_length_at, key_length_at + self.key_length_size),
            *range(self.value_length_at, self.value_at),
        ]

    def header_count_columns(self) -> range:
        """The header count varint's columns: every byte of it, as the first record
        may spell its 0 in more than one (``80 00``); a row whose count's earlier byte
        differs reads another count (``01 00``: -1, refused by the walk)."""
        return range(self.value_at + max(self.value_length, 0), self.size)

    def fixed_columns(self) -> list[int]:
        """The columns every record of a run has the same bytes in: its length varint,
        its key length, its value length and its header count."""
        return [*self.head_fixed(), *self.header_count_columns()]


def _record_layout(data: bytes | memoryview, pos: int, end: int, index: int) -> _Layout | None:
    """The layout of the record at ``pos`` (before ``end``), the ``index``-th of its
    batch, when it reads as :func:`parse_records` reads it, with no headers and every
    varint within :data:`_MAX_VARINT` bytes; None otherwise."""
    try:
        length, at = _varint(data, pos)  # type: ignore[arg-type]
        record_end = at + length
        if length < 6 or record_end > end or at - pos > _MAX_VARINT or data[at] >= 0x80:
            return None
        timestamp_at = at + 1  # after the attributes
        _, offset_at = _varint(data, timestamp_at)  # type: ignore[arg-type]
        offset, key_length_at = _varint(data, offset_at)  # type: ignore[arg-type]
        key_length, at = _varint(data, key_length_at)  # type: ignore[arg-type]
        key_length_size = at - key_length_at
        value_length_at = at + max(key_length, 0)
        value_length, value_at = _varint(data, value_length_at)  # type: ignore[arg-type]
        headers, after = _varint(data, value_at + max(value_length, 0))  # type: ignore[arg-type]
    except (IndexError, KafkaRecordsError):
        return None
    timestamp_size, offset_size = offset_at - timestamp_at, key_length_at - offset_at
    if (
        offset != index
        or key_length < -1
        or value_length < -1
        or headers != 0
        or after != record_end
        or max(timestamp_size, offset_size, key_length_size, value_at - value_length_at)
        > _MAX_VARINT
    ):
        return None
    return _Layout(
        record_end - pos,
        timestamp_at - pos,
        timestamp_size,
        offset_at - pos,
        offset_size,
        key_length_size,
        value_length_at - pos,
        value_at - pos,
        value_length,
    )


def _head_words(
    buf: npt.NDArray[np.uint8],
    grid: npt.NDArray[np.uint8],
    pos: int,
    layout: _Layout,
    stamps: bool = True,
) -> tuple[npt.NDArray[np.bool_], Int64s, Int64s]:
    """:func:`_batch_runs`' checks of a run's rows (``grid``, laid from ``pos`` of
    ``buf``) when the timestamp and offset delta varints end within a row's first 8
    bytes and a row has 8 bytes: each row's first 8 bytes read as one little-endian
    word, and the fixed bytes among them, the attributes byte's top bit and the two
    varints' continuation bits checked against the first row's in one mask and compare
    (a dozen passes over the rows' columns, each a numpy call, become 2; a fixed column
    past the word is compared on its own); the two varints are then read from the
    words. ``(good, timestamp deltas, offset deltas)``
    as :func:`_column_varints` gives them (a row not good reads as anything); without
    ``stamps`` the timestamp deltas are not read (an empty array)."""
    rows = len(grid)
    # One strided read, then contiguous words for the passes after it.
    words = np.ndarray((rows,), np.dtype("<u8"), buf, pos, (layout.size,)).copy()
    first = grid[0]
    mask, pattern, others = _head_mask(layout, bytes(first[:8]))
    good = (words & mask) == pattern
    for column in others:
        good &= grid[:, column] == first[column]
    return (
        good,
        _word_varint(words, layout.timestamp_at, layout.timestamp_size) if stamps else _NO_SPANS,
        _word_varint(words, layout.offset_at, layout.offset_size),
    )


@functools.lru_cache(maxsize=64)
def _head_mask(layout: _Layout, head: bytes) -> tuple[np.uint64, np.uint64, tuple[int, ...]]:
    """:func:`_head_words`' mask and pattern of a run's first 8 bytes (``head``, the first
    row's), and the fixed columns past them (a key's length, the value's length, the
    header count after the value): a producer's batches repeat a few layouts, so each
    is worked out once."""
    mask = pattern = 0
    others = []
    for column in layout.head_fixed():
        if column >= 8:
            others.append(column)
            continue
        mask |= 0xFF << (8 * column)
        pattern |= head[column] << (8 * column)
    mask |= 0x80 << (8 * (layout.timestamp_at - 1))  # attributes: one byte
    for at, size in (
        (layout.timestamp_at, layout.timestamp_size),
        (layout.offset_at, layout.offset_size),
    ):
        for column in range(at, at + size):
            mask |= 0x80 << (8 * column)  # set but in the varint's last byte
            if column < at + size - 1:
                pattern |= 0x80 << (8 * column)
    others += layout.header_count_columns()  # after the value: each byte of it
    # A tuple: the cached answer is shared by every caller.
    return np.uint64(mask), np.uint64(pattern), tuple(others)


def _word_varint(words: npt.NDArray[np.uint64], at: int, size: int) -> Int64s:
    """The zigzag varint of ``size`` bytes at byte ``at`` of each little-endian word."""
    raw = (words >> np.uint64(8 * at)) & np.uint64(0x7F)
    for k in range(1, size):
        raw |= ((words >> np.uint64(8 * (at + k))) & np.uint64(0x7F)) << np.uint64(7 * k)
    value = raw.view(np.int64)
    return (value >> 1) ^ -(value & 1)


def _column_varints(
    grid: npt.NDArray[np.uint8], at: int, size: int, good: npt.NDArray[np.bool_]
) -> Int64s:
    """The zigzag varints of ``size`` bytes in columns ``at..at+size`` of every row of
    ``grid``; ``good`` loses the rows whose varint does not end exactly there."""
    last = grid[:, at + size - 1]
    good &= last < 0x80
    if size == 1:  # nearly every timestamp and offset delta
        one = last.astype(np.int64)
        return (one >> 1) ^ -(one & 1)
    # Up to 9 bytes of 7 bits: 63 bits, as uint64 (the zigzag undoes the sign).
    raw = last.astype(np.uint64) << np.uint64(7 * (size - 1))
    for k in range(size - 1):
        column = grid[:, at + k]
        good &= column >= 0x80
        raw |= (column & 0x7F).astype(np.uint64) << np.uint64(7 * k)
    return ((raw >> np.uint64(1)) ^ (np.uint64(0) - (raw & np.uint64(1)))).view(np.int64)


def _read_records(
    buf: npt.NDArray[np.uint8],
    starts: Int64s,
    local: Int64s,
    counts: Int64s,
    body_ends: Int64s,
    headers: Sequence[SectionHeader],
) -> tuple[Int64s, Int64s, Int64s, npt.NDArray[np.bool_]]:
    """The value spans and timestamps of batches' records starting at ``starts`` (each
    batch's records in order, the ``local``-th of their batch, the batch's records
    bytes ending at ``body_ends``), and which batches read exactly as parse_records
    reads them: every record ends where the next starts (the last where its batch
    ends), its attributes one byte, offset delta its index, key and value within it,
    no headers, nothing left over."""
    last = len(buf) - 1
    batch_first = np.cumsum(counts) - counts
    lengths, sizes = _varints(buf, starts)
    record_ends = starts + sizes + lengths
    next_starts = np.empty_like(starts)
    next_starts[:-1] = starts[1:]
    next_starts[batch_first + counts - 1] = body_ends
    ok = (sizes > 0) & (lengths >= 6) & (record_ends == next_starts)
    at = np.clip(starts + np.maximum(sizes, 1), 0, last)
    ok &= buf[at] < 0x80  # attributes: one byte (parse_records')
    at += 1
    deltas, sizes = _varints(buf, at)
    ok &= sizes > 0
    at += sizes
    offsets, sizes = _varints(buf, at)
    ok &= (sizes > 0) & (offsets == local)
    at += sizes
    key_lengths, sizes = _varints(buf, at)
    ok &= sizes > 0
    at += sizes + np.maximum(key_lengths, 0)
    ok &= at < record_ends
    value_lengths, sizes = _varints(buf, at)
    ok &= sizes > 0
    value_starts = at + sizes
    value_ends = value_starts + np.maximum(value_lengths, 0)
    ok &= value_ends < record_ends
    header_counts, sizes = _varints(buf, value_ends)
    # No headers (the decoder reads those), and the record ends where its length says.
    ok &= (sizes > 0) & (header_counts == 0) & (value_ends + sizes == record_ends)
    batch_ok = np.logical_and.reduceat(ok, batch_first)
    log_append = np.array([h.log_append_time for h in headers])
    stamp = np.array(
        [h.max_timestamp if h.log_append_time else h.base_timestamp for h in headers], np.int64
    )
    timestamps = np.repeat(stamp, counts)
    if not log_append.all():
        timestamps += np.where(np.repeat(log_append, counts), 0, deltas)
    return value_starts, value_ends, timestamps, batch_ok


_MAX_RUNS = 8  # runs of one record size tried in a batch before it is decoded
_MIN_RUN = 4  # a shorter run (but the last) means sizes vary: decoded


def _run_starts(buf: npt.NDArray[np.uint8], pos: int, end: int, count: int) -> Int64s | None:
    """The starts of a batch's ``count`` records laid from ``pos`` to ``end``, found a
    run at a time: from a record known to start at ``pos`` with size ``step``, the next
    ones are guessed at ``pos + k * step`` and their length varints read at once; the
    first whose size is not ``step`` ends the run (every record before it was that
    size, so it does start there) and starts the next. None when the sizes vary more
    than a few runs (:func:`_read_records` checks the rest)."""
    starts = np.empty(count, np.int64)
    done = 0
    for _ in range(_MAX_RUNS):
        if pos >= end:
            return None
        lengths, sizes = _varints(buf, np.array([pos], np.int64))
        step = int(sizes[0]) + int(lengths[0])
        if sizes[0] < 0 or lengths[0] < 6:
            return None
        guess = pos + step * _ascending(count - done)
        lengths, sizes = _varints(buf, np.minimum(guess, end))
        fits = (sizes + lengths == step) & (sizes > 0) & (guess < end)
        run = len(fits) if fits.all() else int(np.argmin(fits))
        starts[done : done + run] = guess[:run]
        done += run
        if done == count:
            return starts
        if run < _MIN_RUN:
            return None
        pos = int(guess[run])
    return None


def _varints(buf: npt.NDArray[np.uint8], at: Int64s) -> tuple[Int64s, Int64s]:
    """The zigzag varints starting at positions ``at`` of ``buf``: values and sizes in
    bytes, a size of -1 where one starts or runs past the end or takes over 9 bytes
    (left to the decoder: a tenth may overflow 64 bits). Up to three bytes each (record
    lengths, offset deltas below 2**20) in a few whole-array passes; longer ones by
    :func:`_long_varints`."""
    last = len(buf) - 1
    if not len(at) or int(at.max()) > last or int(at.min()) < 0:
        return _long_varints(buf, at)
    first = buf[at].astype(np.int64)
    if int(first.max()) < 0x80:  # one byte each (nearly every field)
        return (first >> 1) ^ -(first & 1), np.ones(len(at), np.int64)
    second = buf[np.minimum(at + 1, last)].astype(np.int64)
    third = buf[np.minimum(at + 2, last)].astype(np.int64)
    two = first >= 0x80
    three = two & (second >= 0x80)
    sizes = 1 + two + three
    if (three & (third >= 0x80)).any() or int((at + sizes).max()) > last + 1:
        return _long_varints(buf, at)
    raw = (first & 0x7F) | (((second & 0x7F) << 7) * two) | ((third << 14) * three)
    return (raw >> 1) ^ -(raw & 1), sizes


def _long_varints(buf: npt.NDArray[np.uint8], at: Int64s) -> tuple[Int64s, Int64s]:
    """:func:`_varints` of any length, near the end of ``buf`` too."""
    last = len(buf) - 1
    past = (at > last) | (at < 0)  # a position a bad size before it moved off the bytes
    byte = buf[np.clip(at, 0, last)]
    more = byte >= 0x80
    raw = (byte & 0x7F).astype(np.uint64)
    sizes = np.ones(len(at), np.int64)
    for k in range(1, 9):
        going = np.flatnonzero(more & ~past)
        if not len(going):
            break
        where = at[going] + k
        past[going] |= where > last
        byte = buf[np.minimum(where, last)]
        raw[going] |= (byte & 0x7F).astype(np.uint64) << np.uint64(7 * k)
        sizes[going] += 1
        more[going] = byte >= 0x80
    sizes[more | past] = -1
    values = ((raw >> np.uint64(1)) ^ (np.uint64(0) - (raw & np.uint64(1)))).view(np.int64)
    return values, sizes


def encode_columns(
    values: bytes | memoryview,
    value_starts: Int64s,
    value_lengths: Int64s,
    keys: bytes,
    key_lengths: Int64s,
    offset_deltas: Int64s,
    timestamp_deltas: Int64s,
) -> bytes:
    """The records part of a Kafka batch (uncompressed, no headers), batch-at-a-time:
    record ``i`` has the value ``values[value_starts[i]:][:value_lengths[i]]`` (length
    -1: null, a tombstone; the values ascending in ``values`` with bytes between them),
    the key that is next in ``keys`` (the keys laid end to end; length -1: null) and the
    given deltas. What ``protocols.kafka.records.encode_records`` writes for the same
    records, byte for byte (tests/property/test_kafka_fetch_batches.py), with no Python
    object per record: every record's varints are written as columns, then laid out
    around the keys and values with byte masks (no index per byte)."""
    key_bytes = np.maximum(key_lengths, 0)
    value_bytes = np.maximum(value_lengths, 0)
    value_length_sizes = _varint_sizes(value_lengths)
    # attributes, deltas, key length, key, value length, value, header count
    body_lengths = (
        2
        + _varint_sizes(timestamp_deltas)
        + _varint_sizes(offset_deltas)
        + _varint_sizes(key_lengths)
        + key_bytes
        + value_length_sizes
        + value_bytes
    )
    # Each record's bytes but its key and value, in order: length, attributes (0),
    # timestamp and offset deltas, key length | value length | header count (0).
    frame, frame_sizes = _varint_rows(
        (body_lengths, None, timestamp_deltas, offset_deltas, key_lengths, value_lengths, None)
    )
    sizes = frame_sizes + key_bytes + value_bytes
    key_at = np.cumsum(sizes) - sizes + frame_sizes - value_length_sizes - 1
    value_at = key_at + key_bytes + value_length_sizes
    out = np.empty(int(sizes.sum()), np.uint8)
    key_mask = _range_mask(len(out), key_at, key_bytes)
    value_mask = _range_mask(len(out), value_at, value_bytes)
    source = np.frombuffer(values, np.uint8)
    out[~(key_mask | value_mask)] = np.frombuffer(frame, np.uint8)
    out[key_mask] = np.frombuffer(keys, np.uint8)
    out[value_mask] = source[_range_mask(len(source), value_starts, value_bytes)]
    return out.tobytes()


def _range_mask(size: int, starts: Int64s, lengths: Int64s) -> npt.NDArray[np.bool_]:
    """A mask of ``size`` bytes, True over ``starts[i] .. starts[i] + lengths[i]``
    (ascending, not overlapping): the runs between and over the ranges repeated."""
    ends = starts + lengths
    runs = np.empty(2 * len(starts) + 1, np.int64)
    runs[0:-1:2] = starts - np.concatenate(([0], ends[:-1]))  # the gap before each
    runs[1::2] = lengths
    runs[-1] = size - (int(ends[-1]) if len(ends) else 0)
    pattern = np.zeros(len(runs), np.bool_)
    pattern[1::2] = True
    return np.repeat(pattern, runs)


def _varint_rows(columns: tuple[Int64s | None, ...]) -> tuple[bytes, Int64s]:
    """Each row's zigzag varints of ``columns`` laid end to end (None: a 0 byte, the
    record attributes), all rows together, and each row's size."""
    pieces: list[npt.NDArray[np.uint8]] = []
    masks: list[npt.NDArray[np.bool_]] = []
    rows = next(len(c) for c in columns if c is not None)
    row_sizes = np.zeros(rows, np.int64)
    for column in columns:
        if column is None:
            pieces.append(np.zeros((rows, 1), np.uint8))
            masks.append(np.ones((rows, 1), np.bool_))
            row_sizes += 1
            continue
        zigzag = ((column << 1) ^ (column >> 63)).view(np.uint64)
        sizes = _varint_sizes(column)
        width = int(sizes.max())
        shifts = np.uint64(7) * np.arange(width, dtype=np.uint64)
        groups = ((zigzag[:, None] >> shifts) & np.uint64(0x7F)).astype(np.uint8)
        index = np.arange(width)
        groups[index < sizes[:, None] - 1] |= 0x80  # every byte but a varint's last
        pieces.append(groups)
        masks.append(index < sizes[:, None])
        row_sizes += sizes
    table = np.concatenate(pieces, axis=1)
    return table[np.concatenate(masks, axis=1)].tobytes(), row_sizes


# ---- records ---------------------------------------------------------------------------


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """A zigzag varint (varlong) at ``pos``: (value, position after it)."""
    byte = buf[pos]
    pos += 1
    if byte < 0x80:
        return (byte >> 1) ^ -(byte & 1), pos
    raw = byte & 0x7F
    shift = 7
    while True:
        byte = buf[pos]
        pos += 1
        raw |= (byte & 0x7F) << shift
        if byte < 0x80:
            if raw >> 64:
                raise _corrupt("varint beyond 64 bits")
            return (raw >> 1) ^ -(raw & 1), pos
        shift += 7
        if shift > 63:
            raise _corrupt("varint longer than 10 bytes")


def walk_records(body: bytes, count: int) -> None:
    """Check ``count`` records' structure in ``body`` exactly as :func:`parse_records`
    would (every length within its record, offset deltas 0..n-1, header names UTF-8,
    nothing after the last) without building anything: the produce path's one pass
    over the records. One-byte varints, nearly every field of a record, are read
    inline: a call per field would cost as much as decoding."""
    buf = body
    end = len(buf)
    if count < 0 or count > end:  # a record takes at least 7 bytes
        raise _corrupt(f"{count} records claimed in {end} bytes")
    varint = _varint
    pos = 0
    try:
        for index in range(count):
            byte = buf[pos]
            if byte < 0x80:
                length = (byte >> 1) ^ -(byte & 1)
                pos += 1
            elif buf[pos + 1] < 0x80:  # two bytes: records of 64 to 8,191 bytes
                raw = (byte & 0x7F) | (buf[pos + 1] << 7)
                length = (raw >> 1) ^ -(raw & 1)
                pos += 2
            else:
                length, pos = varint(buf, pos)
            record_end = pos + length
            if length < 6 or record_end > end:
                raise _corrupt(f"record length {length} does not fit {end - pos} bytes")
            if buf[pos] >= 0x80:  # attributes: unused; one byte, read as a varint by some
                raise _corrupt("record attributes above 0x7f")
            pos += 1
            if buf[pos] < 0x80:  # timestamp delta: any value
                pos += 1
            else:
                _, pos = varint(buf, pos)
            byte = buf[pos]
            if byte == index << 1 and byte < 0x80:  # delta == index, one byte below 64
                pos += 1
            else:
                delta, pos = varint(buf, pos)
                if delta != index:
                    raise KafkaRecordsError("invalid", "record offset deltas are not 0, 1, 2, ...")
            for _ in (0, 1):  # key, value: a negative length is null
                byte = buf[pos]
                if byte < 0x80:
                    pos += 1 if byte & 1 else 1 + (byte >> 1)
                elif buf[pos + 1] < 0x80:
                    raw = (byte & 0x7F) | (buf[pos + 1] << 7)
                    pos += 2 if raw & 1 else 2 + (raw >> 1)
                else:
                    size, pos = varint(buf, pos)
                    if size > 0:
                        pos += size
            byte = buf[pos]
            if byte < 0x80:
                header_count = (byte >> 1) ^ -(byte & 1)
                pos += 1
            else:
                header_count, pos = varint(buf, pos)
            if header_count < 0 or header_count > record_end - pos:
                raise _corrupt(f"{header_count} record headers claimed")
            for _ in range(header_count):
                size, pos = varint(buf, pos)
                if size < 0 or pos + size > record_end:
                    raise _corrupt("record header key runs past its record")
                buf[pos : pos + size].decode()  # a reader decodes names as UTF-8
                pos += size
                size, pos = varint(buf, pos)
                if size > 0:
                    pos += size
                if pos > record_end:
                    break
            if pos != record_end:
                raise _corrupt(f"record of {length} bytes holds {length + pos - record_end}")
    except IndexError:
        raise _corrupt("records end inside a record") from None
    except UnicodeDecodeError:
        raise _corrupt("record header key is not UTF-8") from None
    if pos != end:
        raise _corrupt(f"{end - pos} bytes after the batch's {count} records")


def _nullable_bytes(buf: bytes, pos: int, record_end: int, what: str) -> tuple[bytes | None, int]:
    """A record's length-prefixed field at ``pos`` (key, value, header value; a negative
    length is null), checked to end within its record, and the position after it."""
    size, pos = _varint(buf, pos)
    if size < 0:
        return None, pos
    if pos + size > record_end:
        raise _corrupt(f"record {what} runs past its record")
    return buf[pos : pos + size], pos + size


def parse_records(
    body: bytes, count: int
) -> tuple[
    list[int],
    list[int],
    list[bytes | None],
    list[bytes | None],
    list[tuple[tuple[str, bytes | None], ...]],
]:
    """``count`` records from a batch's (decompressed) records bytes, as columns:
    offset deltas, timestamp deltas, keys, values, headers. Every length is checked
    against the bytes left before it is sliced."""
    buf = bytes(body)
    end = len(buf)
    if count < 0 or count > end:  # a record takes at least 7 bytes
        raise _corrupt(f"{count} records claimed in {end} bytes")
    offset_deltas: list[int] = []
    timestamp_deltas: list[int] = []
    keys: list[bytes | None] = []
    values: list[bytes | None] = []
    all_headers: list[tuple[tuple[str, bytes | None], ...]] = []
    varint = _varint
    pos = 0
    try:
        for _ in range(count):
            length, pos = varint(buf, pos)
            record_end = pos + length
            if length < 6 or record_end > end:
                raise _corrupt(f"record length {length} does not fit {end - pos} bytes")
            if buf[pos] >= 0x80:  # attributes: unused; one byte, read as a varint by some
                raise _corrupt("record attributes above 0x7f")
            pos += 1
            timestamp_delta, pos = varint(buf, pos)
            offset_delta, pos = varint(buf, pos)
            key, pos = _nullable_bytes(buf, pos, record_end, "key")
            value, pos = _nullable_bytes(buf, pos, record_end, "value")
            header_count, pos = varint(buf, pos)
            if header_count < 0 or header_count > record_end - pos:
                raise _corrupt(f"{header_count} record headers claimed")
            headers: tuple[tuple[str, bytes | None], ...] = ()
            if header_count:
                pairs = []
                for _ in range(header_count):
                    size, pos = varint(buf, pos)
                    if size < 0 or pos + size > record_end:
                        raise _corrupt("record header key runs past its record")
                    name = buf[pos : pos + size].decode()
                    pos += size
                    header_value, pos = _nullable_bytes(buf, pos, record_end, "header value")
                    pairs.append((name, header_value))
                headers = tuple(pairs)
            if pos != record_end:
                raise _corrupt(f"record of {length} bytes holds {length + pos - record_end}")
            offset_deltas.append(offset_delta)
            timestamp_deltas.append(timestamp_delta)
            keys.append(key)
            values.append(value)
            all_headers.append(headers)
    except IndexError:
        raise _corrupt("records end inside a record") from None
    except UnicodeDecodeError:
        raise _corrupt("record header key is not UTF-8") from None
    if pos != end:
        raise _corrupt(f"{end - pos} bytes after the batch's {count} records")
    return offset_deltas, timestamp_deltas, keys, values, all_headers


# ---- decompression ---------------------------------------------------------------------

MAX_DECOMPRESSED = 128 * 1024 * 1024
"""Default bound on one batch's decompressed records: past it the batch is refused
before more is inflated, so a small batch cannot claim gigabytes."""

XERIAL_MAGIC = b"\x82SNAPPY\x00"
XERIAL_HEADER = struct.Struct(">8sii")  # magic, version, compatible version
_CHUNK = struct.Struct(">i")


def _too_large(limit: int) -> KafkaRecordsError:
    return KafkaRecordsError("too_large", f"records decompress to more than {limit} bytes")


def decompress(codec: int, data: bytes | memoryview, max_bytes: int = MAX_DECOMPRESSED) -> bytes:
    """The records bytes of a batch compressed with ``codec`` (Kafka's numbering: 0 none,
    1 gzip, 2 snappy, 3 lz4, 4 zstd), never inflating more than ``max_bytes``."""
    if codec == 0:
        if memoryview(data).nbytes > max_bytes:
            raise _too_large(max_bytes)
        return bytes(data)
    try:
        if codec == 1:
            return _gunzip(data, max_bytes)
        if codec == 2:
            return _unsnappy(bytes(data), max_bytes)
        if codec == 3:
            return _unlz4(data, max_bytes)
        if codec == 4:
            return _unzstd(data, max_bytes)
    except KafkaRecordsError:
        raise
    except (
        zlib.error,
        zstandard.ZstdError,
        cramjam.DecompressionError,
        RuntimeError,
        ValueError,
    ) as exc:
        # lz4.frame raises RuntimeError on a bad frame
        raise _corrupt(f"records do not decompress as {CODEC_NAMES[codec]}: {exc}") from None
    raise KafkaRecordsError("codec", f"unknown codec {codec}")


def _gunzip(data: bytes | memoryview, max_bytes: int) -> bytes:
    inflater = zlib.decompressobj(wbits=31)
    out = inflater.decompress(data, max_bytes + 1)
    if len(out) > max_bytes:
        raise _too_large(max_bytes)
    if not inflater.eof:
        raise _corrupt("gzip stream ends early")
    return out


def _snappy_block(block: bytes, limit: int) -> bytes:
    # A raw snappy block starts with its uncompressed length: checked before inflating.
    length = 0
    shift = 0
    for index in range(min(5, len(block))):
        byte = block[index]
        length |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
    else:
        raise _corrupt("snappy block without its length")
    if length > limit:
        raise _too_large(limit)
    return bytes(cramjam.snappy.decompress_raw(block))


def _unsnappy(data: bytes, max_bytes: int) -> bytes:
    if not data.startswith(XERIAL_MAGIC):
        return _snappy_block(data, max_bytes)  # librdkafka sends one raw block
    if len(data) < XERIAL_HEADER.size:
        raise _corrupt("xerial snappy header cut short")
    out = bytearray()
    pos = XERIAL_HEADER.size
    while pos < len(data):
        if len(data) - pos < _CHUNK.size:
            raise _corrupt("xerial snappy chunk length cut short")
        (size,) = _CHUNK.unpack_from(data, pos)
        pos += _CHUNK.size
        if size < 0 or size > len(data) - pos:
            raise _corrupt(f"xerial snappy chunk of {size} bytes")
        out += _snappy_block(data[pos : pos + size], max_bytes - len(out))
        pos += size
    return bytes(out)


def _unlz4(data: bytes | memoryview, max_bytes: int) -> bytes:
    inflater = lz4.frame.LZ4FrameDecompressor()
    out = bytes(inflater.decompress(bytes(data), max_length=max_bytes + 1))
    if len(out) > max_bytes:
        raise _too_large(max_bytes)
    if not inflater.eof:
        raise _corrupt("LZ4 frame ends early")
    return out


_ZSTD_MAX_RATIO = 65536
"""Above zstd's largest expansion of input bytes (a 128 KiB block from a 4-byte RLE
block is 32,768:1), so a slice of ``remaining // _ZSTD_MAX_RATIO`` bytes cannot inflate
much past what is left of the limit."""


def _unzstd(data: bytes | memoryview, max_bytes: int) -> bytes:
    # zstandard's one-shot decompress trusts a frame's declared content size (it would
    # allocate what the frame claims) and its readers do not see a truncated frame, so
    # the frame is fed to a decompression object in slices sized to what the limit
    # leaves, and its eof tells a whole frame from a cut one.
    inflater = zstandard.ZstdDecompressor().decompressobj()
    out = bytearray()
    view = memoryview(data)
    pos, total = 0, view.nbytes
    while pos < total and not inflater.eof:
        step = max(64, (max_bytes - len(out)) // _ZSTD_MAX_RATIO)
        out += inflater.decompress(view[pos : pos + step])
        pos += step
        if len(out) > max_bytes:
            raise _too_large(max_bytes)
    if not inflater.eof:
        raise _corrupt("zstd frame ends early")
    return bytes(out)


@dataclass(frozen=True, slots=True)
class KafkaSection:
    """A checked produced batch on its way to the log in Kafka form: its bytes from
    the CRC on, its record count and its max timestamp (the producer's)."""

    section: bytes | memoryview
    count: int
    timestamp_ms: int
