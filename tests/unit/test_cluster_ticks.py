"""A cluster node's ticks go on after one fails: a tick that raises (a disk error
cutting a replica, a bug) is logged, and the next tick runs, so the node keeps
following etcd instead of serving on with the state it last read."""

from __future__ import annotations

import asyncio

import pytest

from headwater.cluster import node as node_module
from headwater.cluster.etcd import EtcdError
from headwater.cluster.node import ClusterNode


def test_a_failing_tick_does_not_end_the_ticks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_module, "TICK_S", 0)
    outcomes: list[BaseException | None] = [
        OSError(5, "Input/output error"),
        EtcdError("etcd is down"),
        RuntimeError("a bug"),
        None,
    ]
    ran: list[int] = []

    async def main() -> None:
        cluster_node = object.__new__(ClusterNode)  # only the tick loop is under test
        cluster_node._etcd_down = False
        done = asyncio.get_running_loop().create_future()

        async def tick() -> None:
            ran.append(len(ran))
            if len(ran) == len(outcomes):
                done.set_result(None)
            outcome = outcomes[min(len(ran), len(outcomes)) - 1]
            if outcome is not None:
                raise outcome

        cluster_node.tick = tick  # type: ignore[method-assign]
        ticks = asyncio.create_task(cluster_node._tick_forever())
        await asyncio.wait_for(done, 10)
        assert not ticks.done()  # still ticking after the three failures
        ticks.cancel()
        with pytest.raises(asyncio.CancelledError):
            await ticks

    asyncio.run(main())
    assert ran[:4] == [0, 1, 2, 3]
