#!/usr/bin/env python3
"""Cold ReadEvents from offset 0 against a raw sequential read of the same segment files,
with the server of another checkout beside this one on the same data (issue 16's cold
read goal: ReadEvents / raw >= 0.8).

One data directory of ``--mib`` MiB of 1,000-byte events (``memory_bench``'s events, 1,000
a batch) is written once by this checkout's server. Then, for each of ``--rounds``: the
raw read (``os.read`` of the partition's segment files, 4 MiB at a time), then each
server in turn (``--before SRC``, another checkout's ``src``, first when given, then this
one), a fresh process on the same files, read by one client (``--clients``:
``memory_bench.read_all``, received into one reused buffer, or ``wire_bench.hw_consume``,
the protocol's incremental decoder; one 8 MiB ReadEvents at a time), cold (page cache
dropped before, needs root) and then warm (the files read once untimed before), each once
the fresh server is idle. Server and client CPU seconds, and the bytes the server had
read from the disk (against the files' size), are recorded per run: with two
cores shared with other work, the ratio falls with the load, the CPU per GB much less.
A second reference, the same files read cold with O_DIRECT (8 MiB reads into one aligned
buffer: the disk without the page cache, as the server reads cold data), is shown beside
the raw read; ratios are against the raw read.

    .venv/bin/python benchmarks/cold_read_bench.py --mib 2048 --before /tmp/wt-old/src
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib import HeadwaterServer, default_root, git_revision, loadavg, log, proc_cpu, settle
from memory_bench import BATCH, BIG_STREAM, DEPTH, EVENT_BYTES, MIB, READ_PAGE, BigEvents, read_all
from storage_bench import can_drop_caches, drop_caches, read_raw_files
from wire_bench import KimberliteClient, hw_consume, hw_produce

CLIENTS: dict[str, Callable[[KimberliteClient, int, int, int], int]] = {
    "into": read_all,
    "decoder": hw_consume,
}


def read_raw_direct(paths: list[Path]) -> int:
    """The files read with O_DIRECT, 8 MiB at a time into one page-aligned buffer."""
    buffer = mmap.mmap(-1, READ_PAGE)
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        pos = 0
        try:
            while n := os.preadv(fd, [buffer], pos):
                pos += n
        finally:
            os.close(fd)
        total += pos
    return total


def disk_read_bytes(pid: int) -> int:
    """Bytes the process has had fetched from storage (/proc/<pid>/io: page cache fills
    and direct reads, not reads served from the cache)."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["read_bytes"])


def build(root: Path, mib: int) -> tuple[int, int]:
    server = HeadwaterServer()
    server.start(root)
    try:
        client = KimberliteClient(server.port)
        stream_id = client.create_stream(BIG_STREAM)
        batches = mib * MIB // EVENT_BYTES // BATCH
        events = hw_produce(client, stream_id, BigEvents(), batches, DEPTH, client_encode=False)
        client.close()
    finally:
        server.stop()
    return stream_id, events


