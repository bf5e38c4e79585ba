"""`headwater serve`: start-up, listeners, ports file and graceful shutdown.

Start-up order: recover the engine, start every configured listener, then write the ports
file, so a process that sees the file can connect to every port in it. SIGTERM/SIGINT:
stop accepting, let in-flight appends finish, fsync, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from headwater.api import EngineAPI, SqlLimits
from headwater.cluster.node import ClusterNode
from headwater.cluster.peers import PeerSecurity
from headwater.server.config import ServerConfig
from headwater.server.limits import ConnectionLimits
from headwater.server.memory import warn_if_over_budget
from headwater.server.metrics import metrics_for
from headwater.server.tls import context_for

log = logging.getLogger("headwater.server")


class Listener:
    """A started front end: its bound port and how to stop it."""

    def __init__(self, name: str, port: int, stop: Callable[[], Awaitable[None]]) -> None:
        self.name = name
        self.port = port
        self.stop = stop


class ListenError(Exception):
    """A listener could not bind its address (a port in use, a host not ours): start-up
    stops, and ``headwater serve`` says so in one line naming the way to change it."""

    def __init__(self, listener: str, host: str, port: int, cause: OSError) -> None:
        # uvloop and asyncio wrap the OS error in their own sentence; the errno's own
        # text ("address already in use") is the part a user needs.
        # A name lookup's failure carries a getaddrinfo code, not an errno: its own text
        # ("Name or service not known"; os.strerror(-2) said "unknown error -2").
        if isinstance(cause, socket.gaierror):
            reason = cause.strerror or str(cause)
        else:
            reason = os.strerror(cause.errno) if cause.errno else str(cause)
        reason = reason[:1].lower() + reason[1:]
        shown = f"[{host}]" if ":" in host else host
        super().__init__(
            f"cannot listen for {listener} on {shown}:{port}: {reason} (change it with "
            f"--listen {listener}=HOST:PORT or [listen] in the config)"
        )
        self.listener = listener


# factory(server, host, port) -> Listener; headwater.server.serve names every front end.
ListenerFactory = Callable[["Server", str, int], Awaitable[Listener]]


class Server:
    """One running server: the engine API and the front ends started over it.

    Front ends get the server for its config, its listeners' ports and its metrics, and
    reach the engine only through :attr:`api`."""

    def __init__(
        self,
        data_dir: Path,
        config: ServerConfig,
        ports_file: Path | None = None,
        front_ends: dict[str, ListenerFactory] | None = None,
    ):
        self.data_dir = data_dir
        self.config = config
        self.ports_file = ports_file
        self.front_ends = front_ends or {}
        self._api: EngineAPI | None = None
        self.listeners: list[Listener] = []
        self.stopping = asyncio.Event()
        self.started_at = time.time()
        self.limits = ConnectionLimits(config.limits, metrics_for(self))
        self.cluster: ClusterNode | None = None  # with [cluster]: this node's part in it

    @property
    def api(self) -> EngineAPI:
        assert self._api is not None, "server not started"
        return self._api

    @property
    def started(self) -> bool:
        return self._api is not None

    def _forget_ports(self) -> None:
        """No ports file while the server is not serving: one left by the previous run
        named its dead ports to whatever waited for the file to appear."""
        if self.ports_file is not None:
            self.ports_file.unlink(missing_ok=True)
            self.ports_file.with_name(self.ports_file.name + ".tmp").unlink(missing_ok=True)

    async def start(self) -> None:
        limits = self.config.limits
        warn_if_over_budget(self.config)  # before opening: a log line even if that fails
        self._api = await EngineAPI.open(
            self.data_dir,
            dataclasses.replace(
                self.config.engine,
                open_files=limits.open_files,
                max_streams_per_tenant=limits.max_streams_per_tenant,
            ),
            self.config.kinds,
            self.config.auth,
            SqlLimits(
                timeout_ms=limits.sql_timeout_ms,
                memory_mib=limits.sql_memory_mib,
                concurrency=limits.sql_concurrency,
                spill_mib=limits.sql_spill_mib,
                result_mib=limits.sql_result_mib,
            ),
            on_sql_limit=lambda limit: self.limits.refused(limit, "sql"),
            quotas=self.config.quotas,
            clustered=self.config.cluster is not None,
        )
        # The data directory is this server's now (its lock held): so is its ports file.
        # Before the lock, a second server refused the directory took the live one's.
        self._forget_ports()
        # A deleted stream's series leave /metrics (they grew with every stream made).
        self._api.on_stream_deleted(metrics_for(self).forget_stream)
        if self.config.cluster is not None:
            # Nor is anything stored before the node knows what it leads (docs/cluster.md).
            self._api.cluster_gate.refuse_appends("this node is joining its cluster")
            # Made before the listeners bind: a front end that takes it at connect (the
            # Kafka session) would otherwise, connected while the node joins, answer as
            # a single node for the connection's life (broker 0, leader of everything).
            self.cluster = ClusterNode(
                self.config.cluster,
                self._api,
                PeerSecurity.of(
                    self.config.cluster, self.limits, context_for(self), self.config.tls
                ),
            )
        # Kimberlite starts last: its Handshake advertises the other listeners' ports.
        for name, factory in sorted(
            self.front_ends.items(), key=lambda item: item[0] == "kimberlite"
        ):
            address = self.config.address(name)
            if address is None:
                continue
            try:
                listener = await factory(self, *address)
            except OSError as exc:
                raise ListenError(name, *address, exc) from None
            self.listeners.append(listener)
            log.info(
                "listening", extra={"listener": name, "host": address[0], "port": listener.port}
            )
        if self.cluster is not None:
            # Joined once the listeners are bound: the node's key advertises their ports.
            await self.cluster.start({lst.name: lst.port for lst in self.listeners})
        if self.ports_file is not None:
            ports = {lst.name: lst.port for lst in self.listeners}
            tmp = self.ports_file.with_name(self.ports_file.name + ".tmp")
            tmp.write_text(json.dumps(ports))
            os.replace(tmp, self.ports_file)
        log.info("headwater ready", extra={"data_dir": str(self.data_dir)})

    async def stop(self) -> None:
        log.info("shutting down")
        if self._api is not None:  # it took the data directory: the ports file is its
            with contextlib.suppress(OSError):  # its directory gone: nothing to take back
                self._forget_ports()
        if self.cluster is not None:
            # First: leadership moves to the other nodes while this one drains.
            await self.cluster.stop()
        if self._api is not None:
            # First: a running query would hold its front end's drain for its whole run.
            self._api.stop_queries()
            await self._api.close_subscriptions()
        # Reads waiting for room in the answer budget go on: their drain is not held.
        self.limits.answers.close()
        for listener in reversed(self.listeners):
            try:
                await listener.stop()
            except Exception:
                log.exception("stopping listener %s failed", listener.name)
        if self._api is not None:
            await self._api.close()
        log.info("stopped cleanly")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        try:
            await self.start()
        except BaseException:
            # A listener that could not bind: close what did start (the engine, the
            # listeners before it) as a shutdown would, then let serve report it.
            await self.stop()
            raise
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
