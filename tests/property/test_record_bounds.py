"""Record bounds found by numpy (:func:`headwater.storage.batch.record_bounds`) are the
walk's, or nothing: on any bytes (values and keys sections as stored, damaged, with
zeros in the data, empty values, long records) it returns exactly the bounds a walk of
the lengths finds, or None where the walk refuses or it cannot show them; and the
records path and the projection's data column, which use it for large batches, give
what decoding events one by one gives (keys, NULL keys, tombstones, headers, empty
values)."""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from records_checks import check_records_columns

from headwater.errors import CorruptBatchError
from headwater.sql.projection import _Piece
from headwater.storage.batch import (
    BOUNDS_FROM,
    Batch,
    build_batch,
    encode_values,
    key_spans,
    record_bounds,
    value_spans,
    value_spans_array,
)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VALUES = dict(head=8, length_at=0, length_size=8)
KEYS = dict(head=5, length_at=1, length_size=4)


def walk(
    section: bytes, count: int, start: int, head: int, length_at: int, length_size: int
) -> list[int] | None:
    """The bounds a plain loop over the length fields finds; None where it refuses."""
    bounds, pos = [start], start
    for _ in range(count):
        if pos + head > len(section):
            return None
        length = int.from_bytes(section[pos + length_at : pos + length_at + length_size], "little")
        pos += head + length
        if pos > len(section):
            return None
        bounds.append(pos)
    return bounds if pos == len(section) else None


def keys_section(keys: list[bytes | None], tombstones: list[bool]) -> bytes:
    return b"".join(
        struct.pack("<BI", (k is not None) | (t << 1), len(k or b"")) + (k or b"")
        for k, t in zip(keys, tombstones, strict=True)
    )


def random_values(rng: random.Random, n: int, longest: int) -> list[bytes]:
    """Empty values, JSON, binary (zeros in the data) and runs of zeros, mixed."""
    weights = [rng.random() for _ in range(4)]
    out: list[bytes] = []
    for kind in rng.choices(range(4), weights, k=n):
        if kind == 0:
            out.append(b"")
        elif kind == 1:
            out.append(b'{"n":%d}' % rng.randrange(10 ** rng.randrange(1, 12)))
        elif kind == 2:
            out.append(rng.randbytes(rng.randrange(longest + 1)))
        else:
            out.append(b"\x00" * rng.randrange(1, 20))
    return out


