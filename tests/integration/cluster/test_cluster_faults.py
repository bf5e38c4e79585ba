"""The fault suite (issue 20): a confluent-kafka producer (acks=all, idempotence)
writes without pause while the test SIGKILLs the partition's leader at a random moment,
waits for a new leader, restarts the killed node and waits for it to rejoin the ISR;
every other round it also SIGKILLs a follower (writes go on with two in-sync
replicas), then restarts it; round after round. Then every acknowledged message must
be read back exactly once, in the order of its offsets, and every replica must hold
the same bytes.

Rounds: ``HEADWATER_FAULT_ROUNDS`` (default 4 in the suite, for CI time: four leader
kills, two of them with a follower killed too; the recorded runs use 20). Failover
times are printed (run with ``-s``) and recorded in docs/benchmarks.md."""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
from cluster_nodes import LEASE_S, WAIT_S, Cluster
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from test_cluster_membership import create_topic

from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROUNDS = int(os.environ.get("HEADWATER_FAULT_ROUNDS", "4"))
TOPIC = "events"


@dataclass
class Acks:
    """What the producer was told: offset of each acknowledged value, and failures."""

    offsets: dict[bytes, int] = field(default_factory=dict)
    # Delivered without an offset: librdkafka acknowledges a retried batch that a later
    # one proves stored ("implicit ack") without knowing where it went.
    unplaced: set[bytes] = field(default_factory=set)
    failed: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # when each ack arrived
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, err: KafkaError | None, message: Message) -> None:
        with self.lock:
            if err is not None:
                self.failed.append(str(err))
                return
            value = message.value()
            assert value is not None
            offset = message.offset()
            if offset is None:
                self.unplaced.add(value)
            else:
                self.offsets[value] = int(offset)
            self.times.append(time.monotonic())

    def count(self) -> int:
        with self.lock:
            return len(self.offsets) + len(self.unplaced)

    def acknowledged(self) -> list[bytes]:
        with self.lock:
            return [*self.offsets, *self.unplaced]

    def first_after(self, moment: float) -> float | None:
        with self.lock:
            later = [t for t in self.times if t > moment]
        return min(later) if later else None


def produce_forever(
    bootstrap: str, acks: Acks, stop: threading.Event, extra: dict[str, object] | None = None
) -> None:
    """``extra``: more librdkafka settings (e.g. ``debug`` while finding a fault)."""
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 5,
            "message.timeout.ms": 120_000,  # retried across failovers, never dropped
            "retry.backoff.ms": 50,
            **(extra or {}),
        }
    )
    sequence = 0
    while not stop.is_set():
        try:
            producer.produce(TOPIC, b"m%08d" % sequence, partition=0, on_delivery=acks)
            sequence += 1
        except BufferError:
            pass
        producer.poll(0.002)
    assert producer.flush(120) == 0


def read_back(bootstrap: str, count: int) -> list[tuple[int, bytes]]:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "faults", "enable.auto.commit": False}
    )
    consumer.assign([TopicPartition(TOPIC, 0, 0)])
    found: list[tuple[int, bytes]] = []
    try:
        while len(found) < count:
            messages = wait_until(
                lambda: consumer.consume(10_000, 0.2), message=f"read {len(found)} of {count}"
            )
            for message in messages:
                assert message.error() is None, message.error()
                found.append((int(message.offset()), bytes(message.value())))  # type: ignore[arg-type]
    finally:
        consumer.close()
    return found


