"""Retention, compaction, sync policies and the offline checker."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from headwater.errors import OffsetRemoved
from headwater.storage.batch import Batch, encode_values
from headwater.storage.check import check_data_dir, check_partition, partition_dirs
from headwater.storage.log import CompactionResult, LogConfig, PartitionLog, SyncPolicy
from headwater.storage.segment import segment_name
from rewrites import HeldRewrite, SeenLock

NONE = SyncPolicy("none")
FSYNC = SyncPolicy("fsync")

# One 50-byte value per batch: 64 + 8 + 50 = 122 bytes; two batches per 300-byte segment.
BATCH = 122


def open_log(path: Path, **config: object) -> PartitionLog:
    config.setdefault("sync", NONE)
    config.setdefault("segment_bytes", 300)
    return PartitionLog.open(path, LogConfig(**config))  # type: ignore[arg-type]


def value(i: int) -> bytes:
    return b"%06d" % i + b"." * 44


def fill(plog: PartitionLog, n: int, ts: int | list[int] = 0) -> None:
    for i in range(n):
        stamp = ts[i] if isinstance(ts, list) else ts
        plog.append([value(plog.end_offset)], first_position=0, timestamp_ms=stamp)


def offsets(plog: PartitionLog, start: int = 0) -> list[int]:
    return [e.offset for e in plog.events(start)]


def bases(plog: PartitionLog) -> list[int]:
    return [s.base_offset for s in plog.segments]


# ---- retention -----------------------------------------------------------------------


def test_retention_by_size_removes_oldest_whole_sealed_segments(tmp_path: Path) -> None:
    plog = open_log(tmp_path, retention_bytes=5 * BATCH)
    fill(plog, 11)  # segments [0,1] [2,3] [4,5] [6,7] [8,9] [10]
    assert bases(plog) == [0, 2, 4, 6, 8, 10]
    assert plog.size_bytes == 11 * BATCH
    removed = plog.enforce_retention()
    # Drop whole segments, oldest first, until the total fits: 11 -> 9 -> 7 -> 5 batches.
    assert removed == 3
    assert bases(plog) == [6, 8, 10]
    assert plog.start_offset == 6
    assert plog.size_bytes == 5 * BATCH
    assert offsets(plog) == list(range(6, 11))
    assert [e.offset for e in plog.read(0).events()] == list(range(6, 11))  # clamped
    for gone in (0, 2, 4):
        for suffix in (".log", ".index", ".timeindex"):
            assert not (tmp_path / segment_name(gone, suffix)).exists()
    assert plog.enforce_retention() == 0  # already within the limit
    plog.close()
    plog = open_log(tmp_path, retention_bytes=5 * BATCH)
    assert (plog.start_offset, plog.end_offset) == (6, 11)
    assert offsets(plog) == list(range(6, 11))
    plog.close()


def test_a_strict_read_of_a_removed_offset_is_refused_not_answered_from_the_start(
    tmp_path: Path,
) -> None:
    plog = open_log(tmp_path, retention_bytes=5 * BATCH)
    fill(plog, 11)
    assert plog.enforce_retention() == 3
    for contiguous in (False, True):
        with pytest.raises(OffsetRemoved, match="offset 4 was removed by retention") as refused:
            plog.read(4, strict=True, contiguous=contiguous)
        assert (refused.value.offset, refused.value.start) == (4, 6)
    assert [e.offset for e in plog.read(6, strict=True).events()] == list(range(6, 11))
    plog.close()


def test_retention_never_removes_the_active_segment(tmp_path: Path) -> None:
    plog = open_log(tmp_path, retention_bytes=0, retention_ms=0)
    fill(plog, 5, ts=0)
    assert plog.enforce_retention(now_ms=10**9) == 2
    assert bases(plog) == [4]
    assert offsets(plog) == [4]
    assert plog.start_offset == 4
    # Appends go on at the right offsets.
    fill(plog, 1)
    assert offsets(plog) == [4, 5]
    plog.close()


def test_retention_leaves_the_active_segment_even_right_after_a_roll(tmp_path: Path) -> None:
    plog = open_log(tmp_path, retention_bytes=0)
    fill(plog, 2)
    plog.roll()
    assert plog.enforce_retention() == 1
    assert bases(plog) == [2]
    assert (plog.start_offset, plog.end_offset) == (2, 2)
    assert plog.read(0).count == 0
    plog.close()
    plog = open_log(tmp_path)
    assert (plog.start_offset, plog.end_offset) == (2, 2)
    plog.close()


def test_retention_by_age_removes_only_an_expired_prefix(tmp_path: Path) -> None:
    plog = open_log(tmp_path, retention_ms=1000)
    # Segments: [0,1] ts 100,200 | [2,3] ts 900,5000 | [4,5] ts 300,400 | [6] ts 6000
    fill(plog, 7, ts=[100, 200, 900, 5000, 300, 400, 6000])
    assert bases(plog) == [0, 2, 4, 6]
    assert plog.enforce_retention(now_ms=1200) == 0  # newest of [0,1] is 200: not > 1000 old
    assert plog.enforce_retention(now_ms=1201) == 1
    assert plog.start_offset == 2
    # [2,3] is kept for its 5000 event, and the older [4,5] behind it stays too.
    assert plog.enforce_retention(now_ms=5500) == 0
    assert plog.enforce_retention(now_ms=6001) == 2
    assert bases(plog) == [6]
    assert offsets(plog) == [6]
    plog.close()


def test_retention_waits_for_durability_under_fsync(tmp_path: Path) -> None:
    plog = open_log(tmp_path, sync=FSYNC, retention_bytes=0)
    fill(plog, 5)
    assert plog.committed_offset == 0
    assert plog.enforce_retention() == 0  # nothing is durable yet
    assert bases(plog) == [0, 2, 4]
    plog.sync()
    assert plog.enforce_retention() == 2
    assert plog.start_offset == 4
    plog.close()


def test_no_retention_limits_keep_everything(tmp_path: Path) -> None:
    plog = open_log(tmp_path)
    fill(plog, 7, ts=0)
    assert plog.enforce_retention(now_ms=10**12) == 0
    assert offsets(plog) == list(range(7))
    plog.close()


# ---- compaction ----------------------------------------------------------------------


def compact_log(path: Path, **config: object) -> PartitionLog:
    config.setdefault("cleanup_policy", "compact")
    config.setdefault("segment_bytes", 10_000)
    config.setdefault("delete_retention_ms", 1000)
    return open_log(path, **config)


def put(
    plog: PartitionLog,
    key: bytes | None,
    val: bytes,
    ts: int = 0,
    tombstone: bool = False,
) -> int:
    info = plog.append([val], first_position=0, timestamp_ms=ts, keys=[key], tombstones=[tombstone])
    return info.base_offset


def snapshot(plog: PartitionLog) -> list[tuple[int, bytes | None, bytes, bool]]:
    return [(e.offset, e.key, e.value, e.tombstone) for e in plog.events()]


def lay_out(plog: PartitionLog, *segments: list[tuple[bytes | None, bytes]]) -> None:
    """Each of ``segments`` (its events' keys and values) put in a segment of its own;
    the last one stays active."""
    for i, events in enumerate(segments):
        if i:
            plog.roll()
        for key, val in events:
            put(plog, key, val)


def test_compaction_keeps_latest_value_per_key_and_keyless_events(tmp_path: Path) -> None:
    plog = compact_log(tmp_path)
    put(plog, b"a", b"a1")  # 0
    put(plog, b"b", b"b1")  # 1
    put(plog, None, b"n1")  # 2
    put(plog, b"a", b"a2")  # 3
    plog.roll()
    put(plog, b"c", b"c1")  # 4
    put(plog, b"b", b"b2")  # 5
    put(plog, None, b"n2")  # 6
    plog.roll()
    put(plog, b"a", b"a3")  # 7  active
    put(plog, b"a", b"a4")  # 8  active: superseded, but the active segment is untouched
    result = plog.compact(now_ms=0)
    assert result.segments_rewritten == 1  # only the first segment lost events
    assert result.events_removed == 3  # a1, b1, a2
    assert result.bytes_after < result.bytes_before
    expected = [
        (2, None, b"n1", False),
        (4, b"c", b"c1", False),
        (5, b"b", b"b2", False),
        (6, None, b"n2", False),
        (7, b"a", b"a3", False),
        (8, b"a", b"a4", False),
    ]
    assert snapshot(plog) == expected
    assert bases(plog) == [0, 4, 7]
    assert plog.end_offset == 9
    # Offsets of survivors are preserved, so reads from any offset find them.
    assert [e.offset for e in plog.events(3)] == [4, 5, 6, 7, 8]
    assert [e.offset for e in plog.read(0, max_events=2).events()] == [2, 4]
    assert plog.read(0, max_events=2).next_offset == 5
    # Compacting again finds nothing more in the sealed segments.
    assert plog.compact(now_ms=0).events_removed == 0
    plog.close()
    plog = compact_log(tmp_path)
    assert snapshot(plog) == expected
    info = plog.append([b"z"], first_position=0, timestamp_ms=0)
    assert info.base_offset == 9
    plog.close()
    assert not check_partition(tmp_path).damaged


def test_compaction_within_one_batch_keeps_sparse_offsets(tmp_path: Path) -> None:
    plog = compact_log(tmp_path)
    plog.append(
        [b"a1", b"x", b"b1", b"a2", b"y"],
        first_position=100,
        timestamp_ms=0,
        keys=[b"a", None, b"b", b"a", None],
    )
    plog.append([b"b2"], first_position=105, timestamp_ms=0, keys=[b"b"])
    plog.roll()
    plog.append([b"tail"], first_position=106, timestamp_ms=0)
    plog.compact(now_ms=0)
    events = list(plog.events())
    assert [(e.offset, e.value) for e in events] == [
        (1, b"x"),
        (3, b"a2"),
        (4, b"y"),
        (5, b"b2"),
        (6, b"tail"),
    ]
    # Positions keep following offsets.
    assert [e.position for e in events] == [101, 103, 104, 105, 106]
    # Reads that start in a gap or cut a sparse batch.
    assert [e.offset for e in plog.read(2, max_events=1).events()] == [3]
    result = plog.read(0, max_bytes=1)
    assert [e.offset for e in result.events()] == [1]
    assert result.next_offset == 3
    assert [e.offset for e in plog.read(3, max_bytes=3).events()] == [3, 4]
    plog.close()


def written_at(plog: PartitionLog, segment: int, ms: int) -> None:
    """Backdate the ``segment``-th segment's last write to ``ms``."""
    path = plog.segments[segment].log_path
    os.utime(path, ns=(ms * 1_000_000, ms * 1_000_000))


def test_compaction_drops_tombstones_their_segment_has_held_delete_retention_ms(
    tmp_path: Path,
) -> None:
    """A tombstone goes once it has been in the log delete_retention_ms: its segment was
    last written before that. The producer's timestamp does not count: a tombstone
    carrying a CreateTime two days old (a mirror, a backfill) was dropped at the first
    compaction, and a consumer behind it never saw the delete."""
    now = int(time.time() * 1000)
    plog = compact_log(tmp_path, delete_retention_ms=1000)
    put(plog, b"old", b"v")  # 0
    put(plog, b"old", b"", tombstone=True)  # 1: tombstone, in the log long enough
    put(plog, b"back", b"", tombstone=True)  # 2: tombstone ...
    put(plog, b"back", b"again")  # 3: ... then a newer value
    plog.roll()
    put(plog, b"new", b"v")  # 4
    put(plog, b"new", b"", ts=now - 2 * 86_400_000, tombstone=True)  # 5: old CreateTime
    plog.roll()
    put(plog, b"other", b"o")  # 6 active
    written_at(plog, 0, now - 5000)
    plog.compact(now_ms=now)
    assert snapshot(plog) == [
        (3, b"back", b"again", False),
        (5, b"new", b"", True),  # written just now: a lagging reader still sees it
        (6, b"other", b"o", False),
    ]
    # The rewrite kept the segment's time: compacting again does not restart its wait.
    assert plog.segments[0].log_path.stat().st_mtime_ns // 1_000_000 == now - 5000
    # Once its segment has been written delete_retention_ms ago the tombstone goes too.
    plog.compact(now_ms=now + 2000)
    assert snapshot(plog) == [(3, b"back", b"again", False), (6, b"other", b"o", False)]
    plog.close()


def test_compaction_never_touches_the_active_segment(tmp_path: Path) -> None:
    plog = compact_log(tmp_path)
    put(plog, b"a", b"1")
    put(plog, b"a", b"2")
    put(plog, b"a", b"", tombstone=True)
    active_size = plog.active.size
    result = plog.compact(now_ms=10**9)
    assert result.segments_rewritten == 0
    assert snapshot(plog) == [(0, b"a", b"1", False), (1, b"a", b"2", False), (2, b"a", b"", True)]
    assert plog.active.size == active_size
    plog.close()


def test_compaction_that_empties_a_segment(tmp_path: Path) -> None:
    plog = compact_log(tmp_path)
    put(plog, b"a", b"1")
    put(plog, b"b", b"1")
    plog.roll()
    put(plog, b"a", b"2")
    put(plog, b"b", b"2")
    plog.roll()
    put(plog, None, b"active")
    plog.compact(now_ms=0)
    assert [(e.offset, e.value) for e in plog.events()] == [(2, b"2"), (3, b"2"), (4, b"active")]
    assert plog.end_offset == 5
    plog.close()
    plog = compact_log(tmp_path)
    assert [(e.offset, e.value) for e in plog.events()] == [(2, b"2"), (3, b"2"), (4, b"active")]
    assert plog.append([b"x"], first_position=0, timestamp_ms=0).base_offset == 5
    plog.close()


def test_segments_compaction_empties_are_removed_but_the_first(tmp_path: Path) -> None:
    """Five keys written over and over: each sealed segment but the last ends up empty.
    They were kept (an empty .log and two indexes each, for ever); now only the first
    stays, as the log's start, and reads find the same events."""
    plog = compact_log(tmp_path)
    lay_out(plog, *[[(b"k%d" % k, b"v%d" % r) for k in range(5)] for r in range(10)])
    result = plog.compact(now_ms=0)
    assert (result.segments_rewritten, result.segments_removed) == (9, 8)
    assert [s.base_offset for s in plog.segments] == [0, 45]
    assert sorted(p.name for p in tmp_path.glob("*.log")) == [
        segment_name(0, ".log"),
        segment_name(45, ".log"),
    ]
    latest = [(45 + k, b"k%d" % k, b"v9", False) for k in range(5)]
    assert snapshot(plog) == latest and plog.start_offset == 0
    # From inside the holes, a read goes on at the next event.
    assert [e.offset for e in plog.read(7, contiguous=True).events()] == []
    assert plog.read(7, contiguous=True).next_offset == 45
    plog.close()
    plog = compact_log(tmp_path)
    assert snapshot(plog) == latest and plog.end_offset == 50
    plog.close()


def test_an_emptied_first_segment_does_not_hold_back_time_retention(tmp_path: Path) -> None:
    plog = compact_log(tmp_path, retention_ms=1000)
    put(plog, b"a", b"1", ts=0)
    plog.roll()
    put(plog, b"a", b"2", ts=0)
    put(plog, b"b", b"1", ts=5000)  # keeps its segment from expiring until 6000
    plog.roll()
    put(plog, b"c", b"1", ts=9000)
    plog.compact(now_ms=0)
    assert [s.size == 0 for s in plog.segments] == [True, False, False]
    assert plog.enforce_retention(now_ms=5500) == 0  # the next one is not expired yet
    assert plog.enforce_retention(now_ms=6500) == 2  # the empty one goes with it
    assert plog.start_offset == 3
    assert snapshot(plog) == [(3, b"c", b"1", False)]
    plog.close()


def test_compaction_under_fsync_keeps_the_newest_value_of_unsynced_events(
    tmp_path: Path,
) -> None:
    # Under the fsync policy a sealed segment can hold events above the durable offset
    # (appended and rolled, fsync still pending). Compaction must never let an older
    # value of a key win over a newer one it has not looked at.
    plog = compact_log(tmp_path, sync=FSYNC)
    put(plog, b"a", b"a1", ts=1)
    plog.sync()  # durable: 1
    put(plog, b"a", b"a2", ts=2)
    plog.roll()
    put(plog, b"x", b"x1", ts=3)
    plog.compact(now_ms=10)
    plog.sync()
    values = {e.key: e.value for e in plog.events()}
    assert values == {b"a": b"a2", b"x": b"x1"}
    plog.close()


def test_a_cut_during_a_compaction_is_not_undone_by_its_rename(tmp_path: Path) -> None:
    # A replica moved off this node is cut to 0 while the maintenance thread compacts
    # its first segment. The compaction's rename used to land after the cut: the cut
    # segment's file came back on disk and the new tail went on writing to the
    # unlinked old one, so what was appended after the cut was gone on restart.
    plog = compact_log(tmp_path)
    lay_out(
        plog,
        [(b"a", b"a1"), (b"b", b"b1"), (None, b"n")],  # 0-2
        [(b"a", b"a2"), (b"b", b"b2")],  # 3-4
        [(b"c", b"c1")],  # 5, active
    )
    held = HeldRewrite(plog)
    compaction = threading.Thread(target=plog.compact, kwargs={"now_ms": 0})
    compaction.start()
    # The cut either waits for the compaction's rewrite or (the bug) is done first.
    held.beside(compaction, lambda: plog.truncate_to(0))
    assert (plog.start_offset, plog.end_offset) == (0, 0)
    assert put(plog, b"z", b"z1") == 0
    plog.close()
    plog = compact_log(tmp_path)
    assert snapshot(plog) == [(0, b"z", b"z1", False)]
    plog.close()
    assert not check_partition(tmp_path).damaged


class _PausingLock:
    """The log's rewrite lock; ``thread`` stops before it first comes to take it."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.thread: threading.Thread | None = None
        self.arrived, self.go_on = threading.Event(), threading.Event()

    def __enter__(self) -> None:
        if threading.current_thread() is self.thread and not self.arrived.is_set():
            self.arrived.set()
            assert self.go_on.wait(30), "the test never let the compaction go on"
        self.lock.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.lock.release()


def test_a_cut_after_a_compaction_found_the_latest_values_keeps_what_it_left(
    tmp_path: Path,
) -> None:
    # A follower's diverged tail is cut while the maintenance thread compacts: the
    # compaction had found each key's latest value, some of them in the cut tail. An
    # older segment compacted after the cut must keep the values the cut made latest
    # again, not drop them for events that are gone.
    plog = compact_log(tmp_path)
    lay_out(
        plog,
        [(b"a", b"a1"), (b"b", b"b1")],  # 0-1
        [(b"b", b"b2"), (b"a", b"a2")],  # 2-3: cut below 3
        [(b"c", b"c1")],  # 4, active
    )
    paused = _PausingLock(plog._rewrite_lock)
    plog._rewrite_lock = paused  # type: ignore[assignment]
    compaction = threading.Thread(target=plog.compact, kwargs={"now_ms": 0})
    paused.thread = compaction
    compaction.start()
    assert paused.arrived.wait(30), "the compaction never came to its first segment"
    assert plog.truncate_to(3) == 3
    paused.go_on.set()
    compaction.join(30)
    assert not compaction.is_alive()

    def values(plog: PartitionLog) -> dict[bytes | None, bytes]:
        return {key: val for _, key, val, _ in snapshot(plog)}

    assert values(plog) == {b"a": b"a1", b"b": b"b2"}
    plog.close()
    plog = compact_log(tmp_path)
    assert values(plog) == {b"a": b"a1", b"b": b"b2"}
    plog.close()
    assert not check_partition(tmp_path).damaged


def files_open_under(directory: Path) -> list[str]:
    """The files under ``directory`` this process holds a descriptor of (only those:
    another thread or a collected object may open or close others meanwhile)."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed
            continue
        if name.startswith(f"{directory}/"):
            names.append(name)
    return names


class _CloseFirst(SeenLock):
    """:class:`SeenLock` whose second take by a thread (a compaction's next segment)
    waits until ``closed`` is set: the close waiting meanwhile goes first."""

    def __init__(self, lock: threading.Lock, closed: threading.Event) -> None:
        super().__init__(lock)
        self.closed = closed

    def __enter__(self) -> None:
        if threading.current_thread() in self.takers:
            assert self.closed.wait(30), "the log was never closed"
        super().__enter__()


A_SUPERSEDED = (
    [(b"a", b"a1"), (None, b"n")],  # 0-1
    [(b"c", b"c1"), (b"a", b"a2")],  # 2-3
    [(b"d", b"d1")],  # 4, active
)
"""Two sealed segments, the second superseding a key of the first, and the active one."""


def test_a_log_closed_during_a_compaction_waits_for_its_rewrite(tmp_path: Path) -> None:
    # Closing a log (shutdown, the stream deleted) while the maintenance thread
    # rewrites one of its segments: the close waits for that rewrite, and the
    # compaction stops there instead of opening its rewritten segments into a closed
    # log (a file left open, a segment swapped into a log nobody closes again).
    plog = compact_log(tmp_path)
    lay_out(plog, *A_SUPERSEDED)
    closed = threading.Event()
    # The compaction comes back for the lock (the next segment) after the close took it.
    held = HeldRewrite(plog, _CloseFirst(plog._rewrite_lock, closed))
    result: list[CompactionResult] = []
    compaction = threading.Thread(target=lambda: result.append(plog.compact(now_ms=0)))
    compaction.start()

    def close() -> None:
        plog.close()
        closed.set()

    held.beside(compaction, close)
    assert result and result[0].segments_rewritten == 1
    assert not files_open_under(tmp_path)
    plog = compact_log(tmp_path)
    assert snapshot(plog) == [
        (1, None, b"n", False),
        (2, b"c", b"c1", False),
        (3, b"a", b"a2", False),
        (4, b"d", b"d1", False),
    ]
    plog.close()
    assert not check_partition(tmp_path).damaged


def test_only_a_lost_index_is_warned_of_not_a_compactions_new_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A compaction's rewritten segment has no index until it is opened: built without
    # a WARNING (one per rewritten segment told operators of damage there was none of),
    # while a sealed segment found without its index on open is still warned of.
    plog = compact_log(tmp_path)
    lay_out(plog, [(b"a", b"a1"), (None, b"n")], [(b"a", b"a2")])
    with caplog.at_level(logging.WARNING, logger="headwater.storage"):
        assert plog.compact(now_ms=0).segments_rewritten == 1
    assert "rebuilding index" not in caplog.text
    assert [e.offset for e in plog.events()] == [1, 2]
    plog.close()
    (tmp_path / segment_name(0, ".index")).unlink()
    with caplog.at_level(logging.WARNING, logger="headwater.storage"):
        plog = compact_log(tmp_path)
    assert f"rebuilding index of {tmp_path / segment_name(0, '.log')}" in caplog.text
    assert [e.offset for e in plog.events()] == [1, 2]
    plog.close()


def test_compaction_survives_a_leftover_cleaned_file(tmp_path: Path) -> None:
    plog = compact_log(tmp_path)
    put(plog, b"a", b"1")
    put(plog, b"a", b"2")
    plog.roll()
    put(plog, None, b"t")
    plog.close()
    # A crash mid-compaction leaves the original .log and a partial .cleaned.
    (tmp_path / (segment_name(0, ".log") + ".cleaned")).write_bytes(b"\x00" * 10)
    plog = compact_log(tmp_path)
    assert [e.value for e in plog.events()] == [b"1", b"2", b"t"]
    plog.compact(now_ms=0)
    assert [e.value for e in plog.events()] == [b"2", b"t"]
    plog.close()
    assert not list(tmp_path.glob("*.cleaned"))


# ---- sync policy and committed offset ------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind", "interval"),
    [
        ("fsync", "fsync", 0),
        ("none", "none", 0),
        ("interval:5", "interval", 5),
        ("interval:1000", "interval", 1000),
        ("  fsync\n", "fsync", 0),
    ],
)
def test_sync_policy_parse_valid(text: str, kind: str, interval: int) -> None:
    policy = SyncPolicy.parse(text)
    assert (policy.kind, policy.interval_ms) == (kind, interval)
    assert SyncPolicy.parse(str(policy)) == policy


