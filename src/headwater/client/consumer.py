"""The group consumer: :class:`AsyncConsumer` (asyncio) and :class:`Consumer` (blocking).

Modelled on confluent-kafka's and aiokafka's consumers, over the server's Rivven listener
with headwater's group calls (docs/sdk.md, "Consumer"):

* ``subscribe([streams], on_assign=, on_revoke=)`` joins the consumer group
  ``group_id``; the server's group coordinator assigns the partitions (``range`` by
  default, ``roundrobin`` or ``cooperative-sticky``) and rebalances when members come and
  go. Heartbeats go out in the background (every ``heartbeat_interval_ms``); a member
  silent past ``session_timeout_ms`` is dropped by the server.
* A rebalance is carried out inside :meth:`~AsyncConsumer.poll`, as Kafka's consumers do:
  the records returned by earlier polls have been handled by then, so the revoked
  partitions' positions are committed (with ``enable_auto_commit``) and ``on_revoke``
  runs before the member rejoins, and ``on_assign`` runs before records of the new
  partitions are returned. A partition's position starts at the group's committed offset,
  else at ``auto_offset_reset`` ("earliest" or "latest").
* ``enable_auto_commit`` commits, at the start of a poll every
  ``auto_commit_interval_ms``, on revoke and on close, the positions of the records
  returned so far: at-least-once, and a record is delivered again only past the last
  commit. ``commit()`` commits explicitly (the positions, or the offsets given).
* ``seek``, ``seek_to_time`` / ``offsets_for_times``, ``position``, ``committed``;
  ``isolation_level`` is ``read_committed`` by default (open and aborted transactions'
  records are never returned).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Self, Unpack

from headwater.engine.groups.errors import (
    GroupError,
    IllegalGeneration,
    RebalanceInProgress,
    UnknownMemberId,
)
from headwater.errors import HeadwaterError, InvalidOffset, UsageError
from headwater.protocols.rivven import rivven_pb2 as pb

from ._core.blocking import Blocking, Inner, LoopThread, blocking
from ._core.rivven import DEFAULT_SERVER, ConnectionOptions, RivvenClient
from .errors import ClientClosed

log = logging.getLogger("headwater.client")

FETCH_MAX_RECORDS = 10_000  # records one fetch asks for (fetch_max_bytes bounds it too)


class TopicPartition(NamedTuple):
    """A partition of a stream."""

    stream: str
    partition: int


@dataclass(frozen=True, slots=True)
class ConsumerRecord:
    """One record, as aiokafka's ConsumerRecord (``topic`` is ``stream``)."""

    stream: str
    partition: int
    offset: int
    timestamp: int  # ms since the epoch
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...]

    @property
    def topic(self) -> str:
        return self.stream


PartitionsCallback = Callable[[list[TopicPartition]], Awaitable[None] | None]
CommitCallback = Callable[[dict[TopicPartition, int], BaseException | None], None]
IsolationLevel = Literal["read_committed", "read_uncommitted"]
OffsetReset = Literal["earliest", "latest"]


def _tp(value: TopicPartition | tuple[str, int]) -> TopicPartition:
    return value if isinstance(value, TopicPartition) else TopicPartition(*value)


