#!/usr/bin/env python3
"""The added latency of an acknowledged Kimberlite append on a 3-node cluster (issue
20: every front end's append answered once the partition's in-sync replicas hold it)
against one node, in one run.

* **cluster**: etcd and three ``headwater serve`` nodes (``[cluster]``, replication
  factor 3, min_insync_replicas 2), stream ``acks_<n>`` (one partition) written through
  the Kimberlite SDK (``headwater.connect``), which follows the partition's leader; each
  append is answered once both followers hold it (docs/cluster.md, "Front ends");
* **single**: one ``headwater serve`` without ``[cluster]`` (answered after the fsync).

``--appends`` sequential appends (one in flight) of ``--events`` events of 100 B;
reported: appends/s and the append's p50 / p99. Rounds alternate between the systems
so the machine's load falls on both alike; the median round is reported, with the load
average.

    .venv/bin/python benchmarks/cluster_acks_bench.py
"""

from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path

import headwater
from benchlib import (
    HelpFormatter,
    cluster_and_single,
    cluster_vs_single,
    default_root,
    git_revision,
    log,
    pct,
    rounds_side_by_side,
)
from headwater.errors import StreamNotFound


def appends_round(address: str, appends: int, events: int) -> dict[str, float]:
    stream = f"acks_{uuid.uuid4().hex[:8]}"
    values = [b"a" * 100] * events
    with headwater.connect(address, retries=50) as client:
        client.create_stream(stream)
        # Until the stream is placed and its leader has taken its epoch, appends are
        # NotLeader, which the client waits out, and the leader the client moves to
        # may not have the stream yet (its next tick makes it): not measured.
        deadline = time.monotonic() + 60
        while True:
            try:
                client.append(stream, values)
                break
            except StreamNotFound:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        latencies = []
        started = time.perf_counter()
        for _ in range(appends):
            at = time.perf_counter()
            client.append(stream, values)
            latencies.append(time.perf_counter() - at)
        elapsed = time.perf_counter() - started
    return {
        "appends_per_s": appends / elapsed,
        "p50_ms": pct(latencies, 50) * 1000,
        "p99_ms": pct(latencies, 99) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--appends", type=int, default=1000)
    parser.add_argument("--events", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args()
    root = args.root or default_root("headwater-cluster-acks-bench-")
    log(f"data under {root}; revision {git_revision()}")
    with cluster_and_single(root) as (nodes, single):
        systems = {
            "single": f"127.0.0.1:{single.ports['kimberlite']}",
            "cluster": f"127.0.0.1:{nodes[0].ports['kimberlite']}",
        }
        medians, loads = rounds_side_by_side(
            systems,
            args.rounds,
            lambda address: appends_round(address, args.appends, args.events),
        )
        print(
            "| system | appends/s | append p50 / p99 ms |\n|---|--:|--:|\n"
            + "\n".join(
                f"| {name} | {m['appends_per_s']:,.1f} | {m['p50_ms']:.2f} / {m['p99_ms']:.2f} |"
                for name, m in medians.items()
            )
        )
        print(cluster_vs_single(medians, loads, "appends_per_s", "appends/s"))


if __name__ == "__main__":
    main()
