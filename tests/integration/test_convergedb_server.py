"""The ConvergeDB listener of a real ``headwater serve`` process, over the wire."""

from __future__ import annotations

import fcntl
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from convergedb_raw import CdbClient, Closed, connect_when_free, eid, query, query_many
from kimberlite_raw import query as sql_query
from kimberlite_raw import query_at, rows_of
from memory_probe import MIB, RssSampler
from servers import LOCAL, Server, serving

from headwater.entities import entity_id
from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.codes import ErrorCode, Opcode
from headwater.protocols.convergedb.fields import FieldType
from headwater.server.memory import process_memory
from waiting import wait_until

LISTEN = {"convergedb": LOCAL}
FIELDS = [("temp", FieldType.F64), ("label", FieldType.STRING)]
ALL_ROWS = "SELECT entity_id, version, temp, label FROM durable ORDER BY entity_id"
AUTH = """
[convergedb]
liveness_check_ms = 20

[auth]
required = false
[[auth.tokens]]
token = "acme-token"
tenants = [42]

[[tenants]]
id = 42
name = "acme"
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(tmp_path_factory.mktemp("cdb"), config=AUTH, listen=LISTEN)


@pytest.fixture()
def port(server: Server) -> int:
    return server.ports["convergedb"]


@pytest.fixture()
def make_cdb_server(make_server: Callable[..., Server]) -> Callable[..., Server]:
    """Servers of a test's own with the ConvergeDB listener on: ``make_cdb_server(config)``."""
    return lambda config="": make_server(config=config, listen=LISTEN)


def state_of(reply: m.Message) -> m.State:
    assert isinstance(reply, m.State), reply
    return reply


def test_two_writers_converge_on_one_entity(port: int) -> None:
    with (
        CdbClient(port, name="a", source_id=1) as a,
        CdbClient(port, name="b", source_id=2) as b,
        CdbClient(port, read_only=True) as reader,
    ):
        kind = a.create_kind("converge", FIELDS)
        stream = reader.send(m.Subscribe(kind.kind_id, bootstrap=False, include_previous=True))
        assert reader.reply(stream).message == m.Ack(Opcode.SUBSCRIBE)
        ack = a.call(m.Assert.of(FIELDS, kind.kind_id, eid(1), [20.0, "a"], b"meta-a"))
        assert ack == m.Ack(Opcode.ASSERT)  # durable once ACKed
        first = state_of(query(reader, kind.kind_id, eid(1)))
        assert (first.change, first.source_set, first.changed_fields) == (
            m.Change.QUERY,
            0b10,
            0b11,
        )
        assert first.fields(FIELDS) == [20.0, "a"] and first.metadata == b""  # never stored
        b.call(m.Patch.of(FIELDS, kind.kind_id, eid(1), {0: 21.5}))
        both = state_of(query(reader, kind.kind_id, eid(1)))
        assert both.source_set == 0b110 and both.fields(FIELDS) == [21.5, "a"]
        a.call(m.Retract(kind.kind_id, eid(1)))
        still = state_of(query(reader, kind.kind_id, eid(1)))
        assert still.source_set == 0b100 and still.version > both.version
        b.call(m.Retract(kind.kind_id, eid(1), b"bye"))
        gone = query(reader, kind.kind_id, eid(1))
        assert isinstance(gone, m.ErrorMessage) and gone.code == ErrorCode.ENTITY_NOT_FOUND
        created, patched, retracted, deleted = reader.messages(stream, 4)
        # Nothing more: the next notification is a later write's.
        a.call(m.Assert.of(FIELDS, kind.kind_id, eid(2), [0.0, "marker"]))
        marker = reader.messages(stream, 1)[0]
        assert isinstance(marker, m.State) and marker.entity_id == eid(2), marker
        assert isinstance(created, m.State) and created.change == m.Change.CREATED
        assert created.metadata == b"meta-a"  # passed through (QUERY above had none)
        assert created.version == first.version and created.source_set == 0b10
        assert created.fields(FIELDS) == [20.0, "a"] and created.changed_fields == 0b11
        assert isinstance(patched, m.State) and patched.change == m.Change.UPDATED
        assert patched.changed_fields == 0b01 and patched.previous_fields(FIELDS) == [20.0, "a"]
        assert isinstance(retracted, m.State) and retracted.source_set == 0b100
        assert retracted.version == still.version and retracted.changed_fields == 0
        assert retracted.fields(FIELDS) == [21.5, "a"] and patched.version == both.version
        assert isinstance(deleted, m.Deleted) and deleted.metadata == b"bye"
        assert deleted.version > retracted.version > patched.version > created.version


def test_errors_on_the_wire(port: int) -> None:
    with CdbClient(port, name="w") as w, CdbClient(port, read_only=True) as ro:
        kind = w.create_kind("errs", FIELDS)
        again = w.create_kind("errs", FIELDS)
        assert again == kind
        grown = w.create_kind("errs", [*FIELDS, ("n", FieldType.U32)])
        assert (grown.kind_id, grown.schema_version, grown.field_count) == (kind.kind_id, 2, 3)
        for message, code in [
            (m.CreateKind("errs", [m.FieldSpec("temp", FieldType.I8)]), ErrorCode.SCHEMA_CONFLICT),
            (m.CreateKind("hw_x", []), ErrorCode.RESERVED_NAME),
            (
                m.GetKind("errs", [m.FieldSpec("label", FieldType.STRING)]),
                ErrorCode.SCHEMA_INCOMPATIBLE,
            ),
            (m.GetKind("nope"), ErrorCode.KIND_NOT_FOUND),
            (m.Assert(kind.kind_id, eid(1), b"\x01"), ErrorCode.BAD_FIELD_DATA),
            (m.Assert(999, eid(1)), ErrorCode.KIND_NOT_FOUND),
            (m.SourceEpochEnd(), ErrorCode.NO_EPOCH),
            (m.Query(kind.kind_id, eid(77)), ErrorCode.ENTITY_NOT_FOUND),
        ]:
            reply = w.call(message)
            assert isinstance(reply, m.ErrorMessage) and reply.code == code, (message, reply)
        # A fire-and-forget write that fails is reported on stream 0.
        w.send(m.Assert(kind.kind_id, eid(1), b"\x01"))
        err = w.take(lambda f: f.stream_id == 0).message
        assert isinstance(err, m.ErrorMessage) and err.code == ErrorCode.BAD_FIELD_DATA
        assert err.ref_opcode == Opcode.ASSERT
        # A BATCH with one bad op applies none of its ops.
        good = m.Assert.of(FIELDS, kind.kind_id, eid(2), [1.0])
        reply = w.call(m.Batch((good, m.Patch(kind.kind_id, eid(3), 1 << 9))))
        assert isinstance(reply, m.ErrorMessage) and reply.code == ErrorCode.BAD_FIELD_DATA
        w.barrier()
        assert isinstance(query(w, kind.kind_id, eid(2)), m.ErrorMessage)
        assert ro.source_id == 0xFF
        reply = ro.call(m.Assert.of(FIELDS, kind.kind_id, eid(2), [1.0]))
        assert isinstance(reply, m.ErrorMessage) and reply.code == ErrorCode.READ_ONLY
        # A live source's slot is not handed to a second connection.
        assert w.source_id is not None
        taken = CdbClient(port, connect=False)
        stream, data = taken.conn.connect("x", source_id=w.source_id)
        taken.sock.sendall(data)
        refused = taken.reply(stream).message
        assert isinstance(refused, m.ErrorMessage) and refused.code == ErrorCode.SOURCE_CONFLICT
        taken.close()


