"""Read answers that their peers do not read are held within ``[limits]
read_answers_mib`` (docs/operations.md): clients that pipeline Kafka Fetches and
Kimberlite ReadEvents or Rivven Consumes of a whole stream, subscribe to it many times
over Kimberlite, or ask HTTP for pages and Arrow range reads,
and never read the answers once took the
server's anonymous memory to 1.4 GiB with four Fetches of a 300 MB topic. Now a
connection builds one large answer at a time, once the one before is read, and all
together hold at most the budget (its RssAnon sampled from /proc); a Fetch finding no
room answers nothing within its max_wait, and once the hogs are gone a consumer reads
every record."""

from __future__ import annotations

import socket
import struct
import time
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition
from kimberlite_raw import RawClient, append, create_stream, query
from kio.schema.fetch.v11.request import FetchPartition, FetchRequest, FetchTopic
from kio.schema.fetch.v11.response import FetchResponse
from kio.schema.types import BrokerId, TopicName
from kio.static.primitive import i8, i32, i64
from limits_clients import raw_socket
from memory_probe import MIB, RssSampler
from prometheus_client.parser import text_string_to_metric_families
from servers import LOCAL, Server, serving, stop_cleanly
from test_rivven_server import Rivven

from headwater.protocols.kafka import ApiKey
from headwater.protocols.kafka.frames import decode_response, encode_request
from headwater.protocols.kimberlite.messages import ReadEventsRequest, SubscribeRequest
from headwater.protocols.rivven import rivven_pb2 as pb
from headwater.server.http.listener import SHUTDOWN_SECONDS
from headwater.server.memory import process_memory
from waiting import wait_until

BUDGET_MIB = 8
CONFIG = f"""
[storage]
sync = "none"

[limits]
read_answers_mib = {BUDGET_MIB}
"""
EVENT = b"e" * 1000
STREAM_MIB = 48
EVENTS_PER_APPEND = 2000
MAX_I32 = (1 << 31) - 1
HTTP_PAGE = "/api/streams/{}/events?limit=10000"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("read-answers"),
        config=CONFIG,
        listen={"kafka": LOCAL, "http": LOCAL, "rivven": LOCAL},
    )


def held_bytes(server: Server) -> float:
    with urllib.request.urlopen(f"http://{server.address_of('http')}/metrics", timeout=15) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "headwater_read_answers_held_bytes":
            return float(family.samples[0].value)
    raise AssertionError("no headwater_read_answers_held_bytes in /metrics")


def fetch_everything(topic: str, max_wait: timedelta) -> FetchRequest:
    return FetchRequest(
        replica_id=BrokerId(-1),
        max_wait=max_wait,
        min_bytes=i32(1),
        max_bytes=i32(MAX_I32),
        isolation_level=i8(0),
        session_id=i32(0),
        session_epoch=i32(-1),
        topics=(
            FetchTopic(
                topic=TopicName(topic),
                partitions=(
                    FetchPartition(
                        partition=i32(0),
                        current_leader_epoch=i32(-1),
                        fetch_offset=i64(0),
                        log_start_offset=i64(-1),
                        partition_max_bytes=i32(MAX_I32),
                    ),
                ),
            ),
        ),
        forgotten_topics_data=(),
        rack_id="",
    )


