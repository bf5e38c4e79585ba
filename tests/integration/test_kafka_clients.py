"""The kafka listener against a real server, with real Kafka clients as the oracle:
confluent-kafka (librdkafka), aiokafka and Debian's kcat (librdkafka 2.0.2), unchanged
(docs/kafka.md).

One server (no auth) serves most tests, each on topics of its own; restart, SASL and
limits tests start their own.
"""

from __future__ import annotations

import asyncio
import shutil
import struct
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from confluent_kafka import (
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic
from limits_clients import counted, raw_socket, read_to_end, refusals
from servers import LOCAL, Server, serving

from headwater.engine.partitioner import keyed_partition
from waiting import wait_until

PARTITIONS = 3
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(tmp_path_factory.mktemp("kafka"), listen={"kafka": LOCAL}, clean_log=True)


def bootstrap(server: Server) -> str:
    return server.address_of("kafka")


def topic_name() -> str:
    return "t_" + uuid.uuid4().hex[:12]  # stream names are [A-Za-z0-9_]


def create_topic(server: Server, partitions: int = PARTITIONS) -> str:
    name = topic_name()
    admin = AdminClient({"bootstrap.servers": bootstrap(server)})
    futures = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    futures[name].result(timeout=DEADLINE_S)
    return name


def produce(
    server: Server, topic: str, messages: list[dict[str, Any]], **config: Any
) -> list[Message]:
    """Produce and flush; the delivery reports, every one checked for errors."""
    producer = Producer({"bootstrap.servers": bootstrap(server), "linger.ms": 5, **config})
    delivered: list[Message] = []
    errors: list[KafkaError] = []

    def report(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            errors.append(err)
        else:
            delivered.append(msg)

    for message in messages:
        producer.produce(topic, on_delivery=report, **message)
    assert producer.flush(DEADLINE_S) == 0, "messages still in flight"
    assert not errors, errors
    return delivered


def consume(
    server: Server,
    topic: str,
    count: int,
    *,
    partitions: int = PARTITIONS,
    **config: Any,
) -> list[Message]:
    """``count`` messages read from offset 0 of every partition (assigned, no group)."""
    consumer = Consumer({"bootstrap.servers": bootstrap(server), "group.id": "reader", **config})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    got: list[Message] = []
    deadline = time.monotonic() + DEADLINE_S
    try:
        while len(got) < count and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                continue
            assert message.error() is None, message.error()
            got.append(message)
    finally:
        consumer.close()
    assert len(got) == count, f"read {len(got)} of {count}"
    return got


# ---- produce and fetch ---------------------------------------------------------------


def test_keyed_messages_land_on_kafkas_partition_and_read_back(server: Server) -> None:
    topic = create_topic(server)
    messages = [
        {"key": f"key-{i}".encode(), "value": f"value-{i}".encode(), "headers": [("h", b"%d" % i)]}
        for i in range(60)
    ]
    # murmur2_random: Kafka's Java partitioner (librdkafka's default is CRC32).
    delivered = produce(server, topic, messages, partitioner="murmur2_random")
    for msg in delivered:
        assert msg.partition() == keyed_partition(msg.key(), PARTITIONS)
    got = consume(server, topic, len(messages))
    by_key = {m.key(): m for m in got}
    for i in range(60):
        message = by_key[f"key-{i}".encode()]
        assert message.value() == f"value-{i}".encode()
        assert message.headers() == [("h", b"%d" % i)]
        assert message.partition() == keyed_partition(message.key(), PARTITIONS)
    # Offsets within each partition are 0, 1, 2, ... in produce order.
    for p in range(PARTITIONS):
        offsets = [m.offset() for m in got if m.partition() == p]
        assert sorted(offsets) == list(range(len(offsets)))


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_every_compression_codec(server: Server, codec: str) -> None:
    topic = create_topic(server, partitions=1)
    values = [f"{codec}-{i}-".encode() * 20 for i in range(200)]
    produce(server, topic, [{"value": v} for v in values], **{"compression.type": codec})
    got = consume(server, topic, len(values), partitions=1)
    assert [m.value() for m in got] == values


@pytest.mark.parametrize("producer_kind", ["plain", "idempotent", "transactional"])
def test_a_batch_of_more_records_than_one_append_takes(server: Server, producer_kind: str) -> None:
    # 15,000 records in one batch: over the engine's 10,000 per append, within
    # max.message.bytes; stored whole, as it came. An idempotent or transactional
    # producer's was refused (INVALID_REQUEST: Java's producers are idempotent by
    # default), and the plain one's was decoded: its null header values came back b"".
    topic = create_topic(server, partitions=1)
    now = int(time.time() * 1000)
    records = [
        {
            "value": b"%d" % i,
            "key": b"k%d" % (i % 7),
            "headers": [("null", None), ("n", b"%d" % i)],
            "timestamp": now - 15_000 + i,
            "partition": 0,
        }
        for i in range(15_000)
    ]
    config: dict[str, Any] = {
        "batch.num.messages": 20_000,
        "batch.size": 1_000_000,
        "linger.ms": 500,
        "compression.type": "zstd",
    }
    if producer_kind == "transactional":
        producer = Producer(
            {"bootstrap.servers": bootstrap(server), "transactional.id": topic, **config}
        )
        producer.init_transactions(DEADLINE_S)
        producer.begin_transaction()
        for record in records:
            producer.produce(topic, **record)
        producer.commit_transaction(DEADLINE_S)
    else:
        if producer_kind == "idempotent":
            config["enable.idempotence"] = True
        delivered = produce(server, topic, records, **config)
        assert sorted(m.offset() for m in delivered) == list(range(len(records)))
    got = consume(
        server, topic, len(records), partitions=1, **{"isolation.level": "read_committed"}
    )
    assert [(m.key(), m.value(), m.headers(), m.timestamp()[1]) for m in got] == [
        (r["key"], r["value"], r["headers"], r["timestamp"]) for r in records
    ]


def test_idempotent_producer_stores_each_message_once(server: Server) -> None:
    topic = create_topic(server, partitions=1)
    values = [b"idem-%d" % i for i in range(500)]
    delivered = produce(
        server,
        topic,
        [{"value": v} for v in values],
        **{"enable.idempotence": True, "acks": "all", "max.in.flight": 5},
    )
    assert sorted(m.offset() for m in delivered) == list(range(len(values)))
    got = consume(server, topic, len(values), partitions=1)
    assert [m.value() for m in got] == values


def test_an_idempotent_producer_lives_on_through_its_topic_made_again(server: Server) -> None:
    # A topic deleted and made again under a live idempotent producer: the partition has
    # never heard of it, so (as in Kafka) its next sequence is taken, not refused
    # OUT_OF_ORDER_SEQUENCE_NUMBER, which librdkafka raises as fatal.
    topic = create_topic(server, partitions=1)
    producer = Producer(
        {"bootstrap.servers": bootstrap(server), "enable.idempotence": True, "linger.ms": 0}
    )
    errors: list[KafkaError] = []

    def report(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            errors.append(err)

    for i in range(5):
        producer.produce(topic, b"a%d" % i, on_delivery=report)
    assert producer.flush(DEADLINE_S) == 0
    admin = AdminClient({"bootstrap.servers": bootstrap(server)})
    admin.delete_topics([topic])[topic].result(timeout=DEADLINE_S)
    admin.create_topics([NewTopic(topic, num_partitions=1)])[topic].result(timeout=DEADLINE_S)
    for value in (b"b0", b"b1"):
        producer.produce(topic, value, on_delivery=report)
    assert producer.flush(DEADLINE_S) == 0
    assert not errors, errors
    assert [m.value() for m in consume(server, topic, 2, partitions=1)] == [b"b0", b"b1"]


def test_offsets_for_times_and_watermarks(server: Server) -> None:
    topic = create_topic(server, partitions=1)
    produce(server, topic, [{"value": b"early-%d" % i, "timestamp": 1_000 + i} for i in range(5)])
    produce(server, topic, [{"value": b"late-%d" % i, "timestamp": 9_000 + i} for i in range(5)])
    consumer = Consumer({"bootstrap.servers": bootstrap(server), "group.id": "times"})
    try:
        (found,) = consumer.offsets_for_times([TopicPartition(topic, 0, 5_000)], timeout=15)
        assert found.offset == 5
        (beyond,) = consumer.offsets_for_times([TopicPartition(topic, 0, 99_999)], timeout=15)
        assert beyond.offset == -1  # Kafka: no such record
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=15)
        assert (low, high) == (0, 10)
    finally:
        consumer.close()
    got = consume(server, topic, 10, partitions=1)
    assert [m.timestamp()[1] for m in got] == [1_000 + i for i in range(5)] + [
        9_000 + i for i in range(5)
    ]


def test_oversize_message_is_refused_and_the_server_serves_on(server: Server) -> None:
    topic = create_topic(server, partitions=1)
    producer = Producer(
        {
            "bootstrap.servers": bootstrap(server),
            "message.max.bytes": 4_000_000,  # let the client send it: the broker decides
            "compression.type": "none",
        }
    )
    results: list[KafkaError | None] = []
    producer.produce(topic, b"x" * 2_000_000, on_delivery=lambda err, msg: results.append(err))
    producer.flush(DEADLINE_S)
    assert len(results) == 1 and results[0] is not None
    assert results[0].code() == KafkaError.MSG_SIZE_TOO_LARGE
    # Nothing was stored, and another client is served.
    produce(server, topic, [{"value": b"small"}])
    assert [m.value() for m in consume(server, topic, 1, partitions=1)] == [b"small"]


def test_fetch_long_polls_until_a_message_arrives(server: Server) -> None:
    topic = create_topic(server, partitions=1)
    consumer = Consumer(
        {"bootstrap.servers": bootstrap(server), "group.id": "poll", "fetch.wait.max.ms": 10_000}
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    try:
        assert consumer.poll(1.0) is None  # the fetch is parked on the server
        started = time.monotonic()
        produce(server, topic, [{"value": b"wake"}])
        message = None
        while message is None and time.monotonic() - started < DEADLINE_S:
            message = consumer.poll(0.5)
        assert message is not None and message.value() == b"wake"
        # Woken by the append, not by fetch.wait.max.ms (10 s).
        assert time.monotonic() - started < 8.0
    finally:
        consumer.close()


# ---- groups ---------------------------------------------------------------------------


def group_consumer(server: Server, group: str, **config: Any) -> Consumer:
    return Consumer(
        {
            "bootstrap.servers": bootstrap(server),
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "session.timeout.ms": 6_000,
            "heartbeat.interval.ms": 300,
            **config,
        }
    )


def poll_until(consumers: list[Consumer], done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for consumer in consumers:
            message = consumer.poll(0.05)
            assert message is None or message.error() is None, message.error()


def test_a_group_of_three_rebalances_when_one_leaves(server: Server) -> None:
    topic = create_topic(server)
    group = "g_" + uuid.uuid4().hex[:8]
    consumers = [group_consumer(server, group) for _ in range(3)]
    for consumer in consumers:
        consumer.subscribe([topic])

    def owned(members: list[Consumer]) -> list[set[int]]:
        return [{tp.partition for tp in c.assignment()} for c in members]

    try:
        poll_until(consumers, lambda: all(len(o) == 1 for o in owned(consumers)), "3 x 1")
        assert set().union(*owned(consumers)) == set(range(PARTITIONS))
        consumers.pop().close()  # LeaveGroup
        poll_until(
            consumers,
            lambda: (
                sorted(len(o) for o in owned(consumers)) == [1, 2]
                and set().union(*owned(consumers)) == set(range(PARTITIONS))
            ),
            "the partitions of the member that left to move to the others",
        )
    finally:
        for consumer in consumers:
            consumer.close()


def test_committed_offsets_resume_after_a_restart(make_server: Callable[..., Server]) -> None:
    server = make_server(listen={"kafka": LOCAL})
    topic = create_topic(server, partitions=1)
    produce(server, topic, [{"value": b"m%d" % i} for i in range(10)])
    group = "resume"
    first = group_consumer(server, group)
    first.subscribe([topic])
    got: list[Message] = []
    poll_until_messages(first, got, 4)
    first.commit(message=got[3], asynchronous=False)  # commits offset 4
    first.close()

    server.stop()
    server.start()
    second = group_consumer(server, group)
    second.subscribe([topic])
    rest: list[Message] = []
    try:
        poll_until_messages(second, rest, 6)
    finally:
        second.close()
    assert [m.value() for m in rest] == [b"m%d" % i for i in range(4, 10)]


def test_a_deleted_topics_offsets_go_with_it(make_server: Callable[..., Server]) -> None:
    # As Kafka: a group's committed offsets of a deleted topic are deleted with it, so a
    # topic made again under its name is consumed from its start (they once survived,
    # and the group skipped the new topic's first records); another topic's stay, and
    # after a restart too.
    server = make_server(listen={"kafka": LOCAL})
    topic, other = create_topic(server, partitions=1), create_topic(server, partitions=1)
    for name in (topic, other):
        produce(server, name, [{"value": b"old-%d" % i} for i in range(10)])
    group = "deleted_" + uuid.uuid4().hex[:8]
    committer = group_consumer(server, group)
    committer.commit(
        offsets=[TopicPartition(topic, 0, 7), TopicPartition(other, 0, 5)], asynchronous=False
    )
    committer.close()
    admin = AdminClient({"bootstrap.servers": bootstrap(server)})
    admin.delete_topics([topic])[topic].result(timeout=DEADLINE_S)
    admin.create_topics([NewTopic(topic, num_partitions=1)])[topic].result(timeout=DEADLINE_S)
    produce(server, topic, [{"value": b"new-%d" % i} for i in range(10)])

    server.stop()
    server.start()
    reader = group_consumer(server, group)
    try:
        committed = reader.committed(
            [TopicPartition(topic, 0), TopicPartition(other, 0)], timeout=DEADLINE_S
        )
        assert [tp.offset for tp in committed] == [OFFSET_INVALID, 5]
        reader.subscribe([topic])
        got: list[Message] = []
        poll_until_messages(reader, got, 10)
    finally:
        reader.close()
    assert [m.value() for m in got] == [b"new-%d" % i for i in range(10)]


def test_offsets_a_transaction_staged_for_a_deleted_topic_go_with_it(server: Server) -> None:
    # send_offsets_to_transaction stages a group's offsets until the commit: a topic
    # deleted meanwhile loses them too (as Kafka drops its pending offsets). They once
    # landed on the topic made again under the name, whose first records the group
    # then skipped.
    topic, out = create_topic(server, partitions=1), create_topic(server, partitions=1)
    produce(server, topic, [{"value": b"old-%d" % i} for i in range(10)])
    consumer = group_consumer(server, "staged_" + uuid.uuid4().hex[:8])
    producer = Producer(
        {"bootstrap.servers": bootstrap(server), "transactional.id": uuid.uuid4().hex}
    )
    try:
        producer.init_transactions(DEADLINE_S)
        producer.begin_transaction()
        producer.produce(out, b"transformed")
        producer.send_offsets_to_transaction(
            [TopicPartition(topic, 0, 7)], consumer.consumer_group_metadata(), DEADLINE_S
        )
        admin = AdminClient({"bootstrap.servers": bootstrap(server)})
        admin.delete_topics([topic])[topic].result(timeout=DEADLINE_S)
        admin.create_topics([NewTopic(topic, num_partitions=1)])[topic].result(timeout=DEADLINE_S)
        produce(server, topic, [{"value": b"new-%d" % i} for i in range(10)])
        producer.commit_transaction(DEADLINE_S)
        committed = consumer.committed([TopicPartition(topic, 0)], timeout=DEADLINE_S)
        assert [tp.offset for tp in committed] == [OFFSET_INVALID]
        consumer.subscribe([topic])
        got: list[Message] = []
        poll_until_messages(consumer, got, 10)
    finally:
        consumer.close()
    assert [m.value() for m in got] == [b"new-%d" % i for i in range(10)]


def poll_until_messages(consumer: Consumer, into: list[Message], count: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while len(into) < count:
        assert time.monotonic() < deadline, f"read {len(into)} of {count}"
        message = consumer.poll(0.5)
        if message is not None:
            assert message.error() is None, message.error()
            into.append(message)


# ---- transactions ---------------------------------------------------------------------


def test_transactions_commit_abort_and_fencing(server: Server) -> None:
    topic = create_topic(server, partitions=1)
    transactional_id = "tx_" + uuid.uuid4().hex[:8]
    config = {"bootstrap.servers": bootstrap(server), "transactional.id": transactional_id}
    producer = Producer(config)
    producer.init_transactions(DEADLINE_S)
    producer.begin_transaction()
    producer.produce(topic, b"committed-1")
    producer.commit_transaction(DEADLINE_S)
    producer.begin_transaction()
    producer.produce(topic, b"aborted")
    producer.flush(DEADLINE_S)
    producer.abort_transaction(DEADLINE_S)
    producer.begin_transaction()
    producer.produce(topic, b"committed-2")
    producer.commit_transaction(DEADLINE_S)

    # A second instance with the same transactional.id fences the first.
    successor = Producer(config)
    successor.init_transactions(DEADLINE_S)
    with pytest.raises(KafkaException) as fenced:
        producer.begin_transaction()
        producer.produce(topic, b"zombie")
        producer.commit_transaction(DEADLINE_S)
    assert fenced.value.args[0].fatal()
    assert fenced.value.args[0].code() == KafkaError._FENCED
    successor.begin_transaction()
    successor.produce(topic, b"committed-3")
    successor.commit_transaction(DEADLINE_S)

    committed = consume(server, topic, 3, partitions=1, **{"isolation.level": "read_committed"})
    assert [m.value() for m in committed] == [b"committed-1", b"committed-2", b"committed-3"]
    everything = consume(server, topic, 4, partitions=1, **{"isolation.level": "read_uncommitted"})
    assert [m.value() for m in everything] == [
        b"committed-1",
        b"aborted",
        b"committed-2",
        b"committed-3",
    ]


# ---- other clients --------------------------------------------------------------------


def test_read_committed_finds_no_offset_by_time_inside_an_open_transaction(
    server: Server,
) -> None:
    # As Kafka: a timestamp lookup stops at what the isolation level may fetch, so
    # read_committed does not find a record of a transaction still open (it once
    # answered its offset, past the last stable offset).
    topic = create_topic(server, partitions=1)
    produce(server, topic, [{"value": b"committed", "timestamp": 1_000}])
    txn = Producer({"bootstrap.servers": bootstrap(server), "transactional.id": topic})
    txn.init_transactions(DEADLINE_S)
    txn.begin_transaction()
    txn.produce(topic, b"open", timestamp=5_000)
    assert txn.flush(DEADLINE_S) == 0
    found = {}
    for isolation in ("read_committed", "read_uncommitted"):
        consumer = Consumer(
            {
                "bootstrap.servers": bootstrap(server),
                "group.id": topic,
                "isolation.level": isolation,
            }
        )
        try:
            wanted = [TopicPartition(topic, 0, 5_000), TopicPartition(topic, 0, 1_000)]
            found[isolation] = [
                tp.offset
                for tp in consumer.offsets_for_times(wanted[:1], timeout=DEADLINE_S)
                + consumer.offsets_for_times(wanted[1:], timeout=DEADLINE_S)
            ]
        finally:
            consumer.close()
    txn.abort_transaction(DEADLINE_S)
    assert found == {"read_committed": [-1, 0], "read_uncommitted": [1, 0]}


def test_aiokafka_produces_and_consumes(server: Server) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka import TopicPartition as AioPartition

    topic = create_topic(server, partitions=1)

    async def run() -> list[bytes]:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap(server), compression_type="gzip")
        await producer.start()
        try:
            for i in range(20):
                await producer.send_and_wait(topic, b"aio-%d" % i, key=b"k")
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap(server))
        await consumer.start()
        try:
            partition = AioPartition(topic, 0)
            consumer.assign([partition])
            consumer.seek(partition, 0)
            values: list[bytes] = []
            async with asyncio.timeout(DEADLINE_S):
                while len(values) < 20:
                    batch = await consumer.getmany(timeout_ms=1000)
                    values += [r.value for records in batch.values() for r in records]
            return values
        finally:
            await consumer.stop()

    assert asyncio.run(run()) == [b"aio-%d" % i for i in range(20)]


def test_aiokafka_idempotent_transactional_and_group(server: Server) -> None:
    # aiokafka speaks the oldest versions: JoinGroup v2, OffsetCommit v2, the v0
    # transaction APIs.
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka import TopicPartition as AioPartition

    topic = create_topic(server, partitions=2)

    async def run() -> tuple[list[bytes], int | None]:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap(server), enable_idempotence=True)
        await producer.start()
        try:
            for i in range(6):
                await producer.send_and_wait(topic, b"idem-%d" % i, partition=i % 2)
        finally:
            await producer.stop()
        transactional = AIOKafkaProducer(
            bootstrap_servers=bootstrap(server), transactional_id="aio_" + uuid.uuid4().hex[:8]
        )
        await transactional.start()
        try:
            async with transactional.transaction():
                await transactional.send(topic, b"committed", partition=0)
            await transactional.begin_transaction()
            await transactional.send(topic, b"aborted", partition=0)
            await transactional.abort_transaction()
        finally:
            await transactional.stop()
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=bootstrap(server),
            group_id="aio_" + uuid.uuid4().hex[:8],
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            isolation_level="read_committed",
        )
        await consumer.start()
        try:
            values: list[bytes] = []
            async with asyncio.timeout(DEADLINE_S):
                while len(values) < 7:
                    batch = await consumer.getmany(timeout_ms=1000)
                    values += [r.value for records in batch.values() for r in records]
            await consumer.commit()
            return sorted(values), await consumer.committed(AioPartition(topic, 1))
        finally:
            await consumer.stop()

    values, committed = asyncio.run(run())
    assert values == sorted([b"idem-%d" % i for i in range(6)] + [b"committed"])
    assert committed == 3  # partition 1 holds idem-1, -3, -5


KCAT = shutil.which("kcat")


def kcat(*args: str, stdin: bytes = b"") -> str:
    assert KCAT is not None, "kcat is not installed (make system-deps)"
    done = subprocess.run(
        [KCAT, *args], input=stdin, capture_output=True, timeout=DEADLINE_S, check=False
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


def test_kcat_lists_produces_and_consumes(server: Server) -> None:
    topic = create_topic(server)
    broker = bootstrap(server)
    listing = kcat("-b", broker, "-L")
    assert f'topic "{topic}" with {PARTITIONS} partitions' in listing
    lines = [f"line-{i}" for i in range(10)]
    kcat(
        "-b", broker, "-P", "-t", topic, "-p", "1", "-z", "snappy", stdin="\n".join(lines).encode()
    )
    out = kcat("-b", broker, "-C", "-t", topic, "-p", "1", "-o", "beginning", "-e", "-q")
    assert out.split() == lines


# ---- SASL -----------------------------------------------------------------------------

TOKEN = "s3cret"
ORPHAN_TOKEN = "orphan"  # grants only a tenant the server does not have
AUTH_CONFIG = f"""
[auth]
required = true
[[auth.tokens]]
token = "{TOKEN}"
tenants = [0]
[[auth.tokens]]
token = "{ORPHAN_TOKEN}"
tenants = [9]
"""


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("kafka-auth"), config=AUTH_CONFIG, listen={"kafka": LOCAL}
    )


SASL = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN", "sasl.username": "u"}


def test_sasl_plain_wrong_password_is_an_authentication_error(auth_server: Server) -> None:
    errors: list[KafkaError] = []
    wrong = Producer(
        {
            "bootstrap.servers": bootstrap(auth_server),
            **SASL,
            "sasl.password": "wrong",
            "error_cb": errors.append,
        }
    )

    def refused() -> bool:
        wrong.poll(0.1)
        return any(e.code() == KafkaError._AUTHENTICATION for e in errors)

    wait_until(refused, DEADLINE_S, "no authentication error")
    # The right token is served after the refused client, for tenant 0.
    topic = topic_name()
    produce(auth_server, topic, [{"value": b"authed"}], **SASL, **{"sasl.password": TOKEN})
    got = consume(auth_server, topic, 1, partitions=1, **SASL, **{"sasl.password": TOKEN})
    assert got[0].value() == b"authed"


def test_a_token_of_a_tenant_the_server_lacks_is_refused_at_authentication(
    auth_server: Server,
) -> None:
    # It authenticated, then every request failed and the connection dropped:
    # librdkafka said only "Broker transport failure". Now SASL refuses it, saying why.
    errors: list[KafkaError] = []
    orphan = Producer(
        {
            "bootstrap.servers": bootstrap(auth_server),
            **SASL,
            "sasl.password": ORPHAN_TOKEN,
            "error_cb": errors.append,
        }
    )

    def refused() -> bool:
        orphan.poll(0.1)
        return any(e.code() == KafkaError._AUTHENTICATION for e in errors)

    wait_until(refused, DEADLINE_S, f"no authentication error: {errors}")
    assert any("tenant 9 does not exist" in e.str() for e in errors), errors


def test_without_sasl_an_auth_server_serves_nothing(auth_server: Server) -> None:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap(auth_server), "group.id": "anon", "error_cb": print}
    )
    try:
        with pytest.raises(KafkaException):
            consumer.list_topics(timeout=2)
    finally:
        consumer.close()


