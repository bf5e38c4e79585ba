"""The cluster's streams: registered in etcd, made on every node, deleted everywhere.

A stream registered in etcd (``streams/<tenant>/<name>``) is one incarnation of its
name, known by the key's create revision: deleted and created again, the name is a new
key with a new revision. Each node records which incarnation each of its streams copies
(``cluster-streams.json`` in its data dir: the local stream id, never reused on a node,
and the revision), so that each tick it can tell

* a stream created here that etcd does not know yet (no record): it registers it;
* its copy of a stream the cluster deleted (a record whose revision etcd no longer
  has, the name gone or registered anew): it deletes the copy, and creates the new
  incarnation empty if there is one;
* a stream etcd has that this node lacks: it creates it and records it.

A delete on a node (any front end's: Kafka DeleteTopics, Kimberlite, HTTP, Rivven, the
CLI) first removes the registration from etcd, with the stream's partition states and
any reassignment, in one txn (so the controller never sees partitions without their
stream), and only then deletes the stream there; the other nodes delete their copies on
their next tick, and a node that was down then deletes its copy when it returns (its
record names a revision etcd no longer has). A node only acts on the partition states of
the incarnation it copies (:meth:`StreamRegistry.copies_current`), so a name deleted and
created again is never served from, or replicated into, an old copy.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from headwater.api import StreamInfo, StreamSettings
from headwater.cluster.etcd import Delete, EtcdError, KeyValue, absent, put_json, same_key
from headwater.errors import HeadwaterError, StorageError, StreamAlreadyExists, StreamNotFound
from headwater.storage.metadata import read_json, write_json_atomic

if TYPE_CHECKING:
    from headwater.cluster.node import ClusterNode

log = logging.getLogger("headwater.cluster")

FILE_NAME = "cluster-streams.json"
DELETE_ATTEMPTS = 5  # a txn fails only when the key changed between its read and it

StreamName = tuple[int, str]  # (tenant id, stream name)


@dataclass(frozen=True)
class Copy:
    """A local stream and the incarnation it copies (etcd's create revision)."""

    stream_id: int
    revision: int


class StreamRegistry:
    def __init__(self, node: ClusterNode) -> None:
        self._node = node
        self._api = node.api
        self._keys = node.keys
        self._path = self._api.replicas.data_dir / FILE_NAME
        self.copies: dict[StreamName, Copy] = self._read()
        self._saved = dict(self.copies)

    def _read(self) -> dict[StreamName, Copy]:
        try:
            records: list[dict[str, Any]] = read_json(self._path)
            return {
                (int(r["tenant"]), str(r["stream"])): Copy(int(r["stream_id"]), int(r["revision"]))
                for r in records
            }
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Without it every stream here is matched to etcd's by name, as it was
            # before the records existed: a copy of a stream deleted meanwhile would
            # be registered again.
            log.warning("cannot read %s (%s); streams are matched to etcd's by name",
                        self._path, exc)  # fmt: skip
            return {}

    async def _save(self) -> None:
        if self.copies == self._saved:
            return
        records = [
            {"tenant": t, "stream": name, "stream_id": c.stream_id, "revision": c.revision}
            for (t, name), c in sorted(self.copies.items())
        ]
        await asyncio.to_thread(write_json_atomic, self._path, records)
        self._saved = dict(self.copies)

    def copies_current(self, tenant_id: int, name: str, registered: KeyValue | None) -> bool:
        """Whether this node's copy of the stream is the incarnation etcd registers now
        (``registered``: its key as read), so its partition states are this copy's."""
        copy = self.copies.get((tenant_id, name))
        return (
            registered is not None
            and copy is not None
            and (copy.revision == registered.create_revision)
        )

    def _local_streams(self) -> tuple[dict[StreamName, StreamInfo], set[StreamName]]:
        """Every stream here by name (the replicated internal ones too), and which of
        them are internal."""
        local: dict[StreamName, StreamInfo] = {}
        internal: set[StreamName] = set()
        for tenant_id in self._api.tenant_ids():
            for stream in self._api.list_streams(tenant_id):
                local[tenant_id, stream.name] = stream
            for stream in self._api.replicas.internal_streams(tenant_id):
                local[tenant_id, stream.name] = stream
                internal.add((tenant_id, stream.name))
        return local, internal

    # ---- each tick ----------------------------------------------------------------------

    async def sync(self) -> None:
        """Make this node's streams agree with etcd's registry (the module's doc)."""
        registered: dict[StreamName, KeyValue] = {}
        for found in await self._node.etcd.get_prefix(self._keys.streams):
            tenant, stream_name = found.key[len(self._keys.streams) :].split("/")
            registered[int(tenant), stream_name] = found
        local, internal = self._local_streams()
        # Records of streams no longer here (deleted on this node, and maybe created
        # here again under a new id): what replication knew of them goes.
        for name, recorded in list(self.copies.items()):
            if name not in local or local[name].stream_id != recorded.stream_id:
                del self.copies[name]
                await self._forget(name)
        deleted: set[StreamName] = set()
        for name, stream in local.items():
            copy = self.copies.get(name)
            kv = registered.get(name)
            if copy is not None and not self.copies_current(*name, kv):
                # Deleted in the cluster, maybe created again: this copy goes (below,
                # the new incarnation is made in its place).
                if await self._delete_copy(name, stream, name in internal):
                    deleted.add(name)
                continue
            if kv is None:
                kv = await self._register(name, stream, name in internal)
                if kv is None:
                    continue  # another node registered the name meanwhile: next tick
            if copy is None:
                self.copies[name] = Copy(stream.stream_id, kv.create_revision)
            theirs = int(kv.json()["partitions"])
            if theirs < stream.partitions:
                # More partitions here (an alter on this node): the registration grows,
                # unless the stream was deleted (and created again) meanwhile.
                value = {**kv.json(), "partitions": stream.partitions}
                await self._node.etcd.txn([same_key(kv)], [put_json(kv.key, value)])
            elif theirs > stream.partitions and name not in internal:
                await self._api.alter_partitions(name[0], stream.stream_id, theirs)
        tenants = set(self._api.tenant_ids())
        for missing, registration in registered.items():
            if (missing not in local or missing in deleted) and missing[0] in tenants:
                await self._create(missing, registration)
        await self._save()

    async def register_new(self, tenant_id: int, name: str, settings: StreamSettings) -> None:
        """Before a client's create of a stream here: registered in etcd first, so a
        name another node registered meanwhile (this node makes its copy at a tick) is
        StreamAlreadyExists rather than a second stream of that name, with its own
        settings and partitions, that this node would keep as the cluster's copy.
        StorageError when etcd cannot be reached: nothing is created."""
        key = self._keys.stream(tenant_id, name)
        value = _registration(settings.partitions or 1, settings)
        try:
            if not await self._node.etcd.txn([absent(key)], [put_json(key, value)]):
                raise StreamAlreadyExists(f"stream {name!r} already exists in the cluster")
        except EtcdError as exc:
            raise StorageError(
                f"cannot create stream {name!r}: the cluster's registry (etcd) did not "
                f"answer: {exc}"
            ) from None
        log.info("stream registered", extra={"tenant": tenant_id, "stream": name})

    async def _register(
        self, name: StreamName, stream: StreamInfo, internal: bool
    ) -> KeyValue | None:
        """Register a stream made here (an internal one, or one made while this node was
        not in the cluster); its key as written, None when the name was registered
        meanwhile."""
        key = self._keys.stream(*name)
        value = _registration(stream.partitions, stream.settings)
        if internal:
            value["internal"] = True  # the others create it as internal too
        if not await self._node.etcd.txn([absent(key)], [put_json(key, value)]):
            return None
        log.info("stream registered", extra={"tenant": name[0], "stream": name[1]})
        return await self._node.etcd.get(key)

    async def _create(self, name: StreamName, kv: KeyValue) -> None:
        """Make here the incarnation etcd registers, and record it."""
        tenant_id, stream_name = name
        try:
            if kv.json().get("internal"):
                if not await self._api.replicas.create_internal(tenant_id, stream_name):
                    return  # an internal stream this version does not replicate
                made = [
                    s
                    for s in self._api.replicas.internal_streams(tenant_id)
                    if s.name == stream_name
                ]
                if not made:
                    return  # not here yet (a kind's changelog comes with the kind)
                info = made[0]
            else:
                registered = kv.json()
                settings = StreamSettings.from_dict(
                    {**registered.get("settings", {}), "partitions": int(registered["partitions"])}
                )
                info = await self._api.create_stream(
                    tenant_id, stream_name, settings, registered=True
                )
        except StreamAlreadyExists:
            return  # a client's create of it here under way: recorded at the next tick
        except HeadwaterError as exc:
            log.warning("cannot create stream %s of tenant %d: %s", stream_name, tenant_id, exc)
            return
        self.copies[name] = Copy(info.stream_id, kv.create_revision)
        log.info("stream created from the cluster", extra={"tenant": tenant_id,
                 "stream": stream_name, "revision": kv.create_revision})  # fmt: skip

    async def _delete_copy(self, name: StreamName, stream: StreamInfo, internal: bool) -> bool:
        """This node's copy of an incarnation the cluster deleted goes (its record stays
        until it is gone, so a crash meanwhile deletes it at the next start); whether
        it went."""
        if internal:
            # Never deleted by a client: etcd lost its registration. Kept; it is
            # registered again once its record is dropped by hand.
            log.warning("internal stream %s of tenant %d is no longer registered", name[1],
                        name[0])  # fmt: skip
            return False
        await self._forget(name)
        try:
            await self._api.delete_stream(name[0], stream.stream_id)
        except StreamNotFound:
            pass  # deleted here meanwhile (this node's own delete, its registration gone)
        except HeadwaterError as exc:
            log.warning("cannot delete stream %s of tenant %d: %s", name[1], name[0], exc)
            return False
        del self.copies[name]
        log.info("stream deleted in the cluster: copy deleted",
                 extra={"tenant": name[0], "stream": name[1]})  # fmt: skip
        return True

    async def _forget(self, name: StreamName) -> None:
        """Replication's and the front ends' state of the stream's partitions goes."""
        for key in [k for k in self._node.partitions if (k.tenant_id, k.stream) == name]:
            del self._node.partitions[key]
        await self._node.replication.forget(*name)
        self._node.front_ends.forget(*name)

    # ---- a delete on this node ------------------------------------------------------------

    async def deregister(self, tenant_id: int, name: str) -> None:
        """Before this node deletes a stream (any front end's delete): the incarnation
        its copy belongs to leaves etcd, with its partition states and any reassignment
        under way, in one txn. A copy of an incarnation already gone (deleted elsewhere,
        maybe registered anew) removes nothing there. StorageError when etcd cannot be
        reached: nothing is deleted, the client may retry."""
        local = self._api.stream_named(tenant_id, name)
        copy = self.copies.get((tenant_id, name))
        mine = copy if copy is not None and copy.stream_id == local.stream_id else None
        etcd, key = self._node.etcd, self._keys.stream(tenant_id, name)
        where = f"{tenant_id}/{name}/"
        try:
            for _ in range(DELETE_ATTEMPTS):
                kv = await etcd.get(key)
                if kv is None or (mine is not None and kv.create_revision != mine.revision):
                    break
                deletes = [
                    Delete(kv.key),
                    Delete(self._keys.partitions + where, prefix=True),
                    Delete(self._keys.reassignments + where, prefix=True),
                ]
                if await etcd.txn([same_key(kv)], deletes):
                    log.info("stream deleted from the cluster",
                             extra={"tenant": tenant_id, "stream": name})  # fmt: skip
                    break
            else:
                raise StorageError(f"cannot delete stream {name!r}: its registration kept changing")
        except EtcdError as exc:
            raise StorageError(
                f"cannot delete stream {name!r}: the cluster's registry (etcd) did not "
                f"answer: {exc}"
            ) from None
        await self._forget((tenant_id, name))


def _registration(partitions: int, settings: StreamSettings) -> dict[str, Any]:
    """A stream's value in etcd: its partition count and its settings, with which every
    node makes its copy (LogAppendTime, compaction, retention: or how a partition is
    kept and stamped would change with its leader)."""
    return {"partitions": partitions, "settings": settings.to_dict()}
