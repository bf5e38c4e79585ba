"""A read whose answer carries no offsets (Kimberlite's ReadEvents: the client counts
them from ``from_offset``) over a log with holes: compaction's (inside batches and
between them), aborted transactions' batches and transaction markers. For random logs and
reads, ``PartitionLog.read(..., contiguous=True)`` answers exactly the events at
``from_offset, from_offset + 1, ...`` as a read_committed reader sees them, at least one
when one is at ``from_offset``; from inside a hole, no events and ``next_offset`` the
first offset present after it; and paging by ``next_offset`` from 0 visits every visible
event exactly once, in order."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from headwater.storage.batch import encode_values, marker_value
from headwater.storage.log import LogConfig, PartitionLog, ReadResult, SyncPolicy

KEYS = [b"a", b"b", b"c", b"d", None]

# (kind, values' sizes, key indexes): a plain append, a committed or an aborted
# transaction's batch (then its marker), or a segment roll.
APPENDS = st.one_of(
    st.tuples(
        st.sampled_from(["plain", "commit", "abort"]),
        st.lists(st.tuples(st.integers(0, 40), st.integers(0, len(KEYS) - 1)), min_size=1),
    ),
    st.just(("roll", [])),
)
READS = st.lists(st.tuples(st.integers(0, 80), st.integers(0, 300), st.integers(1, 6)), max_size=8)


@contextmanager
def log_of(
    appends: list[tuple[str, list[tuple[int, int]]]], compacted: bool
) -> Iterator[PartitionLog]:
    directory = Path(tempfile.mkdtemp(prefix="hw-holes-"))
    config = LogConfig(sync=SyncPolicy("none"), segment_bytes=1 << 20, cleanup_policy="compact")
    plog = PartitionLog.open(directory, config)
    try:
        producer_id = 100
        for kind, events in appends:
            if kind == "roll":
                plog.roll()
                continue
            values = [b"%d:" % plog.end_offset + b"v" * size for size, _ in events]
            keys = [KEYS[k] for _, k in events]
            if kind == "plain":
                plog.append(values, first_position=0, timestamp_ms=0, keys=keys)
                continue
            producer_id += 1  # a producer per transaction: each one's first sequence is 0
            plog.append(
                values,
                first_position=0,
                timestamp_ms=0,
                keys=keys,
                producer=(producer_id, 0),
                producer_epoch=0,
                transactional=True,
            )
            plog.append(
                [marker_value(kind == "commit")],
                first_position=0,
                timestamp_ms=0,
                producer=(producer_id, 0),
                producer_epoch=0,
                transactional=True,
                control=True,
            )
        plog.roll()  # compaction rewrites sealed segments only
        if compacted:
            plog.compact(now_ms=0)
        yield plog
    finally:
        plog.close()
        shutil.rmtree(directory, ignore_errors=True)


def visible(plog: PartitionLog) -> list[tuple[int, bytes]]:
    """What a read_committed reader sees, each event with its stored offset."""
    return [
        (event.offset, event.value)
        for batch in plog.batches(0, committed_only=True)
        for event in batch.events()
    ]


def answered(result: ReadResult, from_offset: int) -> list[tuple[int, bytes]]:
    """The answer as the client labels it: offsets counted from ``from_offset``."""
    values = [event.value for event in result.events()]
    # The bytes sent are the spans' chunks: the same values, in stored form.
    assert b"".join(bytes(c) for c in result.values_chunks()) == encode_values(values)
    return [(from_offset + i, value) for i, value in enumerate(values)]


@settings(max_examples=150, deadline=None)
@given(appends=st.lists(APPENDS, min_size=1, max_size=12), reads=READS, compacted=st.booleans())
def test_contiguous_reads_over_holes(
    appends: list[tuple[str, list[tuple[int, int]]]],
    reads: list[tuple[int, int, int]],
    compacted: bool,
) -> None:
    with log_of(appends, compacted) as plog:
        present = visible(plog)
        by_offset = dict(present)
        end = plog.last_stable_offset
        for from_offset, max_bytes, max_events in reads:
            result = plog.read(from_offset, max_bytes, max_events=max_events, contiguous=True)
            got = answered(result, from_offset)
            # Labelled by counting, every event is the one stored at that offset.
            assert all(by_offset.get(offset) == value for offset, value in got)
            assert len(got) <= max_events
            after = [offset for offset, _ in present if offset >= from_offset]
            if from_offset in by_offset:
                assert got, "an event at from_offset is always answered"
            if got:
                last = got[-1][0]
                assert result.next_offset == (None if last + 1 >= end else last + 1)
            else:  # in a hole (or at the end): on to the first offset present after it
                assert result.next_offset == (after[0] if after else None)
        # Paging as a client does visits every visible event once, in order.
        seen: list[tuple[int, bytes]] = []
        offset: int | None = 0
        pages = 0
        while offset is not None:
            result = plog.read(offset, 60, max_events=5, contiguous=True)
            seen += answered(result, offset)
            assert result.next_offset is None or result.next_offset > offset
            offset = result.next_offset
            pages += 1
            assert pages <= 2 * end + 2
        assert seen == present


@settings(max_examples=100, deadline=None)
@given(appends=st.lists(APPENDS, min_size=1, max_size=12), reads=READS)
def test_reads_that_carry_offsets_are_unchanged(
    appends: list[tuple[str, list[tuple[int, int]]]], reads: list[tuple[int, int, int]]
) -> None:
    """Without ``contiguous`` (readers that get each event's offset: the HTTP API,
    Rivven, subscriptions) a read still passes holes within one answer."""
    with log_of(appends, compacted=True) as plog:
        present = visible(plog)
        for from_offset, max_bytes, max_events in reads:
            result = plog.read(from_offset, max_bytes, max_events=max_events)
            got = [(event.offset, event.value) for event in result.events()]
            after = [item for item in present if item[0] >= from_offset]
            assert got == after[: len(got)]
            if after:
                assert got
