"""SQL over a partitioned stream: one table of every partition's events with a
``partition`` column last; QueryAt cuts all partitions at one tenant log position;
partitions added later join the table; a one-partition stream keeps its columns."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlkit import js, running

from headwater.engine.engine import StreamSettings
from headwater.engine.partitioner import keyed_partition
from headwater.sql import projection as projection_module
from headwater.sql.check import verify_projections
from headwater.sql.sealed import list_sealed, projection_directory


def test_partition_column_is_last_and_counts_match(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            info = await engine.create_stream(0, "orders", StreamSettings(partitions=4))
            keys = [f"user-{i}".encode() for i in range(40)]
            values = [js(user=k.decode(), n=i) for i, k in enumerate(keys)]
            await engine.append_partitioned(0, info.stream_id, values, keys=keys)
            result = await sql.query(0, "SELECT * FROM orders LIMIT 1")
            assert result.columns == ["offset", "position", "ts", "data", "json", "partition"]
            rows = await sql.query(
                0,
                "SELECT partition, count(*) FROM orders GROUP BY partition ORDER BY partition",
            )
            expected: dict[int, int] = {}
            for key in keys:
                p = keyed_partition(key, 4)
                expected[p] = expected.get(p, 0) + 1
            assert rows.rows == [[p, n] for p, n in sorted(expected.items())]
            # Each partition's events in append order (positions are given per
            # partition's batch, so they order partitions, not the request's events).
            users = await sql.query(
                0, "SELECT json->>'user', partition FROM orders ORDER BY partition, \"offset\""
            )
            by_partition = sorted(keys, key=lambda k: keyed_partition(k, 4))
            assert users.rows == [[k.decode(), keyed_partition(k, 4)] for k in by_partition]

            plain = await engine.create_stream(0, "plain")
            await engine.append(0, plain.stream_id, [js(a=1)])
            one = await sql.query(0, "SELECT * FROM plain")
            assert one.columns == ["offset", "position", "ts", "data", "json"]

    asyncio.run(main())


def test_query_at_is_exact_across_partitions_and_new_partitions_join(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            info = await engine.create_stream(0, "s", StreamSettings(partitions=3))
            heads = []
            for i in range(6):
                await engine.append(0, info.stream_id, [js(i=i)], partition=i % 3)
                heads.append(engine.tenant(0).committed_position)
            await sql.query(0, "SELECT 1")  # projections caught up
            for n, head in enumerate(heads, start=1):
                result = await sql.query_at(0, "SELECT count(*) FROM s", [], head)
                assert result.rows == [[n]]
            await engine.alter_partitions(0, info.stream_id, 5)
            await engine.append(0, info.stream_id, [js(i=6)], partition=4)
            rows = await sql.query(0, "SELECT partition, count(*) FROM s GROUP BY 1 ORDER BY 1")
            assert rows.rows == [[0, 2], [1, 2], [2, 2], [4, 1]]

    asyncio.run(main())


def test_check_holds_each_partitions_projection_files_against_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(projection_module, "SEAL_ROWS", 20)
    monkeypatch.setattr(projection_module, "ROUND_ROWS", 10)

    async def write() -> None:
        async with running(tmp_path) as (engine, sql):
            info = await engine.create_stream(0, "s", StreamSettings(partitions=2))
            for first in range(0, 100, 10):
                values = [js(i=i) for i in range(first, first + 10)]
                await engine.append(0, info.stream_id, values, partition=1)
            await engine.append(0, info.stream_id, [js(i=-1)], partition=0)
            assert (await sql.query(0, "SELECT count(*) FROM s")).rows == [[101]]

    asyncio.run(write())
    reports = {(r.name, r.partition): r for r in verify_projections(tmp_path)}
    assert set(reports) == {("s", 0), ("s", 1)}
    one = reports[("s", 1)]
    assert one.files >= 3 and not one.damaged
    assert reports[("s", 0)].files == 0  # one event: nothing sealed
    files = [p for _, _, p in list_sealed(projection_directory(one.stream_dir, 1))]
    files[1].unlink()
    damaged = [r for r in verify_projections(tmp_path) if r.damaged]
    assert [(r.partition, len(r.problems)) for r in damaged] == [(1, 1)]
    assert "logged but in no file" in damaged[0].problems[0]
    repaired = [r for r in verify_projections(tmp_path, repair=True) if r.repaired]
    assert [r.partition for r in repaired] == [1]
    assert not [r for r in verify_projections(tmp_path) if r.damaged]
    assert files[1].exists()
