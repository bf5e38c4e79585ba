"""``GET /ws``: the Kiwi WebSocket gateway (spec/PROTOCOLS.md §3, docs/protocols/kiwi.md).

Authentication happens before the upgrade, as for every REST route, except that the
token may also come as ``?token=`` (browsers cannot set headers on a WebSocket): a
refused request gets the usual JSON error and no WebSocket.
"""

from __future__ import annotations

import socket

from aiohttp import web

from headwater.errors import InvalidRequest
from headwater.server.http.app import METRICS_KEY, SERVER_KEY, tenant_of
from headwater.server.kiwi.gateway import Gateway
from headwater.server.kiwi.session import KiwiSession

GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("headwater_kiwi_gateway")


async def kiwi_socket(request: web.Request) -> web.StreamResponse:
    tenant_id = tenant_of(request, query_token=True)
    gateway = request.app[GATEWAY_KEY]
    ws = web.WebSocketResponse(
        compress=False,  # frames are written pre-built, shared by every subscriber
        max_msg_size=gateway.config.max_message_bytes,
        timeout=2.0,
    )
    if not ws.can_prepare(request).ok:
        raise InvalidRequest("GET /ws needs a WebSocket upgrade")
    await ws.prepare(request)
    if gateway.config.socket_send_buffer is not None and request.transport is not None:
        # A smaller kernel buffer makes a stalled browser reach the send queue's bound
        # (and LAG) sooner, instead of parking megabytes per connection in the kernel.
        sock = request.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, gateway.config.socket_send_buffer)
    session = KiwiSession(gateway, request, ws, tenant_id)
    gateway.sessions.add(session)
    try:
        await session.run()
    finally:
        gateway.sessions.discard(session)
        session.release()
    if not ws.closed:
        await ws.close()
    return ws


async def _start(app: web.Application) -> None:
    app[GATEWAY_KEY].start()


async def _shutdown(app: web.Application) -> None:
    await app[GATEWAY_KEY].shutdown()


def add_routes(app: web.Application) -> None:
    app[GATEWAY_KEY] = Gateway(app[SERVER_KEY], app[METRICS_KEY])
    app.router.add_route("GET", "/ws", kiwi_socket)
    app.on_startup.append(_start)
    app.on_shutdown.append(_shutdown)