def test_acknowledged_writes_survive_leader_kills(cluster: Cluster) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), TOPIC, 1)
    cluster.wait_partitions(1)
    acks = Acks()
    stop = threading.Event()
    producer = threading.Thread(
        target=produce_forever, args=(cluster.bootstrap(), acks, stop), daemon=True
    )
    producer.start()
    rng = random.Random(20)
    leader_moves: list[float] = []
    first_acks: list[float] = []
    try:
        for round_no in range(ROUNDS):
            part = cluster.partitions()[f"0/{TOPIC}/0"]
            victim, epoch = part["leader"], part["epoch"]
            # A random moment: after a random number of further acknowledgements.
            target = acks.count() + rng.randint(20, 400)
            wait_until(lambda target=target: acks.count() >= target, timeout=60)
            killed_at = time.monotonic()
            cluster.nodes[victim].kill()
            wait_until(
                lambda victim=victim: (
                    cluster.partitions()[f"0/{TOPIC}/0"]["leader"] not in (victim, -1)
                ),
                timeout=6 * LEASE_S,
                message=lambda: str(cluster.status()),
            )
            leader_moves.append(time.monotonic() - killed_at)
            after = wait_until(lambda k=killed_at: acks.first_after(k), timeout=60)
            first_acks.append(after - killed_at)
            assert cluster.partitions()[f"0/{TOPIC}/0"]["epoch"] == epoch + 1
            cluster.nodes[victim].start()
            wait_until(
                lambda: len(cluster.partitions()[f"0/{TOPIC}/0"]["isr"]) == 3,
                timeout=30,
                message=lambda: str(cluster.status()),
            )
            print(
                f"round {round_no + 1}: killed {victim}, new leader in {leader_moves[-1]:.2f} s,"
                f" next ack after {first_acks[-1]:.2f} s, {acks.count()} acknowledged"
            )
            if round_no % 2:
                # Every other round a follower dies too: acks=all goes on with the two
                # left (min_insync_replicas 2), and the follower catches up on return.
                part = cluster.partitions()[f"0/{TOPIC}/0"]
                follower = rng.choice([n for n in part["replicas"] if n != part["leader"]])
                target = acks.count() + rng.randint(20, 400)
                wait_until(lambda target=target: acks.count() >= target, timeout=60)
                cluster.nodes[follower].kill()
                wait_until(
                    lambda f=follower: f not in cluster.partitions()[f"0/{TOPIC}/0"]["isr"],
                    timeout=6 * LEASE_S,
                    message=lambda: str(cluster.status()),
                )
                target = acks.count() + 100
                wait_until(lambda target=target: acks.count() >= target, timeout=60)
                cluster.nodes[follower].start()
                wait_until(
                    lambda: len(cluster.partitions()[f"0/{TOPIC}/0"]["isr"]) == 3,
                    timeout=30,
                    message=lambda: str(cluster.status()),
                )
                print(f"round {round_no + 1}: killed follower {follower}; it rejoined")
    finally:
        stop.set()
        producer.join(150)
    assert not producer.is_alive()

    assert acks.failed == []
    acknowledged = acks.count()
    # Every message the producer sent was acknowledged (none failed): the log ends
    # right after the last one.
    end = max(acks.offsets.values()) + 1
    files = cluster.wait_replicas_agree([1, 2, 3], end)
    assert files  # the same bytes on every replica
    leader = cluster.partitions()[f"0/{TOPIC}/0"]["leader"]
    found = read_back(cluster.nodes[leader].address_of("kafka"), end)
    values = [value for _, value in found]
    duplicated = len(values) - len(set(values))
    stored = set(values)
    lost = [v for v in acks.acknowledged() if v not in stored]
    print(
        f"{ROUNDS} rounds: acknowledged {acknowledged}, stored {len(values)}, lost {len(lost)},"
        f" duplicated {duplicated}; new leader after SIGKILL: median"
        f" {statistics.median(leader_moves):.2f} s, max {max(leader_moves):.2f} s; first ack"
        f" after the kill: median {statistics.median(first_acks):.2f} s, max"
        f" {max(first_acks):.2f} s (lease_s = {LEASE_S})"
    )
    assert lost == [] and duplicated == 0
    # Each acknowledged value is where its acknowledgement said, in offset order.
    stored_at = {value: offset for offset, value in found}
    assert all(stored_at[v] == offset for v, offset in acks.offsets.items())
    assert values == sorted(values)  # the producer's order


PARTITIONS = 6


@dataclass
class PartitionAcks:
    """Acknowledged offsets by (partition, value), for a topic of several partitions."""

    offsets: dict[tuple[int, bytes], int] = field(default_factory=dict)
    unplaced: set[tuple[int, bytes]] = field(default_factory=set)  # as Acks.unplaced
    failed: list[str] = field(default_factory=list)
    per_partition: dict[int, int] = field(default_factory=dict)  # acknowledged so far
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, err: KafkaError | None, message: Message) -> None:
        with self.lock:
            if err is not None:
                self.failed.append(str(err))
                return
            value = message.value()
            partition = int(message.partition())  # type: ignore[arg-type]
            assert value is not None
            offset = message.offset()
            if offset is None:
                self.unplaced.add((partition, value))
            else:
                self.offsets[partition, value] = int(offset)
            self.per_partition[partition] = self.per_partition.get(partition, 0) + 1

    def counts(self) -> dict[int, int]:
        with self.lock:
            return dict(self.per_partition)


def produce_to_every_partition(bootstrap: str, acks: PartitionAcks, stop: threading.Event) -> None:
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 5,
            "message.timeout.ms": 180_000,  # outlasts a partition's wait for min ISR
            "retry.backoff.ms": 50,
            **({"debug": "eos,msg,protocol"} if os.environ.get("HEADWATER_KAFKA_DEBUG") else {}),
        }
    )
    # Every partition known before the first message (else: Local: Unknown partition).
    wait_until(lambda: len(producer.list_topics(TOPIC, 5).topics[TOPIC].partitions) == PARTITIONS)
    sequence = 0
    while not stop.is_set():
        try:
            producer.produce(
                TOPIC, b"m%08d" % sequence, partition=sequence % PARTITIONS, on_delivery=acks
            )
            sequence += 1
        except BufferError:
            pass
        producer.poll(0.002)
    assert producer.flush(180) == 0


