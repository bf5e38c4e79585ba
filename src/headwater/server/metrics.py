"""Prometheus metrics of one server (served by the HTTP listener at ``/metrics``).

Each :class:`Server` gets its own :class:`~prometheus_client.CollectorRegistry` (never the
process-wide default one), so several servers can run in one process (tests).

Most series are read from engine, subscription and SQL state at scrape time by a custom
collector, so the hot path does no per-event Python work. What the engine does not keep
is counted by the front ends once per batch through :class:`Metrics`:

* ``record_append(protocol, tenant, stream, events, value_bytes, seconds)``
* ``record_read(protocol, tenant, stream, events, value_bytes)``
* ``record_error(protocol, exc)``
* ``record_limit(limit, listener)``: a client refused or closed by a ``[limits]`` key
* ``record_ws_lag(protocol, events)``: events a WebSocket subscriber lost to lag
* ``add_connections_source(protocol, fn)`` / ``add_subscriptions_source(protocol, fn)``:
  a zero-argument callable returning the current count, read at scrape time.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from headwater.errors import HeadwaterError, StreamQuotaExceeded
from headwater.server.memory import process_memory

if TYPE_CHECKING:
    from headwater.api import EngineAPI
    from headwater.cluster.replication import ReplicaStats
    from headwater.server.app import Server

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

APPEND_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

_BY_SERVER: weakref.WeakKeyDictionary[Server, Metrics] = weakref.WeakKeyDictionary()


def metrics_for(server: Server) -> Metrics:
    """The :class:`Metrics` of ``server`` (created on first use)."""
    metrics = _BY_SERVER.get(server)
    if metrics is None:
        metrics = _BY_SERVER[server] = Metrics(server)
    return metrics


class Metrics:
    """The metrics registry of one server and the per-batch counting API."""

    def __init__(self, server: Server | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.connection_sources: dict[str, list[Callable[[], int]]] = {}
        self.subscription_sources: dict[str, list[Callable[[], int]]] = {}

        def counter(name: str, documentation: str, labels: list[str]) -> Counter:
            return Counter(name, documentation, labels, registry=self.registry)

        self.bytes_appended = counter(
            "headwater_bytes_appended",
            "Bytes of event values appended, per stream (counted by the front ends)",
            ["tenant", "stream"],
        )
        self.appends = counter(
            "headwater_appends", "Append requests acknowledged, per protocol", ["protocol"]
        )
        self.events_read = counter(
            "headwater_events_read", "Events read by clients, per stream", ["tenant", "stream"]
        )
        self.bytes_read = counter(
            "headwater_bytes_read",
            "Bytes of event values read by clients, per stream",
            ["tenant", "stream"],
        )
        self.append_seconds = Histogram(
            "headwater_append_seconds",
            "Latency of an append until acknowledged (durable under the sync policy)",
            ["protocol"],
            buckets=APPEND_BUCKETS,
            registry=self.registry,
        )
        self.errors = counter(
            "headwater_errors",
            "Error replies sent, by protocol and error code (spec/PROTOCOLS.md §1)",
            ["protocol", "code", "name"],
        )
        self.limit_refusals = counter(
            "headwater_limit_refusals",
            "Requests, connections and queries refused or closed by a [limits] setting",
            ["limit", "listener"],
        )
        self.ws_lag_events = counter(
            "headwater_ws_lag_events",
            "Events WebSocket subscribers lost to lag: push events dropped at a full send"
            " queue and pull events overwritten in a full ring buffer",
            ["protocol"],
        )
        # Each append's three series, looked up once per (protocol, tenant, stream):
        # three labels() calls cost about 5% of a single-event append's loop time.
        self._append_series: dict[tuple[str, int, str], tuple[Counter, Counter, Histogram]] = {}
        self.server = server
        if server is not None:
            self.registry.register(_ServerCollector(self, server))

    # ---- front-end API (one call per batch / request) -------------------------------

    def record_append(
        self,
        protocol: str,
        tenant: int,
        stream: str,
        events: int,
        value_bytes: int,
        seconds: float,
    ) -> None:
        """An acknowledged append of ``events`` events (``events`` is counted by the
        engine-state collector; it is part of the call for front ends' convenience)."""
        del events
        key = (protocol, tenant, stream)
        series = self._append_series.get(key)
        if series is None:
            series = self._append_series[key] = (
                self.bytes_appended.labels(str(tenant), stream),
                self.appends.labels(protocol),
                self.append_seconds.labels(protocol),
            )
        stream_bytes, appends, append_seconds = series
        stream_bytes.inc(value_bytes)
        appends.inc()
        append_seconds.observe(seconds)

    def forget_stream(self, tenant: int, stream: str) -> None:
        """The stream was deleted: its series go (they grew with every stream ever made,
        and a stream made again under the name went on from the old one's bytes while
        its event count, the engine's, started again from 0)."""
        labels = (str(tenant), stream)
        for family in (self.bytes_appended, self.events_read, self.bytes_read):
            with contextlib.suppress(KeyError):  # never appended to, or never read
                family.remove(*labels)
        for key in [k for k in self._append_series if k[1:] == (tenant, stream)]:
            del self._append_series[key]

    def record_read(
        self, protocol: str, tenant: int, stream: str, events: int, value_bytes: int
    ) -> None:
        del protocol
        if events:
            self.events_read.labels(str(tenant), stream).inc(events)
            self.bytes_read.labels(str(tenant), stream).inc(value_bytes)

    def read_counter(self, tenant: int, stream: str) -> Callable[[int, int], None]:
        """:meth:`record_read` for one stream, its series looked up once: for a
        subscription's pushes, counted on every delivery."""
        events_read = self.events_read.labels(str(tenant), stream)
        bytes_read = self.bytes_read.labels(str(tenant), stream)

        def count(events: int, value_bytes: int) -> None:
            events_read.inc(events)
            bytes_read.inc(value_bytes)

        return count

    def record_error(self, protocol: str, exc: HeadwaterError) -> None:
        self.errors.labels(protocol, str(exc.code), exc.name).inc()
        if isinstance(exc, StreamQuotaExceeded):  # the engine's refusal of a [limits] key
            self.record_limit(exc.limit, protocol)

    def record_limit(self, limit: str, listener: str) -> None:
        """A client refused or closed by ``[limits] <limit>`` on ``listener``."""
        self.limit_refusals.labels(limit, listener).inc()

    def record_ws_lag(self, protocol: str, events: int) -> None:
        if events:
            self.ws_lag_events.labels(protocol).inc(events)

    def add_connections_source(self, protocol: str, source: Callable[[], int]) -> None:
        self.connection_sources.setdefault(protocol, []).append(source)

    def add_subscriptions_source(self, protocol: str, source: Callable[[], int]) -> None:
        self.subscription_sources.setdefault(protocol, []).append(source)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Open connections and subscriptions per protocol, as the scrape reports them."""
        return {
            "connections": {
                protocol: _sum_sources(sources)
                for protocol, sources in sorted(self.connection_sources.items())
            },
            "subscriptions": {
                protocol: _sum_sources(sources)
                for protocol, sources in sorted(self.subscription_sources.items())
            },
        }

    def render(self, tenants: frozenset[int] | None = None) -> bytes:
        """The Prometheus text exposition of every series, or, given ``tenants`` (a
        scrape with a non-admin token), of those tenants' series and the server-wide
        ones: a series labelled by another tenant is left out."""
        if tenants is None:
            return generate_latest(self.registry)
        return generate_latest(_TenantScope(self.registry, tenants))


# Labels that name something of one tenant: a series carrying one of them is shown only
# with its ``tenant`` label, and only to that tenant's scrapes.
TENANT_LABELS = frozenset({"tenant", "stream", "kind", "group"})


class _TenantScope(Collector):
    """A registry seen by one scrape: the samples of ``tenants`` and the server-wide
    ones (no tenant label). A sample naming a stream, kind or group without a tenant
    label is left out too: it cannot be shown to be the scraper's."""

    def __init__(self, registry: CollectorRegistry, tenants: frozenset[int]) -> None:
        self._registry = registry
        self._tenants = frozenset(str(tenant) for tenant in tenants)

    def _visible(self, labels: dict[str, str]) -> bool:
        tenant = labels.get("tenant")
        if tenant is None:
            return TENANT_LABELS.isdisjoint(labels)
        return tenant in self._tenants

    def collect(self) -> Iterator[Metric]:
        # Every collect() builds its families afresh, so they are filtered in place.
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if self._visible(s.labels)]
            yield family


