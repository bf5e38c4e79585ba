"""[limits] sql_*: the fair queue of SQL places, the per-statement deadline, DuckDB's
memory cap with spilling, and shutdown interrupting what runs (docs/operations.md,
"Limits")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlkit import js, running

from headwater.errors import QueryExecutionError
from headwater.sql.limits import FairQueue, SqlLimits
from headwater.sql.service import SPILL_DIRECTORY
from waiting import TIMEOUT, wait_until_async

# Runs for minutes unless interrupted: a cross join DuckDB cannot shortcut.
SLOW = "SELECT count(*) FROM range(100000000) a, range(1000) b WHERE a.range + b.range < 0"


async def _holder(queue: FairQueue, tenant: int, name: str, granted: list[str]) -> None:
    await queue.acquire(tenant)
    granted.append(name)


def test_fair_queue_serves_tenants_in_turn_and_each_tenant_in_order() -> None:
    async def main() -> None:
        queue = FairQueue(1)
        await queue.acquire(7)  # the place is taken: everyone below waits
        granted: list[str] = []
        arrivals = [(1, "a1"), (1, "a2"), (1, "a3"), (1, "a4"), (2, "b1"), (3, "c1"), (2, "b2")]
        tasks = []
        for queued, (tenant, name) in enumerate(arrivals, 1):
            tasks.append(asyncio.create_task(_holder(queue, tenant, name, granted)))
            await wait_until_async(lambda n=queued: queue.queued == n)  # arrival order
        assert queue.queued_for(1) == 4 and queue.running == 1
        for count in range(1, len(arrivals) + 1):
            queue.release()  # the holder is done: the place passes to exactly one waiter
            await wait_until_async(lambda c=count: len(granted) == c)
            assert queue.running == 1
        # Tenant 1 came first with four, yet 2 and 3 each wait for one of its turns only.
        assert granted == ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]
        await asyncio.gather(*tasks)
        queue.release()
        assert queue.running == 0 and queue.queued == 0

    asyncio.run(main())


def test_fair_queue_admits_up_to_capacity_and_newcomers_wait_behind_the_queue() -> None:
    async def main() -> None:
        queue = FairQueue(2)
        await queue.acquire(1)
        await queue.acquire(1)
        granted: list[str] = []
        first = asyncio.create_task(_holder(queue, 2, "first", granted))
        await wait_until_async(lambda: queue.queued == 1)
        queue.release()
        await first
        # One place free and nobody waiting: taken at once.
        queue.release()
        await queue.acquire(3)
        assert queue.running == 2
        waiting = asyncio.create_task(_holder(queue, 4, "waiting", granted))
        await wait_until_async(lambda: queue.queued == 1)
        queue.release()
        queue.release()  # two places free, one waiter: it gets one, the other is free
        await waiting
        assert granted == ["first", "waiting"] and queue.running == 1

    asyncio.run(main())


def test_fair_queue_skips_waiters_that_gave_up() -> None:
    async def main() -> None:
        queue = FairQueue(1)
        await queue.acquire(0)
        granted: list[str] = []
        gone = asyncio.create_task(_holder(queue, 1, "gone", granted))
        late = asyncio.create_task(_holder(queue, 2, "late", granted))
        stays = asyncio.create_task(_holder(queue, 3, "stays", granted))
        await wait_until_async(lambda: queue.queued == 3)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert queue.queued == 2
        # Handed the place, then cancelled before it ran: the place passes on.
        queue.release()
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
        await stays
        assert granted == ["stays"] and queue.running == 1 and queue.queued == 0

    asyncio.run(main())


def test_fair_queue_refuses_waiters_and_newcomers_once_refusing() -> None:
    async def main() -> None:
        queue = FairQueue(1)
        await queue.acquire(0)
        waiter = asyncio.create_task(queue.acquire(1))
        await wait_until_async(lambda: queue.queued == 1)
        shutting = QueryExecutionError("the server is shutting down")
        queue.refuse_all(shutting)
        with pytest.raises(QueryExecutionError, match="shutting down"):
            await waiter
        with pytest.raises(QueryExecutionError, match="shutting down"):
            await queue.acquire(2)
        queue.release()
        assert queue.running == 0

    asyncio.run(main())


def test_a_statement_past_sql_timeout_ms_is_cancelled_and_the_next_one_runs(
    tmp_path: Path,
) -> None:
    stopped_by: list[str] = []

    async def main() -> None:
        limits = SqlLimits(timeout_ms=300)
        async with running(tmp_path, limits=limits, on_limit=stopped_by.append) as (engine, sql):
            stream = await engine.create_stream(0, "s")
            await engine.append(0, stream.stream_id, [js(n=1), js(n=2)])
            with pytest.raises(QueryExecutionError) as caught:
                await sql.query(0, SLOW)
            assert caught.value.message == "query cancelled after 300 ms (limits.sql_timeout_ms)"
            with pytest.raises(QueryExecutionError, match=r"limits\.sql_timeout_ms"):
                await sql.query_at(0, SLOW, [], 2)
            result = await sql.query(0, "SELECT sum((json->>'n')::INT) FROM s")
            assert result.rows == [[3]]
            assert (sql.running_queries, sql.queued_queries) == (0, 0)

    asyncio.run(main())
    assert stopped_by == ["sql_timeout_ms", "sql_timeout_ms"]


def test_memory_past_sql_memory_mib_spills_or_fails_clearly(tmp_path: Path) -> None:
    stopped_by: list[str] = []

    async def main() -> None:
        # 64 MiB, not less: a spilling sort keeps blocks pinned per DuckDB thread, and at
        # 32 MiB a loaded CI run once failed to pin one (docs/operations.md).
        limits = SqlLimits(memory_mib=64, concurrency=1, spill_mib=2048)
        async with running(tmp_path, limits=limits, on_limit=stopped_by.append) as (engine, sql):
            stream = await engine.create_stream(0, "s")
            await engine.append(0, stream.stream_id, [js(n=i) for i in range(100)])
            setting = await sql.query(0, "SELECT current_setting('memory_limit')")
            assert setting.rows == [["64.0 MiB"]]
            # A sort of ~150 MiB of strings does not fit in 64 MiB: it spills and is right.
            spilled = await sql.query(
                0,
                "SELECT count(*), min(x), max(x) FROM (SELECT lpad(i::VARCHAR, 12, '0') || "
                "'abcdefghij' AS x FROM range(4000000) t(i) ORDER BY x DESC)",
            )
            assert spilled.rows == [[4000000, "000000000000abcdefghij", "000003999999abcdefghij"]]
            assert (tmp_path / SPILL_DIRECTORY).is_dir()
            # One string aggregate cannot spill: refused, naming the limit.
            with pytest.raises(QueryExecutionError) as caught:
                await sql.query(
                    0, "SELECT length(string_agg(i::VARCHAR, ',')) FROM range(30000000) t(i)"
                )
            assert "limits.sql_memory_mib" in caught.value.message
            assert "Out of Memory" in caught.value.message
            # Nothing stored was lost and the next statement runs.
            total = await sql.query(0, "SELECT count(*), sum((json->>'n')::INT) FROM s")
            assert total.rows == [[100, sum(range(100))]]

    asyncio.run(main())
    assert stopped_by == ["sql_memory_mib"]


def test_a_tenant_waits_for_one_turn_of_another_tenants_backlog(tmp_path: Path) -> None:
    async def main() -> None:
        limits = SqlLimits(concurrency=1, timeout_ms=600_000)
        async with running(tmp_path, limits=limits) as (_engine, sql):
            flood = [asyncio.create_task(sql.query(0, SLOW)) for _ in range(3)]
            await wait_until_async(lambda: sql.queued_queries == 2)
            other = asyncio.create_task(sql.query(42, "SELECT 42"))
            await wait_until_async(lambda: sql.queued_queries == 3)
            # Tenant 0's first scan ends (its client went away: interrupted); its second
            # runs, and after it tenant 42's query, before tenant 0's third.
            flood[0].cancel()
            await wait_until_async(lambda: sql.queued_queries == 2)
            assert not other.done()
            flood[1].cancel()
            # Bounded: under first-come order it would wait for the third scan's run.
            assert (await asyncio.wait_for(other, TIMEOUT)).rows == [[42]]
            assert not flood[2].done() and sql.running_queries == 1 and sql.queued_queries == 0
            flood[2].cancel()
            outcomes = await asyncio.gather(*flood, return_exceptions=True)
            assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
            await wait_until_async(lambda: sql.running_queries == 0)

    asyncio.run(main())


def test_stop_queries_interrupts_running_statements_and_refuses_queued_ones(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        limits = SqlLimits(concurrency=1, timeout_ms=600_000)
        async with running(tmp_path, limits=limits) as (_engine, sql):
            scan = asyncio.create_task(sql.query(0, SLOW))
            queued = asyncio.create_task(sql.query(42, "SELECT 1"))
            await wait_until_async(lambda: sql.running_queries == 1 and sql.queued_queries == 1)
            sql.stop_queries()
            with pytest.raises(QueryExecutionError) as caught:
                await scan
            assert caught.value.message == "query cancelled: the server is shutting down"
            with pytest.raises(QueryExecutionError, match="the server is shutting down"):
                await queued
            with pytest.raises(QueryExecutionError, match="the server is shutting down"):
                await sql.query(0, "SELECT 1")

    asyncio.run(main())
