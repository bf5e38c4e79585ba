"""Bearer tokens on /metrics and every /api route (the dashboard's data included), and
/metrics scoped to a token's tenants, against a real server (docs/operations.md,
"Metrics and their tokens"):

- with ``[auth] required = true``, no token or an unknown one is a 401;
- a token sees the series of its own tenants (and the server-wide ones), never a series
  labelled with another tenant; an ``admin = true`` token sees every tenant's;
- without required auth and without a token, /metrics is whole, as before;
- no token, valid or not, ever appears in the server's log (DEBUG level).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import LOCAL, Server, serving
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from headwater.ripple import Worker

TENANT0_TOKEN = "tok-zero-4c1f"
TENANT1_TOKEN = "tok-one-9b2e"
ADMIN_TOKEN = "tok-admin-77aa"  # grants tenant 0, sees every tenant's metrics
UNKNOWN_TOKEN = "tok-unknown-d00d"
TOKENS = (TENANT0_TOKEN, TENANT1_TOKEN, ADMIN_TOKEN, UNKNOWN_TOKEN)

TENANTS = """
[[tenants]]
id = 1
name = "other"
"""
AUTH = f"""
[logging]
level = "DEBUG"

[auth]
required = true
[[auth.tokens]]
token = "{TENANT0_TOKEN}"
tenants = [0]
[[auth.tokens]]
token = "{TENANT1_TOKEN}"
tenants = [1]
[[auth.tokens]]
token = "{ADMIN_TOKEN}"
tenants = [0]
admin = true
"""
STREAMS = {0: "alpha_of_tenant0", 1: "beta_of_tenant1"}
TOKEN_OF = {0: TENANT0_TOKEN, 1: TENANT1_TOKEN}

# The dashboard's data calls (static/dashboard.js) and the other GET routes of /api.
API_READS = (
    "/api/info",
    "/api/streams",
    "/api/kinds",
    "/api/consumer-groups",
    "/api/sources",
    "/api/ripple/workers",
)


def call(
    server: Server,
    method: str,
    path: str,
    body: Any = None,
    *,
    token: str | None = None,
    tenant: int | None = None,
) -> tuple[int, bytes, dict[str, str]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{server.address_of('http')}{path}", data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    if tenant is not None:
        req.add_header("X-Headwater-Tenant", str(tenant))
    try:
        with urllib.request.urlopen(req, timeout=15) as answer:
            return answer.status, answer.read(), dict(answer.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def fill(server: Server, token_of: Mapping[int, str | None]) -> None:
    """A stream per tenant with one event, read once: per-stream series exist for both."""
    for tenant, name in STREAMS.items():
        token = token_of[tenant]
        created = call(server, "POST", "/api/streams", {"name": name}, token=token, tenant=tenant)
        assert created[0] == 201, created
        path = f"/api/streams/{name}/events"
        assert call(server, "POST", path, ["e"], token=token, tenant=tenant)[0] == 200
        assert call(server, "GET", path, token=token, tenant=tenant)[0] == 200


def scrape(server: Server, token: str | None) -> tuple[set[str], set[str], set[str]]:
    """(tenant labels, stream labels, metric names) of a 200 /metrics scrape."""
    status, body, headers = call(server, "GET", "/metrics", token=token)
    assert status == 200, body
    assert headers["Content-Type"].startswith("text/plain")
    tenants: set[str] = set()
    streams: set[str] = set()
    names: set[str] = set()
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            names.add(sample.name)
            if "tenant" in sample.labels:
                tenants.add(sample.labels["tenant"])
            if "stream" in sample.labels:
                streams.add(sample.labels["stream"])
    return tenants, streams, names


@dataclass
class Price:
    symbol: str
    price: float


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("http_auth_scope")
    listen = {"http": LOCAL, "ripple": LOCAL}
    for started in serving(root, config=AUTH + TENANTS, listen=listen):
        fill(started, TOKEN_OF)
        yield started


def assert_401(status: int, body: bytes, headers: dict[str, str]) -> None:
    assert status == 401, body
    assert headers["WWW-Authenticate"] == 'Bearer realm="headwater"'
    error = json.loads(body)["error"]
    assert error["name"] == "AuthenticationFailed"
    assert error["message"] in ("a valid bearer token is required", "unknown token")


@pytest.mark.parametrize("path", ["/metrics", *API_READS])
def test_no_token_or_an_unknown_one_is_401(server: Server, path: str) -> None:
    assert_401(*call(server, "GET", path))
    assert_401(*call(server, "GET", path, token=UNKNOWN_TOKEN))
    # Another client, with its token, is served.
    status, body, _ = call(server, "GET", path, token=TENANT0_TOKEN)
    assert status == 200, body


def test_a_token_sees_only_its_tenants_series(server: Server) -> None:
    for tenant, token in TOKEN_OF.items():
        tenants, streams, names = scrape(server, token)
        assert tenants == {str(tenant)}
        assert streams == {STREAMS[tenant]}
        # Its own per-stream series are all there, and the server-wide ones.
        assert "headwater_events_appended_total" in names
        assert "headwater_bytes_read_total" in names
        assert "headwater_uptime_seconds" in names


def test_an_admin_token_sees_every_tenants_series(server: Server) -> None:
    tenants, streams, _ = scrape(server, ADMIN_TOKEN)
    assert tenants == {"0", "1"}
    assert streams == set(STREAMS.values())


def test_an_admin_token_acts_for_its_own_tenants_only(server: Server) -> None:
    status, body, _ = call(server, "GET", "/api/streams", token=ADMIN_TOKEN, tenant=1)
    assert status == 403, body
    assert call(server, "GET", "/api/streams", token=ADMIN_TOKEN, tenant=0)[0] == 200


def test_ripple_workers_are_shown_to_their_tenant_only(server: Server) -> None:
    with Worker(
        "scoped-job",
        {"scoped_prices": Price},
        server=server.address_of("ripple"),
        token=TENANT1_TOKEN,
    ) as worker:
        worker.set("scoped_prices", "p1", Price("S", 1.0))
        worker.checkpoint()
        status, body, _ = call(server, "GET", "/api/ripple/workers", token=TENANT1_TOKEN, tenant=1)
        assert status == 200, body
        assert [w["worker_id"] for w in json.loads(body)["workers"]] == ["scoped-job"]
        status, body, _ = call(server, "GET", "/api/ripple/workers", token=TENANT0_TOKEN)
        assert status == 200 and json.loads(body) == {"workers": []}
        status, body, _ = call(server, "GET", "/api/ripple/workers", token=TENANT1_TOKEN, tenant=0)
        assert status == 403, body


def test_no_token_is_ever_logged(server: Server) -> None:
    # A WebSocket upgrade with ?token= (where browsers put it) and a refused one.
    url = f"ws://{server.address_of('http')}/ws?token={TENANT0_TOKEN}"
    with ws_connect(url, open_timeout=15):
        pass
    with pytest.raises(InvalidStatus):
        ws_connect(f"ws://{server.address_of('http')}/ws?token={UNKNOWN_TOKEN}", open_timeout=15)
    assert_401(*call(server, "GET", "/metrics", token=UNKNOWN_TOKEN))
    # Requests aiohttp's parser refuses quote the bad line in their error: a header or a
    # request line holding a token. Each is one warning line naming the fault only.
    malformed = [
        f"GET /metrics HTTP/1.1\r\nAuthorization: Bearer {TENANT0_TOKEN}\x01\r\n\r\n",
        f"GET /metrics HTTP/1.1\r\nAuthorization : Bearer {TENANT1_TOKEN}\r\n\r\n",
        f"GET /ws?token={ADMIN_TOKEN}\x01 HTTP/1.1\r\nHost: h\r\n\r\n",
        f"GET /metrics HTTP/1.1\r\nAuthorization: Bearer {UNKNOWN_TOKEN}{'a' * 9000}\r\n\r\n",
    ]
    log_before = server.log_text()
    for raw in malformed:
        with socket.create_connection(("127.0.0.1", server.ports["http"]), timeout=15) as sock:
            sock.sendall(raw.encode("latin-1"))
            answer = sock.recv(1 << 16)
        assert answer.split(b" ", 2)[1] == b"400", answer
    new_lines = server.log_text()[len(log_before) :].splitlines()
    assert len([line for line in new_lines if "bad request from 127.0.0.1:" in line]) == len(
        malformed
    )
    log = server.log_text()
    for token in TOKENS:
        assert token not in log, f"the token {token} is in the server log"
    assert "Traceback" not in log


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Auth not required; one token known (for tenant 1)."""
    root = tmp_path_factory.mktemp("http_open_scope")
    config = f'[auth]\n[[auth.tokens]]\ntoken = "{TENANT1_TOKEN}"\ntenants = [1]\n' + TENANTS
    for started in serving(root, config=config, listen={"http": LOCAL}):
        fill(started, {0: None, 1: None})
        yield started


def test_without_required_auth_no_token_sees_everything(open_server: Server) -> None:
    tenants, streams, _ = scrape(open_server, None)
    assert tenants == {"0", "1"}
    assert streams == set(STREAMS.values())
    assert call(open_server, "GET", "/api/ripple/workers")[0] == 200


def test_without_required_auth_a_known_token_is_still_scoped(open_server: Server) -> None:
    tenants, streams, _ = scrape(open_server, TENANT1_TOKEN)
    assert tenants == {"1"}
    assert streams == {STREAMS[1]}