# ---- [limits] -------------------------------------------------------------------------

MAX_CONNECTIONS = 8  # a librdkafka client opens up to 3 (bootstrap, broker, coordinator)
ADMIN_TOKEN = "operator"
LIMITS_CONFIG = f"""{AUTH_CONFIG}
[[auth.tokens]]
token = "{ADMIN_TOKEN}"
tenants = [0]
admin = true
[limits]
max_connections = {MAX_CONNECTIONS}
handshake_timeout_s = 1.0
max_pending_bytes = 4096
"""


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("kafka-limits"),
        config=LIMITS_CONFIG,
        listen={"kafka": LOCAL, "http": LOCAL},
    )


def authed_topics(server: Server) -> list[str]:
    """A SASL client's view of the topics: proof the listener serves."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap(server), "group.id": "ok", **SASL, "sasl.password": TOKEN}
    )
    try:
        return list(consumer.list_topics(timeout=DEADLINE_S).topics)
    finally:
        consumer.close()


def test_max_connections_closes_the_one_past_it(limited: Server) -> None:
    before = refusals(limited, ADMIN_TOKEN)
    held = [raw_socket(limited, "kafka") for _ in range(MAX_CONNECTIONS)]
    try:
        # Admitted connections are quiet; one more is closed at once (Kafka has no
        # frame to say why: the client sees the close and retries).
        extra = raw_socket(limited, "kafka")
        assert read_to_end(extra) == b""
        extra.close()
    finally:
        for sock in held:
            sock.close()
    # Served again once the held connections are gone (the server sees them close).
    wait_until(lambda: served_again(limited), DEADLINE_S, "not served again")
    assert counted(limited, before, "max_connections", "kafka", ADMIN_TOKEN) == 1


def served_again(server: Server) -> bool:
    try:
        return bool(authed_topics(server) is not None)
    except KafkaException:  # still full: the client was refused too
        return False


def test_handshake_timeout_closes_a_client_that_never_authenticates(limited: Server) -> None:
    before = refusals(limited, ADMIN_TOKEN)
    sock = raw_socket(limited, "kafka")
    assert read_to_end(sock) == b""
    sock.close()
    assert counted(limited, before, "handshake_timeout_s", "kafka", ADMIN_TOKEN) == 1
    assert authed_topics(limited) is not None


def test_max_pending_bytes_before_authentication(limited: Server) -> None:
    before = refusals(limited, ADMIN_TOKEN)
    sock = raw_socket(limited, "kafka")
    # A frame that claims 1 MiB and sends 8 KiB of it, before any SASL.
    sock.sendall(struct.pack(">i", 1 << 20) + b"\0" * 8192)
    assert read_to_end(sock) == b""
    sock.close()
    assert counted(limited, before, "max_pending_bytes", "kafka", ADMIN_TOKEN) == 1
    assert authed_topics(limited) is not None


def test_kcat_authenticates_with_sasl_plain(auth_server: Server) -> None:
    # librdkafka 2.0.2 enables SASL only when SaslHandshake's range includes v0.
    sasl = [
        "-X",
        "security.protocol=SASL_PLAINTEXT",
        "-X",
        "sasl.mechanisms=PLAIN",
        "-X",
        "sasl.username=u",
        "-X",
        f"sasl.password={TOKEN}",
    ]
    broker = bootstrap(auth_server)
    topic = topic_name()
    kcat("-b", broker, "-P", "-t", topic, *sasl, stdin=b"kcat-sasl")
    assert kcat("-b", broker, "-C", "-t", topic, "-o", "beginning", "-e", "-q", *sasl).split() == [
        "kcat-sasl"
    ]


SCRAM = {**SASL, "sasl.mechanism": "SCRAM-SHA-256"}


def test_sasl_scram_sha_256_with_a_token_and_a_wrong_password(auth_server: Server) -> None:
    errors: list[KafkaError] = []
    wrong = Producer(
        {
            "bootstrap.servers": bootstrap(auth_server),
            **SCRAM,
            "sasl.password": "wrong",
            "error_cb": errors.append,
        }
    )

    def refused() -> bool:
        wrong.poll(0.1)
        return any(e.code() == KafkaError._AUTHENTICATION for e in errors)

    wait_until(refused, DEADLINE_S, "no authentication error")
    topic = topic_name()
    produce(auth_server, topic, [{"value": b"scram"}], **SCRAM, **{"sasl.password": TOKEN})
    # Debian's kcat (librdkafka 2.0.2, which repeats the client nonce) reads it back.
    out = kcat(
        "-b",
        bootstrap(auth_server),
        "-C",
        "-t",
        topic,
        "-o",
        "beginning",
        "-e",
        "-q",
        "-X",
        "security.protocol=SASL_PLAINTEXT",
        "-X",
        "sasl.mechanisms=SCRAM-SHA-256",
        "-X",
        "sasl.username=u",
        "-X",
        f"sasl.password={TOKEN}",
    )
    assert out.split() == ["scram"]


# ---- administration ---------------------------------------------------------------------


def test_admin_client_topics_configs_and_groups(server: Server) -> None:
    from confluent_kafka import ConsumerGroupState
    from confluent_kafka.admin import ConfigResource, ConfigSource, NewPartitions, ResourceType

    admin = AdminClient({"bootstrap.servers": bootstrap(server)})
    topic = create_topic(server, partitions=2)
    admin.create_partitions([NewPartitions(topic, 4)])[topic].result(timeout=DEADLINE_S)
    metadata = admin.list_topics(topic, timeout=DEADLINE_S)
    assert len(metadata.topics[topic].partitions) == 4
    shrink = admin.create_partitions([NewPartitions(topic, 3)])[topic]
    with pytest.raises(KafkaException) as refused:
        shrink.result(timeout=DEADLINE_S)
    assert refused.value.args[0].code() == KafkaError.INVALID_PARTITIONS

    resource = ConfigResource(ResourceType.TOPIC, topic)
    configs = admin.describe_configs([resource])[resource].result(timeout=DEADLINE_S)
    # Not set at creation: told as defaults, not as the topic's overrides (they were
    # DYNAMIC_TOPIC_CONFIG, so kafka-configs --describe listed them as set).
    for name, value in (("cleanup.policy", "delete"), ("message.timestamp.type", "CreateTime")):
        assert configs[name].value == value
        assert configs[name].source == ConfigSource.DEFAULT_CONFIG.value, name
        assert configs[name].is_default, name
    # What the topic does not set is the server's [storage] default as it runs (it
    # was once answered null): 128 MiB segments, kept forever (Kafka's -1).
    assert configs["segment.bytes"].value == str(128 << 20)
    assert configs["segment.bytes"].source == ConfigSource.DEFAULT_CONFIG.value
    assert configs["retention.ms"].value == "-1"

    # A group with a member is listed and described; once empty it can be deleted.
    group = "admin_" + uuid.uuid4().hex[:8]
    consumer = group_consumer(server, group)
    consumer.subscribe([topic])
    poll_until([consumer], lambda: len(consumer.assignment()) == 4, "the assignment")
    listed = admin.list_consumer_groups().result(timeout=DEADLINE_S)
    states = {g.group_id: g.state for g in listed.valid}
    assert states[group] == ConsumerGroupState.STABLE
    described = admin.describe_consumer_groups([group])[group].result(timeout=DEADLINE_S)
    assert len(described.members) == 1
    assert {tp.partition for tp in described.members[0].assignment.topic_partitions} == set(
        range(4)
    )
    consumer.close()
    admin.delete_consumer_groups([group])[group].result(timeout=DEADLINE_S)
    remaining = admin.list_consumer_groups().result(timeout=DEADLINE_S)
    assert group not in {g.group_id for g in remaining.valid}

    # A group that only ever committed offsets (no member: as every group is after a
    # restart) is Empty both listed and described; it was once described Dead.
    offsets_only = "offsets_" + uuid.uuid4().hex[:8]
    committer = group_consumer(server, offsets_only)
    committer.commit(offsets=[TopicPartition(topic, 0, 3)], asynchronous=False)
    committer.close()
    listed = admin.list_consumer_groups().result(timeout=DEADLINE_S)
    assert {g.group_id: g.state for g in listed.valid}[offsets_only] == ConsumerGroupState.EMPTY
    described = admin.describe_consumer_groups([offsets_only])[offsets_only].result(DEADLINE_S)
    assert (described.state, described.members) == (ConsumerGroupState.EMPTY, [])

    admin.delete_topics([topic])[topic].result(timeout=DEADLINE_S)
    assert topic not in admin.list_topics(timeout=DEADLINE_S).topics


def test_create_topics_answers_as_kafka_does(server: Server) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap(server)})

    def outcome(*topics: NewTopic) -> dict[str, int]:
        codes = {}
        for name, future in admin.create_topics(list(topics)).items():
            try:
                future.result(timeout=DEADLINE_S)
                codes[name] = KafkaError.NO_ERROR
            except KafkaException as exc:
                codes[name] = exc.args[0].code()
        return codes

    # Kafka's "no limit" (-1, Kafka Streams' repartition topics, Debezium's history
    # topic) and its combined policy (windowed changelogs) are taken; a value past a
    # Java long is not.
    taken = [
        {"retention.ms": "-1"},
        {"retention.bytes": "-1"},
        {"cleanup.policy": "compact,delete"},
        {"cleanup.policy": "delete,compact"},
    ]
    for config in taken:
        name = topic_name()
        assert outcome(NewTopic(name, 1, config=config)) == {name: KafkaError.NO_ERROR}, config
    name = topic_name()
    too_long = NewTopic(name, 1, config={"retention.ms": "9" * 23})
    assert outcome(too_long) == {name: KafkaError.INVALID_CONFIG}
    # A name given twice in one request: neither created, the name answered once (two
    # entries for it once broke librdkafka's parse of the whole answer).
    twice = topic_name()
    assert outcome(NewTopic(twice, 1), NewTopic(twice, 2)) == {twice: KafkaError.INVALID_REQUEST}
    assert twice not in admin.list_topics(timeout=DEADLINE_S).topics
    # The operation's own codes for a bad partition count or replication factor.
    zero, three = topic_name(), topic_name()
    assert outcome(NewTopic(zero, 0), NewTopic(three, 1, replication_factor=3)) == {
        zero: KafkaError.INVALID_PARTITIONS,
        three: KafkaError.INVALID_REPLICATION_FACTOR,
    }


# ---- [tls] ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """``[tls]`` (a trustme certificate) and required auth; the server and the CA file."""
    root = tmp_path_factory.mktemp("kafka-tls")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(root / "server.pem")
    )
    config = f"""{AUTH_CONFIG}
