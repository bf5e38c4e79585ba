"""Acknowledging appends under a sync policy, from asyncio, without blocking the loop.

Group commit: under the ``fsync`` policy an append that finds no fdatasync covering it
starts one (at most ``MAX_SYNCS_IN_FLIGHT`` run at once); appends that arrive meanwhile
wait and share the next one, so N concurrent writers share fsyncs instead of queueing N.
One in flight measured best here (4 writers on one stream: 3.9M events/s with 500 fsyncs
for 2,000 appends, against 3.7M with up to 4 in flight and 1,826 fsyncs). Each fsync runs
in a worker thread, which hands the outcome straight back to the loop.

The worker threads are :class:`FsyncThreads`, long-lived and kept for fsyncs: a sync is
handed over as a plain callable on a queue (one futex wake) and reported with one
``call_soon_threadsafe``. Through ``run_in_executor`` it cost an executor future, an
asyncio future chained to it and a second wake-up of the loop to settle that chain, and
the worker ran Python (future and semaphore bookkeeping) after reporting, holding the
GIL the loop needed (docs/benchmarks.md: with the turn below, 0.80x the server's CPU
per single-event append).

Where the kernel has it, a sync of the active segment alone (nearly every one: a roll
or a directory change makes the exceptions) goes through Linux AIO instead
(:mod:`headwater.storage.aio_fsync`): the loop submits the fdatasync, a kernel worker
runs it and the loop hears of it on an eventfd, so no Python thread crosses the GIL for
it (a four-partition Kafka produce: 1.3-1.45x the messages per second; a lone append's
p50 0.05 ms longer: docs/benchmarks.md). The threads do every other sync, and all of them
where AIO is refused.

An fsync never runs on the loop thread (ARCHITECTURE.md, principle 5), not even a lone
writer's (Redis's ``appendfsync always`` fsyncs in its event loop): measured, that saved
a lone append the two thread switches (0.1-0.2 ms at load 2.5), but one slow fdatasync would hold
every connection of the loop for as long, and on busy cores the loop thread, woken from
the disk wait, queued behind other processes (p90 5-9 ms against 1.3-3.8 through the
worker at load 7-9).

``interval:<ms>`` acknowledges on write and syncs in the background; ``none`` never syncs
until the log is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor

from headwater.errors import HeadwaterError, NotLeader, StorageError
from headwater.storage.aio_fsync import AioFsync
from headwater.storage.log import PartitionLog, SyncPlan
from headwater.tasks import cancel_and_wait

log = logging.getLogger(__name__)

CommitListener = Callable[[int], None]
# What an acknowledgement calls: with None once acknowledged, with the error if the fsync
# failed or the append was cut from the log (:meth:`GroupCommitter.cut`).
CommitDone = Callable[[HeadwaterError | None], None]
MAX_SYNCS_IN_FLIGHT = 1
FSYNC_THREADS = 8  # at most this many fsyncs (of different logs) run at once


class FsyncThreads:
    """Long-lived threads that run the fsyncs of every committer in the process, one
    job (a callable, which reports its own outcome) at a time each. A thread is started
    only when none is idle, up to ``max_threads``; beyond that jobs queue. Daemon
    threads: a committer's ``aclose`` waits for its own fsyncs."""

    def __init__(self, max_threads: int = FSYNC_THREADS) -> None:
        self._max_threads = max_threads
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads waiting for a job and not yet promised one

    def submit(self, job: Callable[[], None]) -> None:
        name = None
        with self._lock:
            if self._idle:
                self._idle -= 1
            elif self._threads < self._max_threads:
                name = f"hw-fsync_{self._threads}"
                self._threads += 1
            # else every thread is busy: the job waits for the first one free
        self._jobs.put(job)
        if name is not None:
            threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        jobs = self._jobs
        while True:
            try:
                jobs.get()()  # a job reports its own outcome
            except Exception:
                log.exception("an fsync job failed")
            with self._lock:
                self._idle += 1


_fsync_threads: FsyncThreads | None = None
_fsync_threads_lock = threading.Lock()


