"""One auth rule on every listener of a real server (headwater.api.auth): a known token
acts for exactly its tenants, a missing or unknown one is refused while auth is
required. A Ripple worker's token travels in headwater's Handshake extension; without one
it is refused before it can touch a kind or a source slot."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from servers import LOCAL, Server, serving
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

import headwater
from headwater import entities
from headwater.errors import AuthenticationFailed
from headwater.protocols.ripple import messages as rm
from headwater.protocols.ripple.connection import ClientConnection
from headwater.ripple import Worker, WorkerError

CONFIG = """
[auth]
required = true
[[auth.tokens]]
token = "s3cret"
tenants = [0]
[[auth.tokens]]
token = "acme-only"
tenants = [42]
[[tenants]]
id = 42
name = "acme"
"""


@dataclass
class Price:
    symbol: str
    price: float


EVERY_LISTENER = {"convergedb": LOCAL, "ripple": LOCAL, "http": LOCAL}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("auth"), config=CONFIG, listen=EVERY_LISTENER, clean_log=True
    )


def http_status(server: Server, token: str | None, tenant: int = 0) -> int:
    request = urllib.request.Request(f"http://{server.address_of('http')}/api/streams")
    request.add_header("X-Headwater-Tenant", str(tenant))
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_kimberlite(server: Server) -> None:
    with headwater.connect(server.address, token="s3cret") as client:
        assert client.authenticated
        client.create_stream("auth_k")
    for token in (None, "wrong"):
        with (
            headwater.connect(server.address, token=token) as client,
            pytest.raises(AuthenticationFailed),
        ):
            client.list_streams()
    with (
        headwater.connect(server.address, token="acme-only", tenant=0) as client,
        pytest.raises(AuthenticationFailed, match="does not grant tenant 0"),
    ):
        client.list_streams()


def test_convergedb(server: Server) -> None:
    address = server.address_of("convergedb")
    with entities.connect(address, token="s3cret", name="auth-writer") as source:
        prices = source.create_kind(Price, "auth_prices")
        source.assert_(prices, "p1", Price("A", 1.5))
        source.flush()
        assert source.get(prices, "p1").value == Price("A", 1.5)
    for token in (None, "wrong"):
        with pytest.raises(entities.AuthFailed):
            entities.connect(address, token=token)


def test_http_and_websocket(server: Server) -> None:
    assert http_status(server, "s3cret") == 200
    assert http_status(server, None) == 401
    assert http_status(server, "wrong") == 401
    assert http_status(server, "acme-only") == 403  # known, but not for tenant 0
    assert http_status(server, "acme-only", tenant=42) == 200
    url = f"ws://{server.address_of('http')}/ws"
    with ws_connect(url, additional_headers={"Authorization": "Bearer s3cret"}) as ws:
        ws.ping().wait(30)
    with pytest.raises(InvalidStatus) as refused:
        ws_connect(url, open_timeout=30)
    assert refused.value.response.status_code == 401


def test_ripple_worker_is_refused_while_auth_is_required(server: Server) -> None:
    address = server.address_of("ripple")
    with pytest.raises(WorkerError, match="authentication failed: a valid token is required"):
        Worker("auth-job", {"ripple_prices": Price}, server=address)
    with pytest.raises(WorkerError, match="authentication failed: unknown token"):
        Worker("auth-job", {"ripple_prices": Price}, server=address, token="wrong")
    with pytest.raises(WorkerError, match="does not grant tenant 0"):
        Worker("auth-job", {"ripple_prices": Price}, server=address, token="acme-only", tenant=0)
    # The server still serves a worker with a valid token, and only it wrote anything.
    with Worker("auth-job", {"ripple_prices": Price}, server=address, token="s3cret") as worker:
        worker.set("ripple_prices", "p1", Price("A", 1.5))
        worker.checkpoint()
    with headwater.connect(server.address, token="s3cret") as client:
        assert client.query("SELECT symbol, price FROM ripple_prices").rows == [("A", "1.5")]


def ripple_answer(server: Server, handshake: bytes, *then: bytes) -> rm.SchemaNegotiation:
    """The server's answer to a raw Handshake (and whatever is pipelined behind it); the
    server must close the connection after a refusal."""
    with socket.create_connection(("127.0.0.1", server.ports["ripple"]), timeout=30) as sock:
        sock.sendall(handshake + b"".join(then))
        codec = ClientConnection("reader")
        received: list[rm.Message] = []
        while data := sock.recv(1 << 16):
            received += [r.message for r in codec.receive_data(data)]
            if received and received[0] == rm.SchemaNegotiation(True, ()):
                return received[0]  # accepted: the connection stays open
    [answer] = received
    assert isinstance(answer, rm.SchemaNegotiation)
    return answer


def test_an_anonymous_ripple_worker_cannot_migrate_a_kind_or_take_source_slots(
    server: Server,
) -> None:
    """The attack of issue 17: an unauthenticated worker overwrote and migrated a tenant's
    kind and took all 64 source slots. Refused now, with nothing written."""
    with entities.connect(server.address_of("convergedb"), token="s3cret", name="owner") as owner:
        held = owner.create_kind(Price, "held_prices")
        owner.assert_(held, "p1", Price("A", 1.5))
        owner.flush()
    migrated = rm.Schema(
        "held_prices",
        2,
        (
            rm.Field("symbol", rm.FieldType.STRING),
            rm.Field("price", rm.FieldType.FLOAT),
            rm.Field("evil", rm.FieldType.STRING),
        ),
    )
    overwrite = rm.Set({"symbol": "HACKED", "price": 0.0, "evil": "x"})
    # One more than the 64 slots a tenant's kinds have, each pipelining an overwrite.
    for n in range(65):
        for auth in (None, rm.HandshakeAuth("wrong"), rm.HandshakeAuth("acme-only", 0)):
            attacker = ClientConnection(f"attacker-{n}")
            hello = attacker.handshake({"held_prices": migrated}, auth=auth)
            answer = ripple_answer(
                server, hello, attacker.send_delta("held_prices", "p1", overwrite)
            )
            assert not answer.ok and answer.errors[0].startswith("authentication failed"), answer
    with headwater.connect(server.address, token="s3cret") as client:
        shown = client.query("SELECT * FROM held_prices")
        assert shown.columns[-3:-1] == ["symbol", "price"]  # not migrated
        assert [row[-3:-1] for row in shown.rows] == [("A", "1.5")]  # not overwritten
    # Every slot is still free: the owner's token gets one, and so does a Ripple worker's.
    with Worker(
        "held-job", {"held_prices": Price}, server=server.address_of("ripple"), token="s3cret"
    ) as worker:
        worker.set("held_prices", "p2", Price("B", 2.5))
        worker.checkpoint()
    request = urllib.request.Request(f"http://{server.address_of('http')}/api/ripple/workers")
    request.add_header("Authorization", "Bearer s3cret")
    with urllib.request.urlopen(request, timeout=30) as response:
        workers = json.loads(response.read())["workers"]
    assert [w["worker_id"] for w in workers if w["worker_id"].startswith("attacker")] == []
    assert "held-job" in [w["worker_id"] for w in workers]


def test_a_ripple_token_writes_only_to_its_tenants(server: Server) -> None:
    """``acme-only`` grants tenant 42: its worker writes there by default, and tenant 0
    sees nothing of it."""
    address = server.address_of("ripple")
    with Worker("acme-job", {"acme_prices": Price}, server=address, token="acme-only") as worker:
        worker.set("acme_prices", "p1", Price("ACME", 42.0))
        worker.checkpoint()
    with headwater.connect(server.address, token="acme-only", tenant=42) as client:
        assert client.query("SELECT symbol, price FROM acme_prices").rows == [("ACME", "42.0")]
    with headwater.connect(server.address, token="s3cret") as client:
        names = [row[0] for row in client.query("SHOW TABLES").rows]
        assert "acme_prices" not in names
