#!/usr/bin/env python3
"""RssAnon of a partition log's sealed indexes: a log of small batches (one time index
entry per batch, an offset index entry per 4 KiB) written once, then opened in a fresh
process with ``PartitionLog.open``, which reads every sealed segment's index files, and
looked up at random offsets and timestamps (a lookup and the read after it, as
``offset_for_timestamp`` does; then the index lookups alone).

    python benchmarks/index_memory_bench.py build DIR --gib 4
    python benchmarks/index_memory_bench.py open DIR      # prints RssAnon/RssFile as JSON
    python benchmarks/index_memory_bench.py open DIR --mapped-limit 4   # past the bound

Run ``open`` with PYTHONPATH pointing at two revisions' ``src`` to compare them.
``--mapped-limit`` maps at most that many sealed indexes at once (the default is an
eighth of vm.max_map_count), so lookups over more segments unmap and map them in turn:
the cost of a data dir past the bound (a revision without the bound ignores it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from headwater.storage import segment as segment_module
from headwater.storage.batch import encode_values
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy


def status() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmRSS"):
                fields[key] = int(value.split()[0]) // 1024  # MiB
    return fields


def build(directory: Path, gib: float, batch_bytes: int) -> None:
    plog = PartitionLog.open(directory, LogConfig(sync=SyncPolicy("none")))
    section = encode_values([b"x" * (batch_bytes - 100)])
    total = int(gib * (1 << 30))
    i = 0
    while plog.size_bytes < total:
        plog.append_encoded(section, 1, first_position=i, timestamp_ms=1_000_000 + i)
        i += 1
    plog.close()
    print(json.dumps({"batches": i, "segments": len(list(directory.glob("*.log")))}))


def open_and_look_up(directory: Path, lookups: int, mapped_limit: int | None) -> None:
    set_limit = getattr(segment_module, "set_mapped_index_limit", None)
    if mapped_limit is not None and set_limit is not None:
        set_limit(mapped_limit)
    before = status()
    started = time.perf_counter()
    plog = PartitionLog.open(directory, LogConfig(sync=SyncPolicy("none")))
    opened = time.perf_counter() - started
    after_open = status()
    rng = random.Random(1)
    end = plog.end_offset
    started = time.perf_counter()
    for _ in range(lookups):
        offset = rng.randrange(end)
        seg = plog.segments[plog._segment_index(offset)]
        seg.position_for(offset)
        plog.offset_for_timestamp(1_000_000 + rng.randrange(end))
    looked_up = time.perf_counter() - started
    after_lookups = status()
    # The index lookups alone (no read after them), best of three rounds.
    sealed = plog.segments[:-1] or plog.segments
    probes = []
    for _ in range(50_000):
        seg = rng.choice(sealed)
        probes.append(
            (seg, rng.randrange(seg.base_offset, max(seg.next_offset, 1 + seg.base_offset)))
        )
    best = {"position_for": 1e9, "position_for_timestamp": 1e9}
    for _ in range(3):
        started = time.perf_counter()
        for seg, offset in probes:
            seg.position_for(offset)
        best["position_for"] = min(best["position_for"], time.perf_counter() - started)
        started = time.perf_counter()
        for seg, offset in probes:
            seg.position_for_timestamp(1_000_000 + offset)
        took = time.perf_counter() - started
        best["position_for_timestamp"] = min(best["position_for_timestamp"], took)
    plog.close()
    print(
        json.dumps(
            {
                "segments": len(plog.segments),
                "events": end,
                "open_s": round(opened, 2),
                "lookup_and_read_us": round(looked_up / lookups * 1e6, 1),
                **{f"{k}_us": round(v / len(probes) * 1e6, 2) for k, v in best.items()},
                "before_open_mib": before,
                "after_open_mib": after_open,
                "after_lookups_mib": after_lookups,
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("build", "open"))
    p.add_argument("directory", type=Path)
    p.add_argument("--gib", type=float, default=4.0, help="data to write (build)")
    p.add_argument("--batch-bytes", type=int, default=1024, help="bytes per batch (build)")
    p.add_argument("--lookups", type=int, default=20_000, help="random lookups (open)")
    p.add_argument(
        "--mapped-limit", type=int, default=None, help="sealed indexes mapped at once (open)"
    )
    args = p.parse_args(argv)
    if args.mode == "build":
        build(args.directory, args.gib, args.batch_bytes)
    else:
        open_and_look_up(args.directory, args.lookups, args.mapped_limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
