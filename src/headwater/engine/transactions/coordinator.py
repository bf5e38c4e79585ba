"""The transaction coordinator: producer ids, epochs and atomic multi-partition writes.

Per tenant, as Kafka's transaction coordinator and ``__transaction_state``:

* ``init_producer`` hands out a producer id, durable across restarts (ids start at
  ``FIRST_PRODUCER_ID``, far above the small ids Kimberlite clients pick for their own
  idempotent appends). With a transactional id it returns that id's producer with its
  epoch bumped: the previous instance (a zombie) is fenced, and a transaction it left
  open is aborted first.
* A transaction begins implicitly with its first partition. ``add_partitions`` (also
  done by ``append`` for a partition not yet in the transaction) records the partition
  durably *before* anything is written to it, so recovery knows every partition that may
  hold the transaction's batches. Appends are transactional batches (the batch
  attribute bit) with the producer's id, epoch and per-partition sequence.
* ``add_offsets`` stages consumer-group offsets (consume-transform-produce): they are
  committed to the group offset store with the transaction, never without it.
* ``end_transaction`` writes the decision (PrepareCommit / PrepareAbort, with the staged
  offsets) to the tenant's internal stream ``hw_transaction_state`` (fsync policy), then
  a marker (control batch) to every partition of the transaction, then the offsets, then
  CompleteCommit / CompleteAbort.

Recovery (``open``) replays the state stream: a transaction found prepared is finished
(its markers written where missing, its offsets committed), so a SIGKILL mid-commit ends
with the transaction wholly visible; one found Ongoing is aborted with its epoch bumped,
so it is wholly absent and its producer fenced. A transaction open longer than its
timeout is aborted the same way by ``abort_expired``.

Markers are written only where the partition's producer table shows the producer's
transaction still open there, so finishing a transaction twice (a retry, a recovery
after some markers were written) adds nothing.

In a cluster (:class:`ClusterHooks`, docs/cluster.md "Transactions across the
cluster") the state stream is replicated and its leader is the tenant's coordinator:
other nodes refuse transactional calls NotCoordinator, producer ids come from the
cluster's id blocks (no write to the state stream), each state record is acknowledged
by the in-sync replicas, a marker is written by its partition's leader, wherever that
is, and a transactional batch is appended by its partition's leader against the
partition's producer state (epoch fencing) without asking the coordinator. A node that
takes the coordinator's place replays the state stream and finishes what was prepared;
an open transaction is left to its producer (or its timeout).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple, TypedDict, Unpack

from headwater.engine.engine import Engine, StreamSettings, run_every
from headwater.engine.groups.errors import CoordinatorNotAvailable
from headwater.engine.groups.offsets import (
    CommittedOffset,
    LogOffsetStore,
    OffsetKey,
    check_metadata,
    committable,
)
from headwater.engine.per_tenant import PerTenant
from headwater.errors import (
    HeadwaterError,
    InvalidRequest,
    InvalidTxnState,
    ProducerFenced,
    StreamAlreadyExists,
    StreamNotFound,
)
from headwater.storage.batch import Headers, marker_value
from headwater.storage.kafka_batch import KafkaSection
from headwater.storage.log import AppendInfo
from headwater.tasks import cancel_and_wait

log = logging.getLogger(__name__)

TXN_STATE_STREAM = "hw_transaction_state"
FIRST_PRODUCER_ID = 1 << 48
DEFAULT_TRANSACTION_TIMEOUT_MS = 60_000  # Kafka's transaction.timeout.ms
MAX_TRANSACTION_TIMEOUT_MS = 900_000  # Kafka's transaction.max.timeout.ms
# Kafka's epoch is an int16: a transactional id's producer gets a new id (epoch 0) when its
# epoch would pass Short.MAX_VALUE - 1, keeping the last bump for fencing, as Kafka does.
# Past 32,767 InitProducerId could not be answered and no Kafka client could read on.
MAX_EPOCH = 0x7FFF
# Kafka's transactional.id.expiration.ms: a transactional id idle this long (no
# transaction open, nothing written for it) is forgotten, its record tombstoned. Without
# it, a producer that took a fresh id per run (a job's UUID) grew the coordinator's
# memory and state stream for good.
TRANSACTIONAL_ID_EXPIRATION_MS = 7 * 24 * 3600 * 1000
MAX_TRANSACTIONAL_ID_BYTES = 0xFFFF
_PRODUCER_IDS_KEY = b"\x00producer-ids"  # no transactional id is empty: never a clash

# (group offsets to commit) for a tenant: the consumer-group offset store's commit.
OffsetsSink = Callable[[int, Mapping[OffsetKey, CommittedOffset]], Awaitable[None]]
Clock = Callable[[], int]


@dataclass(frozen=True)
class ClusterHooks:
    """What a cluster node gives the coordinator (headwater.cluster.transactions)."""

    # NotCoordinator / CoordinatorNotAvailable unless this node coordinates the tenant.
    check: Callable[[int], None]
    # CoordinatorNotAvailable unless this node leads the tenant's state partition now
    # (checked before each state record: a deposed coordinator must not write into its
    # follower copy; a reloading one, not yet answering, may).
    check_leads: Callable[[int], None]
    # A producer id unique in the cluster (tenant id -> id).
    allocate: Callable[[int], Awaitable[int]]
    # The state stream's in-sync replicas hold it below ``end`` (tenant id, end).
    replicated: Callable[[int, int], Awaitable[None]]
    # A marker on the partition's leader (tenant, stream name, partition, producer id,
    # epoch, commit); returns once it is replicated there.
    write_marker: Callable[[int, str, int, int, int, bool], Awaitable[None]]


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class TxnState(StrEnum):
    EMPTY = "Empty"
    ONGOING = "Ongoing"
    PREPARE_COMMIT = "PrepareCommit"
    PREPARE_ABORT = "PrepareAbort"
    COMPLETE_COMMIT = "CompleteCommit"
    COMPLETE_ABORT = "CompleteAbort"


class ProducerIdentity(NamedTuple):
    producer_id: int
    epoch: int


class TxnBatchOptions(TypedDict, total=False):
    """What a transactional append may name beside its values, passed down unchanged to
    :func:`append_transactional` (the defaults are its own): the partition (0), the
    events' keys and headers, and the batch's timestamp."""

    partition: int
    keys: Sequence[bytes | None] | None
    headers: Sequence[Headers] | None
    timestamp_ms: int | None


@dataclass
class TxnMetadata:
    transactional_id: str
    producer_id: int
    epoch: int
    timeout_ms: int
    state: TxnState = TxnState.EMPTY
    partitions: set[tuple[int, int]] = field(default_factory=set)  # (stream id, partition)
    offsets: dict[OffsetKey, CommittedOffset] = field(default_factory=dict)
    started_ms: int = 0
    # Appends admitted but not yet stored: an end waits for them (in memory only).
    appending: int = 0
    appends_done: asyncio.Event = field(default_factory=asyncio.Event)
    # The partitions' stream names by id: stored by name, as a stream's id is each
    # node's own in a cluster.
    names: dict[int, str] = field(default_factory=dict)
    # Once complete: where its markers went, (stream name, partition, offset) (a
    # standalone server's; a backup makes sure its copy holds them all).
    markers: list[tuple[str, int, int]] = field(default_factory=list)
    updated_ms: int = 0  # when its record was last written (expiry counts from it)

    def to_json(self) -> dict[str, Any]:
        return {
            "producer_id": self.producer_id,
            "epoch": self.epoch,
            "timeout_ms": self.timeout_ms,
            "state": str(self.state),
            "partitions": sorted(self.partitions),
            "partition_names": sorted([self.names[s], p] for s, p in self.partitions),
            "offsets": [
                [k.group, k.stream, k.partition, v.offset, v.metadata, v.commit_ms]
                for k, v in self.offsets.items()
            ],
            "started_ms": self.started_ms,
            "markers": [list(marker) for marker in self.markers],
            "updated_ms": self.updated_ms,
        }

    @classmethod
    def from_json(cls, transactional_id: str, data: Mapping[str, Any]) -> TxnMetadata:
        return cls(
            transactional_id,
            int(data["producer_id"]),
            int(data["epoch"]),
            int(data["timeout_ms"]),
            TxnState(data["state"]),
            {(int(s), int(p)) for s, p in data["partitions"]},
            {
                OffsetKey(str(g), str(s), int(p)): CommittedOffset(int(o), str(m), int(t))
                for g, s, p, o, m, t in data["offsets"]
            },
            int(data["started_ms"]),
            updated_ms=int(data.get("updated_ms", 0)),
        )


@dataclass(eq=False, repr=False)
class TenantTransactions:
    """One tenant's transaction coordinator (use :meth:`open`)."""

    engine: Engine
    tenant_id: int
    stream_id: int
    offsets_sink: OffsetsSink
    clock_ms: Clock
    cluster: ClusterHooks | None = None
    transactions: dict[str, TxnMetadata] = field(default_factory=dict, init=False)
    next_producer_id: int = field(default=FIRST_PRODUCER_ID, init=False)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict, init=False)
    recovered: int = field(default=0, init=False)  # finished or aborted by recovery

    @classmethod
    async def open(
        cls,
        engine: Engine,
        tenant_id: int,
        offsets_sink: OffsetsSink | None = None,
        clock_ms: Clock = _wall_ms,
        cluster: ClusterHooks | None = None,
    ) -> TenantTransactions:
        """The tenant's coordinator, its state stream created on first use and replayed;
        every transaction left prepared is finished and every one left open aborted (in
        a cluster: left to its producer or its timeout)."""
        stream_id = await create_state_stream(engine, tenant_id)
        coordinator = cls(
            engine, tenant_id, stream_id, offsets_sink or _log_offsets(engine), clock_ms, cluster
        )
        await coordinator._replay()
        await coordinator._recover(abort_open=cluster is None)
        return coordinator

    async def _replay(self) -> None:
        plog = self.engine.stream(self.tenant_id, self.stream_id, internal=True).log
        at = plog.start_offset
        while True:
            result = await self.engine.read(
                self.tenant_id, self.stream_id, at, 4 << 20, internal=True
            )
            if result.count == 0:
                return
            for event in result.events():
                if event.key is None:
                    continue
                if event.tombstone:  # an expired transactional id
                    self.transactions.pop(event.key.decode(errors="replace"), None)
                    continue
                try:
                    data = json.loads(event.value)
                    next_id = int(data["next_producer_id"])
                    txn = None
                    if event.key != _PRODUCER_IDS_KEY:
                        tid = event.key.decode()
                        txn = TxnMetadata.from_json(tid, data["txn"])
                        if "partition_names" in data["txn"]:
                            self._resolve_names(txn, data["txn"]["partition_names"])
                        else:  # written before names were stored: this node's ids
                            self._name_ids(txn)
                except (ValueError, KeyError, TypeError) as exc:
                    # Not the coordinator's record (front ends cannot reach the stream,
                    # but a data directory may hold what an older version let them
                    # write): skipped, never fatal.
                    log.warning(
                        "tenant %d: %s offset %d is no transaction record (%s); skipped",
                        self.tenant_id,
                        TXN_STATE_STREAM,
                        event.offset,
                        exc,
                    )
                    continue
                self.next_producer_id = max(self.next_producer_id, next_id)
                if txn is not None:
                    # A record from before updated_ms was kept: its expiry counts from now.
                    txn.updated_ms = txn.updated_ms or self.clock_ms()
                    self.transactions[txn.transactional_id] = txn
            at = result.end_offset

    def _resolve_names(self, txn: TxnMetadata, named: Sequence[Sequence[Any]]) -> None:
        """The transaction's partitions by this node's stream ids (a stream deleted
        since is left out: its batches went with it)."""
        txn.partitions.clear()
        for name, partition in named:
            try:
                stream_id = self.engine.stream_by_name(self.tenant_id, str(name)).stream_id
            except StreamNotFound:
                continue
            txn.partitions.add((stream_id, int(partition)))
            txn.names[stream_id] = str(name)

    def _name_ids(self, txn: TxnMetadata) -> None:
        for stream_id, partition in list(txn.partitions):
            try:
                txn.names[stream_id] = self.engine.stream(self.tenant_id, stream_id).name
            except StreamNotFound:  # deleted with the transaction's batches
                txn.partitions.discard((stream_id, partition))

    async def _recover(self, abort_open: bool = True) -> None:
        for txn in list(self.transactions.values()):
            if txn.state in (TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT):
                log.info(
                    "tenant %d: finishing transaction %r left %s",
                    self.tenant_id,
                    txn.transactional_id,
                    txn.state,
                )
                async with self._lock(txn.transactional_id):
                    await self._complete(txn)
                self.recovered += 1
            elif txn.state == TxnState.ONGOING and abort_open:
                log.info(
                    "tenant %d: aborting transaction %r left open by a restart",
                    self.tenant_id,
                    txn.transactional_id,
                )
                async with self._lock(txn.transactional_id):
                    await self._abort_fencing(txn)
                self.recovered += 1
        if abort_open:
            await self._abort_hanging()

    async def _abort_hanging(self) -> None:
        """Once recovery has finished or aborted every transaction it knows, one still
        open in a partition has no coordinator record to end it: its partition's last
        stable offset would stay at its first batch for good (read_committed readers
        stuck). A backup copies the partitions before the state stream, so a
        transaction that ended while it ran is open in the partitions copied before its
        marker, its state already complete. Aborted, as Kafka's tools abort a hanging
        transaction: the copy never shows a transaction that was not committed."""
        epochs = {txn.producer_id: txn.epoch for txn in self.transactions.values()}
        for stream in list(self.engine.tenant(self.tenant_id).streams.values()):
            if stream.deleted:
                continue
            for partition, plog in enumerate(stream.partition_logs):
                for producer_id, epoch in plog.open_transactions().items():
                    log.warning(
                        "tenant %d: stream %r partition %d: aborting a transaction of "
                        "producer %d that no coordinator record ends",
                        self.tenant_id,
                        stream.name,
                        partition,
                        producer_id,
                    )
                    await write_marker(
                        self.engine,
                        self.tenant_id,
                        stream.stream_id,
                        partition,
                        producer_id,
                        max(epoch, epochs.get(producer_id, 0)),
                        commit=False,
                    )
                    self.recovered += 1

    # ---- the state stream ---------------------------------------------------------

    async def _write(self, key: bytes, txn: TxnMetadata | None, *, forget: bool = False) -> None:
        """One keyed record, durable (fsync policy) before this returns (``forget``: a
        tombstone, the key's transactional id expired)."""
        record: dict[str, Any] = {"next_producer_id": self.next_producer_id}
        if txn is not None:
            txn.updated_ms = self.clock_ms()
            record["txn"] = txn.to_json()
        if self.cluster is not None:
            self.cluster.check_leads(self.tenant_id)
        stored = await self.engine.append(
            self.tenant_id,
            self.stream_id,
            [b"" if forget else json.dumps(record).encode()],
            keys=[key],
            tombstones=[True] if forget else None,
            internal=True,
        )
        if self.cluster is not None:  # acks=all: the next coordinator's replica has it
            await self.cluster.replicated(self.tenant_id, stored.next_offset)

    async def _store(self, txn: TxnMetadata) -> None:
        await self._write(txn.transactional_id.encode(), txn)

    def _lock(self, transactional_id: str) -> asyncio.Lock:
        return self._locks.setdefault(transactional_id, asyncio.Lock())

    # ---- producers ----------------------------------------------------------------

    async def init_producer(
        self, transactional_id: str | None = None, timeout_ms: int | None = None
    ) -> ProducerIdentity:
        """InitProducerId: a new producer id (epoch 0) without a transactional id; with
        one, its producer with the epoch bumped (an open transaction is aborted first,
        an ending one finished)."""
        timeout = DEFAULT_TRANSACTION_TIMEOUT_MS if timeout_ms is None else timeout_ms
        if not 1 <= timeout <= MAX_TRANSACTION_TIMEOUT_MS:
            raise InvalidRequest(
                f"transaction_timeout_ms is 1..{MAX_TRANSACTION_TIMEOUT_MS}, not {timeout}"
            )
        if transactional_id is None:
            pid = await self._allocate()
            if self.cluster is None:  # a cluster's id blocks are etcd's to keep
                await self._write(_PRODUCER_IDS_KEY, None)
            return ProducerIdentity(pid, 0)
        _check_transactional_id(transactional_id)
        async with self._lock(transactional_id):
            txn = self.transactions.get(transactional_id)
            if txn is None:
                txn = TxnMetadata(transactional_id, await self._allocate(), 0, timeout)
            else:
                if txn.state == TxnState.ONGOING:
                    await self._abort_fencing(txn)
                elif txn.state in (TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT):
                    await self._complete(txn)
                if txn.epoch >= MAX_EPOCH - 1:  # one bump left, for fencing: a new id
                    txn.producer_id, txn.epoch = await self._allocate(), 0
                else:
                    txn.epoch += 1
                txn.timeout_ms = timeout
                txn.state = TxnState.EMPTY
                txn.partitions.clear()
                txn.offsets.clear()
            await self._store(txn)
            self.transactions[transactional_id] = txn
            return ProducerIdentity(txn.producer_id, txn.epoch)

    async def _allocate(self) -> int:
        if self.cluster is not None:
            return await self.cluster.allocate(self.tenant_id)
        pid = self.next_producer_id
        self.next_producer_id += 1
        return pid

    def _current(self, transactional_id: str, producer: ProducerIdentity) -> TxnMetadata:
        """The transaction of ``transactional_id`` if ``producer`` is its current one."""
        txn = self.transactions.get(transactional_id)
        if txn is None:
            raise InvalidTxnState(
                f"transactional id {transactional_id!r} is unknown: call init_producer first"
            )
        if producer.producer_id != txn.producer_id:
            raise InvalidTxnState(
                f"producer {producer.producer_id} is not transactional id "
                f"{transactional_id!r}'s (init_producer gave {txn.producer_id})"
            )
        if producer.epoch < txn.epoch:
            raise ProducerFenced(
                f"producer {producer.producer_id} epoch {producer.epoch} is fenced: "
                f"transactional id {transactional_id!r} is at epoch {txn.epoch}"
            )
        if producer.epoch > txn.epoch:
            raise InvalidTxnState(
                f"producer {producer.producer_id} epoch {producer.epoch} was never given out"
            )
        return txn

    # ---- transactions -------------------------------------------------------------

    async def add_partitions(
        self,
        transactional_id: str,
        producer: ProducerIdentity,
        partitions: Iterable[tuple[int, int]],
    ) -> None:
        """AddPartitionsToTxn: (stream id, partition) pairs join the transaction (it
        begins with the first); stored before any batch is written to them."""
        async with self._lock(transactional_id):
            txn = self._current(transactional_id, producer)
            await self._add_partitions(txn, partitions)

    async def _add_partitions(
        self, txn: TxnMetadata, partitions: Iterable[tuple[int, int]]
    ) -> None:
        self._check_open(txn)
        new = set()
        for stream_id, partition in partitions:
            stream = self.engine.stream(self.tenant_id, stream_id)  # StreamNotFound
            stream.partition_log(partition)  # InvalidRequest for a partition not there
            if (stream_id, partition) not in txn.partitions:
                new.add((stream_id, partition))
                txn.names[stream_id] = stream.name
        if not new:
            return
        self._begin(txn)
        txn.partitions |= new
        await self._store(txn)

    def _check_open(self, txn: TxnMetadata) -> None:
        if txn.state in (TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT):
            raise InvalidTxnState(
                f"transaction {txn.transactional_id!r} is ending ({txn.state}): wait for it"
            )

    def _begin(self, txn: TxnMetadata) -> None:
        if txn.state != TxnState.ONGOING:
            txn.state = TxnState.ONGOING
            txn.started_ms = self.clock_ms()
            txn.markers = []  # the last transaction's

    async def append(
        self,
        transactional_id: str,
        producer: ProducerIdentity,
        stream_id: int,
        sequence: int,
        values: Sequence[bytes] | KafkaSection,
        **batch: Unpack[TxnBatchOptions],
    ) -> AppendInfo:
        """A transactional batch to one partition (added to the transaction first if
        it is not in it yet); a retried (producer, epoch, sequence) is answered with its
        first offsets and stored once. ``values`` may be a produced Kafka batch, stored
        in Kafka form (its keys and headers are in it)."""
        partition = batch.get("partition", 0)
        async with self._lock(transactional_id):
            txn = self._current(transactional_id, producer)
            if (stream_id, partition) not in txn.partitions or txn.state != TxnState.ONGOING:
                await self._add_partitions(txn, [(stream_id, partition)])
            # Admitted: an end of the transaction waits for this append to be stored,
            # so no batch can land after its partition's marker.
            txn.appending += 1
            txn.appends_done.clear()
        # Appended outside the lock: a transaction's batches to different partitions
        # are written concurrently.
        try:
            return await append_transactional(
                self.engine,
                self.tenant_id,
                producer,
                stream_id,
                sequence,
                values,
                **batch,
            )
        finally:
            txn.appending -= 1
            if txn.appending == 0:
                txn.appends_done.set()

    async def add_offsets(
        self,
        transactional_id: str,
        producer: ProducerIdentity,
        group: str,
        offsets: Mapping[tuple[str, int], tuple[int, str]],
    ) -> None:
        """TxnOffsetCommit: a consumer group's offsets ((stream name, partition) ->
        (next offset, metadata)) are committed with the transaction."""
        now = self.clock_ms()
        staged: dict[OffsetKey, CommittedOffset] = {}
        for (stream_name, partition), (offset, metadata) in offsets.items():
            stream = self.engine.stream_by_name(self.tenant_id, stream_name)
            stream.partition_log(partition)
            if not committable(offset):
                raise InvalidRequest(
                    f"offset {offset} of {stream_name}/{partition} is outside 0..2**63 - 1"
                )
            check_metadata(metadata)
            staged[OffsetKey(group, stream_name, partition)] = CommittedOffset(
                offset, metadata, now
            )
        async with self._lock(transactional_id):
            txn = self._current(transactional_id, producer)
            self._check_open(txn)
            if txn.state != TxnState.ONGOING:
                self._begin(txn)
                await self._store(txn)
            txn.offsets.update(staged)

    async def end_transaction(
        self, transactional_id: str, producer: ProducerIdentity, commit: bool
    ) -> None:
        """EndTxn: commit or abort. Returns once every partition has its marker (and a
        commit's offsets are stored). Ending a transaction with nothing in it, or
        repeating the end just done, is a no-op; the opposite of the end just done is
        InvalidTxnState."""
        async with self._lock(transactional_id):
            txn = self._current(transactional_id, producer)
            done = TxnState.COMPLETE_COMMIT if commit else TxnState.COMPLETE_ABORT
            if txn.state in (TxnState.EMPTY, done):
                return
            if txn.state != TxnState.ONGOING:
                raise InvalidTxnState(
                    f"cannot {'commit' if commit else 'abort'} transaction "
                    f"{transactional_id!r}: it is {txn.state}"
                )
            await _appends_stored(txn)
            txn.state = TxnState.PREPARE_COMMIT if commit else TxnState.PREPARE_ABORT
            if not commit:
                txn.offsets.clear()
            await self._store(txn)
            await self._complete(txn)

    async def _complete(self, txn: TxnMetadata) -> None:
        """Markers to every partition, a commit's offsets, then Complete*: the second
        phase, the same after a crash as the first time."""
        commit = txn.state == TxnState.PREPARE_COMMIT
        partitions = sorted(txn.partitions)
        offsets = await asyncio.gather(
            *(
                self._write_marker(stream_id, partition, txn, commit)
                for stream_id, partition in partitions
            )
        )
        if commit and txn.offsets:
            await self.offsets_sink(self.tenant_id, dict(txn.offsets))
        txn.state = TxnState.COMPLETE_COMMIT if commit else TxnState.COMPLETE_ABORT
        txn.markers = [
            (txn.names[stream_id], partition, offset)
            for (stream_id, partition), offset in zip(partitions, offsets, strict=True)
            if offset is not None and stream_id in txn.names
        ]
        txn.partitions.clear()
        txn.offsets.clear()
        await self._store(txn)

    async def _write_marker(
        self, stream_id: int, partition: int, txn: TxnMetadata, commit: bool
    ) -> int | None:
        """The marker's offset (None: none written here, or a cluster's leader wrote it)."""
        if self.cluster is not None:
            # The partition's leader writes it, checking its own producer table.
            name = txn.names.get(stream_id) or self.engine.stream(self.tenant_id, stream_id).name
            await self.cluster.write_marker(
                self.tenant_id, name, partition, txn.producer_id, txn.epoch, commit
            )
            return None
        written = await write_marker(
            self.engine, self.tenant_id, stream_id, partition, txn.producer_id, txn.epoch, commit
        )
        return None if written is None else written.base_offset

    async def _abort_fencing(self, txn: TxnMetadata) -> None:
        """Abort an open transaction whose producer may still be alive (timed out, left
        by a restart, or replaced by init_producer): the epoch is bumped first, so the
        markers carry the new epoch and the old instance is fenced everywhere."""
        await _appends_stored(txn)
        if txn.epoch < MAX_EPOCH:
            txn.epoch += 1
        txn.state = TxnState.PREPARE_ABORT
        txn.offsets.clear()
        await self._store(txn)
        await self._complete(txn)

    async def abort_expired(self) -> list[str]:
        """Abort every transaction open longer than its timeout; their ids."""
        now = self.clock_ms()
        aborted = []
        for txn in list(self.transactions.values()):
            if txn.state == TxnState.ONGOING and now - txn.started_ms > txn.timeout_ms:
                async with self._lock(txn.transactional_id):
                    if txn.state != TxnState.ONGOING or now - txn.started_ms <= txn.timeout_ms:
                        continue
                    log.info(
                        "tenant %d: aborting transaction %r after its timeout of %d ms",
                        self.tenant_id,
                        txn.transactional_id,
                        txn.timeout_ms,
                    )
                    await self._abort_fencing(txn)
                    aborted.append(txn.transactional_id)
        return aborted

    def writes_state(self) -> bool:
        """Whether this node writes the tenant's state records now (a standalone
        server always; in a cluster the state partition's leader)."""
        if self.cluster is None:
            return True
        try:
            self.cluster.check_leads(self.tenant_id)
        except HeadwaterError:
            return False
        return True

    async def expire_idle(self) -> list[str]:
        """Forget every transactional id idle for TRANSACTIONAL_ID_EXPIRATION_MS (no
        transaction open or ending), as Kafka does: its record is tombstoned, and a
        later InitProducerId for it starts anew (a new producer id). Their ids."""
        now = self.clock_ms()
        idle = (TxnState.EMPTY, TxnState.COMPLETE_COMMIT, TxnState.COMPLETE_ABORT)
        expired = []
        for txn in list(self.transactions.values()):
            if txn.state not in idle or now - txn.updated_ms <= TRANSACTIONAL_ID_EXPIRATION_MS:
                continue
            tid = txn.transactional_id
            async with self._lock(tid):
                if self.transactions.get(tid) is not txn or txn.state not in idle:
                    continue  # taken up again meanwhile
                if now - txn.updated_ms <= TRANSACTIONAL_ID_EXPIRATION_MS:
                    continue
                await self._write(tid.encode(), None, forget=True)
                del self.transactions[tid]
                expired.append(tid)
            lock = self._locks.get(tid)
            # Dropped only when nobody holds or awaits it: a caller already waiting would
            # otherwise hold the old lock while a new caller made another.
            if lock is not None and not lock.locked() and not getattr(lock, "_waiters", None):
                del self._locks[tid]
        if expired and self.cluster is None:
            # A tombstone carries no counter: the expired ids' records may have been the
            # only ones holding it, and compaction takes them (a restart would hand out
            # their producer ids again). A cluster's ids are etcd's to keep.
            await self._write(_PRODUCER_IDS_KEY, None)
        if expired:
            log.info("tenant %d: %d idle transactional ids expired", self.tenant_id, len(expired))
        return expired

    def state(self, transactional_id: str) -> TxnState | None:
        txn = self.transactions.get(transactional_id)
        return None if txn is None else txn.state

    def forget_stream(self, name: str) -> None:
        """The stream ``name`` was deleted: group offsets of it staged in open
        transactions go (as Kafka drops a deleted topic's pending offsets), or a commit
        would put them on a stream made again under the name."""
        for txn in self.transactions.values():
            for key in [key for key in txn.offsets if key.stream == name]:
                del txn.offsets[key]


