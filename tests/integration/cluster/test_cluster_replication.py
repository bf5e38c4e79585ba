"""Replication against real nodes: followers copy the leader's stored batches byte for
byte, a killed leader's replacement takes over and the old leader rejoins the ISR; an
old leader's tail that no follower had is truncated when it comes back; an out-of-sync
replica never leads (unclean election off); with etcd down the cluster goes on serving,
and elects again once it is back."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from cluster_nodes import WAIT_S, Cluster
from confluent_kafka import Consumer, Producer, TopicPartition
from test_cluster_membership import create_topic

from headwater.cluster.local import EtcdProcess
from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def produce(bootstrap: str, values: list[bytes], acks: str = "all") -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "acks": acks, "linger.ms": 5})
    failures: list[object] = []
    for value in values:
        producer.produce(
            "events", value, partition=0, on_delivery=lambda err, _m: err and failures.append(err)
        )
    assert producer.flush(30) == 0 and not failures, failures


def read_all(bootstrap: str, count: int) -> list[bytes]:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "check", "enable.auto.commit": False}
    )
    consumer.assign([TopicPartition("events", 0, 0)])
    values: list[bytes] = []
    try:
        while len(values) < count:
            message = wait_until(
                lambda: consumer.poll(0.2), message="no more messages", timeout=WAIT_S
            )
            assert message.error() is None, message.error()
            values.append(message.value())
    finally:
        consumer.close()
    return values


def unread_answers_from(port: int) -> int:
    """Local TCP connections to ``port`` with bytes received and not yet read (Linux's
    /proc/net/tcp: rx_queue), i.e. answers a stopped follower has not read."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote_port = int(fields[2].split(":")[1], 16)
        rx_queue = int(fields[4].split(":")[1], 16)
        count += remote_port == port and rx_queue > 0
    return count


def leader_of(cluster: Cluster) -> tuple[int, int]:
    part = cluster.partitions()["0/events/0"]
    return part["leader"], part["epoch"]


def test_followers_copy_the_leader_and_a_killed_leader_rejoins(cluster: Cluster) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), "events", 1)
    cluster.wait_partitions(1)
    first, epoch = leader_of(cluster)
    produce(cluster.nodes[first].address_of("kafka"), [b"a%d" % i for i in range(300)])
    cluster.wait_replicas_agree([1, 2, 3], 300)

    cluster.nodes[first].kill()
    second, new_epoch = wait_until(
        lambda: (found := leader_of(cluster))[0] not in (first, -1) and found,
        message=lambda: str(cluster.status()),
        timeout=WAIT_S,
    )
    assert new_epoch == epoch + 1
    produce(cluster.nodes[second].address_of("kafka"), [b"b%d" % i for i in range(200)])
    cluster.nodes[first].start()
    wait_until(
        lambda: sorted(cluster.partitions()["0/events/0"]["isr"]) == [1, 2, 3], timeout=WAIT_S
    )
    cluster.wait_replicas_agree([1, 2, 3], 500)
    expected = [b"a%d" % i for i in range(300)] + [b"b%d" % i for i in range(200)]
    assert read_all(cluster.nodes[second].address_of("kafka"), 500) == expected


