"""examples/vwap end to end: the generator's trades, the example's own pipeline file (its
server, Ripple listener, checkpoint and trigger pointed at the test's), a ConvergeDB
subscriber; every VWAP is checked against a plain Python computation."""

from __future__ import annotations

import importlib.util
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from sdk_server import SdkServer

from headwater import entities
from headwater.pipeline.runner import run_pipeline
from headwater.pipeline.spec import parse_pipeline

pytestmark = pytest.mark.spark

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vwap"
TRADES = 150_000  # 150 s of event time: windows [0, 60) and [60, 120) s close
WINDOW_US = 60_000_000
WATERMARK_US = 10_000_000


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"vwap_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def expected_vwaps(trades: list[dict[str, Any]]) -> dict[str, tuple[float, int]]:
    """key -> (vwap, volume) of every window the watermark has closed."""
    sums: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0])
    for t in trades:
        ts_us = t["timestamp_ns"] // 1000
        window = (t["symbol"], ts_us - ts_us % WINDOW_US)
        sums[window][0] += t["price"] * t["size"]
        sums[window][1] += t["size"]
    horizon = max(t["timestamp_ns"] // 1000 for t in trades) - WATERMARK_US
    return {
        f"{symbol}/{start}": (pv / volume, int(volume))
        for (symbol, start), (pv, volume) in sums.items()
        if start + WINDOW_US <= horizon
    }


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[SdkServer]:
    srv = SdkServer(
        tmp_path / "server",
        listen={"ripple": "127.0.0.1:0", "convergedb": "127.0.0.1:0"},
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_vwap_example_end_to_end(spark: Any, server: SdkServer, tmp_path: Path) -> None:
    generate, watch = _example("generate_trades"), _example("watch_vwap")
    assert generate.main(["--server", server.address, "--count", str(TRADES)]) == 0
    trades = list(generate.trades(TRADES))
    expected = expected_vwaps(trades)
    assert len(expected) == 200  # 100 symbols x 2 closed windows

    # A subscriber, as watch_vwap.py has it, sees each VWAP arrive.
    seen: dict[str, Any] = {}
    done = threading.Event()
    cdb = f"127.0.0.1:{server.ports['convergedb']}"

    def subscribe() -> None:
        with entities.connect(cdb, read_only=True) as reader:
            while True:
                try:
                    kind = reader.get_kind(watch.Vwap, "vwap")
                    break
                except entities.KindNotFound:
                    if done.wait(0.2):
                        return
            with reader.subscribe(kind) as changes:
                for change in changes:
                    v = change.value
                    seen[f"{v.symbol}/{v.window_start_us}"] = v
                    if len(seen) >= len(expected):
                        return

    watcher = threading.Thread(target=subscribe, daemon=True)
    watcher.start()

    data = yaml.safe_load((EXAMPLE / "vwap.yaml").read_text())
    data["server"] = server.address
    data["checkpoint"] = str(tmp_path / "checkpoint")
    data["trigger"] = "availableNow"
    data["sinks"][0]["options"] = {"rippleServer": f"127.0.0.1:{server.ports['ripple']}"}
    spec = parse_pipeline(data, EXAMPLE)
    progress: list[str] = []
    assert run_pipeline(spec, "unused", progress.append, spark=spark) == 0, progress

    watcher.join(60)
    done.set()
    state = spark.read.format("headwater").option("server", server.address)
    rows = state.option("kind", "vwap").load().collect()
    got = {f"{r['symbol']}/{r['window_start_us']}": (r["vwap"], r["volume"]) for r in rows}
    assert set(got) == set(expected)
    for key, (vwap, volume) in expected.items():
        assert got[key][0] == pytest.approx(vwap, rel=1e-12)
        assert got[key][1] == volume
    assert set(seen) == set(expected)
    assert all(seen[k].vwap == pytest.approx(expected[k][0], rel=1e-12) for k in expected)
