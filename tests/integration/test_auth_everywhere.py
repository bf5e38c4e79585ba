"""One auth rule on every listener of a real server (headwater.api.auth): a known token
acts for exactly its tenants, a missing or unknown one is refused while auth is
required. Ripple carries no credential on its wire, so a worker is refused outright."""

from __future__ import annotations

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
    with pytest.raises(WorkerError, match="authentication failed"):
        Worker("auth-job", {"ripple_prices": Price}, server=server.address_of("ripple"))
