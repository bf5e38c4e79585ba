"""The REST routes the dashboard's actions added, against a real ``headwater serve``
(docs/http-api.md): ``GET /api/history`` (the server's last hour of per-minute rates,
per tenant) and ``POST /api/consumer-groups/{stream}/{group}/reset``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from servers import AUTH_CONFIG, LOCAL, serving
from test_http_api import OPENAPI, TENANTS_CONFIG, HttpApi, check_schema

import headwater
from waiting import wait_until

LISTEN = {"http": LOCAL}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpApi]:
    root = tmp_path_factory.mktemp("dashboard_actions")
    for server in serving(root, config=TENANTS_CONFIG, listen=LISTEN):
        yield HttpApi(server)


@pytest.fixture(scope="module")
def auth_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpApi]:
    root = tmp_path_factory.mktemp("dashboard_actions_auth")
    for server in serving(root, config=AUTH_CONFIG + TENANTS_CONFIG, listen=LISTEN):
        yield HttpApi(server)


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(OPENAPI.read_text())
    return data


def ok(srv: HttpApi, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
    status, answer, _ = srv.request(method, path, body, **kwargs)
    assert 200 <= status < 300, answer
    return answer


def counted(history: dict[str, Any], rate: str) -> float:
    """What a history's per-minute rates add up to: the count over its points."""
    return sum(point[rate] * point["seconds"] for point in history["points"])


# ---- history ----------------------------------------------------------------------------


def test_history_counts_the_tenants_own_appends_and_reads(
    srv: HttpApi, spec: dict[str, Any]
) -> None:
    # The server samples on each request too: what follows counts from here.
    before = ok(srv, "GET", "/api/history")
    check_schema(spec, "History", before)
    appended_before = counted(before, "events_per_s")
    read_before = counted(before, "reads_per_s")
    ok(srv, "POST", "/api/streams", {"name": "clicks"})
    ok(srv, "POST", "/api/streams", {"name": "views"})
    ok(srv, "POST", "/api/streams/clicks/events", [{"n": i} for i in range(120)])
    ok(srv, "POST", "/api/streams/views/events", ["a", "b", "c"])
    ok(srv, "GET", "/api/streams/clicks/events?from=0&limit=7")
    # Tenant 42's events are its own: tenant 0's history does not count them.
    ok(srv, "POST", "/api/streams", {"name": "clicks"}, tenant=42)
    ok(srv, "POST", "/api/streams/clicks/events", list(range(500)), tenant=42)
    status, _, _ = srv.request("GET", "/api/streams/nope")
    assert status == 404  # an error answered: counted server-wide

    history = ok(srv, "GET", "/api/history")
    check_schema(spec, "History", history)
    assert history["interval_s"] == 60 and history["minutes"] == 60
    assert 1 <= len(history["points"]) <= 60
    assert round(counted(history, "events_per_s") - appended_before) == 123
    assert round(counted(history, "reads_per_s") - read_before) == 7
    assert round(counted(history, "errors_per_s")) >= 1  # rate * seconds: float sums
    current = history["points"][-1]
    assert current["connections"] >= 1 and current["bytes_per_s"] > 0
    assert [p["t_ms"] % 60_000 for p in history["points"]] == [0] * len(history["points"])
    by_name = {s["name"]: s["events_per_s"] for s in history["streams"]}
    assert all(len(series) == len(history["points"]) for series in by_name.values())
    seconds = [p["seconds"] for p in history["points"]]
    assert round(sum(r * s for r, s in zip(by_name["clicks"], seconds, strict=True))) == 120
    assert round(sum(r * s for r, s in zip(by_name["views"], seconds, strict=True))) == 3

    other = ok(srv, "GET", "/api/history", tenant=42)
    assert round(counted(other, "events_per_s")) == 500
    assert [s["name"] for s in other["streams"]] == ["clicks"]


def test_history_needs_the_tenants_token(auth_srv: HttpApi) -> None:
    status, answer, headers = auth_srv.request("GET", "/api/history")
    assert status == 401 and answer["error"]["name"] == "AuthenticationFailed"
    assert headers["WWW-Authenticate"].startswith("Bearer")
    status, answer, _ = auth_srv.request("GET", "/api/history", token="s3cret", tenant=42)
    assert status == 403, answer
    status, answer, _ = auth_srv.request("GET", "/api/history?tenant=x", token="s3cret")
    assert status == 400 and answer["error"]["name"] == "InvalidRequest"
    # Still serving, and serving the token's own tenant.
    assert ok(auth_srv, "GET", "/api/history", token="s3cret")["points"] is not None


# ---- consumer group offset reset -----------------------------------------------------------


def group_of(srv: HttpApi, stream: str, group: str) -> dict[str, Any]:
    groups = ok(srv, "GET", "/api/consumer-groups")["groups"]
    (found,) = [g for g in groups if (g["stream"], g["group"]) == (stream, group)]
    return found


