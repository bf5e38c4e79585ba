"""Consumer groups across the cluster: a tenant's groups are coordinated by the leader
of its offsets stream (hw_consumer_offsets, replicated like any stream); when that node
is SIGKILLed the group moves to the new leader and resumes from its committed offsets.
Other nodes answer NOT_COORDINATOR; FindCoordinator names the coordinator everywhere."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from cluster_nodes import WAIT_S, Cluster
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from kio.schema.find_coordinator.v3.request import FindCoordinatorRequest
from kio.schema.offset_fetch.v7.request import OffsetFetchRequest
from kio.schema.types import GroupId
from kio.static.primitive import i8
from test_cluster_membership import create_topic
from test_kafka_stored_batches import RawKafka

from headwater.client import AsyncConsumer
from headwater.client import TopicPartition as HwTopicPartition
from headwater.errors import HeadwaterError
from headwater.protocols.kafka import ApiKey, ErrorCode
from headwater.storage.high_watermarks import read_high_watermarks
from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GROUP = "billing"
OFFSETS = "0/hw_consumer_offsets/0"  # the tenant's offsets partition in etcd


def produce(bootstrap: str, values: list[bytes]) -> None:
    """``values`` alternately to partitions 0 and 1, acks=all, idempotent (it retries
    through a leader's failover)."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True})
    # Its own metadata first: one node's answer (a topic just created) has been seen
    # naming one partition after every node's had named both.
    wait_until(
        lambda: (
            len(producer.list_topics("events", timeout=WAIT_S).topics["events"].partitions) == 2
        ),
        message="the producer never saw both partitions",
        timeout=WAIT_S,
    )
    failures: list[object] = []
    for i, value in enumerate(values):
        producer.produce(
            "events", value, partition=i % 2, on_delivery=lambda e, _m: e and failures.append(e)
        )
    assert producer.flush(WAIT_S) == 0 and not failures, failures


def wait_topic_everywhere(cluster: Cluster) -> None:
    """Every node's Metadata shows both partitions of events with a leader."""
    for node in cluster.nodes.values():
        admin = AdminClient({"bootstrap.servers": node.address_of("kafka")})

        def shown(admin: AdminClient = admin) -> bool:
            topic = admin.list_topics(timeout=WAIT_S).topics.get("events")
            return (
                topic is not None
                and topic.error is None
                and sorted(topic.partitions) == [0, 1]
                and all(p.leader >= 0 for p in topic.partitions.values())
            )

        wait_until(shown, message="events not shown by every node", timeout=WAIT_S)


def group_consumer(bootstrap: str) -> Consumer:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": GROUP,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 500,
        }
    )
    consumer.subscribe(["events"])
    return consumer


Received = list[tuple[int, int, bytes]]  # (partition, offset, value)


def consume(consumers: list[Consumer], received: Received, until: set[bytes], commit: bool) -> None:
    """Poll the group's consumers in turn until every value of ``until`` came and every
    consumer holds an assignment; with ``commit`` each commits what it consumed (a
    commit refused during a rebalance or a coordinator move is covered by its next one).

    The assignment matters: one member can form the group and consume everything before
    the other's JoinGroup arrives. That join then waits for the first member to rejoin,
    which it does only inside a poll; a coordinator request the test makes meanwhile
    (committed()) queues behind the blocked JoinGroup on the same connection, as Kafka
    brokers answer a connection's requests in order."""

    def step() -> bool:
        for consumer in consumers:
            messages = consumer.consume(100, 0.1)
            for message in messages:
                assert message.error() is None, message.error()
                received.append((message.partition(), message.offset(), message.value()))
            if commit and messages:
                with contextlib.suppress(KafkaException):
                    consumer.commit(asynchronous=False)
        return until <= {value for _, _, value in received} and all(
            consumer.assignment() for consumer in consumers
        )

    wait_until(step, message=lambda: f"{len(received)} received", timeout=2 * WAIT_S)


def commit_all(consumers: list[Consumer]) -> None:
    """Every consumer's position committed (retried through rebalances)."""

    def committed() -> bool:
        for consumer in consumers:
            consumer.poll(0.05)
            try:
                if consumer.assignment():
                    consumer.commit(asynchronous=False)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError._NO_OFFSET:  # nothing new: done
                    failures.append(exc.args[0])
                    return False
        return True

    failures: list[KafkaError] = []
    wait_until(committed, message=lambda: f"commits kept failing: {failures[-3:]}", timeout=WAIT_S)


def committed_offsets(consumer: Consumer) -> dict[int, int]:
    found = consumer.committed([TopicPartition("events", p) for p in (0, 1)], timeout=WAIT_S)
    return {tp.partition: tp.offset for tp in found}


def ends(consumer: Consumer) -> dict[int, int]:
    return {
        p: consumer.get_watermark_offsets(TopicPartition("events", p), timeout=WAIT_S)[1]
        for p in (0, 1)
    }


