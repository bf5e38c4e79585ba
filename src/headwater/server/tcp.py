"""The asyncio TCP listener every binary front end (Kimberlite, ConvergeDB, Ripple)
shares: bind, count connections (and subscriptions) in /metrics, and stop in order.

A front end gives a factory of its connections (asyncio protocols) and the set they
enter while open. Stopping: stop accepting, run the front end's ``drain`` (answers still
owed go out), close every connection, run ``finish`` (state saved once no connection
can change it), then wait for the server to close."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING, Protocol

from headwater.server.app import Listener
from headwater.server.metrics import metrics_for

if TYPE_CHECKING:
    from headwater.server.app import Server


class Connection(Protocol):
    def close(self) -> None: ...


async def start_tcp_listener(
    server: Server,
    name: str,
    host: str,
    port: int,
    make_connection: Callable[[], asyncio.Protocol],
    connections: Collection[Connection],
    *,
    subscriptions: Callable[[], int] | None = None,
    drain: Callable[[], Awaitable[None]] | None = None,
    finish: Callable[[], Awaitable[None]] | None = None,
) -> Listener:
    tcp = await asyncio.get_running_loop().create_server(
        make_connection, host, port, reuse_address=True
    )
    bound = int(tcp.sockets[0].getsockname()[1])
    metrics = metrics_for(server)
    metrics.add_connections_source(name, lambda: len(connections))
    if subscriptions is not None:
        metrics.add_subscriptions_source(name, subscriptions)

    async def stop() -> None:
        tcp.close()  # stop accepting
        if drain is not None:
            await drain()
        for conn in list(connections):
            conn.close()
        if finish is not None:
            await finish()
        await tcp.wait_closed()

    return Listener(name, bound, stop)
