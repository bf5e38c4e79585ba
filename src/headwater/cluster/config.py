"""``[cluster]``: what makes a server one node of a cluster (docs/cluster.md)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ClusterConfig:
    node_id: int  # unique in the cluster; also the node's Kafka broker id
    etcd: tuple[str, ...]  # etcd client endpoints, e.g. ("127.0.0.1:2379",)
    advertise_host: str = "127.0.0.1"  # the host other nodes and clients reach it at
    replication_factor: int = 3  # replicas of each partition (fewer while fewer nodes live)
    min_insync_replicas: int = 2  # acks=all is refused below this many in-sync replicas
    lease_s: int = 6  # a node silent this long is dead; its partitions move
    rack: str | None = None  # replicas of a partition go to different racks first
    replica_lag_s: float = 10.0  # an in-sync follower this far behind leaves the ISR
    replication_port: int = 0  # the replication listener's port (0: any free one)
    prefix: str = "/headwater/"  # every key of the cluster lives under it in etcd
    # Ports others reach a listener at when not its own (a proxy or NAT between them),
    # by listener name ("kafka", "replication", ...): as Kafka's advertised.listeners.
    advertise_ports: tuple[tuple[str, int], ...] = ()
    # The shared secret every node proves in the replication handshake (cluster/peers.py):
    # given inline or read from secret_file at load; None: the listener asks for none.
    secret: bytes | None = field(default=None, repr=False)
    secret_file: str | None = None

    def __post_init__(self) -> None:
        if self.min_insync_replicas > self.replication_factor:
            raise ValueError(
                f"min_insync_replicas ({self.min_insync_replicas}) is above "
                f"replication_factor ({self.replication_factor})"
            )
