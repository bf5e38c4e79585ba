"""Writes tests/conformance/kafka/*.bin: the requests a real client (confluent-kafka,
i.e. librdkafka) sends, captured by a tiny loopback server that speaks just enough Kafka
(headwater's codec) to be produced to. Run by hand when a vector is to be refreshed:

    .venv/bin/pip install confluent-kafka
    .venv/bin/python tests/conformance/kafka_capture.py

For each codec (none, gzip, snappy, lz4, zstd) a producer without idempotence sends
five records with fixed timestamps, keys, values and headers to topic ``vectors``
(one partition); the first ApiVersions, Metadata and Produce requests of each run are
kept as sent, size prefix included. test_kafka_vectors.py reads them with the codec and
checks the records and the CRC-32C librdkafka computed.
"""

from __future__ import annotations

import dataclasses
import importlib
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from kio.schema.errors import ErrorCode

from headwater.protocols.kafka.apis import ApiKey
from headwater.protocols.kafka.connection import Close, Reply, Request, ServerConnection

OUT = Path(__file__).parent / "kafka"
TOPIC = "vectors"
RECORDS = [
    (b"key-0", b"value-0", [("trace", b"abc")], 1_700_000_000_000),
    (None, b"value-1 without a key", [], 1_700_000_000_001),
    (b"key-2", None, [], 1_700_000_000_002),
    (b"key-3", b"x" * 300, [("a", b"1"), ("b", None)], 1_700_000_000_010),
    (b"key-4", "unicode \u00e9\u4e2d".encode(), [], 1_700_000_000_004),
]
CODECS = ("none", "gzip", "snappy", "lz4", "zstd")


def make(cls: type, **values: Any) -> Any:
    """An instance of a kio class of any version: the values its fields take."""
    names = {field.name for field in dataclasses.fields(cls)}
    return cls(**{name: value for name, value in values.items() if name in names})


def metadata_answer(version: int, port: int) -> Any:
    module = importlib.import_module(f"kio.schema.metadata.v{version}.response")
    partition = make(
        module.MetadataResponsePartition,
        error_code=ErrorCode.none,
        partition_index=0,
        leader_id=0,
        leader_epoch=0,
        replica_nodes=(0,),
        isr_nodes=(0,),
        offline_replicas=(),
    )
    topic = make(
        module.MetadataResponseTopic,
        error_code=ErrorCode.none,
        name=TOPIC,
        topic_id=None,
        is_internal=False,
        partitions=(partition,),
    )
    broker = make(module.MetadataResponseBroker, node_id=0, host="127.0.0.1", port=port)
    return make(
        module.MetadataResponse,
        throttle_time=timedelta(0),
        brokers=(broker,),
        cluster_id="capture",
        controller_id=0,
        topics=(topic,),
    )


def produce_answer(version: int, request: Any) -> Any:
    module = importlib.import_module(f"kio.schema.produce.v{version}.response")
    topics = []
    for topic in request.topic_data:
        partitions = tuple(
            make(
                module.PartitionProduceResponse,
                index=partition.index,
                error_code=ErrorCode.none,
                base_offset=0,
                log_start_offset=0,
                record_errors=(),
            )
            for partition in topic.partition_data
        )
        topics.append(
            make(module.TopicProduceResponse, name=topic.name, partition_responses=partitions)
        )
    return make(module.ProduceResponse, responses=tuple(topics), throttle_time=timedelta(0))


def serve(listener: socket.socket, captured: dict[str, bytes], done: threading.Event) -> None:
    port = listener.getsockname()[1]
    listener.settimeout(0.2)
    while not done.is_set():
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        threading.Thread(target=handle, args=(sock, port, captured, done), daemon=True).start()


def frames(sock: socket.socket, done: threading.Event) -> Iterator[bytes]:
    """Each request as sent (size prefix included), cut here so each can be kept."""
    buffer = b""
    while not done.is_set():
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            continue
        if not data:
            return
        buffer += data
        while len(buffer) >= 4 and len(buffer) >= 4 + int.from_bytes(buffer[:4], "big"):
            size = 4 + int.from_bytes(buffer[:4], "big")
            yield buffer[:size]
            buffer = buffer[size:]


def handle(
    sock: socket.socket, port: int, captured: dict[str, bytes], done: threading.Event
) -> None:
    connection = ServerConnection()
    with sock:
        sock.settimeout(0.2)
        for raw in frames(sock, done):
            version = int.from_bytes(raw[6:8], "big", signed=True)
            for event in connection.receive_data(raw):
                if isinstance(event, Close):
                    print("closed:", event.reason)
                    return
                if isinstance(event, Reply):
                    captured.setdefault(f"api_versions-v{version}", raw)
                    sock.sendall(event.data)
                    continue
                assert isinstance(event, Request)
                captured.setdefault(f"{event.api_key.name.lower()}-v{event.api_version}", raw)
                if event.api_key is ApiKey.METADATA:
                    answer = metadata_answer(event.api_version, port)
                elif event.api_key is ApiKey.PRODUCE:
                    answer = produce_answer(event.api_version, event.request)
                else:
                    print("unanswered:", event.api_key.name)
                    continue
                sock.sendall(connection.send(event, answer))


def capture(codec: str) -> dict[str, bytes]:
    from confluent_kafka import Producer  # a capture-time tool, not a dependency

    captured: dict[str, bytes] = {}
    done = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    server = threading.Thread(target=serve, args=(listener, captured, done), daemon=True)
    server.start()
    producer = Producer(
        {
            "bootstrap.servers": f"127.0.0.1:{listener.getsockname()[1]}",
            "compression.type": codec,
            "enable.idempotence": False,
            "acks": "all",
            "linger.ms": 100,
            "client.id": "vectors",
        }
    )
    for key, value, headers, timestamp in RECORDS:
        producer.produce(
            TOPIC, key=key, value=value, headers=headers, timestamp=timestamp, partition=0
        )
    remaining = producer.flush(10)
    done.set()
    server.join()
    listener.close()
    if remaining:
        raise SystemExit(f"{codec}: {remaining} records not acknowledged")
    return captured


def main() -> None:
    from confluent_kafka import libversion

    OUT.mkdir(exist_ok=True)
    version = libversion()[0]
    for codec in CODECS:
        captured = capture(codec)
        for name, raw in captured.items():
            if name.startswith("produce"):
                path = OUT / f"librdkafka-{version}-{name}-{codec}.bin"
            elif codec == "none":
                path = OUT / f"librdkafka-{version}-{name}.bin"
            else:
                continue
            path.write_bytes(raw)
            print(path, len(raw))


if __name__ == "__main__":
    main()
