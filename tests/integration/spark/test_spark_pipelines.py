"""``headwater pipeline run``: pipelines end to end against a real server, in the shared
session and on a real standalone cluster."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from servers import LOCAL

import headwater
from headwater.pipeline.runner import run_pipeline
from headwater.pipeline.spec import check_streams, load_pipeline, server_kind_columns
from waiting import wait_until

pytestmark = pytest.mark.spark

WINDOW_US = 60_000_000
T0_NS = 1_700_000_040_000_000_000  # a whole minute


def _trades(count: int, symbols: int, step_ms: int) -> list[dict[str, Any]]:
    trades = []
    for i in range(count):
        trades.append(
            {
                "symbol": f"SYM{i % symbols:04d}",
                "price": round(100.0 + (i * 7 % 101) / 10, 1),
                "size": 1 + i % 13,
                "timestamp_ns": T0_NS + i * step_ms * 1_000_000,
                "venue": "XNAS" if i % 2 else "XNYS",
            }
        )
    return trades


def _expected_vwap(trades: list[dict[str, Any]], watermark_us: int) -> dict[tuple[str, int], float]:
    sums: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for t in trades:
        ts_us = t["timestamp_ns"] // 1000
        key = (t["symbol"], ts_us - ts_us % WINDOW_US)
        sums[key][0] += t["price"] * t["size"]
        sums[key][1] += t["size"]
    horizon = max(t["timestamp_ns"] // 1000 for t in trades) - watermark_us
    return {k: pv / v for k, (pv, v) in sums.items() if k[1] + WINDOW_US <= horizon}


def _vwap_pipeline(path: Path, server: str, source: str, sink: str) -> Path:
    spec = {
        "name": "vwap",
        "server": server,
        "sources": [
            {
                "name": "trades",
                "type": "stream",
                "stream": source,
                "format": "json",
                "schema": "symbol STRING, price DOUBLE, size INT, timestamp_ns BIGINT, "
                "venue STRING",
                "options": {"maxOffsetsPerTrigger": 2000},
            }
        ],
        "transforms": [
            {
                "name": "timed",
                "sql": "SELECT symbol, price, size, "
                "timestamp_micros(timestamp_ns DIV 1000) AS ts FROM trades",
            },
            {
                "name": "vwap",
                "window": {
                    "time": "ts",
                    "duration": "60 seconds",
                    "watermark": "10 seconds",
                    "group_by": ["symbol"],
                    "aggregations": {"vwap": "sum(price * size) / sum(size)"},
                },
            },
            {
                "name": "out",
                "sql": "SELECT to_json(named_struct('symbol', symbol, 'start', "
                "unix_micros(window_start), 'vwap', vwap)) AS value FROM vwap",
            },
        ],
        "sinks": [{"name": "vwap_stream", "type": "stream", "stream": sink}],
        "checkpoint": str(path.parent / "checkpoint"),
        "trigger": "availableNow",
        "spark_conf": {"spark.sql.shuffle.partitions": 2, "spark.ui.enabled": False},
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _check_vwap(hw: headwater.Client, sink: str, trades: list[dict[str, Any]]) -> None:
    got = {}
    for event in hw.scan(sink):
        row = json.loads(event.value)
        key = (row["symbol"], row["start"])
        assert key not in got, f"window {key} emitted twice"
        got[key] = row["vwap"]
    expected = _expected_vwap(trades, 10_000_000)
    assert expected and set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12)


def test_vwap_pipeline_in_process(spark: Any, shared_server: Any, sdk_stream_name: str, tmp_path):
    source, sink = sdk_stream_name + "_trades", sdk_stream_name + "_vwap"
    trades = _trades(6000, symbols=7, step_ms=40)  # 4 minutes of trades
    with headwater.connect(shared_server.address) as hw:
        hw.create_stream(source)
        hw.append(source, [json.dumps(t).encode() for t in trades])
        spec = load_pipeline(
            _vwap_pipeline(tmp_path / "p.yaml", shared_server.address, source, sink)
        )
        lines: list[str] = []
        assert run_pipeline(spec, "unused", lines.append, spark=spark) == 0
        _check_vwap(hw, sink, trades)
    batches = [line for line in lines if re.search(r"batch \d+: in 2000 rows", line)]
    assert len(batches) == 3, lines  # 6000 trades, 2000 per trigger
    assert all(re.search(r"lag \d+ offsets, \d+ ms", line) for line in lines)


def test_filter_mask_rename_to_parquet(
    spark: Any, shared_server: Any, sdk_stream_name: str, tmp_path
):
    people = [{"name": f"p{i}", "email": f"p{i}@example.com", "amount": i} for i in range(40)]
    with headwater.connect(shared_server.address) as hw:
        hw.create_stream(sdk_stream_name)
        hw.append(sdk_stream_name, [json.dumps(p).encode() for p in people])
    spec_path = tmp_path / "p.yaml"
    spec_path.write_text(
        yaml.safe_dump(
            {
                "server": shared_server.address,
                "sources": [
                    {
                        "name": "people",
                        "type": "stream",
                        "stream": sdk_stream_name,
                        "format": "json",
                        "schema": "name STRING, email STRING, amount INT",
                    }
                ],
                "transforms": [
                    {"filter": "amount >= 30"},
                    {"mask": ["email"]},
                    {"select": {"name": "customer", "email": "email", "amount": "amount"}},
                ],
                "sinks": [{"type": "parquet", "path": str(tmp_path / "out")}],
                "checkpoint": "cp",
                "trigger": "availableNow",
            },
            sort_keys=False,
        )
    )
    assert run_pipeline(load_pipeline(spec_path), "unused", lambda _: None, spark=spark) == 0
    rows = sorted(tuple(r) for r in spark.read.parquet(str(tmp_path / "out")).collect())
    assert rows == [
        (f"p{i}", hashlib.sha256(f"p{i}@example.com".encode()).hexdigest(), i)
        for i in range(30, 40)
    ]


def _cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable, "NO_COLOR": "1"})
    env["JAVA_TOOL_OPTIONS"] = "-XX:TieredStopAtLevel=1"  # as the shared session: starts faster
    return env


def test_cli_reports_unknown_stream_before_spark(shared_server: Any, tmp_path: Path):
    path = _vwap_pipeline(tmp_path / "p.yaml", shared_server.address, "no_such_trades", "x")
    proc = subprocess.run(
        [sys.executable, "-m", "headwater.cli.main", "pipeline", "run", str(path)],
        capture_output=True,
        text=True,
        env=_cli_env(),
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown stream(s)" in proc.stderr and "no_such_trades" in proc.stderr
    assert not (tmp_path / "checkpoint").exists()


def _spark_class() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent / "bin" / "spark-class"


class _Daemon:
    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [str(_spark_class()), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=_cli_env(),
                start_new_session=True,
            )

    def wait_for(self, pattern: str, timeout: float = 90) -> re.Match[str]:
        def logged() -> re.Match[str] | None:
            text = self.log.read_text(errors="replace")
            assert self.proc.poll() is None, text
            return re.search(pattern, text)

        return wait_until(
            logged,
            timeout,
            lambda: f"{pattern!r} not in {self.log}:\n{self.log.read_text()}",
            interval=0.2,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def standalone_cluster(tmp_path: Path) -> Iterator[str]:
    """A Spark master and one worker from pyspark's own distribution, on loopback."""
    master = _Daemon(
        [
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--webui-port",
            "0",
        ],
        tmp_path / "master.log",
    )
    worker = None
    try:
        url = master.wait_for(r"Starting Spark master at (spark://127\.0\.0\.1:\d+)").group(1)
        worker = _Daemon(
            [
                "org.apache.spark.deploy.worker.Worker",
                url,
                "--host",
                "127.0.0.1",
                "--cores",
                "2",
                "--memory",
                "1g",
                "--webui-port",
                "0",
                "--work-dir",
                str(tmp_path / "work"),
            ],
            tmp_path / "worker.log",
        )
        worker.wait_for(r"Successfully registered with master")
        yield url
    finally:
        if worker is not None:
            worker.stop()
        master.stop()


