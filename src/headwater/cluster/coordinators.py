"""Which node coordinates a tenant's consumer groups (docs/cluster.md, "Consumer groups
across the cluster").

As in Kafka, where a group's coordinator is the leader of its ``__consumer_offsets``
partition, a tenant's groups are coordinated by the leader of its offsets stream
(``hw_consumer_offsets``), which is placed and replicated like any stream. That stream
has one partition per tenant (its offsets are not spread by group id yet), so one node
coordinates all of a tenant's groups.

Each tick, after replication took or gave up leaderships, :meth:`reconcile` reloads the
offsets of a tenant whose offsets partition this node started (or stopped) leading from
the local replica; only then does :meth:`check` let its group requests through. A commit
is acknowledged once the partition's in-sync replicas hold it (:meth:`replicated`), so
the next coordinator's replica has every commit a client was told of.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from headwater.cluster.layout import NO_LEADER, NodeInfo, PartitionKey
from headwater.engine.groups import CoordinatorNotAvailable, NotCoordinator
from headwater.engine.groups.offsets import OFFSETS_STREAM

if TYPE_CHECKING:
    from headwater.cluster.node import ClusterNode

log = logging.getLogger("headwater.cluster")

OFFSETS_PARTITION = 0  # the one partition of a tenant's offsets stream
COMMIT_TIMEOUT_S = 30.0  # an offset commit's wait for the in-sync replicas


class TenantPartitionCoordinators:
    """The coordinator of a tenant's ``NOUN`` is the leader of the tenant's one
    partition of an internal stream (Kafka's ``__consumer_offsets`` /
    ``__transaction_state``), once that leader has reloaded the partition: the tenants
    it has are in ``_coordinating``, which the subclass keeps."""

    STREAM: str
    PARTITION: int
    NOUN: str  # what a tenant's coordinator coordinates, as the messages name it

    def __init__(self, node: ClusterNode) -> None:
        self._node = node
        # Tenants whose partition this node leads and has reloaded.
        self._coordinating: set[int] = set()

    @classmethod
    def partition(cls, tenant_id: int) -> PartitionKey:
        return PartitionKey(tenant_id, cls.STREAM, cls.PARTITION)

    def coordinator(self, tenant_id: int) -> NodeInfo | None:
        """The node coordinating the tenant's ``NOUN`` now, None while there is none
        (the partition not placed yet, leaderless during a failover, or its leader
        reloading)."""
        if tenant_id in self._coordinating:
            return self._node.info
        state = self._node.partitions.get(self.partition(tenant_id))
        if state is None or state.leader in (NO_LEADER, self._node.config.node_id):
            return None  # here: not taken, or not reloaded yet
        return self._node.nodes.get(state.leader)

    def check(self, tenant_id: int) -> None:
        """NotCoordinator (another node coordinates) or CoordinatorNotAvailable (none
        does now) unless this node coordinates the tenant's ``NOUN``."""
        if tenant_id in self._coordinating and self._node.replication.leads(
            self.partition(tenant_id)
        ):
            return
        other = self.coordinator(tenant_id)
        noun = self.NOUN
        if other is None or other.node_id == self._node.config.node_id:
            raise CoordinatorNotAvailable(f"the {noun} coordinator is moving; find it again")
        # Its listeners named as NotLeader names a leader's: the Rivven SDK follows.
        raise NotCoordinator(
            f"node {other.node_id} coordinates this tenant's {noun}s: {other.listed()}"
        )


class GroupCoordinators(TenantPartitionCoordinators):
    STREAM = OFFSETS_STREAM
    PARTITION = OFFSETS_PARTITION
    NOUN = "group"

    async def replicated(self, tenant_id: int, stream: str, end: int) -> None:
        """An offset commit's acks=all: the in-sync replicas hold the offsets partition
        below ``end`` (NotEnoughReplicas* or NotLeader otherwise)."""
        key = PartitionKey(tenant_id, stream, OFFSETS_PARTITION)
        await self._node.replication.wait_replicated(key, end, COMMIT_TIMEOUT_S)

    async def reconcile(self) -> None:
        """Reload the offsets of every tenant whose offsets partition this node has
        started or stopped leading."""
        replication = self._node.replication
        for tenant_id in self._node.api.tenant_ids():
            leads = replication.leads(self.partition(tenant_id))
            if leads == (tenant_id in self._coordinating):
                continue
            if not leads:
                self._coordinating.discard(tenant_id)
            await self._node.api.groups.reload(tenant_id)
            if leads:
                self._coordinating.add(tenant_id)
            log.info(
                "group coordinator" if leads else "no longer the group coordinator",
                extra={"tenant": tenant_id, "node_id": self._node.config.node_id},
            )
