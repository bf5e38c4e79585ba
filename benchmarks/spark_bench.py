#!/usr/bin/env python3
"""Spark reading and writing a headwater stream against Spark on local Parquet, one run.

A real ``headwater serve`` (default ``fsync`` policy) holds ``--events`` JSON events of
about 100 bytes in one stream. Spark (local[2], one session) then:

* read: the whole stream through ``format("headwater")`` into Spark's ``noop`` sink (every
  column of every row materialised), against the same rows (same columns, written once
  by Spark beforehand, untimed) read from Parquet on local disk into ``noop``. Both sides
  get 2 input partitions (the machine has 2 cores).
* write: the ``value`` column of those rows from Parquet into a fresh headwater stream
  (idempotent appends), against writing the same column to Parquet.

Runs alternate between the two sides; the median of ``--repeat`` runs is reported as
rows/s and the headwater / Parquet ratio. Markdown on stdout; JSON with ``--out``.

    .venv/bin/python benchmarks/spark_bench.py            # 2,000,000 events
    .venv/bin/python benchmarks/spark_bench.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import headwater
from benchlib import HeadwaterServer, report, spark_rates, spark_session, spark_table, timed


def fill(server: str, stream: str, events: int) -> None:
    with headwater.connect(server) as hw:
        hw.create_stream(stream)
        chunk = 100_000
        for start in range(0, events, chunk):
            hw.append(
                stream,
                [
                    b'{"sym":"SYM%04d","px":%d.%d,"qty":%d,"venue":"XNAS","seq":%010d}'
                    % (i % 100, 100 + i % 10, i % 10, 1 + i % 500, i)
                    for i in range(start, min(events, start + chunk))
                ],
            )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=2_000_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="100,000 events, 1 repeat")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.events, args.repeat = 100_000, 1
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    root = Path(tempfile.mkdtemp(prefix="spark_bench_"))
    hw_server = HeadwaterServer()
    hw_server.start(root, listeners=("kimberlite", "http"))
    server = f"127.0.0.1:{hw_server.port}"
    try:
        fill_s = timed(lambda: fill(server, "bench", args.events))
        spark = spark_session()
        half = str((args.events + 1) // 2)

        def stream_df() -> Any:
            return (
                spark.read.format("headwater")
                .option("server", server)
                .option("stream", "bench")
                .option("maxOffsetsPerPartition", half)
                .load()
            )

        parquet = root / "parquet"
        stream_df().repartition(2).write.parquet(str(parquet))
        assert spark.read.parquet(str(parquet)).count() == args.events

        read_hw, read_pq, write_hw, write_pq = [], [], [], []
        for run in range(args.repeat):
            sides = [("hw", read_hw), ("pq", read_pq)]
            for side, out in sides if run % 2 == 0 else sides[::-1]:
                df = stream_df() if side == "hw" else spark.read.parquet(str(parquet))
                out.append(timed(lambda df=df: df.write.format("noop").mode("overwrite").save()))
            for side in ("hw", "pq") if run % 2 == 0 else ("pq", "hw"):
                values = spark.read.parquet(str(parquet)).select("value")
                if side == "hw":
                    writer = (
                        values.write.format("headwater")
                        .option("server", server)
                        .option("stream", f"copy{run}")
                        .mode("append")
                    )
                    write_hw.append(timed(writer.save))
                else:
                    target = str(root / f"copy{run}")
                    write_pq.append(timed(lambda t=target, v=values: v.write.parquet(t)))
                    shutil.rmtree(target)
        with headwater.connect(server) as hw:
            for run in range(args.repeat):
                assert hw.stream_info(f"copy{run}").next_offset == args.events
        spark.stop()
    finally:
        hw_server.stop()
        shutil.rmtree(root, ignore_errors=True)

    results = {
        "events": args.events,
        "repeat": args.repeat,
        "fill_events_per_s": args.events / fill_s,
        **spark_rates(
            args.events,
            {
                "read": {"headwater": read_hw, "parquet": read_pq},
                "write": {"headwater": write_hw, "parquet": write_pq},
            },
        ),
        "load_after": os.getloadavg()[0],
    }
    report(results, markdown, args.out)
    return 0


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"{results['events']:,} events, median of {results['repeat']}",
        "",
        *spark_table(results),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
