#!/usr/bin/env python3
"""Where the CPU of a Spark read goes: wall time and CPU seconds of each process (the
headwater server, PySpark's Python workers, the Spark JVM) for one read of a whole stream
into the ``noop`` sink, for

* ``http``: the ``headwater`` format against a server with its HTTP API (the default:
  columnar range reads);
* ``kimberlite``: the same against a server with only the Kimberlite listener (the
  fallback: ReadEvents pages);
* ``parquet``: the same rows from Parquet on local disk;
* ``ceiling``: a Python data source that only yields prebuilt record batches of the same
  schema, 65,536 rows each (no server): what PySpark's Python Data Source API allows.

``local[2]``, 2 input partitions each; sides alternate, ``--repeat`` times (the first
round warms the JVM up). Markdown on stdout.

    .venv/bin/python benchmarks/spark_read_profile.py --events 5000000
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import HeadwaterServer
from spark_bench import fill

_TICK = os.sysconf("SC_CLK_TCK")
CEILING_ROWS = 65_536


def cpu_by_process(servers: dict[int, str]) -> dict[str, float]:
    """CPU seconds so far, summed per role: each server by name, ``jvm``, ``python
    workers`` (PySpark's daemon and workers)."""
    out: dict[str, float] = {}
    seen: dict[int, tuple[int, str, list[str]]] = {}  # pid: (parent, command, stat fields)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        seen[int(entry)] = (int(stat[1]), cmd, stat)

    def ours(pid: int) -> bool:
        # Only this process's descendants: other users' JVMs and Python workers are not.
        while pid in seen and pid != 1:
            if pid == os.getpid():
                return True
            pid = seen[pid][0]
        return False

    for pid, (_, cmd, stat) in seen.items():
        if not ours(pid):
            continue
        if pid in servers:
            role = servers[pid]
        elif "java" in cmd:
            role = "jvm"
        elif "pyspark" in cmd:
            role = "python workers"
        else:
            continue
        ticks = int(stat[11]) + int(stat[12])
        if role == "python workers":
            # Workers that ended and were reaped by PySpark's daemon (cutime, cstime):
            # their CPU would otherwise vanish from the sum between two readings.
            ticks += int(stat[13]) + int(stat[14])
        out[role] = out.get(role, 0.0) + ticks / _TICK
    return out


def ceiling_source(events: int) -> Any:
    """A data source yielding ``events`` rows of the read schema from prebuilt batches."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class Reader(DataSourceReader):
        def partitions(self) -> list[InputPartition]:
            return [InputPartition(0), InputPartition(1)]

        def read(self, partition: InputPartition) -> Any:
            import pyarrow as pa

            from headwater.spark.streams import ROW_SCHEMA

            n = CEILING_ROWS
            values = [
                b'{"sym":"SYM%04d","px":%d.%d,"qty":%d,"venue":"XNAS","seq":%010d}'
                % (i % 100, 100 + i % 10, i % 10, 1 + i % 500, i)
                for i in range(n)
            ]
            columns = [
                pa.nulls(n, pa.binary()),
                pa.array(values, pa.binary()),
                pa.repeat(pa.scalar("bench"), n),
                pa.repeat(pa.scalar(0, pa.int32()), n),
                pa.array(range(n), pa.int64()),
                pa.repeat(pa.scalar(0, pa.int64()), n).cast(ROW_SCHEMA.field("timestamp").type),
                pa.repeat(pa.scalar(1, pa.int32()), n),
                pa.array(range(n), pa.int64()),
            ]
            batch = pa.RecordBatch.from_arrays(columns, schema=ROW_SCHEMA)
            for _ in range(events // 2 // n):
                yield batch

    class Ceiling(DataSource):
        @classmethod
        def name(cls) -> str:
            return "ceiling"

        def schema(self) -> str:
            from headwater.spark.options import ReadOptions

            return ReadOptions.parse({"stream": "s"}).schema_ddl()

        def reader(self, schema: Any) -> DataSourceReader:
            return Reader()

    return Ceiling


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=5_000_000)
    p.add_argument("--repeat", type=int, default=4)
    args = p.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    root = Path(tempfile.mkdtemp(prefix="spark_read_profile_"))
    with_http, kimberlite_only = HeadwaterServer(), HeadwaterServer()
    (root / "http").mkdir()
    (root / "kimberlite").mkdir()
    with_http.start(root / "http", listeners=("kimberlite", "http"))
    kimberlite_only.start(root / "kimberlite", listeners=("kimberlite",))
    servers = {with_http.pid: "server", kimberlite_only.pid: "server"}
    addresses = {
        "http": f"127.0.0.1:{with_http.port}",
        "kimberlite": f"127.0.0.1:{kimberlite_only.port}",
    }
    try:
        for address in addresses.values():
            fill(address, "bench", args.events)
        spark = (
            SparkSession.builder.master("local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.driver.memory", "2g")
            .config("spark.sql.session.timeZone", "UTC")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        spark.dataSource.register(ceiling_source(args.events))
        half = str((args.events + 1) // 2)

        def frame(side: str) -> Any:
            if side == "parquet":
                return spark.read.parquet(str(root / "parquet"))
            if side == "ceiling":
                return spark.read.format("ceiling").load()
            reader = spark.read.format("headwater").option("server", addresses[side])
            return reader.option("stream", "bench").option("maxOffsetsPerPartition", half).load()

        frame("http").repartition(2).write.parquet(str(root / "parquet"))
        rows: list[tuple[int, str, float, dict[str, float]]] = []
        for run in range(args.repeat):
            for side in ("http", "kimberlite", "parquet", "ceiling"):
                before, started = cpu_by_process(servers), time.perf_counter()
                frame(side).write.format("noop").mode("overwrite").save()
                took = time.perf_counter() - started
                after = cpu_by_process(servers)
                used = {k: v - before.get(k, 0.0) for k, v in after.items()}
                rows.append((run, side, took, used))
        spark.stop()
    finally:
        with_http.stop()
        kimberlite_only.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.events:,} rows per read; CPU seconds per process role over each read\n")
    print("| round | side | wall s | server | python workers | jvm |")
    print("|--:|---|--:|--:|--:|--:|")
    for run, side, took, used in rows:
        cells = " | ".join(f"{used.get(k, 0.0):.2f}" for k in ("server", "python workers", "jvm"))
        print(f"| {run} | {side} | {took:.2f} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
