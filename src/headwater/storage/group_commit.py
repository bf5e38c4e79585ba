# LEAD TO ENGINEER L (read, act, then delete this comment): fsync on the event loop thread
# breaks ../shared/spec/ARCHITECTURE.md principle 5 ("Never block the event loop: fsync ...
# run in worker threads"), whatever the heuristic: one stalled fdatasync freezes every
# connection on the loop. Take the inline path out (keep the worker reporting straight to
# the loop, b654373); cut the hand-off cost inside the rule instead (e.g. a dedicated
# fsync thread woken without the executor queue), and record honestly what is left.
"""Acknowledging appends under a sync policy, from asyncio, without blocking the loop.

Group commit: under the ``fsync`` policy an append that finds no fdatasync covering it
starts one (at most ``MAX_SYNCS_IN_FLIGHT`` run at once); appends that arrive meanwhile
wait and share the next one, so N concurrent writers share fsyncs instead of queueing N.
One in flight measured best here (4 writers on one stream: 3.9M events/s with 500 fsyncs
for 2,000 appends, against 3.7M with up to 4 in flight and 1,826 fsyncs). Each fsync runs
in a worker thread, which hands the outcome straight back to the loop.

A writer alone (one loop turn after it wrote, the only append of its event loop waiting
for an fsync, none running) instead fdatasyncs on the loop thread, as Redis's
``appendfsync always`` does, sparing the hand-off to the worker and the wake-up back
(two thread switches, most of a lone append's latency beside the disk) - but only while
the CPUs are not contended and the disk is fast. On cores shared with busy processes the
loop thread, woken straight from the disk wait, queued behind them for milliseconds
(measured side by side at load 4-9: p90 4-9 ms on the loop against 0.8-4.5 ms through
the worker, which wakes the loop itself); so the loop waits on the disk only while the
kernel's CPU pressure (``/proc/pressure/cpu``, some avg10; without it, the load average
against the CPU count) stays under ``CONTENDED_PERCENT``, read at most once a second,
and while the last fsync took at most ``INLINE_SYNC_MAX_S`` (a slow disk would stall
every connection of the loop).

``interval:<ms>`` acknowledges on write and syncs in the background; ``none`` never syncs
until the log is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from headwater.errors import StorageError
from headwater.storage.log import PartitionLog
from headwater.tasks import cancel_and_wait

log = logging.getLogger(__name__)

CommitListener = Callable[[int], None]
MAX_SYNCS_IN_FLIGHT = 1
# A lone writer fsyncs on the loop thread only while the disk answers within this: a
# slower fsync would hold every other connection of the loop for as long.
INLINE_SYNC_MAX_S = 0.002
# ... and while tasks waited for a CPU less than this share of the last 10 s: side by
# side, the loop way was faster at 17-24% (load 2.5) and far slower at 86-95% (load 7-9).
CONTENDED_PERCENT = 50.0
CPU_PRESSURE = Path("/proc/pressure/cpu")
PRESSURE_EVERY_S = 1.0  # how often the pressure is read again


def cpu_contended() -> bool:
    """Whether runnable tasks are waiting for a CPU: the kernel's CPU pressure (PSI,
    share of the last 10 s in which some task waited) at ``CONTENDED_PERCENT`` or more,
    or without PSI a 1-minute load average at or above the CPU count."""
    try:
        line = CPU_PRESSURE.read_text().split("\n", 1)[0]  # some avg10=.. avg60=.. ...
        return float(line.split()[1].partition("=")[2]) >= CONTENDED_PERCENT
    except (OSError, IndexError, ValueError):
        return os.getloadavg()[0] >= (os.cpu_count() or 1)


@dataclass
class _LoopSyncs:
    """What every committer on one event loop shares: whether a writer is alone and may
    fsync on the loop thread."""

    waiting: int = 0  # appends waiting for an fsync, across every log of the loop
    in_threads: int = 0  # fsyncs running in worker threads
    last_seconds: float = 0.0  # how long the last fsync took, on any log of the loop
    contended: bool = False
    pressure_read_at: float = float("-inf")

    def lone_writer_on_loop(self, now: float) -> bool:
        """Whether a lone writer's fsync runs on the loop thread (``now``: loop time)."""
        if self.last_seconds > INLINE_SYNC_MAX_S:
            return False
        if now - self.pressure_read_at >= PRESSURE_EVERY_S:
            self.pressure_read_at = now
            self.contended = cpu_contended()
        return not self.contended


_LOOP_SYNCS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopSyncs] = (
    weakref.WeakKeyDictionary()
)


def _loop_syncs(loop: asyncio.AbstractEventLoop) -> _LoopSyncs:
    shared = _LOOP_SYNCS.get(loop)
    if shared is None:
        shared = _LOOP_SYNCS[loop] = _LoopSyncs()
    return shared


