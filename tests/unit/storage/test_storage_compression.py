"""Sealed segments rewritten as compressed frames: reads, indexes, recovery, check,
retention and compaction all see the same events as before."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from headwater.errors import CorruptBatchError
from headwater.storage.batch import Batch
from headwater.storage.check import check_partition
from headwater.storage.compression import FRAME_MAGIC, decode_frame, encode_frame
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy
from headwater.storage.segment import Segment, WouldBlock, no_wait

NONE = SyncPolicy("none")


def event(i: int) -> bytes:
    # JSON-like and repetitive, as events are: compresses well.
    return json.dumps(
        {"id": i, "user": f"user-{i % 97}", "kind": "click", "page": "/home"}
    ).encode()


def open_log(path: Path, codec: str, **config: object) -> PartitionLog:
    config.setdefault("sync", NONE)
    config.setdefault("segment_bytes", 64 << 10)
    return PartitionLog.open(path, LogConfig(compression=codec, **config))  # type: ignore[arg-type]


def fill(plog: PartitionLog, batches: int, per_batch: int, ts: int = 1000) -> list[bytes]:
    values = []
    for b in range(batches):
        chunk = [event(plog.end_offset + i) for i in range(per_batch)]
        plog.append(chunk, first_position=plog.end_offset, timestamp_ms=ts + b)
        values += chunk
    return values


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_compressed_segments_read_back_the_same_events(
    tmp_path: Path, codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("headwater.storage.log.FRAME_BYTES", 4096)  # several frames a segment
    plog = open_log(tmp_path, codec, segment_bytes=32 << 10)
    values = fill(plog, 600, 3)  # one-to-three-event batches: frames gather many
    plain_size = plog.size_bytes
    sealed = len(plog.segments) - 1
    assert sealed >= 3
    result = plog.compress()
    assert result.segments_compressed == sealed
    assert result.bytes_after * 2 < result.bytes_before  # JSON compresses
    assert plog.size_bytes < plain_size
    assert all(s.compressed for s in plog.segments[:-1]) and not plog.active.compressed
    # Full scan, reads from every offset kind, bounded reads, and positions.
    assert [e.value for e in plog.events(0)] == values
    assert [e.position for e in plog.events(0)] == list(range(len(values)))
    for start in (0, 1, 500, 901, len(values) - 1):
        read = plog.read(start, max_bytes=2000)
        got = list(read.events())
        assert got[0].offset == start
        assert [e.value for e in got] == values[start : start + len(got)]
        assert read.value_bytes <= 2000 or len(got) == 1
    # The time index still finds the batch of a timestamp inside a frame.
    assert plog.offset_for_timestamp(1000 + 250) == 750
    assert plog.compress().segments_compressed == 0  # nothing left to do
    plog.close()
    # The indexes written with the frames are the ones a scan of the frames builds.
    assert not check_partition(tmp_path).damaged

    # Reopened: indexes trusted (or rebuilt when gone), the same events, check is clean.
    for seg_index in tmp_path.glob("*.index"):
        seg_index.unlink()
        break
    reopened = open_log(tmp_path, codec, segment_bytes=32 << 10)
    assert [e.value for e in reopened.events(0)] == values
    assert reopened.read(1234).first_offset == 1234
    assert not check_partition(tmp_path).damaged
    reopened.close()


def test_a_damaged_frame_is_found_by_check_and_never_served(tmp_path: Path) -> None:
    plog = open_log(tmp_path, "zstd")
    fill(plog, 400, 3)
    plog.compress()
    first = plog.segments[0]
    plog.close()
    with open(first.log_path, "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    report = check_partition(tmp_path)
    assert report.damaged
    assert any("CRC" in p for s in report.segments for p in s.problems)
    reopened = open_log(tmp_path, "zstd")
    with pytest.raises(CorruptBatchError):
        list(reopened.events(0))
    reopened.close()


def test_frame_codec_rejects_a_truncated_or_forged_frame(tmp_path: Path) -> None:
    plog = open_log(tmp_path, "none")
    fill(plog, 5, 2)
    batches = list(plog.batches(0))
    frame = encode_frame("lz4", batches)
    assert frame[8] == FRAME_MAGIC
    assert [b.base_offset for b in decode_frame(memoryview(frame))] == [0, 2, 4, 6, 8]
    with pytest.raises(CorruptBatchError):
        decode_frame(memoryview(frame[:-1]))
    forged = bytearray(frame)
    forged[12] = 9  # batch count
    with pytest.raises(CorruptBatchError):
        decode_frame(memoryview(bytes(forged)))
    with pytest.raises(CorruptBatchError):
        decode_frame(memoryview(bytes(forged)), verify=False)  # count no longer matches
    plog.close()


def test_retention_and_compaction_work_on_compressed_segments(tmp_path: Path) -> None:
    plog = open_log(tmp_path, "zstd", cleanup_policy="compact", segment_bytes=8 << 10)
    for i in range(300):
        plog.append([b"v%d" % i], first_position=i, timestamp_ms=i, keys=[b"k%d" % (i % 10)])
    plog.compress()
    assert all(s.compressed for s in plog.segments[:-1])
    result = plog.compact()
    assert result.events_removed > 0
    latest = {e.key: e.value for e in plog.events(0)}
    assert latest == {b"k%d" % k: b"v%d" % (290 + k) for k in range(10)}
    plog.compress()  # the compacted (plain) segments compress again; emptied ones stay
    assert all(s.compressed for s in plog.segments[:-1] if s.size)
    assert {e.key: e.value for e in plog.events(0)} == latest
    sealed = len(plog.segments) - 1
    plog.close()
    # Retention by size counts compressed bytes and drops whole compressed segments.
    trimmed = open_log(tmp_path, "zstd", retention_bytes=1, segment_bytes=8 << 10)
    assert trimmed.enforce_retention() == sealed
    assert trimmed.start_offset == trimmed.active.base_offset
    assert [e.offset for e in trimmed.events(0)][-1] == 299
    trimmed.close()


def test_a_crash_mid_compression_leaves_the_plain_segment(tmp_path: Path) -> None:
    plog = open_log(tmp_path, "zstd")
    values = fill(plog, 300, 3)
    plog.close()
    # What a crash before the rename leaves: a partial temporary file beside the segment.
    first = Segment(tmp_path, 0, 4096)
    leftover = first.log_path.with_name(first.log_path.name + ".compressing.tmp")
    leftover.write_bytes(b"\x00" * 100)
    reopened = open_log(tmp_path, "zstd")
    assert not leftover.exists()
    assert [e.value for e in reopened.events(0)] == values
    reopened.close()


def test_a_server_setting_rejects_an_unknown_codec() -> None:
    with pytest.raises(ValueError, match="compression must be one of none, zstd, lz4"):
        LogConfig(compression="gzip")


def test_no_wait_reads_leave_decompression_to_a_worker_thread(tmp_path: Path) -> None:
    """The event loop reads hot plain data itself; a compressed frame is CPU work, so a
    no-wait read reaching one is sent to a thread (WouldBlock), as a cold page is."""
    plog = open_log(tmp_path, "lz4")
    values = fill(plog, 600, 3)
    plog.compress()
    tail = plog.active.base_offset
    assert [e.value for e in plog.events(0)] == values  # warm: every page cached
    with no_wait():
        assert plog.read(tail, 1 << 20).first_offset == tail
        with pytest.raises(WouldBlock):
            plog.read(0, 1 << 20)
    assert plog.read(0, 1 << 20).first_offset == 0
    plog.close()


def close_as(plog: PartitionLog, *, gone: bool) -> None:
    """Close ``plog`` as a shutdown does, or with ``gone`` as a stream's delete does
    (engine.delete_stream closes each log, then renames the directory and removes it)."""
    plog.close()
    if gone:
        tomb = plog.directory.with_name(".deleted-1")
        os.replace(plog.directory, tomb)
        shutil.rmtree(tomb)


def assert_left_uncompressed(directory: Path, values: list[bytes], *, gone: bool) -> None:
    """What a compression stopped by a close leaves: nothing of a deleted stream; else
    no temporary file, and the log's events as they were, none compressed."""
    if gone:
        assert not directory.exists() and not directory.with_name(".deleted-1").exists()
        return
    assert not list(directory.glob("*.tmp"))
    reopened = open_log(directory, "zstd", segment_bytes=8 << 10)
    assert not any(s.compressed for s in reopened.segments)
    assert [e.value for e in reopened.events(0)] == values
    reopened.close()


