#!/usr/bin/env python3
"""Kafka transactions through a replicated cluster against one node (issue 20), in one
run.

* **cluster**: etcd and three ``headwater serve`` nodes (``[cluster]``, replication
  factor 3), a 2-partition topic whose leaders are two different nodes; the
  transaction coordinator (the leader of ``hw_transaction_state``) writes its state
  with acks=all and asks each partition's leader for its marker
  (docs/cluster.md, "Transactions across the cluster");
* **single**: one ``headwater serve`` without ``[cluster]``.

The same client for both: a confluent-kafka transactional producer,
``--transactions`` transactions of ``--records`` records of 100 B alternately to the
two partitions, each begin / produce / commit_transaction; reported: transactions per
second and commit_transaction's p50 / p99 (the end's latency: the state records and
the markers). Rounds alternate between the systems so the machine's load falls on both
alike; the median round is reported, with the load average.

    .venv/bin/python benchmarks/cluster_txn_bench.py
"""

from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path

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


def transactions_round(
    bootstrap: str, topic: str, transactions: int, records: int
) -> dict[str, float]:
    producer = Producer(
        {"bootstrap.servers": bootstrap, "transactional.id": f"bench-{uuid.uuid4().hex[:8]}"}
    )
    producer.init_transactions(60)
    value = b"t" * 100
    commits = []
    started = time.perf_counter()
    for _ in range(transactions):
        producer.begin_transaction()
        for i in range(records):
            producer.produce(topic, value, partition=i % 2)
        producer.flush(60)
        at = time.perf_counter()
        producer.commit_transaction(60)
        commits.append(time.perf_counter() - at)
    elapsed = time.perf_counter() - started
    return {
        "txn_per_s": transactions / elapsed,
        "commit_p50_ms": pct(commits, 50) * 1000,
        "commit_p99_ms": pct(commits, 99) * 1000,
    }


def ready_topic(bootstrap: str, topic: str) -> None:
    """Create the 2-partition topic and produce to both until acknowledged (a cluster
    places the partitions within a tick or two)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
    producer = Producer(
        {"bootstrap.servers": bootstrap, "acks": "all", "message.timeout.ms": 30_000}
    )
    for partition in (0, 1):
        producer.produce(topic, b"warm-up", partition=partition)
    assert producer.flush(40) == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--transactions", type=int, default=200)
    parser.add_argument("--records", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args()
    root = args.root or default_root("headwater-cluster-txn-bench-")
    log(f"data under {root}; revision {git_revision()}")
    with cluster_and_single(root) as (nodes, single):
        systems = {
            "single": f"127.0.0.1:{single.ports['kafka']}",
            "cluster": ",".join(f"127.0.0.1:{n.ports['kafka']}" for n in nodes),
        }

        def run_round(bootstrap: str) -> dict[str, float]:
            topic = f"txn_{uuid.uuid4().hex[:8]}"
            ready_topic(bootstrap, topic)
            return transactions_round(bootstrap, topic, args.transactions, args.records)

        medians, loads = rounds_side_by_side(systems, args.rounds, run_round)
        print(
            "| system | transactions/s | commit p50 / p99 ms |\n|---|--:|--:|\n"
            + "\n".join(
                f"| {name} | {m['txn_per_s']:,.1f} |"
                f" {m['commit_p50_ms']:.1f} / {m['commit_p99_ms']:.1f} |"
                for name, m in medians.items()
            )
        )
        rate = medians["cluster"]["txn_per_s"] / medians["single"]["txn_per_s"]
        p50 = medians["cluster"]["commit_p50_ms"] / medians["single"]["commit_p50_ms"]
        print(
            f"cluster / single: transactions/s {rate:.2f}x, commit p50 {p50:.2f}x; "
            f"load average {min(loads):.1f}-{max(loads):.1f}"
        )


if __name__ == "__main__":
    main()