PROMPT_SECONDS = 3.0  # an ACK that waited for a window would never come at all


def test_writes_that_change_nothing_are_acked_on_a_quiet_server(port: int) -> None:
    # The ACKs used to wait for a window that nothing opened, so they never came. The
    # reads below give the server time to go quiet: nothing of this tenant is pending.
    with CdbClient(port, name="noop", deadline_ms=2000) as w:
        kind = w.create_kind("noops", FIELDS)
        w.call(m.Assert.of(FIELDS, kind.kind_id, eid(1), [1.0]))
        assert isinstance(query(w, kind.kind_id, eid(1)), m.State)
        stream = w.send(m.Batch(()), ack=True)
        assert stream != 0
        assert w.reply(stream, PROMPT_SECONDS).message == m.Ack(Opcode.BATCH)
        # An entity this source does not hold (it does not exist at all), then one that
        # another source holds.
        stream = w.send(m.Retract(kind.kind_id, eid(99)), ack=True)
        assert w.reply(stream, PROMPT_SECONDS).message == m.Ack(Opcode.RETRACT)
        with CdbClient(port, name="other", deadline_ms=2000) as other:
            stream = other.send(m.Retract(kind.kind_id, eid(1)), ack=True)
            assert other.reply(stream, PROMPT_SECONDS).message == m.Ack(Opcode.RETRACT)
            assert w.source_id is not None
            assert state_of(query(other, kind.kind_id, eid(1))).source_set == 1 << w.source_id
        # An epoch in which everything is re-asserted unchanged: nothing is stale.
        assert w.call(m.SourceEpochBegin()) == m.Ack(Opcode.SOURCE_EPOCH_BEGIN)
        w.send(m.Assert.of(FIELDS, kind.kind_id, eid(1), [1.0]))
        stream = w.send(m.SourceEpochEnd(), ack=True)
        assert w.reply(stream, PROMPT_SECONDS).message == m.EpochEndAck(0)
        # And an epoch over a source that holds nothing at all.
        with CdbClient(port, name="empty", deadline_ms=2000) as empty:
            assert empty.call(m.SourceEpochBegin()) == m.Ack(Opcode.SOURCE_EPOCH_BEGIN)
            stream = empty.send(m.SourceEpochEnd(), ack=True)
            assert empty.reply(stream, PROMPT_SECONDS).message == m.EpochEndAck(0)
        assert state_of(query(w, kind.kind_id, eid(1))).fields(FIELDS) == [1.0, ""]


def send_together(
    go: threading.Barrier,
    streams: dict[int, int],
    n: int,
    client: CdbClient,
    name: str,
    fields: list[tuple[str, FieldType]],
) -> None:
    specs = [m.FieldSpec(field, t) for field, t in fields]
    go.wait()
    streams[n] = client.send(m.CreateKind(name, specs), ack=True)


