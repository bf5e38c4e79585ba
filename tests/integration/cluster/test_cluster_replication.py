"""Replication against real nodes: followers copy the leader's stored batches byte for
byte, a killed leader's replacement takes over and the old leader rejoins the ISR; an
old leader's tail that no follower had is truncated when it comes back; an out-of-sync
replica never leads (unclean election off); with etcd down the cluster goes on serving,
and elects again once it is back."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import threading
import urllib.request
from pathlib import Path
from typing import Any, cast

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


def _etcd_call(etcd: EtcdProcess, path: str, body: dict[str, object]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://{etcd.endpoint}{path}", json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return cast(dict[str, Any], json.loads(answer.read()))


def _registration(etcd: EtcdProcess, node_id: int) -> str | None:
    """The lease of node ``node_id``'s key, None while it has none."""
    key = base64.b64encode(f"/headwater/nodes/{node_id}".encode()).decode()
    kvs = _etcd_call(etcd, "/v3/kv/range", {"key": key}).get("kvs", [])
    return str(kvs[0]["lease"]) if kvs else None


def test_a_leader_back_with_its_data_gone_before_the_controller_looked_loses_nothing(
    tmp_path: Path, etcd: EtcdProcess
) -> None:
    """The controller reads the members each tick: a leader killed, its disk replaced and
    registered again between two reads kept its leadership and ISR seat, led its empty
    log at the old epoch, and the followers cut their logs to it: every acknowledged
    record gone. The controller is held (SIGSTOP, under its lease) from just before the
    old registration expires until the new one is in. A node joining anew now leaves its
    ISRs and leaderships first and catches up as a follower."""
    cluster = Cluster(tmp_path, etcd, lease_s=6)
    try:
        cluster.add(1)
        wait_until(lambda: cluster.status()["controller"] == 1, timeout=WAIT_S)
        for node_id in (2, 3):
            cluster.add(node_id)
        create_topic(cluster.nodes[1].address_of("kafka"), "events", 3)
        placed = cluster.wait_partitions(3)
        key, state = next(
            (k, s)
            for k, s in sorted(placed.items())
            if k.startswith("0/events/") and s["leader"] != 1
        )
        partition, victim = int(key.rsplit("/", 1)[1]), state["leader"]
        values = [b"v%04d" % i for i in range(500)]
        bootstrap = cluster.nodes[victim].address_of("kafka")

        producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})

        def known_to_the_producer() -> bool:  # its partitions and leaders (0.5 s ticks)
            topic = producer.list_topics("events", timeout=5).topics["events"]
            return len(topic.partitions) == 3 and not any(
                p.error or p.leader < 0 for p in topic.partitions.values()
            )

        wait_until(known_to_the_producer, timeout=WAIT_S)
        failures: list[object] = []
        for value in values:
            producer.produce(
                "events",
                value,
                partition=partition,
                on_delivery=lambda e, _m: e and failures.append(e),
            )
        assert producer.flush(30) == 0 and not failures, failures
        wait_until(lambda: set(cluster.partitions()[key]["lag"].values()) == {0}, timeout=WAIT_S)

        old = _registration(etcd, victim)
        assert old is not None
        node = cluster.nodes[victim]
        node.kill()
        shutil.rmtree(node.data_dir)
        restart = threading.Thread(target=node.start, daemon=True)  # waits out the old key
        restart.start()
        wait_until(
            lambda: int(_etcd_call(etcd, "/v3/lease/timetolive", {"ID": old})["TTL"]) <= 1,
            interval=0.05,
            timeout=WAIT_S,
        )
        controller = cluster.nodes[1]
        os.kill(controller.pid, signal.SIGSTOP)
        try:
            wait_until(
                lambda: _registration(etcd, victim) not in (None, old),
                interval=0.05,
                timeout=WAIT_S,
                message=lambda: f"node {victim} did not register again: {node.log_tail()}",
            )
        finally:
            os.kill(controller.pid, signal.SIGCONT)
        restart.join(WAIT_S)

        moved = wait_until(
            lambda: (s := cluster.partitions()[key])["leader"] not in (victim, -1) and s,
            message=lambda: str(cluster.partitions()[key]),
            timeout=WAIT_S,
        )
        assert moved["epoch"] > state["epoch"]
        wait_until(
            lambda: sorted(cluster.partitions()[key]["isr"]) == [1, 2, 3],
            message=lambda: str(cluster.partitions()[key]),
            timeout=WAIT_S,
        )
        for node_id in (1, 2, 3):
            consumer = Consumer(
                {"bootstrap.servers": cluster.nodes[node_id].address_of("kafka"), "group.id": "c"}
            )
            try:
                low, high = consumer.get_watermark_offsets(
                    TopicPartition("events", partition), timeout=30
                )
            finally:
                consumer.close()
            assert (low, high) == (0, len(values)), node_id
        for node_id in (1, 2, 3):
            assert "truncated a divergent tail" not in cluster.nodes[node_id].log_text()
    finally:
        for server in cluster.nodes.values():
            server.kill()
