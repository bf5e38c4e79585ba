"""What replication needs of a partition (docs/cluster.md), as the cluster reaches it.

A leader hands out its stored batches as they are (:meth:`Replicas.read_stored`); a
follower appends them byte for byte (:meth:`Replicas.append_stored`, acknowledged by the
partition's group commit like any append, so subscriptions and SQL see them) and cuts a
divergent tail (:meth:`Replicas.truncate`). Each replica's leader epochs are the
partition's ``leader-epoch-checkpoint`` (storage/leader_epochs.py). Partitions are named
as etcd names them: tenant, stream name, partition.

Of the internal streams, the consumer groups' offsets (``hw_consumer_offsets``) and the
transaction state (``hw_transaction_state``) are replicated like any stream
(:data:`REPLICATED_INTERNAL`): the leader of its partition is the tenant's group
coordinator, respectively transaction coordinator. The others stay each node's own
(docs/cluster.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from headwater.engine.engine import Engine, Stream, StreamInfo
from headwater.engine.groups.offsets import OFFSETS_STREAM, LogOffsetStore
from headwater.engine.kinds.model import kind_of_changelog
from headwater.engine.kinds.replicated import KindChangelogs
from headwater.engine.transactions import TXN_STATE_STREAM, create_state_stream
from headwater.errors import NotLeader, StreamNotFound
from headwater.storage.group_commit import GroupCommitter
from headwater.storage.leader_epochs import LeaderEpochs
from headwater.storage.log import PartitionLog

REPLICATED_INTERNAL = (OFFSETS_STREAM, TXN_STATE_STREAM)


class Replicas:
    def __init__(self, engine: Engine, kinds: KindChangelogs) -> None:
        self._engine = engine
        self._epochs: dict[PartitionLog, LeaderEpochs] = {}
        # Kind changelogs are partition 0 of a stream named for the kind (hw_kind_<name>)
        # as etcd knows them; replication reaches them here like any partition.
        self._kinds = kinds

    @property
    def data_dir(self) -> Path:
        return self._engine.data_dir

    def _log(self, tenant_id: int, stream: str, partition: int) -> PartitionLog:
        if kind_of_changelog(stream) is not None:
            return self._kinds.state(tenant_id, stream).log
        return self._engine.stream_by_name(tenant_id, stream, internal=True).partition_log(
            partition
        )

    def internal_streams(self, tenant_id: int) -> list[StreamInfo]:
        """The tenant's replicated internal streams that exist here (its kinds'
        changelogs among them: :meth:`KindChangelogs.streams`)."""
        found = []
        for name in REPLICATED_INTERNAL:
            try:
                found.append(self._engine.stream_by_name(tenant_id, name, internal=True).info())
            except StreamNotFound:
                continue
        return found + self._kinds.streams(tenant_id)

    async def create_internal(self, tenant_id: int, name: str) -> bool:
        """Create a replicated internal stream another node registered (with the
        settings its owner gives it); False for a name that is not one."""
        if name == OFFSETS_STREAM:
            await LogOffsetStore.open(self._engine, tenant_id)
            return True
        if name == TXN_STATE_STREAM:
            await create_state_stream(self._engine, tenant_id)
            return True
        # A kind's changelog comes with the kind, which the cluster creates from the
        # schema it registered (cluster/kinds.py): here once that is done.
        return kind_of_changelog(name) is not None and self._kinds.holds(tenant_id, name)

    async def wait_for_end(
        self, tenant_id: int, stream: str, partition: int, offset: int, timeout_s: float
    ) -> bool:
        """A follower's long poll: the partition's committed end passes ``offset``
        within ``timeout_s`` (internal streams too)."""
        if kind_of_changelog(stream) is not None:
            state = self._kinds.state(tenant_id, stream)
            return await wait_for_log_of(
                state.log,
                state.committer,
                lambda plog: plog.committed_offset > offset,
                timeout_s,
            )
        where = self._engine.stream_by_name(tenant_id, stream, internal=True)
        return await wait_for_end(where, partition, offset, timeout_s)

    def end(self, tenant_id: int, stream: str, partition: int) -> int:
        """The replica's committed end: every offset below it is durable here."""
        return self._log(tenant_id, stream, partition).committed_offset

    def epochs(self, tenant_id: int, stream: str, partition: int) -> LeaderEpochs:
        """The replica's leader epochs (loaded once, then kept with the log)."""
        plog = self._log(tenant_id, stream, partition)
        epochs = self._epochs.get(plog)
        if epochs is None:
            epochs = self._epochs[plog] = LeaderEpochs(plog.directory)
        return epochs

    async def read_stored(
        self, tenant_id: int, stream: str, partition: int, from_offset: int, max_bytes: int
    ) -> bytes:
        """Whole stored batches from ``from_offset`` (a batch boundary: a follower's
        end) below the committed end, about ``max_bytes`` (at least one batch), read in
        a worker thread."""
        plog = self._log(tenant_id, stream, partition)

        def read() -> bytes:
            out: list[bytes] = []
            size = 0
            for batch in plog.batches(from_offset):
                if out and size + batch.length > max_bytes:
                    break
                out.append(bytes(batch.buffer))
                size += batch.length
            return b"".join(out)

        return await asyncio.get_running_loop().run_in_executor(self._engine.executor, read)

    async def append_stored(self, tenant_id: int, stream: str, partition: int, data: bytes) -> int:
        """Append the leader's batches as they are; the new end once it is durable."""
        if kind_of_changelog(stream) is not None:
            return await self._kinds.append_stored(tenant_id, stream, data)
        where = self._engine.stream_by_name(tenant_id, stream, internal=True)
        plog = where.partition_log(partition)
        end = plog.append_stored(data)
        # The copies carry the leader's tenant log positions: this tenant's next position
        # passes them, so a query here (which reads below it) sees them.
        last = plog.last_position
        if last is not None and last > where.tenant.next_position:
            where.tenant.next_position = last
        await where.committers[partition].committed(end)
        return end

    async def truncate(self, tenant_id: int, stream: str, partition: int, offset: int) -> int:
        """Cut the replica's log (and its epochs) at ``offset``; the new end."""
        if kind_of_changelog(stream) is not None:
            end = await self._kinds.truncate(tenant_id, stream, offset)
            self.epochs(tenant_id, stream, partition).truncate_from(end)
            return end
        committer = self._engine.stream_by_name(tenant_id, stream, internal=True).committers[
            partition
        ]
        # Only a replica that no longer leads is cut: its waiting appends ask the leader.
        moved = NotLeader(f"no longer the leader of partition {partition} of {stream}")
        end = await committer.truncate_to(offset, moved)
        self.epochs(tenant_id, stream, partition).truncate_from(end)
        return end