def test_concurrent_create_kind_gets_distinct_kinds(port: int) -> None:
    # Two CREATE_KINDs at once used to get one kind id and a broken registry. Each round
    # sends both frames before either connection reads, with different field counts.
    with (
        CdbClient(port, name="ck1", deadline_ms=2000) as c1,
        CdbClient(port, name="ck2", deadline_ms=2000) as c2,
    ):
        small = [("a", FieldType.U8)]
        large = [(f"f{i}", FieldType.I64) for i in range(5)]
        for round_ in range(10):
            go = threading.Barrier(2)
            streams: dict[int, int] = {}
            threads = [
                threading.Thread(
                    target=send_together, args=(go, streams, n, client, f"race{round_}_{n}", fields)
                )
                for n, client, fields in [(1, c1, small), (2, c2, large)]
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            one = c1.reply(streams[1]).message
            two = c2.reply(streams[2]).message
            assert isinstance(one, m.KindAck) and isinstance(two, m.KindAck), (one, two)
            assert one.kind_id != two.kind_id
            assert (one.field_count, two.field_count) == (1, 5)
            for client, name, ack, count in [
                (c2, f"race{round_}_1", one, 1),
                (c1, f"race{round_}_2", two, 5),
            ]:
                got = client.call(m.GetKind(name))
                assert isinstance(got, m.KindAck), got
                assert (got.kind_id, got.schema_version, got.field_count) == (
                    ack.kind_id,
                    1,
                    count,
                )
            # Each kind takes writes of its own schema.
            c1.call(m.Assert.of(small, one.kind_id, eid(1), [7]))
            c2.call(m.Assert.of(large, two.kind_id, eid(1), [1, 2, 3, 4, 5]))
            assert state_of(query(c1, two.kind_id, eid(1))).fields(large) == [1, 2, 3, 4, 5]
            assert state_of(query(c2, one.kind_id, eid(1))).fields(small) == [7]


def test_token_selects_the_tenant(port: int) -> None:
    with CdbClient(port, token="acme-token") as acme, CdbClient(port) as default:
        mine = acme.create_kind("tenanted", FIELDS)
        acme.call(m.Assert.of(FIELDS, mine.kind_id, eid(1), [1.0]))
        reply = default.call(m.GetKind("tenanted"))
        assert isinstance(reply, m.ErrorMessage) and reply.code == ErrorCode.KIND_NOT_FOUND
        presence = acme.call(m.GetKind("convergedb_connections"))
        assert isinstance(presence, m.KindAck)
        assert acme.source_id is not None
        row = state_of(query(acme, presence.kind_id, bytes([acme.source_id]) + bytes(31)))
        assert row.source_set == 1 << acme.source_id


def test_epoch_retracts_stale_entities(port: int) -> None:
    with CdbClient(port, name="e") as w, CdbClient(port, name="o") as other:
        kind = w.create_kind("epochs", FIELDS)
        w.send(
            m.Batch(tuple(m.Assert.of(FIELDS, kind.kind_id, eid(i), [float(i)]) for i in range(10)))
        )
        other.call(m.Assert.of(FIELDS, kind.kind_id, eid(9), [9.0]))
        assert w.call(m.SourceEpochBegin()) == m.Ack(Opcode.SOURCE_EPOCH_BEGIN)
        w.send(
            m.Batch(tuple(m.Assert.of(FIELDS, kind.kind_id, eid(i), [float(i)]) for i in range(3)))
        )
        w.send(m.Patch.of(FIELDS, kind.kind_id, eid(3), {1: "kept"}))
        end = w.call(m.SourceEpochEnd())
        assert end == m.EpochEndAck(6)  # 4..9 not re-asserted; 9 is also other's
        for i in range(4):
            assert isinstance(query(w, kind.kind_id, eid(i)), m.State)
        for i in range(4, 9):
            gone = query(w, kind.kind_id, eid(i))
            assert isinstance(gone, m.ErrorMessage) and gone.code == ErrorCode.ENTITY_NOT_FOUND
        assert other.source_id is not None
        assert state_of(query(w, kind.kind_id, eid(9))).source_set == 1 << other.source_id


def test_killed_writer_loses_sole_owned_entities_after_deadline(port: int) -> None:
    with CdbClient(port, name="keeper", source_id=20) as keeper:
        kind = keeper.create_kind("liveness", FIELDS)
        victim = CdbClient(port, name="victim", source_id=21, deadline_ms=1000)
        victim.call(m.Assert.of(FIELDS, kind.kind_id, eid(1), [1.0]))
        victim.call(m.Assert.of(FIELDS, kind.kind_id, eid(2), [2.0]))
        keeper.call(m.Assert.of(FIELDS, kind.kind_id, eid(2), [2.0]))
        victim.abort()
        assert isinstance(query(keeper, kind.kind_id, eid(1)), m.State)  # not yet
        wait_until(
            lambda: not isinstance(query(keeper, kind.kind_id, eid(1)), m.State),
            message="the dead writer's entity was never retracted",
        )
        assert state_of(query(keeper, kind.kind_id, eid(2))).source_set == 1 << 20


def test_a_connect_without_a_deadline_gets_the_contracts_30_s_whatever_the_server_default(
    make_cdb_server: Callable[..., Server],
) -> None:
    """CONNECT's liveness 0 means 30,000 ms (the contract); ``default_liveness_ms`` is
    for sources a restart finds without their own. A client that sent 0 heartbeats for
    30 s (the SDK every 10 s): it used to be dead after the server's default instead."""
    server = make_cdb_server("[convergedb]\ndefault_liveness_ms = 300\nliveness_check_ms = 20\n")
    port = server.ports["convergedb"]
    with CdbClient(port, name="keeper", source_id=20) as keeper:
        kind = keeper.create_kind("contract_deadline", FIELDS)
        silent = CdbClient(port, name="silent", source_id=21)  # liveness 0
        silent.call(m.Assert.of(FIELDS, kind.kind_id, eid(1), [1.0]))
        silent.abort()
        # A writer gone after it, with 300 ms of its own: once its entity is retracted,
        # the checker has judged the first writer too, past the server's default.
        short = CdbClient(port, name="short", source_id=22, deadline_ms=300)
        short.call(m.Assert.of(FIELDS, kind.kind_id, eid(2), [2.0]))
        short.abort()
        wait_until(
            lambda: not isinstance(query(keeper, kind.kind_id, eid(2)), m.State),
            message="the 300 ms writer's entity was never retracted",
        )
        assert isinstance(query(keeper, kind.kind_id, eid(1)), m.State)


WRITER = Path(__file__).parent / "cdb_writer.py"
WRITER_FIELDS = [("n", FieldType.U32), ("owner", FieldType.STRING)]
WRITER_DEADLINE_MS = 1500


class WriterProcess:
    """``cdb_writer.py`` in a process of its own (see its docstring)."""

    def __init__(
        self, port: int, kind: str, source_id: int, first: int, count: int, *, wait: bool = False
    ) -> None:
        args = [str(WRITER), f"127.0.0.1:{port}", kind, str(source_id)]
        args += [str(WRITER_DEADLINE_MS), str(first), str(count)] + (["--wait"] if wait else [])
        self.proc = subprocess.Popen(
            [sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )

    def expect(self, line: str, timeout: float = 30.0) -> None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"the writer did not print {line!r} within {timeout}s"
        got = self.proc.stdout.readline().decode().strip()
        assert got == line, (got, line)

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def sdk_key(i: int) -> bytes:
    return entity_id(f"e{i}")


def notes_until(
    client: CdbClient, stream: int, done: Callable[[list[m.Message]], bool], timeout: float
) -> list[m.Message]:
    """Notifications on ``stream`` until ``done(all so far)``."""
    notes: list[m.Message] = []
    deadline = time.monotonic() + timeout
    while not done(notes):
        assert time.monotonic() < deadline, f"gave up waiting; got {notes}"
        notes += [f.message for f in client.drain(0.05) if f.stream_id == stream]
    return notes


@pytest.fixture()
def writers() -> Iterator[list[WriterProcess]]:
    started: list[WriterProcess] = []
    try:
        yield started
    finally:
        for writer in started:
            if writer.proc.poll() is None:
                writer.kill()


def test_killed_writer_process_loses_its_entities_after_its_deadline(
    port: int, writers: list[WriterProcess]
) -> None:
    """A writer process SIGKILLed: after its liveness deadline the entities only it held
    are DELETED, the ones another live source shares lose only its bit."""
    with (
        CdbClient(port, name="keeper", source_id=40, deadline_ms=30_000) as keeper,
        CdbClient(port, read_only=True) as reader,
    ):
        kind = keeper.create_kind("killed", WRITER_FIELDS)
        stream = reader.send(m.Subscribe(kind.kind_id))
        reader.reply(stream)
        victim = WriterProcess(port, "killed", 41, 0, 10)
        writers.append(victim)
        victim.expect("READY 41")
        for i in range(5, 10):  # shared with the keeper
            keeper.send(m.Assert.of(WRITER_FIELDS, kind.kind_id, sdk_key(i), [i, "keeper"]))
        keeper.barrier()
        notes_until(reader, stream, lambda ns: len(ns) == 15, timeout=10)  # 10 + 5 updates
        victim.kill()
        killed = time.monotonic()
        # Nothing happens at once: the source is only dead once its deadline has passed
        # (its last heartbeat was at most a third of the deadline before the kill).
        assert state_of(query(keeper, kind.kind_id, sdk_key(0))).source_set == 1 << 41
        notes = notes_until(reader, stream, lambda ns: len(ns) >= 10, timeout=15)
        assert time.monotonic() - killed > 0.5
        deleted = {n.entity_id for n in notes if isinstance(n, m.Deleted)}
        updated = {
            n.entity_id: (n.source_set, n.fields(WRITER_FIELDS))
            for n in notes
            if isinstance(n, m.State)
        }
        assert deleted == {sdk_key(i) for i in range(5)}
        assert updated == {sdk_key(i): (1 << 40, [i, "keeper"]) for i in range(5, 10)}
        assert len(notes) == 10
        for i in range(5):
            gone = query(keeper, kind.kind_id, sdk_key(i))
            assert isinstance(gone, m.ErrorMessage) and gone.code == ErrorCode.ENTITY_NOT_FOUND
        for i in range(5, 10):
            assert state_of(query(keeper, kind.kind_id, sdk_key(i))).source_set == 1 << 40


def test_writer_process_replaced_in_time_keeps_the_entities(
    port: int, writers: list[WriterProcess]
) -> None:
    """A writer SIGKILLed and a new process connecting with its source_id before the
    deadline: the entities stay, now held by the new process (killing that one later
    retracts them, so they were not merely kept by a deadline that never fires)."""
    with (
        CdbClient(port, name="maker", deadline_ms=10_000) as maker,
        CdbClient(port, read_only=True) as reader,
    ):
        kind = maker.create_kind("replaced", WRITER_FIELDS)
        stream = reader.send(m.Subscribe(kind.kind_id))
        reader.reply(stream)
        first = WriterProcess(port, "replaced", 42, 0, 5)
        writers.append(first)
        second = WriterProcess(port, "replaced", 42, 0, 0, wait=True)
        writers.append(second)
        first.expect("READY 42")
        second.expect("WAITING")
        notes_until(reader, stream, lambda ns: len(ns) == 5, timeout=10)
        first.kill()
        # A canary with the same deadline that goes silent after the kill: once its
        # entity is deleted, the first writer's deadline has passed as well.
        canary = CdbClient(port, name="canary", deadline_ms=WRITER_DEADLINE_MS)
        canary.call(m.Assert.of(WRITER_FIELDS, kind.kind_id, sdk_key(99), [99, "canary"]))
        second.go()
        second.expect("READY 42")
        notes = notes_until(
            reader, stream, lambda ns: any(isinstance(n, m.Deleted) for n in ns), timeout=15
        )
        canary.close()
        # No notification at all for the replaced writer's entities: only the canary's.
        assert [(type(n), n.entity_id) for n in notes] == [
            (m.State, sdk_key(99)),
            (m.Deleted, sdk_key(99)),
        ]
        for i in range(5):
            kept = state_of(query(maker, kind.kind_id, sdk_key(i)))
            assert kept.source_set == 1 << 42 and kept.fields(WRITER_FIELDS) == [i, "source 42"]
        second.kill()
        notes = notes_until(reader, stream, lambda ns: len(ns) >= 5, timeout=15)
        assert {n.entity_id for n in notes if isinstance(n, m.Deleted)} == {
            sdk_key(i) for i in range(5)
        }


def test_writer_reconnecting_in_time_keeps_its_entities(port: int) -> None:
    with CdbClient(port, read_only=True) as reader:
        first = CdbClient(port, name="w", source_id=22, deadline_ms=1000)
        kind = first.create_kind("reconnect", FIELDS)
        first.call(m.Assert.of(FIELDS, kind.kind_id, eid(1), [1.0]))
        # A canary with the same deadline, silent from the moment the first one drops:
        # once its entity is deleted, the first connection's deadline has passed too.
        canary = CdbClient(port, name="canary", deadline_ms=1000)
        stream = reader.send(m.Subscribe(kind.kind_id, bootstrap=False))
        reader.reply(stream)
        first.abort()
        canary.call(m.Assert.of(FIELDS, kind.kind_id, eid(99), [9.0]))
        second = connect_when_free(port, 22, name="w", deadline_ms=1000)
        gone: list[m.Message] = []

        def canary_gone() -> bool:
            second.send(m.Heartbeat())  # heartbeating meanwhile, every 150 ms
            gone.extend(f.message for f in reader.drain(0.15) if f.stream_id == stream)
            return any(isinstance(n, m.Deleted) for n in gone)

        wait_until(canary_gone, message="the canary's entity was never deleted")
        assert [(type(n), n.entity_id) for n in gone] == [
            (m.State, eid(99)),
            (m.Deleted, eid(99)),
        ]
        canary.close()
        assert state_of(query(reader, kind.kind_id, eid(1))).source_set == 1 << 22
        # A connected source that stops talking is dead as well: closed and retracted.
        frames = second.until_closed(timeout=10)
        assert all(f.stream_id == 0 or isinstance(f.message, m.Ack) for f in frames)
        wait_until(
            lambda: not isinstance(query(reader, kind.kind_id, eid(1)), m.State),
            message="the silent source's entity was never retracted",
        )


def test_bootstrap_racing_live_writes_has_no_gaps(port: int) -> None:
    with CdbClient(port, name="racer") as writer:
        kind = writer.create_kind("race", FIELDS)
        writer.send(
            m.Batch(tuple(m.Assert.of(FIELDS, kind.kind_id, eid(i), [0.0]) for i in range(300)))
        )
        writer.barrier()
        stop = threading.Event()
        batches = [0]

        def write() -> None:
            n = 1
            while not stop.is_set():
                ops: list[m.WriteOp] = [
                    m.Assert.of(FIELDS, kind.kind_id, eid((n * 7 + i) % 400), [float(n)])
                    for i in range(20)
                ]
                ops.append(m.Retract(kind.kind_id, eid(n % 400)))
                writer.send(m.Batch(tuple(ops)))
                writer.barrier()  # paced by the server: one batch applied at a time
                n += 1
                batches[0] = n

        thread = threading.Thread(target=write)
        thread.start()
        try:
            wait_until(lambda: batches[0] > 20, message="the writer is stuck")
            sub = CdbClient(port, read_only=True)
            stream = sub.send(m.Subscribe(kind.kind_id, bootstrap=True))
            # The writes go on through the bootstrap and after it.
            frames = sub.collect(lambda f: isinstance(f.message, m.BootstrapEnd), timeout=30)
            after_end = batches[0] + 20
            wait_until(lambda: batches[0] > after_end, message="the writer is stuck")
        finally:
            stop.set()
            thread.join()
        # A last write: once its notification is here, so is every earlier one (a
        # subscription gets windows in order).
        marker = eid(1000)
        writer.call(m.Assert.of(FIELDS, kind.kind_id, marker, [-1.0]))
        frames += sub.collect(
            lambda f: isinstance(f.message, m.State) and f.message.entity_id == marker
        )
        # Highest version wins, a deletion counts with its version.
        view: dict[bytes, tuple[int, list[object] | None]] = {}
        kinds_seen = {type(f.message) for f in frames if f.stream_id == stream}
        assert m.BootstrapBegin in kinds_seen and m.BootstrapEnd in kinds_seen
        for frame in frames:
            msg = frame.message
            if frame.stream_id != stream:
                continue
            if isinstance(msg, m.State):
                if msg.entity_id not in view or view[msg.entity_id][0] < msg.version:
                    view[msg.entity_id] = (msg.version, list(msg.fields(FIELDS)))
            elif isinstance(msg, m.Deleted) and (
                msg.entity_id not in view or view[msg.entity_id][0] < msg.version
            ):
                view[msg.entity_id] = (msg.version, None)
        truth: dict[bytes, tuple[int, list[object]]] = {}
        for i in range(400):
            reply = query(writer, kind.kind_id, eid(i))
            if isinstance(reply, m.State):
                truth[eid(i)] = (reply.version, list(reply.fields(FIELDS)))
        seen = {k: v for k, v in view.items() if v[1] is not None and k != marker}
        assert seen == truth
        sub.close()


def fold(view: dict[bytes, tuple[int, m.State | None]], msg: m.Message) -> None:
    """Highest version wins; a deletion counts with its version."""
    if isinstance(msg, m.State | m.Deleted):
        seen = view.get(msg.entity_id)
        if seen is None or seen[0] < msg.version:
            view[msg.entity_id] = (msg.version, msg if isinstance(msg, m.State) else None)


@pytest.mark.slow
def test_bootstrap_misses_no_write_made_while_it_runs(port: int) -> None:
    """While a long bootstrap is held back by its subscriber, a writer creates new
    entities, updates and retracts old ones, each exactly once. New entities are in no
    scan, so only the live subscription can deliver them: a server that scanned before it
    registered the subscription (or registered it after the bootstrap) loses them, and
    the entity written once right after SUBSCRIBE is the first to go."""
    pad = "p" * 250
    preload, fresh = 40_000, 1_000
    with CdbClient(port, name="racer2", deadline_ms=5000) as writer:
        kind = writer.create_kind("race_once", FIELDS)
        k = kind.kind_id
        for start in range(0, preload, 1000):
            writer.send(
                m.Batch(
                    tuple(
                        m.Assert.of(FIELDS, k, eid(i), [0.0, f"{i}{pad}"])
                        for i in range(start, start + 1000)
                    )
                )
            )
        writer.barrier()
        # About 12 MB of bootstrap against a 16 kB receive window: the server is held
        # back long before the end, with the writes below in flight.
        sub = CdbClient(port, read_only=True, rcvbuf=16 << 10)
        stream = sub.send(m.Subscribe(k, bootstrap=True))
        assert sub.reply(stream).message == m.Ack(Opcode.SUBSCRIBE)
        first_new = eid(preload)
        writer.call(m.Assert.of(FIELDS, k, first_new, [1.0, "right after SUBSCRIBE"]))
        updated = range(3, preload, 37)  # spread over the whole scan order
        retracted = [i for i in range(11, preload, 401) if (i - 3) % 37]  # none updated
        for n in range(10):  # one window per round (a barrier each): < 4,096 live notes
            ops: list[m.WriteOp] = [
                m.Assert.of(FIELDS, k, eid(preload + 1 + i), [2.0, f"new {i}"])
                for i in range(n * fresh // 10, (n + 1) * fresh // 10)
            ]
            ops += [m.Patch.of(FIELDS, k, eid(i), {0: 3.0}) for i in updated[n::10]]
            ops += [m.Retract(k, eid(i)) for i in retracted[n::10]]
            writer.send(m.Batch(tuple(ops)))
            writer.barrier()
        marker = eid(preload + fresh + 1)
        writer.call(m.Assert.of(FIELDS, k, marker, [4.0, "last"]))  # a window of its own
        # Now read: up to BOOTSTRAP_END, then up to the marker's STATE, which comes after
        # every other live notification (a subscription gets windows in order).
        frames = sub.collect(lambda f: isinstance(f.message, m.BootstrapEnd), timeout=60)
        if not any(
            isinstance(f.message, m.State) and f.message.entity_id == marker for f in frames
        ):
            frames += sub.collect(
                lambda f: isinstance(f.message, m.State) and f.message.entity_id == marker,
                timeout=10,
            )
        assert {f.stream_id for f in frames} == {stream}
        notes = [f.message for f in frames]
        sub.close()
        end = next(i for i, msg in enumerate(notes) if isinstance(msg, m.BootstrapEnd))
        live = [
            i
            for i, msg in enumerate(notes)
            if isinstance(msg, m.Deleted)
            or (isinstance(msg, m.State) and msg.change != m.Change.BOOTSTRAP)
        ]
        live_before_end = sum(1 for i in live if i < end)
        booted_after_live = sum(
            1
            for msg in notes[live[0] : end]
            if isinstance(msg, m.State) and msg.change == m.Change.BOOTSTRAP
        )
        # The writes really raced the bootstrap: most live notifications came inside it,
        # and the scan went on after them.
        expected_live = 1 + fresh + len(updated) + len(retracted) + 1
        assert len(live) == expected_live, (len(live), expected_live)
        assert live_before_end > expected_live // 2, (live_before_end, expected_live)
        assert booted_after_live > 1000, booted_after_live
        view: dict[bytes, tuple[int, m.State | None]] = {}
        for msg in notes:
            fold(view, msg)
        booted = [
            msg.entity_id
            for msg in notes
            if isinstance(msg, m.State) and msg.change == m.Change.BOOTSTRAP
        ]
        assert len(booted) == len(set(booted))  # one scan: each entity at most once
        truth: dict[bytes, tuple[int, int, list[object]]] = {}
        for e, reply in query_many(writer, k, [eid(i) for i in range(preload + fresh + 2)]).items():
            if isinstance(reply, m.State):
                truth[e] = (reply.version, reply.source_set, list(reply.fields(FIELDS)))
        seen = {
            e: (version, s.source_set, list(s.fields(FIELDS)))
            for e, (version, s) in view.items()
            if s is not None
        }
        assert first_new in seen and seen[first_new][2] == [1.0, "right after SUBSCRIBE"]
        assert len(truth) == preload + fresh + 2 - len(retracted)
        assert seen.keys() == truth.keys()
        assert seen == truth


def memory_of(pid: int, key: str = "VmRSS") -> int:
    """A memory figure of the process from /proc/PID/status (VmRSS: resident now; VmHWM:
    the peak since it was last reset), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key}")


def reset_peak_memory(pid: int) -> None:
    """Start VmHWM over from the current RSS (Linux >= 4.0)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


@pytest.mark.slow
def unread_bytes(sock: socket.socket) -> int:
    """Bytes in the socket's receive queue, not yet read."""
    unread: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4)))[0]
    return unread


