"""Kafka clients against a cluster: Metadata lists every node as a broker and each
partition's leader, replicas and ISR as etcd has them; only the leader takes a
produce (NOT_LEADER_OR_FOLLOWER elsewhere); acks=all is refused below min ISR
(NOT_ENOUGH_REPLICAS) while acks=1 is not; a fetch is answered up to the high
watermark by the leader and by followers alike."""

from __future__ import annotations

import dataclasses
import signal
from datetime import timedelta

import pytest
from cluster_nodes import WAIT_S, Cluster
from confluent_kafka.admin import AdminClient
from kimberlite_raw import append, batch, expect_error
from kio.schema.init_producer_id.v4.request import InitProducerIdRequest
from kio.schema.produce.v10.request import ProduceRequest
from kio.schema.produce.v10.response import ProduceResponse
from kio.schema.types import ProducerId
from kio.static.primitive import i16, i32Timedelta
from test_cluster_membership import create_topic
from test_kafka_stored_batches import RECORDS, RawKafka, captured_produce

from headwater.cluster.transactions import BLOCK_SIZE
from headwater.protocols.kafka import ApiKey, ErrorCode
from headwater.protocols.kimberlite.messages import AppendEventsRequest
from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def produce_raw(cluster: Cluster, node_id: int, acks: int = -1) -> tuple[int, int]:
    """One captured librdkafka batch of 5 records, sent to ``node_id``: (error, base)."""
    request, _ = captured_produce("none", "events")
    return send_produce(cluster, node_id, dataclasses.replace(request, acks=i16(acks)))


def send_produce(cluster: Cluster, node_id: int, request: ProduceRequest) -> tuple[int, int]:
    """A Produce v10 of one partition sent to ``node_id`` over the raw Kafka wire: that
    partition's (error code, base offset)."""
    kafka = RawKafka(cluster.nodes[node_id])
    try:
        response = kafka.call(request, ApiKey.PRODUCE, 10)
    finally:
        kafka.close()
    assert isinstance(response, ProduceResponse)
    [answer] = response.responses[0].partition_responses
    return int(answer.error_code), int(answer.base_offset)


def fetched(cluster: Cluster, node_id: int, offset: int = 0) -> tuple[int, bytes]:
    kafka = RawKafka(cluster.nodes[node_id])
    try:
        partition = kafka.fetch("events", offset, read_committed=False)
    finally:
        kafka.close()
    return int(partition.high_watermark), bytes(partition.records or b"")


def test_metadata_names_every_broker_and_each_partition_s_leader(cluster: Cluster) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), "events", 3)
    placed = cluster.wait_partitions(3)
    admin = AdminClient({"bootstrap.servers": cluster.nodes[2].address_of("kafka")})

    def described() -> object:
        metadata = admin.list_topics(timeout=5)
        brokers = {b.id: b.port for b in metadata.brokers.values()}
        topic = metadata.topics.get("events")
        if topic is None or len(topic.partitions) < 3:
            return None  # node 2 makes the stream at its next tick
        parts = {
            f"0/events/{p.id}": (p.leader, sorted(p.replicas), sorted(p.isrs))
            for p in topic.partitions.values()
        }
        return brokers, parts

    expected = {
        path: (p["leader"], sorted(p["replicas"]), sorted(p["isr"])) for path, p in placed.items()
    }
    # A leader names itself once it has taken its epoch (its next tick): until then its
    # partition shows no leader, so the answer is waited for, not read once.
    brokers, _agreed = wait_until(
        lambda: (found := described()) and found[1] == expected and found,
        message=lambda: f"{described()} != {expected}",
        timeout=WAIT_S,
    )
    assert brokers == {n: cluster.nodes[n].ports["kafka"] for n in (1, 2, 3)}