async def wait_for_end(stream: Stream, partition: int, offset: int, timeout_s: float) -> bool:
    """Wait until the partition's committed end passes ``offset`` (an event at or after
    it is stored), at most ``timeout_s``: a long poll. False when the time ran out first."""
    return await wait_for_log(
        stream, partition, lambda plog: plog.committed_offset > offset, timeout_s
    )


async def wait_for_log(
    stream: Stream, partition: int, reached: Callable[[PartitionLog], bool], timeout_s: float
) -> bool:
    """Wait until ``reached(log)`` holds for the partition's log, checked now and at each
    commit (or high watermark move) its committer announces, or until the stream is
    deleted (the waiter asks again and hears it is gone, as Kafka completes a delayed
    fetch of a deleted topic at once), at most ``timeout_s``. False when the time ran out
    first. The one long poll under follower and client fetches."""
    if stream.deleted:
        return True
    return await wait_for_log_of(
        stream.partition_log(partition),
        stream.committers[partition],
        reached,
        timeout_s,
        woken_by=stream.delete_listeners,
    )


async def wait_for_log_of(
    plog: PartitionLog,
    committer: GroupCommitter,
    reached: Callable[[PartitionLog], bool],
    timeout_s: float,
    *,
    woken_by: list[Callable[[], None]] | None = None,
) -> bool:
    """:func:`wait_for_log` for a log and its committer (a kind's changelog too);
    ``woken_by``: listeners of another event that ends the wait (True)."""
    if reached(plog):
        return True
    arrived = asyncio.Event()

    def on_move(_committed: int) -> None:
        if reached(plog):
            arrived.set()

    committer.add_listener(on_move)
    if woken_by is not None:
        woken_by.append(arrived.set)
    try:
        async with asyncio.timeout(timeout_s):
            await arrived.wait()
    except TimeoutError:
        return False
    finally:
        committer.remove_listener(on_move)
        if woken_by is not None:
            woken_by.remove(arrived.set)
    return True
