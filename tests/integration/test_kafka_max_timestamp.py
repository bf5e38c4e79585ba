"""ListOffsets MAX_TIMESTAMP (-3, KIP-734) as confluent-kafka's AdminClient asks for it:
the offset and timestamp of a partition's first record with its largest timestamp, a
record inside a batch included; -1 for an empty partition. And timestamps past what
SQL's microseconds hold: stored and served as sent, SQL going on."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec
from servers import LOCAL, Server, serving

from waiting import wait_until

DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("kafka"), listen={"kafka": LOCAL, "http": LOCAL}, clean_log=True
    )


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


def sql_rows(server: Server, text: str) -> list[list[Any]] | None:
    """The rows of a query over HTTP; None while the projections catch up (503)."""
    request = urllib.request.Request(
        f"http://{server.address_of('http')}/api/sql",
        data=json.dumps({"sql": text}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as answer:
            rows: list[list[Any]] = json.loads(answer.read())["rows"]
            return rows
    except urllib.error.HTTPError as exc:
        if exc.code == 503:
            return None
        raise


def test_timestamps_past_what_sql_holds_are_served_and_stop_no_query(server: Server) -> None:
    # A producer taking nanoseconds for ms, or any 64-bit time: Kafka stores it (3.x
    # does), and SQL's microseconds cannot hold it. Once, one such record stopped the
    # projection of its stream, and SQL over every stream of the tenant with it.
    bootstrap = server.address_of("kafka")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    far, other = "far_" + uuid.uuid4().hex[:8], "near_" + uuid.uuid4().hex[:8]
    for future in admin.create_topics([NewTopic(far, 1), NewTopic(other, 1)]).values():
        future.result(DEADLINE_S)
    stamps = [time.time_ns(), 2**62, -(2**62), 1_700_000_000_000]
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50})
    for stamp in stamps:
        producer.produce(far, b"far", timestamp=stamp)
    producer.produce(other, b"near", timestamp=1_700_000_000_000)
    assert producer.flush(DEADLINE_S) == 0

    def answered() -> list[list[Any]] | None:
        return sql_rows(server, f'SELECT isinf(ts), ts > now() FROM "{far}" ORDER BY "offset"')

    assert wait_until(answered) == [[True, True], [True, True], [True, False], [False, False]]
    near = wait_until(lambda: sql_rows(server, f'SELECT count(*) FROM "{other}"'))
    assert near == [[1]]
    # Kafka reads each record back with the timestamp it was sent with.
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": far, "auto.offset.reset": "earliest"}
    )
    try:
        consumer.assign([TopicPartition(far, 0, 0)])
        read: list[int] = []
        deadline = time.monotonic() + DEADLINE_S
        while len(read) < len(stamps) and time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is not None and message.error() is None:
                read.append(message.timestamp()[1])
        assert read == stamps
    finally:
        consumer.close()
