"""The producer: :class:`AsyncProducer` (asyncio) and :class:`Producer` (blocking).

Modelled on confluent-kafka's and aiokafka's producers, over the server's Rivven
listener (docs/sdk.md, "Producer"):

* ``send(stream, value, key=, headers=, partition=, timestamp=)`` adds the record to
  its stream's batch and returns a future of its :class:`RecordMetadata`
  ``(partition, offset)``.
* A batch goes out when it reaches ``batch_bytes`` of values (or 10,000 records), or
  ``linger_ms`` after its first record, as one request (headwater's ``publish_batch``,
  each partition's records one append). Its records are placed as it goes, by the
  engine's partitioner over the whole batch: the partition named; else Kafka's murmur2
  of the key (the partition Kafka would pick), the keys hashed together; else the
  batch's sticky partition, as Kafka's and Rivven's producers do. One batch of a stream
  is in flight at a time, so a partition's records are stored in the order they were
  sent.
* Idempotence is on by default: the producer gets an id and epoch (InitProducerId) and
  numbers each partition's records, so a batch sent again after a lost connection is
  stored once (the server answers it with the first attempt's offsets).
* ``transactional_id``: ``init_transactions()``, then ``begin_transaction()``,
  sends, ``send_offsets_to_transaction(...)`` and ``commit_transaction()`` or
  ``abort_transaction()``: all of a transaction's records and offsets become visible to
  ``read_committed`` consumers together, or never.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Self, TypeAlias, Unpack

from headwater.engine.partitioner import Partitioner
from headwater.errors import InvalidTxnState, StreamAlreadyExists, UsageError
from headwater.protocols.rivven import rivven_pb2 as pb

from ._core.blocking import Blocking, Inner, LoopThread, blocking
from ._core.rivven import DEFAULT_SERVER, ConnectionOptions, RivvenClient
from .aio import EventLike, HeadersLike, to_event_bytes, to_headers
from .errors import ClientClosed, EventTooLarge

log = logging.getLogger(__name__)

MAX_BATCH_RECORDS = 10_000  # what one append may carry
MAX_BATCH_BYTES = 4 << 20
DEFAULT_LINGER_MS = 5  # librdkafka's linger.ms
DEFAULT_BATCH_BYTES = 1 << 20


class RecordMetadata(NamedTuple):
    """Where a record was stored."""

    partition: int
    offset: int


OffsetsLike = Mapping[tuple[str, int], int]
"""Offsets by (stream, partition): the next offset to read, as Kafka commits them."""


Delivery: TypeAlias = Callable[[BaseException | None, RecordMetadata | None], None]
"""``on_delivery(error, metadata)``: told how a record's send ended."""
_Target: TypeAlias = "asyncio.Future[RecordMetadata] | Delivery"
"""Who learns where a record went: the future :meth:`AsyncProducer.send` returned, or a
callback (the blocking producer's, which needs no loop turn per record)."""


def _settle(target: Any, error: BaseException | None, metadata: RecordMetadata | None) -> None:
    if isinstance(target, asyncio.Future):
        if not target.done():
            if error is not None:
                target.set_exception(error)
            else:
                target.set_result(metadata)
    else:
        target(error, metadata)


@dataclass(eq=False)  # kept in a set, by identity
class _Batch:
    """Records of one stream waiting to be sent, in send order. They are placed on
    partitions when the batch is sent (keys hashed together, keyless records on the
    batch's sticky partition), and go as one request."""

    values: list[bytes] = field(default_factory=list)
    keys: list[bytes | None] = field(default_factory=list)
    headers: list[list[pb.RecordHeader]] = field(default_factory=list)
    partitions: list[int | None] = field(default_factory=list)
    timestamps: list[int] = field(default_factory=list)
    futures: list[_Target] = field(default_factory=list)
    size: int = 0
    timer: asyncio.TimerHandle | None = None
    sent: asyncio.Future[None] | None = None  # done once every record is answered