[tls]
cert = "{root / "server.pem"}"
key = "{root / "server.pem"}"
"""
    listen = {"kafka": LOCAL, "kimberlite": ""}
    for server in serving(root / "server", config=config, listen=listen, clean_log=True):
        yield server, root / "ca.pem"


def test_sasl_ssl_with_confluent_kafka_and_kcat(tls_server: tuple[Server, Path]) -> None:
    server, ca_file = tls_server
    tls = {
        **SCRAM,
        "security.protocol": "SASL_SSL",
        "ssl.ca.location": str(ca_file),
        "sasl.password": TOKEN,
    }
    topic = topic_name()
    produce(server, topic, [{"value": b"over-tls"}], **tls)
    assert [m.value() for m in consume(server, topic, 1, partitions=1, **tls)] == [b"over-tls"]
    out = kcat(
        "-b",
        bootstrap(server),
        "-C",
        "-t",
        topic,
        "-o",
        "beginning",
        "-e",
        "-q",
        *[arg for key, value in tls.items() for arg in ("-X", f"{kcat_key(key)}={value}")],
    )
    assert out.split() == ["over-tls"]


def kcat_key(key: str) -> str:
    # librdkafka 2.0.2 names the mechanism property in the plural.
    return "sasl.mechanisms" if key == "sasl.mechanism" else key


@pytest.fixture
def idle_server(tmp_path: Path) -> Iterator[Server]:
    config = "[limits]\nidle_timeout_s = 1\n"
    yield from serving(tmp_path, config=config, listen={"kafka": LOCAL, "http": LOCAL})


def test_idle_timeout_closes_a_quiet_connection(idle_server: Server) -> None:
    server = idle_server
    before = refusals(server)
    sock = raw_socket(server, "kafka")
    # ApiVersions v0 (api key 18, correlation id 7), then nothing.
    header = struct.pack(">hhih", 18, 0, 7, -1)
    sock.sendall(struct.pack(">i", len(header)) + header)
    answer = read_to_end(sock)
    sock.close()
    (size,) = struct.unpack_from(">i", answer)
    assert len(answer) == 4 + size  # the answer, then the close
    assert struct.unpack_from(">i", answer, 4) == (7,)
    assert counted(server, before, "idle_timeout_s", "kafka") == 1
    # A client that keeps talking is served.
    produce(server, "after_idle", [{"value": b"still served"}])
    assert consume(server, "after_idle", 1, partitions=1)[0].value() == b"still served"


def test_a_zombies_transaction_cannot_move_the_groups_offsets_back(server: Server) -> None:
    """KIP-447: a consume-transform-produce instance whose consumer lost its partition
    sends its offsets with the consumer's old group metadata; the broker refuses them
    (they once committed, taking the group's offset back from the new owner's 7 to 1)."""
    source, group = create_topic(server, 1), "zombie_" + uuid.uuid4().hex[:8]
    writer = Producer({"bootstrap.servers": bootstrap(server)})
    for i in range(10):
        writer.produce(source, f"m{i}".encode())
    writer.flush(DEADLINE_S)

    def member() -> Consumer:
        consumer = group_consumer(server, group, **{"isolation.level": "read_committed"})
        consumer.subscribe([source])
        message = None
        while message is None or message.error():
            message = consumer.poll(1)
        return consumer

    first = member()
    stale = first.consumer_group_metadata()
    zombie = Producer(
        {"bootstrap.servers": bootstrap(server), "transactional.id": "zombie-" + group}
    )
    zombie.init_transactions(DEADLINE_S)
    zombie.begin_transaction()
    first.close()  # its partition goes to the next member
    second = member()
    second.commit(offsets=[TopicPartition(source, 0, 7)], asynchronous=False)
    with pytest.raises(KafkaException) as refused:
        zombie.send_offsets_to_transaction([TopicPartition(source, 0, 1)], stale, DEADLINE_S)
    assert refused.value.args[0].code() in (
        KafkaError.ILLEGAL_GENERATION,
        KafkaError.UNKNOWN_MEMBER_ID,
    ), refused.value
    zombie.abort_transaction(DEADLINE_S)
    # The live member's own transactional commit, with its current metadata, is taken.
    live = Producer({"bootstrap.servers": bootstrap(server), "transactional.id": "live-" + group})
    live.init_transactions(DEADLINE_S)
    live.begin_transaction()
    live.send_offsets_to_transaction(
        [TopicPartition(source, 0, 9)], second.consumer_group_metadata(), DEADLINE_S
    )
    live.commit_transaction(DEADLINE_S)
    assert second.committed([TopicPartition(source, 0)], DEADLINE_S)[0].offset == 9
    second.close()


def test_transactional_offsets_for_a_missing_partition_are_unknown(server: Server) -> None:
    """As Kafka: a TxnOffsetCommit naming a partition that does not exist (of a topic
    that does, or of no topic) answers UNKNOWN_TOPIC_OR_PARTITION (the first was
    INVALID_REQUEST); the transaction must abort and commits no offset; the next
    transaction's offsets are committed."""
    source, group = create_topic(server, 1), "txn_missing_" + uuid.uuid4().hex[:8]
    consumer = group_consumer(server, group)
    producer = Producer(
        {"bootstrap.servers": bootstrap(server), "transactional.id": "missing-" + group}
    )
    producer.init_transactions(DEADLINE_S)
    for missing in (TopicPartition(source, 7, 3), TopicPartition("no_such_" + group, 0, 3)):
        producer.begin_transaction()
        with pytest.raises(KafkaException) as refused:
            # librdkafka retries the error for a partition of a topic it knows until the
            # call's timeout (so it does against Kafka), then reports it.
            producer.send_offsets_to_transaction(
                [TopicPartition(source, 0, 5), missing], consumer.consumer_group_metadata(), 3
            )
        error = refused.value.args[0]
        assert error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART, error
        assert error.txn_requires_abort(), error
        producer.abort_transaction(DEADLINE_S)
        assert consumer.committed([TopicPartition(source, 0)], DEADLINE_S)[0].offset < 0
    producer.begin_transaction()
    producer.send_offsets_to_transaction(
        [TopicPartition(source, 0, 4)], consumer.consumer_group_metadata(), DEADLINE_S
    )
    producer.commit_transaction(DEADLINE_S)
    assert consumer.committed([TopicPartition(source, 0)], DEADLINE_S)[0].offset == 4
    consumer.close()