def test_large_bootstrap_to_a_stalled_subscriber_is_held_back(
    make_cdb_server: Callable[..., Server],
) -> None:
    """A 200,000-entity bootstrap (about 60 MB of frames) to a subscriber that does not
    read: the server sends at the socket's pace, so its memory stays put (a server that
    encoded the whole bootstrap into the socket's buffer grows by the bootstrap's size),
    and it goes on serving others. Read later, the bootstrap is whole: every entity
    exactly once, then BOOTSTRAP_END."""
    fields = [("n", FieldType.U32), ("blob", FieldType.STRING)]
    count, blob = 200_000, "b" * 220
    proc = make_cdb_server('[storage]\nsync = "none"\n')
    pid, port = proc.pid, proc.ports["convergedb"]
    with CdbClient(port, name="bulk", deadline_ms=60_000) as w:
        kind = w.create_kind("bulk", fields)
        k = kind.kind_id
        for start in range(0, count, 2000):
            ops = tuple(
                m.Assert.of(fields, k, eid(i), [i, blob]) for i in range(start, start + 2000)
            )
            w.send(m.Batch(ops))
        w.barrier()
        assert state_of(query(w, k, eid(count - 1))).fields(fields) == [count - 1, blob]
        with proc.client() as sql:  # the writes have reached every projection
            counted = "SELECT count(*) FROM bulk"
            wait_until(lambda: rows_of(sql_query(sql, counted)) == [[count]])
        before = memory_of(pid)
        reset_peak_memory(pid)
        slow = CdbClient(port, read_only=True, rcvbuf=64 << 10)
        stream = slow.send(m.Subscribe(k, bootstrap=True))
        assert slow.reply(stream).message == m.Ack(Opcode.SUBSCRIBE)
        # The subscriber reads nothing more: the server fills its receive window and
        # is held back. Meanwhile other clients are answered at once: a QUERY, and a
        # write with its ACK.
        wait_until(
            lambda: unread_bytes(slow.sock) >= 32 << 10, message="the server sent no bootstrap"
        )
        # No clock here: a server blocked on the stalled socket would answer neither
        # until the subscriber read (it never does before these return).
        for attempt in range(4):
            assert state_of(query(w, k, eid(attempt))).fields(fields) == [attempt, blob]
            w.call(m.Patch.of(fields, k, eid(attempt), {0: attempt + 1}))
        during = memory_of(pid, "VmHWM")
        # Now read it all.
        frames = slow.collect(lambda f: isinstance(f.message, m.BootstrapEnd), timeout=120)
        after = memory_of(pid, "VmHWM")
        slow.close()
    booted = [
        f.message.entity_id
        for f in frames
        if isinstance(f.message, m.State) and f.message.change == m.Change.BOOTSTRAP
    ]
    assert (12 + len(frames[1].message.encode())) * count > 50 << 20  # that large
    assert isinstance(frames[0].message, m.BootstrapBegin)
    assert len(booted) == len(set(booted)) == count
    assert set(booted) == {eid(i) for i in range(count)}
    # The peak RSS while the subscriber stalled, and until it had read everything,
    # against the RSS before it subscribed. Measured growth is under 1 MiB; a server
    # without backpressure grows by tens of MiB.
    margin = 8 << 20
    assert during - before < margin, (before, during)
    assert after - before < margin, (before, after)


