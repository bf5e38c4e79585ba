"""`headwater serve`: the front ends a server starts, and the process around it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from headwater.server.app import ListenerFactory, Server, setup_logging, tune_gc
from headwater.server.config import ServerConfig
from headwater.server.convergedb.listener import start_convergedb
from headwater.server.http.listener import start_http
from headwater.server.kafka.listener import start_kafka
from headwater.server.kimberlite.listener import start_kimberlite
from headwater.server.memory import tune_malloc
from headwater.server.postgres.listener import start_postgres
from headwater.server.ripple.listener import start_ripple
from headwater.server.rivven.listener import start_rivven

FRONT_ENDS: dict[str, ListenerFactory] = {
    "convergedb": start_convergedb,
    "http": start_http,
    "kafka": start_kafka,
    "kimberlite": start_kimberlite,
    "postgres": start_postgres,
    "ripple": start_ripple,
    "rivven": start_rivven,
}
"""Every front end, by its key in ``[listen]`` and in the ports file."""


def serve(data_dir: Path, config: ServerConfig, ports_file: Path | None) -> int:
    setup_logging(config.log_level, config.log_format)
    tune_gc()
    tune_malloc()
    server = Server(data_dir, config, ports_file, FRONT_ENDS)
    try:
        import uvloop
    except ImportError:  # uvloop is optional off Linux/macOS
        asyncio.run(server.run())
    else:
        uvloop.run(server.run())
    return 0
