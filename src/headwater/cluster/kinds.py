"""Entity kinds across the cluster (docs/cluster.md, "Entity kinds").

A kind's changelog is partition 0 of the internal stream ``hw_kind_<name>``
(engine/kinds/replicated.py): registered under ``streams/`` like any internal stream,
it is placed by the controller, led, copied and failed over as a stream partition is.
What a partition does not carry is the kind's schema: it is kept under
``kinds/<tenant>/<name>`` (``{"fields": [[name, type], ...], "event_stream": bool}``),
so every node creates (and migrates) the kind before it copies its changelog.

Each tick a node registers the kinds it has that etcd lacks (or with fewer fields),
creates the kinds etcd has that it lacks, migrates those etcd has with more fields, and
has a kind it has just come to lead apply the rest of its copy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING

from headwater.cluster.etcd import EtcdError
from headwater.cluster.layout import NO_LEADER, PartitionKey
from headwater.engine.kinds import KindInfo
from headwater.engine.kinds.model import changelog_stream
from headwater.errors import HeadwaterError

if TYPE_CHECKING:
    from headwater.cluster.node import ClusterNode

log = logging.getLogger("headwater.cluster.kinds")

PLACEMENT_WAIT_S = 10.0  # CREATE_KIND waits at most this long for the changelog's leader


def _schema(info: KindInfo) -> dict[str, object]:
    return {
        "fields": [[f.name, int(f.type)] for f in info.fields],
        "event_stream": info.event_stream,
    }


class KindRegistrySync:
    def __init__(self, node: ClusterNode) -> None:
        self._node = node
        self._changelogs = node.api.kind_changelogs
        self._prefix = node.keys.prefix + "kinds/"
        self._conflicts: set[tuple[int, str]] = set()  # logged once each
        self._from_cluster: set[tuple[int, str]] = set()  # being created by a tick
        self._changelogs.set_placement(self.placed)

    async def sync(self) -> None:
        """One tick (see the module docstring)."""
        known: dict[tuple[int, str], dict[str, object]] = {}
        for kv in await self._node.etcd.get_prefix(self._prefix):
            tenant, name = kv.key[len(self._prefix) :].split("/")
            known[int(tenant), name] = kv.json()
        tenants = self._node.api.tenant_ids()
        for tenant_id in tenants:
            for info in self._changelogs.kinds(tenant_id):
                theirs = known.pop((tenant_id, info.name), None)
                mine = _schema(info)
                if theirs is None or theirs == mine:
                    if theirs is None:
                        await self.register(tenant_id, info)
                    continue
                their_fields = [list(f) for f in theirs["fields"]]  # type: ignore[attr-defined]
                my_fields = mine["fields"]
                assert isinstance(my_fields, list)
                if their_fields[: len(my_fields)] == my_fields:
                    await self._create(tenant_id, info.name, theirs)  # migrated elsewhere
                elif my_fields[: len(their_fields)] == their_fields:
                    await self.register(tenant_id, info)  # migrated here
                elif (tenant_id, info.name) not in self._conflicts:
                    self._conflicts.add((tenant_id, info.name))
                    log.warning(
                        "kind %s of tenant %d has another schema in the cluster; not replicated",
                        info.name,
                        tenant_id,
                    )
            self._changelogs.kick_leaders(tenant_id)
        for (tenant_id, name), schema in known.items():
            if tenant_id in tenants:
                await self._create(tenant_id, name, schema)

    async def register(self, tenant_id: int, info: KindInfo) -> None:
        """The kind's schema and its changelog stream into etcd (the controller then
        places the changelog's partition)."""
        etcd = self._node.etcd
        await etcd.put(f"{self._prefix}{tenant_id}/{info.name}", json.dumps(_schema(info)).encode())
        stream_key = self._node.keys.stream(tenant_id, changelog_stream(info.name))
        if await etcd.get(stream_key) is None:
            await etcd.put(stream_key, json.dumps({"partitions": 1, "internal": True}).encode())
        log.info("kind registered", extra={"tenant": tenant_id, "kind": info.name})

    async def _create(self, tenant_id: int, name: str, schema: dict[str, object]) -> None:
        fields = [(str(n), int(t)) for n, t in schema["fields"]]  # type: ignore[attr-defined]
        self._from_cluster.add((tenant_id, name))  # placed already: no wait in the tick
        try:
            await self._changelogs.tenant(tenant_id).create_kind(
                name, fields, event_stream=bool(schema.get("event_stream"))
            )
        except HeadwaterError as exc:
            if (tenant_id, name) not in self._conflicts:
                self._conflicts.add((tenant_id, name))
                log.warning("cannot create kind %s of tenant %d: %s", name, tenant_id, exc)
        finally:
            self._from_cluster.discard((tenant_id, name))

    async def placed(self, tenant_id: int, info: KindInfo) -> None:
        """A kind was created here: registered now, and answered once its changelog
        has a leader that knows it leads, or (another node) that has made the kind (so a
        write right after CREATE_KIND is taken by the leader, or refused naming a node
        that has it), at most PLACEMENT_WAIT_S."""
        if (tenant_id, info.name) in self._from_cluster:
            return
        try:
            await self.register(tenant_id, info)
        except EtcdError as exc:
            log.warning("cannot register kind %s yet (the next tick does): %s", info.name, exc)
            return
        key = PartitionKey(tenant_id, changelog_stream(info.name), 0)
        me = self._node.config.node_id
        deadline = time.monotonic() + PLACEMENT_WAIT_S
        while time.monotonic() < deadline:
            state = self._node.partitions.get(key)
            leader = NO_LEADER if state is None else state.leader
            if leader == me and self._node.replication.leads(key):
                return
            if leader not in (me, NO_LEADER) and await self._leads_kind(leader, key):
                return
            await asyncio.sleep(0.05)  # the node's tick (0.5 s) reads etcd's answer

    async def _leads_kind(self, node_id: int, key: PartitionKey) -> bool:
        """Whether ``node_id`` has made the kind and leads it, so a client sent there by
        a refusal finds it and is not refused: known here when this node, a replica, has
        had a fetch answered by it (a node answers only what it leads); else from the
        offsets it publishes once it has made the kind (it leads by the end of that
        tick)."""
        state = self._node.partitions.get(key)
        if state is not None and self._node.config.node_id in state.replicas:
            return key in self._node.replication.follower_hw
        try:
            published = await self._node.etcd.get(self._node.keys.node_offsets(node_id))
        except EtcdError:
            return False
        return published is not None and key.path() in published.json()
