"""The dashboard's chart history (headwater.server.http.history) on a made-up clock: one
point per minute, the counts of each minute's own changes, and its bounds (60 minutes in
a ring, the 10 busiest streams per tenant and finished minute)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from headwater.server.http.history import MINUTES, TOP_STREAMS, History
from headwater.server.metrics import Metrics

START = 1_800_000_000.0 - 1_800_000_000.0 % 60  # a minute's start


@dataclass
class FakeStream:
    tenant_id: int
    stream_id: int
    name: str
    next_offset: int = 0
    size_bytes: int = 0


@dataclass
class FakeApi:
    """What History reads of the engine API: every tenant's streams."""

    streams: list[FakeStream] = field(default_factory=list)

    def all_streams(self) -> list[FakeStream]:
        return list(self.streams)


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


def setup() -> tuple[History, FakeApi, Metrics, Clock]:
    clock = Clock()
    return History(clock), FakeApi(), Metrics(), clock


def test_each_minute_counts_its_own_changes() -> None:
    history, api, metrics, clock = setup()
    orders = FakeStream(0, 1, "orders", next_offset=1_000, size_bytes=50_000)
    api.streams.append(orders)
    history.sample(api, metrics)  # the baseline: what was there before is not counted
    assert history.for_tenant(0)["points"] == []

    clock.now += 30
    orders.next_offset += 600
    orders.size_bytes += 6_000
    metrics.record_read("http", 0, "orders", 90, 900)
    history.sample(api, metrics)
    clock.now += 60  # the next minute
    orders.next_offset += 60
    # A stream created since the last sample counts whole; another tenant's apart.
    api.streams.append(FakeStream(0, 2, "fresh", next_offset=12))
    api.streams.append(FakeStream(7, 1, "orders", next_offset=5_000))
    history.sample(api, metrics)

    answer = history.for_tenant(0)
    first, second = answer["points"]
    assert (first["t_ms"], second["t_ms"]) == (START * 1000, (START + 60) * 1000)
    assert first["seconds"] == 30 and second["seconds"] == 60
    assert first["events_per_s"] == 20 and first["bytes_per_s"] == 200
    assert first["reads_per_s"] == 3
    assert second["events_per_s"] == 72 / 60 and second["bytes_per_s"] == 0
    assert {s["name"]: s["events_per_s"] for s in answer["streams"]} == {
        "orders": [20, 1],
        "fresh": [0, 12 / 60],
    }
    assert history.for_tenant(7)["points"][1]["events_per_s"] == 5_000 / 60


def test_shrinking_streams_do_not_count_negative() -> None:
    history, api, metrics, clock = setup()
    logs = FakeStream(0, 1, "logs", next_offset=10, size_bytes=10_000)
    api.streams.append(logs)
    history.sample(api, metrics)
    clock.now += 5
    logs.size_bytes = 2_000  # retention dropped a segment
    history.sample(api, metrics)
    assert history.for_tenant(0)["points"][0]["bytes_per_s"] == 0


def test_an_hour_in_a_ring_and_the_busiest_streams_per_minute() -> None:
    history, api, metrics, clock = setup()
    streams = [FakeStream(0, i, f"s{i:02}") for i in range(TOP_STREAMS + 5)]
    api.streams.extend(streams)
    history.sample(api, metrics)
    for _ in range(MINUTES + 30):
        clock.now += 60
        for rank, stream in enumerate(streams):
            stream.next_offset += rank + 1  # s14 the busiest, s00 the quietest
        history.sample(api, metrics)
    assert len(history.minutes) == MINUTES
    assert history.minutes[0].start_s == START + 31 * 60  # the oldest 30 fell off
    finished = history.minutes[-2].tenants[0]
    assert sorted(finished.streams) == [f"s{i:02}" for i in range(5, TOP_STREAMS + 5)]
    assert finished.events == sum(range(1, TOP_STREAMS + 6))  # totals count every stream
    answer: dict[str, Any] = history.for_tenant(0)
    assert len(answer["points"]) == MINUTES
    assert [s["name"] for s in answer["streams"]] == [
        f"s{i:02}" for i in reversed(range(5, TOP_STREAMS + 5))
    ]
