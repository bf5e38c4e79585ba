"""The rivven listener against a real server, spoken by the project's own Rivven client
connection (protocols/rivven ClientConnection) over a socket (docs/protocols/rivven.md).

One server runs without required auth; a second requires tokens and has small
``[limits]`` (and HTTP for /metrics), each driven past its value.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest
from limits_clients import counted, read_to_end, refusals
from rivven_raw import Rivven
from servers import LOCAL, Server, http_json, serving

from headwater.engine.partitioner import keyed_partition
from headwater.protocols.rivven import rivven_pb2 as pb
from headwater.protocols.rivven.connection import ClientConnection
from headwater.protocols.rivven.frames import MAX_FRAME, WireFormat, encode_frame
from headwater.protocols.rivven.messages import ErrorCode, decode_postcard_error, make_record
from waiting import wait_until

PARTITIONS = 6
TOKEN = "s3cret"
MAX_CONNECTIONS = 3
HANDSHAKE_TIMEOUT_S = 1.0
AUTH_CONFIG = f"""
[auth]
required = true
[[auth.tokens]]
token = "{TOKEN}"
tenants = [0]
[[auth.tokens]]
token = "orphan"
tenants = [9]
"""
LIMITS_CONFIG = f"""
[limits]
max_connections = {MAX_CONNECTIONS}
handshake_timeout_s = {HANDSHAKE_TIMEOUT_S}
idle_timeout_s = 30
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("rivven"),
        listen={"rivven": LOCAL, "http": LOCAL, "kimberlite": ""},
        clean_log=True,
    )


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("rivven_auth"),
        config=AUTH_CONFIG,
        listen={"rivven": LOCAL, "kimberlite": ""},
    )


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Bound on every interface: its metadata must name the address a client reached.
    yield from serving(
        tmp_path_factory.mktemp("rivven_limits"),
        config=LIMITS_CONFIG,
        listen={"rivven": "0.0.0.0:0", "http": LOCAL, "kimberlite": ""},
    )


@pytest.fixture(scope="module")
def secured_limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("rivven_auth_limits"),
        config=AUTH_CONFIG + LIMITS_CONFIG,
        listen={"rivven": LOCAL, "kimberlite": ""},
    )


def client(server: Server) -> Rivven:
    return Rivven(server.ports["rivven"])


def create_topic(rivven: Rivven, name: str, partitions: int = PARTITIONS) -> None:
    created = rivven.ok(pb.CreateTopicRequest(name=name, partitions=partitions), "create_topic")
    assert isinstance(created, pb.CreateTopicResponse)
    assert created.partitions == partitions


# ---- topics, keyed publish, consume per partition ---------------------------------------


def test_keyed_messages_land_by_murmur2_and_come_back_whole(server: Server) -> None:
    with client(server) as rivven:
        assert rivven.handshake().compatible
        create_topic(rivven, "orders")
        [meta] = rivven.ok(pb.GetMetadataRequest(topics=["orders"]), "get_metadata").topics
        assert [p.id for p in meta.partitions] == list(range(PARTITIONS))
        assert "orders" in rivven.ok(pb.ListTopicsRequest(), "list_topics").topics

        sent: dict[int, list[tuple[bytes, bytes, list[tuple[str, bytes]], int]]] = {}
        base_ms = int(time.time() * 1000) - 60_000
        for i in range(48):
            key = f"customer-{i % 12}".encode()
            value = f"order-{i}".encode()
            headers = [("source", b"test"), ("seq", str(i).encode())]
            timestamp = base_ms + i
            placed = rivven.ok(
                pb.PublishRequest(
                    topic="orders",
                    record=make_record(value, key=key, headers=headers, timestamp_ms=timestamp),
                ),
                "publish",
            )
            assert placed.partition == keyed_partition(key, PARTITIONS)
            assert placed.timestamp == timestamp
            sent.setdefault(placed.partition, []).append((key, value, headers, timestamp))
        assert len(sent) > 1  # twelve keys spread over several partitions

        for partition in range(PARTITIONS):
            records = rivven.consume("orders", partition).records
            got = [
                (r.key, r.value, [(h.key, h.value) for h in r.headers], r.timestamp)
                for r in records
            ]
            assert got == sent.get(partition, [])
            assert [r.offset for r in records] == list(range(len(records)))
            assert all(r.partition == partition and r.has_key for r in records)
            bounds = rivven.ok(
                pb.GetOffsetBoundsRequest(topic="orders", partition=partition),
                "get_offset_bounds",
            )
            assert (bounds.earliest, bounds.latest) == (0, len(records))

        # Seek by time: the first record at or after a timestamp.
        partition, records_sent = next(iter(sent.items()))
        second_ts = records_sent[1][3] if len(records_sent) > 1 else records_sent[0][3]
        found = rivven.ok(
            pb.GetOffsetForTimestampRequest(
                topic="orders", partition=partition, timestamp_ms=second_ts
            ),
            "get_offset_for_timestamp",
        )
        assert found.offset == (1 if len(records_sent) > 1 else 0)


