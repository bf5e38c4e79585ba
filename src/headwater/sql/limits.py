"""What bounds one server's SQL: run time, memory and how many queries run at once.

* :class:`SqlLimits` is ``[limits] sql_*`` as the SQL service takes it (the server
  config's own type lives above this layer).
* :class:`FairQueue` admits ``sql_concurrency`` queries at once; the rest wait their turn,
  taken round-robin between tenants and first-come within a tenant, so one tenant's flood
  of scans delays its own queries, not another tenant's.
* :class:`Deadline` cancels one running query (DuckDB's ``interrupt``) when its time is
  up or the server shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass

import duckdb

# DuckDB drops an interrupt that arrives between two statements of a cursor (it resets
# the flag when the next one starts), so an expired deadline interrupts again at this
# pace until the worker has returned.
REINTERRUPT_SECONDS = 0.05


@dataclass(frozen=True, slots=True)
class SqlLimits:
    """``[limits]``'s SQL keys (docs/operations.md, "Limits")."""

    timeout_ms: int = 30_000  # a query running longer is cancelled
    memory_mib: int = 256  # DuckDB memory per running query (past it: spill, then fail)
    concurrency: int = 2  # queries running at once; the rest wait, fairly per tenant
    spill_mib: int = 4096  # disk all running queries may spill to, together
    result_mib: int = 32  # a result costing more (Arrow, Python values, answer) is refused

    @property
    def database_memory_mib(self) -> int:
        """DuckDB's ``memory_limit``: it is one budget for the whole database (DuckDB
        has no per-query limit), so it is the per-query share times the queries that
        can run at once."""
        return self.memory_mib * self.concurrency


class FairQueue:
    """At most ``capacity`` holders at once; waiters are served round-robin by tenant
    and in arrival order within a tenant.

    ``acquire(tenant)`` returns once the caller holds a place; every successful acquire
    is matched by one ``release()``. A released place passes straight to the next
    waiter, so a newcomer never overtakes the queue. Loop thread only."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a FairQueue admits at least one holder")
        self.capacity = capacity
        self.running = 0
        # Tenants with waiters, in turn order (a dict keeps insertion order): the first
        # is served next, then goes to the back if it has more waiting.
        self._waiting: dict[int, deque[asyncio.Future[None]]] = {}
        self._refusal: Exception | None = None

    @property
    def queued(self) -> int:
        return sum(len(waiters) for waiters in self._waiting.values())

    def queued_for(self, tenant: int) -> int:
        return len(self._waiting.get(tenant, ()))

    async def acquire(self, tenant: int) -> None:
        if self._refusal is not None:
            raise self._refusal
        if self.running < self.capacity and not self._waiting:
            self.running += 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self.release()  # handed a place just as the waiter gave up: pass it on
            else:
                self._forget(tenant, turn)
            raise

    def release(self) -> None:
        while self._waiting:
            tenant = next(iter(self._waiting))
            waiters = self._waiting.pop(tenant)
            turn = waiters.popleft()
            if waiters:
                self._waiting[tenant] = waiters  # back of the line of tenants
            if not turn.done():
                turn.set_result(None)  # the place passes on: ``running`` is unchanged
                return
        self.running -= 1

    def refuse_all(self, error: Exception) -> None:
        """Fail every waiter and every later ``acquire`` with ``error`` (shutdown);
        holders keep their places until they release them."""
        self._refusal = error
        waiting, self._waiting = self._waiting, {}
        for waiters in waiting.values():
            for turn in waiters:
                if not turn.done():
                    turn.set_exception(error)

    def _forget(self, tenant: int, turn: asyncio.Future[None]) -> None:
        waiters = self._waiting.get(tenant)
        if waiters is None:
            return
        with contextlib.suppress(ValueError):
            waiters.remove(turn)
        if not waiters:
            del self._waiting[tenant]


class Deadline:
    """Interrupts one running query's cursor when its time is up (``timed_out``) or when
    :meth:`stop` is called (``stopped``: shutdown, or its client went away). Loop
    thread only; the cursor is closed by the owner after :meth:`finished`."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, cursor: duckdb.DuckDBPyConnection, seconds: float
    ) -> None:
        self._loop = loop
        self._cursor = cursor
        self.timed_out = False
        self.stopped = False
        self._done = False
        self._timer: asyncio.TimerHandle | None = loop.call_later(seconds, self._expire)

    def _expire(self) -> None:
        self.timed_out = True
        self._interrupt()

    def stop(self) -> None:
        if not self._done and not self.timed_out:
            self.stopped = True
        self._interrupt()

    def _interrupt(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._done:
            return
        with contextlib.suppress(duckdb.Error):
            self._cursor.interrupt()
        self._timer = self._loop.call_later(REINTERRUPT_SECONDS, self._interrupt)

    def finished(self) -> None:
        """The worker returned: no more interrupts (the cursor may be closed now)."""
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
