#!/usr/bin/env python3
"""The added latency of an acknowledged entity write on a 3-node cluster (issue 20: a
kind's changelog is a replicated partition, a window ACKed once its in-sync replicas
hold it) against one node, in one run.

* **cluster**: etcd and three ``headwater serve`` nodes (``[cluster]``, replication
  factor 3, min_insync_replicas 2); kind ``bench_<n>`` created through node 1 and
  written through the entities SDK connected to the kind's leader (the SDK does not
  follow it: the address is taken from the first refusal, as a user would); each flush
  is answered once both followers hold the window (docs/cluster.md, "Entity kinds
  across the cluster");
* **single**: one ``headwater serve`` without ``[cluster]`` (answered after the fsync).

``--flushes`` sequential writes of ``--entities`` ASSERTs each, then ``flush()`` (one
window, durable and visible); reported: flushes/s and the flush's p50 / p99 (a flush
refused because the leadership moved is not counted: the writer finds the new leader,
and ``moves`` says how often). Rounds alternate between the systems so the machine's
load falls on both alike; the median round is reported, with the load average.

    .venv/bin/python benchmarks/cluster_kinds_bench.py
"""

from __future__ import annotations

import argparse
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

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
from headwater import entities
from headwater.entities import EntityError


@dataclass
class Reading:
    temp: float
    site: str


def leader_address(address: str, name: str) -> str:
    """Where the kind's writes go: ``address`` when it takes them, else the ConvergeDB
    address its refusal names (waiting out an election)."""
    deadline = time.monotonic() + 60
    while True:
        with entities.connect(address, name="probe") as probe:
            kind = probe.get_kind(Reading, name)
            try:
                probe.assert_(kind, "probe", Reading(0.0, "probe"))
                probe.flush()
                return address
            except EntityError as exc:
                found = re.search(r"convergedb (\S+?),", str(exc))
                if found is not None:
                    return found.group(1)
                if time.monotonic() > deadline:
                    raise
        time.sleep(0.2)


def flushes_round(address: str, flushes: int, count: int) -> dict[str, float]:
    name = f"bench_{uuid.uuid4().hex[:8]}"
    with entities.connect(address, name="setup") as setup:
        setup.create_kind(Reading, name)
    latencies: list[float] = []
    moves = 0
    started = time.perf_counter()
    while len(latencies) < flushes:
        target = leader_address(address, name)
        with entities.connect(target, name="writer") as writer:
            kind = writer.get_kind(Reading, name)
            try:
                while len(latencies) < flushes:
                    at = time.perf_counter()
                    for i in range(count):
                        writer.assert_(kind, f"e{i}", Reading(float(len(latencies)), "site"))
                    writer.flush()
                    latencies.append(time.perf_counter() - at)
            except EntityError as exc:
                # The leadership moved (on a loaded machine a node's lease may lapse):
                # that flush is not counted; the writer moves to the new leader.
                log(f"flush refused ({exc}); finding the leader again")
                moves += 1
    elapsed = time.perf_counter() - started
    return {
        "flushes_per_s": flushes / elapsed,
        "p50_ms": pct(latencies, 50) * 1000,
        "p99_ms": pct(latencies, 99) * 1000,
        "moves": moves,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--flushes", type=int, default=300)
    parser.add_argument("--entities", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args()
    root = args.root or default_root("headwater-cluster-kinds-bench-")
    log(f"data under {root}; revision {git_revision()}")
    with cluster_and_single(root, listeners=("convergedb", "kafka")) as (nodes, single):
        systems = {
            "single": f"127.0.0.1:{single.ports['convergedb']}",
            "cluster": f"127.0.0.1:{nodes[0].ports['convergedb']}",
        }
        medians, loads = rounds_side_by_side(
            systems,
            args.rounds,
            lambda address: flushes_round(address, args.flushes, args.entities),
        )
        print(
            "| system | flushes/s | flush p50 / p99 ms | moves |\n|---|--:|--:|--:|\n"
            + "\n".join(
                f"| {name} | {m['flushes_per_s']:,.1f} | {m['p50_ms']:.2f} / {m['p99_ms']:.2f}"
                f" | {m['moves']:.0f} |"
                for name, m in medians.items()
            )
        )
        print(cluster_vs_single(medians, loads, "flushes_per_s", "flushes/s"))


if __name__ == "__main__":
    main()
