"""Record batches: the unit the log stores, checks and serves.

An append of N events becomes one batch: one header, one CRC-32C, one write. The
layout (docs/storage-format.md) puts every event's value first as ``u64 length | bytes``,
which is exactly how Kimberlite encodes ``Vec<Vec<u8>>`` on the wire, so reads can hand a
stored values section to a socket without decoding the events inside it.

Header, little-endian, 64 bytes::

    0  u32 batch_length    whole batch, header included
    4  u32 crc32c          CRC-32C (Castagnoli) of bytes [8, batch_length)
    8  u8  magic           1
    9  u8  attributes      bit 0 keys, bit 1 headers, bit 2 offset deltas, bit 3 producer,
                           bit 4 producer epoch, bit 5 transactional, bit 6 control,
                           bit 7 Kafka form
    10 u16 reserved        0
    12 u32 count           events in the batch (>= 1)
    16 u64 base_offset     offset of the first event
    24 i64 first_timestamp_ms
    32 i64 max_timestamp_ms
    40 u64 first_position  tenant log position of the first event
    48 u32 values_length
    52 u32 keys_length
    56 u32 headers_length
    60 u32 deltas_length

Sections follow in that order. values: count x (u64 len, bytes). keys: count x (u8 flags
[1 = has key, 2 = tombstone], u32 len, bytes). headers: count x (u32 n, n x (u32 len, name,
u32 len, value)). deltas: count x u32 (event i has offset base_offset + delta[i] and
position first_position + delta[i]); without deltas the batch is dense (delta[i] = i).
producer (16 bytes, last): u64 producer_id, u64 sequence of an idempotent append; with
bit 4 (24 bytes): u64 producer_id, u64 sequence, u32 epoch, u32 reserved (0).

A transactional batch (bit 5, always with bits 3 and 4) belongs to its producer's open
transaction in this partition until a control batch (bits 3-6) of the same producer
ends it: one event whose value is ``u16 version (0) | u16 type`` (0 abort, 1 commit), the
transaction marker. Control batches are never handed to readers.

A batch in Kafka form (bit 7, never with bits 0-2) holds, as its values section, a Kafka
record batch v2 as produced, from its CRC to its end (storage/kafka_batch.py): a Kafka
fetch returns those bytes with their 17-byte prefix put back, and every other reader
gets its records decoded into events by :class:`KafkaBatch`, with a timestamp per
record. Its count and timestamps are the Kafka batch's; its producer section is as
above.
"""

from __future__ import annotations

import struct
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypedDict, Unpack

import crc32c
import numpy as np
import numpy.typing as npt

from headwater.errors import CorruptBatchError, UsageError
from headwater.storage import kafka_batch

MAGIC = 1
HEADER = struct.Struct("<IIBBHIQqqQIIII")
HEADER_SIZE = HEADER.size  # 64
ATTR_KEYS = 0x01
ATTR_HEADERS = 0x02
ATTR_DELTAS = 0x04
ATTR_PRODUCER = 0x08
ATTR_EPOCH = 0x10
ATTR_TRANSACTIONAL = 0x20
ATTR_CONTROL = 0x40
ATTR_KAFKA = 0x80
PRODUCER = struct.Struct("<QQ")
PRODUCER_EPOCH = struct.Struct("<QQII")
CONTROL = struct.Struct("<HH")  # a marker's value: version, type
CONTROL_ABORT = 0
CONTROL_COMMIT = 1
KEY_PRESENT = 0x01
KEY_TOMBSTONE = 0x02
MAX_BATCH_BYTES = 0x7FFF_FFFF

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_KEY = struct.Struct("<BI")
_U32_AT = _U32.unpack_from
_U64_AT = _U64.unpack_from
_LENGTH_CRC = struct.Struct("<II")

Headers = Sequence[tuple[bytes, bytes]]


@dataclass(slots=True)  # not frozen: frozen dataclasses cost ~1 µs more per event
class Event:
    """One decoded event, for callers that need events rather than stored bytes."""

    offset: int
    position: int
    timestamp_ms: int
    value: bytes
    key: bytes | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()
    tombstone: bool = False


def encode_values(values: Sequence[bytes]) -> bytes:
    """The values section for ``values``: ``u64 len | bytes`` per event."""
    if values and len(set(map(len, values))) == 1:
        # One size (fixed-width records): every length prefix is the same bytes.
        prefix = _U64.pack(len(values[0]))
        return prefix + prefix.join(values)
    pack = _U64.pack
    parts: list[bytes] = []
    append = parts.append
    for value in values:
        append(pack(len(value)))
        append(value)
    return b"".join(parts)


