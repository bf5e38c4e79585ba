"""When stream projections catch up: commits no longer start a round each (they arm a
short timer and the round takes everything committed meanwhile), while everyone who
needs the projection now still gets it at once: a Query sees every acknowledged write, a
QueryAt that finds the projection behind starts it, and a backlog of BACKLOG_ROWS does
not wait. While the stream is written hard the round waits for the writes to pause, up
to CATCH_UP_MAX_DELAY."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from sqlkit import CONFIG, js, running

from headwater.errors import ProjectionLag
from headwater.sql import projection as projection_module
from headwater.sql.projection import ChunkBuilder, StreamProjection
from headwater.sql.values import QueryResult
from headwater.storage.aio_fsync import AioFsync
from headwater.storage.log import PartitionLog, SyncPlan
from waiting import scheduled_callbacks_run, wait_until_async


def count_rounds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of each chunk built (one per catch-up round here)."""
    built: list[int] = []
    build = ChunkBuilder.build

    def counting(self: ChunkBuilder, pieces: list[projection_module._Piece]) -> object:
        chunk = build(self, pieces)
        built.append(chunk.rows)
        return chunk

    monkeypatch.setattr(ChunkBuilder, "build", counting)
    return built


def test_single_event_commits_share_rounds_and_queries_see_every_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(projection_module, "CATCH_UP_DELAY", 0.5)
    rounds = count_rounds(monkeypatch)

    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            s = await engine.create_stream(0, "s")
            for i in range(40):
                await engine.append(0, s.stream_id, [js(i=i)])
            # Read your writes: the Query starts the round itself.
            assert (await sql.query(0, "SELECT count(*) FROM s")).rows == [[40]]
            assert len(rounds) < 40 and sum(rounds) == 40
            projection = sql.streams.projection(0, "s")
            assert projection is not None
            # Without a query, the timer catches up (with everything committed meanwhile).
            before = len(rounds)
            for i in range(40, 60):
                await engine.append(0, s.stream_id, [js(i=i)])
            await wait_until_async(lambda: projection.next_offset >= 60, 10, "no catch-up")
            assert sum(rounds) == 60 and len(rounds) - before < 20
            result = await sql.query(0, "SELECT sum((json->>'i')::INT), count(*) FROM s")
            assert result.rows == [[sum(range(60)), 60]]

    asyncio.run(main())


def test_query_at_behind_starts_the_round_and_a_large_backlog_does_not_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(projection_module, "CATCH_UP_DELAY", 3600.0)  # never on its own
    monkeypatch.setattr(projection_module, "ROUND_ROWS", 100)
    monkeypatch.setattr(projection_module, "BACKLOG_ROWS", 100)

    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            s = await engine.create_stream(0, "s")
            await engine.append(0, s.stream_id, [b"1"])
            head = engine.tenant(0).committed_position

            # The projection is behind (its timer is an hour): QueryAt says so,
            # retryably, and starts the round; a retry then succeeds.
            async def answered() -> QueryResult | None:
                try:
                    return await sql.query_at(0, "SELECT count(*) FROM s", [], head)
                except ProjectionLag:
                    return None

            result = await wait_until_async(answered, 10, "QueryAt never caught up")
            assert result.rows == [[1]]
            projection = sql.streams.projection(0, "s")
            assert projection is not None
            # A backlog of BACKLOG_ROWS committed at once is projected without anyone
            # asking, in rounds back to back.
            await engine.append(0, s.stream_id, [b"x"] * 250)
            await wait_until_async(lambda: projection.next_offset >= 251, 10, "no catch-up")
            assert (await sql.query(0, "SELECT count(*) FROM s")).rows == [[251]]

    asyncio.run(main())


