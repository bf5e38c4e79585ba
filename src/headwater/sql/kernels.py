"""Compiled walks over stored record sections: the loops that must visit every record
of a batch (``u64 len | bytes`` values, ``u8 flags | u32 len | bytes`` keys, headwater's
headers section, Kafka's varint records, murmur2 of keys) as machine code (numba,
compiled on first use and cached beside this file) over numpy views of the stored bytes,
handing back Arrow columns built from their output buffers.

The Spark sink places keyed rows with :func:`murmur2_column`. The decoders are not on
the server's paths: loading numba and LLVM costs a server about 35-45 MiB of RssAnon,
which took tests/integration/test_memory_budget.py past its 300 MiB budget (308-326
MiB); docs/benchmarks.md ("Compiled record walks") has what they gained the Spark write
and the Kafka catch-up while they were.

Every kernel checks each length against the bytes left before it reads or copies (numba
does no bounds checking of its own) and answers a negative status for a section that
does not hold what its header says; the wrappers raise :class:`CorruptBatchError`.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import pyarrow as pa

from headwater.errors import CorruptBatchError
from headwater.storage import kafka_batch

HEADERS_TYPE = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
_jit = numba.njit(cache=True, nogil=True)

# ---- kernels -------------------------------------------------------------------------


@_jit
def _u32le(buf: Any, pos: int) -> int:
    return int(
        np.int64(buf[pos])
        | (np.int64(buf[pos + 1]) << 8)
        | (np.int64(buf[pos + 2]) << 16)
        | (np.int64(buf[pos + 3]) << 24)
    )


@_jit
def _values_walk(buf: Any, ends: Any, counts: Any, data: Any, offsets: Any) -> int:
    """Sections of ``u64 len | bytes`` records laid end to end in ``buf`` (section k
    ends at byte ``ends[k]`` and holds ``counts[k]`` records): each value copied to
    ``data`` without its length, and ``offsets`` (one more than the records) bounding
    them there. Returns the data bytes, or -1 when a section's records do not fill it."""
    pos = 0
    written = 0
    row = 0
    offsets[0] = 0
    for k in range(ends.shape[0]):
        end = ends[k]
        for _ in range(counts[k]):
            if end - pos < 8:
                return -1
            if buf[pos + 4] | buf[pos + 5] | buf[pos + 6] | buf[pos + 7]:
                return -1  # a value of 4 GiB or more: no batch holds one
            n = _u32le(buf, pos)
            pos += 8
            if n > end - pos:
                return -1
            data[written : written + n] = buf[pos : pos + n]
            written += n
            pos += n
            row += 1
            offsets[row] = written
        if pos != end:
            return -1
    return written


@_jit
def _keys_walk(buf: Any, count: int, data: Any, offsets: Any, flags: Any) -> int:
    """A keys section (``u8 flags | u32 len | bytes`` per record): the keys copied to
    ``data`` bounded by ``offsets``, each record's flags in ``flags``. -1 when the
    section does not hold exactly ``count`` keys."""
    pos = 0
    end = buf.shape[0]
    written = 0
    offsets[0] = 0
    for i in range(count):
        if end - pos < 5:
            return -1
        flags[i] = buf[pos]
        n = _u32le(buf, pos + 1)
        pos += 5
        if n > end - pos:
            return -1
        data[written : written + n] = buf[pos : pos + n]
        written += n
        pos += n
        offsets[i + 1] = written
    if pos != end:
        return -1
    return written


@_jit
def _headers_walk(
    buf: Any,
    count: int,
    lists: Any,
    names: Any,
    name_offsets: Any,
    values: Any,
    value_offsets: Any,
) -> int:
    """headwater's headers section (``u32 n, n x (u32 len, name, u32 len, value)`` per
    record): ``lists`` bounds each record's headers, the names and values copied out
    with their bounds. Returns the number of headers, or -1."""
    pos = 0
    end = buf.shape[0]
    h = 0
    name_written = 0
    value_written = 0
    lists[0] = 0
    name_offsets[0] = 0
    value_offsets[0] = 0
    for i in range(count):
        if end - pos < 4:
            return -1
        n = _u32le(buf, pos)
        pos += 4
        if n > (end - pos) // 8:
            return -1
        for _ in range(n):
            for part in range(2):
                if end - pos < 4:
                    return -1
                size = _u32le(buf, pos)
                pos += 4
                if size > end - pos:
                    return -1
                if part == 0:
                    names[name_written : name_written + size] = buf[pos : pos + size]
                    name_written += size
                else:
                    values[value_written : value_written + size] = buf[pos : pos + size]
                    value_written += size
                pos += size
            h += 1
            name_offsets[h] = name_written
            value_offsets[h] = value_written
        lists[i + 1] = h
    if pos != end:
        return -1
    return h


