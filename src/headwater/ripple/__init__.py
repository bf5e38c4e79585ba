"""A Python Ripple worker: publish keyed outputs into headwater entity kinds.

    @dataclass
    class Vwap:
        symbol: str
        vwap: float
        volume: int

    with headwater.ripple.Worker("vwap-job", {"vwap": Vwap}) as worker:
        worker.set("vwap", "AAPL", Vwap("AAPL", 150.5, 900))
        worker.patch("vwap", "AAPL", vwap=151.0)
        worker.remove("vwap", "MSFT")
        worker.checkpoint()          # everything above is durable on the server

Sequence numbers are per output, 1, 2, 3, ... unless the caller passes its own (a
deterministic replay). Deltas sent since the last acknowledged checkpoint are kept; when
the connection breaks, the worker reconnects (exponential backoff with jitter), says
Handshake again and resends them with their original sequence numbers, which the server
drops if it had applied them. A background thread sends heartbeats and answers the
server's Checkpoint_requests (everything sent before one is already on its way, so the
acknowledgement is immediate).
"""

from __future__ import annotations

import dataclasses
import select
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from headwater.client.aio import backoff_delay, parse_server
from headwater.errors import ProtocolError, UsageError
from headwater.protocols.ripple import messages as rm
from headwater.protocols.ripple.connection import ClientConnection

DEFAULT_SERVER = "127.0.0.1:7403"
DEFAULT_PORT = 7403
_TYPES: dict[object, rm.FieldType] = {
    str: rm.FieldType.STRING,
    int: rm.FieldType.INT,
    float: rm.FieldType.FLOAT,
    bool: rm.FieldType.BOOL,
}
_NAMED = {t.__name__: t for t in (str, int, float, bool)}  # string annotations


class WorkerError(Exception):
    """The server refused the worker (its Handshake or a delta), or stayed unreachable."""


def schema_of(cls: type, name: str | None = None, version: int = 1) -> rm.Schema:
    """A Ripple schema from a dataclass: str -> String, int -> Int, float -> Float,
    bool -> Bool, in field order."""
    if not dataclasses.is_dataclass(cls):
        raise UsageError(f"{cls!r} is not a dataclass")
    fields = []
    for f in dataclasses.fields(cls):
        kind = f.type if isinstance(f.type, type) else _NAMED.get(str(f.type))
        if kind in _TYPES:
            fields.append(rm.Field(f.name, _TYPES[kind]))
        else:
            raise UsageError(f"field {f.name}: type {f.type!r} has no Ripple type")
    return rm.Schema(name or cls.__name__.lower(), version, tuple(fields))


@dataclasses.dataclass(frozen=True)
class _Sent:
    output: str
    key: str | bytes
    delta: rm.Delta
    sequence_no: int
    watermark_ns: int | None


