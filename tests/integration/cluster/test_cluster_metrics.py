"""Per-replica metrics at /metrics (docs/cluster.md, "Metrics"): read from a real
cluster whose follower is paused (SIGSTOP) until it leaves the ISR, then resumed."""

from __future__ import annotations

import os
import signal
import urllib.request

import pytest
from cluster_nodes import WAIT_S, Cluster
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families
from servers import Server
from test_cluster_membership import create_topic

from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TOPIC = "events"
PARTITION = {"tenant": "0", "stream": TOPIC, "partition": "0"}


def scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every headwater_replica_* and under-replicated sample, by name and labels."""
    url = f"http://127.0.0.1:{server.ports['http']}/metrics"
    with urllib.request.urlopen(url, timeout=15) as answer:
        text = answer.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith(("headwater_replica_", "headwater_under_replicated"))
        for sample in family.samples
    }


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float | None:  # fmt: skip
    return samples.get((name, tuple(sorted(labels.items()))))


def produce(bootstrap: str, count: int, start: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "acks": 1})
    for n in range(start, start + count):
        producer.produce(TOPIC, b"m%06d" % n, partition=0)
    assert producer.flush(30) == 0


def test_replica_metrics_show_a_paused_follower(cluster: Cluster) -> None:
    for node_id in (1, 2, 3):
        cluster.add(node_id, "replica_lag_s = 2\n", http=True)
    create_topic(cluster.nodes[1].address_of("kafka"), TOPIC, 1)
    part = cluster.wait_partitions(1)[f"0/{TOPIC}/0"]
    leader_id = part["leader"]
    leader = cluster.nodes[leader_id]
    follower_id = next(n for n in part["replicas"] if n != leader_id)
    follower = cluster.nodes[follower_id]
    produce(leader.address_of("kafka"), 100, 0)

    def settled(server: Server, hw: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        samples = scrape(server)
        end = value(samples, "headwater_replica_log_end_offset", **PARTITION)
        high = value(samples, "headwater_replica_high_watermark", **PARTITION)
        return samples if end == high == hw else {}

    samples = wait_until(lambda: settled(leader, 100), timeout=WAIT_S)
    assert value(samples, "headwater_replica_leader", **PARTITION) == 1
    assert value(samples, "headwater_replica_isr_size", **PARTITION) == 3
    assert value(samples, "headwater_replica_replicas", **PARTITION) == 3
    assert value(samples, "headwater_under_replicated_partitions") == 0
    lag = "headwater_replica_follower_lag_records"
    assert value(samples, lag, follower=str(follower_id), **PARTITION) == 0
    # The follower answers too, as a follower, with the leader's high watermark.
    theirs = wait_until(lambda: settled(follower, 100), timeout=WAIT_S)
    assert value(theirs, "headwater_replica_leader", **PARTITION) == 0
    assert value(theirs, "headwater_under_replicated_partitions") == 0

    os.kill(follower.pid, signal.SIGSTOP)
    try:
        produce(leader.address_of("kafka"), 50, 100)  # acks=1: the leader alone
        # Behind by the 50, then out of the ISR after replica_lag_s: under-replicated.
        samples = wait_until(
            lambda: (
                (s := scrape(leader))
                and value(s, "headwater_under_replicated_partitions") == 1
                and s
            ),
            timeout=WAIT_S,
            message=lambda: str(scrape(leader)),
        )
        assert value(samples, lag, follower=str(follower_id), **PARTITION) == 50
        seconds = "headwater_replica_follower_lag_seconds"
        assert value(samples, seconds, follower=str(follower_id), **PARTITION) >= 2  # type: ignore[operator]
        assert value(samples, "headwater_replica_isr_size", **PARTITION) == 2
        assert value(samples, "headwater_replica_log_end_offset", **PARTITION) == 150
    finally:
        os.kill(follower.pid, signal.SIGCONT)
    samples = wait_until(
        lambda: (
            (s := scrape(leader)) and value(s, "headwater_under_replicated_partitions") == 0 and s
        ),
        timeout=WAIT_S,
        message=lambda: str(scrape(leader)),
    )
    assert value(samples, "headwater_replica_isr_size", **PARTITION) == 3
    assert value(samples, lag, follower=str(follower_id), **PARTITION) == 0
    assert value(samples, "headwater_replica_high_watermark", **PARTITION) == 150