@pytest.mark.parametrize(
    "text",
    ["", "FSYNC", "always", "interval", "interval:", "interval:0", "interval:-5", "interval:x"],
)
def test_sync_policy_parse_invalid(text: str) -> None:
    with pytest.raises(ValueError):
        SyncPolicy.parse(text)


def test_default_sync_policy_is_fsync() -> None:
    assert LogConfig().sync == SyncPolicy("fsync")
    assert str(SyncPolicy()) == "fsync"


def test_committed_offset_under_fsync_moves_only_on_sync(tmp_path: Path) -> None:
    plog = open_log(tmp_path, sync=FSYNC)
    fill(plog, 3)
    assert plog.end_offset == 3
    assert plog.committed_offset == 0
    assert plog.read(0).count == 0  # unacknowledged events are not readable
    assert list(plog.events()) == []
    assert plog.offset_for_timestamp(0) is None
    assert plog.sync() == 3
    assert plog.committed_offset == 3
    assert [e.offset for e in plog.read(0).events()] == [0, 1, 2]
    fill(plog, 2)
    assert plog.committed_offset == 3
    assert plog.read(0).next_offset is None
    assert offsets(plog) == [0, 1, 2]
    assert offsets(plog, 0) == [0, 1, 2]
    assert [e.offset for e in plog.events(0, upto=5)] == [0, 1, 2, 3, 4]  # explicit upto
    plog.close()  # close syncs
    plog = open_log(tmp_path, sync=FSYNC)
    assert plog.committed_offset == plog.end_offset == 5
    plog.close()


