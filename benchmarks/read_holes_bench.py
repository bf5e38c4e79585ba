#!/usr/bin/env python3
"""Server CPU per Kimberlite ReadEvents, this checkout against another (``--before SRC``)
on the same data: does answering consecutive offsets only (PartitionLog.read's
``contiguous``, docs/protocols/kimberlite.md "ReadEvents over compacted streams") cost
the common read of a log without holes anything?

One data directory is written once by this checkout's server: a stream of ``--batches``
appends of ``--per`` events of ``--size`` bytes (one stored batch each: the per-batch
work of a read is what the change touches) and a compacted stream (keyed events, every
other key written once, so compaction leaves a hole after every other event). Then, for
each of ``--rounds``, each server in turn (the other checkout first, then this one), a
fresh process on the same files, is read whole from offset 0 by one SDK client paging by
next_offset, with 1 MiB pages (whole batches) and 4 KiB pages (cut inside batches). The
server's CPU seconds per read (warm: the files read once untimed before) are the
measure; the load average is recorded beside them. The compacted stream's pages and
events show what the holes cost this checkout (the other answers it wrongly: its
events' offsets are counted over the holes).

Beside the servers, the read itself in one process (``PartitionLog.read`` as ReadEvents
calls it, with ``contiguous`` where the revision has it), each revision in a process of
its own on the same log files, CPU per read as the best of 10 passes: 1 MiB pages over
batches of ``--per`` events (whole batches) and 4 KiB pages over batches of 1,000 events
(cut inside batches). Without the sockets and the event loop this is the precise figure.

    .venv/bin/python benchmarks/read_holes_bench.py --before /tmp/wt-old/src
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import headwater
from benchlib import (
    HeadwaterServer,
    HelpFormatter,
    default_root,
    git_revision,
    loadavg,
    log,
    proc_cpu,
    settle,
)

PLAIN, COMPACTED = "plain", "compacted"
PAGES = {"1MiB": 1 << 20, "4KiB": 4 << 10}
COMPACTED_ROUNDS = 50  # of 40 keyed events: ~1,000 runs of one event each after compaction
CONFIG = '[storage]\nsync = "none"\nmaintenance_interval_ms = 100\n'


LOG_PAGES = {"small": 1 << 20, "big": 4 << 10}  # log directory -> max_bytes


def write_logs(root: Path, args: argparse.Namespace) -> None:
    """The in-process reads' logs: ``--batches`` batches of ``--per`` events, and batches
    of 1,000 events of the same total."""
    from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy

    config = LogConfig(sync=SyncPolicy("none"), segment_bytes=64 << 20)
    for name, per, batches in (
        ("small", args.per, args.batches),
        ("big", 1000, max(1, args.batches * args.per // 1000)),
    ):
        plog = PartitionLog.open(root / f"log-{name}", config)
        values = [b"v" * args.size] * per
        for _ in range(batches):
            plog.append(values, first_position=0, timestamp_ms=0)
        plog.close()


def log_reads(root: Path) -> dict[str, float]:
    """CPU µs per read of each log, read whole from 0 (best of 10 passes)."""
    import inspect

    from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy

    config = LogConfig(sync=SyncPolicy("none"), segment_bytes=64 << 20)
    known = inspect.signature(PartitionLog.read).parameters
    options: dict[str, Any] = {"contiguous": True} if "contiguous" in known else {}
    out: dict[str, float] = {}
    for name, max_bytes in LOG_PAGES.items():
        plog = PartitionLog.open(root / f"log-{name}", config)
        best = float("inf")
        for _ in range(10):
            started = time.process_time()
            reads = 0
            offset: int | None = 0
            while offset is not None:
                # As ReadEvents asks (server/kimberlite/commands/read.py's limits).
                result = plog.read(offset, max_bytes, max_events=(12 << 20) // 8 - 1, **options)
                reads += 1
                offset = result.next_offset
            best = min(best, (time.process_time() - started) / reads)
        out[f"in-process {name} batches us_per_read"] = best * 1e6
        plog.close()
    return out


def log_reads_of(root: Path, src: Path | None) -> dict[str, float]:
    """:func:`log_reads` in a process running ``src`` (this checkout's when None)."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    command = [sys.executable, __file__, "--log-reads", str(root)]
    done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    result: dict[str, float] = json.loads(done.stdout)
    return result


def write(root: Path, args: argparse.Namespace) -> None:
    write_logs(root, args)
    server = HeadwaterServer()
    server.start(root, CONFIG, listeners=("kimberlite", "http"))
    try:
        settings = {"cleanup_policy": "compact", "segment_bytes": 64 << 10}
        body = {"name": COMPACTED, "settings": settings}
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.ports['http']}/api/streams",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=30).close()
        asyncio.run(append_plain(f"127.0.0.1:{server.port}", args))
        with headwater.connect(f"127.0.0.1:{server.port}") as client:
            for round_ in range(COMPACTED_ROUNDS):
                keys = [b"k%d" % (i % 7) if i % 2 else b"%d.%d" % (round_, i) for i in range(40)]
                client.append(COMPACTED, [b"c" * args.size] * 40, keys=keys)
            # Keyless events push the keyed ones into sealed segments, which compaction
            # rewrites; wait for it to be done (the stream's size stops falling).
            for _ in range(2):
                client.append(COMPACTED, [b"f" * (40 << 10)])
            size = -1
            while size != (size := client.stream_info(COMPACTED).size_bytes):
                time.sleep(1)
    finally:
        server.stop()


