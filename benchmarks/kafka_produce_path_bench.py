#!/usr/bin/env python3
"""The Kafka front end's per-Produce work on the event loop, in-process, this checkout
against an older revision's ``src/`` (``--before-src``): the produce check of one
librdkafka-shaped batch (``RecordBatch.check_for_append``: CRC, header, every record
read by numpy), the decode of a Produce v9 request carrying it, and the build and
encoding of its answer (``server.kafka.build.build``, ``encode_response``).

The batch: ``--records`` records of ``--size``-byte values without keys or headers,
offset deltas 0..n-1 and timestamp deltas 0-5 ms spread over it, as librdkafka's
``linger.ms`` 5 makes them (its batches under ``kafka_bench``'s produce hold 750-1,300
records). With ``--vary N`` the values take ``--size`` to ``--size + N`` bytes in a
fixed scattered order instead (a producer of JSON: no two neighbours alike). Also the
check of a Produce to ``--partitions`` partitions, the same records cut into one batch
each, as the front end checks them (``checked_together`` where the revision has it, the
batches it does not pass one by one; else each one by one). Each side runs in its own
process, sides alternating round by round; the median microseconds per call, and per
record for the check. Markdown on stdout.

    .venv/bin/python benchmarks/kafka_produce_path_bench.py --before-src /tmp/wt/src
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import timeit
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchlib import HelpFormatter, git_revision, loadavg, report

RESULTS = Path(__file__).parent / "results"
CASES = ("check_for_append", "check_partitions", "decode_request", "build_answer", "encode_answer")


def measure(
    records: int, size: int, number: int, vary: int = 0, partitions: int = 4
) -> dict[str, float]:
    """Microseconds per call of each case, best of 3 repeats, in this process (whichever
    ``headwater`` it imports)."""
    from kio.schema.errors import ErrorCode

    from headwater.protocols.kafka import records as kafka_records
    from headwater.protocols.kafka.apis import ApiKey, request_type, response_type
    from headwater.protocols.kafka.frames import (
        decode_request_body,
        encode_request,
        encode_response,
        read_fixed_header,
    )
    from headwater.protocols.kafka.records import Record, build_batch, split_batches
    from headwater.server.kafka.build import build

    # 37 is prime to vary + 1 for any vary below 36: sizes scattered, each one used.
    sizes = [size + (i * 37) % (vary + 1) for i in range(records)]

    def batch_of(count: int) -> bytes:
        return build_batch(
            [Record(i, i * 6 // count, None, b"v" * sizes[i], ()) for i in range(count)],
            base_timestamp=1_700_000_000_000,
        )

    batch = batch_of(records)
    [produced] = split_batches(batch)
    parts = [split_batches(batch_of(records // partitions))[0] for _ in range(partitions)]
    together = getattr(kafka_records, "checked_together", None)

    def check_partitions() -> None:
        passed = together(parts) if together is not None else [False] * len(parts)
        for part, ok in zip(parts, passed, strict=True):
            if not ok:
                part.check_for_append()

    produce = request_type(ApiKey.PRODUCE, 9)
    module = sys.modules[produce.__module__]
    request = produce(
        transactional_id=None,
        acks=-1,
        timeout=timedelta(seconds=30),
        topic_data=(
            module.TopicProduceData(
                name="bench",
                partition_data=(module.PartitionProduceData(index=0, records=batch),),
            ),
        ),
    )
    body = encode_request(7, request)[4:]
    fixed = read_fixed_header(body)
    answer_type = response_type(ApiKey.PRODUCE, 9)
    fields = {
        "responses": [
            {
                "name": "bench",
                "partition_responses": [
                    {
                        "index": 0,
                        "error_code": ErrorCode.none,
                        "base_offset": 12_345,
                        "log_append_time": None,
                        "log_start_offset": 0,
                        "record_errors": [],
                        "error_message": None,
                    }
                ],
            }
        ],
        "throttle_time": 0,
    }
    answer = build(answer_type, fields)
    calls = {
        "check_for_append": produced.check_for_append,
        "check_partitions": check_partitions,
        "decode_request": lambda: decode_request_body(fixed, body),
        "build_answer": lambda: build(answer_type, fields),
        "encode_answer": lambda: encode_response(7, answer),
    }
    out = {}
    for name, call in calls.items():
        call()
        out[name] = min(timeit.repeat(call, number=number, repeat=3)) / number * 1e6
    return out


def run_side(src: Path | None, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--records",
        str(args.records),
        "--size",
        str(args.size),
        "--number",
        str(args.number),
        "--vary",
        str(args.vary),
        "--partitions",
        str(args.partitions),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout)
    return result


def markdown(results: dict[str, Any]) -> str:
    med, n = results["median_us"], results["config"]["records"]
    lines = [
        f"revision {results['config']['revision']}, {n} records of "
        f"{results['config']['size']}-{results['config']['size'] + results['config']['vary']}"
        f" B, load {results['config']['loadavg']}",
        "",
        f"| per Produce (check_partitions: {results['config']['partitions']} batches)"
        " | before µs | after µs | after / before |",
        "|---|--:|--:|--:|",
    ]
    for case in CASES:
        before, after = med["before"][case], med["after"][case]
        lines.append(f"| {case} | {before:.1f} | {after:.1f} | {after / before:.2f}x |")
    check = med["after"]["check_for_append"] / n, med["before"]["check_for_append"] / n
    lines.append(f"\ncheck per record: before {check[1]:.3f} µs, after {check[0]:.3f} µs")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--before-src", type=Path, help="older revision's src/")
    parser.add_argument("--records", type=int, default=1_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--vary", type=int, default=0, help="values of --size..--size+N B")
    parser.add_argument("--partitions", type=int, default=4, help="batches of check_partitions")
    parser.add_argument("--number", type=int, default=2_000, help="calls per repeat")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "kafka_produce_path.json")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.records, args.size, args.number, args.vary, args.partitions)))
        return
    if args.before_src is None:
        parser.error("--before-src is required")
    sides: dict[str, Path | None] = {"before": args.before_src, "after": None}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    loads = [loadavg()]
    for round_no in range(args.rounds):
        order = list(sides) if round_no % 2 == 0 else list(reversed(sides))
        for name in order:
            runs[name].append(run_side(sides[name], args))
        loads.append(loadavg())
    results = {
        "median_us": {
            name: {case: statistics.median(r[case] for r in rows) for case in CASES}
            for name, rows in runs.items()
        },
        "runs": runs,
        "config": {
            "records": args.records,
            "size": args.size,
            "vary": args.vary,
            "partitions": args.partitions,
            "number": args.number,
            "rounds": args.rounds,
            "revision": git_revision(),
            "loadavg": loads,
        },
    }
    RESULTS.mkdir(exist_ok=True)
    report(results, markdown, args.out)


if __name__ == "__main__":
    main()