def test_live_buffer_overflow_disconnects(port: int) -> None:
    with CdbClient(port, name="flood") as writer:
        kind = writer.create_kind("flood", [("blob", FieldType.STRING)])
        slow = CdbClient(port, read_only=True)
        stream = slow.send(m.Subscribe(kind.kind_id))
        assert slow.reply(stream).message == m.Ack(Opcode.SUBSCRIBE)
        blob = "x" * 2000
        for round_ in range(12):  # 12 x 1,000 notifications of 2 kB: far past 4,096
            ops = tuple(
                m.Assert.of([("blob", FieldType.STRING)], kind.kind_id, eid(i), [f"{round_}{blob}"])
                for i in range(1000)
            )
            writer.send(m.Batch(ops))
            writer.barrier()  # one window per round: 1,000 net changes each
        frames = slow.until_closed(timeout=30)
        errors = [f.message for f in frames if isinstance(f.message, m.ErrorMessage)]
        assert errors and errors[-1].code == ErrorCode.SUBSCRIPTION_OVERFLOW
        notes = [f for f in frames if isinstance(f.message, m.State)]
        assert len(notes) < 12_000
        # The writer and the server are fine.
        assert isinstance(query(writer, kind.kind_id, eid(1)), m.State)
        with pytest.raises(Closed):
            slow.call(m.Heartbeat())


