"""Sequential reads of data not in the page cache: a reader's chunks are read through the
cache with the kernel's read-ahead, and the pages it went past are dropped behind it; a
unit larger than a chunk is read around the cache (O_DIRECT). The same bytes as a warm
read, every batch's CRC still checked, each byte fetched from the disk about once, and
the stream not left in the page cache."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from unittest import mock

import pytest
from megabyte_batches import megabyte_batches_log

from headwater.errors import CorruptBatchError
from headwater.storage import segment
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy
from headwater.storage.segment import (
    DIRECT_READS,
    Segment,
    WouldBlock,
    _read_chunk,
    cached_share,
    no_wait,
)

MIB = 1 << 20
PAGE = 2 * MIB  # ReadEvents-sized reads: chunks over the pooled (and direct) size


def written_log(
    path: Path, batch: int = 500, count: int = 4000
) -> tuple[PartitionLog, list[bytes]]:
    """Batches of ``batch`` values of 1,000 bytes (``count`` of them: 4 MB by default,
    batch starts not aligned to pages), synced and evicted from the page cache."""
    plog = PartitionLog.open(path, LogConfig(sync=SyncPolicy("fsync")))
    values = [b"%07d" % i + bytes([65 + i % 26]) * 993 for i in range(count)]
    for i in range(0, len(values), batch):
        plog.append(values[i : i + batch], first_position=0, timestamp_ms=0)
    plog.sync()
    evict(plog)
    return plog, values


def log_cached_share(plog: PartitionLog, upto: float = 1.0) -> float:
    """The share of the pages of the log file's first ``upto`` in the page cache."""
    with plog.active.pinned() as fd:
        return cached_share(fd, 0, int(plog.active.log_path.stat().st_size * upto))


def disk_read_bytes() -> int:
    """Bytes this process has had fetched from storage (page cache fills and direct
    reads, not reads served from the cache)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


def evict(plog: PartitionLog) -> None:
    with plog.active.pinned() as fd:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    assert log_cached_share(plog) == 0  # the kernel dropped the clean pages


def read_all(plog: PartitionLog, start: int) -> tuple[list[bytes], bytes]:
    """Every value from ``start``, paging as ReadEvents does (a no-wait read first, as
    on the event loop, then a read that may wait, as in a worker: Engine.read), and the
    stored records."""
    values: list[bytes] = []
    records = b""
    offset: int | None = start
    while offset is not None:
        try:
            with no_wait():
                result = plog.read(offset, PAGE)
        except WouldBlock:
            result = plog.read(offset, PAGE)
        values += [e.value for e in result.events()]
        records += b"".join(bytes(c) for c in result.values_chunks())
        offset = result.next_offset
    return values, records


def flip_byte(path: Path, at: int) -> int:
    """Flip the lowest bit of the byte at ``at`` in ``path``; the byte as it was."""
    with open(path, "r+b") as f:
        f.seek(at)
        original = f.read(1)[0]
        f.seek(at)
        f.write(bytes([original ^ 0x01]))
    return original


@pytest.mark.parametrize("start", [0, 1, 777, 2501])
def test_uncached_data_is_read_byte_for_byte_and_dropped_behind_the_reader(
    tmp_path: Path, start: int
) -> None:
    plog, values = written_log(tmp_path, count=16000)  # 16 MB: 2 MiB pages leave many behind
    before = DIRECT_READS.sequential
    got, records = read_all(plog, start)
    assert DIRECT_READS.sequential > before
    assert got == values[start:]
    # The pages the reader went past are not left in the cache; at most its last reads'.
    assert log_cached_share(plog, upto=0.5) == 0
    assert log_cached_share(plog) < 0.5
    # The same read with the file in the page cache answers the same records, from it.
    plog.active.log_path.read_bytes()
    assert log_cached_share(plog) == 1
    disk = disk_read_bytes()
    assert read_all(plog, start) == (got, records)
    assert disk_read_bytes() == disk
    plog.close()


def test_reading_uncached_data_again_is_again_read_and_dropped(tmp_path: Path) -> None:
    # A no-wait read that finds a chunk not wholly cached gives up without reading: a
    # no-wait read of a missing page would start the kernel's read-ahead there outside a
    # run, and those pages would not be dropped.
    plog, values = written_log(tmp_path, count=16000)
    for _ in range(2):
        before = DIRECT_READS.sequential
        assert read_all(plog, 0)[0] == values
        assert DIRECT_READS.sequential > before
        assert log_cached_share(plog, upto=0.5) == 0
    plog.close()


def test_batches_larger_than_the_read_chunk_are_read_in_the_run_too(tmp_path: Path) -> None:
    # 2 MB batches read in 1 MiB pages: each batch is read whole, past the chunk, and
    # dropped behind the reader like its chunks.
    plog, values = written_log(tmp_path, batch=2000, count=16000)
    before = DIRECT_READS.sequential
    got: list[bytes] = []
    offset: int | None = 0
    while offset is not None:
        try:
            with no_wait():
                result = plog.read(offset, MIB)
        except WouldBlock:
            result = plog.read(offset, MIB)
        got += [e.value for e in result.events()]
        offset = result.next_offset
    assert got == values
    assert DIRECT_READS.sequential > before
    assert log_cached_share(plog, upto=0.5) == 0
    plog.close()


def test_pages_cut_inside_a_batch_read_each_batch_about_once(tmp_path: Path) -> None:
    # 8 MiB pages over 1 MB batches, as ReadEvents pages a cold stream: a page that needs
    # a little of one batch past its first chunk reads that batch, not a whole second
    # chunk that the next page (starting in that batch) reads again (1.35x the file
    # was read before, every other page reading 18 MiB).
    plog, values = megabyte_batches_log(tmp_path)
    evict(plog)
    before = disk_read_bytes()
    got: list[bytes] = []
    offset: int | None = 0
    while offset is not None:
        try:
            with no_wait():
                result = plog.read(offset, 8 * MIB)
        except WouldBlock:
            result = plog.read(offset, 8 * MIB)
        got += [e.value for e in result.events()]
        offset = result.next_offset
    assert got == values
    assert disk_read_bytes() - before < 1.06 * plog.active.size
    plog.close()


def cold_pages(tmp_path: Path) -> tuple[PartitionLog, list[bytes]]:
    """40 MB of 1 MB batches in three segments, not in the page cache."""
    plog, values = megabyte_batches_log(tmp_path, segment_bytes=16 * MIB)
    assert len(plog.segments) == 3
    for seg in plog.segments:
        with seg.pinned() as fd:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return plog, values


def segment_cached_share(seg: Segment, upto: float = 1.0) -> float:
    with seg.pinned() as fd:
        return cached_share(fd, 0, int(seg.size * upto))


def read_pages(plog: PartitionLog, got: list[bytes], page: int = 8 * MIB) -> None:
    """Every value in pages of ``page`` bytes, as a worker thread reads ReadEvents'."""
    offset: int | None = 0
    while offset is not None:
        result = plog.read(offset, page)
        got += [e.value for e in result.events()]
        offset = result.next_offset


