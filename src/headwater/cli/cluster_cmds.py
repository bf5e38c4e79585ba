"""``headwater cluster status``: the cluster as etcd holds it (docs/cluster.md).

It asks etcd, not a node: the answer is the same whichever node is up, and it shows
the cluster while nodes are down."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from headwater.cluster.etcd import Etcd, EtcdError
from headwater.cluster.layout import PartitionKey, PartitionState
from headwater.cluster.reassign import ReassignError, request_reassignment, wait_reassigned
from headwater.cluster.status import cluster_status


def cmd_cluster_status(args: argparse.Namespace) -> int:
    async def read() -> dict[str, Any]:
        etcd = Etcd(args.etcd.split(","))
        try:
            return await cluster_status(etcd, args.prefix)
        finally:
            await etcd.close()

    try:
        status = asyncio.run(read())
    except EtcdError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    if args.json:
        sys.stdout.write(json.dumps(status) + "\n")
        return 0
    console = Console()
    nodes = Table(title=f"nodes (controller: {status['controller']})")
    for column in ("node", "host", "rack", "ports"):
        nodes.add_column(column)
    for node in status["nodes"]:
        ports = " ".join(f"{name}={port}" for name, port in sorted(node["ports"].items()))
        nodes.add_row(str(node["node_id"]), node["host"], node["rack"] or "", ports)
    console.print(nodes)
    parts = Table(title="partitions")
    for column in ("partition", "leader", "epoch", "replicas", "isr", "end", "lag", "moving to"):
        parts.add_column(column)
    for part in status["partitions"]:
        lag = " ".join(
            f"{node}:{'?' if behind is None else behind}" for node, behind in part["lag"].items()
        )
        parts.add_row(
            part["partition"],
            "none" if part["leader"] < 0 else str(part["leader"]),
            str(part["epoch"]),
            ",".join(map(str, part["replicas"])),
            ",".join(map(str, part["isr"])),
            "?" if part["end"] is None else str(part["end"]),
            lag,
            ",".join(map(str, part["reassigning"] or [])),
        )
    console.print(parts)
    return 0


def cmd_cluster_reassign(args: argparse.Namespace) -> int:
    key = PartitionKey(args.tenant, args.stream, args.partition)
    try:
        replicas = [int(n) for n in args.replicas.split(",")]
    except ValueError:
        sys.stderr.write(f"error: --replicas must be node ids like 4,2,3, got {args.replicas}\n")
        return 2

    async def run() -> tuple[PartitionState, PartitionState | None]:
        etcd = Etcd(args.etcd.split(","))
        try:
            before = await request_reassignment(etcd, key, replicas, args.prefix)
            done = None
            if args.wait:
                done = await wait_reassigned(etcd, key, args.wait, args.prefix)
            return before, done
        finally:
            await etcd.close()

    try:
        before, done = asyncio.run(run())
    except (EtcdError, ReassignError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    target = ",".join(map(str, replicas))
    sys.stdout.write(
        f"{key.path()}: replicas {','.join(map(str, before.replicas))} -> {target} requested\n"
    )
    if args.wait:
        if done is None:
            sys.stderr.write(f"error: not done within {args.wait:g} s (it goes on)\n")
            return 1
        sys.stdout.write(
            f"{key.path()}: done: replicas {','.join(map(str, done.replicas))}, "
            f"leader {done.leader}, isr {','.join(map(str, done.isr))}\n"
        )
    return 0


def add_cluster_commands(sub: Any) -> None:
    cluster = sub.add_parser("cluster", help="a replicated cluster's state (from etcd)")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    p = cluster_sub.add_parser("status", help="nodes, partitions, leaders, ISR and lag")
    p.add_argument(
        "--etcd",
        default="127.0.0.1:2379",
        help="etcd endpoints, comma-separated (default 127.0.0.1:2379)",
    )
    p.add_argument("--prefix", default="/headwater/", help="the cluster's etcd key prefix")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(func=cmd_cluster_status)
    p = cluster_sub.add_parser(
        "reassign",
        help="move a partition's replicas (e.g. onto a new node): new ones copied first",
    )
    p.add_argument("--etcd", default="127.0.0.1:2379", help="etcd endpoints, comma-separated")
    p.add_argument("--prefix", default="/headwater/", help="the cluster's etcd key prefix")
    p.add_argument("--tenant", type=int, default=0, help="the stream's tenant id (default 0)")
    p.add_argument("--stream", required=True, help="the stream (Kafka topic)")
    p.add_argument("--partition", type=int, required=True)
    p.add_argument(
        "--replicas",
        required=True,
        help="the target replicas, node ids comma-separated, the preferred leader first",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=0,
        metavar="SECONDS",
        help="wait up to this long for the move to finish (default: just request it)",
    )
    p.set_defaults(func=cmd_cluster_reassign)
