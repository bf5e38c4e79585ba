"""Kiwi stream feeds in process: the subscribers of a stream share one engine subscription
(one log read and one encoding per commit), a session that fails is dropped without
ending the feed for the others, the feed ends with its last subscriber, and deleting the
stream closes every subscriber."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prometheus_client import generate_latest

from headwater.api import AuthConfig, EngineAPI
from headwater.engine.engine import EngineConfig
from headwater.engine.kinds import KindsConfig
from headwater.server.kiwi.streams import attach_stream
from headwater.server.metrics import Metrics

CONFIG = EngineConfig(maintenance_interval_ms=0)


def payload(frame: bytes) -> dict[str, Any]:
    """The JSON message of a server text frame (unmasked)."""
    n = frame[1] & 0x7F
    message = json.loads(frame[{126: 4, 127: 10}.get(n, 2) :])
    assert isinstance(message, dict)
    return message


class FakeSession:
    """Stands in for KiwiSession: records what the feed hands it."""

    packed = False  # takes text frames

    def __init__(self, broken: bool = False) -> None:
        self.broken = broken
        self.offsets: list[int] = []
        self.closed: list[str] = []
        self.changed = asyncio.Event()

    def deliver(self, source_id: str, results: list[bytes]) -> None:
        if self.broken:
            raise RuntimeError("this connection is broken")
        for frame in results:
            message = payload(frame)
            assert message["type"] == "RESULT" and message["data"]["sourceId"] == source_id
            self.offsets.append(message["data"]["offset"])
        self.changed.set()

    def source_closed(self, source_id: str, message: str) -> None:
        self.closed.append(message)
        self.changed.set()

    async def wait(self, ready: Any) -> None:
        async with asyncio.timeout(5):
            while not ready():
                self.changed.clear()
                await self.changed.wait()


async def open_api(path: Path) -> EngineAPI:
    return await EngineAPI.open(path, CONFIG, KindsConfig(), AuthConfig())


def gateway(api: EngineAPI, metrics: Metrics) -> Any:
    return SimpleNamespace(server=SimpleNamespace(api=api), feeds={}, metrics=metrics)


def events_read(metrics: Metrics, stream: str) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("headwater_events_read_total{") and f'stream="{stream}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_subscribers_share_one_engine_subscription_and_a_broken_one_is_dropped(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        api = await open_api(tmp_path)
        metrics = Metrics()
        gw = gateway(api, metrics)
        s = stream = await api.create_stream(0, "s")
        a, b, broken = FakeSession(), FakeSession(), FakeSession(broken=True)
        detach_a = attach_stream(gw, a, s)  # type: ignore[arg-type]
        detach_b = attach_stream(gw, b, s)  # type: ignore[arg-type]
        attach_stream(gw, broken, s)  # type: ignore[arg-type]
        assert api.subscription_counts(0) == {"s": 1}
        assert len(gw.feeds) == 1

        await api.append(0, stream.stream_id, [b"0", b"1", b"2"])
        await a.wait(lambda: len(a.offsets) == 3)
        await b.wait(lambda: len(b.offsets) == 3)
        assert a.offsets == b.offsets == [0, 1, 2]
        assert broken.closed == ["the subscription failed on the server"]
        assert events_read(metrics, "s") == 6  # what each subscriber got

        await api.append(0, stream.stream_id, [b"3"])
        await a.wait(lambda: len(a.offsets) == 4)
        await b.wait(lambda: len(b.offsets) == 4)
        assert api.subscription_counts(0) == {"s": 1}

        # The feed ends with its last subscriber; the next subscriber starts a new one.
        detach_a()
        detach_b()
        assert gw.feeds == {} and api.subscription_counts(0) == {}
        await api.append(0, stream.stream_id, [b"4"])
        c = FakeSession()
        attach_stream(gw, c, s)  # type: ignore[arg-type]
        await api.append(0, stream.stream_id, [b"5"])
        await c.wait(lambda: c.offsets)
        assert c.offsets == [5] and a.offsets == b.offsets == [0, 1, 2, 3]
        await api.close()

    asyncio.run(main())


def test_deleting_the_stream_closes_every_subscriber(tmp_path: Path) -> None:
    async def main() -> None:
        api = await open_api(tmp_path)
        gw = gateway(api, Metrics())
        s = stream = await api.create_stream(0, "s")
        sessions = [FakeSession() for _ in range(3)]
        for session in sessions:
            attach_stream(gw, session, s)  # type: ignore[arg-type]
        await api.delete_stream(0, stream.stream_id)
        for session in sessions:
            await session.wait(lambda session=session: session.closed)
            assert session.closed == ["the stream was deleted"]
        assert gw.feeds == {}
        await api.close()

    asyncio.run(main())
