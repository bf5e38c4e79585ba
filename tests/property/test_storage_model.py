"""Property tests: a PartitionLog always agrees with a plain in-memory list of events,
and no single corrupted byte of a batch goes unnoticed."""

from __future__ import annotations

import bisect
import os
import shutil
import tempfile
import time
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from headwater.errors import CorruptBatchError, UsageError
from headwater.storage.batch import (
    HEADER_SIZE,
    Batch,
    build_batch,
    encode_batch,
    encode_values,
    iter_batches,
)
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy

# Values are never empty, so "the longest prefix within max_bytes" is unique.
VALUES = st.lists(st.binary(min_size=1, max_size=30), min_size=1, max_size=4)
KEYS = st.one_of(st.none(), st.sampled_from([b"a", b"b", b"c", b""]))
# One append: values, keyed?, key, tombstone?, timestamp.
APPEND = st.tuples(
    VALUES, st.booleans(), KEYS, st.booleans(), st.integers(min_value=0, max_value=200)
)


class LogModel(RuleBasedStateMachine):
    """Appends, reads, rolls, syncs, retention and reopen against a list of events."""

    @initialize(
        policy=st.sampled_from(["none", "fsync", "interval:1000"]),
        segment_bytes=st.sampled_from([160, 300, 700]),
        index_interval_bytes=st.sampled_from([1, 100, 4096]),
        retention_bytes=st.sampled_from([None, 250, 900]),
        segment_ms=st.sampled_from([None, 50]),
    )
    def open_log(
        self,
        policy: str,
        segment_bytes: int,
        index_interval_bytes: int,
        retention_bytes: int | None,
        segment_ms: int | None,
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="hw-model-"))
        self.config = LogConfig(
            segment_bytes=segment_bytes,
            segment_ms=segment_ms,
            index_interval_bytes=index_interval_bytes,
            retention_bytes=retention_bytes,
            delete_retention_ms=100,
            sync=SyncPolicy.parse(policy),
        )
        self.plog = PartitionLog.open(self.dir, self.config)
        # The model: every event appended and not removed by retention or compaction,
        # as (offset, value, key, timestamp, tombstone).
        self.events: list[tuple[int, bytes, bytes | None, int, bool]] = []
        self.compacted = False
        self.start = 0
        self.end = 0
        self.durable = 0

    def teardown(self) -> None:
        plog = getattr(self, "plog", None)
        if plog is not None:
            plog.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # ---- helpers ---------------------------------------------------------------------

    @property
    def committed(self) -> int:
        return self.durable if self.config.sync.kind == "fsync" else self.end

    def visible(self, start: int = 0) -> list[tuple[int, bytes]]:
        return [(e[0], e[1]) for e in self.events if start <= e[0] < self.committed]

    # ---- rules -----------------------------------------------------------------------

    @rule(appends=st.lists(APPEND, min_size=1, max_size=4))
    def append(self, appends: list[tuple[list[bytes], bool, bytes | None, bool, int]]) -> None:
        for values, keyed, key, tombstone, ts in appends:
            self.append_one(values, keyed, key, tombstone, ts)

    @rule(values=VALUES, ts=st.integers(min_value=0, max_value=200))
    def append_plain(self, values: list[bytes], ts: int) -> None:
        self.append_one(values, False, None, False, ts)

    def append_one(
        self, values: list[bytes], keyed: bool, key: bytes | None, tombstone: bool, ts: int
    ) -> None:
        keys = [key] * len(values) if keyed else None
        tombstones = [tombstone] * len(values) if keyed else None
        size = len(
            encode_batch(values, base_offset=0, first_position=0, timestamp_ms=ts, keys=keys)
        )
        if size > self.config.segment_bytes:
            with pytest.raises(UsageError):
                self.plog.append(values, first_position=self.end, timestamp_ms=ts, keys=keys)
            return
        info = self.plog.append(
            values, first_position=self.end, timestamp_ms=ts, keys=keys, tombstones=tombstones
        )
        assert info.base_offset == self.end
        assert info.count == len(values)
        for i, v in enumerate(values):
            self.events.append((self.end + i, v, key if keyed else None, ts, keyed and tombstone))
        self.end += len(values)

    @rule(
        data=st.data(),
        max_bytes=st.integers(min_value=0, max_value=150),
        max_events=st.one_of(st.none(), st.integers(min_value=1, max_value=6)),
    )
    def read(self, data: st.DataObject, max_bytes: int, max_events: int | None) -> None:
        offsets = [o for o, _ in self.visible()]
        start = data.draw(
            st.sampled_from([*offsets, self.end + 2])
            if offsets
            else st.integers(min_value=0, max_value=self.end + 2),
            label="start",
        )
        result = self.plog.read(start, max_bytes, max_events=max_events)
        got = [(e.offset, e.value) for e in result.events()]
        want: list[tuple[int, bytes]] = []
        total = 0
        for off, v in self.visible(start):
            if max_events is not None and len(want) >= max_events:
                break
            if want and total + len(v) > max_bytes:
                break
            want.append((off, v))
            total += len(v)
        assert got == want
        assert result.count == len(want)
        assert result.value_bytes == total
        assert result.first_offset == (want[0][0] if want else None)
        if not self.compacted:
            assert result.end_offset == (want[-1][0] + 1 if want else max(start, self.start))
        chunks = b"".join(bytes(c) for c in result.values_chunks())
        assert chunks == encode_values([v for _, v in want])
        self.check_next_offset(want, result.next_offset)

    def check_next_offset(self, want: list[tuple[int, bytes]], next_offset: int | None) -> None:
        if not want:
            assert next_offset is None
            return
        last = want[-1][0]
        if not self.compacted:
            assert next_offset == (last + 1 if last + 1 < self.committed else None)
            return
        # After compaction offsets have gaps: any offset past the last event returned and
        # not past the next surviving one is right; None only when nothing follows.
        following = [o for o, _ in self.visible(last + 1)]
        if next_offset is None:
            assert following == []
        else:
            assert last < next_offset <= (following[0] if following else self.committed)
            assert next_offset < self.committed

    @rule(data=st.data())
    def events_from(self, data: st.DataObject) -> None:
        start = data.draw(st.integers(min_value=0, max_value=self.end + 1), label="start")
        got = [
            (e.offset, e.value, e.key, e.timestamp_ms, e.tombstone) for e in self.plog.events(start)
        ]
        want = [e for e in self.events if max(start, self.start) <= e[0] < self.committed]
        assert got == want

    @rule(t=st.integers(min_value=0, max_value=210))
    def offset_for_timestamp(self, t: int) -> None:
        want = next((e[0] for e in self.events if e[3] >= t and e[0] < self.committed), None)
        got = self.plog.offset_for_timestamp(t)
        if not self.compacted:
            assert got == want
        elif want is None:
            assert got is None
        else:
            # A compacted batch keeps its base offset even when its first event is gone:
            # reading from the answer must start at the first event at or after t.
            assert got is not None and got <= want
            assert next(self.plog.events(got)).offset == want

    @rule()
    def roll(self) -> None:
        self.plog.roll()

    @rule()
    def sync(self) -> None:
        assert self.plog.sync() == self.end
        self.durable = self.end

    @precondition(lambda self: self.config.retention_bytes is not None)
    @rule()
    def enforce_retention(self) -> None:
        old_bases = [s.base_offset for s in self.plog.segments]
        removed = self.plog.enforce_retention()
        new_bases = [s.base_offset for s in self.plog.segments]
        assert new_bases == old_bases[removed:]
        assert len(new_bases) >= 1  # the active segment always stays
        if removed and self.config.sync.kind == "fsync":
            # Only durable segments go: what is not yet acknowledged is never dropped.
            assert self.plog.start_offset <= self.durable
        limit = self.config.retention_bytes
        assert limit is not None
        if len(new_bases) > 1 and self.plog.size_bytes > limit:
            # Stopped while still over the limit: only because the oldest segment is
            # not durable yet under the fsync policy.
            assert self.config.sync.kind == "fsync"
            assert self.plog.segments[0].next_offset > self.durable
        self.start = self.plog.start_offset
        self.events = [e for e in self.events if e[0] >= self.start]

    @precondition(lambda self: len(self.plog.segments) > 1)
    @rule(data=st.data())
    def backdate_a_segment(self, data: st.DataObject) -> None:
        """A sealed segment last written up to 400 ms ago (its tombstones' age)."""
        segment = data.draw(st.sampled_from(self.plog.segments[:-1]))
        written = (time.time_ns() // 1_000_000 - data.draw(st.integers(0, 400))) * 1_000_000
        os.utime(segment.log_path, ns=(written, written))

    @precondition(lambda self: self.committed == self.end)
    @rule(ahead=st.integers(min_value=-200, max_value=200))
    def compact(self, ahead: int) -> None:
        now = time.time_ns() // 1_000_000 + ahead
        segments = self.plog.segments
        active_base = segments[-1].base_offset
        written = {s.base_offset: s.log_path.stat().st_mtime_ns // 1_000_000 for s in segments}
        bases = sorted(written)

        def tombstone_due(offset: int) -> bool:
            """Its segment was last written delete_retention_ms before ``now``."""
            base = bases[bisect.bisect_right(bases, offset) - 1]
            return written[base] < now - self.config.delete_retention_ms

        latest = {e[2]: e[0] for e in self.events if e[2] is not None}
        before = len(self.events)
        self.events = [
            e
            for e in self.events
            if e[0] >= active_base
            or ((e[2] is None or latest[e[2]] == e[0]) and not (e[4] and tombstone_due(e[0])))
        ]
        result = self.plog.compact(now_ms=now)
        assert result.events_removed == before - len(self.events)
        self.compacted = self.compacted or result.events_removed > 0

    @rule()
    def reopen(self) -> None:
        self.plog.close()
        self.plog = PartitionLog.open(self.dir, self.config)
        self.durable = self.end

    # ---- invariants ------------------------------------------------------------------

    @invariant()
    def paging_reads_everything_once(self) -> None:
        if not hasattr(self, "plog"):
            return
        want = self.visible()
        got: list[tuple[int, bytes]] = []
        offset: int | None = 0
        while offset is not None:
            result = self.plog.read(offset, max_bytes=45)
            page = [(e.offset, e.value) for e in result.events()]
            self.check_next_offset(page, result.next_offset)
            got += page
            offset = result.next_offset
            assert len(got) <= len(want)
        assert got == want

    @invariant()
    def offsets_agree(self) -> None:
        if not hasattr(self, "plog"):
            return
        assert self.plog.end_offset == self.end
        assert self.plog.start_offset == self.start
        assert self.plog.committed_offset == self.committed
        assert self.start <= self.plog.active.base_offset <= self.end
        offsets = [e[0] for e in self.events]
        assert offsets == sorted(set(offsets))
        assert all(self.start <= o < self.end for o in offsets)
        if not self.compacted:
            assert offsets == list(range(self.start, self.end))


TestLogModel = LogModel.TestCase
TestLogModel.settings = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---- single-byte corruption ----------------------------------------------------------

HEADERS = st.lists(st.tuples(st.binary(max_size=6), st.binary(max_size=6)), min_size=0, max_size=2)


@st.composite
def batches(draw: st.DrawFn) -> bytes:
    values = draw(st.lists(st.binary(max_size=30), min_size=1, max_size=6))
    n = len(values)
    keys = draw(st.one_of(st.none(), st.lists(KEYS, min_size=n, max_size=n)))
    tombstones = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n)))
    headers = draw(st.one_of(st.none(), st.lists(HEADERS, min_size=n, max_size=n)))
    deltas = None
    if draw(st.booleans()):
        gaps = draw(st.lists(st.integers(min_value=1, max_value=5), min_size=n - 1, max_size=n - 1))
        deltas = [0]
        for gap in gaps:
            deltas.append(deltas[-1] + gap)
    producer = draw(st.one_of(st.none(), st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 99))))
    return build_batch(
        encode_values(values),
        n,
        base_offset=draw(st.integers(min_value=0, max_value=2**40)),
        first_position=draw(st.integers(min_value=0, max_value=2**40)),
        timestamp_ms=draw(st.integers(min_value=-(2**40), max_value=2**40)),
        keys=keys,
        tombstones=tombstones,
        headers=headers,
        deltas=deltas,
        producer=producer,
    )


