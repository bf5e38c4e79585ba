"""A cluster for a test: one real etcd and headwater nodes (real ``headwater serve``
processes through servers.Server), each node's state read back from etcd."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from servers import LOCAL, Server

from headwater.cluster.etcd import Etcd
from headwater.cluster.local import EtcdProcess
from headwater.cluster.status import cluster_status
from waiting import wait_until

LEASE_S = 3  # short, so failover tests are quick; docs/cluster.md reports the default's


class Cluster:
    def __init__(self, root: Path, etcd: EtcdProcess, lease_s: int = LEASE_S) -> None:
        self.root = root
        self.etcd = etcd
        self.lease_s = lease_s
        self.nodes: dict[int, Server] = {}

    def config(self, node_id: int, extra: str = "") -> str:
        return (
            f'[cluster]\nnode_id = {node_id}\netcd = ["{self.etcd.endpoint}"]\n'
            f"lease_s = {self.lease_s}\n{extra}"
        )

    def add(self, node_id: int, extra: str = "") -> Server:
        server = Server(
            self.root / f"node{node_id}",
            config=self.config(node_id, extra),
            listen={"kafka": LOCAL},
        )
        self.nodes[node_id] = server
        return server.start()

    def status(self) -> dict[str, Any]:
        async def read() -> dict[str, Any]:
            etcd = Etcd([self.etcd.endpoint])
            try:
                return await cluster_status(etcd)
            finally:
                await etcd.close()

        return asyncio.run(read())

    def partitions(self) -> dict[str, dict[str, Any]]:
        return {p["partition"]: p for p in self.status()["partitions"]}

    def wait_partitions(self, count: int) -> dict[str, dict[str, Any]]:
        return wait_until(
            lambda: (found := self.partitions()) and len(found) == count and found,
            message=lambda: f"not {count} partitions placed: {self.status()}",
        )

    def bootstrap(self) -> str:
        return ",".join(n.address_of("kafka") for n in self.nodes.values() if n.running)
