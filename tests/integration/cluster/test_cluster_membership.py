"""Membership, placement and leadership in etcd, against real etcd and real nodes:
partitions placed evenly, a killed leader's partitions moved to an in-sync follower
with a new epoch, a node that stops cleanly handing over at once, and the start-up
refusals (etcd unreachable, a node id a live node holds)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cluster_nodes import LEASE_S, WAIT_S, Cluster
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ClusterMetadata, ConfigResource, NewTopic
from servers import free_port, http_call

from headwater.cluster.local import EtcdProcess, node_config
from waiting import wait_until

pytestmark = pytest.mark.cluster


def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(15)


def test_partitions_are_placed_evenly_and_streams_reach_every_node(cluster: Cluster) -> None:
    """Placement, streams made on every node, and (deletes_reach_every_node) deletes."""
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), "orders", 3)
    placed = cluster.wait_partitions(3)
    assert sorted(p["leader"] for p in placed.values()) == [1, 2, 3]
    for part in placed.values():
        assert sorted(part["replicas"]) == [1, 2, 3] and sorted(part["isr"]) == [1, 2, 3]
        assert part["epoch"] == 1
    # Created through node 1 only; the others made it from etcd's registry.
    for node_id in (2, 3):
        admin = AdminClient({"bootstrap.servers": cluster.nodes[node_id].address_of("kafka")})
        wait_until(
            lambda admin=admin: "orders" in admin.list_topics(timeout=5).topics, timeout=WAIT_S
        )
    status = cluster.status()
    assert sorted(n["node_id"] for n in status["nodes"]) == [1, 2, 3]
    assert status["controller"] in (1, 2, 3)
    deletes_reach_every_node(cluster)


def test_a_killed_leader_s_partitions_move_to_in_sync_followers(cluster: Cluster) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), "moves", 3)
    before = cluster.wait_partitions(3)
    victim = before["0/moves/0"]["leader"]
    killed_at = time.monotonic()
    cluster.nodes[victim].kill()

    def moved() -> bool:
        return cluster.partitions()["0/moves/0"]["leader"] != victim

    wait_until(moved, timeout=WAIT_S, message=lambda: str(cluster.status()))
    failover_s = time.monotonic() - killed_at
    print(f"failover after SIGKILL: {failover_s:.2f} s (lease_s = {LEASE_S})")

    # The leaders of the victim's other partitions drop it from their ISR later (after
    # replica_lag_s without its fetches): that is waited for too.
    def dropped() -> dict[str, dict[str, Any]] | None:
        now = cluster.partitions()
        return now if all(victim not in part["isr"] for part in now.values()) else None

    after = wait_until(dropped, timeout=WAIT_S, message=lambda: str(cluster.status()))
    for path, part in after.items():
        assert victim not in part["isr"]
        if before[path]["leader"] == victim:
            assert part["leader"] in before[path]["isr"] and part["leader"] != victim
            assert part["epoch"] == before[path]["epoch"] + 1
        else:  # its leader lived: same leader, same epoch, only the ISR shrank
            assert (part["leader"], part["epoch"]) == (
                before[path]["leader"],
                before[path]["epoch"],
            )
    # The killed node comes back (after its old registration expires) as a member.
    cluster.nodes[victim].start()
    wait_until(lambda: victim in [n["node_id"] for n in cluster.status()["nodes"]], timeout=WAIT_S)

    # A node stopped cleanly revokes its lease: its partitions move without waiting it
    # out. Its registration is gone as soon as it has exited (a lease would keep it
    # for lease_s), which is what lets the controller move them at its next tick.
    leader = cluster.partitions()["0/moves/1"]["leader"]
    assert cluster.nodes[leader].stop() == 0
    assert leader not in [n["node_id"] for n in cluster.status()["nodes"]]
    wait_until(
        lambda: cluster.partitions()["0/moves/1"]["leader"] != leader,
        timeout=WAIT_S,
        message=lambda: str(cluster.status()),
    )


def serve(tmp_path: Path, config: str) -> subprocess.CompletedProcess[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "node.toml").write_text(config)
    return subprocess.run(
        [sys.executable, "-m", "headwater.cli.main", "serve", "--data-dir",
         str(tmp_path / "data"), "--config", str(tmp_path / "node.toml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_node_id_held_by_a_live_node_is_refused(
    cluster: Cluster, etcd: EtcdProcess, tmp_path: Path
) -> None:
    cluster.add(1)
    kafka = f"127.0.0.1:{free_port()}"
    listen = {"kimberlite": "127.0.0.1:0", "kafka": kafka, "http": "", "convergedb": ""}
    listen |= {"ripple": "", "rivven": "", "postgres": ""}
    config = node_config(1, etcd.endpoint, listen, extra=f"lease_s = {LEASE_S}\n")
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(serve, tmp_path / "second", config)
        # While it waits for the id (two leases), its Kafka listener is bound: a client
        # connected then is told of the members (node 1, the process holding the id),
        # never sent to it (before, it named itself broker 1, at its own address).
        admin = AdminClient({"bootstrap.servers": kafka})
        metadata = wait_until(lambda: _metadata(admin), timeout=WAIT_S)
        refused = second.result()
    member = cluster.nodes[1].address_of("kafka")
    assert {b: f"{m.host}:{m.port}" for b, m in metadata.brokers.items()} == {1: member}
    assert refused.returncode == 2, refused.stderr
    assert "node_id 1 is held by another live node" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert cluster.nodes[1].running


def _metadata(admin: AdminClient) -> ClusterMetadata | None:
    try:
        return admin.list_topics(timeout=2)
    except KafkaException:
        return None  # not bound yet


def test_etcd_unreachable_at_start_is_one_line(tmp_path: Path) -> None:
    listen = {"kimberlite": "127.0.0.1:0", "kafka": "", "http": "", "convergedb": ""}
    listen |= {"ripple": "", "rivven": "", "postgres": ""}
    config = node_config(1, f"127.0.0.1:{free_port()}", listen)
    refused = serve(tmp_path, config)
    assert refused.returncode == 2, refused.stderr
    assert "cannot join the cluster: no etcd endpoint answered" in refused.stderr
    assert "Traceback" not in refused.stderr


def stream_copies(cluster: Cluster, node_id: int, name: str) -> list[Path]:
    """The directories of node ``node_id``'s streams named ``name`` (tenant 0)."""
    streams = cluster.nodes[node_id].data_dir / "tenants/0/streams"
    found = []
    for meta in streams.glob("*/stream.json"):
        try:
            text = meta.read_text()
        except FileNotFoundError:  # deleted (renamed away) between the listing and now
            continue
        if json.loads(text).get("name") == name:
            found.append(meta.parent)
    return found


