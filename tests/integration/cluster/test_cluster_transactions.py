"""Transactions across the cluster: a tenant's transactions are coordinated by the
leader of its state stream (hw_transaction_state, replicated like any stream); the
coordinator asks each partition's leader for its marker. A confluent-kafka
transactional producer writes over partitions led by two different nodes; a
read_committed consumer sees a committed transaction whole and an aborted one never,
and a transaction committed just before the coordinator is SIGKILLed is whole on every
partition after the failover, once."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import Any

import pytest
from cluster_nodes import WAIT_S, Cluster
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from kio.schema.find_coordinator.v3.request import FindCoordinatorRequest
from kio.static.primitive import i8
from servers import Server
from test_cluster_groups import wait_topic_everywhere
from test_cluster_membership import create_topic
from test_kafka_stored_batches import RawKafka

from headwater.client import AsyncConsumer, AsyncProducer
from headwater.protocols.kafka import ApiKey, ErrorCode
from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

STATE = "0/hw_transaction_state/0"  # the tenant's transaction state partition in etcd
TXN_KEY = i8(1)  # FindCoordinator's key_type of a transactional id


def transactional_producer(bootstrap: str, transactional_id: str) -> Producer:
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": transactional_id,
            "transaction.timeout.ms": 60_000,
        }
    )
    producer.init_transactions(WAIT_S)
    return producer


def send(producer: Producer, values: list[bytes]) -> None:
    """``values`` alternately to partitions 0 and 1, in the producer's transaction."""
    for i, value in enumerate(values):
        producer.produce("events", value, partition=i % 2)


def committed_reader(bootstrap: str) -> Consumer:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "reader",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    consumer.assign([TopicPartition("events", p, 0) for p in (0, 1)])
    return consumer


def read_until(consumer: Consumer, wanted: set[bytes], seen: list[bytes]) -> None:
    def step() -> bool:
        for message in consumer.consume(200, 0.2):
            if message.error() is None:
                seen.append(message.value())
        return wanted <= set(seen)

    wait_until(step, message=lambda: f"{len(seen)} read", timeout=WAIT_S)


def coordinator_asked(node: Server) -> dict[str, Any]:
    """FindCoordinator(transaction) as a node answers it."""
    kafka = RawKafka(node)
    try:
        request = FindCoordinatorRequest(key="t1", key_type=TXN_KEY)
        answer = kafka.call(request, ApiKey.FIND_COORDINATOR, 3)
    finally:
        kafka.close()
    return {"error_code": answer.error_code, "node_id": answer.node_id}


def state_leader(cluster: Cluster, all_in_sync: bool = False) -> int:
    """The node leading the transaction state partition (the coordinator), once there
    is one; with ``all_in_sync``, once nodes 1, 2 and 3 are all in its ISR too."""
    leader: int = wait_until(
        lambda: (p := cluster.partitions().get(STATE)) and p["leader"] > 0 and p["leader"],
        message=lambda: str(cluster.status()),
        timeout=WAIT_S,
    )
    if all_in_sync:
        wait_until(
            lambda: sorted(cluster.partitions()[STATE]["isr"]) == [1, 2, 3],
            message=lambda: str(cluster.status()),
            timeout=WAIT_S,
        )
    return leader


def kill_coordinator(cluster: Cluster, coordinator: int) -> list[int]:
    """SIGKILL the coordinator; the surviving nodes, once one of them leads the state
    partition."""
    cluster.nodes[coordinator].kill()
    survivors = [n for n in (1, 2, 3) if n != coordinator]
    wait_until(
        lambda: cluster.partitions()[STATE]["leader"] in survivors,
        message=lambda: str(cluster.status()),
        timeout=WAIT_S,
    )
    return survivors