async def committed_over_rivven(address: str) -> tuple[int, int] | str:
    """The group's committed offset of events/0 through the SDK and the moves its
    session made to get it, or its refusal."""
    async with AsyncConsumer(address, group_id=GROUP, enable_auto_commit=False) as consumer:
        try:
            found = await consumer.committed([("events", 0)])
        except HeadwaterError as exc:
            return f"{type(exc).__name__}: {exc}"
        moves = consumer._session.redirects
    offset = found[HwTopicPartition("events", 0)]
    assert offset is not None
    return offset, moves


def coordinator_in_etcd(cluster: Cluster) -> int:
    leader: int = cluster.partitions()[OFFSETS]["leader"]
    return leader


def test_a_group_moves_to_the_new_coordinator_with_its_committed_offsets(
    cluster: Cluster,
) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id, rivven=True)
    create_topic(cluster.nodes[1].address_of("kafka"), "events", 2)
    cluster.wait_partitions(2)
    wait_topic_everywhere(cluster)
    bootstrap = cluster.bootstrap()
    first = [b"a%d" % i for i in range(300)]
    produce(bootstrap, first)

    # A group of two consumes and commits everything; the offsets stream is created by
    # its first FindCoordinator and placed like any stream.
    consumers = [group_consumer(bootstrap), group_consumer(bootstrap)]
    received: Received = []
    consume(consumers, received, set(first), commit=True)
    commit_all(consumers)
    at_commit = ends(consumers[0])
    assert committed_offsets(consumers[0]) == at_commit
    assert sum(at_commit.values()) == 300
    coordinator = coordinator_in_etcd(cluster)
    assert sorted(cluster.partitions()[OFFSETS]["isr"]) == [1, 2, 3]

    # Consumed and not committed: the new consumers get these again.
    uncommitted = [b"b%d" % i for i in range(50)]
    produce(bootstrap, uncommitted)
    consume(consumers, received, set(uncommitted), commit=False)
    for consumer in consumers:
        consumer.close()

    cluster.nodes[coordinator].kill()
    # Its high watermarks were checkpointed (once a tick): returning, it does not start
    # them from zero.
    checkpoint = read_high_watermarks(cluster.nodes[coordinator].data_dir)
    assert checkpoint[0, "hw_consumer_offsets", 0] > 0
    assert checkpoint[0, "events", 0] + checkpoint[0, "events", 1] >= 300
    survivors = [n for n in (1, 2, 3) if n != coordinator]
    new_coordinator = wait_until(
        lambda: (leader := coordinator_in_etcd(cluster)) in survivors and leader,
        message=lambda: str(cluster.status()),
        timeout=WAIT_S,
    )
    bootstrap = cluster.bootstrap()
    later = [b"c%d" % i for i in range(200)]
    produce(bootstrap, later)

    resumed = [group_consumer(bootstrap), group_consumer(bootstrap)]
    after: Received = []
    consume(resumed, after, set(uncommitted) | set(later), commit=True)
    # Resumed exactly at each partition's committed offset: nothing committed read
    # again, nothing after it skipped.
    for partition in (0, 1):
        offsets = [o for p, o, _ in after if p == partition]
        assert min(offsets) == at_commit[partition], (partition, at_commit, min(offsets))
    assert {v for _, _, v in after} == set(uncommitted) | set(later)
    commit_all(resumed)
    final = ends(resumed[0])
    assert committed_offsets(resumed[0]) == final
    assert sum(final.values()) == 550
    for consumer in resumed:
        consumer.close()

    # The killed node returns as a follower of the offsets partition: every node names
    # the new coordinator, and the others refuse the group's requests.
    cluster.nodes[coordinator].start()
    wait_until(
        lambda: sorted(cluster.partitions()[OFFSETS]["isr"]) == [1, 2, 3],
        message=lambda: str(cluster.status()),
        timeout=WAIT_S,
    )
    assert coordinator_in_etcd(cluster) == new_coordinator
    for node_id in (1, 2, 3):
        kafka = RawKafka(cluster.nodes[node_id])
        try:
            found = kafka.call(
                FindCoordinatorRequest(key=GROUP, key_type=i8(0)), ApiKey.FIND_COORDINATOR, 3
            )
            assert (found.error_code, found.node_id) == (ErrorCode.none, new_coordinator)
            fetched = kafka.call(
                OffsetFetchRequest(group_id=GroupId(GROUP), topics=None, require_stable=False),
                ApiKey.OFFSET_FETCH,
                7,
            )
            expected = ErrorCode.none if node_id == new_coordinator else ErrorCode.not_coordinator
            assert fetched.error_code == expected, (node_id, fetched)
        finally:
            kafka.close()

    # Rivven's offset calls have no coordinator lookup: elsewhere they are refused
    # NOT_COORDINATOR (never answered from, or written to, that node's follower copy),
    # naming the coordinator's listeners, and the SDK moves there (one move).
    for node_id in (1, 2, 3):
        committed = asyncio.run(committed_over_rivven(cluster.nodes[node_id].address_of("rivven")))
        assert committed == (final[0], 0 if node_id == new_coordinator else 1), committed
