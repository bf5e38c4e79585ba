"""Push subscriptions with credit flow control and durable consumer groups.

One credit is one event. A subscription's pump task sleeps until its stream commits more
events or it gets credit (no polling), then reads up to ``READ_MAX_EVENTS`` events (its
credits permitting) as stored batches and hands the whole read to the front end in one
call: ``deliver`` gets the read cut into wire pushes (:class:`Push`: at most
``PUSH_MAX_EVENTS`` events / ``PUSH_MAX_BYTES`` bytes of stored value records each, with
the exact credit balance after each), and returns once they are with the transport; a
front end that needs more than the values (keys, timestamps: Kiwi's RESULTs) passes
``deliver_read`` instead and gets the read's stored batches whole. The cutting is per
batch and per push (numpy over record bounds), never a Python step per event. A peer
that stops reading holds only its own pump; after ``backpressure_timeout`` (one timer
per read) it is closed.

Consumer groups: a durable position per (group, stream). Granting credit acknowledges
everything delivered before the grant. One subscription of a group delivers at a time;
later ones wait and take over, from the acknowledged position, when it ends.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from headwater.engine.engine import Engine, Stream
from headwater.errors import (
    CorruptBatchError,
    InvalidOffset,
    InvalidRequest,
    StorageError,
    StreamNotFound,
    UsageError,
)
from headwater.storage.batch import value_spans
from headwater.storage.log import ReadResult
from headwater.storage.metadata import read_json, write_json_atomic

log = logging.getLogger(__name__)

PUSH_MAX_EVENTS = 64
PUSH_MAX_BYTES = 1 << 20
READ_MAX_EVENTS = 4096
READ_MAX_BYTES = 4 << 20
RESUME = (1 << 64) - 1  # from_offset meaning "the group's position" (or the end, no group)
MAX_CREDITS = (1 << 32) - 1
GROUPS_FILE = "groups.json"


class CloseReason(enum.IntEnum):
    CLIENT_CANCELLED = 0
    SERVER_SHUTDOWN = 1
    STREAM_DELETED = 2
    BACKPRESSURE_TIMEOUT = 3
    PROTOCOL_ERROR = 4


class Push(NamedTuple):
    """One SubscriptionEvents push: a run of consecutive offsets as stored value records
    (``u64 len | bytes`` each) and the subscription's credit balance after it."""

    first_offset: int
    event_count: int
    chunks: list[memoryview]
    credits_remaining: int


Deliver = Callable[["Subscription", list[Push]], Awaitable[None]]
DeliverRead = Callable[["Subscription", ReadResult], Awaitable[None]]
OnClose = Callable[["Subscription", CloseReason], None]
# Up to this many bytes of the next read, granted by the front end for a read and its
# delivery (held until the context ends).
ReadRoom = Callable[[int], AbstractAsyncContextManager[int]]


def _span_bounds(chunk: memoryview, count: int) -> np.ndarray:
    """Record bounds (``count + 1`` byte positions) of ``count`` values in ``chunk``."""
    end = len(chunk)
    if count == 1:
        return np.array((0, end), np.int64)
    if end >= 8:
        # One size (fixed-width events are common): the length fields, seen as a strided
        # u64 view, are checked at once instead of walked.
        stride = 8 + int.from_bytes(chunk[:8], "little")
        if end == count * stride:
            lengths = np.ndarray((count,), "<u8", chunk, 0, (stride,))
            if bool((lengths == stride - 8).all()):
                return np.arange(0, end + 1, stride, dtype=np.int64)
    try:
        return np.array(value_spans(chunk, count), np.int64)
    except ValueError as exc:
        raise CorruptBatchError(str(exc)) from None