def test_vwap_pipeline_on_standalone_cluster(
    standalone_cluster: str, shared_server: Any, sdk_stream_name: str, tmp_path: Path
):
    source, sink = sdk_stream_name + "_trades", sdk_stream_name + "_vwap"
    trades = _trades(3000, symbols=5, step_ms=50)
    with headwater.connect(shared_server.address) as hw:
        hw.create_stream(source)
        hw.append(source, [json.dumps(t).encode() for t in trades])
        path = _vwap_pipeline(tmp_path / "p.yaml", shared_server.address, source, sink)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "headwater.cli.main",
                "pipeline",
                "run",
                str(path),
                "--master",
                standalone_cluster,
            ],
            capture_output=True,
            text=True,
            env=_cli_env(),
            timeout=240,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"on {standalone_cluster}" in proc.stdout
        assert re.search(r"\[vwap_vwap_stream\] batch 0: in 2000 rows", proc.stdout), proc.stdout
        _check_vwap(hw, sink, trades)


DOCS = Path(__file__).resolve().parents[3] / "docs" / "spark.md"
PROGRESS = re.compile(
    r"^\[(\w+)\] batch (\d+): in (\d+) rows, out (\d+|\?) rows, lag (\d+) offsets, (\d+) ms$",
    re.MULTILINE,
)


