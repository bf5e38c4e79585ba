"""[limits] sql_timeout_ms, sql_memory_mib and sql_concurrency against a real server:
each driven past its limit through the front ends that run SQL (Kimberlite Query and
QueryAt, HTTP /api/sql, the CLI), the client seeing the documented error and the server
serving the next query (docs/operations.md, "Limits")."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from memory_probe import MIB, RssSampler
from servers import LOCAL, Server

import headwater
from headwater.errors import QueryExecutionError
from headwater.server.memory import process_memory
from waiting import wait_until

HTTP = {"http": LOCAL}
# Runs for minutes unless interrupted: a cross join DuckDB cannot shortcut.
SLOW = "SELECT count(*) FROM range(100000000) a, range(1000) b WHERE a.range + b.range < 0"
TENANTS = """
[[tenants]]
id = 42
name = "other"
"""


def limits(**values: int) -> str:
    return "[limits]\n" + "".join(f"{key} = {value}\n" for key, value in values.items())


def post_sql(server: Server, sql: str, tenant: int = 0) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://{server.address_of('http')}/api/sql",
        data=json.dumps({"sql": sql}).encode(),
        headers={"Content-Type": "application/json", "X-Headwater-Tenant": str(tenant)},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metric(server: Server, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when the series is not there yet)."""
    with urllib.request.urlopen(f"http://{server.address_of('http')}/metrics", timeout=30) as r:
        text = r.read().decode()
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    series = f"{name}{{{wanted}}}" if labels else name
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def refusals(server: Server, limit: str) -> float:
    return metric(server, "headwater_limit_refusals_total", limit=limit, listener="sql")


def in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``call`` in a thread; its result or exception lands in the list."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def rss_mib(server: Server, field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of the server process, in MiB."""
    status = Path(f"/proc/{server.pid}/status").read_text()
    found = re.search(rf"^{field}:\s+(\d+) kB$", status, re.MULTILINE)
    assert found, status
    return int(found.group(1)) / 1024


def test_a_query_past_sql_timeout_ms_is_cancelled_on_every_front_end(
    make_server: Callable[..., Server], sdk_cli_env: dict[str, str]
) -> None:
    server = make_server(config=limits(sql_timeout_ms=500), listen=HTTP)
    cancelled = "query cancelled after 500 ms (limits.sql_timeout_ms)"
    with headwater.connect(server.address, timeout=30) as hw:  # type: ignore[attr-defined]
        hw.create_stream("kept")
        hw.append("kept", [b'{"n": 1}', b'{"n": 2}'])
        with pytest.raises(QueryExecutionError) as caught:
            hw.query(SLOW)
        assert caught.value.message == cancelled
        with pytest.raises(QueryExecutionError) as caught:
            hw.query_at(SLOW, 2)
        assert caught.value.message == cancelled

    status, body = post_sql(server, SLOW)
    assert status == 422
    assert body["error"]["name"] == "QueryExecutionError"
    assert body["error"]["message"] == cancelled

    cli = subprocess.run(
        [sys.executable, "-m", "headwater.cli.main", "sql", SLOW, "--server", server.address],
        capture_output=True,
        text=True,
        env=sdk_cli_env,
        timeout=60,
        check=False,
    )
    assert cli.returncode == 1
    assert cli.stderr.strip() == f"headwater: error: QueryExecutionError: {cancelled}"

    # Every cancellation counted; another client is served and nothing stored was lost.
    assert refusals(server, "sql_timeout_ms") == 4
    with headwater.connect(server.address, timeout=30) as other:  # type: ignore[attr-defined]
        assert other.query("SELECT sum((json->>'n')::INT) FROM kept").rows == [(3,)]
    assert post_sql(server, "SELECT 42 AS answer") == (200, {"columns": ["answer"], "rows": [[42]]})
    assert metric(server, "headwater_sql_queries_running") == 0


def test_sigterm_during_a_long_query_stops_the_server_promptly(
    make_server: Callable[..., Server],
) -> None:
    server = make_server(config=limits(sql_timeout_ms=600_000), listen=HTTP)
    with headwater.connect(server.address, timeout=60) as hw:  # type: ignore[attr-defined]
        thread, outcome = in_thread(lambda: hw.query(SLOW))
        wait_until(
            lambda: metric(server, "headwater_sql_queries_running") == 1,
            message="the slow query never started",
        )
        started = time.monotonic()
        # Server.stop fails the test if SIGTERM goes unanswered for 5 s. Before queries
        # were interrupted first, the running one held the Kimberlite listener's drain
        # for its full 10 s (and an HTTP request aiohttp's shutdown) before anything
        # interrupted it.
        assert server.stop(timeout=5) == 0
        stopped_in = time.monotonic() - started
        thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], QueryExecutionError), outcome
    assert outcome[0].message == "query cancelled: the server is shutting down"
    assert stopped_in < 5
    assert "Traceback" not in server.log_text()