@settings(max_examples=200, deadline=None)
@given(
    data=batches(),
    where=st.floats(min_value=0, max_value=1, exclude_max=True),
    xor=st.integers(1, 255),
)
def test_any_single_corrupted_byte_is_detected(data: bytes, where: float, xor: int) -> None:
    Batch(memoryview(data))  # the intact batch checks out
    pos = int(where * len(data))
    damaged = bytearray(data)
    damaged[pos] ^= xor
    with pytest.raises(CorruptBatchError):
        Batch(memoryview(bytes(damaged)))


@settings(max_examples=100, deadline=None)
@given(data=batches())
def test_batch_round_trip_is_stable(data: bytes) -> None:
    batch = Batch(memoryview(data))
    events = list(batch.events())
    assert len(events) == batch.count
    assert [e.offset for e in events] == batch.offsets()
    assert events[-1].offset == batch.last_offset
    # Re-encoding the decoded events gives back the same bytes.
    again = build_batch(
        encode_values([e.value for e in events]),
        batch.count,
        base_offset=batch.base_offset,
        first_position=batch.first_position,
        timestamp_ms=batch.first_timestamp_ms,
        max_timestamp_ms=batch.max_timestamp_ms,
        keys=[e.key for e in events] if batch.attributes & 0x01 else None,
        tombstones=[e.tombstone for e in events] if batch.attributes & 0x01 else None,
        headers=[e.headers for e in events] if batch.attributes & 0x02 else None,
        deltas=[o - batch.base_offset for o in batch.offsets()] if not batch.dense else None,
        producer=batch.producer,
    )
    assert again == data


