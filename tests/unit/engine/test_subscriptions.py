"""Push subscriptions: credits bound delivery, order and exactly-once across grants,
consumer groups resume and hand over, deletion and shutdown close subscriptions."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from headwater.engine import subscriptions as subscriptions_module
from headwater.engine.engine import Engine, EngineConfig
from headwater.engine.subscriptions import (
    PUSH_MAX_EVENTS,
    RESUME,
    CloseReason,
    GroupOffsets,
    Push,
    Subscription,
    Subscriptions,
)
from headwater.errors import InvalidOffset, InvalidRequest, StorageError
from headwater.storage.batch import value_spans
from waiting import wait_until_async

CONFIG = EngineConfig(maintenance_interval_ms=0)


class Recorder:
    """A front end stand-in: records pushes and close reasons. A push taking the events
    past ``allowed`` (what the test has granted so far) is an overrun, kept in
    :attr:`overruns`: what must not be delivered is caught when it is, not looked for
    after a while."""

    def __init__(self, allowed: int | None = None) -> None:
        self.events: list[tuple[int, bytes]] = []
        self.pushes: list[int] = []
        self.closed: list[CloseReason] = []
        self.arrived = asyncio.Event()
        self.stall: asyncio.Event | None = None
        self.allowed = allowed
        self.overruns: list[tuple[int, int]] = []  # (first offset, count)

    async def deliver(self, sub: Subscription, pushes: list[Push]) -> None:
        for start, count, chunks, _credits in pushes:
            if self.allowed is not None and len(self.events) + count > self.allowed:
                self.overruns.append((start, count))
            data = b"".join(chunks)
            bounds = value_spans(data, count)
            for i in range(count):
                self.events.append((start + i, data[bounds[i] + 8 : bounds[i + 1]]))
            self.pushes.append(count)
        self.arrived.set()
        if self.stall is not None:
            await self.stall.wait()

    def on_close(self, sub: Subscription, reason: CloseReason) -> None:
        self.closed.append(reason)
        self.arrived.set()

    async def wait_for(self, n: int, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self.events) < n:
                self.arrived.clear()
                await self.arrived.wait()


def test_credits_bound_delivery_and_grants_continue_in_order(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        subs = Subscriptions(engine)
        sid = (await engine.create_stream(0, "s")).stream_id
        await engine.append(0, sid, [b"e%d" % i for i in range(100)])
        rec = Recorder(allowed=10)
        sub = subs.subscribe(0, sid, 0, 10, None, rec.deliver, rec.on_close)
        await rec.wait_for(10)
        # Never beyond the credits: each push is checked as it comes (rec.allowed), and
        # none is left to come.
        assert sub.credits == 0
        rec.allowed = 105
        assert subs.grant(sub, 95) == 95
        await engine.append(0, sid, [b"e%d" % i for i in range(100, 120)])
        await rec.wait_for(105)
        assert sub.credits == 0
        assert [o for o, _ in rec.events] == list(range(105))
        assert [v for _, v in rec.events] == [b"e%d" % i for i in range(105)]
        assert max(rec.pushes) <= PUSH_MAX_EVENTS
        subs.close(sub, CloseReason.CLIENT_CANCELLED)
        # A witness subscribed at the end: once it has the late event, any
        # subscription still open on the stream was woken for it too.
        witness = Recorder()
        subs.subscribe(0, sid, 120, 10, None, witness.deliver, witness.on_close)
        await engine.append(0, sid, [b"late"])
        with pytest.raises(InvalidRequest, match="closed"):
            subs.grant(sub, 1)
        await witness.wait_for(1)
        assert witness.events == [(120, b"late")]
        assert len(rec.events) == 105 and rec.overruns == []
        assert rec.closed == [CloseReason.CLIENT_CANCELLED]
        await engine.close()

    asyncio.run(main())


def test_live_tail_and_offsets(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        subs = Subscriptions(engine)
        sid = (await engine.create_stream(0, "s")).stream_id
        await engine.append(0, sid, [b"old"] * 5)
        with pytest.raises(InvalidOffset):
            subs.subscribe(0, sid, 6, 10, None, Recorder().deliver, Recorder().on_close)
        rec = Recorder()
        sub = subs.subscribe(0, sid, RESUME, 100, None, rec.deliver, rec.on_close)
        assert sub.next_offset == 5  # RESUME without a group: from the end
        await engine.append(0, sid, [b"new1", b"new2"])
        await rec.wait_for(2)
        assert rec.events == [(5, b"new1"), (6, b"new2")]
        await engine.close()

    asyncio.run(main())


def test_consumer_group_resumes_after_client_dies_and_hands_over(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        subs = Subscriptions(engine)
        sid = (await engine.create_stream(0, "s")).stream_id
        await engine.append(0, sid, [b"%d" % i for i in range(30)])
        first = Recorder()
        a = subs.subscribe(0, sid, RESUME, 10, "g", first.deliver, first.on_close)
        second = Recorder(allowed=0)  # one active delivery per group: none while a is
        b = subs.subscribe(0, sid, RESUME, 100, "g", second.deliver, second.on_close)
        await first.wait_for(10)
        subs.grant(a, 5)  # acknowledges 0..9
        await first.wait_for(15)
        assert second.events == [] and second.overruns == []
        # The first consumer dies without acknowledging 10..14.
        second.allowed = None
        subs.close(a, CloseReason.CLIENT_CANCELLED)
        await second.wait_for(20)
        assert [o for o, _ in second.events] == list(range(10, 30))
        subs.grant(b, 0)  # acknowledges up to 30
        await subs.close_all()
        await engine.close()

        engine = await Engine.open(tmp_path, CONFIG)
        subs = Subscriptions(engine)
        await engine.append(0, sid, [b"30"])
        third = Recorder()
        subs.subscribe(0, sid, RESUME, 10, "g", third.deliver, third.on_close)
        await third.wait_for(1)
        assert third.events == [(30, b"30")]
        await engine.close()

    asyncio.run(main())


def test_stream_delete_and_shutdown_close_with_reasons(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        subs = Subscriptions(engine)
        s1 = (await engine.create_stream(0, "one")).stream_id
        s2 = (await engine.create_stream(0, "two")).stream_id
        r1, r2 = Recorder(), Recorder()
        subs.subscribe(0, s1, 0, 10, None, r1.deliver, r1.on_close)
        subs.subscribe(0, s2, 0, 10, None, r2.deliver, r2.on_close)
        await engine.delete_stream(0, s1)
        assert r1.closed == [CloseReason.STREAM_DELETED]
        await subs.close_all()
        assert r2.closed == [CloseReason.SERVER_SHUTDOWN]
        await engine.close()

    asyncio.run(main())


def test_stalled_consumer_is_closed_and_does_not_block_others(tmp_path: Path) -> None:
    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        subs = Subscriptions(engine, backpressure_timeout=0.2)
        sid = (await engine.create_stream(0, "s")).stream_id
        stalled, healthy = Recorder(), Recorder()
        stalled.stall = asyncio.Event()
        subs.subscribe(0, sid, 0, 1000, None, stalled.deliver, stalled.on_close)
        subs.subscribe(0, sid, 0, 1000, None, healthy.deliver, healthy.on_close)
        for i in range(10):
            await engine.append(0, sid, [b"%d" % i])
        await healthy.wait_for(10)
        await wait_until_async(lambda: stalled.closed, 5, "the stalled consumer stayed open")
        assert stalled.closed == [CloseReason.BACKPRESSURE_TIMEOUT]
        await engine.close()

    asyncio.run(main())


def test_an_append_wakes_only_the_subscriptions_waiting_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Subscriptions without credit cost an append nothing: 500 of them on the stream,
    and the append wakes only the one with credit (50k such subscriptions had made each
    append 100 times slower). Granting credit still wakes one."""
    woken: list[int] = []
    wake = Subscription.wake

    def counting_wake(sub: Subscription) -> None:
        woken.append(sub.subscription_id)
        wake(sub)

    monkeypatch.setattr(Subscription, "wake", counting_wake)

    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        subs = Subscriptions(engine)
        sid = (await engine.create_stream(0, "s")).stream_id
        idle = [Recorder(allowed=0) for _ in range(500)]
        idle_subs = [subs.subscribe(0, sid, 0, 0, None, r.deliver, r.on_close) for r in idle]
        live = Recorder()
        live_sub = subs.subscribe(0, sid, 0, 10, None, live.deliver, live.on_close)
        # The live pump has started and waits for a commit: only it is registered.
        await wait_until_async(lambda: subs.awaiting_commit.get((0, sid)) == {live_sub})
        woken.clear()
        await engine.append(0, sid, [b"e0"])
        await live.wait_for(1)
        # The append's wake-ups all happen in its commit callback, before the live
        # subscription could read: any of the idle ones would be in ``woken`` by now.
        assert woken == [live_sub.subscription_id]
        assert all(not r.events and not r.overruns for r in idle)
        idle[7].allowed = 1
        subs.grant(idle_subs[7], 1)
        await idle[7].wait_for(1)
        assert idle[7].events == [(0, b"e0")]
        await subs.close_all()
        await engine.close()

    asyncio.run(main())


def test_a_group_position_not_written_is_tried_again_and_its_flush_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed write of groups.json (a full disk) was given up for good: its positions
    never reached the disk, not even at close, and a restart went back to the last ones
    written; and an operator's reset awaiting the flush was told it was done."""
    real_write = subscriptions_module.write_json_atomic

    def full_disk(path: Path, data: object) -> None:
        raise OSError(28, "No space left on device")

    async def main() -> None:
        engine = await Engine.open(tmp_path, CONFIG)
        stream = engine.stream(0, (await engine.create_stream(0, "s")).stream_id)
        offsets = GroupOffsets(stream.directory, engine)
        offsets.commit("rg", 20)
        await offsets.flush()
        monkeypatch.setattr(subscriptions_module, "write_json_atomic", full_disk)
        offsets.commit("rg", 50)
        with pytest.raises(StorageError, match="No space left"):
            await offsets.flush()
        assert GroupOffsets(stream.directory, engine).offsets == {"rg": 20}
        monkeypatch.setattr(subscriptions_module, "write_json_atomic", real_write)
        await offsets.flush()  # room again: written now, nothing stored since needed
        assert GroupOffsets(stream.directory, engine).offsets == {"rg": 50}
        await engine.close()

    asyncio.run(main())
