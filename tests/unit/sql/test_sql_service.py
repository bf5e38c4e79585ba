"""SqlService: queries over stream projections, QueryAt by tenant log position, read your
writes, tenant isolation, INSERT INTO, deletion and restart."""

from __future__ import annotations

import asyncio
import datetime
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlkit import CONFIG, js, running

from headwater.engine.engine import Engine, StreamSettings
from headwater.errors import (
    InvalidOffset,
    PositionAhead,
    ProjectionLag,
    QueryExecutionError,
    TableNotFound,
)
from headwater.sql import SqlService, Timestamp
from headwater.sql import service as service_module
from waiting import wait_until_async


def test_select_and_group_by_over_json_events(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            s = await engine.create_stream(0, "orders")
            events = [js(kind=k, amount=i) for i, k in enumerate("abcabca")]
            await engine.append(0, s.stream_id, [*events, b"not json", b"\xff\xfe", b""])
            result = await sql.query(
                0,
                "SELECT json->>'kind' AS kind, count(*) AS n, sum((json->>'amount')::INT) AS t "
                "FROM orders WHERE json IS NOT NULL GROUP BY 1 ORDER BY 1",
            )
            assert result.columns == ["kind", "n", "t"]
            assert result.rows == [["a", 3, 0 + 3 + 6], ["b", 2, 1 + 4], ["c", 2, 2 + 5]]
            result = await sql.query(
                0, 'SELECT "offset", position, data, json FROM orders ORDER BY 1'
            )
            assert [r[0] for r in result.rows] == list(range(10))
            assert [r[1] for r in result.rows] == list(range(10))
            assert result.rows[0][2] == events[0].hex()
            assert result.rows[0][3] == events[0].decode()
            assert result.rows[7:] == [
                [7, 7, b"not json".hex(), None],
                [8, 8, "fffe", None],
                [9, 9, "", None],
            ]
            described = await sql.query(0, "DESCRIBE orders")
            assert [(r[0], r[1]) for r in described.rows] == [
                ("offset", "BIGINT"),
                ("position", "BIGINT"),
                ("ts", "TIMESTAMP"),
                ("data", "BLOB"),
                ("json", "JSON"),
            ]

    asyncio.run(main())


def test_parameters_in_both_styles(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            s = await engine.create_stream(0, "t")
            await engine.append(0, s.stream_id, [js(k="x", n=i) for i in range(10)])
            dollar = await sql.query(
                0,
                "SELECT count(*) FROM t WHERE (json->>'n')::INT >= $1 AND json->>'k' = $2",
                [4, "x"],
            )
            qmark = await sql.query(
                0,
                "SELECT count(*) FROM t WHERE (json->>'n')::INT >= ? AND json->>'k' = ?",
                [4, "x"],
            )
            assert dollar.rows == qmark.rows == [[6]]
            reused = await sql.query(0, "SELECT $1 + $1, $2, $3, $4", [21, True, None, "é"])
            assert reused.rows == [[42, True, None, "é"]]
            ns = 1_700_000_000_123_456_789
            stamp = await sql.query(0, "SELECT $1, epoch_ns($1)", [Timestamp(ns)])
            assert stamp.rows == [[Timestamp(ns), ns]]
            moment = datetime.datetime(2024, 5, 6, 7, 8, 9, 123456)
            dt = await sql.query(0, "SELECT ? AS d", [moment])
            assert dt.rows == [[Timestamp(1_714_979_289_123_456_000)]]
            # Every event was appended now: a Timestamp parameter compares with ts.
            later = await sql.query(0, "SELECT count(*) FROM t WHERE ts < $1", [Timestamp(ns * 2)])
            assert later.rows == [[10]]

    asyncio.run(main())


def test_query_at_sees_exactly_the_first_p_positions(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path, CONFIG) as (engine, sql):
            a = await engine.create_stream(0, "a")
            b = await engine.create_stream(0, "b")
            expected: list[tuple[str, int, bytes]] = []  # (stream, position, value)
            sizes = [1, 3, 2, 5, 1, 1, 4]
            for i, size in enumerate(sizes):
                name, info = ("a", a) if i % 2 == 0 else ("b", b)
                values = [f"{name}{i}.{j}".encode() for j in range(size)]
                await engine.append(0, info.stream_id, values)
                expected += [(name, len(expected) + j, v) for j, v in enumerate(values)]
            # Two concurrent appends interleave positions across streams.
            await asyncio.gather(
                engine.append(0, a.stream_id, [b"a-c1", b"a-c2"]),
                engine.append(0, b.stream_id, [b"b-c1"]),
            )
            head = engine.tenant(0).committed_position
            assert head == sum(sizes) + 3
            await sql.query(0, "SELECT 1")  # projections caught up
            everything = await sql.query(
                0,
                "SELECT 'a', position, data FROM a UNION ALL SELECT 'b', position, data FROM b "
                "ORDER BY 2",
            )
            assert [r[1] for r in everything.rows] == list(range(head))
            assert [(r[0], r[1], bytes.fromhex(r[2])) for r in everything.rows][
                : len(expected)
            ] == expected
            for p in range(head + 1):
                result = await sql.query_at(
                    0,
                    "SELECT position FROM a UNION ALL SELECT position FROM b ORDER BY 1",
                    [],
                    p,
                )
                assert [r[0] for r in result.rows] == list(range(p)), p
                counts = await sql.query_at(
                    0, "SELECT (SELECT count(*) FROM a), (SELECT count(*) FROM b)", [], p
                )
                in_a = sum(1 for r in everything.rows[:p] if r[0] == "a")
                assert counts.rows == [[in_a, p - in_a]]
            with pytest.raises(PositionAhead):
                await sql.query_at(0, "SELECT 1", [], head + 1)

    asyncio.run(main())


def test_a_query_waits_while_the_projections_move_and_not_once_they_stall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read your writes however far behind a burst left the projections: the wait's
    timeout counts from their last move, not from the query (a 16 GiB burst took 33 s
    to catch up and a Query answered ProjectionLag at 30 s). The clock is the test's."""
    clock = [0.0]
    fake_time = SimpleNamespace(monotonic=lambda: clock[0], perf_counter=time.perf_counter)
    monkeypatch.setattr(service_module, "time", fake_time)

    async def main() -> None:
        async with running(tmp_path) as (_engine, sql):
            reached = [0]
            looked: list[int] = []  # what the wait saw, each time it looked

            def wait_for(target: int) -> asyncio.Future[None]:
                return asyncio.ensure_future(
                    sql._wait(
                        lambda: reached[0],
                        target,
                        lambda: looked.append(reached[0]),
                        lambda: f"stalled at {reached[0]}",
                        1.0,
                    )
                )

            async def move(to: int, seconds: float) -> None:
                clock[0] += seconds
                reached[0] = to
                seen = len(looked)
                sql._signal()
                await wait_until_async(lambda: len(looked) > seen or waiting.done())

            waiting = wait_for(3)
            await wait_until_async(lambda: looked)  # it began, at clock 0
            for step in (1, 2):
                await move(step, 5.0)  # 5x the timeout since the last move, but moved
                assert not waiting.done()
            await move(3, 5.0)
            await waiting  # reached: answered

            looked.clear()
            waiting = wait_for(10)
            await wait_until_async(lambda: looked)
            await move(4, 0.6)  # moved: a second more from here
            await move(4, 0.6)  # 0.6 s without a move: still waiting (it looked again)
            assert not waiting.done()
            await move(4, 0.6)  # 1.2 s without a move: stalled
            with pytest.raises(ProjectionLag, match="stalled at 4"):
                await waiting

    asyncio.run(main())


def test_projection_lag_and_read_your_writes_wait(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path, read_timeout=0.3) as (engine, sql):
            s = await engine.create_stream(0, "s")
            other = await engine.create_stream(0, "other")
            await engine.append(0, s.stream_id, [b"1", b"2"])
            await engine.append(0, other.stream_id, [b"x"])
            assert (await sql.query(0, "SELECT count(*) FROM s")).rows == [[2]]
            projection = sql.streams.projection(0, "s")
            assert projection is not None
            projection.pause()
            await engine.append(0, s.stream_id, [b"3"])
            head = engine.tenant(0).committed_position
            assert head == 4
            # Positions the projection has reached are still served...
            assert (await sql.query_at(0, "SELECT count(*) FROM s", [], 3)).rows == [[2]]
            # ...but not the new head: QueryAt fails at once, Query waits then fails.
            with pytest.raises(ProjectionLag):
                await sql.query_at(0, "SELECT count(*) FROM s", [], head)
            with pytest.raises(ProjectionLag):
                await sql.query(0, "SELECT count(*) FROM s")
            # A Query waits for the projection rather than failing: a query of a position
            # reached, sent after it, is answered while it still waits.
            waiting = asyncio.ensure_future(sql.query(0, "SELECT count(*) FROM s"))
            assert (await sql.query_at(0, "SELECT count(*) FROM s", [], 3)).rows == [[2]]
            assert not waiting.done()
            projection.resume()
            assert (await waiting).rows == [[3]]
            assert (await sql.query_at(0, "SELECT count(*) FROM s", [], head)).rows == [[3]]

    asyncio.run(main())


def test_read_your_writes_under_concurrent_appends(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path, CONFIG) as (engine, sql):
            a = await engine.create_stream(0, "a")
            b = await engine.create_stream(0, "b")
            appended = {"a": 0, "b": 0}

            async def writer(name: str, stream_id: int) -> None:
                for i in range(25):
                    await engine.append(0, stream_id, [js(i=i)] * (1 + i % 3))
                    appended[name] += 1 + i % 3
                    result = await sql.query(
                        0, f"SELECT count(*) FROM {name}"
                    )  # right after the ack
                    assert result.rows[0][0] >= appended[name]

            await asyncio.gather(writer("a", a.stream_id), writer("b", b.stream_id))
            final = await sql.query(0, "SELECT (SELECT count(*) FROM a), (SELECT count(*) FROM b)")
            assert final.rows == [[appended["a"], appended["b"]]]
            # A Query reads a consistent prefix: the positions it sees have no holes.
            positions = await sql.query(
                0, "SELECT position FROM a UNION ALL SELECT position FROM b ORDER BY 1"
            )
            assert [r[0] for r in positions.rows] == list(range(len(positions.rows)))

    asyncio.run(main())


def test_tenants_see_only_their_own_streams(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            mine = await engine.create_stream(0, "orders")
            theirs = await engine.create_stream(42, "orders")
            secret = await engine.create_stream(42, "secret")
            await engine.append(0, mine.stream_id, [b"0-a"])
            await engine.append(42, theirs.stream_id, [b"42-a", b"42-b"])
            await engine.append(42, secret.stream_id, [b"s"])
            assert (await sql.query(0, "SELECT data FROM orders")).rows == [[b"0-a".hex()]]
            assert (await sql.query(42, "SELECT count(*) FROM orders")).rows == [[2]]
            with pytest.raises(TableNotFound):
                await sql.query(0, "SELECT * FROM secret")
            tables = await sql.query(0, "SHOW TABLES")
            assert [r[0] for r in tables.rows] == ["orders"]
            tables = await sql.query(42, "SELECT table_name FROM information_schema.tables")
            assert sorted(r[0] for r in tables.rows) == ["orders", "secret"]
            # Positions are per tenant.
            assert (await sql.query_at(42, "SELECT count(*) FROM secret", [], 3)).rows == [[1]]
            with pytest.raises(PositionAhead):
                await sql.query_at(0, "SELECT 1", [], 2)

    asyncio.run(main())


def test_insert_into_appends_to_the_stream(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            s = await engine.create_stream(0, "s")
            other = await engine.create_stream(0, "other")
            await engine.append(0, s.stream_id, [b"first"])
            result = await sql.query(0, "INSERT INTO s (data) VALUES ('text')")
            assert result.columns == ["rows_affected", "log_offset"]
            assert result.rows == [[1, 1]]
            # BLOB and text rows in one VALUES need a common type, as in DuckDB.
            result = await sql.query(
                0, "INSERT INTO s (data) VALUES (x'00ff'::BLOB), ($1::BLOB)", ["param"]
            )
            assert result.rows == [[2, 2]]
            result = await sql.query(
                0, "INSERT INTO s (json) VALUES ('{\"a\": 1}'), ({'b': [1, 2]}::JSON)"
            )
            assert result.rows == [[2, 4]]
            result = await sql.query(0, "INSERT INTO s (json) SELECT {'n': i} FROM range(3) t(i)")
            assert result.rows == [[3, 6]]
            result = await sql.query(0, "INSERT INTO s BY NAME SELECT 'named' AS data")
            assert result.rows == [[1, 9]]
            copied = await sql.query(0, 'INSERT INTO other SELECT * FROM s WHERE "offset" < 2')
            assert copied.rows == [[2, 0]]
            empty = await sql.query(0, "INSERT INTO other (data) SELECT data FROM s WHERE false")
            assert empty.rows == [[0, 2]]
            events = await engine.read_events(0, s.stream_id, 0)
            assert [e.value for e in events] == [
                b"first",
                b"text",
                b"\x00\xff",
                b"param",
                b'{"a": 1}',
                b'{"b":[1,2]}',
                b'{"n":0}',
                b'{"n":1}',
                b'{"n":2}',
                b"named",
            ]
            assert [e.value for e in await engine.read_events(0, other.stream_id, 0)] == [
                b"first",
                b"text",
            ]
            # Visible to the next query (read your writes), JSON included.
            result = await sql.query(0, "SELECT count(json) FROM s")
            assert result.rows == [[5]]
            with pytest.raises(QueryExecutionError, match="valid JSON"):
                await sql.query(0, "INSERT INTO s (json) VALUES ('{nope')")
            with pytest.raises(TableNotFound):
                await sql.query(0, "INSERT INTO missing (data) VALUES ('x')")
            with pytest.raises(QueryExecutionError, match="assigned by the log"):
                await sql.query(0, "INSERT INTO s (\"offset\", data) VALUES (5, 'x')")
            with pytest.raises(QueryExecutionError, match="non-NULL"):
                await sql.query(0, "INSERT INTO s (data) VALUES (NULL)")
            with pytest.raises(QueryExecutionError, match="BLOB or VARCHAR"):
                await sql.query(0, "INSERT INTO s (data) VALUES (42)")
            with pytest.raises(QueryExecutionError, match="QueryAt"):
                await sql.query_at(0, "INSERT INTO s (data) VALUES ('x')", [], 1)
            with pytest.raises(QueryExecutionError, match="at most"):
                await sql.query(0, "INSERT INTO s (data) SELECT 'x' FROM range(10001)")
            assert len(await engine.read_events(0, s.stream_id, 0)) == 10

    asyncio.run(main())


def test_deleted_stream_table_is_gone(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            s = await engine.create_stream(0, "gone")
            keep = await engine.create_stream(0, "kept")
            await engine.append(0, s.stream_id, [b"x"])
            await engine.append(0, keep.stream_id, [b"y"])
            assert (await sql.query(0, "SELECT count(*) FROM gone")).rows == [[1]]
            await engine.delete_stream(0, s.stream_id)
            with pytest.raises(TableNotFound):
                await sql.query(0, "SELECT count(*) FROM gone")
            assert (await sql.query(0, "SELECT count(*) FROM kept")).rows == [[1]]
            # A new stream with the old name starts empty.
            await engine.create_stream(0, "gone")
            assert (await sql.query(0, "SELECT count(*) FROM gone")).rows == [[0]]

    asyncio.run(main())


def test_restart_rebuilds_projections_identically(tmp_path: Path) -> None:
    queries = [
        'SELECT "offset", position, ts, data, json FROM a ORDER BY position',
        "SELECT json->>'k' AS k, count(*) FROM b GROUP BY 1 ORDER BY 1",
    ]

    async def snapshot(sql: SqlService, head: int) -> list[object]:
        out: list[object] = [(await sql.query(0, q)).rows for q in queries]
        for p in range(0, head + 1, 7):
            out.append((await sql.query_at(0, queries[0], [], p)).rows)
        return out

    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            a = await engine.create_stream(0, "a")
            b = await engine.create_stream(0, "b")
            for i in range(20):
                await engine.append(0, a.stream_id, [js(k=i % 3, i=i), b"raw"])
                await engine.append(0, b.stream_id, [js(k=i % 4)] * (i % 5 + 1))
            head = engine.tenant(0).committed_position
            before = await snapshot(sql, head)
        async with running(tmp_path) as (engine, sql):
            assert engine.tenant(0).committed_position == head
            after = await snapshot(sql, head)
        assert after == before

    asyncio.run(main())


def test_many_small_commits_stay_few_chunks(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            s = await engine.create_stream(0, "s")
            for i in range(300):
                await engine.append(0, s.stream_id, [js(i=i)])
                if i % 10 == 0:
                    await sql.query(0, "SELECT 1")  # let the projection catch up in steps
            result = await sql.query(0, "SELECT sum((json->>'i')::INT), count(*) FROM s")
            assert result.rows == [[sum(range(300)), 300]]
            projection = sql.streams.projection(0, "s")
            assert projection is not None
            assert len(projection.chunks) <= 10
            assert [r[0] for r in (await sql.query(0, 'SELECT "offset" FROM s')).rows] == list(
                range(300)
            )

    asyncio.run(main())


def test_case_clash_and_hidden_internal_streams(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            upper = await engine.create_stream(0, "Foo")
            lower = await engine.create_stream(0, "foo")
            internal = await engine.create_stream(0, "hw_internal", internal=True)
            await engine.append(0, upper.stream_id, [b"U"])
            await engine.append(0, lower.stream_id, [b"l", b"l"])
            # As headwater's own writers of internal streams (transactions, group offsets) do.
            await engine.append(0, internal.stream_id, [b"i"], internal=True)
            assert (await sql.query(0, 'SELECT count(*) FROM "Foo"')).rows == [[1]]
            assert (await sql.query(0, "SELECT count(*) FROM foo")).rows == [[2]]
            with pytest.raises(TableNotFound):
                await sql.query(0, "SELECT * FROM hw_internal")

    asyncio.run(main())


def test_close_before_engine_and_queries_after_close(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        sql = SqlService(engine)
        sql.start()
        s = await engine.create_stream(0, "s")
        await engine.append(0, s.stream_id, [b"x"])
        assert (await sql.query(0, "SELECT count(*) FROM s")).rows == [[1]]
        await sql.close()
        with pytest.raises((QueryExecutionError, ProjectionLag)):
            await sql.query(0, "SELECT 1")
        assert engine.stream_created_listeners == []
        await engine.close()

    asyncio.run(main())


def test_retention_hides_and_frees_expired_rows(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            settings = StreamSettings(segment_bytes=1024, retention_bytes=2048)
            s = await engine.create_stream(0, "s", settings)
            for i in range(40):
                await engine.append(0, s.stream_id, [js(i=i, pad="x" * 40)] * 2)
            assert (await sql.query(0, "SELECT count(*) FROM s")).rows == [[80]]
            await engine.run_maintenance()
            start = engine.stream(0, s.stream_id).log.start_offset
            assert start > 0
            result = await sql.query(0, 'SELECT min("offset"), count(*) FROM s')
            assert result.rows == [[start, 80 - start]]
            await engine.append(0, s.stream_id, [b"more"])
            result = await sql.query(0, 'SELECT min("offset"), count(*) FROM s')
            assert result.rows == [[start, 81 - start]]
            projection = sql.streams.projection(0, "s")
            assert projection is not None
            assert all(c.last_offset >= start for c in projection.chunks)

    asyncio.run(main())


def test_query_at_refuses_a_position_whose_rows_retention_removed(tmp_path: Path) -> None:
    """A position's answer never changes: one taken before retention removed rows of a
    table the query reads is refused from then on, not answered without them; later
    positions, and queries not reading that table, are answered."""

    async def main() -> None:
        async with running(tmp_path) as (engine, sql):
            settings = StreamSettings(segment_bytes=1024, retention_bytes=2048)
            s = await engine.create_stream(0, "s", settings)
            await engine.create_stream(0, "kept")
            await engine.append(0, (await engine.create_stream(0, "t")).stream_id, [js(i=0)])
            for i in range(40):
                await engine.append(0, s.stream_id, [js(i=i, pad="x" * 40)] * 2)
            early = engine.tenant(0).committed_position
            count = "SELECT count(*) FROM s"
            assert (await sql.query(0, count)).rows == [[80]]  # caught up to the head
            assert (await sql.query_at(0, count, [], early)).rows == [[80]]
            await engine.run_maintenance()
            assert engine.stream(0, s.stream_id).log.start_offset > 0
            with pytest.raises(InvalidOffset, match="retention has removed rows") as refused:
                await sql.query_at(0, count, [], early)
            # Its first answerable position is not written yet: said, with what answers
            # now (it named a position QueryAt then refused as ahead of the head).
            assert refused.value.message.endswith(
                f"answers positions from {early + 1} on once the log reaches it (Query answers now)"
            ), refused.value.message
            assert (await sql.query_at(0, "SELECT count(*) FROM t", [], early)).rows == [[1]]
            # The head query reads what is kept; a position from now on, as always.
            kept = (await sql.query(0, count)).rows[0][0]
            assert 0 < kept < 80
            await engine.append(0, s.stream_id, [js(i=99)])
            assert (await sql.query(0, count)).rows == [[kept + 1]]
            later = engine.tenant(0).committed_position
            assert (await sql.query_at(0, count, [], later)).rows == [[kept + 1]]

        # Reopened: when retention ran is not known, so every position up to the head
        # is refused over the table (and still answered over the others).
        async with running(tmp_path) as (engine, sql):
            head = engine.tenant(0).committed_position
            assert (await sql.query(0, count)).rows == [[kept + 1]]
            with pytest.raises(InvalidOffset, match="retention has removed rows"):
                await sql.query_at(0, count, [], head)
            assert (await sql.query_at(0, "SELECT count(*) FROM t", [], head)).rows == [[1]]
            t = engine.stream_by_name(0, "t").stream_id
            await engine.append(0, t, [js(i=1)])
            assert (await sql.query(0, "SELECT count(*) FROM t")).rows == [[2]]
            later = engine.tenant(0).committed_position
            assert (await sql.query_at(0, count, [], later)).rows == [[kept + 1]]

    asyncio.run(main())
