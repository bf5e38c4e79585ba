"""Per-tenant quotas against a real server (``[[tenants]]`` produce_bytes_per_s,
consume_bytes_per_s; docs/operations.md "Quotas"), over HTTP and Kimberlite, and Kafka's and
Rivven's producers: a request past its tenant's rate waits
its turn before it is served (so requests pipelined on one connection are spaced at the
rate), a read's answer is held back for the bytes it read, and the throttle time is
reported (``X-Headwater-Throttle-Ms``, ``headwater_throttle_seconds_total``), while a
tenant without a quota is served at once, meanwhile."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import confluent_kafka
import pytest
from kimberlite_raw import batch, create_stream
from prometheus_client.parser import text_string_to_metric_families
from servers import LOCAL, Server, serving
from test_rivven_server import Rivven

import headwater
from headwater.api.quotas import BURST_S
from headwater.client import AsyncConsumer, AsyncProducer, Producer
from headwater.client.aio import connect_async
from headwater.protocols.kimberlite.messages import AppendEventsRequest, AppendEventsResponse
from headwater.protocols.rivven import rivven_pb2 as pb
from waiting import wait_until

PRODUCE_RATE = 100_000  # bytes/s of tenant 42
CONSUME_RATE = 50_000  # bytes/s of tenant 43
ORDERLY_RATE = 200_000  # bytes/s of tenant 46: a 100-byte append every 0.5 ms
CONFIG = f"""
[storage]
sync = "none"
[[tenants]]
id = 42
name = "producer"
produce_bytes_per_s = {PRODUCE_RATE}
[[tenants]]
id = 43
name = "consumer"
consume_bytes_per_s = {CONSUME_RATE}
[[tenants]]
id = 44
name = "subscriber"
consume_bytes_per_s = {CONSUME_RATE}
[[tenants]]
id = 45
name = "pipeliner"
produce_bytes_per_s = {PRODUCE_RATE}
[[tenants]]
id = 46
name = "orderly"
produce_bytes_per_s = {ORDERLY_RATE}
"""
EVENT = "x" * 10_000
CHUNK = [EVENT] * 10  # 100 kB of event values per append


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("quotas"), config=CONFIG, listen={"http": LOCAL}, clean_log=True
    )


def call(server: Server, method: str, path: str, tenant: int, body: object = None) -> int:
    """The answer's throttle time in ms (it must be a 2xx)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{server.address_of('http')}{path}", data=data, method=method
    )
    request.add_header("X-Headwater-Tenant", str(tenant))
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=60) as response:
        assert 200 <= response.status < 300
        return int(response.headers["X-Headwater-Throttle-Ms"])


def get_json(server: Server, path: str, tenant: int) -> dict[str, object]:
    request = urllib.request.Request(f"http://{server.address_of('http')}{path}")
    request.add_header("X-Headwater-Tenant", str(tenant))
    with urllib.request.urlopen(request, timeout=60) as response:
        answer: dict[str, object] = json.load(response)
        return answer


