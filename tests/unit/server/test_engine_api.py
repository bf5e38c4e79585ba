"""EngineAPI behaviour the front ends rely on beyond the engine's own."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from headwater.api import AuthConfig, EngineAPI
from headwater.engine.engine import EngineConfig, PageRead, StreamSettings
from headwater.engine.kinds import KindsConfig
from headwater.errors import InvalidOffset
from headwater.storage.log import SyncPolicy


def test_flush_kinds_flushes_every_tenant_when_one_fails(tmp_path: Path) -> None:
    # A listener's shutdown flushes all tenants so pending ACKs go out: one tenant whose
    # flush fails must not leave the others unflushed.
    async def main() -> list[str]:
        api = await EngineAPI.open(
            tmp_path, EngineConfig(maintenance_interval_ms=0), KindsConfig(), AuthConfig()
        )
        flushed: list[str] = []

        async def broken() -> None:
            raise OSError("disk gone")

        async def fine() -> None:
            flushed.append("fine")

        tenants = api._kinds.tenants
        saved = dict(tenants)
        tenants.clear()
        tenants.update({1: SimpleNamespace(flush=broken), 2: SimpleNamespace(flush=fine)})
        try:
            with pytest.raises(OSError, match="disk gone"):
                await api.flush_kinds()
        finally:
            tenants.clear()
            tenants.update(saved)
            await api.close()
        return flushed

    assert asyncio.run(main()) == ["fine"]


def test_a_read_whose_offset_retention_removes_before_it_reads_is_refused(
    tmp_path: Path,
) -> None:
    """The offset is checked when the read is asked for; retention may run before the
    page is read (in a worker thread, or after a quota's wait). The read must then fail
    as if it had been checked after: a Kimberlite answer carries no offsets, so events
    from the new start would be taken for the offsets asked."""

    async def main() -> None:
        config = EngineConfig(sync=SyncPolicy("none"), segment_bytes=300, maintenance_interval_ms=0)
        api = await EngineAPI.open(tmp_path, config, KindsConfig(), AuthConfig())
        try:
            info = await api.create_stream(0, "ret", StreamSettings(retention_bytes=600))
            plog = api._engine.stream(0, info.stream_id).partition_log(0)
            read_page = api._engine.read_page

            async def retention_first(page: PageRead, from_offset: int, **kw: Any) -> Any:
                assert plog.enforce_retention() > 0  # between the check and the read
                return await read_page(page, from_offset, **kw)

            for contiguous in (True, False):
                for i in range(12):  # segments of two: more than retention keeps
                    await api.append(0, info.stream_id, [b"%06d" % i + b"." * 44])
                start = plog.start_offset
                api._engine.read_page = retention_first  # type: ignore[method-assign]
                try:
                    with pytest.raises(
                        InvalidOffset,
                        match=rf"offset {start} was removed by retention; the stream starts at",
                    ):
                        await api.read(0, info.stream_id, start, 1 << 20, contiguous=contiguous)
                finally:
                    api._engine.read_page = read_page  # type: ignore[method-assign]
        finally:
            await api.close()

    asyncio.run(main())


def test_a_long_poll_ends_when_its_stream_is_deleted(tmp_path: Path) -> None:
    """A Kafka Fetch parked on min_bytes waited its whole max_wait (up to 30 s) after its
    topic was deleted; Kafka completes a delayed fetch of a deleted topic at once."""

    async def main() -> None:
        api = await EngineAPI.open(
            tmp_path, EngineConfig(maintenance_interval_ms=0), KindsConfig(), AuthConfig()
        )
        try:
            info = await api.create_stream(0, "gone")
            stream = api._engine.stream(0, info.stream_id)
            listening = len(stream.delete_listeners)
            parked = asyncio.ensure_future(api.wait_readable(0, info.stream_id, 0, 0, 60.0))
            await asyncio.sleep(0)  # one loop turn: the task runs to its wait (no await before)
            assert not parked.done()
            await api.delete_stream(0, info.stream_id)
            async with asyncio.timeout(10):  # the wait's own timeout is 60 s
                assert await parked  # woken: the caller asks again and hears it is gone
            assert len(stream.delete_listeners) == listening
        finally:
            await api.close()

    asyncio.run(main())
