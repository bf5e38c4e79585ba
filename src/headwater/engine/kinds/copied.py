"""A follower's apply of copied changelog records, a window at a time, in columns.

A leader writes each window of a kind as one changelog batch (:mod:`.commit`): the
window's entities (distinct, at consecutive tenant log positions), then, for an event
kind, its next sequence under :data:`~.state.SEQUENCE_KEY`. A follower applies what it
copied the same way, in two steps:

* :func:`copied_runs` (a worker thread) decodes the batches into :class:`CopiedRun`
  columns: keys and tombstone flags from the keys section, source sets and records
  from the values section (a fixed-width kind's window read back with the layout it was
  written with, :func:`~.commit.changelog_rows`), records of an older schema padded.
  Consecutive windows with consecutive versions and distinct entities make one run, so
  a run of many small windows is committed once.
* :func:`copied_plan` (the loop: it reads the committed state) compares a run with the
  committed state, in numpy over the run, and gives the :class:`~.commit.FlushPlan` the
  leader's window had (net changes as columns, counts, source-set moves), which
  :func:`~.commit.commit_plan` makes visible before the next run is planned.

Nothing here is a loop per record but the decoding of a batch a leader never writes
(keys of other sizes, gaps in its offsets, an entity twice): those are taken one record
at a time, as :func:`headwater.storage.batch.Batch.events` gives them.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import compress, islice, repeat
from typing import cast

import numpy as np

from headwater.engine.kinds.codec import codec_for
from headwater.engine.kinds.commit import FlushPlan, changelog_rows
from headwater.engine.kinds.fields import FieldSpec
from headwater.engine.kinds.model import ChangeType
from headwater.engine.kinds.state import (
    SEQUENCE_KEY,
    SOURCE_SET,
    Committed,
    KindState,
    whole_record,
)
from headwater.storage.batch import KEY_PRESENT, KEY_TOMBSTONE, Batch, value_spans

SMALL_WINDOW = 32  # records: a batch of fewer is decoded record by record
_U8 = np.dtype(np.uint8)
# The last key of an event kind's window: its next sequence.
_SEQUENCE_ENTRY = struct.pack("<BI", KEY_PRESENT, len(SEQUENCE_KEY)) + SEQUENCE_KEY
_SET_BYTES = np.arange(SOURCE_SET.size)
_unpack_set = SOURCE_SET.unpack_from
_RECORD_OF: Callable[[Committed], bytes] = operator.itemgetter(2)
_SOURCE_SET_OF: Callable[[Committed], int] = operator.itemgetter(1)


@dataclass(slots=True)
class CopiedRun:
    """Copied changelog records applied as one window: entity ``i`` has version
    ``first + i``; a deletion has tombstone set, source set 0 and record ``b""``."""

    fields: tuple[FieldSpec, ...]  # the schema the records were made whole for
    first: int
    entity_ids: list[bytes] = field(default_factory=list)
    tombstones: list[np.ndarray] = field(default_factory=list)  # bool, a piece each
    source_sets: list[np.ndarray] = field(default_factory=list)  # uint64, a piece each
    records: list[bytes] = field(default_factory=list)
    next_sequence: int | None = None  # an event kind's, when a window of the run set it
    applied: int = 0  # the version after the run's last record
    applied_offset: int = 0  # the changelog offset after it

    def takes(self, first: int, ids: list[bytes], seen: set[bytes]) -> bool:
        """Whether a window of ``ids`` from version ``first`` continues this run."""
        return self.first + len(self.entity_ids) == first and seen.isdisjoint(ids)


@dataclass(slots=True)
class _Piece:
    """The records of one batch (or of one record, off the common shape), decoded."""

    first: int
    entity_ids: list[bytes]
    tombstones: np.ndarray
    source_sets: np.ndarray
    records: list[bytes]
    applied: int
    applied_offset: int
    next_sequence: int | None = None


def copied_runs(
    batches: Iterable[Batch], start: int, upto: int, fields: tuple[FieldSpec, ...]
) -> list[CopiedRun]:
    """The changelog records of ``batches`` in ``[start, upto)`` as runs to apply in
    order (a worker thread: only the stored bytes and ``fields`` are read)."""
    runs: list[CopiedRun] = []
    run: CopiedRun | None = None
    seen: set[bytes] = set()
    for batch in batches:
        lo, hi = batch.index_of(start), batch.index_of(upto)
        if lo >= hi:
            continue
        for piece in _pieces(batch, lo, hi, fields):
            ids = piece.entity_ids
            if ids and (run is None or not run.takes(piece.first, ids, seen)):
                run = CopiedRun(fields, piece.first)
                runs.append(run)
                seen = set()
            if run is None:  # a sequence before any entity: a run of none
                run = CopiedRun(fields, piece.first)
                runs.append(run)
            seen.update(ids)
            run.entity_ids += ids
            run.tombstones.append(piece.tombstones)
            run.source_sets.append(piece.source_sets)
            run.records += piece.records
            run.applied, run.applied_offset = piece.applied, piece.applied_offset
            if piece.next_sequence is not None:
                run.next_sequence = piece.next_sequence
    return runs


def _pieces(batch: Batch, lo: int, hi: int, fields: tuple[FieldSpec, ...]) -> list[_Piece]:
    """Records ``lo..hi-1`` of a batch: one piece when the batch is a leader's window
    (dense, every key present and of one size, distinct, a sequence only last), else
    a piece per record."""
    keys_section = batch.keys_section()
    count = batch.count
    if count < SMALL_WINDOW:
        return _small_window(batch, lo, hi, fields)
    keyed = None if keys_section is None or not batch.dense else _window_keys(keys_section, count)
    if keyed is None:
        return _one_by_one(batch, lo, hi, fields)
    ids, flags, sequenced = keyed
    entities = count - 1 if sequenced else count  # the records before the sequence
    stop = min(hi, entities)
    ids = ids[lo:stop] if lo or stop < entities else ids
    if len(set(ids)) != len(ids):
        return _one_by_one(batch, lo, hi, fields)
    tombstones = (flags[lo:stop] & KEY_TOMBSTONE) != 0
    section = batch.values_section()
    sets, records = _window_values(section, count, lo, stop, tombstones, fields)
    first = batch.first_position + lo
    piece = _Piece(
        first, ids, tombstones, sets, records, first + len(ids), batch.base_offset + stop
    )
    if sequenced and hi == count:  # the window's sequence is in the range
        end = len(section)
        if end < SOURCE_SET.size * 2 or _unpack_set(section, end - 16)[0] != SOURCE_SET.size:
            return _one_by_one(batch, lo, hi, fields)
        piece.next_sequence = _unpack_set(section, end - 8)[0]
        piece.applied += 1
        piece.applied_offset += 1
    return [piece]


def _small_window(batch: Batch, lo: int, hi: int, fields: tuple[FieldSpec, ...]) -> list[_Piece]:
    """:func:`_pieces` of a batch of a few records: decoded record by record (numpy's
    cost per call is more than a Python step per record there), still as one piece."""
    events = list(islice(batch.events(lo), hi - lo))
    sequence: int | None = None
    if events and events[-1].key == SEQUENCE_KEY and events[-1].offset == batch.last_offset:
        sequence = _unpack_set(events.pop().value)[0]
    ids = [event.key for event in events]
    if not batch.dense or None in ids or SEQUENCE_KEY in ids or len(set(ids)) != len(ids):
        return _one_by_one(batch, lo, hi, fields)
    codec = codec_for(fields)
    tombstones = [event.tombstone for event in events]
    sets = [0 if event.tombstone else _unpack_set(event.value)[0] for event in events]
    records = [
        b"" if event.tombstone else whole_record(codec, event.value[SOURCE_SET.size :])
        for event in events
    ]
    first = batch.first_position + lo
    piece = _Piece(
        first,
        cast(list[bytes], ids),
        np.array(tombstones, bool),
        np.array(sets, np.uint64),
        records,
        first + len(ids),
        batch.base_offset + lo + len(ids),
        sequence,
    )
    if sequence is not None:
        piece.applied += 1
        piece.applied_offset += 1
    return [piece]


def _window_keys(section: memoryview, count: int) -> tuple[list[bytes], np.ndarray, bool] | None:
    """A leader's window keys (``u8 flags | u32 len | id`` each): every id present and
    of one size, then maybe :data:`SEQUENCE_KEY` last. ``(ids, flags, sequenced)``;
    None for any other keys section."""
    size = len(section)
    tail = len(_SEQUENCE_ENTRY)
    sequenced = size >= tail and section[size - tail :] == _SEQUENCE_ENTRY
    entities = count - 1 if sequenced else count
    if entities == 0:  # an event kind's window of events only
        return [], np.zeros(0, _U8), True
    width = 5 + int.from_bytes(section[1:5], "little")
    if width == tail or size != entities * width + (tail if sequenced else 0):
        return None
    rows = np.frombuffer(section, _U8, entities * width).reshape(entities, width)
    flags = rows[:, 0]
    heads = rows[:, 1:5]
    if not ((flags & KEY_PRESENT) != 0).all() or not (heads == heads[0]).all():
        return None
    if width == 5:  # empty ids: numpy has no zero-width void
        return [b""] * entities, flags, sequenced
    ids: list[bytes] = np.ascontiguousarray(rows[:, 5:]).view(f"V{width - 5}").ravel().tolist()
    return ids, flags, sequenced


def _window_values(
    section: memoryview,
    count: int,
    lo: int,
    stop: int,
    tombstones: np.ndarray,
    fields: tuple[FieldSpec, ...],
) -> tuple[np.ndarray, list[bytes]]:
    """Source sets and whole records of entity records ``lo..stop-1`` (0 and ``b""``
    for a deletion)."""
    n = stop - lo
    fixed = codec_for(fields).fixed
    if fixed is not None and not tombstones.any():
        # The columnar window as written (commit.py): every value 8 + size bytes.
        layout = changelog_rows(fixed.size)
        if len(section) >= stop * layout.itemsize:
            # Read from the batch's first value: each row is where it is only if every
            # value before it is of that size too (a deletion before ``lo`` is not).
            rows = np.frombuffer(section, layout, stop)
            if (rows["length"] == SOURCE_SET.size + fixed.size).all():
                sets = rows["source_set"][lo:].astype(np.uint64)
                records: list[bytes] = rows["record"][lo:].tolist()
                return sets, records
    # Deletions among them, or records of other sizes: each value's bounds first.
    bounds = np.asarray(value_spans(section, count)[lo : stop + 1], np.int64)
    live = ~tombstones
    starts = bounds[:-1][live] + 8  # each live value's source set
    ends = bounds[1:][live]
    sets = np.zeros(n, np.uint64)
    if len(starts):
        sets[live] = np.frombuffer(section, _U8)[starts[:, None] + _SET_BYTES].view("<u8").ravel()
    firsts = starts + SOURCE_SET.size  # each live record's first byte
    live_records: list[bytes]
    if fixed is not None and (ends - firsts == fixed.size).all():
        # Whole records of a fixed-width kind (deletions between them): gathered at once.
        data = np.frombuffer(section, _U8)
        gathered = data[firsts[:, None] + np.arange(fixed.size)]
        live_records = gathered.view(f"V{fixed.size}").ravel().tolist()
    else:
        view, codec = memoryview(section), codec_for(fields)
        live_records = [
            whole_record(codec, bytes(view[a:b]))
            for a, b in zip(firsts.tolist(), ends.tolist(), strict=True)
        ]
    if len(live_records) == n:
        return sets, live_records
    column = np.full(n, b"", dtype=object)
    column[live] = live_records
    return sets, column.tolist()


def _one_by_one(batch: Batch, lo: int, hi: int, fields: tuple[FieldSpec, ...]) -> list[_Piece]:
    """A batch of another shape than a leader's window: a piece per record (a record
    without a key is skipped, as the leader never writes one)."""
    pieces: list[_Piece] = []
    codec = codec_for(fields)
    for event in islice(batch.events(lo), hi - lo):
        eid = event.key
        if eid is None:
            continue
        after, after_offset = event.position + 1, event.offset + 1
        if eid == SEQUENCE_KEY:
            sequence = _unpack_set(event.value)[0]
            empty = np.zeros(0, np.uint64)
            pieces.append(
                _Piece(
                    event.position, [], np.zeros(0, bool), empty, [], after, after_offset, sequence
                )
            )
            continue
        tombstone = event.tombstone
        source_set = 0 if tombstone else _unpack_set(event.value)[0]
        record = b"" if tombstone else whole_record(codec, event.value[SOURCE_SET.size :])
        pieces.append(
            _Piece(
                event.position,
                [eid],
                np.array([tombstone]),
                np.array([source_set], np.uint64),
                [record],
                after,
                after_offset,
            )
        )
    return pieces


def copied_plan(state: KindState, run: CopiedRun) -> FlushPlan:
    """The leader's window again for a run (loop thread): each entity's change against
    the committed state as it is now (created, updated or deleted), the previous
    records, the live count and the source sets' moves, in columns."""
    ids = run.entity_ids
    n = len(ids)
    tombstones = np.concatenate(run.tombstones) if run.tombstones else np.zeros(0, bool)
    sets = np.concatenate(run.source_sets) if run.source_sets else np.zeros(0, np.uint64)
    befores = list(map(state.hot.get, ids))
    if not state.complete and None in befores:  # some may be in the store
        cold = state.cold
        befores = [cold(e) if b is None else b for e, b in zip(ids, befores, strict=True)]
    present = np.fromiter(map(operator.is_not, befores, repeat(None)), bool, n)
    committed = cast(list[Committed], list(compress(befores, present.tolist())))
    old_sets = np.zeros(n, np.uint64)
    old_sets[present] = np.fromiter(map(_SOURCE_SET_OF, committed), np.uint64, len(committed))
    created, updated, deleted = (
        int(ChangeType.CREATED),
        int(ChangeType.UPDATED),
        int(ChangeType.DELETED),
    )
    changes = np.where(tombstones, deleted, np.where(present, updated, created))
    previous_column = np.full(n, None, dtype=object)
    replaced = present & ~tombstones
    if replaced.any():
        previous_column[replaced] = list(compress(map(_RECORD_OF, committed), replaced[present]))
    # A deletion leaves its entity's sources (to no set); a write moves it to its set.
    # Counted by distinct (before, after) pair; an entity that keeps its set moves none.
    moved = (present | ~tombstones) & (old_sets != sets)
    moves: dict[tuple[int, int], int] = {}
    if moved.any():
        pairs = np.stack([old_sets[moved], sets[moved]], axis=1)
        distinct, counts = np.unique(pairs, axis=0, return_counts=True)
        moves = dict(zip(map(tuple, distinct.tolist()), counts.tolist(), strict=True))
    added = int(np.count_nonzero(~present & ~tombstones)) - int(
        np.count_nonzero(present & tombstones)
    )
    return FlushPlan(
        ids,
        changes.tolist(),
        sets.tolist(),
        run.records,
        previous_column.tolist(),
        None,
        state=state,
        fields=run.fields,
        first=run.first,
        log_values=[],
        deleted=np.flatnonzero(tombstones).tolist(),
        next_sequence=state.next_sequence if run.next_sequence is None else run.next_sequence,
        applied=run.applied,
        applied_offset=run.applied_offset,
        added=added,
        moves=moves,
    )
