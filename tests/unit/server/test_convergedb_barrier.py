"""The HEARTBEAT write barrier of a ConvergeDB connection, in process (a real listener on
a loopback port, a raw client), when the kinds cannot keep a window: the barrier never
ACKs past a write of its connection that was lost, though the tenant's newest window
is durable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from failing_windows import FailingWrites, durable_awaited
from headwater.engine.kinds import Window
from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.codes import ErrorCode, Opcode
from headwater.protocols.convergedb.connection import ClientConnection
from headwater.protocols.convergedb.fields import FieldType
from headwater.server.app import Server
from headwater.server.config import ServerConfig
from headwater.server.convergedb.listener import start_convergedb
from waiting import wait_until_async

LISTEN = {"http": "", "kimberlite": "", "convergedb": "127.0.0.1:0", "ripple": ""}


class Client:
    """A ConvergeDB writer over the sans-I/O ClientConnection and asyncio streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = ClientConnection()
        self.frames: list[m.Frame] = []
        self.kind_id = 0

    @classmethod
    async def connect(cls, server: Server) -> Client:
        client = cls(*await asyncio.open_connection("127.0.0.1", server.listeners[0].port))
        await client.call(m.Connect("writer", ""))
        return client

    def send(self, message: m.ClientMessage, *, ack: bool = False) -> int:
        stream, data = self.conn.send(message, ack=ack)
        self.writer.write(data)
        return stream

    async def reply(self, stream: int) -> m.Message:
        """The server's answer on ``stream``."""
        while not any(f.stream_id == stream for f in self.frames):
            chunk = await asyncio.wait_for(self.reader.read(1 << 16), 10)
            assert chunk, "the server closed the connection"
            self.frames += self.conn.receive_data(chunk)
        frame = next(f for f in self.frames if f.stream_id == stream)
        self.frames.remove(frame)
        return frame.message

    async def call(self, message: m.ClientMessage) -> m.Message:
        return await self.reply(self.send(message, ack=True))

    def assert_(self, n: int, *, ack: bool = False) -> int:
        """ASSERT entity ``n`` of the temps kind (its field: n); its stream id."""
        return self.send(m.Assert.of(SCHEMA, self.kind_id, eid(n), [n]), ack=ack)

    async def barrier_refused(self, stream: int | None = None) -> None:
        """A HEARTBEAT barrier (sent now, or the one on ``stream``) answers ERROR with
        the lost write's reason."""
        refused = await (self.call(m.Heartbeat()) if stream is None else self.reply(stream))
        assert isinstance(refused, m.ErrorMessage), refused
        assert refused.code == ErrorCode.INTERNAL and refused.ref_opcode == Opcode.HEARTBEAT
        assert "no space left" in refused.message

    async def barrier_acked(self, stream: int | None = None) -> None:
        acked = await (self.call(m.Heartbeat()) if stream is None else self.reply(stream))
        assert acked == m.Ack(Opcode.HEARTBEAT)


SCHEMA = [m.FieldSpec("c", FieldType.I64)]


@asynccontextmanager
async def temps_writer(data_dir: Path) -> AsyncIterator[tuple[Server, Client]]:
    """A server with the ConvergeDB listener only, and a writer of its kind "temps"."""
    server = Server(data_dir, ServerConfig(listen=LISTEN), None, {"convergedb": start_convergedb})
    await server.start()
    try:
        client = await Client.connect(server)
        kind = await client.call(m.CreateKind("temps", SCHEMA))
        assert isinstance(kind, m.KindAck)
        client.kind_id = kind.kind_id
        yield server, client
    finally:
        await server.stop()


def eid(n: int) -> bytes:
    return (b"e%d" % n).ljust(32, b"\0")


def present(server: Server, client: Client, entities: range) -> list[int]:
    tk = server.api.kinds(0)
    return [n for n in entities if tk.get(client.kind_id, eid(n))]


