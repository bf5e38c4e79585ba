"""The Ripple listener of a real ``headwater serve`` process: deltas into kinds,
redelivery, checkpoints, schema checks and restarts."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
from convergedb_raw import CdbClient, eid, query
from kimberlite_raw import query as sql_query
from kimberlite_raw import rows_of
from servers import LOCAL, Server

from headwater.protocols.convergedb import messages as cm
from headwater.protocols.ripple import connection as rc
from headwater.protocols.ripple import messages as rm
from headwater.protocols.ripple.connection import ClientConnection
from headwater.ripple import Worker as Worker_
from headwater.ripple import WorkerError
from waiting import wait_until

OPENAPI = Path(__file__).parents[2] / "src" / "headwater" / "server" / "openapi.json"
LISTEN = {"convergedb": LOCAL, "ripple": LOCAL, "http": LOCAL}
VWAP = rm.Schema(
    "vwap",
    1,
    (
        rm.Field("symbol", rm.FieldType.STRING),
        rm.Field("vwap", rm.FieldType.FLOAT),
        rm.Field("volume", rm.FieldType.INT),
        rm.Field("open", rm.FieldType.BOOL),
    ),
)


class Worker:
    """A blocking Ripple worker over the sans-I/O ClientConnection."""

    def __init__(self, server: Server, worker_id: str, schemas: dict[str, rm.Schema]):
        port = server.ports["ripple"]
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        self.conn = ClientConnection(worker_id)
        self.sock.sendall(self.conn.handshake(schemas))
        self.answer = self.next(rm.SchemaNegotiation)

    def next(self, kind: type) -> rm.Message:
        while True:
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("the server closed the connection")
            for received in self.conn.receive_data(data):
                if isinstance(received.message, kind):
                    return received.message

    def send(self, output: str, key: str, delta: rm.Delta, **kw: object) -> None:
        self.sock.sendall(self.conn.send_delta(output, key, delta, **kw))  # type: ignore[arg-type]

    def checkpoint(self, checkpoint_id: str) -> rm.CheckpointAck:
        self.sock.sendall(self.conn.checkpoint_request(checkpoint_id, 1))
        ack = self.next(rm.CheckpointAck)
        assert isinstance(ack, rm.CheckpointAck)
        return ack

    def closed_by_server(self) -> bool:
        self.sock.settimeout(10)
        try:
            while self.sock.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture()
def server(make_server: Callable[..., Server]) -> Server:
    """A server of the test's own; a restarted one keeps its addresses."""
    return make_server(listen=LISTEN)


@pytest.fixture()
def address(server: Server) -> str:
    """The server's Ripple address."""
    return server.address_of("ripple")


def state(server: Server) -> list[list[object]]:
    with server.client() as c:
        return rows_of(
            sql_query(c, "SELECT entity_id, symbol, vwap, volume, open FROM vwap ORDER BY 1")
        )


def hex_key(key: str) -> str:
    return key.encode().ljust(32, b"\0").hex()


def quote(symbol: str, px: float, volume: int) -> rm.Set:
    return rm.Set({"symbol": symbol, "vwap": px, "volume": volume, "open": True})