@pytest.mark.parametrize("policy", ["none", "interval:50"])
def test_committed_offset_without_fsync_is_the_end(tmp_path: Path, policy: str) -> None:
    plog = open_log(tmp_path, sync=SyncPolicy.parse(policy))
    fill(plog, 3)
    assert plog.committed_offset == 3
    assert plog.durable_offset == 0
    assert offsets(plog) == [0, 1, 2]
    plog.sync()
    assert plog.durable_offset == 3
    plog.close()


# ---- check ---------------------------------------------------------------------------


def make_checked_log(path: Path, interval: int = 1) -> None:
    plog = open_log(path, index_interval_bytes=interval)
    fill(plog, 7, ts=[1, 2, 3, 4, 5, 6, 7])
    plog.close()


def test_check_clean_log(tmp_path: Path) -> None:
    make_checked_log(tmp_path)
    report = check_partition(tmp_path, index_interval_bytes=1)
    assert not report.damaged
    assert [s.batches for s in report.segments] == [2, 2, 2, 1]
    assert sum(s.events for s in report.segments) == 7
    assert all(not s.problems for s in report.segments)


def test_check_reports_a_corrupt_byte(tmp_path: Path) -> None:
    make_checked_log(tmp_path)
    path = tmp_path / segment_name(2, ".log")
    raw = bytearray(path.read_bytes())
    raw[BATCH + 80] ^= 0x08
    path.write_bytes(bytes(raw))
    report = check_partition(tmp_path, index_interval_bytes=1)
    assert report.damaged
    damaged = [s.path.name for s in report.segments if s.problems]
    assert damaged == [segment_name(2, ".log")]
    # check never repairs anything.
    assert path.read_bytes() == bytes(raw)


