"""One kind of one tenant: its committed entities, its changelog and its subscribers.

The committed state is what readers see (QUERY, scans, bootstrap, SQL): each entity as
``(version, source_set, record)``, moved on only once a window is durable. The changelog
is a compacted partition log: key = entity id, value = u64 source_set + record, a
tombstone for a deletion, and under :data:`SEQUENCE_KEY` an event kind's next sequence.
It is the source of truth; beside it, the kind's :class:`~.store.KindStore` (LMDB)
checkpoints the committed state, so a kind may hold more entities than memory.

In memory a kind keeps a bounded hot set (``hot``, at most ``[convergedb]
hot_entities``) and what the store does not know yet:

* ``dirty``: hot entities changed since the last checkpoint (never evicted);
* ``deleted``: entities deleted since the last checkpoint;
* ``writing``: the checkpoint being written (entity -> state, None for a deletion).

A read looks in ``hot``, then ``deleted`` and ``writing``, then the store (and keeps what
it found hot). While nothing was ever evicted (``complete``) the hot set is every entity
and a miss is an absence, with no store read: a kind that fits in memory pays nothing
for the store but its checkpoints. Eviction is CLOCK-like: the oldest inserted clean
entities go first; a dirty one (written since the last checkpoint, so recently used)
gets a second chance at the young end.

A checkpoint (:meth:`begin_checkpoint`, written in a worker thread, then
:meth:`end_checkpoint`) writes the dirty and deleted entities and the changelog offset
they reflect in one transaction; it is due ``CHECKPOINT_SECONDS`` after the previous
one (which bounds the changelog a restart replays), or sooner when the hot set is over
its capacity with dirty entities eviction may not drop, or many deletions wait. An
entity rewritten many times between checkpoints is written to the store once: a kind
that fits in memory pays little for its store (benchmarks/kinds_inproc_bench.py).

At open (:meth:`load`) the store is read as checkpointed and only the changelog after
its offset is replayed into it; a missing or damaged store is rebuilt from the whole
changelog (logged), in bounded memory.
"""

from __future__ import annotations

import heapq
import logging
import operator
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeAlias

from headwater.engine.kinds.codec import RecordCodec, codec_for
from headwater.engine.kinds.fields import (
    decode_fields,
    default_value,
    encode_fields,
)
from headwater.engine.kinds.model import EntityState, KindInfo
from headwater.engine.kinds.store import SOURCES, KindStore, StoreMeta
from headwater.engine.kinds.subscriptions import KindSubscription
from headwater.storage.group_commit import GroupCommitter
from headwater.storage.log import PartitionLog

log = logging.getLogger(__name__)

SEQUENCE_KEY = b"hw_event_sequence"  # changelog key of an event kind's next sequence
SOURCE_SET = struct.Struct("<Q")
"""The source set before the record in a changelog value (and an event kind's sequence)."""

Committed: TypeAlias = tuple[int, int, bytes]
"""A committed entity: ``(version, source_set, record)``, the record of every field."""

CHECKPOINT_SECONDS = 10.0  # the longest a change waits for the store (bounds replay)
REPLAY_BATCH = 65_536  # changelog entities replayed into the store per transaction
_ID: Callable[[tuple[bytes, Committed]], bytes] = operator.itemgetter(0)


@dataclass
class Checkpoint:
    """The entities a checkpoint writes and the meta it records (taken on the loop)."""

    puts: list[tuple[bytes, Committed]]
    deletes: list[bytes]
    meta: StoreMeta