def test_deltas_become_kind_state_and_redelivery_changes_nothing(server: Server) -> None:
    worker = Worker(server, "w1", {"vwap": VWAP})
    assert worker.answer == rm.SchemaNegotiation(True, ())
    cdb = server.ports["convergedb"]
    with (
        CdbClient(cdb, read_only=True) as watcher,
        CdbClient(cdb, name="marker") as marker,
    ):
        kind = watcher.call(cm.GetKind("vwap"))
        assert isinstance(kind, cm.KindAck), kind
        stream = watcher.send(cm.Subscribe(kind.kind_id), ack=True)
        watcher.reply(stream)

        def until_marker(change: type[cm.Message]) -> list[cm.Message]:
            """The notifications up to the marker source's next write (``change``), which
            comes after every earlier one (a subscription gets windows in order)."""
            frames = watcher.collect(
                lambda f: isinstance(f.message, change) and f.message.entity_id == eid(1)
            )
            return [f.message for f in frames[:-1] if f.stream_id == stream]

        symbol = [("symbol", cm.FieldType.STRING)]
        worker.send("vwap", "AAA", quote("AAA", 10.5, 100), watermark_ns=1_000)
        worker.send("vwap", "BBB", quote("BBB", 20.0, 5))
        worker.send("vwap", "AAA", rm.Patch((rm.FieldSet("vwap", rm.Atom("11.25")),)))
        assert worker.checkpoint("c1").last_sequence_no == 3
        marker.call(cm.Assert.of(symbol, kind.kind_id, eid(1), ["marker"]))
        first = until_marker(cm.State)
        # The same three deltas again, with their sequence numbers: a redelivery.
        for seq, (key, delta) in enumerate(
            [("AAA", quote("AAA", 10.5, 100)), ("BBB", quote("BBB", 20.0, 5))], start=1
        ):
            worker.send("vwap", key, delta, sequence_no=seq)
        worker.send("vwap", "BBB", rm.Remove(), sequence_no=3)  # also old: dropped
        worker.checkpoint("c2")
        marker.call(cm.Retract(kind.kind_id, eid(1)))
        assert until_marker(cm.Deleted) == []  # no notification for a redelivery
    assert len([n for n in first if isinstance(n, cm.State)]) >= 2
    assert state(server) == [
        [hex_key("AAA"), "AAA", "11.25", 100, True],
        [hex_key("BBB"), "BBB", "20.0", 5, True],
    ]
    worker.send("vwap", "BBB", rm.Remove())  # sequence 4: new
    worker.checkpoint("c3")
    assert [r[0] for r in state(server)] == [hex_key("AAA")]
    http = server.ports["http"]
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10) as answer:
        metrics = answer.read().decode()
    assert 'headwater_ripple_watermark_ns{output="vwap",tenant="0",worker="w1"} 1000.0' in metrics
    assert 'headwater_ripple_deltas_total{outcome="duplicate"} 3.0' in metrics
    # Liveness and progress per worker, as the HTTP API shows them (checked against
    # the OpenAPI document's schema).
    worker.sock.sendall(worker.conn.heartbeat(time.time_ns(), 0.75))
    worker.checkpoint("c4")
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/api/ripple/workers") as answer:
        shown = json.loads(answer.read())
    spec = json.loads(OPENAPI.read_text())
    jsonschema.validate(shown, spec["components"]["schemas"]["RippleWorkers"])
    [w1] = shown["workers"]
    assert (w1["worker_id"], w1["connected"], w1["load"]) == ("w1", True, 0.75)
    assert w1["last_heartbeat"] > time.time() - 60
    assert w1["outputs"] == [
        {"output": "vwap", "last_sequence_no": 4, "durable_sequence_no": 4, "watermark_ns": 1000}
    ]
    worker.close()

    def disconnected() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/api/ripple/workers") as answer:
            return not json.loads(answer.read())["workers"][0]["connected"]

    # The server notices the worker leave (its slot's liveness deadline starts).
    wait_until(disconnected, message="the worker still shows as connected")


def test_dedupe_survives_a_restart_and_a_restarted_worker_converges(
    server: Server,
) -> None:
    worker = Worker(server, "w2", {"vwap": VWAP})
    for i in range(20):
        worker.send("vwap", f"S{i % 5}", quote(f"S{i % 5}", float(i), i))
    worker.checkpoint("c1")
    worker.close()
    expected = state(server)
    assert len(expected) == 5
    assert server.stop() == 0
    server.start()
    # The restarted worker replays from its last checkpoint's start: all 20 again.
    again = Worker(server, "w2", {"vwap": VWAP})
    for i in range(20):
        again.send("vwap", f"S{i % 5}", quote(f"S{i % 5}", 99.0, 0), sequence_no=i + 1)
    again.send("vwap", "S0", quote("S0", 1.0, 1), sequence_no=21)
    again.checkpoint("c2")
    now = state(server)
    assert now[1:] == expected[1:]  # the replay changed nothing
    assert now[0][1:4] == ["S0", "1.0", 1]  # the new delta applied
    again.close()


