"""Per-tenant quotas (headwater.api.quotas): the token bucket's arithmetic on an injected
clock, the turn a request waits before it is served (Quotas.reserve/admit: pipelined
requests spaced at the rate, a large request's debt paid by the next one), what a served
read charges afterwards (Quotas.charge/throttle), and the throttle a task reports."""

from __future__ import annotations

import asyncio

import pytest

from headwater.api.quotas import (
    BURST_S,
    InOrder,
    Quota,
    Quotas,
    TenantQuota,
    TokenBucket,
    report_throttle,
)
from waiting import scheduled_callbacks_run


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_under_its_rate_is_never_held_back() -> None:
    bucket = TokenBucket(1000, now=0.0)
    # 100 units every 0.1 s is exactly the rate: the bucket never runs dry.
    waits = [bucket.take(100, now=i / 10) for i in range(1000)]
    assert waits == [0.0] * 1000


def test_a_burst_of_one_second_passes_then_debt_is_paid_at_the_rate() -> None:
    bucket = TokenBucket(1000, now=0.0)
    assert bucket.capacity == 1000 * BURST_S
    assert bucket.take(1000, now=0.0) == 0.0  # the whole burst, at once
    assert bucket.take(500, now=0.0) == 0.5  # 500 units owed at 1000/s
    assert bucket.take(250, now=0.0) == 0.75  # the debt adds up
    # Half a second later 500 units came back: 250 still owed.
    assert bucket.take(0, now=0.5) == 0.25
    assert bucket.take(0, now=0.75) == 0.0


def test_an_idle_bucket_refills_only_to_its_capacity() -> None:
    bucket = TokenBucket(100, now=0.0)
    bucket.take(100, now=0.0)
    # An hour idle buys one second's worth, not an hour's.
    assert bucket.take(200, now=3600.0) == 1.0


