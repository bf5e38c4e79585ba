"""EngineAPI behaviour the front ends rely on beyond the engine's own."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from headwater.api import AuthConfig, EngineAPI
from headwater.engine.engine import EngineConfig
from headwater.engine.kinds import KindsConfig


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