def test_event_stream_kind_delivers_every_op(port: int) -> None:
    with CdbClient(port, name="ev") as w, CdbClient(port, read_only=True) as r:
        kind = w.create_kind("clicks", FIELDS, event_stream=True)
        stream = r.send(m.Subscribe(kind.kind_id, events=True))
        r.reply(stream)
        w.send(m.Assert.of(FIELDS, kind.kind_id, eid(1), [1.0], b"m"))
        w.send(m.Patch.of(FIELDS, kind.kind_id, eid(1), {1: "p"}))
        w.send(m.Retract(kind.kind_id, eid(1)))
        w.barrier()
        events = r.messages(stream, 3)
        assert [(e.op, e.sequence, e.presence_mask) for e in events if isinstance(e, m.Event)] == [
            (Opcode.ASSERT, 0, 0b11),
            (Opcode.PATCH, 1, 0b10),
            (Opcode.RETRACT, 2, 0),
        ]
        assert isinstance(events[0], m.Event) and events[0].metadata == b"m"
        assert events[0].source_id == w.source_id


def test_sigkill_restart_keeps_identical_state_and_sql(
    make_cdb_server: Callable[..., Server],
) -> None:
    proc = make_cdb_server()
    port = proc.ports["convergedb"]
    a = CdbClient(port, name="a", source_id=3)
    b = CdbClient(port, name="b", source_id=4)
    kind = a.create_kind("durable", FIELDS)
    for r in range(4):
        a.send(
            m.Batch(
                tuple(
                    m.Assert.of(FIELDS, kind.kind_id, eid(i), [float(r * 100 + i), f"r{r}"])
                    for i in range(60)
                )
            )
        )
        b.send(
            m.Batch(
                tuple(
                    m.Patch.of(FIELDS, kind.kind_id, eid(i), {1: f"b{r}"}) for i in range(0, 60, 4)
                )
            )
        )
        a.send(m.Batch(tuple(m.Retract(kind.kind_id, eid(i)) for i in range(r, 60, 7))))
    a.barrier()
    b.barrier()
    before = {i: query(a, kind.kind_id, eid(i)) for i in range(60)}
    sql = proc.client()
    rows = rows_of(sql_query(sql, ALL_ROWS))
    live = {eid(i): s for i, s in before.items() if isinstance(s, m.State)}
    assert [r[0] for r in rows] == [k.hex() for k in sorted(live)]
    assert [(r[1], float(r[2]), r[3]) for r in rows] == [
        (live[k].version, *live[k].fields(FIELDS)) for k in sorted(live)
    ]
    # As of a position: an entity's old values before its patch, and not yet there
    # before its assert.
    marker = eid(1000)
    a.call(m.Assert.of(FIELDS, kind.kind_id, marker, [1.0, "old"]))
    v1 = state_of(query(a, kind.kind_id, marker)).version
    a.call(m.Patch.of(FIELDS, kind.kind_id, marker, {1: "new"}))
    where = f"SELECT label, version FROM durable WHERE entity_id = '{marker.hex()}'"
    assert rows_of(query_at(sql, where, v1 + 1)) == [["old", v1]]
    assert rows_of(query_at(sql, where, v1)) == []
    assert rows_of(sql_query(sql, where))[0][0] == "new"
    a.call(m.Retract(kind.kind_id, marker))
    sql.close()
    proc.kill()
    a.close()
    b.close()
    proc.start()
    port = proc.ports["convergedb"]
    with CdbClient(port, read_only=True) as r:
        after = {i: query(r, kind.kind_id, eid(i)) for i in range(60)}
    assert after == before
    sql = proc.client()
    again = rows_of(sql_query(sql, ALL_ROWS))
    assert again == rows
    sql.close()


