"""Ripple checkpoints in process (a real listener on a loopback port, a raw worker) when
the kinds cannot keep a window: a checkpoint never acknowledges, and the saved sequence
table never holds, a delta whose write was lost; the worker is told and disconnected,
and its resend is applied rather than dropped as a redelivery."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest

from failing_windows import FailingWrites, durable_awaited
from headwater.engine.kinds import Window
from headwater.protocols.ripple import messages as rm
from headwater.protocols.ripple.connection import ClientConnection
from headwater.server.app import Server
from headwater.server.config import ServerConfig
from headwater.server.ripple.listener import entity_id_for, start_ripple

LISTEN = {"http": "", "kimberlite": "", "convergedb": "", "ripple": "127.0.0.1:0"}
QUOTES = rm.Schema("quotes", 1, (rm.Field("px", rm.FieldType.FLOAT),))


class Worker:
    """A Ripple worker over the sans-I/O ClientConnection and asyncio streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str):
        self.reader, self.writer = reader, writer
        self.conn = ClientConnection(name)
        self.pending: list[rm.Message] = []

    @classmethod
    async def connect(cls, server: Server, name: str) -> Worker:
        worker = cls(*await asyncio.open_connection("127.0.0.1", server.listeners[0].port), name)
        worker.writer.write(worker.conn.handshake({"quotes": QUOTES}))
        answer = await worker.next()
        assert isinstance(answer, rm.SchemaNegotiation) and answer.ok, answer
        return worker

    async def next(self) -> rm.Message | None:
        """The next message from the server; None once it closed the connection."""
        while not self.pending:
            try:
                chunk = await asyncio.wait_for(self.reader.read(1 << 16), 10)
            except ConnectionError:
                return None
            if not chunk:
                return None
            self.pending += [r.message for r in self.conn.receive_data(chunk)]
        return self.pending.pop(0)

    def send(self, sequence_nos: range) -> None:
        """A Set of key ``<worker><n>`` per sequence number n, with those numbers."""
        for n in sequence_nos:
            key, delta = f"{self.conn.worker_id}{n}", rm.Set({"px": float(n)})
            self.writer.write(self.conn.send_delta("quotes", key, delta, sequence_no=n))

    def ask_checkpoint(self, checkpoint_id: str) -> None:
        with contextlib.suppress(ConnectionError):  # the server may have closed already
            self.writer.write(self.conn.checkpoint_request(checkpoint_id, 1))

    async def checkpoint(self, checkpoint_id: str) -> int:
        self.ask_checkpoint(checkpoint_id)
        ack = await self.next()
        assert isinstance(ack, rm.CheckpointAck), ack
        assert ack.checkpoint_id == checkpoint_id
        return ack.last_sequence_no

    async def until_closed(self) -> list[rm.Message]:
        """What the server sends until it closes the connection (or acks a checkpoint)."""
        messages = []
        while (message := await self.next()) is not None:
            messages.append(message)
            if isinstance(message, rm.CheckpointAck):
                break
        return messages

    def close(self) -> None:
        self.writer.close()


async def started(data_dir: Path) -> Server:
    server = Server(data_dir, ServerConfig(listen=LISTEN), None, {"ripple": start_ripple})
    await server.start()
    return server


def keys_present(server: Server, worker: str) -> list[str]:
    """The keys of ``worker`` (``<worker>1`` to ``<worker>9``) that the quotes kind holds."""
    tk = server.api.kinds(0)
    kind = tk.get_kind("quotes")
    keys = [f"{worker}{n}" for n in range(1, 10)]
    return [key for key in keys if tk.get(kind.kind_id, entity_id_for(key.encode()))]


def saved(data_dir: Path) -> dict[str, int]:
    table = json.loads((data_dir / "ripple" / "tenant-0.json").read_text())
    return {f"{e['worker']}/{e['output']}": e["last"] for e in table["sequences"]}


async def resend_applied(server: Server, count: int) -> None:
    """Worker a reconnects and resends its deltas 1..count (all since its last
    acknowledged checkpoint): the checkpoint after them acks ``count``, and each is in
    the kind."""
    again = await Worker.connect(server, "a")
    again.send(range(1, count + 1))
    assert await again.checkpoint("again") == count
    assert keys_present(server, "a") == [f"a{n}" for n in range(1, count + 1)]
    again.close()


def refused_with_reason(messages: list[rm.Message]) -> bool:
    """No checkpoint acknowledged; a Schema_negotiation ok=false saying why."""
    assert not any(isinstance(m, rm.CheckpointAck) for m in messages), messages
    return any(
        isinstance(m, rm.SchemaNegotiation) and not m.ok and "no space left" in " ".join(m.errors)
        for m in messages
    )


