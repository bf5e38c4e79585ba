"""A sealed segment's indexes are its index files mapped read-only (SealedIndex), not
arrays on the heap: what they cost, what holds them, and when they are let go."""

from __future__ import annotations

import contextlib
import gc
import os
import random
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest

from headwater.storage import log as log_module
from headwater.storage import segment as segment_module
from headwater.storage.files import FileCache
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy
from headwater.storage.segment import Segment
from waiting import wait_until

NONE = SyncPolicy("none")


def open_log(path: Path, **config: object) -> PartitionLog:
    config.setdefault("sync", NONE)
    return PartitionLog.open(path, LogConfig(**config))  # type: ignore[arg-type]


def fill(path: Path, segments: int, batches: int, **config: object) -> None:
    """``segments`` sealed segments of ``batches`` one-event batches each, every batch
    indexed (interval 1) and raising the time index, then a one-batch active segment."""
    plog = open_log(path, index_interval_bytes=1, **config)
    n = 0
    for _ in range(segments):
        for _ in range(batches):
            plog.append([b"v%d" % n], first_position=n, timestamp_ms=1000 + n)
            n += 1
        plog.roll()
    plog.append([b"tail"], first_position=n, timestamp_ms=1000 + n)
    plog.close()


def mapped_files() -> set[str]:
    """Paths of the files this process has mapped (deleted ones too)."""
    with open("/proc/self/maps") as f:
        names = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    return {name.removesuffix(" (deleted)") for name in names}


def open_descriptors() -> set[str]:
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed
            names.add(os.readlink(f"/proc/self/fd/{fd}"))
    return names


def index_paths(seg: Segment) -> set[str]:
    return {str(seg.index_path), str(seg.time_index_path)}


def test_sealed_segments_search_their_mapped_index_files(tmp_path: Path) -> None:
    fill(tmp_path, 5, 50)
    plog = open_log(tmp_path, index_interval_bytes=1)
    sealed, active = plog.segments[:-1], plog.active
    assert len(sealed) == 5
    # Opening checked the files and let them go: they are mapped on the first lookup.
    assert not any(index_paths(seg) & mapped_files() for seg in sealed)
    for seg in sealed:
        index = seg.sealed_index
        assert index is not None and index.mapped
        assert len(index) == 50 and index.time_count == 50
        # Nothing of the index on the heap ...
        assert not (seg.index_offsets or seg.index_positions)
        assert not (seg.time_timestamps or seg.time_offsets)
        # Lookups answer from the files ...
        for off, pos in seg.index_entries():
            assert seg.position_for(off) == pos
    # ... which are now mapped, and no descriptor is kept open for them.
    maps, fds = mapped_files(), open_descriptors()
    for seg in sealed:
        assert index_paths(seg) <= maps
        assert not index_paths(seg) & fds
    assert active.sealed_index is None and len(active.index_offsets) == 1
    plog.close()
    assert not any(index_paths(seg) & mapped_files() for seg in sealed)


def test_the_index_of_many_sealed_segments_costs_no_heap(tmp_path: Path) -> None:
    """Opening a log keeps per segment a few objects, whatever its index holds: ten
    times the entries cost the heap nothing more (as arrays, 32 bytes per batch: about
    280 KiB more here)."""
    small, large = tmp_path / "small", tmp_path / "large"
    fill(small, 8, 100)
    fill(large, 8, 1000)

    def retained(path: Path) -> tuple[int, PartitionLog]:
        gc.collect()
        tracemalloc.start()
        try:
            plog = open_log(path, index_interval_bytes=1)
            gc.collect()
            size, _peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return size, plog

    retained(small)[1].close()  # imports and first-use caches out of the way
    small_bytes, small_log = retained(small)
    large_bytes, large_log = retained(large)
    try:
        assert sum(len(s.time_entries()) for s in large_log.segments) == 8001
        assert large_bytes - small_bytes < 24 << 10, (small_bytes, large_bytes)
    finally:
        small_log.close()
        large_log.close()


