#!/usr/bin/env python3
"""The server's CPU per row of spark_partitions_bench's read and write, without Spark:
the same keyed 6-partition stream (its ``fill``) read whole over the HTTP records path
by two readers (one partition at a time each, as two Spark task slots do), then its
rows written back into a fresh stream by two of the Spark sink's ``PartitionedAppender``
tasks (Arrow batches of 10,000 rows, murmur2-placed, idempotent). Prints the server's
CPU µs per row read and written for each round and their medians; each phase starts
with the server idle, and a write's CPU includes the SQL projection catching up with it.

Run a revision before with ``PYTHONPATH=<checkout>/src`` (server and client from it):

    .venv/bin/python benchmarks/spark_partitions_server_bench.py --events 5000000 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa

import headwater
from benchlib import HeadwaterServer, proc_cpu
from headwater.spark.options import ConnectionOptions
from headwater.spark.streams import PartitionedAppender
from spark_partitions_bench import create, fill

PARTITIONS = 6
TASKS = 2


def settle(pid: int, timeout_s: float = 120.0) -> None:
    """Until the server is idle (under 2% of a core over half a second): the SQL
    projection catches up with appends in the background, and a round's CPU should be
    its own, not the last write's catch-up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = proc_cpu(pid)
        time.sleep(0.5)
        if proc_cpu(pid) - before < 0.01:
            return


def read_all(server: str, ends: list[int]) -> list[pa.RecordBatch]:
    """Every partition's records, two readers taking partitions in turn."""
    todo = list(range(len(ends)))
    lock = threading.Lock()
    got: list[list[pa.RecordBatch]] = [[] for _ in ends]

    def reader() -> None:
        with headwater.connect(server) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    partition = todo.pop(0)
                end = ends[partition]
                batches = client.read_arrow("bench", 0, end, partition=partition, records=True)
                got[partition] = list(batches)

    threads = [threading.Thread(target=reader) for _ in range(TASKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [batch for batches in got for batch in batches]


def write_all(server: str, stream: str, tasks: list[list[pa.RecordBatch]]) -> None:
    with headwater.connect(server) as client, client.http_api() as api:
        create(api, stream, PARTITIONS)
    conn = ConnectionOptions(server=server)
    threads = [
        threading.Thread(
            target=lambda i=i: PartitionedAppender(conn, stream, f"job-{stream}", i).append(
                iter(tasks[i])
            )
        )
        for i in range(TASKS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="spark_partitions_server_bench_"))
    server = HeadwaterServer()
    server.start(root, listeners=("kimberlite", "http"))
    address = f"127.0.0.1:{server.port}"
    try:
        fill(address, "bench", args.events, PARTITIONS)
        with headwater.connect(address) as client, client.http_api() as api:
            ends = [p["next_offset"] for p in api.stream("bench")["partition_offsets"]]
        rows = pa.Table.from_batches(read_all(address, ends)).select(["key", "data"])
        rows = rows.rename_columns(["key", "value"])
        assert rows.num_rows == args.events
        half = rows.num_rows // 2
        tasks = [rows.slice(0, half).to_batches(10_000), rows.slice(half).to_batches(10_000)]
        read_us: list[float] = []
        write_us: list[float] = []
        write_loop_us: list[float] = []
        print(f"{args.events:,} rows, {PARTITIONS} partitions, load {os.getloadavg()[0]:.1f}")
        for round_ in range(args.rounds):
            settle(server.pid)
            cpu, wall = proc_cpu(server.pid), time.perf_counter()
            read_all(address, ends)
            read_s = time.perf_counter() - wall
            read_us.append((proc_cpu(server.pid) - cpu) / args.events * 1e6)
            settle(server.pid)
            cpu, wall = proc_cpu(server.pid), time.perf_counter()
            loop = proc_cpu(server.pid, server.pid)
            write_all(address, f"copy{round_}", tasks)
            write_s = time.perf_counter() - wall
            settle(server.pid)  # the write's projection catch-up is part of the write
            write_us.append((proc_cpu(server.pid) - cpu) / args.events * 1e6)
            # The event loop's share (the append handler, HTTP); the rest is the worker
            # threads' (the SQL projection's catch-up, fsyncs).
            write_loop_us.append((proc_cpu(server.pid, server.pid) - loop) / args.events * 1e6)
            with headwater.connect(address) as client, client.http_api() as api:
                copied = api.stream(f"copy{round_}")["partition_offsets"]
            assert [p["next_offset"] for p in copied] == ends  # every row where murmur2 put it
            print(
                f"round {round_}: read {read_s:.2f} s, server {read_us[-1]:.3f} µs/row; "
                f"write {write_s:.2f} s, server {write_us[-1]:.3f} µs/row "
                f"(event loop {write_loop_us[-1]:.3f}, other threads "
                f"{write_us[-1] - write_loop_us[-1]:.3f})"
            )
        print(
            f"median server CPU µs per row: read {statistics.median(read_us):.3f}, "
            f"write {statistics.median(write_us):.3f} (event loop "
            f"{statistics.median(write_loop_us):.3f}) (load {os.getloadavg()[0]:.1f})"
        )
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
