"""Committed offsets: stored in the tenant's internal compacted stream, fetched with
their metadata, refused (and not stored) from a stale generation, surviving a restart
and compaction, and the lag per partition computed from them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from headwater.engine.engine import Engine, EngineConfig
from headwater.engine.groups import (
    CommittedOffset,
    GroupCoordinator,
    LogOffsetStore,
    OffsetKey,
    OffsetManager,
    TopicPartition,
)
from headwater.engine.groups.errors import (
    IllegalGeneration,
    InvalidGroupId,
    OffsetMetadataTooLarge,
    UnknownMemberId,
)
from headwater.engine.groups.offsets import (
    OFFSETS_STREAM,
    decode_key,
    decode_value,
    encode_key,
    encode_value,
)
from headwater.errors import InvalidOffset, InvalidRequest, StreamNotFound

CONFIG = EngineConfig(maintenance_interval_ms=0)
P0, P1 = TopicPartition("orders", 0), TopicPartition("orders", 1)


class Clock:
    now = 5_000_000

    def __call__(self) -> int:
        return self.now


def make_coordinator(clock: Clock) -> GroupCoordinator:
    return GroupCoordinator(lambda s: 3 if s == "orders" else 0, clock=clock)


async def open_manager(engine: Engine, clock: Clock) -> OffsetManager:
    store = await LogOffsetStore.open(engine, 0)
    manager = await OffsetManager.open(make_coordinator(clock), store)
    manager.clock_ms = clock
    return manager


def test_key_and_value_round_trip() -> None:
    key = OffsetKey("grüppe/1", "orders", 7)
    assert decode_key(encode_key(key)) == key
    value = CommittedOffset(123, "meta ✓", 99)
    assert decode_value(encode_value(value)) == value
    with pytest.raises(ValueError):
        decode_key(encode_key(key) + b"x")


def test_commit_fetch_restart_and_compaction(tmp_path: Path) -> None:
    clock = Clock()

    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        manager = await open_manager(engine, clock)
        group = manager.coordinator
        member, _ = group.join("g", "", protocols=("range",), streams=("orders",))
        group.sync("g", member, 1)
        await manager.commit("g", {P0: (10, "first"), P1: (4, "")}, member_id=member, generation=1)
        clock.now += 1
        await manager.commit("g", {P0: (12, "second")}, member_id=member, generation=1)
        assert manager.fetch("g") == {
            P0: CommittedOffset(12, "second", clock.now),
            P1: CommittedOffset(4, "", clock.now - 1),
        }
        assert manager.fetch("g", [P1, TopicPartition("orders", 2)]) == {
            P1: CommittedOffset(4, "", clock.now - 1)
        }
        # A simple (unmanaged) group commits without member or generation.
        await manager.commit("solo", {P1: (1, "")})
        # Lag: the partition's end minus the committed offset, never below zero.
        assert manager.committed.lag("g", {P0: 20, P1: 3}.__getitem__) == {P0: 8, P1: 0}
        # The stream is the tenant's internal compacted stream, keyed per partition.
        stream = engine.stream_by_name(0, OFFSETS_STREAM, internal=True)
        assert stream.settings.cleanup_policy == "compact"
        assert stream.info().next_offset == 4  # 3 commits: 2 + 1 + 1 events
        await engine.close()

        engine = await Engine.open(tmp_path, CONFIG)
        manager = await open_manager(engine, clock)
        assert manager.fetch("g")[P0] == CommittedOffset(12, "second", clock.now)
        assert manager.fetch("solo") == {P1: CommittedOffset(1, "", clock.now)}
        log = engine.stream_by_name(0, OFFSETS_STREAM, internal=True).log
        log.roll()
        await engine.sync_tenant(0)
        result = log.compact()
        assert result.events_removed == 1  # P0's first commit is superseded
        again = await LogOffsetStore(engine, 0, log_stream_id(engine)).load()
        assert again[OffsetKey("g", "orders", 0)].offset == 12
        assert len(again) == 3
        # Deleting a group writes tombstones; the group is gone after a restart too.
        await manager.delete_group("solo")
        assert manager.fetch("solo") == {}
        await engine.close()
        engine = await Engine.open(tmp_path, CONFIG)
        manager = await open_manager(engine, clock)
        assert manager.committed.groups() == ["g"]
        await engine.close()

    asyncio.run(main())


def log_stream_id(engine: Engine) -> int:
    return engine.stream_by_name(0, OFFSETS_STREAM, internal=True).stream_id


def test_refused_commits_store_nothing(tmp_path: Path) -> None:
    clock = Clock()

    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        manager = await open_manager(engine, clock)
        group = manager.coordinator
        a, _ = group.join("g", "", protocols=("range",), streams=("orders",))
        group.sync("g", a, 1)
        await manager.commit("g", {P0: (5, "")}, member_id=a, generation=1)
        b, _ = group.join("g", "", protocols=("range",), streams=("orders",))
        group.join("g", a, protocols=("range",), streams=("orders",))
        group.sync("g", a, 2)
        group.sync("g", b, 2)
        # a's commit from the generation before the rebalance: refused.
        with pytest.raises(IllegalGeneration):
            await manager.commit("g", {P0: (9, "")}, member_id=a, generation=1)
        with pytest.raises(UnknownMemberId):
            await manager.commit("g", {P0: (9, "")}, member_id="ghost", generation=2)
        with pytest.raises(UnknownMemberId):
            await manager.commit("g", {P0: (9, "")})
        with pytest.raises(InvalidOffset):
            await manager.commit("g", {P0: (-1, "")}, member_id=a, generation=2)
        with pytest.raises(InvalidRequest, match="no partition 3"):
            await manager.commit(
                "g", {TopicPartition("orders", 3): (1, "")}, member_id=a, generation=2
            )
        with pytest.raises(StreamNotFound):
            await manager.commit(
                "g", {TopicPartition("nope", 0): (1, "")}, member_id=a, generation=2
            )
        with pytest.raises(OffsetMetadataTooLarge):  # Kafka's code for it, not a generic one
            await manager.commit("g", {P0: (1, "x" * 4097)}, member_id=a, generation=2)
        with pytest.raises(OffsetMetadataTooLarge):  # counted in UTF-8 bytes
            await manager.commit("g", {P0: (1, "é" * 2049)}, member_id=a, generation=2)
        with pytest.raises(InvalidGroupId):
            await manager.commit("g" * 0x10000, {P0: (1, "")})
        stream = engine.stream_by_name(0, OFFSETS_STREAM, internal=True)
        assert stream.info().next_offset == 1  # only the first commit was written
        # The same member at the current generation is accepted.
        await manager.commit("g", {P0: (9, "")}, member_id=b, generation=2)
        assert manager.fetch("g")[P0].offset == 9
        with pytest.raises(InvalidRequest, match="has members"):
            await manager.delete_group("g")
        assert manager.fetch("g")[P0].offset == 9
        await engine.close()

    asyncio.run(main())
