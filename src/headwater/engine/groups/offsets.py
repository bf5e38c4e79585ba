"""Committed consumer-group offsets per (group, stream, partition), kept in the log.

:class:`OffsetStore` is the durable interface (load everything, commit some, delete some);
:class:`LogOffsetStore` implements it, as Kafka's ``__consumer_offsets`` and Rivven's
offset storage do, over one internal compacted stream per tenant (``hw_consumer_offsets``):
each commit is one keyed append (one record batch, so a commit of many partitions is
stored whole or, after a crash, not at all), the key names (group, stream, partition)
and the value holds the offset, the commit time and the client's metadata string; a
deleted group's offsets are tombstones. Compaction keeps the latest value per key, so
the stream stays as small as the set of live offsets. Loading replays the stream once.

:class:`CommittedOffsets` is the in-memory view a server answers OffsetFetch and lag
from; :class:`OffsetManager` ties the three together: the coordinator's generation
checks, then the durable write, then the view, so a commit is visible only once stored.

(The existing per-stream ``groups.json`` of push subscriptions, engine/subscriptions.py,
is the single-partition groups' resume position; it is not this store's.)
"""

from __future__ import annotations

import struct
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from headwater.engine.engine import MAX_APPEND_EVENTS, Engine, StreamSettings
from headwater.engine.groups.assignors import TopicPartition
from headwater.engine.groups.coordinator import NO_GENERATION, GroupCoordinator
from headwater.engine.groups.errors import InvalidGroupId, OffsetMetadataTooLarge
from headwater.errors import InvalidOffset, InvalidRequest, StreamNotFound

OFFSETS_STREAM = "hw_consumer_offsets"
MAX_METADATA_BYTES = 4096  # Kafka's offset.metadata.max.bytes
MAX_NAME_BYTES = 0xFFFF  # a group id's or stream name's length is a u16 in the key
_KEY_VERSION = 1
_U16 = struct.Struct(">H")
_PARTITION = struct.Struct(">I")
_VALUE = struct.Struct(">BqQ")  # version, offset, commit time (ms)
MAX_OFFSET = (1 << 63) - 1  # stored signed, as Kafka's


def committable(offset: int) -> bool:
    """Whether ``offset`` can be committed: 0 to 2**63 - 1 (Rivven's field is a u64;
    past it the stored form could not hold it)."""
    return 0 <= offset <= MAX_OFFSET


def metadata_fits(metadata: str) -> bool:
    """Whether an offset's ``metadata`` is within Kafka's offset.metadata.max.bytes."""
    return len(metadata.encode()) <= MAX_METADATA_BYTES


def check_metadata(metadata: str) -> None:
    if not metadata_fits(metadata):
        raise OffsetMetadataTooLarge(f"offset metadata is limited to {MAX_METADATA_BYTES} bytes")


# In a cluster: (tenant, stream name, end) returns once the in-sync replicas hold the
# stream's partition 0 below ``end`` (acks=all), so a commit acknowledged survives the
# coordinator's loss (docs/cluster.md, "Consumer groups across the cluster").
Replicated = Callable[[int, str, int], Awaitable[None]]


class OffsetKey(NamedTuple):
    group: str
    stream: str
    partition: int

    @property
    def topic_partition(self) -> TopicPartition:
        return TopicPartition(self.stream, self.partition)


class CommittedOffset(NamedTuple):
    """The next offset the group will consume (Kafka's committed offset), the client's
    metadata string and when it was committed."""

    offset: int
    metadata: str = ""
    commit_ms: int = 0


def encode_key(key: OffsetKey) -> bytes:
    group, stream = key.group.encode(), key.stream.encode()
    return b"".join(
        (
            bytes((_KEY_VERSION,)),
            _U16.pack(len(group)),
            group,
            _U16.pack(len(stream)),
            stream,
            _PARTITION.pack(key.partition),
        )
    )


def decode_key(data: bytes) -> OffsetKey:
    if not data or data[0] != _KEY_VERSION:
        raise ValueError("not an offset key of a known version")
    at = 1
    (size,) = _U16.unpack_from(data, at)
    group = data[at + 2 : at + 2 + size].decode()
    at += 2 + size
    (size,) = _U16.unpack_from(data, at)
    stream = data[at + 2 : at + 2 + size].decode()
    at += 2 + size
    (partition,) = _PARTITION.unpack_from(data, at)
    if at + _PARTITION.size != len(data):
        raise ValueError("an offset key with trailing bytes")
    return OffsetKey(group, stream, partition)


