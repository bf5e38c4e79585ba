"""No acknowledged write lost when the leader dies (docs/cluster.md, "Front ends"): every
front end's append on a cluster node is answered only once the partition's in-sync
replicas hold it, so appends acknowledged by a leader SIGKILLed right after the
acknowledgement are all on the new leader, over Kimberlite, HTTP and Rivven alike; and
with the followers paused (the ISR below min_insync_replicas) an append (Kimberlite, HTTP,
Rivven, SQL INSERT over PostgreSQL) is refused with each protocol's clear error, nothing
stored, until they are back (one taken just before the ISR shrank is answered as stored
but unconfirmed)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import pyarrow as pa
import pytest
from cluster_nodes import WAIT_S, Cluster
from servers import LOCAL, Server
from test_cluster_frontends import http, http_events
from test_cluster_membership import create_topic
from test_rivven_server import Rivven

import headwater
from headwater.client.arrow import HttpApi
from headwater.errors import StorageError
from headwater.protocols.rivven import rivven_pb2 as pb
from headwater.protocols.rivven.messages import ErrorCode, make_record
from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

BATCHES = 40  # acknowledged appends before the kill, the last one right before it
BATCH = 10  # events per append


def add_node(cluster: Cluster, node_id: int, replica_lag_s: int) -> Server:
    server = Server(
        cluster.root / f"node{node_id}",
        config=cluster.config(node_id, f"replica_lag_s = {replica_lag_s}\n"),
        listen={"kafka": LOCAL, "rivven": LOCAL, "http": LOCAL, "postgres": LOCAL},
    )
    cluster.nodes[node_id] = server
    return server.start()


def start_cluster(cluster: Cluster, replica_lag_s: int = 10) -> tuple[int, int]:
    """Three nodes and stream "events" (one partition) every node knows: its leader,
    once it takes writes, and its epoch."""
    for node_id in (1, 2, 3):
        add_node(cluster, node_id, replica_lag_s)
    create_topic(cluster.nodes[1].address_of("kafka"), "events", 1)
    placed = cluster.wait_partitions(1)["0/events/0"]
    for node in cluster.nodes.values():  # the others make the stream at their next tick
        wait_until(lambda n=node: http(n, "GET", "/api/streams/events")[0] == 200, timeout=WAIT_S)
    return int(placed["leader"]), int(placed["epoch"])


@contextmanager
def writer(front_end: str, server: Server) -> Iterator[Callable[[list[str]], None]]:
    """``write(values)``: one append of ``values`` through ``front_end``'s client at
    ``server``, returning once it is acknowledged."""
    if front_end == "kimberlite":
        with headwater.connect(server.address) as client:

            def append(values: list[str]) -> None:
                client.append("events", [v.encode() for v in values])

            yield append
    elif front_end == "http":
        host, port = server.address_of("http").split(":")
        with HttpApi(host, int(port), leader_wait_s=WAIT_S) as api:

            def append_arrow(values: list[str]) -> None:
                column = pa.array([v.encode() for v in values], pa.binary())
                api.append_arrow("events", pa.record_batch({"value": column}))

            yield append_arrow
    else:
        producer = headwater.Producer(server.address_of("rivven"), linger_ms=0)
        try:

            def publish(values: list[str]) -> None:
                sent = [producer.send("events", v.encode(), partition=0) for v in values]
                producer.flush(WAIT_S)
                for future in sent:
                    future.result(WAIT_S)

            yield publish
        finally:
            producer.close()


def new_leader(cluster: Cluster, old: int, epoch: int) -> int:
    def elected() -> int | None:
        part = cluster.partitions()["0/events/0"]
        moved = part["leader"] not in (old, -1) and part["epoch"] > epoch
        return int(part["leader"]) if moved else None

    found: int = wait_until(elected, timeout=WAIT_S, message=lambda: str(cluster.status()))
    return found


@pytest.mark.parametrize("front_end", ["kimberlite", "http", "rivven"])
def test_acknowledged_appends_survive_the_leaders_sigkill(cluster: Cluster, front_end: str) -> None:
    leader, epoch = start_cluster(cluster)
    lead = cluster.nodes[leader]
    acknowledged: list[str] = []
    with writer(front_end, lead) as write:
        # The leader takes writes from its first tick as leader: until then NotLeader,
        # which every client here waits out (an election's answer).
        for i in range(BATCHES):
            values = [f"{front_end}-{i}-{j}" for j in range(BATCH)]
            write(values)
            acknowledged += values
        lead.kill()  # right after the last acknowledgement
    elected = cluster.nodes[new_leader(cluster, leader, epoch)]

    # Everything acknowledged is readable on the new leader, once, in order (its high
    # watermark covers it once the other survivor has fetched it).
    def read_back() -> list[str] | None:
        values, _end = http_events(elected)
        return values if len(values) >= len(acknowledged) else None

    stored = wait_until(
        read_back,
        timeout=WAIT_S,
        message=lambda: f"lost: {sorted(set(acknowledged) - set(http_events(elected)[0]))}",
    )
    assert stored == acknowledged


def test_appends_refused_below_min_isr_then_taken_again(cluster: Cluster) -> None:
    leader, _epoch = start_cluster(cluster, replica_lag_s=2)
    lead = cluster.nodes[leader]
    followers = [cluster.nodes[n] for n in (1, 2, 3) if n != leader]
    with headwater.connect(lead.address) as client:
        assert client.append("events", [b"before"]).first_offset == 0
        for follower in followers:
            follower.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            # Taken while the ISR still lists them: stored, then answered once the ISR
            # shrinks to the leader alone (the followers stop fetching, their leases
            # lapse) with the error that says it was stored.
            with pytest.raises(StorageError, match="stored on the leader, unconfirmed"):
                client.append("events", [b"unconfirmed"])

            def shrunk() -> bool:
                return cluster.partitions()["0/events/0"]["isr"] == [leader]

            wait_until(shrunk, timeout=WAIT_S, message=lambda: str(cluster.status()))
            end = cluster.partitions()["0/events/0"]["end"]
            # Refused before anything is written, by every front end, each its own way.
            with pytest.raises(StorageError, match="below min_insync_replicas"):
                client.append("events", [b"refused-kimberlite"])
            refused = {"records": [{"value": "refused-http"}]}
            status, body = http(lead, "POST", "/api/streams/events/events", refused)
            assert status == 503, body
            assert body["error"]["replication"] == "NOT_ENOUGH_REPLICAS", body
            with Rivven(lead.ports["rivven"]) as rivven:
                rivven.handshake()
                request = pb.BatchPublishRequest(topic="events")
                request.partition_records.add(partition=0, records=[make_record(b"leader-only")])
                refusal = rivven.error(request)
                assert refusal.code == ErrorCode.REPLICA_NOT_AVAILABLE, refusal
                assert "below min_insync_replicas" in refusal.message
                # acks=1 asks for the leader alone: taken.
                request.acks = 1
                assert rivven.ok(request, "publish_batch").results[0].base_offset == end
            with postgres(lead) as conn, pytest.raises(psycopg.Error) as insert:
                conn.execute("INSERT INTO events (data) VALUES ('refused-postgres')")
            assert insert.value.sqlstate == "58030", insert.value
            assert "below min_insync_replicas" in str(insert.value)
            _status, stream = http(lead, "GET", "/api/streams/events")
            assert stream["partition_offsets"][0]["next_offset"] == end + 1  # acks=1's alone
        finally:
            for follower in followers:
                follower.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        # Back in the ISR: taken again, answered once the followers hold it.
        wait_until(
            lambda: len(cluster.partitions()["0/events/0"]["isr"]) == 3,
            timeout=WAIT_S,
            message=lambda: str(cluster.status()),
        )
        after = client.append("events", [b"after"])
    assert after.first_offset == end + 1
    with postgres(lead) as conn:
        inserted = conn.execute("INSERT INTO events (data) VALUES ('after-postgres')")
        assert inserted.rowcount == 1
    values, _ = http_events(lead)
    assert values == ["before", "unconfirmed", "leader-only", "after", "after-postgres"]


def postgres(server: Server) -> psycopg.Connection[tuple[object, ...]]:
    port = server.ports["postgres"]
    dsn = f"host=127.0.0.1 port={port} user=test dbname=0 sslmode=disable"
    return psycopg.connect(dsn, autocommit=True)