def test_a_query_past_sql_memory_mib_spills_or_fails_and_the_server_stays_small(
    make_server: Callable[..., Server],
) -> None:
    server = make_server(config=limits(sql_memory_mib=64, sql_concurrency=1), listen=HTTP)
    with headwater.connect(server.address, timeout=60) as hw:  # type: ignore[attr-defined]
        hw.create_stream("kept")
        hw.append("kept", [json.dumps({"n": n}).encode() for n in range(1000)])
        before = rss_mib(server, "VmRSS")
        # ~190 MiB of sort input (450+ MiB of RSS with DuckDB's default memory limit):
        # within 64 MiB it spills to the data directory and still answers correctly.
        spilled = hw.query(
            "SELECT count(*), min(x), max(x) FROM (SELECT lpad(i::VARCHAR, 12, '0') || "
            "'abcdefghij' AS x FROM range(6000000) t(i) ORDER BY x DESC)"
        )
        assert spilled.rows == [(6000000, "000000000000abcdefghij", "000005999999abcdefghij")]
        peak = rss_mib(server, "VmHWM")
        assert peak - before < 200, f"RSS grew from {before:.0f} to a peak of {peak:.0f} MiB"
        # A single string of ~250 MiB cannot spill: refused, naming the limit.
        with pytest.raises(QueryExecutionError) as caught:
            hw.query("SELECT length(string_agg(i::VARCHAR, ',')) FROM range(30000000) t(i)")
        assert "limits.sql_memory_mib" in caught.value.message
        assert "Out of Memory" in caught.value.message
        assert refusals(server, "sql_memory_mib") == 1
        # Nothing stored was lost, and the server serves the next query.
        total = hw.query("SELECT count(*), sum((json->>'n')::INT) FROM kept")
        assert total.rows == [(1000, sum(range(1000)))]
    status, body = post_sql(server, "SELECT 1 AS one")
    assert status == 200 and body["rows"] == [[1]]


def test_a_result_past_sql_result_mib_is_refused_and_the_server_stays_small(
    make_server: Callable[..., Server],
) -> None:
    # 400 MiB of result from nothing stored: once all of it became Arrow, then Python
    # values, then one JSON answer (a 1.5 GB result took the server to 4.1 GB).
    server = make_server(
        config=limits(sql_result_mib=8, sql_concurrency=1), listen={**HTTP, "postgres": LOCAL}
    )
    huge = "SELECT i, repeat('x', 1000) AS pad FROM range(400000) t(i)"
    before = rss_mib(server, "VmRSS")
    status, body = post_sql(server, huge)
    assert status == 422, body
    assert body["error"]["name"] == "QueryExecutionError"
    message = body["error"]["message"]
    assert message.startswith("the result is over 8 MiB (limits.sql_result_mib;"), message
    with headwater.connect(server.address, timeout=60) as hw:  # type: ignore[attr-defined]
        with pytest.raises(QueryExecutionError, match=r"limits\.sql_result_mib"):
            hw.query(huge)
        # Under the limit, the same rows answer in full.
        assert hw.query(f"SELECT count(*), sum(length(pad)) FROM ({huge})").rows == [
            (400000, 400_000_000)
        ]
        assert len(hw.query(huge.replace("400000", "5000")).rows) == 5000
    with (
        psycopg.connect(
            f"host=127.0.0.1 port={server.ports['postgres']} user=u dbname=0 sslmode=disable",
            autocommit=True,
        ) as conn,
        pytest.raises(psycopg.errors.ProgramLimitExceeded),
    ):
        conn.execute(huge)
    assert refusals(server, "sql_result_mib") == 3
    peak = rss_mib(server, "VmHWM")
    assert peak - before < 150, f"RSS grew from {before:.0f} to a peak of {peak:.0f} MiB"
    assert post_sql(server, "SELECT 1 AS one") == (200, {"columns": ["one"], "rows": [[1]]})


