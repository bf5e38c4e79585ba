"""Shared helpers for the SQL tests: a real engine and SqlService in a temp directory."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from headwater.engine.engine import Engine, EngineConfig
from headwater.sql import SqlService
from headwater.storage.log import SyncPolicy

CONFIG = EngineConfig(maintenance_interval_ms=0, tenants={0: "default", 42: "acme"})
FAST = EngineConfig(
    maintenance_interval_ms=0, tenants={0: "default", 42: "acme"}, sync=SyncPolicy("none")
)


@asynccontextmanager
async def running(
    path: Path, config: EngineConfig = FAST, **service_args: Any
) -> AsyncIterator[tuple[Engine, SqlService]]:
    engine = await Engine.open(path, config)
    service = SqlService(engine, **service_args)
    service.start()
    try:
        yield engine, service
    finally:
        await service.close()
        await engine.close()


def js(**fields: Any) -> bytes:
    return json.dumps(fields).encode()
