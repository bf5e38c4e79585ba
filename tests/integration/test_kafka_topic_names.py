"""Stream names follow Kafka's topic rules ([A-Za-z0-9._-], engine/names.py): a topic a
Kafka client creates with '.' and '-' in its name (confluent-kafka, kcat) is read back
over HTTP, SQL (quoted), Kimberlite and Kiwi; the names Kafka refuses (".", "..", other
characters, more than 249 characters) and headwater's reserved ones are refused over
Kafka with INVALID_TOPIC_EXCEPTION and over Kimberlite with InvalidRequest."""

from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import kimberlite_raw as kr
import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from kio.schema.metadata.v9.request import MetadataRequest, MetadataRequestTopic
from kio.schema.types import TopicName
from limits_clients import raw_socket
from servers import LOCAL, Server, serving
from websockets.sync.client import connect

from headwater.protocols.kafka import ApiKey, ErrorCode
from headwater.protocols.kafka.frames import decode_response, encode_request
from headwater.protocols.kimberlite import (
    CreateStreamRequest,
    ListStreamsRequest,
    StreamsResponse,
)
from headwater.protocols.kimberlite import ErrorCode as E

DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("names"),
        listen={"kafka": LOCAL, "http": LOCAL, "kimberlite": LOCAL},
        clean_log=False,  # the refused names are logged as warnings
    )