def test_transactions_over_partitions_led_by_two_nodes(cluster: Cluster) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), "events", 2)
    placed = cluster.wait_partitions(2)
    wait_topic_everywhere(cluster)
    leaders = {placed[f"0/events/{p}"]["leader"] for p in (0, 1)}
    assert len(leaders) == 2, placed  # placement spreads the two leaderships
    bootstrap = cluster.bootstrap()

    producer = transactional_producer(bootstrap, "t1")
    # The state stream is created by the first FindCoordinator and placed like any
    # stream; every node names its leader, and only that node coordinates.
    coordinator = state_leader(cluster)
    for node in cluster.nodes.values():
        answer = wait_until(
            lambda node=node: (
                (a := coordinator_asked(node)) and a["error_code"] == ErrorCode.none and a
            ),
            timeout=WAIT_S,
        )
        assert answer["node_id"] == coordinator

    # Committed: all of it, on both partitions. Aborted: none of it.
    committed = [b"c%d" % i for i in range(20)]
    producer.begin_transaction()
    send(producer, committed)
    producer.commit_transaction(WAIT_S)
    aborted = [b"x%d" % i for i in range(20)]
    producer.begin_transaction()
    send(producer, aborted)
    producer.flush(WAIT_S)
    producer.abort_transaction(WAIT_S)
    after = [b"d%d" % i for i in range(20)]
    producer.begin_transaction()
    send(producer, after)
    producer.commit_transaction(WAIT_S)

    # Read on each node in turn (bootstrap through one node; every replica serves
    # read_committed up to the last stable offset).
    for node in cluster.nodes.values():
        consumer = committed_reader(node.address_of("kafka"))
        seen: list[bytes] = []
        # The last transaction read whole proves the aborted one, before it, was passed.
        read_until(consumer, set(committed) | set(after), seen)
        consumer.close()
        assert not set(aborted) & set(seen)
        assert sorted(seen) == sorted(committed + after)  # each once

    # A second instance fences the first across the cluster (epoch bumped at the
    # coordinator, checked by each partition's leader).
    zombie = producer
    fresh = transactional_producer(bootstrap, "t1")
    zombie.begin_transaction()
    zombie.produce("events", b"zombie", partition=0)
    with pytest.raises(KafkaException) as refused:
        zombie.commit_transaction(WAIT_S)
    assert refused.value.args[0].code() in (
        KafkaError._FENCED,
        KafkaError.PRODUCER_FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
    ), refused.value
    fresh.begin_transaction()
    send(fresh, [b"f0", b"f1"])
    fresh.commit_transaction(WAIT_S)
    consumer = committed_reader(bootstrap)
    seen = []
    read_until(consumer, {b"f0", b"f1"}, seen)
    consumer.close()
    assert b"zombie" not in seen


def test_a_commit_survives_its_coordinator_s_sigkill(cluster: Cluster) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), "events", 2)
    cluster.wait_partitions(2)
    wait_topic_everywhere(cluster)
    bootstrap = cluster.bootstrap()
    producer = transactional_producer(bootstrap, "t1")
    coordinator = state_leader(cluster, all_in_sync=True)
    first = [b"a%d" % i for i in range(50)]
    producer.begin_transaction()
    send(producer, first)
    producer.commit_transaction(WAIT_S)
    # An open transaction at the kill: its producer goes on with it afterwards.
    second = [b"b%d" % i for i in range(50)]
    producer.begin_transaction()
    send(producer, second[:25])
    producer.flush(WAIT_S)

    survivors = kill_coordinator(cluster, coordinator)
    send(producer, second[25:])
    producer.commit_transaction(WAIT_S)
    third = [b"c%d" % i for i in range(10)]
    producer.begin_transaction()
    send(producer, third)
    producer.commit_transaction(WAIT_S)

    for node_id in survivors:
        consumer = committed_reader(cluster.nodes[node_id].address_of("kafka"))
        seen: list[bytes] = []
        read_until(consumer, set(first + second + third), seen)
        consumer.close()
        assert sorted(seen) == sorted(first + second + third)  # nothing twice


def test_a_commit_prepared_when_its_coordinator_dies_is_finished_by_the_next(
    cluster: Cluster,
) -> None:
    """The coordinator is SIGKILLed between its PrepareCommit and the markers: it is
    held there by pausing the other partition's leader (a state record waits for the
    in-sync replicas, the paused one among them), and killed the moment PrepareCommit is
    in its log. The next coordinator finds the decision (or, if no replica had it yet,
    the producer's EndTxn is retried there) and the transaction is whole, once."""
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), "events", 2)
    placed = cluster.wait_partitions(2)
    wait_topic_everywhere(cluster)
    producer = transactional_producer(cluster.bootstrap(), "t1")
    coordinator = state_leader(cluster, all_in_sync=True)
    paused = next(
        placed[f"0/events/{p}"]["leader"]
        for p in (0, 1)
        if placed[f"0/events/{p}"]["leader"] != coordinator
    )
    values = [b"v%d" % i for i in range(40)]
    producer.begin_transaction()
    send(producer, values)
    producer.flush(WAIT_S)
    before = b"".join(cluster.log_files(coordinator, stream="hw_transaction_state").values())
    assert before.count(b"PrepareCommit") == 0

    os.kill(cluster.nodes[paused].pid, signal.SIGSTOP)
    committing = threading.Thread(target=lambda: outcome.append(commit(producer)))
    outcome: list[str | None] = []
    try:
        committing.start()
        wait_until(
            lambda: (
                b"PrepareCommit"
                in b"".join(cluster.log_files(coordinator, stream="hw_transaction_state").values())
            ),
            message="no PrepareCommit in the coordinator's state log",
            timeout=WAIT_S,
        )
        cluster.nodes[coordinator].kill()
    finally:
        os.kill(cluster.nodes[paused].pid, signal.SIGCONT)
    committing.join(3 * WAIT_S)
    assert outcome == [None], outcome  # commit_transaction returned: committed

    survivors = [n for n in (1, 2, 3) if n != coordinator]
    for node_id in survivors:
        consumer = committed_reader(cluster.nodes[node_id].address_of("kafka"))
        seen: list[bytes] = []
        read_until(consumer, set(values), seen)
        consumer.close()
        assert sorted(seen) == sorted(values)  # nothing twice