def _forget_fsync_threads() -> None:
    """In a forked child: the parent's threads are not there, so it makes its own."""
    global _fsync_threads, _fsync_threads_lock
    _fsync_threads = None
    _fsync_threads_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_fsync_threads)


def fsync_threads() -> FsyncThreads:
    """The process's fsync threads (made at the first fsync)."""
    global _fsync_threads
    with _fsync_threads_lock:
        if _fsync_threads is None:
            _fsync_threads = FsyncThreads()
        return _fsync_threads


def _no_wait(error: HeadwaterError | None) -> None:
    """The acknowledgement of an append that needs no fsync: nothing waits for it."""


def _settle(fut: asyncio.Future[None], error: HeadwaterError | None) -> None:
    if fut.done():  # its waiter was cancelled
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _call(done: CommitDone, error: HeadwaterError | None) -> None:
    try:
        done(error)
    except Exception:  # one waiter's bug must not keep the others unanswered
        log.exception("an acknowledgement failed")


class GroupCommitter:
    """Durability for one partition log. Its ``fsync`` policy's syncs run on
    :func:`fsync_threads`; ``executor`` runs the rest (``interval`` syncs, the last sync
    at closing)."""

    def __init__(self, plog: PartitionLog, executor: Executor | None = None) -> None:
        self.log = plog
        self.policy = plog.config.sync
        self._executor = executor
        self._waiters: list[tuple[int, CommitDone]] = []
        # Running fsyncs (by number) and the end offset each was started for; closing
        # waits on ``_syncs_ended`` until none runs.
        self._syncs: dict[int, int] = {}
        self._syncs_ended: asyncio.Future[None] | None = None
        self._start_pending = False  # a start of an fsync is due after this loop turn
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sync_number = 0
        self._interval_task: asyncio.Task[None] | None = None
        self._listeners: list[CommitListener] = []
        self.fsyncs = 0
        self.interval_wakes = 0  # the interval policy's background loop: times it looked
        self._interval_sync: asyncio.Future[int] | None = None
        self._last_sync_started = 0.0
        self.fsync_seconds_total = 0.0
        self.last_fsync_seconds = 0.0
        # The loop's AIO fsyncs (aio_fsync.py), taken at the first sync; None: threads.
        self._aio: AioFsync | None = None
        self._aio_tried = False

    def add_listener(self, listener: CommitListener) -> None:
        """Call ``listener(committed_offset)`` whenever more events become readable."""
        self._listeners.append(listener)

    def remove_listener(self, listener: CommitListener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def readable_moved(self) -> None:
        """More events became readable without a commit (a cluster's high watermark
        moved): the listeners look again."""
        self._notify()

    def _notify(self) -> None:
        committed = self.log.committed_offset
        for listener in list(self._listeners):
            try:
                listener(committed)
            except Exception:  # a listener's bug must not fail the append
                log.exception("commit listener failed")

    def start(self) -> None:
        if self.policy.kind == "interval" and self._interval_task is None:
            self._interval_task = asyncio.get_running_loop().create_task(self._interval_loop())

    async def committed(self, next_offset: int) -> None:
        """Return once events below ``next_offset`` are acknowledged under the policy."""
        if self.policy.kind != "fsync" or self.log.durable_offset >= next_offset:
            self.commit_then(next_offset, _no_wait)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.commit_then(next_offset, functools.partial(_settle, fut))
        await fut

    def commit_then(self, next_offset: int, done: CommitDone) -> None:
        """Call ``done(None)`` once events below ``next_offset`` are acknowledged under
        the policy (before returning when they already are), ``done(error)`` if the
        fsync failed; on the loop thread. For a caller that is not a coroutine: a front
        end answering an append from here needs no task of its own."""
        if self.policy.kind != "fsync":
            if self.policy.kind == "interval":
                self._sync_if_overdue()
            self._notify()
            done(None)
            return
        if self.log.durable_offset >= next_offset:
            done(None)
            return
        self._waiters.append((next_offset, done))
        if self._syncs:
            self._maybe_start_sync()
        elif not self._start_pending:
            # The fsync starts after this loop turn: requests read in the same turn (a
            # pipelining client's, other connections') write meanwhile and share it.
            # One callback for them all, rather than each task taking a turn itself.
            self._start_pending = True
            self._loop = loop = asyncio.get_running_loop()  # the waiters' loop
            loop.call_soon(self._start_after_turn)

    def _start_after_turn(self) -> None:
        self._start_pending = False
        self._maybe_start_sync()

    def _maybe_start_sync(self) -> None:
        """Start an fsync when some waiter is not covered by one already running."""
        if len(self._syncs) >= MAX_SYNCS_IN_FLIGHT or not self._waiters:
            return
        covered = max(self._syncs.values(), default=-1)
        if max(target for target, _ in self._waiters) <= covered:
            return
        loop = self._loop  # set by commit_then(); a lookup is a getpid()
        assert loop is not None
        self._sync_number += 1
        number = self._sync_number
        # Everything written by now is below end_offset; the sync covers that.
        self._syncs[number] = self.log.end_offset
        try:
            plan = self.log.plan_sync()
        except Exception as exc:  # the active segment's file could not be opened
            loop.call_soon(self._sync_ended, number, exc, 0, 0.0)
            return
        if plan is None:  # nothing written since the last sync: what is durable stands
            loop.call_soon(self._sync_ended, number, None, self.log.durable_offset, 0.0)
            return
        if plan.file_only:
            if not self._aio_tried:
                self._aio_tried = True
                self._aio = AioFsync.acquire(loop)
            if self._aio is not None and self._aio.loop is loop:
                started = time.perf_counter()

                def done(res: int) -> None:
                    error = OSError(-res, os.strerror(-res)) if res < 0 else None
                    self._end_sync(number, plan, error, started)

                if self._aio.fdatasync(plan.fd, done):
                    return
        fsync_threads().submit(lambda: self._sync_in_thread(loop, number, plan))

    def _timed_sync(self, plan: SyncPlan | None = None) -> tuple[int, float]:
        """Runs in a worker thread: the sync (of ``plan``, or of everything written by
        now) and how long it took."""
        started = time.perf_counter()
        durable = self.log.sync() if plan is None else self.log.sync_planned(plan)
        return durable, time.perf_counter() - started

    def _sync_in_thread(self, loop: asyncio.AbstractEventLoop, number: int, plan: SyncPlan) -> None:
        """Runs in a worker thread: the sync, whose outcome goes straight to the loop
        (one wake-up; through the executor future it took two more loop turns)."""
        try:
            durable, elapsed = self._timed_sync(plan)
        except Exception as exc:
            outcome: tuple[Exception | None, int, float] = (exc, 0, 0.0)
        else:
            outcome = (None, durable, elapsed)
        # The report is the thread's last step before it waits again (releasing the
        # GIL the woken loop needs: no context manager's exit after it).
        try:
            loop.call_soon_threadsafe(self._sync_ended, number, *outcome)
        except RuntimeError:  # the loop closed: no one is left to acknowledge
            return

    def _end_sync(self, number: int, plan: SyncPlan, error: OSError | None, started: float) -> None:
        """On the loop: an AIO fdatasync of ``plan`` ended (``error``: it failed)."""
        try:
            durable = self.log.end_sync(plan, error)
        except Exception as exc:
            self._sync_ended(number, exc, 0, 0.0)
        else:
            self._sync_ended(number, None, durable, time.perf_counter() - started)

    def _sync_ended(self, number: int, exc: Exception | None, durable: int, elapsed: float) -> None:
        """On the loop thread: acknowledge every waiter the fsync covered (every waiter
        fails if it failed)."""
        self._syncs.pop(number, None)
        if not self._syncs and self._syncs_ended is not None:
            if not self._syncs_ended.done():
                self._syncs_ended.set_result(None)
            self._syncs_ended = None
        if exc is not None:
            error = exc if isinstance(exc, StorageError) else StorageError(str(exc))
            waiters, self._waiters = self._waiters, []
            for _, done in waiters:
                _call(done, error)
            return
        self._synced(durable, elapsed)

    def _synced(self, durable: int, elapsed: float) -> None:
        """An fsync made everything below ``durable`` durable: acknowledge its waiters,
        tell the listeners, start the next fsync if someone still waits."""
        self.fsyncs += 1
        self.fsync_seconds_total += elapsed
        self.last_fsync_seconds = elapsed
        still: list[tuple[int, CommitDone]] = []
        for target, done in self._waiters:
            if target <= durable:
                _call(done, None)
            else:
                still.append((target, done))
        self._waiters = still
        # An append is written before it waits, so a target past the end means the log
        # was cut under it: no fsync can ever cover it, and each would start another for
        # it. Its truncater fails it too (cut()), but an fsync may return first. Only a
        # replica that no longer leads is cut, so the client is told to ask the leader.
        self.cut(self.log.end_offset, NotLeader("the log was cut below this append"))
        self._notify()
        self._maybe_start_sync()  # waiters that arrived while the cap was reached

    async def truncate_to(self, offset: int, error: HeadwaterError) -> int:
        """:meth:`PartitionLog.truncate_to` in the executor (a replica's divergent tail, a
        replica moved off the node); the appends waiting past the new end fail with
        ``error`` at once (:meth:`cut`). The new end."""
        loop = asyncio.get_running_loop()
        end = await loop.run_in_executor(self._executor, self.log.truncate_to, offset)
        self.cut(end, error)
        return end

    def cut(self, end: int, error: HeadwaterError) -> None:
        """The log was cut at ``end`` (a replica's divergent tail, a replica moved off
        the node): every waiter for an append past it fails with ``error``. No fsync can
        cover those any more; left waiting, each answer would hang, and every fsync's
        return would start another for them."""
        cut = [done for target, done in self._waiters if target > end]
        if not cut:
            return
        self._waiters = [(target, done) for target, done in self._waiters if target <= end]
        for done in cut:
            _call(done, error)

    def _sync_if_overdue(self) -> None:
        """Start an fsync now when the last one began an interval ago or more. Submitted
        straight to a worker thread, so the promise holds even while a writer keeps the
        loop busy and the background timer cannot run."""
        loop = asyncio.get_running_loop()
        if self._interval_sync is not None:
            return
        if loop.time() - self._last_sync_started < self.policy.interval_ms / 1000:
            return
        self._last_sync_started = loop.time()
        fut = loop.run_in_executor(self._executor, self.log.sync)
        self._interval_sync = fut

        def done(f: asyncio.Future[int]) -> None:
            self._interval_sync = None
            self.fsyncs += 1
            if f.exception() is not None:
                log.error("interval fsync failed for %s: %s", self.log.directory, f.exception())

        fut.add_done_callback(done)

    async def _run_sync(self) -> int:
        loop = asyncio.get_running_loop()
        durable, elapsed = await loop.run_in_executor(self._executor, self._timed_sync)
        self.fsyncs += 1
        self.fsync_seconds_total += elapsed
        self.last_fsync_seconds = elapsed
        return durable

    async def _interval_loop(self) -> None:
        interval = self.policy.interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            if self.log.closed:
                return
            self.interval_wakes += 1
            if self.log.durable_offset < self.log.end_offset and self._interval_sync is None:
                self._last_sync_started = asyncio.get_running_loop().time()
                try:
                    await self._run_sync()
                except StorageError:
                    log.exception("interval fsync failed for %s", self.log.directory)
                    return

    async def aclose(self) -> None:
        """Stop background syncing and make everything written durable."""
        await cancel_and_wait(self._interval_task)
        self._interval_task = None
        while self._syncs:
            if self._syncs_ended is None or self._syncs_ended.done():
                self._syncs_ended = asyncio.get_running_loop().create_future()
            await self._syncs_ended
        if self._interval_sync is not None:
            await asyncio.wait([self._interval_sync])
        if self._aio is not None:
            self._aio.release()
            self._aio = None
        if not self.log.closed and self.log.failed is None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.log.sync)