def created(cluster: Cluster, name: str, partitions: int) -> None:
    """Wait until every running node has the stream with its partitions placed (a
    producer's Metadata to a node still without it would create it there, as Kafka's
    auto-creation does, with one partition)."""
    wait_until(
        lambda: (
            all(
                len(copies := stream_copies(cluster, n, name)) == 1
                and len(list(copies[0].glob("partition-*"))) == partitions
                for n, node in cluster.nodes.items()
                if node.running
            )
            and len([p for p in cluster.partitions() if p.startswith(f"0/{name}/")]) == partitions
        ),
        timeout=WAIT_S,
        message=lambda: str(cluster.status()),
    )


def produce(bootstrap: str, topic: str, values: list[bytes], partitions: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    failed: list[object] = []
    for n, value in enumerate(values):
        producer.produce(
            topic, value, partition=n % partitions, on_delivery=lambda e, _m: e and failed.append(e)
        )
    assert producer.flush(30) == 0 and failed == []


def read_all(bootstrap: str, topic: str, partitions: int, count: int) -> list[bytes]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "deleted"})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    found: list[bytes] = []
    try:
        while len(found) < count:
            for message in wait_until(lambda: consumer.consume(1000, 0.2), timeout=WAIT_S):
                assert message.error() is None, message.error()
                found.append(bytes(message.value()))  # type: ignore[arg-type]
    finally:
        consumer.close()
    return found


