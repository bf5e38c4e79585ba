"""A sealed segment's indexes are its index files mapped read-only (SealedIndex), not
arrays on the heap: what they cost, what holds them, and when they are let go."""

from __future__ import annotations

import contextlib
import gc
import os
import tracemalloc
from pathlib import Path

import pytest

from headwater.storage import segment as segment_module
from headwater.storage.files import FileCache
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy
from headwater.storage.segment import Segment

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
    """Paths of the files this process has mapped."""
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}


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
    maps, fds = mapped_files(), open_descriptors()
    for seg in sealed:
        index = seg.sealed_index
        assert index is not None and index.mapped
        assert len(index) == 50 and index.time_count == 50
        # Nothing of the index on the heap ...
        assert not (seg.index_offsets or seg.index_positions)
        assert not (seg.time_timestamps or seg.time_offsets)
        # ... the files are mapped, and no descriptor is kept open for them.
        assert index_paths(seg) <= maps
        assert not index_paths(seg) & fds
        # Lookups answer from the files.
        for off, pos in seg.index_entries():
            assert seg.position_for(off) == pos
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
