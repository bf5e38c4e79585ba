"""Clients of the limits tests: a well-behaved client of each binary listener, raw
sockets, the protocol's last word before a close, and the refusals counted in /metrics."""

from __future__ import annotations

import socket
import struct
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from convergedb_raw import CdbClient
from kimberlite_raw import RawClient
from kio.schema.api_versions.v3.request import ApiVersionsRequest
from kio.schema.api_versions.v3.response import ApiVersionsResponse
from prometheus_client.parser import text_string_to_metric_families
from servers import Server

from headwater.protocols.convergedb import messages as cm
from headwater.protocols.convergedb.codes import Opcode
from headwater.protocols.convergedb.frames import FrameDecoder, encode_header
from headwater.protocols.kafka.apis import ApiKey
from headwater.protocols.kafka.frames import decode_response, encode_request
from headwater.protocols.kimberlite import messages as km
from headwater.protocols.kimberlite.connection import ClientConnection as KimberliteClient
from headwater.protocols.kimberlite.frames import frame_header
from headwater.protocols.postgres import messages as pm
from headwater.protocols.ripple import envelope
from headwater.protocols.ripple import messages as rm
from headwater.protocols.ripple.connection import ClientConnection as RippleClient
from headwater.protocols.rivven import rivven_pb2 as pb
from headwater.protocols.rivven.connection import ClientConnection as RivvenClient

TCP_LISTENERS = ("kimberlite", "convergedb", "ripple")
# The later binary listeners: the same limits through the same ConnectionGuard. Kafka
# has no error frame a broker may send unasked, so it has no last word before a close.
LATER_LISTENERS = ("rivven", "postgres", "kafka")
ALL_BINARY = (*TCP_LISTENERS, *LATER_LISTENERS)
WITH_LAST_WORD = (*TCP_LISTENERS, "rivven", "postgres")
SCHEMA = rm.Schema("limits", 1, (rm.Field("n", rm.FieldType.INT),))


