"""The Kafka record-batch path before and after batches were stored in Kafka form
(issue 19), in one run: two servers side by side, one from this checkout and one from
an older revision's ``src/`` (a git worktree), each fed the same confluent-kafka produce
(acks=all, 100 B values, fsync before ack) and then consumed back whole; rounds
alternate between them. Reported per server: messages/s and server CPU microseconds
per message for produce (until the last ack; and of that, the event loop thread's
alone), for the catch-up after it (until the server is idle: the SQL projection of what
was produced) and for consume, and after/before ratios.

    .venv/bin/python benchmarks/kafka_batch_path_bench.py --before-src /tmp/wt/src
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from benchlib import (
    HeadwaterServer,
    HelpFormatter,
    default_root,
    git_revision,
    kafka_consume_all,
    loadavg,
    log,
    proc_cpu,
    settle,
)

RESULTS = Path(__file__).parent / "results"


def create_topic(bootstrap: str, partitions: int) -> str:
    name = "bench_" + uuid.uuid4().hex[:10]
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, num_partitions=partitions)])[name].result(timeout=30)
    return name


def produce(bootstrap: str, topic: str, count: int, size: int, codec: str) -> None:
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "linger.ms": 5,
            "compression.type": codec,
            "queue.buffering.max.messages": 1_000_000,
            "batch.num.messages": 10_000,
        }
    )
    value = b"v" * size
    failed = 0

    def report(err: Any, _msg: Any) -> None:
        nonlocal failed
        failed += err is not None

    for _ in range(count):
        while True:
            try:
                producer.produce(topic, value, on_delivery=report)
                break
            except BufferError:
                producer.poll(0.01)
    if producer.flush(120) or failed:
        raise RuntimeError(f"{failed} messages failed")


def timed(server: HeadwaterServer, work: Any, *args: Any) -> tuple[float, float, float]:
    """(wall seconds, server CPU seconds, the server's event loop thread's CPU seconds)
    of ``work(*args)``."""
    cpu, loop = proc_cpu(server.pid), proc_cpu(server.pid, server.pid)
    started = time.perf_counter()
    work(*args)
    wall = time.perf_counter() - started
    return wall, proc_cpu(server.pid) - cpu, proc_cpu(server.pid, server.pid) - loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--before-src", type=Path, required=True, help="older revision's src/")
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--codec", default="none")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    root = default_root("kafka-batch-path-")
    servers = {
        "before": HeadwaterServer(args.before_src, "before"),
        "after": HeadwaterServer(None, "after"),
    }
    for name, server in servers.items():
        (root / name).mkdir()
        server.start(root / name, listeners=("kafka",))
    runs: dict[str, dict[str, list[float]]] = {
        name: {
            k: []
            for k in (
                "produce_s",
                "produce_cpu",
                "produce_loop_cpu",
                "catch_up_cpu",
                "consume_s",
                "consume_cpu",
            )
        }
        for name in servers
    }
    loads = [loadavg()]
    try:
        for round_no in range(args.rounds):
            order = list(servers) if round_no % 2 == 0 else list(reversed(servers))
            for name in order:
                server = servers[name]
                bootstrap = f"127.0.0.1:{server.ports['kafka']}"
                topic = create_topic(bootstrap, args.partitions)
                settle([s.pid for s in servers.values()], 10)
                wall, cpu, loop = timed(
                    server, produce, bootstrap, topic, args.messages, args.size, args.codec
                )
                runs[name]["produce_s"].append(wall)
                runs[name]["produce_cpu"].append(cpu)
                runs[name]["produce_loop_cpu"].append(loop)
                # What the server does after the last ack for what was produced (the
                # SQL projection catching up), until it is idle again.
                cpu = proc_cpu(server.pid)
                settle([s.pid for s in servers.values()], 120)
                runs[name]["catch_up_cpu"].append(proc_cpu(server.pid) - cpu)
                wall, cpu, _ = timed(
                    server, kafka_consume_all, bootstrap, topic, args.partitions, args.messages, 300
                )
                runs[name]["consume_s"].append(wall)
                runs[name]["consume_cpu"].append(cpu)
                log(
                    f"round {round_no} {name}: produce {runs[name]['produce_s'][-1]:.2f}s"
                    f" consume {wall:.2f}s"
                )
            loads.append(loadavg())
    finally:
        for server in servers.values():
            server.stop()
    n = args.messages
    summary: dict[str, Any] = {}
    for name, r in runs.items():
        summary[name] = {
            "produce_msgs_per_s": round(n / statistics.median(r["produce_s"])),
            "produce_server_cpu_us_per_msg": round(
                statistics.median(r["produce_cpu"]) / n * 1e6, 2
            ),
            # The event loop's part (Produce decode, check, append, answer): the other
            # threads' fsyncs and any catch-up round inside the window left out.
            "produce_loop_cpu_us_per_msg": round(
                statistics.median(r["produce_loop_cpu"]) / n * 1e6, 2
            ),
            "catch_up_server_cpu_us_per_msg": round(
                statistics.median(r["catch_up_cpu"]) / n * 1e6, 2
            ),
            "consume_msgs_per_s": round(n / statistics.median(r["consume_s"])),
            "consume_server_cpu_us_per_msg": round(
                statistics.median(r["consume_cpu"]) / n * 1e6, 2
            ),
            "runs": r,
        }
    summary["ratios_after_over_before"] = {
        key: (
            round(summary["after"][key] / summary["before"][key], 2)
            if summary["before"][key]
            else None  # nothing measured before (under the clock tick)
        )
        for key in (
            "produce_msgs_per_s",
            "produce_server_cpu_us_per_msg",
            "produce_loop_cpu_us_per_msg",
            "catch_up_server_cpu_us_per_msg",
            "consume_msgs_per_s",
            "consume_server_cpu_us_per_msg",
        )
    }
    summary["config"] = {
        "messages": n,
        "size": args.size,
        "partitions": args.partitions,
        "codec": args.codec,
        "rounds": args.rounds,
        "revision": git_revision(),
        "loadavg": loads,
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"kafka_batch_path-{args.codec}.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2, default=str))


if __name__ == "__main__":
    main()