def _docs_pipeline() -> dict[str, Any]:
    (block,) = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.DOTALL)
    data = yaml.safe_load(block)
    assert isinstance(data, dict)
    return data


def _progress(stdout: str) -> dict[str, list[tuple[int, int, int | None, int]]]:
    """query name -> (batch, rows in, rows out or None for '?', lag) per progress line."""
    lines: dict[str, list[tuple[int, int, int | None, int]]] = defaultdict(list)
    for name, batch, rows_in, rows_out, lag, _ms in PROGRESS.findall(stdout):
        out = None if rows_out == "?" else int(rows_out)
        lines[name].append((int(batch), int(rows_in), out, int(lag)))
    return lines


def test_docs_pipeline_example_runs(
    spark: Any, jvm_stdout: Path, make_server: Any, tmp_path: Path
) -> None:
    """The pipeline of docs/spark.md as it is there (only its server, paths and trigger
    pointed at the test's), checked and run as `headwater pipeline run` does: two
    sources (a stream and a kind's changelog), every transform type, five sinks, and the
    progress lines."""
    server = make_server(config="[ripple]\nliveness_ms = 600000\n", listen={"ripple": LOCAL})
    trades = _trades(3000, symbols=5, step_ms=50)  # 150 s: two windows close
    with headwater.connect(server.address) as hw:
        hw.create_stream("raw_trades")
        hw.append("raw_trades", [json.dumps(t).encode() for t in trades])
    limits = spark.createDataFrame(
        [(f"L{i}", 10.0 + i, False) for i in range(4)],
        "key string, max_price double, deleted boolean",
    )
    for df in (limits, spark.createDataFrame([("L2", None, True)], limits.schema)):
        df.coalesce(1).write.format("headwater").option("server", server.address).option(
            "kind", "price_limits"
        ).mode("append").save()

    data = _docs_pipeline()
    assert data["server"] == "127.0.0.1:7401" and data["trigger"] == "1 second"
    data["server"] = server.address
    data["checkpoint"] = str(tmp_path / "checkpoints")
    data["trigger"] = "availableNow"  # ends once it has read what is there
    (parquet,) = [s for s in data["sinks"] if s["type"] == "parquet"]
    parquet["path"] = str(tmp_path / "vwap_parquet")
    path = tmp_path / "docs_example.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    spec = load_pipeline(path, server_kind_columns)  # as `headwater pipeline run` checks it
    check_streams(spec)
    console_from = jvm_stdout.stat().st_size
    lines: list[str] = []
    assert run_pipeline(spec, "unused", lines.append, spark=spark) == 0, lines
    with jvm_stdout.open("rb") as f:
        f.seek(console_from)
        console = f.read().decode(errors="replace")

    expected = {
        (hashlib.sha256(sym.encode()).hexdigest(), start): vwap
        for (sym, start), vwap in _expected_vwap(trades, 10_000_000).items()
    }
    assert len(expected) == 10  # 5 symbols x 2 closed windows

    def check(values: list[str]) -> None:
        got = {}
        for value in values:
            row = json.loads(value)
            start = datetime.fromisoformat(row["start"]).timestamp()
            got[(row["sym"], round(start * 1_000_000))] = row["vwap"]
        assert set(got) == set(expected) and len(values) == len(expected)
        assert all(got[k] == pytest.approx(v, rel=1e-12) for k, v in expected.items())

    with headwater.connect(server.address) as hw:
        stream_values = [e.value.decode() for e in hw.scan("vwap_out")]
    check(stream_values)
    check([r.value for r in spark.read.parquet(str(tmp_path / "vwap_parquet")).collect()])
    check([v for v in stream_values if v in console])  # the console sink printed each

    def kind(name: str) -> list[Any]:
        reader = spark.read.format("headwater").option("server", server.address)
        return reader.option("kind", name).load().collect()

    by_entity = {r.entity_id: (r.sym, r.vwap) for r in kind("vwap")}  # key: "<sym>/<start>"
    assert by_entity.keys() == {
        hashlib.sha256(f"{sym}/{start}".encode()).hexdigest() for sym, start in expected
    }
    for (sym, start), vwap in expected.items():
        got_sym, got_vwap = by_entity[hashlib.sha256(f"{sym}/{start}".encode()).hexdigest()]
        assert got_sym == sym and got_vwap == pytest.approx(vwap, rel=1e-12)
    limit_ids = {r.entity_id: r.max_price for r in kind("price_limits")}
    assert sorted(limit_ids.values()) == [10.0, 11.0, 13.0]  # L2 removed
    doubled = {r.entity_id: r.max_price2 for r in kind("doubled_limits")}
    assert doubled == {
        hashlib.sha256(entity.encode()).hexdigest(): 2 * price
        for entity, price in limit_ids.items()
    }

    # One progress line per micro-batch of each of the five queries, with real numbers.
    progress = _progress("\n".join(lines))
    assert sorted(progress) == [f"vwap_sink{i}" for i in range(5)], lines
    for name, lines in progress.items():
        assert [b for b, *_ in lines] == list(range(len(lines))), (name, lines)
        if name != "vwap_sink4":  # the trades, all in the first batch (<= 10000 per trigger)
            assert sum(rows_in for _, rows_in, _, _ in lines) == 3000
            assert lines[0][3] == 0  # nothing left behind: lag 0 offsets
        outs = [out for _, _, out, _ in lines]
        if name == "vwap_sink1":
            assert set(outs) == {None}  # a file sink does not report its rows: '?'
        elif name == "vwap_sink4":
            assert None not in outs and sum(outs) >= 4  # every change of price_limits
        else:  # stream, console and kind sinks: one row per closed window
            assert None not in outs and sum(outs) == 10, (name, lines)


