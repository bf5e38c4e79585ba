"""The asyncio shell around a tenant's group coordinator, for every front end that
speaks a group protocol (Kafka's, Rivven's with headwater's additions).

The coordinator (engine/groups) is a pure state machine: a JoinGroup may have to wait for
the other members, so :class:`TenantGroups` keeps each pending join's future by member id
and resolves it when the coordinator hands out its reply (from another member's join or
leave, or from :meth:`GroupCoordinator.tick` at its next deadline: session and rebalance
timeouts, run by a ticker task). :class:`GroupShells` holds one per tenant for a
listener. Each listener has its own, so the members of one group should speak one
protocol: a join waiting on one listener is not answered by the other's ticker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from headwater.api import EngineAPI
from headwater.engine.groups import GroupCoordinator, Reply, SyncFailed, SyncResult


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class TenantGroups:
    def __init__(self, coordinator: GroupCoordinator) -> None:
        self.coordinator = coordinator
        # pending JoinGroups by member id (unique: the coordinator makes them)
        self.pending: dict[str, asyncio.Future[Reply]] = {}
        # pending SyncGroups waiting on the leader's (a group its leader assigns)
        self.syncs: dict[str, asyncio.Future[Reply]] = {}
        # what a front end keeps per (group, member): Kafka's protocol metadata
        self.metadata: dict[tuple[str, str], dict[str, bytes]] = {}
        # a group's protocol type as its members gave it (Kafka's "consumer", Connect's
        # "connect", ...), while it has members
        self.protocol_types: dict[str, str] = {}
        self.wake = asyncio.Event()
        self.ticker = asyncio.get_running_loop().create_task(self._tick_loop())

    def dispatch(self, replies: list[Reply]) -> None:
        for reply in replies:
            waiting = self.syncs if isinstance(reply, SyncResult | SyncFailed) else self.pending
            future = waiting.pop(reply.member_id, None)
            if future is not None and not future.done():
                future.set_result(reply)
        self.wake.set()  # the next deadline may have moved

    async def wait_join(self, member_id: str, replies: list[Reply]) -> Reply:
        """The reply to ``member_id``'s join (just made, which gave ``replies``)."""
        return await self._wait(self.pending, member_id, replies)

    async def wait_sync(self, member_id: str, replies: list[Reply]) -> Reply:
        """The reply to ``member_id``'s sync (just made, which gave ``replies``)."""
        return await self._wait(self.syncs, member_id, replies)

    async def _wait(
        self, waiting: dict[str, asyncio.Future[Reply]], member_id: str, replies: list[Reply]
    ) -> Reply:
        earlier = waiting.pop(member_id, None)
        if earlier is not None:
            earlier.cancel()
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        waiting[member_id] = future
        self.dispatch(replies)
        try:
            return await future
        finally:
            if waiting.get(member_id) is future:
                del waiting[member_id]

    async def _tick_loop(self) -> None:
        coordinator = self.coordinator
        while True:
            deadline = coordinator.next_deadline()
            timeout = None if deadline is None else max(0.0, (deadline - now_ms()) / 1000)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.wake.wait()
            self.wake.clear()
            replies = coordinator.tick()
            if replies:
                self.dispatch(replies)


class GroupShells:
    """One listener's :class:`TenantGroups`, made on first use."""

    def __init__(self, api: EngineAPI) -> None:
        self.api = api
        self.tenants: dict[int, TenantGroups] = {}

    async def tenant(self, tenant_id: int) -> TenantGroups:
        found = self.tenants.get(tenant_id)
        if found is None:
            coordinator = await self.api.groups.coordinator(tenant_id)
            found = self.tenants.get(tenant_id)
            if found is None:
                found = self.tenants[tenant_id] = TenantGroups(coordinator)
        return found

    async def close(self) -> None:
        for tenant in self.tenants.values():
            tenant.ticker.cancel()
            for future in (*tenant.pending.values(), *tenant.syncs.values()):
                future.cancel()
        self.tenants.clear()
