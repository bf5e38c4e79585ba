"""What ``headwater cluster status`` shows, read from etcd alone (no engine needed)."""

from __future__ import annotations

from typing import Any

from headwater.cluster.etcd import Etcd
from headwater.cluster.layout import Keys, NodeInfo, PartitionState


async def cluster_status(etcd: Etcd, prefix: str = "/headwater/") -> dict[str, Any]:
    """What ``headwater cluster status`` shows: live nodes, the controller, and per
    partition its leader, epoch, replicas, ISR and each replica's lag behind the
    leader's end (None where a replica has published no offset), and the target of a
    reassignment under way."""
    keys = Keys(prefix)
    nodes = [NodeInfo.from_json(kv.json()) for kv in await etcd.get_prefix(keys.nodes)]
    controller = await etcd.get(keys.controller)
    ends = {
        int(kv.key[len(keys.offsets) :]): kv.json() for kv in await etcd.get_prefix(keys.offsets)
    }
    moving = {
        kv.key[len(keys.reassignments) :]: kv.json()["replicas"]
        for kv in await etcd.get_prefix(keys.reassignments)
    }
    partitions = []
    for kv in await etcd.get_prefix(keys.partitions):
        path = kv.key[len(keys.partitions) :]
        state = PartitionState.from_json(kv.json())
        leader_end = ends.get(state.leader, {}).get(path)
        lag: dict[str, int | None] = {}
        for replica in state.replicas:
            end = ends.get(replica, {}).get(path)
            lag[str(replica)] = None if end is None or leader_end is None else leader_end - end
        partitions.append(
            {
                "partition": path,
                **state.to_json(),
                "end": leader_end,
                "lag": lag,
                "reassigning": moving.get(path),  # the target replicas, while moving
            }
        )
    return {
        "controller": controller.json()["node_id"] if controller else None,
        "nodes": [n.to_json() for n in nodes],
        "partitions": partitions,
    }