def test_a_segment_sealed_by_a_roll_lets_its_arrays_go(tmp_path: Path) -> None:
    plog = open_log(tmp_path, index_interval_bytes=1)
    for n in range(20):
        plog.append([b"x"], first_position=n, timestamp_ms=n)
    seg = plog.active
    before = [(seg.position_for(o), seg.position_for_timestamp(o)) for o in range(-1, 22)]
    plog.roll()
    assert seg.sealed_index is not None and not seg.index_offsets and not seg.time_offsets
    after = [(seg.position_for(o), seg.position_for_timestamp(o)) for o in range(-1, 22)]
    assert after == before
    plog.close()


def test_compressed_segments_index_frames_from_their_mapped_files(tmp_path: Path) -> None:
    fill(tmp_path, 3, 200, compression="zstd")
    plog = open_log(tmp_path, index_interval_bytes=1, compression="zstd")
    assert plog.compress().segments_compressed == 3
    for seg in plog.segments[:-1]:
        assert seg.compressed and seg.sealed_index is not None and seg.sealed_index.mapped
        assert not seg.index_offsets
    assert [e.value for e in plog.events(150)][:2] == [b"v150", b"v151"]
    assert plog.offset_for_timestamp(1000 + 333) == 333
    plog.close()
    plog = open_log(tmp_path, index_interval_bytes=1, compression="zstd")
    assert all(s.compressed and s.sealed_index is not None for s in plog.segments[:-1])
    assert plog.offset_for_timestamp(1000 + 450) == 450
    assert [e.value for e in plog.events(599)] == [b"v599", b"tail"]
    plog.close()


def test_deleted_and_replaced_segments_leave_no_mapping_once_buried(tmp_path: Path) -> None:
    plog = open_log(tmp_path, index_interval_bytes=1)
    for n in range(60):
        plog.append([b"v"], first_position=n, timestamp_ms=1000 + n, keys=[b"k%d" % (n % 3)])
        if n % 20 == 19:
            plog.roll()
    plog.sync()
    first = plog.segments[0]
    old_paths = index_paths(first)
    compacted = plog.segments[1]
    assert plog.compact(now_ms=10**12).segments_rewritten >= 1
    # The old segment is kept for its readers until buried, its index with its bytes.
    assert old_paths <= mapped_files()
    plog.config = LogConfig(sync=NONE, index_interval_bytes=1, retention_bytes=1)
    assert plog.enforce_retention() >= 1
    assert first not in plog.segments and compacted not in plog.segments
    plog.close()  # buries the graveyard
    gone = {p for p in mapped_files() if p.startswith(str(tmp_path))}
    assert not gone


def test_a_closed_segment_answers_lookups_from_its_start(tmp_path: Path) -> None:
    fill(tmp_path, 2, 30)
    plog = open_log(tmp_path, index_interval_bytes=1)
    seg = plog.segments[1]
    assert seg.position_for(45) > 0
    plog.close()
    assert seg.sealed_index is not None and seg.sealed_index.closed
    # Nothing unmapped is touched: the answers are the safe ones (a read of the closed
    # .log fails on its own).
    assert seg.position_for(45) == 0
    assert seg.position_for_timestamp(1045) == 0
    assert seg._unit_end_below(0, 4 << 20) == 4 << 20


def test_truncating_into_a_sealed_segment_keeps_no_mapping_of_it(tmp_path: Path) -> None:
    fill(tmp_path, 3, 20)
    plog = open_log(tmp_path, index_interval_bytes=1)
    seg = plog.segments[1]
    assert plog.truncate_to(25) == 25
    tail = plog.active
    assert tail.base_offset == 20 and tail.sealed_index is None
    assert seg.sealed_index is not None and seg.sealed_index.closed
    assert not tail.index_path.exists()
    assert [e.value for e in plog.events(18)] == [
        b"v18",
        b"v19",
        *(b"v%d" % n for n in range(20, 25)),
    ]
    plog.close()


def test_index_files_open_no_descriptor_of_the_file_cache(tmp_path: Path) -> None:
    fill(tmp_path, 6, 10)
    files = FileCache(2)
    plog = PartitionLog.open(tmp_path, LogConfig(sync=NONE, index_interval_bytes=1), files)
    assert files.open_count <= 2
    assert not any(p.endswith((".index", ".timeindex")) for p in open_descriptors())
    assert [e.value for e in plog.events(0)][:1] == [b"v0"]
    plog.close()


