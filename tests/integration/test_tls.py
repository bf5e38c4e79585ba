"""TLS on every listener of a real server (``[tls]``), and every client over it.

One server has TLS: each listener (Kimberlite, ConvergeDB, Ripple, HTTP and the Kiwi
gateway on it) does a real operation with the SDK, the entities client, the Ripple
worker, the CLI, the Spark connector's connection, urllib and websockets, all trusting
the test CA; a plain-text client is refused on each, with one warning line in the log
and the listener still serving. Another has mutual TLS (``client_ca``) and
``[auth] required``: a client certificate of the CA is accepted, none or another CA's is
refused, and a Ripple worker authenticates by its certificate's CN (``cert_cn``).
Certificates come from trustme."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import confluent_kafka
import psycopg
import pytest
import trustme
from confluent_kafka.admin import AdminClient
from servers import LOCAL, Server, assert_clean_log, serving
from websockets.exceptions import InvalidMessage
from websockets.sync.client import connect as ws_connect

import headwater
from headwater import entities
from headwater.client import Consumer, Producer, ServerUnavailable
from headwater.ripple import Worker, WorkerError
from headwater.spark.options import ConnectionOptions
from headwater.spark.streams import open_client
from waiting import wait_until

LISTEN = {name: LOCAL for name in ("convergedb", "ripple", "http", "rivven", "kafka", "postgres")}
TOKEN = "s3cret"
TIMEOUT = 15.0  # a bound on a connection attempt, not a measurement


@dataclass(frozen=True)
class Certs:
    ca: Path  # the CA every server and client certificate below is signed by
    server: Path  # the servers' chain and key (127.0.0.1, localhost)
    worker: Path  # a client certificate, CN worker-1 (mapped to tenant 0 by cert_cn)
    stranger: Path  # a client certificate of the same CA, CN stranger (mapped to nothing)
    foreign: Path  # a client certificate of another CA, CN worker-1


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    root = tmp_path_factory.mktemp("certs")
    ca, other_ca = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    files = {
        "server": ca.issue_cert("127.0.0.1", "localhost"),
        "worker": ca.issue_cert("worker-1", common_name="worker-1"),
        "stranger": ca.issue_cert("stranger", common_name="stranger"),
        "foreign": other_ca.issue_cert("worker-1", common_name="worker-1"),
    }
    for name, leaf in files.items():
        leaf.private_key_and_cert_chain_pem.write_to_path(str(root / f"{name}.pem"))
        (root / f"{name}.pem").chmod(0o600)  # libpq refuses a key others may read
    return Certs(root / "ca.pem", *(root / f"{name}.pem" for name in files))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[Server]:
    config = f'[tls]\ncert = "{certs.server}"\nkey = "{certs.server}"\n'
    yield from serving(tmp_path_factory.mktemp("tls"), config=config, listen=LISTEN)


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[Server]:
    config = f"""
[tls]
cert = "{certs.server}"
key = "{certs.server}"
client_ca = "{certs.ca}"

[auth]
required = true
[[auth.tokens]]
token = "{TOKEN}"
tenants = [0]
[[auth.tokens]]
cert_cn = "worker-1"
tenants = [0]
"""
    yield from serving(tmp_path_factory.mktemp("mtls"), config=config, listen=LISTEN)


@dataclass
class Vwap:
    symbol: str
    vwap: float
    volume: int


@dataclass
class Sensor:
    site: str
    temp: float


def context(certs: Certs, client: Path | None = None) -> ssl.SSLContext:
    """What urllib and websockets connect with: trust the test CA (and present
    ``client``)."""
    tls = ssl.create_default_context(cafile=certs.ca)
    if client is not None:
        tls.load_cert_chain(client)
    return tls


def https_get(server: Server, path: str, tls: ssl.SSLContext) -> Any:
    request = urllib.request.Request(f"https://127.0.0.1:{server.ports['http']}{path}")
    request.add_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(request, timeout=TIMEOUT, context=tls) as response:
        return json.loads(response.read())


def warned_about(server: Server, port: int) -> str:
    """The server's warning about the failed TLS handshake from local port ``port``."""
    peer = f"127.0.0.1:{port}"
    lines = [line for line in server.log_text().splitlines() if peer in line]
    return next((line for line in lines if "WARNING" in line and "TLS handshake" in line), "")


