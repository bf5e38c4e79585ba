"""No-wait reads: served from the page cache on the calling thread, or WouldBlock."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy
from headwater.storage.segment import WouldBlock, no_wait


def test_cached_data_reads_without_waiting(tmp_path: Path) -> None:
    plog = PartitionLog.open(tmp_path, LogConfig(sync=SyncPolicy("none")))
    for i in range(20):
        plog.append([b"v%d" % i] * 10, first_position=0, timestamp_ms=0)
    with no_wait():
        result = plog.read(0, 1 << 20)
    assert [e.value for e in result.events()] == [b"v%d" % (i // 10) for i in range(200)]
    plog.close()


def test_uncached_data_raises_would_block_and_reads_normally_after(tmp_path: Path) -> None:
    plog = PartitionLog.open(tmp_path, LogConfig(sync=SyncPolicy("fsync")))
    plog.append([b"x" * 1000] * 1000, first_position=0, timestamp_ms=0)
    plog.sync()
    # Evict this file's pages (they are clean after the fsync).
    with plog.active.pinned() as fd:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        with no_wait():
            plog.read(0, 1 << 20)
    except WouldBlock:
        pass  # the expected outcome where the kernel honours the eviction
    else:
        pytest.skip("the kernel kept the pages cached; nothing to observe here")
    assert plog.read(0, 1 << 20).count >= 1
    plog.close()