def test_a_refused_mapping_reads_the_index_files_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fill(tmp_path, 3, 40)
    plog = open_log(tmp_path, index_interval_bytes=1)
    expected = [(s.index_entries(), s.time_entries()) for s in plog.segments[:-1]]
    answers = [
        (plog.offset_for_timestamp(t), list(plog.events(t - 1000))[:1]) for t in (1000, 1077, 1119)
    ]
    plog.close()

    def refuse(path: Path) -> None:
        raise segment_module._MapRefused(12, f"mmap of {path.name}: Cannot allocate memory")

    monkeypatch.setattr(segment_module, "_map_file", refuse)
    monkeypatch.setattr(segment_module, "_map_failures", 0)
    plog = open_log(tmp_path, index_interval_bytes=1)
    assert all(s.sealed_index is not None and not s.sealed_index.mapped for s in plog.segments[:-1])
    assert [(s.index_entries(), s.time_entries()) for s in plog.segments[:-1]] == expected
    assert [
        (plog.offset_for_timestamp(t), list(plog.events(t - 1000))[:1]) for t in (1000, 1077, 1119)
    ] == answers
    assert "not mapped" in caplog.text
    plog.close()


def test_deleting_a_log_unmaps_its_graveyard_too(tmp_path: Path) -> None:
    plog = open_log(tmp_path / "p", index_interval_bytes=1)
    for n in range(40):
        plog.append([b"v"], first_position=n, timestamp_ms=1000 + n, keys=[b"k%d" % (n % 2)])
        if n % 10 == 9:
            plog.roll()
    plog.sync()
    assert plog.compact(now_ms=10**12).segments_rewritten >= 1
    assert any(p.startswith(str(tmp_path)) for p in mapped_files())
    plog.delete()
    assert not any(p.startswith(str(tmp_path)) for p in mapped_files())
    assert not any(p.startswith(str(tmp_path)) for p in open_descriptors())


# ---- lifetime: lookups racing eviction and close; the bound on mappings --------------


@pytest.fixture
def mapped_limit() -> Iterator[Callable[[int], None]]:
    """Set the process's bound on mapped indexes for one test."""
    before = segment_module.mapped_index_limit
    yield segment_module.set_mapped_index_limit
    segment_module.set_mapped_index_limit(before)


def our_mapped_indexes(path: Path) -> set[str]:
    return {p for p in mapped_files() if p.startswith(str(path)) and p.endswith("index")}


def expected_answers(plog: PartitionLog) -> dict[tuple[int, str, int], int | None]:
    """Every sealed segment's lookups, asked once, single-threaded."""
    answers: dict[tuple[int, str, int], int | None] = {}
    for i, seg in enumerate(plog.segments[:-1]):
        for offset in range(seg.base_offset - 1, seg.next_offset + 1):
            answers[(i, "offset", offset)] = seg.position_for(offset)
            answers[(i, "time", 1000 + offset)] = seg.position_for_timestamp(1000 + offset)
    return answers


def ask(seg: Segment, kind: str, arg: int) -> int | None:
    return seg.position_for(arg) if kind == "offset" else seg.position_for_timestamp(arg)


def test_more_sealed_indexes_than_the_bound_are_mapped_in_turn(
    tmp_path: Path, mapped_limit: Callable[[int], None]
) -> None:
    """Past ``mapped_index_limit`` indexes the oldest are unmapped and mapped again on
    their next lookup: the process never holds more than the bound, and every answer is
    the one it gives unbounded."""
    fill(tmp_path, 10, 30)
    plog = open_log(tmp_path, index_interval_bytes=1)
    expected = expected_answers(plog)  # unbounded: the default limit is thousands
    assert len(our_mapped_indexes(tmp_path)) == 20
    mapped_limit(3)
    assert segment_module.mapped_index_count() <= 3
    assert len(our_mapped_indexes(tmp_path)) <= 6
    seen: set[str] = set()
    for _ in range(2):
        for n, ((i, kind, arg), answer) in enumerate(expected.items()):
            assert ask(plog.segments[i], kind, arg) == answer
            if n % 7 == 0:
                mapped = our_mapped_indexes(tmp_path)
                assert len(mapped) <= 6  # two files per index
                seen |= mapped
    assert len(seen) == 20  # every segment's files were mapped at some point
    assert [e.value for e in plog.events(95)][:2] == [b"v95", b"v96"]
    plog.close()
    assert not our_mapped_indexes(tmp_path)


