"""``[limits]`` on the binary listeners (Kimberlite, ConvergeDB, Ripple, Rivven,
PostgreSQL; Kafka's, which has no error frame to send, in test_limits_fuzz and
test_kafka_clients) and the Kiwi
WebSocket, each driven past its value against a real server: the client gets the
protocol's own error naming the limit, the refusal is counted in /metrics
(``headwater_limit_refusals_total{limit, listener}``) and the server goes on serving a
well-behaved client.

The server's limits are small so each is reached at once: 10 connections (HTTP's
count too), 1 s to
authenticate, 3 s idle, 8 KiB held before auth, 2 subscriptions per connection.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from convergedb_raw import CdbClient
from kimberlite_raw import RawClient, create_stream, expect_error
from limits_clients import (
    ALL_BINARY,
    WITH_LAST_WORD,
    counted,
    expect_list,
    good_client,
    huge_frame_head,
    last_word,
    raw_socket,
    read_to_end,
    refusals,
    serves,
    try_serves,
)
from servers import LOCAL, Server, serving
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection as WsClient
from websockets.sync.client import connect as ws_connect

from headwater.protocols.convergedb import messages as cm
from headwater.protocols.convergedb.codes import ErrorCode as CdbError
from headwater.protocols.convergedb.codes import Opcode
from headwater.protocols.convergedb.fields import FieldType
from headwater.protocols.kimberlite import messages as km
from headwater.protocols.rivven.messages import ErrorCode as RivvenError
from waiting import wait_until

MAX_CONNECTIONS = 10
HANDSHAKE_TIMEOUT_S = 1.0
IDLE_TIMEOUT_S = 3.0
MAX_PENDING_BYTES = 8192
MAX_SUBSCRIPTIONS = 2

CONFIG = f"""
[limits]
max_connections = {MAX_CONNECTIONS}
handshake_timeout_s = {HANDSHAKE_TIMEOUT_S}
idle_timeout_s = {IDLE_TIMEOUT_S}
max_pending_bytes = {MAX_PENDING_BYTES}
max_subscriptions_per_connection = {MAX_SUBSCRIPTIONS}

[[kiwi.sources]]
id = "c1"
type = "counter"
interval_ms = 1000

[[kiwi.sources]]
id = "c2"
type = "counter"
interval_ms = 1000

[[kiwi.sources]]
id = "c3"
type = "counter"
interval_ms = 1000
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    listen = {name: LOCAL for name in (*ALL_BINARY, "http")}
    yield from serving(
        tmp_path_factory.mktemp("limits"), config=CONFIG, listen=listen, clean_log=True
    )


# ---- max_connections ------------------------------------------------------------------------


@pytest.mark.parametrize("listener", WITH_LAST_WORD)
def test_a_connection_past_max_connections_gets_the_protocols_error(
    server: Server, listener: str
) -> None:
    before = refusals(server)
    holders: list[RawClient] = []
    try:
        # Fill every slot (with whatever else is still open) with authenticated clients:
        # the one that is refused shows the server is full.
        while True:
            holder = RawClient(server.ports["kimberlite"], handshake=False)
            holder.send_raw(holder.conn.handshake()[1])
            response = holder.next_response()
            assert response is not None, "neither an answer nor a refusal"
            if isinstance(response.payload, km.ErrorResponse):
                assert response.payload.code == km.ErrorCode.RATE_LIMITED, response
                assert "max_connections" in response.payload.message
                holder.close()
                break
            holders.append(holder)
            assert len(holders) <= MAX_CONNECTIONS, "no connection was ever refused"
        refused = raw_socket(server, listener)
        code, message = last_word(listener, read_to_end(refused))
        assert "max_connections" in message
        assert code in (
            km.ErrorCode.RATE_LIMITED,
            CdbError.LIMIT_EXCEEDED,
            RivvenError.QUOTA_EXCEEDED,
            "53300",  # PostgreSQL's too_many_connections
            None,  # Ripple's answer has no code
        )
        refused.close()
        holders.pop().close()
        # The slot is free once the server has seen the close: then it serves again.
        wait_until(lambda: try_serves(server, listener), message="no slot came free")
    finally:
        for holder in holders:
            holder.close()
    assert counted(server, before, "max_connections", "kimberlite") >= 1
    assert counted(server, before, "max_connections", listener) >= 1


# ---- handshake_timeout_s ------------------------------------------------------------------


def test_peers_that_never_authenticate_are_closed_after_handshake_timeout(
    server: Server,
) -> None:
    before = refusals(server)
    started = time.monotonic()
    # On each listener: a socket that sends nothing, and one that stops inside the
    # header of its first frame (a slowloris).
    silent = {listener: raw_socket(server, listener) for listener in WITH_LAST_WORD}
    partial = {listener: raw_socket(server, listener) for listener in WITH_LAST_WORD}
    for listener, sock in partial.items():
        sock.sendall(huge_frame_head(listener)[:5])
    for listener in WITH_LAST_WORD:
        for sock in (silent[listener], partial[listener]):
            _code, message = last_word(listener, read_to_end(sock))
            assert "handshake_timeout_s" in message, message
            sock.close()
    assert time.monotonic() - started >= HANDSHAKE_TIMEOUT_S
    for listener in WITH_LAST_WORD:
        serves(server, listener)
        assert counted(server, before, "handshake_timeout_s", listener) == 2


