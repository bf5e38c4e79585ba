#!/usr/bin/env python3
"""Segment compression: size and read cost of compressed sealed segments (issue 16).

One log of JSON-like events (fields of varied values, as application events have) is
written plain, then copied and compressed with each codec (``PartitionLog.compress``,
what maintenance runs). For each of none, lz4 and zstd:

* bytes on disk and the ratio to plain;
* compress time (the maintenance rewrite) in MB/s of plain segment bytes;
* a sequential read of the whole log through ``PartitionLog.read(offset, 1 MiB)`` taking
  ``values_chunks()`` (the wire path: what ReadEvents and subscriptions do), warm (after an
  untimed pass), in MB/s of event values;
* the same through the decoding ``events()`` iterator;
* point reads: ``read(offset, 1000)`` at random offsets, median microseconds.

Run ``python benchmarks/compression_bench.py [--mib 256] [--event-bytes 600]``; results go
to stdout as a markdown table (docs/benchmarks.md, "Segment compression").
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy

MIB = 1 << 20
CODECS = ("none", "lz4", "zstd")
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
]


def make_event(rng: random.Random, i: int, size: int) -> bytes:
    body = {
        "id": i,
        "ts": 1_760_000_000_000 + i * 17,
        "user": f"user-{rng.randrange(50_000)}",
        "session": f"{rng.getrandbits(64):016x}",
        "action": rng.choice(["view", "click", "add_to_cart", "purchase", "search"]),
        "page": f"/items/{rng.randrange(10_000)}",
        "price": round(rng.uniform(1, 500), 2),
        "tags": rng.sample(WORDS, 3),
    }
    text = json.dumps(body)
    while len(text) < size - 20:
        text = text[:-1] + f', "note{len(text)}": "{" ".join(rng.sample(WORDS, 4))}"}}'
    return text.encode()


def write_log(directory: Path, mib: int, event_bytes: int, per_batch: int) -> tuple[int, int]:
    rng = random.Random(16)
    config = LogConfig(sync=SyncPolicy("none"), segment_bytes=64 * MIB)
    plog = PartitionLog.open(directory, config)
    events = value_bytes = 0
    while value_bytes < mib * MIB:
        batch = [make_event(rng, events + k, event_bytes) for k in range(per_batch)]
        plog.append(batch, first_position=events)
        events += len(batch)
        value_bytes += sum(map(len, batch))
    plog.roll()  # everything sealed: every segment is compressed
    plog.close()
    return events, value_bytes


def scan_chunks(plog: PartitionLog) -> int:
    offset, total = 0, 0
    while True:
        result = plog.read(offset, 1 * MIB)
        total += sum(len(chunk) for chunk in result.values_chunks())
        if result.next_offset is None:
            return total
        offset = result.next_offset


def scan_events(plog: PartitionLog) -> int:
    return sum(len(event.value) for event in plog.events(0))


def timed(fn: object, *args: object) -> float:
    began = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB of event values")
    parser.add_argument("--event-bytes", type=int, default=600)
    parser.add_argument("--per-batch", type=int, default=10, help="events per append")
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hw-compress-", dir=args.root))
    try:
        plain_dir = root / "none"
        events, value_bytes = write_log(plain_dir, args.mib, args.event_bytes, args.per_batch)
        plain_size = sum(p.stat().st_size for p in plain_dir.glob("*.log"))
        print(
            f"{events} events, {value_bytes / MIB:.0f} MiB of values in batches of"
            f" {args.per_batch}, {plain_size / MIB:.0f} MiB of plain segments\n"
        )
        print(
            "| codec | on disk MiB | ratio | compress MB/s | read (wire) MB/s |"
            " read (events) MB/s | point read µs |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        rng = random.Random(7)
        points = [rng.randrange(events) for _ in range(2000)]
        for codec in CODECS:
            directory = root / codec
            if codec != "none":
                shutil.copytree(plain_dir, directory)
            config = LogConfig(sync=SyncPolicy("none"), segment_bytes=64 * MIB, compression=codec)
            plog = PartitionLog.open(directory, config)
            compress_s = timed(plog.compress) if codec != "none" else 0.0
            size = sum(s.size for s in plog.segments)
            assert scan_chunks(plog) >= value_bytes  # warm-up pass, and a check
            chunks_s = min(timed(scan_chunks, plog) for _ in range(3))
            events_s = min(timed(scan_events, plog) for _ in range(2))
            point_us = []
            for offset in points:
                began = time.perf_counter()
                plog.read(offset, 1000)
                point_us.append((time.perf_counter() - began) * 1e6)
            plog.close()
            mbps = value_bytes / 1e6
            compress = f"{plain_size / 1e6 / compress_s:.0f}" if compress_s else "-"
            print(
                f"| {codec} | {size / MIB:.1f} | {plain_size / size:.2f} | {compress} |"
                f" {mbps / chunks_s:.0f} | {mbps / events_s:.0f} |"
                f" {statistics.median(point_us):.0f} |"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
