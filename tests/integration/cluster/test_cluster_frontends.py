"""Every front end against a cluster (docs/cluster.md, "Front ends"): a write to a node
that does not lead the partition is refused with the protocol's NotLeader naming the
leader, and nothing is stored there; every reader, on the leader and on a follower,
stops at the high watermark and is woken when it moves; the SDKs (the Rivven producer
and the Kimberlite client) pointed at a follower follow the leader and store each
record once."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from cluster_nodes import WAIT_S, Cluster
from kimberlite_raw import RawClient, append, batch, expect_error, read, rows_of
from servers import LOCAL, Server
from test_cluster_kafka import produce_raw
from test_cluster_membership import create_topic
from test_kafka_stored_batches import RECORDS, RawKafka
from test_rivven_server import Rivven

import headwater
from headwater.protocols.kimberlite.messages import (
    AppendEventsRequest,
    AppendEventsResponse,
    QueryRequest,
    SubscribeRequest,
    SubscribeResponse,
    SubscriptionEventsResponse,
)
from headwater.protocols.rivven import rivven_pb2 as pb
from headwater.protocols.rivven.messages import ErrorCode, make_record
from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# The paused follower must stay in the ISR while the test looks (it holds the high
# watermark back only as a member).
CLUSTER_EXTRA = "replica_lag_s = 120\n"


def add_node(cluster: Cluster, node_id: int) -> Server:
    """A node with every front end the tests speak on a port of its own."""
    server = Server(
        cluster.root / f"node{node_id}",
        config=cluster.config(node_id, CLUSTER_EXTRA),
        listen={"kafka": LOCAL, "rivven": LOCAL, "http": LOCAL},
    )
    cluster.nodes[node_id] = server
    return server.start()


def start_cluster(cluster: Cluster) -> tuple[int, list[int]]:
    """Three nodes and stream "events" (one partition): its leader, once it takes
    writes, and the followers."""
    for node_id in (1, 2, 3):
        add_node(cluster, node_id)
    create_topic(cluster.nodes[1].address_of("kafka"), "events", 1)
    leader = cluster.wait_partitions(1)["0/events/0"]["leader"]
    # The leader takes its epoch on its next tick: until then it refuses too.
    lead = cluster.nodes[leader]
    with lead.client() as client:
        wait_until(
            lambda: isinstance(
                client.call(AppendEventsRequest(events_id(lead), batch([b"first"]))),
                AppendEventsResponse,
            ),
            timeout=WAIT_S,
        )
    for node in cluster.nodes.values():  # the others make the stream at their next tick
        wait_until(lambda n=node: http(n, "GET", "/api/streams/events")[0] == 200, timeout=WAIT_S)
    return leader, [n for n in (1, 2, 3) if n != leader]


def http(server: Server, method: str, path: str, body: object = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://{server.address_of('http')}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=15) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def events_id(server: Server) -> int:
    """Stream "events"'s id on ``server`` (ids are each node's own)."""
    status, body = http(server, "GET", "/api/streams/events")
    assert status == 200, body
    return int(body["stream_id"])


def http_events(server: Server) -> tuple[list[str], int]:
    """The values an HTTP read from offset 0 gives, and its end_offset."""
    status, body = http(server, "GET", "/api/streams/events/events?from=0&limit=1000")
    assert status == 200, body
    return [e["value"] for e in body["events"]], body["end_offset"]


def visible(server: Server) -> dict[str, int]:
    """How many events each front end shows on ``server``."""
    with server.client() as client:
        kimberlite = len(read(client, events_id(server))[0])
        [[sql]] = rows_of(client.call(QueryRequest("SELECT count(*) FROM events")))
    with Rivven(server.ports["rivven"]) as rivven:
        rivven.handshake()
        consumed = rivven.consume("events", 0)
    assert consumed.high_watermark == len(consumed.records), consumed.high_watermark
    events, end = http_events(server)
    assert end == len(events), (end, len(events))
    # Where the Spark source's partitions end (read_committed and read_uncommitted).
    _status, stream = http(server, "GET", "/api/streams/events")
    [offsets] = stream["partition_offsets"]
    return {
        "http": len(events),
        "spark_committed": offsets["last_stable_offset"],
        "spark_uncommitted": offsets["high_watermark"],
        "kimberlite": kimberlite,
        "rivven": len(consumed.records),
        "sql": int(sql),  # type: ignore[call-overload]
    }


LONG_POLL_S = 30  # the longest a Kafka Fetch or a Rivven Consume may be held


def long_fetch(server: Server, offset: int) -> int:
    """A Kafka Fetch held until something is readable at ``offset``: the high
    watermark it answers."""
    kafka = RawKafka(server)
    kafka.sock.settimeout(LONG_POLL_S + WAIT_S)  # held up to LONG_POLL_S by design
    try:
        wait = timedelta(seconds=LONG_POLL_S)
        answer = kafka.fetch("events", offset, read_committed=False, max_wait=wait, min_bytes=1)
        return int(answer.high_watermark)
    finally:
        kafka.close()


def long_consume(server: Server, offset: int) -> list[bytes]:
    """A Rivven Consume held until something is readable at ``offset``: the values."""
    with Rivven(server.ports["rivven"]) as rivven:
        rivven.sock.settimeout(LONG_POLL_S + WAIT_S)
        rivven.handshake()
        answer = rivven.ok(
            pb.ConsumeRequest(
                topic="events", partition=0, offset=offset, max_wait_ms=LONG_POLL_S * 1000
            ),
            "consume",
        )
    return [record.value for record in answer.records]


def batch_publish() -> pb.BatchPublishRequest:
    request = pb.BatchPublishRequest(topic="events")
    request.partition_records.add(partition=0, records=[make_record(b"x")])
    return request


def everywhere(count: int) -> dict[str, int]:
    front_ends = ("http", "kimberlite", "rivven", "sql", "spark_committed", "spark_uncommitted")
    return dict.fromkeys(front_ends, count)


def test_followers_refuse_every_write_naming_the_leader(cluster: Cluster) -> None:
    leader, followers = start_cluster(cluster)
    lead = cluster.nodes[leader]
    for follower in followers:
        node = cluster.nodes[follower]
        # HTTP: 421 Misdirected Request, the leader's addresses in the body (503, no
        # leader named, until the follower's tick has read the partition's state).
        status, body = wait_until(
            lambda n=node: (
                (answer := http(n, "POST", "/api/streams/events/events", ["x"]))[0] != 503
                and answer
            ),
            timeout=WAIT_S,
        )
        assert status == 421, body
        assert body["error"]["name"] == "NotLeader" and body["error"]["retryable"]
        assert body["error"]["leader"]["node_id"] == leader
        assert body["error"]["leader"]["http"] == lead.address_of("http")
        # SQL INSERT, over HTTP and over Kimberlite.
        status, body = http(
            node, "POST", "/api/sql", {"sql": "INSERT INTO events (data) VALUES ('x')"}
        )
        assert (status, body["error"]["name"]) == (421, "NotLeader"), body
        with node.client() as client:
            refused = expect_error(
                client.call(QueryRequest("INSERT INTO events (data) VALUES ('x')")), 15, "sql"
            )
        assert f"node {leader} leads partition 0 of events" in refused.message
        assert f"kimberlite {lead.address}" in refused.message
        # Rivven publish and publish_batch: NOT_LEADER, the leader in the details.
        with Rivven(node.ports["rivven"]) as rivven:
            rivven.handshake()
            for request in (
                pb.PublishRequest(topic="events", record=make_record(b"x")),
                batch_publish(),
            ):
                error = rivven.error(request)
                assert error.code == ErrorCode.NOT_LEADER, error
                assert error.details["leader_rivven"] == lead.address_of("rivven")
                assert error.details["leader_node_id"] == str(leader)
    # Nothing was stored anywhere but the leader's one event: the replicas agree on it.
    cluster.wait_replicas_agree([1, 2, 3], 1)
    wait_until(lambda: all(http_events(cluster.nodes[n]) == (["first"], 1) for n in (1, 2, 3)))


def test_no_reader_sees_past_the_high_watermark(cluster: Cluster) -> None:
    leader, (holding, paused) = start_cluster(cluster)
    lead = cluster.nodes[leader]
    with lead.client() as client:
        append(client, events_id(lead), [b"a", b"b"])
    cluster.wait_replicas_agree([1, 2, 3], 3)
    for node_id in (1, 2, 3):  # a follower learns the high watermark at its next fetch
        wait_until(lambda n=node_id: visible(cluster.nodes[n]) == everywhere(3), timeout=WAIT_S)
    watcher = RawClient(lead.port)
    sub_id = watcher.send(SubscribeRequest(events_id(lead), 0, 1000))
    subscribed = watcher.reply(sub_id)
    assert isinstance(subscribed, SubscribeResponse), subscribed
    pushed: list[bytes] = []

    def take_pushes() -> int:
        while (r := watcher.next_response(0.05)) is not None:
            if isinstance(r.payload, SubscriptionEventsResponse):
                pushed.extend(r.payload.events.values())
        return len(pushed)

    wait_until(lambda: take_pushes() == 3 or None, timeout=WAIT_S)

    # One follower paused: the leader and the other follower store an acks=1 batch that
    # the high watermark (held back by the paused ISR member) does not cover yet.
    cluster.nodes[paused].proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        assert produce_raw(cluster, leader, acks=1) == (0, 3)
        total = 3 + len(RECORDS)

        def held() -> bool:
            part = cluster.partitions()["0/events/0"]
            return part["end"] == total and part["lag"].get(str(holding)) == 0

        wait_until(held, timeout=WAIT_S, message=lambda: str(cluster.status()))
        # Long polls for what comes after the high watermark, on the leader (Kafka) and
        # on the follower holding the batch (Rivven): only its move can end them early.
        polls = ThreadPoolExecutor(2)
        polled_at = time.monotonic()
        kafka_poll = polls.submit(long_fetch, lead, 3)
        rivven_poll = polls.submit(long_consume, cluster.nodes[holding], 3)
        # Stored on both, readable on neither, by any front end.
        for node_id in (leader, holding):
            assert visible(cluster.nodes[node_id]) == everywhere(3), node_id
        # A subscription opened now reads what is there in one read: it gets 3 events.
        with lead.client() as late:
            late_id = late.send(SubscribeRequest(events_id(lead), 0, 1000))
            assert isinstance(late.reply(late_id), SubscribeResponse)
            first = late.take(lambda r: isinstance(r.payload, SubscriptionEventsResponse), 15)
            assert first is not None and isinstance(first.payload, SubscriptionEventsResponse)
            assert first.payload.events.values() == [b"first", b"a", b"b"]
        assert take_pushes() == 3
        assert not kafka_poll.done() and not rivven_poll.done()
    finally:
        cluster.nodes[paused].proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
    # The follower catches up, the high watermark moves, and every reader sees it: the
    # subscription and the long polls are woken by that move alone (nothing was
    # appended since), well before their 30 s wait ends.
    wait_until(lambda: take_pushes() == total or None, timeout=WAIT_S)
    assert kafka_poll.result(WAIT_S) == total
    assert rivven_poll.result(WAIT_S) == [value or b"" for _k, value, _h, _ts in RECORDS]
    assert time.monotonic() - polled_at < LONG_POLL_S - 5
    polls.shutdown()
    assert pushed[3:] == [value or b"" for _key, value, _headers, _ts in RECORDS]
    for node_id in (1, 2, 3):
        wait_until(
            lambda n=node_id: visible(cluster.nodes[n]) == everywhere(total),
            timeout=WAIT_S,
            message=lambda n=node_id: str(visible(cluster.nodes[n])),
        )
    watcher.close()


def test_the_sdks_pointed_at_a_follower_write_to_the_leader(cluster: Cluster) -> None:
    leader, followers = start_cluster(cluster)
    producer = headwater.Producer(cluster.nodes[followers[0]].address_of("rivven"), linger_ms=1)
    try:
        futures = [producer.send("events", f"sdk-{i}".encode()) for i in range(200)]
        producer.flush(WAIT_S)
        offsets = [f.result(WAIT_S).offset for f in futures]
    finally:
        producer.close()
    assert offsets == list(range(1, 201))  # after the leader's "first", each once, in order
    with headwater.connect(cluster.nodes[followers[1]].address) as client:
        stored = client.append("events", [b"kimberlite-1", b"kimberlite-2"])
        assert stored.first_offset == 201
    cluster.wait_replicas_agree([1, 2, 3], 203)
    values, _ = http_events(cluster.nodes[leader])
    assert values == ["first", *(f"sdk-{i}" for i in range(200)), "kimberlite-1", "kimberlite-2"]
