#!/usr/bin/env python3
"""Produce and consume over 1, 4 and 16 partitions, and group rebalance time (issue 18).

One real ``headwater serve`` (Kafka and Rivven listeners on loopback, default
configuration: fsync on every append). In one run, interleaved so the machine's load
falls on every case alike:

* **Kafka produce**: ``--messages`` messages of each ``--sizes`` with confluent-kafka
  (acks=all, linger.ms=5), spread round-robin over the topic's partitions, from the first
  produce() to flush() returning;
* **Kafka consume**: the same messages read back by one group consumer (subscribe,
  ``fetch.queue.backoff.ms`` 10), from its assignment to its last message (the group
  join before it is reported apart);
* **SDK produce / consume**: ``--sdk-messages`` messages through headwater's own
  producer (``headwater.AsyncProducer`` over the Rivven listener: batches per partition,
  linger 5 ms, idempotent) and group consumer (``AsyncConsumer``, timed from its first
  records to its last);
* **Rivven produce / consume** (single-record Publish, the protobuf message a plain
  Rivven client sends: ``--depth`` in flight; consumed with ConsumeRequests of every
  partition in flight): ``--rivven-messages`` messages, the project's own sans-I/O
  client connection;
* **rebalance**: consumers of one group on a 16-partition topic join one by one (1, 2,
  3) and leave again (3 -> 2 -> 1); the time from the join (subscribe) or the leave
  (close) to the moment the last member has its new assignment (each consumer's
  on_assign callback is timed in its own thread), with the members' heartbeat interval
  ``--heartbeats-ms`` (librdkafka's default is 3000: a member learns of a rebalance on
  its next heartbeat).

Every figure is set beside the 1-partition figure of the same run (the ratio is the
scaling); CPU seconds of the server and of this client process are recorded per case, so
a client-bound case can be told from a server-bound one.

    .venv/bin/python benchmarks/partitions_bench.py
    .venv/bin/python benchmarks/run_all.py --bench partitions_bench
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

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
from headwater.client.consumer import AsyncConsumer
from headwater.client.producer import AsyncProducer
from headwater.protocols.rivven import rivven_pb2 as pb
from headwater.protocols.rivven.connection import ClientConnection
from headwater.protocols.rivven.messages import make_record

DEADLINE_S = 60.0
REBALANCE_PARTITIONS = 16


def figures(
    server: HeadwaterServer,
    messages: int,
    seconds: float,
    cpu_server: float,
    cpu_client: float,
    value: bytes | None = None,
) -> dict[str, float]:
    """A run's rate (and MB/s when ``value`` is what each message carried) with the
    server's and this process's CPU seconds since ``cpu_server`` / ``cpu_client``."""
    rates = {"seconds": seconds, "msgs_per_s": messages / seconds}
    if value is not None:
        rates["mb_per_s"] = messages * len(value) / seconds / 1e6
    return rates | {
        "server_cpu_s": proc_cpu(server.pid) - cpu_server,
        "client_cpu_s": time.process_time() - cpu_client,
    }


# ---- Kafka: produce and consume -----------------------------------------------------------


def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, partitions)]).values():
        future.result(DEADLINE_S)


def kafka_produce(
    server: HeadwaterServer, topic: str, partitions: int, messages: int, value: bytes
) -> dict[str, float]:
    bootstrap = f"127.0.0.1:{server.ports['kafka']}"
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5})
    errors: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(str(err))

    cpu_server, cpu_client = proc_cpu(server.pid), time.process_time()
    t0 = time.perf_counter()
    for i in range(messages):
        while True:
            try:
                producer.produce(topic, value, partition=i % partitions, on_delivery=delivered)
                break
            except BufferError:  # the client's queue is full: let deliveries drain it
                producer.poll(0.005)
    left = producer.flush(DEADLINE_S)
    seconds = time.perf_counter() - t0
    if left or errors:
        raise RuntimeError(f"{left} undelivered, errors {errors[:3]}")
    return figures(server, messages, seconds, cpu_server, cpu_client, value)


def kafka_consume(
    server: HeadwaterServer, topic: str, messages: int, group: str
) -> dict[str, float]:
    bootstrap = f"127.0.0.1:{server.ports['kafka']}"
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            # librdkafka stops fetching for fetch.queue.backoff.ms (1000) whenever its
            # local queue holds queued.min.messages (100,000): with 100 B messages over
            # many partitions one fetch round fills it, and the consumer then sat idle
            # for a second while this loop drained it (seen with debug=fetch).
            "fetch.queue.backoff.ms": 10,
        }
    )
    assigned: list[float] = []

    def on_assign(_consumer: Any, _partitions: list[TopicPartition]) -> None:
        assigned.append(time.perf_counter())

    cpu_server, cpu_client = proc_cpu(server.pid), time.process_time()
    t0 = time.perf_counter()
    consumer.subscribe([topic], on_assign=on_assign)
    got = 0
    try:
        while got < messages:
            batch = consumer.consume(min(10_000, messages - got), 1.0)
            if not batch and time.perf_counter() - t0 > DEADLINE_S:
                raise RuntimeError(f"consumed {got} of {messages} within {DEADLINE_S}s")
            for message in batch:
                if message.error() is not None:
                    raise KafkaException(message.error())
            got += len(batch)
        end = time.perf_counter()
    finally:
        consumer.close()
    # From the assignment (the join is reported apart) to the last message.
    seconds = end - assigned[0]
    return {"join_s": assigned[0] - t0} | figures(server, messages, seconds, cpu_server, cpu_client)


# ---- Rivven: produce and consume ----------------------------------------------------------


class RivvenClient:
    """The project's sans-I/O Rivven client connection over a blocking socket."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = ClientConnection("partitions-bench")
        self.answers: dict[int, Any] = {}
        correlation_id, data = self.conn.handshake()
        self.sock.sendall(data)
        self.wait({correlation_id})

    def send(self, requests: list[Any]) -> set[int]:
        ids = set()
        chunks = []
        for request in requests:
            correlation_id, data = self.conn.send_request(request)
            ids.add(correlation_id)
            chunks.append(data)
        self.sock.sendall(b"".join(chunks))
        return ids

    def wait(self, ids: set[int]) -> dict[int, Any]:
        """The answers to ``ids`` (answers to later requests that come with them are
        kept for their own wait)."""
        while not ids <= self.answers.keys():
            data = self.sock.recv(1 << 20)
            if not data:
                raise RuntimeError("the server closed the Rivven connection")
            for frame in self.conn.receive_data(data):
                response = frame.response
                if response.WhichOneof("response_type") == "error":
                    raise RuntimeError(f"Rivven error: {response.error}")
                self.answers[frame.correlation_id] = response
        return {i: self.answers.pop(i) for i in ids}

    def close(self) -> None:
        self.sock.close()


