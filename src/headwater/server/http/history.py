"""The dashboard's chart history: the last hour of per-minute rates, kept by the server
so a page opened (or reloaded) shows the hour at once instead of starting empty.

A sampler reads the server's cumulative counters every :data:`SAMPLE_SECONDS` (and once
more on each ``GET /api/history``, so the current minute is up to date) and adds what
changed to the current minute: per tenant, events and bytes appended (from each stream's
end offset and size on disk, as the dashboard's own 2 s rates are) and events read (from
/metrics' ``headwater_events_read``); server-wide, errors answered and open connections.

Bounded: :data:`MINUTES` minutes in a ring (the oldest falls off), and each finished
minute keeps the events of only its :data:`TOP_STREAMS` busiest streams per tenant (the
tenant's totals count every stream).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import Counter

from headwater.server.http.app import (
    METRICS_KEY,
    SERVER_KEY,
    api_of,
    json_response,
    tenant_of,
)

if TYPE_CHECKING:
    from headwater.api import EngineAPI
    from headwater.server.metrics import Metrics

log = logging.getLogger("headwater.http")

MINUTES = 60  # the last hour, one point a minute
# Each sample reads every stream's end offset and size (about 5 us a stream: 10 ms of the
# event loop for 2,000 streams), as a /metrics scrape does; every 15 s keeps that small.
SAMPLE_SECONDS = 15.0
# Per tenant and finished minute: the busiest streams keep their own series.
TOP_STREAMS = 10


@dataclass
class TenantMinute:
    events: int = 0
    bytes: int = 0
    reads: int = 0
    streams: dict[str, int] = field(default_factory=dict)  # events appended per stream


@dataclass
class Minute:
    start_s: int  # unix seconds, a multiple of 60
    seconds: float = 0.0  # how much of the minute was sampled (less in the server's first)
    errors: int = 0
    connections: int = 0  # the most open at one sample
    tenants: dict[int, TenantMinute] = field(default_factory=dict)

    def tenant(self, tenant_id: int) -> TenantMinute:
        found = self.tenants.get(tenant_id)
        if found is None:
            found = self.tenants[tenant_id] = TenantMinute()
        return found

    def trim(self) -> None:
        """A finished minute keeps only its busiest streams' own counts."""
        for counts in self.tenants.values():
            if len(counts.streams) > TOP_STREAMS:
                busiest = sorted(counts.streams.items(), key=lambda item: -item[1])
                counts.streams = dict(busiest[:TOP_STREAMS])


def _counter_by_tenant(counter: Counter) -> dict[int, int]:
    """A counter labelled by tenant (and more), summed per tenant."""
    out: dict[int, int] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                tenant_id = int(sample.labels["tenant"])
                out[tenant_id] = out.get(tenant_id, 0) + int(sample.value)
    return out


def _counter_total(counter: Counter) -> int:
    return sum(
        int(sample.value)
        for metric in counter.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


class History:
    """Per-minute counts of the last :data:`MINUTES` minutes, fed by :meth:`sample`."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.minutes: deque[Minute] = deque(maxlen=MINUTES)
        # The counters at the last sample: (tenant, stream id) -> (end offset, bytes),
        # events read per tenant, errors.
        self._streams: dict[tuple[int, int], tuple[int, int]] = {}
        self._reads: dict[int, int] = {}
        self._errors = 0
        self._last: float | None = None

    def sample(self, api: EngineAPI, metrics: Metrics) -> None:
        now = self.clock()
        streams = {(s.tenant_id, s.stream_id): s for s in api.all_streams()}
        reads = _counter_by_tenant(metrics.events_read)
        errors = _counter_total(metrics.errors)
        connections = sum(metrics.snapshot()["connections"].values())
        last = self._last
        if last is not None:
            minute = self._minute(now)
            minute.seconds += max(0.0, now - last)
            minute.errors += max(0, errors - self._errors)
            minute.connections = max(minute.connections, connections)
            for key, info in streams.items():
                # A stream first seen was created since the last sample: all of it is new.
                before_events, before_bytes = self._streams.get(key, (0, 0))
                events = max(0, info.next_offset - before_events)
                # Retention and compaction shrink a stream: not negative writes.
                written = max(0, info.size_bytes - before_bytes)
                if events or written:
                    counts = minute.tenant(info.tenant_id)
                    counts.events += events
                    counts.bytes += written
                    if events:
                        counts.streams[info.name] = counts.streams.get(info.name, 0) + events
            for tenant_id, total in reads.items():
                read = max(0, total - self._reads.get(tenant_id, 0))
                if read:
                    minute.tenant(tenant_id).reads += read
        self._streams = {key: (s.next_offset, s.size_bytes) for key, s in streams.items()}
        self._reads = reads
        self._errors = errors
        self._last = now

    def _minute(self, now: float) -> Minute:
        start = int(now // 60) * 60
        if self.minutes and self.minutes[-1].start_s == start:
            return self.minutes[-1]
        if self.minutes:
            self.minutes[-1].trim()
        minute = Minute(start)
        self.minutes.append(minute)
        return minute

    def for_tenant(self, tenant_id: int) -> dict[str, Any]:
        """The hour as one tenant sees it: its own rates, the server's errors and
        connections, and its busiest streams' event rates (one value per point)."""
        cutoff = int(self.clock() // 60) * 60 - (MINUTES - 1) * 60
        minutes = [m for m in self.minutes if m.start_s >= cutoff and m.seconds > 0]
        points = []
        totals: dict[str, int] = {}
        for minute in minutes:
            counts = minute.tenants.get(tenant_id, TenantMinute())
            points.append(
                {
                    "t_ms": minute.start_s * 1000,
                    "seconds": minute.seconds,
                    "events_per_s": counts.events / minute.seconds,
                    "bytes_per_s": counts.bytes / minute.seconds,
                    "reads_per_s": counts.reads / minute.seconds,
                    "errors_per_s": minute.errors / minute.seconds,
                    "connections": minute.connections,
                }
            )
            for name, events in counts.streams.items():
                totals[name] = totals.get(name, 0) + events
        busiest = sorted(totals, key=lambda name: (-totals[name], name))[:TOP_STREAMS]
        streams = [
            {
                "name": name,
                "events_per_s": [
                    m.tenants.get(tenant_id, TenantMinute()).streams.get(name, 0) / m.seconds
                    for m in minutes
                ],
            }
            for name in busiest
        ]
        return {
            "interval_s": 60,
            "minutes": MINUTES,
            "sample_s": SAMPLE_SECONDS,
            "points": points,
            "streams": streams,
        }


HISTORY_KEY: web.AppKey[History] = web.AppKey("headwater_history", History)


async def sampling(app: web.Application) -> AsyncIterator[None]:
    """The HTTP app's life (``cleanup_ctx``): sample every SAMPLE_SECONDS while the
    engine is open."""
    server = app[SERVER_KEY]
    history = app[HISTORY_KEY] = History()

    async def sample_forever() -> None:
        while True:
            if server.started and not server.api.closing:
                try:
                    history.sample(server.api, app[METRICS_KEY])
                except Exception:  # a bug of ours: the charts lose a sample, not the server
                    log.exception("sampling the dashboard history failed")
            await asyncio.sleep(SAMPLE_SECONDS)

    task = asyncio.create_task(sample_forever(), name="dashboard-history")
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def get_history(request: web.Request) -> web.Response:
    tenant_id = tenant_of(request)
    history = request.app[HISTORY_KEY]
    history.sample(api_of(request), request.app[METRICS_KEY])
    return json_response(history.for_tenant(tenant_id))


ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/api/history", get_history),
]