def test_a_barrier_after_a_lost_fire_and_forget_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ASSERT on stream 0 (no ACK asked) whose window fails, then one that is
    durable, then a HEARTBEAT barrier: the barrier answers ERROR with the reason, since
    not everything written before it is durable; the next barrier, with nothing lost
    since, is ACKed."""

    async def main() -> None:
        async with temps_writer(tmp_path) as (server, client):
            writes = FailingWrites(server.api.kinds(0), monkeypatch)
            writes.failing = True
            client.assert_(1)
            await writes.refused.wait()
            writes.failing = False
            # A later window of the same connection, durable: the tenant's newest.
            assert await client.reply(client.assert_(2, ack=True)) == m.Ack(Opcode.ASSERT)
            await client.barrier_refused()
            client.assert_(3)
            await client.barrier_acked()
            assert present(server, client, range(1, 4)) == [2, 3]

    asyncio.run(main())


def test_a_write_lost_after_a_barrier_is_told_to_the_next_barrier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Barrier A waits on the window holding write 1; write 2 (stream 0, after A) goes
    into the next window, which fails as soon as the first is durable, before A goes on.
    A is ACKed (everything before it is durable); barrier B, sent after write 2, answers
    ERROR. A used to take write 2's loss for itself and B was ACKed past it."""

    async def main() -> None:
        async with temps_writer(tmp_path) as (server, client):
            tk = server.api.kinds(0)
            writes = FailingWrites(tk, monkeypatch)
            real = writes.real
            first_started, go_on = asyncio.Event(), asyncio.Event()

            async def first_held(window: Window) -> int:
                writes.real, writes.failing = real, True  # the next window fails at once
                first_started.set()
                await go_on.wait()
                return await real(window)

            writes.real = first_held
            client.assert_(1)
            a = client.send(m.Heartbeat(), ack=True)
            await asyncio.wait_for(first_started.wait(), 10)  # window 1 is being written
            client.assert_(2)
            # The server has applied write 2 (into the next window).
            await wait_until_async(lambda: not tk.windows.pending.empty)
            tk.windows._window_due()  # window 2 is flushed right after window 1
            go_on.set()
            await client.barrier_acked(a)
            assert writes.refused.is_set()
            writes.failing = False
            await client.barrier_refused()
            await client.barrier_acked()
            assert present(server, client, range(1, 3)) == [1]

    asyncio.run(main())


def test_a_loss_told_by_a_barrier_is_not_told_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A barrier waiting on the very window that fails answers ERROR; the next barrier,
    nothing more lost, is ACKed (it used to find the failed window again and answer
    ERROR too)."""

    async def main() -> None:
        async with temps_writer(tmp_path) as (server, client):
            writes = FailingWrites(server.api.kinds(0), monkeypatch)
            writes.failing = writes.hold = True
            client.assert_(1)
            await asyncio.wait_for(writes.refused.wait(), 10)  # its window is being written
            awaited = durable_awaited(monkeypatch)
            a = client.send(m.Heartbeat(), ack=True)
            await asyncio.wait_for(awaited.wait(), 10)  # barrier A waits on that window
            writes.failing = False
            writes.release.set()
            await client.barrier_refused(a)
            await client.barrier_acked()

    asyncio.run(main())


def test_a_barrier_after_a_lost_epoch_end_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SOURCE_EPOCH_END on stream 0 whose retractions' window fails, then a durable
    write and a barrier: the barrier answers ERROR, the retractions being this
    connection's writes (they were not noted, and the barrier was ACKed)."""

    async def main() -> None:
        async with temps_writer(tmp_path) as (server, client):
            assert await client.reply(client.assert_(1, ack=True)) == m.Ack(Opcode.ASSERT)
            assert await client.call(m.SourceEpochBegin()) == m.Ack(Opcode.SOURCE_EPOCH_BEGIN)
            writes = FailingWrites(server.api.kinds(0), monkeypatch)
            writes.failing = True
            client.send(m.SourceEpochEnd())  # retracts entity 1
            await asyncio.wait_for(writes.refused.wait(), 10)
            writes.failing = False
            assert await client.reply(client.assert_(2, ack=True)) == m.Ack(Opcode.ASSERT)
            await client.barrier_refused()
            await client.barrier_acked()

    asyncio.run(main())
