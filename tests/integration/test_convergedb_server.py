"""The ConvergeDB listener of a real ``headwater serve`` process, over the wire."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from convergedb_raw import CdbClient, Closed, cdb_config, cdb_port, eid, query
from kimberlite_raw import ServerProcess, query_at, rows_of
from kimberlite_raw import query as sql_query

from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.codes import ErrorCode, Opcode
from headwater.protocols.convergedb.fields import FieldType

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
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("cdb"), cdb_config(AUTH)).start()
    try:
        yield proc
    finally:
        proc.terminate()


@pytest.fixture()
def port(server: ServerProcess) -> int:
    return cdb_port(server)


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
        b.call(m.Patch.of(FIELDS, kind.kind_id, eid(1), {0: 21.5}))
        both = state_of(query(reader, kind.kind_id, eid(1)))
        assert both.source_set == 0b110 and both.fields(FIELDS) == [21.5, "a"]
        a.call(m.Retract(kind.kind_id, eid(1)))
        still = state_of(query(reader, kind.kind_id, eid(1)))
        assert still.source_set == 0b100 and still.version > both.version
        b.call(m.Retract(kind.kind_id, eid(1), b"bye"))
        gone = query(reader, kind.kind_id, eid(1))
        assert isinstance(gone, m.ErrorMessage) and gone.code == ErrorCode.ENTITY_NOT_FOUND
        notes = [f.message for f in reader.drain(0.2) if f.stream_id == stream]
        created, patched, retracted, deleted = notes
        assert isinstance(created, m.State) and created.change == m.Change.CREATED
        assert created.metadata == b"meta-a"  # passed through, never stored
        assert query(reader, kind.kind_id, eid(1)) is not None
        assert isinstance(patched, m.State) and patched.change == m.Change.UPDATED
        assert patched.changed_fields == 0b01 and patched.previous_fields(FIELDS) == [20.0, "a"]
        assert isinstance(retracted, m.State) and retracted.source_set == 0b100
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
        deadline = time.monotonic() + 10
        while isinstance(query(keeper, kind.kind_id, eid(1)), m.State):
            assert time.monotonic() < deadline, "the dead writer's entity was never retracted"
            time.sleep(0.05)
        assert state_of(query(keeper, kind.kind_id, eid(2))).source_set == 1 << 20


def test_writer_reconnecting_in_time_keeps_its_entities(port: int) -> None:
    with CdbClient(port, read_only=True) as reader:
        first = CdbClient(port, name="w", source_id=22, deadline_ms=1000)
        kind = first.create_kind("reconnect", FIELDS)
        first.call(m.Assert.of(FIELDS, kind.kind_id, eid(1), [1.0]))
        first.abort()
        time.sleep(0.2)
        second = CdbClient(port, name="w", source_id=22, deadline_ms=1000)
        for _ in range(10):  # 1.5 s: past the deadline, heartbeating
            time.sleep(0.15)
            second.send(m.Heartbeat())
        assert state_of(query(reader, kind.kind_id, eid(1))).source_set == 1 << 22
        # A connected source that stops talking is dead as well: closed and retracted.
        frames = second.until_closed(timeout=10)
        assert all(f.stream_id == 0 or isinstance(f.message, m.Ack) for f in frames)
        deadline = time.monotonic() + 10
        while isinstance(query(reader, kind.kind_id, eid(1)), m.State):
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_bootstrap_racing_live_writes_has_no_gaps(port: int) -> None:
    with CdbClient(port, name="racer") as writer:
        kind = writer.create_kind("race", FIELDS)
        writer.send(
            m.Batch(tuple(m.Assert.of(FIELDS, kind.kind_id, eid(i), [0.0]) for i in range(300)))
        )
        writer.barrier()
        stop = threading.Event()

        def write() -> None:
            n = 1
            while not stop.is_set():
                ops: list[m.WriteOp] = [
                    m.Assert.of(FIELDS, kind.kind_id, eid((n * 7 + i) % 400), [float(n)])
                    for i in range(20)
                ]
                ops.append(m.Retract(kind.kind_id, eid(n % 400)))
                writer.send(m.Batch(tuple(ops)))
                n += 1
                time.sleep(0.002)

        thread = threading.Thread(target=write)
        thread.start()
        try:
            time.sleep(0.1)
            sub = CdbClient(port, read_only=True)
            stream = sub.send(m.Subscribe(kind.kind_id, bootstrap=True))
            time.sleep(0.3)
        finally:
            stop.set()
            thread.join()
        writer.barrier()
        # Highest version wins, a deletion counts with its version.
        view: dict[bytes, tuple[int, list[object] | None]] = {}
        frames = sub.drain(0.5)
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
        seen = {k: v for k, v in view.items() if v[1] is not None}
        assert seen == truth
        sub.close()


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
        events = [f.message for f in r.drain(0.3) if f.stream_id == stream]
        assert [(e.op, e.sequence, e.presence_mask) for e in events if isinstance(e, m.Event)] == [
            (Opcode.ASSERT, 0, 0b11),
            (Opcode.PATCH, 1, 0b10),
            (Opcode.RETRACT, 2, 0),
        ]
        assert isinstance(events[0], m.Event) and events[0].metadata == b"m"
        assert events[0].source_id == w.source_id


def test_sigkill_restart_keeps_identical_state_and_sql(tmp_path: Path) -> None:
    proc = ServerProcess(tmp_path / "srv", cdb_config()).start()
    try:
        port = cdb_port(proc)
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
                        m.Patch.of(FIELDS, kind.kind_id, eid(i), {1: f"b{r}"})
                        for i in range(0, 60, 4)
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
        port = cdb_port(proc)
        with CdbClient(port, read_only=True) as r:
            after = {i: query(r, kind.kind_id, eid(i)) for i in range(60)}
        assert after == before
        sql = proc.client()
        again = rows_of(sql_query(sql, ALL_ROWS))
        assert again == rows
        sql.close()
    finally:
        proc.terminate()


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
