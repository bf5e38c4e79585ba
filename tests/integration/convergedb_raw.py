"""A small raw ConvergeDB test client over one blocking socket and the sans-I/O
:class:`~headwater.protocols.convergedb.connection.ClientConnection`."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence

from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.codes import ErrorCode, Opcode
from headwater.protocols.convergedb.connection import ClientConnection
from headwater.protocols.convergedb.fields import FieldSpec, FieldType
from waiting import wait_until


class Closed(AssertionError):
    """The server closed the connection."""


class CdbClient:
    """One ConvergeDB connection. Frames that arrive while waiting for another are kept
    in arrival order in :attr:`inbox` until taken."""

    def __init__(
        self,
        port: int,
        *,
        name: str = "",
        token: str = "",
        source_id: int | None = None,
        read_only: bool = False,
        deadline_ms: int = 0,
        connect: bool = True,
        timeout: float = 15.0,
        rcvbuf: int | None = None,
    ) -> None:
        if rcvbuf is None:
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        else:
            # Set before connecting, so the TCP window never grows past it: a client that
            # stops reading holds back the server after little more than this.
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            self.sock.settimeout(timeout)
            self.sock.connect(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = ClientConnection()
        self.timeout = timeout
        self.inbox: list[m.Frame] = []
        self.eof = False
        self.source_id: int | None = None
        if connect:
            stream, data = self.conn.connect(
                name,
                token,
                source_id=source_id,
                read_only=read_only,
                liveness_deadline_ms=deadline_ms,
            )
            self.sock.sendall(data)
            reply = self.reply(stream).message
            assert isinstance(reply, m.ConnectAck), reply
            self.source_id = reply.source_id

    # -- sending --

    def send(self, message: m.ClientMessage, *, ack: bool = False) -> int:
        stream, data = self.conn.send(message, ack=ack)
        self.sock.sendall(data)
        return stream

    def call(self, message: m.ClientMessage) -> m.Message:
        """Send a request that is answered and return the answer."""
        return self.reply(self.send(message, ack=True)).message

    def create_kind(
        self, name: str, fields: Sequence[tuple[str, int]], *, event_stream: bool = False
    ) -> m.KindAck:
        specs = [FieldSpec(n, FieldType(t)) for n, t in fields]
        reply = self.call(m.CreateKind(name, specs, event_stream))
        assert isinstance(reply, m.KindAck), reply
        return reply

    def barrier(self) -> None:
        reply = self.call(m.Heartbeat())
        assert reply == m.Ack(Opcode.HEARTBEAT), reply

    # -- receiving --

    def _fill(self, deadline: float) -> bool:
        if self.eof:
            raise Closed("the server closed the connection")
        self.sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            data = self.sock.recv(1 << 20)
        except TimeoutError:
            return False
        except ConnectionResetError:
            data = b""
        if not data:
            self.eof = True
            raise Closed("the server closed the connection")
        self.inbox.extend(self.conn.receive_data(data))
        return True

    def take(self, match: Callable[[m.Frame], bool], timeout: float | None = None) -> m.Frame:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            for i, frame in enumerate(self.inbox):
                if match(frame):
                    return self.inbox.pop(i)
            if time.monotonic() > deadline:
                raise AssertionError(f"no matching frame in time; inbox: {self.inbox[:5]}")
            self._fill(deadline)

    def reply(self, stream: int, timeout: float | None = None) -> m.Frame:
        """The answer on ``stream`` (an ACK, an ERROR or a QUERY's STATE)."""

        def is_reply(frame: m.Frame) -> bool:
            if frame.stream_id != stream:
                return False
            msg = frame.message
            if isinstance(msg, m.State):
                return msg.change == m.Change.QUERY
            return isinstance(
                msg, m.Ack | m.ConnectAck | m.KindAck | m.EpochEndAck | m.ErrorMessage
            )

        return self.take(is_reply, timeout)

    def collect(
        self, stop: Callable[[m.Frame], bool], timeout: float | None = None
    ) -> list[m.Frame]:
        """Every frame in arrival order (the inbox first) up to and including the first one
        for which ``stop`` is true; ``stop`` sees each frame once, in order, so it may count
        or remember. Frames after that one stay in the inbox."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        checked = 0
        while True:
            while checked < len(self.inbox):
                frame = self.inbox[checked]
                checked += 1
                if stop(frame):
                    frames, self.inbox = self.inbox[:checked], self.inbox[checked:]
                    return frames
            if time.monotonic() > deadline:
                raise AssertionError(f"collect: no stop frame in time after {checked} frames")
            self._fill(deadline)

    def messages(self, stream: int, count: int, timeout: float | None = None) -> list[m.Message]:
        """The next ``count`` messages on ``stream``, in arrival order (frames of other
        streams stay in the inbox)."""
        return [self.take(lambda f: f.stream_id == stream, timeout).message for _ in range(count)]

    def drain(self, duration: float) -> list[m.Frame]:
        """Everything that arrives within ``duration`` seconds (plus the inbox)."""
        deadline = time.monotonic() + duration
        while time.monotonic() < deadline:
            try:
                self._fill(deadline)
            except Closed:
                break
        frames, self.inbox = self.inbox, []
        return frames

    def until_closed(self, timeout: float = 15.0) -> list[m.Frame]:
        deadline = time.monotonic() + timeout
        while not self.eof:
            if time.monotonic() > deadline:
                raise AssertionError("the server did not close the connection")
            try:
                self._fill(deadline)
            except Closed:
                break
        frames, self.inbox = self.inbox, []
        return frames

    def close(self) -> None:
        self.sock.close()

    def abort(self) -> None:
        """Drop the connection with a RST, as a killed process would."""
        self.sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
        )
        self.sock.close()

    def __enter__(self) -> CdbClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_when_free(
    port: int, source_id: int, *, name: str = "", deadline_ms: int = 0
) -> CdbClient:
    """A connection as ``source_id`` once the server has seen that slot's previous
    connection end (until then it answers SOURCE_CONFLICT)."""

    def attempt() -> CdbClient | None:
        client = CdbClient(port, connect=False)
        stream, data = client.conn.connect(
            name, source_id=source_id, liveness_deadline_ms=deadline_ms
        )
        client.sock.sendall(data)
        reply = client.reply(stream).message
        if isinstance(reply, m.ErrorMessage) and reply.code == ErrorCode.SOURCE_CONFLICT:
            client.close()
            return None
        assert isinstance(reply, m.ConnectAck), reply
        client.source_id = reply.source_id
        return client

    return wait_until(attempt, message=f"source {source_id} stayed taken")


def eid(n: int) -> bytes:
    return n.to_bytes(32, "big")


def query(client: CdbClient, kind_id: int, entity: bytes) -> m.State | m.ErrorMessage:
    reply = client.call(m.Query(kind_id, entity))
    assert isinstance(reply, m.State | m.ErrorMessage), reply
    return reply


def query_many(
    client: CdbClient, kind_id: int, entities: Sequence[bytes], window: int = 512
) -> dict[bytes, m.State | m.ErrorMessage]:
    """QUERY each entity, ``window`` requests in flight at a time (one round trip each
    would take seconds for tens of thousands)."""
    out: dict[bytes, m.State | m.ErrorMessage] = {}
    for start in range(0, len(entities), window):
        chunk = entities[start : start + window]
        streams = [(e, client.send(m.Query(kind_id, e), ack=True)) for e in chunk]
        for entity, stream in streams:
            reply = client.reply(stream).message
            assert isinstance(reply, m.State | m.ErrorMessage), reply
            out[entity] = reply
    return out
