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
    for column in ("partition", "leader", "epoch", "replicas", "isr", "end", "lag"):
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
        )
    console.print(parts)
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