def split_pushes(
    result: ReadResult, max_events: int, max_bytes: int
) -> list[tuple[int, int, list[memoryview]]]:
    """Cut a read into pushes of at most ``max_events`` events and ``max_bytes`` bytes of
    values (always at least one event), each a run of consecutive offsets, as
    ``(first_offset, count, stored value chunks)``: greedily, each push as long as the
    limits allow (a stored batch may end inside a push; a gap in the offsets never does).

    Work is per stored batch and per push, never per event: a read within the limits
    is one push of its spans' chunks; otherwise the cuts come from numpy over the
    spans' record bounds and offsets."""
    spans = result.spans
    if not spans:
        return []
    views: list[memoryview] = []
    counts: list[int] = []
    firsts: list[int] = []
    sparse: list[list[int] | None] = []
    contiguous = True
    value_bytes = 0
    expected = -1
    for span in spans:  # per stored batch
        batch = span.batch
        n = span.stop - span.start
        view = span.values_chunk()
        if batch.dense:
            first = batch.base_offset + span.start
            sparse.append(None)
        else:  # compacted: offsets with gaps (rare); their offsets as a list
            listed = batch.offsets()[span.start : span.stop]
            first = listed[0]
            sparse.append(listed)
            contiguous = contiguous and listed[-1] - first == n - 1
        contiguous = contiguous and (expected < 0 or first == expected)
        expected = first + n
        views.append(view)
        counts.append(n)
        firsts.append(first)
        value_bytes += len(view) - 8 * n
    total = sum(counts)
    if contiguous and total <= max_events and value_bytes <= max_bytes:
        return [(firsts[0], total, views)]
    bounds = [_span_bounds(view, n) for view, n in zip(views, counts, strict=True)]
    sizes = np.concatenate([np.diff(b) - 8 for b in bounds])
    sums = np.zeros(total + 1, np.int64)
    np.cumsum(sizes, out=sums[1:])
    offsets = np.concatenate(
        [
            np.arange(first, first + n, dtype=np.int64) if offs is None else np.array(offs)
            for first, n, offs in zip(firsts, counts, sparse, strict=True)
        ]
    )
    # A run of consecutive offsets ends where the next offset is not one more.
    breaks = np.flatnonzero(np.diff(offsets) != 1) + 1
    starts = np.arange(0, total, max_events, dtype=np.int64)
    stops = np.minimum(starts + max_events, total)
    if breaks.size == 0 and bool((sums[stops] - sums[starts] <= max_bytes).all()):
        cuts: list[int] = starts.tolist()  # every run of max_events fits the byte limit
    else:
        # Per push: the furthest stop within the event limit, the next gap and the byte
        # limit (a binary search over the running sums), but at least one event.
        run_ends = np.append(breaks, total)
        cuts = []
        i = 0
        while i < total:
            cuts.append(i)
            gap = int(run_ends[np.searchsorted(run_ends, i, "right")])
            fit = int(np.searchsorted(sums, sums[i] + max_bytes, "right")) - 1
            i = max(i + 1, min(i + max_events, gap, fit))
    cuts.append(total)
    # A push may take pieces of several spans: the pieces are cut where a push or a span
    # begins, and their byte ranges looked up at once in the spans' joined record bounds
    # (span s's bounds start at index span_first[s] + s).
    cut_at = np.array(cuts, np.int64)
    span_first = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=span_first[1:])
    piece_starts = np.union1d(cut_at[:-1], span_first[:-1])
    piece_ends = np.append(piece_starts[1:], total)
    piece_span = np.searchsorted(span_first, piece_starts, "right") - 1
    joined = np.concatenate(bounds)
    lows = joined[piece_starts + piece_span].tolist()
    highs = joined[piece_ends + piece_span].tolist()
    owner = (np.searchsorted(cut_at, piece_starts, "right") - 1).tolist()
    firsts_of = offsets[cut_at[:-1]].tolist()
    sizes_of = np.diff(cut_at).tolist()
    pushes: list[tuple[int, int, list[memoryview]]] = [
        (first, size, []) for first, size in zip(firsts_of, sizes_of, strict=True)
    ]
    for k, span, lo, hi in zip(owner, piece_span.tolist(), lows, highs, strict=True):
        view = views[span]
        pushes[k][2].append(view if lo == 0 and hi == len(view) else view[lo:hi])
    return pushes


def plan_pushes(result: ReadResult, credits: int) -> list[Push]:
    """A read as wire pushes (:func:`split_pushes` with the protocol's limits), each with
    the credit balance left once it and those before it are delivered."""
    out: list[Push] = []
    for first, count, chunks in split_pushes(result, PUSH_MAX_EVENTS, PUSH_MAX_BYTES):
        credits -= count
        out.append(Push(first, count, chunks, credits))
    return out