def throttle_seconds(server: Server) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(f"http://{server.address_of('http')}/metrics") as response:
        text = response.read().decode()
    return {
        (sample.labels["tenant"], sample.labels["quota"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "headwater_throttle_seconds"
        for sample in family.samples
        if sample.name == "headwater_throttle_seconds_total"
    }


def test_a_tenant_past_its_produce_rate_is_throttled_and_another_is_not(server: Server) -> None:
    for tenant in (0, 42):
        call(server, "POST", "/api/streams", tenant, {"name": "q_produce"})
    appends = 10  # 1 MB at 100 kB/s
    throttled: list[float] = []

    def produce() -> None:
        for _ in range(appends):
            throttled.append(call(server, "POST", "/api/streams/q_produce/events", 42, CHUNK))

    producer = threading.Thread(target=produce)
    producer.start()
    wait_until(lambda: ("42", "produce") in throttle_seconds(server), message="no throttle")
    # Tenant 0 has no quota: served at once while tenant 42's requests wait their turn
    # (its 1 MB is all sent before tenant 42, already being throttled, is done).
    unthrottled = [
        call(server, "POST", "/api/streams/q_produce/events", 0, CHUNK) for _ in range(appends)
    ]
    assert producer.is_alive()
    producer.join(timeout=60)
    assert unthrottled == [0] * appends
    # The first append is the burst (one second of the rate), the second puts the tenant
    # in debt and is served at once too; each later one waits until the 100 kB of the
    # one before it are paid at 100 kB/s. The last one's debt is left to the tenant's
    # next request; the time between two requests refills the bucket (so the sum can
    # only fall short, by at most one more request's worth).
    chunk_s = len(EVENT) * len(CHUNK) / PRODUCE_RATE
    ideal_s = (appends * len(EVENT) * len(CHUNK) - PRODUCE_RATE * BURST_S) / PRODUCE_RATE
    assert throttled[:2] == [0, 0] and len(throttled) == appends
    assert ideal_s - 2 * chunk_s <= sum(throttled) / 1000 <= ideal_s - chunk_s + 0.001
    reported = throttle_seconds(server)
    assert reported[("42", "produce")] == pytest.approx(sum(throttled) / 1000, abs=0.01)
    assert [key for key in reported if key[0] == "0"] == []


def test_a_read_past_the_consume_rate_is_answered_then_held_back(server: Server) -> None:
    for tenant in (0, 43):
        call(server, "POST", "/api/streams", tenant, {"name": "q_consume"})
        call(server, "POST", "/api/streams/q_consume/events", tenant, CHUNK)  # no produce quota
    # The bucket is full (one second of the rate): 100 kB read owes 50 kB at 50 kB/s.
    first = call(server, "GET", "/api/streams/q_consume/events?limit=10", 43)
    assert first == round((len(EVENT) * len(CHUNK) - CONSUME_RATE * BURST_S) / CONSUME_RATE * 1000)
    assert call(server, "GET", "/api/streams/q_consume/events?limit=10", 0) == 0  # not 43's


def test_subscription_pushes_past_the_consume_rate_hold_the_next_push_back(
    server: Server,
) -> None:
    """Pushes count against the consume rate: once a push put the tenant in debt, the
    subscription's next read waits until it is paid, so 300 kB at 50 kB/s (50 kB of
    burst) are throttled 5 s in all, however the pushes were cut."""
    call(server, "POST", "/api/streams", 44, {"name": "q_push"})
    for _ in range(3):
        call(server, "POST", "/api/streams/q_push/events", 44, CHUNK)
    with (
        headwater.connect(server.address, tenant=44) as client,
        client.subscribe("q_push", 0) as subscription,
    ):
        for received, event in enumerate(subscription, start=1):
            assert event.value == EVENT.encode()
            if received == 3 * len(CHUNK):
                break
    ideal_s = (3 * len(EVENT) * len(CHUNK) - CONSUME_RATE * BURST_S) / CONSUME_RATE
    wait_until(
        lambda: throttle_seconds(server).get(("44", "consume"), 0) >= ideal_s - 0.01,
        message="the pushes were not counted against tenant 44's consume rate",
    )
    assert throttle_seconds(server)[("44", "consume")] == pytest.approx(ideal_s, abs=0.01)


def test_pipelined_appends_are_spaced_at_the_produce_rate(server: Server) -> None:
    """40 appends of 10 kB sent at once on one Kimberlite connection, none waiting for
    an answer, against 100 kB/s: the first 100 kB are the burst, each later append waits
    its turn before it is stored, so the last one is stored 2.9 s after the first (not
    all at once with their answers held back), while tenant 0 is served meanwhile."""
    for tenant in (0, 45):
        call(server, "POST", "/api/streams", tenant, {"name": "q_pipe"})
    appends = 40

    async def pipeline() -> None:
        async with (
            connect_async(server.address, tenant=45) as pipeliner,
            connect_async(server.address, tenant=0) as other,
        ):
            pipelined = asyncio.gather(
                *(pipeliner.append("q_pipe", [EVENT]) for _ in range(appends))
            )
            await asyncio.to_thread(
                wait_until,
                lambda: ("45", "produce") in throttle_seconds(server),
                message="tenant 45's pipelined appends were not throttled",
            )
            # Tenant 0 has no quota: stored at once while tenant 45's appends wait.
            assert (await other.append("q_pipe", [EVENT])).count == 1
            assert not pipelined.done()
            assert sorted(result.first_offset for result in await pipelined) == list(range(appends))

    asyncio.run(pipeline())
    page = get_json(server, f"/api/streams/q_pipe/events?limit={appends}", 45)
    events = page["events"]
    assert isinstance(events, list) and len(events) == appends
    stored_at_ms = sorted(event["timestamp_ms"] for event in events)
    # The server's own append times: 300 kB past the burst at 100 kB/s, less the last
    # append's 10 kB (its debt is the next request's to wait) = 2.9 s between the first
    # and the last append stored (some of it may be eaten by the time the 40 requests
    # took to arrive, which refills the bucket meanwhile).
    event_s = len(EVENT) / PRODUCE_RATE
    spaced_s = (appends * len(EVENT) - PRODUCE_RATE * BURST_S) / PRODUCE_RATE - event_s
    assert (stored_at_ms[-1] - stored_at_ms[0]) / 1000 >= spaced_s - 0.4
    # Each request's own wait is counted (they overlap): 0.1 s, 0.2 s, ... 2.9 s, at
    # most 43.5 s in all (less what the bucket refilled while they arrived); an answer
    # held back after serving (as before) would have counted 46.5 s.
    turns_s = sum(k * event_s for k in range(1, round(spaced_s / event_s) + 1))
    reported = throttle_seconds(server)
    assert spaced_s <= reported[("45", "produce")] <= turns_s + 0.001
    assert [key for key in reported if key[0] == "0"] == []


def test_pipelined_appends_waiting_their_turns_are_stored_in_the_order_sent(
    server: Server,
) -> None:
    """5,000 appends of 100 bytes sent at once on one connection against 200 kB/s: the
    3,000 past the burst wait turns 0.5 ms apart, and each is stored after the one sent
    before it (turns that close once fired out of order now and then, the loop's clock
    being in milliseconds: one or two appends in 3,000 stored before their predecessor).
    Sent as one write of raw requests, so a loaded machine still sends them faster than
    the rate (through the SDK, a CI run once sent them slower: no turn was waited)."""
    appends = 5_000
    with server.client(46) as client:
        stream_id = create_stream(client, "q_order")
        sent = [
            client.conn.send_request(
                AppendEventsRequest(stream_id, batch([f"{i:08d}".ljust(100, ".").encode()]))
            )
            for i in range(appends)
        ]
        client.send_raw(b"".join(data for _, data in sent))
        offsets = []
        for request_id, _ in sent:
            reply = client.reply(request_id)
            assert isinstance(reply, AppendEventsResponse), reply
            offsets.append(reply.first_offset)
    assert offsets == list(range(appends))
    assert throttle_seconds(server)[("46", "produce")] > 0  # they did wait their turns


WIRE_RATE = 200_000  # bytes/s of tenant 0 on the Kafka and Rivven server below
WIRE_VALUE = b"k" * 100_000


@pytest.fixture(scope="module")
def wire_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = (
        f'[[tenants]]\nid = 0\nname = "default"\nproduce_bytes_per_s = {WIRE_RATE}\n'
        f"consume_bytes_per_s = {WIRE_RATE}\n"
    )
    listen = {"http": LOCAL, "kafka": LOCAL, "rivven": LOCAL}
    yield from serving(tmp_path_factory.mktemp("wire_quotas"), config=config, listen=listen)


def wire_throttled(server: Server, produce: Callable[[], None]) -> float:
    """Seconds tenant 0's produce quota held back ``produce``'s six 100 kB requests."""
    before = throttle_seconds(server).get(("0", "produce"), 0.0)
    produce()
    return throttle_seconds(server).get(("0", "produce"), 0.0) - before


@pytest.mark.parametrize("client", ["kafka", "rivven"])
def test_kafka_and_rivven_producers_are_held_to_the_produce_rate(
    wire_server: Server, client: str
) -> None:
    """Six requests of 100 kB, each sent once the one before is answered: the first two
    pass (a second's burst, then debt), each later one waits for the one before it to be
    paid at 200 kB/s (0.5 s each), as an HTTP or Kimberlite append would."""
    topic = f"wire_{client}"
    with headwater.connect(wire_server.address) as hw:  # type: ignore[attr-defined]
        hw.create_stream(topic)

    def kafka() -> None:
        producer = confluent_kafka.Producer(
            {"bootstrap.servers": wire_server.address_of("kafka"), "linger.ms": 0}
        )
        for _ in range(6):
            producer.produce(topic, WIRE_VALUE)
            assert producer.flush(60) == 0  # one Produce request each

    def rivven() -> None:
        with Producer(wire_server.address_of("rivven")) as producer:
            for _ in range(6):
                producer.send(topic, WIRE_VALUE).result(60)

    waited = wire_throttled(wire_server, kafka if client == "kafka" else rivven)
    # Four waits of 0.5 s (the time between requests refills the bucket a little), or
    # up to six after the other client's test left its last request's debt to this one.
    assert 1.0 <= waited <= 3.0 + 0.001, waited


def kafka_config(server: Server, throttled: list[float], **extra: object) -> dict[str, object]:
    """A confluent-kafka client config whose throttle_cb collects the throttle time of
    every throttled answer (librdkafka reports each; confluent-kafka in seconds)."""
    return {
        "bootstrap.servers": server.address_of("kafka"),
        "throttle_cb": lambda event: throttled.append(event.throttle_time),
        **extra,
    }


def test_kafka_produce_answers_carry_the_throttle_time(wire_server: Server) -> None:
    """KIP-219: past the produce rate the Produce answer comes at once with
    throttle_time_ms (the debt left: 0.5 s per 100 kB at 200 kB/s), and the client is
    held to the rate all the same (its connection muted for that long)."""
    topic = "throttle_time_produce"
    with headwater.connect(wire_server.address) as hw:  # type: ignore[attr-defined]
        hw.create_stream(topic)
    throttled: list[float] = []
    producer = confluent_kafka.Producer(kafka_config(wire_server, throttled, **{"linger.ms": 0}))
    started = time.monotonic()
    for _ in range(6):
        producer.produce(topic, WIRE_VALUE)
        assert producer.flush(60) == 0  # one Produce request each
    producer.poll(0)  # serves the throttle callbacks of the last answer
    elapsed = time.monotonic() - started
    told = [s for s in throttled if s > 0]  # librdkafka reports 0 when it ends
    # The tenant's bucket is the module's server's: the first answers may find it
    # partly spent by an earlier test (a first throttle of 0.06 s was seen), but every
    # answer past the burst carries the debt of its 100 kB, about 0.5 s.
    assert len(told) >= 3 and all(s <= 1.5 for s in told), throttled
    assert all(s >= 0.1 for s in told[-3:]), throttled
    # 600 kB at 200 kB/s with a second's burst: at least 1 s, whoever waited it.
    assert elapsed >= 1.0, elapsed


def test_transactional_batches_count_toward_the_produce_quota(wire_server: Server) -> None:
    topic = "throttle_time_txn"
    with headwater.connect(wire_server.address) as hw:  # type: ignore[attr-defined]
        hw.create_stream(topic)
    throttled: list[float] = []
    producer = confluent_kafka.Producer(
        kafka_config(wire_server, throttled, **{"linger.ms": 0, "transactional.id": "quota-t"})
    )
    producer.init_transactions(30)
    before = throttle_seconds(wire_server).get(("0", "produce"), 0.0)
    producer.begin_transaction()
    for _ in range(6):
        producer.produce(topic, WIRE_VALUE)
        assert producer.flush(60) == 0
    producer.commit_transaction(60)
    producer.poll(0)
    assert throttled, "no Produce answer of the transaction carried a throttle time"
    assert throttle_seconds(wire_server).get(("0", "produce"), 0.0) - before >= 1.0


def test_kafka_fetch_answers_carry_the_throttle_time(wire_server: Server) -> None:
    topic = "throttle_time_fetch"
    with headwater.connect(wire_server.address) as hw:  # type: ignore[attr-defined]
        hw.create_stream(topic)
    with Producer(wire_server.address_of("rivven")) as producer:
        for _ in range(8):  # 800 kB: past the consume rate's one-second burst
            producer.send(topic, WIRE_VALUE).result(60)
    throttled: list[float] = []
    consumer = confluent_kafka.Consumer(
        kafka_config(
            wire_server,
            throttled,
            **{"group.id": "throttle-fetch", "auto.offset.reset": "earliest"},
        )
    )
    consumer.subscribe([topic])
    read = 0
    try:
        while read < 8:
            message = wait_until(lambda: consumer.poll(0.2), message="no more messages")
            assert message.error() is None, message.error()
            read += 1
        wait_until(lambda: consumer.poll(0) is None and throttled, message="no throttle event")
    finally:
        consumer.close()
    # 800 kB read at once at 200 kB/s with a second's burst: about 3 s of debt told.
    # (librdkafka also reports 0 once a broker stops throttling it.)
    assert max(throttled) >= 1.0, throttled


@pytest.mark.parametrize("idempotent", [False, True])
def test_rivven_requests_past_the_rate_are_answered_throttled_and_sent_again(
    wire_server: Server, idempotent: bool
) -> None:
    """Rivven's contract (rivven.proto's ThrottledResponse, Rivven's docs/quotas.md):
    past a quota the server answers ``throttled`` instead of serving the request, and
    the client waits throttle_time_ms and sends it again. Six 100 kB publishes at
    200 kB/s: the SDK is told to wait, and every record is stored exactly once, in
    order. Without idempotence a throttled publish that had been stored all the same
    would be stored twice by the resend; with it, a sequence advanced for a refused
    publish would be refused as out of order."""
    topic = f"rivven_throttled_{idempotent}"
    with headwater.connect(wire_server.address) as hw:  # type: ignore[attr-defined]
        hw.create_stream(topic)

    async def produce_then_consume() -> tuple[int, float, list[tuple[int, bytes]], int]:
        address = wire_server.address_of("rivven")
        started = time.monotonic()
        async with AsyncProducer(address, enable_idempotence=idempotent) as producer:
            for index in range(6):
                await producer.send_and_wait(topic, WIRE_VALUE[:-1] + bytes([index]))
            produced_throttled = producer.throttled
        elapsed = time.monotonic() - started
        read: list[tuple[int, bytes]] = []
        async with AsyncConsumer(address) as consumer:
            consumer.assign([(topic, 0)])
            while len(read) < 6:  # 600 kB at 200 kB/s: the consumer is throttled too
                record = await consumer.poll(5.0)
                if record is not None:
                    read.append((record.offset, record.value))
            consume_throttled = consumer.throttled
        return produced_throttled, elapsed, read, consume_throttled

    told_before = throttle_seconds(wire_server).get(("0", "produce"), 0.0)
    produced_throttled, elapsed, read, _ = asyncio.run(produce_then_consume())
    assert produced_throttled >= 1
    # 600 kB at 200 kB/s with a second's burst: at least 1 s, waited by the client.
    assert elapsed >= 1.0, elapsed
    assert read == [(index, WIRE_VALUE[:-1] + bytes([index])) for index in range(6)]
    with headwater.connect(wire_server.address) as hw:  # type: ignore[attr-defined]
        assert hw.stream_info(topic).next_offset == 6  # nothing stored twice
    told = throttle_seconds(wire_server).get(("0", "produce"), 0.0) - told_before
    assert told >= 0.4, told  # the waits told count as throttle time


def test_a_rivven_request_answered_throttled_is_not_served(wire_server: Server) -> None:
    """On the wire: a publish past the produce rate is answered ``throttled`` (the time
    until the debt is paid, Rivven's name of the rate, the tenant) and not stored; sent
    again after that time, it is. A consume past the consume rate likewise."""
    topic = "rivven_throttled_raw"
    publish = pb.PublishRequest(topic=topic, record=pb.Record(value=WIRE_VALUE))
    consume = pb.ConsumeRequest(topic=topic, partition=0, offset=0)
    with Rivven(wire_server.ports["rivven"]) as rivven:
        rivven.handshake()
        rivven.ok(pb.CreateTopicRequest(name=topic, partitions=1), "create_topic")

        def until_served(request: pb.PublishRequest | pb.ConsumeRequest, times: int) -> list[Any]:
            """Send ``request`` until it is served ``times`` times, waiting out each
            throttled answer as the contract says; the throttled answers."""
            told = []
            while times:
                answer = rivven.call(request)
                if answer.HasField("throttled"):
                    told.append(answer.throttled)
                    # What the contract asks of a throttled client: wait as told.
                    time.sleep(answer.throttled.throttle_time_ms / 1000)
                else:
                    assert answer.HasField("publish") or answer.HasField("consume"), answer
                    times -= 1
            return told

        # Four of 100 kB at 200 kB/s, a second's burst: the fourth finds the tenant in debt.
        told = until_served(publish, 4)
        assert told and all(0 < t.throttle_time_ms <= 1000 for t in told), told
        assert {(t.quota_type, t.entity) for t in told} == {("produce_bytes_rate", "tenant:0")}
        bounds = rivven.ok(pb.GetOffsetBoundsRequest(topic=topic, partition=0), "get_offset_bounds")
        assert bounds.latest == 4  # the throttled publishes stored nothing

        # Each read of the 400 kB puts the tenant in debt for the next.
        told = until_served(consume, 2)
        assert told and {t.quota_type for t in told} == {"consume_bytes_rate"}, told


def test_a_throttled_kafka_producers_records_keep_the_order_it_sent(wire_server: Server) -> None:
    """A producer without idempotence, five requests in flight, 6,000 records of 100
    bytes in requests of three, against 200 kB/s: the requests that find the connection
    muted wait, and are then stored in the order they came, as Kafka (which reads nothing
    more from a muted channel) stores them. A request arriving just as the mute ended
    was once stored before the ones still waiting (2-4 records in 6,000 out of order)."""
    topic, count = "wire_kafka_order", 6_000
    with headwater.connect(wire_server.address) as hw:  # type: ignore[attr-defined]
        hw.create_stream(topic)
    producer = confluent_kafka.Producer(
        {
            "bootstrap.servers": wire_server.address_of("kafka"),
            "linger.ms": 0,
            "batch.num.messages": 3,
            "max.in.flight": 5,
            "enable.idempotence": False,
            "acks": 1,
        }
    )
    for i in range(count):
        while True:
            try:
                producer.produce(topic, f"{i:08d}".encode().ljust(100, b"."), partition=0)
                break
            except BufferError:  # the client's queue is full: let it send
                producer.poll(0.01)
    assert producer.flush(60) == 0
    assert ("0", "produce") in throttle_seconds(wire_server)  # the mute did hold requests
    consumer = confluent_kafka.Consumer(
        {"bootstrap.servers": wire_server.address_of("kafka"), "group.id": "order"}
    )
    consumer.assign([confluent_kafka.TopicPartition(topic, 0, 0)])
    stored: list[int] = []
    while len(stored) < count:
        message = consumer.poll(30)
        assert message is not None, f"only {len(stored)} of {count} records read"
        assert message.error() is None, message.error()
        stored.append(int(message.value()[:8]))
    consumer.close()
    assert stored == list(range(count))


def test_a_rivven_publish_gets_its_turn_while_another_client_keeps_the_tenant_at_its_rate(
    wire_server: Server,
) -> None:
    """A Kimberlite client appending 100 kB at a time waits its turns and keeps tenant 0
    in debt the whole time. A Rivven publish was refused as long as any debt was left:
    it was never stored while the other client wrote. Told its turn, it is served then."""
    with headwater.connect(wire_server.address) as hw:  # type: ignore[attr-defined]
        hw.create_stream("hog_turns")
        hw.create_stream("riv_turns")
    stop = threading.Event()
    appended: list[int] = []

    def hog() -> None:
        with headwater.connect(wire_server.address, timeout=120) as hw:  # type: ignore[attr-defined]
            while not stop.is_set():
                hw.append("hog_turns", [WIRE_VALUE])
                appended.append(1)

    writer = threading.Thread(target=hog, daemon=True)
    writer.start()
    try:
        wait_until(lambda: len(appended) >= 3, message="the hog never reached the rate")
        before = len(appended)
        with Producer(wire_server.address_of("rivven")) as producer:
            stored = producer.send("riv_turns", b"small").result(60)
        assert len(appended) > before  # the hog wrote on meanwhile: the tenant in debt
    finally:
        stop.set()
        writer.join(60)
    assert stored.offset == 0