def commit(producer: Producer) -> str | None:
    """commit_transaction's outcome: None, or the error it raised."""
    try:
        producer.commit_transaction(3 * WAIT_S)
    except KafkaException as exc:
        return str(exc)
    return None


def test_an_open_transaction_left_by_a_dead_coordinator_times_out_at_the_next(
    cluster: Cluster,
) -> None:
    """A producer abandons an open transaction (5 s timeout) and its coordinator is
    SIGKILLed: the next coordinator, which replayed it as Ongoing, aborts it at its
    timeout, so the partitions' last stable offset passes it. Shown by another
    producer's later transaction being read, the abandoned records never."""
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), "events", 2)
    cluster.wait_partitions(2)
    wait_topic_everywhere(cluster)
    abandoned = Producer(
        {
            "bootstrap.servers": cluster.bootstrap(),
            "transactional.id": "left",
            "transaction.timeout.ms": 5000,
        }
    )
    abandoned.init_transactions(WAIT_S)
    coordinator = state_leader(cluster, all_in_sync=True)
    left = [b"left%d" % i for i in range(10)]
    abandoned.begin_transaction()
    send(abandoned, left)
    abandoned.flush(WAIT_S)
    survivors = kill_coordinator(cluster, coordinator)

    later = transactional_producer(cluster.bootstrap(), "later")
    after = [b"after%d" % i for i in range(10)]
    later.begin_transaction()
    send(later, after)
    later.commit_transaction(WAIT_S)
    for node_id in survivors:
        consumer = committed_reader(cluster.nodes[node_id].address_of("kafka"))
        seen: list[bytes] = []
        read_until(consumer, set(after), seen)
        consumer.close()
        assert sorted(seen) == sorted(after)  # the abandoned transaction: aborted
    assert any(
        "aborting transaction 'left' after its timeout" in cluster.nodes[n].log_text()
        for n in survivors
    )


def test_a_rivven_sdk_transaction_through_a_node_that_does_not_coordinate(
    cluster: Cluster,
) -> None:
    """The SDK's transactional producer (Rivven) pointed at a node that does not
    coordinate the tenant's transactions: its BeginTransaction there is NOT_COORDINATOR
    naming the coordinator's listeners, and the session moves there as it follows a
    NotLeader; the transaction's records (to a partition the coordinator leads) are read
    whole once committed, and an aborted transaction's never."""
    for node_id in (1, 2, 3):
        cluster.add(node_id, rivven=True)
    coordinator_asked(cluster.nodes[1])  # the state stream is made on first sight
    coordinator = state_leader(cluster, all_in_sync=True)
    create_topic(cluster.nodes[1].address_of("kafka"), "events", 6)
    placed = cluster.wait_partitions(7)  # and the state partition
    led = [
        int(path.rsplit("/", 1)[1])
        for path, part in placed.items()
        if path.startswith("0/events/") and part["leader"] == coordinator
    ]
    assert led, placed  # placement spreads the leaderships: the coordinator has some
    other = next(n for n in (1, 2, 3) if n != coordinator)

    async def transactions() -> int:
        address = cluster.nodes[other].address_of("rivven")
        async with AsyncProducer(address, transactional_id="r1") as producer:
            await producer.init_transactions()
            for prefix, commit in ((b"c", True), (b"a", False), (b"d", True)):
                await producer.begin_transaction()
                for i in range(10):
                    producer.send("events", prefix + b"%d" % i, partition=led[0])
                if commit:
                    await producer.commit_transaction()
                else:
                    await producer.abort_transaction()
            return producer._session.redirects

    moves = asyncio.run(transactions())
    assert moves == 1  # to the coordinator, which also leads the partition

    async def read_committed(address: str) -> list[bytes]:
        # The last transaction's records come after the aborted one's: read up to
        # them, an aborted record would have been read before. Through Rivven (the
        # SDK's consumer, read_committed), from a node that follows the partition.
        seen: list[bytes] = []
        async with AsyncConsumer(address, group_id="reader") as consumer:
            consumer.assign([("events", led[0])])
            consumer.seek(("events", led[0]), 0)
            async with asyncio.timeout(WAIT_S):
                while b"d9" not in seen:
                    record = await consumer.poll(1.0)
                    if record is not None and record.value is not None:
                        seen.append(record.value)
        return seen

    seen = asyncio.run(read_committed(cluster.nodes[other].address_of("rivven")))
    assert seen == [b"c%d" % i for i in range(10)] + [b"d%d" % i for i in range(10)]