def plain_client_refused(server: Server, listener: str, first_bytes: bytes) -> None:
    """Plain TCP to a TLS listener: the server closes it on the first bytes and logs one
    warning line naming the client's address, without a traceback."""
    with socket.create_connection(("127.0.0.1", server.ports[listener]), timeout=TIMEOUT) as s:
        port = s.getsockname()[1]
        s.sendall(first_bytes)
        try:
            answer = s.recv(1 << 16)
        except ConnectionResetError:
            answer = b""
    assert answer == b"", f"{listener} answered plain text with {answer[:80]!r}"
    line = wait_until(lambda: warned_about(server, port), message=server.log_tail)
    assert f"{listener}: TLS handshake with 127.0.0.1:{port} failed" in line
    assert_clean_log(server)
    # TLS clients that closed before this one (earlier tests') left no asyncio warning
    # ("returning true from eof_received() has no effect when using ssl").
    assert "eof_received" not in server.log_text()


# ---- TLS on every listener --------------------------------------------------------------


def test_kimberlite_sdk_over_tls(tls_server: Server, certs: Certs) -> None:
    with headwater.connect(tls_server.address, ca=certs.ca) as hw:
        hw.create_stream("tls_trades")
        assert hw.append("tls_trades", [b"a", b"b"]).count == 2
        assert [e.value for e in hw.read("tls_trades").events] == [b"a", b"b"]
        # The HTTP port the Handshake advertises is HTTPS too: Arrow reads go over it.
        batches = list(hw.read_arrow("tls_trades"))
        assert sum(batch.num_rows for batch in batches) == 2

    async def read_async() -> list[bytes]:
        async with await headwater.connect_async(tls_server.address, ca=certs.ca) as client:
            return [e.value for e in (await client.read("tls_trades")).events]

    assert asyncio.run(read_async()) == [b"a", b"b"]


def test_convergedb_entities_client_over_tls(tls_server: Server, certs: Certs) -> None:
    address = tls_server.address_of("convergedb")
    with entities.connect(address, name="tls-writer", ca=certs.ca) as writer:
        sensors = writer.create_kind(Sensor, "tls_sensors")
        writer.assert_(sensors, "s1", Sensor("north", 21.5))
        writer.flush()
        stored = writer.get(sensors, "s1")
    assert stored is not None and stored.value == Sensor("north", 21.5)
    kinds = entities.list_kinds(tls_server.address_of("http"), ca=certs.ca)
    assert "tls_sensors" in [kind.name for kind in kinds]


def test_ripple_worker_over_tls(tls_server: Server, certs: Certs) -> None:
    address = tls_server.address_of("ripple")
    with Worker("tls-worker", {"tls_vwap": Vwap}, address, ca=certs.ca) as worker:
        worker.set("tls_vwap", "AAPL", Vwap("AAPL", 150.5, 900))
        worker.checkpoint()  # durable and visible on the server
    with headwater.connect(tls_server.address, ca=certs.ca) as hw:
        rows = hw.query("SELECT symbol, vwap, volume FROM tls_vwap").rows
    assert rows == [("AAPL", "150.5", 900)]  # a DOUBLE arrives as its text


def test_rivven_producer_and_consumer_over_tls(tls_server: Server, certs: Certs) -> None:
    with headwater.connect(tls_server.address, ca=certs.ca) as hw:
        hw.create_stream("tls_rivven")
    with Producer(tls_server.address_of("rivven"), ca=certs.ca) as producer:
        assert producer.send("tls_rivven", b"over tls").result(TIMEOUT).offset == 0
    with Consumer(tls_server.address_of("rivven"), ca=certs.ca) as consumer:
        consumer.assign([("tls_rivven", 0)])
        record = consumer.poll(timeout=TIMEOUT)
    assert record is not None and record.value == b"over tls"


