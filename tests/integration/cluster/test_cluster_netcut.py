"""Network cuts (issue 20's fault suite): the leader of a partition cut off from etcd
only, or from everything (etcd, its clients, its peers), while a confluent-kafka
producer (acks=all, idempotence) writes without pause; a new leader is elected, the
acknowledgements resume and go on while the old leader is still up behind its cut;
healed, it rejoins as a follower and gives up any tail nobody else has. Afterwards
every acknowledged message is read back exactly once at its acknowledged offset, and
the replicas hold the same bytes.

Every node reaches etcd through a proxy of its own and is reached (Kafka clients,
peers' replication fetches) through proxies advertised in its place
(``[cluster] advertise_ports``): tests/integration/cluster/netcut.py.
Rounds: ``HEADWATER_FAULT_ROUNDS`` (default 4 in the suite, for CI time, 20 in the recorded runs;
each round alternates the two cuts)."""

from __future__ import annotations

import os
import random
import statistics
import threading
import time

import pytest
from cluster_nodes import LEASE_S, WAIT_S, Cluster
from netcut import Proxies, Proxy, proxies
from servers import free_port
from test_cluster_faults import TOPIC, Acks, produce_forever, read_back
from test_cluster_membership import create_topic

from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROUNDS = int(os.environ.get("HEADWATER_FAULT_ROUNDS", "4"))
RESUMED = 300  # acknowledgements after the election that show writes go on
# A node cut off from its clients answers nothing and resets nothing: a client learns
# of it only when its requests in flight there time out (librdkafka's socket.timeout.ms,
# 60 s by default; Kafka's Java client: request.timeout.ms, 30 s), then moves them to
# the new leader. 10 s here, so a round's wait stays well inside WAIT_S.
PRODUCER = {"socket.timeout.ms": 10_000, "request.timeout.ms": 10_000}
# librdkafka's debug contexts for finding a stall (HEADWATER_KAFKA_DEBUG=1: on stderr).
if os.environ.get("HEADWATER_KAFKA_DEBUG"):
    PRODUCER["debug"] = "broker,topic,msg,metadata"  # type: ignore[assignment]


class NodeLinks:
    """One node's proxies: to etcd, and in front of its Kafka and replication ports."""

    def __init__(self, running: Proxies, cluster: Cluster, node_id: int) -> None:
        etcd_host, etcd_port = cluster.etcd.endpoint.rsplit(":", 1)
        self.replication_port = free_port()
        self.etcd = running.add(lambda: (etcd_host, int(etcd_port)), f"etcd<-{node_id}")
        self.kafka = running.add(
            lambda: ("127.0.0.1", cluster.nodes[node_id].ports["kafka"]), f"kafka->{node_id}"
        )
        self.replication = running.add(
            lambda: ("127.0.0.1", self.replication_port), f"replication->{node_id}"
        )

    def config(self) -> str:
        return (
            f"replication_port = {self.replication_port}\n"
            f"advertise_ports = {{kafka = {self.kafka.port},"
            f" replication = {self.replication.port}}}\n"
        )

    def all(self) -> list[Proxy]:
        return [self.etcd, self.kafka, self.replication]


def partition(cluster: Cluster) -> dict[str, object]:
    return cluster.partitions()[f"0/{TOPIC}/0"]


def test_acknowledged_writes_survive_network_cuts(cluster: Cluster) -> None:
    with proxies() as running:
        links = {n: NodeLinks(running, cluster, n) for n in (1, 2, 3)}
        for node_id, link in links.items():
            cluster.add(node_id, link.config(), etcd=link.etcd.address)
        create_topic(links[1].kafka.address, TOPIC, 1)
        cluster.wait_partitions(1)
        acks = Acks()
        stop = threading.Event()
        bootstrap = ",".join(link.kafka.address for link in links.values())
        producer = threading.Thread(
            target=produce_forever, args=(bootstrap, acks, stop, PRODUCER), daemon=True
        )
        producer.start()
        rng = random.Random(21)
        elections: list[float] = []
        resumed: list[float] = []
        try:
            for round_no in range(ROUNDS):
                part = partition(cluster)
                victim, epoch = int(part["leader"]), int(part["epoch"])  # type: ignore[call-overload]
                everything = round_no % 2 == 1
                cut = links[victim].all() if everything else [links[victim].etcd]
                target = acks.count() + rng.randint(20, 400)
                wait_until(lambda target=target: acks.count() >= target, timeout=WAIT_S)
                cut_at = time.monotonic()
                for proxy in cut:
                    proxy.cut()
                wait_until(
                    lambda victim=victim: partition(cluster)["leader"] not in (victim, -1),
                    timeout=WAIT_S,
                    message=lambda: str(cluster.status()),
                )
                elections.append(time.monotonic() - cut_at)
                assert partition(cluster)["epoch"] == epoch + 1
                # Writes go on at the new leader while the old one is still up, cut off.
                after = acks.count() + RESUMED
                wait_until(
                    lambda after=after: acks.count() >= after,
                    timeout=WAIT_S,
                    message=lambda: f"{acks.count()} acknowledged: {cluster.status()}",
                )
                first = acks.first_after(cut_at + elections[-1])
                assert first is not None
                resumed.append(first - cut_at)
                assert cluster.nodes[victim].running
                for proxy in cut:
                    proxy.heal()
                # Back as a follower: in the ISR of the new leader's epoch.
                wait_until(
                    lambda: len(partition(cluster)["isr"]) == 3,  # type: ignore[arg-type]
                    timeout=WAIT_S,
                    message=lambda: str(cluster.status()),
                )
                print(
                    f"round {round_no + 1}: cut {victim} from "
                    f"{'everything' if everything else 'etcd'}, new leader in"
                    f" {elections[-1]:.2f} s, first ack after it {resumed[-1]:.2f} s from the cut,"
                    f" {acks.count()} acknowledged"
                )
        finally:
            stop.set()
            producer.join(150)
        assert not producer.is_alive()

        assert acks.failed == []
        end = max(acks.offsets.values()) + 1
        assert cluster.wait_replicas_agree([1, 2, 3], end)
        leader = int(partition(cluster)["leader"])  # type: ignore[call-overload]
        found = read_back(links[leader].kafka.address, end)
        values = [value for _, value in found]
        duplicated = len(values) - len(set(values))
        stored_at = {value: offset for offset, value in found}
        lost = [v for v in acks.acknowledged() if v not in stored_at]
        print(
            f"{ROUNDS} rounds of cuts: acknowledged {acks.count()}, stored {len(values)},"
            f" lost {len(lost)}, duplicated {duplicated}; new leader after the cut: median"
            f" {statistics.median(elections):.2f} s, max {max(elections):.2f} s; first ack"
            f" after the cut: median {statistics.median(resumed):.2f} s, max"
            f" {max(resumed):.2f} s (lease_s = {LEASE_S})"
        )
        assert lost == [] and duplicated == 0
        assert all(stored_at[v] == offset for v, offset in acks.offsets.items())
        assert values == sorted(values)
