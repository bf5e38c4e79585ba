"""Requests a front end answers from a callback instead of a task of their own (a lone
Kimberlite AppendEvents): they count as in flight for the reading pause, the close after
the peer's EOF and the listener's drain, as tasks do."""

from __future__ import annotations

import asyncio

from headwater.server.tcp import TaskPerRequestConnection


class Transport:
    def __init__(self) -> None:
        self.paused = False
        self.closed = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class Connection(TaskPerRequestConnection):
    max_inflight = 4


def connected() -> tuple[Connection, Transport]:
    conn = Connection()
    transport = Transport()
    conn.transport = transport  # type: ignore[assignment]
    return conn, transport


def test_inline_requests_pause_reading_at_the_cap_and_resume_at_half() -> None:
    async def main() -> None:
        conn, transport = connected()
        release = asyncio.Event()

        async def waits() -> None:
            await release.wait()

        conn._start(waits())
        for _ in range(3):
            conn._began_inline()
        assert transport.paused and conn.busy()  # 1 task + 3 inline: the cap of 4
        conn._answered_inline()
        assert transport.paused  # 3 in flight: above half
        conn._answered_inline()
        assert not transport.paused  # 2: half the cap
        release.set()
        await asyncio.gather(*conn.tasks)
        conn._answered_inline()
        assert not conn.busy() and not transport.closed

    asyncio.run(main())


def test_after_eof_the_connection_closes_once_the_last_inline_answer_is_out() -> None:
    conn, transport = connected()
    conn._began_inline()
    conn._began_inline()
    conn._close_when_answered()
    assert not transport.closed
    conn._answered_inline()
    assert not transport.closed
    conn._answered_inline()
    assert transport.closed


def test_drain_waits_for_inline_requests() -> None:
    async def main() -> None:
        conn, _ = connected()
        assert conn.inline_answered().done()  # nothing in flight
        conn._began_inline()
        conn._began_inline()
        answered = conn.inline_answered()
        assert conn.inline_answered() is answered
        conn._answered_inline()
        assert not answered.done()
        conn._answered_inline()
        assert answered.done()
        conn._began_inline()  # a later request is not covered by the earlier wait
        assert not conn.inline_answered().done()
        conn._answered_inline()

    asyncio.run(main())


def test_a_stopping_listeners_connections_read_no_more_until_they_close() -> None:
    """Reading stops as the listener's drain begins: a request arriving then was started
    (a Kimberlite append stored) and its connection closed before its answer. A request
    in flight that ends does not resume reading, as it would at half the cap."""

    async def main() -> None:
        conn, transport = connected()
        release = asyncio.Event()

        async def waits() -> None:
            await release.wait()

        for _ in range(4):  # at the cap: paused
            conn._start(waits())
        conn.stop_reading()
        release.set()
        await asyncio.gather(*conn.tasks)
        assert transport.paused and not conn.busy()  # drained, still not reading
        idle, idle_transport = connected()
        idle.stop_reading()  # not paused before: paused now
        assert idle_transport.paused

    asyncio.run(main())
