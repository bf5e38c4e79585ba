"""A per-tenant service opened once, on first use: the transaction coordinator's and the
consumer groups' state of each tenant (each replays an internal stream when opened)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from headwater.engine.engine import Engine

T = TypeVar("T")


class PerTenant(dict[int, T]):
    """Each tenant's opened service, by tenant id. :meth:`open` opens a tenant's at most
    once however many callers ask at the same time; the dict holds those opened."""

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self._engine = engine
        self._locks: dict[int, asyncio.Lock] = {}

    def lock(self, tenant_id: int) -> asyncio.Lock:
        """Held while the tenant's service is opened (and by whoever replaces it)."""
        return self._locks.setdefault(tenant_id, asyncio.Lock())

    async def open(self, tenant_id: int, opener: Callable[[], Awaitable[T]]) -> T:
        """The tenant's service, opened by ``opener`` if it is not yet (TenantNotFound
        for a tenant the engine does not have)."""
        found = self.get(tenant_id)
        if found is not None:
            return found
        self._engine.tenant(tenant_id)  # TenantNotFound
        async with self.lock(tenant_id):
            found = self.get(tenant_id)
            if found is None:
                found = self[tenant_id] = await opener()
            return found