class Worker:
    def __init__(
        self,
        worker_id: str,
        outputs: Mapping[str, type | rm.Schema],
        server: str = DEFAULT_SERVER,
        *,
        heartbeat_s: float = 5.0,
        timeout: float = 30.0,
        reconnect_attempts: int = 8,
        resume: bool = False,
    ) -> None:
        """``resume``: continue numbering after the last sequence number the server
        applied for this worker (asked with a checkpoint at start), for a worker that
        does not replay deterministically; by default numbering starts at 1, and a
        restarted worker resending from its checkpoint gets its old deltas dropped."""
        self.worker_id = worker_id
        self.schemas = {
            out: s if isinstance(s, rm.Schema) else schema_of(s, out) for out, s in outputs.items()
        }
        self.address = parse_server(server, DEFAULT_PORT)
        self.timeout = timeout
        self.reconnect_attempts = reconnect_attempts
        self._lock = threading.RLock()
        self._pending: list[_Sent] = []  # since the last acknowledged checkpoint
        self._next: dict[str, int] = {}
        self._sock: socket.socket | None = None
        self._conn: ClientConnection | None = None
        self._closed = False
        self.reconnects = 0
        self._connect()
        if resume:
            last = self.checkpoint()
            self._next = {output: last + 1 for output in self.schemas}
        self._stop = threading.Event()
        self._heartbeats = threading.Thread(
            target=self._beat, args=(heartbeat_s,), name="ripple-heartbeat", daemon=True
        )
        self._heartbeats.start()

    # ---- public API -----------------------------------------------------------------

    def set(self, output: str, key: str | bytes, record: Any, **kw: Any) -> int:
        """Replace the entity's state with ``record`` (a dataclass or a mapping)."""
        if dataclasses.is_dataclass(record) and not isinstance(record, type):
            values = dataclasses.asdict(record)
        else:
            values = dict(record)
        return self._send(output, key, rm.Set(values), **kw)

    def patch(
        self,
        output: str,
        key: str | bytes,
        *,
        sequence_no: int | None = None,
        watermark_ns: int | None = None,
        **fields: Any,
    ) -> int:
        """Change only ``fields`` (sent in their text form, as §4 has it)."""
        ops = tuple(rm.FieldSet(name, rm.Atom(_text(v))) for name, v in fields.items())
        return self._send(
            output, key, rm.Patch(ops), sequence_no=sequence_no, watermark_ns=watermark_ns
        )

    def remove(self, output: str, key: str | bytes, **kw: Any) -> int:
        return self._send(output, key, rm.Remove(), **kw)

    def checkpoint(self, checkpoint_id: str | None = None, epoch: int = 0) -> int:
        """Wait until the server made everything sent so far durable and visible;
        returns the server's last applied sequence number."""
        checkpoint_id = checkpoint_id or uuid.uuid4().hex
        with self._lock:
            for attempt in range(self.reconnect_attempts + 1):
                try:
                    assert self._sock is not None and self._conn is not None
                    self._sock.sendall(self._conn.checkpoint_request(checkpoint_id, epoch))
                    ack = self._wait_for(rm.CheckpointAck)
                    assert isinstance(ack, rm.CheckpointAck)
                    self._pending.clear()
                    return ack.last_sequence_no
                except OSError:
                    self._reconnect(attempt + 1)
        raise WorkerError("the checkpoint failed after every reconnect")

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._closed = True
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------

    def _send(
        self,
        output: str,
        key: str | bytes,
        delta: rm.Delta,
        *,
        sequence_no: int | None = None,
        watermark_ns: int | None = None,
    ) -> int:
        with self._lock:
            if output not in self.schemas:
                raise UsageError(f"output {output!r} was not declared")
            seq = sequence_no if sequence_no is not None else self._next.get(output, 1)
            self._next[output] = max(self._next.get(output, 1), seq + 1)
            sent = _Sent(output, key, delta, seq, watermark_ns)
            self._pending.append(sent)
            try:
                self._write(sent)
            except OSError:
                self._reconnect(1)  # resends everything pending, this one included
            return seq

    def _write(self, sent: _Sent) -> None:
        assert self._sock is not None and self._conn is not None
        data = self._conn.send_delta(
            sent.output,
            sent.key,
            sent.delta,
            sequence_no=sent.sequence_no,
            watermark_ns=sent.watermark_ns,
        )
        self._sock.sendall(data)

    def _connect(self) -> None:
        sock = socket.create_connection(self.address, timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self._conn = sock, ClientConnection(self.worker_id)
        sock.sendall(self._conn.handshake(self.schemas))
        answer = self._wait_for(rm.SchemaNegotiation)
        assert isinstance(answer, rm.SchemaNegotiation)
        if not answer.ok:
            sock.close()
            self._sock = None
            raise WorkerError("the server refused the worker: " + "; ".join(answer.errors))

    def _reconnect(self, first_attempt: int) -> None:
        if self._closed:
            raise WorkerError("the worker is closed")
        for attempt in range(first_attempt, self.reconnect_attempts + 1):
            time.sleep(backoff_delay(attempt, 0.05, 2.0))
            try:
                if self._sock is not None:
                    self._sock.close()
                self._connect()
                for sent in self._pending:
                    self._write(sent)
                self.reconnects += 1
                return
            except OSError:
                continue
        raise WorkerError(f"no Ripple server at {self.address[0]}:{self.address[1]}")

    def _wait_for(self, kind: type) -> rm.Message:
        assert self._sock is not None and self._conn is not None
        while True:
            data = self._sock.recv(1 << 16)
            if not data:
                raise ConnectionResetError("the server closed the connection")
            try:
                received = self._conn.receive_data(data)
            except ProtocolError as exc:
                raise ConnectionResetError(f"bad bytes from the server: {exc}") from None
            for item in received:
                message = item.message
                if isinstance(message, rm.CheckpointRequest):
                    self._answer(message)
                    continue
                refused = isinstance(message, rm.SchemaNegotiation) and not message.ok
                if refused and kind is not rm.SchemaNegotiation:
                    assert isinstance(message, rm.SchemaNegotiation)
                    raise WorkerError("the server refused: " + "; ".join(message.errors))
                if isinstance(message, kind):
                    return message

    def _answer(self, request: rm.CheckpointRequest) -> None:
        """The server's checkpoint: everything this worker sent before the request is in
        the socket already (the server reads in order), so acknowledge at once."""
        assert self._sock is not None and self._conn is not None
        last = max(self._next.values(), default=1) - 1
        self._sock.sendall(self._conn.checkpoint_ack(request.checkpoint_id, request.epoch, last))

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            with self._lock:
                if self._sock is None or self._conn is None:
                    return
                try:
                    self._sock.sendall(self._conn.heartbeat(time.time_ns(), 0.0))
                    self._poll()
                except (OSError, ProtocolError):
                    continue  # the next send or checkpoint reconnects

    def _poll(self) -> None:
        """Answer what the server sent meanwhile (its Checkpoint_requests)."""
        assert self._sock is not None and self._conn is not None
        while select.select([self._sock], [], [], 0)[0]:
            data = self._sock.recv(1 << 16)
            if not data:
                raise ConnectionResetError("the server closed the connection")
            for item in self._conn.receive_data(data):
                if isinstance(item.message, rm.CheckpointRequest):
                    self._answer(item.message)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


__all__ = ["Worker", "WorkerError", "schema_of"]
