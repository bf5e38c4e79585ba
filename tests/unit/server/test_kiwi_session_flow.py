"""A Kiwi session's flow control for commands: while its socket is paused (the peer is
not reading), the replies to commands it keeps sending wait in the outbox, and once the
outbox is full the session stops reading commands until the socket drains. A peer that
sends without reading costs the server a bounded outbox, not memory without end.
(In process, with a stand-in transport and WebSocket; plain asyncio.run.)"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from aiohttp import WSMsgType

from headwater.protocols.kiwi.messages import Request, encode_command
from headwater.server.kiwi.session import KiwiSession
from waiting import wait_until_async

SEND_QUEUE = 4
COMMANDS = 40


class Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def is_closing(self) -> bool:
        return False

    def writelines(self, frames: list[bytes]) -> None:
        self.written += frames


class Peer:
    """The WebSocket as the session reads it: COMMANDS REQUESTs for a source it never
    subscribed to (each answered REQUEST_ERROR), then a close."""

    def __init__(self) -> None:
        self.read = 0

    async def receive(self, timeout: float | None = None) -> Any:
        self.read += 1
        if self.read > COMMANDS:
            return SimpleNamespace(type=WSMsgType.CLOSE, data=None)
        command = encode_command(Request("nowhere", 1))
        return SimpleNamespace(type=WSMsgType.TEXT, data=command)


def replies(frames: list[bytes]) -> list[str]:
    return [json.loads(frame[2:])["type"] for frame in frames]


def session_with(drain: Any) -> tuple[KiwiSession, Transport, Any, Peer]:
    transport = Transport()
    protocol = SimpleNamespace(writing_paused=True)  # the peer is not reading
    request = SimpleNamespace(
        transport=transport, protocol=protocol, query={}, writer=SimpleNamespace(drain=drain)
    )
    config = SimpleNamespace(buffer_capacity=8, lag_notice_threshold=1, send_queue=SEND_QUEUE)
    limits = SimpleNamespace(idle_timeout_s=60.0)
    gateway = SimpleNamespace(
        config=config, server=SimpleNamespace(config=SimpleNamespace(limits=limits))
    )
    peer = Peer()
    session = KiwiSession(gateway, request, peer, 0)  # type: ignore[arg-type]
    return session, transport, protocol, peer


async def turns(n: int) -> None:
    """Let the loop run ``n`` times: a reader that could go on would have read more."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_commands_wait_while_the_outbox_is_full_and_the_socket_paused() -> None:
    async def main() -> None:
        drained: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def drain() -> None:
            await drained

        session, transport, protocol, peer = session_with(drain)
        reader = asyncio.create_task(session.run())
        # The first reply is written and pauses the socket; the next ones wait, and
        # once SEND_QUEUE of them do, the session stops reading commands.
        await wait_until_async(lambda: session.core.full, 10, "the outbox never filled")
        stopped_at = peer.read
        await turns(20)
        assert peer.read == stopped_at == 1 + SEND_QUEUE
        assert session.core.backlog == SEND_QUEUE
        assert replies(transport.written) == ["REQUEST_ERROR"]
        # The socket drains: the queued replies go out and reading resumes, to the end.
        protocol.writing_paused = False
        drained.set_result(None)
        await asyncio.wait_for(reader, 10)
        assert peer.read == COMMANDS + 1
        assert replies(transport.written) == ["REQUEST_ERROR"] * COMMANDS

    asyncio.run(main())


def test_a_connection_lost_while_draining_lets_the_reader_end() -> None:
    async def main() -> None:
        lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def drain() -> None:
            await lost

        session, _, _, peer = session_with(drain)
        reader = asyncio.create_task(session.run())
        await wait_until_async(lambda: session.core.full, 10, "the outbox never filled")
        lost.set_exception(ConnectionResetError("Connection lost"))
        # The reader is not left waiting for room that will never come: it reads on
        # (replies now go nowhere) and ends with the peer's close.
        await asyncio.wait_for(reader, 10)
        assert peer.read == COMMANDS + 1

    asyncio.run(main())


def test_a_connection_closed_cleanly_while_draining_lets_the_reader_end() -> None:
    """aiohttp ends a drain without an error when the connection closes cleanly: the
    transport is closing, nothing will ever drain, and the reader must not wait."""

    async def main() -> None:
        closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def drain() -> None:
            await closed

        session, transport, _, peer = session_with(drain)
        reader = asyncio.create_task(session.run())
        await wait_until_async(lambda: session.core.full, 10, "the outbox never filled")
        transport.is_closing = lambda: True  # type: ignore[method-assign]
        closed.set_result(None)
        await asyncio.wait_for(reader, 10)
        assert peer.read == COMMANDS + 1

    asyncio.run(main())