def fixed_stride(section: bytes | memoryview, count: int, start: int = 0) -> int | None:
    """The record size (8 + value length) when the ``count`` records from ``start`` to the
    end of a values section all hold values of one size and fill it exactly; else None.

    Events of one size (fixed-width records are common) are checked with eight strided
    slices, one per byte of the length field, instead of a loop per event."""
    end = len(section)
    if count < 2 or end - start < 8:
        return None
    stride = 8 + _U64_AT(section, start)[0]
    if end - start != count * stride:
        return None
    view = memoryview(section).cast("B") if isinstance(section, memoryview) else section
    head = bytes(view[start : start + 8])
    if all(view[start + k : end : stride] == head[k : k + 1] * count for k in range(8)):
        return int(stride)
    return None


BOUNDS_FROM = 256
"""Sections of at least this many records are tried with :func:`record_bounds` (a few
whole-array numpy passes); fewer are walked in Python, cheaper than numpy's per-call
overhead for them."""
SHORT_RECORD = 128
""":func:`record_bounds` is tried only where records average under this many bytes after
their heads: it reads every byte, a walk reads one length per record, so longer records
are walked."""


def record_bounds(
    section: bytes | memoryview,
    count: int,
    start: int,
    *,
    head: int,
    length_at: int,
    length_size: int,
) -> npt.NDArray[np.int64] | None:
    """Bounds (``count + 1`` positions) of the ``count`` length-prefixed records laid
    from ``start`` to the end of ``section`` (each a ``head``-byte head holding a
    little-endian length of ``length_size`` bytes at ``length_at``, then that many
    bytes), found by numpy without a Python step per record when every record is
    shorter than 256 bytes; None when that cannot be shown (the caller walks, and
    refuses what the walk refuses).

    A record under 256 bytes has every length byte but the first zero, so every record
    starts at a position whose bytes there are zero. Those positions are found at once;
    when there are exactly ``count`` of them, the first is ``start``, each one's first
    length byte leads to the next and the last one's to the end, they are exactly what
    a walk from ``start`` finds (each length read in full is that byte), so nothing is
    taken on trust: any other outcome (a longer record, zero bytes in the data where a
    length could be) returns None."""
    data = np.frombuffer(section, np.uint8)
    span = len(data) - start - head + 1  # positions a record can start at
    if count < 1 or span < 1 or length_size < 2:
        return None
    zero = data == 0
    at = start + length_at
    candidate = zero[at + 1 : at + 1 + span].copy()
    for k in range(2, length_size):
        candidate &= zero[at + k : at + k + span]
    starts = np.flatnonzero(candidate)
    if not count <= len(starts) <= 2 * count:
        return None
    ends = starts + data[starts + at] + head  # int64: flatnonzero's dtype
    stop = len(data) - start
    if len(starts) > count:  # zeros in the data (binary values): sift out what no walk reaches
        starts, ends = _sift(starts, ends, stop)
    if (
        len(starts) != count
        or starts[0] != 0
        or ends[-1] != stop
        or not np.array_equal(ends[:-1], starts[1:])
    ):
        return None
    bounds = np.empty(count + 1, np.int64)
    bounds[:-1] = starts
    bounds[-1] = stop
    bounds += start
    return bounds


