"""A Kiwi session's flow control for commands: while its socket is paused (the peer is
not reading), the replies to commands it keeps sending wait in the outbox, and once the
outbox is full the session stops reading commands until the socket drains. A peer that
sends without reading costs the server a bounded outbox, not memory without end.
(In process, with a stand-in transport and WebSocket; plain asyncio.run.)"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any, Literal

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


class Room(asyncio.Event):
    """The session's room event, telling when the command reader starts waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.set()
        self.parked = asyncio.Event()

    async def wait(self) -> Literal[True]:
        if not self.is_set():
            self.parked.set()
        return await super().wait()


class Paused:
    """A session reading the peer's commands while its socket is paused: ``drained``
    is what the socket's drain waits for (a result: it drained; an error: it broke)."""

    def __init__(self) -> None:
        self.drained: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport = Transport()
        self.protocol = SimpleNamespace(writing_paused=True)  # the peer is not reading
        request = SimpleNamespace(
            transport=self.transport,
            protocol=self.protocol,
            query={},
            writer=SimpleNamespace(drain=self._drain),
        )
        config = SimpleNamespace(buffer_capacity=8, lag_notice_threshold=1, send_queue=SEND_QUEUE)
        limits = SimpleNamespace(idle_timeout_s=60.0)
        server = SimpleNamespace(config=SimpleNamespace(limits=limits))
        self.peer = Peer()
        self.session = KiwiSession(
            SimpleNamespace(config=config, server=server),  # type: ignore[arg-type]
            request,  # type: ignore[arg-type]
            self.peer,  # type: ignore[arg-type]
            0,
        )
        self.room = Room()  # the event the reader waits on while the outbox is full
        self.session._room = self.room
        self.reader = asyncio.create_task(self.session.run())

    async def _drain(self) -> None:
        await self.drained

    async def full(self) -> None:
        """The first reply was written and paused the socket; SEND_QUEUE more wait."""
        await wait_until_async(lambda: self.session.core.full, 10, "the outbox never filled")


def test_commands_wait_while_the_outbox_is_full_and_the_socket_paused() -> None:
    async def main() -> None:
        paused = Paused()
        await paused.full()
        # The reader parks on the room: it reads nothing more until the socket drains.
        await asyncio.wait_for(paused.room.parked.wait(), 10)
        assert paused.peer.read == 1 + SEND_QUEUE
        assert paused.session.core.backlog == SEND_QUEUE
        assert replies(paused.transport.written) == ["REQUEST_ERROR"]
        # The socket drains: the queued replies go out and reading resumes, to the end.
        paused.protocol.writing_paused = False
        paused.drained.set_result(None)
        await asyncio.wait_for(paused.reader, 10)
        assert paused.peer.read == COMMANDS + 1
        assert replies(paused.transport.written) == ["REQUEST_ERROR"] * COMMANDS

    asyncio.run(main())


def test_a_connection_lost_while_draining_lets_the_reader_end() -> None:
    async def main() -> None:
        paused = Paused()
        await paused.full()
        paused.drained.set_exception(ConnectionResetError("Connection lost"))
        # The reader is not left waiting for room that will never come: it reads on
        # (replies now go nowhere) and ends with the peer's close.
        await asyncio.wait_for(paused.reader, 10)
        assert paused.peer.read == COMMANDS + 1

    asyncio.run(main())


def test_a_connection_closed_cleanly_while_draining_lets_the_reader_end() -> None:
    """aiohttp ends a drain without an error when the connection closes cleanly: the
    transport is closing, nothing will ever drain, and the reader must not wait."""

    async def main() -> None:
        paused = Paused()
        await paused.full()
        paused.transport.is_closing = lambda: True  # type: ignore[method-assign]
        paused.drained.set_result(None)
        await asyncio.wait_for(paused.reader, 10)
        assert paused.peer.read == COMMANDS + 1

    asyncio.run(main())