def test_a_select_of_wide_events_is_refused_without_copying_them_whole(
    make_server: Callable[..., Server],
) -> None:
    # DuckDB copies a whole vector (2048 rows) of a scanned batch before any limit sees
    # a row: 2048 events of the 4 MiB an append allows would be 8 GiB. A projection's
    # chunks hold at most SEAL_BYTES (16 MiB) of values, which bounds that copy.
    server = make_server(config=limits(sql_concurrency=1), listen=HTTP)
    with headwater.connect(server.address, timeout=60) as hw:  # type: ignore[attr-defined]
        hw.create_stream("wide")
        for n in range(64):
            hw.append("wide", [bytes([65 + n % 26]) * (1 << 20) for _ in range(4)])
        assert hw.query("SELECT count(*), sum(octet_length(data)) FROM wide").rows == [
            (256, 256 << 20)
        ]
        baseline = process_memory(server.pid)
        assert baseline is not None
        with RssSampler(server.pid) as sampler:
            sampler.phase = "select"
            with pytest.raises(QueryExecutionError, match=r"limits\.sql_result_mib"):
                hw.query("SELECT data FROM wide")
            sampler.phase = "after"
            # What fits is answered in full; the server serves the next query.
            rows = hw.query(
                'SELECT "offset", data FROM wide WHERE "offset" BETWEEN 100 AND 104'
            ).rows
            # A BLOB column answers as hex text over Kimberlite.
            expected = [(n, (bytes([65 + n // 4 % 26]) * (1 << 20)).hex()) for n in range(100, 105)]
            assert [tuple(r) for r in rows] == expected
    grown = (sampler.peaks["select"] - baseline.rss_anon) / MIB
    assert grown < 100, f"RssAnon grew {grown:.0f} MiB in the refused SELECT: {sampler.report()}"


def test_an_insert_past_the_append_limits_is_refused_before_its_source_is_read_whole(
    make_server: Callable[..., Server],
) -> None:
    # The INSERT's whole source became Arrow before the 10,000-row check: a million
    # rows of 1 KB took the server from 170 MiB to a peak of 2.3 GiB, then were refused.
    server = make_server(config=limits(sql_concurrency=1), listen=HTTP)
    assert post_sql(server, "SELECT 1 AS one")[0] == 200
    with headwater.connect(server.address, timeout=60) as hw:  # type: ignore[attr-defined]
        hw.create_stream("sink")
        before = rss_mib(server, "VmRSS")
        for source in (
            "SELECT repeat('x', 1000) FROM range(1000000)",  # too many rows
            # 10,000 rows of 400 MB: DuckDB still makes one vector (2048 rows) of them.
            "SELECT repeat('x', 40000) FROM range(10000)",
        ):
            status, body = post_sql(server, f"INSERT INTO sink (data) {source}")
            assert status == 422, body
            assert "INSERT appends at most 10000 rows and 4 MiB" in body["error"]["message"]
        peak = rss_mib(server, "VmHWM")
        assert peak - before < 150, f"RSS grew from {before:.0f} to a peak of {peak:.0f} MiB"
        assert hw.stream_info("sink").next_offset == 0  # nothing stored
        status, body = post_sql(server, "INSERT INTO sink (data) SELECT 'x' FROM range(10000)")
        assert status == 200, body
        assert hw.stream_info("sink").next_offset == 10_000


def test_one_tenants_backlog_of_scans_does_not_starve_another_tenant(
    make_server: Callable[..., Server],
) -> None:
    server = make_server(
        config=limits(sql_concurrency=1, sql_timeout_ms=1500) + TENANTS, listen=HTTP
    )
    answered: list[str] = []
    lock = threading.Lock()

    def scan(tenant: int, sql: str, label: str) -> object:
        with headwater.connect(server.address, tenant=tenant, timeout=60) as hw:  # type: ignore[attr-defined]
            try:
                return hw.query(sql)
            finally:
                with lock:
                    answered.append(label)

    flood = [in_thread(lambda: scan(0, SLOW, "flood")) for _ in range(3)]
    wait_until(
        lambda: metric(server, "headwater_sql_queries_queued") == 2,
        message="tenant 0's scans never queued",
    )
    other_thread, other = in_thread(lambda: scan(42, "SELECT 42 AS answer", "other"))
    for thread, _ in [*flood, (other_thread, other)]:
        thread.join(60)
    assert len(answered) == 4
    # First come, first served would answer tenant 42 last, after every scan of tenant 0.
    assert answered.index("other") < 3, answered
    assert other[0].rows == [(42,)]  # type: ignore[union-attr]
    for _, outcome in flood:
        assert isinstance(outcome[0], QueryExecutionError), outcome
        assert "limits.sql_timeout_ms" in outcome[0].message
    assert refusals(server, "sql_timeout_ms") == 3


def test_a_query_past_sql_timeout_ms_is_cancelled_over_postgresql(
    make_server: Callable[..., Server],
) -> None:
    """The same limit through the PostgreSQL front end (psycopg): the statement is
    cancelled with SQLSTATE 57014 query_canceled, the message naming the key, counted,
    and the next query on the same connection is answered."""
    server = make_server(config=limits(sql_timeout_ms=500), listen={**HTTP, "postgres": LOCAL})
    dsn = f"host=127.0.0.1 port={server.ports['postgres']} user=u dbname=0 sslmode=disable"
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.QueryCanceled) as caught:
            conn.execute(SLOW)
        assert caught.value.sqlstate == "57014"
        assert caught.value.diag.message_primary == (
            "query cancelled after 500 ms (limits.sql_timeout_ms)"
        )
        assert conn.execute("SELECT 42 AS answer").fetchall() == [(42,)]
    assert refusals(server, "sql_timeout_ms") == 1
    assert metric(server, "headwater_sql_queries_running") == 0