def test_answers_nobody_reads_are_held_within_read_answers_mib(server: Server) -> None:
    topic = "hogged"
    with server.client() as client:
        stream_id = create_stream(client, topic)
        for _ in range(STREAM_MIB * MIB // (len(EVENT) * EVENTS_PER_APPEND)):
            append(client, stream_id, [EVENT] * EVENTS_PER_APPEND)
        query(client, f"SELECT count(*) FROM {topic}")  # the SQL projection caught up
    baseline = process_memory(server.pid)
    assert baseline is not None

    kafka_hogs = [raw_socket(server, "kafka") for _ in range(4)]
    kimberlite_hogs = [RawClient(server.port) for _ in range(2)]
    subscriber_hog = RawClient(server.port)  # 40 subscriptions with credit, never read
    http_hogs = [raw_socket(server, "http") for _ in range(8)]
    arrow_hogs = [raw_socket(server, "http") for _ in range(2)]
    rivven_hogs = [Rivven(server.ports["rivven"]) for _ in range(2)]
    for hog in rivven_hogs:
        hog.handshake()
    with RssSampler(server.pid) as sampler:
        # Every hog asks for the whole stream, over and over, and reads nothing back:
        # 16 Fetches of 48 MiB, 16 ReadEvents of 12 MiB, 16 Rivven Consumes of 8 MiB, 8
        # HTTP pages of 10 MB (and their JSON) and 2 Arrow range reads: over 1 GiB if all
        # were held.
        request = encode_request(1, fetch_everything(topic, timedelta(milliseconds=100)))
        for sock in kafka_hogs:
            sock.sendall(request * 4)
        for hog in kimberlite_hogs:
            for _ in range(8):
                hog.send(ReadEventsRequest(stream_id, 0, 12 * MIB))
        for hog in rivven_hogs:
            for _ in range(8):
                hog.send(
                    pb.ConsumeRequest(topic=topic, partition=0, offset=0, max_messages=100_000)
                )
        # Each subscription read 4 MiB at once whatever its peer took (+335 MB for 80).
        for _ in range(40):
            subscriber_hog.send(SubscribeRequest(stream_id, 0, 4096, None))
        # Pages of 10,000 events (10 MB, and their JSON) and Arrow range reads over HTTP.
        for sock in http_hogs:
            sock.sendall(f"GET {HTTP_PAGE.format(topic)} HTTP/1.1\r\nHost: hw\r\n\r\n".encode())
        for sock in arrow_hogs:
            sock.sendall(f"GET /api/streams/{topic}/arrow HTTP/1.1\r\nHost: hw\r\n\r\n".encode())
        # A Fetch sent after all of theirs: once it is answered, the server has taken up
        # every request before it. Finding the budget taken, it waits its max_wait for
        # room, then answers nothing, as when no record is there yet.
        answer = fetch_once_the_budget_is_full(server, topic, "the hogs' answers")
    grown = sampler.peak_anon - baseline.rss_anon
    # The budget, the read chunks its answer pins and what the socket layer copies.
    assert grown < (BUDGET_MIB + 40) * MIB, sampler.report()
    assert [not p.records for t in answer.responses for p in t.partitions] == [True], answer

    for sock in kafka_hogs:
        sock.close()
    for hog in [*kimberlite_hogs, subscriber_hog]:
        hog.sock.close()
    for sock in http_hogs + arrow_hogs:
        sock.close()
    for hog in rivven_hogs:
        hog.close()
    wait_until(lambda: held_bytes(server) == 0, message="the hogs' answers were not freed")

    consumer = Consumer(
        {"bootstrap.servers": server.address_of("kafka"), "group.id": "after-the-hogs"}
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    expected = STREAM_MIB * MIB // (len(EVENT) * EVENTS_PER_APPEND) * EVENTS_PER_APPEND
    read = 0
    while read < expected:
        messages = consumer.consume(10_000, 30)
        assert messages, f"only {read} of {expected} records read"
        for message in messages:
            assert message.error() is None, message.error()
            assert message.value() == EVENT
        read += len(messages)
    consumer.close()
    assert read == expected


def test_fetches_queued_behind_a_long_poll_are_not_built_before_it_is_answered(
    server: Server,
) -> None:
    """Kafka answers a connection's requests in order: Fetches sent behind a long poll
    once each read their records and counted them free at once, their answers queued
    in memory behind it, outside the budget. They now wait for the answers ahead."""
    topic, quiet = "queued", "queued-quiet"
    with server.client() as client:
        stream_id = create_stream(client, topic)
        for _ in range(STREAM_MIB * MIB // (len(EVENT) * EVENTS_PER_APPEND)):
            append(client, stream_id, [EVENT] * EVENTS_PER_APPEND)
        create_stream(client, quiet)
        query(client, f"SELECT count(*) FROM {topic}")  # the SQL projection caught up
    baseline = process_memory(server.pid)
    assert baseline is not None

    hog = raw_socket(server, "kafka")
    with RssSampler(server.pid) as sampler:
        # A long poll on an empty topic, then 24 Fetches of the 48 MiB topic (each
        # could take the whole 8 MiB budget: 192 MiB if all were held).
        long_poll = fetch_everything(quiet, timedelta(seconds=3))
        whole = encode_request(2, fetch_everything(topic, timedelta(milliseconds=100)))
        hog.sendall(encode_request(1, long_poll) + whole * 24)
        first = read_answer(hog, 1)  # after its 3 s: the Fetches behind it had time
        assert [not p.records for t in first.responses for p in t.partitions] == [True], first
        # A Fetch on another connection, answered once the server has taken up every
        # request before it: nothing, as the budget is taken.
        answer = fetch_once_the_budget_is_full(server, topic, "the Fetches behind the poll")
    hog.close()
    grown = sampler.peak_anon - baseline.rss_anon
    assert grown < (BUDGET_MIB + 40) * MIB, sampler.report()
    assert [not p.records for t in answer.responses for p in t.partitions] == [True], answer
    wait_until(lambda: held_bytes(server) == 0, message="the hog's answers were not freed")


def test_a_server_stops_while_its_clients_leave_their_answers_unread(tmp_path: Path) -> None:
    """SIGTERM with every kind of hog connected and the budget full: the reads waiting
    for room or for their peer go on and the server exits 0 (it once waited on them)."""
    listen = {"kafka": LOCAL, "http": LOCAL, "rivven": LOCAL}
    server = Server(tmp_path, config=CONFIG, listen=listen).start()
    try:
        topic = "hogged"
        with server.client() as client:
            stream_id = create_stream(client, topic)
            for _ in range(8):
                append(client, stream_id, [EVENT] * EVENTS_PER_APPEND)
        hogs = [raw_socket(server, "kafka") for _ in range(2)]
        request = encode_request(1, fetch_everything(topic, timedelta(seconds=30)))
        for sock in hogs:
            sock.sendall(request * 4)
        readers = [RawClient(server.port) for _ in range(2)]
        for reader in readers:
            for _ in range(4):
                reader.send(ReadEventsRequest(stream_id, 0, 12 * MIB))
        consumers = [Rivven(server.ports["rivven"]) for _ in range(2)]
        for consumer in consumers:
            consumer.handshake()
            for _ in range(4):
                consumer.send(
                    pb.ConsumeRequest(topic=topic, partition=0, offset=0, max_messages=100_000)
                )
        # HTTP clients whose answers the kernel cannot take for them either (a small
        # receive window): pages and Arrow range reads blocked on their writes.
        for path in [HTTP_PAGE.format(topic)] * 2 + [f"/api/streams/{topic}/arrow"] * 2:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.ports["http"]))
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: hw\r\n\r\n".encode())
            hogs.append(sock)
        wait_until(
            lambda: held_bytes(server) >= BUDGET_MIB * MIB,
            message="the hogs' answers did not fill the budget",
        )
        started = time.monotonic()
        stop_cleanly(server, clean_log=True)  # a client gone mid-answer is no error
        stopped_in = time.monotonic() - started
        # Not by giving up on them at the drain's timeout (a read waiting for a peer
        # paused after the drain let it go once held the stop for those 10 s), nor by
        # waiting out aiohttp's shutdown timeout for the HTTP clients (about 21 s).
        assert "still running after" not in server.log_text(), server.log_tail()
        assert stopped_in < SHUTDOWN_SECONDS, f"{stopped_in:.1f} s:\n{server.log_tail()}"
        for sock in hogs:
            sock.close()
        for reader in readers:
            reader.sock.close()
        for consumer in consumers:
            consumer.close()
    finally:
        server.kill()


def fetch_once_the_budget_is_full(server: Server, topic: str, holders: str) -> FetchResponse:
    """Once ``holders`` hold the whole budget: a Fetch of ``topic`` on a connection of
    its own, and its answer."""
    wait_until(
        lambda: held_bytes(server) >= BUDGET_MIB * MIB,
        message=f"{holders} did not fill the budget",
    )
    probe = raw_socket(server, "kafka")
    probe.sendall(encode_request(7, fetch_everything(topic, timedelta(milliseconds=200))))
    answer = read_answer(probe, 7)
    probe.close()
    return answer


def read_answer(sock: socket.socket, correlation: int) -> FetchResponse:
    def exact(n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "the server closed the connection"
            data += chunk
        return bytes(data)

    (size,) = struct.unpack(">i", exact(4))
    got, response = decode_response(ApiKey.FETCH, 11, exact(size))
    assert got == correlation
    assert isinstance(response, FetchResponse)
    return response