class TransactionCoordinator:
    """Every tenant's coordinator, each opened on first use."""

    def __init__(
        self,
        engine: Engine,
        offsets_sink: OffsetsSink | None = None,
        clock_ms: Clock = _wall_ms,
    ) -> None:
        self.engine = engine
        self.offsets_sink = offsets_sink
        self.clock_ms = clock_ms
        self._tenants: PerTenant[TenantTransactions] = PerTenant(engine)
        self._expiry: asyncio.Task[None] | None = None
        self.cluster: ClusterHooks | None = None
        # Called with (tenant id, transactional id) as an idle id expires: front ends
        # that keep something per id (Rivven's binding) forget it too.
        self.expiry_listeners: list[Callable[[int, str], None]] = []

    def join_cluster(self, hooks: ClusterHooks) -> None:
        """From now on this node coordinates a tenant's transactions only while the
        cluster says so (:meth:`reload` as that changes)."""
        self.cluster = hooks
        self._tenants.clear()

    async def reload(self, tenant_id: int, coordinates: bool) -> None:
        """A cluster node started (replay the state stream, finish what was prepared)
        or stopped coordinating the tenant's transactions."""
        async with self._tenants.lock(tenant_id):
            self._tenants.pop(tenant_id, None)
            if coordinates:
                self._tenants[tenant_id] = await TenantTransactions.open(
                    self.engine, tenant_id, self.offsets_sink, self.clock_ms, self.cluster
                )

    async def new_producer_id(self, tenant_id: int) -> ProducerIdentity | None:
        """In a cluster, an idempotent producer's id from any node (epoch 0); None on
        a single node (the tenant's coordinator hands it out)."""
        if self.cluster is None:
            return None
        self.engine.tenant(tenant_id)  # TenantNotFound
        return ProducerIdentity(await self.cluster.allocate(tenant_id), 0)

    def coordinates(self, tenant_id: int) -> bool:
        """Whether the tenant's transactions are coordinated here (always on a single
        node)."""
        if self.cluster is None:
            return True
        try:
            self.cluster.check(tenant_id)
        except HeadwaterError:
            return False
        return tenant_id in self._tenants

    def forget_stream(self, tenant_id: int, name: str) -> None:
        """A deleted stream's offsets staged in the tenant's open transactions go
        (:meth:`TenantTransactions.forget_stream`), where they are coordinated here."""
        txns = self._tenants.get(tenant_id)
        if txns is not None:
            txns.forget_stream(name)

    async def recover(self) -> None:
        """Open the coordinator of every tenant that has a state stream (finishing or
        aborting what a crash left), so no transaction waits for its tenant's next
        transactional call to be resolved."""
        for tenant_id in sorted(self.engine.tenants):
            tenant = self.engine.tenant(tenant_id)
            if TXN_STATE_STREAM in tenant.by_name:
                await self.tenant(tenant_id)

    async def tenant(self, tenant_id: int) -> TenantTransactions:
        if self.cluster is not None:
            # Placed once it exists (Kafka clients create it by FindCoordinator;
            # Rivven, which has none, by its first transactional call).
            await create_state_stream(self.engine, tenant_id)
            self.cluster.check(tenant_id)  # NotCoordinator elsewhere
            found = self._tenants.get(tenant_id)
            if found is None:  # the leader, not reloaded yet
                raise CoordinatorNotAvailable("the transaction coordinator is moving")
            return found
        return await self._tenants.open(
            tenant_id,
            lambda: TenantTransactions.open(
                self.engine, tenant_id, self.offsets_sink, self.clock_ms
            ),
        )

    async def abort_expired(self) -> list[tuple[int, str]]:
        aborted = []
        for tenant_id, coordinator in list(self._tenants.items()):
            aborted += [(tenant_id, tid) for tid in await coordinator.abort_expired()]
        return aborted

    async def expire(self) -> None:
        """Transactions past their timeout aborted, then idle transactional ids
        forgotten (a cluster's coordinator node does both: its followers' copies wait)."""
        await self.abort_expired()
        for tenant_id, coordinator in list(self._tenants.items()):
            if coordinator.writes_state():
                for tid in await coordinator.expire_idle():
                    for listener in self.expiry_listeners:
                        listener(tenant_id, tid)

    def start_expiry(self, interval_s: float = 1.0) -> None:
        """Check transaction timeouts and idle transactional ids every ``interval_s``
        seconds."""
        self._expiry = asyncio.get_running_loop().create_task(
            run_every(interval_s, self.expire, "transaction timeouts", log)
        )

    async def close(self) -> None:
        await cancel_and_wait(self._expiry)
        self._expiry = None