def later_clients(server: Server, certs: Certs, cert: Path | None) -> dict[str, object]:
    """One operation each by a Rivven producer, a Kafka client (librdkafka) and a
    PostgreSQL client (libpq through psycopg), over TLS with the token (and ``cert``);
    what each answered, or its error."""
    answers: dict[str, object] = {}
    try:
        with Producer(
            server.address_of("rivven"), token=TOKEN, ca=certs.ca, cert=cert, reconnect=False
        ) as producer:
            answers["rivven"] = producer.send("tls_later", b"x").result(TIMEOUT).offset >= 0
    except Exception as exc:  # what the client raised is the answer here
        answers["rivven"] = exc
    kafka_options = {
        "bootstrap.servers": server.address_of("kafka"),
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "u",
        "sasl.password": TOKEN,
        "ssl.ca.location": str(certs.ca),
        **({"ssl.certificate.location": str(cert), "ssl.key.location": str(cert)} if cert else {}),
    }
    try:
        topics = AdminClient(kafka_options).list_topics(timeout=10).topics
        answers["kafka"] = "tls_later" in topics
    except confluent_kafka.KafkaException as exc:
        answers["kafka"] = exc
    dsn = (
        f"host=127.0.0.1 port={server.ports['postgres']} user=u dbname=0 password={TOKEN}"
        f" sslmode=verify-full sslrootcert={certs.ca} connect_timeout=10"
        + (f" sslcert={cert} sslkey={cert}" if cert else "")
    )
    try:
        with psycopg.connect(dsn) as conn:
            answers["postgres"] = conn.execute("SELECT 42").fetchone() == (42,)
    except psycopg.OperationalError as exc:
        answers["postgres"] = exc
    return answers


def test_mutual_tls_on_the_rivven_kafka_and_postgres_listeners(
    mtls_server: Server, certs: Certs
) -> None:
    with headwater.connect(mtls_server.address, token=TOKEN, ca=certs.ca, cert=certs.worker) as hw:
        hw.create_stream("tls_later")
    assert later_clients(mtls_server, certs, certs.worker) == dict.fromkeys(
        ("rivven", "kafka", "postgres"), True
    )
    for cert in (None, certs.foreign):
        refused = later_clients(mtls_server, certs, cert)
        assert all(isinstance(answer, Exception) for answer in refused.values()), refused
    log = mtls_server.log_text()
    for listener in ("rivven", "kafka", "postgres"):
        assert f"{listener}: TLS handshake with 127.0.0.1:" in log or listener == "postgres"
    assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in log and "CERTIFICATE_VERIFY_FAILED" in log
    assert_clean_log(mtls_server)
    # Still serving clients with a good certificate.
    assert later_clients(mtls_server, certs, certs.worker)["rivven"] is True


def test_https_api_and_wss_gateway(tls_server: Server, certs: Certs) -> None:
    with headwater.connect(tls_server.address, ca=certs.ca) as hw:
        hw.create_stream("tls_feed")
        streams = https_get(tls_server, "/api/streams", context(certs))
        assert "tls_feed" in [s["name"] for s in streams["streams"]]
        url = f"wss://127.0.0.1:{tls_server.ports['http']}/ws"
        with ws_connect(url, ssl=context(certs), open_timeout=TIMEOUT) as ws:
            ws.send(json.dumps({"type": "SUBSCRIBE", "sourceId": "tls_feed", "mode": "push"}))
            assert json.loads(ws.recv(timeout=TIMEOUT))["type"] == "SUBSCRIBE_OK"
            hw.append("tls_feed", [b"over wss"])
            result = json.loads(ws.recv(timeout=TIMEOUT))
    assert result["type"] == "RESULT" and result["data"]["value"] == "over wss"


