"""The read-ahead of sequential readers' next pages: served only to the read it was
started for, only when it stopped at its budget, never when too old, and never more
than ``limit`` pages held."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from headwater.api.readahead import ReadAhead
from headwater.storage.log import ReadResult


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
        await asyncio.sleep(0)  # the read is done; only its age keeps it from a reader
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
            await asyncio.sleep(0)
        assert len(ahead) == 2
        gate.set()
        assert await ahead.take(("a",)) is None  # dropped for c
        assert cancelled == ["a"]
        assert await ahead.take(("b",)) is not None
        assert await ahead.take(("c",)) is not None
        ahead.close()
        assert len(ahead) == 0

    asyncio.run(main())
