"""examples/vwap as a user runs it: the generator, the watcher and `headwater pipeline run
examples/vwap/vwap.yaml` (the shipped file, its own trigger, pointed at the test's server
with --server and --checkpoint), more trades while it runs, Ctrl-C. The watcher must see
windows updated as trades arrive, and every final VWAP must equal plain Python's."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from servers import LOCAL, Server, serving

import headwater
from waiting import wait_until

pytestmark = pytest.mark.spark

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vwap"
FIRST, MORE = 70_000, 40_000  # 70 s of trades, then 40 s more while the pipeline runs
WINDOW_US = 60_000_000
DEADLINE_S = 240  # the whole run, JVM start included


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("vwap_generate", EXAMPLE / "generate_trades.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_vwaps(trades: list[dict[str, Any]]) -> dict[tuple[str, int], tuple[float, int]]:
    """(symbol, window start µs) -> (vwap, volume) of every window with trades: in update
    mode each window holds all its trades (they arrive in event-time order: none late)."""
    sums: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0])
    for t in trades:
        ts_us = t["timestamp_ns"] // 1000
        window = (t["symbol"], ts_us - ts_us % WINDOW_US)
        sums[window][0] += t["price"] * t["size"]
        sums[window][1] += t["size"]
    return {w: (pv / volume, int(volume)) for w, (pv, volume) in sums.items()}


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[Server]:
    yield from serving(tmp_path / "server", listen={"ripple": LOCAL, "convergedb": LOCAL})


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "SPARK_LOCAL_IP": "127.0.0.1",
            "PYSPARK_PYTHON": sys.executable,
            "NO_COLOR": "1",
            "PYTHONUNBUFFERED": "1",
            "JAVA_TOOL_OPTIONS": "-XX:TieredStopAtLevel=1",  # a faster JVM start
        }
    )
    return env


def _state(server: Server) -> dict[tuple[str, int], tuple[float, int]]:
    with headwater.connect(server.address) as hw:
        tables = {str(row[0]) for row in hw.query("SHOW TABLES").rows}
        if "vwap" not in tables:
            return {}
        rows = hw.query("SELECT symbol, window_start_us, vwap, volume FROM vwap").rows
    return {(str(s), int(str(w))): (float(str(v)), int(str(n))) for s, w, v, n in rows}


def _wait_for(
    server: Server, want: dict[tuple[str, int], tuple[float, int]], pipeline: Any, log: Path
) -> None:
    """Until the kind holds exactly ``want`` (the pipeline's batches come on their own)."""
    state: dict[tuple[str, int], tuple[float, int]] = {}

    def final() -> bool:
        nonlocal state
        assert pipeline.poll() is None, log.read_text()
        state = _state(server)
        return state.keys() == want.keys() and all(
            state[k][1] == want[k][1] and state[k][0] == pytest.approx(want[k][0], rel=1e-12)
            for k in want
        )

    def missing() -> str:
        count = len(want.keys() - state.keys())
        return f"{count} windows missing or not final:\n{log.read_text()[-3000:]}"

    wait_until(final, DEADLINE_S, missing, interval=0.5)  # a query per poll: not too often


def _progress(log: Path) -> list[tuple[str, str, str]]:
    """(rows in, rows out, lag) of each progress line of the pipeline's query."""
    return re.findall(
        r"^\[vwap_vwap_kind\] batch \d+: in (\d+) rows, out (\d+) rows, lag (\d+) offsets, "
        r"\d+ ms$",
        log.read_text(),
        re.MULTILINE,
    )


def test_vwap_example_through_the_cli(server: Server, tmp_path: Path) -> None:
    generate = _generator()
    cdb = f"127.0.0.1:{server.ports['convergedb']}"
    run = [sys.executable, str(EXAMPLE / "generate_trades.py"), "--server", server.address]
    subprocess.run([*run, "--count", str(FIRST)], check=True, env=_env(), timeout=120)

    watch_log, pipeline_log = tmp_path / "watch.log", tmp_path / "pipeline.log"
    with watch_log.open("w") as watch_out, pipeline_log.open("w") as pipeline_out:
        watcher = subprocess.Popen(
            [sys.executable, str(EXAMPLE / "watch_vwap.py"), "--server", cdb],
            stdout=watch_out,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
        pipeline = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "headwater.cli.main",
                "pipeline",
                "run",
                str(EXAMPLE / "vwap.yaml"),
                "--server",
                server.address,
                "--checkpoint",
                str(tmp_path / "checkpoint"),
            ],
            stdout=pipeline_out,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
        try:
            first = list(generate.trades(FIRST))
            _wait_for(server, expected_vwaps(first), pipeline, pipeline_log)
            # More trades while it runs: window [60 s, 120 s) goes on filling up.
            more = [*run, "--count", str(MORE), "--first", str(FIRST)]
            subprocess.run(more, check=True, env=_env(), timeout=120)
            everything = expected_vwaps(list(generate.trades(FIRST + MORE)))
            _wait_for(server, everything, pipeline, pipeline_log)
            wait_until(  # and the batch that wrote them is done
                lambda: sum(int(n) for n, _, _ in _progress(pipeline_log)) >= FIRST + MORE,
                60,
                pipeline_log.read_text,
                interval=0.2,
            )
            pipeline.send_signal(signal.SIGINT)  # Ctrl-C
            assert pipeline.wait(60) == 130, pipeline_log.read_text()
        finally:
            for proc in (pipeline, watcher):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert len(everything) == 200  # 100 symbols x 2 windows

    # The watcher saw each window created (or in its bootstrap, when the pipeline's first
    # batch came before the subscription), then updated as its trades came in, and its
    # last line for each window is the final VWAP.
    last: dict[tuple[str, int], tuple[float, int]] = {}
    changes: dict[tuple[str, int], list[str]] = defaultdict(list)
    for change, symbol, start, vwap, volume in re.findall(
        r"^(bootstrap|created|updated)\s+(SYM\d{4}) (\d+) (\S+) (\d+)",
        watch_log.read_text(),
        re.MULTILINE,
    ):
        key = (symbol, int(start))
        changes[key].append(change)
        last[key] = (float(vwap), int(volume))
    assert last.keys() == everything.keys()
    assert all(last[k][0] == pytest.approx(v[0], rel=1e-12) for k, v in everything.items())
    assert all(last[k][1] == v[1] for k, v in everything.items())
    assert all(c[0] in ("bootstrap", "created") for c in changes.values())
    assert all(set(c[1:]) <= {"updated"} for c in changes.values())
    second = generate.START_NS // 1000 + WINDOW_US  # window [60 s, 120 s): its trades came
    spanning = [k for k in everything if k[1] == second]  # in 3 batches, before and after
    assert len(spanning) == 100 and all(len(changes[k]) >= 3 for k in spanning)

    # One progress line per micro-batch, the rows written known (update mode's writes
    # are counted by the pipeline: Spark does not count foreachBatch's).
    lines = _progress(pipeline_log)
    assert sum(int(rows_in) for rows_in, _, _ in lines) == FIRST + MORE
    assert max(int(rows_in) for rows_in, _, _ in lines) == 20_000  # maxOffsetsPerTrigger
    assert sum(int(out) for _, out, _ in lines) > len(everything)  # windows written again