def test_an_incompatible_schema_is_refused_with_reasons(server: Server) -> None:
    Worker(server, "w3", {"vwap": VWAP}).close()
    clash = rm.Schema("vwap", 2, (rm.Field("symbol", rm.FieldType.INT),))
    refused = Worker(server, "w4", {"vwap": clash})
    assert refused.answer.ok is False  # type: ignore[union-attr]
    assert "vwap" in " ".join(refused.answer.errors)  # type: ignore[union-attr]
    assert refused.closed_by_server()
    # Appending a field is a migration the kind accepts.
    wider = rm.Schema("vwap", 2, (*VWAP.fields, rm.Field("venue", rm.FieldType.STRING)))
    accepted = Worker(server, "w5", {"vwap": wider})
    assert accepted.answer.ok is True  # type: ignore[union-attr]
    accepted.send(
        "vwap", "X", rm.Set({"symbol": "X", "vwap": 1.0, "volume": 1, "open": False, "venue": "N"})
    )
    accepted.checkpoint("c")
    with server.client() as c:
        assert rows_of(sql_query(c, "SELECT venue FROM vwap WHERE symbol = 'X'")) == [["N"]]
    accepted.close()


# ---- the Python worker (headwater.ripple.Worker) ---------------------------------------


@dataclass
class Quote:
    symbol: str
    vwap: float
    volume: int
    open: bool


def run(worker: Worker_, output: str, deltas: range) -> None:
    """Deterministic deltas: sequence number n sets key K(n % 7) from n."""
    for n in deltas:
        key = f"K{n % 7}"
        if n % 11 == 0:
            worker.remove(output, key, sequence_no=n)
        elif n % 5 == 0:
            worker.patch(output, key, sequence_no=n, volume=n)
        else:
            worker.set(output, key, Quote(key, n / 4, n, n % 2 == 0), sequence_no=n)


def table(server: Server, kind: str) -> list[list[object]]:
    with server.client() as c:
        return rows_of(
            sql_query(c, f"SELECT entity_id, symbol, vwap, volume, open FROM {kind} ORDER BY 1")
        )


def test_worker_killed_and_restarted_from_its_checkpoint_converges(
    server: Server, address: str
) -> None:
    with Worker_("steady", {"steady": Quote}, address) as steady:
        run(steady, "steady", range(1, 301))
        steady.checkpoint()
    crashy = Worker_("crashy", {"crashy": Quote}, address)
    run(crashy, "crashy", range(1, 151))
    crashy.checkpoint()
    run(crashy, "crashy", range(151, 231))
    crashy._kill()  # killed: no goodbye, no checkpoint
    # A new process restarts from the checkpoint and replays its deterministic input.
    with Worker_("crashy", {"crashy": Quote}, address) as restarted:
        run(restarted, "crashy", range(151, 301))
        assert restarted.checkpoint() == 300
    assert table(server, "crashy") == table(server, "steady")
    assert len(table(server, "steady")) >= 5


def test_worker_reconnects_and_resends_after_a_server_restart(server: Server, address: str) -> None:
    with Worker_("w", {"quotes": Quote}, address, heartbeat_s=0.05) as worker:
        worker.set("quotes", "A", Quote("A", 1.0, 1, True))
        worker.checkpoint()
        assert server.stop() == 0
        server.start()
        worker.set("quotes", "B", Quote("B", 2.0, 2, False))  # the old socket is dead
        worker.patch("quotes", "A", vwap=1.5)
        assert worker.checkpoint() == 3
        assert worker.reconnects >= 1
    assert table(server, "quotes") == [
        [hex_key("A"), "A", "1.5", 1, True],
        [hex_key("B"), "B", "2.0", 2, False],
    ]


