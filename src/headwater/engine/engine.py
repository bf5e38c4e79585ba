"""The engine: tenants, streams and the tenant log, behind one API every front end calls.

The engine runs on the asyncio loop thread. Appends are assigned their offsets and tenant
log positions on that thread (so positions follow commit order per stream), written with
one ``pwrite``, and acknowledged by the stream's group committer under its sync policy.
Anything that may wait for the disk (fsync, metadata writes, recovery, retention,
compaction, large reads) runs in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, Unpack

import numpy as np

from headwater.engine.names import RESERVED_PREFIXES, check_stream_name
from headwater.engine.partitioner import Partitioner
from headwater.errors import (
    AppendTooLarge,
    BatchTooLarge,
    HeadwaterError,
    InternalError,
    InvalidRequest,
    StorageError,
    StreamAlreadyExists,
    StreamNotFound,
    StreamQuotaExceeded,
    TenantNotFound,
)
from headwater.storage.batch import HEADER_SIZE, Event, EventColumns, Headers, encode_values
from headwater.storage.compression import check_compression
from headwater.storage.files import DEFAULT_OPEN_FILES, FileCache
from headwater.storage.group_commit import GroupCommitter
from headwater.storage.log import (
    AppendInfo,
    LogConfig,
    PartitionLog,
    ReadResult,
    SyncPolicy,
    fsync_directory,
)
from headwater.storage.metadata import (
    DataDirLock,
    MetadataWriter,
    read_json,
    remove_temp_files,
    write_json_atomic,
)
from headwater.storage.segment import WouldBlock, no_wait
from headwater.tasks import cancel_and_wait

# An append's acknowledgement in a cluster (Kafka's acks): ACKS_ALL (the default for
# every front end) waits until the partition's in-sync replicas hold the batch;
# ACKS_LEADER answers once this node stored it (Kafka's acks=1 and 0, Rivven's acks=1).
ACKS_ALL = -1
ACKS_LEADER = 1


class ReplicaAcks(Protocol):
    """What a cluster node sets as :attr:`Engine.replica_acks` (its ClusterView)."""

    def check_min_isr(self, tenant_id: int, stream: str, partition: int) -> None:
        """NotEnoughReplicas, before anything is written, when the ISR is too small."""

    async def replicated(
        self, tenant_id: int, stream: str, partition: int, end: int, timeout_s: float
    ) -> None:
        """Return once the in-sync replicas hold the partition below ``end``."""


log = logging.getLogger(__name__)

MAX_APPEND_EVENTS = 10_000
# A produced Kafka batch is stored whole, as Kafka stores it: librdkafka sends up to
# batch.num.messages (10,000 by default), a compressed Java batch of small records more.
# Readers cut inside a batch; the SQL projection takes one whole in a round of this size.
MAX_KAFKA_BATCH_RECORDS = 65_536
MAX_APPEND_BYTES = 4 << 20
MAX_PARTITIONS = 1024
TIMESTAMP_TYPES = ("CreateTime", "LogAppendTime")
STREAM_META = "stream.json"
TENANT_META = "tenant.json"


READ_COMMITTED = "read_committed"
READ_UNCOMMITTED = "read_uncommitted"


def committed_only(isolation: str) -> bool:
    """Whether a read at ``isolation`` sees committed transactions only."""
    if isolation == READ_COMMITTED:
        return True
    if isolation == READ_UNCOMMITTED:
        return False
    raise InvalidRequest(f"isolation is read_committed or read_uncommitted, not {isolation!r}")


@dataclass(frozen=True, slots=True)
class PageRead:
    """A read of one partition but for where it starts: every page of a sequential
    reader asks the same (its read-ahead key, api/readahead.py). ``isolation``:
    ``read_committed`` (the default) stops at the partition's last stable offset and
    leaves out aborted transactions; ``read_uncommitted`` shows every stored event
    (transaction markers are never shown). ``contiguous``: the events' offsets have no
    hole, for an answer that carries none. ``strict``: OffsetRemoved when retention
    removed the offset a page starts at, not a page from the log's start
    (:meth:`PartitionLog.read`)."""

    tenant_id: int
    stream_id: int
    max_bytes: int = 1 << 20
    max_events: int | None = None
    partition: int = 0
    isolation: str = READ_COMMITTED
    contiguous: bool = False
    strict: bool = False

    def __post_init__(self) -> None:
        committed_only(self.isolation)  # refused here, not in the thread that reads

    def read(self, plog: PartitionLog, from_offset: int, *, kafka: bool = False) -> ReadResult:
        return plog.read(
            from_offset,
            self.max_bytes,
            max_events=self.max_events,
            committed_only=committed_only(self.isolation),
            kafka=kafka,
            contiguous=self.contiguous,
            strict=self.strict,
        )


async def run_every(
    interval: float, job: Callable[[], Awaitable[object]], what: str, logger: logging.Logger = log
) -> None:
    """Run ``job`` every ``interval`` seconds until cancelled; a run that fails is logged
    (``<what> failed``) and the next one goes ahead."""
    while True:
        await asyncio.sleep(interval)
        try:
            await job()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%s failed", what)


@dataclass(frozen=True)
class EngineConfig:
    """Server-wide storage defaults; a stream may override each of them."""

    sync: SyncPolicy = field(default_factory=SyncPolicy)
    segment_bytes: int = 128 << 20
    segment_ms: int | None = 7 * 86_400_000
    retention_ms: int | None = None
    retention_bytes: int | None = None
    delete_retention_ms: int = 86_400_000
    producer_expiry_ms: int = 86_400_000
    maintenance_interval_ms: int = 30_000
    compression: str = "none"  # sealed segments: "none", "zstd" or "lz4"
    tenants: dict[int, str] = field(default_factory=lambda: {0: "default"})
    # [limits]: segment files open at once across every log (least recently used closed),
    # and streams one tenant may have (a create past it: StreamQuotaExceeded).
    open_files: int = DEFAULT_OPEN_FILES
    max_streams_per_tenant: int = 100_000


# A segment's size and age must be positive; retention and tombstones' time may be 0, as
# in Kafka (delete sealed segments, or tombstones, at the next maintenance run).
_POSITIVE_SETTINGS = ("segment_bytes", "segment_ms")
_NON_NEGATIVE_SETTINGS = ("retention_ms", "retention_bytes", "delete_retention_ms")


@dataclass(frozen=True)
class StreamSettings:
    """Per-stream overrides; ``None`` means "the server's default"."""

    sync: str | None = None
    segment_bytes: int | None = None
    segment_ms: int | None = None
    retention_ms: int | None = None
    retention_bytes: int | None = None
    cleanup_policy: str = "delete"
    delete_retention_ms: int | None = None
    compression: str | None = None
    # CreateTime: an event keeps the producer's timestamp (the broker's clock when it
    # gives none); LogAppendTime: the broker's clock always, as Kafka's topic setting.
    timestamp_type: str = "CreateTime"
    # Asked for at creation (None: 1) and by alter_partitions; stream.json keeps the
    # count at its top level ("partitions"), not among the settings.
    partitions: int | None = None

    def log_config(self, defaults: EngineConfig) -> LogConfig:
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return LogConfig(
            segment_bytes=pick(self.segment_bytes, defaults.segment_bytes),
            segment_ms=pick(self.segment_ms, defaults.segment_ms),
            retention_ms=pick(self.retention_ms, defaults.retention_ms),
            retention_bytes=pick(self.retention_bytes, defaults.retention_bytes),
            cleanup_policy=self.cleanup_policy,
            delete_retention_ms=pick(self.delete_retention_ms, defaults.delete_retention_ms),
            producer_expiry_ms=defaults.producer_expiry_ms,
            sync=SyncPolicy.parse(self.sync) if self.sync else defaults.sync,
            compression=pick(self.compression, defaults.compression),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StreamSettings:
        # JSON has one number type: 60000.0 is the integer 60000 (as JSON Schema says).
        known: dict[str, Any] = {
            k: int(v) if isinstance(v, float) and v.is_integer() else v
            for k, v in data.items()
            if k in cls.__dataclass_fields__
        }
        settings = cls(**known)
        settings.validate()
        return settings

    def to_dict(self) -> dict[str, Any]:
        """The settings set, as stream.json (and a cluster's registration) keeps them:
        without the partition count (kept apart, where it changes with alter_partitions);
        :meth:`from_dict` reads them back."""
        stored = {k: v for k, v in asdict(self).items() if v is not None}
        stored.pop("partitions", None)
        return stored

    def validate(self) -> None:
        # Settings arrive as JSON or wire values: check types before anything parses them.
        if self.sync is not None and not isinstance(self.sync, str):
            raise InvalidRequest("sync must be a string: fsync, none or interval:<ms>")
        if not isinstance(self.cleanup_policy, str):
            raise InvalidRequest("cleanup_policy must be 'delete' or 'compact'")
        if self.timestamp_type not in TIMESTAMP_TYPES:
            raise InvalidRequest("timestamp_type must be 'CreateTime' or 'LogAppendTime'")
        if self.partitions is not None:
            check_partition_count(self.partitions)
        if self.compression is not None:
            try:
                check_compression(self.compression)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
        for name in (*_POSITIVE_SETTINGS, *_NON_NEGATIVE_SETTINGS):
            value = getattr(self, name)
            low = 1 if name in _POSITIVE_SETTINGS else 0
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not low <= value < 1 << 63
            ):
                what = "a positive integer" if low else "an integer from 0"
                raise InvalidRequest(f"{name} must be {what} up to 2**63-1")
        try:
            if self.sync is not None:
                SyncPolicy.parse(self.sync)
            LogConfig(
                segment_bytes=self.segment_bytes or LogConfig.segment_bytes,
                cleanup_policy=self.cleanup_policy,
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None


def check_partition_count(count: object) -> int:
    """``count`` as a stream's partition count: an integer from 1 to MAX_PARTITIONS."""
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_PARTITIONS:
        raise InvalidRequest(f"partitions must be an integer from 1 to {MAX_PARTITIONS}")
    return count


@dataclass(frozen=True)
class PartitionInfo:
    partition: int
    start_offset: int
    next_offset: int  # committed end: the next offset an append to it gets
    size_bytes: int
    segments: int
    last_stable_offset: int  # where read_committed readers stop (an open transaction)
    # where read_uncommitted readers stop: next_offset, or in a cluster the high watermark
    high_watermark: int


@dataclass(frozen=True)
class StreamInfo:
    """A stream as front ends show it. ``start_offset`` and ``next_offset`` are partition
    0's (what single-partition clients read); ``size_bytes`` and ``segments`` add up every
    partition; ``partition_info`` has each partition's own."""

    tenant_id: int
    stream_id: int
    name: str
    created_ns: int
    start_offset: int
    next_offset: int
    size_bytes: int
    segments: int
    settings: StreamSettings
    sync: str
    partitions: int = 1
    partition_info: tuple[PartitionInfo, ...] = ()

    @property
    def events_appended(self) -> int:
        """Events ever appended to the stream: the sum of its partitions' next offsets
        (``next_offset`` alone for a stream of one partition)."""
        if not self.partition_info:
            return self.next_offset
        return sum(p.next_offset for p in self.partition_info)


@dataclass(frozen=True)
class PartitionedAppend:
    """Where each event of a partitioned append went: ``partitions[i]`` and
    ``offsets[i]`` for event i, and the tenant log positions each partition's events
    got (``appends``: one AppendInfo per batch written, in partition order)."""

    partitions: list[int]
    offsets: list[int]
    timestamps: list[int]
    appends: list[tuple[int, AppendInfo]]


@dataclass(eq=False)
class Stream:
    """One stream: ``partition_logs[n]`` is ``partition-<n>/``, each with its own group
    committer. ``log`` and ``committer`` are partition 0's, what every front end that
    predates partitions reads and appends to."""

    tenant: Tenant = field(repr=False)
    stream_id: int
    name: str
    created_ns: int
    settings: StreamSettings
    partition_logs: list[PartitionLog] = field(repr=False)
    committers: list[GroupCommitter] = field(repr=False)
    deleted: bool = False
    delete_listeners: list[Callable[[], None]] = field(default_factory=list, repr=False)
    # Told (with the new count) after alter_partitions added partitions.
    partition_listeners: list[Callable[[int], None]] = field(default_factory=list, repr=False)
    # Sticky partitioning of keyless events (the broker's, for producers that name none).
    partitioner: Partitioner = field(default_factory=Partitioner, repr=False)
    alter_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    # headwater's own state (a reserved name: hw_consumer_offsets, hw_transaction_state):
    # the engine's lookups treat it as absent unless the caller passes internal=True.
    internal: bool = False

    @property
    def log(self) -> PartitionLog:
        return self.partition_logs[0]

    @property
    def committer(self) -> GroupCommitter:
        return self.committers[0]

    @property
    def partitions(self) -> int:
        return len(self.partition_logs)

    @property
    def directory(self) -> Path:
        return self.log.directory.parent

    def partition_log(self, partition: int) -> PartitionLog:
        if not isinstance(partition, int) or not 0 <= partition < len(self.partition_logs):
            raise InvalidRequest(
                f"partition {partition} does not exist: stream {self.name!r} has "
                f"{len(self.partition_logs)} (0..{len(self.partition_logs) - 1})"
            )
        return self.partition_logs[partition]

    def info(self) -> StreamInfo:
        parts = tuple(
            PartitionInfo(
                partition=n,
                start_offset=plog.start_offset,
                next_offset=plog.committed_offset,
                size_bytes=plog.size_bytes,
                segments=len(plog.segments),
                last_stable_offset=plog.last_stable_offset,
                high_watermark=plog.readable_offset,
            )
            for n, plog in enumerate(self.partition_logs)
        )
        return StreamInfo(
            tenant_id=self.tenant.tenant_id,
            stream_id=self.stream_id,
            name=self.name,
            created_ns=self.created_ns,
            start_offset=parts[0].start_offset,
            next_offset=parts[0].next_offset,
            size_bytes=sum(p.size_bytes for p in parts),
            segments=sum(p.segments for p in parts),
            settings=self.settings,
            sync=str(self.log.config.sync),
            partitions=len(parts),
            partition_info=parts,
        )


class Tenant:
    """A tenant: its streams and its log position counter."""

    def __init__(self, tenant_id: int, name: str, directory: Path) -> None:
        self.tenant_id = tenant_id
        self.name = name
        self.directory = directory
        self.streams: dict[int, Stream] = {}
        self.by_name: dict[str, int] = {}
        self.next_stream_id = 1
        self.next_position = 0
        self.position_floor = 0  # positions of deleted streams are never reused
        self._inflight: dict[int, int] = {}  # first position -> count, not yet committed
        self.reserved_names: set[str] = set()  # streams being created
        self.kind_names: set[str] = set()  # a stream may not take them (both are SQL tables)
        self.creates_in_flight = 0  # stream creates under way (the stream quota counts them)

    @property
    def committed_position(self) -> int:
        """Every position below this is committed (the tenant log's head)."""
        return min(self._inflight) if self._inflight else self.next_position

    def claim_positions(self, count: int) -> int:
        first = self.next_position
        self.next_position += count
        self._inflight[first] = count
        return first

    def release_positions(self, first: int) -> None:
        self._inflight.pop(first, None)

    def meta(self) -> dict[str, Any]:
        return {
            "id": self.tenant_id,
            "name": self.name,
            "next_stream_id": self.next_stream_id,
            "position_floor": max(self.position_floor, self.next_position),
        }


class Engine:
    """Owns every tenant and stream under one data directory."""

    def __init__(self, data_dir: Path, config: EngineConfig) -> None:
        self.data_dir = data_dir
        self.config = config
        self.tenants: dict[int, Tenant] = {}
        self.executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="hw-io")
        # Every segment file of every log is opened through this bounded set.
        self.files = FileCache(config.open_files)
        self.metadata = MetadataWriter()
        self._lock = DataDirLock(data_dir)
        self.stream_quota_refusals = 0
        self._maintenance: asyncio.Task[None] | None = None
        self._inflight_appends = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.closing = False
        self.closed = False
        self.events_appended = 0
        self.bytes_appended = 0
        # Hooks for layers built on the engine (SQL projections, subscriptions, metrics).
        self.stream_created_listeners: list[Callable[[Stream], None]] = []
        self.stream_deleted_listeners: list[Callable[[Stream], None]] = []
        # In a cluster (docs/cluster.md): raises NotLeader unless this node leads the
        # partition (tenant, stream name, partition) now; None on a single node.
        self.leader_check: Callable[[int, str, int], None] | None = None
        # In a cluster: raises NotLeader (naming the leader) when this node holds no
        # replica of the partition, whose reads would find it empty; None on one node.
        self.replica_check: Callable[[int, str, int], None] | None = None
        # In a cluster: an ACKS_ALL append is refused below min ISR before it is written
        # and answered once the in-sync replicas hold it (one wait per stored batch, up
        # to replica_acks_timeout_s); None on a single node.
        self.replica_acks: ReplicaAcks | None = None
        self.replica_acks_timeout_s = 30.0
        # In a cluster: awaited before a (non-internal) stream is deleted, with (tenant,
        # name): the stream leaves the cluster's registry first; None on a single node.
        self.before_delete: Callable[[int, str], Awaitable[None]] | None = None
        # In a cluster: a stream a client creates here is first registered in the
        # cluster (StreamAlreadyExists when it is there already); None on one node.
        self.before_create: Callable[[int, str, StreamSettings], Awaitable[None]] | None = None

    # ---- lifecycle ------------------------------------------------------------------

    @classmethod
    async def open(cls, data_dir: Path | str, config: EngineConfig | None = None) -> Engine:
        """Open the data directory, recovering every log (in a worker thread)."""
        engine = cls(Path(data_dir), config or EngineConfig())
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            await loop.run_in_executor(engine.executor, engine._load)
        except BaseException:
            await loop.run_in_executor(engine.executor, engine._abandon)
            raise
        streams = sum(len(t.streams) for t in engine.tenants.values())
        log.info(
            "recovered %d tenants, %d streams in %.3fs",
            len(engine.tenants),
            streams,
            time.monotonic() - started,
        )
        for tenant in engine.tenants.values():
            for stream in tenant.streams.values():
                for committer in stream.committers:
                    committer.start()
        interval = engine.config.maintenance_interval_ms
        if interval > 0:
            engine._maintenance = loop.create_task(engine._maintenance_loop(interval / 1000))
        return engine

    def _load(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock.acquire()
        tenants_dir = self.data_dir / "tenants"
        tenants_dir.mkdir(parents=True, exist_ok=True)
        known: dict[int, str] = dict(self.config.tenants)
        known.setdefault(0, "default")
        for path in tenants_dir.iterdir():
            if path.is_dir() and path.name.isdigit():
                meta_path = path / TENANT_META
                name = _read_meta(meta_path)["name"] if meta_path.exists() else str(path.name)
                known.setdefault(int(path.name), str(name))
        for tenant_id, name in sorted(known.items()):
            self.tenants[tenant_id] = self._load_tenant(tenant_id, name)

    def _load_tenant(self, tenant_id: int, name: str) -> Tenant:
        directory = self.data_dir / "tenants" / str(tenant_id)
        tenant = Tenant(tenant_id, name, directory)
        streams_dir = directory / "streams"
        streams_dir.mkdir(parents=True, exist_ok=True)
        meta_path = directory / TENANT_META
        # Metadata writes a crash cut short: tenant.json's, and the kind registry's beside
        # it (each stream's own, groups.json's, as each stream is opened below).
        remove_temp_files(directory)
        if (directory / "kinds").is_dir():
            remove_temp_files(directory / "kinds")
        if meta_path.exists():
            meta = _read_meta(meta_path)
            tenant.next_stream_id = int(meta.get("next_stream_id", 1))
            tenant.position_floor = int(meta.get("position_floor", 0))
        # In id order, so of two streams holding one name (damage `headwater check`
        # names) the older one keeps it, on every start alike.
        for path in sorted(streams_dir.iterdir(), key=_by_stream_id):
            if path.name.startswith((".deleted-", ".creating-")):
                shutil.rmtree(path, ignore_errors=True)  # a delete or create cut short
                continue
            if path.name.isdigit():
                tenant.next_stream_id = max(tenant.next_stream_id, int(path.name) + 1)
            if not (path / STREAM_META).exists():
                continue
            remove_temp_files(path)
            stream = self._open_stream(tenant, path, _read_meta(path / STREAM_META))
            tenant.streams[stream.stream_id] = stream
            tenant.next_stream_id = max(tenant.next_stream_id, stream.stream_id + 1)
            holder = tenant.by_name.setdefault(stream.name, stream.stream_id)
            if holder != stream.stream_id:
                log.error(
                    "streams %d and %d of tenant %d are both named %r; the name stays with "
                    "%d, %d is left out of listings and reachable by id only (run headwater "
                    "check)",
                    holder,
                    stream.stream_id,
                    tenant_id,
                    stream.name,
                    holder,
                    stream.stream_id,
                )
        last_positions = [
            p
            for s in tenant.streams.values()
            for plog in s.partition_logs
            if (p := plog.last_position) is not None
        ]
        tenant.next_position = max([tenant.position_floor, *last_positions])
        self.metadata.write(meta_path, tenant.meta)
        return tenant

    def _abandon(self) -> None:
        """After a failed open: close what was opened and let the data directory go."""
        for tenant in self.tenants.values():
            for stream in tenant.streams.values():
                for plog in stream.partition_logs:
                    plog.close()
        self._lock.release()

    def _open_stream(self, tenant: Tenant, path: Path, meta: dict[str, Any]) -> Stream:
        settings = StreamSettings.from_dict(meta.get("settings", {}))
        count = int(meta.get("partitions", 1))
        if count < 1:
            raise StorageError(f"{path / STREAM_META}: partitions {count} (run headwater check)")
        logs: list[PartitionLog] = []
        try:
            for n in range(count):
                logs.append(self._open_partition(path, n, settings))
        except BaseException:
            for plog in logs:
                plog.close()
            raise
        return Stream(
            tenant,
            int(meta["id"]),
            str(meta["name"]),
            int(meta["created_ns"]),
            settings,
            logs,
            [GroupCommitter(plog, self.executor) for plog in logs],
            # From the name, so recovery marks what create_stream(internal=True) made:
            # only internal creates may take a reserved name (check_stream_name).
            internal=str(meta["name"]).startswith(RESERVED_PREFIXES),
        )

    def _open_partition(self, path: Path, partition: int, settings: StreamSettings) -> PartitionLog:
        # A partition directory missing under a count stream.json gives: created empty
        # (alter_partitions makes the directories before it writes the count, so only
        # outside damage takes one away; an empty partition is what it had at most).
        directory = path / f"partition-{partition}"
        return PartitionLog.open(directory, settings.log_config(self.config), self.files)

    async def close(self) -> None:
        """Graceful stop: refuse new appends, finish in-flight ones, fsync, close."""
        if self.closed:
            return
        self.closing = True
        await cancel_and_wait(self._maintenance)
        await self._idle.wait()
        loop = asyncio.get_running_loop()
        # Copies: the loop runs between the closes, and a delete in flight may end then
        # and take its stream out of the tenant's streams (its log is closed once).
        for tenant in list(self.tenants.values()):
            for stream in list(tenant.streams.values()):
                for committer, plog in zip(stream.committers, stream.partition_logs, strict=True):
                    await committer.aclose()
                    # In a worker: the close fsyncs, and waits for a segment's rewrite
                    # under way in the maintenance thread.
                    await loop.run_in_executor(self.executor, plog.close)
        for tenant in list(self.tenants.values()):
            await loop.run_in_executor(
                self.executor, self.metadata.write, tenant.directory / TENANT_META, tenant.meta
            )
        self.executor.shutdown(wait=True)
        self._lock.release()
        self.closed = True

    @staticmethod
    def _fire(listeners: list[Callable[[Stream], None]], stream: Stream) -> None:
        for listener in list(listeners):
            try:
                listener(stream)
            except Exception:
                log.exception("engine listener failed")

    def all_streams(self, *, internal: bool = False) -> list[Stream]:
        """Every live stream of every tenant; internal ones only with ``internal``."""
        return [
            s
            for t in self.tenants.values()
            for s in t.streams.values()
            if not s.deleted and (internal or not s.internal)
        ]

    # ---- lookups --------------------------------------------------------------------

    def tenant(self, tenant_id: int) -> Tenant:
        try:
            return self.tenants[tenant_id]
        except KeyError:
            raise TenantNotFound(f"tenant {tenant_id} does not exist") from None

    def check_replica(self, stream: Stream, partition: int) -> None:
        """In a cluster, NotLeader (naming the leader) where this node holds no replica
        of a client stream's partition: every client read (reads, subscriptions, SQL)
        asks here, so none answers from the empty copy."""
        if self.replica_check is not None and not stream.internal:
            self.replica_check(stream.tenant.tenant_id, stream.name, partition)

    # Every operation on a stream finds it here, so this is where internal streams are
    # hidden from front ends: without ``internal=True`` (which only headwater's own
    # components pass: the group offset store, the transaction coordinator) an internal
    # stream is StreamNotFound with the message of one that does not exist, by id or by
    # name, so neither its existence nor its id leaks.

    def stream(self, tenant_id: int, stream_id: int, *, internal: bool = False) -> Stream:
        stream = self.tenant(tenant_id).streams.get(stream_id)
        if stream is None or stream.deleted or (stream.internal and not internal):
            raise StreamNotFound(f"stream {stream_id} does not exist")
        return stream

    def stream_by_name(self, tenant_id: int, name: str, *, internal: bool = False) -> Stream:
        tenant = self.tenant(tenant_id)
        stream_id = tenant.by_name.get(name)
        if stream_id is None:
            raise StreamNotFound(f"stream {name!r} does not exist")
        try:
            return self.stream(tenant_id, stream_id, internal=internal)
        except StreamNotFound:
            raise StreamNotFound(f"stream {name!r} does not exist") from None

    def list_streams(self, tenant_id: int) -> list[StreamInfo]:
        """The tenant's streams, each under its name. A stream whose name another holds
        (damage from an older version, see _load_tenant) is left out: clients resolve
        names from this list and must find the one the server resolves them to. Internal
        streams are left out (see :meth:`stream`)."""
        tenant = self.tenant(tenant_id)
        return [
            s.info()
            for _, s in sorted(tenant.streams.items())
            if not s.deleted and not s.internal and tenant.by_name.get(s.name) == s.stream_id
        ]

    # ---- stream admin ---------------------------------------------------------------

    async def create_stream(
        self,
        tenant_id: int,
        name: str,
        settings: StreamSettings | None = None,
        *,
        internal: bool = False,
        registered: bool = False,
    ) -> StreamInfo:
        """A new stream. ``registered``: a cluster's copy of a stream its registry has
        (the cluster makes it; :attr:`before_create` is for clients' creates)."""
        tenant = self.tenant(tenant_id)
        check_stream_name(name, internal=internal)
        settings = settings or StreamSettings()
        settings.validate()
        if name in tenant.by_name or name in tenant.reserved_names:
            raise StreamAlreadyExists(f"stream {name!r} already exists")
        if name in tenant.kind_names:
            raise StreamAlreadyExists(
                f"{name!r} is an entity kind of this tenant: a stream cannot take its name"
                " (both are tables of the tenant's SQL)"
            )
        self._check_open()
        # Creates under way count: 16 at once must not pass the limit together. Streams
        # the server makes for itself (internal names) are never refused.
        limit = self.config.max_streams_per_tenant
        if not internal and len(tenant.streams) + tenant.creates_in_flight >= limit:
            self.stream_quota_refusals += 1
            raise StreamQuotaExceeded(
                f"tenant {tenant_id} has {limit} streams, the most its quota allows "
                "([limits] max_streams_per_tenant); delete one first"
            )
        stream_id = tenant.next_stream_id
        tenant.next_stream_id += 1
        tenant.reserved_names.add(name)
        tenant.creates_in_flight += 1
        partitions = settings.partitions or 1
        meta = {
            "id": stream_id,
            "name": name,
            "created_ns": time.time_ns(),
            "partitions": partitions,
            "settings": settings.to_dict(),
        }
        path = tenant.directory / "streams" / str(stream_id)

        def create() -> Stream:
            # Built under a temporary name and renamed into place: the rename is the
            # one commit point. A crash before it leaves nothing that could block the id
            # or pass for a stream (recovery removes .creating-*); a create that fails
            # after it is undone before the client hears of the failure, so a stream
            # exists after a restart exactly when its create succeeded (or never got
            # its answer out). tenant.json is not written: the directory name is the
            # id's record, and a delete writes tenant.json before it removes one.
            building = path.with_name(f".creating-{stream_id}")
            shutil.rmtree(building, ignore_errors=True)
            for n in range(partitions):
                (building / f"partition-{n}").mkdir(parents=True)
            write_json_atomic(building / STREAM_META, meta)
            os.replace(building, path)
            fsync_directory(path.parent)
            try:
                return self._open_stream(tenant, path, meta)
            except BaseException:
                undone = path.with_name(f".deleted-{stream_id}")
                os.replace(path, undone)
                fsync_directory(path.parent)
                shutil.rmtree(undone, ignore_errors=True)
                raise

        try:
            if self.before_create is not None and not internal and not registered:
                await self.before_create(tenant_id, name, settings)
            stream = await asyncio.get_running_loop().run_in_executor(self.executor, create)
        finally:
            tenant.reserved_names.discard(name)
            tenant.creates_in_flight -= 1
        for committer in stream.committers:
            committer.start()
        tenant.streams[stream_id] = stream
        tenant.by_name[name] = stream_id
        self._fire(self.stream_created_listeners, stream)
        log.info("created stream %s (tenant %d, id %d)", name, tenant_id, stream_id)
        return stream.info()

    async def delete_stream(self, tenant_id: int, stream_id: int) -> None:
        stream = self.stream(tenant_id, stream_id)
        if self.before_delete is not None and not stream.internal:
            await self.before_delete(tenant_id, stream.name)
            if stream.deleted:  # deleted by another call meanwhile
                raise StreamNotFound(f"stream {stream_id} does not exist")
        tenant = stream.tenant
        stream.deleted = True
        tenant.by_name.pop(stream.name, None)
        for listener in list(stream.delete_listeners):
            try:
                listener()
            except Exception:
                log.exception("stream delete listener failed")
        self._fire(self.stream_deleted_listeners, stream)
        loop = asyncio.get_running_loop()
        for committer, plog in zip(stream.committers, stream.partition_logs, strict=True):
            await committer.aclose()
            # In a worker: the close waits for a compaction's segment rewrite under way.
            await loop.run_in_executor(self.executor, plog.close)
        tenant.position_floor = max(tenant.position_floor, tenant.next_position)
        tomb = stream.directory.with_name(f".deleted-{stream_id}")

        def remove() -> None:
            # The floor first: a crash after the rename must not let positions go back.
            self.metadata.write(tenant.directory / TENANT_META, tenant.meta)
            os.replace(stream.directory, tomb)
            shutil.rmtree(tomb, ignore_errors=True)

        await asyncio.get_running_loop().run_in_executor(self.executor, remove)
        tenant.streams.pop(stream_id, None)
        log.info("deleted stream %s (tenant %d, id %d)", stream.name, tenant_id, stream_id)

    async def alter_partitions(self, tenant_id: int, stream_id: int, partitions: int) -> StreamInfo:
        """Give a stream ``partitions`` partitions: more than it has adds empty ones, the
        same count changes nothing, fewer is refused (InvalidRequest), as Kafka's. Events
        already stored stay where they are; keyed events appended from now on are placed
        by the new count (so a key's new events may go to another partition)."""
        check_partition_count(partitions)
        stream = self.stream(tenant_id, stream_id)
        self._check_open()
        # One alter of a stream at a time: each sees the count the one before left.
        async with stream.alter_lock:
            have = stream.partitions
            if partitions < have:
                raise InvalidRequest(
                    f"stream {stream.name!r} has {have} partitions; partitions can be added, "
                    f"never removed (asked for {partitions})"
                )
            if partitions == have:
                return stream.info()

            def grow() -> list[PartitionLog]:
                # The directories first (fsynced), the count last: stream.json's rename
                # is the commit point, and a crash before it leaves empty directories
                # past the count that the next alter reuses.
                meta = _read_meta(stream.directory / STREAM_META)
                meta["partitions"] = partitions
                logs: list[PartitionLog] = []
                try:
                    for n in range(have, partitions):
                        logs.append(self._open_partition(stream.directory, n, stream.settings))
                    fsync_directory(stream.directory)
                    write_json_atomic(stream.directory / STREAM_META, meta)
                except BaseException:
                    for plog in logs:
                        plog.close()
                    raise
                return logs

            logs = await asyncio.get_running_loop().run_in_executor(self.executor, grow)
            if stream.deleted:  # deleted while its directories were made: gone with it
                for plog in logs:
                    plog.close()
                raise StreamNotFound(f"stream {stream_id} does not exist")
            committers = [GroupCommitter(plog, self.executor) for plog in logs]
            for committer in committers:
                committer.start()
            stream.committers.extend(committers)
            stream.partition_logs.extend(logs)
        for listener in list(stream.partition_listeners):
            try:
                listener(partitions)
            except Exception:
                log.exception("partition listener failed")
        log.info(
            "stream %s (tenant %d) now has %d partitions (had %d)",
            stream.name,
            tenant_id,
            partitions,
            have,
        )
        return stream.info()

    # ---- appends and reads ----------------------------------------------------------

    def _check_open(self) -> None:
        if self.closing:
            raise StorageError("server is shutting down")

    async def append(
        self,
        tenant_id: int,
        stream_id: int,
        values: Sequence[bytes],
        *,
        timestamp_ms: int | None = None,
        partition: int = 0,
        internal: bool = False,
        acks: int = ACKS_ALL,
        **columns: Unpack[EventColumns],
    ) -> AppendInfo:
        """Append a batch of events to one partition (0 unless named); returns once they
        are acknowledged (``acks``: see :meth:`append_encoded`). A ``producer`` (id,
        sequence) among ``columns``: see :meth:`append_idempotent`. ``internal``: see
        :meth:`stream`."""
        return await self.append_encoded(
            tenant_id,
            stream_id,
            encode_values(values),
            len(values),
            value_bytes=sum(map(len, values)),
            timestamp_ms=timestamp_ms,
            partition=partition,
            internal=internal,
            acks=acks,
            **columns,
        )

    async def append_partitioned(
        self,
        tenant_id: int,
        stream_id: int,
        values: Sequence[bytes],
        *,
        keys: Sequence[bytes | None] | None = None,
        headers: Sequence[Headers] | None = None,
        partitions: Sequence[int | None] | None = None,
        timestamps: Sequence[int | None] | None = None,
        tombstones: Sequence[bool] | None = None,
        acks: int = ACKS_ALL,
    ) -> PartitionedAppend:
        """Append events placed by the stream's partitioner: ``partitions[i]`` when given
        (it must exist), else Kafka's murmur2 of ``keys[i]``, else the sticky partition of
        the batch's keyless events. The batch is split by partition in one pass and each
        partition's events go in one append (one more per change of timestamp within a
        partition: a stored batch has one timestamp), all written before any commit is
        awaited, so each partition's events of one call get consecutive offsets. The
        whole batch is checked (sizes, partitions) before anything is written; a storage
        failure part-way may leave some partitions' events stored. ``acks``: see
        :meth:`append_encoded` (one wait per partition written)."""
        stream = self.stream(tenant_id, stream_id)
        self._check_open()
        count = len(values)
        if not 1 <= count <= MAX_APPEND_EVENTS:
            raise InvalidRequest(f"an append carries 1..{MAX_APPEND_EVENTS} events, not {count}")
        if sum(map(len, values)) > MAX_APPEND_BYTES:
            raise AppendTooLarge(f"an append carries at most {MAX_APPEND_BYTES} bytes of events")
        for name, column in (
            ("keys", keys),
            ("headers", headers),
            ("partitions", partitions),
            ("timestamps", timestamps),
            ("tombstones", tombstones),
        ):
            if column is not None and len(column) != count:
                raise InvalidRequest(
                    f"{name} needs one entry per event ({count}), not {len(column)}"
                )
        placed = stream.partitioner.partition(
            keys if keys is not None else [None] * count, stream.partitions, partitions
        )
        if self.leader_check is not None and not stream.internal:
            for partition in np.unique(placed).tolist():
                self.leader_check(tenant_id, stream.name, partition)
        replicated = self._replicated_acks(stream, acks)
        if replicated is not None:
            for partition in np.unique(placed).tolist():
                replicated.check_min_isr(tenant_id, stream.name, partition)
        now = int(time.time() * 1000)
        log_append_time = stream.settings.timestamp_type == "LogAppendTime"
        if timestamps is None or log_append_time:
            stamped = [now] * count
        else:
            stamped = [now if t is None else t for t in timestamps]
        # Events of one partition in their batch order (a stable sort), cut where the
        # partition or the timestamp changes: each run is one stored batch.
        order = np.argsort(placed, kind="stable").tolist()
        runs: list[list[int]] = []
        for i in order:
            if runs and placed[runs[-1][0]] == placed[i] and stamped[runs[-1][0]] == stamped[i]:
                runs[-1].append(i)
            else:
                runs.append([i])

        def take(column: Sequence[Any] | None, run: list[int]) -> list[Any] | None:
            return None if column is None else [column[i] for i in run]

        sections = [encode_values([values[i] for i in run]) for run in runs]
        for run, section in zip(runs, sections, strict=True):
            # A batch never spans segments: every run is checked before any is written.
            segment_bytes = stream.partition_logs[int(placed[run[0]])].config.segment_bytes
            if HEADER_SIZE + len(section) > segment_bytes:
                raise BatchTooLarge(
                    f"{len(run)} events of {len(section)} stored bytes for partition "
                    f"{int(placed[run[0]])} do not fit the stream's {segment_bytes}-byte "
                    "segments (segment_bytes)"
                )
        with_headers = headers is not None and any(headers)
        tenant = stream.tenant
        claimed: list[int] = []
        infos: list[AppendInfo] = []
        self._inflight_appends += 1
        self._idle.clear()
        try:
            # Every run is written here, on the loop thread, before any commit is
            # awaited: no other append gets between them, so a partition's events of
            # this call have consecutive offsets (front ends answer a base offset).
            for run, section in zip(runs, sections, strict=True):
                first_position = tenant.claim_positions(len(run))
                claimed.append(first_position)
                infos.append(
                    stream.partition_logs[int(placed[run[0]])].append_encoded(
                        section,
                        len(run),
                        first_position=first_position,
                        timestamp_ms=None if log_append_time else stamped[run[0]],
                        keys=take(keys, run),
                        headers=take(headers, run) if with_headers else None,
                        tombstones=take(tombstones, run),
                    )
                )
            await asyncio.gather(
                *(
                    stream.committers[int(placed[run[0]])].committed(info.next_offset)
                    for run, info in zip(runs, infos, strict=True)
                )
            )
        finally:
            for first_position in claimed:
                tenant.release_positions(first_position)
            self._inflight_appends -= 1
            if self._inflight_appends == 0:
                self._idle.set()
        self.events_appended += count
        self.bytes_appended += sum(map(len, values))
        if replicated is not None:
            ends: dict[int, int] = {}
            for run, info in zip(runs, infos, strict=True):
                partition = int(placed[run[0]])
                ends[partition] = max(ends.get(partition, 0), info.next_offset)
            await self._replicas_hold(replicated, tenant_id, stream, ends)
        offsets = [0] * count
        for run, info in zip(runs, infos, strict=True):
            for k, i in enumerate(run):
                offsets[i] = info.base_offset + k
        return PartitionedAppend(
            partitions=placed.tolist(),
            offsets=offsets,
            timestamps=_timestamps_by_event(runs, infos, count),
            appends=[(int(placed[run[0]]), info) for run, info in zip(runs, infos, strict=True)],
        )

    async def append_encoded(
        self,
        tenant_id: int,
        stream_id: int,
        values_section: bytes | memoryview,
        count: int,
        *,
        value_bytes: int | None = None,
        timestamp_ms: int | None = None,
        partition: int = 0,
        internal: bool = False,
        acks: int = ACKS_ALL,
        **columns: Unpack[EventColumns],
    ) -> AppendInfo:
        """Append events already in stored ``u64 len | bytes`` form (as the Kimberlite
        wire carries them), without touching each event again, to one partition (0
        unless named). ``timestamp_ms`` is the producer's (CreateTime; None: now); a
        LogAppendTime stream stores its own clock's instead. In a cluster an ``acks``
        of ACKS_ALL (the default) is refused NotEnoughReplicas before anything is
        written when the ISR is below min_insync_replicas, and answered once the
        in-sync replicas hold the batch (NotEnoughReplicasAfterAppend,
        ReplicationTimedOut or NotLeader if not); ACKS_LEADER once this node stored it."""
        producer = columns.get("producer")
        stream = self.stream(tenant_id, stream_id, internal=internal)
        plog = stream.partition_log(partition)
        # Transaction markers are the transaction coordinator's (docs/cluster.md).
        if self.leader_check is not None and not stream.internal and not columns.get("control"):
            self.leader_check(tenant_id, stream.name, partition)
        replicated = None if columns.get("control") else self._replicated_acks(stream, acks)
        if replicated is not None:
            replicated.check_min_isr(tenant_id, stream.name, partition)
        committer = stream.committers[partition]
        at_most = MAX_KAFKA_BATCH_RECORDS if columns.get("kafka") else MAX_APPEND_EVENTS
        payload = self._check_encoded(stream, plog, values_section, count, value_bytes, at_most)
        if stream.settings.timestamp_type == "LogAppendTime":
            timestamp_ms = None
        if producer is not None and not columns.get("control"):
            stored = plog.check_producer(*producer, columns.get("producer_epoch"))
            if stored is not None:  # a retry: answer as the first time, append nothing
                await committer.committed(stored.base_offset + stored.count)
                if replicated is not None:  # its first answer may have been lost unconfirmed
                    end = {partition: stored.base_offset + stored.count}
                    await self._replicas_hold(replicated, tenant_id, stream, end)
                # Its stored first timestamp: a LogAppendTime topic's retry is answered
                # the stamp it was given (it was 0: 1970 to a Kafka client).
                return AppendInfo(stored.base_offset, stored.count, -1, stored.timestamp_ms)
        first_position, info = self._write_encoded(
            stream, plog, values_section, count, timestamp_ms, columns
        )
        try:
            await committer.committed(info.next_offset)
        finally:
            self._appended(stream, first_position)
        self.events_appended += count
        self.bytes_appended += payload
        if replicated is not None:
            await self._replicas_hold(replicated, tenant_id, stream, {partition: info.next_offset})
        return info

    def append_encoded_then(
        self,
        tenant_id: int,
        stream_id: int,
        values_section: bytes | memoryview,
        count: int,
        done: Callable[[AppendInfo | None, HeadwaterError | None], None],
        *,
        value_bytes: int | None = None,
    ) -> None:
        """:meth:`append_encoded` of partition 0 for a caller that is not a coroutine (a
        front end answering a lone append without a task of its own): the same checks,
        raised before anything is written, and the same write; then ``done(info, None)``
        on the loop once the sync policy acknowledges it, ``done(None, error)`` if its
        fsync failed. Not in a cluster (acks=all waits for the replicas: use
        :meth:`append_encoded`)."""
        stream = self.stream(tenant_id, stream_id)
        if self.leader_check is not None or self._replicated_acks(stream, ACKS_ALL) is not None:
            raise InternalError("append_encoded_then is for a node outside a cluster")
        plog = stream.partition_log(0)
        payload = self._check_encoded(stream, plog, values_section, count, value_bytes)
        first_position, info = self._write_encoded(stream, plog, values_section, count, None, {})

        def acknowledged(error: HeadwaterError | None) -> None:
            self._appended(stream, first_position)
            if error is not None:
                done(None, error)
                return
            self.events_appended += count
            self.bytes_appended += payload
            done(info, None)

        stream.committers[0].commit_then(info.next_offset, acknowledged)

    def _check_encoded(
        self,
        stream: Stream,
        plog: PartitionLog,
        values_section: bytes | memoryview,
        count: int,
        value_bytes: int | None,
        max_events: int = MAX_APPEND_EVENTS,
    ) -> int:
        """An encoded append's checks before anything is written; returns its payload
        bytes (the events' values without their length prefixes)."""
        self._check_open()
        if not 1 <= count <= max_events:
            raise InvalidRequest(f"an append carries 1..{max_events} events, not {count}")
        payload = len(values_section) - 8 * count if value_bytes is None else value_bytes
        if payload > MAX_APPEND_BYTES:
            raise AppendTooLarge(f"an append carries at most {MAX_APPEND_BYTES} bytes of events")
        # A batch never spans segments: refuse before a position is claimed for it.
        segment_bytes = plog.config.segment_bytes
        if HEADER_SIZE + len(values_section) > segment_bytes:
            raise BatchTooLarge(
                f"an append of {len(values_section)} stored bytes does not fit the stream's "
                f"{segment_bytes}-byte segments (segment_bytes)"
            )
        return payload

    def _write_encoded(
        self,
        stream: Stream,
        plog: PartitionLog,
        values_section: bytes | memoryview,
        count: int,
        timestamp_ms: int | None,
        columns: EventColumns,
    ) -> tuple[int, AppendInfo]:
        """Claim the events' positions and write them; the append is in flight until
        :meth:`_appended` (the engine's close waits for it). Returns the first position
        and what was written."""
        first_position = stream.tenant.claim_positions(count)
        self._inflight_appends += 1
        self._idle.clear()
        try:
            info = plog.append_encoded(
                values_section,
                count,
                first_position=first_position,
                timestamp_ms=timestamp_ms,
                **columns,
            )
        except BaseException:
            self._appended(stream, first_position)
            raise
        return first_position, info

    def _appended(self, stream: Stream, first_position: int) -> None:
        """An append written by :meth:`_write_encoded` is acknowledged or failed."""
        stream.tenant.release_positions(first_position)
        self._inflight_appends -= 1
        if self._inflight_appends == 0:
            self._idle.set()

    def _replicated_acks(self, stream: Stream, acks: int) -> ReplicaAcks | None:
        """The cluster's acks=all hook when this append waits for the in-sync replicas:
        in a cluster, ACKS_ALL, a user stream (internal streams' owners wait as they
        need, e.g. the group and transaction coordinators)."""
        if self.replica_acks is None or acks != ACKS_ALL or stream.internal:
            return None
        return self.replica_acks

    async def _replicas_hold(
        self, acks: ReplicaAcks, tenant_id: int, stream: Stream, ends: dict[int, int]
    ) -> None:
        """One wait per partition written: its in-sync replicas hold it below its end."""
        await asyncio.gather(
            *(
                acks.replicated(tenant_id, stream.name, partition, end, self.replica_acks_timeout_s)
                for partition, end in ends.items()
            )
        )

    async def append_idempotent(
        self,
        tenant_id: int,
        stream_id: int,
        producer_id: int,
        sequence: int,
        values: Sequence[bytes],
    ) -> AppendInfo:
        """Append unless ``(producer_id, sequence)`` was applied already, in which case
        the original offsets come back and nothing is appended."""
        return await self.append(tenant_id, stream_id, values, producer=(producer_id, sequence))

    def read_now(
        self,
        tenant_id: int,
        stream_id: int,
        from_offset: int,
        max_bytes: int = 1 << 20,
        *,
        partition: int = 0,
        isolation: str = READ_COMMITTED,
    ) -> ReadResult:
        """Read on the calling thread (for small reads and worker threads)."""
        plog = self.stream(tenant_id, stream_id).partition_log(partition)
        return plog.read(from_offset, max_bytes, committed_only=committed_only(isolation))

    async def read(
        self,
        tenant_id: int,
        stream_id: int,
        from_offset: int,
        max_bytes: int = 1 << 20,
        *,
        max_events: int | None = None,
        partition: int = 0,
        isolation: str = READ_COMMITTED,
        internal: bool = False,
        kafka: bool = False,
        contiguous: bool = False,
    ) -> ReadResult:
        """Committed events of one partition (0 unless named) from ``from_offset``: the
        :class:`PageRead` of these arguments, read by :meth:`read_page`."""
        page = PageRead(
            tenant_id, stream_id, max_bytes, max_events, partition, isolation, contiguous
        )
        return await self.read_page(page, from_offset, internal=internal, kafka=kafka)

    async def read_page(
        self, page: PageRead, from_offset: int, *, internal: bool = False, kafka: bool = False
    ) -> ReadResult:
        """``page`` from ``from_offset``. Data in the page cache is read right here on the
        loop (no-wait reads); anything that would wait for the disk is read in a worker
        thread. ``internal``: see :meth:`stream`. ``kafka``: whole stored batches, markers
        and aborted batches included, as a Kafka fetch answers (:meth:`PartitionLog.read`)."""
        plog = self.stream(page.tenant_id, page.stream_id, internal=internal).partition_log(
            page.partition
        )

        def read() -> ReadResult:
            return page.read(plog, from_offset, kafka=kafka)

        try:
            with no_wait():
                return read()
        except WouldBlock:
            pass
        return await asyncio.get_running_loop().run_in_executor(self.executor, read)

    def read_soon(
        self, page: PageRead, from_offset: int, then: Callable[[], bool] | None = None
    ) -> tuple[asyncio.Future[ReadResult], asyncio.Future[ReadResult]]:
        """:meth:`read_page` of a sequential reader's next page (api/readahead.py),
        started in a worker thread now rather than at the loop's next turn, and the page
        after it, read by the same thread right after when the first stopped at its
        budget and ``then()`` (asked in the thread) still wants it; that future is
        cancelled when the page is not read. The disk reads on while the loop sends a
        page: a thread started from the loop waited for it (for the GIL) to finish
        sending."""
        loop = asyncio.get_running_loop()
        pages: tuple[asyncio.Future[ReadResult], asyncio.Future[ReadResult]] = (
            loop.create_future(),
            loop.create_future(),
        )

        def read_pages() -> None:
            offset = from_offset
            try:
                plog = self.stream(page.tenant_id, page.stream_id).partition_log(page.partition)
                for future in pages:
                    result = page.read(plog, offset)
                    loop.call_soon_threadsafe(_settle, future, result, None)
                    if result.next_offset is None or then is None or not then():
                        break
                    offset = result.next_offset
            except Exception as exc:  # the reader's own read raises it again
                loop.call_soon_threadsafe(_settle, pages[0], None, exc)
            loop.call_soon_threadsafe(pages[1].cancel)

        try:
            self.executor.submit(read_pages)
        except RuntimeError as exc:  # shut down (the engine is closing): no page
            pages[0].set_exception(exc)
            pages[1].cancel()
        return pages

    async def read_events(
        self,
        tenant_id: int,
        stream_id: int,
        from_offset: int,
        limit: int = 1000,
        *,
        partition: int = 0,
    ) -> list[Event]:
        result = await self.read(
            tenant_id, stream_id, from_offset, 1 << 62, max_events=limit, partition=partition
        )
        return list(result.events())

    async def offset_for_timestamp(
        self, tenant_id: int, stream_id: int, timestamp_ms: int, *, partition: int = 0
    ) -> int | None:
        """The first offset of one partition (0 unless named) whose batch's timestamp is
        at or after ``timestamp_ms``; None when no committed event is that late."""
        plog = self.stream(tenant_id, stream_id).partition_log(partition)
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, plog.offset_for_timestamp, timestamp_ms
        )

    async def offset_of_max_timestamp(
        self, tenant_id: int, stream_id: int, *, partition: int = 0
    ) -> tuple[int, int] | None:
        """(offset, timestamp) of one partition's first record with its largest
        timestamp; None when it has none."""
        plog = self.stream(tenant_id, stream_id).partition_log(partition)
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, plog.offset_of_max_timestamp
        )

    async def sync_tenant(self, tenant_id: int) -> None:
        """fsync every partition of every stream of a tenant, whatever its sync policy."""
        loop = asyncio.get_running_loop()
        logs = [
            plog
            for s in self.tenant(tenant_id).streams.values()
            if not s.deleted
            for plog in s.partition_logs
            if not plog.closed
        ]
        await asyncio.gather(*(loop.run_in_executor(self.executor, plog.sync) for plog in logs))

    # ---- maintenance ----------------------------------------------------------------

    async def run_maintenance(self) -> dict[str, int]:
        """Apply retention, compaction and compression to every stream once (in a worker
        thread)."""
        removed = compacted = compressed = 0
        loop = asyncio.get_running_loop()
        for tenant in list(self.tenants.values()):
            for stream in list(tenant.streams.values()):
                for plog in list(stream.partition_logs):
                    if stream.deleted or plog.closed:
                        continue
                    if not stream.internal:
                        # Not the server's own state (group offsets, transactions): the
                        # default retention took a group's committed offset once it was a
                        # retention period old, lost at the next restart. Compaction
                        # alone keeps those logs bounded, as Kafka's __consumer_offsets.
                        removed += await loop.run_in_executor(self.executor, plog.enforce_retention)
                    if plog.config.cleanup_policy == "compact":  # per key, per partition
                        result = await loop.run_in_executor(self.executor, plog.compact)
                        compacted += result.events_removed
                    if plog.config.compression != "none":
                        done = await loop.run_in_executor(self.executor, plog.compress)
                        compressed += done.segments_compressed
        return {
            "segments_removed": removed,
            "events_compacted": compacted,
            "segments_compressed": compressed,
        }

    async def _maintenance_loop(self, interval: float) -> None:
        await run_every(interval, self.run_maintenance, "maintenance")


