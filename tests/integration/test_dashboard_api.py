"""The dashboard's page and the REST views it reads (kinds, entities, consumer groups,
kind sources) against a real ``headwater serve`` process (docs/http-api.md)."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from convergedb_raw import CdbClient, eid
from servers import LOCAL, Server, serving

import headwater
from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.fields import FieldType
from waiting import wait_until

OPENAPI = Path(__file__).parents[2] / "src" / "headwater" / "server" / "openapi.json"
LISTEN = {"http": LOCAL, "convergedb": LOCAL}
FIELDS = [
    ("temp", FieldType.F64),
    ("label", FieldType.STRING),
    ("raw", FieldType.BYTES),
    ("seen", FieldType.TIMESTAMP),
    ("ok", FieldType.BOOL),
]


class Api:
    def __init__(self, server: Server) -> None:
        self.base = f"http://{server.address_of('http')}"
        self.kimberlite = server.address
        self.convergedb = server.ports["convergedb"]

    def get(self, path: str) -> tuple[int, bytes, dict[str, str]]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=30) as resp:
                return resp.status, resp.read(), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(), dict(exc.headers)

    def json(self, path: str, status: int = 200) -> Any:
        got, body, headers = self.get(path)
        assert got == status, body
        assert headers["Content-Type"].startswith("application/json")
        return json.loads(body)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    for server in serving(tmp_path_factory.mktemp("dashboard_api"), listen=LISTEN):
        yield Api(server)


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(OPENAPI.read_text())
    return data


def check_schema(spec: dict[str, Any], name: str, instance: Any) -> None:
    schema = {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}
    jsonschema.Draft202012Validator(schema).validate(instance)


# ---- the page ---------------------------------------------------------------------------


def test_page_and_static_files(api: Api) -> None:
    status, body, headers = api.get("/")
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    assert b'<script src="/static/dashboard.js"' in body
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    for name, content_type in (
        ("dashboard.js", "text/javascript"),
        ("dashboard.css", "text/css"),
        ("favicon.svg", "image/svg+xml"),
    ):
        status, body, headers = api.get(f"/static/{name}")
        assert status == 200 and body, name
        assert headers["Content-Type"].split(";")[0] == content_type
        assert headers["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize(
    "path",
    [
        "/static/missing.js",
        "/static/__init__.py",  # not a served file type, though it exists in the package
        "/static/..%2Fdashboard.py",
        "/static/%2E%2E%2Fapi.py",
        "/static/.hidden.css",
        "/static/",
    ],
)
def test_static_refuses_anything_else(api: Api, path: str) -> None:
    status, body, _ = api.get(path)
    assert status == 404, body
    assert json.loads(body)["error"]["name"] == "InvalidRequest"


# ---- kinds, entities and sources --------------------------------------------------------


def test_kinds_entities_and_sources(api: Api, spec: dict[str, Any]) -> None:
    with CdbClient(api.convergedb, name="sensor-feed") as writer:
        kind = writer.create_kind("sensors", [(n, int(t)) for n, t in FIELDS])
        seen_ns = 1_700_000_000_123_456_789
        for i in range(12):
            values = [i + 0.5, f"s{i}", bytes([i, 255]), seen_ns + i, i % 2 == 0]
            writer.call(m.Assert.of(FIELDS, kind.kind_id, eid(i), values))
        writer.call(m.Retract(kind.kind_id, eid(11)))

        kinds = api.json("/api/kinds")
        check_schema(spec, "Kinds", kinds)
        by_name = {k["name"]: k for k in kinds["kinds"]}
        sensors = by_name["sensors"]
        assert sensors["entities"] == 11 and sensors["internal"] is False
        assert [f["name"] for f in sensors["fields"]] == [n for n, _ in FIELDS]
        assert [f["type"] for f in sensors["fields"]] == [
            "f64",
            "string",
            "bytes",
            "timestamp",
            "bool",
        ]
        assert sensors["changelog_bytes"] > 0
        # The presence kind lists the connected writer.
        assert by_name["convergedb_connections"]["internal"] is True
        assert by_name["convergedb_connections"]["entities"] == 1

        page = api.json("/api/kinds/sensors/entities?limit=5")
        check_schema(spec, "KindEntities", page)
        assert page["total"] == 11
        assert [e["entity_id"] for e in page["entities"]] == [eid(i).hex() for i in range(5)]
        third = page["entities"][3]
        assert third["fields"] == {
            "temp": 3.5,
            "label": "s3",
            "raw": base64.b64encode(bytes([3, 255])).decode(),
            "seen": seen_ns + 3,
            "ok": False,
        }
        assert third["version"] > page["entities"][2]["version"]
        everything = api.json("/api/kinds/sensors/entities")
        assert len(everything["entities"]) == 11  # the retracted one is gone
        one = api.json(f"/api/kinds/sensors/entities/{eid(3).hex()}")
        check_schema(spec, "Entity", one)
        assert one == third
        assert api.json(f"/api/kinds/sensors/entities/{eid(3).hex().upper()}") == third
        described = api.json("/api/kinds/sensors")
        check_schema(spec, "Kind", described)
        assert described == sensors
        retracted = api.json(f"/api/kinds/sensors/entities/{eid(11).hex()}", 404)
        assert (retracted["error"]["name"], retracted["error"]["code"]) == ("EntityNotFound", 6)

        sources = api.json("/api/sources")
        check_schema(spec, "KindSources", sources)
        (source,) = sources["sources"]
        assert source["name"] == "sensor-feed" and source["connected"] is True
        assert source["source_id"] == writer.source_id
        assert source["entities"] == 11

    # The writer left: its slot stays in its liveness grace period, no longer connected.
    wait_until(
        lambda: all(not s["connected"] for s in api.json("/api/sources")["sources"]),
        message="the source never showed as disconnected",
    )


@pytest.mark.parametrize(
    ("path", "status", "name"),
    [
        ("/api/kinds/nope/entities", 404, "KindNotFound"),
        ("/api/kinds/nope", 404, "KindNotFound"),
        # Not a 64-hex-digit id: a key, which no entity has here.
        ("/api/kinds/sensors/entities/zz", 404, "EntityNotFound"),
        ("/api/kinds/sensors/entities/00ff", 404, "EntityNotFound"),
        ("/api/kinds/sensors/entities?limit=0", 400, "InvalidRequest"),
        ("/api/kinds/sensors/entities?limit=10001", 400, "InvalidRequest"),
        ("/api/kinds/sensors/entities?limit=x", 400, "InvalidRequest"),
        ("/api/kinds?tenant=9", 404, "TenantNotFound"),
        ("/api/consumer-groups?tenant=-1", 400, "InvalidRequest"),
    ],
)
def test_kind_views_reject(api: Api, path: str, status: int, name: str) -> None:
    body = api.json(path, status)
    assert body["error"]["name"] == name


# ---- consumer groups and connection counts ----------------------------------------------


def test_consumer_groups_and_connections(api: Api, spec: dict[str, Any]) -> None:
    with headwater.connect(api.kimberlite) as client:
        client.create_stream("orders")
        client.append("orders", [f"{i}".encode() for i in range(30)])
        with client.subscribe("orders", 0, credits=4, group="billing") as sub:
            events = iter(sub)  # ending a for loop would end the subscription
            consumed = [next(events).offset for _ in range(20)]
            assert consumed == list(range(20))
            answer = wait_until(
                lambda: (got := api.json("/api/consumer-groups"))["groups"] and got,
                message="no group appeared",
            )
            check_schema(spec, "ConsumerGroups", answer)
            assert answer["partition_groups"] == []  # no Kafka or Rivven group here
            groups = answer["groups"]
            (group,) = groups
            assert group["stream"] == "orders" and group["group"] == "billing"
            assert group["active"] is True and group["waiting"] == 0
            assert group["end_offset"] == 30
            assert 0 < group["committed_offset"] <= 20
            assert group["lag"] == 30 - group["committed_offset"]
            info = api.json("/api/info")
            assert info["connections"]["kimberlite"] >= 1
            assert info["subscriptions"]["kimberlite"] >= 1
        wait_until(
            lambda: not api.json("/api/consumer-groups")["groups"][0]["active"],
            message="the group never went idle",
        )


def test_entity_view_is_valid_json_for_non_finite_floats(api: Api) -> None:
    fields = [("reading", FieldType.F64)]
    with CdbClient(api.convergedb, name="gauges") as writer:
        kind = writer.create_kind("gauges", [(n, int(t)) for n, t in fields])
        for i, value in enumerate((float("nan"), float("inf"), -2.5)):
            writer.call(m.Assert.of(fields, kind.kind_id, eid(i), [value]))
        status, body, _ = api.get("/api/kinds/gauges/entities")
    assert status == 200
    # Strict JSON (what browsers parse): NaN and Infinity are not JSON, so they are null.
    page = json.loads(body, parse_constant=lambda name: pytest.fail(f"{name} in the body"))
    assert [e["fields"]["reading"] for e in page["entities"]] == [None, None, -2.5]
