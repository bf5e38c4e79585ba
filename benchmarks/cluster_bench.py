#!/usr/bin/env python3
"""Produce through a replicated cluster against one node (issue 20), in one run.

* **cluster**: etcd and three ``headwater serve`` nodes (``[cluster]``,
  replication_factor 3, min_insync_replicas 2), the topic's one partition led by one
  node and copied by two followers; acks=all waits until every in-sync replica has a
  batch;
* **single**: one ``headwater serve`` without ``[cluster]`` (acks=all is the node alone).

The same client for both: confluent-kafka, ``acks=all``, idempotence, ``linger.ms`` 5,
``--messages`` values of ``--size`` bytes to partition 0, from the first produce() to
flush() returning (the queued latency: each message's produce() to its delivery
report, mostly time waiting in the client's queue); then ``--latency-messages`` sent
one at a time (linger 0, each flushed): the latency of one acknowledged write. Rounds
alternate between the systems so the machine's load falls on both alike; the median
round is reported, with the load average.

    .venv/bin/python benchmarks/cluster_bench.py
"""

from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from benchlib import (
    HelpFormatter,
    cluster_and_single,
    default_root,
    git_revision,
    log,
    pct,
    rounds_side_by_side,
)


def produce_round(bootstrap: str, topic: str, messages: int, size: int) -> dict[str, float]:
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 5,
        }
    )
    value = b"x" * size
    sent_at: list[float] = [0.0] * messages
    latencies: list[float] = []
    failures: list[str] = []

    def delivered(err: Any, message: Any) -> None:
        if err is not None:
            failures.append(str(err))
            return
        latencies.append(time.perf_counter() - sent_at[int(message.key())])

    started = time.perf_counter()
    for i in range(messages):
        while True:
            try:
                sent_at[i] = time.perf_counter()
                producer.produce(
                    topic, value, key=str(i).encode(), partition=0, on_delivery=delivered
                )
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    assert producer.flush(120) == 0
    elapsed = time.perf_counter() - started
    if failures:
        raise RuntimeError(f"{len(failures)} messages failed: {failures[:3]}")
    return {
        "msgs_per_s": messages / elapsed,
        "p50_ms": pct(latencies, 50) * 1000,
        "p99_ms": pct(latencies, 99) * 1000,
    }


def latency_round(bootstrap: str, topic: str, messages: int, size: int) -> dict[str, float]:
    """One message at a time (linger 0), each waited for: produce() to delivery."""
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all",
                         "enable.idempotence": True, "linger.ms": 0})  # fmt: skip
    value = b"y" * size
    latencies = []
    for _ in range(messages):
        started = time.perf_counter()
        producer.produce(topic, value, partition=0)
        assert producer.flush(30) == 0
        latencies.append(time.perf_counter() - started)
    return {"one_p50_ms": pct(latencies, 50) * 1000, "one_p99_ms": pct(latencies, 99) * 1000}


def ready_topic(bootstrap: str, topic: str) -> None:
    """Create the topic and produce until a message is acknowledged (a cluster places
    the partition and its leader takes its epoch within a tick or two)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    producer = Producer(
        {"bootstrap.servers": bootstrap, "acks": "all", "message.timeout.ms": 30_000}
    )
    producer.produce(topic, b"warm-up", partition=0)
    assert producer.flush(40) == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency-messages", type=int, default=300)
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args()
    root = args.root or default_root("headwater-cluster-bench-")
    log(f"data under {root}; revision {git_revision()}")
    with cluster_and_single(root) as (nodes, single):
        systems = {
            "single": f"127.0.0.1:{single.ports['kafka']}",
            "cluster": ",".join(f"127.0.0.1:{n.ports['kafka']}" for n in nodes),
        }

        def run_round(bootstrap: str) -> dict[str, float]:
            topic = f"bench_{uuid.uuid4().hex[:8]}"
            ready_topic(bootstrap, topic)
            result = produce_round(bootstrap, topic, args.messages, args.size)
            return result | latency_round(bootstrap, topic, args.latency_messages, args.size)

        medians, loads = rounds_side_by_side(systems, args.rounds, run_round)
        print(
            "| system | messages/s | queued p50 / p99 ms | one at a time p50 / p99 ms |\n"
            "|---|--:|--:|--:|\n"
            + "\n".join(
                f"| {name} | {m['msgs_per_s']:,.0f} | {m['p50_ms']:.0f} / {m['p99_ms']:.0f} |"
                f" {m['one_p50_ms']:.1f} / {m['one_p99_ms']:.1f} |"
                for name, m in medians.items()
            )
        )
        ratio = medians["cluster"]["msgs_per_s"] / medians["single"]["msgs_per_s"]
        p99 = medians["cluster"]["one_p99_ms"] / medians["single"]["one_p99_ms"]
        print(
            f"cluster / single: throughput {ratio:.2f}x, p99 {p99:.2f}x; "
            f"load average {min(loads):.1f}-{max(loads):.1f}"
        )


if __name__ == "__main__":
    main()
