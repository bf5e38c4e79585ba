"""The replication listener is held to what the client listeners are (cluster/peers.py):
a node without the cluster secret is refused and copies nothing, the right secret
replicates; under [tls] nodes replicate over mutual TLS and a plain-text peer is
refused; a peer that does not finish its handshake in handshake_timeout_s is closed,
one sending a frame past max_pending_bytes before it is refused at once, and one past
max_connections is told so."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

import pytest
import trustme
from cluster_nodes import WAIT_S, Cluster
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from test_cluster_membership import create_topic
from test_cluster_replication import produce

from headwater.protocols import replication as wire
from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SECRET = "the-cluster-secret-0123456789"
TWO_REPLICAS = "replication_factor = 2\nmin_insync_replicas = 1\n"


def replication_address(cluster: Cluster, node_id: int) -> tuple[str, int]:
    node = wait_until(
        lambda: next((n for n in cluster.status()["nodes"] if n["node_id"] == node_id), None),
        message=f"node {node_id} not registered",
        timeout=WAIT_S,
    )
    return node["host"], node["ports"]["replication"]


def refusals_logged(cluster: Cluster, text: str) -> bool:
    return any(text in node.log_text() for node in cluster.nodes.values())


def read_frames(sock: socket.socket, deadline_s: float) -> tuple[list[wire.Frame], float]:
    """Every frame the listener sends until it closes, and when it closed (monotonic)."""
    frames, reader = [], wire.FrameReader()
    sock.settimeout(deadline_s)
    try:
        while data := sock.recv(1 << 16):
            frames += reader.feed(data)
    except ConnectionResetError:  # closed with our bytes unread: a close all the same
        pass
    return frames, time.monotonic()


def test_a_node_without_the_secret_is_refused_and_the_right_secret_replicates(
    cluster: Cluster,
) -> None:
    lag = "replica_lag_s = 2\n"
    cluster.add(1, f'{TWO_REPLICAS}{lag}secret = "{SECRET}"\n')
    cluster.add(2, f'{TWO_REPLICAS}{lag}secret = "another-secret-of-some-length"\n')
    create_topic(cluster.nodes[1].address_of("kafka"), "events", 1)
    part = cluster.wait_partitions(1)["0/events/0"]
    assert sorted(part["replicas"]) == [1, 2]
    leader = part["leader"]
    follower = 3 - leader
    produce(cluster.nodes[leader].address_of("kafka"), [b"v%d" % i for i in range(50)], acks="1")
    # The follower's every fetch starts with the handshake: a refusal logged by the
    # leader after the produce means the follower got nothing past it.
    wait_until(
        lambda: refusals_logged(cluster, "did not prove the cluster secret"),
        message=lambda: cluster.nodes[leader].log_tail(),
        timeout=WAIT_S,
    )
    assert "Traceback" not in cluster.nodes[leader].log_text()
    assert cluster.log_files(follower) in ({}, {name: b"" for name in cluster.log_files(follower)})
    # Nor does it count as in sync: it leaves the ISR once replica_lag_s has passed.
    wait_until(
        lambda: cluster.partitions()["0/events/0"]["isr"] == [leader],
        message=lambda: str(cluster.status()),
        timeout=WAIT_S,
    )

    assert cluster.nodes[2].stop() == 0
    cluster.add(2, f'{TWO_REPLICAS}{lag}secret = "{SECRET}"\n')
    cluster.wait_replicas_agree([1, 2], 50)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(
        str(root / "node.pem")
    )
    return root / "ca.pem", root / "node.pem"


def test_replication_over_mutual_tls_and_a_plain_peer_is_refused(
    cluster: Cluster, certs: tuple[Path, Path]
) -> None:
    ca, node_pem = certs
    tls = f'[tls]\ncert = "{node_pem}"\nkey = "{node_pem}"\nclient_ca = "{ca}"\n'
    extra = f'{TWO_REPLICAS}secret = "{SECRET}"\n{tls}'
    cluster.add(1, extra)
    cluster.add(2, extra)
    # [tls] covers the Kafka listener too: the test's client speaks mutual TLS as well.
    kafka_tls = {
        "bootstrap.servers": cluster.nodes[1].address_of("kafka"),
        "security.protocol": "SSL",
        "ssl.ca.location": str(ca),
        "ssl.certificate.location": str(node_pem),
        "ssl.key.location": str(node_pem),
    }
    admin = AdminClient(kafka_tls)  # kept: its futures fail once it is collected
    admin.create_topics([NewTopic("events", 1, 1)])["events"].result(WAIT_S)
    cluster.wait_partitions(1)
    producer = Producer({**kafka_tls, "acks": "all"})
    for i in range(50):
        producer.produce("events", b"t%d" % i, partition=0)
    assert producer.flush(WAIT_S) == 0
    leader = cluster.partitions()["0/events/0"]["leader"]
    cluster.wait_replicas_agree([1, 2], 50)

    # A plain-text peer asking for a fetch is cut at its first bytes: no challenge, no data.
    with socket.create_connection(replication_address(cluster, leader), timeout=WAIT_S) as sock:
        sock.sendall(wire.encode({"kind": wire.HELLO, "node": 9, "proof": ""}))
        frames, _ = read_frames(sock, WAIT_S)
    assert frames == []
    wait_until(
        lambda: "replication: TLS handshake with" in cluster.nodes[leader].log_text(),
        message=lambda: cluster.nodes[leader].log_tail(),
        timeout=WAIT_S,
    )


def test_replication_limits_past_max_connections_handshake_timeout_and_frame_size(
    cluster: Cluster,
) -> None:
    cluster.add(1, f'secret = "{SECRET}"\n[limits]\nhandshake_timeout_s = 1\nmax_connections = 4\n')
    address = replication_address(cluster, 1)

    # The clock is read before connecting: the server may accept, and start its
    # timeout, before connect() returns here (seen: closed 0.99999 s after).
    opened = time.monotonic()
    with socket.create_connection(address, timeout=WAIT_S) as silent:
        frames, closed = read_frames(silent, WAIT_S)
    assert [f.header.get("kind") for f in frames] == [wire.CHALLENGE, None]
    assert frames[1].header == {"error": "handshake_timeout_s"}
    assert 1.0 <= closed - opened < WAIT_S

    # Past max_pending_bytes (1 MiB) before the handshake: refused without waiting for it.
    with socket.create_connection(address, timeout=WAIT_S) as huge:
        huge.sendall(struct.pack(">II", 16 << 20, 10) + b"x" * 1000)
        frames, _ = read_frames(huge, WAIT_S)
    assert frames[-1].header == {"error": wire.UNAUTHORIZED}
    log = cluster.nodes[1].log_text()
    assert "no handshake within 1 s" in log and "bad replication frame" in log

    # max_connections (shared with the client listeners: a stray probe of the test
    # harness may hold a slot too): of five peers in their handshake at once, four at
    # most get the challenge and the rest are told max_connections at once.
    peers = [socket.create_connection(address, timeout=WAIT_S) for _ in range(5)]
    try:
        firsts = []
        for sock in peers:
            sock.settimeout(WAIT_S)
            firsts.append(wire.FrameReader().feed(sock.recv(1 << 16))[0].header)
    finally:
        for sock in peers:
            sock.close()
    admitted = [h for h in firsts if h.get("kind") == wire.CHALLENGE]
    refused = [h for h in firsts if h == {"error": "max_connections"}]
    assert len(admitted) + len(refused) == 5 and len(admitted) <= 4 and refused, firsts
    assert "Traceback" not in cluster.nodes[1].log_text()
