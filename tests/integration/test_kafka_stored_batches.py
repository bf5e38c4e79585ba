"""The Kafka record batch path against a real server (docs/kafka.md, docs/storage-format.md
"Kafka form"): a batch librdkafka produced (captured in tests/conformance/kafka/) is
fetched back byte for byte from its CRC on, for every codec, while the HTTP read API
and SQL see its records as events with keys, headers and a timestamp per record; a
read_committed Fetch answers as Kafka does: aborted batches, the commit/abort markers as
control batches and the aborted-transactions list, up to the last stable offset."""

from __future__ import annotations

import base64
import dataclasses
import json
import struct
import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import (
    TIMESTAMP_CREATE_TIME,
    TIMESTAMP_LOG_APPEND_TIME,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic
from kio.schema.fetch.v11.request import FetchPartition, FetchRequest, FetchTopic
from kio.schema.fetch.v11.response import FetchResponse, PartitionData
from kio.schema.produce.v10.request import (
    PartitionProduceData,
    ProduceRequest,
    TopicProduceData,
)
from kio.schema.produce.v10.response import ProduceResponse
from kio.schema.types import BrokerId, TopicName
from kio.static.primitive import i8, i16, i32, i64
from limits_clients import raw_socket
from servers import LOCAL, Server, serving

import headwater
from headwater.engine.engine import MAX_APPEND_EVENTS
from headwater.protocols.kafka import ApiKey, ErrorCode
from headwater.protocols.kafka.connection import Request, ServerConnection
from headwater.protocols.kafka.frames import decode_response, encode_request
from headwater.protocols.kafka.records import (
    Compression,
    ControlType,
    Record,
    build_batch,
    control_batch,
    control_type,
    split_batches,
)

VECTORS = Path(__file__).resolve().parents[1] / "conformance" / "kafka"
CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
DEADLINE_S = 30.0
# What the captured batches hold (tests/conformance/kafka_capture.py): key, value,
# headers, timestamp.
RECORDS = [
    (b"key-0", b"value-0", (("trace", b"abc"),), 1_700_000_000_000),
    (None, b"value-1 without a key", (), 1_700_000_000_001),
    (b"key-2", None, (), 1_700_000_000_002),
    (b"key-3", b"x" * 300, (("a", b"1"), ("b", None)), 1_700_000_000_010),
    (b"key-4", "unicode \u00e9\u4e2d".encode(), (), 1_700_000_000_004),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("kafka-stored"),
        listen={"kafka": LOCAL, "http": LOCAL, "kimberlite": LOCAL},
        clean_log=True,
    )


def create_topic(server: Server) -> str:
    name = "t_" + uuid.uuid4().hex[:12]
    admin = AdminClient({"bootstrap.servers": server.address_of("kafka")})
    admin.create_topics([NewTopic(name, num_partitions=1)])[name].result(timeout=DEADLINE_S)
    return name


class RawKafka:
    """One connection sending kio requests and reading their answers in order."""

    def __init__(self, server: Server) -> None:
        self.sock = raw_socket(server, "kafka")
        self.correlation = 0

    def close(self) -> None:
        self.sock.close()

    def _exact(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            assert chunk, "the server closed the connection"
            data += chunk
        return bytes(data)

    def call(self, request: Any, api_key: ApiKey, version: int) -> Any:
        self.correlation += 1
        self.sock.sendall(encode_request(self.correlation, request))
        (size,) = struct.unpack(">i", self._exact(4))
        correlation, response = decode_response(api_key, version, self._exact(size))
        assert correlation == self.correlation
        return response

    def fetch(
        self,
        topic: str,
        offset: int,
        *,
        read_committed: bool,
        max_wait: timedelta = timedelta(0),
        min_bytes: int = 0,
        partition: int = 0,
    ) -> PartitionData:
        request = FetchRequest(
            replica_id=BrokerId(-1),
            max_wait=max_wait,
            min_bytes=i32(min_bytes),
            max_bytes=i32(1 << 20),
            isolation_level=i8(1 if read_committed else 0),
            session_id=i32(0),
            session_epoch=i32(-1),
            topics=(
                FetchTopic(
                    topic=TopicName(topic),
                    partitions=(
                        FetchPartition(
                            partition=i32(partition),
                            current_leader_epoch=i32(-1),
                            fetch_offset=i64(offset),
                            log_start_offset=i64(-1),
                            partition_max_bytes=i32(1 << 20),
                        ),
                    ),
                ),
            ),
            forgotten_topics_data=(),
            rack_id="",
        )
        response = self.call(request, ApiKey.FETCH, 11)
        assert isinstance(response, FetchResponse)
        [topic_answer] = response.responses
        [partition] = topic_answer.partitions
        assert partition.error_code == 0, partition
        return partition


def produce_request(topic: str, *batches: tuple[int, bytes], acks: int = -1) -> ProduceRequest:
    """A Produce v10 of each (partition, record batch) to ``topic``."""
    return ProduceRequest(
        transactional_id=None,
        acks=i16(acks),
        timeout=timedelta(seconds=DEADLINE_S),
        topic_data=(
            TopicProduceData(
                name=TopicName(topic),
                partition_data=tuple(
                    PartitionProduceData(index=i32(partition), records=records)
                    for partition, records in batches
                ),
            ),
        ),
    )


def produced(kafka: RawKafka, request: ProduceRequest) -> list[tuple[int, int]]:
    """``request``'s answer: (error code, base offset) of each partition, in order."""
    response = kafka.call(request, ApiKey.PRODUCE, 10)
    assert isinstance(response, ProduceResponse)
    [answers] = response.responses
    return [(a.error_code, a.base_offset) for a in answers.partition_responses]


def captured_produce(codec: str, topic: str) -> tuple[ProduceRequest, bytes]:
    """librdkafka's Produce v10 of RECORDS with ``codec``, sent to ``topic`` instead,
    and the batch in it."""
    [event] = ServerConnection().receive_data(
        (VECTORS / f"librdkafka-2.16.0-produce-v10-{codec}.bin").read_bytes()
    )
    assert isinstance(event, Request) and isinstance(event.request, ProduceRequest)
    request = event.request
    [data] = request.topic_data
    assert data.partition_data[0].records is not None
    batch = bytes(data.partition_data[0].records)
    retargeted = dataclasses.replace(
        request, topic_data=(dataclasses.replace(data, name=TopicName(topic)),)
    )
    return retargeted, batch


def http(server: Server, path: str, body: Any = None) -> Any:
    request = urllib.request.Request(
        f"http://{server.address_of('http')}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=DEADLINE_S) as answer:
        return json.loads(answer.read())


@pytest.mark.parametrize("codec", CODECS)
def test_a_produced_batch_is_fetched_back_byte_for_byte(server: Server, codec: str) -> None:
    topic = create_topic(server)
    request, produced = captured_produce(codec, topic)
    kafka = RawKafka(server)
    try:
        for expected_base in (0, len(RECORDS)):  # the second lands at offset 5
            response = kafka.call(request, ApiKey.PRODUCE, 10)
            assert isinstance(response, ProduceResponse)
            [answer] = response.responses[0].partition_responses
            assert (answer.error_code, answer.base_offset) == (0, expected_base)
        fetched = kafka.fetch(topic, len(RECORDS), read_committed=False)
    finally:
        kafka.close()
    assert fetched.high_watermark == 2 * len(RECORDS)
    assert fetched.records is not None
    data = bytes(fetched.records)
    # Kafka's prefix (base offset 5, the length, leader epoch 0, magic 2), then the
    # producer's bytes from its CRC on, untouched: compressed as it came.
    assert data[17:] == produced[17:]
    assert struct.unpack_from(">qiib", data) == (len(RECORDS), len(produced) - 12, 0, 2)
    [batch] = split_batches(data)
    batch.check_crc()

    # Every other reader: the records as events, with keys, headers and each record's
    # own timestamp.
    read = http(server, f"/api/streams/{topic}/events?from={len(RECORDS)}&limit=100")
    events = read["events"]
    assert [e["offset"] for e in events] == list(range(len(RECORDS), 2 * len(RECORDS)))
    assert [e.get("key") for e in events] == [
        None if key is None else key.decode() for key, _, _, _ in RECORDS
    ]
    assert [e["timestamp_ms"] for e in events] == [ts for _, _, _, ts in RECORDS]
    assert [bool(e.get("tombstone")) for e in events] == [v is None for _, v, _, _ in RECORDS]
    assert [[(h["name"], h["value"]) for h in e.get("headers", [])] for e in events] == [
        [(name, (value or b"").decode()) for name, value in headers] for _, _, headers, _ in RECORDS
    ]
    # Kimberlite's ReadEvents: the values, one byte-cut read after another.
    with headwater.connect(server.address) as client:
        values = [e.value for e in client.scan(topic, len(RECORDS), max_bytes=64)]
    assert values == [value or b"" for _, value, _, _ in RECORDS]
    rows = http(
        server,
        "/api/sql",
        {"sql": f'SELECT "offset", epoch_ms(ts) FROM {topic} ORDER BY "offset"'},
    )["rows"]
    assert rows == [[i, RECORDS[i % len(RECORDS)][3]] for i in range(2 * len(RECORDS))]


def test_read_committed_fetch_lists_aborted_transactions_and_markers(server: Server) -> None:
    topic = create_topic(server)
    config = {
        "bootstrap.servers": server.address_of("kafka"),
        "transactional.id": "tx_" + uuid.uuid4().hex[:8],
        "compression.type": "zstd",
    }
    producer = Producer(config)
    producer.init_transactions(DEADLINE_S)
    for value, commit in ((b"committed", True), (b"aborted", False)):
        producer.begin_transaction()
        producer.produce(topic, value, key=b"k")
        producer.flush(DEADLINE_S)
        if commit:
            producer.commit_transaction(DEADLINE_S)
        else:
            producer.abort_transaction(DEADLINE_S)
    producer.begin_transaction()
    producer.produce(topic, b"open")
    producer.flush(DEADLINE_S)  # stored, its transaction still open

    kafka = RawKafka(server)
    try:
        committed = kafka.fetch(topic, 0, read_committed=True)
        uncommitted = kafka.fetch(topic, 0, read_committed=False)
        producer.commit_transaction(DEADLINE_S)
        after = kafka.fetch(topic, 0, read_committed=True)
    finally:
        kafka.close()

    # Offsets: 0 committed, 1 its commit marker, 2 aborted, 3 its abort marker, 4 open.
    assert (committed.high_watermark, committed.last_stable_offset) == (5, 4)
    batches = split_batches(bytes(committed.records or b""))
    assert [b.header.base_offset for b in batches] == [0, 1, 2, 3]
    assert [b.header.is_control for b in batches] == [False, True, False, True]
    assert [control_type(b) for b in batches if b.header.is_control] == [
        ControlType.COMMIT,
        ControlType.ABORT,
    ]
    assert [b.records().values for b in batches if not b.header.is_control] == [
        [b"committed"],
        [b"aborted"],
    ]
    producer_id = batches[0].header.producer_id
    assert [(a.producer_id, a.first_offset) for a in committed.aborted_transactions] == [
        (producer_id, 2)
    ]
    # read_uncommitted: up to the end, the open transaction's batch too, and no list.
    assert [b.header.base_offset for b in split_batches(bytes(uncommitted.records or b""))] == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert not uncommitted.aborted_transactions
    # Once committed, the last stable offset moves past its marker.
    assert (after.high_watermark, after.last_stable_offset) == (6, 6)
    assert [b.header.base_offset for b in split_batches(bytes(after.records or b""))] == [
        0,
        1,
        2,
        3,
        4,
        5,
    ]


def refused_then_stored_alone(
    server: Server, request: ProduceRequest, records: bytes, error: ErrorCode
) -> None:
    """``request`` carrying ``records`` instead of its own is answered ``error``; the
    connection serves on, and ``request`` itself is then stored at offset 0: nothing of
    the refused one was kept."""
    [data] = request.topic_data
    partition = dataclasses.replace(data.partition_data[0], records=records)
    forged = dataclasses.replace(
        request, topic_data=(dataclasses.replace(data, partition_data=(partition,)),)
    )
    kafka = RawKafka(server)
    try:
        response = kafka.call(forged, ApiKey.PRODUCE, 10)
        [answer] = response.responses[0].partition_responses
        assert answer.error_code == error
        response = kafka.call(request, ApiKey.PRODUCE, 10)
        [answer] = response.responses[0].partition_responses
        assert (answer.error_code, answer.base_offset) == (ErrorCode.none, 0)
    finally:
        kafka.close()


def test_a_produced_control_batch_is_refused_and_nothing_is_stored(server: Server) -> None:
    topic = create_topic(server)
    request, _ = captured_produce("none", topic)
    marker = control_batch(
        ControlType.COMMIT,
        producer_id=7,
        producer_epoch=0,
        coordinator_epoch=0,
        base_offset=0,
        timestamp=1_700_000_000_000,
    )
    refused_then_stored_alone(server, request, marker, ErrorCode.invalid_record)


@pytest.mark.parametrize("count", [2, MAX_APPEND_EVENTS + 1])
def test_a_transactional_batch_without_a_producer_id_is_refused_and_nothing_is_stored(
    server: Server, count: int
) -> None:
    """Whether it is stored as it came or (more records than one stored batch holds)
    decoded into several appends: a transactional batch outside a transaction is refused
    (the larger one was once stored as plain events)."""
    topic = create_topic(server)
    request, _ = captured_produce("none", topic)
    assert request.transactional_id is None
    batch = build_batch(
        [Record(i, 0, None, b"") for i in range(count)],
        base_timestamp=1_700_000_000_000,
        transactional=True,
    )
    refused_then_stored_alone(server, request, batch, ErrorCode.invalid_txn_state)


@pytest.mark.parametrize("timestamp_type", ["LogAppendTime", "CreateTime"])
def test_produce_answers_the_log_append_time_of_a_log_append_time_topic(
    server: Server, timestamp_type: str
) -> None:
    # librdkafka takes a delivered message's timestamp from the Produce answer's
    # log_append_time when it is not -1 (and says LogAppendTime); a consumer reads
    # the stamped batch. On a CreateTime topic the answer is -1: the producer's own.
    name = "t_" + uuid.uuid4().hex[:12]
    admin = AdminClient({"bootstrap.servers": server.address_of("kafka")})
    topic = NewTopic(name, num_partitions=1, config={"message.timestamp.type": timestamp_type})
    admin.create_topics([topic])[name].result(timeout=DEADLINE_S)
    producer = Producer({"bootstrap.servers": server.address_of("kafka"), "linger.ms": 0})
    delivered: list[tuple[int, int]] = []
    created_ms = 1_600_000_000_000  # far from now: tells the clock from the producer
    before_ms = int(time.time() * 1000)
    producer.produce(
        name,
        b"v",
        timestamp=created_ms,
        on_delivery=lambda err, msg: delivered.append(msg.timestamp()) if err is None else None,
    )
    assert producer.flush(DEADLINE_S) == 0
    after_ms = int(time.time() * 1000)
    [(kind, stamp_ms)] = delivered
    consumer = Consumer(
        {
            "bootstrap.servers": server.address_of("kafka"),
            "group.id": name,
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([name])
    message = consumer.poll(DEADLINE_S)
    consumer.close()
    assert message is not None and message.error() is None
    if timestamp_type == "LogAppendTime":
        assert kind == TIMESTAMP_LOG_APPEND_TIME
        assert before_ms <= stamp_ms <= after_ms
        assert message.timestamp() == (TIMESTAMP_LOG_APPEND_TIME, stamp_ms)
    else:
        assert (kind, stamp_ms) == (TIMESTAMP_CREATE_TIME, created_ms)
        assert message.timestamp() == (TIMESTAMP_CREATE_TIME, created_ms)


def test_a_consumer_reads_a_long_http_batch_converted_batch_at_a_time(server: Server) -> None:
    # A batch of headwater's form of 64 events or more (here 300 from the HTTP API:
    # keys and none, tombstone-free values of three sizes, an empty one) is converted
    # batch-at-a-time for a Fetch; librdkafka reads every record as appended, at its
    # offset, with the batch's timestamp.
    topic = create_topic(server)
    stamp_ms = 1_650_000_000_000
    records: list[tuple[bytes | None, bytes]] = [
        (None if i % 3 == 0 else b"k%d" % i, b"" if i == 7 else b"v%d-" % i * (i % 5))
        for i in range(300)
    ]
    body = {
        "records": [
            {"value_b64": base64.b64encode(value).decode(), "timestamp_ms": stamp_ms}
            | ({} if key is None else {"key_b64": base64.b64encode(key).decode()})
            for key, value in records
        ]
    }
    assert http(server, f"/api/streams/{topic}/events", body)["count"] == len(records)
    consumer = Consumer(
        {
            "bootstrap.servers": server.address_of("kafka"),
            "group.id": topic,
            "enable.partition.eof": True,
        }
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    seen: list[tuple[int, bytes | None, bytes, int]] = []
    while True:
        message = consumer.poll(DEADLINE_S)
        assert message is not None, f"no answer after {len(seen)} records"
        if message.error() is not None:
            assert message.error().code() == KafkaError._PARTITION_EOF
            break
        seen.append((message.offset(), message.key(), message.value(), message.timestamp()[1]))
    consumer.close()
    assert seen == [(i, key, value, stamp_ms) for i, (key, value) in enumerate(records)]


def test_a_consumer_reads_past_another_protocols_producer_id_beyond_int64(
    server: Server,
) -> None:
    # Kimberlite's producer ids are u64: one of 2**63 or more between two plain appends
    # made every Fetch of the partition fail (the server dropped the connection), so
    # librdkafka read nothing of the topic, not even the record before it.
    topic = create_topic(server)
    with headwater.connect(server.address_of("kimberlite")) as client:
        client.append(topic, [b"before"])
        client.append_idempotent(topic, (1 << 63) + 12_345, 0, [b"idempotent"])
        client.append(topic, [b"after"])
    consumer = Consumer(
        {
            "bootstrap.servers": server.address_of("kafka"),
            "group.id": topic,
            "enable.partition.eof": True,
        }
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    seen: list[bytes] = []
    while True:
        message = consumer.poll(DEADLINE_S)
        assert message is not None, f"no answer after {seen}"
        if message.error() is not None:
            assert message.error().code() == KafkaError._PARTITION_EOF, message.error()
            break
        seen.append(message.value())
    consumer.close()
    assert seen == [b"before", b"idempotent", b"after"]


def test_one_produce_over_partitions_answers_each_partition_for_itself(server: Server) -> None:
    """One Produce over three partitions: a damaged batch is refused on its own
    partition while the others are stored; sent again with the damage mended, the
    idempotent producer's batch is a retry, answered with its first offset and not
    stored twice, and the plain batch is stored again after the first."""
    name = "t_" + uuid.uuid4().hex[:12]
    admin = AdminClient({"bootstrap.servers": server.address_of("kafka")})
    admin.create_topics([NewTopic(name, num_partitions=3)])[name].result(timeout=DEADLINE_S)

    def batch(count: int, **options: Any) -> bytes:
        records = [Record(i, i, None, f"value-{i}".encode()) for i in range(count)]
        return build_batch(records, base_timestamp=1_700_000_000_000, **options)

    idempotent = batch(3, producer_id=4242, producer_epoch=0, base_sequence=0)
    plain = batch(2)
    sound = batch(4)
    damaged = sound[:-1] + bytes([sound[-1] ^ 0xFF])  # a value byte: the CRC no longer fits

    def produce(kafka: RawKafka, third: bytes) -> list[tuple[int, int]]:
        request = produce_request(name, (0, idempotent), (1, plain), (2, third))
        return produced(kafka, request)

    kafka = RawKafka(server)
    try:
        assert produce(kafka, damaged) == [
            (ErrorCode.none, 0),
            (ErrorCode.none, 0),
            (ErrorCode.corrupt_message, -1),
        ]
        assert produce(kafka, sound) == [
            (ErrorCode.none, 0),  # the retry: its first offset again
            (ErrorCode.none, 2),
            (ErrorCode.none, 0),  # nothing of the damaged batch was kept
        ]
        ends = [kafka.fetch(name, 0, read_committed=False, partition=p) for p in range(3)]
        assert [end.high_watermark for end in ends] == [3, 4, 4]
    finally:
        kafka.close()


@pytest.mark.parametrize("batches", [2, 0])
def test_a_partition_of_a_produce_takes_exactly_one_batch(server: Server, batches: int) -> None:
    # Kafka's rule for Produce v3 on: two batches for one partition (the first sound) or
    # none are INVALID_RECORD, and nothing of them is stored (once, the first of two was
    # stored while the answer said the request failed: a retry stored it again).
    topic = create_topic(server)
    request, produced = captured_produce("none", topic)
    refused_then_stored_alone(server, request, produced * batches, ErrorCode.invalid_record)


def test_pipelined_produces_are_stored_in_the_order_they_were_sent(server: Server) -> None:
    # A Java-style producer pipelines requests on one connection: request A to
    # partitions 0 and 1, then B to partition 0 alone, twenty times over, before reading
    # an answer. Partition 0 holds them in the order sent (A's appends of several
    # partitions once went through tasks, and B's lone append overtook them).
    name = "t_" + uuid.uuid4().hex[:12]
    admin = AdminClient({"bootstrap.servers": server.address_of("kafka")})
    admin.create_topics([NewTopic(name, num_partitions=2)])[name].result(timeout=DEADLINE_S)

    def produce(*parts: tuple[int, bytes]) -> ProduceRequest:
        batches = [(p, build_batch([Record(0, 0, None, v)], base_timestamp=1)) for p, v in parts]
        return produce_request(name, *batches, acks=1)

    sent: list[bytes] = []
    wire = bytearray()
    kafka = RawKafka(server)
    try:
        for n in range(20):
            for request, value in (
                (produce((0, b"A%d" % n), (1, b"a%d" % n)), b"A%d" % n),
                (produce((0, b"B%d" % n)), b"B%d" % n),
            ):
                kafka.correlation += 1
                wire += encode_request(kafka.correlation, request)
                sent.append(value)
        kafka.sock.sendall(wire)
        for correlation in range(1, kafka.correlation + 1):
            (size,) = struct.unpack(">i", kafka._exact(4))
            answered, response = decode_response(ApiKey.PRODUCE, 10, kafka._exact(size))
            assert answered == correlation
            assert all(a.error_code == 0 for a in response.responses[0].partition_responses)
        fetched = kafka.fetch(name, 0, read_committed=False)
    finally:
        kafka.close()
    stored = [
        value for batch in split_batches(fetched.records or b"") for value in batch.records().values
    ]
    assert stored == sent


def test_an_idempotent_producers_sequence_wraps_past_int32_as_kafkas_does(
    server: Server,
) -> None:
    # Kafka's sequence is an int32 its producer wraps to 0 after 2**31 - 1: the batch
    # after the limit was refused for good (OUT_OF_ORDER_SEQUENCE_NUMBER, "older than
    # the last 64 remembered"), so a producer that had sent 2**31 records to a partition
    # could write no more. A retry from before the wrap is still answered as stored.
    topic = create_topic(server)
    producer = {"producer_id": 424_242, "producer_epoch": 0}

    def batch(sequence: int, *values: bytes) -> bytes:
        records = [Record(i, 0, None, value) for i, value in enumerate(values)]
        return build_batch(
            records, base_timestamp=1_700_000_000_000, base_sequence=sequence, **producer
        )

    def produce(records: bytes) -> tuple[int, int]:
        [answer] = produced(kafka, produce_request(topic, (0, records)))
        return answer

    last_before_the_wrap = batch((1 << 31) - 2, b"a", b"b")  # sequences 2**31 - 2, - 1
    kafka = RawKafka(server)
    try:
        assert produce(last_before_the_wrap) == (ErrorCode.none, 0)
        assert produce(batch(0, b"c")) == (ErrorCode.none, 2)
        assert produce(batch(1, b"d", b"e")) == (ErrorCode.none, 3)
        assert produce(last_before_the_wrap) == (ErrorCode.none, 0)  # a retry: stored once
        assert produce(batch(5, b"gap")) == (ErrorCode.out_of_order_sequence_number, -1)
        fetched = kafka.fetch(topic, 0, read_committed=False)
    finally:
        kafka.close()
    stored = [v for b in split_batches(fetched.records or b"") for v in b.records().values]
    assert stored == [b"a", b"b", b"c", b"d", b"e"]


def test_refusals_carry_kafkas_codes_and_store_nothing(server: Server) -> None:
    # Each as Kafka answers it, nothing of it stored: acks other than -1/0/1; a record
    # without a key on a compacted topic; a batch larger than the topic's segments.
    # And the groups' two: DeleteGroups of a group never seen; an OffsetCommit naming a
    # missing topic beside a real one commits the real one.
    admin = AdminClient({"bootstrap.servers": server.address_of("kafka")})
    topics = {
        "acks": {},
        "compact": {"cleanup.policy": "compact"},
        "segment": {"segment.bytes": "1024"},
    }
    names = {kind: "t_" + uuid.uuid4().hex[:12] for kind in topics}
    made = admin.create_topics([NewTopic(names[k], 1, config=c) for k, c in topics.items()])
    for future in made.values():
        future.result(timeout=DEADLINE_S)

    def produce(kind: str, records: bytes, acks: int = -1) -> tuple[int, int]:
        [answer] = produced(kafka, produce_request(names[kind], (0, records), acks=acks))
        return answer

    def one(key: bytes | None, value: bytes = b"v") -> bytes:
        return build_batch([Record(0, 0, key, value)], base_timestamp=1_700_000_000_000)

    kafka = RawKafka(server)
    try:
        assert produce("acks", one(None), acks=5) == (ErrorCode.invalid_required_acks, -1)
        assert produce("compact", one(None)) == (ErrorCode.invalid_record, -1)
        assert produce("segment", one(None, b"x" * 2000)) == (ErrorCode.record_list_too_large, -1)
        # Each topic then takes what it should, at offset 0: nothing was kept before.
        assert produce("acks", one(None)) == (ErrorCode.none, 0)
        assert produce("compact", one(b"k")) == (ErrorCode.none, 0)
        assert produce("segment", one(None)) == (ErrorCode.none, 0)
    finally:
        kafka.close()

    never = "never_" + uuid.uuid4().hex[:8]
    with pytest.raises(KafkaException) as refused:
        admin.delete_consumer_groups([never])[never].result(timeout=DEADLINE_S)
    assert refused.value.args[0].code() == KafkaError.GROUP_ID_NOT_FOUND
    consumer = Consumer({"bootstrap.servers": server.address_of("kafka"), "group.id": never})
    try:
        real, missing = TopicPartition(names["acks"], 0, 1), TopicPartition("t_missing", 0, 1)
        with pytest.raises(KafkaException):
            consumer.commit(offsets=[real, missing], asynchronous=False)
        [committed] = consumer.committed([TopicPartition(names["acks"], 0)], timeout=DEADLINE_S)
        assert committed.offset == 1
    finally:
        consumer.close()


def test_a_batch_of_tens_of_thousands_of_records_is_stored_whole(server: Server) -> None:
    # Over the 10,000 events of one append, a produced batch is still stored as it
    # came (it was cut into parts that another append could land between, and an
    # idempotent producer's next batch was then out of order): a retry is stored once,
    # the next batch follows on, every view reads it; past 65,536 records it is
    # refused whole (RECORD_LIST_TOO_LARGE), nothing stored.
    topic = create_topic(server)
    producer = {"producer_id": 515_151, "producer_epoch": 0}

    def batch(sequence: int, values: list[bytes], codec: Compression = Compression.NONE) -> bytes:
        records = [Record(i, i, b"k", value) for i, value in enumerate(values)]
        return build_batch(
            records,
            base_timestamp=1_700_000_000_000,
            base_sequence=sequence,
            compression=codec,
            **producer,
        )

    big = batch(0, [b"v%d" % i for i in range(40_000)])
    kafka = RawKafka(server)
    try:
        [first] = produced(kafka, produce_request(topic, (0, big)))
        [retry] = produced(kafka, produce_request(topic, (0, big)))
        [after] = produced(kafka, produce_request(topic, (0, batch(40_000, [b"next"]))))
        too_many = batch(40_001, [b"x"] * 65_537, Compression.ZSTD)  # within max.message.bytes
        [refused] = produced(kafka, produce_request(topic, (0, too_many)))
        fetched = kafka.fetch(topic, 0, read_committed=False)
    finally:
        kafka.close()
    assert first == retry == (ErrorCode.none, 0)
    assert after == (ErrorCode.none, 40_000)
    assert refused == (ErrorCode.record_list_too_large, -1)
    [stored] = split_batches(fetched.records or b"")[:1]
    assert stored.header.records_count == 40_000  # the batch as it came
    # The other views: HTTP pages cut inside it, SQL, the SDK's scan over Kimberlite.
    page = http(server, f"/api/streams/{topic}/events?from=39990&limit=100")
    assert [e["offset"] for e in page["events"]] == list(range(39_990, 40_001))
    counted = http(server, "/api/sql", {"sql": f'SELECT count(*), max("offset") FROM {topic}'})
    assert counted["rows"] == [[40_001, 40_000]]
    with headwater.connect(server.address) as hw:  # type: ignore[attr-defined]
        values = [e.value for e in hw.scan(topic, 0)]
    assert values == [b"v%d" % i for i in range(40_000)] + [b"next"]


def test_a_retried_batch_of_a_log_append_time_topic_is_answered_its_stamp(
    server: Server,
) -> None:
    # A retry (stored once) was answered log_append_time 0: 1970 to the producer.
    name = "t_" + uuid.uuid4().hex[:12]
    admin = AdminClient({"bootstrap.servers": server.address_of("kafka")})
    topic = NewTopic(name, num_partitions=1, config={"message.timestamp.type": "LogAppendTime"})
    admin.create_topics([topic])[name].result(timeout=DEADLINE_S)
    records = [Record(0, 0, b"k", b"v")]
    batch = build_batch(
        records,
        base_timestamp=1_600_000_000_000,
        producer_id=616_161,
        producer_epoch=0,
        base_sequence=0,
    )
    kafka = RawKafka(server)
    try:
        answers = [kafka.call(produce_request(name, (0, batch)), ApiKey.PRODUCE, 10) for _ in "ab"]
    finally:
        kafka.close()
    stamps = []
    for answer in answers:
        [partition] = answer.responses[0].partition_responses
        assert (partition.error_code, partition.base_offset) == (ErrorCode.none, 0)
        stamps.append(partition.log_append_time)
    assert stamps[0] == stamps[1] and stamps[0].year >= 2026, stamps