def bootstrap_of(client: CdbClient, kind_id: int) -> list[m.State]:
    """Subscribe with bootstrap and return its STATEs (change 2) once BOOTSTRAP_END came."""
    stream = client.send(m.Subscribe(kind_id, bootstrap=True))
    assert client.reply(stream).message == m.Ack(Opcode.SUBSCRIBE)
    states: list[m.State] = []
    while True:
        msg = client.take(lambda f: f.stream_id == stream).message
        if isinstance(msg, m.BootstrapEnd):
            return states
        if isinstance(msg, m.State) and msg.change == m.Change.BOOTSTRAP:
            states.append(msg)


def test_metadata_reaches_notifications_and_is_never_stored(
    make_cdb_server: Callable[..., Server],
) -> None:
    proc = make_cdb_server()
    port = proc.ports["convergedb"]
    with CdbClient(port, name="w", source_id=5) as w, CdbClient(port, read_only=True) as r:
        kind = w.create_kind("meta", FIELDS)
        stream = r.send(m.Subscribe(kind.kind_id, bootstrap=False))
        r.reply(stream)
        w.call(m.Assert.of(FIELDS, kind.kind_id, eid(1), [1.0, "one"], b"created-1"))
        w.call(m.Assert.of(FIELDS, kind.kind_id, eid(2), [2.0, "two"], b"created-2"))
        w.call(m.Patch.of(FIELDS, kind.kind_id, eid(2), {1: "patched"}, b"patched-2"))
        w.call(m.Assert.of(FIELDS, kind.kind_id, eid(3), [3.0], b"created-3"))
        w.call(m.Retract(kind.kind_id, eid(3), b"gone-3"))
        live = r.messages(stream, 5)
        got = [
            (type(n).__name__, n.entity_id, n.metadata)
            for n in live
            if isinstance(n, m.State | m.Deleted)
        ]
        assert got == [
            ("State", eid(1), b"created-1"),
            ("State", eid(2), b"created-2"),
            ("State", eid(2), b"patched-2"),
            ("State", eid(3), b"created-3"),
            ("Deleted", eid(3), b"gone-3"),
        ]
        queried = {i: state_of(query(w, kind.kind_id, eid(i))) for i in (1, 2)}
        assert all(q.metadata == b"" for q in queried.values())
        assert queried[2].fields(FIELDS) == [2.0, "patched"]
    with CdbClient(port, read_only=True) as r:
        booted = bootstrap_of(r, kind.kind_id)
    assert sorted(s.entity_id for s in booted) == [eid(1), eid(2)]
    assert all(s.metadata == b"" for s in booted)
    # A crash and restart rebuild the state from the changelog: still no metadata,
    # the same versions and values.
    proc.kill()
    proc.start()
    port = proc.ports["convergedb"]
    with CdbClient(port, read_only=True) as r:
        after = {i: state_of(query(r, kind.kind_id, eid(i))) for i in (1, 2)}
        assert {i: (s.version, s.fields(FIELDS), s.metadata) for i, s in after.items()} == {
            i: (q.version, q.fields(FIELDS), b"") for i, q in queried.items()
        }
        rebooted = bootstrap_of(r, kind.kind_id)
    assert sorted((s.entity_id, s.version, s.metadata) for s in rebooted) == [
        (eid(i), queried[i].version, b"") for i in (1, 2)
    ]