def _sift(
    starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64], stop: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Candidate record starts (and where each one's record would end) less those that
    cannot be on the walk from 0: a record that ends neither at a candidate nor at
    ``stop``, or a candidate (but 0) where no candidate's record ends. True starts are
    never dropped (each ends at the next, or at ``stop``, and is where the one before
    ends); a few rounds drop the chains of false ones."""
    for _ in range(4):
        ends = np.minimum(ends, stop + 1)
        member = np.zeros(stop + 2, np.bool_)
        member[starts] = True
        member[stop] = True
        onward = member[ends]
        led = np.zeros(stop + 2, np.bool_)
        led[ends[onward]] = True
        led[0] = True
        keep = onward & led[starts]
        if keep.all():
            break
        starts, ends = starts[keep], ends[keep]
    return starts, ends


BOUNDS_MAX_BYTES = 8 << 20
"""Larger sections are walked: :func:`record_bounds` holds two byte-sized masks of the
section at once (appends are at most 4 MiB, so this only bounds what a rewrite made)."""


def _short_records(section: bytes | memoryview, count: int, start: int, head: int) -> bool:
    size = len(section) - start
    short = size < count * (head + SHORT_RECORD)
    return count >= BOUNDS_FROM and short and size <= BOUNDS_MAX_BYTES


def value_spans(section: bytes | memoryview, count: int, start: int = 0) -> list[int]:
    """Boundaries of ``count`` values in a values section: ``count + 1`` byte positions.

    Raises ValueError when the section does not hold exactly ``count`` well-formed values.
    """
    stride = fixed_stride(section, count, start)
    if stride is not None:
        return list(range(start, len(section) + 1, stride))
    if _short_records(section, count, start, 8):
        found = record_bounds(section, count, start, head=8, length_at=0, length_size=8)
        if found is not None:
            return found.tolist()  # type: ignore[no-any-return]
    return _walk_values(section, count, start)


def value_spans_array(
    section: bytes | memoryview, count: int, start: int = 0
) -> npt.NDArray[np.int64]:
    """:func:`value_spans` as a numpy array, for callers that build columns from it."""
    stride = fixed_stride(section, count, start)
    if stride is not None:
        return np.arange(start, len(section) + 1, stride, dtype=np.int64)
    if _short_records(section, count, start, 8):
        found = record_bounds(section, count, start, head=8, length_at=0, length_size=8)
        if found is not None:
            return found
    return np.array(_walk_values(section, count, start), np.int64)


def key_spans(section: bytes | memoryview, count: int) -> npt.NDArray[np.int64]:
    """Boundaries (``count + 1`` byte positions) of the ``count`` records of a keys
    section (``u8 flags | u32 len | bytes`` each). CorruptBatchError when the section
    does not hold exactly ``count`` of them."""
    if _short_records(section, count, 0, 5):
        found = record_bounds(section, count, 0, head=5, length_at=1, length_size=4)
        if found is not None:
            return found
    pos = 0
    try:
        bounds = [0] + [pos := pos + 5 + _U32_AT(section, pos + 1)[0] for _ in range(count)]
    except struct.error:
        raise CorruptBatchError("keys section truncated: a key overruns it") from None
    if pos != len(section):
        raise CorruptBatchError("keys section does not match its keys")
    return np.array(bounds, np.int64)


def _walk_values(section: bytes | memoryview, count: int, start: int) -> list[int]:
    end = len(section)
    # Values of different sizes: one walk over the length fields, as a comprehension
    # (the per-event cost of reading pages of JSON). A length running past the end makes
    # the next read of a length fail, or the last bound miss the end: checked once.
    pos = start
    try:
        bounds = [start] + [pos := pos + 8 + _U64_AT(section, pos)[0] for _ in range(count)]
    except (struct.error, OverflowError):
        raise ValueError("values section truncated: a value overruns it") from None
    if pos > end:
        raise ValueError("the last value overruns its section")
    if pos != end:
        raise ValueError(f"{end - pos} bytes after the last value")
    return bounds


def _encode_keys(keys: Sequence[bytes | None], tombstones: Sequence[bool] | None) -> bytes:
    if tombstones is None and keys and None not in keys:
        lengths = set(map(len, keys))  # type: ignore[arg-type]
        if len(lengths) == 1:
            # Present keys of one size (entity ids): every key's head is the same bytes.
            head = _KEY.pack(KEY_PRESENT, lengths.pop())
            return head + head.join(keys)  # type: ignore[arg-type]
    pack = _KEY.pack
    parts: list[bytes] = []
    for i, key in enumerate(keys):
        flags = KEY_TOMBSTONE if tombstones is not None and tombstones[i] else 0
        if key is None:
            parts.append(pack(flags, 0))
        else:
            parts.append(pack(flags | KEY_PRESENT, len(key)))
            parts.append(key)
    return b"".join(parts)


def _encode_headers(headers: Sequence[Headers]) -> bytes:
    pack = _U32.pack
    parts: list[bytes] = []
    for event_headers in headers:
        parts.append(pack(len(event_headers)))
        for name, value in event_headers:
            parts += (pack(len(name)), name, pack(len(value)), value)
    return b"".join(parts)


def build_batch(
    values_section: bytes | memoryview,
    count: int,
    *,
    base_offset: int,
    first_position: int,
    timestamp_ms: int,
    max_timestamp_ms: int | None = None,
    keys: Sequence[bytes | None] | None = None,
    keys_section: bytes | None = None,
    tombstones: Sequence[bool] | None = None,
    headers: Sequence[Headers] | None = None,
    deltas: Sequence[int] | None = None,
    producer: tuple[int, int] | None = None,
    producer_epoch: int | None = None,
    transactional: bool = False,
    control: bool = False,
    kafka: bool = False,
) -> bytes:
    """Assemble one batch from an already encoded values section (trusted: the caller
    checked it with :func:`value_spans` or built it with :func:`encode_values`; with
    ``kafka``, a Kafka batch from its CRC on, checked with
    :func:`kafka_batch.check_section`). A transactional or control batch needs its
    producer and epoch. ``keys_section``: the keys already encoded as the keys section
    (one ``u8 flags | u32 len | bytes`` per event, trusted as the values section is), in
    place of ``keys``."""
    if count < 1:
        raise UsageError("a batch holds at least one event")
    if (transactional or control) and (producer is None or producer_epoch is None):
        raise UsageError("a transactional or control batch needs a producer and its epoch")
    attributes = 0
    if kafka:
        if keys is not None or keys_section is not None or tombstones is not None:
            raise UsageError("a Kafka-form batch carries its keys and headers in its records")
        if headers is not None or deltas:
            raise UsageError("a Kafka-form batch carries its keys and headers in its records")
        if control:
            raise UsageError("transaction markers are stored in headwater's form")
        attributes |= ATTR_KAFKA
    sections = [values_section]
    keys_bytes = headers_bytes = deltas_bytes = b""
    if keys_section is not None:
        if keys is not None or tombstones is not None:
            raise UsageError("keys come encoded (keys_section) or as keys, not both")
        attributes |= ATTR_KEYS
        keys_bytes = keys_section
        sections.append(keys_bytes)
    elif keys is not None or tombstones is not None:
        if keys is None:
            keys = [None] * count
        if len(keys) != count or (tombstones is not None and len(tombstones) != count):
            raise UsageError("keys and tombstones need one entry per event")
        attributes |= ATTR_KEYS
        keys_bytes = _encode_keys(keys, tombstones)
        sections.append(keys_bytes)
    if headers is not None and any(headers):
        if len(headers) != count:
            raise UsageError("headers need one entry per event")
        attributes |= ATTR_HEADERS
        headers_bytes = _encode_headers(headers)
        sections.append(headers_bytes)
    if deltas is not None:
        if len(deltas) != count:
            raise UsageError("deltas need one entry per event")
        attributes |= ATTR_DELTAS
        deltas_bytes = struct.pack(f"<{count}I", *deltas)
        sections.append(deltas_bytes)
    producer_bytes = b""
    if producer is not None:
        attributes |= ATTR_PRODUCER
        if producer_epoch is None:
            producer_bytes = PRODUCER.pack(*producer)
        else:
            attributes |= ATTR_EPOCH
            producer_bytes = PRODUCER_EPOCH.pack(*producer, producer_epoch, 0)
        if transactional or control:
            attributes |= ATTR_TRANSACTIONAL
        if control:
            attributes |= ATTR_CONTROL
        sections.append(producer_bytes)
    total = HEADER_SIZE + len(values_section) + len(keys_bytes)
    total += len(headers_bytes) + len(deltas_bytes) + len(producer_bytes)
    if total > MAX_BATCH_BYTES:
        raise UsageError("batch larger than 2 GiB")
    header = HEADER.pack(
        total,
        0,
        MAGIC,
        attributes,
        0,
        count,
        base_offset,
        timestamp_ms,
        timestamp_ms if max_timestamp_ms is None else max_timestamp_ms,
        first_position,
        len(values_section),
        len(keys_bytes),
        len(headers_bytes),
        len(deltas_bytes),
    )
    crc = crc32c.crc32c(header[8:])
    for section in sections:
        crc = crc32c.crc32c(section, crc)
    return b"".join((_LENGTH_CRC.pack(total, crc), header[8:], *sections))


class EventColumns(TypedDict, total=False):
    """What an append may carry beside the values, passed down unchanged from the engine
    to :func:`build_batch`: per-event keys, tombstones and headers (one entry per event),
    the producer ``(id, sequence)`` of an idempotent append and its epoch (None: a
    producer without epochs, as Kimberlite's), whether the batch is transactional or
    a transaction marker (control), and whether its values section is a Kafka batch
    (``kafka``: stored in Kafka form, keys and headers inside its records)."""

    keys: Sequence[bytes | None] | None
    keys_section: bytes | None
    tombstones: Sequence[bool] | None
    headers: Sequence[Headers] | None
    producer: tuple[int, int] | None
    producer_epoch: int | None
    transactional: bool
    control: bool
    kafka: bool


def encode_batch(
    values: Sequence[bytes],
    *,
    base_offset: int,
    first_position: int,
    timestamp_ms: int,
    **columns: Unpack[EventColumns],
) -> bytes:
    """Encode a list of event values (and optional keys/headers) as one batch."""
    return build_batch(
        encode_values(values),
        len(values),
        base_offset=base_offset,
        first_position=first_position,
        timestamp_ms=timestamp_ms,
        **columns,
    )


class Batch:
    """A stored batch, checked on construction; its bytes are never copied. A batch in
    Kafka form is made a :class:`KafkaBatch`."""

    __slots__ = (
        "_deltas",
        "_section_bounds",
        "attributes",
        "base_offset",
        "buffer",
        "count",
        "first_position",
        "first_timestamp_ms",
        "max_timestamp_ms",
        "producer",
        "producer_epoch",
    )

    def __new__(cls, buffer: memoryview, *, verify: bool = True) -> Batch:
        if cls is Batch and len(buffer) > 9 and buffer[9] & ATTR_KAFKA:
            return object.__new__(KafkaBatch)
        return object.__new__(cls)

    def __init__(self, buffer: memoryview, *, verify: bool = True) -> None:
        if len(buffer) < HEADER_SIZE:
            raise CorruptBatchError("batch shorter than its header")
        (
            length,
            crc,
            magic,
            self.attributes,
            _reserved,
            self.count,
            self.base_offset,
            self.first_timestamp_ms,
            self.max_timestamp_ms,
            self.first_position,
            values_length,
            keys_length,
            headers_length,
            deltas_length,
        ) = HEADER.unpack_from(buffer)
        if length != len(buffer):
            raise CorruptBatchError(f"batch length {length} does not match {len(buffer)} bytes")
        if verify and crc32c.crc32c(buffer[8:]) != crc:
            raise CorruptBatchError(f"CRC mismatch in batch at offset {self.base_offset}")
        if magic != MAGIC:
            raise CorruptBatchError(f"unknown batch magic {magic}")
        v_end = HEADER_SIZE + values_length
        k_end = v_end + keys_length
        h_end = k_end + headers_length
        producer_length = 0
        if self.attributes & ATTR_PRODUCER:
            producer_length = PRODUCER_EPOCH.size if self.attributes & ATTR_EPOCH else 16
        if h_end + deltas_length + producer_length != length or self.count < 1:
            raise CorruptBatchError("batch sections do not add up to its length")
        self._section_bounds = (v_end, k_end, h_end)
        self.buffer = buffer
        self._deltas = None
        self.producer = None
        self.producer_epoch = None
        if producer_length:
            self.producer = PRODUCER.unpack_from(buffer, length - producer_length)
            if producer_length == PRODUCER_EPOCH.size:
                self.producer_epoch = PRODUCER_EPOCH.unpack_from(buffer, length - 24)[2]
        elif self.attributes & (ATTR_TRANSACTIONAL | ATTR_CONTROL):
            raise CorruptBatchError("a transactional batch without its producer")
        if self.attributes & ATTR_DELTAS:
            if deltas_length != 4 * self.count:
                raise CorruptBatchError("offset deltas do not match the event count")
            self._deltas = struct.unpack_from(f"<{self.count}I", buffer, h_end)

    @property
    def length(self) -> int:
        return len(self.buffer)

    @property
    def kafka_section(self) -> memoryview | None:
        """A Kafka-form batch's stored Kafka bytes (from the CRC on); None otherwise."""
        return None

    @property
    def payload_bytes(self) -> int:
        """What a read counts this batch's events as: their values' bytes (a Kafka-form
        batch: its stored records, as a Kafka fetch returns them, never decoded)."""
        return int(self._section_bounds[0] - HEADER_SIZE - 8 * self.count)

    def timestamps(self) -> list[int] | None:
        """Each event's timestamp; None when every event has ``first_timestamp_ms``
        (headwater's form: a batch has one timestamp)."""
        return None

    @property
    def transactional(self) -> bool:
        return bool(self.attributes & ATTR_TRANSACTIONAL)

    @property
    def control(self) -> bool:
        """A transaction marker, never shown to readers."""
        return bool(self.attributes & ATTR_CONTROL)

    def marker_commits(self) -> bool:
        """A control batch's decision: True for a commit marker, False for an abort."""
        if self.count != 1:
            raise CorruptBatchError(f"control batch at offset {self.base_offset} is malformed")
        try:
            return marker_commits(self.values_section())
        except ValueError as exc:
            raise CorruptBatchError(f"control batch at offset {self.base_offset}: {exc}") from None

    @property
    def last_offset(self) -> int:
        return int(self.base_offset + (self._deltas[-1] if self._deltas else self.count - 1))

    @property
    def next_offset(self) -> int:
        return self.last_offset + 1

    @property
    def dense(self) -> bool:
        return self._deltas is None

    def offsets(self) -> list[int]:
        base = self.base_offset
        if self._deltas is None:
            return list(range(base, base + self.count))
        return [base + d for d in self._deltas]

    def values_section(self) -> memoryview:
        return self.buffer[HEADER_SIZE : self._section_bounds[0]]

    def value_bounds(self) -> list[int]:
        """Byte positions (within the values section) bounding each value's record."""
        try:
            return value_spans(self.values_section(), self.count)
        except ValueError as exc:
            raise CorruptBatchError(str(exc)) from None

    def value_bounds_array(self) -> npt.NDArray[np.int64]:
        """:meth:`value_bounds` as a numpy array (built in bulk for a large batch)."""
        try:
            return value_spans_array(self.values_section(), self.count)
        except ValueError as exc:
            raise CorruptBatchError(str(exc)) from None

    def take_values(
        self,
        start: int,
        max_bytes: int,
        max_events: int,
        *,
        at_least_one: bool,
        start_pos: int | None = None,
    ) -> tuple[int, int, int, int]:
        """Walk the value records from event ``start``, taking while their values' bytes
        stay within ``max_bytes`` (one regardless when ``at_least_one``) and at most
        ``max_events``: ``(stop, lo, hi, value_bytes)`` with ``[lo, hi)`` the taken
        records' bytes in the values section. Reads no record past the cut, so cutting a
        batch costs what is taken, not the whole batch; ``start_pos``, when the caller
        knows it, is where event ``start``'s record begins (a previous call's ``hi``)."""
        section = self.values_section()
        end = len(section)
        pos = 0
        if start_pos is not None:
            pos = start_pos
        else:
            for _ in range(start):
                if pos + 8 > end:
                    raise CorruptBatchError("values section truncated")
                pos += 8 + _U64_AT(section, pos)[0]
        lo = pos
        taken = size = 0
        limit = min(self.count - start, max_events)
        stride = fixed_stride(section, self.count - start, pos) if limit > 1 else None
        if stride is not None:
            # Values of one size (checked across the rest of the section, lengths only):
            # the cut is arithmetic, not a walk of the records before it.
            width = stride - 8
            fits = max(max_bytes, 0) // width if width else (limit if max_bytes >= 0 else 0)
            taken = min(limit, fits)
            if taken == 0 and at_least_one:
                taken = 1
            return start + taken, lo, lo + taken * stride, taken * width
        while taken < limit:
            if pos + 8 > end:
                raise CorruptBatchError("values section truncated")
            n = _U64_AT(section, pos)[0]
            if size + n > max_bytes and (taken or not at_least_one):
                break
            pos += 8 + n
            if pos > end:
                raise CorruptBatchError("value overruns its section")
            size += n
            taken += 1
        return start + taken, lo, pos, size

    @property
    def identity(self) -> tuple[int, bytes]:
        """(base offset, stored CRC): tells this batch from a rewritten (compacted) one."""
        return self.base_offset, bytes(self.buffer[4:8])

    def index_of(self, offset: int) -> int:
        """Index of the first event at or after ``offset`` (``count`` if none)."""
        if self._deltas is None:
            return int(min(max(offset - self.base_offset, 0), self.count))
        return bisect_left(self._deltas, offset - self.base_offset)

    def run_at(self, offset: int) -> tuple[int, int, int]:
        """``(start, first, stop)``: the index of the first event at or after ``offset``
        (which must be at most :attr:`last_offset`), that event's offset, and the index
        after the run of consecutive offsets it begins (``count`` for a dense batch).
        One call per batch on a read's path: a dense batch costs what index_of does."""
        deltas = self._deltas
        if deltas is None:
            start = min(max(offset - self.base_offset, 0), self.count)
            return start, self.base_offset + start, self.count
        start = bisect_left(deltas, offset - self.base_offset)
        return start, self.base_offset + deltas[start], self.run_end(start)

    def offset_at(self, index: int) -> int:
        """Offset of event ``index``."""
        if self._deltas is None:
            return int(self.base_offset + index)
        return int(self.base_offset + self._deltas[index])

    def run_end(self, start: int) -> int:
        """Index after the run of consecutive offsets that event ``start`` begins:
        ``count`` when the rest of the batch has no hole (always, for a dense batch)."""
        deltas = self._deltas
        if deltas is None:
            return int(self.count)
        # Deltas rise by at least one per event, so delta - index never falls: the run
        # is where it keeps event start's value, found by bisection, not by a walk.
        first = deltas[start] - start
        if deltas[-1] - (self.count - 1) == first:
            return int(self.count)
        return bisect_right(range(self.count), first, lo=start, key=lambda i: deltas[i] - i)

    def events(self, start: int = 0) -> Iterator[Event]:
        """Decode events from index ``start`` on."""
        values = self.values_section()
        bounds = self.value_bounds()
        keys = self._keys() if self.attributes & ATTR_KEYS else None
        headers = self._headers() if self.attributes & ATTR_HEADERS else None
        offsets = self.offsets()
        ts = self.first_timestamp_ms
        for i in range(start, self.count):
            key, tombstone = keys[i] if keys is not None else (None, False)
            yield Event(
                offset=offsets[i],
                position=self.first_position + offsets[i] - self.base_offset,
                timestamp_ms=ts,
                value=bytes(values[bounds[i] + 8 : bounds[i + 1]]),
                key=key,
                headers=headers[i] if headers is not None else (),
                tombstone=tombstone,
            )

    def keys_section(self) -> memoryview | None:
        """The keys section as stored (``u8 flags | u32 len | bytes`` per event), for
        readers that decode it in bulk; None for a batch stored without keys."""
        v_end, k_end, _ = self._section_bounds
        return self.buffer[v_end:k_end] if self.attributes & ATTR_KEYS else None

    def headers_section(self) -> memoryview | None:
        """The headers section as stored (``u32 n, n x (u32 len, name, u32 len, value)``
        per event), for readers that decode it in bulk; None for a batch stored without
        headers."""
        _, k_end, h_end = self._section_bounds
        return self.buffer[k_end:h_end] if self.attributes & ATTR_HEADERS else None

    def headers(self) -> list[tuple[tuple[bytes, bytes], ...]] | None:
        """Each event's headers; None for a batch stored without headers."""
        return self._headers() if self.attributes & ATTR_HEADERS else None

    def keys(self) -> list[tuple[bytes | None, bool]] | None:
        """Each event's key and whether it is a tombstone; None for a batch stored
        without keys."""
        return self._keys() if self.attributes & ATTR_KEYS else None

    def _keys(self) -> list[tuple[bytes | None, bool]]:
        v_end, k_end, _ = self._section_bounds
        buf = self.buffer
        pos = v_end
        out: list[tuple[bytes | None, bool]] = []
        for _ in range(self.count):
            if pos + 5 > k_end:
                raise CorruptBatchError("keys section truncated")
            flags, n = _KEY.unpack_from(buf, pos)
            pos += 5
            if pos + n > k_end:
                raise CorruptBatchError("key overruns its section")
            key = bytes(buf[pos : pos + n]) if flags & KEY_PRESENT else None
            out.append((key, bool(flags & KEY_TOMBSTONE)))
            pos += n
        return out

    def _headers(self) -> list[tuple[tuple[bytes, bytes], ...]]:
        _, k_end, h_end = self._section_bounds
        buf = self.buffer
        pos = k_end

        def take() -> bytes:
            nonlocal pos
            if pos + 4 > h_end:
                raise CorruptBatchError("headers section truncated")
            (n,) = _U32_AT(buf, pos)
            pos += 4
            if pos + n > h_end:
                raise CorruptBatchError("header overruns its section")
            data = bytes(buf[pos : pos + n])
            pos += n
            return data

        out: list[tuple[tuple[bytes, bytes], ...]] = []
        for _ in range(self.count):
            if pos + 4 > h_end:
                raise CorruptBatchError("headers section truncated")
            (n,) = _U32_AT(buf, pos)
            pos += 4
            if n > (h_end - pos) // 8:
                raise CorruptBatchError("header count overruns its section")
            out.append(tuple((take(), take()) for _ in range(n)))
        return out


class KafkaBatch(Batch):
    """A stored batch in Kafka form. Its records are decoded once, when a reader first
    asks for events, values, keys or headers, into a batch of headwater's form kept
    beside it; a Kafka fetch never asks (:attr:`kafka_section`). ``attributes`` says
    keys and headers are there to ask for (bits 0 and 1), as a decoded batch may have
    them."""

    __slots__ = ("_columns", "_decoded", "_values")

    def __init__(self, buffer: memoryview, *, verify: bool = True) -> None:
        super().__init__(buffer, verify=verify)
        v_end, _, h_end = self._section_bounds
        if self.attributes & (ATTR_KEYS | ATTR_HEADERS | ATTR_DELTAS) or h_end != v_end:
            raise CorruptBatchError(f"Kafka-form batch at offset {self.base_offset} has sections")
        try:
            header = kafka_batch.section_header(self.kafka_section)
        except kafka_batch.KafkaRecordsError as exc:
            raise CorruptBatchError(f"batch at offset {self.base_offset}: {exc}") from None
        if header.records_count != self.count:
            raise CorruptBatchError(
                f"Kafka-form batch at offset {self.base_offset} holds {header.records_count}"
                f" records, its header says {self.count}"
            )
        self.attributes |= ATTR_KEYS | ATTR_HEADERS
        self._columns: kafka_batch.Columns | None = None
        self._decoded: Batch | None = None
        self._values: memoryview | None = None

    @property
    def kafka_section(self) -> memoryview:
        return self.buffer[HEADER_SIZE : self._section_bounds[0]]

    @property
    def payload_bytes(self) -> int:
        return int(self._section_bounds[0]) - HEADER_SIZE

    def columns(self) -> kafka_batch.Columns:
        """The records as columns: timestamps, keys, values, headers (decoded on first
        use, then kept)."""
        if self._columns is None:
            try:
                self._columns = kafka_batch.decode_section(self.kafka_section)
            except kafka_batch.KafkaRecordsError as exc:
                raise CorruptBatchError(
                    f"Kafka-form batch at offset {self.base_offset}: {exc}"
                ) from None
        return self._columns

    def decoded(self) -> Batch:
        """The same events in headwater's form (built on first use, then kept)."""
        if self._decoded is None:
            _, keys, values, headers = self.columns()
            data = build_batch(
                self.values_section(),
                self.count,
                base_offset=self.base_offset,
                first_position=self.first_position,
                timestamp_ms=self.first_timestamp_ms,
                max_timestamp_ms=self.max_timestamp_ms,
                keys=keys,
                tombstones=[value is None for value in values],
                headers=headers,
            )
            self._decoded = Batch(memoryview(data), verify=False)
        return self._decoded

    def timestamps(self) -> list[int]:
        return self.columns()[0]

    def values_section(self) -> memoryview:
        # Values alone (the SQL projection's and Kimberlite's reads): no keys or headers
        # section is built for them.
        if self._values is None:
            values = self.columns()[2]
            self._values = memoryview(encode_values([value or b"" for value in values]))
        return self._values

    def events(self, start: int = 0) -> Iterator[Event]:
        timestamps = self.timestamps()
        for event in self.decoded().events(start):
            event.timestamp_ms = timestamps[event.offset - self.base_offset]
            yield event

    def _keys(self) -> list[tuple[bytes | None, bool]]:
        decoded = self.decoded()
        return decoded._keys() if decoded.attributes & ATTR_KEYS else [(None, False)] * self.count

    def keys_section(self) -> memoryview | None:
        return self.decoded().keys_section()

    def headers_section(self) -> memoryview | None:
        return self.decoded().headers_section()

    def _headers(self) -> list[tuple[tuple[bytes, bytes], ...]]:
        # The decoded batch has a headers section only when some record has headers.
        decoded = self.decoded()
        return decoded._headers() if decoded.attributes & ATTR_HEADERS else [()] * self.count


def marker_value(commit: bool) -> bytes:
    """The one event of a transaction marker's control batch."""
    return CONTROL.pack(0, CONTROL_COMMIT if commit else CONTROL_ABORT)


def marker_commits(values_section: bytes | memoryview) -> bool:
    """A marker's values section (``u64 len | marker``): True for commit, False for
    abort; ValueError when it is no marker."""
    if len(values_section) != 8 + CONTROL.size or _U64_AT(values_section, 0)[0] != CONTROL.size:
        raise ValueError("a marker is one 4-byte value")
    version, kind = CONTROL.unpack_from(values_section, 8)
    if version != 0 or kind not in (CONTROL_ABORT, CONTROL_COMMIT):
        raise ValueError(f"unknown marker version {version} or type {kind}")
    return bool(kind == CONTROL_COMMIT)


def peek_length(buffer: bytes | bytearray | memoryview, pos: int = 0) -> int:
    """The batch_length field of the batch starting at ``pos`` (unchecked)."""
    return int(_U32_AT(buffer, pos)[0])


def iter_batches(buffer: memoryview, *, verify: bool = True) -> Iterator[Batch]:
    """Batches laid end to end in ``buffer``; raises CorruptBatchError at the first bad one."""
    pos = 0
    end = len(buffer)
    while pos < end:
        if end - pos < HEADER_SIZE:
            raise CorruptBatchError("truncated batch header")
        length = peek_length(buffer, pos)
        if length < HEADER_SIZE or pos + length > end:
            raise CorruptBatchError("truncated batch")
        yield Batch(buffer[pos : pos + length], verify=verify)
        pos += length