@pytest.mark.parametrize("suffix", [".index", ".timeindex"])
def test_check_reports_a_missing_index(tmp_path: Path, suffix: str) -> None:
    make_checked_log(tmp_path)
    (tmp_path / segment_name(4, suffix)).unlink()
    report = check_partition(tmp_path, index_interval_bytes=1)
    assert report.damaged
    problems = [p for s in report.segments for p in s.problems]
    assert len(problems) == 1
    assert "missing" in problems[0]
    # Opening the log rebuilds it, after which the check is clean again.
    open_log(tmp_path, index_interval_bytes=1).close()
    assert not check_partition(tmp_path, index_interval_bytes=1).damaged


def test_check_reports_a_stale_index(tmp_path: Path) -> None:
    make_checked_log(tmp_path)
    path = tmp_path / segment_name(0, ".index")
    path.write_bytes(path.read_bytes()[:-8])
    report = check_partition(tmp_path, index_interval_bytes=1)
    assert report.damaged


def test_check_opens_nothing_for_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """headwater check verifies without changing anything, so a snapshot or a read-only
    mount can be checked: it opened every segment read-write (EROFS on such a mount, a
    traceback and exit 1, which means "damage found")."""
    part = tmp_path / "tenants" / "0" / "streams" / "1" / "partition-0"
    part.mkdir(parents=True)
    make_checked_log(part, interval=4096)
    opened: list[int] = []
    real_open = os.open

    def recording(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        opened.append(flags)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording)
    [report] = check_data_dir(tmp_path)
    assert len(report.segments) == 4 and not report.damaged
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC
    assert opened and not [flags for flags in opened if flags & writing]


