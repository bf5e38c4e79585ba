"""What the cluster keeps in etcd, and the pure decisions taken over it.

Keys (under the configured prefix, ``/headwater/`` by default; values are JSON)::

    nodes/<node_id>                      a live node: host, rack, listener ports (lease)
    controller                           the elected controller's node id (lease)
    streams/<tenant>/<name>              a stream: its partition count
    partitions/<tenant>/<name>/<p>       replicas, leader (-1: none), epoch, ISR
    offsets/<node_id>                    that node's end offset per replica (lease)
    reassign/<tenant>/<name>/<p>         a reassignment under way: the target replicas

A partition's state is only ever changed by a txn guarded on its mod revision, so two
writers (the controller, a leader shrinking its ISR) never overwrite each other.
Stream names are ``[A-Za-z0-9._-]`` and never "." or ".." (engine/names.py), so they go
into keys as they are: no "/" to split on, no path step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

NO_LEADER = -1


@dataclass(frozen=True)
class NodeInfo:
    node_id: int
    host: str
    rack: str | None = None
    ports: Mapping[str, int] = field(default_factory=dict)  # by listener name

    def to_json(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "host": self.host, "rack": self.rack,
                "ports": dict(self.ports)}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeInfo:
        return cls(int(data["node_id"]), str(data["host"]), data.get("rack"),
                   {str(k): int(v) for k, v in data.get("ports", {}).items()})  # fmt: skip

    def addresses(self) -> dict[str, str]:
        """``host:port`` of each client-facing listener, by name (a NotLeader's or a
        NotCoordinator's hint: clients follow the one they speak)."""
        return {
            name: f"{self.host}:{port}"
            for name, port in sorted(self.ports.items())
            if name != "replication"
        }

    def listed(self) -> str:
        """:meth:`addresses` for a message: ``kafka 10.0.0.2:9092, rivven ...``, the
        form the clients read a hint from (the only place most wires have for it)."""
        return ", ".join(f"{name} {address}" for name, address in self.addresses().items())


@dataclass(frozen=True)
class PartitionState:
    replicas: tuple[int, ...]  # the preferred leader first
    leader: int  # NO_LEADER while no in-sync replica is alive
    epoch: int  # bumped at every change of leader
    isr: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"replicas": list(self.replicas), "leader": self.leader,
                "epoch": self.epoch, "isr": list(self.isr)}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PartitionState:
        return cls(tuple(data["replicas"]), int(data["leader"]), int(data["epoch"]),
                   tuple(data["isr"]))  # fmt: skip


@dataclass(frozen=True, order=True)
class PartitionKey:
    tenant_id: int
    stream: str
    partition: int

    def path(self) -> str:
        return f"{self.tenant_id}/{self.stream}/{self.partition}"

    @classmethod
    def parse(cls, path: str) -> PartitionKey:
        tenant, stream, partition = path.split("/")
        return cls(int(tenant), stream, int(partition))


class Keys:
    """The etcd keys of one cluster (its prefix)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.nodes = self.prefix + "nodes/"
        self.controller = self.prefix + "controller"
        self.streams = self.prefix + "streams/"
        self.partitions = self.prefix + "partitions/"
        self.offsets = self.prefix + "offsets/"
        self.reassignments = self.prefix + "reassign/"

    def node(self, node_id: int) -> str:
        return f"{self.nodes}{node_id}"

    def stream(self, tenant_id: int, name: str) -> str:
        return f"{self.streams}{tenant_id}/{name}"

    def partition(self, key: PartitionKey) -> str:
        return self.partitions + key.path()

    def node_offsets(self, node_id: int) -> str:
        return f"{self.offsets}{node_id}"

    def reassignment(self, key: PartitionKey) -> str:
        return self.reassignments + key.path()


def place_replicas(
    nodes: Sequence[NodeInfo], load: Counter[int], leaders: Counter[int], factor: int
) -> tuple[int, ...]:
    """Replicas for a new partition: ``factor`` live nodes (fewer if fewer live), the
    least loaded first, each on a rack not yet used while one is left (racks unset: one
    rack); the replica leading the fewest partitions goes first (the preferred leader).
    ``load`` and ``leaders`` count replicas and leaderships per node so far and are
    updated, so placing a stream's partitions one after another spreads them evenly."""
    chosen: list[NodeInfo] = []
    candidates = sorted(nodes, key=lambda n: (load[n.node_id], n.node_id))
    while candidates and len(chosen) < factor:
        used = {n.rack for n in chosen}
        fresh = [n for n in candidates if n.rack not in used]
        pick = (fresh or candidates)[0]
        chosen.append(pick)
        candidates.remove(pick)
    replicas = sorted((n.node_id for n in chosen), key=lambda i: (leaders[i], load[i], i))
    for node_id in replicas:
        load[node_id] += 1
    if replicas:
        leaders[replicas[0]] += 1
    return tuple(replicas)


def after_failures(state: PartitionState, live: Iterable[int]) -> PartitionState:
    """The state once dead nodes are dropped: dead members leave the ISR (never below
    one member, the last one in sync, so it can lead again when it comes back), and a
    dead leader is replaced by a live in-sync replica (the first in replica order),
    or by none: an out-of-sync replica never leads (unclean election is off), so the
    partition waits for an in-sync one. A change of leader bumps the epoch."""
    alive = set(live)
    isr = tuple(n for n in state.isr if n in alive)
    if not isr:
        isr = (state.leader,) if state.leader in state.isr else state.isr[:1]
    leader = state.leader
    if leader not in alive:
        in_sync_alive = [n for n in state.replicas if n in isr and n in alive]
        leader = in_sync_alive[0] if in_sync_alive else NO_LEADER
    if leader == state.leader and isr == state.isr:
        return state
    epoch = state.epoch + 1 if leader != state.leader else state.epoch
    return replace(state, leader=leader, epoch=epoch, isr=isr)


def reassignment_step(
    state: PartitionState, target: Sequence[int], live: Iterable[int]
) -> PartitionState:
    """The next state of a partition moving to the ``target`` replicas (Kafka's
    reassignment): first the new replicas are added (they fetch from the leader and the
    leader takes them into the ISR once caught up), then, once every target replica is
    in sync, the replicas become the target, the ISR keeps its target members and a
    leader left out hands over to the first in-sync target replica (epoch + 1). The
    state itself while a target node is not alive or a new replica has not caught up."""
    alive = set(live)
    if not all(n in alive for n in target):
        return state
    adding = tuple(n for n in target if n not in state.replicas)
    if adding:
        return replace(state, replicas=state.replicas + adding)
    if tuple(target) == state.replicas or not set(target) <= set(state.isr):
        return state
    isr = tuple(n for n in state.isr if n in target)
    leader = state.leader if state.leader in target else next(n for n in target if n in isr)
    epoch = state.epoch + 1 if leader != state.leader else state.epoch
    return PartitionState(tuple(target), leader, epoch, isr)