def test_a_lookup_whose_entries_are_closed_under_it_looks_up_again(tmp_path: Path) -> None:
    """A lookup reads the mapping through views that a close releases before it unmaps:
    one racing the close gets ValueError from the view (never unmapped memory), and
    ``search`` asks again under the lock, reopening the files."""
    fill(tmp_path, 2, 40)
    plog = open_log(tmp_path, index_interval_bytes=1)
    seg = plog.segments[1]
    index = seg.sealed_index
    assert index is not None
    want = seg.position_for(65)
    entries = index._entries
    assert entries is not None and want > 0
    calls = []

    def closed_midway(found: segment_module._IndexEntries, rel: int) -> int:
        calls.append(found)
        if len(calls) == 1:
            with segment_module._maps_lock:  # an eviction by another thread, say
                index._close_entries()
            assert not our_mapped_indexes(tmp_path) & index_paths(seg)
        return segment_module._IndexEntries.position_for(found, rel)

    assert index.search(closed_midway, 65 - seg.base_offset) == want
    assert calls[0] is entries and calls[1] is not entries  # reopened under the lock
    with pytest.raises(ValueError):  # a released view: no read of the unmapped pages
        entries.position_for(25)
    plog.close()


def test_lookups_in_threads_survive_eviction_retention_and_close(
    tmp_path: Path, mapped_limit: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker threads look up in every sealed segment while the bound (one index) makes
    each lookup of another segment unmap the last, retention retires and buries
    segments, and the log is closed: every answer is the true one, or "from the start"
    once its segment is retired (its index not open then) or closed; nothing reads
    unmapped memory (that would kill the test process)."""
    fill(tmp_path, 8, 30)
    plog = open_log(tmp_path, index_interval_bytes=1)
    expected = expected_answers(plog)
    segments = plog.segments[:-1]
    mapped_limit(1)
    # Each lookup in the entries first lets the other threads run (which evict or close
    # them): the race is run every time, not left to the scheduler. The raced ones raise
    # ValueError from a released view, counted here.
    lookups = {
        segment_module._IndexEntries.position_for.__code__,
        segment_module._IndexEntries.position_for_timestamp.__code__,
    }
    raced = [0]

    def count_races(frame: FrameType, event: str, arg: object) -> Callable[..., object]:
        if event == "exception" and isinstance(arg, tuple) and arg[0] is ValueError:
            raced[0] += 1
        return count_races

    def yield_first(frame: FrameType, event: str, arg: object) -> Callable[..., object] | None:
        if event == "call" and frame.f_code in lookups:
            time.sleep(0)  # gives up the GIL: another thread runs inside the lookup
            return count_races
        return None

    threading.settrace(yield_first)
    stop = threading.Event()
    wrong: list[tuple[int, str, int, int | None, int | None]] = []
    asked = [0]
    keys = list(expected)
    hot = [k for k in keys if k[0] in (0, 7)]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            # Mostly two segments: their lookups race each other's eviction.
            i, kind, arg = key = rng.choice(hot if rng.random() < 0.9 else keys)
            seg = segments[i]
            got = ask(seg, kind, arg)
            index = seg.sealed_index
            gone = index is not None and (index.retired or index.closed)
            if got != expected[key] and not (gone and got == 0):
                wrong.append((i, kind, arg, got, expected[key]))
            asked[0] += 1

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    try:
        for thread in threads:
            thread.start()
        threading.settrace(None)  # for threads started from here on
        wait_until(lambda: asked[0] >= 1000)
        # Retention retires the three oldest segments; burying them closes their index
        # while the workers still look up in them.
        plog.config = LogConfig(sync=NONE, index_interval_bytes=1, retention_bytes=6000)
        assert plog.enforce_retention() >= 1
        mark = asked[0]
        wait_until(lambda: asked[0] >= mark + 1000)
        monkeypatch.setattr(log_module, "GRAVEYARD_SECONDS", -1.0)
        plog._bury()
        assert segments[0].sealed_index is not None and segments[0].sealed_index.closed
        mark = asked[0]
        wait_until(lambda: asked[0] >= mark + 1000)
        plog.close()
        mark = asked[0]
        wait_until(lambda: asked[0] >= mark + 1000)
    finally:
        threading.settrace(None)
        stop.set()
        for thread in threads:
            thread.join()
    assert not wrong, wrong[:5]
    assert raced[0] > 0  # lookups did meet entries closed under them
    assert not our_mapped_indexes(tmp_path)


def test_a_retired_segment_keeps_its_own_index_until_buried(
    tmp_path: Path, mapped_limit: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compaction renames new segments' files over the old ones' paths. An old segment
    whose index was open (looked up lately: a reader may be on it) keeps answering from
    it, outside the bound, until it is buried, which unmaps it; one whose index was not
    open answers "from the start" and never maps its paths again (they name the new
    segment's files now)."""
    plog = open_log(tmp_path, index_interval_bytes=1)
    for n in range(60):
        plog.append([b"v%d" % n], first_position=n, timestamp_ms=1000 + n, keys=[b"k%d" % (n % 3)])
        if n % 20 == 19:
            plog.roll()
    plog.sync()
    hot, cold = plog.segments[0], plog.segments[1]
    assert hot.sealed_index is not None and cold.sealed_index is not None
    before = [(hot.position_for(o), hot.position_for_timestamp(1000 + o)) for o in range(20)]
    assert before[-1][0] > 0
    assert cold.sealed_index._entries is None  # never looked up
    assert plog.compact(now_ms=10**12).segments_rewritten == 3
    assert hot not in plog.segments and cold not in plog.segments
    assert hot.sealed_index.retired and cold.sealed_index.retired
    mapped_limit(1)  # lookups of the new segments do not evict a retired index
    for seg in plog.segments[:-1]:
        seg.position_for(seg.base_offset)
    after = [(hot.position_for(o), hot.position_for_timestamp(1000 + o)) for o in range(20)]
    assert after == before
    assert index_paths(hot) <= mapped_files()  # its own (deleted) files, still mapped
    assert [cold.position_for(o) for o in (20, 30, 39)] == [0, 0, 0]
    assert cold.position_for_timestamp(1030) == 0
    assert cold.sealed_index._entries is None and not cold.sealed_index.broken
    assert sum(b.count for b in cold.batches_from(0, cold.size)) == 20  # its .log reads
    monkeypatch.setattr(log_module, "GRAVEYARD_SECONDS", -1.0)
    plog._bury()
    assert hot.sealed_index.closed
    assert hot.position_for(15) == 0  # closed: from the start
    plog.close()
    assert not our_mapped_indexes(tmp_path)


def test_index_files_renamed_over_a_mapping_leave_it_whole(
    tmp_path: Path, mapped_limit: Callable[[int], None], caplog: pytest.LogCaptureFixture
) -> None:
    """Index files are only ever replaced by a rename (or unlinked), never rewritten in
    place, so a mapping keeps the inode it was made of and never faults (SIGBUS comes
    from a file cut short under its mapping). Renamed over by files of other sizes, a
    mapped index answers as before; once unmapped it does not reopen files that are not
    the ones it read (other sizes, or another CRC in the trailer): from the start, with a
    warning."""
    fill(tmp_path, 3, 30)
    plog = open_log(tmp_path, index_interval_bytes=1)
    seg, other = plog.segments[0], plog.segments[1]
    before = [(seg.position_for(o), seg.position_for_timestamp(1000 + o)) for o in range(30)]
    assert before[-1][0] > 0
    # The offset index: twice as long; the time index: the same size, other entries.
    for path, data in (
        (seg.index_path, other.index_path.read_bytes() * 2),
        (seg.time_index_path, other.time_index_path.read_bytes()),
    ):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # how Segment.write_index_files replaces them
    after = [(seg.position_for(o), seg.position_for_timestamp(1000 + o)) for o in range(30)]
    assert after == before
    mapped_limit(1)
    other.position_for(40)  # unmaps seg's index
    assert seg.sealed_index is not None and seg.sealed_index._entries is None
    assert seg.position_for(20) == 0
    assert seg.position_for_timestamp(1020) == 0
    assert "changed underneath" in caplog.text
    # The rest of the log is untouched; the segment itself still reads from its start.
    assert [e.value for e in plog.events(20)][:2] == [b"v20", b"v21"]
    plog.close()