async def append_plain(address: str, args: argparse.Namespace) -> None:
    """``--batches`` appends, 100 in flight: each one stored batch."""
    values = [b"v" * args.size] * args.per
    async with headwater.connect_async(address) as client:
        await client.create_stream(PLAIN)
        for start in range(0, args.batches, 100):
            count = min(100, args.batches - start)
            await asyncio.gather(*(client.append(PLAIN, values) for _ in range(count)))


def read_all(address: str, stream: str, max_bytes: int) -> tuple[int, int]:
    """(pages, events) of reading ``stream`` from 0 to its end."""
    pages = events = 0
    with headwater.connect(address) as client:
        offset = 0
        while True:
            page = client.read(stream, offset, max_bytes)
            pages += 1
            events += len(page.events)
            if page.at_end:
                return pages, events
            offset = page.next_offset


def one_run(root: Path, src: Path | None, passes: int) -> dict[str, float]:
    server = HeadwaterServer(src=src)
    (root / "headwater-ports.json").unlink()  # the last server's: this one writes its own
    server.start(root, CONFIG)
    try:
        address = f"127.0.0.1:{server.port}"
        settle([server.pid], 30)
        read_all(address, PLAIN, 1 << 20)  # warm: the files in the page cache
        out: dict[str, float] = {}
        # Enough reads of each kind for the CPU clock's 10 ms ticks not to matter.
        passes_of = {
            (PLAIN, "1MiB"): passes,
            (PLAIN, "4KiB"): max(1, passes // 4),
            (COMPACTED, "1MiB"): 1,
            (COMPACTED, "4KiB"): 1,
        }
        for stream in (PLAIN, COMPACTED):
            for name, max_bytes in PAGES.items():
                settle([server.pid], 30)
                before = proc_cpu(server.pid)
                passes = passes_of[stream, name]
                for _ in range(passes):
                    pages, events = read_all(address, stream, max_bytes)
                cpu = (proc_cpu(server.pid) - before) / passes
                out[f"{stream} {name} server_us_per_read"] = cpu / pages * 1e6
                out[f"{stream} {name} pages"] = pages
                out[f"{stream} {name} events"] = events
        return out
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--before", type=Path, default=None, help="another checkout's src/")
    p.add_argument("--batches", type=int, default=20_000, help="appends to the plain stream")
    p.add_argument("--per", type=int, default=10, help="events per append")
    p.add_argument("--size", type=int, default=100, help="bytes per event")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--passes", type=int, default=20, help="whole reads per 1 MiB-page run")
    p.add_argument("--root", type=Path, default=None, help="scratch directory (removed)")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    p.add_argument("--log-reads", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.log_reads is not None:  # one revision's in-process reads (log_reads_of)
        print(json.dumps(log_reads(args.log_reads)))
        return 0
    root = args.root or default_root("headwater-read-holes-")
    root.mkdir(parents=True, exist_ok=True)
    try:
        log(f"writing {args.batches} batches of {args.per} x {args.size} B")
        write(root, args)
        systems: dict[str, Path | None] = {"this": None}
        if args.before is not None:
            systems = {"before": args.before, "this": None}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
        loads = [loadavg()[0]]
        for round_no in range(args.rounds):
            for name, src in systems.items():
                runs[name].append(one_run(root, src, args.passes) | log_reads_of(root, src))
                log(f"round {round_no + 1} {name}: {runs[name][-1]}")
            loads.append(loadavg()[0])
        medians = {
            name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            for name, rs in runs.items()
        }
        result: dict[str, Any] = {
            "revision": git_revision(),
            "before": str(args.before) if args.before else None,
            "loads": loads,
            "medians": medians,
        }
        for key, value in medians["this"].items():
            line = f"{key}: {value:,.1f}"
            if "before" in medians and key.endswith("us_per_read") and COMPACTED not in key:
                line += f" (before {medians['before'][key]:,.1f}: "
                line += f"{value / medians['before'][key]:.3f}x)"
            print(line)
        print(f"load average over the run: {', '.join(f'{x:.1f}' for x in loads)}")
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=2))
        return 0
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
