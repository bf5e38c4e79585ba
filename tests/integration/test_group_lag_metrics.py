"""``headwater_consumer_group_lag`` per partition at /metrics and the dashboard's
consumer-group route for partitioned (Kafka) groups, against a real server with tenant
tokens (docs/operations.md, "Metrics"; docs/http-api.md): each committed partition's
gauge is its end offset minus the committed offset, another tenant's token sees none of
it, and the lag is still exported after a restart, before any group client returns."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families
from servers import LOCAL, Server, serving

TENANT0_TOKEN = "tok-lag-zero-1a2b"
TENANT1_TOKEN = "tok-lag-one-3c4d"
CONFIG = f"""
[[tenants]]
id = 1
name = "other"

[auth]
required = true
[[auth.tokens]]
token = "{TENANT0_TOKEN}"
tenants = [0]
[[auth.tokens]]
token = "{TENANT1_TOKEN}"
tenants = [1]
"""
PARTITIONS = 3
EVENTS_PER_PARTITION = (5, 7, 4)
COMMITTED = (2, 7, 1)  # partition 1 fully consumed: lag 0
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("group_lag")
    yield from serving(root, config=CONFIG, listen={"http": LOCAL, "kafka": LOCAL})


def kafka_config(server: Server, token: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": server.address_of("kafka"),
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "u",
        "sasl.password": token,
    }


def get(server: Server, path: str, token: str, tenant: int = 0) -> Any:
    req = urllib.request.Request(f"http://{server.address_of('http')}{path}")
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("X-Headwater-Tenant", str(tenant))
    with urllib.request.urlopen(req, timeout=15) as answer:
        body = answer.read()
        return body.decode() if path == "/metrics" else json.loads(body)


def lags(server: Server, token: str, group: str) -> dict[tuple[str, str, str], float]:
    """(tenant, stream, partition) -> headwater_consumer_group_lag of ``group``."""
    out: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(get(server, "/metrics", token)):
        for sample in family.samples:
            if sample.name == "headwater_consumer_group_lag" and sample.labels["group"] == group:
                labels = sample.labels
                out[(labels["tenant"], labels["stream"], labels["partition"])] = sample.value
    return out


def committed_group(server: Server) -> tuple[str, str]:
    """A 3-partition topic of tenant 0 with EVENTS_PER_PARTITION events and a group that
    committed COMMITTED offsets (outside group management, as a tool would)."""
    config = kafka_config(server, TENANT0_TOKEN)
    topic, group = "lag_" + uuid.uuid4().hex[:10], "billing_" + uuid.uuid4().hex[:6]
    admin = AdminClient(config)
    futures = admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS)])
    futures[topic].result(timeout=DEADLINE_S)
    producer = Producer(config)
    for partition, count in enumerate(EVENTS_PER_PARTITION):
        for n in range(count):
            producer.produce(topic, value=f"{partition}-{n}".encode(), partition=partition)
    assert producer.flush(DEADLINE_S) == 0
    consumer = Consumer({**config, "group.id": group, "enable.auto.commit": False})
    try:
        offsets = [TopicPartition(topic, p, o) for p, o in enumerate(COMMITTED)]
        answered = consumer.commit(offsets=offsets, asynchronous=False)
        assert answered is not None and all(tp.error is None for tp in answered), answered
    finally:
        consumer.close()
    return topic, group


def expected(topic: str) -> dict[tuple[str, str, str], float]:
    return {
        ("0", topic, str(p)): float(end - done)
        for p, (end, done) in enumerate(zip(EVENTS_PER_PARTITION, COMMITTED, strict=True))
    }


def test_lag_per_partition_at_metrics_and_dashboard_scoped_by_tenant(server: Server) -> None:
    topic, group = committed_group(server)
    assert lags(server, TENANT0_TOKEN, group) == expected(topic)
    assert lags(server, TENANT1_TOKEN, group) == {}

    answer = get(server, "/api/consumer-groups", TENANT0_TOKEN)
    mine = [p for p in answer["partition_groups"] if p["group"] == group]
    assert mine == [
        {
            "group": group,
            "stream": topic,
            "partition": p,
            "committed_offset": COMMITTED[p],
            "end_offset": EVENTS_PER_PARTITION[p],
            "lag": EVENTS_PER_PARTITION[p] - COMMITTED[p],
        }
        for p in range(PARTITIONS)
    ]
    other = get(server, "/api/consumer-groups", TENANT1_TOKEN, tenant=1)
    assert all(p["group"] != group for p in other["partition_groups"])

    # The lag follows the log: three more events on partition 0.
    producer = Producer(kafka_config(server, TENANT0_TOKEN))
    for n in range(3):
        producer.produce(topic, value=b"more-%d" % n, partition=0)
    assert producer.flush(DEADLINE_S) == 0
    assert lags(server, TENANT0_TOKEN, group)[("0", topic, "0")] == EVENTS_PER_PARTITION[0] + 3 - 2


def test_lag_is_exported_after_a_restart(server: Server) -> None:
    topic, group = committed_group(server)
    server.restart()
    # No Kafka client has connected since: the offsets were loaded as the server opened.
    assert lags(server, TENANT0_TOKEN, group) == expected(topic)


def test_unknown_token_still_refused(server: Server) -> None:
    with pytest.raises(urllib.error.HTTPError) as refused:
        get(server, "/metrics", "tok-nobody")
    assert refused.value.code == 401