class _ClosedBeforeTheSwap:
    """A log's rewrite lock whose first taker (the compression's swap) finds the log
    closed, and with ``gone`` its directory renamed and removed, as a stream's delete
    leaves them (engine.delete_stream closes each log, then removes the directory)."""

    def __init__(self, plog: PartitionLog, *, gone: bool) -> None:
        self.plog, self.gone, self.first = plog, gone, True
        self.lock: threading.Lock = plog._rewrite_lock

    def __enter__(self) -> None:
        plog = self.plog
        if self.first:
            self.first = False
            plog._rewrite_lock = self.lock  # the close takes the real one
            close_as(plog, gone=self.gone)
        self.lock.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.lock.release()


@pytest.mark.parametrize("gone", [False, True], ids=["shutdown", "stream-deleted"])
def test_a_compression_stops_at_a_log_closed_before_its_swap(tmp_path: Path, gone: bool) -> None:
    # The maintenance thread compresses the first of several sealed segments while the
    # log is closed (shutdown, or the stream deleted: its directory then goes at once).
    # The compression stops there, leaving nothing behind, instead of failing on the
    # next segment's closed file or on the deleted directory.
    directory = tmp_path / "partition-0"
    plog = open_log(directory, "zstd", segment_bytes=8 << 10)
    values = fill(plog, 300, 3)
    assert len(plog.segments) > 2
    plog._rewrite_lock = _ClosedBeforeTheSwap(plog, gone=gone)  # type: ignore[assignment]
    assert plog.compress().segments_compressed == 0
    assert plog.closed
    assert_left_uncompressed(directory, values, gone=gone)


