"""The asyncio SDK (``headwater.connect_async``) against a real server process."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import headwater
from headwater.client import AsyncClient, Event, EventTooLarge, ServerUnavailable
from headwater.errors import (
    InvalidRequest,
    PositionAhead,
    QueryParseError,
    StreamAlreadyExists,
    StreamNotFound,
)
from waiting import wait_until_async

MiB = 1 << 20


def run(server: Any, body: Callable[[AsyncClient], Awaitable[None]]) -> None:
    async def main() -> None:
        async with await headwater.connect_async(server.address, timeout=20) as client:
            await body(client)

    asyncio.run(main())


def test_every_method(shared_server: Any, sdk_stream_name: str) -> None:
    name = sdk_stream_name

    async def body(hw: AsyncClient) -> None:
        stream_id = await hw.create_stream(name)
        with pytest.raises(StreamAlreadyExists):
            await hw.create_stream(name)
        assert await hw.stream_id(name) == stream_id
        assert (await hw.stream_info(name)).next_offset == 0
        assert name in [s.name for s in await hw.list_streams()]

        assert await hw.append(name, [b"a", "b", b"c"]) == (0, 3)
        assert await hw.append_idempotent(name, 1, 0, [b"d"]) == (3, 1)
        assert await hw.append_idempotent(name, 1, 0, [b"d"]) == (3, 1)
        events, next_offset = await hw.read(name, 1)
        assert (events, next_offset) == ([Event(1, b"b"), Event(2, b"c"), Event(3, b"d")], 4)
        assert [e.offset async for e in hw.scan(name, limit=2)] == [0, 1]

        result = await hw.query(f'SELECT count(*) AS n FROM {name} WHERE "offset" >= $1', 2)
        assert (result.columns, result.rows) == (["n"], [(2,)])
        top = (await hw.query(f"SELECT max(position) FROM {name}")).scalar()
        assert isinstance(top, int)
        assert (await hw.query_at(f"SELECT count(*) FROM {name}", top + 1)).scalar() == 4
        assert (await hw.query_at(f"SELECT count(*) FROM {name}", top)).scalar() == 3
        with pytest.raises(PositionAhead):
            await hw.query_at("SELECT 1", 1 << 60)
        with pytest.raises(QueryParseError):
            await hw.query("SELECT FROM WHERE")
        assert await hw.sync() is True

        with pytest.raises(EventTooLarge):
            await hw.append(name, [b"x" * (4 * MiB + 1)])
        with pytest.raises(InvalidRequest):
            await hw.append_idempotent(name, 1, 9, [b"gap"])

        await hw.delete_stream(name)
        with pytest.raises(StreamNotFound):
            await hw.append(name, [b"gone"])
        with pytest.raises(StreamNotFound):
            await hw.stream_info(name)

    run(shared_server, body)


def test_pipelining_many_concurrent_appends_on_one_connection(
    shared_server: Any, sdk_stream_name: str
) -> None:
    name = sdk_stream_name

    async def body(hw: AsyncClient) -> None:
        await hw.create_stream(name)
        conn = hw._conn
        assert conn is not None
        n = 300
        tasks = [asyncio.ensure_future(hw.append(name, [f"{i}".encode()])) for i in range(n)]
        queries = [
            asyncio.ensure_future(hw.query(f"SELECT count(*) >= 0 FROM {name}")) for _ in range(20)
        ]
        # Every request has been written and is waiting for its answer on the one
        # connection: many in flight at once, matched by request id. (Checked every turn
        # of the loop: the tasks write their requests in their first one.)
        await wait_until_async(lambda: len(conn.pending) > 100, 5, "few in flight", interval=0)
        results = await asyncio.gather(*tasks)
        assert [(await q).scalar() for q in queries] == [True] * 20
        assert hw._conn is conn  # still the same connection
        assert sorted(r.first_offset for r in results) == list(range(n))
        assert all(r.count == 1 for r in results)
        # Each event landed where its own answer said.
        events = [e async for e in hw.scan(name)]
        by_offset = {e.offset: e.value for e in events}
        for i, r in enumerate(results):
            assert by_offset[r.first_offset] == f"{i}".encode()

    run(shared_server, body)


def test_split_append_is_pipelined_and_ordered(shared_server: Any, sdk_stream_name: str) -> None:
    name = sdk_stream_name

    async def body(hw: AsyncClient) -> None:
        await hw.create_stream(name)
        values = [i.to_bytes(4, "big") for i in range(25_000)]
        result = await hw.append(name, values, max_in_flight=3)
        assert result.batches == [(0, 10_000), (10_000, 10_000), (20_000, 5_000)]
        got = [e.value async for e in hw.scan(name, max_bytes=4 * MiB)]
        assert got == values

    run(shared_server, body)


def test_async_subscription_with_credit_refill(shared_server: Any, sdk_stream_name: str) -> None:
    name = sdk_stream_name

    async def body(hw: AsyncClient) -> None:
        await hw.create_stream(name)
        await hw.append(name, [f"{i}".encode() for i in range(150)])
        received: list[Event] = []

        async def produce() -> None:
            for start in range(150, 450, 50):
                await hw.append(name, [f"{i}".encode() for i in range(start, start + 50)])

        producer = asyncio.ensure_future(produce())
        async with hw.subscribe(name, 0, credits=25) as sub:
            async for event in sub:
                received.append(event)
                if len(received) == 450:
                    break
            assert sub.subscription_id is not None
        assert sub.closed
        await producer
        assert [e.offset for e in received] == list(range(450))
        assert [e.value for e in received] == [f"{i}".encode() for i in range(450)]

        # Two concurrent subscriptions share the connection with other requests.
        async def take(count: int) -> list[int]:
            got: list[int] = []
            async for event in hw.subscribe(name, 400, credits=7):
                got.append(event.offset)
                if len(got) == count:
                    break
            return got

        a, b, streams = await asyncio.gather(take(50), take(30), hw.list_streams())
        assert a == list(range(400, 450)) and b == list(range(400, 430))
        assert name in [s.name for s in streams]
        # The abandoned iterators unsubscribe as they are closed.
        await wait_until_async(lambda: not hw._subscriptions, message="subscriptions left")

        with pytest.raises(StreamNotFound):
            await hw.subscribe("no_such_stream_at_all").start()

    run(shared_server, body)


def test_connect_async_unavailable(unused_port: int) -> None:
    async def main() -> None:
        with pytest.raises(ServerUnavailable, match="refused"):
            await headwater.connect_async(f"127.0.0.1:{unused_port}")

    asyncio.run(main())
