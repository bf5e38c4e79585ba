"""Record batch format: encoding, decoding, checking and the documented byte layout."""

from __future__ import annotations

import struct

import crc32c
import pytest
from hypothesis import given
from hypothesis import strategies as st

from headwater.errors import CorruptBatchError, UsageError
from headwater.storage.batch import (
    ATTR_DELTAS,
    ATTR_HEADERS,
    ATTR_KEYS,
    ATTR_PRODUCER,
    HEADER_SIZE,
    MAGIC,
    Batch,
    Event,
    build_batch,
    encode_batch,
    encode_values,
    iter_batches,
    peek_length,
    value_spans,
)


def decode(data: bytes) -> list[Event]:
    return list(Batch(memoryview(data)).events())


# ---- round trips ---------------------------------------------------------------------


def test_values_only_round_trip() -> None:
    values = [b"alpha", b"", b"\x00\xff" * 50, b"z"]
    data = encode_batch(values, base_offset=100, first_position=7000, timestamp_ms=1234)
    batch = Batch(memoryview(data))
    assert batch.count == 4
    assert batch.base_offset == 100
    assert batch.last_offset == 103
    assert batch.next_offset == 104
    assert batch.dense
    assert batch.offsets() == [100, 101, 102, 103]
    assert batch.length == len(data)
    assert batch.attributes == 0
    events = list(batch.events())
    assert [e.value for e in events] == values
    assert [e.offset for e in events] == [100, 101, 102, 103]
    assert [e.position for e in events] == [7000, 7001, 7002, 7003]
    assert all(e.timestamp_ms == 1234 for e in events)
    assert all(e.key is None and not e.tombstone and e.headers == () for e in events)
    # The stored values section is exactly the wire form of the values.
    assert bytes(batch.values_section()) == encode_values(values)


def test_keys_none_and_bytes_and_tombstones_round_trip() -> None:
    values = [b"v0", b"v1", b"v2", b"v3"]
    keys = [b"k0", None, b"", b"k3"]
    tombstones = [False, False, True, True]
    data = encode_batch(
        values, base_offset=0, first_position=0, timestamp_ms=5, keys=keys, tombstones=tombstones
    )
    batch = Batch(memoryview(data))
    assert batch.attributes & ATTR_KEYS
    events = list(batch.events())
    assert [e.key for e in events] == keys  # an empty key is a key, not "no key"
    assert [e.tombstone for e in events] == tombstones
    assert [e.value for e in events] == values


def test_tombstones_without_keys_mean_no_keys() -> None:
    data = encode_batch(
        [b"a", b"b"], base_offset=0, first_position=0, timestamp_ms=0, tombstones=[True, False]
    )
    events = decode(data)
    assert [e.key for e in events] == [None, None]
    assert [e.tombstone for e in events] == [True, False]


def test_headers_round_trip() -> None:
    headers = [
        [(b"content-type", b"json"), (b"trace", b"\x00\x01")],
        [],
        [(b"", b"")],
    ]
    data = encode_batch(
        [b"a", b"b", b"c"], base_offset=3, first_position=9, timestamp_ms=0, headers=headers
    )
    batch = Batch(memoryview(data))
    assert batch.attributes & ATTR_HEADERS
    assert [e.headers for e in batch.events()] == [tuple(h) for h in headers]


def test_all_empty_headers_add_no_section() -> None:
    data = encode_batch(
        [b"a", b"b"], base_offset=0, first_position=0, timestamp_ms=0, headers=[[], []]
    )
    batch = Batch(memoryview(data))
    assert not batch.attributes & ATTR_HEADERS
    assert [e.headers for e in batch.events()] == [(), ()]


def test_deltas_give_sparse_offsets_and_positions() -> None:
    values = [b"x", b"yy", b"zzz"]
    data = build_batch(
        encode_values(values),
        3,
        base_offset=50,
        first_position=1000,
        timestamp_ms=1,
        max_timestamp_ms=9,
        keys=[b"a", None, b"c"],
        headers=[[(b"h", b"1")], [], []],
        deltas=[0, 4, 9],
    )
    batch = Batch(memoryview(data))
    assert batch.attributes & ATTR_DELTAS
    assert not batch.dense
    assert batch.offsets() == [50, 54, 59]
    assert batch.last_offset == 59
    assert batch.next_offset == 60
    assert batch.max_timestamp_ms == 9
    events = list(batch.events())
    assert [(e.offset, e.position, e.value, e.key) for e in events] == [
        (50, 1000, b"x", b"a"),
        (54, 1004, b"yy", None),
        (59, 1009, b"zzz", b"c"),
    ]
    assert events[0].headers == ((b"h", b"1"),)
    # index_of: first event at or after an offset, count when past the end.
    assert [batch.index_of(o) for o in (0, 50, 51, 54, 55, 59, 60, 1000)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
    ]
    # Decoding from an index starts there.
    assert [e.offset for e in batch.events(1)] == [54, 59]