@pytest.mark.parametrize("page", [MIB, 8 * MIB])
def test_cold_pages_are_read_from_the_disk_about_once_and_not_kept(
    tmp_path: Path, page: int
) -> None:
    # The kernel's read-ahead reads the pages after a chunk while it is checked; the
    # pages a reader went past are dropped at its next read, a segment read to its end
    # (its last read shorter than a pooled one, with 1 MiB pages) when the reader's run
    # in the next one begins.
    plog, values = cold_pages(tmp_path)
    before = disk_read_bytes(), DIRECT_READS.sequential
    got: list[bytes] = []
    read_pages(plog, got, page)
    assert got == values
    assert DIRECT_READS.sequential - before[1] >= 40 * MIB // page // 2
    file_bytes = sum(seg.size for seg in plog.segments)
    assert disk_read_bytes() - before[0] < 1.06 * file_bytes
    assert segment_cached_share(plog.segments[0]) == 0
    assert segment_cached_share(plog.segments[1]) == 0
    assert len(segment._cold_runs) <= segment.COLD_RUNS
    plog.close()


def test_a_damaged_byte_in_a_cold_run_is_refused(tmp_path: Path) -> None:
    plog, values = cold_pages(tmp_path)
    log_file = plog.segments[0].log_path
    damaged = log_file.stat().st_size * 3 // 4  # well past the first page's chunk
    original = flip_byte(log_file, damaged)
    with plog.segments[0].pinned() as fd:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    sequential = DIRECT_READS.sequential
    got: list[bytes] = []
    with pytest.raises(CorruptBatchError, match="CRC mismatch"):
        read_pages(plog, got)
    assert DIRECT_READS.sequential - sequential >= 2
    assert got == values[: len(got)] and 0 < len(got) < len(values)
    assert log_file.read_bytes()[damaged] == original ^ 0x01
    plog.close()


def test_a_damaged_byte_is_refused_on_the_cold_path(tmp_path: Path) -> None:
    plog, _ = written_log(tmp_path)
    log_file = plog.active.log_path
    damaged = log_file.stat().st_size // 2  # inside the values of a middle batch
    original = flip_byte(log_file, damaged)
    evict(plog)
    before = DIRECT_READS.sequential
    with pytest.raises(CorruptBatchError, match="CRC mismatch"):
        read_all(plog, 0)
    assert DIRECT_READS.sequential > before
    # The read changed nothing: the damaged byte is still the only difference.
    assert log_file.read_bytes()[damaged] == original ^ 0x01
    plog.close()


def test_a_damaged_batch_met_by_several_reads_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A reader and its read-ahead meet the same damaged batch: every read is refused,
    # the operator gets one ERROR line naming the file.
    plog, _ = written_log(tmp_path)
    log_file = plog.active.log_path
    flip_byte(log_file, log_file.stat().st_size // 2)
    evict(plog)
    with caplog.at_level(logging.ERROR, logger="headwater.storage.log"):
        for _ in range(3):
            with pytest.raises(CorruptBatchError, match="CRC mismatch"):
                read_all(plog, 0)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert log_file.name in errors[0].getMessage()
    plog.close()


def test_a_file_system_refusing_o_direct_is_read_through_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "data"
    data = os.urandom(3 * MIB)
    path.write_bytes(data)
    real_open = os.open

    def refuse_direct(file: str, flags: int, *args: int) -> int:
        if flags & segment._O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT refused")
        return real_open(file, flags, *args)

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages, which the eviction below drops
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert cached_share(fd, 0, len(data)) == 0
        with mock.patch.object(os, "open", refuse_direct):
            chunk, direct = _read_chunk(fd, 2 * MIB + 5, 1001)
        assert not direct
        assert bytes(chunk) == data[1001 : 1001 + 2 * MIB + 5]
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        chunk, direct = _read_chunk(fd, 2 * MIB + 5, 1001)
        assert direct
        assert bytes(chunk) == data[1001 : 1001 + 2 * MIB + 5]
        # Past the end of the file: short, as any read.
        chunk, direct = _read_chunk(fd, 2 * MIB, 2 * MIB)
        assert bytes(chunk) == data[2 * MIB :]
    finally:
        os.close(fd)