def test_reset_moves_an_idle_group_and_consumers_resume_there(
    srv: HttpApi, spec: dict[str, Any]
) -> None:
    with headwater.connect(f"127.0.0.1:{srv.ports['kimberlite']}") as client:
        client.create_stream("payments")
        client.append("payments", [f"{i}".encode() for i in range(30)])
        with client.subscribe("payments", 0, credits=4, group="ledger") as sub:
            events = iter(sub)
            assert [next(events).offset for _ in range(20)] == list(range(20))
            wait_until(
                lambda: any(
                    g["group"] == "ledger" for g in ok(srv, "GET", "/api/consumer-groups")["groups"]
                ),
                message="the group never committed",
            )
            committed = group_of(srv, "payments", "ledger")["committed_offset"]
            # A member is consuming: refused, nothing changed.
            status, answer, _ = srv.request(
                "POST", "/api/consumer-groups/payments/ledger/reset", {"to": "earliest"}
            )
            assert status == 400 and "consuming" in answer["error"]["message"], answer
            assert group_of(srv, "payments", "ledger")["committed_offset"] >= committed
        wait_until(
            lambda: not group_of(srv, "payments", "ledger")["active"],
            message="the group never went idle",
        )

        path = "/api/consumer-groups/payments/ledger/reset"
        reset = ok(srv, "POST", path, {"to": "earliest"})
        check_schema(spec, "ConsumerGroup", reset)
        assert reset == {
            "stream": "payments",
            "group": "ledger",
            "committed_offset": 0,
            "end_offset": 30,
            "lag": 30,
            "active": False,
            "waiting": 0,
        }
        assert group_of(srv, "payments", "ledger") == reset
        assert ok(srv, "POST", path, {"to": "latest"})["committed_offset"] == 30
        assert ok(srv, "POST", path, {"timestamp_ms": 0})["committed_offset"] == 0
        assert ok(srv, "POST", path, {"offset": 25})["lag"] == 5

        # The group's next member starts where the reset put it.
        with client.subscribe("payments", "resume", credits=4, group="ledger") as sub:
            assert next(iter(sub)).offset == 25
    wait_until(
        lambda: not group_of(srv, "payments", "ledger")["active"],
        message="the group never went idle",
    )
    # On disk before the answer: a crash right after it keeps the reset.
    assert ok(srv, "POST", path, {"offset": 12})["committed_offset"] == 12
    srv.server.kill()
    srv.server.start()
    assert group_of(srv, "payments", "ledger")["committed_offset"] == 12


@pytest.mark.parametrize(
    ("path", "body", "status", "name", "says"),
    [
        ("/api/consumer-groups/refunds/ledger/reset", {}, 400, "InvalidRequest", "one of"),
        ("/api/consumer-groups/refunds/ledger/reset", [1], 400, "InvalidRequest", "one of"),
        (
            "/api/consumer-groups/refunds/ledger/reset",
            {"offset": 1, "to": "latest"},
            400,
            "InvalidRequest",
            "one of",
        ),
        (
            "/api/consumer-groups/refunds/ledger/reset",
            {"to": "first"},
            400,
            "InvalidRequest",
            "earliest",
        ),
        (
            "/api/consumer-groups/refunds/ledger/reset",
            {"offset": -1},
            400,
            "InvalidRequest",
            "non-negative",
        ),
        (
            "/api/consumer-groups/refunds/ledger/reset",
            {"offset": True},
            400,
            "InvalidRequest",
            "integer",
        ),
        (
            "/api/consumer-groups/refunds/ledger/reset",
            {"offset": 11},
            400,
            "InvalidOffset",
            "0..10",
        ),
        (
            "/api/consumer-groups/refunds/nobody/reset",
            {"offset": 0},
            400,
            "InvalidRequest",
            "nobody",
        ),
        (
            "/api/consumer-groups/nostream/ledger/reset",
            {"offset": 0},
            404,
            "StreamNotFound",
            "nostream",
        ),
    ],
)
def test_reset_refuses_bad_input_and_changes_nothing(
    srv: HttpApi, path: str, body: Any, status: int, name: str, says: str
) -> None:
    streams = {s["name"] for s in ok(srv, "GET", "/api/streams")["streams"]}
    if "refunds" not in streams:
        with headwater.connect(f"127.0.0.1:{srv.ports['kimberlite']}") as client:
            client.create_stream("refunds")
            client.append("refunds", [f"{i}".encode() for i in range(10)])
            with client.subscribe("refunds", 0, credits=2, group="ledger") as sub:
                events = iter(sub)
                for _ in range(6):
                    next(events)
        wait_until(
            lambda: not group_of(srv, "refunds", "ledger")["active"],
            message="the group never went idle",
        )
    before = group_of(srv, "refunds", "ledger")
    got, answer, _ = srv.request("POST", path, body)
    assert got == status, answer
    assert answer["error"]["name"] == name and says in answer["error"]["message"], answer
    assert group_of(srv, "refunds", "ledger") == before
    if status == 400:  # the stream exists: the body is read, and refused
        got, answer, _ = srv.request("POST", path, raw=b"not json")
        assert got == 400 and "not valid JSON" in answer["error"]["message"]
    assert group_of(srv, "refunds", "ledger") == before