def count_timer_firings(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The loop time of each firing of a projection's catch-up timer."""
    fired: list[float] = []
    timer_fired = StreamProjection._timer_fired

    def counting(self: StreamProjection) -> None:
        fired.append(asyncio.get_running_loop().time())
        timer_fired(self)

    monkeypatch.setattr(StreamProjection, "_timer_fired", counting)
    return fired


def test_rounds_wait_while_the_stream_is_written_hard_and_run_once_it_pauses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(projection_module, "CATCH_UP_DELAY", 0.05)
    monkeypatch.setattr(projection_module, "CATCH_UP_QUIET", 0.2)  # every append is "hard"
    monkeypatch.setattr(projection_module, "CATCH_UP_MAX_DELAY", 3600.0)
    rounds = count_rounds(monkeypatch)
    fired = count_timer_firings(monkeypatch)

    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            s = await engine.create_stream(0, "s")
            appended = 0
            # Appends, the loop free between them, until the timer has fired twice:
            # under CATCH_UP_DELAY alone the first firing ran a round.
            while len(fired) < 2:
                await engine.append(0, s.stream_id, [js(i=appended)])
                appended += 1
                await scheduled_callbacks_run()  # a loop turn: the timer runs when due
            assert rounds == []
            projection = sql.streams.projection(0, "s")
            assert projection is not None
            # The writes pause: the round runs without anyone asking, with everything.
            await wait_until_async(
                lambda: projection.next_offset >= appended, 10, "no catch-up after the writes"
            )
            assert sum(rounds) == appended and len(rounds) == 1
            result = await sql.query(0, "SELECT count(*) FROM s")
            assert result.rows == [[appended]]

    asyncio.run(main())


def test_a_stream_written_without_pause_is_projected_after_the_max_delay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(projection_module, "CATCH_UP_DELAY", 0.05)
    monkeypatch.setattr(projection_module, "CATCH_UP_QUIET", 3600.0)  # never pauses
    monkeypatch.setattr(projection_module, "CATCH_UP_MAX_DELAY", 0.3)
    rounds = count_rounds(monkeypatch)

    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            s = await engine.create_stream(0, "s")
            projection = sql.streams.projection(0, "s")
            assert projection is not None
            loop = asyncio.get_running_loop()
            started = loop.time()
            appended = 0
            while not rounds:  # the writer never pauses, yet a round comes
                await engine.append(0, s.stream_id, [js(i=appended)])
                appended += 1
                await scheduled_callbacks_run()  # a loop turn: the timer runs when due
            # Not at CATCH_UP_DELAY: at the max delay from the first commit.
            assert loop.time() - started >= 0.3
            await wait_until_async(lambda: projection.next_offset > 0, 10, "round not installed")

    asyncio.run(main())


def test_rounds_wait_while_appends_wait_for_their_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Commits far apart do not make a stream quiet while an append waits for its fsync
    # (a loaded machine spaces a hard writer's commits out).
    monkeypatch.setattr(projection_module, "CATCH_UP_DELAY", 0.05)
    monkeypatch.setattr(projection_module, "CATCH_UP_QUIET", 0.05)
    monkeypatch.setattr(projection_module, "CATCH_UP_MAX_DELAY", 3600.0)
    rounds = count_rounds(monkeypatch)
    fired = count_timer_firings(monkeypatch)
    gate = threading.Event()
    sync = PartitionLog.sync_planned
    # The fsyncs go through the threads, where the test can hold one (through AIO the
    # kernel runs it).
    monkeypatch.setattr(AioFsync, "disabled", True)

    def gated_sync(self: PartitionLog, plan: SyncPlan | None) -> int:
        gate.wait(30)  # the fsync thread holds the append until the test lets it go
        return sync(self, plan)

    async def main() -> None:
        async with running(tmp_path, CONFIG) as (engine, sql):
            s = await engine.create_stream(0, "s")
            projection = sql.streams.projection(0, "s")
            assert projection is not None
            await engine.append(0, s.stream_id, [js(i=0)])  # committed: arms the timer
            monkeypatch.setattr(PartitionLog, "sync_planned", gated_sync)
            pending = asyncio.create_task(engine.append(0, s.stream_id, [js(i=1)]))
            try:
                # Three firings, the last ones long after the only commit, or a round.
                await wait_until_async(lambda: len(fired) >= 3 or rounds, 10, "no timer")
                assert rounds == [] and not pending.done()
            finally:
                gate.set()
            await pending
            await wait_until_async(lambda: projection.next_offset >= 2, 10, "no catch-up")
            assert sum(rounds) == 2

    asyncio.run(main())
