"""The read-ahead of sequential readers' next pages: served only to the read it was
started for, only when it stopped at its budget, never when too old, and never more
than ``limit`` pages held; chained up to a reader's depth; and the engine's read of a
page with the page after it in one worker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from headwater.api import AuthConfig, EngineAPI
from headwater.api.readahead import Pages, ReadAhead
from headwater.engine.engine import EngineConfig, PageRead
from headwater.engine.kinds import KindsConfig
from headwater.errors import HeadwaterError
from headwater.storage.log import ReadResult
from waiting import scheduled_callbacks_run, wait_until_async


def page(next_offset: int | None) -> ReadResult:
    return ReadResult([], 1, 10, next_offset, next_offset or 0)


def test_a_page_cut_by_its_budget_is_served_once_to_its_own_key() -> None:
    async def main() -> None:
        ahead = ReadAhead()
        reads: list[int] = []

        async def read() -> ReadResult:
            reads.append(1)
            return page(20)

        ahead.start(("s", 10), read)
        ahead.start(("s", 10), read)  # already under way: not read twice
        assert await ahead.take(("s", 11)) is None  # another offset
        result = await ahead.take(("s", 10))
        assert result is not None and result.next_offset == 20
        assert await ahead.take(("s", 10)) is None  # served once
        assert reads == [1] and ahead.served == 1

    asyncio.run(main())


def test_a_page_that_reached_the_end_a_failed_one_and_an_old_one_are_not_served() -> None:
    async def main() -> None:
        ahead = ReadAhead(limit=4)

        async def at_end() -> ReadResult:
            return page(None)  # more may be stored by the time it is asked for

        async def failed() -> ReadResult:
            raise OSError("segment gone")

        ahead.start(("end",), at_end)
        ahead.start(("failed",), failed)
        assert await ahead.take(("end",)) is None
        assert await ahead.take(("failed",)) is None
        old = ReadAhead(max_age_s=0.0)

        async def cut() -> ReadResult:
            return page(5)

        old.start(("old",), cut)
        await scheduled_callbacks_run()  # the read is done; only its age keeps it from a reader
        assert await old.take(("old",)) is None
        assert ahead.served == old.served == 0

    asyncio.run(main())


def test_past_the_limit_the_oldest_page_is_dropped_and_its_read_cancelled() -> None:
    async def main() -> None:
        ahead = ReadAhead(limit=2)
        gate = asyncio.Event()
        cancelled: list[str] = []

        def reader(name: str) -> Callable[[], Coroutine[Any, Any, ReadResult]]:
            async def read() -> ReadResult:
                try:
                    await gate.wait()
                except asyncio.CancelledError:
                    cancelled.append(name)
                    raise
                return page(1)

            return read

        for name in ("a", "b", "c"):
            ahead.start((name,), reader(name))
            await scheduled_callbacks_run()
        assert len(ahead) == 2
        gate.set()
        assert await ahead.take(("a",)) is None  # dropped for c
        assert cancelled == ["a"]
        assert await ahead.take(("b",)) is not None
        assert await ahead.take(("c",)) is not None
        ahead.close()
        assert len(ahead) == 0

    asyncio.run(main())


def test_a_chain_reads_the_pages_after_a_page_up_to_its_depth_and_the_limit() -> None:
    # follow(offset) reads the page at offset and the page after it (as the engine's
    # worker does); pages are ten offsets long and end at 100.
    async def main() -> None:
        ahead = ReadAhead(limit=3, depth=2)
        reads: list[int] = []

        def follow(offset: int) -> Pages:
            reads.append(offset)

            async def at(start: int) -> ReadResult:
                return page(start + 10 if start + 10 < 100 else None)

            return at(offset), at(offset + 10)

        ahead.start(("r", 10), follow=follow)
        # Without the reader asking, the chain holds its depth of pages (10 and 20),
        # read by one call, and goes no further.
        await wait_until_async(lambda: len(ahead) == 2)
        assert reads == [10] and ahead.chained == 1
        for offset in range(10, 90, 10):
            result = await ahead.take(("r", offset))
            assert result is not None and result.next_offset == offset + 10
            assert len(ahead) <= 2  # this reader's depth, under the server's limit
            # Taking a page lets the chain read on from the page after it.
            await wait_until_async(lambda stop=offset + 20: len(ahead) == 2 or stop >= 100)
        assert ahead.served == 8
        assert reads == [10, 30, 50, 70, 90]  # each call read two pages
        ahead.close()

    asyncio.run(main())


def test_a_reader_asking_for_room_drops_a_chained_page_first() -> None:
    async def main() -> None:
        ahead = ReadAhead(limit=2, depth=2)

        def follow(offset: int) -> Pages:
            async def at(start: int) -> ReadResult:
                return page(start + 10)

            return at(offset), at(offset + 10)

        ahead.start(("a", 10), follow=follow)
        await wait_until_async(lambda: len(ahead) == 2)  # a's 10 and 20 (chained)

        async def b_page() -> ReadResult:
            return page(60)

        ahead.start(("b", 50), b_page)  # the server's limit: a's chained page goes
        assert len(ahead) == 2
        assert await ahead.take(("a", 20)) is None
        assert await ahead.take(("b", 50)) is not None
        assert await ahead.take(("a", 10)) is not None
        ahead.close()

    asyncio.run(main())


def test_a_page_the_thread_did_not_read_sends_the_reader_to_read_afresh() -> None:
    # The worker reads the page after only while there is room; when it does not, it
    # cancels that page's future, and a reader taking it reads afresh (no error).
    async def main() -> None:
        ahead = ReadAhead(limit=4, depth=2)
        loop = asyncio.get_running_loop()
        first: asyncio.Future[ReadResult] = loop.create_future()
        second: asyncio.Future[ReadResult] = loop.create_future()
        ahead.start(("r", 10), follow=lambda offset: (first, second))
        first.set_result(page(20))
        await wait_until_async(lambda: len(ahead) == 2)  # 20 held, not yet read
        second.cancel()
        assert await ahead.take(("r", 10)) is not None
        assert await ahead.take(("r", 20)) is None
        ahead.close()

    asyncio.run(main())


def test_the_engine_reads_a_page_and_the_page_after_it_in_one_worker(tmp_path: Path) -> None:
    async def main() -> None:
        api = await EngineAPI.open(
            tmp_path, EngineConfig(maintenance_interval_ms=0), KindsConfig(), AuthConfig()
        )
        engine = api._engine
        try:
            stream = (await api.create_stream(0, "paged")).stream_id
            await api.append(0, stream, [b"%04d" % i for i in range(30)])
            page_bytes = 40  # ten 4-byte events a page

            def values(result: ReadResult) -> list[bytes]:
                return [event.value for event in result.events()]

            first, second = engine.read_soon(PageRead(0, stream, page_bytes), 5, then=lambda: True)
            fresh = await engine.read(0, stream, 5, page_bytes)
            assert values(await first) == values(fresh) == [b"%04d" % i for i in range(5, 15)]
            after = await engine.read(0, stream, 15, page_bytes)
            assert values(await second) == values(after)
            # Not wanted (no room), or the first page reached the end: not read.
            first, second = engine.read_soon(PageRead(0, stream, page_bytes), 5, then=lambda: False)
            await first
            await wait_until_async(second.done)
            assert second.cancelled()
            first, second = engine.read_soon(PageRead(0, stream, page_bytes), 25, then=lambda: True)
            assert (await first).next_offset is None
            await wait_until_async(second.done)
            assert second.cancelled()
            # A stream that is gone fails the page as a read would.
            first, second = engine.read_soon(PageRead(0, 999, page_bytes), 0)
            with pytest.raises(HeadwaterError):
                await first
            await wait_until_async(second.done)
        finally:
            await api.close()
        # Closed: the page fails at once instead of the caller.
        first, second = engine.read_soon(PageRead(0, stream, page_bytes), 5)
        with pytest.raises(RuntimeError):
            await first
        assert second.cancelled()

    asyncio.run(main())