@dataclass
class _StreamQueue:
    """One stream's batches: the one filling, those ready, whether one is in flight (one
    at a time, so each partition stores records in send order) and each partition's
    next batch sequence number (idempotence)."""

    filling: _Batch | None = None
    ready: list[_Batch] = field(default_factory=list)
    in_flight: bool = False
    sequences: dict[int, int] = field(default_factory=dict)


class AsyncProducer(RivvenClient):
    """A producer for asyncio (see the module). Use as ``async with AsyncProducer(...)
    as producer:`` or call :meth:`start` and :meth:`close`."""

    def __init__(
        self,
        server: str = DEFAULT_SERVER,
        *,
        linger_ms: float = DEFAULT_LINGER_MS,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        enable_idempotence: bool = True,
        transactional_id: str | None = None,
        transaction_timeout_ms: int = 60_000,
        client_id: str = "headwater-producer",
        **connection: Unpack[ConnectionOptions],
    ) -> None:
        """``server`` is the Rivven listener (``host:port``, default port 7404).
        ``linger_ms`` and ``batch_bytes`` bound a batch by time and size (librdkafka's
        ``linger.ms`` and ``batch.size``); a transactional producer is idempotent."""
        if not 1 <= batch_bytes <= MAX_BATCH_BYTES:
            raise ValueError(f"batch_bytes must be 1..{MAX_BATCH_BYTES}")
        if linger_ms < 0:
            raise ValueError("linger_ms must not be negative")
        if transactional_id is not None and not enable_idempotence:
            raise ValueError("a transactional producer is idempotent: enable_idempotence=True")
        self.linger_ms = linger_ms
        self.batch_bytes = batch_bytes
        self.enable_idempotence = enable_idempotence
        self.transactional_id = transactional_id
        self.transaction_timeout_ms = transaction_timeout_ms
        super().__init__(server, client_id, connection)
        self.producer_id: int | None = None
        self.producer_epoch = 0
        self._partitions: dict[str, int] = {}
        self._partitioners: dict[str, Partitioner] = {}
        self._queues: dict[str, _StreamQueue] = {}
        self._renumber = False  # a batch failed: sequences restart under a new id
        self._outstanding: set[_Batch] = set()  # batches not yet answered
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_transaction = False

    # ---- lifecycle ------------------------------------------------------------------

    @property
    def requests(self) -> int:
        """Requests written so far (a batch is one)."""
        return self._session.requests

    async def start(self) -> Self:
        """Connect, and get a producer id when idempotent (and not transactional:
        :meth:`init_transactions` does that)."""
        await self._session._ensure()
        if self.enable_idempotence and self.transactional_id is None:
            await self._init_producer_id()
        return self

    async def close(self) -> None:
        """Send what is waiting, then close the connection."""
        if self._closed:
            return
        try:
            await self.flush()
        finally:
            self._closed = True
            await self._session.close()

    async def _init_producer_id(self) -> None:
        answer = await self._session.request(
            pb.InitProducerIdRequest(), pb.InitProducerIdResponse, safe=True
        )
        self.producer_id, self.producer_epoch = answer.producer_id, answer.producer_epoch
        self._renumber = False
        for queue in self._queues.values():
            queue.sequences.clear()  # a new id numbers from 0

    # ---- sending --------------------------------------------------------------------

    def send(
        self,
        stream: str,
        value: EventLike | None,
        *,
        key: EventLike | None = None,
        headers: HeadersLike | None = None,
        partition: int | None = None,
        timestamp: int | None = None,
    ) -> asyncio.Future[RecordMetadata]:
        """Add a record to its stream's batch; the future resolves with where it was
        stored once its batch is acknowledged (or with the batch's error). ``timestamp``
        in ms since the epoch (default: the server's clock on arrival); ``value`` None
        is an empty value."""
        future: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
        self._enqueue(stream, value, key, headers, partition, timestamp, future)
        return future

    def _enqueue(
        self,
        stream: str,
        value: EventLike | None,
        key: EventLike | None,
        headers: HeadersLike | None,
        partition: int | None,
        timestamp: int | None,
        target: Any,
    ) -> None:
        """Add a record to its stream's batch; ``target`` learns how it ended."""
        if self._closed:
            raise ClientClosed("the producer is closed")
        if self.transactional_id is not None and not self._in_transaction:
            raise InvalidTxnState("a transactional producer sends inside begin_transaction()")
        data = b"" if value is None else to_event_bytes(value)
        size = len(data)
        if size > MAX_BATCH_BYTES:
            raise EventTooLarge(
                f"a {size:,}-byte value is over what one append carries "
                f"({MAX_BATCH_BYTES:,} bytes); nothing was sent"
            )
        if partition is not None and not 0 <= partition < self._partitions.get(stream, 1 << 31):
            raise UsageError(f"stream {stream!r} has no partition {partition}")
        queue = self._queues.get(stream)
        if queue is None:
            queue = self._queues[stream] = _StreamQueue()
        stamp = timestamp or 0
        batch = queue.filling
        if batch is not None and (
            batch.size + size > self.batch_bytes
            or len(batch.values) >= MAX_BATCH_RECORDS
            # an idempotent batch is stored with one timestamp: its first record's
            or (self.enable_idempotence and stamp != batch.timestamps[0])
        ):
            self._release(stream, queue)
            batch = None
        if batch is None:
            batch = queue.filling = _Batch()
            self._outstanding.add(batch)
            if self.linger_ms > 0:
                batch.timer = asyncio.get_running_loop().call_later(
                    self.linger_ms / 1000, self._linger_over, stream, batch
                )
        batch.values.append(data)
        batch.keys.append(None if key is None else to_event_bytes(key))
        batch.headers.append(
            [pb.RecordHeader(key=k, value=v) for k, v in to_headers(headers)] if headers else []
        )
        batch.partitions.append(partition)
        batch.timestamps.append(stamp)
        batch.futures.append(target)
        batch.size += size
        if self.linger_ms <= 0 or batch.size >= self.batch_bytes:
            self._release(stream, queue)

    async def send_and_wait(
        self,
        stream: str,
        value: EventLike | None,
        *,
        key: EventLike | None = None,
        headers: HeadersLike | None = None,
        partition: int | None = None,
        timestamp: int | None = None,
    ) -> RecordMetadata:
        """:meth:`send`, then wait for its acknowledgement (its batch goes at once)."""
        future = self.send(
            stream, value, key=key, headers=headers, partition=partition, timestamp=timestamp
        )
        self._release_all()
        return await future

    async def flush(self) -> None:
        """Send every waiting batch now and wait until each is answered (errors stay on
        the records' futures)."""
        while self._outstanding:
            self._release_all()
            waiting = [b.sent for b in self._outstanding if b.sent is not None]
            if waiting:
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)

    async def create_stream(self, name: str, *, partitions: int = 1, exist_ok: bool = False) -> int:
        """Create a stream of ``partitions`` partitions (CreateTopic); returns its
        partition count. ``exist_ok``: a stream of that name is taken as it is."""
        try:
            answer = await self._session.request(
                pb.CreateTopicRequest(name=name, partitions=partitions),
                pb.CreateTopicResponse,
                safe=exist_ok,
            )
        except StreamAlreadyExists:
            if not exist_ok:
                raise
            await self._lookup(name)
            return self._partitions[name]
        self._partitions[name] = answer.partitions
        return answer.partitions

    async def partitions_for(self, stream: str) -> int:
        """How many partitions ``stream`` has (looked up once, then cached)."""
        if stream not in self._partitions:
            await self._lookup(stream)
        return self._partitions[stream]

    async def _lookup(self, stream: str) -> None:
        answer = await self._session.request(
            pb.GetMetadataRequest(topics=[stream]), pb.GetMetadataResponse, safe=True
        )
        self._partitions[stream] = len(answer.topics[0].partitions)

    def _linger_over(self, stream: str, batch: _Batch) -> None:
        queue = self._queues[stream]
        if queue.filling is batch:
            self._release(stream, queue)

    def _release(self, stream: str, queue: _StreamQueue) -> None:
        """The filling batch is ready: send it unless one is in flight."""
        batch = queue.filling
        if batch is not None:
            queue.filling = None
            if batch.timer is not None:
                batch.timer.cancel()
            batch.sent = asyncio.get_running_loop().create_future()
            queue.ready.append(batch)
        if not queue.in_flight and queue.ready:
            queue.in_flight = True
            self._spawn(self._send_batch(stream, queue, queue.ready.pop(0)))

    def _release_all(self) -> None:
        for stream, queue in list(self._queues.items()):
            self._release(stream, queue)

    def _place(self, stream: str, batch: _Batch) -> list[int]:
        """Each record's partition: named, else its key's (murmur2, hashed together),
        else the stream's sticky partition for this batch."""
        count = self._partitions[stream]
        for partition in batch.partitions:
            if partition is not None and partition >= count:
                raise UsageError(f"stream {stream!r} has no partition {partition} ({count})")
        partitioner = self._partitioners.setdefault(stream, Partitioner())
        placed: list[int] = partitioner.partition(batch.keys, count, batch.partitions).tolist()
        return placed

    async def _send_batch(self, stream: str, queue: _StreamQueue, batch: _Batch) -> None:
        try:
            if stream not in self._partitions:
                await self._lookup(stream)
            placed = self._place(stream, batch)
            request = pb.BatchPublishRequest(topic=stream)
            idempotent = self.enable_idempotence
            if idempotent:
                if self.producer_id is None or (self._renumber and self.transactional_id is None):
                    await self._init_producer_id()
                assert self.producer_id is not None
                request.producer_id = self.producer_id
                request.producer_epoch = self.producer_epoch
                if self.transactional_id is not None:
                    request.txn_id = self.transactional_id
            entries: dict[int, pb.PartitionRecords] = {}
            rows: dict[int, list[int]] = {}  # each partition's records, in send order
            for index, partition in enumerate(placed):
                entry = entries.get(partition)
                if entry is None:
                    entry = entries[partition] = request.partition_records.add(partition=partition)
                    rows[partition] = []
                    if idempotent:
                        # One sequence number a batch (the server's producer table
                        # numbers appends), the batch's for good: a retry carries it.
                        entry.base_sequence = queue.sequences.get(partition, 0)
                        queue.sequences[partition] = entry.base_sequence + 1
                key = batch.keys[index]
                entry.records.add(
                    key=key or b"",
                    has_key=key is not None,
                    value=batch.values[index],
                    headers=batch.headers[index],
                    timestamp=batch.timestamps[index],
                )
                rows[partition].append(index)
            answer = await self._session.request(request, pb.BatchPublishResponse, safe=idempotent)
            targets = batch.futures
            for result in answer.results:
                base = result.base_offset
                partition = result.partition
                for position, index in enumerate(rows[partition]):
                    _settle(targets[index], None, RecordMetadata(partition, base + position))
        except BaseException as exc:
            for target in batch.futures:
                _settle(target, exc, None)
            if isinstance(exc, asyncio.CancelledError):
                raise
            if self.enable_idempotence:
                # The batch may or may not be stored and took its sequence numbers: the
                # next batch would be out of order for good. A new producer id (or, in a
                # transaction, epoch, once it ends) numbers from 0 again, as Kafka's
                # producer bumps its epoch.
                self._renumber = True
        finally:
            self._outstanding.discard(batch)
            if batch.sent is not None and not batch.sent.done():
                batch.sent.set_result(None)
            queue.in_flight = False
            if not self._closed:
                self._release(stream, queue)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- transactions ---------------------------------------------------------------

    def _txn_request_fields(self) -> dict[str, Any]:
        if self.transactional_id is None:
            raise InvalidTxnState("the producer has no transactional_id")
        if self.producer_id is None:
            raise InvalidTxnState("init_transactions() first")
        return {
            "txn_id": self.transactional_id,
            "producer_id": self.producer_id,
            "producer_epoch": self.producer_epoch,
        }

    async def init_transactions(self) -> None:
        """Get the producer's id and epoch; the first transaction it begins fences any
        older producer of the same ``transactional_id`` (its open transaction aborted)."""
        if self.transactional_id is None:
            raise InvalidTxnState("the producer has no transactional_id")
        await self._init_producer_id()

    async def begin_transaction(self) -> None:
        """Start a transaction: the records sent until it ends belong to it."""
        fields = self._txn_request_fields()
        if self._in_transaction:
            raise InvalidTxnState("a transaction is already open")
        if self._renumber:  # a batch of the last transaction failed: a new epoch
            await self._init_producer_id()
            fields = self._txn_request_fields()
        await self._session.request(
            pb.BeginTransactionRequest(**fields, timeout_ms=self.transaction_timeout_ms),
            pb.BeginTransactionResponse,
            safe=True,
        )
        self._in_transaction = True

    async def send_offsets_to_transaction(self, offsets: OffsetsLike, group_id: str) -> None:
        """Commit ``offsets`` ((stream, partition) -> the next offset to read) of
        consumer group ``group_id`` with the transaction (consume-transform-produce)."""
        fields = self._txn_request_fields()
        if not self._in_transaction:
            raise InvalidTxnState("begin_transaction() first")
        await self._session.request(
            pb.AddOffsetsToTxnRequest(
                **fields,
                group_id=group_id,
                offsets=[
                    pb.TopicPartitionOffset(topic=s, partition=p, offset=o)
                    for (s, p), o in offsets.items()
                ],
            ),
            pb.OffsetsAddedToTxnResponse,
            safe=True,
        )

    async def commit_transaction(self) -> None:
        """Send what is waiting, then commit: every record and offset of the
        transaction becomes visible together. A record that failed aborts instead and
        raises its error."""
        fields = self._txn_request_fields()
        if not self._in_transaction:
            raise InvalidTxnState("begin_transaction() first")
        failed = await self._flush_transaction()
        if failed is not None:
            await self._end(pb.AbortTransactionRequest(**fields), pb.AbortTransactionResponse)
            raise failed
        await self._end(pb.CommitTransactionRequest(**fields), pb.CommitTransactionResponse)

    async def abort_transaction(self) -> None:
        """Abort: no record or offset of the transaction is ever seen by a
        read_committed consumer."""
        fields = self._txn_request_fields()
        if not self._in_transaction:
            raise InvalidTxnState("begin_transaction() first")
        await self._flush_transaction()
        await self._end(pb.AbortTransactionRequest(**fields), pb.AbortTransactionResponse)

    async def _flush_transaction(self) -> BaseException | None:
        """Flush; the first error a record of the transaction got, if any."""
        failed: list[BaseException] = []
        for batch in self._outstanding:
            batch.futures = [_watching(target, failed) for target in batch.futures]
        await self.flush()
        return failed[0] if failed else None

    async def _end(self, request: Any, expect: type[Any]) -> None:
        try:
            await self._session.request(request, expect, safe=False)
        finally:
            self._in_transaction = False


