"""The pool of large segment read buffers: reused once nothing refers to them, never
while a view is held, and never keeping more than its bound."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest

from headwater.storage import segment
from headwater.storage.segment import (
    BUFFER_ROUND,
    POOLED_READ,
    ReadBuffers,
    WouldBlock,
    _read,
    no_wait,
)

MIB = 1 << 20


def test_an_idle_buffer_is_reused_and_a_held_one_is_not() -> None:
    pool = ReadBuffers(8 * MIB)
    first = pool.take(2 * MIB)
    first_id = id(first)  # the pool keeps it, so the id stays its own
    view = memoryview(first)[:10]  # a batch of a read, still held by a reader
    del first
    second = pool.take(2 * MIB)
    assert id(second) != first_id
    view.release()
    del view
    again = pool.take(2 * MIB)
    assert id(again) == first_id  # nobody refers to it any more
    assert pool.held_bytes() == 4 * MIB


def test_a_far_larger_idle_buffer_is_not_lent_to_a_small_read() -> None:
    pool = ReadBuffers(64 * MIB)
    big = pool.take(16 * MIB)
    del big
    small = pool.take(MIB)
    assert len(small) == MIB  # a reader keeping this does not pin 16 MiB
    del small
    assert len(pool.take(12 * MIB)) == 16 * MIB  # the big one, idle, fits this one


def test_the_pool_never_keeps_more_than_its_bound() -> None:
    pool = ReadBuffers(4 * MIB)
    held = [pool.take(MIB) for _ in range(10)]  # all in use at once
    assert all(len(b) == MIB for b in held)
    assert pool.held_bytes() == 4 * MIB  # six went unpooled (freed when dropped)
    del held
    # Idle buffers of the wrong size make room for the size now asked for.
    wanted = pool.take(3 * MIB)
    assert len(wanted) == 3 * MIB
    assert pool.held_bytes() <= 4 * MIB


def test_large_reads_use_the_pool_and_short_ones_end_at_the_file_end(tmp_path: Path) -> None:
    path = tmp_path / "data"
    data = os.urandom(POOLED_READ + 5 * BUFFER_ROUND // 4)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        whole = _read(fd, len(data) + 100, 0)  # past the end: short, as pread is
        assert isinstance(whole, memoryview)
        assert bytes(whole) == data
        tail = _read(fd, 100, len(data) - 50)
        assert bytes(tail) == data[-50:]
    finally:
        os.close(fd)


def test_a_no_wait_read_of_a_chunk_whose_end_is_not_cached_copies_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "data"
    path.write_bytes(os.urandom(4 * MIB))
    pool = ReadBuffers(8 * MIB)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no kernel read-ahead on fd
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.pread(fd, 2 * MIB, 0)  # the front is cached again, the end is not
        with mock.patch.object(segment, "READ_BUFFERS", pool):
            buffer = pool.take(4 * MIB)
            del buffer  # idle: the read below gets it
            try:
                with no_wait():
                    _read(fd, 4 * MIB, 0)
            except WouldBlock:
                pass
            else:
                pytest.skip("the kernel kept the pages cached; nothing to observe here")
            (lent,) = pool._buffers
            # The end was asked first: the cached front was not copied for nothing.
            assert bytes(lent[: 2 * MIB]) == bytes(2 * MIB)
        assert bytes(_read(fd, 4 * MIB, 0)) == path.read_bytes()
    finally:
        os.close(fd)
