"""AioFsync: fdatasync through Linux AIO, completions on the loop; refusals fall back to
the fsync threads with the same outcome (plain asyncio.run; no pytest-asyncio)."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from headwater.storage import aio_fsync
from headwater.storage.aio_fsync import AioFsync
from headwater.storage.group_commit import GroupCommitter
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy


@pytest.fixture(autouse=True)
def aio_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """AIO must be there on the machines the suite runs on (Linux on x86-64 or arm64):
    its absence fails the run. Each test starts with it enabled."""
    assert aio_fsync._SYSCALL is not None, "no Linux AIO syscalls on this machine"
    monkeypatch.setattr(AioFsync, "disabled", False)


def test_fdatasyncs_complete_on_the_loop_and_the_last_user_closes_the_context(
    tmp_path: Path,
) -> None:
    files = [os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT) for i in range(3)]
    for fd in files:
        os.write(fd, b"x" * 10_000)
    ended: list[tuple[int, int, bool]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        first = AioFsync.acquire(loop)
        second = AioFsync.acquire(loop)
        assert first is not None and second is first  # one context per loop
        done = asyncio.Event()

        def callback(fd: int) -> Callable[[int], None]:
            def call(res: int) -> None:
                ended.append((fd, res, threading.current_thread() is threading.main_thread()))
                if len(ended) == len(files):
                    done.set()

            return call

        for fd in files:
            assert first.fdatasync(fd, callback(fd))
        await asyncio.wait_for(done.wait(), timeout=30)
        first.release()
        assert AioFsync._by_loop.get(loop) is second  # one user left: still open
        second.release()
        assert loop not in AioFsync._by_loop
        assert not first.fdatasync(files[0], callback(files[0]))  # closed: not started

    asyncio.run(main())
    assert sorted(ended) == sorted((fd, 0, True) for fd in files)
    for fd in files:
        os.close(fd)


def test_a_file_without_aio_fsync_turns_aio_off_and_the_fsync_threads_take_over(
    tmp_path: Path,
) -> None:
    """A pipe has no fsync: io_submit refuses it (EINVAL), as a kernel or file system
    without AIO fsync would. Nothing is started or called back, and every later sync
    uses the threads: a committer's appends are still acknowledged."""
    read_end, write_end = os.pipe()
    called: list[int] = []
    plog = PartitionLog.open(tmp_path / "log", LogConfig(sync=SyncPolicy.parse("fsync")))

    async def main() -> None:
        fsync = AioFsync.acquire(asyncio.get_running_loop())
        assert fsync is not None
        assert not fsync.fdatasync(write_end, called.append)
        assert AioFsync.disabled
        assert AioFsync.acquire(asyncio.get_running_loop()) is None
        fsync.release()
        committer = GroupCommitter(plog)
        info = plog.append([b"a"], first_position=0, timestamp_ms=0)
        await asyncio.wait_for(committer.committed(info.next_offset), timeout=30)
        assert plog.durable_offset == 1 and committer._aio is None
        await committer.aclose()

    asyncio.run(main())
    assert called == []
    os.close(read_end)
    os.close(write_end)
    plog.close()


def test_a_full_ring_sends_that_sync_to_a_thread_and_keeps_aio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """io_submit's EAGAIN (every slot of the ring in flight) is for now only: that sync
    runs in an fsync thread, AIO stays on, and the appends are acknowledged."""
    assert aio_fsync._SYSCALL is not None
    real_call, numbers = aio_fsync._SYSCALL
    refused: list[int] = []

    def full(number: int, *args: Any) -> int:
        if number == numbers[3]:  # io_submit
            refused.append(1)
            ctypes.set_errno(errno.EAGAIN)
            return -1
        return real_call(number, *args)

    monkeypatch.setattr(aio_fsync, "_SYSCALL", (full, numbers))
    in_threads: list[str] = []
    real_fdatasync = os.fdatasync

    def recording(fd: int) -> None:
        in_threads.append(threading.current_thread().name)
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", recording)
    plog = PartitionLog.open(tmp_path, LogConfig(sync=SyncPolicy.parse("fsync")))

    async def main() -> None:
        committer = GroupCommitter(plog)
        for i in range(3):
            info = plog.append([b"%d" % i], first_position=0, timestamp_ms=0)
            await asyncio.wait_for(committer.committed(info.next_offset), timeout=30)
            assert plog.durable_offset == i + 1
        assert committer._aio is not None  # taken, and kept
        await committer.aclose()

    asyncio.run(main())
    assert not AioFsync.disabled
    assert len(refused) == 3
    assert [name.startswith("hw-fsync") for name in in_threads[:3]] == [True] * 3
    plog.close()
