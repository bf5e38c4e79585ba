"""A window made durable, then visible: the flush of one tenant's window.

Every entity whose net state changed over the window gets the next tenant log position
as its version and one record in its kind's changelog (key = entity id, value = u64
source_set + record, a tombstone for a deletion), one append per kind, then one group
commit (fdatasync) per changelog for the whole window. Once durable, the committed state
moves on and the kind's subscribers get the window's net changes (and EVENTs for
event-stream kinds, :mod:`.notify`).

The net changes of a window are found in one of two ways: :func:`_columnar_changes` for
the common window of whole fixed-width records (numpy over the joined records), else
:func:`_net_changes`, a pass per entity.
"""

from __future__ import annotations

import asyncio
import functools
import operator
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import TYPE_CHECKING, cast

import numpy as np

from headwater.engine.kinds.fields import FieldSpec, default_value, encode_present_fields
from headwater.engine.kinds.model import (
    OP_ASSERT,
    OP_PATCH,
    ChangeColumns,
    ChangeType,
    EventNote,
    StateColumns,
    changelog_stream,
)
from headwater.engine.kinds.notify import changed_fields, publish
from headwater.engine.kinds.state import (
    SEQUENCE_KEY,
    SOURCE_SET,
    Committed,
    KindState,
    count_moves,
)
from headwater.engine.kinds.windows import Entry, EventDraft, Window, Work
from headwater.errors import HeadwaterError

if TYPE_CHECKING:
    from headwater.engine.engine import Engine, Tenant


@dataclass(slots=True)
class FlushPlan(ChangeColumns):
    """What a window writes for one kind, and what readers and subscribers get once it
    is durable (the net changes as columns: see :class:`StateColumns`)."""

    state: KindState
    fields: tuple[FieldSpec, ...]  # the schema the records were made for
    first: int  # the version (tenant log position) of the first change
    log_values: list[bytes]
    deleted: list[int]  # indexes of DELETED changes
    next_sequence: int
    notes: list[EventNote] = field(default_factory=list)
    applied: int = 0
    applied_offset: int = 0  # the changelog offset after the window's records
    added: int = 0  # live entities created less deleted
    # Source sets left for others: (before, after) -> how many (per-source counts).
    moves: dict[tuple[int, int], int] = field(default_factory=dict)
    values_section: bytes | None = None  # log_values already encoded (columnar plans)
    changed_fields: list[int] | None = None  # known already (columnar plans)


