"""Engine core: tenants, streams, tenant log positions, appends and reads."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from headwater.engine.engine import Engine, EngineConfig, StreamInfo, StreamSettings
from headwater.errors import (
    InvalidRequest,
    StorageError,
    StreamAlreadyExists,
    StreamNotFound,
    TenantNotFound,
)
from headwater.storage.log import SyncPolicy
from rewrites import HeldRewrite
from waiting import scheduled_callbacks_run, wait_until_async

CONFIG = EngineConfig(maintenance_interval_ms=0, tenants={0: "default", 42: "acme"})


def test_create_list_describe_delete(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        a = await engine.create_stream(0, "orders")
        b = await engine.create_stream(0, "trades", StreamSettings(retention_ms=60_000))
        assert (a.stream_id, b.stream_id) == (1, 2)
        assert [s.name for s in engine.list_streams(0)] == ["orders", "trades"]
        assert engine.stream_by_name(0, "trades").info().settings.retention_ms == 60_000
        with pytest.raises(StreamAlreadyExists):
            await engine.create_stream(0, "orders")
        await engine.delete_stream(0, a.stream_id)
        assert [s.name for s in engine.list_streams(0)] == ["trades"]
        with pytest.raises(StreamNotFound):
            await engine.append(0, a.stream_id, [b"x"])
        # The name is free again and takes a new id: ids are never reused.
        again = await engine.create_stream(0, "orders")
        assert again.stream_id == 3
        await engine.close()

        engine = await Engine.open(tmp_path, CONFIG)
        assert [(s.stream_id, s.name) for s in engine.list_streams(0)] == [
            (2, "trades"),
            (3, "orders"),
        ]
        assert not (tmp_path / "tenants/0/streams/1").exists()
        await engine.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    "name", ["", "a b", "x" * 257, "hw_internal", "convergedb_x", "naïve", "a/b", ".", ".."]
)
def test_bad_names_are_invalid_requests(tmp_path: Path, name: str) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        with pytest.raises(InvalidRequest):
            await engine.create_stream(0, name)
        assert engine.list_streams(0) == []
        await engine.close()

    asyncio.run(main())


def test_tenants_are_isolated(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        mine = await engine.create_stream(42, "events")
        with pytest.raises(StreamNotFound):
            engine.stream(0, mine.stream_id)
        with pytest.raises(TenantNotFound):
            await engine.create_stream(7, "events")
        # The same name in another tenant is another stream.
        await engine.create_stream(0, "events")
        await engine.append(42, mine.stream_id, [b"a", b"b"])
        assert engine.tenant(42).next_position == 2
        assert engine.tenant(0).next_position == 0
        await engine.close()

    asyncio.run(main())


def test_positions_span_streams_and_survive_restart_and_delete(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        s1 = (await engine.create_stream(0, "one")).stream_id
        s2 = (await engine.create_stream(0, "two")).stream_id
        await engine.append(0, s1, [b"a", b"b", b"c"])
        await engine.append(0, s2, [b"d", b"e"])
        await engine.append(0, s1, [b"f"])
        events1 = await engine.read_events(0, s1, 0)
        events2 = await engine.read_events(0, s2, 0)
        assert [e.position for e in events1] == [0, 1, 2, 5]
        assert [e.position for e in events2] == [3, 4]
        assert engine.tenant(0).committed_position == 6
        await engine.close()

        engine = await Engine.open(tmp_path, CONFIG)
        assert engine.tenant(0).next_position == 6
        # Deleting the stream that holds the highest position must not let it be reused.
        await engine.delete_stream(0, s1)
        await engine.close()
        engine = await Engine.open(tmp_path, CONFIG)
        info = await engine.append(0, s2, [b"g"])
        assert info.first_position == 6
        await engine.close()

    asyncio.run(main())


def test_append_limits_reject_and_store_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        sid = (await engine.create_stream(0, "s")).stream_id
        with pytest.raises(InvalidRequest):
            await engine.append(0, sid, [])
        with pytest.raises(InvalidRequest):
            await engine.append(0, sid, [b""] * 10_001)
        with pytest.raises(InvalidRequest):
            await engine.append(0, sid, [b"x" * (4 << 20), b"y"])
        await engine.append(0, sid, [b""] * 10_000)
        await engine.append(0, sid, [b"x" * (4 << 20)])
        info = engine.stream(0, sid).info()
        assert info.next_offset == 10_001
        assert engine.tenant(0).next_position == 10_001
        await engine.close()

    asyncio.run(main())


def test_read_your_acknowledged_writes_under_each_policy(tmp_path: Path) -> None:
    for policy in ("fsync", "interval:5", "none"):

        async def main(policy: str = policy) -> None:
            config = EngineConfig(sync=SyncPolicy.parse(policy), maintenance_interval_ms=0)
            engine = await Engine.open(tmp_path / policy.replace(":", "_"), config)
            sid = (await engine.create_stream(0, "s")).stream_id
            values = [f"event-{i}".encode() for i in range(50)]
            acks = await asyncio.gather(
                *(engine.append(0, sid, values[i : i + 5]) for i in range(0, 50, 5))
            )
            assert sorted(a.base_offset for a in acks) == list(range(0, 50, 5))
            events = await engine.read_events(0, sid, 0, limit=100)
            by_offset = {e.offset: e.value for e in events}
            for ack in acks:
                got = [by_offset[ack.base_offset + i] for i in range(ack.count)]
                assert got == values[ack.first_position : ack.first_position + ack.count]
            await engine.close()

            engine = await Engine.open(tmp_path / policy.replace(":", "_"), config)
            again = await engine.read_events(0, sid, 0, limit=100)
            assert [(e.offset, e.value) for e in again] == [(e.offset, e.value) for e in events]
            await engine.close()

        asyncio.run(main())


def test_stream_sync_override_and_bad_settings(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        info = await engine.create_stream(0, "fast", StreamSettings(sync="none"))
        assert info.sync == "none"
        assert engine.stream(0, info.stream_id).info().sync == "none"
        for bad in (
            StreamSettings(sync="sometimes"),
            StreamSettings(cleanup_policy="shred"),
            StreamSettings(retention_ms=-5),
            StreamSettings(segment_ms=0),
        ):
            with pytest.raises(InvalidRequest):
                await engine.create_stream(0, "bad", bad)
        # 0 is Kafka's "at once" for retention and tombstones, and kept as 0 (not "unset").
        zero = StreamSettings(retention_ms=0, retention_bytes=0, delete_retention_ms=0)
        await engine.create_stream(0, "brief", zero)
        assert sorted(s.name for s in engine.list_streams(0)) == ["brief", "fast"]
        await engine.close()
        engine = await Engine.open(tmp_path, CONFIG)
        assert engine.stream_by_name(0, "fast").info().sync == "none"
        settings = engine.stream_by_name(0, "brief").info().settings
        assert (settings.retention_ms, settings.retention_bytes, settings.delete_retention_ms) == (
            0,
            0,
            0,
        )
        await engine.close()

    asyncio.run(main())


def test_close_refuses_new_appends_and_finishes_inflight(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        sid = (await engine.create_stream(0, "s")).stream_id
        pending = [asyncio.create_task(engine.append(0, sid, [b"v"] * 100)) for _ in range(20)]
        # One turn of the loop (not a wait for time): every append runs to its first await,
        # so all 20 are in flight when close begins.
        await scheduled_callbacks_run()
        await engine.close()
        results = await asyncio.gather(*pending, return_exceptions=True)
        ok = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, BaseException)]
        assert all(isinstance(r, StorageError) for r in refused)
        engine = await Engine.open(tmp_path, CONFIG)
        assert engine.stream(0, sid).info().next_offset == 100 * len(ok)
        await engine.close()

    asyncio.run(main())


def test_retention_and_compaction_through_maintenance(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        logs = await engine.create_stream(
            0, "logs", StreamSettings(segment_bytes=4096, retention_bytes=10_000)
        )
        table = await engine.create_stream(
            0, "table", StreamSettings(segment_bytes=4096, cleanup_policy="compact")
        )
        for i in range(100):
            await engine.append(0, logs.stream_id, [b"x" * 200])
            await engine.append(0, table.stream_id, [f"v{i}".encode()], keys=[b"k%d" % (i % 5)])
        result = await engine.run_maintenance()
        assert result["segments_removed"] > 0
        assert result["events_compacted"] > 0
        log_info = engine.stream(0, logs.stream_id).info()
        assert log_info.start_offset > 0
        assert log_info.next_offset == 100
        table_events = await engine.read_events(0, table.stream_id, 0, limit=1000)
        latest = {e.key: e.value for e in table_events}
        assert latest == {b"k%d" % k: f"v{95 + k}".encode() for k in range(5)}
        await engine.close()

    asyncio.run(main())


def test_the_servers_state_streams_are_never_cut_by_the_default_retention(
    tmp_path: Path,
) -> None:
    """[storage] retention_bytes / retention_ms (the server's defaults) applied to the
    internal state streams too: a consumer group's committed offset went once it was a
    retention period old, gone at the next restart. Only compaction bounds them."""

    async def main() -> None:
        config = EngineConfig(
            maintenance_interval_ms=0, segment_bytes=4096, retention_bytes=10_000, retention_ms=1
        )
        engine = await Engine.open(tmp_path, config)
        user = await engine.create_stream(0, "user")
        state = await engine.create_stream(
            0, "hw_consumer_offsets", StreamSettings(cleanup_policy="compact"), internal=True
        )
        for i in range(100):
            await engine.append(0, user.stream_id, [b"x" * 200])
            await engine.append(
                0, state.stream_id, [b"y" * 200], keys=[b"group-%d" % i], internal=True
            )
        assert (await engine.run_maintenance())["segments_removed"] > 0
        assert engine.stream(0, user.stream_id).info().start_offset > 0  # retention ran
        kept = engine.stream(0, state.stream_id, internal=True).info()
        assert (kept.start_offset, kept.next_offset) == (0, 100)
        await engine.close()

    asyncio.run(main())


def test_offset_for_timestamp(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        sid = (await engine.create_stream(0, "s")).stream_id
        for i, ts in enumerate((1_000, 2_000, 3_000)):
            await engine.append(0, sid, [b"a", b"b"], timestamp_ms=ts + i)
        assert await engine.offset_for_timestamp(0, sid, 0) == 0
        assert await engine.offset_for_timestamp(0, sid, 1_500) == 2
        assert await engine.offset_for_timestamp(0, sid, 3_002) == 4
        assert await engine.offset_for_timestamp(0, sid, 9_999) is None
        await engine.close()

    asyncio.run(main())


def test_an_append_larger_than_a_segment_is_invalid_and_claims_no_position(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        sid = (await engine.create_stream(0, "small", StreamSettings(segment_bytes=4096))).stream_id
        await engine.append(0, sid, [b"a" * 1000])
        with pytest.raises(InvalidRequest, match="segment_bytes"):
            await engine.append(0, sid, [b"x" * 2100, b"y" * 2100])
        await engine.append(0, sid, [b"b" * 1000])  # the stream goes on, positions unbroken
        events = await engine.read_events(0, sid, 0, limit=10)
        assert [(e.offset, e.value[:1]) for e in events] == [(0, b"a"), (1, b"b")]
        assert engine.tenant(0).next_position == 2
        await engine.close()

    asyncio.run(main())


async def compaction_held(
    engine: Engine,
) -> tuple[StreamInfo, HeldRewrite, asyncio.Task[dict[str, int]]]:
    """A compacted stream "table" of 100 events over 5 keys, and the engine's maintenance
    under way, its compaction held at the rename of the stream's first segment."""
    table = await engine.create_stream(
        0, "table", StreamSettings(segment_bytes=4096, cleanup_policy="compact")
    )
    for i in range(100):
        await engine.append(0, table.stream_id, [f"v{i}".encode()], keys=[b"k%d" % (i % 5)])
    held = HeldRewrite(engine.stream(0, table.stream_id).partition_logs[0])
    maintenance = asyncio.create_task(engine.run_maintenance())
    await wait_until_async(held.at_rename.is_set)
    return table, held, maintenance


def test_a_stream_deleted_during_a_compaction_waits_for_its_rewrite_off_the_loop(
    tmp_path: Path,
) -> None:
    # The delete closes the stream's log, which waits for the maintenance thread's
    # segment rewrite under way: in a worker, so the loop goes on serving meanwhile.
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        table, held, maintenance = await compaction_held(engine)
        plog, takers = held.plog, held.lock.takers
        came = len(takers)  # retention's and the compaction's own takes
        deleting = asyncio.create_task(engine.delete_stream(0, table.stream_id))
        # The close waits for the lock in a worker; the loop runs this meanwhile.
        await wait_until_async(lambda: len(takers) > came)
        assert threading.current_thread() not in takers and not deleting.done()
        other = await engine.create_stream(0, "other")
        held.go_on.set()
        await deleting
        assert (await maintenance)["events_compacted"] > 0
        assert plog.closed
        assert [s.stream_id for s in engine.all_streams()] == [other.stream_id]
        assert not (tmp_path / f"tenants/0/streams/{table.stream_id}").exists()
        await engine.close()

    asyncio.run(main())


def test_a_shutdown_during_a_compaction_waits_for_its_rewrite_off_the_loop(
    tmp_path: Path,
) -> None:
    # The engine's close closes every log, which fsyncs and waits for the maintenance
    # thread's segment rewrite under way: in a worker, so the loop goes on meanwhile
    # (answering what is in flight, closing connections). A delete that ends then
    # takes its stream out of the tenant's streams, which the shutdown walks: that
    # raised "dictionary changed size during iteration", and left the engine unclosed
    # (logs unsynced, executor and directory lock held).
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        other = await engine.create_stream(0, "other")
        await engine.append(0, other.stream_id, [b"o"])
        table, held, maintenance = await compaction_held(engine)
        plog, takers = held.plog, held.lock.takers
        came = len(takers)  # retention's and the compaction's own takes
        closing = asyncio.create_task(engine.close())
        # The shutdown waits on the table's log (its rewrite) in a worker ...
        await wait_until_async(lambda: len(takers) > came)
        assert threading.current_thread() not in takers and not closing.done()
        # ... while a delete (in flight as it began) ends.
        await engine.delete_stream(0, other.stream_id)
        held.go_on.set()
        await closing
        assert (await maintenance)["events_compacted"] > 0
        assert plog.closed and engine.closed
        engine = await Engine.open(tmp_path, CONFIG)
        assert [s.name for s in engine.all_streams()] == ["table"]
        events = await engine.read_events(0, table.stream_id, 0, limit=200)
        assert {e.key: e.value for e in events} == {b"k%d" % k: b"v%d" % (95 + k) for k in range(5)}
        await engine.close()

    asyncio.run(main())