def test_check_data_dir_finds_nested_partitions(tmp_path: Path) -> None:
    a = tmp_path / "tenants" / "0" / "streams" / "1" / "partition-0"
    b = tmp_path / "tenants" / "0" / "streams" / "2" / "partition-0"
    for d in (a, b):
        d.mkdir(parents=True)
        make_checked_log(d, interval=4096)  # check_data_dir assumes the default
    (tmp_path / "tenants" / "0" / "tenant.json").write_text("{}")
    assert sorted(partition_dirs(tmp_path)) == [a, b]
    reports = check_data_dir(tmp_path)
    assert [r.path for r in reports] == [a, b]
    assert all(len(r.segments) == 4 and not r.damaged for r in reports)


def test_a_read_resuming_in_a_batch_that_compaction_rewrote(tmp_path: Path) -> None:
    """A read that cut a batch remembers where the cut fell; when compaction rewrites that
    batch under the same base offset before the next read, the next read must not trust
    the remembered position (values of different sizes: positions really move)."""
    plog = compact_log(tmp_path)
    values = [b"%d" % i * (3 * i + 1) for i in range(6)]
    plog.append(values, first_position=0, timestamp_ms=0, keys=[b"a", b"b", b"c", b"d", b"e", b"f"])
    plog.roll()
    put(plog, b"a", b"newest")  # supersedes offset 0 only
    first = plog.read(0, max_bytes=sum(map(len, values[:3])))
    assert [e.offset for e in first.events()] == [0, 1, 2]
    assert plog.compact(now_ms=0).events_removed == 1
    # Offset 4 is now the batch's fourth event, as offset 3 was when the read cut it.
    rest = plog.read(4, max_bytes=len(values[4]))
    assert [(e.offset, e.value) for e in rest.events()] == [(4, values[4])]
    assert b"".join(bytes(c) for c in rest.values_chunks()) == encode_values(values[4:5])
    plog.close()


