"""The read-answer budget (server/answers.py): what an answer may take, when its room
is free again, and that a connection's answers wait for the peer to read."""

from __future__ import annotations

import asyncio

from headwater.server.answers import AnswerBudget, AnswerRoom
from waiting import scheduled_callbacks_run


def test_an_answer_takes_what_is_left_and_gives_it_back_once_written() -> None:
    async def main() -> None:
        budget = AnswerBudget(100)
        first, second = AnswerRoom(budget), AnswerRoom(budget)
        async with first.turn(70) as granted:
            assert granted == 70
        first.pause_writing()  # its answer sits in the write buffer
        await scheduled_callbacks_run()  # past the check made once it was handed over
        async with second.turn(70, wait_s=0) as granted:
            assert granted == 30  # what is left: it reads less
        await scheduled_callbacks_run()
        assert budget.held == 70  # the first answer is still unread
        first.resume_writing()  # the peer read it
        assert budget.held == 0

    asyncio.run(main())


def test_with_no_room_a_read_waits_until_some_is_given_back_or_its_time_is_up() -> None:
    async def main() -> None:
        budget = AnswerBudget(10)
        hog, reader = AnswerRoom(budget), AnswerRoom(budget)
        async with hog.turn(10):
            pass
        hog.pause_writing()
        await scheduled_callbacks_run()
        async with reader.turn(5, wait_s=0.01) as granted:
            assert granted == 0  # none within its wait: it reads nothing

        async def later() -> int:
            async with reader.turn(5) as granted:
                return granted

        waiting = asyncio.ensure_future(later())
        for _ in range(5):  # its turns on the loop: it is waiting, not done
            await scheduled_callbacks_run()
        assert not waiting.done()
        hog.lost()  # the hog's connection closed: its room is free
        assert await waiting == 5

    asyncio.run(main())


def test_a_connections_next_answer_waits_for_the_peer_to_read_the_one_before() -> None:
    async def main() -> list[str]:
        room, built = AnswerRoom(AnswerBudget(1 << 20)), []

        async def answer(name: str) -> None:
            async with room.turn(10):
                built.append(name)
                if name == "first":
                    room.pause_writing()  # the transport's buffer is full

        tasks = [asyncio.ensure_future(answer(name)) for name in ("first", "second")]
        for _ in range(5):
            await scheduled_callbacks_run()
        assert built == ["first"]
        room.resume_writing()
        await asyncio.gather(*tasks)
        return built

    assert asyncio.run(main()) == ["first", "second"]


def test_once_lost_a_connections_answers_no_longer_wait_for_the_peer() -> None:
    """The server stopping calls ``lost`` once: an answer written after it that fills
    the buffer (``pause_writing``) must not make the next one wait for a peer that
    will never read it."""

    async def main() -> None:
        budget = AnswerBudget(100)
        room = AnswerRoom(budget)
        room.lost()
        async with room.turn(10):
            pass
        room.pause_writing()  # the answer after the stop began sits in the buffer
        async with asyncio.timeout(5):
            async with room.turn(10) as granted:
                assert granted == 10

    asyncio.run(main())
