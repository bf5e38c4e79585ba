"""The working state of one tenant: write ops applied to coalescing windows.

Writes apply to the *working* state: the open window over the window being flushed over
the committed state. Rules: ASSERT sets the source's bit and replaces the fields; PATCH
sets the bit and updates the present fields (creating the entity with defaults); RETRACT
clears the bit; no bit left = deleted. The open window is flushed ``coalesce_ms`` (20 ms)
after its first write, one flush at a time (:mod:`.commit` writes it); the writes in it
are durable, and their ACKs due, when its ``done`` future is.

Everything here runs on the asyncio loop thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from headwater.engine.kinds.fields import FieldValue, default_value
from headwater.engine.kinds.model import (
    OP_ASSERT,
    OP_PATCH,
    OP_RETRACT,
    AssertOp,
    AssertRecords,
    PatchOp,
    RetractOp,
    WriteOp,
)
from headwater.engine.kinds.state import KindState
from headwater.errors import HeadwaterError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Work:
    """An entity as the open window leaves it (values None: absent)."""

    source_set: int
    values: list[FieldValue] | None
    metadata: bytes = b""
    record: bytes | None = None  # ``values`` encoded, when an ASSERT brought it


Asserted: TypeAlias = tuple[int, bytes]
"""A window entry left by an ASSERT of a whole record with no metadata, the bulk of all
writes: ``(source_set, record)``, no object. Any other op on the entity in the same
window turns it into a :class:`Work`."""

Entry: TypeAlias = "Work | Asserted"


@dataclass(slots=True)
class EventDraft:
    """An op on an event-stream kind, made an EVENT when its window is written."""

    entity_id: bytes
    op: int
    source_id: int
    values: Sequence[FieldValue] | Mapping[int, FieldValue] | None
    metadata: bytes


class Window:
    """One coalescing window of one tenant; ``await window.durable()`` waits for it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.entities: dict[int, dict[bytes, Entry]] = {}
        self.events: dict[int, list[EventDraft]] = {}
        self.done: asyncio.Future[None] = loop.create_future()
        self.scheduled = False
        self.ops = 0

    @property
    def empty(self) -> bool:
        return self.ops == 0

    async def durable(self) -> None:
        """Return once everything in this window is durable and visible to readers."""
        await asyncio.shield(self.done)

    def failure(self) -> BaseException | None:
        """Once :attr:`done`: why the window could not be made durable (a
        CancelledError when its flush was cancelled); None when it is durable."""
        if self.done.cancelled():
            return asyncio.CancelledError()
        return self.done.exception()