def test_a_compaction_stops_at_a_log_closed_while_it_reads_the_keys(tmp_path: Path) -> None:
    # The close (shutdown, the stream deleted) comes while the compaction reads the
    # whole log for each key's latest value, holding no lock: the compaction stops
    # without a rewrite instead of failing on the next segment's closed file.
    plog = compact_log(tmp_path)
    put(plog, b"a", b"a1")  # 0
    plog.roll()
    put(plog, b"a", b"a2")  # 1
    plog.roll()
    put(plog, b"a", b"a3")  # 2, active
    batches = plog.batches

    def closed_after_the_first(*args: Any, **kwargs: Any) -> Iterator[Batch]:
        read = batches(*args, **kwargs)
        yield next(read)
        plog.close()
        yield from read

    plog.batches = closed_after_the_first  # type: ignore[method-assign]
    assert plog.compact(now_ms=0).segments_rewritten == 0
    assert plog.closed and not files_open_under(tmp_path)
    plog = compact_log(tmp_path)
    assert [e.value for e in plog.events()] == [b"a1", b"a2", b"a3"]
    plog.close()


def test_a_log_deleted_during_a_compaction_waits_for_its_rewrite(tmp_path: Path) -> None:
    # Deleting a log while the maintenance thread rewrites one of its segments: the
    # delete waits for that rewrite. It used to remove the directory under it, and the
    # compaction failed renaming its rewritten file into a directory that was gone.
    plog = compact_log(tmp_path)
    lay_out(plog, *A_SUPERSEDED)
    held = HeldRewrite(plog)
    failures: list[BaseException] = []

    def compact() -> None:
        try:
            plog.compact(now_ms=0)
        except BaseException as exc:
            failures.append(exc)

    compaction = threading.Thread(target=compact)
    compaction.start()
    held.beside(compaction, plog.delete)
    assert failures == []
    assert not tmp_path.exists()
    assert not files_open_under(tmp_path)