def test_pipelined_long_poll_is_answered_after_a_later_publish(server: Server) -> None:
    with client(server) as rivven:
        create_topic(rivven, "pipelined", partitions=2)
        waiting = rivven.send(
            pb.ConsumeRequest(topic="pipelined", partition=1, offset=0, max_wait_ms=20_000)
        )
        published = rivven.send(
            pb.PublishRequest(topic="pipelined", partition=1, record=make_record(b"late"))
        )
        # The publish sent second is answered while the consume still waits for it.
        assert rivven.answer(published).publish.offset == 0
        records = rivven.answer(waiting).consume.records
        assert [(r.value, r.has_key) for r in records] == [(b"late", False)]


# ---- consumer groups ----------------------------------------------------------------


def test_group_offsets_commit_fetch_and_resume_after_restart(server: Server) -> None:
    with client(server) as rivven:
        create_topic(rivven, "resumable", partitions=3)
        for i in range(5):
            rivven.ok(
                pb.PublishRequest(
                    topic="resumable", partition=2, record=make_record(f"v{i}".encode())
                ),
                "publish",
            )
        unset = rivven.ok(
            pb.GetOffsetRequest(consumer_group="g1", topic="resumable", partition=2),
            "get_offset",
        )
        assert unset.offset == -1
        rivven.ok(
            pb.CommitOffsetRequest(
                consumer_group="g1", topic="resumable", partition=2, offset=3, metadata="m"
            ),
            "commit_offset",
        )
        assert "g1" in rivven.ok(pb.ListGroupsRequest(), "list_groups").groups
    server.restart()
    with client(server) as rivven:
        fetched = rivven.ok(
            pb.GetOffsetRequest(consumer_group="g1", topic="resumable", partition=2),
            "get_offset",
        )
        assert (fetched.offset, fetched.metadata) == (3, "m")
        resumed = rivven.consume("resumable", 2, fetched.offset)
        assert [r.value for r in resumed.records] == [b"v3", b"v4"]
        described = rivven.ok(pb.DescribeGroupRequest(consumer_group="g1"), "describe_group")
        [topic] = described.topic_offsets
        assert (topic.topic, [(p.partition, p.offset) for p in topic.partition_offsets]) == (
            "resumable",
            [(2, 3)],
        )


# ---- exactly once -------------------------------------------------------------------


def test_idempotent_retry_is_stored_once(server: Server) -> None:
    with client(server) as rivven:
        create_topic(rivven, "payments", partitions=2)
        producer = rivven.ok(pb.InitProducerIdRequest(), "init_producer_id")
        request = pb.IdempotentPublishRequest(
            topic="payments",
            partition=1,
            record=make_record(b"pay-1", key=b"k"),
            producer_id=producer.producer_id,
            producer_epoch=producer.producer_epoch,
            sequence=0,
        )
        first = rivven.ok(request, "idempotent_publish")
        retry = rivven.ok(request, "idempotent_publish")
        assert (first.offset, first.duplicate) == (0, False)
        assert (retry.offset, retry.duplicate) == (0, True)
        request.sequence = 1
        request.record.value = b"pay-2"
        assert rivven.ok(request, "idempotent_publish").offset == 1
        assert [r.value for r in rivven.consume("payments", 1).records] == [b"pay-1", b"pay-2"]