async def create_state_stream(engine: Engine, tenant_id: int) -> int:
    """The tenant's ``hw_transaction_state`` (compacted, fsynced), created if missing;
    its id."""
    try:
        return engine.stream_by_name(tenant_id, TXN_STATE_STREAM, internal=True).stream_id
    except StreamNotFound:
        pass
    settings = StreamSettings(cleanup_policy="compact", sync="fsync")
    try:
        info = await engine.create_stream(tenant_id, TXN_STATE_STREAM, settings, internal=True)
    except StreamAlreadyExists:  # created meanwhile (a concurrent first call)
        return engine.stream_by_name(tenant_id, TXN_STATE_STREAM, internal=True).stream_id
    return info.stream_id


async def append_transactional(
    engine: Engine,
    tenant_id: int,
    producer: ProducerIdentity,
    stream_id: int,
    sequence: int,
    values: Sequence[bytes] | KafkaSection,
    *,
    partition: int = 0,
    keys: Sequence[bytes | None] | None = None,
    headers: Sequence[Headers] | None = None,
    timestamp_ms: int | None = None,
) -> AppendInfo:
    """A transactional batch stored as it is: the partition's producer table checks its
    epoch (an older one is fenced) and sequence (a retry is answered, not stored)."""
    if isinstance(values, KafkaSection):
        return await engine.append_encoded(
            tenant_id,
            stream_id,
            values.section,
            values.count,
            value_bytes=len(values.section),
            partition=partition,
            timestamp_ms=values.timestamp_ms,
            producer=(producer.producer_id, sequence),
            producer_epoch=producer.epoch,
            transactional=True,
            kafka=True,
        )
    return await engine.append(
        tenant_id,
        stream_id,
        values,
        partition=partition,
        timestamp_ms=timestamp_ms,
        keys=keys,
        headers=headers,
        producer=(producer.producer_id, sequence),
        producer_epoch=producer.epoch,
        transactional=True,
    )