def _replica_metrics(replicas: list[ReplicaStats]) -> Iterator[Metric]:
    """With [cluster]: each partition replica on this node (docs/cluster.md, Metrics)."""
    labels = ["tenant", "stream", "partition"]

    def gauge(name: str, documentation: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, documentation, labels=[*labels, *extra])

    leader = gauge("headwater_replica_leader", "1 where this node leads the partition, else 0")
    isr = gauge("headwater_replica_isr_size", "In-sync replicas of the partition (etcd's ISR)")
    replica_count = gauge("headwater_replica_replicas", "Replicas of the partition")
    hw = gauge("headwater_replica_high_watermark", "Offsets below it are on every ISR member")
    end = gauge("headwater_replica_log_end_offset", "This replica's end offset")
    lag_records = gauge(
        "headwater_replica_follower_lag_records",
        "On the leader: records a follower is behind the leader's end (as of its last fetch)",
        ("follower",),
    )
    lag_seconds = gauge(
        "headwater_replica_follower_lag_seconds",
        "On the leader: seconds since a follower last had everything the leader had (0: now)",
        ("follower",),
    )
    for replica in replicas:
        key = replica.key
        values = [str(key.tenant_id), key.stream, str(key.partition)]
        leader.add_metric(values, 1 if replica.leader else 0)
        isr.add_metric(values, replica.isr)
        replica_count.add_metric(values, replica.replicas)
        hw.add_metric(values, replica.high_watermark)
        end.add_metric(values, replica.log_end)
        for follower, records in sorted(replica.lag_records.items()):
            lag_records.add_metric([*values, str(follower)], records)
            lag_seconds.add_metric([*values, str(follower)], replica.lag_seconds[follower])
    yield from (leader, isr, replica_count, hw, end, lag_records, lag_seconds)
    yield GaugeMetricFamily(
        "headwater_under_replicated_partitions",
        "Partitions this node leads with fewer in-sync replicas than replicas (as Kafka's "
        "UnderReplicatedPartitions)",
        value=sum(1 for replica in replicas if replica.under_replicated),
    )