def test_field_set_numbers_are_decimal_digits_only(server: Server, address: str) -> None:
    # Python's int() and float() once read these (underscores, spaces, Arabic-Indic
    # digits), where docs/protocols/ripple.md says an optional sign, then digits.
    with Worker_("strict", {"strict": Quote}, address) as worker:
        worker.set("strict", "A", Quote("A", 1.0, 1, True))
        assert worker.checkpoint() == 1
    for field, text in (
        ("volume", "1_000"),
        ("volume", " 12 "),
        ("volume", "\u0661\u0662\u0663"),
        ("vwap", "1_000.5"),
        ("volume", "9223372036854775808"),
    ):
        with (
            Worker_("strict", {"strict": Quote}, address, resume=True) as worker,
            pytest.raises(WorkerError, match=f"field {field}: .* is not a"),
        ):
            worker.patch("strict", "A", **{field: text})
            worker.checkpoint()
    with Worker_("strict", {"strict": Quote}, address, resume=True) as worker:
        worker.patch("strict", "A", volume="-12", vwap="1e3")
        worker.checkpoint()
    assert table(server, "strict") == [[hex_key("A"), "A", "1000.0", -12, True]]


def test_worker_refused_for_an_incompatible_schema(
    address: str,
) -> None:
    Worker_("a", {"clash": Quote}, address).close()

    @dataclass
    class Other:
        symbol: int

    with pytest.raises(WorkerError, match="clash"):
        Worker_("b", {"clash": Other}, address)


def test_worker_answers_the_servers_checkpoint_request() -> None:
    """Checkpoints go both ways: a server (here a stand-in speaking the server side of the
    codec) asks, the worker acknowledges with its last sequence number."""
    from headwater.protocols.ripple.connection import MessageReceived, ServerConnection

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    acks: list[rm.CheckpointAck] = []

    def serve() -> None:
        conn, _ = listener.accept()
        server = ServerConnection()
        conn.settimeout(10)
        while True:
            data = conn.recv(1 << 16)
            if not data:
                return
            for event in server.receive_data(data):
                if isinstance(event, rc.HandshakeReceived):
                    conn.sendall(server.accept_handshake())
                elif isinstance(event, rc.DeltaReceived) and event.message.sequence_no == 2:
                    conn.sendall(server.send(rm.CheckpointRequest("from-server", 7)))
                elif isinstance(event, MessageReceived) and isinstance(
                    event.message, rm.CheckpointAck
                ):
                    acks.append(event.message)
                    conn.close()
                    return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with Worker_("w", {"quotes": Quote}, f"127.0.0.1:{port}", heartbeat_s=0.05) as worker:
        worker.set("quotes", "A", Quote("A", 1.0, 1, True))
        worker.set("quotes", "B", Quote("B", 2.0, 2, True))
        thread.join(10)
    listener.close()
    assert acks == [rm.CheckpointAck("from-server", "w", 7, 2)]


def test_a_resuming_worker_numbers_after_what_the_server_applied(
    server: Server, address: str
) -> None:
    with Worker_("job", {"quotes": Quote}, address) as first:
        first.set("quotes", "A", Quote("A", 1.0, 1, True))
        first.set("quotes", "A", Quote("A", 2.0, 2, True))
        first.checkpoint()
    with Worker_("job", {"quotes": Quote}, address) as naive:
        naive.set("quotes", "A", Quote("A", 9.0, 9, True))  # sequence 1 again: dropped
        naive.checkpoint()
    assert table(server, "quotes")[0][2] == "2.0"
    with Worker_("job", {"quotes": Quote}, address, resume=True) as resumed:
        assert resumed.set("quotes", "A", Quote("A", 3.0, 3, True)) == 3
        resumed.checkpoint()
    assert table(server, "quotes")[0][2] == "3.0"


SHORT_MS = 200