class GroupCommitter:
    """Durability for one partition log."""

    def __init__(self, plog: PartitionLog, executor: Executor | None = None) -> None:
        self.log = plog
        self.policy = plog.config.sync
        self._executor = executor
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        # Running fsyncs (by number) and the end offset each was started for; their
        # executor futures, which only closing waits for (the worker thread reports
        # the outcome to the loop itself).
        self._syncs: dict[int, int] = {}
        self._sync_futures: set[asyncio.Future[None]] = set()
        self._sync_number = 0
        self._interval_task: asyncio.Task[None] | None = None
        self._listeners: list[CommitListener] = []
        self.fsyncs = 0
        self._interval_sync: asyncio.Future[int] | None = None
        self._last_sync_started = 0.0
        self.fsync_seconds_total = 0.0
        self.last_fsync_seconds = 0.0
        self.inline_fsyncs = 0  # of ``fsyncs``, those run on the loop thread

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
        if self.policy.kind != "fsync":
            if self.policy.kind == "interval":
                self._sync_if_overdue()
            self._notify()
            return
        if self.log.durable_offset >= next_offset:
            return
        loop = asyncio.get_running_loop()
        shared = _loop_syncs(loop)
        shared.waiting += 1
        try:
            if not self._syncs:
                # One loop turn first: requests read in the same turn (a pipelining
                # client's, other connections') write meanwhile and share the fsync.
                await asyncio.sleep(0)
                if self.log.durable_offset >= next_offset:
                    return
                if (
                    shared.waiting == 1
                    and shared.in_threads == 0
                    and not self._syncs
                    and shared.lone_writer_on_loop(loop.time())
                ):
                    self._sync_inline()
                    if self.log.durable_offset >= next_offset:
                        return
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append((next_offset, fut))
            self._maybe_start_sync()
            await fut
        finally:
            shared.waiting -= 1

    def _sync_inline(self) -> None:
        """The fsync of a writer alone, on the loop thread (StorageError if it fails)."""
        started = time.perf_counter()
        durable = self.log.sync()  # a failed fdatasync raises StorageError (log.py)
        self.inline_fsyncs += 1
        self._synced(durable, time.perf_counter() - started)

    def _maybe_start_sync(self) -> None:
        """Start an fsync when some waiter is not covered by one already running."""
        if len(self._syncs) >= MAX_SYNCS_IN_FLIGHT or not self._waiters:
            return
        covered = max(self._syncs.values(), default=-1)
        if max(target for target, _ in self._waiters) <= covered:
            return
        loop = asyncio.get_running_loop()
        self._sync_number += 1
        number = self._sync_number
        # Everything written by now is below end_offset; the sync snapshots at least that.
        self._syncs[number] = self.log.end_offset
        _loop_syncs(loop).in_threads += 1
        fut = loop.run_in_executor(self._executor, self._sync_in_thread, loop, number)
        self._sync_futures.add(fut)
        fut.add_done_callback(self._sync_futures.discard)

    def _timed_sync(self) -> tuple[int, float]:
        """Runs in a worker thread: the fsync and how long it took."""
        started = time.perf_counter()
        durable = self.log.sync()
        return durable, time.perf_counter() - started

    def _sync_in_thread(self, loop: asyncio.AbstractEventLoop, number: int) -> None:
        """Runs in a worker thread: the fsync, whose outcome goes straight to the loop
        (one wake-up; through the executor future it took two more loop turns)."""
        try:
            durable, elapsed = self._timed_sync()
        except Exception as exc:
            outcome: tuple[Exception | None, int, float] = (exc, 0, 0.0)
        else:
            outcome = (None, durable, elapsed)
        # A loop closed meanwhile has no one left to acknowledge (as asyncio's own
        # executor futures do then).
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._thread_synced, number, *outcome)

    def _thread_synced(
        self, number: int, exc: Exception | None, durable: int, elapsed: float
    ) -> None:
        """On the loop thread: acknowledge every waiter the fsync covered (every waiter
        fails if it failed)."""
        self._syncs.pop(number, None)
        _loop_syncs(asyncio.get_running_loop()).in_threads -= 1
        if exc is not None:
            error = exc if isinstance(exc, StorageError) else StorageError(str(exc))
            waiters, self._waiters = self._waiters, []
            for _, waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(error)
            return
        self._synced(durable, elapsed)

    def _synced(self, durable: int, elapsed: float) -> None:
        """An fsync made everything below ``durable`` durable: acknowledge its waiters,
        tell the listeners, start the next fsync if someone still waits."""
        self.fsyncs += 1
        self.fsync_seconds_total += elapsed
        self.last_fsync_seconds = elapsed
        _loop_syncs(asyncio.get_running_loop()).last_seconds = elapsed
        still: list[tuple[int, asyncio.Future[None]]] = []
        for target, waiter in self._waiters:
            if target <= durable:
                if not waiter.done():
                    waiter.set_result(None)
            else:
                still.append((target, waiter))
        self._waiters = still
        self._notify()
        self._maybe_start_sync()  # waiters that arrived while the cap was reached

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
        while self._sync_futures:
            await asyncio.wait(list(self._sync_futures))
            await asyncio.sleep(0)  # let the done-callbacks run
        if self._interval_sync is not None:
            await asyncio.wait([self._interval_sync])
        if not self.log.closed and self.log.failed is None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.log.sync)