def encode_value(value: CommittedOffset) -> bytes:
    return _VALUE.pack(1, value.offset, value.commit_ms) + value.metadata.encode()


def decode_value(data: bytes) -> CommittedOffset:
    version, offset, commit_ms = _VALUE.unpack_from(data)
    if version != 1:
        raise ValueError(f"an offset value of unknown version {version}")
    return CommittedOffset(offset, data[_VALUE.size :].decode(), commit_ms)


class OffsetStore(Protocol):
    async def load(self) -> dict[OffsetKey, CommittedOffset]: ...

    async def commit(self, offsets: Mapping[OffsetKey, CommittedOffset]) -> None:
        """Store ``offsets`` durably (under the stream's sync policy) before returning."""
        ...

    async def delete(self, keys: Iterable[OffsetKey]) -> None: ...


@dataclass(eq=False, repr=False)
class LogOffsetStore:
    """One tenant's offsets in its internal compacted stream."""

    engine: Engine
    tenant_id: int
    stream_id: int
    replicated: Replicated | None = None

    @classmethod
    async def open(
        cls, engine: Engine, tenant_id: int, replicated: Replicated | None = None
    ) -> LogOffsetStore:
        """The tenant's store, its stream created on first use."""
        try:
            stream_id = engine.stream_by_name(tenant_id, OFFSETS_STREAM, internal=True).stream_id
        except StreamNotFound:
            settings = StreamSettings(cleanup_policy="compact")
            info = await engine.create_stream(tenant_id, OFFSETS_STREAM, settings, internal=True)
            stream_id = info.stream_id
        return cls(engine, tenant_id, stream_id, replicated)

    async def load(self) -> dict[OffsetKey, CommittedOffset]:
        log = self.engine.stream(self.tenant_id, self.stream_id, internal=True).log
        offsets: dict[OffsetKey, CommittedOffset] = {}
        at = log.start_offset
        while True:
            result = await self.engine.read(
                self.tenant_id, self.stream_id, at, 4 << 20, internal=True
            )
            if result.count == 0:
                return offsets
            for event in result.events():
                if event.key is None:
                    continue
                key = decode_key(event.key)
                if event.tombstone:
                    offsets.pop(key, None)
                else:
                    offsets[key] = decode_value(event.value)
            at = result.end_offset

    async def commit(self, offsets: Mapping[OffsetKey, CommittedOffset]) -> None:
        await self._write(
            [encode_key(k) for k in offsets], [encode_value(v) for v in offsets.values()]
        )

    async def delete(self, keys: Iterable[OffsetKey]) -> None:
        encoded = [encode_key(k) for k in keys]
        await self._write(encoded, [b""] * len(encoded), tombstones=True)

    async def _write(
        self, keys: list[bytes], values: list[bytes], *, tombstones: bool = False
    ) -> None:
        """Keyed records (tombstones: deletes), MAX_APPEND_EVENTS an append; with
        ``replicated`` (a cluster), returns once the in-sync replicas hold the last."""
        end = 0
        for start in range(0, len(keys), MAX_APPEND_EVENTS):
            chunk = slice(start, start + MAX_APPEND_EVENTS)
            stored = await self.engine.append(
                self.tenant_id,
                self.stream_id,
                values[chunk],
                keys=keys[chunk],
                tombstones=[True] * len(values[chunk]) if tombstones else None,
                internal=True,
            )
            end = stored.next_offset
        if self.replicated is not None and end:
            await self.replicated(self.tenant_id, OFFSETS_STREAM, end)