def test_committed_transaction_visible_aborted_invisible(server: Server) -> None:
    with client(server) as rivven:
        create_topic(rivven, "ledger", partitions=2)
        producer = rivven.ok(pb.InitProducerIdRequest(), "init_producer_id")
        pid, epoch = producer.producer_id, producer.producer_epoch

        def run(txn: str, values: list[bytes], commit: bool, first_sequence: int) -> None:
            rivven.ok(
                pb.BeginTransactionRequest(txn_id=txn, producer_id=pid, producer_epoch=epoch),
                "begin_transaction",
            )
            for n, value in enumerate(values):
                rivven.ok(
                    pb.TransactionalPublishRequest(
                        txn_id=txn,
                        topic="ledger",
                        partition=n % 2,
                        record=make_record(value),
                        producer_id=pid,
                        producer_epoch=epoch,
                        sequence=first_sequence + n // 2,
                    ),
                    "transactional_publish",
                )
            end = pb.CommitTransactionRequest if commit else pb.AbortTransactionRequest
            kind = "commit_transaction" if commit else "abort_transaction"
            rivven.ok(end(txn_id=txn, producer_id=pid, producer_epoch=epoch), kind)

        run("t1", [b"a0", b"a1", b"a2", b"a3"], commit=False, first_sequence=0)
        run("t1", [b"c0", b"c1"], commit=True, first_sequence=2)
        # Open: published, neither committed nor aborted yet.
        rivven.ok(
            pb.BeginTransactionRequest(txn_id="t1", producer_id=pid, producer_epoch=epoch),
            "begin_transaction",
        )
        rivven.ok(
            pb.TransactionalPublishRequest(
                txn_id="t1",
                topic="ledger",
                partition=0,
                record=make_record(b"open"),
                producer_id=pid,
                producer_epoch=epoch,
                sequence=3,
            ),
            "transactional_publish",
        )
        committed = [
            r.value for p in (0, 1) for r in rivven.consume("ledger", p, isolation=1).records
        ]
        assert sorted(committed) == [b"c0", b"c1"]
        uncommitted = [r.value for p in (0, 1) for r in rivven.consume("ledger", p).records]
        assert sorted(uncommitted) == sorted([b"a0", b"a1", b"a2", b"a3", b"c0", b"c1", b"open"])


def test_an_older_instance_cannot_begin_the_transactional_id_again(server: Server) -> None:
    # A began "job", then B (a newer InitProducerId) took it over. A zombie A beginning
    # again was accepted: it aborted B's open transaction, committed its own, and B's
    # commit was refused: the live instance fenced by the old one.
    with client(server) as rivven:
        create_topic(rivven, "jobs", partitions=1)
        older, newer = (rivven.ok(pb.InitProducerIdRequest(), "init_producer_id") for _ in "ab")

        def begin(producer: pb.InitProducerIdResponse) -> pb.Response:
            return rivven.call(
                pb.BeginTransactionRequest(
                    txn_id="job",
                    producer_id=producer.producer_id,
                    producer_epoch=producer.producer_epoch,
                )
            )

        def publish(producer: pb.InitProducerIdResponse, value: bytes) -> None:
            rivven.ok(
                pb.TransactionalPublishRequest(
                    txn_id="job",
                    topic="jobs",
                    partition=0,
                    record=make_record(value),
                    producer_id=producer.producer_id,
                    producer_epoch=producer.producer_epoch,
                    sequence=0,
                ),
                "transactional_publish",
            )

        assert begin(older).WhichOneof("response_type") == "begin_transaction"
        assert begin(newer).WhichOneof("response_type") == "begin_transaction"
        publish(newer, b"newer's")
        again = begin(older)
        assert again.WhichOneof("response_type") == "error", again
        assert "fenced" in again.error.message
        rivven.ok(
            pb.CommitTransactionRequest(
                txn_id="job", producer_id=newer.producer_id, producer_epoch=newer.producer_epoch
            ),
            "commit_transaction",
        )
        assert [r.value for r in rivven.consume("jobs", 0, isolation=1).records] == [b"newer's"]


# ---- errors: answered, the connection still serving ---------------------------------