class Windows:
    """The open window and the one being flushed, and the ops applied to them.

    ``write`` makes a window durable and visible.
    """

    def __init__(
        self,
        tenant_id: int,
        kinds: dict[int, KindState],
        write: Callable[[Window], Awaitable[None]],
        coalesce_ms: int,
    ) -> None:
        self.tenant_id = tenant_id
        self.kinds = kinds
        self._write = write
        self._coalesce_s = coalesce_ms / 1000
        self._loop = asyncio.get_running_loop()
        self.pending = Window(self._loop)
        self.flushing: Window | None = None
        self._flush_task: asyncio.Task[None] | None = None
        self._flush_due = False
        self.closed = False

    # ---- writes -----------------------------------------------------------------------

    def window_for_ack(self) -> Window:
        """The window whose durability makes the writes applied so far durable: the open
        one when it holds anything; else the one being flushed; else (writes that changed
        nothing on a quiet tenant) one already done, so their ACK is not held forever."""
        if not self.pending.empty:
            return self.pending
        if self.flushing is not None:
            return self.flushing
        done = Window(self._loop)
        done.done.set_result(None)
        return done

    def apply(
        self, sid: int, ops: Sequence[WriteOp], epoch: dict[int, set[bytes]] | None = None
    ) -> None:
        """Apply ``ops`` (checked already, grouped by kind) as source ``sid``; entities
        they assert or patch join ``epoch`` (kind -> the entities the source wrote since
        its open epoch began, if it has one)."""
        if not ops:
            return
        bit = 1 << sid
        window = self.pending
        flushing = self.flushing
        last_kind = -1
        entities: dict[bytes, Entry] = {}
        touched: set[bytes] | None = None
        state: KindState | None = None
        for op in ops:
            kind_id = op.kind_id
            if kind_id != last_kind:
                state = self.kinds[kind_id]
                entities = window.entities.setdefault(kind_id, {})
                touched = None if epoch is None else epoch.setdefault(kind_id, set())
                last_kind = kind_id
            assert state is not None
            if type(op) is AssertRecords:
                self._apply_records(state, op.pairs, bit, entities, flushing, touched)
                window.ops += len(op.pairs)
                continue
            assert not isinstance(op, AssertRecords)
            eid = op.entity_id
            entry = entities.get(eid)
            if type(op) is AssertOp and op.record is not None and not op.metadata:
                # A whole record and no metadata: the entry is a plain tuple.
                if entry is None:
                    source_set = self._source_set(state, flushing, eid)
                elif type(entry) is tuple:
                    source_set = entry[0]
                else:
                    assert isinstance(entry, Work)
                    source_set = entry.source_set
                entities[eid] = (source_set | bit, op.record)
                if touched is not None:
                    touched.add(eid)
                window.ops += 1
                if state.info.event_stream:
                    window.events.setdefault(kind_id, []).append(
                        EventDraft(eid, OP_ASSERT, sid, op.values, op.metadata)
                    )
                continue
            if entry is None:
                work = self._working(state, flushing, eid)
                if isinstance(op, RetractOp) and not work.source_set & bit:
                    # Retracting what this source does not hold changes nothing, but an
                    # event-stream kind still delivers the op.
                    if state.info.event_stream:
                        self._note_event(window, kind_id, eid, OP_RETRACT, sid, op.metadata)
                    continue
                entities[eid] = work
            elif type(entry) is tuple:
                work = entities[eid] = self._as_work(state, entry)
            else:
                assert isinstance(entry, Work)
                work = entry
            if isinstance(op, AssertOp):
                work.values = list(op.values)
                work.record = op.record
                work.source_set |= bit
                if touched is not None:
                    touched.add(eid)
            elif isinstance(op, PatchOp):
                if work.values is None:
                    work.values = [default_value(f.type) for f in state.info.fields]
                for i, value in op.values.items():
                    work.values[i] = value
                work.record = None
                work.source_set |= bit
                if touched is not None:
                    touched.add(eid)
            else:
                if not work.source_set & bit:
                    if state.info.event_stream:
                        self._note_event(window, kind_id, eid, OP_RETRACT, sid, op.metadata)
                    continue
                work.source_set &= ~bit
                if not work.source_set:
                    work.values = None
            work.metadata = op.metadata
            window.ops += 1
            if state.info.event_stream:
                window.events.setdefault(kind_id, []).append(
                    EventDraft(
                        eid,
                        OP_ASSERT
                        if isinstance(op, AssertOp)
                        else OP_PATCH
                        if isinstance(op, PatchOp)
                        else OP_RETRACT,
                        sid,
                        op.values if not isinstance(op, RetractOp) else None,
                        op.metadata,
                    )
                )
        if not window.scheduled and window.ops:
            window.scheduled = True
            self._loop.call_later(self._coalesce_s, self._window_due)

    @staticmethod
    def _apply_records(
        state: KindState,
        pairs: Sequence[tuple[bytes, bytes]],
        bit: int,
        entities: dict[bytes, Entry],
        flushing: Window | None,
        touched: set[bytes] | None,
    ) -> None:
        """ASSERTs of whole records with no metadata, the hot path: per entity, only the
        source set it had is looked up and a ``(source_set, record)`` tuple stored."""
        hot_get, complete, cold = state.hot.get, state.complete, state.cold
        earlier = None if flushing is None else flushing.entities.get(state.info.kind_id)
        current = entities.get
        for eid, record in pairs:
            entry = current(eid)
            if entry is None:
                prior = None if earlier is None else earlier.get(eid)
                if prior is None:
                    before = hot_get(eid)
                    if before is None and not complete:
                        before = cold(eid)
                    source_set = 0 if before is None else before[1]
                elif type(prior) is tuple:
                    source_set = prior[0]
                else:
                    assert isinstance(prior, Work)
                    source_set = prior.source_set
            elif type(entry) is tuple:
                source_set = entry[0]
            else:
                assert isinstance(entry, Work)
                source_set = entry.source_set
            entities[eid] = (source_set | bit, record)
        if touched is not None:
            touched.update([eid for eid, _ in pairs])

    @staticmethod
    def _note_event(
        window: Window, kind_id: int, eid: bytes, op: int, sid: int, metadata: bytes
    ) -> None:
        """An op of an event-stream kind that changes no state: only its EVENT."""
        window.events.setdefault(kind_id, []).append(EventDraft(eid, op, sid, None, metadata))
        window.ops += 1

    @staticmethod
    def _as_work(state: KindState, entry: Asserted) -> Work:
        source_set, record = entry
        return Work(source_set, list(state.codec.decode_assert(record)), record=record)

    @staticmethod
    def _source_set(state: KindState, flushing: Window | None, eid: bytes) -> int:
        """The entity's source set as the window being flushed, else the committed state,
        leaves it."""
        if flushing is not None:
            prior = flushing.entities.get(state.info.kind_id, {}).get(eid)
            if prior is not None:
                return prior[0] if type(prior) is tuple else prior.source_set  # type: ignore[union-attr]
        committed = state.lookup(eid)
        return 0 if committed is None else committed[1]

    @classmethod
    def _working(cls, state: KindState, flushing: Window | None, eid: bytes) -> Work:
        if flushing is not None:
            prior = flushing.entities.get(state.info.kind_id, {}).get(eid)
            if type(prior) is tuple:
                return cls._as_work(state, prior)
            if prior is not None:
                assert isinstance(prior, Work)
                values = None if prior.values is None else list(prior.values)
                return Work(prior.source_set, values, record=prior.record)
        committed = state.lookup(eid)
        if committed is None:
            return Work(0, None)
        return cls._as_work(state, (committed[1], committed[2]))

    def migrated(self, state: KindState) -> None:
        """The kind appended fields: records asserted into the open window were whole for
        the old schema, and now take the new fields' defaults."""
        entries = self.pending.entities.get(state.info.kind_id, {})
        for eid, entry in entries.items():
            if type(entry) is tuple:
                entries[eid] = (entry[0], state.whole_record(entry[1]))

    async def barrier(self) -> None:
        """Return once every write applied before the call is durable and visible."""
        if not self.pending.empty:
            await self.pending.durable()
        elif self.flushing is not None:
            await self.flushing.durable()

    # ---- flushing -----------------------------------------------------------------------

    def _window_due(self) -> None:
        if self.closed:
            return
        self._flush_due = True
        if self._flush_task is None:
            self._flush_task = self._loop.create_task(self._flush_loop())

    async def _flush_loop(self) -> None:
        try:
            while self._flush_due:
                self._flush_due = False
                await self.flush()
        finally:
            self._flush_task = None

    async def flush(self) -> None:
        """Make the open window durable and visible now (one flush at a time)."""
        while self.flushing is not None:
            await asyncio.shield(self.flushing.done)
        window = self.pending
        if window.empty:
            return
        self.pending = Window(self._loop)
        self.flushing = window
        try:
            await self._write(window)
        except BaseException as exc:
            if isinstance(exc, HeadwaterError):  # e.g. a cluster's replicas did not confirm
                log.warning("a window of tenant %d failed: %s", self.tenant_id, exc)
            else:
                log.exception("flushing a window of tenant %d failed", self.tenant_id)
            if not window.done.done():
                window.done.set_exception(
                    exc if isinstance(exc, Exception) else RuntimeError("flush cancelled")
                )
                window.done.exception()  # retrieved: waiters may be gone
            if isinstance(exc, HeadwaterError):
                return  # its writers are told; the next window goes on
            raise
        finally:
            self.flushing = None
        window.done.set_result(None)

    async def close(self) -> None:
        """Flush what is open and schedule nothing more."""
        self.closed = True
        if self._flush_task is not None:
            await self._flush_task
        await self.flush()
