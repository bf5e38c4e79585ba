"""Clients of the limits tests: a well-behaved client of each binary listener, raw
sockets, the protocol's last word before a close, and the refusals counted in /metrics."""

from __future__ import annotations

import socket
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from convergedb_raw import CdbClient
from kimberlite_raw import RawClient
from prometheus_client.parser import text_string_to_metric_families
from servers import Server

from headwater.protocols.convergedb import messages as cm
from headwater.protocols.convergedb.codes import Opcode
from headwater.protocols.convergedb.frames import FrameDecoder, encode_header
from headwater.protocols.kimberlite import messages as km
from headwater.protocols.kimberlite.connection import ClientConnection as KimberliteClient
from headwater.protocols.kimberlite.frames import frame_header
from headwater.protocols.ripple import envelope
from headwater.protocols.ripple import messages as rm
from headwater.protocols.ripple.connection import ClientConnection as RippleClient

TCP_LISTENERS = ("kimberlite", "convergedb", "ripple")
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
    sock = raw_socket(server, "ripple")
    worker = RippleClient(f"w{uuid.uuid4().hex[:8]}")
    sock.sendall(worker.handshake({"limits": SCHEMA}))
    assert ripple_next(sock, worker, rm.SchemaNegotiation) == rm.SchemaNegotiation(True, ())

    def checkpoint() -> None:
        sock.sendall(worker.checkpoint_request(uuid.uuid4().hex, 1))
        assert isinstance(ripple_next(sock, worker, rm.CheckpointAck), rm.CheckpointAck)

    return Good(listener, checkpoint, sock)


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
