"""ListOffsets MAX_TIMESTAMP (-3, KIP-734) as confluent-kafka's AdminClient asks for it:
the offset and timestamp of a partition's first record with its largest timestamp, a
record inside a batch included; -1 for an empty partition."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec
from servers import LOCAL, Server, serving

DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(tmp_path_factory.mktemp("kafka"), listen={"kafka": LOCAL}, clean_log=True)


def test_max_timestamp_is_the_first_record_with_the_largest_timestamp(server: Server) -> None:
    bootstrap = server.address_of("kafka")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topic = "maxts_" + uuid.uuid4().hex[:8]
    admin.create_topics([NewTopic(topic, num_partitions=2)])[topic].result(DEADLINE_S)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 100})
    # Offsets 0..4, one batch each; then 5..7 in one batch whose middle record is the
    # latest of all, and 8, as late as it, after.
    for stamp in (1_000, 5_000, 3_000, 5_000, 2_000):
        producer.produce(topic, b"v", partition=0, timestamp=stamp)
        producer.flush(DEADLINE_S)
    for stamp in (6_000, 9_000, 8_000):
        producer.produce(topic, b"v", partition=0, timestamp=stamp)
    producer.flush(DEADLINE_S)
    producer.produce(topic, b"v", partition=0, timestamp=9_000)
    producer.flush(DEADLINE_S)

    def max_timestamp(partition: int) -> tuple[int, int]:
        tp = TopicPartition(topic, partition)
        found = admin.list_offsets({tp: OffsetSpec.max_timestamp()})[tp].result(DEADLINE_S)
        return found.offset, found.timestamp

    assert max_timestamp(0) == (6, 9_000)
    assert max_timestamp(1) == (-1, -1)  # nothing stored
