"""GroupCommitter: shared fsyncs under ``fsync``, background syncs under ``interval``,
none under ``none`` (plain asyncio.run; no pytest-asyncio). Every test runs twice: with
the active segment's fsyncs through Linux AIO (aio_fsync.py, the default where the
kernel has it) and through the fsync threads (the fallback)."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from headwater.errors import HeadwaterError, NotLeader, StorageError
from headwater.storage import aio_fsync
from headwater.storage.aio_fsync import AioFsync, SyncDone
from headwater.storage.group_commit import FsyncThreads, GroupCommitter
from headwater.storage.log import LogConfig, PartitionLog, SyncPlan, SyncPolicy
from waiting import scheduled_callbacks_run, wait_until, wait_until_async


@pytest.fixture(autouse=True, params=["aio", "threads"])
def fsync_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which way the active segment's fsyncs go. AIO must be there on the machines
    the suite runs on (Linux on x86-64 or arm64): its absence fails the run."""
    if request.param == "aio":
        assert aio_fsync._SYSCALL is not None, "no Linux AIO syscalls on this machine"
    monkeypatch.setattr(AioFsync, "disabled", request.param == "threads")
    return str(request.param)


def open_log(path: Path, policy: str) -> PartitionLog:
    return PartitionLog.open(path, LogConfig(sync=SyncPolicy.parse(policy)))


def count_syncs(plog: PartitionLog) -> list[int]:
    """Wrap ``plog.end_sync`` so every sync that ends (from any thread, by any path)
    is recorded."""
    calls: list[int] = []
    real: Callable[[SyncPlan, OSError | None], int] = plog.end_sync

    def counting(plan: SyncPlan, error: OSError | None) -> int:
        calls.append(1)
        return real(plan, error)

    plog.end_sync = counting  # type: ignore[method-assign]
    return calls


def break_fsyncs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fsync from now on fails with EIO, a thread's and an AIO one."""

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    def broken_aio(aio: AioFsync, fd: int, done: SyncDone) -> bool:
        aio.loop.call_soon(done, -errno.EIO)
        return True

    monkeypatch.setattr(os, "fdatasync", broken)
    monkeypatch.setattr(AioFsync, "fdatasync", broken_aio)


