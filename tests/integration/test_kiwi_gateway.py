"""The Kiwi WebSocket gateway of a real ``headwater serve`` process (docs/protocols/kiwi.md),
through the ``websockets`` client library (and one raw socket client that stops reading)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from convergedb_raw import CdbClient, eid
from prometheus_client.parser import text_string_to_metric_families
from servers import LOCAL, Server, serving, stop_cleanly
from websockets.asyncio.client import connect as async_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.fields import FieldType
from headwater.server.http.listener import SHUTDOWN_SECONDS
from waiting import wait_until

TIMEOUT = 20.0
TOKEN = "all"
LISTEN = {"http": LOCAL, "convergedb": LOCAL}
CONFIG = """
[storage]
sync = "none"

[auth]
required = true
[[auth.tokens]]
token = "all"
tenants = [0, 42]
[[auth.tokens]]
token = "zero"
tenants = [0]

[[tenants]]
id = 42
name = "acme"

[kiwi.subscriber]
buffer_capacity = 4
lag_notice_threshold = 2
send_queue = 64
socket_send_buffer = 65536

[[kiwi.sources]]
id = "forever"
type = "counter"
interval_ms = 10
min = 1000

[[kiwi.sources]]
id = "short"
type = "counter"
interval_ms = 5
min = 0
max = 3