class GroupOffsets:
    """Acknowledged positions of the consumer groups of one stream, in groups.json."""

    def __init__(self, directory: Path, engine: Engine) -> None:
        self.path = directory / GROUPS_FILE
        self.engine = engine
        self.offsets: dict[str, int] = {}
        if self.path.exists():
            self.offsets = {str(k): int(v) for k, v in read_json(self.path).items()}
        self.active: dict[str, Subscription] = {}
        self.waiting: dict[str, list[Subscription]] = {}
        self._flush: asyncio.Task[None] | None = None
        self._dirty = False
        self.failure: OSError | None = None  # the last write's, while it is not done

    def commit(self, group: str, offset: int) -> None:
        if self.offsets.get(group, -1) >= offset:
            return
        self._store(group, offset)

    def reset(self, group: str, offset: int) -> None:
        """Move ``group`` to ``offset``, backwards as well as forwards (an operator's
        reset; the caller makes sure no member of the group is consuming)."""
        self._store(group, offset)

    def _store(self, group: str, offset: int) -> None:
        self.offsets[group] = offset
        self._dirty = True
        if self._flush is None:
            self._flush = asyncio.get_running_loop().create_task(self._flush_loop())

    async def _flush_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._dirty:
                self._dirty = False
                snapshot = dict(self.offsets)
                try:
                    await loop.run_in_executor(
                        self.engine.executor, write_json_atomic, self.path, snapshot
                    )
                except OSError as exc:
                    # Still to write: the next store, flush or close tries again (it was
                    # given up for good, and a restart went back to the last positions
                    # written).
                    self._dirty = True
                    self.failure = exc
                    log.error("writing %s failed: %s", self.path, exc)
                    return
                self.failure = None
        finally:
            self._flush = None

    async def flush(self) -> None:
        """Every position stored so far on disk; StorageError when it cannot be
        written (a full disk): what is not written is tried again later."""
        if self._flush is None and self._dirty:
            self._flush = asyncio.get_running_loop().create_task(self._flush_loop())
        if self._flush is not None:
            await asyncio.wait([self._flush])
        if self._dirty and self.failure is not None:
            raise StorageError(f"writing {self.path.name} failed: {self.failure}")


@dataclass(eq=False, repr=False)  # compared and hashed by identity: held in sets
class Subscription:
    manager: Subscriptions
    subscription_id: int
    stream: Stream
    next_offset: int
    credits: int
    group: str | None
    deliver: Deliver | None
    on_close: OnClose
    deliver_read: DeliverRead | None = None
    partition: int = 0
    # The front end's room for a read and its delivery (the connection's turn and the
    # server's read-answer budget): without it a connection's subscriptions each read
    # READ_MAX_BYTES at once, however little its peer takes.
    read_room: ReadRoom | None = None
    closed: bool = field(default=False, init=False)
    active: bool = field(init=False)  # False while another member of its group reads
    delivered_events: int = field(default=0, init=False)
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.active = self.group is None

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        plog = self.stream.partition_logs[self.partition]
        try:
            while not self.closed:
                if (
                    not self.active
                    or self.credits <= 0
                    or self.next_offset >= plog.last_stable_offset
                ):
                    if self.active and self.credits > 0:
                        # Only a commit can move it on: be woken by the next one. Without
                        # credit (or while a group waits) a grant or hand-over wakes it.
                        self.manager.await_commit(self)
                    await self._wake.wait()
                    self._wake.clear()
                    continue
                if self.read_room is None:
                    delivered = await self._read_and_deliver(READ_MAX_BYTES)
                else:
                    async with self.read_room(READ_MAX_BYTES) as room:
                        delivered = await self._read_and_deliver(room)
                if delivered is None:
                    return
                if delivered and (pace := self.manager.pace) is not None:
                    # Out of the room: a throttled tenant's wait holds no read.
                    await pace(self.stream.tenant.tenant_id, delivered)
        except asyncio.CancelledError:
            raise
        except (StreamNotFound, ConnectionError):
            self.manager.close(self, CloseReason.STREAM_DELETED)
        except Exception:
            log.exception("subscription %d failed", self.subscription_id)
            self.manager.close(self, CloseReason.PROTOCOL_ERROR)

    async def _read_and_deliver(self, max_bytes: int) -> int | None:
        """One read of up to ``max_bytes`` from the cursor, delivered: its value bytes
        (for the tenant's quota), None once the subscription is over."""
        engine = self.manager.engine
        plog = self.stream.partition_logs[self.partition]
        if self.next_offset < plog.start_offset:
            self.next_offset = plog.start_offset  # retention removed what we wanted
        # One read covers many pushes: the disk (or page cache) is visited once
        # per READ_MAX_EVENTS, while each push still keeps to the wire limits.
        result = await engine.read(
            self.stream.tenant.tenant_id,
            self.stream.stream_id,
            self.next_offset,
            max(max_bytes, 1),
            max_events=min(READ_MAX_EVENTS, self.credits),
            partition=self.partition,
        )
        if self.closed:
            return None
        if result.count == 0:
            # Only markers or aborted transactions were there: move past them.
            self.next_offset = max(self.next_offset, result.end_offset)
            return 0
        # The whole read goes to the front end at once: one call, one timeout.
        # The cursor moves first: the front end hands every push to the
        # transport before it awaits, so a group's grant arriving during that
        # wait acknowledges only what the transport already has.
        pushes = None
        if self.deliver_read is None:
            pushes = plan_pushes(result, self.credits)
        self.next_offset = max(self.next_offset, result.end_offset)
        self.credits -= result.count
        self.delivered_events += result.count
        try:
            async with asyncio.timeout(self.manager.backpressure_timeout):
                if pushes is None:
                    assert self.deliver_read is not None
                    await self.deliver_read(self, result)
                else:
                    assert self.deliver is not None
                    await self.deliver(self, pushes)
        except TimeoutError:
            self.manager.close(self, CloseReason.BACKPRESSURE_TIMEOUT)
            return None
        return result.value_bytes