class CommittedOffsets:
    """The committed offsets, in memory, as loaded from and written to the store."""

    def __init__(self, offsets: Mapping[OffsetKey, CommittedOffset] | None = None) -> None:
        self._by_group: dict[str, dict[TopicPartition, CommittedOffset]] = {}
        for key, value in (offsets or {}).items():
            self._by_group.setdefault(key.group, {})[key.topic_partition] = value

    def apply(self, offsets: Mapping[OffsetKey, CommittedOffset]) -> None:
        for key, value in offsets.items():
            self._by_group.setdefault(key.group, {})[key.topic_partition] = value

    def remove(self, group: str) -> list[OffsetKey]:
        """Forget a group; returns the keys its offsets were stored under."""
        gone = self._by_group.pop(group, {})
        return [OffsetKey(group, tp.stream, tp.partition) for tp in sorted(gone)]

    def remove_stream(self, stream: str) -> list[OffsetKey]:
        """Forget every group's offsets of ``stream``; returns the keys they were stored
        under (a group left with none is forgotten too)."""
        gone: list[OffsetKey] = []
        for group, committed in list(self._by_group.items()):
            for tp in sorted(tp for tp in committed if tp.stream == stream):
                del committed[tp]
                gone.append(OffsetKey(group, tp.stream, tp.partition))
            if not committed:
                del self._by_group[group]
        return gone

    def groups(self) -> list[str]:
        return sorted(self._by_group)

    def fetch(
        self, group: str, partitions: Iterable[TopicPartition] | None = None
    ) -> dict[TopicPartition, CommittedOffset]:
        """The group's committed offsets (of ``partitions``, or all); a partition with
        no commit is absent (Kafka answers -1 for it)."""
        committed = self._by_group.get(group, {})
        if partitions is None:
            return dict(sorted(committed.items()))
        return {tp: committed[tp] for tp in partitions if tp in committed}

    def lag(
        self, group: str, end_offset: Callable[[TopicPartition], int]
    ) -> dict[TopicPartition, int]:
        """Per committed partition: events at or past the committed offset (never
        negative; ``end_offset`` is the partition's next offset to be written)."""
        return {
            tp: max(0, end_offset(tp) - value.offset)
            for tp, value in sorted(self._by_group.get(group, {}).items())
        }


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(eq=False, repr=False)
class OffsetManager:
    """Commit and fetch for one tenant: the coordinator's generation checks, then the
    store, then the in-memory view (a refused commit stores nothing)."""

    coordinator: GroupCoordinator
    store: OffsetStore
    committed: CommittedOffsets
    clock_ms: Callable[[], int] = field(default=_wall_ms, kw_only=True)

    @classmethod
    async def open(cls, coordinator: GroupCoordinator, store: OffsetStore) -> OffsetManager:
        return cls(coordinator, store, CommittedOffsets(await store.load()))

    async def commit(
        self,
        group: str,
        offsets: Mapping[TopicPartition, tuple[int, str]],
        *,
        member_id: str = "",
        generation: int = NO_GENERATION,
        instance_id: str | None = None,
    ) -> None:
        """OffsetCommit: ``offsets`` maps each partition to (next offset, metadata)."""
        self.coordinator.validate_commit(group, member_id, generation, instance_id)
        if len(group.encode()) > MAX_NAME_BYTES:
            raise InvalidGroupId(f"a consumer group id is limited to {MAX_NAME_BYTES} bytes")
        now = self.clock_ms()
        entries: dict[OffsetKey, CommittedOffset] = {}
        for tp, (offset, metadata) in offsets.items():
            count = self.coordinator.partitions_of(tp.stream)
            if count == 0:
                raise StreamNotFound(f"stream {tp.stream!r} does not exist")
            if not 0 <= tp.partition < count:
                raise InvalidRequest(
                    f"stream {tp.stream!r} has no partition {tp.partition} (it has {count})"
                )
            if not committable(offset):
                raise InvalidOffset(
                    f"offset {offset} of {tp.stream}/{tp.partition} is outside 0..2**63 - 1"
                )
            check_metadata(metadata)
            entries[OffsetKey(group, tp.stream, tp.partition)] = CommittedOffset(
                offset, metadata, now
            )
        if entries:
            await self.store.commit(entries)
            self.committed.apply(entries)

    def fetch(
        self, group: str, partitions: Iterable[TopicPartition] | None = None
    ) -> dict[TopicPartition, CommittedOffset]:
        return self.committed.fetch(group, partitions)

    async def forget_stream(self, stream: str) -> None:
        """A deleted stream's offsets, of every group, as Kafka deletes a deleted topic's:
        a stream made again under its name is consumed from its start."""
        keys = self.committed.remove_stream(stream)
        if keys:
            await self.store.delete(keys)

    async def delete_group(self, group: str) -> None:
        """DeleteGroups: an empty group and its offsets (refused while it has members)."""
        if group in self.coordinator.groups:
            self.coordinator.delete_group(group)
        keys = self.committed.remove(group)
        if keys:
            await self.store.delete(keys)
