"""What replication needs of a partition (docs/cluster.md), as the cluster reaches it.

A leader hands out its stored batches as they are (:meth:`Replicas.read_stored`); a
follower appends them byte for byte (:meth:`Replicas.append_stored`, acknowledged by the
partition's group commit like any append, so subscriptions and SQL see them) and cuts a
divergent tail (:meth:`Replicas.truncate`). Each replica's leader epochs are the
partition's ``leader-epoch-checkpoint`` (storage/leader_epochs.py). Partitions are named
as etcd names them: tenant, stream name, partition.
"""

from __future__ import annotations

import asyncio

from headwater.engine.engine import Engine
from headwater.storage.leader_epochs import LeaderEpochs
from headwater.storage.log import PartitionLog


class Replicas:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._epochs: dict[PartitionLog, LeaderEpochs] = {}

    def _log(self, tenant_id: int, stream: str, partition: int) -> PartitionLog:
        return self._engine.stream_by_name(tenant_id, stream).partition_log(partition)

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
        where = self._engine.stream_by_name(tenant_id, stream)
        plog = where.partition_log(partition)
        end = plog.append_stored(data)
        await where.committers[partition].committed(end)
        return end

    async def truncate(self, tenant_id: int, stream: str, partition: int, offset: int) -> int:
        """Cut the replica's log (and its epochs) at ``offset``; the new end."""
        plog = self._log(tenant_id, stream, partition)
        end = await asyncio.get_running_loop().run_in_executor(
            self._engine.executor, plog.truncate_to, offset
        )
        self.epochs(tenant_id, stream, partition).truncate_from(end)
        return end