def test_leaders_of_several_partitions_killed_at_once(cluster: Cluster) -> None:
    """Six partitions over three nodes (each leads two): SIGKILL one node, so two
    partitions lose their leader at once; once they lead elsewhere and take writes,
    restart it and at once SIGKILL a second node (now leading more than two), before
    the first has necessarily caught up. Every partition goes on once the nodes are
    back; nothing acknowledged is lost or duplicated and the replicas agree."""
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), TOPIC, PARTITIONS)
    placed = cluster.wait_partitions(PARTITIONS)
    assert sorted(p["leader"] for p in placed.values()) == [1, 1, 2, 2, 3, 3]
    acks = PartitionAcks()
    stop = threading.Event()
    producer = threading.Thread(
        target=produce_to_every_partition, args=(cluster.bootstrap(), acks, stop), daemon=True
    )
    producer.start()

    def leaders() -> dict[int, int]:
        return {int(k.rsplit("/", 1)[1]): p["leader"] for k, p in cluster.partitions().items()}

    def every_partition_acknowledges(more: int = 50) -> None:
        before = acks.counts()
        wait_until(
            lambda: all(
                acks.counts().get(p, 0) >= before.get(p, 0) + more for p in range(PARTITIONS)
            ),
            timeout=WAIT_S,
            message=lambda: f"{acks.counts()} acknowledged: {cluster.status()}",
        )

    try:
        every_partition_acknowledges()
        for kill in (1, 2):
            # The node leading the most partitions now (a lease lapsing under load may
            # have moved some): several partitions' leaders at once.
            counts = Counter(leaders().values())
            victim, led = max(counts.items(), key=lambda item: (item[1], -item[0]))
            assert led >= 2, counts
            cluster.nodes[victim].kill()
            wait_until(
                lambda victim=victim: all(n not in (victim, -1) for n in leaders().values()),
                timeout=WAIT_S,
                message=lambda: str(cluster.status()),
            )
            if kill == 1:
                every_partition_acknowledges()
            cluster.nodes[victim].start()
        every_partition_acknowledges()
        wait_until(
            lambda: all(len(p["isr"]) == 3 for p in cluster.partitions().values()),
            timeout=WAIT_S,
            message=lambda: str(cluster.status()),
        )
        every_partition_acknowledges()
    finally:
        stop.set()
        producer.join(200)
    assert not producer.is_alive()
    assert acks.failed == []

    consumer = Consumer(
        {"bootstrap.servers": cluster.bootstrap(), "group.id": "six", "enable.auto.commit": False}
    )
    ends = {p: 0 for p in range(PARTITIONS)}
    for (partition, _), offset in acks.offsets.items():
        ends[partition] = max(ends[partition], offset + 1)
    consumer.assign([TopicPartition(TOPIC, p, 0) for p in range(PARTITIONS)])
    found: dict[tuple[int, bytes], list[int]] = {}
    total = sum(ends.values())
    read = 0
    try:
        while read < total:
            for message in wait_until(lambda: consumer.consume(10_000, 0.2), timeout=WAIT_S):
                assert message.error() is None, message.error()
                key = (int(message.partition()), bytes(message.value()))  # type: ignore[arg-type]
                found.setdefault(key, []).append(int(message.offset()))  # type: ignore[arg-type]
                read += 1
    finally:
        consumer.close()
    duplicated = [k for k, offsets in found.items() if len(offsets) > 1]
    lost = [k for k in [*acks.offsets, *acks.unplaced] if k not in found]
    print(
        f"{PARTITIONS} partitions, two nodes' leaders killed: acknowledged"
        f" {len(acks.offsets) + len(acks.unplaced)} ({len(acks.unplaced)} without an offset),"
        f" read {read}, lost {len(lost)}, duplicated {len(duplicated)}"
    )
    assert lost == [] and duplicated == [] and read == total
    assert all(found[k] == [offset] for k, offset in acks.offsets.items())
    # Every replica of every partition holds the same bytes.
    for p in range(PARTITIONS):
        wait_until(
            lambda p=p: (
                all(
                    cluster.log_files(n, partition=p) == cluster.log_files(1, partition=p)
                    for n in (2, 3)
                )
                and cluster.log_files(1, partition=p)
            ),
            timeout=WAIT_S,
            message=lambda p=p: f"partition {p} differs: {cluster.status()}",
        )
