"""TCP proxies a test can cut and heal: a network cut between one node and etcd, its
clients or its peers, without root or network namespaces.

A :class:`Proxy` listens on a port of its own and forwards each connection to a target
looked up when the connection arrives (a node's port may be known only once it runs).
``cut()`` behaves as a network that drops every packet: bytes already in flight and any
sent later go nowhere, in either direction, on open connections and on new ones, and
nobody is told (no reset), so each side finds out by its own timeouts, as over a real
cut. ``heal()`` closes the connections held through the cut (by then a real
connection would have timed out, or the peer given up on it) and forwards new ones
again.

All proxies of a test share one event loop in a thread of their own (:class:`Proxies`),
so the test's own code stays synchronous."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

Target = Callable[[], tuple[str, int]]


class Proxy:
    def __init__(self, loop: asyncio.AbstractEventLoop, target: Target, name: str) -> None:
        self.name = name
        self.port = 0
        self._loop = loop
        self._target = target
        self._cut = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0  # accepted since start: a test can see a client arrive

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        self._call(self._set_cut, True)

    def heal(self) -> None:
        self._call(self._set_cut, False)

    def _call(self, func: Callable[..., Any], *args: Any) -> Any:
        async def run() -> Any:
            return func(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def _set_cut(self, cut: bool) -> None:
        self._cut = cut
        if not cut:
            for writer in list(self._writers):
                writer.close()  # both ends of every pair: each side sees it closed
            self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            if self._cut:
                # A connection attempt across a cut: held, answered never.
                with contextlib.suppress(ConnectionError, OSError):
                    while await reader.read(1 << 16):
                        pass
                return
            host, port = self._target()
            try:
                up_reader, upstream = await asyncio.open_connection(host, port)
            except OSError:
                return  # nothing listens there (the node is down): refused, as direct
            self._writers.add(upstream)
            await asyncio.gather(
                self._pump(reader, upstream), self._pump(up_reader, writer), return_exceptions=True
            )
        finally:
            for end in (writer, upstream):
                if end is not None:
                    self._writers.discard(end)
                    end.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                if self._cut:
                    continue  # dropped on the floor
                writer.write(data)
                await writer.drain()
        finally:
            # One side closed: so does the other (unless cut: a cut tells nobody).
            if not self._cut:
                writer.close()

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()


class Proxies:
    """The event loop (a daemon thread) every proxy of a test runs on."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.all: list[Proxy] = []

    def add(self, target: Target, name: str) -> Proxy:
        proxy = Proxy(self._loop, target, name)
        future: Future[None] = asyncio.run_coroutine_threadsafe(proxy._start(), self._loop)
        future.result(10)
        self.all.append(proxy)
        return proxy

    def close(self) -> None:
        for proxy in self.all:
            asyncio.run_coroutine_threadsafe(proxy._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@contextlib.contextmanager
def proxies() -> Iterator[Proxies]:
    running = Proxies()
    try:
        yield running
    finally:
        running.close()