class KindState:
    """One kind of one tenant: its committed entities, changelog and subscribers."""

    def __init__(
        self,
        info: KindInfo,
        plog: PartitionLog,
        committer: GroupCommitter,
        store: KindStore,
        hot_entities: int,
    ) -> None:
        self.info = info
        self.codec = codec_for(info.fields)
        self.log = plog
        self.committer = committer
        self.store = store
        self.capacity = max(1, hot_entities)
        self.hot: dict[bytes, Committed] = {}  # oldest inserted first
        self.dirty: set[bytes] = set()
        self.deleted: set[bytes] = set()
        self.writing: dict[bytes, Committed | None] = {}
        self.complete = True  # nothing evicted: ``hot`` is every committed entity
        self.checkpoint_running = False
        self.last_checkpoint = time.monotonic()
        self.count = 0  # live entities
        self.held_counts = [0] * SOURCES  # live entities with each source's bit
        self.next_sequence = 0
        self.subscribers: list[KindSubscription] = []
        self.applied_position = 0  # every change of this kind below it is committed
        self.applied_offset = 0  # the changelog offset after the last committed window
        # In a cluster (engine/kinds/replicated.py): a follower applies its copied
        # changelog below replica_limit() (the high watermark); ``following`` until a
        # new leader has applied all of its copy.
        self.replica_limit: Callable[[], int] | None = None
        self.following = False

    # ---- reads --------------------------------------------------------------------------

    def lookup(self, entity_id: bytes) -> Committed | None:
        """The committed ``(version, source_set, record)`` of an entity, None when absent."""
        found = self.hot.get(entity_id)
        if found is not None or self.complete:
            return found
        return self.cold(entity_id)

    def cold(self, entity_id: bytes) -> Committed | None:
        """:meth:`lookup` past the hot set: deleted, being written, or in the store (then
        kept hot: a read makes it recently used)."""
        if entity_id in self.deleted:
            return None
        if entity_id in self.writing:
            return self.writing[entity_id]
        if self.complete:
            return self.hot.get(entity_id)
        stored = self.store.get(entity_id)
        if stored is None:
            return None
        version, source_set, record = stored
        found = (version, source_set, self.whole_record(record))
        if len(self.hot) < self.capacity:  # else it waits for room: eviction is at commit
            self.hot[entity_id] = found
        return found

    def entity(self, entity_id: bytes) -> EntityState | None:
        """The committed state of an entity, None when absent."""
        committed = self.lookup(entity_id)
        if committed is None:
            return None
        return self.entity_state(entity_id, committed)

    def entity_state(self, entity_id: bytes, committed: Committed) -> EntityState:
        version, source_set, record = committed
        return EntityState(
            self.info.kind_id, entity_id, version, source_set, record, self.info.fields
        )

    def scan_entities(self, *, ordered: bool = False) -> Iterator[EntityState]:
        """Every committed entity, each as it is when reached (``ordered``: by id)."""
        for eid, committed in self.committed_items(ordered=ordered):
            yield self.entity_state(eid, committed)

    def committed_items(self, *, ordered: bool = False) -> Iterator[tuple[bytes, Committed]]:
        """Every committed ``(entity_id, (version, source_set, record))``, each as it is
        when reached; streamed from the store a chunk at a time (one short read
        transaction per chunk), so memory stays bounded by the hot set."""
        if self.complete:
            ids = sorted(self.hot) if ordered else list(self.hot)
            for eid in ids:
                committed = self.lookup(eid)
                if committed is not None:
                    yield eid, committed
            return
        # Entities the store may hold older or deleted: read from memory.
        newer = self.dirty.union(self.deleted, self.writing)
        in_memory = sorted(newer) if ordered else list(newer)

        def from_memory() -> Iterator[tuple[bytes, Committed]]:
            for eid in in_memory:
                committed = self.lookup(eid)
                if committed is not None:
                    yield eid, committed

        def from_store() -> Iterator[tuple[bytes, Committed]]:
            after: bytes | None = None
            while chunk := self.store.chunk(after):
                after = chunk[-1][0]
                for eid, (version, source_set, record) in chunk:
                    if eid in newer:
                        continue
                    committed = self.hot.get(eid)
                    if committed is None:
                        if eid in self.deleted:  # deleted since the scan began
                            continue
                        if eid in self.writing:
                            committed = self.writing[eid]
                            if committed is None:
                                continue
                        else:
                            committed = (version, source_set, self.whole_record(record))
                    yield eid, committed

        if ordered:
            yield from heapq.merge(from_memory(), from_store(), key=_ID)
        else:
            yield from from_memory()
            yield from from_store()

    def frozen_items(self) -> Callable[[], Iterator[tuple[bytes, Committed]]]:
        """The committed state as it is now (loop thread), to read later in another
        thread, in id order: what memory holds newer than the store is copied (at most
        the hot set), and the store is read in a read transaction opened now."""
        if self.complete:
            items = list(self.hot.items())

            def read_memory() -> Iterator[tuple[bytes, Committed]]:
                items.sort(key=_ID)
                yield from items

            return read_memory
        newer = self.dirty.union(self.deleted, self.writing)
        overlay = sorted(
            (eid, committed) for eid in newer if (committed := self.lookup(eid)) is not None
        )
        store, whole = self.store, self.whole_record
        txn = store.snapshot()

        def from_store() -> Iterator[tuple[bytes, Committed]]:
            after: bytes | None = None
            while chunk := store.chunk(after, txn=txn):
                after = chunk[-1][0]
                for eid, (version, source_set, record) in chunk:
                    if eid not in newer:
                        yield eid, (version, source_set, whole(record))

        def read() -> Iterator[tuple[bytes, Committed]]:
            try:
                yield from heapq.merge(overlay, from_store(), key=_ID)
            finally:
                txn.abort()

        return read

    def whole_record(self, record: bytes) -> bytes:
        """A record written under an older (shorter) schema, with the newer fields'
        defaults appended; a record of the current schema as it is."""
        return whole_record(self.codec, record)

    # ---- the hot set ----------------------------------------------------------------------

    def evict(self) -> None:
        """Bring the hot set an eighth below its capacity: the oldest clean entities
        go; dirty ones move to the young end (a checkpoint makes them evictable)."""
        hot, dirty = self.hot, self.dirty
        excess = len(hot) - (self.capacity - self.capacity // 8)
        if excess <= 0 or len(hot) <= len(dirty):
            return  # nothing to evict before a checkpoint
        victims: list[bytes] = []
        spared: list[bytes] = []
        for eid in hot:
            if eid in dirty:
                spared.append(eid)
            else:
                victims.append(eid)
                if len(victims) >= excess:
                    break
        for eid in victims:
            del hot[eid]
        for eid in spared:
            hot[eid] = hot.pop(eid)
        if victims:
            self.complete = False

    # ---- checkpoints ----------------------------------------------------------------------

    def checkpoint_due(self, now: float) -> bool:
        if self.checkpoint_running:
            return False
        if not self.dirty and not self.deleted:
            return False
        return (
            len(self.hot) > self.capacity  # dirty entities kept eviction from the capacity
            or len(self.deleted) > self.capacity // 2
            or now - self.last_checkpoint >= CHECKPOINT_SECONDS
        )

    def begin_checkpoint(self) -> Checkpoint:
        """Take what the store does not know yet (loop thread); write it with
        :meth:`write_checkpoint` (worker thread), then call :meth:`end_checkpoint`."""
        hot = self.hot
        puts = [(eid, hot[eid]) for eid in self.dirty]
        deletes = list(self.deleted)
        writing: dict[bytes, Committed | None] = dict(puts)
        writing.update(dict.fromkeys(deletes))
        self.writing = writing
        self.dirty = set()
        self.deleted = set()
        self.checkpoint_running = True
        meta = StoreMeta(
            self.applied_offset,
            self.applied_position,
            self.next_sequence,
            self.count,
            list(self.held_counts),
        )
        return Checkpoint(puts, deletes, meta)

    def write_checkpoint(self, checkpoint: Checkpoint) -> None:
        self.store.write(checkpoint.puts, checkpoint.deletes, checkpoint.meta)

    def end_checkpoint(self, written: bool) -> None:
        """The checkpoint is in the store (``written``), or failed: then what it held
        is waiting for the next one again."""
        if not written:
            for eid, committed in self.writing.items():
                if eid in self.dirty or eid in self.deleted:
                    continue  # changed again since: waiting for the next one already
                if committed is None:
                    self.deleted.add(eid)
                else:
                    self.hot.setdefault(eid, committed)
                    self.dirty.add(eid)
        self.writing = {}
        self.checkpoint_running = False
        self.last_checkpoint = time.monotonic()
        if len(self.hot) > self.capacity:
            self.evict()

    # ---- open -------------------------------------------------------------------------------

    def load(self) -> None:
        """Open the committed state (worker thread, at open): the store's checkpoint and
        the changelog after it, replayed into the store; the store rebuilt from the whole
        changelog when it has no usable checkpoint. Then the hot set is the whole kind
        when it fits in it."""
        plog = self.log
        meta = self.store.meta()
        if meta is not None and not plog.start_offset <= meta.offset <= plog.end_offset:
            log.warning(
                "entity store of kind %s (tenant %d) is at changelog offset %d, outside "
                "the changelog's %d..%d: rebuilding it from the changelog",
                self.info.name,
                self.info.tenant_id,
                meta.offset,
                plog.start_offset,
                plog.end_offset,
            )
            meta = None
        if meta is None:
            if plog.end_offset > plog.start_offset:
                log.info(
                    "building the entity store of kind %s (tenant %d) from its changelog",
                    self.info.name,
                    self.info.tenant_id,
                )
            self.store.clear()
            meta = StoreMeta(offset=plog.start_offset)
        meta = self._replay(meta)
        self.count = meta.count
        self.held_counts = list(meta.held)
        self.next_sequence = meta.next_sequence
        self.applied_position = meta.position
        self.applied_offset = meta.offset
        self.complete = meta.count <= self.capacity
        if self.complete:
            after: bytes | None = None
            while chunk := self.store.chunk(after):
                after = chunk[-1][0]
                for eid, (version, source_set, record) in chunk:
                    self.hot[eid] = (version, source_set, self.whole_record(record))

    def rebuild(self) -> None:
        """Open the committed state again from the store and the changelog (worker
        thread): a follower's changelog was cut below what it had applied. What memory
        held newer than the store is dropped; the store's checkpoint past the cut is
        rebuilt from the changelog by :meth:`load`."""
        self.hot = {}
        self.dirty = set()
        self.deleted = set()
        self.writing = {}
        meta = self.store.meta()
        if meta is not None and meta.offset > self.log.end_offset:
            self.store.clear()
        self.load()

    def _replay(self, meta: StoreMeta) -> StoreMeta:
        """Apply the changelog from ``meta.offset`` to the store, a transaction per
        :data:`REPLAY_BATCH` entities; the meta of the last one written."""
        unpack_set = SOURCE_SET.unpack_from
        store = self.store
        batch: dict[bytes, Committed | None] = {}
        held = meta.held

        def write() -> None:
            puts = [(eid, c) for eid, c in batch.items() if c is not None]
            deletes = [eid for eid, c in batch.items() if c is None]
            store.write(puts, deletes, meta)
            batch.clear()

        replayed = False
        for event in self.log.events(meta.offset):
            replayed = True
            meta.offset = event.offset + 1
            meta.position = event.position + 1
            key = event.key
            if key is None:
                continue
            if key == SEQUENCE_KEY:
                meta.next_sequence = unpack_set(event.value)[0]
                continue
            before = batch[key] if key in batch else store.get(key)
            if before is not None:
                meta.count -= 1
                _count_bits(held, before[1], -1)
            if event.tombstone:
                batch[key] = None
            else:
                value = event.value
                source_set = unpack_set(value)[0]
                batch[key] = (event.position, source_set, bytes(value[8:]))
                meta.count += 1
                _count_bits(held, source_set, 1)
            if len(batch) >= REPLAY_BATCH:
                write()
        if replayed or batch or store.meta() is None:
            meta.offset = max(meta.offset, self.log.start_offset)
            write()
        return meta

    def migrate(self, info: KindInfo) -> None:
        """Fields were appended: committed entities take the new fields' defaults (the
        hot ones now; the store's when read, by :meth:`whole_record`)."""
        added_fields = info.fields[len(self.info.fields) :]
        added = encode_fields(added_fields, [default_value(f.type) for f in added_fields])
        self.info = info
        self.codec = codec_for(info.fields)
        for entries in (self.hot, self.writing):
            for eid, committed in list(entries.items()):
                if committed is not None:
                    version, source_set, record = committed
                    entries[eid] = (version, source_set, record + added)

    def close(self) -> None:
        self.log.close()
        self.store.close()


def whole_record(codec: RecordCodec, record: bytes) -> bytes:
    """``record`` with every field of ``codec``'s schema: one written under an older
    (shorter) schema gets the newer fields' defaults appended (pure: a worker thread may
    call it)."""
    fixed = codec.fixed
    if fixed is not None and len(record) == fixed.size:
        return record
    fields = codec.fields
    values = decode_fields(fields, record)  # checked, field by field
    if len(values) == len(fields):
        return record  # whole already: its bytes as they are, not encoded again
    values += [default_value(f.type) for f in fields[len(values) :]]
    return encode_fields(fields, values)


def _count_bits(counts: list[int], source_set: int, delta: int) -> None:
    """Add ``delta`` to the count of each source whose bit is in ``source_set``."""
    while source_set:
        low = source_set & -source_set
        counts[low.bit_length() - 1] += delta
        source_set ^= low


def count_moves(counts: list[int], moves: dict[tuple[int, int], int]) -> None:
    """Per-source entity counts after entities moved from one source set to another
    (``(before, after) -> how many``; 0 for none)."""
    for (before, after), n in moves.items():
        if before != after:
            _count_bits(counts, before, -n)
            _count_bits(counts, after, n)