def refusals(server: Server, token: str | None = None) -> dict[tuple[str, str], float]:
    """headwater_limit_refusals_total by (limit, listener); ``token``: an admin token,
    for a server whose /metrics requires one."""
    url = f"http://127.0.0.1:{server.ports['http']}/metrics"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=15) as answer:
        text = answer.read().decode()
    return {
        (sample.labels["limit"], sample.labels["listener"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "headwater_limit_refusals"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def counted(
    server: Server,
    before: dict[tuple[str, str], float],
    limit: str,
    listener: str,
    token: str | None = None,
) -> int:
    after = refusals(server, token)
    return int(after.get((limit, listener), 0) - before.get((limit, listener), 0))


def raw_socket(server: Server, listener: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.ports[listener]), timeout=15)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_to_end(sock: socket.socket, timeout: float = 15.0) -> bytes:
    """Everything the server sends until it closes; AssertionError if it does not."""
    sock.settimeout(timeout)
    data = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the server did not close in {timeout}s") from None
    return bytes(data)


def last_word(listener: str, data: bytes) -> tuple[object, str]:
    """The protocol's error the server sent before closing: (its code, its message)."""
    if listener == "kimberlite":
        (response,) = KimberliteClient().receive_data(data)
        assert response.request_id == 0
        assert isinstance(response.payload, km.ErrorResponse), response
        return response.payload.code, response.payload.message
    if listener == "convergedb":
        frames = FrameDecoder()
        frames.feed(data)
        (raw,) = list(frames)
        message = cm.decode_message(raw.opcode, raw.payload)
        assert isinstance(message, cm.ErrorMessage), message
        assert raw.stream_id == 0
        return message.code, message.message
    if listener == "rivven":
        (frame,) = RivvenClient().receive_data(data)
        assert frame.correlation_id == 0
        return frame.response.error.code, frame.response.error.message
    if listener == "postgres":
        error = pm.split_backend(data)[-1]
        assert (error.type, error.fields["S"]) == ("E", "FATAL"), error
        return error.fields["C"], error.fields["M"]
    assert listener == "ripple", f"{listener} sends no last word"
    envelopes = envelope.EnvelopeDecoder()
    envelopes.feed(data)
    (env,) = list(envelopes)
    answer = rm.decode_message(env)
    assert isinstance(answer, rm.SchemaNegotiation) and not answer.ok, answer
    (reason,) = answer.errors
    return None, reason


@dataclass
class Good:
    """A well-behaved, authenticated client of one listener; :meth:`check` makes a
    round trip."""

    listener: str
    check: Callable[[], None]
    sock: socket.socket

    def close(self) -> None:
        self.sock.close()


def good_client(server: Server, listener: str) -> Good:
    if listener == "kimberlite":
        kimberlite = RawClient(server.ports["kimberlite"])
        return Good(
            listener,
            lambda: expect_list(kimberlite.call(km.ListStreamsRequest())),
            kimberlite.sock,
        )
    if listener == "convergedb":
        cdb = CdbClient(server.ports["convergedb"], name=f"w{uuid.uuid4().hex[:8]}")
        return Good(listener, cdb.barrier, cdb.sock)
    if listener in LATER_LISTENERS:
        return _later_client(server, listener)
    sock = raw_socket(server, "ripple")
    worker = RippleClient(f"w{uuid.uuid4().hex[:8]}")
    sock.sendall(worker.handshake({"limits": SCHEMA}))
    assert ripple_next(sock, worker, rm.SchemaNegotiation) == rm.SchemaNegotiation(True, ())

    def checkpoint() -> None:
        sock.sendall(worker.checkpoint_request(uuid.uuid4().hex, 1))
        assert isinstance(ripple_next(sock, worker, rm.CheckpointAck), rm.CheckpointAck)

    return Good(listener, checkpoint, sock)


def _later_client(server: Server, listener: str) -> Good:
    """A Rivven client that pings, a PostgreSQL one that runs SELECT 1, a Kafka one that
    asks ApiVersions (servers without required auth)."""
    sock = raw_socket(server, listener)
    if listener == "rivven":
        rivven = RivvenClient("limits")

        def ping() -> None:
            correlation_id, data = rivven.send_request(pb.PingRequest())
            sock.sendall(data)
            while not (frames := rivven.receive_data(_recv(sock))):
                pass
            (frame,) = frames
            assert frame.correlation_id == correlation_id
            assert frame.response.WhichOneof("response_type") == "ping", frame.response

        ping()
        return Good(listener, ping, sock)
    if listener == "postgres":
        sock.sendall(pm.encode_startup({"user": "limits", "database": "0"}))
        _until_ready(sock)

        def select() -> None:
            sock.sendall(pm.encode_frontend(pm.Query("SELECT 1")))
            assert "D" in [message.type for message in _until_ready(sock)]

        return Good(listener, select, sock)
    correlation = iter(range(1, 1 << 30))

    def api_versions() -> None:
        correlation_id = next(correlation)
        sock.sendall(
            encode_request(
                correlation_id,
                ApiVersionsRequest(client_software_name="limits", client_software_version="1"),
            )
        )
        (size,) = struct.unpack(">i", _exact(sock, 4))
        got, answer = decode_response(ApiKey.API_VERSIONS, 3, _exact(sock, size))
        assert got == correlation_id and isinstance(answer, ApiVersionsResponse), answer

    api_versions()
    return Good(listener, api_versions, sock)


def _recv(sock: socket.socket, most: int = 1 << 16) -> bytes:
    data = sock.recv(most)
    assert data, "the server closed the connection"
    return data


def _exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        data += _recv(sock, n - len(data))
    return bytes(data)


def _until_ready(sock: socket.socket) -> list[pm.BackendMessage]:
    """PostgreSQL messages up to ReadyForQuery (none may be an error)."""
    data = bytearray()
    while True:
        data += _recv(sock)
        if data.endswith(b"Z\x00\x00\x00\x05I"):  # ReadyForQuery, idle
            messages = pm.split_backend(bytes(data))
            assert all(message.type != "E" for message in messages), messages
            return messages


def expect_list(reply: km.ResponsePayload) -> None:
    assert isinstance(reply, km.StreamsResponse), reply


def ripple_next(sock: socket.socket, worker: RippleClient, kind: type) -> rm.Message:
    while True:
        data = sock.recv(1 << 16)
        assert data, "the server closed the Ripple connection"
        for received in worker.receive_data(data):
            if isinstance(received.message, kind):
                return received.message


def serves(server: Server, listener: str) -> None:
    """A new well-behaved client of ``listener`` gets its answers."""
    client = good_client(server, listener)
    try:
        client.check()
    finally:
        client.close()


def huge_frame_head(listener: str) -> bytes:
    """The header of a frame claiming 16 MiB, as the first bytes of a connection."""
    if listener == "kimberlite":
        return frame_header(16 << 20, 0)
    if listener == "convergedb":
        return encode_header(1, Opcode.CONNECT, 16 << 20)
    if listener == "rivven":  # its frames are at most 10 MiB
        return struct.pack(">I", 8 << 20)
    if listener == "kafka":
        return struct.pack(">i", 16 << 20)
    if listener == "postgres":  # a startup packet is at most 10,000 bytes (PostgreSQL's)
        return struct.pack(">ii", 9_000, pm.PROTOCOL_VERSION)
    return envelope.HEADER.pack(
        envelope.MAGIC, 1, int(envelope.MessageType.HANDSHAKE), 0, 1, 0,
        envelope.ZERO_FINGERPRINT, 16 << 20,
    )  # fmt: skip


def try_serves(server: Server, listener: str) -> bool:
    try:
        serves(server, listener)
    except (AssertionError, OSError):
        return False
    return True