@_jit
def _varint(buf: Any, pos: int, end: int) -> tuple[int, int]:
    """A zigzag varint at ``pos``: (value, position after it); position -1 when it
    runs past ``end`` or beyond 10 bytes."""
    raw = np.uint64(0)
    shift = np.uint64(0)
    while True:
        if pos >= end or shift > np.uint64(63):
            return 0, -1
        byte = buf[pos]
        pos += 1
        raw |= np.uint64(byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += np.uint64(7)
    value = np.int64(raw >> np.uint64(1)) ^ -np.int64(raw & np.uint64(1))
    return int(value), pos


@_jit
def _kafka_walk(
    buf: Any,
    count: int,
    stamps: Any,
    keys: Any,
    key_offsets: Any,
    key_valid: Any,
    values: Any,
    value_offsets: Any,
    value_valid: Any,
    lists: Any,
    names: Any,
    name_offsets: Any,
    hvalues: Any,
    hvalue_offsets: Any,
) -> int:
    """Kafka v2 records (uncompressed) as columns: timestamp deltas, keys and values
    (copied out; ``*_valid`` 0 where null), headers as in :func:`_headers_walk` (a null
    header value is empty). Returns the number of headers, or -1 for records that do
    not read as ``count`` records ending exactly at the end of ``buf``."""
    pos = 0
    end = buf.shape[0]
    h = 0
    kw = 0
    vw = 0
    nw = 0
    hw = 0
    key_offsets[0] = 0
    value_offsets[0] = 0
    lists[0] = 0
    name_offsets[0] = 0
    hvalue_offsets[0] = 0
    for i in range(count):
        length, pos = _varint(buf, pos, end)
        if pos < 0 or length < 6 or length > end - pos:
            return -1
        record_end = pos + length
        pos += 1  # attributes
        delta, pos = _varint(buf, pos, record_end)
        if pos < 0:
            return -1
        stamps[i] = delta
        delta, pos = _varint(buf, pos, record_end)  # offset delta
        if pos < 0 or delta != i:
            return -1
        size, pos = _varint(buf, pos, record_end)
        if pos < 0 or size > record_end - pos:
            return -1
        key_valid[i] = size >= 0
        if size > 0:
            keys[kw : kw + size] = buf[pos : pos + size]
            kw += size
            pos += size
        key_offsets[i + 1] = kw
        size, pos = _varint(buf, pos, record_end)
        if pos < 0 or size > record_end - pos:
            return -1
        value_valid[i] = size >= 0
        if size > 0:
            values[vw : vw + size] = buf[pos : pos + size]
            vw += size
            pos += size
        value_offsets[i + 1] = vw
        n, pos = _varint(buf, pos, record_end)
        if pos < 0 or n < 0 or n > record_end - pos:
            return -1
        for _ in range(n):
            size, pos = _varint(buf, pos, record_end)
            if pos < 0 or size < 0 or size > record_end - pos:
                return -1
            names[nw : nw + size] = buf[pos : pos + size]
            nw += size
            pos += size
            size, pos = _varint(buf, pos, record_end)
            if pos < 0 or size > record_end - pos:
                return -1
            if size > 0:
                hvalues[hw : hw + size] = buf[pos : pos + size]
                hw += size
                pos += size
            h += 1
            name_offsets[h] = nw
            hvalue_offsets[h] = hw
        lists[i + 1] = h
        if pos != record_end:
            return -1
    if pos != end:
        return -1
    return h


@_jit
def _prefixed_join(heads: Any, data: Any, offsets: Any, out: Any) -> None:
    """Row i of ``heads`` (fixed-size prefixes) then item i of ``data`` (bounded by
    ``offsets``), for every row, laid end to end in ``out``."""
    width = heads.shape[1]
    pos = 0
    for i in range(heads.shape[0]):
        out[pos : pos + width] = heads[i]
        pos += width
        lo = offsets[i]
        hi = offsets[i + 1]
        out[pos : pos + hi - lo] = data[lo:hi]
        pos += hi - lo


@_jit
def _murmur2(data: Any, offsets: Any, out: Any) -> None:
    """Kafka's murmur2 (``Utils.murmur2``, unsigned) of each item of ``data`` bounded
    by ``offsets``, as :func:`headwater.engine.partitioner.murmur2` computes it."""
    mask = np.uint64(0xFFFFFFFF)
    m = np.uint64(0x5BD1E995)
    for i in range(out.shape[0]):
        lo = offsets[i]
        length = offsets[i + 1] - lo
        h = (np.uint64(0x9747B28C) ^ np.uint64(length)) & mask
        for j in range(length // 4):
            at = lo + 4 * j
            k = (
                np.uint64(data[at])
                | (np.uint64(data[at + 1]) << np.uint64(8))
                | (np.uint64(data[at + 2]) << np.uint64(16))
                | (np.uint64(data[at + 3]) << np.uint64(24))
            )
            k = (k * m) & mask
            k ^= k >> np.uint64(24)
            k = (k * m) & mask
            h = ((h * m) & mask) ^ k
        tail = length & 3
        if tail:
            base = lo + (length & ~3)
            if tail == 3:
                h ^= np.uint64(data[base + 2]) << np.uint64(16)
            if tail >= 2:
                h ^= np.uint64(data[base + 1]) << np.uint64(8)
            h ^= np.uint64(data[base])
            h = (h * m) & mask
        h ^= h >> np.uint64(13)
        h = (h * m) & mask
        h ^= h >> np.uint64(15)
        out[i] = h


# ---- wrappers ------------------------------------------------------------------------


def _bytes(view: bytes | bytearray | memoryview | pa.Buffer) -> np.ndarray:
    """Stored bytes as a kernel's input, always read-only: numba compiles a kernel once
    per argument type, and a writable array is another type."""
    array = np.frombuffer(view, np.uint8)
    array.flags.writeable = False
    return array


def _binary(
    data: np.ndarray, size: int, offsets: np.ndarray, rows: int, valid: np.ndarray | None = None
) -> pa.Array:
    """A binary array over the kernel's output (int32 offsets, as the schemas have)."""
    validity = None
    null_count = 0
    if valid is not None and not valid.all():
        validity = pa.py_buffer(np.packbits(valid.astype(np.bool_), bitorder="little"))
        null_count = rows - int(np.count_nonzero(valid))
    if size >= 1 << 31:
        raise CorruptBatchError("a column of 2 GiB or more")
    return pa.Array.from_buffers(
        pa.binary(),
        rows,
        [validity, pa.py_buffer(offsets[: rows + 1].astype(np.int32)), pa.py_buffer(data[:size])],
        null_count,
    )


def values_column(sections: list[memoryview], counts: list[int]) -> pa.Array:
    """The values of stored values sections (``u64 len | bytes`` per record) as one
    binary array, in order: one copy of the bytes, no Python per value."""
    buf = _bytes(b"".join(sections)) if len(sections) != 1 else _bytes(sections[0])
    ends = np.cumsum(np.fromiter(map(len, sections), np.int64, len(sections)))
    count_array = np.array(counts, np.int64)
    rows = int(count_array.sum())
    data = np.empty(len(buf), np.uint8)  # a bound whatever the section claims
    offsets = np.empty(rows + 1, np.int64)
    size = _values_walk(buf, ends, count_array, data, offsets)
    if size < 0:
        raise CorruptBatchError("a values section does not hold its events")
    return _binary(data, size, offsets, rows)


def keys_column(section: memoryview, count: int) -> tuple[pa.Array, np.ndarray]:
    """A keys section's keys as a binary array (NULL where a record has none) and each
    record's flags (``KEY_PRESENT``, ``KEY_TOMBSTONE``)."""
    from headwater.storage.batch import KEY_PRESENT

    buf = _bytes(section)
    data = np.empty(len(buf), np.uint8)
    offsets = np.empty(count + 1, np.int64)
    flags = np.empty(count, np.uint8)
    size = _keys_walk(buf, count, data, offsets, flags)
    if size < 0:
        raise CorruptBatchError("keys section does not match its keys")
    return _binary(data, size, offsets, count, (flags & KEY_PRESENT) != 0), flags


def _headers_array(
    rows: int,
    lists: np.ndarray,
    headers: int,
    names: np.ndarray,
    name_offsets: np.ndarray,
    hvalues: np.ndarray,
    hvalue_offsets: np.ndarray,
) -> pa.Array:
    """``list<struct<key, value>>`` from a kernel's header output; a record without
    headers is NULL (as the records path has always shown it)."""
    name_array = _binary(names, int(name_offsets[headers]), name_offsets, headers)
    try:
        keys = name_array.cast(pa.string())
    except pa.ArrowInvalid:  # names that are not UTF-8: replaced, as bytes.decode does
        keys = pa.array([n.decode("utf-8", "replace") for n in name_array.to_pylist()], pa.string())
    values = _binary(hvalues, int(hvalue_offsets[headers]), hvalue_offsets, headers)
    entries = pa.StructArray.from_arrays([keys, values], names=["key", "value"])
    bounds = lists[: rows + 1].astype(np.int32)
    has = np.diff(bounds) > 0
    mask = None if has.all() else pa.array(~has)
    return pa.ListArray.from_arrays(pa.array(bounds), entries, HEADERS_TYPE, mask=mask)


def headers_column(section: memoryview, count: int) -> pa.Array:
    """headwater's headers section as a ``list<struct<key, value>>`` array."""
    buf = _bytes(section)
    lists = np.empty(count + 1, np.int64)
    most = len(buf) // 8 + 1
    names = np.empty(len(buf), np.uint8)
    values = np.empty(len(buf), np.uint8)
    name_offsets = np.empty(most, np.int64)
    value_offsets = np.empty(most, np.int64)
    headers = _headers_walk(buf, count, lists, names, name_offsets, values, value_offsets)
    if headers < 0:
        raise CorruptBatchError("headers section does not match its events")
    return _headers_array(count, lists, headers, names, name_offsets, values, value_offsets)


class KafkaColumns:
    """A Kafka-form batch's records as columns: each record's timestamp (ms) and value
    (NULL: none, a tombstone's value); :meth:`keys` (NULL: none) and :meth:`headers`
    (NULL: none) are made into Arrow arrays only when asked for (the projection never
    asks)."""

    __slots__ = ("_headers", "_keys", "timestamps", "values")

    def __init__(
        self,
        timestamps: np.ndarray,
        values: pa.Array,
        keys: tuple[np.ndarray, int, np.ndarray, np.ndarray],
        headers: tuple[np.ndarray, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    ) -> None:
        self.timestamps = timestamps
        self.values = values
        self._keys = keys
        self._headers = headers

    def keys(self) -> pa.Array:
        data, size, offsets, valid = self._keys
        return _binary(data, size, offsets, len(self.values), valid)

    def headers(self) -> pa.Array:
        rows = len(self.values)
        lists, names, name_offsets, hvalues, hvalue_offsets = (
            self._headers[0],
            *self._headers[2:],
        )
        count = self._headers[1]
        return _headers_array(rows, lists, count, names, name_offsets, hvalues, hvalue_offsets)


def kafka_columns(section: memoryview | bytes) -> KafkaColumns:
    """A stored Kafka section (from its CRC on) decoded in one compiled pass over its
    (decompressed) records."""
    view = memoryview(section)
    try:
        header = kafka_batch.section_header(view)
        codec = header.attributes & kafka_batch.ATTR_CODEC
        records = view[kafka_batch.SECTION_HEADER_SIZE :]
        body = records if codec == 0 else kafka_batch.decompress(codec, records)
    except kafka_batch.KafkaRecordsError as exc:
        raise CorruptBatchError(f"Kafka-form batch: {exc}") from None
    count = header.records_count
    buf = _bytes(body)
    size = len(buf)
    most = size // 2 + 1  # a header takes at least two bytes
    stamps = np.empty(count, np.int64)
    keys, values, names, hvalues = (np.empty(size, np.uint8) for _ in range(4))
    key_offsets = np.empty(count + 1, np.int64)
    value_offsets = np.empty(count + 1, np.int64)
    key_valid = np.empty(count, np.uint8)
    value_valid = np.empty(count, np.uint8)
    lists = np.empty(count + 1, np.int64)
    name_offsets = np.empty(most, np.int64)
    hvalue_offsets = np.empty(most, np.int64)
    headers = _kafka_walk(
        buf,
        count,
        stamps,
        keys,
        key_offsets,
        key_valid,
        values,
        value_offsets,
        value_valid,
        lists,
        names,
        name_offsets,
        hvalues,
        hvalue_offsets,
    )
    if headers < 0:
        raise CorruptBatchError("Kafka-form batch: its records do not read")
    if header.log_append_time:
        stamps[:] = header.max_timestamp
    else:
        stamps += header.base_timestamp
    return KafkaColumns(
        stamps,
        _binary(values, int(value_offsets[count]), value_offsets, count, value_valid),
        (keys, int(key_offsets[count]), key_offsets, key_valid),
        (lists, headers, names, name_offsets, hvalues, hvalue_offsets),
    )


def prefixed_join(heads: np.ndarray, items: pa.Array) -> bytes:
    """Each fixed-size prefix (a row of ``heads``, a numpy structured array) followed by
    its item (a binary array without nulls), all laid end to end."""
    count = len(items)
    if count == 0:
        return b""
    offsets = np.frombuffer(items.buffers()[1], np.int32, count + 1, items.offset * 4)
    first, last = int(offsets[0]), int(offsets[-1])
    data_buffer = items.buffers()[2]
    data = _bytes(data_buffer if data_buffer is not None else b"")[first:last]
    width = heads.dtype.itemsize
    out = np.empty(count * width + last - first, np.uint8)
    _prefixed_join(
        heads.view(np.uint8).reshape(count, width), data, offsets.astype(np.int64) - first, out
    )
    return out.tobytes()


def murmur2_column(items: pa.Array) -> np.ndarray:
    """Kafka's murmur2 (unsigned, uint32) of every item of a binary array without
    nulls, in one compiled pass over its buffers."""
    count = len(items)
    out = np.empty(count, np.uint64)
    if count:
        offsets = np.frombuffer(items.buffers()[1], np.int32, count + 1, items.offset * 4)
        data_buffer = items.buffers()[2]
        data = _bytes(data_buffer if data_buffer is not None else b"")
        _murmur2(data, offsets.astype(np.int64), out)
    return out.astype(np.uint32)


def warm_up() -> None:
    """Compile every kernel now (or load it from numba's cache beside this file) on
    tiny inputs of the types the wrappers pass: ``make`` runs this after installing,
    so no server pays the seconds of the first compile in a catch-up."""
    values_column([memoryview(b"\x01\x00\x00\x00\x00\x00\x00\x00v")], [1])
    keys_column(memoryview(b"\x01\x01\x00\x00\x00k"), 1)
    headers_column(memoryview(b"\x01\x00\x00\x00\x01\x00\x00\x00h\x01\x00\x00\x00v"), 1)
    # One record: length 6, attributes, timestamp and offset deltas 0, a null key, an
    # empty value, no headers.
    record = bytes([12, 0, 0, 0, 1, 0, 0])
    section = kafka_batch.SECTION_HEADER.pack(0, 0, 0, 0, 0, -1, -1, -1, 1) + record
    columns = kafka_columns(section)
    columns.keys()
    columns.headers()
    heads = np.zeros(1, np.dtype([("length", "<u8")]))
    prefixed_join(heads, pa.array([b"v"], pa.binary()))
    murmur2_column(pa.array([b"key"], pa.binary()))
