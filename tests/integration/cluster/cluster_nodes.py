"""A cluster for a test: one real etcd and headwater nodes (real ``headwater serve``
processes through servers.Server), each node's state read back from etcd."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, cast

from servers import LOCAL, Server

from headwater.cluster.etcd import Etcd
from headwater.cluster.local import EtcdProcess
from headwater.cluster.status import cluster_status
from waiting import wait_until

LEASE_S = 3  # short, so failover tests are quick; docs/cluster.md reports the default's
# Every cluster wait's deadline: a lease to expire, replica_lag_s (10 s) to drop a dead
# follower, then an election, on a loaded 2-core CI machine. A bound, never a pace: the
# waits end at their event.
WAIT_S = 60.0


class Cluster:
    def __init__(self, root: Path, etcd: EtcdProcess, lease_s: int = LEASE_S) -> None:
        self.root = root
        self.etcd = etcd
        self.lease_s = lease_s
        self.nodes: dict[int, Server] = {}
        self.stream = "events"  # the stream wait_replicas_agree looks at

    def config(self, node_id: int, extra: str = "", etcd: str | None = None) -> str:
        return (
            f'[cluster]\nnode_id = {node_id}\netcd = ["{etcd or self.etcd.endpoint}"]\n'
            f"lease_s = {self.lease_s}\n{extra}"
        )

    def add(
        self,
        node_id: int,
        extra: str = "",
        etcd: str | None = None,
        http: bool = False,
        rivven: bool = False,
    ) -> Server:
        """Node ``node_id`` started; ``etcd``: the endpoint it reaches etcd at (a proxy);
        ``http``: its HTTP listener on too (/metrics); ``rivven``: its Rivven one."""
        server = Server(
            self.root / f"node{node_id}",
            config=self.config(node_id, extra, etcd),
            listen={
                "kafka": LOCAL,
                **({"http": LOCAL} if http else {}),
                **({"rivven": LOCAL} if rivven else {}),
            },
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

    def status_node(self, node_id: int) -> dict[str, Any]:
        return next(n for n in self.status()["nodes"] if n["node_id"] == node_id)

    def partitions(self) -> dict[str, dict[str, Any]]:
        return {p["partition"]: p for p in self.status()["partitions"]}

    def wait_partitions(self, count: int) -> dict[str, dict[str, Any]]:
        return wait_until(
            lambda: (found := self.partitions()) and len(found) == count and found,
            message=lambda: f"not {count} partitions placed: {self.status()}",
            timeout=WAIT_S,
        )

    def log_files(
        self, node_id: int, partition: int = 0, stream: str | None = None
    ) -> dict[str, bytes]:
        """The segment files of one replica (tenant 0; ``stream``: the one
        wait_replicas_agree looks at), by name. Found by name: a stream's id differs
        between nodes (each numbers its streams as it creates them, internal ones too)."""
        name = stream or self.stream
        streams = self.nodes[node_id].data_dir / "tenants/0/streams"
        for meta in streams.glob("*/stream.json"):
            if json.loads(meta.read_text()).get("name") == name:
                directory = meta.parent / f"partition-{partition}"
                return {p.name: p.read_bytes() for p in sorted(directory.glob("*.log"))}
        return {}

    def stream_meta(self, node_id: int, name: str) -> dict[str, Any] | None:
        """The stream.json of node ``node_id``'s copy of stream ``name`` (tenant 0), None
        while it has none."""
        streams = self.nodes[node_id].data_dir / "tenants/0/streams"
        for meta in streams.glob("*/stream.json"):
            stored = json.loads(meta.read_text())
            if stored.get("name") == name:
                return cast(dict[str, Any], stored)
        return None

    def wait_replicas_agree(self, node_ids: list[int], end: int) -> dict[str, bytes]:
        """Every listed replica holds the same bytes (and reports ``end``)."""

        def agree() -> dict[str, bytes] | None:
            files = [self.log_files(n) for n in node_ids]
            if any(f != files[0] for f in files) or not files[0]:
                return None
            part = self.partitions()["0/" + self.stream + "/0"]
            lags = [part["lag"].get(str(n)) for n in node_ids]
            return files[0] if part["end"] == end and lags == [0] * len(node_ids) else None

        return wait_until(
            agree, message=lambda: f"replicas differ: {self.status()}", timeout=WAIT_S
        )

    def bootstrap(self) -> str:
        return ",".join(n.address_of("kafka") for n in self.nodes.values() if n.running)
