"""What a cluster node sets on the engine so every front end keeps to the cluster's
rules without asking (docs/cluster.md, "Front ends"): appends only on a partition's
leader, acknowledged once its in-sync replicas hold them, reads only below its high
watermark.

A single node never calls these: its appends are not checked and its readers read to
the committed end, at no cost (one ``is None`` test).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from headwater.engine.engine import Engine, ReplicaAcks, StreamSettings
from headwater.engine.kinds.model import kind_of_changelog
from headwater.engine.kinds.replicated import KindChangelogs
from headwater.errors import NotLeader, StreamNotFound


class ClusterGate:
    def __init__(self, engine: Engine, kinds: KindChangelogs) -> None:
        self._engine = engine
        self._kinds = kinds  # kind changelogs: their followers apply below the HW

    def check_appends(self, check: Callable[[int, str, int], None]) -> None:
        """Every append to a (non-internal) stream partition first calls
        ``check(tenant, stream name, partition)``, which raises NotLeader to refuse it:
        Rivven, HTTP, SQL INSERT, Kiwi and Kafka's and Kimberlite's appends alike."""
        self._engine.leader_check = check

    def check_reads(self, check: Callable[[int, str, int], None]) -> None:
        """Every client read of a (non-internal) stream partition (reads, Arrow ranges,
        subscriptions, SQL over its table) first calls ``check(tenant, stream name,
        partition)``, which raises NotLeader where this node holds no replica of it:
        there it is empty, and its reads would say so without a word."""
        self._engine.replica_check = check

    def wait_for_replicas(self, acks: ReplicaAcks) -> None:
        """Every append (acks=all, the default; Kafka's and Rivven's acks=1 excepted) to
        a (non-internal) stream partition is refused NotEnoughReplicas before it is
        written when the ISR is below min_insync_replicas, and answered only once the
        in-sync replicas hold it: no acknowledged write is lost when the leader dies."""
        self._engine.replica_acks = acks

    def register_before_create(
        self, register: Callable[[int, str, StreamSettings], Awaitable[None]]
    ) -> None:
        """Every create of a (non-internal) stream by a client first awaits
        ``register(tenant, stream name, settings)``, which puts it in the cluster's
        registry or raises (StreamAlreadyExists: the name is the cluster's already):
        two nodes never make two streams of one name, each with its own settings."""
        self._engine.before_create = register

    def deregister_before_delete(self, deregister: Callable[[int, str], Awaitable[None]]) -> None:
        """Every delete of a (non-internal) stream first awaits ``deregister(tenant,
        stream name)``, which takes it out of the cluster's registry (or raises, and
        nothing is deleted): so a delete through any front end reaches every node."""
        self._engine.before_delete = deregister

    def refuse_appends(self, why: str) -> None:
        """Every append to a (non-internal) stream is NotLeader (``why``) until
        :meth:`check_appends`: a cluster node's listeners are bound before it has read
        from etcd what it leads."""

        def refuse(_tenant_id: int, _stream: str, _partition: int) -> None:
            raise NotLeader(why)

        self._engine.leader_check = refuse

    def limit_reads(
        self, tenant_id: int, stream: str, partition: int, limit: Callable[[], int]
    ) -> bool:
        """Readers of the partition (reads, subscriptions, the SQL projection, long
        polls) stop below ``limit()``, its high watermark, from now on. False when the
        stream is not here (yet), or is internal (its owners read it as they need)."""
        if kind_of_changelog(stream) is not None:
            if not self._kinds.holds(tenant_id, stream):
                return False
            self._kinds.limit(tenant_id, stream, limit)
            return True
        try:
            where = self._engine.stream_by_name(tenant_id, stream)
        except StreamNotFound:
            return False
        if partition >= where.partitions:
            return False
        where.partition_log(partition).readable_limit = limit
        return True

    def readable_moved(self, tenant_id: int, stream: str, partition: int) -> None:
        """The partition's high watermark moved: waiting readers look again (a kind's
        follower applies its changelog up to it)."""
        if kind_of_changelog(stream) is not None:
            self._kinds.moved(tenant_id, stream)
            return
        try:
            where = self._engine.stream_by_name(tenant_id, stream)
        except StreamNotFound:
            return
        if partition < where.partitions:
            where.committers[partition].readable_moved()
