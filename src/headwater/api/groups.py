"""Consumer groups of every tenant, as the front ends reach them (engine/groups).

One :class:`~headwater.engine.groups.GroupCoordinator` and one
:class:`~headwater.engine.groups.OffsetManager` per tenant, opened on first use (the
offsets are loaded once from the tenant's ``hw_consumer_offsets``). Front ends that speak
a group protocol (Kafka's JoinGroup/SyncGroup...) use :meth:`ConsumerGroups.coordinator`;
those that only commit and fetch positions (Rivven's protobuf clients) use
:meth:`ConsumerGroups.commit` and :meth:`ConsumerGroups.fetch`. Offsets committed inside a
transaction reach the same in-memory view through :meth:`ConsumerGroups.commit_staged`
(the transaction coordinator's offsets sink), so a fetch sees them once committed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from headwater.engine.engine import Engine
from headwater.engine.groups import (
    NO_GENERATION,
    CommittedOffset,
    CommittedOffsets,
    CoordinatorNotAvailable,
    GroupCoordinator,
    LogOffsetStore,
    NotCoordinator,
    OffsetKey,
    OffsetManager,
    TopicPartition,
)
from headwater.engine.groups.offsets import OFFSETS_STREAM, Replicated
from headwater.engine.per_tenant import PerTenant
from headwater.errors import StreamNotFound


@dataclass(frozen=True)
class PartitionLag:
    """A group's committed offset on one partition against the partition's end (the
    dashboard's and ``headwater_consumer_group_lag``'s view)."""

    tenant_id: int
    group: str
    stream: str
    partition: int
    committed_offset: int
    end_offset: int  # the partition's next offset to be written
    lag: int  # end_offset - committed_offset, never negative


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class ConsumerGroups:
    """Every tenant's group coordinator and committed offsets."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._tenants: PerTenant[OffsetManager] = PerTenant(engine)
        # With [cluster]: commits wait for the offsets partition's in-sync replicas.
        self.replicated: Replicated | None = None
        # With [cluster]: raises unless this node coordinates the tenant's groups, so a
        # front end without a coordinator check of its own (Rivven's commits) never
        # writes this node's follower copy of the offsets stream or reads a stale one.
        self.check_coordinator: Callable[[int], None] | None = None

    async def _manager(self, tenant_id: int) -> OffsetManager:
        async def open_manager() -> OffsetManager:
            coordinator = GroupCoordinator(self._partitions_of(tenant_id), clock=_wall_ms)
            store = await LogOffsetStore.open(self._engine, tenant_id, self._wait_replicated)
            return await OffsetManager.open(coordinator, store)

        return await self._tenants.open(tenant_id, open_manager)

    async def load_stored(self) -> None:
        """Load the offsets of every tenant that has stored some, so lag is known (at
        /metrics, on the dashboard) after a restart before any group client returns."""
        for tenant_id in sorted(self._engine.tenants):
            try:
                self._engine.stream_by_name(tenant_id, OFFSETS_STREAM, internal=True)
            except StreamNotFound:
                continue
            await self._manager(tenant_id)

    async def _wait_replicated(self, tenant_id: int, stream: str, end: int) -> None:
        # Looked up at each commit: the cluster sets it after the offsets were loaded.
        if self.replicated is not None:
            await self.replicated(tenant_id, stream, end)

    def _check_coordinator(self, tenant_id: int) -> None:
        if self.check_coordinator is not None:
            self.check_coordinator(tenant_id)

    async def open_stored(self, tenant_id: int) -> None:
        """The tenant's offsets stream (created if missing) and its offsets loaded: a
        cluster needs the stream before it can place it and name its coordinator."""
        await self._manager(tenant_id)

    async def reload(self, tenant_id: int) -> None:
        """This node became (or stopped being) the tenant's group coordinator in a
        cluster: the committed offsets are read again from the local replica of the
        offsets stream (what the old coordinator had replicated). Membership stays: a
        JoinGroup may be waiting on it (a leadership that lapsed for a moment under
        load comes back to it), and members of an older term here are unknown to their
        clients' new generation, so they rejoin (UNKNOWN_MEMBER_ID) or time out."""
        manager = self._tenants.get(tenant_id)
        if manager is None:
            return  # loaded from the replica on first use
        manager.committed = CommittedOffsets(await manager.store.load())

    def partition_lags(self, tenant_id: int | None = None) -> Iterator[PartitionLag]:
        """Every committed (group, stream, partition) of ``tenant_id`` (or of every
        tenant) with its lag, by tenant, group, stream, partition. A partition the group
        never committed is absent (as Kafka's tools show no lag for it); so is one whose
        stream was deleted. Tenants whose offsets are not loaded have none: every tenant
        with stored offsets is loaded by :meth:`load_stored` when the server opens."""
        for tenant in sorted(self._tenants):
            if tenant_id is not None and tenant != tenant_id:
                continue
            committed = self._tenants[tenant].committed
            for group in committed.groups():
                for tp, value in committed.fetch(group).items():
                    try:
                        stream = self._engine.stream_by_name(tenant, tp.stream)
                    except StreamNotFound:
                        continue
                    if tp.partition >= stream.partitions:
                        continue
                    end = stream.partition_log(tp.partition).committed_offset
                    yield PartitionLag(
                        tenant,
                        group,
                        tp.stream,
                        tp.partition,
                        value.offset,
                        end,
                        max(0, end - value.offset),
                    )

    def _partitions_of(self, tenant_id: int) -> Callable[[str], int]:
        def partitions_of(stream: str) -> int:
            try:
                return self._engine.stream_by_name(tenant_id, stream).partitions
            except StreamNotFound:
                return 0

        return partitions_of

    async def coordinator(self, tenant_id: int) -> GroupCoordinator:
        """The tenant's group state machine (membership, rebalances)."""
        return (await self._manager(tenant_id)).coordinator

    async def commit(
        self,
        tenant_id: int,
        group: str,
        offsets: Mapping[tuple[str, int], tuple[int, str]],
        *,
        member_id: str = "",
        generation: int = NO_GENERATION,
        instance_id: str | None = None,
    ) -> None:
        """OffsetCommit: (stream name, partition) -> (next offset, metadata), stored
        durably before returning (refused whole: StreamNotFound, InvalidRequest for a
        partition the stream lacks, InvalidOffset for a negative offset, the group
        errors for a member or generation the group does not have)."""
        self._check_coordinator(tenant_id)
        manager = await self._manager(tenant_id)
        await manager.commit(
            group,
            {TopicPartition(s, p): value for (s, p), value in offsets.items()},
            member_id=member_id,
            generation=generation,
            instance_id=instance_id,
        )

    async def fetch(
        self, tenant_id: int, group: str, partitions: Iterable[tuple[str, int]] | None = None
    ) -> dict[tuple[str, int], CommittedOffset]:
        """OffsetFetch: the group's committed offsets (of ``partitions``, or all); a
        partition without a commit is absent."""
        self._check_coordinator(tenant_id)
        manager = await self._manager(tenant_id)
        wanted = None if partitions is None else [TopicPartition(s, p) for s, p in partitions]
        return {(tp.stream, tp.partition): v for tp, v in manager.fetch(group, wanted).items()}

    async def group_ids(self, tenant_id: int) -> list[str]:
        """Groups with committed offsets or members, sorted."""
        manager = await self._manager(tenant_id)
        return sorted(set(manager.committed.groups()) | set(manager.coordinator.groups))

    async def forget_stream(self, tenant_id: int, stream: str) -> None:
        """Every group's committed offsets of a deleted stream, removed (stored too).
        In a cluster only the tenant's group coordinator holds them: another node
        leaves them (docs/kafka.md, "DeleteTopics")."""
        try:
            self._engine.stream_by_name(tenant_id, OFFSETS_STREAM, internal=True)
            self._check_coordinator(tenant_id)
        except (StreamNotFound, NotCoordinator, CoordinatorNotAvailable):
            return  # no group of the tenant ever committed, or not here
        manager = await self._manager(tenant_id)
        await manager.forget_stream(stream)

    async def delete(self, tenant_id: int, group: str) -> None:
        """DeleteGroups: an empty group and its offsets (InvalidRequest while it has
        members)."""
        self._check_coordinator(tenant_id)
        manager = await self._manager(tenant_id)
        await manager.delete_group(group)

    async def commit_staged(
        self, tenant_id: int, offsets: Mapping[OffsetKey, CommittedOffset]
    ) -> None:
        """A committed transaction's offsets: stored, then visible to :meth:`fetch`."""
        manager = await self._manager(tenant_id)
        await manager.store.commit(offsets)
        manager.committed.apply(offsets)
