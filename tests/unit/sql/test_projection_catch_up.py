"""When stream projections catch up: commits no longer start a round each (they arm a
short timer and the round takes everything committed meanwhile), while everyone who
needs the projection now still gets it at once: a Query sees every acknowledged write, a
QueryAt that finds the projection behind starts it, and a backlog of a full round does
not wait."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlkit import js, running

from headwater.errors import ProjectionLag
from headwater.sql import projection as projection_module
from headwater.sql.projection import ChunkBuilder
from headwater.sql.values import QueryResult
from waiting import wait_until_async


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


def test_query_at_behind_starts_the_round_and_a_full_round_does_not_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(projection_module, "CATCH_UP_DELAY", 3600.0)  # never on its own
    monkeypatch.setattr(projection_module, "ROUND_ROWS", 100)

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
            # A full round's worth committed at once is projected without anyone asking.
            await engine.append(0, s.stream_id, [b"x"] * 150)
            await wait_until_async(lambda: projection.next_offset >= 151, 10, "no full round")
            assert (await sql.query(0, "SELECT count(*) FROM s")).rows == [[151]]

    asyncio.run(main())