@st.composite
def sections(draw: st.DrawFn) -> tuple[bytes, int, int, dict[str, int]]:
    """A values or keys section of random records (sometimes over 255 bytes), after
    ``start`` junk bytes, maybe damaged (a byte changed, bytes added or cut) and with
    a claimed count maybe off by one."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    n = draw(st.integers(1, 400))
    longest = draw(st.sampled_from([8, 60, 255, 300]))
    layout = draw(st.sampled_from([VALUES, KEYS]))
    values = random_values(rng, n, longest)
    if layout is VALUES:
        body = encode_values(values)
    else:
        keys = [None if rng.random() < 0.2 else v for v in values]
        body = keys_section(keys, [rng.random() < 0.1 for _ in values])
    start = draw(st.integers(0, 3))
    section = bytearray(rng.randbytes(start) + body)
    damage = draw(st.sampled_from(["none", "none", "flip", "append", "cut"]))
    if damage == "flip" and len(section) > start:
        section[rng.randrange(start, len(section))] ^= 1 << rng.randrange(8)
    elif damage == "append":
        section += rng.randbytes(rng.randrange(1, 9))
    elif damage == "cut" and len(section) > start:
        del section[-rng.randrange(1, min(9, len(section) - start) + 1) :]
    count = max(1, n + draw(st.integers(-1, 1)) * (draw(st.integers(0, 3)) == 0))
    return bytes(section), count, start, layout


@SETTINGS
@given(sections())
def test_record_bounds_are_the_walks_or_none(case: tuple[bytes, int, int, dict[str, int]]) -> None:
    section, count, start, layout = case
    want = walk(section, count, start, **layout)
    found = record_bounds(section, count, start, **layout)
    if found is not None:
        assert found.tolist() == want
    for view in (section, memoryview(section)):  # what the callers use, either way
        if layout is VALUES:
            if want is None:
                with pytest.raises(ValueError):
                    value_spans(view, count, start)
                with pytest.raises(ValueError):
                    value_spans_array(view, count, start)
            else:
                assert value_spans(view, count, start) == want
                assert value_spans_array(view, count, start).tolist() == want
        elif start == 0:
            if want is None:
                with pytest.raises(CorruptBatchError):
                    key_spans(view, count)
            else:
                assert key_spans(view, count).tolist() == want


@SETTINGS
@given(st.integers(0, 2**32), st.integers(1, 600), st.sampled_from([VALUES, KEYS]))
def test_short_records_are_bounded_by_numpy(seed: int, n: int, layout: dict[str, int]) -> None:
    """Records under 256 bytes with no zero bytes in them (JSON, text keys): numpy
    finds the bounds, so the test above is not passing on the walk alone; with zero
    bytes in the data too, while they leave it a few false starts."""
    rng = random.Random(seed)
    values = [rng.randbytes(rng.randrange(256)).replace(b"\x00", b"a") for _ in range(n)]
    if rng.random() < 0.5:  # a value starting with a zero byte: a false start after it
        values = [b"\x00" + v[:254] if rng.random() < 0.01 else v for v in values]
    keyed = keys_section(list(values), [False] * n)
    section = encode_values(values) if layout is VALUES else keyed
    found = record_bounds(section, n, 0, **layout)
    assert found is not None
    assert found.tolist() == walk(section, n, 0, **layout)


@st.composite
def large_batches(draw: st.DrawFn) -> Batch:
    """A stored batch of BOUNDS_FROM or more events (so numpy bounds its sections):
    JSON and binary values, empty ones, keys or NULL keys, tombstones, headers."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    n = draw(st.integers(BOUNDS_FROM, 3 * BOUNDS_FROM))
    values = random_values(rng, n, draw(st.sampled_from([40, 120, 300])))
    keyed = draw(st.booleans())
    keys = [None if rng.random() < 0.1 else b"cust-%d" % rng.randrange(10**6) for _ in values]
    headers = None
    if draw(st.booleans()):
        headers = [
            [(b"h%d" % k, rng.randbytes(rng.randrange(5))) for k in range(rng.randrange(3))]
            for _ in values
        ]
    stored = build_batch(
        encode_values(values),
        n,
        base_offset=draw(st.integers(0, 1 << 40)),
        first_position=draw(st.integers(0, 1 << 40)),
        timestamp_ms=draw(st.integers(0, 1 << 41)),
        keys=keys if keyed else None,
        tombstones=[rng.random() < 0.05 for _ in values] if keyed else None,
        headers=headers,
    )
    return Batch(memoryview(stored))


@SETTINGS
@given(large_batches(), st.data())
def test_records_of_large_batches_equal_the_events_one_by_one(
    batch: Batch, data: st.DataObject
) -> None:
    start = data.draw(st.integers(0, batch.count - 1))
    stop = data.draw(st.integers(start + 1, batch.count))
    check_records_columns([_Piece(batch, start, stop)])


def test_false_starts_that_add_up_are_refused() -> None:
    """A 300-byte value (its start no candidate) holding one false start whose length
    byte leads exactly to the section's end: as many candidates as records, the first
    at 0 and the last ending at the end, but not a chain: refused, and the walk's
    bounds served instead."""
    hidden = 16 + 100  # where the false start lies: after the empty value and 100 bytes
    length = 8 + 8 + 300 - hidden - 8  # its length byte leads to the end
    values = [b"", b"a" * 100 + bytes([length]) + b"\x00" * 7 + b"a" * 192]
    section = encode_values(values)
    assert record_bounds(section, 2, 0, **VALUES) is None
    assert value_spans(section, 2) == walk(section, 2, 0, **VALUES) == [0, 8, 316]