@pytest.mark.parametrize(("liveness_ms", "kept"), [(SHORT_MS, False), (60_000, True)])
def test_a_gone_workers_entities_last_its_liveness_deadline(
    make_server: Callable[..., Server], liveness_ms: int, kept: bool
) -> None:
    """``[ripple] liveness_ms``: how long what a worker wrote outlives its connection."""
    proc = make_server(config=f"[ripple]\nliveness_ms = {liveness_ms}\n", listen=LISTEN)
    cdb = proc.ports["convergedb"]
    with CdbClient(cdb, read_only=True) as reader:
        with Worker_("batch-job", {"held": Quote}, proc.address_of("ripple")) as worker:
            run(worker, "held", range(1, 8))
            worker.checkpoint()
        assert len(table(proc, "held")) == 7
        if not kept:
            wait_until(lambda: not table(proc, "held"), message="the entities outlived 200 ms")
            return
        # A canary source with twice the short deadline, silent from the moment the
        # worker left: once its entity is gone, the short deadline has long passed.
        canary = CdbClient(cdb, name="canary", deadline_ms=2 * SHORT_MS)
        n = [("n", cm.FieldType.U32)]
        kind = canary.create_kind("canary", n)
        canary.call(cm.Assert.of(n, kind.kind_id, eid(1), [1]))
        wait_until(
            lambda: isinstance(query(reader, kind.kind_id, eid(1)), cm.ErrorMessage),
            message="the canary outlived its deadline",
        )
        canary.close()
    assert len(table(proc, "held")) == 7  # well within the long deadline


def test_a_worker_back_after_its_liveness_deadline_replays_what_was_retracted(
    make_server: Callable[..., Server],
) -> None:
    """Past its liveness deadline a gone worker's entities are retracted. Its replay
    from the checkpoint, with the same sequence numbers, was then dropped as
    redeliveries of state that no longer existed: its data was lost for good. Now the
    replay is applied again (within the deadline a replay is still a redelivery:
    test_a_resuming_worker_numbers_after_what_the_server_applied)."""
    proc = make_server(config=f"[ripple]\nliveness_ms = {SHORT_MS}\n", listen=LISTEN)
    address = proc.address_of("ripple")
    with Worker_("job", {"gone": Quote}, address) as worker:
        run(worker, "gone", range(1, 8))
        assert worker.checkpoint() == 7
    written = table(proc, "gone")
    assert len(written) == 7
    wait_until(lambda: not table(proc, "gone"), message="the entities outlived 200 ms")
    with Worker_("job", {"gone": Quote}, address) as replaying:
        run(replaying, "gone", range(1, 8))  # deterministic: the same numbers
        assert replaying.checkpoint() == 7
    assert table(proc, "gone") == written


TENANT_TOKEN = """
[[auth.tokens]]
token = "acme-token"
tenants = [42]
[[tenants]]
id = 42
name = "acme"
"""


def test_a_workers_token_picks_its_tenant_and_its_sequence_numbers_live_there(
    make_server: Callable[..., Server],
) -> None:
    """Without [auth] required a worker may still send a token (the Handshake's auth
    extension): it then writes to the token's tenant, whose sequence table is its own
    (ripple/tenant-42.json) and survives a restart; a worker without one is tenant 0's,
    as before, even under the same worker id."""
    proc = make_server(config=TENANT_TOKEN, listen=LISTEN)
    address = proc.address_of("ripple")
    with Worker_("job", {"quotes": Quote}, address, token="acme-token") as acme:
        run(acme, "quotes", range(1, 11))
        assert acme.checkpoint() == 10
    with Worker_("job", {"quotes": Quote}, address) as anonymous:
        anonymous.set("quotes", "Z", Quote("Z", 0.5, 1, True))  # sequence 1: new here
        assert anonymous.checkpoint() == 1
    with proc.client(tenant_id=42) as c:
        acme_rows = rows_of(sql_query(c, "SELECT symbol FROM quotes ORDER BY 1"))
    assert len(acme_rows) == 7  # K0..K6 (see run)
    assert [r[1] for r in table(proc, "quotes")] == ["Z"]
    assert (proc.data_dir / "ripple" / "tenant-42.json").exists()
    assert proc.stop() == 0
    proc.start()
    with Worker_("job", {"quotes": Quote}, address, token="acme-token") as again:
        again.set("quotes", "K1", Quote("K1", 99.0, 99, True), sequence_no=3)  # applied before
        assert again.checkpoint() == 10
    with proc.client(tenant_id=42) as c:
        assert rows_of(sql_query(c, "SELECT symbol FROM quotes ORDER BY 1")) == acme_rows