def _watching(target: Any, failed: list[BaseException]) -> Delivery:
    """``target``, and a failure noted in ``failed`` too."""

    def settle(error: BaseException | None, metadata: RecordMetadata | None) -> None:
        if error is not None:
            failed.append(error)
        _settle(target, error, metadata)

    return settle


class RecordFuture:
    """What the blocking producer's ``send`` returns: ``result(timeout)`` waits for the
    record's :class:`RecordMetadata` (or raises its error), as a
    :class:`concurrent.futures.Future` does. Lighter than one: nothing to wait on is made
    unless someone waits, so a send costs little in the sending thread."""

    __slots__ = ("_done", "_error", "_event", "_metadata")
    _lock = threading.Lock()  # guards the lazily made event of every RecordFuture

    def __init__(self) -> None:
        self._done = False
        self._error: BaseException | None = None
        self._metadata: RecordMetadata | None = None
        self._event: threading.Event | None = None

    def _settle(self, error: BaseException | None, metadata: RecordMetadata | None) -> None:
        with RecordFuture._lock:
            self._error, self._metadata, self._done = error, metadata, True
            event = self._event
        if event is not None:
            event.set()

    def done(self) -> bool:
        return self._done

    def _wait(self, timeout: float | None) -> None:
        if self._done:
            return
        with RecordFuture._lock:
            if self._done:
                return
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        if not event.wait(timeout):
            raise TimeoutError(f"the record was not acknowledged within {timeout}s")

    def result(self, timeout: float | None = None) -> RecordMetadata:
        self._wait(timeout)
        if self._error is not None:
            raise self._error
        assert self._metadata is not None
        return self._metadata

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._error