# ---- torn tails ----------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    appends=st.lists(VALUES, min_size=1, max_size=8),
    where=st.floats(min_value=0, max_value=1),
)
def test_reopen_after_torn_tail_keeps_exactly_the_whole_batches(
    appends: list[list[bytes]], where: float
) -> None:
    directory = Path(tempfile.mkdtemp(prefix="hw-tear-"))
    try:
        config = LogConfig(sync=SyncPolicy("none"))
        plog = PartitionLog.open(directory, config)
        ends = []  # (file size, next offset) after each append
        for values in appends:
            info = plog.append(values, first_position=0, timestamp_ms=0)
            ends.append((plog.size_bytes, info.next_offset))
        full = [(e.offset, e.value) for e in plog.events()]
        size = plog.size_bytes
        plog.close()
        cut = int(where * size)
        (log_file,) = directory.glob("*.log")
        with open(log_file, "r+b") as f:
            f.truncate(cut)
        keep = max((n for s, n in ends if s <= cut), default=0)
        plog = PartitionLog.open(directory, config)
        assert plog.end_offset == keep
        assert [(e.offset, e.value) for e in plog.events()] == full[:keep]
        plog.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ---- damage in sealed segments is never served silently ------------------------------


def read_all(plog: PartitionLog) -> list[tuple[int, bytes]]:
    got: list[tuple[int, bytes]] = []
    offset: int | None = 0
    while offset is not None:
        result = plog.read(offset, max_bytes=100)
        got += [(e.offset, e.value) for e in result.events()]
        offset = result.next_offset
    return got


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    appends=st.lists(VALUES, min_size=2, max_size=10),
    where=st.floats(min_value=0, max_value=1, exclude_max=True),
    header_byte=st.one_of(st.none(), st.integers(min_value=0, max_value=HEADER_SIZE - 1)),
    xor=st.integers(min_value=1, max_value=255),
    interval=st.sampled_from([1, 4096]),
)
def test_a_flipped_byte_in_a_sealed_segment_is_never_served_silently(
    appends: list[list[bytes]], where: float, header_byte: int | None, xor: int, interval: int
) -> None:
    """Damage anywhere in a sealed segment (``where`` picks a byte of the sealed data, or
    with ``header_byte`` that byte of the header of the batch ``where`` falls in)."""
    directory = Path(tempfile.mkdtemp(prefix="hw-flip-"))
    try:
        config = LogConfig(
            segment_bytes=400, index_interval_bytes=interval, sync=SyncPolicy("none")
        )
        plog = PartitionLog.open(directory, config)
        for values in appends:
            plog.append(values, first_position=0, timestamp_ms=0)
        plog.roll()
        plog.append([b"active"], first_position=0, timestamp_ms=0)
        full = [(e.offset, e.value) for e in plog.events()]
        sealed = [seg.log_path for seg in plog.segments[:-1]]
        plog.close()
        # (file, batch start, batch length) of every sealed batch, in log order.
        spans = []
        for path in sealed:
            pos = 0
            for batch in iter_batches(memoryview(path.read_bytes())):
                spans.append((path, pos, batch.length))
                pos += batch.length
        total = sum(length for _, _, length in spans)
        target = int(where * total)
        for path, start, length in spans:
            if target < length:
                at = start + (target if header_byte is None else header_byte)
                raw = bytearray(path.read_bytes())
                raw[at] ^= xor
                path.write_bytes(bytes(raw))
                break
            target -= length
        plog = PartitionLog.open(directory, config)
        # Either the damage is reported, or what comes back is exactly what was written:
        # never a silent gap, never altered bytes.
        for reader in (
            lambda: [(e.offset, e.value) for e in plog.events()],
            lambda: read_all(plog),
        ):
            try:
                got = reader()
            except CorruptBatchError:
                continue
            assert got == full
        plog.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
