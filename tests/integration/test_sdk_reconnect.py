"""Retries, lost connections and reconnects.

A scripted in-process Kimberlite server (built on the codec's ServerConnection) makes
errors and dropped connections happen exactly when wanted; a real ``headwater serve``
is restarted (SIGTERM, then started again on the same port and data directory) to check
that clients and subscriptions carry on.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import headwater
from headwater.client import Client, ConnectionLost, Event, ServerUnavailable
from headwater.errors import ProjectionLag, RateLimited, StorageError
from headwater.protocols.kimberlite import messages as m
from headwater.protocols.kimberlite.connection import Reject, Reply, ServerConnection
from waiting import wait_until_async

FAST = {"backoff_base": 0.001, "backoff_max": 0.01}
CAPABILITIES = ["query", "append", "subscribe", "query_at", "sync", "idempotent_append", "admin"]

Action = m.ResponsePayload | str | None
"""What the scripted server does with a request: answer it, "close" the connection, or
stay silent (None)."""


def error(exc_type: type[Exception], message: str = "scripted") -> m.ErrorResponse:
    return m.ErrorResponse(exc_type.code, message)  # type: ignore[attr-defined]


class ScriptedServer:
    """A Kimberlite server on a thread whose answers come from ``script``."""

    def __init__(self, script: Callable[[int, m.RequestPayload], Action]) -> None:
        self.script = script
        self.requests: list[tuple[int, m.RequestPayload]] = []
        self.connections = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        assert self._ready.wait(10)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0)
        )
        self.port = self.server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def seen(self, kind: type) -> list[tuple[int, Any]]:
        return [(c, p) for c, p in self.requests if isinstance(p, kind)]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = self.connections
        self.connections += 1
        codec = ServerConnection()
        try:
            while data := await reader.read(1 << 16):
                for event in codec.receive_data(data):
                    if isinstance(event, Reply | Reject):
                        writer.write(event.data)
                        continue
                    if not isinstance(event, m.Request):
                        return
                    if isinstance(event.payload, m.HandshakeRequest):
                        reply: Action = m.HandshakeResponse(1, True, CAPABILITIES)
                    else:
                        self.requests.append((index, event.payload))
                        reply = self.script(index, event.payload)
                    if reply == "close":
                        return
                    if isinstance(reply, str):
                        raise AssertionError(reply)
                    if reply is not None:
                        writer.write(codec.send(m.Response(event.id, reply)))
        finally:
            writer.close()

    def stop(self) -> None:
        if self.loop.is_closed():
            return

        async def shutdown() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def scripted() -> Iterator[Callable[[Callable[[int, m.RequestPayload], Action]], ScriptedServer]]:
    servers: list[ScriptedServer] = []

    def make(script: Callable[[int, m.RequestPayload], Action]) -> ScriptedServer:
        server = ScriptedServer(script)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


QUERY_OK = m.QueryResponse(["x"], [[1]])


def test_retryable_errors_are_retried_with_backoff_for_safe_requests(scripted: Any) -> None:
    answers = iter([error(ProjectionLag), error(RateLimited), QUERY_OK])
    server = scripted(lambda conn, payload: next(answers))
    with headwater.connect(server.address, **FAST) as hw:
        assert hw.query("SELECT 1").rows == [(1,)]
        assert hw.retried == 2
    assert len(server.seen(m.QueryRequest)) == 3


def test_retries_are_bounded(scripted: Any) -> None:
    server = scripted(lambda conn, payload: error(ProjectionLag, "still lagging"))
    with headwater.connect(server.address, retries=3, **FAST) as hw:
        with pytest.raises(ProjectionLag, match="still lagging") as exc_info:
            hw.read(1, 0)
        assert exc_info.value.retryable
    assert len(server.seen(m.ReadEventsRequest)) == 4  # the first try and 3 retries


def test_plain_append_is_never_retried(scripted: Any) -> None:
    server = scripted(lambda conn, payload: error(RateLimited, "slow down"))
    with headwater.connect(server.address, **FAST) as hw, pytest.raises(RateLimited):
        hw.append(1, [b"once"])
    assert len(server.seen(m.AppendEventsRequest)) == 1


def test_idempotent_append_is_retried_on_retryable_errors(scripted: Any) -> None:
    answers = iter([error(StorageError), m.AppendEventsResponse(5, 2)])
    server = scripted(lambda conn, payload: next(answers))
    with headwater.connect(server.address, **FAST) as hw:
        assert hw.append_idempotent(1, 77, 3, [b"a", b"b"]) == (5, 2)
    sent = [p for _, p in server.seen(m.AppendIdempotentRequest)]
    assert len(sent) == 2
    assert {(p.producer_id, p.sequence, tuple(p.events.values())) for p in sent} == {
        (77, 3, (b"a", b"b"))
    }


def test_in_flight_append_raises_connection_lost_and_is_not_resent(scripted: Any) -> None:
    def script(conn: int, payload: m.RequestPayload) -> Action:
        if isinstance(payload, m.AppendEventsRequest):
            return "close"  # the server may or may not have stored it: the client can't know
        return m.StreamsResponse([])

    server = scripted(script)
    with headwater.connect(server.address, **FAST) as hw:
        with pytest.raises(ConnectionLost, match="may or may not have been applied") as exc_info:
            hw.append(1, [b"maybe"])
        assert exc_info.value.maybe_applied
        assert isinstance(exc_info.value, ConnectionError)
        assert hw.list_streams() == []  # the next request reconnects
        assert hw.reconnects == 1
    assert len(server.seen(m.AppendEventsRequest)) == 1
    assert server.connections == 2


def test_in_flight_safe_requests_are_resent_after_reconnect(scripted: Any) -> None:
    def script(conn: int, payload: m.RequestPayload) -> Action:
        if conn == 0:
            return "close"
        if isinstance(payload, m.AppendIdempotentRequest):
            return m.AppendEventsResponse(9, 1)
        return QUERY_OK

    server = scripted(script)
    with headwater.connect(server.address, **FAST) as hw:
        assert hw.query("SELECT 1").rows == [(1,)]
        assert hw.reconnects == 1
    server2 = scripted(script)
    with headwater.connect(server2.address, **FAST) as hw:
        assert hw.append_idempotent(1, 1, 0, [b"x"]) == (9, 1)
    assert [c for c, _ in server2.seen(m.AppendIdempotentRequest)] == [0, 1]


def test_requests_of_many_coroutines_fail_or_resume_together(scripted: Any) -> None:
    """A connection dropped with many requests in flight: the safe ones come back on
    the new connection, the appends raise ConnectionLost (never resent)."""

    def script(conn: int, payload: m.RequestPayload) -> Action:
        if conn == 0:
            return None if len(server.requests) < 40 else "close"
        return QUERY_OK

    server = scripted(script)

    async def main() -> None:
        hw = await headwater.connect_async(server.address, **FAST)
        queries = [asyncio.ensure_future(hw.query("SELECT 1")) for _ in range(20)]
        appends = [asyncio.ensure_future(hw.append(1, [b"x"])) for _ in range(20)]
        results = await asyncio.gather(*queries, *appends, return_exceptions=True)
        assert all(isinstance(r, headwater.client.QueryResult) for r in results[:20])
        assert all(isinstance(r, ConnectionLost) and r.maybe_applied for r in results[20:])
        assert hw.reconnects == 1
        await hw.close()

    asyncio.run(main())
    assert len([c for c, _ in server.seen(m.AppendEventsRequest)]) == 20


def test_reconnect_off_reports_the_lost_connection(scripted: Any) -> None:
    server = scripted(lambda conn, payload: "close")
    with headwater.connect(server.address, reconnect=False) as hw:
        with pytest.raises(ConnectionLost):
            hw.query("SELECT 1")
        with pytest.raises(ConnectionLost, match="reconnect is off"):
            hw.query("SELECT 1")
    assert server.connections == 1


def test_reconnect_gives_up_with_server_unavailable(scripted: Any) -> None:
    server = scripted(lambda conn, payload: QUERY_OK)
    hw = headwater.connect(server.address, reconnect_attempts=3, **FAST)
    try:
        server.stop()

        async def drop() -> None:
            assert hw.aio._conn is not None
            hw.aio._conn.abort()

        hw.submit(drop()).result(5)
        with pytest.raises(ServerUnavailable, match="could not reconnect in 3 attempts"):
            hw.query("SELECT 1")
    finally:
        hw.close()


# ---- a real server, restarted ------------------------------------------------------------


def _collect(sub: Any, count: int, timeout: float = 20.0) -> list[Event]:
    got: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += sub.next_batch(timeout=0.5)
    return got


def test_client_and_subscription_survive_a_server_restart(
    make_server: Any, unused_port: int
) -> None:
    server = make_server(port=unused_port)
    hw: Client = headwater.connect(server.address)
    try:
        hw.create_stream("restarts")
        hw.append("restarts", [f"{i}".encode() for i in range(10)])
        sub = hw.subscribe("restarts", 0, credits=8).start()
        assert [e.offset for e in _collect(sub, 10)] == list(range(10))

        server.restart()  # SIGTERM, then the same data directory and port

        # Nothing was in flight: the append goes out on the new connection.
        assert hw.append("restarts", [f"{i}".encode() for i in range(10, 30)]) == (10, 20)
        assert hw.reconnects == 1
        after = _collect(sub, 20)
        # The subscription re-subscribed from the next offset it had not seen.
        assert [e.offset for e in after] == list(range(10, 30))
        assert [e.value for e in after] == [f"{i}".encode() for i in range(10, 30)]
        assert sub.resubscribes == 1
        assert sub.next_batch(timeout=0.1) == []  # no duplicates
        assert [e.value for e in hw.read("restarts").events] == [f"{i}".encode() for i in range(30)]
        sub.close()
    finally:
        hw.close()


def test_async_requests_wait_for_the_server_to_come_back(
    make_server: Any, unused_port: int
) -> None:
    server = make_server(port=unused_port)

    async def main() -> None:
        hw = await headwater.connect_async(server.address)
        await hw.create_stream("waits")
        server.stop()
        await wait_until_async(lambda: not hw.connected, message="the client missed the stop")
        restart = asyncio.get_running_loop().run_in_executor(None, server.start)
        # Issued while the server is down: sent once it is back (never written before).
        results = await asyncio.gather(
            hw.append("waits", [b"a"]), hw.query("SELECT 1"), hw.list_streams()
        )
        await restart
        assert results[0] == (0, 1)
        assert hw.reconnects == 1
        await hw.close()

    asyncio.run(main())