def http(server: Server, method: str, path: str, body: Any = None) -> Any:
    request = urllib.request.Request(
        f"http://{server.address_of('http')}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=DEADLINE_S) as response:
        return json.loads(response.read())


def kimberlite_stream_id(client: kr.RawClient, name: str) -> int:
    listing = client.call(ListStreamsRequest())
    assert isinstance(listing, StreamsResponse), listing
    (found,) = [s.stream_id for s in listing.streams if s.name == name]
    return found


def test_a_topic_with_dots_and_dashes_is_read_over_every_front_end(server: Server) -> None:
    topic = "orders.v1-eu"
    admin = AdminClient({"bootstrap.servers": server.address_of("kafka")})
    admin.create_topics([NewTopic(topic, num_partitions=1)])[topic].result(DEADLINE_S)
    producer = Producer({"bootstrap.servers": server.address_of("kafka")})
    for i in range(3):
        producer.produce(topic, b'{"n": %d}' % i, key=b"k")
    assert producer.flush(DEADLINE_S) == 0
    # HTTP: the name in the path as it is.
    page = http(server, "GET", f"/api/streams/{urllib.parse.quote(topic)}/events")
    assert [e["value"] for e in page["events"]] == ['{"n": 0}', '{"n": 1}', '{"n": 2}']
    # SQL: a quoted identifier.
    result = http(server, "POST", "/api/sql", {"sql": f'SELECT count(*) AS c FROM "{topic}"'})
    assert result["rows"] == [[3]]
    # Kimberlite: listed by name, read by id.
    client = server.client()
    try:
        stream_id = kimberlite_stream_id(client, topic)
        assert kr.read_all(client, stream_id) == [b'{"n": 0}', b'{"n": 1}', b'{"n": 2}']
        answer = kr.query(client, f'SELECT count(*) FROM "{topic}"')
        assert [list(row) for row in answer.rows] == [[3]]
    finally:
        client.close()


def test_kiwi_pushes_a_dotted_topics_records(server: Server) -> None:
    topic = "ticks.eu-west"
    admin = AdminClient({"bootstrap.servers": server.address_of("kafka")})
    admin.create_topics([NewTopic(topic, num_partitions=1)])[topic].result(DEADLINE_S)
    with connect(f"ws://{server.address_of('http')}/ws", open_timeout=DEADLINE_S) as ws:
        ws.send(json.dumps({"type": "SUBSCRIBE", "sourceId": topic, "mode": "push"}))
        ok = json.loads(ws.recv(timeout=DEADLINE_S))
        assert ok == {"type": "SUBSCRIBE_OK", "data": {"sourceId": topic}}
        producer = Producer({"bootstrap.servers": server.address_of("kafka")})
        producer.produce(topic, b"px=10", key=b"eur")
        assert producer.flush(DEADLINE_S) == 0
        result = json.loads(ws.recv(timeout=DEADLINE_S))
    assert result["type"] == "RESULT"
    assert {k: result["data"][k] for k in ("sourceId", "key", "value", "offset")} == {
        "sourceId": topic,
        "key": "eur",
        "value": "px=10",
        "offset": 0,
    }


def test_a_debezium_style_topic_is_created_by_kcat(server: Server) -> None:
    kcat = shutil.which("kcat")
    assert kcat is not None, "kcat is not installed (make system-deps)"
    topic = "dbserver1.inventory.customers"
    broker = server.address_of("kafka")
    subprocess.run(
        [kcat, "-b", broker, "-P", "-t", topic],
        input=b"c1\nc2\n",
        check=True,
        timeout=DEADLINE_S,
        capture_output=True,
    )
    done = subprocess.run(
        [kcat, "-b", broker, "-C", "-t", topic, "-o", "beginning", "-c", "2", "-e"],
        check=True,
        timeout=DEADLINE_S,
        capture_output=True,
    )
    assert done.stdout.split() == [b"c1", b"c2"]
    assert http(server, "GET", f"/api/streams/{topic}")["name"] == topic


REFUSED = [".", "..", "a/b", "with space", "naïve", "x" * 250, "hw_mine", "convergedb_x"]


@pytest.mark.parametrize("name", REFUSED)
def test_names_kafka_refuses_are_refused_over_kafka(server: Server, name: str) -> None:
    admin = AdminClient({"bootstrap.servers": server.address_of("kafka")})
    future = admin.create_topics([NewTopic(name, num_partitions=1)])[name]
    with pytest.raises(KafkaException) as refused:
        future.result(DEADLINE_S)
    assert refused.value.args[0].code() == KafkaError.TOPIC_EXCEPTION, refused.value
    listed = {s["name"] for s in http(server, "GET", "/api/streams")["streams"]}
    assert name not in listed


def test_a_topic_colliding_with_another_in_dots_and_underscores_is_refused(
    server: Server,
) -> None:
    admin = AdminClient({"bootstrap.servers": server.address_of("kafka")})
    admin.create_topics([NewTopic("metrics_eu", num_partitions=1)])["metrics_eu"].result(DEADLINE_S)
    future = admin.create_topics([NewTopic("metrics.eu", num_partitions=1)])["metrics.eu"]
    with pytest.raises(KafkaException) as refused:
        future.result(DEADLINE_S)
    assert refused.value.args[0].code() == KafkaError.TOPIC_EXCEPTION, refused.value
    assert "collides" in refused.value.args[0].str()
    # headwater's own front ends keep their own rules: both names may be streams.
    client = server.client()
    try:
        kr.create_stream(client, "metrics.eu")
    finally:
        client.close()


def test_the_longest_kafka_topic_name_and_the_longest_stream_name(server: Server) -> None:
    admin = AdminClient({"bootstrap.servers": server.address_of("kafka")})
    longest = "t." + "x" * 247  # 249: Kafka's limit
    admin.create_topics([NewTopic(longest, num_partitions=1)])[longest].result(DEADLINE_S)
    client = server.client()
    try:
        # headwater's own limit is 256, over its own protocols.
        kr.create_stream(client, "s-" + "y" * 254)
        reply = client.call(CreateStreamRequest("s-" + "y" * 255))
        kr.expect_error(reply, E.INVALID_REQUEST, "257 characters")
        for name in [".", "..", "a/b"]:
            kr.expect_error(client.call(CreateStreamRequest(name)), E.INVALID_REQUEST, name)
    finally:
        client.close()


def _answer(sock: socket.socket) -> bytes:
    data = bytearray()
    while len(data) < 4 or len(data) < 4 + struct.unpack(">i", data[:4])[0]:
        chunk = sock.recv(1 << 16)
        assert chunk, "the server closed the connection instead of answering"
        data += chunk
    return bytes(data[4:])


def test_a_topic_auto_created_by_concurrent_metadata_requests_is_answered_on_each(
    server: Server,
) -> None:
    """Several connections ask for the same new topic at once, each auto-creating it:
    every one is answered (LEADER_NOT_AVAILABLE while another's create of it is under
    way, as Kafka answers for a topic being created), none has its connection closed,
    and the topic exists once afterwards."""
    name = f"racing.{uuid.uuid4().hex[:8]}"
    request = MetadataRequest(
        topics=(MetadataRequestTopic(name=TopicName(name)),),
        allow_auto_topic_creation=True,
        include_cluster_authorized_operations=False,
        include_topic_authorized_operations=False,
    )
    socks = [raw_socket(server, "kafka") for _ in range(8)]
    try:
        for sock in socks:  # all sent before any answer is read
            sock.sendall(encode_request(1, request))
        codes = []
        for sock in socks:
            correlation, answer = decode_response(ApiKey.METADATA, 9, _answer(sock))
            assert correlation == 1
            ((topic,),) = [answer.topics]
            assert topic.name == name
            codes.append(topic.error_code)
    finally:
        for sock in socks:
            sock.close()
    assert set(codes) <= {ErrorCode.none, ErrorCode.leader_not_available}, codes
    assert ErrorCode.none in codes, codes
    listed = [s["name"] for s in http(server, "GET", "/api/streams")["streams"]]
    assert listed.count(name) == 1, listed
