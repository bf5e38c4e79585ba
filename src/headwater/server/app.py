"""`headwater serve`: start-up, listeners, ports file and graceful shutdown.

Start-up order: recover the engine, start every configured listener, then write the ports
file, so a process that sees the file can connect to every port in it. SIGTERM/SIGINT:
stop accepting, let in-flight appends finish, fsync, exit 0.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from headwater.engine.engine import Engine
from headwater.engine.kinds import KindsEngine
from headwater.engine.subscriptions import CloseReason, Subscriptions
from headwater.server.config import ServerConfig
from headwater.sql.kinds import KindTables
from headwater.sql.service import SqlService

log = logging.getLogger("headwater.server")


class Listener:
    """A started front end: its bound port and how to stop it."""

    def __init__(self, name: str, port: int, stop: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        self.port = port
        self.stop = stop


# name -> factory(server, host, port) -> Listener; each protocol issue adds its own.
ListenerFactory = Callable[["Server", str, int], Awaitable[Listener]]
LISTENERS: dict[str, ListenerFactory] = {}


def register_listener(name: str, factory: ListenerFactory) -> None:
    LISTENERS[name] = factory


class Server:
    def __init__(self, data_dir: Path, config: ServerConfig, ports_file: Path | None = None):
        self.data_dir = data_dir
        self.config = config
        self.ports_file = ports_file
        self.engine: Engine | None = None
        self._kinds: KindsEngine | None = None
        self._subscriptions: Subscriptions | None = None
        self._sql: SqlService | None = None
        self.listeners: list[Listener] = []
        self.stopping = asyncio.Event()
        self.started_at = time.time()

    @property
    def subscriptions(self) -> Subscriptions:
        assert self._subscriptions is not None, "server not started"
        return self._subscriptions

    @property
    def kinds(self) -> KindsEngine:
        assert self._kinds is not None, "server not started"
        return self._kinds

    @property
    def sql(self) -> SqlService:
        assert self._sql is not None, "server not started"
        return self._sql

    async def start(self) -> None:
        self.engine = await Engine.open(self.data_dir, self.config.engine)
        self._subscriptions = Subscriptions(self.engine)
        self._kinds = await KindsEngine.open(self.engine, self.config.kinds)
        self._sql = SqlService(self.engine)
        self._sql.add_source(KindTables(self._kinds))
        self._sql.start()
        # Kimberlite starts last: its Handshake advertises the other listeners' ports.
        for name, factory in sorted(LISTENERS.items(), key=lambda item: item[0] == "kimberlite"):
            address = self.config.address(name)
            if address is None:
                continue
            listener = await factory(self, *address)
            self.listeners.append(listener)
            log.info(
                "listening", extra={"listener": name, "host": address[0], "port": listener.port}
            )
        if self.ports_file is not None:
            ports = {lst.name: lst.port for lst in self.listeners}
            tmp = self.ports_file.with_name(self.ports_file.name + ".tmp")
            tmp.write_text(json.dumps(ports))
            os.replace(tmp, self.ports_file)
        log.info("headwater ready", extra={"data_dir": str(self.data_dir)})

    async def stop(self) -> None:
        log.info("shutting down")
        if self._subscriptions is not None:
            await self._subscriptions.close_all(CloseReason.SERVER_SHUTDOWN)
        for listener in reversed(self.listeners):
            try:
                await listener.stop()
            except Exception:
                log.exception("stopping listener %s failed", listener.name)
        if self._sql is not None:
            await self._sql.close()
        if self._kinds is not None:
            await self._kinds.close()
        if self.engine is not None:
            await self.engine.close()
        log.info("stopped cleanly")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        await self.start()
        await self.stopping.wait()
        await self.stop()


class _JsonFormatter(logging.Formatter):
    _skip = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in self._skip})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class _TextFormatter(logging.Formatter):
    _skip = _JsonFormatter._skip

    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(f"{k}={v}" for k, v in record.__dict__.items() if k not in self._skip)
        line = (
            f"{self.formatTime(record, '%Y-%m-%dT%H:%M:%S')} {record.levelname:<7} "
            f"{record.name}: {record.getMessage()}"
        )
        if extras:
            line += f" {extras}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def serve(data_dir: Path, config: ServerConfig, ports_file: Path | None) -> int:
    setup_logging(config.log_level, config.log_format)
    _load_front_ends()
    tune_gc()
    server = Server(data_dir, config, ports_file)
    try:
        import uvloop
    except ImportError:  # uvloop is optional off Linux/macOS
        asyncio.run(server.run())
    else:
        uvloop.run(server.run())
    return 0


def tune_gc() -> None:
    """Make the cyclic GC fit a server holding large live state.

    Entity state, windows and notifications are many small container objects that live
    for a window or longer; with CPython's default first threshold (700) young
    collections run every few hundred writes and promote each survivor twice, which cost
    ~40 % of the CPU of a BATCH of ASSERTs (benchmarks/kinds_bench.py). Garbage here is
    freed by reference counting; cycles are rare, so collecting less often loses nothing
    but a little memory. What was loaded at start (modules, config) is frozen out of
    every collection."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 10)


def _load_front_ends() -> None:
    """Import the protocol front ends; each registers its listener."""
    import headwater.server.convergedb.listener
    import headwater.server.http.listener
    import headwater.server.kimberlite.listener
    import headwater.server.ripple.listener  # noqa: F401
