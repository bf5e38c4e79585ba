"""Per-tenant quotas, throttled as Kafka does it: the request is served, then its answer
is held back for as long as the tenant needs to come back under its rate, and that time
is reported (HTTP: ``X-Headwater-Throttle-Ms``; /metrics:
``headwater_throttle_seconds_total{tenant,quota}``).

``[[tenants]]`` may set three rates (:class:`TenantQuota`): bytes produced per second
(the events of appends), bytes consumed per second (reads and subscription pushes) and
requests per second (every call through the engine API that a client's request makes).
Each rate of each tenant is a token bucket (:class:`TokenBucket`) that holds one second
of its rate, so a tenant under its rate is never delayed and a burst of up to a second's
worth passes at once; past it the bucket goes into debt, and the answer waits until the
debt is paid back. One answer waits at most :data:`MAX_THROTTLE_S` (a client's timeout
must not fire because of a throttle); the rest of the debt is paid by the next answers.

The wait is an ``await asyncio.sleep`` in the task serving the request: other requests,
other tenants and the event loop go on meanwhile. A tenant without a quota costs one
dict lookup, and a server without any quota does not wrap the engine's operations at all
(:meth:`Quotas.enabled`).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum

BURST_S = 1.0
"""A bucket holds this many seconds of its rate: the burst that passes undelayed."""
MAX_THROTTLE_S = 10.0
"""Longest one answer is held back (the debt beyond it is carried to the next ones)."""


@dataclass(frozen=True)
class TenantQuota:
    """Per-tenant rates of ``[[tenants]]`` (None: unlimited). Past a rate the server
    delays its answer and reports the throttle time, as Kafka's quotas do."""

    produce_bytes_per_s: int | None = None
    consume_bytes_per_s: int | None = None
    requests_per_s: int | None = None


class Quota(StrEnum):
    """What a rate counts (the ``quota`` label of ``headwater_throttle_seconds_total``)."""

    PRODUCE = "produce"  # bytes of appended events
    CONSUME = "consume"  # bytes of events read or pushed
    REQUESTS = "requests"


class TokenBucket:
    """``rate`` units per second, ``rate * burst_s`` of them at most in hand.

    :meth:`take` spends units (a served request spends them whatever the balance, so the
    balance can go negative: a debt) and answers how long the caller must wait until the
    balance is back at zero: debt / rate. The clock is passed in, so the arithmetic is
    testable without waiting.
    """

    __slots__ = ("capacity", "rate", "tokens", "updated")

    def __init__(self, rate: float, now: float, burst_s: float = BURST_S) -> None:
        if rate <= 0:
            raise ValueError(f"a rate must be positive, not {rate}")
        self.rate = float(rate)
        self.capacity = self.rate * burst_s
        self.tokens = self.capacity
        self.updated = now

    def take(self, amount: float, now: float) -> float:
        """Spend ``amount`` at ``now``; the seconds until the balance is back at zero."""
        elapsed = max(0.0, now - self.updated)  # a clock never runs backwards here
        self.tokens = min(self.capacity, self.tokens + elapsed * self.rate)
        self.updated = now
        self.tokens -= amount
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


@dataclass
class ThrottleReport:
    """The throttle time of the answers awaited inside :func:`report_throttle`."""

    seconds: float = 0.0

    @property
    def ms(self) -> int:
        return round(self.seconds * 1000)


_REPORT: contextvars.ContextVar[ThrottleReport | None] = contextvars.ContextVar(
    "headwater_throttle_report", default=None
)


@contextmanager
def report_throttle() -> Iterator[ThrottleReport]:
    """Collect the throttle time of the engine API calls this task makes inside the
    block (a front end whose answer has a field for it: HTTP's header)."""
    report = ThrottleReport()
    token = _REPORT.set(report)
    try:
        yield report
    finally:
        _REPORT.reset(token)


class Quotas:
    """The buckets of every tenant with a quota, and the throttle time each caused."""

    def __init__(
        self,
        quotas: Mapping[int, TenantQuota],
        *,
        clock: Callable[[], float] = time.monotonic,
        max_throttle_s: float = MAX_THROTTLE_S,
    ) -> None:
        self._clock = clock
        self._max_throttle_s = max_throttle_s
        now = clock()
        self._buckets: dict[int, dict[Quota, TokenBucket]] = {}
        for tenant_id, quota in quotas.items():
            rates = {
                Quota.PRODUCE: quota.produce_bytes_per_s,
                Quota.CONSUME: quota.consume_bytes_per_s,
                Quota.REQUESTS: quota.requests_per_s,
            }
            buckets = {kind: TokenBucket(rate, now) for kind, rate in rates.items() if rate}
            if buckets:
                self._buckets[tenant_id] = buckets
        self.throttle_seconds_total: dict[tuple[int, Quota], float] = {}

    @property
    def enabled(self) -> bool:
        """Whether any tenant has a quota (without one, nothing needs counting)."""
        return bool(self._buckets)

    def charge(
        self, tenant_id: int, *, produce: int = 0, consume: int = 0, requests: int = 0
    ) -> float:
        """Count what a served request spent; the seconds its answer must wait (the
        longest of its quotas' waits, at most ``max_throttle_s``). Each quota's own wait
        is added to ``throttle_seconds_total``."""
        buckets = self._buckets.get(tenant_id)
        if buckets is None:
            return 0.0
        now = self._clock()
        delay = 0.0
        for kind, amount in (
            (Quota.PRODUCE, produce),
            (Quota.CONSUME, consume),
            (Quota.REQUESTS, requests),
        ):
            bucket = buckets.get(kind)
            if bucket is None or not amount:
                continue
            wait = min(bucket.take(amount, now), self._max_throttle_s)
            if wait > 0:
                key = (tenant_id, kind)
                self.throttle_seconds_total[key] = self.throttle_seconds_total.get(key, 0.0) + wait
                delay = max(delay, wait)
        return delay

    async def throttle(
        self, tenant_id: int, *, produce: int = 0, consume: int = 0, requests: int = 0
    ) -> float:
        """:meth:`charge`, then wait that long (this task only), reported to the
        enclosing :func:`report_throttle`; the seconds waited."""
        delay = self.charge(tenant_id, produce=produce, consume=consume, requests=requests)
        report = _REPORT.get()
        if report is not None:
            report.seconds += delay
        if delay > 0:
            await asyncio.sleep(delay)
        return delay
