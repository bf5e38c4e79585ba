#!/usr/bin/env python3
"""SQL benchmark: a GROUP BY through ``SqlService.query`` against DuckDB over the same
rows in a plain in-memory Arrow table, in one run.

Setup: N JSON events (default 1,000,000) appended to one stream in batches of 1,000 with
sync policy ``none`` (setup speed; the sync policy does not touch the query path). The
projection build time (catch-up of the whole stream from the log) is reported too.

Measured, best of ``--repeat`` runs after one warm-up each:

* ``service``: ``await SqlService.query(0, SQL)`` end to end (read-your-writes check,
  snapshot, worker thread, DuckDB, conversion of the result rows to QueryValues);
* ``direct``: ``duckdb.connect()`` + ``register`` of a ``pyarrow.Table`` with the same
  columns (offset, position, ts, data, json) built in memory, and the same SQL fetched
  with ``fetchall()``.

The goal is service/direct <= 1.5. Run ``python benchmarks/sql_bench.py --help`` for the
flags; ``--quick`` is a smoke-test size. Results go to stdout as a markdown table and,
with ``--out``, to JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from benchlib import report
from headwater.engine.engine import Engine, EngineConfig, StreamSettings
from headwater.sql import SqlService

KINDS = ["click", "view", "purchase", "signup", "logout", "search", "share", "like"]
QUERIES = {
    "group_by": (
        "SELECT json->>'kind' AS kind, count(*) AS n, sum((json->>'amount')::BIGINT) AS total "
        "FROM events GROUP BY 1 ORDER BY 1"
    ),
    "filter_count": "SELECT count(*) FROM events WHERE json->>'kind' = 'purchase'",
    "count": "SELECT count(*) FROM events",
}


def event(i: int) -> bytes:
    return json.dumps(
        {"kind": KINDS[i % len(KINDS)], "user": i % 1000, "amount": i % 100, "seq": i}
    ).encode()


def best(times: list[float]) -> float:
    return min(times)


async def run(events: int, batch: int, repeat: int) -> dict[str, Any]:
    data_dir = Path(tempfile.mkdtemp(prefix="hw-sql-bench-"))
    try:
        engine = await Engine.open(data_dir, EngineConfig(maintenance_interval_ms=0))
        info = await engine.create_stream(0, "events", StreamSettings(sync="none"))
        started = time.perf_counter()
        values: list[bytes] = []
        for first in range(0, events, batch):
            chunk = [event(i) for i in range(first, min(first + batch, events))]
            values.extend(chunk)
            await engine.append(0, info.stream_id, chunk)
        append_s = time.perf_counter() - started
        print(f"appended {events} events in {append_s:.2f}s", file=sys.stderr)

        service = SqlService(engine)
        started = time.perf_counter()
        service.start()
        await service.wait_for_position(0, engine.tenant(0).committed_position, 600)
        project_s = time.perf_counter() - started
        print(f"projection built in {project_s:.2f}s", file=sys.stderr)

        # The same rows as a plain Arrow table for DuckDB directly.
        ts = pa.array([0] * events, pa.timestamp("us"))
        texts = pa.array([v.decode() for v in values], pa.string())
        direct_table = pa.table(
            {
                "offset": pa.array(range(events), pa.int64()),
                "position": pa.array(range(events), pa.int64()),
                "ts": ts,
                "data": pa.array(values, pa.binary()),
                "json": pa.ExtensionArray.from_storage(pa.json_(pa.string()), texts),
            }
        )
        con = duckdb.connect()
        con.register("events", direct_table)

        results: dict[str, Any] = {}
        for name, sql in QUERIES.items():
            svc_times: list[float] = []
            direct_times: list[float] = []
            svc_rows = await service.query(0, sql)  # warm-up
            direct_rows = con.execute(sql).fetchall()
            for _ in range(repeat):
                t0 = time.perf_counter()
                svc_rows = await service.query(0, sql)
                svc_times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                direct_rows = con.execute(sql).fetchall()
                direct_times.append(time.perf_counter() - t0)
            assert [list(r) for r in direct_rows] == svc_rows.rows, (direct_rows, svc_rows.rows)
            results[name] = {
                "sql": sql,
                "service_s": best(svc_times),
                "direct_s": best(direct_times),
                "ratio": best(svc_times) / best(direct_times),
            }
            print(
                f"{name}: service {best(svc_times) * 1000:.1f} ms, "
                f"direct {best(direct_times) * 1000:.1f} ms, "
                f"ratio {best(svc_times) / best(direct_times):.2f}",
                file=sys.stderr,
            )
        con.close()
        await service.close()
        await engine.close()
        return {
            "environment": {
                "python": platform.python_version(),
                "duckdb": duckdb.__version__,
                "pyarrow": pa.__version__,
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
            },
            "events": events,
            "batch": batch,
            "repeat": repeat,
            "append_s": append_s,
            "projection_build_s": project_s,
            "queries": results,
        }
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        f"{results['events']:,} JSON events in batches of {results['batch']}, "
        f"best of {results['repeat']}; duckdb {env['duckdb']}, pyarrow {env['pyarrow']}, "
        f"{env['cpus']} CPUs.",
        "",
        f"Projection built from the log in {results['projection_build_s']:.2f} s "
        f"({results['events'] / results['projection_build_s'] / 1e6:.2f} M events/s).",
        "",
        "| query | SqlService.query | DuckDB over Arrow | ratio |",
        "|---|---:|---:|---:|",
    ]
    for name, q in results["queries"].items():
        lines.append(
            f"| {name} | {q['service_s'] * 1000:.1f} ms | {q['direct_s'] * 1000:.1f} ms "
            f"| {q['ratio']:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--events", type=int, default=1_000_000, help="events to append")
    p.add_argument("--batch", type=int, default=1000, help="events per append")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per query (best wins)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.events, args.repeat = 20_000, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = asyncio.run(run(args.events, args.batch, args.repeat))
    report(results, markdown, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
