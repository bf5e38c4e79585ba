"""The HTTP front end against a real ``headwater serve`` process (docs/http-api.md)."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openapi_spec_validator
import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import LOCAL, Server, serving

from headwater.server.app import Server as AppServer
from headwater.server.config import ServerConfig
from headwater.server.http.listener import build_app
from waiting import wait_until

OPENAPI = Path(__file__).parents[2] / "src" / "headwater" / "server" / "openapi.json"

AUTH_CONFIG = """
[auth]
required = true
[[auth.tokens]]
token = "zero-only"
tenants = [0]
[[auth.tokens]]
token = "both"
tenants = [0, 42]
"""
TENANTS_CONFIG = """
[[tenants]]
id = 42
name = "acme"
"""


LISTEN = {"http": LOCAL}


class HttpApi:
    """Requests to the HTTP API of a :class:`~servers.Server` (HTTP and Kimberlite on)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.ports = server.ports
        self.base = f"http://{server.address_of('http')}"

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        content_type: str = "application/json",
        tenant: int | str | None = None,
        token: str | None = None,
    ) -> tuple[int, Any, dict[str, str]]:
        """(status, decoded JSON or text or None, headers)."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", content_type)
        if tenant is not None:
            req.add_header("X-Headwater-Tenant", str(tenant))
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                status, payload, headers = resp.status, resp.read(), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            status, payload, headers = exc.code, exc.read(), dict(exc.headers)
        ctype = headers.get("Content-Type", "")
        if not payload:
            return status, None, headers
        if ctype.startswith("application/json"):
            return status, json.loads(payload), headers
        return status, payload.decode(), headers


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpApi]:
    root = tmp_path_factory.mktemp("http")
    for server in serving(root, config=TENANTS_CONFIG, listen=LISTEN):
        yield HttpApi(server)


@pytest.fixture(scope="module")
def auth_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpApi]:
    root = tmp_path_factory.mktemp("http_auth")
    for server in serving(root, config=AUTH_CONFIG + TENANTS_CONFIG, listen=LISTEN):
        yield HttpApi(server)


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(OPENAPI.read_text())
    return data


def check_schema(spec: dict[str, Any], name: str, instance: Any) -> None:
    schema = {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}
    jsonschema.Draft202012Validator(schema).validate(instance)


def assert_error(
    result: tuple[int, Any, dict[str, str]], status: int, name: str, code: int
) -> None:
    got_status, body, _ = result
    assert got_status == status, body
    assert body["error"]["name"] == name, body
    assert body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["retryable"], bool)


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# ---- service endpoints --------------------------------------------------------------


def test_health_ready_info(srv: HttpApi, spec: dict[str, Any]) -> None:
    assert srv.request("GET", "/health")[:2] == (200, {"status": "ok"})
    assert srv.request("GET", "/ready")[:2] == (200, {"status": "ready"})
    status, info, _ = srv.request("GET", "/api/info")
    assert status == 200
    assert info["listeners"] == srv.ports
    assert info["tenant"]["id"] == 0 and info["auth_required"] is False
    check_schema(spec, "ServerInfo", info)
    status, info, _ = srv.request("GET", "/api/info?tenant=42")
    assert info["tenant"]["name"] == "acme"


def test_openapi_served_and_complete(srv: HttpApi, spec: dict[str, Any]) -> None:
    status, served, headers = srv.request("GET", "/openapi.json")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert served == spec
    # Every route the application serves is documented, with its method.
    app = build_app(AppServer(Path("unused"), ServerConfig()))
    served_routes = {
        (route.method.lower(), route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None
    }
    documented = {(m, p) for p, ops in spec["paths"].items() for m in ops}
    assert served_routes == documented
    openapi_spec_validator.validate(spec)


def test_unknown_route_and_method_are_json(srv: HttpApi) -> None:
    assert_error(srv.request("GET", "/api/nope"), 404, "InvalidRequest", 2)
    status, body, headers = srv.request("PUT", "/api/streams")
    assert status == 405 and body["error"]["code"] == 2
    assert "POST" in headers.get("Allow", "")


# ---- streams ------------------------------------------------------------------------


def test_stream_lifecycle(srv: HttpApi, spec: dict[str, Any]) -> None:
    status, created, headers = srv.request(
        "POST", "/api/streams", {"name": "life", "settings": {"retention_ms": 60000}}
    )
    assert status == 201, created
    assert headers["Location"] == "/api/streams/life"
    assert created["name"] == "life" and created["next_offset"] == 0
    assert created["settings"]["retention_ms"] == 60000
    check_schema(spec, "Stream", created)
    assert_error(
        srv.request("POST", "/api/streams", {"name": "life"}), 409, "StreamAlreadyExists", 10
    )
    status, listing, _ = srv.request("GET", "/api/streams")
    assert status == 200 and "life" in [s["name"] for s in listing["streams"]]
    status, described, _ = srv.request("GET", "/api/streams/life")
    assert status == 200 and described["stream_id"] == created["stream_id"]
    status, body, _ = srv.request("DELETE", "/api/streams/life")
    assert (status, body) == (204, None)
    assert_error(srv.request("GET", "/api/streams/life"), 404, "StreamNotFound", 5)
    assert_error(srv.request("DELETE", "/api/streams/life"), 404, "StreamNotFound", 5)
    status, listing, _ = srv.request("GET", "/api/streams")
    assert "life" not in [s["name"] for s in listing["streams"]]


@pytest.mark.parametrize(
    "body",
    [
        {"name": "bad name"},
        {"name": "hw_reserved"},
        {"name": ""},
        {"name": 5},
        {"nam": "x"},
        {"name": "okname", "settings": {"cleanup_policy": "shred"}},
        {"name": "okname", "settings": {"retention_ms": -1}},
        # Past a signed 64-bit count (Kafka's Java long) once stored as given.
        {"name": "okname", "settings": {"retention_ms": 1e30}},
        {"name": "okname", "settings": {"retention_bytes": 2**63}},
        {"name": "okname", "settings": {"sync": "interval:99999999999999999999"}},
        {"name": "okname", "settings": []},
        {"name": "okname", "settings": {"colour": "red"}},
        {"name": "okname", "settings": {"segment_bytes": "big"}},
        ["okname"],
    ],
)
def test_create_stream_rejects(srv: HttpApi, body: Any) -> None:
    assert_error(srv.request("POST", "/api/streams", body), 400, "InvalidRequest", 2)
    assert "okname" not in [s["name"] for s in srv.request("GET", "/api/streams")[1]["streams"]]


def test_create_stream_bad_json(srv: HttpApi) -> None:
    assert_error(srv.request("POST", "/api/streams", raw=b"{nope"), 400, "InvalidRequest", 2)
    assert_error(srv.request("POST", "/api/streams", raw=b""), 400, "InvalidRequest", 2)


# ---- append and read ----------------------------------------------------------------


def test_append_json_and_ndjson_then_read(srv: HttpApi, spec: dict[str, Any]) -> None:
    srv.request("POST", "/api/streams", {"name": "ev"})
    status, res, _ = srv.request(
        "POST", "/api/streams/ev/events", ["héllo", {"a": 1, "b": [1, 2]}, 42, True, [1]]
    )
    assert status == 200, res
    assert (res["base_offset"], res["count"], res["next_offset"]) == (0, 5, 5)
    check_schema(spec, "AppendResult", res)
    ndjson = b'{"x": 1}\r\n\n"quoted"\n7\n'
    status, res, _ = srv.request(
        "POST", "/api/streams/ev/events", raw=ndjson, content_type="application/x-ndjson"
    )
    assert status == 200, res
    assert (res["base_offset"], res["count"]) == (5, 3)
    raw_b64 = base64.b64encode(b"\xff\x00bin").decode()
    status, res, _ = srv.request("POST", "/api/streams/ev/events?encoding=base64", [raw_b64])
    assert status == 200 and res["base_offset"] == 8

    status, page, _ = srv.request("GET", "/api/streams/ev/events")
    assert status == 200
    check_schema(spec, "ReadResult", page)
    values = [e["value"] for e in page["events"]]
    assert values == [
        "héllo",
        '{"a":1,"b":[1,2]}',
        "42",
        "true",
        "[1]",
        '{"x": 1}',
        '"quoted"',
        "7",
        None,
    ]
    assert base64.b64decode(page["events"][0]["value_b64"]) == "héllo".encode()
    assert base64.b64decode(page["events"][8]["value_b64"]) == b"\xff\x00bin"
    assert [e["offset"] for e in page["events"]] == list(range(9))
    positions = [e["position"] for e in page["events"]]
    assert positions == sorted(positions)
    assert page["next_offset"] == 9 and page["end_offset"] == 9 and page["start_offset"] == 0

    # A range: from/to/limit.
    status, page, _ = srv.request("GET", "/api/streams/ev/events?from=2&to=5")
    assert [e["offset"] for e in page["events"]] == [2, 3, 4] and page["next_offset"] == 5
    status, page, _ = srv.request("GET", "/api/streams/ev/events?from=3&limit=2")
    assert [e["offset"] for e in page["events"]] == [3, 4]
    status, page, _ = srv.request("GET", "/api/streams/ev/events?from=100")
    assert status == 200 and page["events"] == [] and page["next_offset"] == 100
    status, page, _ = srv.request("GET", "/api/streams/ev/events?from=4&to=4")
    assert page["events"] == []


def test_appended_json_keeps_its_numbers_as_sent(srv: HttpApi) -> None:
    # Array elements were parsed into Python floats and written back: 1e400 became
    # Infinity (not JSON), 0.10000000000000000555 became 0.1, 1E2 became 100.0. An
    # element is stored as its text as sent, without the whitespace between tokens
    # (inside strings kept).
    srv.request("POST", "/api/streams", {"name": "numbers"})
    body = (
        b'[1e400, {"p": 0.10000000000000000555, "s": "a  b \\" c"}, '
        b"12345678901234567890.5 , 1E2, [1, -0.0 ,2]]"
    )
    status, res, _ = srv.request(
        "POST", "/api/streams/numbers/events", raw=body, content_type="application/json"
    )
    assert status == 200, res
    status, page, _ = srv.request("GET", "/api/streams/numbers/events")
    assert [e["value"] for e in page["events"]] == [
        "1e400",
        '{"p":0.10000000000000000555,"s":"a  b \\" c"}',
        "12345678901234567890.5",
        "1E2",
        "[1,-0.0,2]",
    ]


@pytest.mark.parametrize(
    "query",
    [
        "from=-1",
        "from=x",
        "limit=0",
        "limit=10001",
        "from=5&to=2",
        "tenant=abc",
        # Past a signed 64-bit number: it was read, and echoed back as next_offset.
        "from=100000000000000000000000",
        "to=9223372036854775808",
    ],
)
def test_read_rejects(srv: HttpApi, query: str) -> None:
    srv.request("POST", "/api/streams", {"name": "rd"})
    assert_error(srv.request("GET", f"/api/streams/rd/events?{query}"), 400, "InvalidRequest", 2)


def test_read_and_append_missing_stream(srv: HttpApi) -> None:
    assert_error(srv.request("GET", "/api/streams/missing/events"), 404, "StreamNotFound", 5)
    assert_error(
        srv.request("POST", "/api/streams/missing/events", ["a"]), 404, "StreamNotFound", 5
    )


def _next_offset(srv: HttpApi, name: str) -> int:
    status, info, _ = srv.request("GET", f"/api/streams/{name}")
    assert status == 200
    offset: int = info["next_offset"]
    return offset


@pytest.mark.parametrize(
    ("raw", "content_type"),
    [
        (json.dumps(["x"] * 10_001).encode(), "application/json"),
        (b"\n".join([b"1"] * 10_001), "application/x-ndjson"),
        (json.dumps(["a" * (1 << 20)] * 4 + ["b"]).encode(), "application/json"),
        (b"[]", "application/json"),
        (b"", "application/x-ndjson"),
        (b'["ok", null]', "application/json"),
        (b'{"not": "an array"}', "application/json"),
        (b"[1, 2", "application/json"),
        (b'{"ok": 1}\nnot json\n', "application/x-ndjson"),
        (b'["ok"]', "text/plain"),
        (b'["not base64!"]', "application/json; encoding=base64"),
        # Padding past a whole quantum: Python's decoder takes it, the spec's pattern not.
        (b'["AAAA="]', "application/json; encoding=base64"),
        # Each record carries exactly one of value and value_b64 (the Records schema).
        (b'{"records": [{}]}', "application/json"),
        (b'{"records": [{"value": "a", "value_b64": "YQ=="}]}', "application/json"),
        (b'{"records": [{"value_b64": "AAAA="}]}', "application/json"),
        # A time past a signed 64-bit ms count once failed inside as a retryable 500.
        (b'{"records": [{"value": "a", "timestamp_ms": 9223372036854775808}]}', "application/json"),
        (b'{"records": [{"value": "a", "timestamp_ms": -1}]}', "application/json"),
        # NaN and Infinity are not JSON (Python's json reads them: they were stored).
        (b'["ok", NaN]', "application/json"),
        (b'[{"a": -Infinity}]', "application/json"),
        (b'{"ok": 1}\n{"a": Infinity}\n', "application/x-ndjson"),
        (b"NaN\n", "application/x-ndjson"),
    ],
)
def test_append_rejects_and_stores_nothing(srv: HttpApi, raw: bytes, content_type: str) -> None:
    srv.request("POST", "/api/streams", {"name": "lim"})
    before = _next_offset(srv, "lim")
    path = "/api/streams/lim/events"
    if content_type.endswith("encoding=base64"):
        path, content_type = path + "?encoding=base64", "application/json"
    status, body, _ = srv.request("POST", path, raw=raw, content_type=content_type)
    assert status == 400, body
    assert body["error"]["name"] == "InvalidRequest"
    assert _next_offset(srv, "lim") == before


def test_append_at_the_limits_is_accepted(srv: HttpApi) -> None:
    srv.request("POST", "/api/streams", {"name": "edge"})
    status, res, _ = srv.request("POST", "/api/streams/edge/events", ["x"] * 10_000)
    assert status == 200 and res["count"] == 10_000
    status, res, _ = srv.request("POST", "/api/streams/edge/events", ["a" * (1 << 20)] * 4)
    assert status == 200 and res["count"] == 4


def test_oversized_body_is_413_json(srv: HttpApi) -> None:
    srv.request("POST", "/api/streams", {"name": "huge"})
    raw = json.dumps(["a" * (17 << 20)]).encode()
    try:
        status, body, _ = srv.request("POST", "/api/streams/huge/events", raw=raw)
    except (ConnectionError, urllib.error.URLError):
        pytest.skip("server closed the connection before the client finished sending")
    assert status == 413 and body["error"]["code"] == 2
    assert _next_offset(srv, "huge") == 0


# ---- SQL ----------------------------------------------------------------------------


def test_sql_query_and_query_at(srv: HttpApi, spec: dict[str, Any]) -> None:
    srv.request("POST", "/api/streams", {"name": "sq"})
    srv.request("POST", "/api/streams/sq/events", [{"n": 1}, {"n": 2}])
    status, res, _ = srv.request("POST", "/api/sql", {"sql": "SELECT count(*) AS c FROM sq"})
    assert status == 200, res
    assert res == {"columns": ["c"], "rows": [[2]]}
    check_schema(spec, "SqlResult", res)
    status, res, _ = srv.request(
        "POST", "/api/sql", {"sql": "SELECT ? + 1 AS v, ? AS s, ? AS b", "params": [41, "x", True]}
    )
    assert res["rows"] == [[42, "x", True]]
    status, res, _ = srv.request(
        "POST", "/api/sql", {"sql": "SELECT ? AS t", "params": [{"timestamp_ns": 1_500_000_000}]}
    )
    assert status == 200 and res["rows"][0][0].startswith("1970-01-01 00:00:01.5")

    # INSERT appends to the stream.
    status, res, _ = srv.request("POST", "/api/sql", {"sql": "INSERT INTO sq (data) VALUES ('x')"})
    assert status == 200, res
    assert res["columns"] == ["rows_affected", "log_offset"] and res["rows"] == [[1, 2]]

    status, info, _ = srv.request("GET", "/api/info")
    head = info["tenant"]["log_position"]

    def answered() -> tuple[int, Any, dict[str, str]] | None:
        # ProjectionLag (503, retryable) until the projections reach the head.
        result = srv.request(
            "POST", "/api/sql", {"sql": "SELECT count(*) FROM sq", "position": head}
        )
        status, res, headers = result
        if status != 503:
            return result
        assert res["error"]["name"] == "ProjectionLag" and res["error"]["retryable"]
        assert headers["Retry-After"] == "1"
        return None

    status, res, _ = wait_until(answered, 10, "the projections never reached the head")
    assert status == 200, res
    assert res["rows"] == [[3]] and res["position"] == head
    status, res, _ = srv.request(
        "POST", "/api/sql", {"sql": "SELECT count(*) FROM sq", "position": 0}
    )
    assert status == 200 and res["rows"] == [[0]]
    assert_error(
        srv.request("POST", "/api/sql", {"sql": "SELECT 1", "position": head + 1000}),
        422,
        "PositionAhead",
        9,
    )


@pytest.mark.parametrize(
    ("body", "status", "name", "code"),
    [
        ({"sql": "SELEKT nonsense"}, 400, "QueryParseError", 7),
        ({"sql": "SELECT * FROM no_such_table"}, 404, "TableNotFound", 6),
        ({"sql": ""}, 400, "InvalidRequest", 2),
        ({"sql": "SELECT 1", "params": [1.5]}, 400, "InvalidRequest", 2),
        ({"sql": "SELECT 1", "params": "x"}, 400, "InvalidRequest", 2),
        ({"sql": "SELECT 1", "position": -1}, 400, "InvalidRequest", 2),
        ({"sql": "SELECT 1", "extra": 1}, 400, "InvalidRequest", 2),
        ({"query": "SELECT 1"}, 400, "InvalidRequest", 2),
    ],
)
def test_sql_errors(srv: HttpApi, body: Any, status: int, name: str, code: int) -> None:
    assert_error(srv.request("POST", "/api/sql", body), status, name, code)


def test_sql_execution_error(srv: HttpApi) -> None:
    status, body, _ = srv.request("POST", "/api/sql", {"sql": "SELECT 1 / 'x'::INTEGER"})
    assert status in (400, 422), body
    assert body["error"]["name"] in ("QueryExecutionError", "QueryParseError")


# ---- tenants and auth ---------------------------------------------------------------


def test_tenant_isolation(srv: HttpApi) -> None:
    assert srv.request("POST", "/api/streams", {"name": "iso"}, tenant=42)[0] == 201
    srv.request("POST", "/api/streams/iso/events", ["t42"], tenant=42)
    assert_error(srv.request("GET", "/api/streams/iso"), 404, "StreamNotFound", 5)
    assert_error(srv.request("GET", "/api/streams/iso?tenant=0"), 404, "StreamNotFound", 5)
    page = srv.request("GET", "/api/streams/iso/events?tenant=42")[1]
    assert [e["value"] for e in page["events"]] == ["t42"]
    names0 = [s["name"] for s in srv.request("GET", "/api/streams")[1]["streams"]]
    names42 = [s["name"] for s in srv.request("GET", "/api/streams", tenant=42)[1]["streams"]]
    assert "iso" not in names0 and names42 == ["iso"]
    # The same name in tenant 0 is a different stream.
    assert srv.request("POST", "/api/streams", {"name": "iso"})[0] == 201
    assert srv.request("GET", "/api/streams/iso/events")[1]["events"] == []
    assert_error(srv.request("GET", "/api/streams", tenant=99), 404, "TenantNotFound", 4)
    assert_error(srv.request("GET", "/api/streams", tenant="x"), 400, "InvalidRequest", 2)
    assert_error(srv.request("GET", "/api/streams", tenant=-1), 400, "InvalidRequest", 2)


def test_auth_off_accepts_any_token(srv: HttpApi) -> None:
    assert srv.request("GET", "/api/streams", token="whatever")[0] == 200


def test_auth_required(auth_srv: HttpApi) -> None:
    s = auth_srv
    status, body, headers = s.request("GET", "/api/streams")
    assert status == 401 and body["error"]["name"] == "AuthenticationFailed"
    assert headers["WWW-Authenticate"].startswith("Bearer")
    assert_error(s.request("GET", "/api/streams", token="wrong"), 401, "AuthenticationFailed", 3)
    assert_error(
        s.request("POST", "/api/streams", {"name": "x"}, token="wrong"),
        401,
        "AuthenticationFailed",
        3,
    )
    assert s.request("GET", "/api/streams", token="zero-only")[0] == 200
    assert_error(
        s.request("GET", "/api/streams", token="zero-only", tenant=42),
        403,
        "AuthenticationFailed",
        3,
    )
    assert s.request("POST", "/api/streams", {"name": "a"}, token="both", tenant=42)[0] == 201
    assert s.request("POST", "/api/streams/a/events", ["v"], token="both", tenant=42)[0] == 200
    # Probes and the contract need no token; /metrics does (it names tenants' streams).
    for path in ("/health", "/ready", "/openapi.json"):
        assert s.request("GET", path)[0] == 200, path
    assert s.request("GET", "/metrics")[0] == 401
    assert s.request("GET", "/metrics", token="zero-only")[0] == 200
    req = urllib.request.Request(s.base + "/api/streams", headers={"Authorization": "Basic eA=="})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 401


# ---- metrics ------------------------------------------------------------------------


def test_metrics(srv: HttpApi) -> None:
    srv.request("POST", "/api/streams", {"name": "met"})

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        status, text, headers = srv.request("GET", "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        return metric_samples(text)

    labels = (("stream", "met"), ("tenant", "0"))
    before = scrape()
    errors_key = (
        "headwater_errors_total",
        (("code", "5"), ("name", "StreamNotFound"), ("protocol", "http")),
    )
    errors_before = before.get(errors_key, 0)
    srv.request("POST", "/api/streams/met/events", ["ab", "cde"])
    srv.request(
        "POST", "/api/streams/met/events", raw=b"1\n2\n", content_type="application/x-ndjson"
    )
    srv.request("GET", "/api/streams/met/events")
    srv.request("GET", "/api/streams/met_missing")
    after = scrape()
    assert after[("headwater_events_appended_total", labels)] == 4
    assert after[("headwater_bytes_appended_total", labels)] == 7
    assert after[("headwater_events_read_total", labels)] == 4
    assert after[("headwater_bytes_read_total", labels)] == 7
    count = ("headwater_append_seconds_count", (("protocol", "http"),))
    assert after[count] - before.get(count, 0) == 2
    assert after[errors_key] - errors_before == 1
    assert (
        after[("headwater_fsync_seconds_count", ())] > before[("headwater_fsync_seconds_count", ())]
    )
    assert after[("headwater_engine_events_appended_total", ())] >= 4
    assert after[("headwater_connections", (("protocol", "http"),))] >= 1
    assert after[("headwater_streams", (("tenant", "0"),))] >= 1
    assert after[("headwater_tenant_log_position", (("tenant", "0"),))] >= 4
    names = {name for name, _ in after}
    for required in (
        "headwater_append_seconds_bucket",
        "headwater_fsync_seconds_bucket",
        "headwater_fsync_seconds_sum",
        "headwater_uptime_seconds",
        "headwater_sql_queries_total",
    ):
        assert required in names, required


def test_a_deleted_streams_series_leave_metrics(srv: HttpApi) -> None:
    # They stayed for good (a stream churned through names grew /metrics without
    # bound), and a stream made again under the name went on from the old one's bytes
    # while its event count started again from 0.
    def series() -> dict[str, float]:
        text = srv.request("GET", "/metrics")[1]
        found = metric_samples(text)
        return {n: v for (n, labels), v in found.items() if ("stream", "churn") in labels}

    srv.request("POST", "/api/streams", {"name": "churn"})
    srv.request("POST", "/api/streams/churn/events", ["abcde"])
    srv.request("GET", "/api/streams/churn/events")
    assert series()["headwater_bytes_appended_total"] == 5
    assert series()["headwater_bytes_read_total"] == 5
    assert srv.request("DELETE", "/api/streams/churn")[0] == 204
    assert series() == {}
    srv.request("POST", "/api/streams", {"name": "churn"})
    srv.request("POST", "/api/streams/churn/events", ["xy"])
    again = series()
    assert again["headwater_bytes_appended_total"] == 2
    assert again["headwater_events_appended_total"] == 1
    assert "headwater_bytes_read_total" not in again


def test_fsyncs_of_every_partition_count_and_a_delete_takes_none_back(srv: HttpApi) -> None:
    # headwater_fsync_seconds counted partition 0's committers only, and a stream's
    # delete took its fsyncs back out: a counter going down reads as a reset to rate()
    # and the slow-fsync alert.
    def fsyncs() -> float:
        text = srv.request("GET", "/metrics")[1]
        return metric_samples(text)[("headwater_fsync_seconds_count", ())]

    srv.request("POST", "/api/streams", {"name": "fsp", "settings": {"partitions": 4}})
    before = fsyncs()
    for _ in range(5):
        status, _, _ = srv.request("POST", "/api/streams/fsp/events?partition=3", ["x"])
        assert status == 200
    after = fsyncs()
    assert after >= before + 5  # each lone append waited for its own fsync
    assert srv.request("DELETE", "/api/streams/fsp")[0] == 204
    assert fsyncs() >= after


def test_graceful_stop(tmp_path: Path) -> None:
    server = Server(tmp_path / "stop", listen=LISTEN).start()
    try:
        api = HttpApi(server)
        assert api.request("POST", "/api/streams", {"name": "s"})[0] == 201
        assert api.request("POST", "/api/streams/s/events", ["a"])[0] == 200
        assert server.stop() == 0
    finally:
        server.kill()