class WindowWriter:
    """Writes a tenant's windows to its kinds' changelogs and commits them."""

    def __init__(self, tenant: Tenant, kinds: dict[int, KindState], engine: Engine) -> None:
        self.tenant = tenant
        self.kinds = kinds
        self.engine = engine

    async def write(self, window: Window) -> int:
        """Make ``window`` durable (every kind's changes appended, then synced), then
        visible: committed state and subscribers. Returns how many changes it held."""
        tenant = self.tenant
        plans: list[FlushPlan] = []
        commits: list[Awaitable[None]] = []
        outcomes: list[BaseException | None] = []
        claimed: list[int] = []
        refused: Exception | None = None
        try:
            try:
                self._append_all(window, plans, commits, claimed)
            except Exception as exc:
                # A changelog refused its kind's records (closed, cut, a failed write or
                # roll: an OSError too) after others took theirs: handled like any partly
                # failed window's below, those others' state moving on with their logs
                # (their records are there whatever the later kind's error was).
                if not commits:
                    raise
                refused = exc
            if commits:
                outcomes = await asyncio.gather(*commits, return_exceptions=True)
        finally:
            for first in claimed:
                tenant.release_positions(first)
        failed: list[BaseException] = [outcome for outcome in outcomes if outcome is not None]
        if not all(isinstance(error, HeadwaterError) for error in failed):
            raise next(e for e in failed if not isinstance(e, HeadwaterError))
        if refused is not None:
            failed.append(refused)
        if failed:
            # One kind's changelog was cut (or its fsync failed, or it refused the
            # append) while the others' are durable: those move on with their logs
            # (the next window is planned against their state, and followers apply
            # their records), once the in-sync replicas hold them as any window's; the
            # writers are told it failed.
            durable = [
                plan for plan, outcome in zip(plans, outcomes, strict=True) if outcome is None
            ]
            await self._replicated(durable)
            for plan in durable:
                commit_plan(plan)
            raise failed[0]
        unconfirmed = await self._replicated(plans)
        for plan in plans:
            commit_plan(plan)
        if unconfirmed is not None:
            # Stored here, so the state moves on with the log (the next window is
            # planned against it); the writers are told it is not confirmed.
            raise unconfirmed
        return sum(len(plan.entity_ids) for plan in plans)

    def _append_all(
        self,
        window: Window,
        plans: list[FlushPlan],
        commits: list[Awaitable[None]],
        claimed: list[int],
    ) -> None:
        """Append each kind's changes in ``window`` to its changelog, adding its plan to
        ``plans``, the wait for its fsync to ``commits`` and its first claimed position
        to ``claimed`` as each is done: should a later kind fail, they tell what was
        appended."""
        tenant = self.tenant
        for kind_id in set(window.entities) | set(window.events):
            state = self.kinds[kind_id]
            entities = window.entities.get(kind_id, {})
            drafts = window.events.get(kind_id, [])
            # Positions are claimed below, once the count is known; nothing can claim
            # in between (no await), so the versions handed out here are the claim's.
            first = tenant.next_position
            plan = None if drafts else _columnar_changes(state, entities, first)
            if plan is None:
                plan = _net_changes(state, entities, first)
            count = len(plan.entity_ids) + (1 if drafts else 0)
            if count == 0:
                continue
            claimed.append(tenant.claim_positions(count))
            assert claimed[-1] == first
            keys: list[bytes | None] = list(plan.entity_ids)
            values_out = plan.log_values
            if drafts:
                plan.notes, plan.next_sequence = _event_notes(state, drafts)
                keys.append(SEQUENCE_KEY)
                values_out.append(SOURCE_SET.pack(plan.next_sequence))
            if plan.values_section is not None:
                info = state.log.append_encoded(
                    plan.values_section, count, first_position=first, keys=keys
                )
            else:
                tombstones = [not v for v in values_out] if plan.deleted else None
                info = state.log.append(
                    values_out, first_position=first, keys=keys, tombstones=tombstones
                )
            plan.applied = first + count
            plan.applied_offset = info.next_offset
            commits.append(state.committer.committed(info.next_offset))
            plans.append(plan)

    async def _replicated(self, plans: list[FlushPlan]) -> HeadwaterError | None:
        """In a cluster (acks=all): wait until the in-sync replicas hold every kind's
        changelog records of the window; the error when they did not confirm (stored
        here, unconfirmed), None once they did (and on a single node)."""
        engine = self.engine
        acks = engine.replica_acks
        if acks is None:
            return None
        waits = [
            acks.replicated(
                self.tenant.tenant_id,
                changelog_stream(plan.state.info.name),
                0,
                plan.applied_offset,
                engine.replica_acks_timeout_s,
            )
            for plan in plans
            if not plan.state.info.internal
        ]
        for outcome in await asyncio.gather(*waits, return_exceptions=True):
            if isinstance(outcome, HeadwaterError):
                return outcome
            if isinstance(outcome, BaseException):
                raise outcome
        return None


def commit_plan(plan: FlushPlan) -> None:
    """The window is durable: readers see its state, subscribers get its changes (a
    leader's window, or a follower's run of copied changelog records)."""
    state = plan.state
    ids, records, previous = plan.entity_ids, plan.records, plan.previous
    if state.info.fields != plan.fields:
        # The kind migrated while this window was being written: pad what it wrote.
        records[:] = [state.whole_record(r) if r else r for r in records]
        previous[:] = [None if p is None else state.whole_record(p) for p in previous]
    first = plan.first
    versions = range(first, first + len(ids))
    entries = zip(versions, plan.source_sets, records, strict=True)
    hot, dirty, deleted = state.hot, state.dirty, state.deleted
    if deleted:  # created again since a deletion the store does not know yet
        deleted.difference_update(ids)
    hot.update(zip(ids, entries, strict=True))
    dirty.update(ids)  # the store learns them at the next checkpoint
    for i in plan.deleted:
        eid = ids[i]
        hot.pop(eid, None)  # may have been evicted (it was read from the store)
        dirty.discard(eid)
        deleted.add(eid)
    state.count += plan.added
    if plan.moves:
        count_moves(state.held_counts, plan.moves)
    if len(hot) > state.capacity:
        state.evict()
    state.applied_position = plan.applied
    state.applied_offset = plan.applied_offset
    state.next_sequence = plan.next_sequence
    if state.subscribers:
        changes_of = functools.partial(changed_fields, state.codec)
        state_notes = StateColumns(
            ids,
            plan.changes,
            plan.source_sets,
            records,
            previous,
            plan.metadata,
            kind_id=state.info.kind_id,
            first_version=first,
            changed_of=changes_of,
            known_changed=plan.changed_fields if state.info.fields == plan.fields else None,
        )
        publish(state, state_notes, plan.notes)