def _offset(value: int, tp: TopicPartition) -> int:
    """An offset the caller gave, checked here: the wire's unsigned field would fail
    later, in a poll or a commit, with the protobuf library's error."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 63:
        raise UsageError(f"an offset of {tp} is an int from 0 to 2**63-1, not {value!r}")
    return value


def _ms(when: int | float | _dt.datetime) -> int:
    """A time as ms since the epoch (an int is taken as ms already)."""
    if isinstance(when, _dt.datetime):
        return int(when.timestamp() * 1000)
    return int(when)


class _Fetched(NamedTuple):
    tp: TopicPartition
    epoch: int  # the partition's fetch epoch when read: a seek or revoke makes it stale
    records: list[pb.ConsumedRecord]
    error: BaseException | None = None  # the fetch failed: the next poll raises it


class AsyncConsumer(RivvenClient):
    """A group consumer for asyncio (see the module). ``async with AsyncConsumer(...)
    as consumer:``, ``consumer.subscribe([...])``, then ``async for record in
    consumer:`` or ``await consumer.poll(timeout)``."""

    def __init__(
        self,
        server: str = DEFAULT_SERVER,
        *,
        group_id: str | None = None,
        client_id: str = "headwater-consumer",
        enable_auto_commit: bool = True,
        auto_commit_interval_ms: int = 5_000,
        auto_offset_reset: OffsetReset = "earliest",
        isolation_level: IsolationLevel = "read_committed",
        session_timeout_ms: int = 45_000,
        heartbeat_interval_ms: int = 3_000,
        rebalance_timeout_ms: int | None = None,
        partition_assignment_strategy: str | Iterable[str] = "range",
        group_instance_id: str | None = None,
        max_poll_records: int = 500,
        fetch_max_wait_ms: int = 500,
        fetch_max_bytes: int = 1 << 20,
        on_commit: CommitCallback | None = None,
        **connection: Unpack[ConnectionOptions],
    ) -> None:
        """``server`` is the Rivven listener (``host:port``, default port 7404); the
        options keep Kafka's names and defaults (``session_timeout_ms`` at least the
        server's 6,000). ``on_commit(offsets, error)`` runs after every commit."""
        if auto_offset_reset not in ("earliest", "latest"):
            raise ValueError("auto_offset_reset is 'earliest' or 'latest'")
        if isolation_level not in ("read_committed", "read_uncommitted"):
            raise ValueError("isolation_level is 'read_committed' or 'read_uncommitted'")
        self.group_id = group_id
        self.enable_auto_commit = enable_auto_commit and group_id is not None
        self.auto_commit_interval_ms = auto_commit_interval_ms
        self.auto_offset_reset = auto_offset_reset
        self.isolation_level = isolation_level
        self.session_timeout_ms = session_timeout_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.rebalance_timeout_ms = rebalance_timeout_ms or session_timeout_ms
        strategies = (
            [partition_assignment_strategy]
            if isinstance(partition_assignment_strategy, str)
            else list(partition_assignment_strategy)
        )
        self.assignors = strategies
        self.group_instance_id = group_instance_id
        self.max_poll_records = max_poll_records
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.fetch_max_bytes = fetch_max_bytes
        self.on_commit = on_commit
        super().__init__(server, client_id, connection)
        # membership
        self.member_id = ""
        self.generation = -1
        self.rebalances = 0  # assignments received, handy in tests and for monitoring
        self._topics: list[str] = []
        self._on_assign: PartitionsCallback | None = None
        self._on_revoke: PartitionsCallback | None = None
        self._membership: asyncio.Task[None] | None = None
        self._joined: asyncio.Future[tuple[list[TopicPartition], list[TopicPartition]]] | None
        self._joined = None
        self._rejoin_needed = asyncio.Event()
        self._revoked = asyncio.Event()
        self._manual = False
        # partitions, positions and fetching
        self._assignment: list[TopicPartition] = []
        self._positions: dict[TopicPartition, int] = {}
        self._committed_positions: dict[TopicPartition, int] = {}
        self._fetch_epochs: dict[TopicPartition, int] = {}
        self._fetchers: dict[TopicPartition, asyncio.Task[None]] = {}
        self._queue: asyncio.Queue[_Fetched] = asyncio.Queue(maxsize=16)
        self._buffer: deque[ConsumerRecord] = deque()
        self._last_auto_commit = time.monotonic()

    # ---- lifecycle ------------------------------------------------------------------

    async def start(self) -> Self:
        """Connect (the group is joined by the first poll after :meth:`subscribe`)."""
        await self._session._ensure()
        return self

    async def close(self) -> None:
        """Commit the positions (with auto-commit), run ``on_revoke``, leave the group
        (its partitions go to the others at once) and close the connection."""
        if self._closed:
            return
        try:
            if self._assignment and not self._manual:
                await self._revoke(list(self._assignment))
            if self._membership is not None:
                self._membership.cancel()
                with contextlib.suppress(BaseException):
                    await self._membership
            if self.member_id and self.group_id is not None:
                with contextlib.suppress(HeadwaterError):
                    await self._session.request(
                        pb.LeaveGroupRequest(
                            group_id=self.group_id,
                            member_id=self.member_id,
                            instance_id=self.group_instance_id or "",
                        ),
                        pb.LeaveGroupResponse,
                        safe=True,
                    )
        finally:
            self._closed = True
            self._stop_fetchers(list(self._fetchers))
            await self._session.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed("the consumer is closed")

    # ---- subscription and membership ----------------------------------------------

    def subscribe(
        self,
        streams: Iterable[str],
        *,
        on_assign: PartitionsCallback | None = None,
        on_revoke: PartitionsCallback | None = None,
    ) -> None:
        """Consume ``streams`` as a member of ``group_id``; the callbacks (plain or
        async functions of the partitions) run inside :meth:`poll`."""
        self._check_open()
        if self.group_id is None:
            raise UsageError("subscribe needs a group_id (or assign() partitions yourself)")
        topics = list(streams)
        if not topics:
            raise UsageError("subscribe to at least one stream")
        self._topics = topics
        self._on_assign, self._on_revoke = on_assign, on_revoke
        if self._membership is not None:
            self._rejoin_needed.set()  # a new subscription: join again with it

    def assign(self, partitions: Iterable[TopicPartition | tuple[str, int]]) -> None:
        """Read these partitions without group membership (commits then need a group
        with no members)."""
        self._check_open()
        if self._membership is not None:
            raise UsageError("the consumer is subscribed: assign() is for a consumer without")
        self._manual = True
        wanted = [_tp(p) for p in partitions]
        self._stop_fetchers([tp for tp in self._assignment if tp not in wanted])
        self._assignment = wanted

    def assignment(self) -> list[TopicPartition]:
        """The partitions this consumer reads now."""
        return list(self._assignment)

    async def _membership_loop(self) -> None:
        """Join, heartbeat until a rebalance is due, wait until poll has revoked, and
        again; errors other than the group's own end the consumer's polls."""
        assert self.group_id is not None
        group_id = self.group_id
        attempts = 0  # joins refused in a row: each waits a little longer
        while True:
            try:
                answer = await self._session.request(
                    pb.JoinGroupRequest(
                        group_id=group_id,
                        member_id=self.member_id,
                        topics=self._topics,
                        session_timeout_ms=self.session_timeout_ms,
                        rebalance_timeout_ms=self.rebalance_timeout_ms,
                        instance_id=self.group_instance_id or "",
                        assignors=self.assignors,
                        owned=self._owned(),
                    ),
                    pb.JoinGroupResponse,
                    safe=True,
                    wait=self.rebalance_timeout_ms / 1000,
                )
            except (UnknownMemberId, RebalanceInProgress) as exc:
                if isinstance(exc, UnknownMemberId):
                    self.member_id = ""  # forgotten (a restart, an expiry): join anew
                attempts += 1
                await asyncio.sleep(self._session._backoff(attempts))
                continue
            attempts = 0
            self.member_id, self.generation = answer.member_id, answer.generation
            gained = [TopicPartition(a.topic, p) for a in answer.assignment for p in a.partitions]
            lost = [TopicPartition(a.topic, p) for a in answer.revoke for p in a.partitions]
            self._rejoin_needed.clear()
            self._revoked.clear()
            joined = asyncio.get_running_loop().create_future()
            joined.set_result((gained, lost))
            self._joined = joined
            await self._heartbeat_until_rebalance(group_id)
            await self._revoked.wait()  # poll (or close) revoked what it must

    def _owned(self) -> list[pb.GroupAssignment]:
        by_stream: dict[str, list[int]] = {}
        for tp in self._assignment:
            by_stream.setdefault(tp.stream, []).append(tp.partition)
        return [pb.GroupAssignment(topic=s, partitions=p) for s, p in by_stream.items()]

    async def _heartbeat_until_rebalance(self, group_id: str) -> None:
        interval = self.heartbeat_interval_ms / 1000
        while not self._rejoin_needed.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._rejoin_needed.wait(), interval)
            if self._rejoin_needed.is_set():
                return
            try:
                await self._session.request(
                    pb.GroupHeartbeatRequest(
                        group_id=group_id,
                        member_id=self.member_id,
                        generation=self.generation,
                        instance_id=self.group_instance_id or "",
                    ),
                    pb.GroupHeartbeatResponse,
                    safe=True,
                )
            except UnknownMemberId:
                self.member_id = ""  # dropped (session expired): join as a new member
                self._rejoin_needed.set()
            except (RebalanceInProgress, IllegalGeneration):
                self._rejoin_needed.set()
            except GroupError as exc:
                log.warning("consumer group %r heartbeat: %s", group_id, exc)
                self._rejoin_needed.set()

    async def _service(self) -> None:
        """What poll does before returning records: join on first use, carry out a
        rebalance, auto-commit."""
        self._check_open()
        if self._topics and self._membership is None:
            self._membership = asyncio.get_running_loop().create_task(self._membership_loop())
        membership = self._membership
        if membership is not None and membership.done():
            error = membership.exception() if not membership.cancelled() else None
            raise error or ClientClosed("the consumer's group membership ended")
        if self._rejoin_needed.is_set() and not self._revoked.is_set():
            # An answer not carried out yet goes first: the coordinator has handed what
            # it takes away to another member once every member had its answer (it was
            # dropped here, and two members read the same partitions).
            await self._carry_out_join()
            cooperative = "cooperative-sticky" in self.assignors[:1]
            if not cooperative:
                await self._revoke(list(self._assignment))  # eager: give up everything
            elif self.enable_auto_commit:
                await self._commit_positions()
            self._revoked.set()
        await self._carry_out_join()
        if (
            self.enable_auto_commit
            and time.monotonic() - self._last_auto_commit >= self.auto_commit_interval_ms / 1000
        ):
            await self._commit_positions()

    async def _carry_out_join(self) -> None:
        """The last JoinGroup's answer, once: its partitions revoked, then assigned."""
        joined = self._joined
        if joined is None or not joined.done():
            return
        self._joined = None
        gained, lost = joined.result()
        if lost:
            await self._revoke(lost)
        self.rebalances += 1
        await self._assign(gained)

    async def _assign(self, gained: list[TopicPartition]) -> None:
        new = [tp for tp in gained if tp not in self._assignment]
        self._assignment = sorted(set(self._assignment) | set(gained))
        if self.group_id is not None and new:
            found = await asyncio.gather(*(self._committed_of(tp) for tp in new))
            for tp, offset in zip(new, found, strict=True):
                if offset is not None:
                    self._positions[tp] = self._committed_positions[tp] = offset
        if new:
            await self._call(self._on_assign, new)

    async def _revoke(self, lost: list[TopicPartition]) -> None:
        if not lost:
            return
        self._stop_fetchers(lost)
        self._buffer = deque(r for r in self._buffer if (r.stream, r.partition) not in lost)
        if self.enable_auto_commit:
            await self._commit_positions(lost)
        # Still assigned while on_revoke runs, so that it may commit their positions.
        await self._call(self._on_revoke, lost)
        self._assignment = [tp for tp in self._assignment if tp not in lost]
        for tp in lost:
            self._positions.pop(tp, None)
            self._committed_positions.pop(tp, None)

    async def _call(self, callback: PartitionsCallback | None, tps: list[TopicPartition]) -> None:
        if callback is not None:
            result = callback(list(tps))
            if inspect.isawaitable(result):
                await result

    # ---- fetching -------------------------------------------------------------------

    async def _start_position(self, tp: TopicPartition) -> int:
        answer = await self._session.request(
            pb.GetOffsetBoundsRequest(topic=tp.stream, partition=tp.partition),
            pb.GetOffsetBoundsResponse,
            safe=True,
        )
        return answer.earliest if self.auto_offset_reset == "earliest" else answer.latest

    def _ensure_fetchers(self) -> None:
        for tp in self._assignment:
            if tp not in self._fetchers:
                epoch = self._fetch_epochs.get(tp, 0) + 1
                self._fetch_epochs[tp] = epoch
                task = asyncio.get_running_loop().create_task(self._fetch_loop(tp, epoch))
                self._fetchers[tp] = task

    def _stop_fetchers(self, tps: Iterable[TopicPartition]) -> None:
        for tp in tps:
            task = self._fetchers.pop(tp, None)
            if task is not None:
                task.cancel()
            self._fetch_epochs[tp] = self._fetch_epochs.get(tp, 0) + 1

    async def _fetch_loop(self, tp: TopicPartition, epoch: int) -> None:
        """Long-poll one partition from its position, handing record batches to poll."""
        try:
            offset = self._positions.get(tp)
            if offset is None:
                offset = self._positions[tp] = await self._start_position(tp)
            isolation = 1 if self.isolation_level == "read_committed" else 0
            while True:
                answer = await self._session.request(
                    pb.ConsumeRequest(
                        topic=tp.stream,
                        partition=tp.partition,
                        offset=offset,
                        max_messages=FETCH_MAX_RECORDS,
                        max_bytes=self.fetch_max_bytes,
                        isolation_level=isolation,
                        max_wait_ms=self.fetch_max_wait_ms,
                    ),
                    pb.ConsumeResponse,
                    safe=True,
                    wait=self.fetch_max_wait_ms / 1000,
                )
                records = list(answer.records)
                if records:
                    offset = records[-1].offset + 1
                    await self._queue.put(_Fetched(tp, epoch, records))
        except asyncio.CancelledError:
            raise
        except InvalidOffset as exc:
            # Past the end or below retention (a seek, a deleted segment): start again
            # where auto_offset_reset says, as Kafka's consumer does.
            log.warning("consumer %s: %s; reset to %s", tp, exc, self.auto_offset_reset)
            self._positions.pop(tp, None)
            self._fetchers.pop(tp, None)
        except BaseException as exc:
            await self._queue.put(_Fetched(tp, epoch, [], exc))

    def _take(self, fetched: _Fetched) -> None:
        """A fetched batch into the buffer, unless its partition was sought or revoked
        since it was read."""
        tp = fetched.tp
        if fetched.epoch != self._fetch_epochs.get(tp) or tp not in self._assignment:
            return
        if fetched.error is not None:
            self._fetchers.pop(tp, None)  # the next poll fetches it again, if it is called
            raise fetched.error
        position = self._positions.get(tp, 0)
        stream, partition = tp
        self._buffer.extend(
            ConsumerRecord(
                stream,
                partition,
                record.offset,
                record.timestamp,
                record.key if record.has_key else None,
                record.value,
                tuple((h.key, h.value) for h in record.headers),
            )
            for record in fetched.records
            if record.offset >= position
        )

    def _returned(self, record: ConsumerRecord) -> ConsumerRecord:
        self._positions[TopicPartition(record.stream, record.partition)] = record.offset + 1
        return record

    async def poll(self, timeout: float | None = 1.0) -> ConsumerRecord | None:
        """The next record, or None when none came within ``timeout`` seconds (None:
        wait as long as it takes). Rebalances and auto-commits happen here."""
        records = await self.getmany(timeout=timeout, max_records=1)
        return records[0] if records else None

    async def getmany(
        self, timeout: float | None = 1.0, max_records: int | None = None
    ) -> list[ConsumerRecord]:
        """Up to ``max_records`` (default ``max_poll_records``) records that are ready,
        waiting at most ``timeout`` seconds for the first."""
        limit = max_records or self.max_poll_records
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            await self._service()
            self._ensure_fetchers()
            while not self._buffer and not self._queue.empty():
                self._take(self._queue.get_nowait())
            if self._buffer:
                count = min(limit, len(self._buffer))
                return [self._returned(self._buffer.popleft()) for _ in range(count)]
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return []
            # Wait for records, a rebalance or an assignment, whichever comes first
            # (at most a heartbeat interval, so a rebalance is never left waiting).
            step = self.heartbeat_interval_ms / 1000
            wait = step if left is None else min(left, step)
            with contextlib.suppress(TimeoutError):
                self._take(await asyncio.wait_for(self._queue.get(), wait))

    def __aiter__(self) -> AsyncIterator[ConsumerRecord]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[ConsumerRecord]:
        while not self._closed:
            for record in await self.getmany(timeout=None):
                yield record

    # ---- offsets --------------------------------------------------------------------

    async def commit(
        self, offsets: Mapping[TopicPartition | tuple[str, int], int] | None = None
    ) -> None:
        """Commit ``offsets`` (partition -> the next offset to read), or the positions
        of every assigned partition (what earlier polls returned). A member's commit is
        refused (IllegalGeneration, RebalanceInProgress...) once its partitions moved."""
        if offsets is None:
            await self._commit_positions(raise_errors=True)
            return
        checked = {_tp(tp): offset for tp, offset in offsets.items()}
        await self._commit({tp: _offset(offset, tp) for tp, offset in checked.items()}, True)

    async def _commit_positions(
        self, partitions: Iterable[TopicPartition] | None = None, *, raise_errors: bool = False
    ) -> None:
        self._last_auto_commit = time.monotonic()
        wanted = self._assignment if partitions is None else list(partitions)
        offsets = {
            tp: self._positions[tp]
            for tp in wanted
            if tp in self._positions and self._positions[tp] != self._committed_positions.get(tp)
        }
        if offsets:
            await self._commit(offsets, raise_errors)

    async def _commit(self, offsets: dict[TopicPartition, int], raise_errors: bool) -> None:
        if self.group_id is None:
            raise UsageError("commit needs a group_id")
        group_id = self.group_id
        # A member's commit names it and its generation; a manual one names neither.
        member_id = "" if self._manual else self.member_id
        generation = None if self._manual else self.generation
        error: BaseException | None = None
        try:
            await asyncio.gather(
                *(
                    self._session.request(
                        pb.CommitOffsetRequest(
                            consumer_group=group_id,
                            topic=tp.stream,
                            partition=tp.partition,
                            offset=offset,
                            member_id=member_id,
                            generation=generation,
                        ),
                        pb.CommitOffsetResponse,
                        safe=True,
                    )
                    for tp, offset in offsets.items()
                )
            )
            self._committed_positions.update(offsets)
        except HeadwaterError as exc:
            error = exc
            log.warning("consumer group %r: commit refused: %s", group_id, exc)
        if self.on_commit is not None:
            self.on_commit(dict(offsets), error)
        if error is not None and raise_errors:
            raise error

    async def _committed_of(self, tp: TopicPartition) -> int | None:
        assert self.group_id is not None
        answer = await self._session.request(
            pb.GetOffsetRequest(
                consumer_group=self.group_id, topic=tp.stream, partition=tp.partition
            ),
            pb.GetOffsetResponse,
            safe=True,
        )
        return None if answer.offset < 0 else answer.offset

    async def committed(
        self, partitions: Iterable[TopicPartition | tuple[str, int]]
    ) -> dict[TopicPartition, int | None]:
        """The group's committed offsets (None: never committed)."""
        tps = [_tp(p) for p in partitions]
        found = await asyncio.gather(*(self._committed_of(tp) for tp in tps))
        return dict(zip(tps, found, strict=True))

    def position(self, partition: TopicPartition | tuple[str, int]) -> int | None:
        """The offset the next record returned from ``partition`` will have (None:
        not known yet: no record returned and no committed offset)."""
        return self._positions.get(_tp(partition))

    def seek(self, partition: TopicPartition | tuple[str, int], offset: int) -> None:
        """Read ``partition`` from ``offset`` on (records already fetched are dropped)."""
        tp = _tp(partition)
        if tp not in self._assignment:
            raise UsageError(f"{tp} is not assigned to this consumer")
        _offset(offset, tp)
        self._stop_fetchers([tp])
        self._buffer = deque(r for r in self._buffer if (r.stream, r.partition) != tp)
        self._positions[tp] = offset

    async def offsets_for_times(
        self, times: Mapping[TopicPartition | tuple[str, int], int | float | _dt.datetime]
    ) -> dict[TopicPartition, int | None]:
        """Per partition, the first offset whose record is at or after the time (ms
        since the epoch, or a datetime); None when no record is that late."""

        async def one(tp: TopicPartition, when: int) -> int | None:
            answer = await self._session.request(
                pb.GetOffsetForTimestampRequest(
                    topic=tp.stream, partition=tp.partition, timestamp_ms=when
                ),
                pb.GetOffsetForTimestampResponse,
                safe=True,
            )
            return answer.offset if answer.HasField("offset") else None

        tps = [(_tp(p), _ms(w)) for p, w in times.items()]
        found = await asyncio.gather(*(one(tp, when) for tp, when in tps))
        return {tp: offset for (tp, _), offset in zip(tps, found, strict=True)}

    async def seek_to_time(
        self,
        when: int | float | _dt.datetime,
        partitions: Iterable[TopicPartition | tuple[str, int]] | None = None,
    ) -> None:
        """Seek each partition (default: every assigned one) to its first record at or
        after ``when``; one with no record that late to its end."""
        tps = self._assignment if partitions is None else [_tp(p) for p in partitions]
        found = await self.offsets_for_times({tp: when for tp in tps})
        for tp, offset in found.items():
            if offset is None:
                offset = (
                    await self._session.request(
                        pb.GetOffsetBoundsRequest(topic=tp.stream, partition=tp.partition),
                        pb.GetOffsetBoundsResponse,
                        safe=True,
                    )
                ).latest
            self.seek(tp, offset)

    async def wait_for_assignment(self, timeout: float | None = None) -> list[TopicPartition]:
        """Poll (keeping records for later polls) until the group assigned this
        consumer its partitions; handy before a seek."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self.rebalances == 0 or self._joined is not None:
            await self._service()
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                raise TimeoutError("no assignment yet")
            await asyncio.sleep(min(0.01, left) if left is not None else 0.01)
        return self.assignment()


class Consumer(Blocking[AsyncConsumer]):
    """The blocking consumer: :class:`AsyncConsumer` on a loop thread of its own, so
    heartbeats go on while the caller is busy; ``for record in consumer:`` or
    ``consumer.poll(timeout)``, as confluent-kafka's."""

    def __init__(self, server: str = DEFAULT_SERVER, **options: Any) -> None:
        runner, inner = LoopThread.started(
            lambda: _start_consumer(server, options),
            name="headwater-consumer",
            closed_message="the consumer is closed",
        )
        super().__init__(inner, runner)

    def subscribe(
        self,
        streams: Iterable[str],
        *,
        on_assign: Callable[[list[TopicPartition]], None] | None = None,
        on_revoke: Callable[[list[TopicPartition]], None] | None = None,
    ) -> None:
        """Join ``group_id`` for ``streams``; the callbacks run on a worker thread while
        the poll that carries out the rebalance waits for them, so they may call the
        consumer (commit, seek, committed...)."""
        topics = list(streams)  # on the loop: a rejoin sets one of its events
        self._on_loop(
            lambda: self._inner.subscribe(
                topics, on_assign=_threaded(on_assign), on_revoke=_threaded(on_revoke)
            )
        )

    def _on_loop(self, function: Callable[[], None]) -> None:
        """Run ``function`` on the consumer's loop: at once when called there (from an
        ``on_assign`` / ``on_revoke`` callback, which polls run on the loop)."""
        if threading.current_thread() is self._runner.thread:
            function()
        else:
            self._run(_call(function))

    def assign(self, partitions: Iterable[TopicPartition | tuple[str, int]]) -> None:
        wanted = list(partitions)
        self._on_loop(lambda: self._inner.assign(wanted))

    def assignment(self) -> list[TopicPartition]:
        return self._inner.assignment()

    poll = blocking(AsyncConsumer.poll)

    def consume(self, num_messages: int = 1, timeout: float | None = 1.0) -> list[ConsumerRecord]:
        """Up to ``num_messages`` records, waiting at most ``timeout`` for the first."""
        return self._run(self._inner.getmany(timeout, num_messages))

    def __iter__(self) -> Iterator[ConsumerRecord]:
        while not self._inner.closed:
            yield from self._run(self._inner.getmany(timeout=None))

    def commit(
        self,
        offsets: Mapping[TopicPartition | tuple[str, int], int] | None = None,
        *,
        asynchronous: bool = False,
    ) -> None:
        """Commit (see :meth:`AsyncConsumer.commit`); ``asynchronous`` returns at once,
        the outcome going to ``on_commit``."""
        if asynchronous:
            self._runner.submit(self._inner.commit(offsets)).add_done_callback(
                lambda f: f.exception()  # the outcome went to on_commit and the log
            )
            return
        self._run(self._inner.commit(offsets))

    committed = blocking(AsyncConsumer.committed)

    def position(self, partition: TopicPartition | tuple[str, int]) -> int | None:
        return self._inner.position(partition)

    def seek(self, partition: TopicPartition | tuple[str, int], offset: int) -> None:
        """Read ``partition`` from ``offset`` on (also from within ``on_assign``)."""
        self._on_loop(lambda: self._inner.seek(partition, offset))

    offsets_for_times = blocking(AsyncConsumer.offsets_for_times)

    seek_to_time = blocking(AsyncConsumer.seek_to_time)

    wait_for_assignment = blocking(AsyncConsumer.wait_for_assignment)

    member_id = Inner[str]()
    generation = Inner[int]()
    rebalances = Inner[int]()


async def _start_consumer(server: str, options: dict[str, Any]) -> AsyncConsumer:
    """The consumer, made on its loop (its queue and events belong to that loop), and
    connected."""
    return await AsyncConsumer(server, **options).start()


async def _call(function: Callable[[], None]) -> None:
    function()


def _threaded(
    callback: Callable[[list[TopicPartition]], None] | None,
) -> PartitionsCallback | None:
    """``callback`` run on a worker thread, so that it may call the blocking consumer
    (whose calls run on the loop the poll is on)."""
    if callback is None:
        return None

    async def run(partitions: list[TopicPartition]) -> None:
        await asyncio.to_thread(callback, partitions)

    return run