def test_dense_index_of_clamps() -> None:
    batch = Batch(
        memoryview(encode_batch([b"a"] * 5, base_offset=10, first_position=0, timestamp_ms=0))
    )
    assert [batch.index_of(o) for o in (0, 10, 12, 14, 15, 99)] == [0, 0, 2, 4, 5, 5]
    assert [e.offset for e in batch.events(3)] == [13, 14]


def test_build_batch_rejects_misuse() -> None:
    with pytest.raises(UsageError):
        build_batch(b"", 0, base_offset=0, first_position=0, timestamp_ms=0)
    section = encode_values([b"a", b"b"])
    with pytest.raises(UsageError):
        build_batch(section, 2, base_offset=0, first_position=0, timestamp_ms=0, keys=[b"k"])
    with pytest.raises(UsageError):
        build_batch(section, 2, base_offset=0, first_position=0, timestamp_ms=0, tombstones=[True])
    with pytest.raises(UsageError):
        build_batch(
            section, 2, base_offset=0, first_position=0, timestamp_ms=0, headers=[[(b"a", b"b")]]
        )
    with pytest.raises(UsageError):
        build_batch(section, 2, base_offset=0, first_position=0, timestamp_ms=0, deltas=[0])


# ---- header layout -------------------------------------------------------------------


def test_header_layout_matches_documented_byte_offsets() -> None:
    values = [b"hello", b"world!"]
    keys = [b"k1", None]
    headers = [[(b"n", b"v")], []]
    data = build_batch(
        encode_values(values),
        2,
        base_offset=0x0102030405060708,
        first_position=0x1112131415161718,
        timestamp_ms=-5,
        max_timestamp_ms=1_700_000_000_000,
        keys=keys,
        headers=headers,
        deltas=[0, 3],
    )

    def u32(at: int) -> int:
        return u32_at(data, at)

    assert HEADER_SIZE == 64
    assert u32(0) == len(data)
    assert u32(4) == crc32c.crc32c(data[8:])
    assert data[8] == MAGIC == 1
    assert data[9] == ATTR_KEYS | ATTR_HEADERS | ATTR_DELTAS
    assert struct.unpack_from("<H", data, 10)[0] == 0
    assert u32(12) == 2
    assert struct.unpack_from("<Q", data, 16)[0] == 0x0102030405060708
    assert struct.unpack_from("<q", data, 24)[0] == -5
    assert struct.unpack_from("<q", data, 32)[0] == 1_700_000_000_000
    assert struct.unpack_from("<Q", data, 40)[0] == 0x1112131415161718
    values_len, keys_len, headers_len, deltas_len = (u32(48), u32(52), u32(56), u32(60))
    assert values_len == len(encode_values(values)) == 8 + 5 + 8 + 6
    assert keys_len == (1 + 4 + 2) + (1 + 4)
    assert headers_len == (4 + 4 + 1 + 4 + 1) + 4
    assert deltas_len == 8
    assert HEADER_SIZE + values_len + keys_len + headers_len + deltas_len == len(data)
    # Sections follow in order: values, keys, headers, deltas.
    assert data[64 : 64 + values_len] == encode_values(values)
    k = 64 + values_len
    assert data[k : k + keys_len] == b"\x01" + struct.pack("<I", 2) + b"k1" + b"\x00" + (
        b"\x00" * 4
    )
    h = k + keys_len
    assert data[h : h + headers_len] == (
        struct.pack("<I", 1) + struct.pack("<I", 1) + b"n" + struct.pack("<I", 1) + b"v"
    ) + struct.pack("<I", 0)
    d = h + headers_len
    assert data[d:] == struct.pack("<II", 0, 3)
    assert peek_length(data) == len(data)