async def write_marker(
    engine: Engine,
    tenant_id: int,
    stream_id: int,
    partition: int,
    producer_id: int,
    epoch: int,
    commit: bool,
) -> AppendInfo | None:
    """The producer's commit or abort marker on the partition, if its transaction is
    open there (None: nothing appended there, its marker written already, or the stream
    deleted with the transaction's batches)."""
    try:
        plog = engine.stream(tenant_id, stream_id).partition_log(partition)
    except StreamNotFound:
        return None
    if not plog.has_open_transaction(producer_id):
        return None
    return await engine.append(
        tenant_id,
        stream_id,
        [marker_value(commit)],
        partition=partition,
        producer=(producer_id, 0),
        producer_epoch=epoch,
        control=True,
    )


async def _appends_stored(txn: TxnMetadata) -> None:
    """Wait for the transaction's admitted appends (the caller holds its lock, so no
    more are admitted meanwhile)."""
    if txn.appending:
        await txn.appends_done.wait()


def _check_transactional_id(transactional_id: str) -> None:
    size = len(transactional_id.encode())
    if not 1 <= size <= MAX_TRANSACTIONAL_ID_BYTES:
        raise InvalidRequest(f"a transactional id is 1..{MAX_TRANSACTIONAL_ID_BYTES} bytes")


def _log_offsets(engine: Engine) -> OffsetsSink:
    """Commit to the tenant's ``hw_consumer_offsets`` (engine/groups/offsets.py)."""

    async def commit(tenant_id: int, offsets: Mapping[OffsetKey, CommittedOffset]) -> None:
        store = await LogOffsetStore.open(engine, tenant_id)
        await store.commit(offsets)

    return commit
