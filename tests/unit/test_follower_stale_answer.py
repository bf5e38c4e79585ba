"""A follower's fetch answer that arrives after etcd moved the partition's leadership
(here, to this very node) changes nothing: appended, it would put the old leader's tail
into the new leader's log and producer table and its leader epochs back over the new
one (the reassignment test's OUT_OF_ORDER_SEQUENCE on the new leader, docs/cluster.md).
The node, its replicas and the leader's connection are stand-ins; the Replication is
the real one."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from headwater.cluster.layout import PartitionKey, PartitionState
from headwater.cluster.replication import Replication
from headwater.protocols import replication as wire
from headwater.storage.leader_epochs import LeaderEpochs

KEY = PartitionKey(0, "events", 0)
ME, OLD_LEADER = 2, 1


class CopyingReplicas:
    """What Replication asks of the partition: its end, epochs, and the copies made."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.leader_epochs = LeaderEpochs(data_dir)
        self.appended: list[bytes] = []
        self.cut_to: list[int] = []

    def end(self, tenant_id: int, stream: str, partition: int) -> int:
        return 10

    def epochs(self, tenant_id: int, stream: str, partition: int) -> LeaderEpochs:
        return self.leader_epochs

    async def append_stored(self, tenant_id: int, stream: str, partition: int, data: bytes) -> int:
        self.appended.append(data)
        return 10 + len(data)

    async def truncate(self, tenant_id: int, stream: str, partition: int, offset: int) -> int:
        self.cut_to.append(offset)
        return offset


class Leader:
    """The old leader's end of the connection: records the fetch sent."""

    def __init__(self) -> None:
        self.sent = bytearray()
        self.asked = asyncio.Event()

    def write(self, data: bytes) -> None:
        self.sent += data
        self.asked.set()

    async def drain(self) -> None:
        return None


def node_with(replicas: CopyingReplicas, leader: int, epoch: int) -> Any:
    return SimpleNamespace(
        api=SimpleNamespace(replicas=replicas),
        config=SimpleNamespace(node_id=ME),
        partitions={KEY: PartitionState((1, 2, 3), leader, epoch, (1, 2, 3))},
        front_ends=SimpleNamespace(moved=lambda key: None),
    )


async def answer_after(
    replication: Replication, change: Any, header: dict[str, Any], data: bytes
) -> bool:
    """One fetch of ``replication`` from OLD_LEADER in epoch 3: ``change()`` runs once it
    is sent, then the answer arrives."""
    reader = asyncio.StreamReader()
    leader = Leader()
    fetching = asyncio.create_task(
        replication._fetch_once(KEY, OLD_LEADER, 3, reader, cast(Any, leader), wire.FrameReader())
    )
    await leader.asked.wait()
    change()
    reader.feed_data(wire.encode(header, data))
    return await fetching


def test_an_answer_taken_before_the_move_is_copied(tmp_path: Path) -> None:
    replicas = CopyingReplicas(tmp_path)
    node = node_with(replicas, OLD_LEADER, 3)
    replication = Replication(node)
    header = {"hw": 10, "epochs": [[3, 0]]}
    assert asyncio.run(answer_after(replication, lambda: None, header, b"batches")) is True
    assert replicas.appended == [b"batches"]
    assert replicas.leader_epochs.entries == [(3, 0)]


def test_an_answer_arriving_after_this_node_leads_changes_nothing(tmp_path: Path) -> None:
    replicas = CopyingReplicas(tmp_path)
    replicas.leader_epochs.assign(3, 0)
    node = node_with(replicas, OLD_LEADER, 3)
    replication = Replication(node)

    def now_led_here() -> None:
        node.partitions = {KEY: PartitionState((1, 2, 3), ME, 4, (1, 2, 3))}
        replicas.leader_epochs.assign(4, 10)  # as _take_leadership does

    header = {"hw": 12, "epochs": [[3, 0]]}
    assert asyncio.run(answer_after(replication, now_led_here, header, b"old tail")) is False
    assert replicas.appended == []
    assert replicas.leader_epochs.entries == [(3, 0), (4, 10)]
    # Nor is a divergent-tail answer of the old leader acted on.
    diverging = {"diverging": [3, 5]}
    assert asyncio.run(answer_after(replication, lambda: None, diverging, b"")) is False
    assert replicas.cut_to == []
