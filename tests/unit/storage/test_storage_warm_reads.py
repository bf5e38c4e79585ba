"""What a sequential reader of cached data costs the server per byte: each chunk it
reads ends at a batch boundary the offset index knows (nothing read past it that the
next chunk reads again), no read-ahead is asked for pages already cached, and the page
cache is asked about a range in one call (cachestat) with the same answer as mincore."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
from megabyte_batches import megabyte_batches_log

from headwater.storage import segment
from headwater.storage.segment import cached_share

MIB = 1 << 20


def test_warm_8_mib_pages_over_1_mb_batches_copy_each_batch_about_once(tmp_path: Path) -> None:
    # ReadEvents' 8 MiB pages over 1 MB batches: a page ends inside a batch, which the
    # next page reads again (one batch in nine), but no chunk copies part of a batch
    # past the page's last one: 1.14x the file was copied here before, 1.10x after
    # (1.26x and 1.11x in cold_read_bench's warm read of 1 GiB).
    plog, values = megabyte_batches_log(tmp_path)
    with plog.active.pinned() as fd:
        os.pread(fd, plog.active.size, 0)  # cached
        assert cached_share(fd, 0, plog.active.size) == 1.0
    copied = 0
    real_read = segment._read

    def counting_read(fd: int, length: int, pos: int) -> bytes | bytearray | memoryview:
        nonlocal copied
        data = real_read(fd, length, pos)
        copied += len(data)
        return data

    got: list[bytes] = []
    offset: int | None = 0
    with (
        mock.patch.object(segment, "_read", counting_read),
        mock.patch.object(segment.os, "posix_fadvise", wraps=os.posix_fadvise) as fadvise,
    ):
        while offset is not None:
            result = plog.read(offset, 8 * MIB)
            got += [e.value for e in result.events()]
            offset = result.next_offset
    assert got == values  # every batch's CRC checked on the bytes handed over
    assert copied < 1.12 * plog.active.size
    willneed = [c for c in fadvise.call_args_list if c.args[3] == os.POSIX_FADV_WILLNEED]
    assert willneed == []  # all cached: nothing to read ahead
    plog.close()


@pytest.mark.parametrize(
    ("pos", "length"),
    [(0, 8 * MIB), (12345, 9 * MIB), (MIB, 3 * MIB), (4 * MIB + 1, 2 * MIB), (0, 100)],
)
def test_cachestat_and_mincore_tell_the_same_share(tmp_path: Path, pos: int, length: int) -> None:
    path = tmp_path / "data"
    path.write_bytes(os.urandom(10 * MIB))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # only what is read is cached
        os.pread(fd, 3 * MIB, MIB)
        assert segment._cachestat_works  # the test machine's kernel has it (6.5+)
        with_cachestat = cached_share(fd, pos, length)
        with mock.patch.object(segment, "_cachestat_works", False):
            with_mincore = cached_share(fd, pos, length)
    finally:
        os.close(fd)
    assert with_cachestat == with_mincore
    assert 0.0 <= with_cachestat <= 1.0