def test_tombstone_flag_bits() -> None:
    data = encode_batch(
        [b"a", b"b"],
        base_offset=0,
        first_position=0,
        timestamp_ms=0,
        keys=[b"k", None],
        tombstones=[True, True],
    )
    keys_at = 64 + u32_at(data, 48)
    assert data[keys_at] == 0x01 | 0x02  # has key + tombstone
    assert data[keys_at + 1 + 4 + 1] == 0x02  # no key, tombstone


def u32_at(data: bytes, at: int) -> int:
    return int(struct.unpack_from("<I", data, at)[0])


def test_dense_batch_defaults_max_timestamp_to_timestamp() -> None:
    data = encode_batch([b"a"], base_offset=0, first_position=0, timestamp_ms=77)
    assert struct.unpack_from("<qq", data, 24) == (77, 77)


# ---- corruption ----------------------------------------------------------------------


def sample_batch() -> bytes:
    return encode_batch(
        [b"one", b"two", b""],
        base_offset=42,
        first_position=1,
        timestamp_ms=99,
        keys=[b"a", None, b"c"],
        tombstones=[False, False, True],
        headers=[[(b"h", b"v")], [], []],
    )


@pytest.mark.parametrize("position", [0, 3, 4, 7, 8, 9, 12, 16, 23, 40, 48, 63, 64, 70, -1])
def test_any_flipped_byte_is_detected(position: int) -> None:
    data = bytearray(sample_batch())
    data[position] ^= 0x40
    with pytest.raises(CorruptBatchError):
        Batch(memoryview(bytes(data)))


def test_crc_is_skipped_only_when_asked() -> None:
    data = bytearray(sample_batch())
    data[-1] ^= 0x01  # inside a section: structure still adds up
    batch = Batch(memoryview(bytes(data)), verify=False)
    assert batch.count == 3
    with pytest.raises(CorruptBatchError):
        Batch(memoryview(bytes(data)))


def test_structural_checks_with_valid_crc() -> None:
    def resealed(data: bytearray) -> memoryview:
        struct.pack_into("<I", data, 4, crc32c.crc32c(bytes(data[8:])))
        return memoryview(bytes(data))

    good = sample_batch()
    bad_magic = bytearray(good)
    bad_magic[8] = 2
    with pytest.raises(CorruptBatchError, match="magic"):
        Batch(resealed(bad_magic))

    bad_sections = bytearray(good)
    struct.pack_into("<I", bad_sections, 48, u32_at(good, 48) + 1)
    with pytest.raises(CorruptBatchError):
        Batch(resealed(bad_sections))

    zero_count = bytearray(good)
    struct.pack_into("<I", zero_count, 12, 0)
    with pytest.raises(CorruptBatchError):
        Batch(resealed(zero_count))

    # A value length that overruns the values section is caught when values are read.
    overrun = bytearray(good)
    struct.pack_into("<Q", overrun, 64, 10_000)
    batch = Batch(resealed(overrun))
    with pytest.raises(CorruptBatchError):
        batch.value_bounds()
    with pytest.raises(CorruptBatchError):
        list(batch.events())


def test_too_short_buffers_are_corrupt() -> None:
    with pytest.raises(CorruptBatchError):
        Batch(memoryview(b"\x00" * 10))
    data = sample_batch()
    with pytest.raises(CorruptBatchError):
        Batch(memoryview(data[:-1]))
    with pytest.raises(CorruptBatchError):
        Batch(memoryview(data + b"\x00"))


# ---- iter_batches --------------------------------------------------------------------


def test_iter_batches_walks_concatenated_batches() -> None:
    a = encode_batch([b"a1", b"a2"], base_offset=0, first_position=0, timestamp_ms=1)
    b = encode_batch([b"b1"], base_offset=2, first_position=2, timestamp_ms=2, keys=[b"k"])
    c = encode_batch([b"c1", b"c2", b"c3"], base_offset=3, first_position=3, timestamp_ms=3)
    batches = list(iter_batches(memoryview(a + b + c)))
    assert [x.base_offset for x in batches] == [0, 2, 3]
    assert [e.value for x in batches for e in x.events()] == [
        b"a1",
        b"a2",
        b"b1",
        b"c1",
        b"c2",
        b"c3",
    ]
    assert list(iter_batches(memoryview(b""))) == []