class Producer(Blocking[AsyncProducer]):
    """The blocking producer: :class:`AsyncProducer` on a loop thread of its own. Its
    ``send`` returns a :class:`RecordFuture` and takes an ``on_delivery`` callback
    ``(error, metadata)``, as confluent-kafka's ``produce`` does."""

    def __init__(self, server: str = DEFAULT_SERVER, **options: Any) -> None:
        runner, inner = LoopThread.started(
            AsyncProducer(server, **options).start,
            name="headwater-producer",
            closed_message="the producer is closed",
        )
        super().__init__(inner, runner)
        # records sent from the caller's thread, taken in by the loop in one go
        self._handoff: list[tuple[Any, ...]] = []
        self._handoff_lock = threading.Lock()
        self._handoff_scheduled = False

    requests = Inner[int]("Requests written so far (a batch is one).")
    partitions_for = blocking(AsyncProducer.partitions_for)
    create_stream = blocking(AsyncProducer.create_stream)

    def send(
        self,
        stream: str,
        value: EventLike | None,
        *,
        key: EventLike | None = None,
        headers: HeadersLike | None = None,
        partition: int | None = None,
        timestamp: int | None = None,
        on_delivery: Callable[[BaseException | None, RecordMetadata | None], None] | None = None,
    ) -> RecordFuture:
        """Queue a record (see :meth:`AsyncProducer.send`); ``on_delivery(error,
        metadata)`` runs on the producer's thread once it is acknowledged or failed."""
        result = RecordFuture()
        settle = result._settle
        if on_delivery is not None:

            def settle(error: BaseException | None, metadata: RecordMetadata | None) -> None:
                result._settle(error, metadata)
                try:
                    on_delivery(error, metadata)
                except Exception:
                    # The caller's bug: logged, and no other record's outcome changes
                    # (it once failed its whole batch, stored records reported lost).
                    log.exception("on_delivery raised for a record of %s", stream)

        if self._runner.stopped:
            raise ClientClosed("the producer is closed")
        record = (stream, value, key, headers, partition, timestamp, settle)
        with self._handoff_lock:
            self._handoff.append(record)
            if self._handoff_scheduled:
                return result
            self._handoff_scheduled = True
        # One wake-up of the loop for every record sent meanwhile, not one each.
        self._runner.loop.call_soon_threadsafe(self._take_handoff)
        return result

    def _take_handoff(self) -> None:
        with self._handoff_lock:
            records, self._handoff = self._handoff, []
            self._handoff_scheduled = False
        for record in records:
            try:
                self._inner._enqueue(*record)
            except BaseException as exc:
                record[-1](exc, None)

    def flush(self, timeout: float | None = None) -> None:
        """Send every waiting record and wait for their acknowledgements."""
        future = self._runner.submit(self._flush())
        future.result(timeout)

    async def _flush(self) -> None:
        self._take_handoff()  # what was sent before the flush is in it
        await self._inner.flush()

    # Transactions, as AsyncProducer's (what was sent before is in the loop's queue ahead
    # of them).
    init_transactions = blocking(AsyncProducer.init_transactions)
    begin_transaction = blocking(AsyncProducer.begin_transaction)
    send_offsets_to_transaction = blocking(AsyncProducer.send_offsets_to_transaction)
    commit_transaction = blocking(AsyncProducer.commit_transaction)
    abort_transaction = blocking(AsyncProducer.abort_transaction)