def test_only_the_leader_takes_writes_and_acks_all_needs_min_isr(cluster: Cluster) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), "events", 1)
    leader = cluster.wait_partitions(1)["0/events/0"]["leader"]
    followers = [n for n in (1, 2, 3) if n != leader]
    # The leader takes its epoch on its next tick: until then it refuses too (retryable).
    assert wait_until(lambda: produce_raw(cluster, leader)[0] == 0 or None, timeout=WAIT_S) is True
    for follower in followers:
        assert produce_raw(cluster, follower) == (ErrorCode.not_leader_or_follower, -1)
        # Kimberlite: NotLeader (15), naming where the leader is.
        with cluster.nodes[follower].client() as client:
            refused = expect_error(
                client.call(AppendEventsRequest(1, batch([b"x"]))), 15, "kimberlite"
            )
        assert f"node {leader} leads" in refused.message
        assert f"kafka 127.0.0.1:{cluster.nodes[leader].ports['kafka']}" in refused.message
    with cluster.nodes[leader].client() as client:
        assert append(client, 1, [b"k"]).first_offset == len(RECORDS)
    n = len(RECORDS) + 1  # and Kimberlite's one event
    cluster.wait_replicas_agree([1, 2, 3], n)
    # Followers answer fetches too, up to the high watermark, with the leader's bytes
    # (a follower learns the high watermark on its next fetch: it is waited for).
    wait_until(
        lambda: {fetched(cluster, node) for node in (1, 2, 3)} == {fetched(cluster, leader)},
        timeout=WAIT_S,
        message=lambda: str({node: fetched(cluster, node)[0] for node in (1, 2, 3)}),
    )
    assert fetched(cluster, leader)[0] == n

    # Paused followers hold the high watermark back: acks=1 is taken but not yet
    # readable; once they resume it is.
    for follower in followers:
        cluster.nodes[follower].proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        assert produce_raw(cluster, leader, acks=1) == (0, n)
        n_after = n + len(RECORDS)
        wait_until(lambda: cluster.partitions()["0/events/0"]["end"] == n_after, timeout=WAIT_S)
        assert fetched(cluster, leader) == fetched(cluster, leader, 0)
        assert fetched(cluster, leader)[0] == n  # stored at the leader, not yet readable
        assert fetched(cluster, leader, n) == (n, b"")
    finally:
        for follower in followers:
            cluster.nodes[follower].proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
    wait_until(lambda: fetched(cluster, leader)[0] == n_after, timeout=WAIT_S)

    # Both followers gone: the ISR is the leader alone, below min_insync_replicas (2).
    for follower in followers:
        cluster.nodes[follower].kill()
    # As the leader sees it (its Metadata answers from the state it acts on).
    admin = AdminClient({"bootstrap.servers": cluster.nodes[leader].address_of("kafka")})
    wait_until(
        lambda: (
            admin.list_topics("events", timeout=5).topics["events"].partitions[0].isrs == [leader]
        ),
        message=lambda: str(cluster.status()),
        timeout=WAIT_S,
    )
    # Refused before it is stored: the acks=1 batch after it takes the next offset.
    assert produce_raw(cluster, leader, acks=-1) == (ErrorCode.not_enough_replicas, -1)
    assert produce_raw(cluster, leader, acks=1) == (0, n_after)


def test_nodes_hand_out_producer_ids_from_blocks_of_their_own(cluster: Cluster) -> None:
    # Two idempotent producers whose InitProducerId went to different nodes must not
    # share an id: they would corrupt each other's sequences in every partition. Each
    # node takes a block of ids from etcd (cluster/transactions.py), none twice.
    for node_id in (1, 2):
        cluster.add(node_id)
    ids = []
    for node_id in (1, 2, 1):
        kafka = RawKafka(cluster.nodes[node_id])
        try:
            request = InitProducerIdRequest(
                transactional_id=None,
                transaction_timeout=i32Timedelta.parse(timedelta(seconds=60)),
                producer_id=ProducerId(-1),
                producer_epoch=i16(-1),
            )
            answer = kafka.call(request, ApiKey.INIT_PRODUCER_ID, 4)
        finally:
            kafka.close()
        assert answer.error_code == 0
        ids.append(int(answer.producer_id))
    assert len(set(ids)) == 3
    assert ids[2] == ids[0] + 1  # node 1's block
    assert abs(ids[1] - ids[0]) >= BLOCK_SIZE  # node 2's, another one
