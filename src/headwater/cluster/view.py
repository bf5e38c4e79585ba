"""What a front end asks the cluster (docs/cluster.md, "Front ends"): who leads a
partition, whether this node does, how far consumers may read, and acks=all's wait.

A front end is handed ``server.cluster`` (None on a single node, where every
partition is led here and readable to its end) and calls only these methods; the
answers come from etcd's state as of this node's last tick and from replication."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from headwater.cluster.layout import NodeInfo, PartitionKey
from headwater.cluster.replication import (
    NotEnoughReplicas,
    NotEnoughReplicasAfterAppend,
    ReplicationTimedOut,
)
from headwater.engine.kinds.model import kind_of_changelog
from headwater.errors import NotLeader

if TYPE_CHECKING:
    from headwater.cluster.node import ClusterNode

__all__ = [
    "ClusterView",
    "NotEnoughReplicas",
    "NotEnoughReplicasAfterAppend",
    "NotLeader",
    "PartitionView",
    "ReplicationTimedOut",
    "not_leader",
]


def not_leader(key: PartitionKey, leader: NodeInfo | None) -> NotLeader:
    """The refusal of a write to ``key`` on a node that does not lead it: what was
    written to (a kind by its name, for its changelog; else the partition), the
    leader's id and every client-facing listener's address, in the message (the only
    place most wires have for them) and beside it (HTTP's JSON body); or that it has
    no leader now (``leader`` None: an election)."""
    kind = kind_of_changelog(key.stream)
    target = f"partition {key.partition} of {key.stream}" if kind is None else f"kind {kind}"
    if leader is None:
        return NotLeader(f"{target} has no leader right now")
    return NotLeader(
        f"node {leader.node_id} leads {target}: {leader.listed()}",
        {"node_id": leader.node_id, **leader.addresses()},
    )


@dataclass(frozen=True)
class PartitionView:
    leader: int  # -1: none now
    epoch: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


class ClusterView:
    def __init__(self, node: ClusterNode) -> None:
        self.node_id = node.config.node_id
        self._node = node
        self._replication = node.replication

    def nodes(self) -> list[NodeInfo]:
        """The live nodes, by id (this one among them once it has joined, unless it is
        fenced off: Replication.fenced)."""
        live = dict(self._node.nodes)
        if not self._node.joined:
            # Not a member yet (waiting for its id): clients are sent to the members
            # only (under its id: the process that holds it), never to it.
            return [live[n] for n in sorted(live)]
        live.setdefault(self.node_id, self._node.info)
        if self._replication.fenced():
            del live[self.node_id]
        return [live[n] for n in sorted(live)]

    @property
    def controller_id(self) -> int:
        return self._node.controller_id

    def group_coordinator(self, tenant_id: int) -> NodeInfo | None:
        """The node coordinating the tenant's consumer groups (the leader of its offsets
        stream), None while none does (FindCoordinator: COORDINATOR_NOT_AVAILABLE)."""
        return self._node.coordinators.coordinator(tenant_id)

    def transaction_coordinator(self, tenant_id: int) -> NodeInfo | None:
        """The node coordinating the tenant's transactions (the leader of its state
        stream), None while none does (FindCoordinator: COORDINATOR_NOT_AVAILABLE)."""
        return self._node.transactions.coordinator(tenant_id)

    def check_group_coordinator(self, tenant_id: int) -> None:
        """NotCoordinator / CoordinatorNotAvailable unless this node coordinates the
        tenant's groups now."""
        self._node.coordinators.check(tenant_id)

    def partition(self, tenant_id: int, stream: str, partition: int) -> PartitionView | None:
        key = PartitionKey(tenant_id, stream, partition)
        state = self._node.partitions.get(key)
        if state is None:
            return None
        leader = state.leader
        if leader == self.node_id and not self._replication.leads(key):
            leader = -1  # not (or no longer surely) leading: clients ask the others
        return PartitionView(leader, state.epoch, state.replicas, state.isr)

    def check_leader(self, tenant_id: int, stream: str, partition: int) -> None:
        """NotLeader (its message naming the leader's listeners when one is known)
        unless this node leads the partition now."""
        key = PartitionKey(tenant_id, stream, partition)
        if self._replication.leads(key):
            return
        state = self._node.partitions.get(key)
        raise not_leader(key, None if state is None else self._node.nodes.get(state.leader))

    def check_replica(self, tenant_id: int, stream: str, partition: int) -> None:
        """NotLeader naming the leader unless this node holds a replica of the partition
        (or etcd has not placed it yet: it is this node's alone until then)."""
        key = PartitionKey(tenant_id, stream, partition)
        state = self._node.partitions.get(key)
        if state is None or self.node_id in state.replicas:
            return
        raise not_leader(key, self._node.nodes.get(state.leader))

    def high_watermark(self, tenant_id: int, stream: str, partition: int, end: int) -> int:
        """Where consumers of the partition stop (never past the local ``end``); a
        partition etcd does not know yet (just created) is readable to its end here."""
        key = PartitionKey(tenant_id, stream, partition)
        if key not in self._node.partitions:
            return end
        return min(end, self._replication.high_watermark(key))

    async def replicated(
        self, tenant_id: int, stream: str, partition: int, end: int, timeout_s: float
    ) -> None:
        """acks=all, after the append: every in-sync replica holds the partition below
        ``end`` (NotEnoughReplicasAfterAppend when the ISR is below min_insync_replicas,
        ReplicationTimedOut when time runs out)."""
        key = PartitionKey(tenant_id, stream, partition)
        await self._replication.wait_replicated(key, end, timeout_s)

    def check_min_isr(self, tenant_id: int, stream: str, partition: int) -> None:
        """NotEnoughReplicas before an acks=all append when the ISR is already too small
        (Kafka refuses those before writing)."""
        state = self._node.partitions.get(PartitionKey(tenant_id, stream, partition))
        needed = self._node.config.min_insync_replicas
        if state is not None and len(state.isr) < needed:
            raise NotEnoughReplicas(
                f"{len(state.isr)} in-sync replicas, below min_insync_replicas ({needed})"
            )
