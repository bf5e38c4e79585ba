"""Partitioned streams in the engine: placement, per-partition reads, seek by time,
growing the partition count, compaction per key per partition, and recovery."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headwater.engine.engine import Engine, EngineConfig, StreamSettings
from headwater.engine.partitioner import keyed_partition
from headwater.errors import InvalidRequest
from headwater.storage.batch import Event

CONFIG = EngineConfig(maintenance_interval_ms=0)


async def read_all(engine: Engine, stream_id: int, partition: int) -> list[Event]:
    return await engine.read_events(0, stream_id, 0, 100_000, partition=partition)


def test_default_stream_has_one_partition_and_reads_as_before(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        info = await engine.create_stream(0, "plain")
        assert info.partitions == 1
        assert [p.partition for p in info.partition_info] == [0]
        await engine.append(0, info.stream_id, [b"a", b"b"], keys=[b"k", None])
        placed = await engine.append_partitioned(0, info.stream_id, [b"c"], keys=[b"z"])
        assert placed.partitions == [0] and placed.offsets == [2]
        events = await engine.read_events(0, info.stream_id, 0)
        assert [(e.value, e.key) for e in events] == [(b"a", b"k"), (b"b", None), (b"c", b"z")]
        assert sorted(p.name for p in (tmp_path / "tenants/0/streams/1").iterdir()) == [
            "partition-0",
            "stream.json",
        ]
        await engine.close()

    asyncio.run(main())


def test_keyed_events_land_on_kafka_partition_with_keys_headers_timestamps(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        info = await engine.create_stream(0, "orders", StreamSettings(partitions=6))
        assert info.partitions == 6
        keys = [f"customer-{i}".encode() for i in range(60)]
        values = [b"v" + k for k in keys]
        headers = [((b"trace", str(i).encode()),) for i in range(60)]
        timestamps = [1_700_000_000_000 + (i // 10) for i in range(60)]
        placed = await engine.append_partitioned(
            0, info.stream_id, values, keys=keys, headers=headers, timestamps=timestamps
        )
        assert placed.partitions == [keyed_partition(k, 6) for k in keys]
        assert placed.timestamps == timestamps
        for partition in range(6):
            events = await read_all(engine, info.stream_id, partition)
            mine = [i for i in range(60) if placed.partitions[i] == partition]
            assert [e.key for e in events] == [keys[i] for i in mine]
            assert [e.value for e in events] == [values[i] for i in mine]
            assert [e.headers for e in events] == [headers[i] for i in mine]
            assert [e.timestamp_ms for e in events] == [timestamps[i] for i in mine]
            assert [e.offset for e in events] == [placed.offsets[i] for i in mine]
            assert [e.offset for e in events] == list(range(len(mine)))
        assert engine.stream(0, info.stream_id).info().events_appended == 60
        positions = [e.position for p in range(6) for e in await read_all(engine, 1, p)]
        assert sorted(positions) == list(range(60)), "one tenant log position per event"
        await engine.close()

    asyncio.run(main())


def test_explicit_partition_and_bad_ones(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        info = await engine.create_stream(0, "s", StreamSettings(partitions=3))
        placed = await engine.append_partitioned(
            0, info.stream_id, [b"a", b"b"], keys=[b"k", b"k"], partitions=[2, None]
        )
        assert placed.partitions == [2, keyed_partition(b"k", 3)]
        with pytest.raises(InvalidRequest, match="partition 3 does not exist"):
            await engine.append_partitioned(0, info.stream_id, [b"a"], partitions=[3])
        with pytest.raises(InvalidRequest, match="partition 5 does not exist"):
            await engine.append(0, info.stream_id, [b"a"], partition=5)
        with pytest.raises(InvalidRequest, match="partition -1 does not exist"):
            await engine.read(0, info.stream_id, 0, partition=-1)
        with pytest.raises(InvalidRequest, match="partitions must be"):
            await engine.create_stream(0, "t", StreamSettings(partitions=0))
        await engine.append(0, info.stream_id, [b"direct"], partition=1)
        assert [e.value for e in await read_all(engine, info.stream_id, 1)] == [b"direct"]
        await engine.close()

    asyncio.run(main())


def test_keyless_batch_sticks_to_one_partition(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        info = await engine.create_stream(0, "s", StreamSettings(partitions=4))
        placed = await engine.append_partitioned(0, info.stream_id, [b"x"] * 50)
        assert len(set(placed.partitions)) == 1
        assert placed.offsets == list(range(50))
        await engine.close()

    asyncio.run(main())


def test_log_append_time_ignores_the_producer_clock(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        info = await engine.create_stream(
            0, "s", StreamSettings(partitions=2, timestamp_type="LogAppendTime")
        )
        placed = await engine.append_partitioned(0, info.stream_id, [b"a"], timestamps=[5])
        assert placed.timestamps[0] > 1_600_000_000_000
        appended = await engine.append(0, info.stream_id, [b"b"], timestamp_ms=5, partition=1)
        assert appended.timestamp_ms > 1_600_000_000_000
        with pytest.raises(InvalidRequest, match="timestamp_type"):
            await engine.create_stream(0, "t", StreamSettings(timestamp_type="Whenever"))
        await engine.close()

    asyncio.run(main())


def test_seek_by_time_per_partition(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        info = await engine.create_stream(0, "s", StreamSettings(partitions=2))
        for t in (100, 200, 300):
            await engine.append(0, info.stream_id, [b"p0"], timestamp_ms=t, partition=0)
            await engine.append(0, info.stream_id, [b"p1", b"p1"], timestamp_ms=t + 50, partition=1)
        seek = engine.offset_for_timestamp
        assert await seek(0, info.stream_id, 150, partition=0) == 1
        assert await seek(0, info.stream_id, 150, partition=1) == 0
        assert await seek(0, info.stream_id, 251, partition=1) == 4
        assert await seek(0, info.stream_id, 301, partition=0) is None
        await engine.close()

    asyncio.run(main())


def test_more_partitions_keep_old_data_and_move_only_new_writes(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        info = await engine.create_stream(0, "s", StreamSettings(partitions=2))
        keys = [f"k{i}".encode() for i in range(40)]
        before = await engine.append_partitioned(0, info.stream_id, keys, keys=keys)
        grown = await engine.alter_partitions(0, info.stream_id, 5)
        assert grown.partitions == 5
        with pytest.raises(InvalidRequest, match="never removed"):
            await engine.alter_partitions(0, info.stream_id, 3)
        assert (await engine.alter_partitions(0, info.stream_id, 5)).partitions == 5
        after = await engine.append_partitioned(0, info.stream_id, keys, keys=keys)
        assert after.partitions == [keyed_partition(k, 5) for k in keys]
        assert before.partitions == [keyed_partition(k, 2) for k in keys]
        await engine.close()

        engine = await Engine.open(tmp_path, CONFIG)
        assert engine.stream(0, info.stream_id).partitions == 5
        for partition in range(5):
            got = [e.key for e in await read_all(engine, info.stream_id, partition)]
            old = [k for k, p in zip(keys, before.partitions, strict=True) if p == partition]
            new = [k for k, p in zip(keys, after.partitions, strict=True) if p == partition]
            assert got == old + new
        await engine.close()

    asyncio.run(main())


def test_compaction_keeps_latest_value_per_key_in_each_partition(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        settings = StreamSettings(partitions=3, cleanup_policy="compact", segment_bytes=4096)
        info = await engine.create_stream(0, "table", settings)
        keys = [f"key-{i}".encode() for i in range(12)]
        for round_ in range(6):
            values = [k + b"=" + str(round_).encode() * 100 for k in keys]
            await engine.append_partitioned(0, info.stream_id, values, keys=keys)
        stream = engine.stream(0, info.stream_id)
        for plog in stream.partition_logs:
            plog.roll()
        result = await engine.run_maintenance()
        assert result["events_compacted"] > 0
        for partition in range(3):
            events = await read_all(engine, info.stream_id, partition)
            mine = [k for k in keys if keyed_partition(k, 3) == partition]
            assert sorted(e.key for e in events if e.key) == sorted(mine)
            assert all(e.value.endswith(b"5" * 100) for e in events)
        await engine.close()

    asyncio.run(main())


@settings(max_examples=25, deadline=None)
@given(
    partitions=st.integers(1, 8),
    batches=st.lists(
        st.lists(
            st.tuples(st.one_of(st.none(), st.binary(max_size=6)), st.binary(max_size=8)),
            min_size=1,
            max_size=20,
        ),
        min_size=1,
        max_size=5,
    ),
)
def test_reads_return_exactly_what_was_appended_per_partition(
    tmp_path_factory: pytest.TempPathFactory,
    partitions: int,
    batches: list[list[tuple[bytes | None, bytes]]],
) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path_factory.mktemp("p"), CONFIG)
        info = await engine.create_stream(0, "s", StreamSettings(partitions=partitions))
        expected: dict[int, list[tuple[bytes | None, bytes]]] = {}
        for batch in batches:
            keys = [k for k, _ in batch]
            placed = await engine.append_partitioned(
                0, info.stream_id, [v for _, v in batch], keys=keys
            )
            for (key, value), p in zip(batch, placed.partitions, strict=True):
                if key is not None:
                    assert p == keyed_partition(key, partitions)
                expected.setdefault(p, []).append((key, value))
        for partition in range(partitions):
            events = await read_all(engine, info.stream_id, partition)
            assert [(e.key, e.value) for e in events] == expected.get(partition, [])
        await engine.close()

    asyncio.run(main())


def test_subscriptions_follow_one_partition_each(tmp_path: Path) -> None:
    from headwater.engine.subscriptions import CloseReason, Push, Subscription, Subscriptions
    from headwater.errors import InvalidRequest as Invalid
    from headwater.storage.batch import value_spans

    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        subs = Subscriptions(engine)
        info = await engine.create_stream(0, "s", StreamSettings(partitions=3))
        got: dict[int, list[tuple[int, bytes]]] = {0: [], 1: [], 2: []}
        arrived = asyncio.Event()
        closed: list[CloseReason] = []

        async def deliver(sub: Subscription, pushes: list[Push]) -> None:
            for start, count, chunks, _credits in pushes:
                data = b"".join(chunks)
                bounds = value_spans(data, count)
                got[sub.partition] += [
                    (start + i, data[bounds[i] + 8 : bounds[i + 1]]) for i in range(count)
                ]
            arrived.set()

        def on_close(sub: Subscription, reason: CloseReason) -> None:
            closed.append(reason)

        await engine.append(0, info.stream_id, [b"before-1"], partition=1)
        live = [
            subs.subscribe(0, info.stream_id, 0, 100, None, deliver, on_close, partition=p)
            for p in range(3)
        ]
        with pytest.raises(Invalid, match="partition 0"):
            subs.subscribe(0, info.stream_id, 0, 10, "g", deliver, on_close, partition=1)
        with pytest.raises(Invalid, match="partition 7 does not exist"):
            subs.subscribe(0, info.stream_id, 0, 10, None, deliver, on_close, partition=7)
        await engine.append(0, info.stream_id, [b"a", b"b"], partition=2)
        await engine.append(0, info.stream_id, [b"zero"], partition=0)
        async with asyncio.timeout(10):
            while [len(got[p]) for p in range(3)] != [1, 1, 2]:
                arrived.clear()
                await arrived.wait()
        assert got == {0: [(0, b"zero")], 1: [(0, b"before-1")], 2: [(0, b"a"), (1, b"b")]}
        for sub in live:
            subs.close(sub, CloseReason.CLIENT_CANCELLED)
        assert closed == [CloseReason.CLIENT_CANCELLED] * 3
        await engine.close()

    asyncio.run(main())


def test_check_names_a_missing_partition_and_checks_every_partitions_segments(
    tmp_path: Path,
) -> None:
    from headwater.storage.check import check_data_dir, check_metadata

    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        info = await engine.create_stream(0, "s", StreamSettings(partitions=3))
        for partition in range(3):
            await engine.append(0, info.stream_id, [b"x"], partition=partition)
        await engine.close()

    asyncio.run(main())
    reports = check_data_dir(tmp_path)
    checked = sorted(r.path.name for r in reports if r.path.parent.name == "1")
    assert checked == ["partition-0", "partition-1", "partition-2"]
    assert check_metadata(tmp_path) == []
    stream_dir = tmp_path / "tenants/0/streams/1"
    for leftover in (stream_dir / "partition-2").iterdir():
        leftover.unlink()
    (stream_dir / "partition-2").rmdir()
    assert [(p.path.name, p.problem) for p in check_metadata(tmp_path)] == [
        ("stream.json", "metadata without its partition-2/ directory (no data)")
    ]


def test_concurrent_alters_take_turns(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        info = await engine.create_stream(0, "s")
        async with asyncio.timeout(30):
            results = await asyncio.gather(
                engine.alter_partitions(0, info.stream_id, 5),
                engine.alter_partitions(0, info.stream_id, 3),
                return_exceptions=True,
            )
        # The first grows to 5; the second then asks for fewer than there are.
        assert isinstance(results[0], type(info)) and results[0].partitions == 5
        assert isinstance(results[1], InvalidRequest)
        await engine.append(0, info.stream_id, [b"x"], partition=4)
        await engine.close()
        engine = await Engine.open(tmp_path, CONFIG)
        assert engine.stream(0, info.stream_id).partitions == 5
        assert [e.value for e in await read_all(engine, info.stream_id, 4)] == [b"x"]
        await engine.close()

    asyncio.run(main())


def test_one_calls_events_of_a_partition_get_consecutive_offsets(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        info = await engine.create_stream(0, "s", StreamSettings(partitions=2))

        def call(tag: bytes) -> Any:
            # Ten timestamps: ten stored batches in partition 0 for one call.
            return engine.append_partitioned(
                0,
                info.stream_id,
                [tag + bytes([i]) for i in range(10)],
                partitions=[0] * 10,
                timestamps=[1000 + i for i in range(10)],
            )

        placed = await asyncio.gather(*(call(bytes([65 + n])) for n in range(4)))
        for one in placed:
            assert one.offsets == list(range(one.offsets[0], one.offsets[0] + 10))
            assert one.timestamps == [1000 + i for i in range(10)]
        events = await read_all(engine, info.stream_id, 0)
        assert len(events) == 40 and [e.offset for e in events] == list(range(40))
        assert len({e.position for e in events}) == 40
        await engine.close()

    asyncio.run(main())
