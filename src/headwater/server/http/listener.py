"""Start and stop the HTTP listener (``[listen] http``, default 127.0.0.1:7400)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from headwater.server.app import Listener
from headwater.server.http import api, dashboard, history, overview, ws
from headwater.server.http.app import (
    MAX_BODY_BYTES,
    METRICS_KEY,
    PROTOCOL,
    SERVER_KEY,
    errors_middleware,
    throttle_middleware,
)
from headwater.server.http.connections import LimitedAppRunner
from headwater.server.metrics import metrics_for
from headwater.server.tls import listen

if TYPE_CHECKING:
    from headwater.server.app import Server

SHUTDOWN_SECONDS = 10.0
# aiohttp's own bounds on a request's head (these are its defaults, named here: a longer
# request line or header, or more headers, is a 400 before any handler runs).
MAX_LINE_BYTES = 8190
MAX_FIELD_BYTES = 8190
MAX_HEADERS = 128
# How long a body the handler did not read (a refused upload) is read and discarded so
# the client sees the answer before the connection closes.
LINGER_SECONDS = 2.0


def build_app(server: Server) -> web.Application:
    """The application of ``server``: REST API, ``/metrics``, the Kiwi gateway
    ``/ws`` and the dashboard."""
    app = web.Application(
        middlewares=[throttle_middleware, errors_middleware], client_max_size=MAX_BODY_BYTES
    )
    app[SERVER_KEY] = server
    app[METRICS_KEY] = metrics_for(server)
    for routes in (api.ROUTES, overview.ROUTES, history.ROUTES, dashboard.ROUTES):
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
    app.cleanup_ctx.append(history.sampling)
    ws.add_routes(app)
    return app


async def start_http(server: Server, host: str, port: int) -> Listener:
    app = build_app(server)
    limits = server.config.limits
    runner = LimitedAppRunner(
        app,
        server.limits,
        # No access log: a request line may carry ?token= (WebSocket upgrades).
        access_log=None,
        shutdown_timeout=SHUTDOWN_SECONDS,
        keepalive_timeout=limits.idle_timeout_s,
        max_line_size=MAX_LINE_BYTES,
        max_field_size=MAX_FIELD_BYTES,
        max_headers=MAX_HEADERS,
        lingering_time=LINGER_SECONDS,
    )
    await runner.setup()
    assert runner.server is not None
    # Bound as the TCP front ends are: with [tls], HTTPS (and so wss:// for /ws), each
    # failed handshake one warning line.
    listening = await listen(server, PROTOCOL, runner.server, host, port)
    bound = int(listening.sockets[0].getsockname()[1])

    def open_connections() -> int:
        # A /ws connection is counted once, as Kiwi's (max_connections counts it once;
        # Grafana's connections panel sums every protocol).
        web_server = runner.server
        if web_server is None:
            return 0
        return len(web_server.connections) - len(app[ws.GATEWAY_KEY].sessions)

    metrics_for(server).add_connections_source(PROTOCOL, open_connections)

    async def stop() -> None:
        listening.close()  # stop accepting
        # Lets in-flight requests finish (bounded), closes the rest.
        await runner.cleanup()
        await listening.wait_closed()

    return Listener(PROTOCOL, bound, stop)
