"""The PostgreSQL listener's limits while a client is inside the TLS handshake it asked
for (SSLRequest answered 'S', then no ClientHello): ``handshake_timeout_s`` closes it
with a FATAL error naming the limit, and its ``max_connections`` place is given back.

A connection closed during that handshake never hears ``connection_lost`` (the TLS
layer keeps it), so the listener must release the place itself: before it did, about
one stalled client in three kept its place for good, and a few of them locked every
client out (docs/operations.md, "Limits")."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import trustme
from limits_clients import read_to_end
from servers import LOCAL, Server, serving

from headwater.protocols.postgres import messages as m

MAX_CONNECTIONS = 2
ROUNDS = 8  # of MAX_CONNECTIONS stalled handshakes at once: a leak shows within a few


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """``[tls]`` with a trustme certificate and small limits; yields the server and the
    CA file."""
    root = tmp_path_factory.mktemp("postgres_tls_limits")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(root / "ca.pem"))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(root / "server.pem")
    )
    config = f"""
[limits]
max_connections = {MAX_CONNECTIONS}
handshake_timeout_s = 0.5

[tls]
cert = "{root / "server.pem"}"
key = "{root / "server.pem"}"
"""
    listen = {"postgres": LOCAL, "kimberlite": ""}
    for server in serving(root / "server", config=config, listen=listen, clean_log=True):
        yield server, root / "ca.pem"


def stall_in_tls_handshakes(server: Server, clients: int) -> list[bytes]:
    """``clients`` connections ask for TLS, then send nothing: what the server sends each
    until it closes."""
    address = ("127.0.0.1", server.ports["postgres"])
    socks = [socket.create_connection(address, timeout=15) for _ in range(clients)]
    try:
        for sock in socks:
            sock.sendall(m.encode_ssl_request())
            assert sock.recv(1) == b"S"
        return [read_to_end(sock) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def test_clients_stalled_in_the_tls_handshake_give_their_places_back(
    tls_server: tuple[Server, Path],
) -> None:
    server, ca = tls_server
    for _ in range(ROUNDS):
        for answer in stall_in_tls_handshakes(server, MAX_CONNECTIONS):
            [error] = m.split_backend(answer)
            assert (error.fields["S"], error.fields["C"]) == ("FATAL", "08P01")
            assert "handshake_timeout_s" in error.fields["M"]
    dsn = (
        f"host=127.0.0.1 port={server.ports['postgres']} user=analyst dbname=0"
        f" sslmode=verify-full sslrootcert={ca} connect_timeout=15"
    )
    # Every place is free again: as many clients as max_connections are served at once.
    clients = [psycopg.connect(dsn, autocommit=True) for _ in range(MAX_CONNECTIONS)]
    try:
        for number, client in enumerate(clients):
            assert client.execute("SELECT %s::int", (number,)).fetchone() == (number,)
    finally:
        for client in clients:
            client.close()
