"""headwater.server.metrics: per-server registries, per-batch API, scrape-time collector."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from headwater.errors import StreamNotFound
from headwater.server.app import Server
from headwater.server.config import ServerConfig
from headwater.server.metrics import Metrics, metrics_for
from waiting import wait_until_async

OFF = {"http": "", "kimberlite": "", "convergedb": "", "ripple": ""}


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(
    data: dict[tuple[str, tuple[tuple[str, str], ...]], float], metric: str, **labels: str
) -> float:
    return data[(metric, tuple(sorted(labels.items())))]


def names(data: Iterable[tuple[str, object]]) -> set[str]:
    return {name for name, _ in data}


def test_registries_are_per_instance() -> None:
    a, b = Metrics(), Metrics()
    a.record_append("http", 0, "s", 3, 30, 0.002)
    a.record_read("http", 0, "s", 2, 20)
    a.record_error("http", StreamNotFound("x"))
    b.record_append("http", 0, "s", 1, 5, 0.001)
    da, db = samples(a.render()), samples(b.render())
    assert value(da, "headwater_bytes_appended_total", tenant="0", stream="s") == 30
    assert value(db, "headwater_bytes_appended_total", tenant="0", stream="s") == 5
    assert value(da, "headwater_append_seconds_count", protocol="http") == 1
    assert value(da, "headwater_events_read_total", tenant="0", stream="s") == 2
    assert value(da, "headwater_bytes_read_total", tenant="0", stream="s") == 20
    assert (
        value(da, "headwater_errors_total", protocol="http", code="5", name="StreamNotFound") == 1
    )
    assert ("headwater_errors_total", ()) not in db


def test_sources_and_broken_source() -> None:
    m = Metrics(Server(Path("/nonexistent"), ServerConfig(listen=dict(OFF))))
    m.add_connections_source("kimberlite", lambda: 3)
    m.add_connections_source("kimberlite", lambda: 2)
    m.add_subscriptions_source("kimberlite", lambda: 1 // 0)  # must not break the scrape
    data = samples(m.render())
    assert value(data, "headwater_connections", protocol="kimberlite") == 5
    assert value(data, "headwater_subscriptions", protocol="kimberlite") == 0
    # Engine not open yet: no engine series, no error.
    assert "headwater_streams" not in names(data)


def test_metrics_for_is_cached_per_server() -> None:
    s1 = Server(Path("/a"), ServerConfig(listen=dict(OFF)))
    s2 = Server(Path("/b"), ServerConfig(listen=dict(OFF)))
    assert metrics_for(s1) is metrics_for(s1)
    assert metrics_for(s1) is not metrics_for(s2)


def test_engine_state_collector(tmp_path: Path) -> None:
    async def scenario() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        server = Server(tmp_path, ServerConfig(listen=dict(OFF)))
        await server.start()
        try:
            api = server.api
            info = await api.create_stream(0, "orders")
            await api.append(0, info.stream_id, [b"a", b"bb", b"ccc"])
            await api.append(0, info.stream_id, [b"d"])

            async def deliver(*_args: object) -> None:
                return None

            def on_close(*_args: object) -> None:
                return None

            sub = api.subscribe(0, info.stream_id, 0, 2, "g1", deliver, on_close)
            # The pump delivers its two credits' worth.
            await wait_until_async(lambda: sub.credits == 0, message="nothing delivered")
            api.grant(sub, 5)  # commits the group at offset 2
            # ... then the 2 remaining events: 3 credits left.
            await wait_until_async(lambda: sub.credits == 3, message="the rest not delivered")
            data = samples(metrics_for(server).render())
            return data
        finally:
            await server.stop()

    data = asyncio.run(scenario())
    assert value(data, "headwater_streams", tenant="0") == 1
    assert value(data, "headwater_tenant_log_position", tenant="0") == 4
    assert value(data, "headwater_events_appended_total", tenant="0", stream="orders") == 4
    assert value(data, "headwater_engine_events_appended_total") == 4
    assert value(data, "headwater_engine_bytes_appended_total") == 7
    assert value(data, "headwater_fsync_seconds_count") >= 1
    assert value(data, "headwater_fsync_seconds_sum") >= 0
    assert value(data, "headwater_subscriptions_open", tenant="0", stream="orders") == 1
    # 2 delivered, then 5 granted; the pump delivers the 2 remaining events (4 total).
    assert value(data, "headwater_credits_outstanding", tenant="0", stream="orders") == 3
    lag = value(
        data,
        "headwater_consumer_group_lag",
        tenant="0",
        stream="orders",
        group="g1",
        partition="0",
    )
    assert lag == 2
    assert value(data, "headwater_sql_queries_total") >= 0


def test_kind_metrics(tmp_path: Path) -> None:
    from headwater.engine.kinds import assert_op
    from headwater.protocols.convergedb.fields import FieldType

    async def scenario() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        server = Server(tmp_path, ServerConfig(listen=dict(OFF)))
        await server.start()
        try:
            tk = server.api.kinds(0)
            kind = await tk.create_kind("sensor", [("t", FieldType.F64)])
            src = tk.connect("w")
            tk.subscribe(kind.kind_id)
            src.apply([assert_op(kind, bytes([i]) * 32, [1.0]) for i in range(3)])
            await tk.barrier()
            return samples(metrics_for(server).render())
        finally:
            await server.stop()

    data = asyncio.run(scenario())
    assert value(data, "headwater_kind_entities", tenant="0", kind="sensor") == 3
    assert value(data, "headwater_kind_subscribers", tenant="0", kind="sensor") == 1
    # The presence entity of the source is a change too.
    assert value(data, "headwater_kind_changes_total", tenant="0") == 4
    assert value(data, "headwater_kind_windows_total", tenant="0") >= 1
    assert value(data, "headwater_kind_entities", tenant="0", kind="convergedb_connections") == 1
