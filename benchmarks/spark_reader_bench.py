#!/usr/bin/env python3
"""The Spark stream reader alone, without Spark: rows/s one RangeReader makes of the
spark_bench stream (JSON events of varying size), to separate its cost from Spark's
Arrow-to-row conversion. Its two paths alternate: columnar over the HTTP API (what
executors use by default) and ReadEvents pages over Kimberlite (the fallback). Then the
fallback's metadata query (GROUP BY) against the exact one (a window function).

    .venv/bin/python benchmarks/spark_reader_bench.py --events 2000000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchlib import HeadwaterServer, proc_cpu
from headwater.client import connect
from headwater.spark.options import ConnectionOptions
from headwater.spark.streams import _GROUPS_SQL, _RUNS_SQL, ROW_SCHEMA, RangeReader
from spark_bench import fill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=2_000_000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    server = HeadwaterServer()
    server.start(Path(tempfile.mkdtemp(prefix="spark-reader-")), listeners=("kimberlite", "http"))
    address = f"127.0.0.1:{server.port}"
    try:
        fill(address, "bench", args.events)
        conn = ConnectionOptions(server=address)
        for _ in range(args.repeat):
            for via_http in (True, False):
                started, cpu = time.perf_counter(), time.process_time()
                reader = RangeReader(conn, "bench", 0, args.events, True, "raw", ROW_SCHEMA)
                rows = sum(batch.num_rows for batch in reader.batches(via_http=via_http))
                took = time.perf_counter() - started
                print(
                    f"{'http' if via_http else 'kimberlite':>10}: {rows:,} rows in {took:.2f} s: "
                    f"{rows / took:,.0f} rows/s, reader CPU {time.process_time() - cpu:.2f} s"
                )
        # The Kimberlite path's metadata query for one Spark partition (half the stream):
        # the GROUP BY it runs against the exact runs query it falls back to.
        with connect(address) as client:
            for _ in range(args.repeat):
                for name, sql in (("group by", _GROUPS_SQL), ("window", _RUNS_SQL)):
                    started, cpu = time.perf_counter(), proc_cpu(server.pid)
                    client.query(sql.format(table='"bench"'), 0, args.events // 2)
                    print(
                        f"{name:>10}: metadata of {args.events // 2:,} offsets in "
                        f"{time.perf_counter() - started:.3f} s, server CPU "
                        f"{proc_cpu(server.pid) - cpu:.2f} s"
                    )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