def test_offset_metadata_past_kafkas_limit_is_refused_for_its_partition_alone(
    server: Server,
) -> None:
    """As Kafka (offset.metadata.max.bytes = 4096): a commit whose metadata is longer is
    answered OFFSET_METADATA_TOO_LARGE for that partition, and the request's other
    partitions are committed. It was UNKNOWN_TOPIC_OR_PARTITION for every partition,
    which aiokafka retries for ever (a commit() that never returned)."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka import TopicPartition as AioPartition
    from aiokafka.errors import OffsetMetadataTooLargeError
    from aiokafka.structs import OffsetAndMetadata

    topic, group = create_topic(server, 2), "meta_" + uuid.uuid4().hex[:8]
    # One request for two partitions, one with too much metadata: the other is committed.
    consumer = group_consumer(server, group)
    with pytest.raises(KafkaException) as refused:
        consumer.commit(
            offsets=[
                TopicPartition(topic, 0, 5, metadata="m" * 5000),
                TopicPartition(topic, 1, 7, metadata="fine"),
            ],
            asynchronous=False,
        )
    assert refused.value.args[0].code() == KafkaError.OFFSET_METADATA_TOO_LARGE
    committed = consumer.committed([TopicPartition(topic, 0), TopicPartition(topic, 1)], 10)
    assert [(p.offset, p.metadata) for p in committed] == [(OFFSET_INVALID, None), (7, "fine")]
    consumer.close()

    async def run() -> int | None:
        # (librdkafka's binding reads metadata as a C string: 4,096 bytes of it back
        # through confluent-kafka read past their end, so aiokafka reads them here.)
        consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap(server), group_id=group, enable_auto_commit=False
        )
        await consumer.start()
        try:
            first = AioPartition(topic, 0)
            consumer.assign([first])
            await consumer.commit({first: OffsetAndMetadata(2, "m" * 4096)})  # at the limit
            async with asyncio.timeout(DEADLINE_S):  # raised at once, not retried
                with pytest.raises(OffsetMetadataTooLargeError):
                    await consumer.commit({first: OffsetAndMetadata(3, "m" * 4097)})
            return await consumer.committed(first)
        finally:
            await consumer.stop()

    assert asyncio.run(run()) == 2


def read_partition(server: Server, topic: str) -> list[tuple[bytes | None, bytes | None]]:
    """Every record of partition 0, up to its end when read: (key, value) each."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap(server), "group.id": "r", "enable.partition.eof": True}
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    got: list[tuple[bytes | None, bytes | None]] = []
    try:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                continue
            error = message.error()
            if error is not None and error.code() == KafkaError._PARTITION_EOF:
                return got
            assert error is None, error
            got.append((message.key(), message.value()))
        raise AssertionError(f"no end of {topic} within {DEADLINE_S} s: {len(got)} read")
    finally:
        consumer.close()


