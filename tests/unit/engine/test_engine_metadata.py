"""Stream creation's commit point, the stream quota and the data directory lock, at the
engine (the server-level tests are tests/integration/test_stream_limits.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from headwater.engine.engine import Engine, EngineConfig, Stream, Tenant
from headwater.errors import StorageError, StreamQuotaExceeded

CONFIG = EngineConfig(maintenance_interval_ms=0, tenants={0: "default", 1: "other"})


def test_a_create_that_fails_after_its_rename_leaves_no_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = Engine._open_stream

    def failing_open(self: Engine, tenant: Tenant, path: Path, meta: dict[str, Any]) -> Stream:
        if meta["name"] == "doomed":
            assert path.is_dir()  # renamed into place: past the commit point
            raise OSError(24, "Too many open files")
        return real_open(self, tenant, path, meta)

    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        monkeypatch.setattr(Engine, "_open_stream", failing_open)
        with pytest.raises(OSError, match="Too many open files"):
            await engine.create_stream(0, "doomed")
        monkeypatch.setattr(Engine, "_open_stream", real_open)
        streams = tmp_path / "tenants/0/streams"
        assert sorted(p.name for p in streams.iterdir()) == []
        kept = await engine.create_stream(0, "kept")
        await engine.close()
        engine = await Engine.open(tmp_path, CONFIG)
        try:
            assert [s.name for s in engine.list_streams(0)] == ["kept"]
            assert kept.stream_id == engine.stream_by_name(0, "kept").stream_id
            await engine.create_stream(0, "doomed")  # the name was never taken
        finally:
            await engine.close()

    asyncio.run(main())


def test_the_stream_quota_counts_creates_under_way_per_tenant(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, dataclasses.replace(CONFIG, max_streams_per_tenant=3))
        try:
            results = await asyncio.gather(
                *(engine.create_stream(0, f"s{i}") for i in range(6)), return_exceptions=True
            )
            refused = [r for r in results if isinstance(r, StreamQuotaExceeded)]
            assert len(refused) == 3 and len(engine.list_streams(0)) == 3, results
            assert engine.stream_quota_refusals == 3
            await engine.create_stream(1, "s0")  # another tenant counts apart
            await engine.create_stream(0, "hw_internal", internal=True)  # never refused
            await engine.delete_stream(0, engine.stream_by_name(0, "s0").stream_id)
            with pytest.raises(StreamQuotaExceeded, match="max_streams_per_tenant"):
                await engine.create_stream(0, "s9")  # the internal stream counts
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_second_engine_on_one_data_dir_is_refused_until_the_first_closes(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        first = await Engine.open(tmp_path, CONFIG)
        with pytest.raises(StorageError, match="in use by another headwater process"):
            await Engine.open(tmp_path, CONFIG)
        await first.close()
        second = await Engine.open(tmp_path, CONFIG)
        await second.close()

    asyncio.run(main())
