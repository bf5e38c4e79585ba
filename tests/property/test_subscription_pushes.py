"""Cutting a subscription's read into wire pushes (engine.subscriptions.split_pushes, the
batch-at-a-time version): for random event sizes, stored batches with and without offset
gaps (compaction), reads starting and ending inside batches, and limits small and as the
protocol has them, the pushes cover exactly the read, in order; each holds at most
``max_events`` events and ``max_bytes`` bytes of values (unless it is one larger event),
each is a run of consecutive offsets; and they equal what the former per-event loop cut.
``plan_pushes`` gives each push the exact credit balance after it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from headwater.engine.subscriptions import (
    PUSH_MAX_BYTES,
    PUSH_MAX_EVENTS,
    plan_pushes,
    split_pushes,
)
from headwater.storage.batch import Batch, build_batch, encode_values, value_spans
from headwater.storage.log import ReadResult, ReadSpan

EXAMPLES = settings(max_examples=300, deadline=None)


def per_event_split(
    result: ReadResult, max_events: int, max_bytes: int
) -> Iterator[tuple[int, int, list[memoryview]]]:
    """The former algorithm, one Python step per event (the reference)."""
    first = -1
    count = size = 0
    chunks: list[memoryview] = []
    for span in result.spans:
        batch = span.batch
        section = batch.values_section()
        bounds = batch.value_bounds()
        offsets = batch.offsets()
        i = span.start
        while i < span.stop:
            start = i
            while i < span.stop:
                n = bounds[i + 1] - bounds[i] - 8
                contiguous = count == 0 or offsets[i] == first + count
                if count and (count == max_events or size + n > max_bytes or not contiguous):
                    break
                if count == 0:
                    first = offsets[i]
                count += 1
                size += n
                i += 1
            if i > start:
                chunks.append(section[bounds[start] : bounds[i]])
            if i < span.stop or count == max_events:
                yield first, count, chunks
                first, count, size, chunks = -1, 0, 0, []
    if count:
        yield first, count, chunks


@dataclass(frozen=True)
class StoredBatch:
    sizes: list[int]
    gaps: list[int] | None  # extra offset gap before each event after the first: sparse
    gap_before: int  # offsets skipped between the previous batch and this one


small_size = st.integers(0, 300)
big_size = st.sampled_from([200_000, 600_000, PUSH_MAX_BYTES - 1, PUSH_MAX_BYTES, 1_100_000])


@st.composite
def stored_batches(draw: st.DrawFn, big: bool) -> StoredBatch:
    n = draw(st.integers(1, 150))
    if draw(st.booleans()):  # one size: the strided fast path
        sizes = [draw(small_size)] * n
    else:
        element = st.one_of(small_size, big_size) if big else small_size
        sizes = draw(st.lists(element, min_size=n, max_size=n))
    if big:  # keep the examples' memory modest
        sizes = sizes[: max(1, 8 if any(s > 1000 for s in sizes) else n)]
    gaps = None
    if draw(st.integers(0, 3)) == 0:
        gaps = draw(
            st.lists(
                st.sampled_from([0, 0, 0, 1, 3]), min_size=len(sizes) - 1, max_size=len(sizes) - 1
            )
        )
    return StoredBatch(sizes, gaps, draw(st.sampled_from([0, 0, 0, 1, 5])))


@st.composite
def reads(draw: st.DrawFn) -> tuple[ReadResult, int, int]:
    protocol_limits = draw(st.booleans())
    if protocol_limits:
        max_events, max_bytes = PUSH_MAX_EVENTS, PUSH_MAX_BYTES
    else:
        max_events, max_bytes = draw(st.integers(1, 70)), draw(st.integers(1, 4000))
    specs = draw(st.lists(stored_batches(protocol_limits), min_size=1, max_size=5))
    batches: list[Batch] = []
    offset = draw(st.integers(0, 1000))
    for spec in specs:
        offset += spec.gap_before
        values = [bytes([65 + (i % 26)]) * size for i, size in enumerate(spec.sizes)]
        deltas = None
        if spec.gaps is not None:
            deltas = [0]
            for gap in spec.gaps:
                deltas.append(deltas[-1] + 1 + gap)
        data = build_batch(
            encode_values(values),
            len(values),
            base_offset=offset,
            first_position=offset,
            timestamp_ms=0,
            deltas=deltas,
        )
        batch = Batch(memoryview(data))
        batches.append(batch)
        offset = batch.next_offset
    spans: list[ReadSpan] = []
    for k, batch in enumerate(batches):
        # A read may start and end inside a batch; log reads cut spans by records.
        start = draw(st.integers(0, batch.count - 1)) if k == 0 else 0
        stop = draw(st.integers(start + 1, batch.count)) if k == len(batches) - 1 else batch.count
        records = None
        if start > 0 or stop < batch.count or draw(st.booleans()):
            bounds = batch.value_bounds()
            records = (bounds[start], bounds[stop])
        spans.append(ReadSpan(batch, start, stop, records))
    count = sum(s.stop - s.start for s in spans)
    value_bytes = sum(len(s.values_chunk()) - 8 * (s.stop - s.start) for s in spans)
    last = spans[-1]
    end = last.batch.offsets()[last.stop - 1] + 1
    return ReadResult(spans, count, value_bytes, end, end), max_events, max_bytes


def _as_bytes(
    pushes: list[tuple[int, int, list[memoryview]]] | Iterator[tuple[int, int, list[memoryview]]],
) -> list[tuple[int, int, list[bytes]]]:
    return [(first, count, [bytes(c) for c in chunks]) for first, count, chunks in pushes]


@EXAMPLES
@given(reads())
def test_pushes_cover_the_read_within_limits_and_equal_the_per_event_cut(
    case: tuple[ReadResult, int, int],
) -> None:
    result, max_events, max_bytes = case
    pushes = split_pushes(result, max_events, max_bytes)
    assert _as_bytes(pushes) == _as_bytes(per_event_split(result, max_events, max_bytes))
    # Exactly the read, in order: the same records, the same offsets.
    read_offsets = [o for s in result.spans for o in s.batch.offsets()[s.start : s.stop]]
    read_bytes = b"".join(bytes(s.values_chunk()) for s in result.spans)
    assert b"".join(bytes(c) for _, _, chunks in pushes for c in chunks) == read_bytes
    assert sum(count for _, count, _ in pushes) == result.count == len(read_offsets)
    taken = 0
    for first, count, chunks in pushes:
        assert 1 <= count <= max_events
        # A run of consecutive offsets starting at ``first``.
        assert read_offsets[taken : taken + count] == list(range(first, first + count))
        data = b"".join(bytes(c) for c in chunks)
        bounds = value_spans(data, count)
        value_bytes = len(data) - 8 * count
        assert value_bytes <= max_bytes or count == 1, (count, value_bytes)
        assert len(bounds) == count + 1
        taken += count


@EXAMPLES
@given(reads(), st.integers(0, 1 << 20))
def test_each_push_carries_the_exact_credit_balance_after_it(
    case: tuple[ReadResult, int, int], spare: int
) -> None:
    result, _, _ = case
    credits = result.count + spare
    pushes = plan_pushes(result, credits)
    assert [(p.first_offset, p.event_count, p.chunks) for p in pushes] == split_pushes(
        result, PUSH_MAX_EVENTS, PUSH_MAX_BYTES
    )
    balance = credits
    for push in pushes:
        balance -= push.event_count
        assert push.credits_remaining == balance
    assert balance == spare