def test_an_old_leader_s_unreplicated_tail_is_truncated(cluster: Cluster) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), "events", 1)
    cluster.wait_partitions(1)
    old, _ = leader_of(cluster)
    followers = [n for n in (1, 2, 3) if n != old]
    produce(cluster.nodes[old].address_of("kafka"), [b"kept%d" % i for i in range(50)])
    cluster.wait_replicas_agree([1, 2, 3], 50)
    # The followers pause (well within their lease) and the test waits until the
    # leader has answered their open fetches (the answers sit unread in their sockets):
    # no fetch of theirs is open, so what the leader takes now only it has.
    # A follower paused between an answer and its next fetch has no answer coming:
    # that attempt is let go (the followers resume and catch up) and made again.
    port = cluster.status_node(old)["ports"]["replication"]
    for _attempt in range(10):
        for n in followers:
            cluster.nodes[n].proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            wait_until(lambda: unread_answers_from(port) == len(followers), timeout=2)
            break
        except AssertionError:
            for n in followers:
                cluster.nodes[n].proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
    else:
        raise AssertionError("the followers never paused with their fetches answered")
    try:
        produce(cluster.nodes[old].address_of("kafka"), [b"lost%d" % i for i in range(7)], "1")
        wait_until(lambda: cluster.partitions()["0/events/0"]["end"] == 57, timeout=WAIT_S)
        cluster.nodes[old].kill()
    finally:
        for n in followers:
            cluster.nodes[n].proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
    new, _ = wait_until(
        lambda: (found := leader_of(cluster))[0] in followers and found,
        message=lambda: str(cluster.status()),
        timeout=WAIT_S,
    )
    produce(cluster.nodes[new].address_of("kafka"), [b"new%d" % i for i in range(20)])
    cluster.nodes[old].start()
    cluster.wait_replicas_agree([1, 2, 3], 70)
    assert "truncated a divergent tail" in cluster.nodes[old].log_text()
    expected = [b"kept%d" % i for i in range(50)] + [b"new%d" % i for i in range(20)]
    assert read_all(cluster.nodes[old].address_of("kafka"), 70) == expected


def test_an_out_of_sync_replica_never_leads(cluster: Cluster) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), "events", 1)
    cluster.wait_partitions(1)
    leader, epoch = leader_of(cluster)
    others = [n for n in (1, 2, 3) if n != leader]
    for n in others:
        cluster.nodes[n].kill()
    wait_until(
        lambda: cluster.partitions()["0/events/0"]["isr"] == [leader],
        message=lambda: str(cluster.status()),
        timeout=WAIT_S,
    )
    produce(cluster.nodes[leader].address_of("kafka"), [b"only-here"], acks="1")
    cluster.nodes[leader].kill()
    for n in others:
        cluster.nodes[n].start()
    wait_until(
        lambda: sorted(n["node_id"] for n in cluster.status()["nodes"]) == sorted(others),
        timeout=WAIT_S,
    )
    wait_until(
        lambda: leader_of(cluster)[0] == -1, message=lambda: str(cluster.status()), timeout=WAIT_S
    )
    leaderless_epoch = leader_of(cluster)[1]
    cluster.nodes[leader].start()
    # The only in-sync replica leads again, and the epoch shows nobody led in between.
    assert wait_until(
        lambda: leader_of(cluster)[0] == leader and leader_of(cluster),
        message=lambda: str(cluster.status()),
        timeout=WAIT_S,
    ) == (
        leader,
        leaderless_epoch + 1,
    )
    assert leaderless_epoch == epoch + 1
    cluster.wait_replicas_agree([1, 2, 3], 1)


def test_the_cluster_serves_while_etcd_is_down_and_elects_again_after(
    cluster: Cluster, etcd: EtcdProcess
) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), "events", 1)
    cluster.wait_partitions(1)
    leader, epoch = leader_of(cluster)
    produce(cluster.bootstrap(), [b"before%d" % i for i in range(50)])
    etcd.kill()
    noticed = "cannot reach etcd; serving with the last state read"
    wait_until(lambda: all(noticed in n.log_text() for n in cluster.nodes.values()), timeout=WAIT_S)
    # Leaders and ISRs stay as last read: acks=all writes and reads go on.
    produce(cluster.bootstrap(), [b"during%d" % i for i in range(50)])
    during = read_all(cluster.nodes[leader].address_of("kafka"), 100)
    assert during[50:] == [b"during%d" % i for i in range(50)]
    etcd.start()  # the same data and ports
    cluster.nodes[leader].kill()
    new, new_epoch = wait_until(
        lambda: (found := leader_of(cluster))[0] not in (leader, -1) and found,
        timeout=30,
        message=lambda: str(cluster.status()),
    )
    assert new_epoch == epoch + 1
    produce(cluster.bootstrap(), [b"after%d" % i for i in range(10)])
    values = read_all(cluster.nodes[new].address_of("kafka"), 110)
    assert values[100:] == [b"after%d" % i for i in range(10)]
    assert "etcd reachable again" in cluster.nodes[new].log_text()