def deletes_reach_every_node(cluster: Cluster) -> None:
    """Kafka DeleteTopics through one node deletes the stream on every node and its
    partitions leave etcd; the name created again (through another node) is a fresh,
    empty stream everywhere; a node stopped during a delete deletes its copy when it
    returns, and its copy of a name deleted and created again meanwhile is replaced by
    the new, empty one. (On the cluster of the placement test: one cluster start less.)"""
    admin = AdminClient({"bootstrap.servers": cluster.nodes[2].address_of("kafka")})
    for name in ("first", "gone", "again"):
        create_topic(cluster.nodes[1].address_of("kafka"), name, 2)
        created(cluster, name, 2)
    for name in ("first", "gone", "again"):
        produce(cluster.bootstrap(), name, [b"old-%d" % n for n in range(20)], 2)

    # Every node up: deleted through node 2, created again through node 3 at once.
    admin.delete_topics(["first"])["first"].result(15)
    wait_until(lambda: all(not stream_copies(cluster, n, "first") for n in (1, 2, 3)),
               timeout=WAIT_S, message=lambda: str(cluster.status()))  # fmt: skip
    assert not [p for p in cluster.partitions() if p.startswith("0/first/")]
    create_topic(cluster.nodes[3].address_of("kafka"), "first", 3)
    created(cluster, "first", 3)
    new_values = [b"new-%d" % n for n in range(9)]
    produce(cluster.bootstrap(), "first", new_values, 3)
    assert sorted(read_all(cluster.bootstrap(), "first", 3, 9)) == sorted(new_values)
    for p in range(3):
        wait_until(
            lambda p=p: all(
                cluster.log_files(n, p, "first") == cluster.log_files(1, p, "first") for n in (2, 3)
            ),
            timeout=WAIT_S,
            message=lambda: str(cluster.status()),
        )

    # Node 3 stopped: "gone" deleted, "again" deleted and created again meanwhile.
    old_again = stream_copies(cluster, 3, "again")
    assert cluster.nodes[3].stop() == 0
    for name in ("gone", "again"):
        admin.delete_topics([name])[name].result(15)
    create_topic(cluster.nodes[1].address_of("kafka"), "again", 1)
    created(cluster, "again", 1)
    produce(cluster.bootstrap(), "again", [b"fresh"], 1)
    wait_until(
        lambda: not stream_copies(cluster, 1, "gone") and not stream_copies(cluster, 2, "gone")
    )
    cluster.nodes[3].start()
    wait_until(
        lambda: (
            not stream_copies(cluster, 3, "gone")
            and (copies := stream_copies(cluster, 3, "again")) != old_again
            and len(copies) == 1
        ),
        timeout=WAIT_S,
        message=lambda: str(cluster.status()),
    )
    # Node 3's copy is the new incarnation's: one partition, holding no old batch (it
    # was placed while node 3 was away, so node 3 holds no replica of it).
    (again,) = stream_copies(cluster, 3, "again")
    assert sorted(p.name for p in again.glob("partition-*")) == ["partition-0"]
    assert not any(f.stat().st_size for f in again.glob("partition-0/*.log"))
    topics = AdminClient({"bootstrap.servers": cluster.nodes[3].address_of("kafka")})
    listed = topics.list_topics(timeout=15).topics
    assert "gone" not in listed and len(listed["again"].partitions) == 1
    assert read_all(cluster.nodes[3].address_of("kafka"), "again", 1, 1) == [b"fresh"]
    assert sorted(p for p in cluster.partitions() if "/gone/" in p or "/again/" in p) == [
        "0/again/0"
    ]