def test_compaction_keeps_a_tombstone_with_an_old_create_time(
    make_server: Callable[..., Server],
) -> None:
    """delete.retention.ms counts from when the tombstone entered the log, not from the
    producer's timestamp: a mirrored or backfilled delete, two days old by its
    CreateTime, was dropped at the first compaction, and a consumer behind it kept the
    deleted key's value."""
    server = make_server(
        config="[storage]\nmaintenance_interval_ms = 100\n", listen={"kafka": LOCAL}
    )
    topic = topic_name()
    admin = AdminClient({"bootstrap.servers": bootstrap(server)})
    config = {"cleanup.policy": "compact", "segment.bytes": "1024"}
    admin.create_topics([NewTopic(topic, 1, 1, config=config)])[topic].result(DEADLINE_S)
    two_days_ago = int(time.time() * 1000) - 2 * 86_400_000
    pad = b"x" * 300
    produce(
        server,
        topic,
        [
            {"key": b"gone", "value": b"old " + pad},
            {"key": b"deleted", "value": b"value " + pad},
            {"key": b"deleted", "value": None, "timestamp": two_days_ago},
            {"key": b"gone", "value": b"new " + pad},
            *({"key": b"filler%d" % i, "value": pad} for i in range(8)),  # seals the above
        ],
        **{"linger.ms": 0, "batch.num.messages": 1},
    )
    # Compaction has run once the superseded value is gone; the old delete stays.

    def compacted() -> list[tuple[bytes | None, bytes | None]] | None:
        records = read_partition(server, topic)
        return records if (b"gone", b"old " + pad) not in records else None

    records = wait_until(compacted, message="compaction never removed a superseded value")
    assert (b"deleted", None) in records and (b"deleted", b"value " + pad) not in records