def rivven_produce(
    server: HeadwaterServer, topic: str, partitions: int, messages: int, value: bytes, depth: int
) -> dict[str, float]:
    client = RivvenClient(server.ports["rivven"])
    try:
        client.wait(client.send([pb.CreateTopicRequest(name=topic, partitions=partitions)]))
        record = make_record(value)
        cpu_server, cpu_client = proc_cpu(server.pid), time.process_time()
        t0 = time.perf_counter()
        # A window of ``depth`` Publishes: the next half is sent once half have answered.
        sent = 0
        outstanding: list[set[int]] = []
        half = max(depth // 2, 1)
        while sent < messages or outstanding:
            while sent < messages and len(outstanding) < 2:
                count = min(half, messages - sent)
                requests = [
                    pb.PublishRequest(topic=topic, partition=(sent + j) % partitions, record=record)
                    for j in range(count)
                ]
                outstanding.append(client.send(requests))
                sent += count
            client.wait(outstanding.pop(0))
        seconds = time.perf_counter() - t0
    finally:
        client.close()
    return figures(server, messages, seconds, cpu_server, cpu_client, value)


def rivven_consume(
    server: HeadwaterServer, topic: str, partitions: int, messages: int
) -> dict[str, float]:
    client = RivvenClient(server.ports["rivven"])
    offsets = dict.fromkeys(range(partitions), 0)
    got = 0
    try:
        cpu_server, cpu_client = proc_cpu(server.pid), time.process_time()
        t0 = time.perf_counter()
        while got < messages:
            order = sorted(offsets)
            requests = [
                pb.ConsumeRequest(topic=topic, partition=p, offset=offsets[p], max_messages=10_000)
                for p in order
            ]
            ids = sorted(client.send(requests))
            answers = client.wait(set(ids))
            for p, correlation_id in zip(order, ids, strict=True):
                records = answers[correlation_id].consume.records
                if records:
                    offsets[p] = records[-1].offset + 1
                    got += len(records)
            if time.perf_counter() - t0 > DEADLINE_S:
                raise RuntimeError(f"consumed {got} of {messages} within {DEADLINE_S}s")
        seconds = time.perf_counter() - t0
    finally:
        client.close()
    return figures(server, messages, seconds, cpu_server, cpu_client)


# ---- the SDK (over the Rivven listener) ---------------------------------------------------


def sdk_produce(
    server: HeadwaterServer, topic: str, partitions: int, messages: int, value: bytes
) -> dict[str, float]:
    """headwater.AsyncProducer (batches per partition, linger 5 ms, idempotent)."""

    async def produce() -> float:
        address = f"127.0.0.1:{server.ports['rivven']}"
        async with AsyncProducer(address, linger_ms=5) as producer:
            await producer.create_stream(topic, partitions=partitions)
            t0 = time.perf_counter()
            sent = [producer.send(topic, value, partition=i % partitions) for i in range(messages)]
            await producer.flush()
            await asyncio.gather(*sent)  # any batch's error
            return time.perf_counter() - t0

    cpu_server, cpu_client = proc_cpu(server.pid), time.process_time()
    seconds = asyncio.run(produce())
    return figures(server, messages, seconds, cpu_server, cpu_client, value)


def sdk_consume(server: HeadwaterServer, topic: str, messages: int, group: str) -> dict[str, float]:
    """headwater.AsyncConsumer in a group, from its first records to its last."""

    async def consume() -> tuple[float, float, int]:
        address = f"127.0.0.1:{server.ports['rivven']}"
        async with AsyncConsumer(address, group_id=group, enable_auto_commit=False) as consumer:
            t0 = time.perf_counter()
            consumer.subscribe([topic])
            first = await consumer.getmany(timeout=DEADLINE_S, max_records=10_000)
            start = time.perf_counter()
            got = len(first)
            while got < messages:
                batch = await consumer.getmany(timeout=DEADLINE_S, max_records=10_000)
                if not batch:
                    raise RuntimeError(f"consumed {got} of {messages} within {DEADLINE_S}s")
                got += len(batch)
            return start - t0, time.perf_counter() - start, messages - len(first)

    cpu_server, cpu_client = proc_cpu(server.pid), time.process_time()
    join_s, seconds, timed = asyncio.run(consume())
    return {"join_s": join_s} | figures(server, timed, seconds, cpu_server, cpu_client)


# ---- group rebalance ----------------------------------------------------------------------


class Member(threading.Thread):
    """One group consumer polling in its own thread; each assignment it is given is
    timed in its on_assign callback."""

    def __init__(self, bootstrap: str, topic: str, group: str, heartbeat_ms: int) -> None:
        super().__init__(daemon=True)
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": group,
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "heartbeat.interval.ms": heartbeat_ms,
                "partition.assignment.strategy": "range",
            }
        )
        self.topic = topic
        self.assignment: frozenset[int] = frozenset()
        self.assigned_at = 0.0
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    def on_assign(self, _consumer: Any, partitions: list[TopicPartition]) -> None:
        with self.lock:
            self.assignment = frozenset(tp.partition for tp in partitions)
            self.assigned_at = time.perf_counter()

    def on_revoke(self, _consumer: Any, _partitions: list[TopicPartition]) -> None:
        with self.lock:
            self.assignment = frozenset()

    def run(self) -> None:
        self.consumer.subscribe([self.topic], on_assign=self.on_assign, on_revoke=self.on_revoke)
        while not self.stopping.is_set():
            self.consumer.poll(0.02)
        self.consumer.close()  # leaves the group

    def state(self) -> tuple[frozenset[int], float]:
        with self.lock:
            return self.assignment, self.assigned_at