def commit_key(tenant_id: int, stream_id: int, partition: int) -> tuple[int, ...]:
    """The key of a stream partition's commit waiters: ``(tenant, stream)`` for
    partition 0, as before partitions, ``(tenant, stream, partition)`` for the others."""
    return (tenant_id, stream_id) if partition == 0 else (tenant_id, stream_id, partition)


class Subscriptions:
    """Every live subscription of the server."""

    def __init__(self, engine: Engine, backpressure_timeout: float = 30.0) -> None:
        self.engine = engine
        self.backpressure_timeout = backpressure_timeout
        self.by_stream: dict[tuple[int, int], set[Subscription]] = {}
        # Per stream partition (commit_key), the subscriptions waiting for its next
        # commit (caught up, with credit): what an append wakes, so its cost is theirs
        # and not every subscription's of the stream (50k without credit made each
        # append 100x slower).
        self.awaiting_commit: dict[tuple[int, ...], set[Subscription]] = {}
        self.groups: dict[tuple[int, int], GroupOffsets] = {}
        self._next_id = 1
        self._listening: set[tuple[int, ...]] = set()
        # Awaited after each delivery, outside its backpressure timeout, with the tenant
        # and the bytes delivered: the engine API's consume quota holds the next read
        # back there. None (no quota anywhere): nothing is awaited.
        self.pace: Callable[[int, int], Awaitable[None]] | None = None

    def _groups_for(self, stream: Stream) -> GroupOffsets:
        key = (stream.tenant.tenant_id, stream.stream_id)
        groups = self.groups.get(key)
        if groups is None:
            groups = self.groups[key] = GroupOffsets(stream.directory, self.engine)
        return groups

    def groups_of(self, stream: Stream) -> GroupOffsets:
        """The consumer groups of ``stream`` (read from its groups.json on first use)."""
        return self._groups_for(stream)

    def _listen(self, stream: Stream, partition: int) -> None:
        stream_key = (stream.tenant.tenant_id, stream.stream_id)
        key = commit_key(*stream_key, partition)
        if key in self._listening:
            return
        first = not any(k[:2] == key[:2] for k in self._listening)
        self._listening.add(key)

        def committed(_offset: int) -> None:
            waiting = self.awaiting_commit.pop(key, None)
            if waiting:
                for sub in waiting:
                    sub.wake()

        def deleted() -> None:
            for sub in list(self.by_stream.get(stream_key, ())):
                self.close(sub, CloseReason.STREAM_DELETED)

        stream.committers[partition].add_listener(committed)
        if first:
            stream.delete_listeners.append(deleted)

    def await_commit(self, sub: Subscription) -> None:
        """Wake ``sub`` at its partition's next commit (once)."""
        key = commit_key(sub.stream.tenant.tenant_id, sub.stream.stream_id, sub.partition)
        self.awaiting_commit.setdefault(key, set()).add(sub)

    def subscribe(
        self,
        tenant_id: int,
        stream_id: int,
        from_offset: int,
        credits: int,
        group: str | None,
        deliver: Deliver | None,
        on_close: OnClose,
        *,
        deliver_read: DeliverRead | None = None,
        partition: int = 0,
        read_room: ReadRoom | None = None,
    ) -> Subscription:
        """Start a subscription to one partition (0 unless named); its start offset is
        ``next_offset`` on return. Exactly one of ``deliver`` (pushes of values) and
        ``deliver_read`` (whole reads) is given. A consumer group's offset is the
        stream's (partition 0's): a group subscription of another partition is refused."""
        if (deliver is None) == (deliver_read is None):
            raise UsageError("give exactly one of deliver and deliver_read")
        stream = self.engine.stream(tenant_id, stream_id)
        if not 0 <= credits <= MAX_CREDITS:
            raise InvalidRequest("credits must fit in u32")
        if group is not None and not group:
            raise InvalidRequest("a consumer group name must not be empty")
        plog = stream.partition_log(partition)
        self.engine.check_replica(stream, partition)
        if group is not None and partition != 0:
            raise InvalidRequest(
                "a consumer group subscription reads partition 0 (its offset is the "
                "stream's); subscribe to other partitions without a group"
            )
        groups = self._groups_for(stream) if group is not None else None
        if from_offset == RESUME:
            if groups is not None and group is not None:
                start = groups.offsets.get(group, 0)
            else:
                start = plog.readable_offset  # a cluster's high watermark, else the end
        elif from_offset > plog.committed_offset:
            raise InvalidOffset(
                f"offset {from_offset} is beyond the end of the stream ({plog.committed_offset})"
            )
        else:
            start = from_offset
        start = max(start, plog.start_offset)
        sub = Subscription(
            self,
            self._next_id,
            stream,
            start,
            credits,
            group,
            deliver,
            on_close,
            deliver_read,
            partition,
            read_room,
        )
        self._next_id += 1
        self._listen(stream, partition)
        self.by_stream.setdefault((tenant_id, stream_id), set()).add(sub)
        if groups is not None and group is not None:
            if group in groups.active:
                groups.waiting.setdefault(group, []).append(sub)
            else:
                groups.active[group] = sub
                sub.active = True
        sub.start()
        return sub

    def grant(self, sub: Subscription, credits: int) -> int:
        """Add credit; for a group, acknowledge everything delivered so far."""
        if sub.closed:
            raise InvalidRequest(f"subscription {sub.subscription_id} is closed")
        if credits < 0 or sub.credits + credits > MAX_CREDITS:
            raise InvalidRequest("credit balance must fit in u32")
        sub.credits += credits
        if sub.group is not None and sub.active:
            self._groups_for(sub.stream).commit(sub.group, sub.next_offset)
        sub.wake()
        return sub.credits

    def close(self, sub: Subscription, reason: CloseReason) -> None:
        """End a subscription: nothing more is delivered; the front end is told why."""
        if sub.closed:
            return
        sub.closed = True
        sub.wake()
        if sub._task is not None and sub._task is not asyncio.current_task():
            sub._task.cancel()
        key = (sub.stream.tenant.tenant_id, sub.stream.stream_id)
        subs = self.by_stream.get(key)
        if subs is not None:
            subs.discard(sub)
        waiting_key = commit_key(*key, sub.partition)
        waiting = self.awaiting_commit.get(waiting_key)
        if waiting is not None:
            waiting.discard(sub)
            if not waiting:
                del self.awaiting_commit[waiting_key]
        if sub.group is not None:
            self._hand_over(sub)
        try:
            sub.on_close(sub, reason)
        except Exception:
            log.exception("subscription close callback failed")

    def _hand_over(self, sub: Subscription) -> None:
        groups = self._groups_for(sub.stream)
        assert sub.group is not None
        waiting = groups.waiting.get(sub.group, [])
        if sub in waiting:
            waiting.remove(sub)
            return
        if groups.active.get(sub.group) is not sub:
            return
        del groups.active[sub.group]
        while waiting:
            successor = waiting.pop(0)
            if successor.closed:
                continue
            groups.active[sub.group] = successor
            successor.active = True
            # Resume from what the group acknowledged: unacknowledged events come again.
            successor.next_offset = max(
                groups.offsets.get(sub.group, successor.next_offset), sub.stream.log.start_offset
            )
            successor.wake()
            return

    async def close_all(self, reason: CloseReason = CloseReason.SERVER_SHUTDOWN) -> None:
        for subs in list(self.by_stream.values()):
            for sub in list(subs):
                self.close(sub, reason)
        for groups in self.groups.values():
            try:
                await groups.flush()
            except StorageError as exc:  # logged; the other streams' groups still go
                log.error("consumer group positions not written at close: %s", exc)
