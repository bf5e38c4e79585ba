"""A group consumer carrying out a rebalance: an answer the coordinator gave is never
dropped, even when the next rebalance is noticed before the poll that would carry it
out (in process: no server; the consumer's state set as its membership leaves it)."""

from __future__ import annotations

import asyncio

from headwater.client.consumer import AsyncConsumer, TopicPartition


def test_a_pending_answer_is_carried_out_before_the_next_rejoin() -> None:
    """cooperative-sticky: A's answer takes partitions 2 and 3 away; the follow-up
    rebalance (the coordinator starts it once every member has its answer, and hands
    2 and 3 to another member in it) is noticed before A polls. That poll dropped the
    answer, and A went on reading 2 and 3 beside their new owner."""

    async def main() -> tuple[list[TopicPartition], list[list[int]]]:
        consumer = AsyncConsumer(
            "127.0.0.1:1",
            group_id="g",
            partition_assignment_strategy="cooperative-sticky",
            enable_auto_commit=False,
        )
        revoked: list[list[int]] = []
        consumer._on_revoke = lambda tps: revoked.append([tp.partition for tp in tps])
        held = [TopicPartition("s", p) for p in range(4)]
        consumer._assignment = list(held)
        answer = asyncio.get_running_loop().create_future()
        answer.set_result((held[:2], held[2:]))  # keep 0 and 1, give up 2 and 3
        consumer._joined = answer
        consumer._rejoin_needed.set()  # the follow-up, noticed by a heartbeat since
        await consumer._service()
        assert consumer._revoked.is_set()  # the membership may rejoin now
        return consumer._assignment, revoked

    assignment, revoked = asyncio.run(main())
    assert revoked == [[2, 3]]
    assert [tp.partition for tp in assignment] == [0, 1]