def settled_at(members: list[Member], since: float) -> float | None:
    """When the last member got its assignment, once every member holds one given after
    ``since`` and together they own each partition exactly once; else None."""
    states = [m.state() for m in members]
    owned = [p for assignment, _ in states for p in assignment]
    if sorted(owned) != list(range(REBALANCE_PARTITIONS)):
        return None
    if any(not assignment or at <= since for assignment, at in states):
        return None
    return max(at for _, at in states)


def wait_settled(members: list[Member], since: float) -> float:
    deadline = time.perf_counter() + DEADLINE_S
    while (at := settled_at(members, since)) is None:
        if time.perf_counter() > deadline:
            raise RuntimeError(f"the group did not settle: {[m.state() for m in members]}")
        time.sleep(0.005)  # the pace of the check; the time measured is the callback's
    return at - since


def rebalances(server: HeadwaterServer, topic: str, heartbeat_ms: int, run: int) -> list[float]:
    """Seconds for: join to 1, 2, 3 members; leave to 2, 1."""
    bootstrap = f"127.0.0.1:{server.ports['kafka']}"
    group = f"rebalance_{heartbeat_ms}_{run}"
    members: list[Member] = []
    times = []
    try:
        for _ in range(3):
            member = Member(bootstrap, topic, group, heartbeat_ms)
            since = time.perf_counter()
            member.start()
            members.append(member)
            times.append(wait_settled(members, since))
        for _ in range(2):
            leaving = members.pop()
            since = time.perf_counter()
            leaving.stopping.set()
            times.append(wait_settled(members, since))
            leaving.join(DEADLINE_S)
    finally:
        for member in members:
            member.stopping.set()
        for member in members:
            member.join(DEADLINE_S)
    return times