def _timestamps_by_event(
    runs: Sequence[Sequence[int]], infos: Sequence[AppendInfo], count: int
) -> list[int]:
    """The stored timestamp of each event of a partitioned append (its batch's)."""
    out = [0] * count
    for run, info in zip(runs, infos, strict=True):
        for i in run:
            out[i] = info.timestamp_ms
    return out


def _read_meta(path: Path) -> dict[str, Any]:
    """A metadata file's object; StorageError naming the file when it is damaged (the
    server refuses to start on it rather than guess: ``headwater check`` says more)."""
    try:
        data = read_json(path)
    except (OSError, ValueError) as exc:
        raise StorageError(f"{path} cannot be read ({exc}); run headwater check") from None
    if not isinstance(data, dict):
        raise StorageError(f"{path} is not a JSON object; run headwater check")
    return data


def _by_stream_id(path: Path) -> tuple[bool, int, str]:
    """Stream directories in id order, anything else after them."""
    return (not path.name.isdigit(), int(path.name) if path.name.isdigit() else 0, path.name)


def _settle(
    future: asyncio.Future[ReadResult], result: ReadResult | None, error: Exception | None
) -> None:
    """Resolve a page read in a worker (on the loop), unless it was cancelled meanwhile."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        assert result is not None
        future.set_result(result)
