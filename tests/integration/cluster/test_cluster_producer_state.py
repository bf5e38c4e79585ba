"""An idempotent producer's state on a new partition leader (docs/cluster.md, "Producer
state on a new leader"): every replica keeps the partition's producer table from the
batches it copies, so once the leader is SIGKILLed the follower that takes over answers
a retried batch it already holds as the old leader did (stored once, its original
offset), refuses a gap, and takes the next sequence. Batches are built here with a
fixed producer id, epoch and sequences and sent over the raw Kafka wire, as a client
resending after NOT_LEADER_FOR_PARTITION would."""

from __future__ import annotations

import dataclasses

import pytest
from cluster_nodes import WAIT_S, Cluster
from kio.static.primitive import i16
from test_cluster_kafka import send_produce
from test_cluster_membership import create_topic
from test_kafka_stored_batches import captured_produce

from headwater.protocols.kafka import ErrorCode
from headwater.protocols.kafka.records import Record, build_batch
from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PRODUCER_ID = 4_000_000_001  # no node hands it out: the table takes any id at sequence 0
TOPIC = "events"


def idempotent_batch(sequence: int, count: int, epoch: int = 0) -> bytes:
    records = [Record(i, i, b"k", b"seq-%d-epoch-%d" % (sequence + i, epoch)) for i in range(count)]
    return build_batch(
        records,
        base_timestamp=1_700_000_000_000 + sequence,
        producer_id=PRODUCER_ID,
        producer_epoch=epoch,
        base_sequence=sequence,
    )


def produce(cluster: Cluster, node_id: int, batch: bytes) -> tuple[int, int]:
    """``batch`` sent to ``node_id`` with acks=all: (error code, base offset)."""
    request, _ = captured_produce("none", TOPIC)
    [data] = request.topic_data
    partition = dataclasses.replace(data.partition_data[0], records=batch)
    request = dataclasses.replace(
        request,
        acks=i16(-1),
        topic_data=(dataclasses.replace(data, partition_data=(partition,)),),
    )
    return send_produce(cluster, node_id, request)


# NOT_LEADER until the node takes its epoch (its next tick), NOT_ENOUGH_REPLICAS until
# the ISR it leads is back to min_insync_replicas: retried, as a client does.
RETRIABLE = {ErrorCode.not_leader_or_follower, ErrorCode.not_enough_replicas}


def produce_at_leader(cluster: Cluster, node_id: int, batch: bytes) -> tuple[int, int]:
    answer: tuple[int, int] = wait_until(
        lambda: (got := produce(cluster, node_id, batch))[0] not in RETRIABLE and got,
        timeout=WAIT_S,
    )
    return answer


def test_a_new_leader_answers_a_retried_batch_from_the_copied_producer_state(
    cluster: Cluster,
) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), TOPIC, 1)
    old_leader = cluster.wait_partitions(1)[f"0/{TOPIC}/0"]["leader"]
    # Kafka numbers records: each batch's base sequence is the last one's + its count.
    sizes = [3, 2, 4, 1, 3, 2]
    stored: dict[int, int] = {}  # base sequence -> base offset
    sequence = 0
    for count in sizes:
        error, offset = produce_at_leader(cluster, old_leader, idempotent_batch(sequence, count))
        assert error == ErrorCode.none
        stored[sequence] = offset
        sequence += count
    end = sum(sizes)
    assert sorted(stored.values()) == [0, 3, 5, 9, 10, 13]
    cluster.wait_replicas_agree([1, 2, 3], end)

    cluster.nodes[old_leader].kill()
    new_leader = wait_until(
        lambda: (
            (p := cluster.partitions()[f"0/{TOPIC}/0"])["leader"] not in (old_leader, -1)
            and p["leader"]
        ),
        timeout=WAIT_S,
    )
    # The last batch again (the one a client resends after losing its answer), and an
    # older one inside the window Kafka keeps: each stored once, at its first offset.
    last = sequence - sizes[-1]
    assert produce_at_leader(cluster, new_leader, idempotent_batch(last, sizes[-1])) == (
        ErrorCode.none,
        stored[last],
    )
    assert produce_at_leader(cluster, new_leader, idempotent_batch(3, 2)) == (
        ErrorCode.none,
        stored[3],
    )
    # A gap is refused, nothing stored; the next sequence is taken at the end.
    assert produce_at_leader(cluster, new_leader, idempotent_batch(sequence + 1, 1)) == (
        ErrorCode.out_of_order_sequence_number,
        -1,
    )
    assert produce_at_leader(cluster, new_leader, idempotent_batch(sequence, 2)) == (
        ErrorCode.none,
        end,
    )
    survivors = [n for n in (1, 2, 3) if n != old_leader]
    cluster.wait_replicas_agree(survivors, end + 2)