[[kiwi.sources]]
id = "lazy"
type = "counter"
interval_ms = 10
min = 7
max = 11
lazy = true
"""


class Gateway:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.http = server.ports["http"]
        self.convergedb = server.ports["convergedb"]

    def url(self, query: str = "") -> str:
        return f"ws://127.0.0.1:{self.http}/ws{query}"

    def connect(
        self, *, token: str | None = TOKEN, tenant: int | None = None, query: str = ""
    ) -> ClientConnection:
        headers = {}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        if tenant is not None:
            headers["X-Headwater-Tenant"] = str(tenant)
        return connect(self.url(query), additional_headers=headers, open_timeout=TIMEOUT)

    def rest(self, method: str, path: str, body: Any = None, tenant: int = 0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.http}{path}", data=data, method=method
        )
        req.add_header("Authorization", f"Bearer {TOKEN}")
        req.add_header("X-Headwater-Tenant", str(tenant))
        if data is not None:
            req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
            payload = resp.read()
            ctype = resp.headers.get("Content-Type", "")
        return json.loads(payload) if ctype.startswith("application/json") else payload

    def create_stream(self, name: str, tenant: int = 0) -> None:
        self.rest("POST", "/api/streams", {"name": name}, tenant)

    def append(self, name: str, events: list[Any], tenant: int = 0) -> None:
        self.rest("POST", f"/api/streams/{name}/events", events, tenant)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    for server in serving(tmp_path_factory.mktemp("kiwi"), config=CONFIG, listen=LISTEN):
        yield Gateway(server)


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    return "".join(c if c.isalnum() else "_" for c in request.node.name)[:60]


def send(ws: ClientConnection, message: dict[str, Any]) -> None:
    ws.send(json.dumps(message))


def recv(ws: ClientConnection) -> dict[str, Any]:
    message = json.loads(ws.recv(timeout=TIMEOUT))
    assert isinstance(message, dict)
    return message


def subscribe(ws: ClientConnection, source: str, mode: str = "push") -> None:
    send(ws, {"type": "SUBSCRIBE", "sourceId": source, "mode": mode})
    assert recv(ws) == {"type": "SUBSCRIBE_OK", "data": {"sourceId": source}}


def offsets(messages: list[dict[str, Any]]) -> list[int]:
    return [msg["data"]["offset"] for msg in messages]


def lag(source: str, count: int) -> dict[str, Any]:
    return {"type": "NOTICE", "data": {"type": "LAG", "sourceId": source, "count": count}}


def close_code(ws: ClientConnection) -> int:
    with pytest.raises(ConnectionClosed) as info:
        while True:
            ws.recv(timeout=TIMEOUT)
    assert info.value.rcvd is not None
    return info.value.rcvd.code


# ---- streams -------------------------------------------------------------------------


def test_push_delivers_new_events_as_results(gw: Gateway, name: str) -> None:
    gw.create_stream(name)
    gw.append(name, ["before"])  # subscriptions start live: never delivered
    with gw.connect() as ws:
        subscribe(ws, name)
        gw.append(name, ["hello", {"px": 10}])
        first, second = recv(ws), recv(ws)
    assert first == {
        "type": "RESULT",
        "data": {
            "sourceId": name,
            "sourceType": "kafka",
            "payload": base64.b64encode(b"hello").decode(),
            "partition": 0,
            "offset": 1,
            "key": None,
            "value": "hello",
            "timestamp": first["data"]["timestamp"],
        },
    }
    assert isinstance(first["data"]["timestamp"], int) and first["data"]["timestamp"] > 0
    assert second["data"]["offset"] == 2 and json.loads(second["data"]["value"]) == {"px": 10}


def test_pull_requests_add_up(gw: Gateway, name: str) -> None:
    gw.create_stream(name)
    with gw.connect() as ws:
        subscribe(ws, name, "pull")
        gw.append(name, ["a", "b", "c"])
        send(ws, {"type": "REQUEST", "sourceId": name, "n": 1})
        assert recv(ws) == {"type": "REQUEST_OK", "data": {"sourceId": name, "n": 1}}
        assert offsets([recv(ws)]) == [0]
        send(ws, {"type": "REQUEST", "sourceId": name, "n": 1})
        send(ws, {"type": "REQUEST", "sourceId": name, "n": 3})
        got = [recv(ws) for _ in range(4)]
        assert got[0] == {"type": "REQUEST_OK", "data": {"sourceId": name, "n": 1}}
        oks = [msg for msg in got if msg["type"] == "REQUEST_OK"]
        assert [ok["data"]["n"] for ok in oks] == [1, 3]
        assert offsets([msg for msg in got if msg["type"] == "RESULT"]) == [1, 2]
        # Two requested events are still outstanding: new events go straight out.
        gw.append(name, ["d", "e", "f"])
        assert offsets([recv(ws), recv(ws)]) == [3, 4]
        send(ws, {"type": "REQUEST", "sourceId": name, "n": 1})
        assert recv(ws)["type"] == "REQUEST_OK"  # "f" waited in the buffer until now
        assert offsets([recv(ws)]) == [5]


def test_pull_buffer_overwrites_oldest_and_notices_lag(gw: Gateway, name: str) -> None:
    """buffer_capacity = 4, lag_notice_threshold = 2."""
    gw.create_stream(name)
    with gw.connect() as ws:
        subscribe(ws, name, "pull")
        gw.append(name, [str(i) for i in range(7)])  # 3 overwritten: lag 3 >= 2
        assert recv(ws) == lag(name, 3)
        send(ws, {"type": "REQUEST", "sourceId": name, "n": 10})
        assert recv(ws)["type"] == "REQUEST_OK"
        assert offsets([recv(ws) for _ in range(4)]) == [3, 4, 5, 6]
        # Delivery reset lag; 6 events are still requested: 7..12 go out, 13..16 wait.
        gw.append(name, [str(i) for i in range(7, 17)])
        assert offsets([recv(ws) for _ in range(6)]) == [7, 8, 9, 10, 11, 12]
        gw.append(name, ["17"])  # overwrites 13: lag 1, below the threshold
        gw.append(name, ["18"])  # overwrites 14: lag 2
        assert recv(ws) == lag(name, 2)
        send(ws, {"type": "REQUEST", "sourceId": name, "n": 4})
        assert recv(ws)["type"] == "REQUEST_OK"
        assert offsets([recv(ws) for _ in range(4)]) == [15, 16, 17, 18]
    metrics = gw.rest("GET", "/metrics").decode()
    dropped = {
        sample.labels.get("protocol"): sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "headwater_ws_lag_events_total"
    }
    assert dropped["kiwi"] >= 5


def test_stream_deletion_closes_the_subscription(gw: Gateway, name: str) -> None:
    gw.create_stream(name)
    with gw.connect() as ws:
        subscribe(ws, name)
        gw.rest("DELETE", f"/api/streams/{name}")
        notice = recv(ws)
        assert notice["type"] == "NOTICE" and notice["data"]["type"] == "SUBSCRIPTION_CLOSED"
        assert notice["data"]["sourceId"] == name and "deleted" in notice["data"]["message"]
        send(ws, {"type": "SUBSCRIBE", "sourceId": name})
        assert recv(ws)["type"] == "SUBSCRIBE_ERROR"
        send(ws, {"type": "UNSUBSCRIBE", "sourceId": name})
        assert recv(ws)["type"] == "UNSUBSCRIBE_ERROR"


def test_command_errors(gw: Gateway, name: str) -> None:
    gw.create_stream(name)
    with gw.connect() as ws:
        send(ws, {"type": "SUBSCRIBE", "sourceId": "no_such_source"})
        reply = recv(ws)
        assert reply["type"] == "SUBSCRIBE_ERROR"
        assert reply["data"]["sourceId"] == "no_such_source" and reply["data"]["error"]
        subscribe(ws, name)
        send(ws, {"type": "SUBSCRIBE", "sourceId": name, "mode": "pull"})
        assert recv(ws)["type"] == "SUBSCRIBE_ERROR"
        send(ws, {"type": "REQUEST", "sourceId": name, "n": 1})
        assert recv(ws)["type"] == "REQUEST_ERROR"  # push subscription
        send(ws, {"type": "REQUEST", "sourceId": "other", "n": 1})
        assert recv(ws)["type"] == "REQUEST_ERROR"
        send(ws, {"type": "UNSUBSCRIBE", "sourceId": name})
        assert recv(ws) == {"type": "UNSUBSCRIBE_OK", "data": {"sourceId": name}}
        send(ws, {"type": "UNSUBSCRIBE", "sourceId": name})
        assert recv(ws)["type"] == "UNSUBSCRIBE_ERROR"
        subscribe(ws, name)  # again, after unsubscribing
        gw.append(name, ["x"])
        assert offsets([recv(ws)]) == [0]


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (b'{"type":"SUBSCRIBE","sourceId":"x"}', 1003),
        ("{not json", 1008),
        ('{"type":"PUBLISH","sourceId":"x"}', 1008),
        ('{"type":"REQUEST","sourceId":"x","n":-1}', 1008),
    ],
)
def test_protocol_errors_close_the_socket(gw: Gateway, message: str | bytes, code: int) -> None:
    with gw.connect() as ws:
        ws.send(message)
        assert close_code(ws) == code
    with gw.connect() as ws:  # the server carries on
        subscribe(ws, "forever")


# ---- auth ------------------------------------------------------------------------------


def test_token_in_header_or_query(gw: Gateway, name: str) -> None:
    gw.create_stream(name, tenant=42)
    for ws in (
        gw.connect(tenant=42),
        gw.connect(token=None, query=f"?token={TOKEN}&tenant=42"),
    ):
        with ws:
            subscribe(ws, name)
            gw.append(name, ["x"], tenant=42)
            assert recv(ws)["data"]["sourceId"] == name
    with gw.connect() as ws:  # tenant 0 has no such stream
        send(ws, {"type": "SUBSCRIBE", "sourceId": name})
        assert recv(ws)["type"] == "SUBSCRIBE_ERROR"


@pytest.mark.parametrize(
    ("token", "query", "status"),
    [(None, "", 401), ("wrong", "", 401), (None, "?token=wrong", 401), ("zero", "?tenant=42", 403)],
)
def test_refused_tokens(gw: Gateway, token: str | None, query: str, status: int) -> None:
    with pytest.raises(InvalidStatus) as info:
        gw.connect(token=token, query=query)
    assert info.value.response.status_code == status


# ---- kinds and counters --------------------------------------------------------------


def test_kind_changes_arrive_as_entity_results(gw: Gateway) -> None:
    fields = [("temp", FieldType.F64), ("label", FieldType.STRING)]
    with CdbClient(gw.convergedb, name="w", token=TOKEN, source_id=1) as writer:
        kind = writer.create_kind("kiwi_sensor", fields)
        with gw.connect() as ws:
            subscribe(ws, "kiwi_sensor")
            writer.call(m.Assert.of(fields, kind.kind_id, eid(1), [20.5, "a"]))
            writer.call(m.Patch.of(fields, kind.kind_id, eid(1), {0: 21.0}))
            writer.call(m.Retract(kind.kind_id, eid(1)))
            results = [recv(ws)["data"] for _ in range(3)]
    assert [(r["change"], r["fields"]) for r in results] == [
        ("created", {"temp": 20.5, "label": "a"}),
        ("updated", {"temp": 21.0, "label": "a"}),
        ("deleted", {}),
    ]
    assert {r["sourceType"] for r in results} == {"entity"}
    assert {r["entityId"] for r in results} == {eid(1).hex()}
    versions = [r["version"] for r in results]
    assert versions == sorted(versions) and len(set(versions)) == 3


def test_counter_counts_up_from_now(gw: Gateway) -> None:
    with gw.connect() as ws:
        subscribe(ws, "forever")
        counts = [recv(ws)["data"] for _ in range(5)]
    assert {c["sourceType"] for c in counts} == {"counter"}
    first = counts[0]["count"]
    assert first >= 1000  # started with the server, not with this subscription
    assert [c["count"] for c in counts] == list(range(first, first + 5))


def test_lazy_counter_starts_at_first_subscription_and_ends_at_max(gw: Gateway) -> None:
    with gw.connect() as ws:
        subscribe(ws, "lazy")
        counts = [recv(ws)["data"]["count"] for _ in range(5)]
        closed = recv(ws)
        assert counts == [7, 8, 9, 10, 11]
        assert closed["type"] == "NOTICE" and closed["data"]["type"] == "SUBSCRIPTION_CLOSED"
        send(ws, {"type": "SUBSCRIBE", "sourceId": "lazy"})
        assert recv(ws)["type"] == "SUBSCRIBE_ERROR"  # an ended finite source


def test_finite_counter_started_with_the_server_ends(gw: Gateway) -> None:
    with gw.connect() as ws:
        send(ws, {"type": "SUBSCRIBE", "sourceId": "short"})
        reply = recv(ws)
        if reply["type"] == "SUBSCRIBE_OK":  # still running (a very slow start): wait
            while (msg := recv(ws))["type"] == "RESULT":
                assert msg["data"]["count"] <= 3
            assert msg["data"]["type"] == "SUBSCRIPTION_CLOSED"
            send(ws, {"type": "SUBSCRIBE", "sourceId": "short"})
            reply = recv(ws)
        assert reply["type"] == "SUBSCRIBE_ERROR"


def test_metrics_count_kiwi_connections_and_subscriptions(gw: Gateway, name: str) -> None:
    gw.create_stream(name)

    def gauges(protocol: str = "kiwi") -> dict[str, float]:
        text = gw.rest("GET", "/metrics").decode()
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.labels.get("protocol") == protocol
            and sample.name in ("headwater_connections", "headwater_subscriptions")
        }

    http_before = gauges("http")["headwater_connections"]
    with gw.connect() as a, gw.connect() as b:
        subscribe(a, name)
        subscribe(a, "forever")
        subscribe(b, name)
        assert gauges() == {"headwater_connections": 2, "headwater_subscriptions": 3}
        # Counted once, as Kiwi's: they were http's too, so Grafana's sum over the
        # protocols showed 4 connections for these 2.
        assert gauges("http")["headwater_connections"] == http_before


# ---- one shared feed per stream ----------------------------------------------------------


def engine_subscriptions(gw: Gateway, name: str, tenant: int = 0) -> float:
    """``headwater_subscriptions_open`` of the stream: the engine subscriptions reading it."""
    text = gw.rest("GET", "/metrics").decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "headwater_subscriptions_open"
                and sample.labels.get("stream") == name
                and sample.labels.get("tenant") == str(tenant)
            ):
                return sample.value
    return 0


def results_until(ws: ClientConnection, last_offset: int) -> list[int]:
    """Offsets of the RESULTs received up to and including ``last_offset``."""
    got: list[int] = []
    while not got or got[-1] < last_offset:
        message = recv(ws)
        assert message["type"] == "RESULT", message
        got.append(message["data"]["offset"])
    return got


def test_subscribers_of_a_stream_share_one_engine_subscription(gw: Gateway, name: str) -> None:
    gw.create_stream(name)
    with gw.connect() as a, gw.connect() as b, gw.connect() as c:
        subscribe(a, name)
        subscribe(b, name)
        subscribe(c, name, "pull")
        assert engine_subscriptions(gw, name) == 1
        gw.append(name, ["x", "y"])
        assert results_until(a, 1) == [0, 1]
        assert results_until(b, 1) == [0, 1]
        send(c, {"type": "REQUEST", "sourceId": name, "n": 2})
        assert recv(c)["type"] == "REQUEST_OK"
        assert results_until(c, 1) == [0, 1]

        # One leaves: the others keep the feed; it comes back from the end, not before.
        send(a, {"type": "UNSUBSCRIBE", "sourceId": name})
        assert recv(a)["type"] == "UNSUBSCRIBE_OK"
        assert engine_subscriptions(gw, name) == 1
        gw.append(name, ["z"])
        assert results_until(b, 2) == [2]
        subscribe(a, name)
        gw.append(name, ["w"])
        assert results_until(a, 3) == [3]
        assert results_until(b, 3) == [3]

        # Everyone leaves: the feed ends; a new subscriber starts a new one, live.
        for ws in (a, b, c):
            send(ws, {"type": "UNSUBSCRIBE", "sourceId": name})
            assert recv(ws)["type"] == "UNSUBSCRIBE_OK"
        assert engine_subscriptions(gw, name) == 0
        gw.append(name, ["missed"])
        subscribe(c, name, "pull")
        assert engine_subscriptions(gw, name) == 1
        gw.append(name, ["v"])
        send(c, {"type": "REQUEST", "sourceId": name, "n": 5})
        assert recv(c)["type"] == "REQUEST_OK"
        assert results_until(c, 5) == [5]


def test_subscribers_joining_at_different_positions(gw: Gateway, name: str) -> None:
    gw.create_stream(name)
    with gw.connect() as a, gw.connect() as b, gw.connect() as c:
        subscribe(a, name)
        gw.append(name, ["0", "1", "2"])
        subscribe(b, name)  # the shared feed may not have read 0..2 yet: b never gets them
        gw.append(name, ["3", "4"])
        subscribe(c, name)
        gw.append(name, ["5"])
        assert results_until(a, 5) == [0, 1, 2, 3, 4, 5]
        assert results_until(b, 5) == [3, 4, 5]
        assert results_until(c, 5) == [5]


def test_a_lagging_subscriber_does_not_hold_back_the_others(gw: Gateway, name: str) -> None:
    """buffer_capacity = 4, lag_notice_threshold = 2: the pull subscriber that requests
    nothing loses all but the newest 4 of 10 events while the push ones get all 10."""
    gw.create_stream(name)
    with gw.connect() as lagging, gw.connect() as a, gw.connect() as b:
        subscribe(lagging, name, "pull")
        subscribe(a, name)
        subscribe(b, name)
        gw.append(name, [str(i) for i in range(5)])
        gw.append(name, [str(i) for i in range(5, 10)])
        assert results_until(a, 9) == list(range(10))
        assert results_until(b, 9) == list(range(10))
        notice = recv(lagging)
        while notice != lag(name, 6):  # the count grows while the notice waits to be sent
            assert notice["type"] == "NOTICE" and notice["data"]["type"] == "LAG", notice
            notice = recv(lagging)
        send(lagging, {"type": "REQUEST", "sourceId": name, "n": 10})
        assert recv(lagging)["type"] == "REQUEST_OK"
        assert results_until(lagging, 9) == [6, 7, 8, 9]
        gw.append(name, ["10"])
        assert results_until(a, 10) == [10]
        assert results_until(lagging, 10) == [10]  # 6 requested events still outstanding


def test_a_read_larger_than_the_send_queue_reaches_a_subscriber_that_keeps_up(
    gw: Gateway, name: str
) -> None:
    """send_queue = 64: one append of 200 small events is one read of the feed; the
    socket takes it all (far below its buffer), so nothing is shed."""
    gw.create_stream(name)
    with gw.connect() as ws:
        subscribe(ws, name)
        gw.append(name, [str(i) for i in range(200)])
        assert results_until(ws, 199) == list(range(200))


def test_a_request_gets_every_buffered_event_beyond_the_send_queue(
    make_server: Callable[..., Server],
) -> None:
    """A pull subscription's buffer (32) holding more than the send queue (8): one
    REQUEST for more than both got the first send queue's worth, the rest waiting for
    some later command or event (on a quiet stream, for ever)."""
    config = "[kiwi.subscriber]\nbuffer_capacity = 32\nsend_queue = 8\n"
    gw = Gateway(make_server(config=config, listen=LISTEN))
    gw.create_stream("pulled")
    with gw.connect(token=None) as ws, gw.connect(token=None) as pushed:
        subscribe(ws, "pulled", "pull")
        subscribe(pushed, "pulled")
        gw.append("pulled", [str(i) for i in range(32)])
        # The feed hands a read to every subscriber at once: pushed, they are buffered.
        assert results_until(pushed, 31) == list(range(32))
        send(ws, {"type": "REQUEST", "sourceId": "pulled", "n": 1000})
        assert recv(ws)["type"] == "REQUEST_OK"
        assert results_until(ws, 31) == list(range(32))


def test_stream_deletion_closes_every_subscriber(gw: Gateway, name: str) -> None:
    gw.create_stream(name)
    with gw.connect() as a, gw.connect() as b, gw.connect() as c:
        subscribe(a, name)
        subscribe(b, name)
        subscribe(c, name, "pull")
        gw.rest("DELETE", f"/api/streams/{name}")
        for ws in (a, b, c):
            notice = recv(ws)
            assert notice["type"] == "NOTICE", notice
            assert notice["data"]["type"] == "SUBSCRIPTION_CLOSED"
            assert notice["data"]["sourceId"] == name and "deleted" in notice["data"]["message"]
        assert engine_subscriptions(gw, name) == 0
        # A new stream of the same name is a new source with a feed of its own.
        gw.create_stream(name)
        subscribe(a, name)
        subscribe(b, name)
        gw.append(name, ["new"])
        assert results_until(a, 0) == [0]
        assert results_until(b, 0) == [0]


def test_each_tenant_has_its_own_feed(gw: Gateway, name: str) -> None:
    gw.create_stream(name)
    gw.create_stream(name, tenant=42)
    with gw.connect(tenant=0) as zero, gw.connect(tenant=42) as acme:
        subscribe(zero, name)
        subscribe(acme, name)
        gw.append(name, ["acme 0", "acme 1"], tenant=42)
        gw.append(name, ["zero 0"])
        first = recv(zero)
        assert first["data"]["offset"] == 0 and first["data"]["value"] == "zero 0"
        got = [recv(acme)["data"]["value"] for _ in range(2)]
        assert got == ["acme 0", "acme 1"]
        assert engine_subscriptions(gw, name, 0) == engine_subscriptions(gw, name, 42) == 1


# ---- shutdown --------------------------------------------------------------------------


def test_shutdown_closes_every_subscription(make_server: Callable[..., Server]) -> None:
    gw = Gateway(make_server(config=CONFIG, listen=LISTEN))
    gw.create_stream("s")
    with gw.connect() as ws:
        subscribe(ws, "s")
        subscribe(ws, "forever")
        assert gw.server.proc is not None
        gw.server.proc.send_signal(15)  # SIGTERM
        closed: set[str] = set()
        while len(closed) < 2:
            msg = recv(ws)
            if msg["type"] == "NOTICE":
                assert msg["data"]["type"] == "SUBSCRIPTION_CLOSED"
                closed.add(msg["data"]["sourceId"])
            else:
                assert msg["type"] == "RESULT" and msg["data"]["sourceId"] == "forever"
        assert closed == {"s", "forever"}
        assert close_code(ws) == 1001
    assert gw.server.stop() == 0


def test_shutdown_with_subscribers_that_read_nothing(make_server: Callable[..., Server]) -> None:
    """Two subscribers stop reading and the server sheds for them (their socket full),
    then SIGTERM: the close frame's drain was once cancelled under it and the server
    crashed at its stop (exit 1); it exits 0, its log clean, without waiting out
    aiohttp's shutdown timeout for them (about 24 s)."""
    gw = Gateway(make_server(config=CONFIG, listen=LISTEN))
    gw.create_stream("s")
    stalled = [StalledClient(gw.http, "s") for _ in range(2)]

    def shed() -> float:
        text = gw.rest("GET", "/metrics").decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "headwater_ws_lag_events_total"
        )

    def append_until_shed() -> bool:
        gw.append("s", ["v" * 4000] * 100)
        return shed() > 0

    wait_until(append_until_shed, message="the stalled subscribers were never shed")
    started = time.monotonic()
    stop_cleanly(gw.server, clean_log=True)
    assert time.monotonic() - started < SHUTDOWN_SECONDS, gw.server.log_tail()
    for client in stalled:
        client.sock.close()


