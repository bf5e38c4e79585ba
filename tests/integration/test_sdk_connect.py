"""The SDK's ways in, against a real server: ``async with connect_async(...)`` (streams
and entities) and ``create_stream(..., exist_ok=True)`` (blocking and asyncio), which
let a script such as the README's run again."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from servers import LOCAL, Server, free_port, serving

import headwater
from headwater import entities
from headwater.client import AsyncClient, ServerUnavailable
from headwater.errors import StreamAlreadyExists


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(tmp_path_factory.mktemp("sdk_connect"), listen={"convergedb": LOCAL})


@dataclass
class Gauge:
    site: str
    level: float


def test_async_with_connect_async_connects_and_closes(server: Server) -> None:
    async def main() -> AsyncClient:
        async with headwater.connect_async(server.address, timeout=20) as hw:
            assert isinstance(hw, AsyncClient)
            assert not hw.closed
            assert (await hw.query("SELECT 41 + 1")).scalar() == 42
        assert hw.closed
        # The awaited form still gives a connected client, and its own `async with`.
        async with await headwater.connect_async(server.address, timeout=20) as again:
            assert (await again.query("SELECT 1")).scalar() == 1
        assert again.closed
        return hw

    asyncio.run(main())


def test_async_with_connect_async_to_nothing_raises_server_unavailable() -> None:
    async def main() -> None:
        address = f"127.0.0.1:{free_port()}"
        with pytest.raises(ServerUnavailable, match=address):
            async with headwater.connect_async(address, reconnect_attempts=1):
                raise AssertionError("entered without a server")

    asyncio.run(main())


def test_async_with_entities_connect_async(server: Server, sdk_stream_name: str) -> None:
    kind_name = f"g{sdk_stream_name}"[:60]

    async def main() -> None:
        address = server.address_of("convergedb")
        async with entities.connect_async(address, name="writer") as src:
            gauges = await src.create_kind(Gauge, kind_name)
            await src.assert_(gauges, "tank-1", Gauge("north", 0.75))
        # Leaving the block flushed the write: a second client reads it.
        async with entities.connect_async(address, read_only=True) as reader:
            kind = await reader.get_kind(Gauge, kind_name)
            found = await reader.get(kind, "tank-1")
            assert found is not None
            assert found.value == Gauge("north", 0.75)
        assert src.closed and reader.closed

    asyncio.run(main())


def test_create_stream_exist_ok_blocking(server: Server, sdk_stream_name: str) -> None:
    with headwater.connect(server.address, timeout=20) as hw:
        stream_id = hw.create_stream(sdk_stream_name)
        hw.append(sdk_stream_name, [b"kept"])
        with pytest.raises(StreamAlreadyExists):
            hw.create_stream(sdk_stream_name)
    # A new client (nothing cached) gets the existing stream, its events untouched.
    with headwater.connect(server.address, timeout=20) as hw:
        assert hw.create_stream(sdk_stream_name, exist_ok=True) == stream_id
        assert hw.create_stream(sdk_stream_name, exist_ok=True) == stream_id
        assert [e.value for e in hw.scan(sdk_stream_name)] == [b"kept"]


def test_create_stream_exist_ok_async(server: Server, sdk_stream_name: str) -> None:
    async def main() -> None:
        async with headwater.connect_async(server.address, timeout=20) as hw:
            created = await hw.create_stream(sdk_stream_name, exist_ok=True)
            assert await hw.create_stream(sdk_stream_name, exist_ok=True) == created
            with pytest.raises(StreamAlreadyExists):
                await hw.create_stream(sdk_stream_name)
            assert [s.name for s in await hw.list_streams()].count(sdk_stream_name) == 1

    asyncio.run(main())
