#!/usr/bin/env python3
"""Spark reading and writing a 6-partition headwater stream against Spark on local
Parquet of the same rows, one run.

A real ``headwater serve`` (default ``fsync`` policy; Kimberlite and HTTP listeners)
holds ``--events`` keyed JSON events of about 67 bytes (keys ``cust-<n>``, 10,000 of
them) in a stream of ``--partitions`` partitions, each key on its murmur2 partition as
Kafka's partitioner puts it. Spark (local[2], one session) then:

* read: the whole stream through ``format("headwater")`` (one input partition per
  stream partition) into Spark's ``noop`` sink, every column of every row materialised
  (key, value, stream, partition, offset, timestamp, timestampType, position), against
  the same rows and columns read from Parquet (one file per stream partition, written by
  Spark beforehand, untimed) into ``noop``;
* write: the ``key`` and ``value`` columns of those rows from Parquet into a fresh
  stream of as many partitions (each row placed by murmur2 of its key, idempotent
  appends, fsynced), against writing the same two columns to Parquet.

Runs alternate between the two sides; the median of ``--repeat`` runs is reported as
rows/s and the headwater / Parquet ratio, with the load average before and after.
Markdown on stdout; JSON with ``--out``.

    .venv/bin/python benchmarks/spark_partitions_bench.py --events 5000000 --repeat 5
    .venv/bin/python benchmarks/spark_partitions_bench.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

import headwater
from benchlib import HeadwaterServer, report, spark_rates, spark_session, spark_table, timed
from headwater.engine.partitioner import murmur2_batch
from spark_read_profile import cpu_by_process

ROLES = ("server", "python workers", "jvm")

KEYS = 10_000


def create(api: Any, stream: str, partitions: int) -> None:
    body = json.dumps({"name": stream, "settings": {"partitions": partitions}}).encode()
    api.request("POST", "/api/streams", body, "application/json")


def fill(server: str, stream: str, events: int, partitions: int) -> None:
    """Keyed events, each on its key's murmur2 partition, in appends of 10,000."""
    keys = [b"cust-%d" % k for k in range(KEYS)]
    homes = (murmur2_batch(keys) & 0x7FFFFFFF) % partitions
    with headwater.connect(server) as hw, hw.http_api() as api:
        create(api, stream, partitions)
        chunk = 60_000
        for start in range(0, events, chunk):
            ids = range(start, min(events, start + chunk))
            key_ids = np.array([i * 7919 % KEYS for i in ids])
            values = [
                b'{"sym":"SYM%04d","px":%d.%d,"qty":%d,"venue":"XNAS","seq":%010d}'
                % (i % 100, 100 + i % 10, i % 10, 1 + i % 500, i)
                for i in ids
            ]
            batch = pa.record_batch(
                {
                    "value": pa.array(values, pa.binary()),
                    "key": pa.array([keys[k] for k in key_ids]),
                }
            )
            target = homes[key_ids]
            for p in range(partitions):
                rows = np.flatnonzero(target == p)
                for lo in range(0, len(rows), 10_000):
                    part = batch.take(pa.array(rows[lo : lo + 10_000]))
                    api.append_arrow(stream, part, partition=p)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=2_000_000)
    p.add_argument("--partitions", type=int, default=6)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--arrow-batch-rows",
        type=int,
        help="spark.sql.execution.arrow.maxRecordsPerBatch (Spark's default: 10,000): the "
        "rows of each Arrow batch the sink is given, spread over the partitions",
    )
    p.add_argument("--quick", action="store_true", help="100,000 events, 1 repeat")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.events, args.repeat = 100_000, 1
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    load_before = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="spark_partitions_bench_"))
    hw_server = HeadwaterServer()
    hw_server.start(root, listeners=("kimberlite", "http"))
    server = f"127.0.0.1:{hw_server.port}"
    try:
        fill_s = timed(lambda: fill(server, "bench", args.events, args.partitions))
        arrow_conf = (
            {"spark.sql.execution.arrow.maxRecordsPerBatch": str(args.arrow_batch_rows)}
            if args.arrow_batch_rows
            else {}
        )
        spark = spark_session(**arrow_conf)

        def stream_df() -> Any:
            return (
                spark.read.format("headwater")
                .option("server", server)
                .option("stream", "bench")
                .load()
            )

        assert stream_df().rdd.getNumPartitions() == args.partitions
        parquet = root / "parquet"
        stream_df().write.parquet(str(parquet))  # one file per input (stream) partition
        assert spark.read.parquet(str(parquet)).count() == args.events

        read_hw, read_pq, write_hw, write_pq = [], [], [], []
        cpu: dict[str, list[dict[str, float]]] = {
            "read hw": [],
            "read pq": [],
            "write hw": [],
            "write pq": [],
        }

        def measured(side: str, action: Any) -> float:
            """Wall seconds of ``action``; each role's CPU seconds kept under ``side``."""
            before = cpu_by_process({hw_server.pid: "server"})
            took = timed(action)
            after = cpu_by_process({hw_server.pid: "server"})
            cpu[side].append({r: after.get(r, 0.0) - before.get(r, 0.0) for r in ROLES})
            return took

        with headwater.connect(server) as hw, hw.http_api() as api:
            for run in range(args.repeat):
                sides = [("hw", read_hw), ("pq", read_pq)]
                for side, out in sides if run % 2 == 0 else sides[::-1]:
                    df = stream_df() if side == "hw" else spark.read.parquet(str(parquet))
                    out.append(
                        measured(
                            f"read {side}",
                            lambda df=df: df.write.format("noop").mode("overwrite").save(),
                        )
                    )
                for side in ("hw", "pq") if run % 2 == 0 else ("pq", "hw"):
                    rows = spark.read.parquet(str(parquet)).select("key", "value")
                    if side == "hw":
                        create(api, f"copy{run}", args.partitions)
                        writer = (
                            rows.write.format("headwater")
                            .option("server", server)
                            .option("stream", f"copy{run}")
                            .mode("append")
                        )
                        write_hw.append(measured("write hw", writer.save))
                    else:
                        target = str(root / f"copy{run}")
                        write_pq.append(
                            measured("write pq", lambda t=target, r=rows: r.write.parquet(t))
                        )
                        shutil.rmtree(target)
            for run in range(args.repeat):
                copied = api.stream(f"copy{run}")["partition_offsets"]
                assert sum(p["next_offset"] for p in copied) == args.events
            source = api.stream("bench")["partition_offsets"]
            # Keys land where the fill put them (murmur2): the same per-partition counts.
            assert [p["next_offset"] for p in copied] == [p["next_offset"] for p in source]
        spark.stop()
    finally:
        hw_server.stop()
        shutil.rmtree(root, ignore_errors=True)

    results = {
        "events": args.events,
        "partitions": args.partitions,
        "arrow_batch_rows": args.arrow_batch_rows or 10_000,
        "repeat": args.repeat,
        "fill_events_per_s": args.events / fill_s,
        **spark_rates(
            args.events,
            {
                "read": {"headwater": read_hw, "parquet": read_pq},
                "write": {"headwater": write_hw, "parquet": write_pq},
            },
        ),
        "cpu_s": cpu,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    report(results, markdown, args.out)
    return 0


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"{results['events']:,} events in {results['partitions']} partitions, Arrow batches "
        f"of {results['arrow_batch_rows']:,} rows, median of "
        f"{results['repeat']} (load {results['load_before']:.1f} before, "
        f"{results['load_after']:.1f} after)",
        "",
        *spark_table(results, with_runs=True),
        "",
        *cpu_table(results["cpu_s"], results["events"]),
    ]
    return "\n".join(lines)


def cpu_table(cpu_s: dict[str, list[dict[str, float]]], events: int) -> list[str]:
    """Each side's CPU seconds per million rows by role (``cpu_s[side]``: one dict of
    role seconds per run), median and every run's."""
    lines = [
        "CPU seconds per million rows, median over the runs (each run's in brackets):",
        "",
        "| side | " + " | ".join(ROLES) + " |",
        "|---|" + "--:|" * len(ROLES),
    ]
    per_million = 1e6 / events
    for side, runs in cpu_s.items():
        cells = []
        for role in ROLES:
            spent = [run[role] * per_million for run in runs]
            each = ", ".join(f"{s:.2f}" for s in spent)
            cells.append(f"{statistics.median(spent):.2f} ({each})")
        lines.append(f"| {side} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