def test_a_checkpoint_after_a_failed_window_is_refused_and_the_resend_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window holding a worker's deltas fails before its Checkpoint_request comes:
    the request is not acknowledged (the worker is told why and disconnected), and the
    same deltas resent on a new connection are applied, not dropped as redeliveries."""

    async def main() -> None:
        server = await started(tmp_path)
        try:
            a = await Worker.connect(server, "a")
            writes = FailingWrites(server.api.kinds(0), monkeypatch)
            writes.failing = True
            a.send(range(1, 4))
            await writes.refused.wait()
            a.ask_checkpoint("c1")
            assert refused_with_reason(await a.until_closed())
            writes.failing = False
            a.close()

            await resend_applied(server, 3)
        finally:
            await server.stop()

    asyncio.run(main())


def test_a_checkpoint_waiting_on_a_window_that_fails_is_refused_and_the_resend_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Checkpoint_request arrives while the window holding the deltas is being
    written, and that write fails: no acknowledgement, the reason, then the resend on a
    new connection is applied."""

    async def main() -> None:
        server = await started(tmp_path)
        try:
            a = await Worker.connect(server, "a")
            writes = FailingWrites(server.api.kinds(0), monkeypatch)
            writes.failing = writes.hold = True
            awaited = durable_awaited(monkeypatch)  # someone waits for a window
            a.send(range(1, 4))
            await writes.refused.wait()  # the window is being written, and held there
            a.ask_checkpoint("c1")
            a.send(range(4, 6))  # after the request: into the next window, not covered
            await awaited.wait()  # the request waits for the window
            writes.release.set()
            assert refused_with_reason(await a.until_closed())
            writes.failing = False
            a.close()

            await resend_applied(server, 5)
        finally:
            await server.stop()

    asyncio.run(main())


def test_another_workers_checkpoint_saves_only_durable_sequence_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker a's window fails; worker b's checkpoint afterwards saves the tenant's table,
    which holds b's numbers and none of a's lost ones, so after a restart a's resent
    deltas are applied."""

    async def main() -> None:
        server = await started(tmp_path)
        try:
            b = await Worker.connect(server, "b")
            b.send(range(1, 3))
            assert await b.checkpoint("b1") == 2
            a = await Worker.connect(server, "a")
            writes = FailingWrites(server.api.kinds(0), monkeypatch)
            writes.failing = True
            a.send(range(1, 4))
            await writes.refused.wait()
            writes.failing = False
            b.send(range(3, 4))
            assert await b.checkpoint("b2") == 3
            assert saved(tmp_path) == {"b/quotes": 3}
            assert refused_with_reason(await a.until_closed())
            a.close()
            b.close()
        finally:
            await server.stop()
        assert saved(tmp_path) == {"b/quotes": 3}

        server = await started(tmp_path)
        try:
            await resend_applied(server, 3)
            assert saved(tmp_path) == {"a/quotes": 3, "b/quotes": 3}
        finally:
            await server.stop()

    asyncio.run(main())


def test_a_checkpoint_on_a_new_connection_covers_the_old_connections_window_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker reconnects (the server fences its old connection) while the window
    holding what it sent on the old one is still being written. Its checkpoint on the
    new connection answers once that window is durable, with its numbers: a restarted
    worker resuming numbers after the ack's last (Worker(resume=True)), and an ack that
    missed them would have it reuse 1-3 for new deltas, which the old window's numbers,
    durable a moment later and saved, would then drop as redeliveries after a restart."""

    async def main() -> None:
        server = await started(tmp_path)
        try:
            old = await Worker.connect(server, "a")
            writes = FailingWrites(server.api.kinds(0), monkeypatch)
            held = asyncio.Event()
            real = writes.real

            async def held_write(window: Window) -> int:
                held.set()
                await writes.release.wait()
                return await real(window)

            writes.real = held_write
            awaited = durable_awaited(monkeypatch)  # someone waits for a window
            old.send(range(1, 4))
            await held.wait()  # the window holding 1-3 is being written, and held there

            new = await Worker.connect(server, "a")  # fences the old connection
            asked = asyncio.ensure_future(new.checkpoint("c1"))
            waiting = asyncio.ensure_future(awaited.wait())
            await asyncio.wait({asked, waiting}, return_when=asyncio.FIRST_COMPLETED)
            writes.release.set()
            assert await asked == 3
            assert saved(tmp_path) == {"a/quotes": 3}
            assert keys_present(server, "a") == ["a1", "a2", "a3"]
            waiting.cancel()
            old.close()
            new.close()
        finally:
            await server.stop()

    asyncio.run(main())


