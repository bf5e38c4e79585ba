"""``headwater cluster reassign``: ask the controller to move a partition's replicas
(docs/cluster.md, "Adding a node and moving partitions"). The request is one etcd key,
``reassign/<tenant>/<stream>/<p>`` holding the target replicas; the controller adds
the new replicas, waits until they are in sync, then drops the old ones and deletes
the key (:func:`headwater.cluster.layout.reassignment_step`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

from headwater.cluster.etcd import Etcd, absent, put_json
from headwater.cluster.layout import Keys, NodeInfo, PartitionKey, PartitionState


class ReassignError(Exception):
    """The request cannot be made (said in one line by the command)."""


async def request_reassignment(
    etcd: Etcd, key: PartitionKey, replicas: Sequence[int], prefix: str = "/headwater/"
) -> PartitionState:
    """Write the request; the partition's current state. Refused: an unknown partition,
    an empty or repeated replica list, a node that is not alive, a request already
    under way for the partition."""
    keys = Keys(prefix)
    if not replicas or len(set(replicas)) != len(replicas):
        raise ReassignError(f"replicas must be distinct node ids, got {list(replicas)}")
    current = await etcd.get(keys.partition(key))
    if current is None:
        raise ReassignError(f"partition {key.path()} is not placed (no such stream or partition)")
    live = {NodeInfo.from_json(kv.json()).node_id for kv in await etcd.get_prefix(keys.nodes)}
    dead = [n for n in replicas if n not in live]
    if dead:
        raise ReassignError(f"node(s) {', '.join(map(str, dead))} not alive")
    path = keys.reassignment(key)
    if not await etcd.txn([absent(path)], [put_json(path, {"replicas": list(replicas)})]):
        pending = await etcd.get(path)
        target = pending.json()["replicas"] if pending is not None else "?"
        raise ReassignError(f"partition {key.path()} is already moving to {target}")
    return PartitionState.from_json(json.loads(current.value))


async def wait_reassigned(
    etcd: Etcd, key: PartitionKey, timeout_s: float, prefix: str = "/headwater/"
) -> PartitionState | None:
    """The partition's state once its request is done (the key deleted); None when
    ``timeout_s`` passes first."""
    keys = Keys(prefix)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await etcd.get(keys.reassignment(key)) is None:
            done = await etcd.get(keys.partition(key))
            return None if done is None else PartitionState.from_json(done.json())
        await asyncio.sleep(0.5)  # etcd holds no watch here (docs/cluster.md): a poll
    return None