def test_errors_are_answered_and_the_connection_keeps_serving(server: Server) -> None:
    with client(server) as rivven:
        missing = rivven.error(pb.ConsumeRequest(topic="no-such-topic", partition=0))
        assert missing.code == ErrorCode.TOPIC_NOT_FOUND
        assert missing.message.startswith("TOPIC_NOT_FOUND:")
        create_topic(rivven, "small", partitions=2)
        beyond = rivven.error(pb.ConsumeRequest(topic="small", partition=5))
        assert beyond.code == ErrorCode.PARTITION_NOT_FOUND
        scram = rivven.error(pb.ScramClientFirstRequest(message=b"n,,n=user,r=abc"))
        assert scram.code == ErrorCode.INVALID_REQUEST and "not supported" in scram.message

        # A postcard frame: answered in postcard, the connection open.
        rivven.sock.sendall(encode_frame(WireFormat.POSTCARD, 77, b"\x1e"))
        reply = read_frame(rivven.sock)
        assert reply[:2] == (WireFormat.POSTCARD, 77)
        assert "postcard (0x00) is not accepted" in decode_postcard_error(reply[2])
        rivven.ok(pb.PingRequest(), "ping")

    # A frame over 10 MiB: MESSAGE_TOO_LARGE with id 0, then the server closes.
    with client(server) as rivven:
        rivven.sock.sendall(struct.pack(">I", MAX_FRAME + 1) + b"\x01")
        data = read_to_end(rivven.sock)
        answers = ClientConnection().receive_data(data)
        [answer] = answers
        assert answer.correlation_id == 0
        assert answer.response.error.code == ErrorCode.MESSAGE_TOO_LARGE
    with client(server) as rivven:  # the server still serves another client
        rivven.ok(pb.PingRequest(), "ping")
    assert "Traceback" not in server.log_text()


def test_create_topic_reads_kafkas_topic_configs_as_the_kafka_front_end_does(
    server: Server,
) -> None:
    # Rivven's CreateTopic takes Kafka's config names; it refused what Kafka's accepts:
    # -1 retention (no limit) and cleanup.policy "compact,delete".
    with client(server) as rivven:
        config = {
            "retention.ms": "-1",
            "retention.bytes": "-1",
            "cleanup.policy": "compact,delete",
            "segment.bytes": "1048576",
        }
        rivven.ok(
            pb.CreateTopicRequest(name="configured", partitions=1, config=config), "create_topic"
        )
        bad = rivven.error(
            pb.CreateTopicRequest(name="badly", partitions=1, config={"retention.ms": "soon"})
        )
        assert bad.code == ErrorCode.INVALID_REQUEST and "must be an integer" in bad.message
    settings = http_json(server, "GET", "/api/streams/configured")["settings"]
    assert settings["cleanup_policy"] == "compact" and settings["segment_bytes"] == 1 << 20
    assert "retention_ms" not in settings and "retention_bytes" not in settings