# ---- the run --------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = default_root("partitions-bench-")
    server = HeadwaterServer()
    server.start(root, listeners=("kafka", "rivven"))
    results: dict[str, Any] = {
        "environment": {
            "revision": git_revision(),
            "load_before": loadavg(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "config": {
            k: getattr(args, k)
            for k in (
                "messages",
                "sdk_messages",
                "rivven_messages",
                "sizes",
                "partitions",
                "repeat",
                "depth",
            )
        }
        | {"heartbeats_ms": args.heartbeats_ms},
        "runs": [],
        "rebalance": {},
    }
    try:
        bootstrap = f"127.0.0.1:{server.ports['kafka']}"
        for repeat in range(args.repeat):
            # Interleaved: each repeat runs every partition count, in turn first.
            counts = args.partitions[repeat % len(args.partitions) :]
            counts += args.partitions[: repeat % len(args.partitions)]
            for size in args.sizes:
                value = b"x" * size
                for partitions in counts:
                    settle([server.pid], 10.0)
                    name = f"p{partitions}_s{size}_r{repeat}"
                    create_topic(bootstrap, f"k_{name}", partitions)
                    row: dict[str, Any] = {
                        "repeat": repeat,
                        "size": size,
                        "partitions": partitions,
                        "load": loadavg()[0],
                    }
                    row["kafka_produce"] = kafka_produce(
                        server, f"k_{name}", partitions, args.messages, value
                    )
                    # The SQL projection catches up on what was just produced in the
                    # background: the consume is timed once the server is idle again.
                    settle([server.pid], 60.0)
                    row["kafka_consume"] = kafka_consume(
                        server, f"k_{name}", args.messages, f"g_{name}"
                    )
                    if args.rivven_messages:
                        row["rivven_produce"] = rivven_produce(
                            server, f"r_{name}", partitions, args.rivven_messages, value, args.depth
                        )
                        settle([server.pid], 60.0)
                        row["rivven_consume"] = rivven_consume(
                            server, f"r_{name}", partitions, args.rivven_messages
                        )
                    if args.sdk_messages:
                        settle([server.pid], 60.0)
                        row["sdk_produce"] = sdk_produce(
                            server, f"s_{name}", partitions, args.sdk_messages, value
                        )
                        settle([server.pid], 60.0)
                        row["sdk_consume"] = sdk_consume(
                            server, f"s_{name}", args.sdk_messages, f"sg_{name}"
                        )
                    log(f"{name}: {json.dumps(row)}")
                    results["runs"].append(row)
        create_topic(bootstrap, "rebalance", REBALANCE_PARTITIONS)
        for heartbeat_ms in args.heartbeats_ms:
            rounds = []
            for repeat in range(args.repeat):
                times = rebalances(server, "rebalance", heartbeat_ms, repeat)
                log(f"rebalance heartbeat {heartbeat_ms} ms: {times}")
                rounds.append(times)
            results["rebalance"][str(heartbeat_ms)] = rounds
        server.check_alive()
    finally:
        server.stop()
        results["environment"]["load_after"] = loadavg()
    return results


CASES = (
    "kafka_produce",
    "kafka_consume",
    "sdk_produce",
    "sdk_consume",
    "rivven_produce",
    "rivven_consume",
)
STEPS = ("join 0->1", "join 1->2", "join 2->3", "leave 3->2", "leave 2->1")


def medians(results: dict[str, Any]) -> dict[tuple[int, int, str], dict[str, float]]:
    """(size, partitions, case) -> the median of each figure over the repeats."""
    grouped: dict[tuple[int, int, str], list[dict[str, float]]] = {}
    for row in results["runs"]:
        for case in CASES:
            if case in row:
                grouped.setdefault((row["size"], row["partitions"], case), []).append(row[case])
    return {
        key: {field: statistics.median(r[field] for r in rows) for field in rows[0]}
        for key, rows in grouped.items()
    }


def markdown(results: dict[str, Any]) -> str:
    env, config = results["environment"], results["config"]
    table = medians(results)
    lines = [
        f"partitions_bench at {env['revision']}, {env['started']}, load average "
        f"{env['load_before']} before, {env['load_after']} after; medians of "
        f"{config['repeat']} interleaved repeats; Kafka {config['messages']:,} messages, "
        f"SDK {config['sdk_messages']:,}, Rivven {config['rivven_messages']:,} (depth "
        f"{config['depth']})",
        "",
        "| case | size | partitions | msgs/s | vs 1 partition | server CPU s | client CPU s |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in CASES:
        for size in config["sizes"]:
            base = table.get((size, config["partitions"][0], case))
            for partitions in config["partitions"]:
                cell = table.get((size, partitions, case))
                if cell is None or base is None:
                    continue
                lines.append(
                    f"| {case.replace('_', ' ')} | {size} B | {partitions} "
                    f"| {cell['msgs_per_s']:,.0f} | {cell['msgs_per_s'] / base['msgs_per_s']:.2f}x "
                    f"| {cell['server_cpu_s']:.1f} | {cell['client_cpu_s']:.1f} |"
                )
    joins = [row["kafka_consume"]["join_s"] for row in results["runs"] if "kafka_consume" in row]
    if joins:
        lines += [
            "",
            f"Kafka consumer's first message after subscribe: median "
            f"{statistics.median(joins):.2f} s (group join + first fetch)",
        ]
    lines += [
        "",
        f"Group rebalance, {REBALANCE_PARTITIONS} partitions, seconds until every member "
        "has its new assignment (median / max of the repeats):",
        "",
        "| heartbeat.interval.ms | " + " | ".join(STEPS) + " |",
        "|---|" + "---|" * len(STEPS),
    ]
    for heartbeat, rounds in results["rebalance"].items():
        cells = [
            f"{statistics.median(r[i] for r in rounds):.2f} / {max(r[i] for r in rounds):.2f}"
            for i in range(len(STEPS))
        ]
        lines.append(f"| {heartbeat} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--messages", type=int, default=200_000, help="Kafka messages per case")
    p.add_argument(
        "--rivven-messages", type=int, default=20_000, help="Rivven messages per case (0: none)"
    )
    p.add_argument(
        "--sdk-messages",
        type=int,
        default=100_000,
        help="messages per case through the SDK's producer and group consumer (0: none)",
    )
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[100, 1024])
    p.add_argument(
        "--partitions", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16]
    )
    p.add_argument("--depth", type=int, default=256, help="Rivven Publishes in flight")
    p.add_argument(
        "--heartbeats-ms",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[100, 3000],
        help="the group members' heartbeat.interval.ms, one rebalance series each",
    )
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args()
    if args.quick:
        args.messages, args.rivven_messages, args.repeat = 5_000, 1_000, 1
        args.sdk_messages = 5_000
        args.heartbeats_ms = [100]
    results = run(args)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    print(markdown(results))


if __name__ == "__main__":
    main()