def test_a_refused_delta_leaves_the_deltas_before_it_applied(tmp_path: Path) -> None:
    """Sets 1-2, a Patch of a field the kind lacks (3) and a Set (4) arrive together: the
    worker is refused with the reason, 1-2 are applied (they were dropped with the
    refused one), and 3 is not counted: the worker sends a corrected 3 and 4 on a new
    connection, and they are applied."""

    async def main() -> None:
        server = await started(tmp_path)
        try:
            a = await Worker.connect(server, "a")
            a.send(range(1, 3))
            patch = rm.Patch((rm.FieldSet("nosuch", rm.Atom("x")),))
            a.writer.write(a.conn.send_delta("quotes", "a3", patch, sequence_no=3))
            a.send(range(4, 5))
            refused = await a.until_closed()
            assert any(
                isinstance(m, rm.SchemaNegotiation) and "nosuch" in " ".join(m.errors)
                for m in refused
            ), refused
            a.close()

            again = await Worker.connect(server, "a")
            assert await again.checkpoint("c1") == 2  # 1-2 durable, 3 not counted
            assert keys_present(server, "a") == ["a1", "a2"]
            again.send(range(3, 5))
            assert await again.checkpoint("c2") == 4
            assert keys_present(server, "a") == ["a1", "a2", "a3", "a4"]
            again.close()
        finally:
            await server.stop()

    asyncio.run(main())


COUNTS = rm.Schema("counts", 1, (rm.Field("n", rm.FieldType.INT64),))


def test_a_delta_whose_value_the_kind_refuses_leaves_the_deltas_before_it_applied(
    tmp_path: Path,
) -> None:
    """As above, but 3 is refused by the kind's own check of its values (BadFieldData, a
    KindsError: a Patch of an i64 field with a number past its range) rather than by the
    listener: 1-2 are still applied and durable, and 3 is not counted."""

    async def main() -> None:
        server = await started(tmp_path)
        try:
            a = Worker(*await asyncio.open_connection("127.0.0.1", server.listeners[0].port), "a")
            a.writer.write(a.conn.handshake({"counts": COUNTS}))
            answer = await a.next()
            assert isinstance(answer, rm.SchemaNegotiation) and answer.ok, answer
            for n in (1, 2):
                a.writer.write(
                    a.conn.send_delta("counts", f"a{n}", rm.Set({"n": n}), sequence_no=n)
                )
            huge = rm.Patch((rm.FieldSet("n", rm.Atom(str(1 << 70))),))
            a.writer.write(a.conn.send_delta("counts", "a3", huge, sequence_no=3))
            a.writer.write(a.conn.send_delta("counts", "a4", rm.Set({"n": 4}), sequence_no=4))
            refused = await a.until_closed()
            assert any(isinstance(m, rm.SchemaNegotiation) and not m.ok for m in refused), refused
            a.close()

            again = Worker(
                *await asyncio.open_connection("127.0.0.1", server.listeners[0].port), "a"
            )
            again.writer.write(again.conn.handshake({"counts": COUNTS}))
            answer = await again.next()
            assert isinstance(answer, rm.SchemaNegotiation) and answer.ok, answer
            assert await again.checkpoint("c1") == 2  # 1-2 durable, 3 not counted
            tk = server.api.kinds(0)
            kind = tk.get_kind("counts")
            present = [
                n for n in range(1, 5) if tk.get(kind.kind_id, entity_id_for(f"a{n}".encode()))
            ]
            assert present == [1, 2]
            again.close()
        finally:
            await server.stop()

    asyncio.run(main())


def test_a_refused_delta_counts_no_gap_and_moves_no_watermark(tmp_path: Path) -> None:
    """A refused delta is not counted: not the gap its number jumps over (counted again
    when the corrected delta is sent), nor its watermark."""

    async def main() -> None:
        from headwater.server.ripple.listener import STATES

        server = await started(tmp_path)
        try:
            a = await Worker.connect(server, "a")
            a.writer.write(
                a.conn.send_delta(
                    "quotes", "a1", rm.Set({"px": 1.0}), watermark_ns=10, sequence_no=1
                )
            )
            assert await a.checkpoint("c1") == 1
            patch = rm.Patch((rm.FieldSet("nosuch", rm.Atom("x")),))
            a.writer.write(a.conn.send_delta("quotes", "a5", patch, watermark_ns=99, sequence_no=5))
            await a.until_closed()
            a.close()
            state = STATES[server].by_tenant[0]
            assert state.tracker.gaps == 0
            assert state.watermarks[("a", "quotes")] == 10
        finally:
            await server.stop()

    asyncio.run(main())


def test_an_output_durable_after_its_connection_ended_is_shown(tmp_path: Path) -> None:
    """A connection's end rewinds an output with nothing durable yet to nothing known;
    its window then commits, making a number durable: /api/ripple/workers still shows
    the output, with that durable number (it used to vanish until the worker sent
    again, though the saved table held it)."""

    async def main() -> None:
        from headwater.server.ripple.listener import RippleState

        state = RippleState(0, tmp_path / "tenant-0.json", set())
        key = ("a", "quotes")
        state.tracker.observe(key, 3)
        state.tracker.rewind(key, state.durable.get(key))  # the end: nothing durable yet
        state.durable[key] = 3  # then its window commits
        [worker] = state.workers()
        assert worker["outputs"] == [
            {
                "output": "quotes",
                "last_sequence_no": 3,
                "durable_sequence_no": 3,
                "watermark_ns": None,
            }
        ]

    asyncio.run(main())
