"""One server's part in the cluster: membership, stream registry and the controller.

Every node holds an etcd lease (``lease_s``), renewed a few times per lease, and its
``nodes/<id>`` key under it; a node that dies (SIGKILL, a cut network) stops renewing,
etcd drops its key when the lease runs out, and the controller sees it gone.

Each tick (``TICK_S``) a node
* registers the streams it has that etcd does not know yet, creates locally the
  streams etcd knows that it lacks (so a stream created through any node's front end
  exists on every node, with the same partition count) and deletes its copies of
  streams deleted in the cluster (cluster/streams.py),
* publishes its end offset per partition (``offsets/<id>``: what ``headwater cluster
  status`` reports lag from),
* tries to become the controller (a txn creating ``controller`` under its lease: etcd
  lets exactly one node win, and the key goes with its lease), and if it is, places the
  partitions that have no state yet and moves the leadership of dead nodes' partitions
  to live in-sync replicas (:func:`headwater.cluster.layout.after_failures`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Mapping

from headwater.api import EngineAPI
from headwater.cluster.config import ClusterConfig
from headwater.cluster.coordinators import GroupCoordinators
from headwater.cluster.etcd import (
    Delete,
    Etcd,
    EtcdError,
    Put,
    absent,
    put_json,
    same_key,
    unchanged,
)
from headwater.cluster.frontends import FrontEndRules
from headwater.cluster.kinds import KindRegistrySync
from headwater.cluster.layout import (
    Keys,
    NodeInfo,
    PartitionKey,
    PartitionState,
    after_failures,
    place_replicas,
    reassignment_step,
)
from headwater.cluster.peers import PeerSecurity
from headwater.cluster.replication import Replication
from headwater.cluster.streams import StreamRegistry
from headwater.cluster.transactions import TransactionCoordinators
from headwater.cluster.view import ClusterView
from headwater.tasks import cancel_and_wait

log = logging.getLogger("headwater.cluster")
REJOIN_ATTEMPTS = 5  # rounds of leaving the ISRs, each after the controller moved one

TICK_S = 0.5  # how often a node reconciles with etcd (a failover takes lease_s + this)


class ClusterJoinError(Exception):
    """The node cannot join: etcd unreachable, or its node id held by a live process.
    ``headwater serve`` says so in one line and exits."""


class ClusterNode:
    def __init__(
        self,
        config: ClusterConfig,
        api: EngineAPI,
        security: PeerSecurity,
    ):
        self.config = config
        self.api = api
        self.security = security  # the replication listener's TLS, secret and limits
        self.keys = Keys(config.prefix)
        # Its listeners' ports come with start(): until then it advertises none.
        self.info = NodeInfo(config.node_id, config.advertise_host, config.rack, {})
        self.etcd = Etcd(config.etcd)
        self.lease = 0
        self.is_controller = False
        # What the last tick read from etcd: front ends answer from these.
        self.nodes: dict[int, NodeInfo] = {}
        self.partitions: dict[PartitionKey, PartitionState] = {}
        self._published_offsets: dict[str, int] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._etcd_down = False  # the last tick could not reach etcd
        self._renewed_at = 0.0  # when etcd last renewed the lease (monotonic)
        self.joined = False  # registered and etcd read once: a member clients may be sent to
        self.replication = Replication(self)
        self.controller_id = -1  # as of the last tick
        self.coordinators = GroupCoordinators(self)
        self.kinds = KindRegistrySync(self)  # kinds' schemas; changelogs are partitions
        self.streams = StreamRegistry(self)  # streams made and deleted on every node
        self.transactions = TransactionCoordinators(self)
        self.view = ClusterView(self)  # what the front ends ask
        self.front_ends = FrontEndRules(self)  # appends on leaders, reads below the HW

    # ---- life ---------------------------------------------------------------------------

    async def start(self, ports: Mapping[str, int]) -> None:
        """Join, advertising the listeners' ``ports``: take a lease and the node's key
        under it. A key still held by an earlier run of this node (killed, its lease not
        yet expired) is waited out, up to two leases; a key held longer than that is
        another live process. Either that or etcd unreachable: ClusterJoinError (the
        server's stop then closes the client)."""
        self.front_ends.start()
        self.api.cluster_gate.deregister_before_delete(self.streams.deregister)
        self.api.cluster_gate.register_before_create(self.streams.register_new)
        await self.replication.start(self.config.advertise_host, self.config.replication_port)
        # Offset commits are acknowledged once the offsets partition's ISR holds them.
        self.api.groups.replicated = self.coordinators.replicated
        self.api.groups.check_coordinator = self.coordinators.check
        # The leader of the state stream coordinates transactions (cluster/transactions.py).
        self.api.join_transactions_cluster(self.transactions.hooks())
        self.info = NodeInfo(
            self.info.node_id,
            self.info.host,
            self.info.rack,
            {
                **ports,
                "replication": self.replication.port,
                **dict(self.config.advertise_ports),
            },
        )
        try:
            await self._join()
        except EtcdError as exc:
            raise ClusterJoinError(f"cannot join the cluster: {exc}") from None
        self._tasks = [
            asyncio.create_task(self._keep_alive_forever(), name="cluster-lease"),
            asyncio.create_task(self._tick_forever(), name="cluster-tick"),
        ]
        log.info("joined the cluster", extra={"node_id": self.config.node_id})

    async def _join(self) -> None:
        deadline = time.monotonic() + 2 * self.config.lease_s + 2
        waited = False
        while not await self._register():
            if time.monotonic() > deadline:
                raise ClusterJoinError(
                    f"cannot join the cluster: node_id {self.config.node_id} is held by "
                    "another live node"
                )
            if not waited:
                log.info(
                    "waiting for an earlier registration of this node to expire",
                    extra={"node_id": self.config.node_id},
                )
                waited = True
            # Meanwhile its Metadata names the members, so a client asking it keeps them.
            await self._read_nodes()
            await asyncio.sleep(TICK_S)
        await self._rejoin_out_of_sync()
        await self.tick()
        self.joined = True

    async def stop(self) -> None:
        """Leave: the lease is revoked, so the node's key (and the controller key, if it
        held it) go at once and its partitions move without waiting for the lease."""
        await cancel_and_wait(*self._tasks)
        await self.transactions.stop()
        await self.replication.stop()
        if self.lease:
            try:
                await self.etcd.revoke_lease(self.lease)
            except EtcdError as exc:
                log.warning("could not revoke the node's lease: %s", exc)
        await self.etcd.close()

    def lease_fresh(self) -> bool:
        """Whether etcd renewed this node's lease within the last lease: if not, the
        others may have counted it dead and elected new leaders."""
        return time.monotonic() - self._renewed_at < self.config.lease_s

    async def _register(self) -> bool:
        if not self.lease:
            self.lease = await self.etcd.grant_lease(self.config.lease_s)
            self._renewed_at = time.monotonic()
        return await self.etcd.txn(
            [absent(self.keys.node(self.config.node_id))],
            [put_json(self.keys.node(self.config.node_id), self.info.to_json(), self.lease)],
        )

    async def _rejoin_out_of_sync(self) -> None:
        """Registered anew (a start, or after its lease expired), this node first leaves
        the ISR of every partition and the leadership of those it led, as the controller
        does for a node it sees die. The controller reads the members each tick: a node
        that died and registered again between two reads kept its seats, and restarted
        with its data gone it led its empty log at the old epoch while the followers cut
        theirs to it (every acknowledged record lost). It rejoins the ISR by catching up,
        as any follower (Kafka's broker epoch, KIP-380, has a broker do the same)."""
        me = self.config.node_id
        for _ in range(REJOIN_ATTEMPTS):
            others = {
                NodeInfo.from_json(kv.json()).node_id
                for kv in await self.etcd.get_prefix(self.keys.nodes)
            } - {me}
            raced = False
            for kv in await self.etcd.get_prefix(self.keys.partitions):
                state = PartitionState.from_json(kv.json())
                if me not in state.isr and state.leader != me:
                    continue
                left = after_failures(state, others)
                if left == state:
                    continue
                if await self.etcd.txn([unchanged(kv)], [put_json(kv.key, left.to_json())]):
                    log.info(
                        "left the ISR until caught up (joined anew)",
                        extra={"partition": kv.key[len(self.keys.partitions) :], **left.to_json()},
                    )
                else:
                    raced = True  # the controller moved it meanwhile: looked at again
            if not raced:
                return
        log.warning("could not leave every ISR after joining: the controller kept moving them")

    async def _keep_alive_forever(self) -> None:
        interval = self.config.lease_s / 3
        while True:
            await asyncio.sleep(interval)
            try:
                if await self.etcd.keep_alive(self.lease) > 0:
                    self._renewed_at = time.monotonic()
                    continue
                # Expired (etcd unreachable longer than a lease): the cluster has
                # counted this node dead; it rejoins with a new lease.
                log.warning("the node's lease expired; rejoining the cluster")
                self.lease = 0
                self._published_offsets = None
                self.is_controller = False
                if await self._register():
                    await self._rejoin_out_of_sync()
            except EtcdError as exc:
                if not self._etcd_down:
                    log.warning("cannot renew the node's lease: %s", exc)

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.tick()
            except EtcdError as exc:
                # Once per outage, not every tick: the node serves on meanwhile, with
                # the leaders and ISRs it last read (no election can happen without etcd).
                if not self._etcd_down:
                    log.warning("cannot reach etcd; serving with the last state read: %s", exc)
                    self._etcd_down = True
            except Exception:
                # Anything else (a disk error cutting a replica, a bug) must not end the
                # ticks: the node would serve on, never again following etcd's changes.
                log.exception("a cluster tick failed; the next one tries again")
            else:
                if self._etcd_down:
                    log.info("etcd reachable again")
                    self._etcd_down = False

    # ---- one round ----------------------------------------------------------------------

    async def tick(self) -> None:
        await self.kinds.sync()  # before the streams: a kind made now is recorded now
        await self.streams.sync()
        await self._publish_offsets()
        if await self._hold_controller():
            await self._control()
        await self._read_state()
        await self.replication.reconcile()
        self.front_ends.reconcile()
        await self.coordinators.reconcile()
        self.transactions.reconcile()

    def local_ends(self) -> dict[str, int]:
        """This node's end offset of every partition it holds, by partition path."""
        ends: dict[str, int] = {}
        for tenant_id in self.api.tenant_ids():
            streams = self.api.list_streams(tenant_id)
            for stream in [*streams, *self.api.replicas.internal_streams(tenant_id)]:
                for part in stream.partition_info:
                    key = PartitionKey(tenant_id, stream.name, part.partition)
                    ends[key.path()] = part.next_offset
        return ends

    async def _publish_offsets(self) -> None:
        ends = self.local_ends()
        if ends != self._published_offsets:
            await self.etcd.put(
                self.keys.node_offsets(self.config.node_id),
                json.dumps(ends, sort_keys=True).encode(),
                self.lease,
            )
            self._published_offsets = ends

    async def _hold_controller(self) -> bool:
        me = json.dumps({"node_id": self.config.node_id}).encode()
        won = await self.etcd.txn(
            [absent(self.keys.controller)],
            [put_json(self.keys.controller, {"node_id": self.config.node_id}, self.lease)],
        )
        if not won:
            current = await self.etcd.get(self.keys.controller)
            won = current is not None and current.lease == self.lease and current.value == me
        if won != self.is_controller:
            log.info("controller" if won else "no longer the controller",
                     extra={"node_id": self.config.node_id})  # fmt: skip
            self.is_controller = won
        return won

    async def _control(self) -> None:
        """The controller's round: place new partitions, fail over dead leaders."""
        nodes = [
            NodeInfo.from_json(kv.json()) for kv in await self.etcd.get_prefix(self.keys.nodes)
        ]
        live = {n.node_id for n in nodes}
        stored = {
            PartitionKey.parse(kv.key[len(self.keys.partitions) :]): kv
            for kv in await self.etcd.get_prefix(self.keys.partitions)
        }
        load: Counter[int] = Counter()
        leaders: Counter[int] = Counter()
        for kv in stored.values():
            state = PartitionState.from_json(kv.json())
            load.update(state.replicas)
            leaders[state.leader] += 1
        for kv in await self.etcd.get_prefix(self.keys.streams):
            tenant, name = kv.key[len(self.keys.streams) :].split("/")
            for partition in range(int(kv.json()["partitions"])):
                key = PartitionKey(int(tenant), name, partition)
                if key in stored:
                    continue
                replicas = place_replicas(nodes, load, leaders, self.config.replication_factor)
                if not replicas:
                    continue
                state = PartitionState(replicas, replicas[0], 1, replicas)
                path = self.keys.partition(key)
                # Not for a stream deleted since it was read (the delete removed its
                # partitions' states in the same txn).
                guards = [absent(path), same_key(kv)]
                if await self.etcd.txn(guards, [put_json(path, state.to_json())]):
                    log.info("partition placed", extra={"partition": key.path(), **state.to_json()})
        for key, kv in stored.items():
            state = PartitionState.from_json(kv.json())
            moved = after_failures(state, live)
            if moved == state:
                continue
            if await self.etcd.txn([unchanged(kv)], [put_json(kv.key, moved.to_json())]):
                log.info(
                    "partition leadership moved" if moved.leader != state.leader else "isr shrunk",
                    extra={"partition": key.path(), "from": state.leader, **moved.to_json()},
                )
        await self._reassign(live)

    async def _reassign(self, live: set[int]) -> None:
        """One step of each reassignment under way (``headwater cluster reassign``):
        the new replicas added, then, once they are in sync, the old ones dropped
        (:func:`headwater.cluster.layout.reassignment_step`); the request is deleted in
        the txn that completes it."""
        for request in await self.etcd.get_prefix(self.keys.reassignments):
            key = PartitionKey.parse(request.key[len(self.keys.reassignments) :])
            target = tuple(int(n) for n in request.json()["replicas"])
            current = await self.etcd.get(self.keys.partition(key))
            if current is None:
                continue  # not placed yet
            state = PartitionState.from_json(current.json())
            moved = reassignment_step(state, target, live)
            guards = [unchanged(current), unchanged(request)]
            if moved.replicas == target:
                writes: list[Put | Delete] = [Delete(request.key)]
                if moved != state:
                    writes.append(put_json(current.key, moved.to_json()))
                if await self.etcd.txn(guards, writes):
                    log.info(
                        "partition reassigned",
                        extra={"partition": key.path(), "from": list(state.replicas),
                               **moved.to_json()},
                    )  # fmt: skip
            elif moved != state and await self.etcd.txn(
                guards, [put_json(current.key, moved.to_json())]
            ):
                log.info(
                    "reassignment: replicas added",
                    extra={"partition": key.path(), **moved.to_json()},
                )

    async def _read_nodes(self) -> None:
        self.nodes = {
            info.node_id: info
            for info in (
                NodeInfo.from_json(kv.json()) for kv in await self.etcd.get_prefix(self.keys.nodes)
            )
        }

    async def _read_state(self) -> None:
        controller = await self.etcd.get(self.keys.controller)
        self.controller_id = int(controller.json()["node_id"]) if controller else -1
        await self._read_nodes()
        placed = await self.etcd.get_prefix(self.keys.partitions)
        # Read after the partitions: a partition state of a stream deleted meanwhile
        # (and maybe created again) is then not of the incarnation this node copies.
        registered = {
            kv.key[len(self.keys.streams) :]: kv
            for kv in await self.etcd.get_prefix(self.keys.streams)
        }
        self.partitions = {}
        for kv in placed:
            key = PartitionKey.parse(kv.key[len(self.keys.partitions) :])
            stream = registered.get(f"{key.tenant_id}/{key.stream}")
            if self.streams.copies_current(key.tenant_id, key.stream, stream):
                self.partitions[key] = PartitionState.from_json(kv.json())