def test_a_client_waiting_out_each_throttle_gets_exactly_its_rate() -> None:
    """Kafka's promise: a client that waits its throttle before the next request is held
    to the rate. 1 MB in 100 kB requests at 100 kB/s: the first request is the burst,
    each later one waits 1 s, 9 s in all."""
    rate, chunk, total = 100_000, 100_000, 1_000_000
    bucket = TokenBucket(rate, now=0.0)
    now, waits = 0.0, []
    for _ in range(total // chunk):
        wait = bucket.take(chunk, now)
        waits.append(wait)
        now += wait  # the answer arrives once the debt is paid; the next request then
    assert waits == [0.0] + [1.0] * 9
    assert sum(waits) == (total - rate * BURST_S) / rate


def test_a_bucket_needs_a_positive_rate() -> None:
    with pytest.raises(ValueError):
        TokenBucket(0, now=0.0)


def test_quotas_charge_per_tenant_the_longest_wait_of_its_quotas() -> None:
    clock = Clock()
    quotas = Quotas(
        {
            42: TenantQuota(produce_bytes_per_s=1000, requests_per_s=2),
            7: TenantQuota(consume_bytes_per_s=10),
            8: TenantQuota(),  # a [[tenants]] entry without rates
        },
        clock=clock,
    )
    assert quotas.enabled
    assert quotas.charge(0, produce=10**9, requests=10**6) == 0.0  # no quota: free
    assert quotas.charge(8, produce=10**9) == 0.0
    assert quotas.charge(42, produce=1000, requests=1) == 0.0  # within both bursts
    assert quotas.charge(42, produce=500, requests=1) == 0.5  # produce owes 0.5 s
    # Both requests in hand are spent: two more owe 1 s at 2/s, as 1000 bytes do.
    assert quotas.charge(42, produce=500, requests=2) == 1.0
    assert quotas.charge(7, consume=15) == 0.5
    assert quotas.charge(7, produce=10**6, requests=10**6) == 0.0  # only consume counts
    assert quotas.throttle_seconds_total == {
        (42, Quota.PRODUCE): 0.5 + 1.0,
        (42, Quota.REQUESTS): 1.0,
        (7, Quota.CONSUME): 0.5,
    }


def test_one_answer_waits_at_most_max_throttle_and_the_rest_is_carried() -> None:
    clock = Clock()
    quotas = Quotas({1: TenantQuota(produce_bytes_per_s=100)}, clock=clock, max_throttle_s=10)
    assert quotas.charge(1, produce=100 + 2500) == 10.0  # 25 s owed, 10 s waited
    clock.now += 10
    assert quotas.charge(1, produce=0) == 0.0  # nothing charged, nothing waited
    assert quotas.charge(1, produce=1) == 10.0  # 15 s still owed (and one more byte)
    clock.now += 15
    assert quotas.charge(1, produce=1) == pytest.approx(0.02)


def test_no_quota_at_all_is_not_enabled() -> None:
    assert not Quotas({}).enabled
    assert not Quotas({3: TenantQuota()}).enabled


def test_throttle_waits_and_reports_to_the_enclosing_block_only() -> None:
    quotas = Quotas({1: TenantQuota(requests_per_s=100)}, clock=Clock())

    async def main() -> tuple[int, int, float]:
        with report_throttle() as outer:
            for _ in range(100):  # the burst
                assert await quotas.throttle(1, requests=1) == 0.0
            waited = await quotas.throttle(1, requests=3)
            with report_throttle() as inner:
                await quotas.throttle(2, requests=10**6)  # another tenant: no quota
        return outer.ms, inner.ms, waited

    outer_ms, inner_ms, waited = asyncio.run(main())
    # 3 requests past the burst at 100/s (the clock stands still): 30 ms.
    assert waited == pytest.approx(0.03)
    assert (outer_ms, inner_ms) == (30, 0)


def test_pipelined_requests_are_spaced_at_the_rate() -> None:
    """40 appends of 10 kB sent at once (the clock stands still) against 100 kB/s: the
    burst (10 of them) and the one that puts the tenant in debt pass at once, then each
    waits until the ones before it are paid for: turns 0.1 s apart, up to 2.9 s."""
    quotas = Quotas({1: TenantQuota(produce_bytes_per_s=100_000)}, clock=Clock())
    turns = [quotas.reserve(1, produce=10_000, requests=1) for _ in range(40)]
    assert turns == pytest.approx([0.0] * 11 + [k / 10 for k in range(1, 30)])
    # Each request's own turn is counted: their waits overlap in time.
    assert quotas.throttle_seconds_total == {(1, Quota.PRODUCE): pytest.approx(43.5)}


def test_a_request_larger_than_the_cap_leaves_its_debt_to_the_next_request() -> None:
    """A sequential client: each request waits its whole turn (no cap before serving),
    so 25 s of debt left by one request is paid by the next, not forgiven."""
    clock = Clock()
    quotas = Quotas({1: TenantQuota(produce_bytes_per_s=100)}, clock=clock, max_throttle_s=10)
    assert quotas.reserve(1, produce=100 + 2500) == 0.0  # served at once: 25 s owed
    clock.now += 10
    assert quotas.reserve(1, produce=1) == 15.0  # the rest of it, beyond any cap
    clock.now += 15
    # Only the byte of the request before is owed, then nothing.
    assert quotas.reserve(1, produce=1) == pytest.approx(0.01)
    clock.now += 0.02
    assert quotas.reserve(1, produce=1) == pytest.approx(0.0, abs=1e-9)


def test_consume_debt_delays_the_next_read_but_not_an_append() -> None:
    clock = Clock()
    quotas = Quotas(
        {1: TenantQuota(produce_bytes_per_s=100, consume_bytes_per_s=100)},
        clock=clock,
        max_throttle_s=1,
    )
    assert quotas.reserve(1, requests=1, consume=True) == 0.0  # a read: nothing owed
    # It read 400 bytes: 3 s owed, its answer held back 1 s (the cap).
    assert quotas.charge(1, consume=400) == 1.0
    clock.now += 1
    assert quotas.reserve(1, produce=100) == 0.0  # an append owes nothing to consume
    assert quotas.reserve(1, requests=1, consume=True) == 2.0  # the next read: the rest
    assert quotas.throttle_seconds_total == {(1, Quota.CONSUME): 1.0 + 2.0}


def test_admitted_requests_are_served_in_turn_and_report_their_wait() -> None:
    """admit really waits each turn (asyncio's real sleep, hence milliseconds):
    pipelined requests are served in the order of their turns, and an HTTP answer's
    throttle includes the wait before it was served. The buckets' clock stands still, so
    a loaded machine starting the requests a few milliseconds apart does not shorten
    the turns they are owed."""
    quotas = Quotas({1: TenantQuota(produce_bytes_per_s=100_000)}, clock=lambda: 0.0)
    served: list[int] = []
    waited: list[float] = []

    async def request(index: int, produce: int) -> int:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with report_throttle() as report:
            await quotas.admit(1, produce=produce, requests=1)
        served.append(index)
        waited.append(loop.time() - started)
        return report.ms

    async def main() -> list[int]:
        # The burst, then three of 1 kB at 100 kB/s: turns 0, 0, 10 and 20 ms.
        sizes = [100_000, 1000, 1000, 1000]
        return await asyncio.gather(*(request(i, size) for i, size in enumerate(sizes)))

    reported = asyncio.run(main())
    assert served == [0, 1, 2, 3]
    assert reported == [0, 0, 10, 20]
    # Really waited (the loop's timers may end up to a millisecond early).
    assert waited[3] >= 0.019


def test_a_cancelled_request_gives_back_what_it_reserved() -> None:
    clock = Clock()
    quotas = Quotas({1: TenantQuota(produce_bytes_per_s=100)}, clock=clock)

    async def main() -> None:
        quotas.reserve(1, produce=200)  # 1 s owed
        waiting = asyncio.ensure_future(quotas.admit(1, produce=10_000))
        await scheduled_callbacks_run()  # it reserved its 100 s and waits its 1 s turn
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())
    # Only the served request's debt is left: 1 s, not 101 s.
    assert quotas.reserve(1, produce=1) == 1.0


def test_waits_in_order_are_served_in_the_order_they_came() -> None:
    """The second request's wait ends first, the third has none; the first is still
    served first and each other after the one before; a request cancelled while it
    waits frees the one after it."""

    async def main() -> list[str]:
        line, served = InOrder(), []

        async def request(name: str, seconds: float) -> None:
            await line.wait(seconds)
            served.append(name)

        first = asyncio.ensure_future(request("first", 0.05))
        await scheduled_callbacks_run()  # it waits now
        cancelled = asyncio.ensure_future(request("cancelled", 0.0))
        second = asyncio.ensure_future(request("second", 0.001))
        third = asyncio.ensure_future(request("third", 0.0))
        await scheduled_callbacks_run()
        cancelled.cancel()
        await asyncio.gather(first, second, third)
        assert cancelled.cancelled() and not line.waiting()
        await line.wait(0)  # nobody waiting: at once
        return served

    assert asyncio.run(main()) == ["first", "second", "third"]