def test_file_sources_two_sinks_and_progress(spark: Any, make_server: Any, tmp_path: Path) -> None:
    """CSV, JSON and Parquet directories as sources, a select keeping columns, a stream
    sink and a kind sink, and a progress line per micro-batch with the real numbers."""
    server = make_server(listen={"ripple": LOCAL})
    people = {
        src: [(f"{src}{i}", f"city{i % 3}", 100 * i + ord(src)) for i in range(8)] for src in "abc"
    }
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "part1.csv").write_text(
        "name,city,amount\n" + "".join(f"{n},{c},{a}\n" for n, c, a in people["a"])
    )
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "part1.json").write_text(
        "".join(json.dumps({"name": n, "city": c, "amount": a}) + "\n" for n, c, a in people["b"])
    )
    spark.createDataFrame(people["c"], "name string, city string, amount long").write.parquet(
        str(tmp_path / "c")
    )
    schema = "name STRING, city STRING, amount INT"
    spec_path = tmp_path / "files.yaml"
    spec_path.write_text(
        yaml.safe_dump(
            {
                "name": "files",
                "server": server.address,
                "sources": [
                    {
                        "name": "a",
                        "type": "csv",
                        "path": str(tmp_path / "a"),
                        "schema": schema,
                        "options": {"header": True},
                    },
                    {"name": "b", "type": "json", "path": str(tmp_path / "b"), "schema": schema},
                    {"name": "c", "type": "parquet", "path": str(tmp_path / "c")},  # its schema
                ],
                "transforms": [
                    {
                        "name": "everyone",
                        "sql": "SELECT name, city, amount FROM a UNION ALL "
                        "SELECT name, city, amount FROM b UNION ALL "
                        "SELECT name, city, CAST(amount AS INT) FROM c",
                    },
                    {"name": "kept", "select": ["name", "amount"]},
                    {"name": "as_json", "sql": "SELECT to_json(struct(*)) AS value FROM kept"},
                ],
                "sinks": [
                    {"type": "stream", "stream": "people_out", "input": "as_json"},
                    {"type": "kind", "kind": "people", "key": "name", "input": "kept"},
                ],
                "checkpoint": str(tmp_path / "cp"),
                "trigger": "availableNow",
            },
            sort_keys=False,
        )
    )
    lines: list[str] = []
    assert run_pipeline(load_pipeline(spec_path), "unused", lines.append, spark=spark) == 0
    everyone = sorted(p for rows in people.values() for p in rows)
    with headwater.connect(server.address) as hw:
        out = sorted(
            (r["name"], r["amount"])
            for r in map(json.loads, (e.value for e in hw.scan("people_out")))
        )
    assert out == [(n, a) for n, _, a in everyone]
    df = spark.read.format("headwater").option("server", server.address)
    state = {r.entity_id: r.amount for r in df.option("kind", "people").load().collect()}
    assert state == {n.encode().ljust(32, b"\0").hex(): a for n, _, a in everyone}
    progress = _progress("\n".join(lines))
    assert progress == {  # one batch each: 24 rows in, 24 out, nothing left behind
        "files_sink0": [(0, 24, 24, 0)],
        "files_sink1": [(0, 24, 24, 0)],
    }, lines
