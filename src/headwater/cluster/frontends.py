"""The cluster's rules for every front end, set once on the engine (docs/cluster.md,
"Front ends"): an append to a partition this node does not lead is NotLeader (naming
the leader), an acknowledged append waits for the in-sync replicas, and every reader
of a replicated partition, leader or follower, stops below its high watermark and is
woken when it moves.

Set on the engine (through :class:`headwater.api.cluster_gate.ClusterGate`) rather than
in each front end, so Rivven, HTTP, SQL INSERT, Kiwi, subscriptions and the SQL
projection keep to them as Kafka and Kimberlite do, and a front end added later too.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from headwater.cluster.layout import PartitionKey

if TYPE_CHECKING:
    from headwater.cluster.node import ClusterNode


class FrontEndRules:
    def __init__(self, node: ClusterNode) -> None:
        self._node = node
        self._gate = node.api.cluster_gate
        # The high watermark readers were last woken for, per partition capped here.
        self._published: dict[PartitionKey, int] = {}

    def start(self) -> None:
        """Appends are checked from now on (before the node has read etcd: none leads),
        and acknowledged once the in-sync replicas hold them."""
        self._gate.check_appends(self._node.view.check_leader)
        self._gate.check_reads(self._node.view.check_replica)
        self._gate.wait_for_replicas(self._node.view)

    def reconcile(self) -> None:
        """Each tick: cap the readers of every partition etcd places (new streams, new
        partitions, a stream recreated), and wake them where the high watermark moved
        without a fetch saying so (an ISR shrunk, a leadership taken)."""
        capped: set[PartitionKey] = set()
        high_watermark = self._node.replication.high_watermark
        for key in self._node.partitions:
            where = (key.tenant_id, key.stream, key.partition)
            if self._gate.limit_reads(*where, partial(high_watermark, key)):
                capped.add(key)
                self.moved(key)
        for key in self._published.keys() - capped:
            del self._published[key]

    def forget(self, tenant_id: int, stream: str) -> None:
        """A stream deleted in the cluster: the name created again is woken afresh."""
        for key in [k for k in self._published if (k.tenant_id, k.stream) == (tenant_id, stream)]:
            del self._published[key]

    def moved(self, key: PartitionKey) -> None:
        """Replication learned something that may move ``key``'s high watermark: wake
        its waiting readers (subscriptions, the SQL projection) if it did."""
        hw = self._node.replication.high_watermark(key)
        if self._published.get(key) != hw:
            self._published[key] = hw
            self._gate.readable_moved(key.tenant_id, key.stream, key.partition)
