#!/usr/bin/env python3
"""What ``[tls]`` costs a replicated cluster's produce (issue 17), in one run.

Two 2-node clusters side by side (replication_factor 2, min_insync_replicas 2, both with
``[cluster] secret``), each on its own etcd:

* **plain**: the Kafka listener and the replication listener over TCP;
* **mtls**: ``[tls]`` with ``client_ca``: the Kafka client speaks mutual TLS to the
  leader and the follower fetches over mutual TLS.

The same client for both: confluent-kafka, acks=all, linger.ms 5, ``--messages`` values
of ``--size`` bytes to partition 0, from the first produce() to flush() returning.
Rounds alternate between the clusters so the machine's load falls on both alike; the
median round of each is reported, with the load average.

    .venv/bin/python benchmarks/cluster_tls_bench.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import trustme
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from benchlib import HeadwaterServer, HelpFormatter, default_root, git_revision, loadavg, log
from headwater.cluster.local import EtcdProcess

SECRET = "bench-cluster-secret-0123456789"


def start_cluster(root: Path, name: str, tls: str) -> tuple[EtcdProcess, list[HeadwaterServer]]:
    etcd = EtcdProcess(root / f"etcd-{name}").start()
    nodes = []
    for node_id in (1, 2):
        node = HeadwaterServer(name=f"{name}{node_id}")
        (root / f"{name}{node_id}").mkdir(parents=True, exist_ok=True)
        node.start(
            root / f"{name}{node_id}",
            f'[cluster]\nnode_id = {node_id}\netcd = ["{etcd.endpoint}"]\n'
            f'replication_factor = 2\nmin_insync_replicas = 2\nsecret = "{SECRET}"\n{tls}',
            listeners=("kafka",),
        )
        nodes.append(node)
    return etcd, nodes


def produce_mb_per_s(conf: dict[str, Any], messages: int, size: int) -> float:
    producer = Producer({**conf, "acks": "all", "linger.ms": 5})
    value = b"v" * size
    started = time.monotonic()
    for _ in range(messages):
        producer.produce("events", value, partition=0)
        producer.poll(0)
    if producer.flush(300) != 0:
        raise RuntimeError("messages left unacknowledged")
    return messages * size / (time.monotonic() - started) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    root = default_root("headwater-cluster-tls-")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    leaf = ca.issue_cert("127.0.0.1")
    leaf.private_key_and_cert_chain_pem.write_to_path(str(root / "node.pem"))
    pem, ca_pem = root / "node.pem", root / "ca.pem"
    tls = f'[tls]\ncert = "{pem}"\nkey = "{pem}"\nclient_ca = "{ca_pem}"\n'
    client_tls = {
        "security.protocol": "SSL",
        "ssl.ca.location": str(ca_pem),
        "ssl.certificate.location": str(pem),
        "ssl.key.location": str(pem),
    }
    clusters: dict[str, tuple[EtcdProcess, list[HeadwaterServer], dict[str, Any]]] = {}
    try:
        for name, config, client in (("plain", "", {}), ("mtls", tls, client_tls)):
            etcd, nodes = start_cluster(root, name, config)
            conf = {"bootstrap.servers": f"127.0.0.1:{nodes[0].ports['kafka']}", **client}
            admin = AdminClient(conf)
            admin.create_topics([NewTopic("events", 1, -1)])["events"].result(60)
            clusters[name] = (etcd, nodes, conf)
            produce_mb_per_s(conf, 20, args.size)  # warm up: leader elected, ISR full
        results: dict[str, list[float]] = {name: [] for name in clusters}
        loads = [loadavg()[0]]
        for _ in range(args.rounds):
            for name, (_, _, conf) in clusters.items():
                results[name].append(produce_mb_per_s(conf, args.messages, args.size))
            loads.append(loadavg()[0])
        medians = {name: statistics.median(r) for name, r in results.items()}
        print(f"revision {git_revision()}, load {min(loads):.1f}-{max(loads):.1f}")
        for name, rounds in results.items():
            print(
                f"{name:6} MB/s median {medians[name]:.1f} rounds {[round(r, 1) for r in rounds]}"
            )
        print(f"mtls / plain: {medians['mtls'] / medians['plain']:.2f}")
    finally:
        for etcd, nodes, _ in clusters.values():
            for node in nodes:
                node.stop()
            etcd.kill()
        log(f"data under {root}")


if __name__ == "__main__":
    main()
