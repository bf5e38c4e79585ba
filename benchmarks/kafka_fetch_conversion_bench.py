#!/usr/bin/env python3
"""The Kafka Fetch of a batch stored in headwater's form (a Kimberlite, HTTP or SDK
producer's), both encoders in one process, rounds alternating: ``as_kafka_batch``
(numpy columns and byte masks, what a Fetch uses from 64 events) against the
record-by-record encoder it replaced (a ``Record`` per event through ``build_batch``,
still used for events with headers and short batches). Each checks the other's bytes.
Best of ``--repeat`` per batch shape, µs per event; Markdown on stdout.

    .venv/bin/python benchmarks/kafka_fetch_conversion_bench.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from benchlib import HelpFormatter, loadavg
from headwater.server.kafka.handlers import _kafka_records, _producer_fields, as_kafka_batch
from headwater.storage.batch import Batch, encode_batch

SHAPES = (
    (10_000, "100 B values"),
    (10_000, "100 B values, 6-10 B keys"),
    (1_000, "100 B values"),
    (100, "100 B values"),
)


def best(encode: Callable[..., bytes], batch: Batch, count: int, repeat: int) -> float:
    """The least seconds of ``repeat`` encodings of ``batch``'s ``count`` events."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        encode(batch, 0, count)
        times.append(time.perf_counter() - started)
    return min(times)


def record_by_record(batch: Batch, start: int, stop: int) -> bytes:
    return _kafka_records(batch, start, stop, _producer_fields(batch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    print(f"load {loadavg()}\n")
    print("| events | shape | record by record µs/event | batch-at-a-time µs/event | ratio |")
    print("|--:|---|--:|--:|--:|")
    for count, shape in SHAPES:
        keys = [b"key-%d" % i for i in range(count)] if "keys" in shape else None
        batch = Batch(
            memoryview(
                encode_batch(
                    [b"v" * 100] * count, base_offset=0, first_position=0, timestamp_ms=1, keys=keys
                )
            )
        )
        assert as_kafka_batch(batch, 0, count) == record_by_record(batch, 0, count)
        old = new = float("inf")
        for _ in range(3):  # alternating, so the machine's load falls on both alike
            old = min(old, best(record_by_record, batch, count, args.repeat))
            new = min(new, best(as_kafka_batch, batch, count, args.repeat))
        print(
            f"| {count:,} | {shape} | {old / count * 1e6:.2f} | {new / count * 1e6:.2f}"
            f" | {new / old:.2f} |"
        )


if __name__ == "__main__":
    main()