def test_a_streams_settings_reach_every_node(cluster: Cluster) -> None:
    """Made through one node with LogAppendTime, compaction and a retention: the other
    nodes made their copies with defaults, so the partitions they led stamped the
    producer's time and kept every value (and a failover changed a partition's rules)."""
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    configs = {
        "message.timestamp.type": "LogAppendTime",
        "cleanup.policy": "compact",
        "retention.ms": "3600000",
    }
    admin = AdminClient({"bootstrap.servers": cluster.nodes[1].address_of("kafka")})
    admin.create_topics([NewTopic("stamped", 3, 1, config=configs)])["stamped"].result(15)
    cluster.wait_partitions(3)
    for node_id in (2, 3):
        other = AdminClient({"bootstrap.servers": cluster.nodes[node_id].address_of("kafka")})
        wait_until(
            lambda other=other: "stamped" in other.list_topics(timeout=5).topics, timeout=WAIT_S
        )
        resource = ConfigResource("topic", "stamped")
        described = other.describe_configs([resource])[resource].result(15)
        assert {name: described[name].value for name in configs} == configs, node_id
        # How the node keeps its copy: its own stream.json, once its tick has made it.
        meta = wait_until(lambda n=node_id: cluster.stream_meta(n, "stamped"), timeout=WAIT_S)
        settings = meta["settings"]
        assert settings["timestamp_type"] == "LogAppendTime", (node_id, settings)
        assert (settings["cleanup_policy"], settings["retention_ms"]) == ("compact", 3_600_000)


def test_one_name_created_on_two_nodes_at_once_is_one_stream(cluster: Cluster) -> None:
    """Two clients create one stream name at once through two nodes (HTTP: Kafka's
    CreateTopics all go to the controller), with different partitions and settings.
    Each node made its own before either registered it: both were told it was created,
    and the loser's node kept its copy (its partitions, its settings) as the cluster's.
    Now one is 409 StreamAlreadyExists, and every node's copy is the winner's."""
    for node_id in (1, 2, 3):
        cluster.add(node_id, http=True)
    asks = {
        1: {"name": "twice", "settings": {"partitions": 3, "timestamp_type": "LogAppendTime"}},
        2: {"name": "twice"},
    }

    def create(node_id: int) -> int:
        return http_call(cluster.nodes[node_id], "POST", "/api/streams", asks[node_id])[0]

    with ThreadPoolExecutor(2) as pool:
        outcomes = dict(zip((1, 2), pool.map(create, (1, 2)), strict=True))
    assert sorted(outcomes.values()) == [201, 409], outcomes
    winner = next(n for n, status in outcomes.items() if status == 201)
    settings: dict[str, Any] = asks[winner].get("settings", {})
    partitions = settings.get("partitions", 1)
    for node_id in (1, 2, 3):
        stored = wait_until(
            lambda n=node_id: (
                (meta := cluster.stream_meta(n, "twice")) is not None
                and meta["partitions"] == partitions
                and meta
            ),
            timeout=WAIT_S,
        )
        stamped = stored["settings"].get("timestamp_type")
        assert stamped == settings.get("timestamp_type", "CreateTime"), node_id


def test_a_producers_metadata_on_another_node_does_not_make_its_own_copy(
    cluster: Cluster,
) -> None:
    """A producer asking a node for a topic just created through another (Metadata with
    auto-creation, librdkafka's producer's) made that node a copy of its own, one
    partition and default settings, before its tick made the cluster's: the producer
    saw one partition and no leader, and the copy kept CreateTime for good. The name is
    registered first now, so that node answers "being created" and makes the cluster's."""
    for node_id in (1, 2, 3):
        cluster.add(node_id, http=True)
    ask = {"name": "early", "settings": {"partitions": 3, "timestamp_type": "LogAppendTime"}}
    assert http_call(cluster.nodes[1], "POST", "/api/streams", ask)[0] == 201
    producer = Producer({"bootstrap.servers": cluster.nodes[2].address_of("kafka")})
    producer.list_topics("early", timeout=15)  # at once: before node 2's next tick
    meta = wait_until(
        lambda: (m := cluster.stream_meta(2, "early")) is not None and m["partitions"] == 3 and m,
        timeout=WAIT_S,
    )
    assert meta["settings"]["timestamp_type"] == "LogAppendTime", meta