# ---- many subscribers and one that stalls ---------------------------------------------


class StalledClient:
    """A raw WebSocket client with a tiny receive buffer that stops reading after
    subscribing, then reads everything at the end."""

    def __init__(self, port: int, source: str) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(TIMEOUT)
        self.sock.connect(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            f"GET /ws?token={TOKEN} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head
        self.send({"type": "SUBSCRIBE", "sourceId": source})
        self.buffer = b""

    def send(self, message: dict[str, Any]) -> None:
        payload = json.dumps(message).encode()
        assert len(payload) < 126
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(bytes((0x81, 0x80 | len(payload))) + mask + masked)

    def _frame(self) -> dict[str, Any] | None:
        """The next whole message in the buffer, if there is one."""
        data = self.buffer
        if len(data) < 2:
            return None
        n = data[1] & 0x7F
        header = {126: 4, 127: 10}.get(n, 2)
        if len(data) < header:
            return None
        if n == 126:
            n = struct.unpack_from("!H", data, 2)[0]
        elif n == 127:
            n = struct.unpack_from("!Q", data, 2)[0]
        if len(data) < header + n:
            return None
        assert data[0] == 0x81  # FIN, text
        self.buffer = data[header + n :]
        message = json.loads(data[header : header + n])
        assert isinstance(message, dict)
        return message

    def messages_until(self, done: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while not out or out[-1]["type"] != done:
            message = self._frame()
            if message is not None:
                out.append(message)
                continue
            chunk = self.sock.recv(1 << 20)
            assert chunk, "the server closed the connection"
            self.buffer += chunk
        return out


@pytest.mark.slow
def test_many_subscribers_get_everything_while_a_stalled_one_is_shed(gw: Gateway) -> None:
    source, subscribers, rounds, per_round = "fanout", 200, 6, 50
    value = "v" * 4000
    gw.create_stream(source)
    total = rounds * per_round
    stalled = StalledClient(gw.http, source)

    async def main() -> list[list[int]]:
        received: list[list[int]] = [[] for _ in range(subscribers)]
        progress = asyncio.Condition()

        async def subscriber(i: int, ready: asyncio.Event) -> None:
            async with async_connect(
                gw.url(f"?token={TOKEN}"), open_timeout=TIMEOUT, max_size=None
            ) as ws:
                await ws.send(json.dumps({"type": "SUBSCRIBE", "sourceId": source}))
                assert json.loads(await ws.recv())["type"] == "SUBSCRIBE_OK"
                ready.set()
                while len(received[i]) < total:
                    msg = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
                    assert msg["type"] == "RESULT", msg  # no LAG: these keep up
                    received[i].append(msg["data"]["offset"])
                    async with progress:
                        progress.notify_all()

        readies = [asyncio.Event() for _ in range(subscribers)]
        tasks = [asyncio.create_task(subscriber(i, readies[i])) for i in range(subscribers)]
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), TIMEOUT * 3)
        loop = asyncio.get_running_loop()
        for r in range(rounds):
            await loop.run_in_executor(None, gw.append, source, [value] * per_round)
            # Rounds keep each keeping-up subscriber's backlog under its send queue.
            async with progress:
                await asyncio.wait_for(
                    progress.wait_for(
                        lambda goal=(r + 1) * per_round: all(len(g) >= goal for g in received)
                    ),
                    TIMEOUT * 3,
                )
        await asyncio.gather(*tasks)
        return received

    received = asyncio.run(main())
    assert all(got == list(range(total)) for got in received)

    stalled.send({"type": "UNSUBSCRIBE", "sourceId": source})  # read once it drains
    messages = stalled.messages_until("UNSUBSCRIBE_OK")
    assert messages[0]["type"] == "SUBSCRIBE_OK"
    body = messages[1:-1]
    delivered = [msg["data"]["offset"] for msg in body if msg["type"] == "RESULT"]
    assert delivered == sorted(delivered) and len(delivered) < total
    assert any(msg["type"] == "NOTICE" for msg in body)
    # Every gap is reported where it is, by a LAG notice counting the whole gap.
    last_notice: int | None = None
    expected = 0
    for msg in [*body, {"type": "END", "data": {"offset": total}}]:
        if msg["type"] == "NOTICE":
            assert msg["data"]["type"] == "LAG"
            last_notice = msg["data"]["count"]
            continue
        gap = msg["data"]["offset"] - expected
        assert (last_notice or 0) == gap, (expected, msg["data"]["offset"], last_notice)
        expected = msg["data"]["offset"] + 1
        last_notice = None
    stalled.sock.close()