@pytest.mark.parametrize("cut", [1, 10, 63, 64, 65])
def test_iter_batches_raises_on_torn_tail_after_whole_batches(cut: int) -> None:
    a = encode_batch([b"a1"], base_offset=0, first_position=0, timestamp_ms=1)
    b = encode_batch([b"b1" * 40], base_offset=1, first_position=1, timestamp_ms=2)
    it = iter_batches(memoryview(a + b[:cut]))
    assert next(it).base_offset == 0
    with pytest.raises(CorruptBatchError):
        next(it)


def test_iter_batches_raises_on_corrupt_middle_batch() -> None:
    a = encode_batch([b"a1"], base_offset=0, first_position=0, timestamp_ms=1)
    b = bytearray(encode_batch([b"b1"], base_offset=1, first_position=1, timestamp_ms=2))
    b[-1] ^= 0xFF
    c = encode_batch([b"c1"], base_offset=2, first_position=2, timestamp_ms=3)
    it = iter_batches(memoryview(a + bytes(b) + c))
    assert next(it).base_offset == 0
    with pytest.raises(CorruptBatchError):
        next(it)
    # Without verification the same bytes pass (the CRC is the only thing that changed).
    assert [x.base_offset for x in iter_batches(memoryview(a + bytes(b) + c), verify=False)] == [
        0,
        1,
        2,
    ]


def test_iter_batches_rejects_length_below_header() -> None:
    bogus = struct.pack("<I", 10) + b"\x00" * 100
    with pytest.raises(CorruptBatchError):
        list(iter_batches(memoryview(bogus)))


# ---- value_spans ---------------------------------------------------------------------


def test_value_spans_bounds() -> None:
    section = encode_values([b"ab", b"", b"cde"])
    assert value_spans(section, 3) == [0, 10, 18, 29]
    assert value_spans(memoryview(section), 3) == [0, 10, 18, 29]
    assert value_spans(b"", 0) == [0]
    # From a start position inside a larger buffer.
    assert value_spans(b"xx" + section, 3, start=2) == [2, 12, 20, 31]


@pytest.mark.parametrize(
    ("section", "count"),
    [
        (b"", 1),  # nothing at all
        (b"\x01\x00\x00", 1),  # truncated length prefix
        (struct.pack("<Q", 5) + b"abc", 1),  # value overruns the section
        (encode_values([b"a"]), 2),  # fewer values than claimed
        (struct.pack("<Q", 2**63) + b"x", 1),  # absurd length
    ],
)
def test_value_spans_rejects_malformed(section: bytes, count: int) -> None:
    with pytest.raises(ValueError):
        value_spans(section, count)


def test_value_spans_rejects_trailing_bytes() -> None:
    # The docstring promises a ValueError unless the section holds *exactly* ``count``
    # values: bytes after the last value must not pass as a valid values section, or an
    # append checked with value_spans stores (and later serves) the trailing garbage.
    with pytest.raises(ValueError):
        value_spans(encode_values([b"a", b"b"]) + b"\x00", 2)
    with pytest.raises(ValueError):
        value_spans(encode_values([b"a", b"b"]), 1)


def test_producer_section_round_trip_and_is_last() -> None:
    data = build_batch(
        encode_values([b"a"]),
        1,
        base_offset=0,
        first_position=0,
        timestamp_ms=0,
        keys=[b"k"],
        producer=(7, 3),
    )
    batch = Batch(memoryview(data))
    assert batch.attributes & ATTR_PRODUCER
    assert batch.producer == (7, 3)
    assert data[-16:] == struct.pack("<QQ", 7, 3)
    assert [e.key for e in batch.events()] == [b"k"]
    plain = Batch(memoryview(encode_batch([b"a"], base_offset=0, first_position=0, timestamp_ms=0)))
    assert plain.producer is None


def _reference_spans(section: bytes, count: int, start: int) -> list[int] | None:
    """value_spans as a plain loop over the length fields; None when malformed."""
    bounds, pos = [start], start
    for _ in range(count):
        if pos + 8 > len(section):
            return None
        pos += 8 + struct.unpack_from("<Q", section, pos)[0]
        if pos > len(section):
            return None
        bounds.append(pos)
    return bounds if pos == len(section) else None