def run_server(
    server: HeadwaterServer, root: Path, stream_id: int, events: int, cold: bool, client_name: str
) -> dict[str, Any]:
    (root / "headwater-ports.json").unlink(missing_ok=True)
    server.start(root)
    try:
        client = KimberliteClient(server.port)
        # A fresh server opens its SQL projections in the background for a second or
        # two: measure the read, not that (memory_bench reads a server long started).
        settled_s = settle([server.pid], 30)
        if cold:
            drop_caches()
        else:
            # A cold read goes around the page cache (O_DIRECT) and leaves it empty:
            # warm means the files are cached, so cache them first (untimed).
            read_raw_files(sorted((root / "headwater-data").rglob("*.log")))
        cpu = (proc_cpu(server.pid), proc_cpu(os.getpid()))
        disk = disk_read_bytes(server.pid)
        began = time.perf_counter()
        CLIENTS[client_name](client, stream_id, events, READ_PAGE)
        seconds = time.perf_counter() - began
        result = {
            "s": seconds,
            "server_cpu_s": proc_cpu(server.pid) - cpu[0],
            "client_cpu_s": proc_cpu(os.getpid()) - cpu[1],
            "server_disk_read_bytes": disk_read_bytes(server.pid) - disk,
            "settled_s": settled_s,
        }
        client.close()
    finally:
        server.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=2048, help="data written (MiB)")
    p.add_argument("--before", type=Path, default=None, help="another checkout's src/")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--clients",
        default="into",
        help=f"reading clients, comma-separated, each against every server: {', '.join(CLIENTS)}",
    )
    p.add_argument("--root", type=Path, default=None, help="scratch directory (removed)")
    p.add_argument("--quick", action="store_true", help="64 MiB, one round")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.mib, args.rounds = 64, 1
    root = args.root or default_root("headwater-cold-read-bench-")
    root.mkdir(parents=True, exist_ok=True)
    servers = {"this": HeadwaterServer(name="this")}
    if args.before is not None:
        servers = {"before": HeadwaterServer(src=args.before, name="before"), **servers}
    clients = args.clients.split(",")
    if unknown := set(clients) - set(CLIENTS):
        p.error(f"unknown clients {sorted(unknown)}: pick from {', '.join(CLIENTS)}")
    results: dict[str, Any] = {
        "revision": git_revision(),
        "before": str(args.before) if args.before else None,
        "clients": clients,
        "drop_caches": can_drop_caches(),
        "loadavg_before": loadavg(),
        "runs": [],
    }
    try:
        stream_id, events = build(root, args.mib)
        files = sorted((root / "headwater-data").rglob("*.log"))
        file_bytes = sum(f.stat().st_size for f in files)
        results.update(events=events, file_bytes=file_bytes, segment_files=len(files))
        for _ in range(args.rounds):
            if can_drop_caches():
                drop_caches()
            began = time.perf_counter()
            read_raw_files(files)
            results["runs"].append({"side": "raw", "cold": True, "s": time.perf_counter() - began})
            if can_drop_caches():
                drop_caches()
                began = time.perf_counter()
                read_raw_direct(files)
                seconds = time.perf_counter() - began
                results["runs"].append({"side": "raw (O_DIRECT)", "cold": True, "s": seconds})
            for name, server in servers.items():
                for client_name in clients:
                    side = name if len(clients) == 1 else f"{name}, {client_name} client"
                    for cold in (True, False):
                        run = run_server(
                            server, root, stream_id, events, cold and can_drop_caches(), client_name
                        )
                        results["runs"].append({"side": side, "cold": cold, **run})
                        rate = file_bytes / run["s"] / 1e6
                        log(f"{side} {'cold' if cold else 'warm'}: {rate:.0f} MB/s")
            results["runs"][-1]["loadavg"] = loadavg()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["loadavg_after"] = loadavg()
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2, default=str))
    print(markdown(results))
    return 0


def markdown(results: dict[str, Any]) -> str:
    size = results["file_bytes"]
    runs = results["runs"]
    raw = [r["s"] for r in runs if r["side"] == "raw"]
    lines = [
        f"Cold read of {size / 1e9:.2f} GB ({results['segment_files']} segment files,"
        f" {results['events']:,} events), revision {results['revision']}"
        f" (before: {results['before']}; clients: {', '.join(results['clients'])});"
        f" load average {results['loadavg_before']} before,"
        f" {results['loadavg_after']} after; page cache dropped: {results['drop_caches']}.",
        "",
        "| side | cache | MB/s (each round) | / raw cold (mean times) | server CPU s"
        " | client CPU s | server disk reads / file bytes |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    sides = dict.fromkeys(r["side"] for r in runs)
    for side in sides:
        for cold in (True, False):
            rs = [r for r in runs if r["side"] == side and r["cold"] == cold]
            if not rs:
                continue
            mean = sum(r["s"] for r in rs) / len(rs)
            rates = ", ".join(f"{size / r['s'] / 1e6:.0f}" for r in rs)
            cpu = [
                ", ".join(f"{r[k]:.2f}" for r in rs) if k in rs[0] else "-"
                for k in ("server_cpu_s", "client_cpu_s")
            ]
            disk = (
                ", ".join(f"{r['server_disk_read_bytes'] / size:.2f}" for r in rs)
                if "server_disk_read_bytes" in rs[0]
                else "-"
            )
            ratio = (sum(raw) / len(raw)) / mean
            cache = "dropped" if cold and results["drop_caches"] else "warm"
            lines.append(
                f"| {side} | {cache} | {rates} | {ratio:.2f} | {cpu[0]} | {cpu[1]} | {disk} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
