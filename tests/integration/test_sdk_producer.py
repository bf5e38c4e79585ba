"""The SDK's producer against a real server's Rivven listener (docs/sdk.md, "Producer"):
keyed records on Kafka's partition for the key, batching and linger, idempotent retries
stored once, transactions seen whole or not at all by read_committed consumers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Consumer as KafkaConsumer
from confluent_kafka import KafkaError
from confluent_kafka import Producer as KafkaProducer
from confluent_kafka import TopicPartition as KafkaPartition
from servers import LOCAL, Server, serving

import headwater
from headwater.client._core import batching
from headwater.client.consumer import AsyncConsumer, ConsumerRecord, TopicPartition
from headwater.client.errors import EventTooLarge
from headwater.client.producer import MAX_BATCH_BYTES, AsyncProducer, RecordMetadata
from headwater.engine.partitioner import keyed_partition
from headwater.errors import InvalidRequest, InvalidTxnState
from headwater.protocols.rivven import rivven_pb2 as pb

PARTITIONS = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("sdk_producer"),
        listen={"rivven": LOCAL, "kafka": LOCAL, "kimberlite": ""},
    )


def rivven(server: Server) -> str:
    return server.address_of("rivven")


async def read_all(
    server: Server,
    stream: str,
    count: int,
    *,
    partitions: int = PARTITIONS,
    isolation: Any = "read_committed",
) -> list[ConsumerRecord]:
    """``count`` records of every partition from offset 0 (no group membership)."""
    async with AsyncConsumer(rivven(server), isolation_level=isolation) as consumer:
        consumer.assign([(stream, p) for p in range(partitions)])
        records: list[ConsumerRecord] = []
        while len(records) < count:
            got = await consumer.getmany(timeout=10)
            assert got, f"only {len(records)} of {count} records came"
            records += got
        assert len(records) == count
        return records


def test_keyed_records_land_on_kafkas_partition_for_the_key(server: Server) -> None:
    keys = [f"customer-{i}".encode() for i in range(300)]
    with headwater.Producer(rivven(server)) as producer:
        producer.create_stream("keyed", partitions=PARTITIONS)
        producer.create_stream("keyed-by-kafka", partitions=PARTITIONS)
        futures = [producer.send("keyed", b"v" + key, key=key) for key in keys]
        producer.flush()
        placed = [future.result() for future in futures]
    # The same keys through a Kafka client (Java's partitioner, murmur2_random) to the
    # server's Kafka listener: the same partition for every key.
    kafka = KafkaProducer(
        {
            "bootstrap.servers": server.address_of("kafka"),
            "partitioner": "murmur2_random",
            "linger.ms": 5,
        }
    )
    by_kafka: dict[bytes, int] = {}

    def delivered(error: Any, message: Any) -> None:
        assert error is None, error
        by_kafka[message.key()] = message.partition()

    for key in keys:
        kafka.produce("keyed-by-kafka", b"v", key=key, on_delivery=delivered)
    assert kafka.flush(30) == 0
    assert [p for p, _ in placed] == [by_kafka[key] for key in keys]
    assert [p for p, _ in placed] == [keyed_partition(key, PARTITIONS) for key in keys]
    assert len({p for p, _ in placed}) == PARTITIONS
    # Read back: each record where its metadata said, with its key.
    records = asyncio.run(read_all(server, "keyed", len(keys)))
    stored = {(r.partition, r.offset): (r.key, r.value) for r in records}
    for key, (partition, offset) in zip(keys, placed, strict=True):
        assert stored[(partition, offset)] == (key, b"v" + key)


def test_linger_gathers_records_into_fewer_requests(server: Server) -> None:
    async def produce(stream: str, linger_ms: float, batch_bytes: int) -> tuple[int, list[Any]]:
        async with AsyncProducer(
            rivven(server), linger_ms=linger_ms, batch_bytes=batch_bytes
        ) as producer:
            await producer.create_stream(stream, partitions=1)
            before = producer.requests
            placed = await asyncio.gather(
                *(producer.send(stream, f"{stream}-{i}".encode()) for i in range(400))
            )
            return producer.requests - before, placed

    async def main() -> None:
        lingering, placed = await produce("lingered", 1_000, 1 << 20)
        one_by_one, _ = await produce("unlingered", 0, 1 << 20)
        cut, _ = await produce("cut", 1_000, 1_000)  # batches of at most 1,000 B of values
        assert placed == [RecordMetadata(0, i) for i in range(400)]
        assert lingering == 1  # the 400 records: one batch, one request
        assert one_by_one == 400  # no linger: each record its own batch
        values = [f"cut-{i}".encode() for i in range(400)]
        assert cut == len(batching.batches(values, len, 10_000, 1_000)) == 3
        records = await read_all(server, "lingered", 400, partitions=1)
        assert [r.value for r in records] == [f"lingered-{i}".encode() for i in range(400)]

    asyncio.run(main())


def test_idempotent_batch_sent_again_is_stored_once(server: Server) -> None:
    async def main() -> None:
        async with AsyncProducer(rivven(server), linger_ms=0) as producer:
            await producer.create_stream("idem", partitions=2)
            assert producer.producer_id is not None
            # The same batch twice, as a retry after a lost answer sends it.
            request = pb.BatchPublishRequest(
                topic="idem", producer_id=producer.producer_id, producer_epoch=0
            )
            request.partition_records.add(
                partition=1,
                base_sequence=0,
                records=[pb.Record(value=b"a"), pb.Record(value=b"b")],
            )
            first = await producer._session.request(request, pb.BatchPublishResponse, safe=True)
            again = await producer._session.request(request, pb.BatchPublishResponse, safe=True)
            assert not first.results[0].duplicate
            assert again.results[0].duplicate
            assert again.results[0].base_offset == first.results[0].base_offset == 0

            # And through the producer: the connection closes right after the batch is
            # written, so its answer never arrives and the producer sends it again on a
            # new connection; stored once, whether the first copy was stored or not.
            def closing(conn: Any) -> None:
                send = conn.send

                def send_then_close(message: Any, route: Any = None) -> Any:
                    sent = send(message, route)
                    if isinstance(message, pb.BatchPublishRequest):
                        conn.close()
                    return sent

                conn.send = send_then_close

            closing(await producer._session._ensure())
            placed = await asyncio.gather(
                *(producer.send("idem", f"r{i}".encode(), partition=0) for i in range(5))
            )
            assert producer._session.retried >= 1
            assert placed == [RecordMetadata(0, i) for i in range(5)]
            for partition, end in ((0, 5), (1, 2)):  # nothing stored twice
                bounds = await producer._session.request(
                    pb.GetOffsetBoundsRequest(topic="idem", partition=partition),
                    pb.GetOffsetBoundsResponse,
                    safe=True,
                )
                assert bounds.latest == end

    asyncio.run(main())
    records = asyncio.run(read_all(server, "idem", 7, partitions=2))
    assert sorted((r.partition, r.value) for r in records) == [
        (0, b"r0"),
        (0, b"r1"),
        (0, b"r2"),
        (0, b"r3"),
        (0, b"r4"),
        (1, b"a"),
        (1, b"b"),
    ]


def test_transactions_commit_whole_and_abort_whole(server: Server) -> None:
    async def main() -> None:
        async with AsyncProducer(rivven(server), transactional_id="tx-orders") as producer:
            await producer.create_stream("txn", partitions=2)
            with pytest.raises(InvalidTxnState):
                producer.send("txn", b"outside")
            await producer.init_transactions()
            await producer.begin_transaction()
            for i in range(10):
                producer.send("txn", f"committed-{i}".encode(), partition=i % 2)
            await producer.send_offsets_to_transaction({("txn", 0): 7}, "txn-group")
            await producer.commit_transaction()
            await producer.begin_transaction()
            for i in range(6):
                producer.send("txn", f"aborted-{i}".encode(), partition=i % 2)
            await producer.send_offsets_to_transaction({("txn", 0): 99}, "txn-group")
            await producer.abort_transaction()
            await producer.begin_transaction()
            # after the aborted records in both partitions: a reader that reaches these
            # has passed the aborted ones
            sent = [producer.send("txn", f"late-{i}".encode(), partition=i % 2) for i in range(4)]
            await producer.commit_transaction()
            assert all(f.done() for f in sent)

        committed = await read_all(server, "txn", 14, partitions=2)
        assert sorted(r.value for r in committed) == sorted(
            [f"committed-{i}".encode() for i in range(10)]
            + [f"late-{i}".encode() for i in range(4)]
        )
        everything = await read_all(server, "txn", 20, partitions=2, isolation="read_uncommitted")
        assert sum(r.value.startswith(b"aborted-") for r in everything) == 6
        async with AsyncConsumer(rivven(server), group_id="txn-group") as consumer:
            assert await consumer.committed([("txn", 0)]) == {TopicPartition("txn", 0): 7}

    asyncio.run(main())


def kafka_read_to_end(server: Server, stream: str, partitions: int, isolation: str) -> list[bytes]:
    """Every value a librdkafka consumer with ``isolation`` reads from offset 0 of each
    partition up to its end (the last stable offset under read_committed)."""
    consumer = KafkaConsumer(
        {
            "bootstrap.servers": server.address_of("kafka"),
            "group.id": "unused",
            "enable.auto.commit": False,
            "isolation.level": isolation,
            "enable.partition.eof": True,
        }
    )
    try:
        consumer.assign([KafkaPartition(stream, p, 0) for p in range(partitions)])
        values: list[bytes] = []
        at_end: set[int] = set()
        while len(at_end) < partitions:
            message = consumer.poll(30)
            assert message is not None, f"no record nor end of partition within 30 s: {values}"
            error = message.error()
            if error is not None:
                assert error.code() == KafkaError._PARTITION_EOF, error
                at_end.add(message.partition())
                continue
            value = message.value()
            assert value is not None
            values.append(value)
        return values
    finally:
        consumer.close()


def test_a_kafka_consumer_sees_rivven_transactions_as_kafka_would(server: Server) -> None:
    """A transaction written over Rivven (batches stored in headwater's form) fetched by a
    Kafka client: read_committed leaves the aborted records out, read_uncommitted shows
    them, and the markers are control batches the client skips."""

    async def main() -> None:
        async with AsyncProducer(rivven(server), transactional_id="tx-to-kafka") as producer:
            await producer.create_stream("txn_kafka", partitions=2)
            await producer.init_transactions()
            for word, count, commit in (
                ("kept", 4, True),
                ("dropped", 6, False),
                ("late", 2, True),
            ):
                await producer.begin_transaction()
                for i in range(count):
                    producer.send("txn_kafka", f"{word}-{i}".encode(), partition=i % 2)
                if commit:
                    await producer.commit_transaction()
                else:
                    await producer.abort_transaction()

    asyncio.run(main())
    kept = [f"kept-{i}".encode() for i in range(4)] + [f"late-{i}".encode() for i in range(2)]
    dropped = [f"dropped-{i}".encode() for i in range(6)]
    assert sorted(kafka_read_to_end(server, "txn_kafka", 2, "read_committed")) == sorted(kept)
    assert sorted(kafka_read_to_end(server, "txn_kafka", 2, "read_uncommitted")) == sorted(
        kept + dropped
    )


def test_batches_past_the_limits_are_refused_whole(server: Server) -> None:
    async def main() -> None:
        async with AsyncProducer(rivven(server)) as producer:
            await producer.create_stream("limits", partitions=2)
            # One value over what an append carries: refused before anything is sent.
            with pytest.raises(EventTooLarge):
                producer.send("limits", b"x" * (MAX_BATCH_BYTES + 1))
            session = producer._session

            def batch(partition: int, *values: bytes) -> pb.BatchPublishRequest:
                request = pb.BatchPublishRequest(topic="limits")
                request.partition_records.add(
                    partition=partition, records=[pb.Record(value=v) for v in values]
                )
                return request

            # Over 4 MiB of values in one partition's batch (the frame is under 10 MiB).
            big = batch(0, b"a" * (3 << 20), b"b" * (2 << 20))
            with pytest.raises(InvalidRequest, match="at most"):
                await session.request(big, pb.BatchPublishResponse, safe=False)
            # A partition the stream lacks: refused, even beside a good one.
            mixed = batch(1, b"fine")
            mixed.partition_records.add(partition=2, records=[pb.Record(value=b"nowhere")])
            with pytest.raises(InvalidRequest, match="no partition 2"):
                await session.request(mixed, pb.BatchPublishResponse, safe=False)
            # A transactional batch of a producer that began no transaction.
            stray = batch(0, b"stray")
            stray.producer_id, stray.txn_id = 1, "never-begun"
            with pytest.raises(InvalidTxnState):
                await session.request(stray, pb.BatchPublishResponse, safe=False)
            # Nothing of them was stored; the connection still serves.
            for partition in (0, 1):
                bounds = await session.request(
                    pb.GetOffsetBoundsRequest(topic="limits", partition=partition),
                    pb.GetOffsetBoundsResponse,
                    safe=True,
                )
                assert bounds.latest == 0
            assert await producer.send("limits", b"after", partition=1) == (1, 0)

    asyncio.run(main())


def test_a_failed_batch_does_not_wedge_the_producer(tmp_path: Any) -> None:
    """A batch lost to an unreachable server took its sequence number: every later
    batch to that partition was refused as out of order, for good (idempotent and
    transactional alike). A new id (a new epoch once the transaction ends) numbers
    from 0 again."""
    server = Server(tmp_path / "down", listen={"rivven": LOCAL, "kimberlite": ""}).start()
    try:
        address = rivven(server)
        options: dict[str, Any] = {"linger_ms": 0, "reconnect_attempts": 1, "backoff_max": 0.05}
        plain = headwater.Producer(address, **options)
        txn = headwater.Producer(address, transactional_id="wedge", **options)
        try:
            plain.create_stream("wedge", partitions=1)
            assert plain.send("wedge", b"a").result(15).offset == 0
            txn.init_transactions()
            txn.begin_transaction()
            server.stop()
            with pytest.raises(Exception):  # noqa: B017 - whichever way the send ended
                plain.send("wedge", b"lost").result(30)
            txn.send("wedge", b"lost-in-txn")
            with pytest.raises(Exception):  # noqa: B017
                txn.commit_transaction()
            server.start()
            later = [plain.send("wedge", v).result(30) for v in (b"c", b"d")]
            assert [m.partition for m in later] == [0, 0]
            txn.begin_transaction()
            txn.send("wedge", b"in-txn")
            txn.commit_transaction()
        finally:
            plain.close()
            txn.close()

        async def stored() -> list[bytes]:
            return [r.value for r in await read_all(server, "wedge", 4, partitions=1)]

        assert asyncio.run(stored()) == [b"a", b"c", b"d", b"in-txn"]
    finally:
        server.stop()


def test_a_raising_on_delivery_changes_no_records_outcome(server: Server) -> None:
    told: list[tuple[BaseException | None, RecordMetadata | None]] = []

    def on_delivery(error: BaseException | None, metadata: RecordMetadata | None) -> None:
        told.append((error, metadata))
        if metadata is not None and metadata.offset == 0:
            raise RuntimeError("the caller's bug")

    with headwater.Producer(rivven(server), linger_ms=50) as producer:
        producer.create_stream("told", partitions=1)
        futures = [producer.send("told", v, on_delivery=on_delivery) for v in (b"x", b"y", b"z")]
        producer.flush()
        assert [f.result(15).offset for f in futures] == [0, 1, 2]
    # Each record told once, as stored.
    assert [(e, m.offset if m else None) for e, m in told] == [(None, 0), (None, 1), (None, 2)]