@given(
    sizes=st.lists(st.sampled_from([0, 1, 3, 7, 100]), min_size=0, max_size=12),
    same=st.booleans(),
    start=st.integers(0, 3),
    claimed_extra=st.integers(-1, 1),
    flip=st.integers(0, 10_000),
)
def test_value_spans_matches_a_plain_walk(
    sizes: list[int], same: bool, start: int, claimed_extra: int, flip: int
) -> None:
    """The fixed-size fast path (all events one size) gives what walking every length
    gives, and never accepts a section the walk refuses: uneven sizes with the same total,
    a wrong count, or any one byte of a length field changed."""
    if same and sizes:
        sizes = [sizes[0]] * len(sizes)
    values = [bytes([65 + i % 26]) * n for i, n in enumerate(sizes)]
    section = bytearray(b"\xee" * start + encode_values(values))
    if len(section) > start and flip % 3 == 0:
        section[start + flip % (len(section) - start)] ^= 1 << (flip % 8)
    count = max(0, len(values) + claimed_extra)
    want = _reference_spans(bytes(section), count, start)
    if want is None:
        with pytest.raises(ValueError):
            value_spans(bytes(section), count, start)
    else:
        assert value_spans(bytes(section), count, start) == want
        assert value_spans(memoryview(bytes(section)), count, start) == want


@given(
    st.lists(st.binary(max_size=6), min_size=1, max_size=8),
    st.lists(st.one_of(st.none(), st.binary(min_size=3, max_size=3), st.binary(max_size=4))),
    st.booleans(),
)
def test_values_and_keys_of_one_size_encode_like_any_others(
    values: list[bytes], drawn_keys: list[bytes | None], with_tombstones: bool
) -> None:
    """The one-size shortcuts (a shared length prefix, a shared key head) give the bytes
    of the per-event encoding: the batch decodes to the same values, keys, tombstones."""
    values = values + [values[0]] * 3  # often all of one size
    keys = (drawn_keys + [b"abc"] * len(values))[: len(values)]
    tombstones = [i % 3 == 0 for i in range(len(values))] if with_tombstones else None
    section = encode_values(values)
    assert section == b"".join(struct.pack("<Q", len(v)) + v for v in values)
    data = build_batch(
        section,
        len(values),
        base_offset=0,
        first_position=0,
        timestamp_ms=0,
        keys=keys,
        tombstones=tombstones,
    )
    events = list(Batch(memoryview(data)).events())
    assert [e.value for e in events] == values
    assert [e.key for e in events] == keys
    assert [e.tombstone for e in events] == (tombstones or [False] * len(values))


def walk_take(
    values: list[bytes], start: int, max_bytes: int, max_events: int, least: bool
) -> tuple[int, int, int, int]:
    """What take_values answers, by a walk of the values one at a time."""
    taken = size = 0
    for value in values[start : start + max_events]:
        if size + len(value) > max_bytes and (taken or not least):
            break
        size += len(value)
        taken += 1
    lo = sum(8 + len(v) for v in values[:start])
    hi = lo + sum(8 + len(v) for v in values[start : start + taken])
    return start + taken, lo, hi, size


@given(
    width=st.integers(0, 40),
    count=st.integers(1, 60),
    odd=st.one_of(st.none(), st.integers(0, 59)),
    data=st.data(),
)
def test_take_values_of_one_size_cut_as_a_walk_would(
    width: int, count: int, odd: int | None, data: st.DataObject
) -> None:
    # Values of one size are cut arithmetically; one value of another size anywhere
    # (odd) sends the cut back to the walk. Either way the answer is the walk's.
    values = [bytes([65 + i % 26]) * width for i in range(count)]
    if odd is not None and odd < count:
        values[odd] = b"z" * (width + 1 + odd % 3)
    section = encode_values(values)
    batch = Batch(
        memoryview(build_batch(section, count, base_offset=0, first_position=0, timestamp_ms=0))
    )
    start = data.draw(st.integers(0, count - 1))
    max_bytes = data.draw(st.integers(-1, (width + 3) * count))
    max_events = data.draw(st.integers(1, count + 1))
    least = data.draw(st.booleans())
    want = walk_take(values, start, max_bytes, max_events, least)
    assert batch.take_values(start, max_bytes, max_events, at_least_one=least) == want
    lo = want[1]
    assert batch.take_values(start, max_bytes, max_events, at_least_one=least, start_pos=lo) == want