class HeldFsyncs:
    """The committer's fsyncs do not end until :meth:`release`: a thread's fdatasync
    waits, an AIO one's completion is delivered only then (on the loop). ``entered``:
    one has started."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self._released = threading.Event()
        self._late: list[tuple[SyncDone, int]] = []
        real = os.fdatasync
        real_aio = AioFsync.fdatasync

        def held(fd: int) -> None:
            if threading.current_thread().name.startswith("hw-fsync"):
                self.entered.set()
                assert self._released.wait(30)
            real(fd)

        def held_aio(aio: AioFsync, fd: int, done: SyncDone) -> bool:
            def late(res: int) -> None:
                if self._released.is_set():
                    done(res)
                else:
                    self._late.append((done, res))

            started = real_aio(aio, fd, late)
            self.entered.set()
            return started

        monkeypatch.setattr(os, "fdatasync", held)
        monkeypatch.setattr(AioFsync, "fdatasync", held_aio)

    def release(self) -> None:
        """On the loop: let every held fsync end."""
        self._released.set()
        late, self._late = self._late, []
        for done, res in late:
            done(res)


def test_concurrent_waiters_share_fsyncs(tmp_path: Path) -> None:
    plog = open_log(tmp_path, "fsync")
    calls = count_syncs(plog)
    writers, rounds = 20, 3

    async def main() -> None:
        committer = GroupCommitter(plog)
        seen: list[int] = []
        committer.add_listener(seen.append)

        async def writer(w: int) -> list[int]:
            acked = []
            for r in range(rounds):
                # One turn of the loop (not a wait for time): all writers append in the
                # same turn, so their waits for an fsync overlap.
                await scheduled_callbacks_run()
                info = plog.append([b"w%d-r%d" % (w, r)], first_position=0, timestamp_ms=0)
                await committer.committed(info.next_offset)
                # Acknowledged means durable and readable.
                assert plog.durable_offset >= info.next_offset
                assert plog.committed_offset >= info.next_offset
                acked.append(info.base_offset)
            return acked

        results = await asyncio.wait_for(
            asyncio.gather(*(writer(w) for w in range(writers))), timeout=60
        )
        total = writers * rounds
        assert sorted(o for acked in results for o in acked) == list(range(total))
        assert plog.committed_offset == plog.durable_offset == total
        assert 1 <= committer.fsyncs < total
        assert len(calls) == committer.fsyncs
        assert committer.fsync_seconds_total >= committer.last_fsync_seconds >= 0
        # Listeners heard about the commits, ending at the final committed offset.
        assert seen and seen == sorted(seen) and seen[-1] == total
        await committer.aclose()

    asyncio.run(main())
    assert [e.value for e in plog.read(0, max_events=1).events()] == [b"w0-r0"]
    plog.close()


def test_appends_of_one_loop_turn_share_one_fsync(tmp_path: Path) -> None:
    """Requests read in the same loop turn (a pipelining client's) all write before the
    fsync starts, so one fsync acknowledges them all (the first used to start an fsync
    for itself alone, and the rest waited for a second)."""
    plog = open_log(tmp_path, "fsync")
    calls = count_syncs(plog)

    async def main() -> None:
        committer = GroupCommitter(plog)

        async def writer(i: int) -> None:
            info = plog.append([b"%d" % i], first_position=0, timestamp_ms=0)
            await committer.committed(info.next_offset)
            assert plog.durable_offset >= info.next_offset

        await asyncio.gather(*(writer(i) for i in range(5)))
        assert committer.fsyncs == 1

    asyncio.run(main())
    assert len(calls) == 1 and plog.durable_offset == 5
    plog.close()


def test_one_appender_after_another_each_gets_an_fsync(tmp_path: Path) -> None:
    plog = open_log(tmp_path, "fsync")

    async def main() -> None:
        committer = GroupCommitter(plog)
        for i in range(3):
            info = plog.append([b"%d" % i], first_position=0, timestamp_ms=0)
            await committer.committed(info.next_offset)
            assert plog.committed_offset == i + 1
        assert committer.fsyncs == 3
        # Waiting for something already durable costs nothing.
        await committer.committed(2)
        await committer.committed(3)
        assert committer.fsyncs == 3

    asyncio.run(main())
    plog.close()


def test_no_fsync_runs_on_the_loop_thread_not_even_a_lone_writers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync_path: str
) -> None:
    """ARCHITECTURE.md, principle 5: the loop keeps serving while the disk syncs. No
    fdatasync is called on the loop thread: through AIO the loop only submits it and
    the kernel runs it; through the threads, the last fsync below waits for a callback
    it hands to the loop: run on the loop thread it could never see it (the wait's
    deadline fails the test)."""
    plog = open_log(tmp_path, "fsync")
    on_loop: list[bool] = []  # per fdatasync call: on the main (the loop's) thread?
    real = os.fdatasync

    def recording(fd: int) -> None:
        on_loop.append(threading.current_thread() is threading.main_thread())
        real(fd)

    monkeypatch.setattr(os, "fdatasync", recording)
    submitted: list[int] = []  # AIO fdatasyncs submitted
    real_aio = AioFsync.fdatasync

    def submitting(aio: AioFsync, fd: int, done: SyncDone) -> bool:
        submitted.append(fd)
        return real_aio(aio, fd, done)

    monkeypatch.setattr(AioFsync, "fdatasync", submitting)
    recorded = plog.sync_planned
    loop_ran = threading.Event()

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def waits_for_the_loop(plan: SyncPlan | None) -> int:
            loop.call_soon_threadsafe(loop_ran.set)
            assert loop_ran.wait(timeout=30), "the loop did not run while the fsync ran"
            return recorded(plan)

        committer = GroupCommitter(plog)
        for i in range(3):  # one writer at a time: always alone
            info = plog.append([b"%d" % i], first_position=0, timestamp_ms=0)
            await committer.committed(info.next_offset)
            assert plog.durable_offset == i + 1
        plog.sync_planned = waits_for_the_loop  # type: ignore[method-assign]
        info = plog.append([b"3"], first_position=0, timestamp_ms=0)
        await committer.committed(info.next_offset)
        assert loop_ran.is_set() == (fsync_path == "threads")
        assert plog.durable_offset == 4 and committer.fsyncs == 4
        plog.sync_planned = recorded  # type: ignore[method-assign]
        await committer.aclose()

    asyncio.run(main())
    assert not any(on_loop)
    calls = (len(on_loop), len(submitted))
    assert calls == ((4, 0) if fsync_path == "threads" else (0, 4))
    plog.close()


def test_failed_fsync_fails_every_waiter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plog = open_log(tmp_path, "fsync")
    plog.append([b"ok"], first_position=0, timestamp_ms=0)
    plog.sync()

    async def main() -> None:
        committer = GroupCommitter(plog)
        break_fsyncs(monkeypatch)

        async def writer(i: int) -> None:
            info = plog.append([b"%d" % i], first_position=0, timestamp_ms=0)
            await committer.committed(info.next_offset)

        results = await asyncio.wait_for(
            asyncio.gather(*(writer(i) for i in range(5)), return_exceptions=True), timeout=30
        )
        assert len(results) == 5
        assert all(isinstance(r, StorageError) for r in results)
        assert plog.committed_offset == 1  # nothing new was acknowledged
        # After a failed fsync the log refuses further writes.
        with pytest.raises(StorageError):
            plog.append([b"later"], first_position=0, timestamp_ms=0)

    asyncio.run(main())
    monkeypatch.undo()
    plog.close()


def test_commit_then_calls_back_once_the_fsync_covers_the_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The callback form a front end answers a lone append from: called on the loop
    after the fdatasync that covers the append (not before: it is not durable yet), at
    once when it already is, with the error when the fsync failed."""
    plog = open_log(tmp_path, "fsync")
    loop_thread = threading.get_ident()
    calls: list[tuple[StorageError | None, int, bool]] = []

    def done(error: StorageError | None) -> None:
        calls.append((error, plog.durable_offset, threading.get_ident() == loop_thread))

    async def main() -> None:
        committer = GroupCommitter(plog)
        info = plog.append([b"a"], first_position=0, timestamp_ms=0)
        committer.commit_then(info.next_offset, done)
        assert calls == []  # written, not yet durable: no answer
        await wait_until_async(lambda: calls, 30, "the callback never came")
        assert calls == [(None, 1, True)] and committer.fsyncs == 1
        committer.commit_then(info.next_offset, done)  # durable already: at once
        assert calls[1:] == [(None, 1, True)] and committer.fsyncs == 1

        break_fsyncs(monkeypatch)
        info = plog.append([b"b"], first_position=0, timestamp_ms=0)
        committer.commit_then(info.next_offset, done)
        await wait_until_async(lambda: len(calls) == 3, 30, "the failure was never reported")
        error, durable, on_loop = calls[2]
        assert isinstance(error, StorageError) and durable == 1 and on_loop
        monkeypatch.undo()

    asyncio.run(main())
    plog.close()


def test_appends_cut_from_the_log_fail_their_waiters(tmp_path: Path) -> None:
    """A replica's log cut under appends still waiting for their fsync (leadership moved
    away): their waiters get the cut's error at once, a waiter at or below the cut is
    still acknowledged, and the committer goes on (closes, acknowledges new appends).
    Left waiting, they hung forever and every fsync's return started another."""
    plog = open_log(tmp_path, "fsync")
    plog.append([b"kept"], first_position=0, timestamp_ms=0)
    calls: list[tuple[int, HeadwaterError | None]] = []

    async def main() -> None:
        committer = GroupCommitter(plog)
        committer.commit_then(1, lambda error: calls.append((1, error)))
        for target in (2, 3):
            plog.append([b"cut %d" % target], first_position=0, timestamp_ms=0)
            committer.commit_then(target, lambda error, t=target: calls.append((t, error)))
        # Cut in the same loop turn: no fsync has started yet.
        end = plog.truncate_to(1)
        assert end == 1
        committer.cut(end, NotLeader("moved"))
        assert [(t, type(e)) for t, e in calls] == [(2, NotLeader), (3, NotLeader)]
        await wait_until_async(lambda: len(calls) == 3, 30, "the kept append was never acked")
        assert calls[2] == (1, None)
        info = plog.append([b"after"], first_position=0, timestamp_ms=0)
        await asyncio.wait_for(committer.committed(info.next_offset), timeout=30)
        fsyncs = committer.fsyncs
        await asyncio.wait_for(committer.aclose(), timeout=30)
        assert committer.fsyncs == fsyncs  # no fsync started for the appends cut

    asyncio.run(main())
    assert [e.value for e in plog.read(0).events()] == [b"kept", b"after"]
    plog.close()


def test_an_append_cut_without_cut_fails_at_the_next_fsync(tmp_path: Path) -> None:
    """Should a truncater not call cut(), the next fsync's return fails the appends past
    the log's end (no fsync can cover them: NotLeader, since only a replica that no
    longer leads is cut) instead of starting fsync after fsync."""
    plog = open_log(tmp_path, "fsync")
    calls: list[tuple[int, HeadwaterError | None]] = []

    async def main() -> None:
        committer = GroupCommitter(plog)
        for target in (1, 2):
            plog.append([b"e%d" % target], first_position=0, timestamp_ms=0)
            committer.commit_then(target, lambda error, t=target: calls.append((t, error)))
        plog.truncate_to(1)
        await wait_until_async(lambda: len(calls) == 2, 30, "the waiters were never answered")
        assert calls[0] == (1, None)
        assert calls[1][0] == 2 and isinstance(calls[1][1], NotLeader)
        fsyncs = committer.fsyncs
        await asyncio.wait_for(committer.aclose(), timeout=30)
        assert committer.fsyncs == fsyncs

    asyncio.run(main())
    plog.close()


def test_an_fsync_in_flight_across_a_cut_does_not_make_the_cut_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fsync that started before the log was cut returns after it: the offsets it
    saw are gone, so it neither acknowledges them nor raises the durable offset past the
    end (an append written there afterwards would be acknowledged without an fsync, and
    a follower would fetch from past its own end)."""
    plog = open_log(tmp_path, "fsync")
    plog.sync()  # the log's first (its directory too): the next are the file's alone
    held = HeldFsyncs(monkeypatch)
    calls: list[tuple[int, HeadwaterError | None]] = []

    async def main() -> None:
        committer = GroupCommitter(plog)
        loop = asyncio.get_running_loop()
        for target in (1, 2, 3):
            plog.append([b"e%d" % target], first_position=0, timestamp_ms=0)
            committer.commit_then(target, lambda error, t=target: calls.append((t, error)))
        assert await loop.run_in_executor(None, held.entered.wait, 30)
        end = await loop.run_in_executor(None, plog.truncate_to, 0)
        held.release()  # the fsync returns before the truncater's cut(): the fallback
        await wait_until_async(lambda: len(calls) == 3, 30, "the waiters were never answered")
        assert [(t, type(e)) for t, e in calls] == [(t, NotLeader) for t in (1, 2, 3)]
        committer.cut(end, NotLeader("moved"))  # late: nothing left to fail
        assert plog.durable_offset <= plog.end_offset == 0
        fsyncs = committer.fsyncs
        info = plog.append([b"new"], first_position=0, timestamp_ms=0)
        await asyncio.wait_for(committer.committed(info.next_offset), timeout=30)
        assert committer.fsyncs > fsyncs  # acknowledged by an fsync of its own
        assert plog.durable_offset == plog.end_offset == 1
        await asyncio.wait_for(committer.aclose(), timeout=30)

    asyncio.run(main())
    monkeypatch.undo()
    assert [e.value for e in plog.read(0).events()] == [b"new"]
    plog.close()


def test_a_sync_pins_the_active_file_before_a_truncation_can_close_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A truncation replaces (and closes) the active segment. A sync that took the
    segment under the log's lock and pinned its file after letting go of it failed
    with "was removed" when a cut came in between, and every waiter, those below the
    cut too, got that error. The pin is taken under the lock now, so a truncation waits
    for it and the file closes only when the sync lets go."""
    plog = open_log(tmp_path, "fsync")
    for i in range(3):
        plog.append([b"e%d" % i], first_position=0, timestamp_ms=0)
    pinned_under_lock: list[bool] = []
    real_pin = plog.files.pin

    def pin(handle: Any) -> int:
        pinned_under_lock.append(plog._lock._is_owned())  # type: ignore[attr-defined]
        return real_pin(handle)

    monkeypatch.setattr(plog.files, "pin", pin)
    assert plog.sync() == 3
    assert pinned_under_lock == [True]
    monkeypatch.undo()
    plog.close()


def test_interval_policy_syncs_in_the_background(tmp_path: Path) -> None:
    plog = open_log(tmp_path, "interval:20")
    calls = count_syncs(plog)

    async def main() -> None:
        committer = GroupCommitter(plog)
        committer.start()
        committer.start()  # idempotent
        info = plog.append([b"a", b"b"], first_position=0, timestamp_ms=0)
        # Acknowledged on write: no fsync is awaited.
        await asyncio.wait_for(committer.committed(info.next_offset), timeout=5)
        assert plog.committed_offset == 2
        await wait_until_async(lambda: plog.durable_offset == 2 and committer.fsyncs >= 1)
        # Every fsync started has been counted: none is in flight.
        await wait_until_async(lambda: committer.fsyncs == len(calls))
        settled = committer.fsyncs
        # Nothing new written: the background loop wakes and has nothing to sync.
        wakes = committer.interval_wakes
        await wait_until_async(lambda: committer.interval_wakes >= wakes + 3)
        assert committer.fsyncs == settled and len(calls) == settled
        info = plog.append([b"c"], first_position=2, timestamp_ms=0)
        await wait_until_async(lambda: plog.durable_offset == 3 and committer.fsyncs > settled)
        await committer.aclose()
        assert committer._interval_task is None

    asyncio.run(main())
    plog.close()


def test_none_policy_never_fsyncs_until_close(tmp_path: Path) -> None:
    plog = open_log(tmp_path, "none")
    calls = count_syncs(plog)
    heard: list[int] = []

    async def main() -> None:
        committer = GroupCommitter(plog)
        committer.add_listener(heard.append)
        committer.start()  # no background task for 'none'
        for i in range(10):
            info = plog.append([b"%d" % i], first_position=0, timestamp_ms=0)
            await asyncio.wait_for(committer.committed(info.next_offset), timeout=5)
            assert plog.committed_offset == i + 1
        # Nothing syncs later either: no fsync was started, and no background task is
        # there to start one.
        assert committer._interval_task is None
        assert committer.fsyncs == 0
        assert calls == []
        assert plog.durable_offset == 0
        assert heard == list(range(1, 11))
        await committer.aclose()  # closing makes everything durable
        assert len(calls) == 1
        assert plog.durable_offset == 10

    asyncio.run(main())
    plog.close()


def test_listener_errors_do_not_fail_appends(tmp_path: Path) -> None:
    plog = open_log(tmp_path, "fsync")
    good: list[int] = []

    def bad(_offset: int) -> None:
        raise RuntimeError("listener bug")

    async def main() -> None:
        committer = GroupCommitter(plog)
        committer.add_listener(bad)
        committer.add_listener(good.append)
        info = plog.append([b"x"], first_position=0, timestamp_ms=0)
        await committer.committed(info.next_offset)
        committer.remove_listener(good.append)
        committer.remove_listener(good.append)  # removing twice is harmless
        info = plog.append([b"y"], first_position=0, timestamp_ms=0)
        await committer.committed(info.next_offset)

    asyncio.run(main())
    assert good == [1]
    plog.close()


def test_fsync_threads_run_at_most_their_cap_at_once_and_queue_the_rest() -> None:
    """Past ``max_threads`` jobs wait for a thread to free up; every job runs once."""
    threads = FsyncThreads(max_threads=2)
    release = threading.Event()
    lock = threading.Lock()
    running: list[int] = []
    peak: list[int] = [0]
    finished: list[int] = []
    all_done = threading.Event()
    jobs = 7

    def job(n: int) -> Callable[[], None]:
        def run() -> None:
            with lock:
                running.append(n)
                peak[0] = max(peak[0], len(running))
            assert release.wait(timeout=30)
            with lock:
                running.remove(n)
                finished.append(n)
                if len(finished) == jobs:
                    all_done.set()

        return run

    for n in range(jobs):
        threads.submit(job(n))
    # Both threads hold a job and the other five wait in the queue.
    wait_until(lambda: len(running) == 2)
    assert not finished
    release.set()
    assert all_done.wait(timeout=30)
    assert sorted(finished) == list(range(jobs))
    assert peak[0] == 2
    # The two threads are reused: a later job starts no third one.
    after = threading.Event()
    threads.submit(after.set)
    assert after.wait(timeout=30)
    assert threads._threads == 2


def test_closing_waits_for_the_fsync_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aclose returns only after the fsync running for a waiter has reported back."""
    plog = open_log(tmp_path, "fsync")
    plog.sync()  # the log's first (its directory too): the next are the file's alone
    order: list[str] = []
    real_end: Callable[[SyncPlan, OSError | None], int] = plog.end_sync

    def ended(plan: SyncPlan, error: OSError | None) -> int:
        order.append("fsync")
        return real_end(plan, error)

    plog.end_sync = ended  # type: ignore[method-assign]
    # Only the committer's fsync is held; closing's own last sync (an executor
    # thread's) runs at once, so a close that did not wait would end before it.
    held = HeldFsyncs(monkeypatch)

    async def main() -> None:
        committer = GroupCommitter(plog)
        info = plog.append([b"x"], first_position=0, timestamp_ms=0)
        append = asyncio.ensure_future(committer.committed(info.next_offset))
        await wait_until_async(held.entered.is_set)
        closing = asyncio.ensure_future(committer.aclose())
        # Released once closing waits for it (a close that did not wait never would).
        await wait_until_async(lambda: committer._syncs_ended is not None)
        held.release()
        await asyncio.wait_for(closing, timeout=30)
        order.append("closed")
        await asyncio.wait_for(append, timeout=30)
        assert plog.durable_offset == 1

    asyncio.run(main())
    # The held one ended, then the close (whose own sync had nothing left to do).
    assert order == ["fsync", "closed"]
    plog.close()


def test_a_forked_child_gets_fsync_threads_of_its_own(tmp_path: Path) -> None:
    """The parent's fsync threads do not exist in a forked child: its fsyncs still run
    (they would wait forever on a queue no thread reads)."""
    plog = open_log(tmp_path / "parent", "fsync")

    async def one_append(log: PartitionLog) -> None:
        committer = GroupCommitter(log)
        info = log.append([b"x"], first_position=0, timestamp_ms=0)
        await asyncio.wait_for(committer.committed(info.next_offset), timeout=30)
        await committer.aclose()

    asyncio.run(one_append(plog))  # the parent's threads exist now
    plog.close()
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if its append was acknowledged
        code = 1
        try:
            child_log = open_log(tmp_path / "child", "fsync")
            asyncio.run(one_append(child_log))
            code = 0 if child_log.durable_offset == 1 else 2
            child_log.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_sync_ending_after_another_failed_makes_nothing_durable(tmp_path: Path) -> None:
    """The kernel reports an fsync error once: a second sync planned beside a failed one
    may return success for data the first lost. Once the log is failed, no sync's end
    moves the durable offset."""
    plog = open_log(tmp_path, "fsync")
    plog.sync()
    plog.append([b"a"], first_position=0, timestamp_ms=0)
    first, second = plog.plan_sync(), plog.plan_sync()
    assert first is not None and second is not None
    with pytest.raises(StorageError):
        plog.end_sync(first, OSError(errno.EIO, "Input/output error"))
    with pytest.raises(StorageError):
        plog.end_sync(second, None)
    assert plog.durable_offset == 0
    plog.close()
