"""Idempotent appends: a retried (producer, sequence) never duplicates, across restarts."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest

from headwater.engine.engine import Engine, EngineConfig, StreamSettings
from headwater.errors import InvalidRequest
from headwater.storage.batch import encode_values

CONFIG = EngineConfig(maintenance_interval_ms=0)


async def _count(engine: Engine, sid: int) -> int:
    return engine.stream(0, sid).info().next_offset


def test_retry_returns_original_offsets_and_appends_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        sid = (await engine.create_stream(0, "s")).stream_id
        await engine.append(0, sid, [b"plain"])
        first = await engine.append_idempotent(0, sid, 7, 0, [b"a", b"b"])
        second = await engine.append_idempotent(0, sid, 7, 1, [b"c"])
        again = await engine.append_idempotent(0, sid, 7, 0, [b"a", b"b"])
        assert (first.base_offset, first.count) == (1, 2)
        assert (second.base_offset, second.count) == (3, 1)
        assert (again.base_offset, again.count) == (1, 2)
        assert await _count(engine, sid) == 4
        # Producers are independent of each other.
        other = await engine.append_idempotent(0, sid, 8, 0, [b"d"])
        assert other.base_offset == 4
        await engine.close()

    asyncio.run(main())


@pytest.mark.parametrize(("first_seq", "next_seq"), [(5, None), (0, 2)])
def test_out_of_order_sequences_are_invalid(
    tmp_path: Path, first_seq: int, next_seq: int | None
) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        sid = (await engine.create_stream(0, "s")).stream_id
        if next_seq is None:
            with pytest.raises(InvalidRequest, match="first sequence must be 0"):
                await engine.append_idempotent(0, sid, 1, first_seq, [b"x"])
        else:
            await engine.append_idempotent(0, sid, 1, first_seq, [b"x"])
            with pytest.raises(InvalidRequest, match="expected 1"):
                await engine.append_idempotent(0, sid, 1, next_seq, [b"y"])
        assert await _count(engine, sid) == (0 if next_seq is None else 1)
        assert engine.tenant(0).next_position == (0 if next_seq is None else 1)
        await engine.close()

    asyncio.run(main())


def test_table_survives_clean_restart_roll_and_crash(tmp_path: Path) -> None:
    settings = StreamSettings(segment_bytes=1024)

    async def write(data: Path, start: int, stop: int, *, close: bool) -> None:
        engine = await Engine.open(data, CONFIG)
        if not engine.list_streams(0):
            await engine.create_stream(0, "s", settings)
        sid = engine.stream_by_name(0, "s").stream_id
        for seq in range(start, stop):
            await engine.append_idempotent(0, sid, 99, seq, [b"v%d" % seq * 20])
        if close:
            await engine.close()
        else:
            # Simulate kill -9: copy the files as they are (page cache), never close.
            shutil.copytree(data, data.with_name("crashed"))

    async def retry_all(data: Path, upto: int) -> None:
        engine = await Engine.open(data, CONFIG)
        sid = engine.stream_by_name(0, "s").stream_id
        before = await _count(engine, sid)
        for seq in range(upto):
            info = await engine.append_idempotent(0, sid, 99, seq, [b"v%d" % seq * 20])
            assert info.count == 1
        assert await _count(engine, sid) == before == upto
        nxt = await engine.append_idempotent(0, sid, 99, upto, [b"next"])
        assert nxt.base_offset == upto
        await engine.close()

    data = tmp_path / "data"
    asyncio.run(write(data, 0, 30, close=True))  # rolls several segments
    asyncio.run(retry_all(data, 30))
    asyncio.run(write(data, 31, 40, close=False))
    asyncio.run(retry_all(tmp_path / "crashed", 40))


def test_idle_producers_are_forgotten_at_the_next_roll_and_active_ones_kept(
    tmp_path: Path,
) -> None:
    """Writers with a producer id per task (the Spark sink) must not grow the table
    forever: producers idle past producer_expiry_ms go when a snapshot is written, across
    a restart too; a producer still writing keeps its dedupe history."""
    config = EngineConfig(maintenance_interval_ms=0, producer_expiry_ms=60_000)
    now = int(time.time() * 1000)

    async def main() -> None:
        engine = await Engine.open(tmp_path, config)
        sid = (await engine.create_stream(0, "s")).stream_id
        log = engine.stream(0, sid).log
        for producer in range(100):  # one batch each, an hour ago
            await engine.append_encoded(
                0, sid, *_encoded([b"old"]), producer=(producer, 0), timestamp_ms=now - 3_600_000
            )
        await engine.append_encoded(
            0, sid, *_encoded([b"new"]), producer=(1000, 0), timestamp_ms=now
        )
        assert len(log.producers.producers) == 101
        log.roll()
        assert set(log.producers.producers) == {1000}
        again = await engine.append_idempotent(0, sid, 1000, 0, [b"new"])
        assert again.base_offset == 100  # still deduplicated
        await engine.close()
        engine = await Engine.open(tmp_path, config)
        assert set(engine.stream(0, sid).log.producers.producers) == {1000}
        await engine.close()

    asyncio.run(main())


def _encoded(values: list[bytes]) -> tuple[bytes, int]:
    return encode_values(values), len(values)
