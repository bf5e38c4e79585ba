"""One kind of one tenant: its committed entities, its changelog and its subscribers.

The committed state is what readers see (QUERY, scans, bootstrap, SQL): each entity as
``(version, source_set, record)``, moved on only once a window is durable. The changelog
is a compacted partition log: key = entity id, value = u64 source_set + record, a
tombstone for a deletion, and under :data:`SEQUENCE_KEY` an event kind's next sequence;
at open the committed state is rebuilt from it (the last record per entity wins).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import TypeAlias

from headwater.engine.kinds.codec import codec_for
from headwater.engine.kinds.fields import decode_fields, default_value, encode_fields
from headwater.engine.kinds.model import EntityState, KindInfo
from headwater.engine.kinds.subscriptions import KindSubscription
from headwater.storage.group_commit import GroupCommitter
from headwater.storage.log import PartitionLog

SEQUENCE_KEY = b"hw_event_sequence"  # changelog key of an event kind's next sequence
SOURCE_SET = struct.Struct("<Q")
"""The source set before the record in a changelog value (and an event kind's sequence)."""

Committed: TypeAlias = tuple[int, int, bytes]
"""A committed entity: ``(version, source_set, record)``, the record of every field."""


class KindState:
    """One kind of one tenant: its committed entities, changelog and subscribers."""

    def __init__(self, info: KindInfo, plog: PartitionLog, committer: GroupCommitter) -> None:
        self.info = info
        self.codec = codec_for(info.fields)
        self.committed: dict[bytes, Committed] = {}
        self.log = plog
        self.committer = committer
        self.next_sequence = 0
        self.subscribers: list[KindSubscription] = []
        self.applied_position = 0  # every change of this kind below it is committed

    def entity(self, entity_id: bytes) -> EntityState | None:
        """The committed state of an entity, None when absent."""
        committed = self.committed.get(entity_id)
        if committed is None:
            return None
        return self.entity_state(entity_id, committed)

    def entity_state(self, entity_id: bytes, committed: Committed) -> EntityState:
        version, source_set, record = committed
        return EntityState(
            self.info.kind_id, entity_id, version, source_set, record, self.info.fields
        )

    def scan_entities(self) -> Iterator[EntityState]:
        """Every committed entity, each as it is when reached."""
        committed = self.committed
        for eid in list(committed):
            current = committed.get(eid)
            if current is not None:
                yield self.entity_state(eid, current)

    def whole_record(self, record: bytes) -> bytes:
        """A record written under an older (shorter) schema, with the newer fields'
        defaults appended; a record of the current schema as it is."""
        fixed = self.codec.fixed
        if fixed is not None and len(record) == fixed.size:
            return record
        fields = self.info.fields
        return encode_fields(fields, decode_fields(fields, record, complete=True))

    def load(self) -> None:
        """Rebuild the committed state from the changelog (worker thread, at open)."""
        committed = self.committed
        unpack_set = SOURCE_SET.unpack_from
        whole = self.whole_record
        for event in self.log.events(self.log.start_offset):
            self.applied_position = event.position + 1
            key = event.key
            if key is None:
                continue
            if key == SEQUENCE_KEY:
                self.next_sequence = unpack_set(event.value)[0]
                continue
            if event.tombstone:
                committed.pop(key, None)
                continue
            value = event.value
            committed[key] = (event.position, unpack_set(value)[0], whole(bytes(value[8:])))

    def migrate(self, info: KindInfo) -> None:
        """Fields were appended: committed entities take the new fields' defaults."""
        added_fields = info.fields[len(self.info.fields) :]
        added = encode_fields(added_fields, [default_value(f.type) for f in added_fields])
        self.info = info
        self.codec = codec_for(info.fields)
        committed = self.committed
        for eid, (version, source_set, record) in list(committed.items()):
            committed[eid] = (version, source_set, record + added)
