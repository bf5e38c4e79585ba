"""Per-tenant quotas, throttled as Kafka does it: a request past its tenant's rate waits
its turn before it is served, and that time is reported (HTTP: ``X-Headwater-Throttle-Ms``;
/metrics: ``headwater_throttle_seconds_total{tenant,quota}``).

``[[tenants]]`` may set three rates (:class:`TenantQuota`): bytes produced per second
(the events of appends), bytes consumed per second (reads and subscription pushes) and
requests per second (every call through the engine API that a client's request makes).
Each rate of each tenant is a token bucket (:class:`TokenBucket`) that holds one second
of its rate, so a tenant under its rate is never delayed and a burst of up to a second's
worth passes at once; past it the bucket goes into debt.

What a request is known to spend before it is served (one request; an append's bytes) is
reserved by :meth:`Quotas.admit` at once, atomically on the event loop, and the request
then waits the debt its tenant had *before* it: its turn. Requests pipelined on one
connection (Kimberlite allows 1,024 in flight) are so spaced at the rate instead of all
being served at once, and a request too large for one second of the rate puts its debt
on the next request, which waits it in full (Kafka mutes the connection instead, to the
same effect). The bytes of a read are known only once it is served: they are counted
then by :meth:`Quotas.throttle`, which holds the answer back for the consume debt but at
most :data:`MAX_THROTTLE_S` (a client's timeout must not fire because of a throttle);
the rest of that debt is waited by the tenant's next read, in its admission.

Waits are an ``await asyncio.sleep`` in the task serving the request: other requests,
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
from typing import TypedDict, Unpack

BURST_S = 1.0
"""A bucket holds this many seconds of its rate: the burst that passes undelayed."""
MAX_THROTTLE_S = 10.0
"""Longest one answer is held back after its read (the consume debt beyond it is waited
by the tenant's next read before it is served)."""


@dataclass(frozen=True)
class TenantQuota:
    """Per-tenant rates of ``[[tenants]]`` (None: unlimited). Past a rate the server
    delays the tenant's requests and reports the throttle time, as Kafka's quotas do."""

    produce_bytes_per_s: int | None = None
    consume_bytes_per_s: int | None = None
    requests_per_s: int | None = None


class Quota(StrEnum):
    """What a rate counts (the ``quota`` label of ``headwater_throttle_seconds_total``)."""

    PRODUCE = "produce"  # bytes of appended events
    CONSUME = "consume"  # bytes of events read or pushed
    REQUESTS = "requests"


class Spent(TypedDict, total=False):
    """What a served request spent, as :meth:`Quotas.charge` takes it (each 0
    unless given), and the longest its answer may wait (``max_wait_s``)."""

    produce: int
    consume: int
    requests: int
    max_wait_s: float | None


class TokenBucket:
    """``rate`` units per second, ``rate * burst_s`` of them at most in hand.

    Spending is never refused, so the balance can go negative: a debt, paid back at the
    rate. :meth:`take` spends and answers the debt after (a served request's wait),
    :meth:`reserve` spends and answers the debt before (an admitted request's turn),
    :meth:`owed` only answers the debt. The clock is passed in, so the arithmetic is
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

    def owed(self, now: float) -> float:
        """The seconds until the balance is back at zero, spending nothing."""
        elapsed = max(0.0, now - self.updated)  # a clock never runs backwards here
        self.tokens = min(self.capacity, self.tokens + elapsed * self.rate)
        self.updated = now
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    def take(self, amount: float, now: float) -> float:
        """Spend ``amount`` at ``now``; the seconds until the balance is back at zero."""
        self.owed(now)
        self.tokens -= amount
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    def reserve(self, amount: float, now: float) -> float:
        """Spend ``amount`` at ``now``; the seconds the balance owed before it (the
        spender's turn: the requests reserved before it are paid for by then)."""
        turn = self.owed(now)
        self.tokens -= amount
        return turn

    def refund(self, amount: float) -> None:
        """Give back what a request reserved but never spent (it was cancelled)."""
        self.tokens = min(self.capacity, self.tokens + amount)


@dataclass
class ThrottleReport:
    """The throttle time of the engine API calls awaited inside :func:`report_throttle`.
    ``deferred``: the calls do not wait; the front end answers at once and holds the
    client back itself (Kafka since KIP-219: throttle_time_ms and a muted connection)."""

    seconds: float = 0.0
    deferred: bool = False

    @property
    def ms(self) -> int:
        return round(self.seconds * 1000)


_REPORT: contextvars.ContextVar[ThrottleReport | None] = contextvars.ContextVar(
    "headwater_throttle_report", default=None
)


@contextmanager
def report_throttle(*, deferred: bool = False) -> Iterator[ThrottleReport]:
    """Collect the throttle time of the engine API calls this task makes inside the
    block (a front end whose answer has a field for it: HTTP's header). ``deferred``:
    they spend their quotas without waiting (:attr:`ThrottleReport.deferred`)."""
    report = ThrottleReport(deferred=deferred)
    token = _REPORT.set(report)
    try:
        yield report
    finally:
        _REPORT.reset(token)


class InOrder:
    """Requests that each wait some time before they are served, served in the order
    they came all the same: each waits its own time, then for the one before it. Two
    waits a fraction of a millisecond apart may otherwise end the other way round (the
    loop's timers are in whole milliseconds), and a request whose wait is over already
    would be served before the ones still waiting ahead of it: a pipelined append stored
    before the one sent ahead of it."""

    def __init__(self) -> None:
        self._last: asyncio.Future[None] | None = None  # the last request still waiting

    def waiting(self) -> bool:
        return self._last is not None

    async def wait(self, seconds: float) -> None:
        """Wait ``seconds`` (if above 0), then until the request before is served; at
        once when neither holds it. Cancelled, this request's place passes to the next
        one, which is then served once the one before is."""
        before = self._last
        if seconds <= 0 and before is None:
            return
        mine = asyncio.get_running_loop().create_future()
        self._last = mine
        try:
            if seconds > 0:
                await asyncio.sleep(seconds)
            if before is not None and not before.done():
                await asyncio.wait((before,))  # not cancelling it when this one is
        finally:
            if before is not None and not before.done():  # cancelled: the next one waits
                before.add_done_callback(lambda _: self._served(mine))  # for the one before
            else:
                self._served(mine)

    def _served(self, request: asyncio.Future[None]) -> None:
        request.set_result(None)
        if self._last is request:
            self._last = None


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
        # Each tenant's requests waiting their turns, reads apart from the rest.
        self._lines: dict[tuple[int, bool], InOrder] = {}

    @property
    def enabled(self) -> bool:
        """Whether any tenant has a quota (without one, nothing needs counting)."""
        return bool(self._buckets)

    def owed(self, tenant_id: int) -> float:
        """The seconds until every quota of the tenant is out of debt: how long its
        next request would wait (Kafka's throttle_time_ms after a deferred request)."""
        buckets = self._buckets.get(tenant_id)
        if buckets is None:
            return 0.0
        now = self._clock()
        return max(bucket.owed(now) for bucket in buckets.values())

    def debt(self, tenant_id: int, kinds: tuple[Quota, ...]) -> tuple[float, Quota | None]:
        """The seconds until the tenant's ``kinds`` quotas are out of debt, and the one
        owing longest (None: none owes): what a front end that refuses a request past
        a rate tells its client (Rivven's ThrottledResponse)."""
        buckets = self._buckets.get(tenant_id)
        if buckets is None:
            return 0.0, None
        now = self._clock()
        longest, owing = 0.0, None
        for kind in kinds:
            bucket = buckets.get(kind)
            if bucket is not None and (wait := bucket.owed(now)) > longest:
                longest, owing = wait, kind
        return longest, owing

    def now(self) -> float:
        """The buckets' clock (seconds): when a turn told to a client comes."""
        return self._clock()

    def told(self, tenant_id: int, kind: Quota, seconds: float) -> None:
        """A front end told a client to back off ``seconds`` (Kafka's throttle_time_ms
        after a deferred request): counted as throttle time like a wait."""
        if seconds > 0:
            self._count(tenant_id, kind, seconds)

    def _count(self, tenant_id: int, kind: Quota, wait: float) -> None:
        key = (tenant_id, kind)
        self.throttle_seconds_total[key] = self.throttle_seconds_total.get(key, 0.0) + wait

    def reserve(
        self, tenant_id: int, *, produce: int = 0, requests: int = 0, consume: bool = False
    ) -> float:
        """Reserve what a request about to be served is known to spend; its turn: the
        seconds until the debt its tenant had before it is paid (the longest of the
        quotas it spends, and of the consume debt too when ``consume``: a read). Each
        quota's own wait is added to ``throttle_seconds_total``."""
        buckets = self._buckets.get(tenant_id)
        if buckets is None:
            return 0.0
        now = self._clock()
        turn = 0.0
        for kind, amount in ((Quota.PRODUCE, produce), (Quota.REQUESTS, requests)):
            bucket = buckets.get(kind)
            if bucket is None or not amount:
                continue
            wait = bucket.reserve(amount, now)
            if wait > 0:
                self._count(tenant_id, kind, wait)
                turn = max(turn, wait)
        if consume and (bucket := buckets.get(Quota.CONSUME)) is not None:
            wait = bucket.owed(now)
            if wait > 0:
                self._count(tenant_id, Quota.CONSUME, wait)
                turn = max(turn, wait)
        return turn

    async def admit(
        self, tenant_id: int, *, produce: int = 0, requests: int = 0, consume: bool = False
    ) -> float:
        """Before serving a request: :meth:`reserve`, then wait its turn (this task only,
        however long: that is what spaces pipelined requests at the rate), reported to
        the enclosing :func:`report_throttle`; the seconds waited. Cancelled while
        waiting (its client is gone), the request gives back what it reserved."""
        buckets = self._buckets.get(tenant_id)
        if buckets is None:
            return 0.0
        turn = self.reserve(tenant_id, produce=produce, requests=requests, consume=consume)
        line = self._lines.get((tenant_id, consume))
        if turn <= 0 and (line is None or not line.waiting()):
            return 0.0
        report = _REPORT.get()
        if report is not None and turn > 0:
            report.seconds += turn
            if report.deferred:
                return 0.0
        if line is None:
            line = self._lines[(tenant_id, consume)] = InOrder()
        try:
            await line.wait(turn)
        except asyncio.CancelledError:
            for kind, amount in ((Quota.PRODUCE, produce), (Quota.REQUESTS, requests)):
                if amount and (bucket := buckets.get(kind)) is not None:
                    bucket.refund(amount)
            raise
        return turn

    def charge(
        self,
        tenant_id: int,
        *,
        produce: int = 0,
        consume: int = 0,
        requests: int = 0,
        max_wait_s: float | None = None,
    ) -> float:
        """Count what a served request spent; the seconds its answer must wait (the
        longest of its quotas' waits, at most ``max_wait_s``, by default
        :data:`MAX_THROTTLE_S`). Each quota's own wait is added to
        ``throttle_seconds_total``."""
        buckets = self._buckets.get(tenant_id)
        if buckets is None:
            return 0.0
        cap = self._max_throttle_s if max_wait_s is None else max_wait_s
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
            wait = min(bucket.take(amount, now), cap)
            if wait > 0:
                self._count(tenant_id, kind, wait)
                delay = max(delay, wait)
        return delay

    async def throttle(self, tenant_id: int, **spent: Unpack[Spent]) -> float:
        """After serving a request whose cost was known only then (a read's bytes):
        :meth:`charge`, then wait that long (this task only), reported to the enclosing
        :func:`report_throttle`; the seconds waited."""
        delay = self.charge(tenant_id, **spent)
        report = _REPORT.get()
        if report is not None:
            report.seconds += delay
        if delay > 0 and not (report is not None and report.deferred):
            await asyncio.sleep(delay)
        return delay