def test_cli_and_spark_connector_over_tls(tls_server: Server, certs: Certs) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEADWATER_")}
    command = [sys.executable, "-m", "headwater.cli.main", "stream"]
    server = ["--server", tls_server.address]
    created = subprocess.run(
        [*command, "create", "tls_cli", *server, "--ca-file", str(certs.ca)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert created.returncode == 0, created.stderr
    # The CA from the environment, as the token and server can be.
    listed = subprocess.run(
        [*command, "list", "--json", *server],
        capture_output=True,
        text=True,
        env={**env, "HEADWATER_CA_FILE": str(certs.ca)},
        timeout=60,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    assert "tls_cli" in [s["name"] for s in json.loads(listed.stdout)]
    plain = subprocess.run(
        [*command, "list", *server], capture_output=True, text=True, env=env, timeout=60
    )
    assert plain.returncode == 2 and "tls=True" in plain.stderr
    assert "Traceback" not in plain.stderr

    options = ConnectionOptions.parse({"server": tls_server.address, "cafile": str(certs.ca)})
    with open_client(options) as client:
        assert "tls_cli" in [s.name for s in client.list_streams()]


# ---- plain clients refused ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("listener", "first_bytes"),
    [
        ("kimberlite", b"\x00\x00\x00\x10" + b"\x00" * 16),
        ("convergedb", b"\x01\x00\x00\x00\x00\x05hello"),
        ("ripple", b"\x00\x00\x00\x08" + b"\x00" * 8),
        ("http", b"GET /api/streams HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("rivven", b"\x00\x00\x00\x08" + b"\x00" * 8),
        ("kafka", b"\x00\x00\x00\x0c\x00\x12\x00\x03" + b"\x00" * 8),
    ],
)
def test_plain_clients_are_refused_and_the_listener_keeps_serving(
    tls_server: Server, certs: Certs, listener: str, first_bytes: bytes
) -> None:
    plain_client_refused(tls_server, listener, first_bytes)
    # The same listener still serves a TLS client.
    with (
        socket.create_connection(("127.0.0.1", tls_server.ports[listener])) as raw,
        context(certs).wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        assert tls.version() in ("TLSv1.2", "TLSv1.3")


def test_plain_sdk_clients_are_told_to_use_tls(tls_server: Server, certs: Certs) -> None:
    with pytest.raises(ServerUnavailable, match="connect with tls=True"):
        headwater.connect(tls_server.address, reconnect=False, timeout=TIMEOUT)
    with pytest.raises(ServerUnavailable, match="connect with tls=True"):
        entities.connect(tls_server.address_of("convergedb"), timeout=TIMEOUT)
    with pytest.raises(OSError):  # the connection closed, whatever urllib calls it
        urllib.request.urlopen(f"http://127.0.0.1:{tls_server.ports['http']}/api/streams")
    with pytest.raises(InvalidMessage, match="did not receive a valid HTTP response"):
        ws_connect(f"ws://127.0.0.1:{tls_server.ports['http']}/ws", open_timeout=TIMEOUT)
    # A client that does not trust the server's CA refuses it in turn.
    with pytest.raises(ServerUnavailable, match="certificate did not verify"):
        headwater.connect(tls_server.address, tls=True, reconnect=False, timeout=TIMEOUT)
    with headwater.connect(tls_server.address, ca=certs.ca) as hw:
        hw.list_streams()


# ---- mutual TLS and certificate identities ------------------------------------------------


def test_mutual_tls_accepts_a_certificate_of_the_client_ca(
    mtls_server: Server, certs: Certs
) -> None:
    with headwater.connect(
        mtls_server.address, token=TOKEN, ca=certs.ca, cert=certs.stranger
    ) as hw:
        hw.create_stream("mtls_events")
        hw.append("mtls_events", [b"x"])
    streams = https_get(mtls_server, "/api/streams", context(certs, certs.stranger))
    assert "mtls_events" in [s["name"] for s in streams["streams"]]
    address = mtls_server.address_of("convergedb")
    with entities.connect(
        address, token=TOKEN, name="mtls", ca=certs.ca, cert=certs.stranger
    ) as writer:
        writer.create_kind(Sensor, "mtls_sensors")


@pytest.mark.parametrize("client_cert", ["none", "foreign"])
def test_mutual_tls_refuses_clients_without_a_certificate_of_the_client_ca(
    mtls_server: Server, certs: Certs, client_cert: str
) -> None:
    cert = None if client_cert == "none" else certs.foreign
    with pytest.raises(ServerUnavailable, match="requires a client certificate"):
        headwater.connect(mtls_server.address, token=TOKEN, ca=certs.ca, cert=cert, reconnect=False)
    expected = "PEER_DID_NOT_RETURN_A_CERTIFICATE" if cert is None else "CERTIFICATE_VERIFY_FAILED"
    wait_until(lambda: expected in mtls_server.log_text(), message=mtls_server.log_tail)
    tls = context(certs) if cert is None else context(certs, cert)
    with pytest.raises(OSError):  # ssl.SSLError, a reset, urllib's URLError
        https_get(mtls_server, "/api/streams", tls)
    assert_clean_log(mtls_server)
    # Still serving a client with a good certificate.
    with headwater.connect(mtls_server.address, token=TOKEN, ca=certs.ca, cert=certs.worker) as hw:
        hw.list_streams()


def test_a_ripple_worker_authenticates_by_its_certificate(
    mtls_server: Server, certs: Certs
) -> None:
    address = mtls_server.address_of("ripple")
    # No token: the certificate's CN (worker-1) is mapped to tenant 0 by cert_cn.
    with Worker("cert-worker", {"mtls_vwap": Vwap}, address, ca=certs.ca, cert=certs.worker) as w:
        w.set("mtls_vwap", "MSFT", Vwap("MSFT", 410.0, 5))
        w.checkpoint()
    with headwater.connect(mtls_server.address, token=TOKEN, ca=certs.ca, cert=certs.worker) as hw:
        assert hw.query("SELECT symbol, volume FROM mtls_vwap").rows == [("MSFT", 5)]


def test_a_ripple_worker_with_an_unmapped_certificate_is_refused(
    mtls_server: Server, certs: Certs
) -> None:
    address = mtls_server.address_of("ripple")
    with pytest.raises(WorkerError, match=r"authentication failed.*stranger"):
        Worker("stray", {"mtls_stray": Vwap}, address, ca=certs.ca, cert=certs.stranger)
    with pytest.raises((WorkerError, ServerUnavailable), match="requires a client certificate"):
        Worker("stray", {"mtls_stray": Vwap}, address, ca=certs.ca, reconnect_attempts=1)
    # Nothing was created for the refused workers.
    kinds = https_get(mtls_server, "/api/kinds", context(certs, certs.worker))["kinds"]
    assert "mtls_stray" not in [kind["name"] for kind in kinds]


def test_a_certificate_that_does_not_load_stops_start_up_in_one_line(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    config = tmp_path / "headwater.toml"
    config.write_text(f'[tls]\ncert = "{garbage}"\nkey = "{garbage}"\n')
    serve = [sys.executable, "-m", "headwater.cli.main", "serve"]
    started = subprocess.run(
        [*serve, "--data-dir", str(tmp_path / "data"), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert started.returncode == 2
    assert "tls: cannot load the certificate" in started.stderr
    assert "Traceback" not in started.stderr


def test_a_tls_handshake_not_done_in_time_is_closed_and_counted(
    make_server: Callable[..., Server], certs: Certs
) -> None:
    config = (
        f'[tls]\ncert = "{certs.server}"\nkey = "{certs.server}"\n'
        "[limits]\nhandshake_timeout_s = 0.5\n"
    )
    server = make_server(config=config, listen={"http": LOCAL})
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as silent:
        port = silent.getsockname()[1]
        assert silent.recv(1) == b""  # closed by the server; no ClientHello was sent
    line = wait_until(lambda: warned_about(server, port), message=server.log_tail)
    assert "not done within 0.5s: closed" in line
    request = urllib.request.Request(f"https://127.0.0.1:{server.ports['http']}/metrics")
    with urllib.request.urlopen(request, timeout=TIMEOUT, context=context(certs)) as page:
        metrics = page.read().decode()
    assert 'limit="handshake_timeout_s",listener="kimberlite"} 1.0' in metrics
    with headwater.connect(server.address, ca=certs.ca) as hw:  # still serving
        hw.list_streams()


def test_tls_handshakes_under_way_are_bounded_by_max_connections(
    make_server: Callable[..., Server], certs: Certs
) -> None:
    config = (
        f'[tls]\ncert = "{certs.server}"\nkey = "{certs.server}"\n[limits]\nmax_connections = 2\n'
    )
    server = make_server(config=config)
    address = ("127.0.0.1", server.port)
    idle = [socket.create_connection(address, timeout=TIMEOUT) for _ in range(2)]
    with socket.create_connection(address, timeout=TIMEOUT) as third:
        port = third.getsockname()[1]
        assert third.recv(1) == b""  # closed at once: two handshakes hold the listener
    refusal = f"kimberlite: 127.0.0.1:{port} refused: 2 TLS handshakes under way"
    wait_until(lambda: refusal in server.log_text(), message=server.log_tail)
    ports = [s.getsockname()[1] for s in idle]
    for sock in idle:
        sock.close()  # their handshakes fail: the listener has room again
    for idle_port in ports:
        wait_until(lambda p=idle_port: warned_about(server, p), message=server.log_tail)
    with headwater.connect(server.address, ca=certs.ca) as hw:
        hw.list_streams()
    assert_clean_log(server)