def _sum_sources(sources: list[Callable[[], int]]) -> int:
    total = 0
    for source in sources:
        try:
            total += int(source())
        except Exception:  # a broken source must not break the scrape
            continue
    return total


def _memory_metrics(budget_mib: int) -> Iterator[Metric]:
    """The process's resident memory against its budget ([limits] memory_mib)."""
    memory = process_memory()
    if memory is not None:
        yield GaugeMetricFamily(
            "headwater_process_rss_anon_bytes",
            "Anonymous resident memory (heap, Arrow buffers, DuckDB): what memory_mib bounds",
            value=memory.rss_anon,
        )
        yield GaugeMetricFamily(
            "headwater_process_rss_file_bytes",
            "File-backed resident memory (mapped segment and projection files; reclaimable)",
            value=memory.rss_file,
        )
    yield GaugeMetricFamily(
        "headwater_memory_budget_bytes",
        "The anonymous resident memory budget, [limits] memory_mib",
        value=budget_mib * 1024 * 1024,
    )


class _ServerCollector(Collector):
    """Series read from engine, subscription and SQL state at scrape time."""

    def __init__(self, metrics: Metrics, server: Server) -> None:
        self._metrics = metrics
        self._server = weakref.ref(server)

    def describe(self) -> list[Metric]:
        return []  # dynamic: the registry calls collect() for each scrape

    def collect(self) -> Iterator[Metric]:
        server = self._server()
        if server is None:
            return
        metrics = self._metrics

        connections = GaugeMetricFamily(
            "headwater_connections", "Open client connections per protocol", labels=["protocol"]
        )
        for protocol, sources in sorted(metrics.connection_sources.items()):
            connections.add_metric([protocol], _sum_sources(sources))
        yield connections

        per_protocol = GaugeMetricFamily(
            "headwater_subscriptions", "Open subscriptions per protocol", labels=["protocol"]
        )
        for protocol, sources in sorted(metrics.subscription_sources.items()):
            per_protocol.add_metric([protocol], _sum_sources(sources))
        yield per_protocol
        yield from _memory_metrics(server.config.limits.memory_mib)
        yield GaugeMetricFamily(
            "headwater_read_answers_held_bytes",
            "Bytes of read answers (Kafka Fetch, Kimberlite ReadEvents, Rivven Consume, HTTP"
            " pages, Arrow messages) held until their peers read them; at most [limits]"
            " read_answers_mib",
            value=server.limits.answers.held,
        )

        if not server.started:
            return
        api = server.api
        uptime = GaugeMetricFamily("headwater_uptime_seconds", "Seconds since the server started")
        uptime.add_metric([], time.time() - server.started_at)
        yield uptime

        yield CounterMetricFamily(
            "headwater_engine_events_appended",
            "Events appended since the process started (every protocol)",
            value=api.events_appended,
        )
        yield CounterMetricFamily(
            "headwater_engine_bytes_appended",
            "Bytes of event values appended since the process started (every protocol)",
            value=api.bytes_appended,
        )

        streams = GaugeMetricFamily("headwater_streams", "Streams per tenant", labels=["tenant"])
        position = GaugeMetricFamily(
            "headwater_tenant_log_position",
            "Committed head of the tenant log (every position below it is committed)",
            labels=["tenant"],
        )
        appended = CounterMetricFamily(
            "headwater_events_appended",
            "Events ever appended to the stream (its partitions' next offsets), every protocol",
            labels=["tenant", "stream"],
        )
        start = GaugeMetricFamily(
            "headwater_stream_start_offset",
            "First offset still stored (retention moves it)",
            labels=["tenant", "stream"],
        )
        size = GaugeMetricFamily(
            "headwater_stream_size_bytes", "Bytes on disk per stream", labels=["tenant", "stream"]
        )
        for tenant_id in api.tenant_ids():
            tenant_label = str(tenant_id)
            tenant = api.tenant_info(tenant_id)
            streams.add_metric([tenant_label], tenant.streams)
            position.add_metric([tenant_label], tenant.log_position)
            for stream in api.list_streams(tenant_id):
                labels = [tenant_label, stream.name]
                appended.add_metric(labels, stream.events_appended)
                start.add_metric(labels, stream.start_offset)
                size.add_metric(labels, stream.size_bytes)
        yield from (streams, position, appended, start, size)

        # The committers keep a count and a sum only, so the histogram has the +Inf
        # bucket alone (rate(sum)/rate(count) gives the mean fsync time).
        fsync = api.fsync_stats()
        yield HistogramMetricFamily(
            "headwater_fsync_seconds",
            "Time spent in fsync by the group committers (live streams)",
            buckets=[("+Inf", fsync.count)],
            sum_value=fsync.seconds_total,
        )
        yield GaugeMetricFamily(
            "headwater_fsync_last_seconds",
            "Longest of the streams' most recent fsync times",
            value=fsync.last_seconds,
        )

        yield from self._subscription_metrics(api)
        yield from self._kind_metrics(api)
        if server.cluster is not None:
            yield from _replica_metrics(server.cluster.replication.stats())

        queries, query_seconds = api.query_stats()
        yield CounterMetricFamily("headwater_sql_queries", "SQL statements run", value=queries)
        yield CounterMetricFamily(
            "headwater_sql_query_seconds",
            "Seconds spent running SQL statements",
            value=query_seconds,
        )
        running, queued = api.query_queue()
        yield GaugeMetricFamily(
            "headwater_sql_queries_running", "SQL statements running now", value=running
        )
        yield GaugeMetricFamily(
            "headwater_sql_queries_queued",
            "SQL statements waiting for one of [limits] sql_concurrency places",
            value=queued,
        )
        throttled = CounterMetricFamily(
            "headwater_throttle_seconds",
            "Seconds requests waited (or read answers were held back) because of a tenant's quota "
            "([[tenants]]), per quota, summed over requests",
            labels=["tenant", "quota"],
        )
        for (tenant_id, quota), seconds in api.throttle_seconds().items():
            throttled.add_metric([str(tenant_id), quota], seconds)
        yield throttled

    @staticmethod
    def _subscription_metrics(api: EngineAPI) -> Iterator[Metric]:
        open_subs = GaugeMetricFamily(
            "headwater_subscriptions_open",
            "Open subscriptions per stream (every protocol)",
            labels=["tenant", "stream"],
        )
        credits = GaugeMetricFamily(
            "headwater_credits_outstanding",
            "Unused delivery credits granted to subscriptions, per stream",
            labels=["tenant", "stream"],
        )
        for stats in api.subscription_stats():
            labels = [str(stats.tenant_id), stats.stream]
            open_subs.add_metric(labels, stats.open)
            credits.add_metric(labels, stats.credits)
        yield open_subs
        yield credits

        lag = GaugeMetricFamily(
            "headwater_consumer_group_lag",
            "Events between a consumer group's committed offset and its partition's end",
            labels=["tenant", "group", "stream", "partition"],
        )
        # Partitioned groups (Kafka, Rivven: engine/groups) per committed partition, then
        # the push subscriptions' resume groups as partition 0; a resume group sharing a
        # partitioned group's name and partition is left out (one sample per label set).
        seen: set[tuple[str, ...]] = set()
        for part in api.groups.partition_lags():
            labels = [str(part.tenant_id), part.group, part.stream, str(part.partition)]
            seen.add(tuple(labels))
            lag.add_metric(labels, part.lag)
        for group in api.group_lags():
            labels = [str(group.tenant_id), group.group, group.stream, "0"]
            if tuple(labels) not in seen:
                lag.add_metric(labels, group.lag)
        yield lag

    @staticmethod
    def _kind_metrics(api: EngineAPI) -> Iterator[Metric]:
        entities = GaugeMetricFamily(
            "headwater_kind_entities", "Live entities per kind", labels=["tenant", "kind"]
        )
        subscribers = GaugeMetricFamily(
            "headwater_kind_subscribers", "Live subscriptions per kind", labels=["tenant", "kind"]
        )
        windows = CounterMetricFamily(
            "headwater_kind_windows",
            "Coalescing windows made durable (one group commit each)",
            labels=["tenant"],
        )
        changes = CounterMetricFamily(
            "headwater_kind_changes",
            "Entity changes written to kind changelogs (net, after coalescing)",
            labels=["tenant"],
        )
        for tenant_id, (flushed, committed) in api.kind_totals().items():
            windows.add_metric([str(tenant_id)], flushed)
            changes.add_metric([str(tenant_id)], committed)
        for kind in api.kind_stats():
            labels = [str(kind.tenant_id), kind.info.name]
            entities.add_metric(labels, kind.entities)
            subscribers.add_metric(labels, kind.subscribers)
        yield from (entities, subscribers, windows, changes)