def test_a_consume_asking_for_every_tiny_record_gets_a_frame_of_them(server: Server) -> None:
    # 1-byte records cost protobuf more than their stored bytes: a Consume with no
    # count limit read 8 MiB of them, and its answer (about 14 MiB) was over the frame:
    # MESSAGE_TOO_LARGE, every time, so such a client never got past them.
    total = 700_000
    with client(server) as rivven:
        create_topic(rivven, "tiny", partitions=1)
        for _ in range(total // 10_000):
            records = [make_record(b"t")] * 10_000
            batch = [pb.PartitionRecords(partition=0, records=records)]
            rivven.ok(
                pb.BatchPublishRequest(topic="tiny", partition_records=batch), "publish_batch"
            )
        offset = 0
        while offset < total:
            answer = rivven.ok(
                pb.ConsumeRequest(topic="tiny", partition=0, offset=offset, max_messages=2**32 - 1),
                "consume",
            )
            offsets = [record.offset for record in answer.records]
            assert offsets and offsets == list(range(offset, offset + len(offsets)))
            offset += len(offsets)
    assert offset == total


def test_refused_values_are_answered_and_store_nothing(server: Server) -> None:
    # A publish_batch with one partition's values over the append limit stored the other
    # partitions' records, then answered INVALID_REQUEST (a client that fixed and sent
    # it again stored them twice). Sequences below 0 and an offset commit past 2**63 - 1
    # reached the storage layer and answered UNKNOWN "internal error" with a traceback.
    with client(server) as rivven:
        create_topic(rivven, "refusals", partitions=2)
        producer = rivven.ok(pb.InitProducerIdRequest(), "init_producer_id")
        over = rivven.error(
            pb.BatchPublishRequest(
                topic="refusals",
                partition_records=[
                    pb.PartitionRecords(partition=0, records=[make_record(b"small")] * 2),
                    pb.PartitionRecords(partition=1, records=[make_record(b"x" * (1 << 20))] * 5),
                ],
            )
        )
        assert over.code == ErrorCode.MESSAGE_TOO_LARGE and "bytes of values" in over.message
        # One record over the 4 MiB an append takes: as Kafka answers it (it was
        # INVALID_REQUEST).
        big = make_record(b"x" * ((4 << 20) + 1))
        alone = rivven.error(pb.PublishRequest(topic="refusals", partition=0, record=big))
        assert alone.code == ErrorCode.MESSAGE_TOO_LARGE, alone
        negative = [
            pb.IdempotentPublishRequest(
                topic="refusals",
                partition=0,
                record=make_record(b"n"),
                producer_id=producer.producer_id,
                producer_epoch=producer.producer_epoch,
                sequence=-1,
            ),
            pb.BatchPublishRequest(
                topic="refusals",
                producer_id=producer.producer_id,
                producer_epoch=producer.producer_epoch,
                partition_records=[
                    pb.PartitionRecords(partition=0, base_sequence=-5, records=[make_record(b"n")])
                ],
            ),
        ]
        for request in negative:
            refused = rivven.error(request)
            assert refused.code == ErrorCode.INVALID_REQUEST, refused
            assert "sequences are 0..2**64 - 1" in refused.message
        too_far = rivven.error(
            pb.CommitOffsetRequest(
                consumer_group="g", topic="refusals", partition=0, offset=1 << 63
            )
        )
        assert "outside 0..2**63 - 1" in too_far.message
        assert [rivven.consume("refusals", p).records for p in (0, 1)] == [[], []]
    assert "Traceback" not in server.log_text()


def read_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    """One raw frame: (format, correlation id, payload)."""
    head = b""
    while len(head) < 4:
        head += sock.recv(4 - len(head))
    (length,) = struct.unpack(">I", head)
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    return body[0], struct.unpack(">I", body[1:5])[0], body[5:]


# ---- auth and limits ----------------------------------------------------------------


def test_required_auth_refuses_until_a_token_is_presented(secured: Server) -> None:
    with client(secured) as rivven:
        refused = rivven.error(pb.ListTopicsRequest())
        assert refused.code == ErrorCode.UNAUTHORIZED
        wrong = rivven.error(
            pb.AuthenticateRequest(plain=pb.PlainAuth(username="u", password="wrong"))
        )
        assert wrong.code == ErrorCode.UNAUTHORIZED
        # A token granting only a tenant the server lacks: refused here, not every
        # request after it (UNKNOWN "tenant 9 does not exist").
        orphan = rivven.error(
            pb.AuthenticateRequest(plain=pb.PlainAuth(username="u", password="orphan"))
        )
        assert orphan.code == ErrorCode.UNAUTHORIZED
        assert "tenant 9 does not exist" in orphan.message
        # The client asks to be refused on a cleartext link: it was accepted (and its
        # token used) anyway. Over TLS it is accepted (test_tls.py's Rivven clients).
        cleartext = rivven.error(
            pb.AuthenticateRequest(
                plain=pb.PlainAuth(username="u", password=TOKEN, require_tls=True)
            )
        )
        assert cleartext.code == ErrorCode.UNAUTHORIZED and "require_tls" in cleartext.message
        rivven.authenticate(TOKEN)
        rivven.ok(pb.ListTopicsRequest(), "list_topics")


def test_max_connections(limited: Server) -> None:
    before = refusals(limited)
    held = [client(limited) for _ in range(MAX_CONNECTIONS)]
    try:
        for rivven in held:  # each admitted: it answers
            rivven.ok(pb.PingRequest(), "ping")
        extra = client(limited)
        answers = ClientConnection().receive_data(read_to_end(extra.sock))
        extra.close()
        [answer] = answers
        assert answer.response.error.code == ErrorCode.QUOTA_EXCEEDED
        assert "max_connections" in answer.response.error.message
    finally:
        for rivven in held:
            rivven.close()

    # /metrics is a connection too: read once the held ones are gone.
    def refusal_counted() -> bool:
        try:
            return counted(limited, before, "max_connections", "rivven") == 1
        except urllib.error.HTTPError as exc:  # 503 while the held ones are still closing
            assert exc.code == 503
            return False

    wait_until(refusal_counted, message="the refusal was not counted in /metrics")
    with client(limited) as rivven:  # its places are given back
        rivven.ok(pb.PingRequest(), "ping")


def test_handshake_timeout(limited: Server) -> None:
    before = refusals(limited)
    with client(limited) as rivven:  # connects and sends nothing
        answers = ClientConnection().receive_data(read_to_end(rivven.sock))
    [answer] = answers
    assert answer.correlation_id == 0
    assert "handshake_timeout_s" in answer.response.error.message
    assert counted(limited, before, "handshake_timeout_s", "rivven") == 1
    with client(limited) as rivven:  # the server still serves another client
        rivven.ok(pb.PingRequest(), "ping")


def test_with_auth_required_a_handshake_alone_does_not_accept_the_connection(
    secured_limited: Server,
) -> None:
    # A compatible Handshake lifted the limits of a connection not yet accepted: without
    # ever presenting a token it could send 10 MiB frames and stay open for good. Now it
    # has handshake_timeout_s to Authenticate, as without the Handshake.
    with client(secured_limited) as rivven:
        assert rivven.handshake().compatible
        answers = ClientConnection().receive_data(read_to_end(rivven.sock))
    [answer] = answers
    assert answer.correlation_id == 0
    assert "handshake_timeout_s" in answer.response.error.message
    with client(secured_limited) as rivven:  # a token accepts it: it outlives the timeout
        assert rivven.handshake().compatible
        rivven.authenticate(TOKEN)
        waited = rivven.call(
            pb.ConsumeRequest(
                topic="none-yet",
                partition=0,
                max_wait_ms=int(HANDSHAKE_TIMEOUT_S * 2000),
            )
        )
        assert waited.error.code == ErrorCode.TOPIC_NOT_FOUND


def test_without_auth_a_first_request_refused_or_long_polling_accepts_the_connection(
    limited: Server,
) -> None:
    # A connection whose first request failed, or long-polled past handshake_timeout_s,
    # was closed as never accepted (its long poll's answer never came).
    with client(limited) as rivven:
        create_topic(rivven, "quiet-limited", partitions=1)
    with client(limited) as rivven:
        missing = rivven.error(pb.ConsumeRequest(topic="no-such-topic", partition=0))
        assert missing.code == ErrorCode.TOPIC_NOT_FOUND
        polled = rivven.consume_waiting("quiet-limited", int(HANDSHAKE_TIMEOUT_S * 2000))
        assert list(polled.records) == []
        rivven.ok(pb.PingRequest(), "ping")
    with client(limited) as rivven:  # a long poll first
        polled = rivven.consume_waiting("quiet-limited", int(HANDSHAKE_TIMEOUT_S * 2000))
        assert list(polled.records) == []


def test_metadata_names_the_address_the_client_reached(limited: Server) -> None:
    # The listener binds 0.0.0.0: metadata named that, which sends a client to its own
    # host. It names the address this connection reached, as the Kafka listener does.
    with client(limited) as rivven:
        metadata = rivven.ok(pb.GetClusterMetadataRequest(), "get_cluster_metadata")
        [broker] = metadata.brokers
        assert (broker.host, broker.port) == ("127.0.0.1", limited.ports["rivven"])


def test_a_long_poll_is_answered_when_the_server_stops(tmp_path: Path) -> None:
    own = Server(tmp_path, listen={"rivven": LOCAL, "kimberlite": ""}).start()
    try:
        with client(own) as rivven:
            create_topic(rivven, "quiet", partitions=1)
            waiting = rivven.send(
                pb.ConsumeRequest(topic="quiet", partition=0, offset=0, max_wait_ms=30_000)
            )
            rivven.ok(pb.PingRequest(), "ping")  # the consume is in flight, the ping answered
            os.kill(own.pid, signal.SIGTERM)
            # Answered (empty) as the listener stops, not cut off when the drain's 10 s
            # run out and the connection is closed unanswered.
            answer = rivven.answer(waiting)
            assert answer.WhichOneof("response_type") == "consume"
            assert list(answer.consume.records) == []
        assert own.stop() == 0
    finally:
        own.kill()
