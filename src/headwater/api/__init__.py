"""The engine API: the one door every front end goes through.

Kimberlite, ConvergeDB, Ripple, the HTTP API, the Kiwi WebSocket gateway and /metrics
are handed one :class:`EngineAPI` and call nothing else of the engine: streams (create,
append, read, seek), push subscriptions with credits, entity kinds (per tenant), SQL
queries (now and "as of" a log position), tenants and authentication. None of them sees a
stream's partition log or a kind's state; what they show (offsets, sizes, counts) comes
back as plain values (:class:`~headwater.engine.engine.StreamInfo`,
:class:`TenantInfo`, :class:`KindStats`).

The SDKs, the CLI and the Spark source reach the same operations over the wire.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, Unpack

from headwater.api.auth import Auth, AuthConfig, Principal
from headwater.api.cluster_gate import ClusterGate
from headwater.api.groups import ConsumerGroups
from headwater.api.quotas import Quotas, TenantQuota
from headwater.api.readahead import Pages, ReadAhead
from headwater.api.replication import Replicas, wait_for_end, wait_for_log
from headwater.engine.engine import (
    MAX_APPEND_BYTES,
    MAX_APPEND_EVENTS,
    READ_COMMITTED,
    READ_UNCOMMITTED,
    Engine,
    EngineConfig,
    PageRead,
    PartitionedAppend,
    PartitionInfo,
    Stream,
    StreamInfo,
    StreamSettings,
)
from headwater.engine.kinds import (
    EntityState,
    KindInfo,
    KindsConfig,
    KindsEngine,
    KindState,
    TenantKinds,
)
from headwater.engine.subscriptions import (
    MAX_CREDITS,
    RESUME,
    CloseReason,
    Deliver,
    DeliverRead,
    GroupOffsets,
    OnClose,
    Subscription,
    Subscriptions,
)
from headwater.engine.transactions import (
    ClusterHooks,
    ProducerIdentity,
    TransactionCoordinator,
    TxnBatchOptions,
    append_transactional,
    create_state_stream,
    write_marker,
)
from headwater.errors import (
    AuthenticationFailed,
    InvalidOffset,
    InvalidRequest,
    OffsetRemoved,
    TenantNotFound,
)
from headwater.sql.kinds import KindTables
from headwater.sql.limits import SqlLimits
from headwater.sql.records import RecordsCursor
from headwater.sql.service import SqlService
from headwater.sql.values import QueryResult
from headwater.storage.kafka_batch import KafkaSection
from headwater.storage.log import AppendInfo, LogConfig, ReadResult
from headwater.storage.producers import AbortedTxn

__all__ = [
    "MAX_APPEND_BYTES",
    "MAX_APPEND_EVENTS",
    "MAX_CREDITS",
    "RESUME",
    "AppendInfo",
    "Auth",
    "AuthConfig",
    "CloseReason",
    "Deliver",
    "DeliverRead",
    "EngineAPI",
    "GroupInfo",
    "GroupLag",
    "KindStats",
    "OnClose",
    "PartitionInfo",
    "PartitionedAppend",
    "Principal",
    "QueryResult",
    "ReadResult",
    "SqlLimits",
    "StreamInfo",
    "StreamSettings",
    "StreamTarget",
    "Subscription",
    "TenantInfo",
]


@dataclass(frozen=True)
class StreamTarget:
    """What a write needs of a stream it names: its id and partition count, without the
    per-partition offsets and sizes a StreamInfo gathers (O(partitions) a call)."""

    stream_id: int
    name: str
    partitions: int


@dataclass(frozen=True)
class TenantInfo:
    tenant_id: int
    name: str
    log_position: int  # every position below it is committed
    streams: int


@dataclass(frozen=True)
class KindStats:
    """What the dashboard, the kind catalog and /metrics show of one kind."""

    tenant_id: int
    info: KindInfo
    entities: int
    subscribers: int
    changelog_bytes: int


@dataclass(frozen=True)
class FsyncStats:
    count: int
    seconds_total: float
    last_seconds: float  # the longest of the streams' most recent fsyncs


@dataclass(frozen=True)
class GroupLag:
    tenant_id: int
    stream: str
    group: str
    lag: int  # events between the group's committed offset and the stream's end


@dataclass(frozen=True)
class GroupInfo:
    """A consumer group of one stream (the dashboard's view)."""

    stream: str
    group: str
    committed_offset: int
    end_offset: int
    lag: int
    active: bool  # a member is taking deliveries
    waiting: int  # members queued behind it


@dataclass(frozen=True)
class SourceInfo:
    """A kind writer holding a source slot (connected, or within its grace period)."""

    source_id: int
    name: str
    connected: bool
    connected_at_ms: int
    idle_ms: int
    liveness_deadline_ms: int
    entities: int  # entities it asserts, its own presence entity not counted


@dataclass(frozen=True)
class SubscriptionStats:
    tenant_id: int
    stream: str
    open: int
    credits: int


def _kind_stats(tenant_id: int, state: KindState) -> KindStats:
    return KindStats(
        tenant_id=tenant_id,
        info=state.info,
        entities=state.count,
        subscribers=len(state.subscribers),
        changelog_bytes=state.log.size_bytes,
    )


# ---- quotas: the engine's operations, counted and throttled ------------------------------
# Bound in place of the engine's own by EngineAPI.__post_init__ when a tenant has a quota.
# Each first reserves what it is known to spend and waits its turn (Quotas.admit), then
# is served: a request that then fails still counted, it was admitted.

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass(frozen=True)
class _Cost:
    """What a request is known to spend before it is served."""

    tenant_id: int
    produce: int = 0  # bytes of event values
    consume: bool = False  # a read: it waits the consume debt earlier reads left


def _request_cost(tenant_id: int, *_: object, **__: object) -> _Cost:
    return _Cost(tenant_id)


def _read_cost(tenant_id: int, *_: object, **__: object) -> _Cost:
    return _Cost(tenant_id, consume=True)


def _values_cost(tenant_id: int, stream_id: int, values: Sequence[bytes], **_: object) -> _Cost:
    return _Cost(tenant_id, produce=sum(map(len, values)))


def _section_cost(
    tenant_id: int,
    stream_id: int,
    values_section: bytes | memoryview,
    count: int,
    *,
    value_bytes: int | None = None,
    **_: object,
) -> _Cost:
    # The events' own bytes, without the section's u64 length prefixes.
    produced = len(values_section) - 8 * count if value_bytes is None else value_bytes
    return _Cost(tenant_id, produce=produced)


def _admitted(
    quotas: Quotas, serve: Callable[_P, Coroutine[Any, Any, _R]], cost: Callable[_P, _Cost]
) -> Callable[_P, Coroutine[Any, Any, _R]]:
    """``serve`` once the request's ``cost`` (one request, and what else it spends) has
    waited its turn."""

    async def admitted(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        spent = cost(*args, **kwargs)
        await quotas.admit(
            spent.tenant_id, produce=spent.produce, requests=1, consume=spent.consume
        )
        return await serve(*args, **kwargs)

    return admitted


@dataclass(eq=False)
class EngineAPI:
    """Streams, subscriptions, kinds, queries and tenants of one data directory.

    Operations the engine's services already offer in the shape a front end needs are
    handed out as they are (bound in ``__post_init__``: ``list_streams``,
    ``create_stream``, ``delete_stream``, ``alter_partitions``, ``append``,
    ``append_encoded``, ``append_partitioned``, ``offset_for_timestamp``,
    ``offset_of_max_timestamp``, ``sync_tenant``, ``subscribe``, ``grant``, ``query``,
    ``query_at``, ``stream_range``);
    the methods below are what the API adds: plain values instead of live engine
    objects, and the checks every front end would otherwise repeat. The services
    themselves stay private.

    Streams have partitions: ``append``, ``append_encoded``, ``read``, ``stream_end``,
    ``offset_for_timestamp``, ``subscribe`` and ``stream_range`` take ``partition`` (0
    when not named, so front ends that know one partition keep working);
    ``append_partitioned`` places each event by the stream's partitioner (explicit,
    Kafka's murmur2 of the key, sticky when keyless).

    With per-tenant quotas (``quotas.enabled``), ``append``, ``append_encoded``,
    ``append_transactional``,
    ``append_partitioned``, ``read``, ``create_stream``, ``delete_stream``, ``query``,
    ``query_at`` and ``stream_range`` first wait their turn past a rate, then are served
    (a read's answer is also held back for the bytes it read), and subscription pushes
    wait before the next one
    (:mod:`headwater.api.quotas`); without any quota they are the engine's own,
    untouched."""

    _engine: Engine
    _subscriptions: Subscriptions
    _kinds: KindsEngine
    _queries: SqlService
    auth: Auth
    quotas: Quotas = field(default_factory=lambda: Quotas({}))
    _read_ahead: ReadAhead = field(default_factory=ReadAhead)

    def __post_init__(self) -> None:
        engine, subscriptions, queries = self._engine, self._subscriptions, self._queries
        # streams
        self.list_streams = engine.list_streams
        self.create_stream = engine.create_stream
        self.delete_stream = self._delete_stream
        self.alter_partitions = engine.alter_partitions
        self.append = engine.append
        self.append_encoded = engine.append_encoded
        # A lone append answered from its acknowledgement, without a task (Kimberlite's
        # AppendEvents outside a cluster); None under quotas, whose wait is a coroutine.
        self.append_encoded_then = None if self.quotas.enabled else engine.append_encoded_then
        self.append_partitioned = engine.append_partitioned
        self.offset_for_timestamp = engine.offset_for_timestamp
        self.offset_of_max_timestamp = engine.offset_of_max_timestamp
        self.sync_tenant = engine.sync_tenant
        # The fsyncs of deleted streams, kept in the server's totals (a counter that
        # fell with each delete read as a reset to rate() and the slow-fsync alert).
        self._retired_fsync_count, self._retired_fsync_seconds = 0, 0.0
        engine.stream_deleted_listeners.append(self._retire_fsyncs)
        # consumer groups (engine/groups): membership, committed offsets per partition
        self.groups = ConsumerGroups(engine)
        # replication (docs/cluster.md): stored batches out and in, divergent tails cut
        self.replicas = Replicas(engine, self._kinds.changelogs)
        # a cluster node's rules for every front end: appends on leaders, reads below
        # the high watermark (docs/cluster.md, "Front ends")
        self.cluster_gate = ClusterGate(engine, self._kinds.changelogs)
        # kind changelogs as replicated partitions (engine/kinds/replicated.py)
        self.kind_changelogs = self._kinds.changelogs
        # exactly-once producers (engine/transactions): ids, epochs, transactions; a
        # transaction's offsets reach the groups' view as it commits
        self._transactions = TransactionCoordinator(engine, self.groups.commit_staged)
        # subscriptions
        self.subscribe = subscriptions.subscribe
        self.grant = subscriptions.grant
        # queries
        self.query = queries.query
        self.query_at = queries.query_at
        self.stream_range = queries.stream_range
        if self.quotas.enabled:
            self.create_stream = _admitted(self.quotas, engine.create_stream, _request_cost)
            self.delete_stream = _admitted(self.quotas, self._delete_stream, _request_cost)
            self.append = _admitted(self.quotas, engine.append, _values_cost)
            self.append_encoded = _admitted(self.quotas, engine.append_encoded, _section_cost)
            self.append_partitioned = _admitted(
                self.quotas, engine.append_partitioned, _values_cost
            )
            self.query = _admitted(self.quotas, queries.query, _request_cost)
            self.query_at = _admitted(self.quotas, queries.query_at, _request_cost)
            # A read of the stream: it waits the consume debt earlier reads left too.
            self.stream_range = _admitted(self.quotas, queries.stream_range, _read_cost)
            subscriptions.pace = self._pace_subscription

    @classmethod
    async def open(
        cls,
        data_dir: Path,
        engine_config: EngineConfig,
        kinds_config: KindsConfig,
        auth_config: AuthConfig,
        sql_limits: SqlLimits | None = None,
        on_sql_limit: Callable[[str], None] | None = None,
        quotas: Mapping[int, TenantQuota] | None = None,
        clustered: bool = False,
    ) -> EngineAPI:
        """Recover the engine and kinds, start the SQL projections. ``on_sql_limit`` is
        told the ``[limits]`` key each statement stopped by a limit ran into; ``quotas``
        are the per-tenant rates (``[[tenants]]``). A ``clustered`` node leaves its
        transactions to the coordinator the cluster names (docs/cluster.md)."""
        engine = await Engine.open(data_dir, engine_config)
        subscriptions = Subscriptions(engine)
        kinds = await KindsEngine.open(engine, kinds_config)
        queries = SqlService(engine, limits=sql_limits, on_limit=on_sql_limit)
        queries.add_source(KindTables(kinds))
        queries.start()
        api = cls(engine, subscriptions, kinds, queries, Auth(auth_config), Quotas(quotas or {}))
        # Before any front end listens: a transaction a crash left prepared is finished,
        # one left open aborted (each wholly visible or wholly absent).
        if not clustered:
            await api._transactions.recover()
        api._transactions.start_expiry()
        # Committed group offsets are known from the start (/metrics' group lag).
        await api.groups.load_stored()
        return api

    async def close_subscriptions(self) -> None:
        """End every subscription (each front end is told: server shutdown)."""
        await self._subscriptions.close_all(CloseReason.SERVER_SHUTDOWN)

    def stop_queries(self) -> None:
        """Shutdown: interrupt running SQL statements and refuse queued and new ones, so
        front ends waiting on them can answer and stop."""
        self._queries.stop_queries()

    async def close(self) -> None:
        """End every subscription, stop the projections, flush kinds, close the log."""
        self._read_ahead.close()
        await self._transactions.close()
        await self._subscriptions.close_all(CloseReason.SERVER_SHUTDOWN)
        await self._queries.close()
        await self._kinds.close()
        await self._engine.close()

    @property
    def closing(self) -> bool:
        return self._engine.closing

    # ---- tenants and auth -------------------------------------------------------------

    def authenticate(self, token: str | None) -> Principal:
        """The principal of ``token`` (AuthenticationFailed when auth requires one)."""
        return self.auth.authenticate(token)

    def check_tenant(self, tenant_id: int) -> None:
        """TenantNotFound unless ``tenant_id`` exists."""
        self._engine.tenant(tenant_id)

    def session_tenant(self, principal: Principal) -> int:
        """The tenant a session whose wire names none acts for (Kafka's, Rivven's): the
        principal's lowest. AuthenticationFailed when this server has no such tenant: a
        token granting only tenants ``[[tenants]]`` does not declare authenticated, then
        every request failed (Rivven: UNKNOWN; Kafka: the connection dropped)."""
        tenant_id = principal.default_tenant
        try:
            self.check_tenant(tenant_id)
        except TenantNotFound:
            raise AuthenticationFailed(
                f"the token's tenant {tenant_id} does not exist on this server"
                " (no [[tenants]] entry declares it)"
            ) from None
        return tenant_id

    def tenant_named(self, name: str) -> int | None:
        """The id of the tenant ``name`` names (``[[tenants]] name``), None when none
        does (names are not required to be unique: the lowest id wins)."""
        ids = [t.tenant_id for t in self._engine.tenants.values() if t.name == name]
        return min(ids, default=None)

    def tenant_info(self, tenant_id: int) -> TenantInfo:
        tenant = self._engine.tenant(tenant_id)
        return TenantInfo(
            tenant_id=tenant_id,
            name=tenant.name,
            log_position=tenant.committed_position,
            streams=sum(1 for s in tenant.streams.values() if not s.deleted and not s.internal),
        )

    def tenant_ids(self) -> list[int]:
        return sorted(self._engine.tenants)

    # ---- streams ----------------------------------------------------------------------

    def all_streams(self) -> list[StreamInfo]:
        """Every live stream of every tenant (internal ones are not shown)."""
        return [stream.info() for stream in self._engine.all_streams()]

    def stream_info(self, tenant_id: int, stream_id: int) -> StreamInfo:
        return self._engine.stream(tenant_id, stream_id).info()

    def stream_named(self, tenant_id: int, name: str) -> StreamInfo:
        """StreamNotFound unless ``name`` exists in the tenant."""
        return self._engine.stream_by_name(tenant_id, name).info()

    def stream_log_config(self, tenant_id: int, name: str) -> LogConfig:
        """What stream ``name``'s logs run with: its own settings, the rest the
        server's ``[storage]`` defaults (StreamNotFound unless it exists)."""
        return self._engine.stream_by_name(tenant_id, name).partition_logs[0].config

    def stream_target(self, tenant_id: int, name: str) -> StreamTarget:
        """StreamNotFound unless ``name`` exists in the tenant; cheap enough for a
        request that writes one record."""
        stream = self._engine.stream_by_name(tenant_id, name)
        return StreamTarget(stream.stream_id, stream.name, len(stream.partition_logs))

    def stream_name(self, tenant_id: int, stream_id: int) -> str:
        return self._engine.stream(tenant_id, stream_id).name

    def stream_end(self, tenant_id: int, stream_id: int, partition: int = 0) -> int:
        """A partition's committed end offset (the next offset an append to it gets)."""
        return self._engine.stream(tenant_id, stream_id).partition_log(partition).committed_offset

    def readable_end(self, tenant_id: int, stream_id: int, partition: int = 0) -> int:
        """Where a partition's readers stop (read_uncommitted): its committed end, or in
        a cluster its high watermark (docs/cluster.md, "Front ends")."""
        return self._engine.stream(tenant_id, stream_id).partition_log(partition).readable_offset

    async def wait_readable(
        self, tenant_id: int, stream_id: int, partition: int, offset: int, timeout_s: float
    ) -> bool:
        """Wait until readers may read at ``offset`` (the readable end passes it: a
        commit, or in a cluster a high watermark move), at most ``timeout_s``: a long
        poll. False when the time ran out first."""
        stream = self._engine.stream(tenant_id, stream_id)
        return await wait_for_log(
            stream, partition, lambda plog: plog.readable_offset > offset, timeout_s
        )

    def last_stable_offset(self, tenant_id: int, stream_id: int, partition: int = 0) -> int:
        """A partition's last stable offset: where read_committed reads stop (the first
        offset of a transaction still open, else the committed end)."""
        return self._engine.stream(tenant_id, stream_id).partition_log(partition).last_stable_offset

    async def read(
        self,
        tenant_id: int,
        stream_id: int,
        from_offset: int,
        max_bytes: int,
        *,
        max_events: int | None = None,
        partition: int = 0,
        isolation: str = READ_COMMITTED,
        kafka: bool = False,
        read_ahead: bool = False,
        contiguous: bool = False,
    ) -> ReadResult:
        """Committed events of one partition (0 unless named) from ``from_offset`` as
        stored batches. InvalidOffset when retention removed ``from_offset``.
        ``isolation``: read_committed (default: open transactions' events wait for
        their end, aborted ones are never shown) or read_uncommitted. ``kafka``: as a
        Kafka fetch reads (whole batches, markers and aborted batches included, the
        client filtering by :meth:`aborted_transactions`). ``read_ahead``: a reader
        that pages sequentially (:mod:`headwater.api.readahead`): when this read stops
        at its budget, the next page is read while the reader handles this one.
        ``contiguous``: the answer's events are the offsets from ``from_offset`` on with
        no hole (compaction's, aborted batches'), for an answer that carries no offsets;
        from inside a hole, no events and ``next_offset`` past it
        (:meth:`PartitionLog.read <headwater.storage.log.PartitionLog.read>`)."""
        where = f"partition {partition}" if partition else "the stream"
        stream = self._engine.stream(tenant_id, stream_id)
        self._engine.check_replica(stream, partition)
        start = stream.partition_log(partition).start_offset
        if from_offset < start:
            raise OffsetRemoved(from_offset, start, where)
        throttled = self.quotas.enabled
        if throttled:
            # Its turn first (the consume debt of earlier reads too), then the bytes it
            # read hold its answer back (capped; the rest is waited by the next turn).
            await self.quotas.admit(tenant_id, requests=1, consume=True)

        # Strict: a page whose start retention removed meanwhile is OffsetRemoved, never
        # the events from the new start (a Kimberlite answer carries no offsets).
        page = PageRead(
            tenant_id, stream_id, max_bytes, max_events, partition, isolation, contiguous, True
        )

        def ahead(offset: int) -> Pages:
            return self._engine.read_soon(page, offset, then=self._read_ahead.room)

        # A throttled reader waits its turn anyway: reading ahead would only hold memory.
        read_ahead = read_ahead and not throttled and not kafka
        try:
            result = await self._read_ahead.take((page, from_offset)) if read_ahead else None
            if result is None:
                result = await self._engine.read_page(page, from_offset, kafka=kafka)
        except OffsetRemoved as exc:  # retention ran while it waited its turn or read
            raise OffsetRemoved(exc.offset, exc.start, where) from None
        next_offset = result.next_offset
        if read_ahead and next_offset is not None:
            self._read_ahead.start((page, next_offset), follow=ahead)
        if throttled:
            await self.quotas.throttle(tenant_id, consume=result.value_bytes)
        return result

    def aborted_transactions(
        self, tenant_id: int, stream_id: int, partition: int, start: int, end: int
    ) -> list[AbortedTxn]:
        """Aborted transactions with batches in offsets ``[start, end)`` of one
        partition, by first offset (a Kafka read_committed fetch lists them)."""
        plog = self._engine.stream(tenant_id, stream_id).partition_log(partition)
        return plog.aborted_transactions(start, end)

    async def stream_records(
        self,
        tenant_id: int,
        stream_id: int,
        start: int,
        end: int,
        *,
        partition: int = 0,
        isolation: str = READ_COMMITTED,
    ) -> RecordsCursor:
        """Offsets [start, end) of one partition as Arrow record batches with keys and
        headers, read from the log round by round (:class:`RecordsCursor`: call its
        ``next_batch`` off the event loop). ``end`` is cut at the last stable offset
        (read_committed) or the committed offset (read_uncommitted). InvalidOffset when
        retention removed ``start``."""
        if isolation not in (READ_COMMITTED, READ_UNCOMMITTED):
            raise InvalidRequest(
                f"isolation must be {READ_COMMITTED} or {READ_UNCOMMITTED}, not {isolation!r}"
            )
        if start < 0 or end < start:
            raise InvalidRequest(f"bad range {start}..{end}: 0 <= from <= to")
        stream = self._engine.stream(tenant_id, stream_id)
        self._engine.check_replica(stream, partition)
        plog = stream.partition_log(partition)
        if start < plog.start_offset:
            where = f"partition {partition}" if partition else "the stream"
            raise OffsetRemoved(start, plog.start_offset, where)
        if self.quotas.enabled:
            await self.quotas.admit(tenant_id, requests=1, consume=True)
        return RecordsCursor(plog, start, end, committed_only=isolation == READ_COMMITTED)

    async def wait_for_end(
        self, tenant_id: int, stream_id: int, partition: int, offset: int, timeout_s: float
    ) -> bool:
        """Wait until the partition's committed end passes ``offset`` (an event at or
        after it is stored), at most ``timeout_s``: a consumer's long poll. False when
        the time ran out first."""
        stream = self._engine.stream(tenant_id, stream_id)
        return await wait_for_end(stream, partition, offset, timeout_s)

    # ---- exactly-once producers (docs/transactions.md) ---------------------------------

    async def init_producer(
        self,
        tenant_id: int,
        transactional_id: str | None = None,
        transaction_timeout_ms: int | None = None,
    ) -> ProducerIdentity:
        """InitProducerId: a producer id and epoch (with a transactional id: its
        producer, the epoch bumped, an older instance fenced)."""
        if transactional_id is None:
            anywhere = await self._transactions.new_producer_id(tenant_id)
            if anywhere is not None:
                return anywhere
        txns = await self._transactions.tenant(tenant_id)
        return await txns.init_producer(transactional_id, transaction_timeout_ms)

    async def add_partitions_to_txn(
        self,
        tenant_id: int,
        transactional_id: str,
        producer: ProducerIdentity,
        partitions: Sequence[tuple[int, int]],
    ) -> None:
        """(stream id, partition) pairs join the producer's transaction."""
        txns = await self._transactions.tenant(tenant_id)
        await txns.add_partitions(transactional_id, producer, partitions)

    async def append_transactional(
        self,
        tenant_id: int,
        transactional_id: str,
        producer: ProducerIdentity,
        stream_id: int,
        sequence: int,
        values: Sequence[bytes] | KafkaSection,
        **batch: Unpack[TxnBatchOptions],
    ) -> AppendInfo:
        """A batch inside the producer's transaction (its partition joins it); a
        produced Kafka batch is stored in Kafka form. In a cluster, a partition's leader
        that does not coordinate the transaction stores it against the partition's
        producer table (the client added the partition at the coordinator first)."""
        if self.quotas.enabled:  # produced like any append: held to the produce rate
            produced = (
                len(values.section) if isinstance(values, KafkaSection) else sum(map(len, values))
            )
            await self.quotas.admit(tenant_id, produce=produced, requests=1)
        if self._transactions.coordinates(tenant_id):
            txns = await self._transactions.tenant(tenant_id)
            append = functools.partial(txns.append, transactional_id)
        else:
            append = functools.partial(append_transactional, self._engine, tenant_id)
        return await append(producer, stream_id, sequence, values, **batch)

    async def add_offsets_to_txn(
        self,
        tenant_id: int,
        transactional_id: str,
        producer: ProducerIdentity,
        group: str,
        offsets: Mapping[tuple[str, int], tuple[int, str]],
    ) -> None:
        """Consumer-group offsets ((stream, partition) -> (offset, metadata)) committed
        with the transaction."""
        txns = await self._transactions.tenant(tenant_id)
        await txns.add_offsets(transactional_id, producer, group, offsets)

    async def end_transaction(
        self, tenant_id: int, transactional_id: str, producer: ProducerIdentity, commit: bool
    ) -> None:
        """Commit or abort the producer's transaction, atomically across partitions."""
        txns = await self._transactions.tenant(tenant_id)
        await txns.end_transaction(transactional_id, producer, commit)

    # ---- transactions across a cluster (docs/cluster.md) --------------------------------

    def join_transactions_cluster(self, hooks: ClusterHooks) -> None:
        """The cluster names the transaction coordinator from now on."""
        self._transactions.join_cluster(hooks)

    async def reload_transactions(self, tenant_id: int, coordinates: bool) -> None:
        """This node started (replay the state, finish what was prepared) or stopped
        coordinating the tenant's transactions."""
        await self._transactions.reload(tenant_id, coordinates)

    async def _delete_stream(self, tenant_id: int, stream_id: int) -> None:
        """The stream and its events, and every group's committed offsets of it, those
        staged in open transactions too (as Kafka deletes a deleted topic's): a stream
        made again under its name starts afresh."""
        name = self._engine.stream(tenant_id, stream_id).name
        await self._engine.delete_stream(tenant_id, stream_id)
        self._transactions.forget_stream(tenant_id, name)
        await self.groups.forget_stream(tenant_id, name)

    def on_stream_deleted(self, listener: Callable[[int, str], None]) -> None:
        """Call ``listener(tenant_id, stream name)`` as a stream is deleted (here or, in a
        cluster, as this node drops its copy): what a front end keeps per stream (its
        metrics' series) can go."""
        self._engine.stream_deleted_listeners.append(
            lambda stream: listener(stream.tenant.tenant_id, stream.name)
        )

    def on_transactional_id_expired(self, listener: Callable[[int, str], None]) -> None:
        """Call ``listener(tenant_id, transactional_id)`` as an idle transactional id
        expires (TRANSACTIONAL_ID_EXPIRATION_MS, as Kafka's): whatever a front end
        keeps for it can go."""
        self._transactions.expiry_listeners.append(listener)

    async def open_transaction_state(self, tenant_id: int) -> None:
        """The tenant's transaction state stream, created if missing (as Kafka creates
        __transaction_state on the first FindCoordinator for a transactional id)."""
        await create_state_stream(self._engine, tenant_id)

    async def write_marker(
        self,
        tenant_id: int,
        stream: str,
        partition: int,
        producer_id: int,
        epoch: int,
        commit: bool,
    ) -> int | None:
        """A marker the coordinator asked this partition's leader for; the partition's
        end after it, None when the transaction is not open there (already marked)."""
        stream_id = self._engine.stream_by_name(tenant_id, stream).stream_id
        stored = await write_marker(
            self._engine, tenant_id, stream_id, partition, producer_id, epoch, commit
        )
        return None if stored is None else stored.next_offset

    def fsync_stats(self) -> FsyncStats:
        """The group committers' fsyncs, every partition of every stream (internal ones
        too: the totals are the server's, they name no stream) and of the streams deleted
        since the start (only partition 0's were counted, and a delete took its stream's
        share back)."""
        count, seconds = self._retired_fsync_count, self._retired_fsync_seconds
        last = 0.0
        for stream in self._engine.all_streams(internal=True):
            for committer in stream.committers:
                count += committer.fsyncs
                seconds += committer.fsync_seconds_total
                last = max(last, committer.last_fsync_seconds)
        return FsyncStats(count, seconds, last)

    def _retire_fsyncs(self, stream: Stream) -> None:
        for committer in stream.committers:
            self._retired_fsync_count += committer.fsyncs
            self._retired_fsync_seconds += committer.fsync_seconds_total

    @property
    def events_appended(self) -> int:
        return self._engine.events_appended

    @property
    def bytes_appended(self) -> int:
        return self._engine.bytes_appended

    # ---- quotas ------------------------------------------------------------------------

    async def _pace_subscription(self, tenant_id: int, value_bytes: int) -> None:
        """After a subscription's push (it went out at once): its bytes are counted, and
        the subscription's next push waits until the tenant's consume debt is paid, in
        full (no answer is waiting on it, so no cap)."""
        await self.quotas.throttle(tenant_id, consume=value_bytes, max_wait_s=math.inf)

    def throttle_seconds(self) -> dict[tuple[int, str], float]:
        """Seconds requests waited their turn or answers were held back, per (tenant,
        quota), since start (summed over requests: concurrent ones' waits overlap)."""
        return {
            (tenant_id, str(quota)): seconds
            for (tenant_id, quota), seconds in sorted(self.quotas.throttle_seconds_total.items())
        }

    # ---- subscriptions ----------------------------------------------------------------

    def unsubscribe(
        self, subscription: Subscription, reason: CloseReason = CloseReason.CLIENT_CANCELLED
    ) -> None:
        self._subscriptions.close(subscription, reason)

    def subscription_stats(self) -> Iterator[SubscriptionStats]:
        for (tenant_id, _stream_id), members in sorted(self._subscriptions.by_stream.items()):
            live = [s for s in members if not s.closed]
            if live:
                yield SubscriptionStats(
                    tenant_id, live[0].stream.name, len(live), sum(s.credits for s in live)
                )

    def subscription_counts(self, tenant_id: int) -> dict[str, int]:
        """Open subscriptions per stream name of a tenant."""
        counts: dict[str, int] = {}
        for stats in self.subscription_stats():
            if stats.tenant_id == tenant_id:
                counts[stats.stream] = stats.open
        return counts

    def group_lags(self) -> Iterator[GroupLag]:
        for (tenant_id, stream_id), groups in sorted(self._subscriptions.groups.items()):
            tenant = self._engine.tenants.get(tenant_id)
            stream = None if tenant is None else tenant.streams.get(stream_id)
            if stream is None or stream.deleted:
                continue
            end = stream.log.committed_offset
            for group, offset in sorted(groups.offsets.items()):
                yield GroupLag(tenant_id, stream.name, group, max(0, end - offset))

    def consumer_groups(self, tenant_id: int) -> list[GroupInfo]:
        """Every consumer group of the tenant's streams, by stream then group."""
        out: list[GroupInfo] = []
        for info in self._engine.list_streams(tenant_id):
            stream = self._engine.stream(tenant_id, info.stream_id)
            offsets = self._subscriptions.groups_of(stream)
            groups = sorted(offsets.offsets)
            out.extend(self._group_info(stream, offsets, group) for group in groups)
        return out

    async def reset_group_offset(
        self, tenant_id: int, stream_id: int, group: str, offset: int
    ) -> GroupInfo:
        """Move consumer group ``group`` of a stream to ``offset`` (back to replay, ahead
        to skip), durably before returning, as Kafka's ``--reset-offsets``: the group must
        exist and no member of it may be consuming (its position would be overwritten by
        the member's next acknowledgement), and ``offset`` must lie in the stream's
        retained range. InvalidRequest or InvalidOffset otherwise, nothing changed."""
        stream = self._engine.stream(tenant_id, stream_id)
        offsets = self._subscriptions.groups_of(stream)
        if group not in offsets.offsets:
            raise InvalidRequest(f"stream {stream.name!r} has no consumer group {group!r}")
        if group in offsets.active:
            raise InvalidRequest(
                f"consumer group {group!r} of stream {stream.name!r} has a member consuming:"
                " stop its consumers before resetting its offset"
            )
        start, end = stream.log.start_offset, stream.log.committed_offset
        if not start <= offset <= end:
            raise InvalidOffset(
                f"offset {offset} is outside the range {start}..{end} of stream {stream.name!r}"
            )
        offsets.reset(group, offset)
        await offsets.flush()
        return self._group_info(stream, offsets, group)

    @staticmethod
    def _group_info(stream: Stream, offsets: GroupOffsets, group: str) -> GroupInfo:
        end = stream.log.committed_offset
        offset = offsets.offsets[group]
        waiting = len(offsets.waiting.get(group, ()))
        active = group in offsets.active
        return GroupInfo(stream.name, group, offset, end, max(0, end - offset), active, waiting)

    # ---- kinds ------------------------------------------------------------------------

    def kinds(self, tenant_id: int) -> TenantKinds:
        """The entity kinds of a tenant: create, connect sources, apply, subscribe."""
        return self._kinds.tenant(tenant_id)

    def kind_stats(self, tenant_id: int | None = None) -> list[KindStats]:
        """Schema, entities, subscribers and changelog size of each kind (of one tenant,
        or of all), by tenant then kind id."""
        out: list[KindStats] = []
        for tid, tenant in sorted(self._kinds.tenants.items()):
            if tenant_id is not None and tid != tenant_id:
                continue
            out.extend(_kind_stats(tid, state) for _, state in sorted(tenant.kinds.items()))
        return out

    def kind_named(self, tenant_id: int, name: str) -> KindStats:
        """KindNotFound unless the tenant has a kind ``name``."""
        tenant = self._kinds.tenant(tenant_id)
        return _kind_stats(tenant_id, tenant.kind_state(tenant.get_kind(name).kind_id))

    def kind_entities(
        self, tenant_id: int, kind_id: int, limit: int
    ) -> tuple[int, list[EntityState]]:
        """The number of live entities of a kind and the first ``limit`` of them by
        entity id (a stable order for repeated reads of a large kind)."""
        state = self._kinds.tenant(tenant_id).kind_state(kind_id)
        first = itertools.islice(state.scan_entities(ordered=True), max(0, limit))
        return state.count, list(first)

    def kind_entity(self, tenant_id: int, kind_id: int, entity_id: bytes) -> EntityState | None:
        return self._kinds.tenant(tenant_id).kind_state(kind_id).entity(entity_id)

    def kind_sources(self, tenant_id: int) -> list[SourceInfo]:
        """The tenant's kind writers (ConvergeDB connections and Ripple workers)."""
        tenant = self._kinds.tenant(tenant_id)
        now = time.monotonic()
        return [
            SourceInfo(
                source_id=slot,
                name=source.name,
                connected=source.connected,
                connected_at_ms=source.connected_at_ns // 1_000_000,
                idle_ms=max(0, round((now - source.last_seen) * 1000)),
                liveness_deadline_ms=source.deadline_ms,
                entities=tenant.source_entity_count(slot),
            )
            for slot, source in sorted(tenant.sources.items())
        ]

    def kind_totals(self) -> dict[int, tuple[int, int]]:
        """Per tenant: (windows flushed, changes committed)."""
        return {
            tid: (tenant.windows_flushed, tenant.changes_committed)
            for tid, tenant in sorted(self._kinds.tenants.items())
        }

    # ---- queries ----------------------------------------------------------------------

    def query_stats(self) -> tuple[int, float]:
        """(statements run, seconds spent running them) since start."""
        return self._queries.queries, self._queries.query_seconds_total

    def query_queue(self) -> tuple[int, int]:
        """(statements running, statements waiting for one of ``sql_concurrency``)."""
        return self._queries.running_queries, self._queries.queued_queries

    # ---- lifecycle helpers ------------------------------------------------------------

    async def flush_kinds(self, tenant_id: int | None = None) -> None:
        """Make every pending kind write durable and acknowledged (of one tenant, or all).
        Every tenant is flushed even when another's flush fails; the first failure is
        raised after all of them."""
        tenants = [t for tid, t in self._kinds.tenants.items() if tenant_id in (None, tid)]
        outcomes = await asyncio.gather(*(t.flush() for t in tenants), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