@pytest.mark.parametrize("gone", [False, True], ids=["shutdown", "stream-deleted"])
def test_a_compression_stops_at_a_log_closed_while_it_reads(tmp_path: Path, gone: bool) -> None:
    # The close comes while the first segment is read for its frames (no lock held):
    # the compression stops there instead of failing on the closed file.
    directory = tmp_path / "partition-0"
    plog = open_log(directory, "zstd", segment_bytes=8 << 10)
    values = fill(plog, 300, 3)
    first = plog.segments[0]
    batches_from = first.batches_from

    def closed_first(*args: Any, **kwargs: Any) -> Iterator[Batch]:
        close_as(plog, gone=gone)
        return batches_from(*args, **kwargs)

    first.batches_from = closed_first  # type: ignore[method-assign]
    assert plog.compress().segments_compressed == 0
    assert plog.closed
    assert_left_uncompressed(directory, values, gone=gone)


def test_a_compression_fsyncs_without_the_log_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Appends take the log lock on the event loop: a compression that fsynced its
    # rename and its new indexes under that lock held every connection of the server
    # for as long as the disk took.
    plog = open_log(tmp_path / "partition-0", "zstd", segment_bytes=8 << 10)
    values = fill(plog, 300, 3)
    fsync = os.fsync
    held_at_fsync: list[bool] = []

    def lock_free() -> bool:
        free: list[bool] = []

        def attempt() -> None:
            free.append(plog._lock.acquire(blocking=False))
            if free[0]:
                plog._lock.release()

        other = threading.Thread(target=attempt)
        other.start()
        other.join()
        return free[0]

    def watched_fsync(fd: int) -> None:
        held_at_fsync.append(not lock_free())
        fsync(fd)

    monkeypatch.setattr(os, "fsync", watched_fsync)
    sealed = len(plog.segments) - 1
    assert sealed > 1 and plog.compress().segments_compressed == sealed
    monkeypatch.undo()
    # Each segment's frames, the directory, and its two index files.
    assert len(held_at_fsync) == 4 * sealed
    assert not any(held_at_fsync)
    assert [e.value for e in plog.events()] == values
    plog.close()
