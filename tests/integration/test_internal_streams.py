"""headwater's own state streams (hw_transaction_state, hw_consumer_offsets) against a real
``headwater serve``: every front-end path answers "not found" for them exactly as for a
stream that never existed (by name and by id), while transactions and group commits,
which keep their state there, still work and survive a restart."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from kimberlite_raw import RawClient
from servers import LOCAL, Server, serving
from test_rivven_server import Rivven

from headwater.errors import StreamNotFound
from headwater.protocols.kimberlite.messages import (
    AppendEventsRequest,
    AppendIdempotentRequest,
    DeleteStreamRequest,
    ErrorResponse,
    EventBatch,
    ListStreamsRequest,
    QueryRequest,
    ReadEventsRequest,
    StreamsResponse,
    SubscribeRequest,
)
from headwater.protocols.rivven import rivven_pb2 as pb
from headwater.protocols.rivven.messages import make_record

INTERNAL = ("hw_transaction_state", "hw_consumer_offsets")
ABSENT = "never_created"  # a name no stream ever had: what the internal ones must look like
ABSENT_ID = 4242  # likewise an id
TOPIC = "orders"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("internal_streams"),
        listen={"kimberlite": LOCAL, "http": LOCAL, "postgres": LOCAL, "rivven": LOCAL},
        clean_log=True,
    )


def transact(server: Server, txn: str, value: bytes) -> None:
    """One committed transaction of one event on TOPIC, over the Rivven listener (a new
    producer each time: its first sequence is 0)."""
    with Rivven(server.ports["rivven"]) as rivven:
        producer = rivven.ok(pb.InitProducerIdRequest(), "init_producer_id")
        ids = {"producer_id": producer.producer_id, "producer_epoch": producer.producer_epoch}
        rivven.ok(pb.BeginTransactionRequest(txn_id=txn, **ids), "begin_transaction")
        publish = pb.TransactionalPublishRequest(
            txn_id=txn, topic=TOPIC, partition=0, record=make_record(value), sequence=0
        )
        publish.producer_id, publish.producer_epoch = ids["producer_id"], ids["producer_epoch"]
        rivven.ok(publish, "transactional_publish")
        rivven.ok(pb.CommitTransactionRequest(txn_id=txn, **ids), "commit_transaction")


def committed_values(server: Server) -> list[bytes]:
    with Rivven(server.ports["rivven"]) as rivven:
        return [r.value for r in rivven.consume(TOPIC, 0, isolation=1).records]


def group_offset(server: Server) -> int:
    with Rivven(server.ports["rivven"]) as rivven:
        fetched = rivven.ok(
            pb.GetOffsetRequest(consumer_group="g1", topic=TOPIC, partition=0), "get_offset"
        )
        offset: int = fetched.offset
        return offset


def ids_on_disk(server: Server) -> dict[str, int]:
    """Stream name -> id from the data directory (what backup and check read)."""
    found = {}
    for meta in (server.data_dir / "tenants" / "0" / "streams").glob("*/stream.json"):
        data = json.loads(meta.read_text())
        found[data["name"]] = int(data["id"])
    return found


def as_absent(answer: object, name: str) -> str:
    """``answer`` as text with ``name`` put as ABSENT, and without DuckDB's "Did you
    mean" suggestion (picked by similarity to the name asked for, from the tables a
    client can see: it differs between two names either way)."""
    text = answer if isinstance(answer, str) else json.dumps(answer)
    return re.sub(r"(\\n|\n)Did you mean [^?]*\?", "", text.replace(name, ABSENT))


def http(server: Server, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://{server.address_of('http')}{path}", data=body, method=method
    )
    if body is not None and body[:1] == b"{":
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def http_paths(name: str) -> list[tuple[str, str, bytes | None]]:
    return [
        ("GET", f"/api/streams/{name}", None),
        ("GET", f"/api/streams/{name}/events?from=0", None),
        ("POST", f"/api/streams/{name}/events", b"garbage\n"),
        ("POST", f"/api/streams/{name}/events", b'{"records": [{"value": "garbage"}]}'),
        ("GET", f"/api/streams/{name}/arrow?from=0&to=1", None),
        ("GET", f"/api/streams/{name}/offsets?timestamp_ms=0", None),
        ("PATCH", f"/api/streams/{name}", b'{"partitions": 2}'),
        ("POST", f"/api/consumer-groups/{name}/g1/reset", b'{"offset": 0}'),
        ("DELETE", f"/api/streams/{name}", None),
        ("POST", "/api/sql", json.dumps({"sql": f"SELECT * FROM {name}"}).encode()),
        ("POST", "/api/sql", json.dumps({"sql": f"INSERT INTO {name} VALUES ('x')"}).encode()),
    ]


def kimberlite_requests(stream_id: int) -> list[Any]:
    events = EventBatch.of([b"garbage"])
    return [
        AppendEventsRequest(stream_id, events),
        AppendIdempotentRequest(stream_id, 9, 0, events),
        ReadEventsRequest(stream_id, 0, 1 << 20),
        SubscribeRequest(stream_id, 0, 10),
        DeleteStreamRequest(stream_id),
    ]


def kimberlite_errors(client: RawClient, stream_id: int) -> list[tuple[int, str]]:
    out = []
    for request in kimberlite_requests(stream_id):
        reply = client.call(request)
        assert isinstance(reply, ErrorResponse), (request, reply)
        out.append((reply.code, reply.message))
    return out


def pg_errors(server: Server, table: str) -> list[str]:
    dsn = f"host=127.0.0.1 port={server.ports['postgres']} user=u dbname=0 sslmode=disable"
    messages = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in (f"SELECT * FROM {table}", f"INSERT INTO {table} VALUES ('x')"):
            with pytest.raises(psycopg.Error) as failed:
                conn.execute(statement)
            messages.append(str(failed.value))
        # The connection still serves after the refusals.
        assert conn.execute("SELECT 1").fetchall() == [(1,)]
    return messages


def cli_stream_names(server: Server) -> list[str]:
    command = [sys.executable, "-m", "headwater.cli.main", "stream", "list", "--json"]
    proc = subprocess.run(
        [*command, "--server", server.address], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return [s["name"] for s in json.loads(proc.stdout)]


def test_internal_streams_are_not_found_anywhere_and_keep_working(server: Server) -> None:
    with Rivven(server.ports["rivven"]) as rivven:
        rivven.ok(pb.CreateTopicRequest(name=TOPIC, partitions=1), "create_topic")
    transact(server, "t1", b"first")
    with Rivven(server.ports["rivven"]) as rivven:
        rivven.ok(
            pb.CommitOffsetRequest(consumer_group="g1", topic=TOPIC, partition=0, offset=1),
            "commit_offset",
        )
    on_disk = ids_on_disk(server)
    assert set(INTERNAL) <= set(on_disk), on_disk  # both exist: there is something to hide
    sizes = {
        name: sum(f.stat().st_size for f in server.data_dir.rglob(f"streams/{on_disk[name]}/**/*"))
        for name in INTERNAL
    }

    # HTTP: listing, and every path by name, answered as for a name never used.
    status, listed = http(server, "GET", "/api/streams")
    assert status == 200 and [s["name"] for s in listed["streams"]] == [TOPIC], listed
    for name in INTERNAL:
        for (method, path, body), (_, absent_path, absent_body) in zip(
            http_paths(name), http_paths(ABSENT), strict=True
        ):
            got = http(server, method, path, body)
            expected = http(server, method, absent_path, absent_body)
            assert got[0] == expected[0] == 404, (method, path, got)
            assert as_absent(got, name) == as_absent(expected, ABSENT), (path, got)
    status, groups = http(server, "GET", "/api/consumer-groups")
    assert status == 200 and not any(g["stream"] in INTERNAL for g in groups["groups"]), groups
    status, metrics = http(server, "GET", "/metrics")
    assert status == 200 and TOPIC in metrics
    assert not any(name in metrics for name in INTERNAL)

    # Kimberlite: listing, and every request by the internal streams' real ids, answered
    # as for an id never used; SQL as for a table that does not exist.
    with server.client() as client:
        reply = client.call(ListStreamsRequest())
        assert isinstance(reply, StreamsResponse)
        assert [s.name for s in reply.streams] == [TOPIC]
        absent = kimberlite_errors(client, ABSENT_ID)
        assert {code for code, _ in absent} == {StreamNotFound.code}
        for name in INTERNAL:
            stream_id = on_disk[name]
            assert kimberlite_errors(client, stream_id) == [
                (code, message.replace(str(ABSENT_ID), str(stream_id))) for code, message in absent
            ]
            hidden = client.call(QueryRequest(f"SELECT * FROM {name}", []))
            missing = client.call(QueryRequest(f"SELECT * FROM {ABSENT}", []))
            assert isinstance(hidden, ErrorResponse) and isinstance(missing, ErrorResponse)
            assert hidden.code == missing.code
            assert as_absent(hidden.message, name) == as_absent(missing.message, ABSENT)

    # Rivven (the front end that keeps state in them): consume and publish by name.
    with Rivven(server.ports["rivven"]) as rivven:
        for name in INTERNAL:
            for request in (
                pb.ConsumeRequest(topic=name, partition=0, offset=0),
                pb.PublishRequest(topic=name, partition=0, record=make_record(b"garbage")),
            ):
                hidden_error = rivven.error(request)
                request.topic = ABSENT
                missing_error = rivven.error(request)
                assert hidden_error.code == missing_error.code
                assert hidden_error.message.replace(name, ABSENT) == missing_error.message

    # The postgres listener's SQL and the CLI.
    for name in INTERNAL:
        hidden_pg = [as_absent(m, name) for m in pg_errors(server, name)]
        assert hidden_pg == [as_absent(m, ABSENT) for m in pg_errors(server, ABSENT)]
    assert cli_stream_names(server) == [TOPIC]

    # Nothing any of that tried reached the internal streams.
    assert ids_on_disk(server) == on_disk
    for name in INTERNAL:
        files = server.data_dir.rglob(f"streams/{on_disk[name]}/**/*")
        assert sum(f.stat().st_size for f in files) == sizes[name], name

    # Their owners still work, and what they stored survives a restart.
    transact(server, "t2", b"second")
    assert committed_values(server) == [b"first", b"second"]
    server.restart()
    assert committed_values(server) == [b"first", b"second"]
    assert group_offset(server) == 1
    transact(server, "t1", b"third")
    assert committed_values(server) == [b"first", b"second", b"third"]
    assert "no transaction record" not in server.log_text()
    status, listed = http(server, "GET", "/api/streams")
    assert status == 200 and [s["name"] for s in listed["streams"]] == [TOPIC]
