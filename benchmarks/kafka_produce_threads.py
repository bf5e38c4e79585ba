#!/usr/bin/env python3
"""Where a Kafka produce's server time goes besides Python: the threads it wakes
(issue 19). One real ``headwater serve``; ``kafka_bench``'s raw client (one socket,
Produce requests of 2,000 records cut into one batch per partition, 4 in flight) sends
``--messages`` records over ``--partitions`` partitions, ``--rounds`` times.

Per round, from ``/proc/<pid>/task/*``: each thread's CPU and voluntary / involuntary
context switches over the produce, per request. The event loop thread is the process's
main thread; the others, busy during a produce, are the fsync threads (the SQL
projection's catch-up waits for the writes to pause, past these short runs). With
``--strace``, one more round under ``strace -c -f`` counts the server's ``futex``,
``fdatasync``, ``pwrite64`` and ``io_submit``/``io_getevents`` (the active segments'
fsyncs through Linux AIO) calls per request (strace slows the round:
its rate is not reported). Markdown on stdout.

    .venv/bin/python benchmarks/kafka_produce_threads.py --partitions 4 --strace
    .venv/bin/python benchmarks/kafka_produce_threads.py --partitions 4 --sync none
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import kafka_bench as kb
from benchlib import HelpFormatter, default_root, git_revision, loadavg, log, proc_cpu, report
from headwater.protocols.kafka.apis import ApiKey

RESULTS = Path(__file__).parent / "results"
RECORDS_PER_REQUEST = 2_000
STRACED = ("futex", "fdatasync", "pwrite64", "io_submit", "io_getevents")


def switches(pid: int, tid: str) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    voluntary = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.MULTILINE)
    involuntary = re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", status, re.MULTILINE)
    assert voluntary and involuntary, status
    return int(voluntary.group(1)), int(involuntary.group(1))


def threads(pid: int) -> dict[str, tuple[float, int, int]]:
    """Thread id -> (CPU seconds, voluntary, involuntary switches) so far."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[tid] = (proc_cpu(pid, int(tid)), *switches(pid, tid))
        except (OSError, AssertionError):
            continue  # the thread ended meanwhile
    return out


def produce_round(
    client: kb.RawKafka, frames: Any, counts: Any, requests: int, version: int
) -> float:
    started = time.perf_counter()
    kb.raw_produce(client, frames, counts, requests, 4, version)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--messages", type=int, default=1_600_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strace", action="store_true", help="one more round under strace -c")
    parser.add_argument(
        "--sync", default="", help='the server\'s [storage] sync ("none": no fsyncs); default fsync'
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "kafka_produce_threads.json")
    args = parser.parse_args()
    if args.strace and shutil.which("strace") is None:
        parser.error("--strace needs strace (Debian's strace package)")
    requests = args.messages // RECORDS_PER_REQUEST
    root = default_root("kafka-threads-")
    server = kb.HeadwaterServer()
    extra = f'[storage]\nsync = "{args.sync}"\n' if args.sync else ""
    server.start(root, extra_config=extra, listeners=("kafka", "kimberlite"))
    pid = server.pid
    rounds: list[dict[str, Any]] = []
    traced: dict[str, float] = {}
    loads = [loadavg()]
    try:
        port = server.ports["kafka"]
        version = kb.raw_versions([port])[ApiKey.PRODUCE]
        topic = kb.create_topic(f"{kb.HOST}:{port}", args.partitions)
        client = kb.RawKafka(port)
        work = kb.Workload(100, RECORDS_PER_REQUEST, 8)
        frames, counts = kb.produce_frames(topic, args.partitions, work, version)
        produce_round(client, frames, counts, 50, version)  # warm: connections, the topic's files
        for n in range(args.rounds):
            kb.settle([pid], 60)
            before = threads(pid)
            seconds = produce_round(client, frames, counts, requests, version)
            after = threads(pid)
            rows = []
            for tid, (cpu, vol, invol) in after.items():
                was = before.get(tid, (0.0, 0, 0))
                delta = (cpu - was[0], vol - was[1], invol - was[2])
                if delta[0] > 0.005 or delta[1] > requests // 10:
                    rows.append(
                        {
                            "thread": "event loop" if tid == str(pid) else f"thread {tid}",
                            "cpu_s": round(delta[0], 3),
                            "voluntary_per_request": round(delta[1] / requests, 2),
                            "involuntary_per_request": round(delta[2] / requests, 2),
                        }
                    )
            rows.sort(key=lambda r: (r["thread"] != "event loop", -r["cpu_s"]))
            rate = requests * RECORDS_PER_REQUEST / seconds
            rounds.append({"msgs_per_s": round(rate), "threads": rows})
            log(f"round {n}: {rate:,.0f} msgs/s")
        if args.strace:
            kb.settle([pid], 60)
            trace = root / "strace.txt"
            tracer = subprocess.Popen(
                ["strace", "-c", "-f", "-e", f"trace={','.join(STRACED)}", "-p", str(pid)],
                stderr=trace.open("w"),
            )
            time.sleep(1.0)  # attached to every thread before the round starts
            produce_round(client, frames, counts, requests, version)
            tracer.send_signal(2)
            tracer.wait(30)
            for line in trace.read_text().splitlines():
                fields = line.split()
                if fields and fields[-1] in STRACED:
                    traced[fields[-1]] = round(int(fields[3]) / requests, 2)
        client.close()
    finally:
        server.stop()
        loads.append(loadavg())
    results = {
        "revision": git_revision(),
        "partitions": args.partitions,
        "requests_per_round": requests,
        "load": loads,
        "rounds": rounds,
        "syscalls_per_request": traced,
        "median_msgs_per_s": statistics.median(r["msgs_per_s"] for r in rounds),
    }
    report(results, markdown, args.out)


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Raw Kafka produce, {results['partitions']} partitions, "
        f"{results['requests_per_round']} requests a round (load {results['load']}); "
        f"median {results['median_msgs_per_s']:,} msgs/s",
        "",
        "| round | thread | CPU s | voluntary switches / request | involuntary / request |",
        "|---|---|--:|--:|--:|",
    ]
    for n, round_ in enumerate(results["rounds"]):
        for row in round_["threads"]:
            lines.append(
                f"| {n} | {row['thread']} | {row['cpu_s']:.2f} | "
                f"{row['voluntary_per_request']:.1f} | {row['involuntary_per_request']:.1f} |"
            )
    if results["syscalls_per_request"]:
        lines += ["", "Under strace -c -f, per request:", ""]
        lines += [f"* {name}: {count}" for name, count in results["syscalls_per_request"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