def _columnar_changes(
    state: KindState, entities: dict[bytes, Entry], first: int
) -> FlushPlan | None:
    """:func:`_net_changes` for the common window, in columns: a fixed-width kind whose
    entries are all whole records (``(source_set, record)`` tuples, as BATCHes of ASSERTs
    leave them) of entities that are all new or all committed already. The comparison
    with the committed state, the changed fields and the changelog values are numpy over
    the joined records instead of a Python loop per entity. None when the window is not
    of that shape (the general pass then handles it)."""
    codec = state.codec
    fixed = codec.fixed
    n = len(entities)
    moves: dict[tuple[int, int], int]
    if fixed is None or n == 0:
        return None
    entries = cast(list[tuple[int, bytes]], list(entities.values()))
    if set(map(type, entries)) != {tuple}:  # a Work entry: the general pass
        return None
    eids = list(entities)
    befores = list(map(state.hot.get, eids))
    if not state.complete and None in befores:  # some may be in the store
        cold = state.cold
        befores = [cold(e) if b is None else b for e, b in zip(eids, befores, strict=True)]
    missing = befores.count(None)
    if missing not in (0, n):
        return None
    size = fixed.size
    set_list: list[int] = list(map(_FIRST, entries))
    records: list[bytes] = list(map(_SECOND, entries))
    new = b"".join(records)
    if len(new) != n * size:  # records never exceed the schema's size: all whole
        return None
    sets = np.fromiter(set_list, np.uint64, n)
    if missing == n:
        changes = [int(ChangeType.CREATED)] * n
        previous: list[bytes | None] = [None] * n
        changed = [(1 << len(codec.fields)) - 1] * n
        source_sets = set_list
        added = n
        moves = {(0, s): count for s, count in Counter(set_list).items()}
    else:
        committed = cast(list[Committed], befores)  # none missing
        old_records: list[bytes] = list(map(_RECORD_OF, committed))
        old = b"".join(old_records)
        if len(old) != n * size:  # a record from before a migration appended fields
            return None
        masks = codec.changed_masks(new, old)
        old_sets = np.fromiter(map(_SOURCE_SET_OF, committed), np.uint64, n)
        moved = sets != old_sets
        keep = (masks != 0) | moved
        added = 0
        moves = {}
        if moved.any():
            pairs = zip(old_sets[moved].tolist(), sets[moved].tolist(), strict=True)
            moves = dict(Counter(pairs))
        if keep.all():
            source_sets = set_list
        else:  # some end as they were committed: no version, no notification
            kept = keep.tolist()
            eids = list(compress(eids, kept))
            records = list(compress(records, kept))
            old_records = list(compress(old_records, kept))
            source_sets = list(compress(set_list, kept))
            masks, sets = masks[keep], sets[keep]
            new = b"".join(records)
        changes = [int(ChangeType.UPDATED)] * len(eids)
        previous = list(old_records)
        changed = masks.tolist()
    rows = np.empty(len(eids), dtype=changelog_rows(size))
    rows["length"] = SOURCE_SET.size + size
    rows["source_set"] = sets
    rows["record"] = np.frombuffer(new, dtype=f"V{size}")
    return FlushPlan(
        eids,
        changes,
        source_sets,
        records,
        previous,
        None,
        state=state,
        fields=state.info.fields,
        first=first,
        log_values=[],
        deleted=[],
        next_sequence=state.next_sequence,
        values_section=rows.tobytes(),
        changed_fields=changed,
        added=added,
        moves=moves,
    )


_FIRST: Callable[[tuple[int, bytes]], int] = operator.itemgetter(0)  # of window entries
_SECOND: Callable[[tuple[int, bytes]], bytes] = operator.itemgetter(1)
# Of a committed (version, source_set, record).
_RECORD_OF: Callable[[Committed], bytes] = operator.itemgetter(2)
_SOURCE_SET_OF: Callable[[Committed], int] = operator.itemgetter(1)