def test_acks_arrive_after_the_client_half_closes(port: int) -> None:
    with CdbClient(port, name="half") as w:
        kind = w.create_kind("halfclose", FIELDS)
        streams = [
            w.send(m.Assert.of(FIELDS, kind.kind_id, eid(i), [float(i)]), ack=True)
            for i in range(5)
        ]
        w.sock.shutdown(socket.SHUT_WR)
        frames = w.until_closed()
        acked = {f.stream_id for f in frames if f.message == m.Ack(Opcode.ASSERT)}
        assert acked == set(streams)
    with CdbClient(port, read_only=True) as r:
        assert all(isinstance(query(r, kind.kind_id, eid(i)), m.State) for i in range(5))


def test_queries_whose_answers_nobody_reads_are_not_answered_into_memory(
    server: Server, port: int
) -> None:
    """A QUERY of 44 bytes can answer megabytes: a client that pipelined them and read
    nothing grew the server by 4 MiB a query (600 MiB for 150), held until it left. A
    client whose answers wait unread is no longer read from; it gets every answer as it
    reads them."""
    wide = [(f"f{i}", FieldType.STRING) for i in range(64)]
    big = ["z" * 65_535] * 64  # 4 MiB, legal
    with CdbClient(port, name="big-writer", source_id=40) as writer:
        kind = writer.create_kind("wide_entities", wide).kind_id
        assert writer.call(m.Assert.of(wide, kind, eid(1), big)) == m.Ack(Opcode.ASSERT)
        baseline = process_memory(server.pid)
        assert baseline is not None
        count = 100
        with (
            CdbClient(port, name="hog", read_only=True, rcvbuf=4096) as hog,
            RssSampler(server.pid) as sampler,
        ):
            streams = [hog.conn.send(m.Query(kind, eid(1)), ack=True) for _ in range(count)]
            hog.sock.sendall(b"".join(data for _, data in streams))
            first = hog.reply(streams[0][0], timeout=30).message  # it took the queries up
            # A round trip on another connection: the server's loop has run past the
            # hog's frames (without the limit, all of them answered into memory by now).
            assert isinstance(query(writer, kind, eid(1)), m.State)
            grown = sampler.peak_anon - baseline.rss_anon
            answers = [first] + [hog.reply(s, timeout=30).message for s, _ in streams[1:]]
        assert grown < 40 * MIB, sampler.report()
        assert all(isinstance(a, m.State) and a.entity_id == eid(1) for a in answers)


def test_a_client_that_stops_sending_gets_every_answer_held_back(port: int) -> None:
    """Requests wait unread while the client reads nothing; one that then ends its side
    of the connection (EOF) and reads still gets an answer to each, then the close."""
    wide = [(f"f{i}", FieldType.STRING) for i in range(64)]
    with CdbClient(port, name="eof-writer", source_id=41) as writer:
        kind = writer.create_kind("wide_entities_eof", wide).kind_id
        writer.call(m.Assert.of(wide, kind, eid(1), ["y" * 65_535] * 64))
    with CdbClient(port, name="eof-reader", read_only=True, rcvbuf=4096) as reader:
        streams = [reader.conn.send(m.Query(kind, eid(1)), ack=True) for _ in range(20)]
        reader.sock.sendall(b"".join(data for _, data in streams))
        reader.sock.shutdown(socket.SHUT_WR)
        answers = [reader.reply(stream, timeout=30).message for stream, _ in streams]
        assert all(isinstance(a, m.State) and a.entity_id == eid(1) for a in answers)
        assert reader.until_closed() == []