def test_a_refused_token_does_not_hold_a_connection_past_the_handshake_timeout(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """With auth required, a Handshake or CONNECT whose token is refused leaves the
    connection unauthenticated: it is closed at the handshake timeout like a silent one."""
    config = CONFIG + '[auth]\nrequired = true\n[[auth.tokens]]\ntoken = "s3cret"\ntenants = [0]\n'
    listen = {"kimberlite": LOCAL, "convergedb": LOCAL, "http": LOCAL}
    for server in serving(tmp_path_factory.mktemp("limits_auth"), config=config, listen=listen):
        kimberlite = RawClient(server.ports["kimberlite"], handshake=False)
        reply = kimberlite.call_payload(kimberlite.conn.handshake("wrong"))
        assert isinstance(reply, km.HandshakeResponse) and not reply.authenticated
        cdb = CdbClient(server.ports["convergedb"], connect=False)
        stream, data = cdb.conn.connect("w", "wrong")
        cdb.sock.sendall(data)
        refused = cdb.reply(stream).message
        assert isinstance(refused, cm.ErrorMessage) and refused.code == CdbError.AUTH_FAILED
        (closing,) = kimberlite.wait_closed()
        assert isinstance(closing.payload, km.ErrorResponse)
        assert "handshake_timeout_s" in closing.payload.message
        (frame,) = cdb.until_closed()
        assert isinstance(frame.message, cm.ErrorMessage)
        assert "handshake_timeout_s" in frame.message.message
        good = RawClient(server.ports["kimberlite"], token="s3cret")
        expect_list(good.call(km.ListStreamsRequest()))
        good.close()


# ---- idle_timeout_s -----------------------------------------------------------------------


def test_idle_connections_without_subscriptions_are_closed(server: Server) -> None:
    with contextlib.ExitStack() as stack:
        idle_connections_are_closed(server, stack.enter_context)


def idle_connections_are_closed(server: Server, entered: Callable[[WsClient], WsClient]) -> None:
    before = refusals(server)
    # Subscribed clients first: their idle deadlines come before the idle clients', so
    # once those are closed these would have been too.
    kimberlite_sub = RawClient(server.ports["kimberlite"])
    stream_id = create_stream(kimberlite_sub, f"idle_{uuid.uuid4().hex[:8]}")
    subscribed = kimberlite_sub.call(km.SubscribeRequest(stream_id, 0, 10))
    assert isinstance(subscribed, km.SubscribeResponse), subscribed
    cdb_sub = CdbClient(server.ports["convergedb"], name=f"s{uuid.uuid4().hex[:8]}")
    kind = cdb_sub.create_kind(f"idle_{uuid.uuid4().hex[:8]}", [("n", FieldType.I64)])
    assert cdb_sub.call(cm.Subscribe(kind.kind_id)) == cm.Ack(Opcode.SUBSCRIBE)
    ws_sub = entered(kiwi(server))
    ws_sub.send(json.dumps({"type": "SUBSCRIBE", "sourceId": "c1", "mode": "pull"}))
    assert json.loads(ws_sub.recv(timeout=15))["type"] == "SUBSCRIBE_OK"

    idle = {listener: good_client(server, listener) for listener in WITH_LAST_WORD}
    ws_idle = entered(kiwi(server))
    for listener, client in idle.items():
        _code, message = last_word(listener, read_to_end(client.sock, IDLE_TIMEOUT_S + 15))
        assert "idle_timeout_s" in message, message
        client.close()
    with pytest.raises(ConnectionClosed) as closed:
        ws_idle.recv(timeout=IDLE_TIMEOUT_S + 15)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
    assert "idle_timeout_s" in closed.value.rcvd.reason

    # The subscribed ones are open and answer.
    expect_list(kimberlite_sub.call(km.ListStreamsRequest()))
    cdb_sub.barrier()
    ws_sub.send(json.dumps({"type": "REQUEST", "sourceId": "c1", "n": 1}))
    assert json.loads(ws_sub.recv(timeout=15))["type"] == "REQUEST_OK"
    kimberlite_sub.close()
    cdb_sub.close()
    for listener in (*WITH_LAST_WORD, "kiwi"):
        assert counted(server, before, "idle_timeout_s", listener) >= 1, listener


def kiwi(server: Server) -> WsClient:
    return ws_connect(f"ws://127.0.0.1:{server.ports['http']}/ws", open_timeout=15)


# ---- max_pending_bytes --------------------------------------------------------------------


@pytest.mark.parametrize("listener", WITH_LAST_WORD)
def test_bytes_held_before_auth_are_bounded_by_max_pending_bytes(
    server: Server, listener: str
) -> None:
    before = refusals(server)
    sock = raw_socket(server, listener)
    data = huge_frame_head(listener) + bytes(MAX_PENDING_BYTES)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.sendall(data)  # refused while sending: what was answered is still to be read
    _code, message = last_word(listener, read_to_end(sock))
    assert "max_pending_bytes" in message, message
    sock.close()
    serves(server, listener)
    assert counted(server, before, "max_pending_bytes", listener) == 1


def test_after_auth_frames_past_max_pending_bytes_are_served(server: Server) -> None:
    """The limit is on what a peer makes the server hold before it authenticates: an
    authenticated client appends an event far larger than it."""
    client = RawClient(server.ports["kimberlite"])
    stream_id = create_stream(client, f"big_{uuid.uuid4().hex[:8]}")
    event = bytes(range(256)) * (8 * MAX_PENDING_BYTES // 256)
    reply = client.call(km.AppendEventsRequest(stream_id, km.EventBatch.of([event])))
    assert isinstance(reply, km.AppendEventsResponse), reply
    client.close()


# ---- max_subscriptions_per_connection -----------------------------------------------------


def test_kimberlite_subscriptions_past_the_limit_are_refused(server: Server) -> None:
    before = refusals(server)
    client = RawClient(server.ports["kimberlite"])
    stream_id = create_stream(client, f"subs_{uuid.uuid4().hex[:8]}")
    ids = []
    for _ in range(MAX_SUBSCRIPTIONS):
        reply = client.call(km.SubscribeRequest(stream_id, 0, 10))
        assert isinstance(reply, km.SubscribeResponse), reply
        ids.append(reply.subscription_id)
    error = expect_error(
        client.call(km.SubscribeRequest(stream_id, 0, 10)), km.ErrorCode.INVALID_REQUEST
    )
    assert "max_subscriptions_per_connection" in error.message
    # The connection keeps working: one ended, a new one is taken.
    closed = client.call(km.UnsubscribeRequest(ids[0]))
    assert isinstance(closed, km.SubscriptionClosedResponse), closed
    assert isinstance(client.call(km.SubscribeRequest(stream_id, 0, 10)), km.SubscribeResponse)
    client.close()
    assert counted(server, before, "max_subscriptions_per_connection", "kimberlite") == 1


def test_convergedb_subscriptions_past_the_limit_are_refused(server: Server) -> None:
    before = refusals(server)
    client = CdbClient(server.ports["convergedb"], name=f"s{uuid.uuid4().hex[:8]}")
    kinds = [
        client.create_kind(f"subs_{uuid.uuid4().hex[:8]}", [("n", FieldType.I64)]).kind_id
        for _ in range(MAX_SUBSCRIPTIONS + 1)
    ]
    for kind_id in kinds[:MAX_SUBSCRIPTIONS]:
        assert client.call(cm.Subscribe(kind_id)) == cm.Ack(Opcode.SUBSCRIBE)
    refused = client.call(cm.Subscribe(kinds[-1]))
    assert isinstance(refused, cm.ErrorMessage), refused
    assert refused.code == CdbError.LIMIT_EXCEEDED
    assert "max_subscriptions_per_connection" in refused.message
    assert client.call(cm.Unsubscribe(kinds[0])) == cm.Ack(Opcode.UNSUBSCRIBE)
    assert client.call(cm.Subscribe(kinds[-1])) == cm.Ack(Opcode.SUBSCRIBE)
    client.close()
    assert counted(server, before, "max_subscriptions_per_connection", "convergedb") == 1


def test_kiwi_subscriptions_past_the_limit_are_refused(server: Server) -> None:
    before = refusals(server)
    with kiwi(server) as ws:
        kiwi_subscriptions_are_limited(ws)
    assert counted(server, before, "max_subscriptions_per_connection", "kiwi") == 1


def kiwi_subscriptions_are_limited(ws: WsClient) -> None:
    def command(kind: str, source: str) -> dict[str, object]:
        ws.send(json.dumps({"type": kind, "sourceId": source, "mode": "pull"}))
        answer: dict[str, object] = json.loads(ws.recv(timeout=15))
        return answer

    assert command("SUBSCRIBE", "c1")["type"] == "SUBSCRIBE_OK"
    assert command("SUBSCRIBE", "c2")["type"] == "SUBSCRIBE_OK"
    refused = command("SUBSCRIBE", "c3")
    assert refused["type"] == "SUBSCRIBE_ERROR", refused
    assert "max_subscriptions_per_connection" in json.dumps(refused)
    assert command("UNSUBSCRIBE", "c1")["type"] == "UNSUBSCRIBE_OK"
    assert command("SUBSCRIBE", "c3")["type"] == "SUBSCRIBE_OK"