@functools.lru_cache(maxsize=64)
def changelog_rows(record_size: int) -> np.dtype[np.void]:
    """A changelog value of a fixed-width kind in its values section: ``u64 len | u64
    source_set | record`` (how a columnar window is written, and how a follower reads
    the copied window back: engine/kinds/replicated.py)."""
    return np.dtype([("length", "<u8"), ("source_set", "<u8"), ("record", f"V{record_size}")])


def _net_changes(state: KindState, entities: dict[bytes, Entry], first: int) -> FlushPlan:
    """One pass over a kind's window entries: the net change of each entity (none when
    it ends as it was committed), as columns, with its changelog value. Change i gets
    version ``first + i``."""
    info = state.info
    fields = info.fields
    nfields = len(fields)
    encode = state.codec.encode
    hot_get, complete, cold = state.hot.get, state.complete, state.cold
    added = 0
    moves: dict[tuple[int, int], int] = {}
    pack_set = SOURCE_SET.pack
    ids: list[bytes] = []
    changes: list[int] = []
    source_sets: list[int] = []
    records: list[bytes] = []
    previous: list[bytes | None] = []
    log_values: list[bytes] = []
    metadata: list[bytes] | None = None
    deleted: list[int] = []
    created, updated = int(ChangeType.CREATED), int(ChangeType.UPDATED)
    for eid, entry in entities.items():
        before = hot_get(eid)
        if before is None and not complete:
            before = cold(eid)
        meta = b""
        if type(entry) is tuple:
            source_set, record = entry
        else:
            assert isinstance(entry, Work)
            values = entry.values
            meta = entry.metadata
            if values is None:
                if before is None:
                    continue  # created and deleted within the window: no trace
                if metadata is None and meta:
                    metadata = [b""] * len(ids)
                deleted.append(len(ids))
                added -= 1
                moves[before[1], 0] = moves.get((before[1], 0), 0) + 1
                ids.append(eid)
                changes.append(int(ChangeType.DELETED))
                source_sets.append(0)
                records.append(b"")
                previous.append(None)
                log_values.append(b"")
                if metadata is not None:
                    metadata.append(meta)
                continue
            record_or_none = entry.record
            if len(values) < nfields:
                # written before a migration appended fields: they take defaults
                values.extend(default_value(f.type) for f in fields[len(values) :])
                record_or_none = None
            record = encode(values) if record_or_none is None else record_or_none
            source_set = entry.source_set
        if before is None:
            changes.append(created)
            previous.append(None)
            added += 1
            moves[0, source_set] = moves.get((0, source_set), 0) + 1
        elif before[1] == source_set and before[2] == record:
            continue  # as it was: no version, no notification
        else:
            changes.append(updated)
            previous.append(before[2])
            if before[1] != source_set:
                moves[before[1], source_set] = moves.get((before[1], source_set), 0) + 1
        if metadata is None and meta:
            metadata = [b""] * len(ids)
        ids.append(eid)
        source_sets.append(source_set)
        records.append(record)
        log_values.append(pack_set(source_set) + record)
        if metadata is not None:
            metadata.append(meta)
    return FlushPlan(
        ids,
        changes,
        source_sets,
        records,
        previous,
        metadata,
        state=state,
        fields=fields,
        first=first,
        log_values=log_values,
        deleted=deleted,
        next_sequence=state.next_sequence,
        added=added,
        moves=moves,
    )


def _event_notes(state: KindState, drafts: list[EventDraft]) -> tuple[list[EventNote], int]:
    """An event-stream kind's EVENTs for the window's ops; the next sequence after."""
    fields = state.info.fields
    codec = state.codec
    everything = (1 << len(fields)) - 1
    seq = state.next_sequence
    notes: list[EventNote] = []
    for d in drafts:
        if d.op == OP_ASSERT:
            assert isinstance(d.values, Sequence)
            full = list(d.values)
            full += [default_value(f.type) for f in fields[len(full) :]]
            mask, data = everything, codec.encode(full)
        elif d.op == OP_PATCH:
            assert isinstance(d.values, Mapping)
            mask, data = encode_present_fields(fields, d.values)
        else:
            mask, data = 0, b""
        notes.append(
            EventNote(
                state.info.kind_id, d.entity_id, d.op, d.source_id, seq, mask, data, d.metadata
            )
        )
        seq += 1
    return notes, seq
