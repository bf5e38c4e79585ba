"""Sync: make everything the tenant has written durable, whatever the sync policy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from headwater.protocols.kimberlite import messages as m

if TYPE_CHECKING:
    from headwater.server.kimberlite.listener import KimberliteConnection


async def sync(
    conn: KimberliteConnection, request: m.Request, payload: m.SyncRequest
) -> m.ResponsePayload:
    await conn.api.sync_tenant(request.tenant_id)
    return m.SyncResponse(True)
