#!/usr/bin/env python3
"""headwater's SDK producer and group consumer beside confluent-kafka (issue 18).

One real ``headwater serve`` (Rivven and Kafka listeners on loopback, default
configuration: fsync on every append). Each round, side by side so the machine's load
falls on every case alike, ``--messages`` keyed records of ``--size`` bytes into a new
``--partitions``-partition stream:

* **SDK async produce**: ``headwater.AsyncProducer`` (linger 5 ms, idempotent, batches
  per stream) over the Rivven listener, from the first ``send`` to ``flush`` returning;
* **SDK blocking produce**: ``headwater.Producer``, the same from the calling thread;
* **confluent-kafka produce**: librdkafka (acks=all, linger.ms 5, murmur2_random)
  through the Kafka listener;
* **SDK consume** / **confluent-kafka consume**: the records read back by one group
  member (``AsyncConsumer.getmany`` / ``Consumer.consume``), from the first record to
  the last (the group join before it is not counted). Each consume starts once the
  server is idle (its SQL projection has caught up with the produce).

Figures are records per second; the ratio is the SDK's over confluent-kafka's of the
same round.

    .venv/bin/python benchmarks/sdk_bench.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer

import headwater
from benchlib import (
    HeadwaterServer,
    HelpFormatter,
    default_root,
    git_revision,
    loadavg,
    log,
    settle,
)
from headwater.client.consumer import AsyncConsumer
from headwater.client.producer import AsyncProducer


def sdk_async_produce(address: str, topic: str, args: argparse.Namespace) -> float:
    value = b"x" * args.size

    async def run() -> float:
        async with AsyncProducer(address, linger_ms=5) as producer:
            await producer.create_stream(topic, partitions=args.partitions)
            start = time.perf_counter()
            for i in range(args.messages):
                producer.send(topic, value, key=b"key-%d" % i)
            await producer.flush()
            return time.perf_counter() - start

    return args.messages / asyncio.run(run())


def sdk_blocking_produce(address: str, topic: str, args: argparse.Namespace) -> float:
    value = b"x" * args.size
    with headwater.Producer(address, linger_ms=5) as producer:
        producer.create_stream(topic, partitions=args.partitions)
        start = time.perf_counter()
        for i in range(args.messages):
            producer.send(topic, value, key=b"key-%d" % i)
        producer.flush()
        return args.messages / (time.perf_counter() - start)


def kafka_produce(rivven: str, kafka: str, topic: str, args: argparse.Namespace) -> float:
    with headwater.Producer(rivven) as admin:
        admin.create_stream(topic, partitions=args.partitions)
    value = b"x" * args.size
    producer = Producer(
        {
            "bootstrap.servers": kafka,
            "linger.ms": 5,
            "acks": "all",
            "partitioner": "murmur2_random",
        }
    )
    start = time.perf_counter()
    for i in range(args.messages):
        while True:
            try:
                producer.produce(topic, value, key=b"key-%d" % i)
                break
            except BufferError:
                producer.poll(0.01)
    assert producer.flush(120) == 0
    return args.messages / (time.perf_counter() - start)


def sdk_consume(address: str, topic: str, args: argparse.Namespace) -> float:
    async def run() -> float:
        async with AsyncConsumer(
            address, group_id=f"g-{topic}", enable_auto_commit=False
        ) as consumer:
            consumer.subscribe([topic])
            count, start = 0, 0.0
            while count < args.messages:
                got = await consumer.getmany(timeout=30, max_records=10_000)
                assert got, f"only {count} of {args.messages} records came"
                if not count:
                    start = time.perf_counter()
                count += len(got)
            return time.perf_counter() - start

    return args.messages / asyncio.run(run())


def kafka_consume(kafka: str, topic: str, args: argparse.Namespace) -> float:
    consumer = Consumer(
        {
            "bootstrap.servers": kafka,
            "group.id": f"k-{topic}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "fetch.queue.backoff.ms": 10,
        }
    )
    consumer.subscribe([topic])
    count, start = 0, 0.0
    while count < args.messages:
        messages = [m for m in consumer.consume(10_000, 30) if not m.error()]
        assert messages, f"only {count} of {args.messages} records came"
        if not count:
            start = time.perf_counter()
        count += len(messages)
    elapsed = time.perf_counter() - start
    consumer.close()
    return args.messages / elapsed


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.root or default_root("sdk-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    server = HeadwaterServer()
    server.start(root, listeners=("rivven", "kafka"))
    rivven = f"127.0.0.1:{server.ports['rivven']}"
    kafka = f"127.0.0.1:{server.ports['kafka']}"
    rounds: list[dict[str, float]] = []
    results: dict[str, Any] = {
        "environment": {"revision": git_revision(), "load_before": loadavg()},
        "config": vars(args),
        "rounds": rounds,
    }
    try:
        for index in range(args.rounds):
            tag = f"{index}-{int(time.time())}"
            row = {
                "sdk_async_produce": sdk_async_produce(rivven, f"sa-{tag}", args),
                "sdk_blocking_produce": sdk_blocking_produce(rivven, f"sb-{tag}", args),
                "kafka_produce": kafka_produce(rivven, kafka, f"k-{tag}", args),
            }
            settle([server.pid], 60)
            row["sdk_consume"] = sdk_consume(rivven, f"sa-{tag}", args)
            settle([server.pid], 60)
            row["kafka_consume"] = kafka_consume(kafka, f"k-{tag}", args)
            row["load"] = loadavg()[0]
            log(f"round {index}: {json.dumps({k: round(v, 1) for k, v in row.items()})}")
            rounds.append(row)
    finally:
        server.stop()
        results["environment"]["load_after"] = loadavg()
    return results


def markdown(results: dict[str, Any]) -> str:
    rounds = results["rounds"]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    ratios = {
        key: [r[key] / r[f"kafka_{kind}"] for r in rounds]
        for key, kind in (
            ("sdk_async_produce", "produce"),
            ("sdk_blocking_produce", "produce"),
            ("sdk_consume", "consume"),
        )
    }
    lines = [
        "| case | records/s (median) | / confluent-kafka, each round |",
        "|---|--:|---|",
    ]
    for key, label in (
        ("sdk_async_produce", "SDK AsyncProducer"),
        ("sdk_blocking_produce", "SDK Producer (blocking)"),
        ("kafka_produce", "confluent-kafka produce"),
        ("sdk_consume", "SDK AsyncConsumer"),
        ("kafka_consume", "confluent-kafka consume"),
    ):
        each = ", ".join(f"{x:.2f}" for x in ratios.get(key, []))
        lines.append(f"| {label} | {median(key):,.0f} | {each or '-'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--messages", type=int, default=50_000, help="records a case")
    parser.add_argument("--size", type=int, default=100, help="value bytes")
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", help="scratch directory (default: a new temporary one)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    results = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(markdown(results))
    print(
        f"load before {results['environment']['load_before']}, after "
        f"{results['environment']['load_after']}"
    )


if __name__ == "__main__":
    main()
