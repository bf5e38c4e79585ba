"""headwater_events_read_total and _bytes_read_total count what every front end gives
its clients: Kafka Fetches, Rivven Consumes and Kimberlite subscription pushes were not
counted (only Kimberlite ReadEvents, HTTP, Arrow and Kiwi were), so the dashboard's
reads per second missed most consumers."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition
from prometheus_client.parser import text_string_to_metric_families
from rivven_raw import Rivven
from servers import LOCAL, Server, serving

import headwater

DEADLINE_S = 30.0
VALUES = [b"one", b"two", b"three"]  # 11 bytes


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("read-metrics"),
        listen={"kimberlite": LOCAL, "kafka": LOCAL, "rivven": LOCAL, "http": LOCAL},
    )


def read_counters(server: Server, stream: str) -> tuple[float, float]:
    """(events, bytes) read of ``stream``, as /metrics says."""
    with urllib.request.urlopen(f"http://{server.address_of('http')}/metrics") as answer:
        text = answer.read().decode()
    found = {"headwater_events_read_total": 0.0, "headwater_bytes_read_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found and sample.labels.get("stream") == stream:
                found[sample.name] = sample.value
    return found["headwater_events_read_total"], found["headwater_bytes_read_total"]


def stream_of(server: Server, name: str) -> str:
    with headwater.connect(server.address) as client:
        client.create_stream(name)
        client.append(name, VALUES)
    return name


def test_a_kafka_fetch_counts_what_it_gave(server: Server) -> None:
    name = stream_of(server, "by_kafka")
    consumer = Consumer(
        {
            "bootstrap.servers": server.address_of("kafka"),
            "group.id": name,
            "enable.partition.eof": True,
        }
    )
    consumer.assign([TopicPartition(name, 0, 0)])
    got = []
    while True:
        message = consumer.poll(DEADLINE_S)
        assert message is not None, f"no answer after {got}"
        if message.error() is not None:
            assert message.error().code() == KafkaError._PARTITION_EOF
            break
        got.append(message.value())
    consumer.close()
    assert got == VALUES
    events, value_bytes = read_counters(server, name)
    assert events == 3 and value_bytes > 0  # a fetch's bytes: the stored batches'


def test_a_rivven_consume_counts_what_it_gave(server: Server) -> None:
    name = stream_of(server, "by_rivven")
    with Rivven(server.ports["rivven"]) as rivven:
        answer = rivven.consume(name, 0)
    assert [r.value for r in answer.records] == VALUES
    assert read_counters(server, name) == (3, 11)


def test_kimberlite_pushes_count_what_they_gave(server: Server) -> None:
    name = stream_of(server, "by_push")
    with headwater.connect(server.address) as client:
        subscription = client.subscribe(name, from_offset=0)
        got = [subscription.next(timeout=DEADLINE_S) for _ in VALUES]
        subscription.close()
    assert [event.value for event in got if event is not None] == VALUES
    assert read_counters(server, name) == (3, 11)
