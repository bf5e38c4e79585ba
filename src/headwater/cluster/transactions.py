"""Transactions across the cluster (docs/cluster.md, "Transactions across the cluster").

As in Kafka, where a transactional id's coordinator is the leader of its
``__transaction_state`` partition, a tenant's transactions are coordinated by the leader
of its state stream (``hw_transaction_state``), placed and replicated like any stream.
It has one partition per tenant, so one node coordinates all of a tenant's
transactions; the others refuse transactional calls NOT_COORDINATOR.

* **State.** Each record the coordinator writes (Ongoing with the partitions added,
  PrepareCommit / PrepareAbort, Complete*) is acknowledged by the partition's in-sync
  replicas before the call returns (:meth:`replicated`), so the next coordinator's
  replica has every decision a producer was told of.
* **Failover.** A node that starts leading the state partition replays its replica and
  finishes every transaction it finds prepared (its markers written where missing)
  before it answers as the coordinator (:meth:`reconcile`, in the background: a marker
  may wait for another partition's failover). An open transaction is kept: its producer
  goes on with it at the new coordinator, or its timeout aborts it.
* **Markers.** The coordinator asks each partition's leader to write its marker
  (:meth:`write_marker`): its own partitions directly, the others' over the replication
  listener (``txn_marker`` in :mod:`headwater.protocols.replication`, Kafka's
  WriteTxnMarkers). The leader writes it only while the producer's transaction is open
  there (so a retry adds nothing) and answers once its in-sync replicas hold it; the
  coordinator retries against whoever leads the partition until one does.
* **Producer ids** come from blocks of :data:`BLOCK_SIZE` that a node takes from an etcd
  counter (``producer_ids``) by compare-and-set (Kafka's KIP-730), so any node hands out
  an idempotent producer's id without writing the state stream, and no two nodes the
  same id.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from headwater.cluster.coordinators import TenantPartitionCoordinators
from headwater.cluster.etcd import absent, put_json, unchanged
from headwater.cluster.layout import NO_LEADER, PartitionKey
from headwater.engine.groups import CoordinatorNotAvailable
from headwater.engine.transactions import TXN_STATE_STREAM, ClusterHooks
from headwater.errors import HeadwaterError, NotLeader, ProtocolError
from headwater.protocols import replication as wire
from headwater.tasks import cancel_and_wait

if TYPE_CHECKING:
    from headwater.cluster.node import ClusterNode

log = logging.getLogger("headwater.cluster")

STATE_PARTITION = 0  # the one partition of a tenant's transaction state stream
REPLICATED_TIMEOUT_S = 30.0  # a state record's or a marker's wait for the ISR
MARKER_TIMEOUT_S = 60.0  # a marker's retries while its partition has no reachable leader
RETRY_S = 0.25
ASK_TIMEOUT_S = REPLICATED_TIMEOUT_S + 5.0  # the leader waits up to its ISR's timeout
BLOCK_SIZE = 1000  # producer ids a node takes at once
# Above every id a single node (2**48 on) or a cluster node's own range (2**48 + node
# id * 2**40, before id blocks replaced those ranges) handed out.
FIRST_BLOCK_ID = 1 << 56


class TransactionCoordinators(TenantPartitionCoordinators):
    STREAM = TXN_STATE_STREAM
    PARTITION = STATE_PARTITION
    NOUN = "transaction"

    def __init__(self, node: ClusterNode) -> None:
        super().__init__(node)
        self._reloads: dict[int, asyncio.Task[None]] = {}
        self._ids_lock = asyncio.Lock()
        self._next_id = 0
        self._block_end = 0

    def hooks(self) -> ClusterHooks:
        return ClusterHooks(
            self.check, self.check_leads, self.allocate, self.replicated, self.write_marker
        )

    def check_leads(self, tenant_id: int) -> None:
        if not self._node.replication.leads(self.partition(tenant_id)):
            # Not NotLeader: a Kafka client finds the coordinator again on this one.
            raise CoordinatorNotAvailable("no longer the transaction coordinator; find it again")

    async def replicated(self, tenant_id: int, end: int) -> None:
        await self._node.replication.wait_replicated(
            self.partition(tenant_id), end, REPLICATED_TIMEOUT_S
        )

    # ---- producer ids -------------------------------------------------------------------

    async def allocate(self, _tenant_id: int) -> int:
        """A producer id no other node hands out (ids are unique across tenants too)."""
        async with self._ids_lock:
            if self._next_id >= self._block_end:
                self._next_id, self._block_end = await self._take_block()
            pid = self._next_id
            self._next_id += 1
            return pid

    async def _take_block(self) -> tuple[int, int]:
        etcd, key = self._node.etcd, self._node.keys.prefix + "producer_ids"
        while True:
            current = await etcd.get(key)
            start = FIRST_BLOCK_ID if current is None else int(current.json()["next"])
            guard = absent(key) if current is None else unchanged(current)
            if await etcd.txn([guard], [put_json(key, {"next": start + BLOCK_SIZE})]):
                return start, start + BLOCK_SIZE

    # ---- markers ------------------------------------------------------------------------

    async def write_marker(
        self,
        tenant_id: int,
        stream: str,
        partition: int,
        producer_id: int,
        epoch: int,
        commit: bool,
    ) -> None:
        """The marker on the partition's leader, once its ISR holds it; retried against
        whoever leads the partition (a failover under way) for up to MARKER_TIMEOUT_S."""
        key = PartitionKey(tenant_id, stream, partition)
        marker = wire.TxnMarker(tenant_id, stream, partition, producer_id, epoch, commit)
        deadline = time.monotonic() + MARKER_TIMEOUT_S
        while True:
            try:
                state = self._node.partitions.get(key)
                if state is None or state.leader == NO_LEADER:
                    raise NotLeader(f"partition {partition} of {stream} has no leader")
                if state.leader == self._node.config.node_id:
                    await self._write_here(marker)
                    return
                await self._ask(state.leader, marker)
                return
            except (HeadwaterError, OSError, ProtocolError, TimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise NotLeader(
                        f"could not write the transaction marker on partition {partition} "
                        f"of {stream}: {exc}"
                    ) from None
                await asyncio.sleep(RETRY_S)

    async def _write_here(self, marker: wire.TxnMarker) -> None:
        key = PartitionKey(marker.tenant, marker.stream, marker.partition)
        if not self._node.replication.leads(key):
            raise NotLeader(f"not the leader of partition {marker.partition} of {marker.stream}")
        end = await self._node.api.write_marker(
            marker.tenant,
            marker.stream,
            marker.partition,
            marker.producer_id,
            marker.epoch,
            marker.commit,
        )
        if end is None:  # written before: wait for the ISR to hold what is there
            end = self._node.api.replicas.end(marker.tenant, marker.stream, marker.partition)
        await self._node.replication.wait_replicated(key, end, REPLICATED_TIMEOUT_S)

    async def _ask(self, leader: int, marker: wire.TxnMarker) -> None:
        node = self._node.nodes.get(leader)
        if node is None or "replication" not in node.ports:
            raise NotLeader(f"node {leader} is not reachable")
        # Bounded: a leader that stopped answering (paused, cut off) is asked again, or
        # its successor, once etcd names one.
        async with asyncio.timeout(ASK_TIMEOUT_S):
            reader, writer = await self._node.security.connect(node.host, node.ports["replication"])
            try:
                writer.write(marker.encode())
                await writer.drain()
                frames = wire.FrameReader()
                while not (got := frames.feed(await reader.read(1 << 16))):
                    if reader.at_eof():
                        raise ConnectionError(f"node {leader} closed the connection")
            finally:
                writer.close()
        error = got[0].header.get("error")
        if error:
            raise NotLeader(f"node {leader}: {error}")

    async def answer_marker(self, marker: wire.TxnMarker) -> bytes:
        """The replication listener's answer to a coordinator's marker request."""
        try:
            await self._write_here(marker)
        except HeadwaterError as exc:
            return wire.encode({"error": str(exc) or type(exc).__name__})
        return wire.encode({"error": None})

    # ---- each tick ----------------------------------------------------------------------

    def reconcile(self) -> None:
        """Start reloading the transactions of every tenant whose state partition this
        node has started or stopped leading (in the background: a recovery's markers may
        wait for other partitions' failovers, which later ticks carry out)."""
        replication = self._node.replication
        for tenant_id in self._node.api.tenant_ids():
            if tenant_id in self._reloads:
                continue
            leads = replication.leads(self.partition(tenant_id))
            if leads == (tenant_id in self._coordinating):
                continue
            self._coordinating.discard(tenant_id)
            self._reloads[tenant_id] = asyncio.create_task(
                self._reload(tenant_id, leads), name=f"transactions-reload-{tenant_id}"
            )

    async def _reload(self, tenant_id: int, leads: bool) -> None:
        try:
            await self._node.api.reload_transactions(tenant_id, leads)
            if leads and self._node.replication.leads(self.partition(tenant_id)):
                self._coordinating.add(tenant_id)
            log.info(
                "transaction coordinator" if leads else "no longer the transaction coordinator",
                extra={"tenant": tenant_id, "node_id": self._node.config.node_id},
            )
        except HeadwaterError as exc:  # the next tick tries again
            log.warning("cannot reload the transactions of tenant %d: %s", tenant_id, exc)
        finally:
            del self._reloads[tenant_id]

    async def stop(self) -> None:
        await cancel_and_wait(*self._reloads.values())
