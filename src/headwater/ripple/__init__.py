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
deterministic replay). A delta is framed in the caller's thread (a bad one raises there)
and written by the worker's event-loop thread, which batches what several calls framed
into one write. Deltas sent since the last acknowledged checkpoint are kept; when the
connection breaks, the worker reconnects (exponential backoff with jitter, through the
connection core every SDK client shares: :mod:`headwater.client._core`), says Handshake again
and resends them with their original sequence numbers, which the server drops if it had
applied them. The loop thread also sends heartbeats and answers the server's
Checkpoint_requests (everything sent before one is already on its way, so the
acknowledgement is immediate).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from headwater.client._core.blocking import Blocking, LoopThread
from headwater.client._core.link import Link, NotSent
from headwater.client._core.session import Resumable, Session, parse_server
from headwater.client._core.tls import PathLike, client_context
from headwater.client.errors import ClientError, ConnectionLost, ServerUnavailable
from headwater.errors import HeadwaterError, UsageError
from headwater.protocols.ripple import messages as rm
from headwater.protocols.ripple.connection import ClientConnection, Received

DEFAULT_SERVER = "127.0.0.1:7403"
DEFAULT_PORT = 7403
_TYPES: dict[object, rm.FieldType] = {
    str: rm.FieldType.STRING,
    int: rm.FieldType.INT,
    float: rm.FieldType.FLOAT,
    bool: rm.FieldType.BOOL,
}
_NAMED = {t.__name__: t for t in (str, int, float, bool)}  # string annotations
_HANDSHAKE = rm.SchemaNegotiation
"""The key the Handshake's answer is awaited on (a checkpoint's is its id, a str)."""


class WorkerError(ClientError):
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


class _Link(Link[Received, rm.Message]):
    """One worker connection over the Ripple codec. What is framed for it waits in
    ``outbox`` (under the worker's guard), so envelopes leave in the order they were
    numbered whichever thread framed them."""

    codec: ClientConnection

    def __init__(
        self,
        worker_id: str,
        on_lost: Callable[[_Link, BaseException | None], None],
        on_checkpoint_request: Callable[[_Link, rm.CheckpointRequest], None],
    ) -> None:
        super().__init__(ClientConnection(worker_id), on_lost)
        self.on_checkpoint_request = on_checkpoint_request
        self.outbox: list[bytes] = []
        self.flush_scheduled = False

    def _dispatch(self, received: Received) -> None:
        message = received.message
        if isinstance(message, rm.CheckpointRequest):
            self.on_checkpoint_request(self, message)
        elif isinstance(message, rm.CheckpointAck):
            self._deliver(message.checkpoint_id, message, push=False)
        elif isinstance(message, rm.SchemaNegotiation):
            answered = self._deliver(_HANDSHAKE, message, push=False)
            if not answered and not message.ok:
                # A delta was refused: whoever waits (a checkpoint) hears why.
                self._fail_pending(WorkerError("the server refused: " + "; ".join(message.errors)))

    def flush(self) -> None:
        """Write the outbox (the worker's guard held, on the loop); NotSent when the
        connection is gone (its deltas are resent on the next one)."""
        data = b"".join(self.outbox)
        self.outbox.clear()
        self.flush_scheduled = False
        if data:
            self._post(data)


class _AsyncWorker(Session[_Link, Resumable[_Link]]):
    """The worker's asyncio half, run on the :class:`Worker`'s loop thread; deltas are
    framed in the caller's thread (:meth:`send`)."""

    service = "Ripple"
    listener = "ripple"
    default_port = DEFAULT_PORT
    closed_message = "the worker is closed"

    def __init__(
        self,
        worker_id: str,
        schemas: Mapping[str, rm.Schema],
        server: str,
        *,
        heartbeat_s: float,
        timeout: float,
        reconnect_attempts: int,
        auth: rm.HandshakeAuth | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(server, timeout, True, reconnect_attempts, 0.05, 2.0, tls=tls)
        self.worker_id = worker_id
        self.schemas = schemas
        self.auth = auth  # the Handshake extension's token and tenant (None: anonymous)
        self.heartbeat_s = heartbeat_s
        # The caller's thread and the loop's share what follows.
        self._guard = threading.Lock()
        self._pending: list[_Sent] = []  # since the last acknowledged checkpoint
        self._next: dict[str, int] = {}
        self._writer: _Link | None = None  # the connection deltas are framed for
        self._errors: list[BaseException] = []  # of background reconnects, for send()
        self._reviving = False

    # ---- connecting ---------------------------------------------------------------------

    async def _open(self) -> _Link:
        conn = await self._dial(
            lambda: _Link(self.worker_id, self._on_lost, self._on_checkpoint_request)
        )

        def hello(c: _Link) -> tuple[Hashable, asyncio.Future[rm.Message]]:
            handshake = c.codec.handshake(self.schemas, auth=self.auth)
            return _HANDSHAKE, c._expect(_HANDSHAKE, handshake)

        await self._greet(conn, hello, "Handshake", rm.SchemaNegotiation)
        self._keep_alive(conn, self.heartbeat_s, self._beat, when_idle=False)
        return conn

    def _error_of(self, reply: object) -> HeadwaterError | None:
        if isinstance(reply, rm.SchemaNegotiation) and not reply.ok:
            return WorkerError("the server refused the worker: " + "; ".join(reply.errors))
        return None

    async def _reconnect(self) -> _Link:
        try:
            return await super()._reconnect()
        except ServerUnavailable as exc:
            raise WorkerError(f"no Ripple server at {self.address}: {exc}") from None

    def _connected(self, conn: _Link) -> None:
        with self._guard:  # from now on deltas are framed for conn: first the unacknowledged
            self._writer = conn
            conn.outbox = [self._frame(conn, sent) for sent in self._pending]
            with contextlib.suppress(NotSent):
                conn.flush()

    def _unfinished(self) -> bool:
        return bool(self._pending)

    def _revive(self) -> None:
        """Reconnect in the background (and so resend what is unacknowledged)."""
        if not self._reviving and not self._closed:
            self._reviving = True
            self._spawn(self._recover([]))

    async def _recovered(self) -> None:
        self._reviving = False

    def _recovery_failed(self, exc: BaseException) -> None:
        self._reviving = False
        with self._guard:
            self._errors.append(exc)

    # ---- output -------------------------------------------------------------------------

    def _frame(self, conn: _Link, sent: _Sent) -> bytes:
        return conn.codec.send_delta(
            sent.output,
            sent.key,
            sent.delta,
            sequence_no=sent.sequence_no,
            watermark_ns=sent.watermark_ns,
        )

    def send(
        self,
        output: str,
        key: str | bytes,
        delta: rm.Delta,
        sequence_no: int | None,
        watermark_ns: int | None,
    ) -> int:
        """Frame a delta (in the caller's thread) for the loop to write; its sequence
        number."""
        with self._guard:
            self._check_open()
            if self._errors:
                error = self._errors.pop(0)
                self._errors.clear()
                raise error
            if output not in self.schemas:
                raise UsageError(f"output {output!r} was not declared")
            seq = sequence_no if sequence_no is not None else self._next.get(output, 1)
            sent = _Sent(output, key, delta, seq, watermark_ns)
            writer = self._writer
            assert writer is not None and self._loop is not None
            writer.outbox.append(self._frame(writer, sent))  # a bad delta raises here
            self._next[output] = max(self._next.get(output, 1), seq + 1)
            self._pending.append(sent)
            kick = not writer.flush_scheduled
            writer.flush_scheduled = True
        if kick:
            self._loop.call_soon_threadsafe(self._flush, writer)
        return seq

    def _flush(self, conn: _Link) -> None:
        with self._guard:
            try:
                conn.flush()
                return
            except NotSent:
                pass
        if conn is self._conn:
            self._revive()  # the next delta reconnects, as a failed write would

    def _beat(self, conn: _Link) -> None:
        with self._guard:
            conn.flush()
            conn._post(conn.codec.heartbeat(time.time_ns(), 0.0))

    def _on_checkpoint_request(self, conn: _Link, request: rm.CheckpointRequest) -> None:
        """The server's checkpoint: everything this worker sent before the request is in
        the socket already (the server reads in order), so acknowledge at once."""
        with self._guard, contextlib.suppress(NotSent):
            last = max(self._next.values(), default=1) - 1
            conn.flush()
            conn._post(conn.codec.checkpoint_ack(request.checkpoint_id, request.epoch, last))

    async def checkpoint(self, checkpoint_id: str, epoch: int) -> int:
        """Wait until the server made everything sent so far durable and visible;
        returns the server's last applied sequence number."""
        covered = 0

        def ask(conn: _Link) -> tuple[Hashable, asyncio.Future[rm.Message]]:
            nonlocal covered
            with self._guard:
                conn.flush()
                covered = len(self._pending)
                data = conn.codec.checkpoint_request(checkpoint_id, epoch)
                return checkpoint_id, conn._expect(checkpoint_id, data)

        try:
            ack = await self._exchange(ask, "Checkpoint_request", rm.CheckpointAck, safe=True)
        except ConnectionLost as exc:
            raise WorkerError(f"the checkpoint failed after every reconnect ({exc})") from None
        with self._guard:
            del self._pending[:covered]
            self._errors.clear()
        return ack.last_sequence_no

    def number_after(self, last: int) -> None:
        """Number every output's next delta ``last + 1``."""
        with self._guard:
            self._next = {output: last + 1 for output in self.schemas}

    async def close(self) -> None:
        """Write what is framed, then close the connection (no checkpoint)."""
        if self._closed:
            return
        conn = self._writer
        if conn is not None:
            with self._guard, contextlib.suppress(NotSent):
                conn.flush()
        await self._shut()
        if conn is not None:
            await conn.wait_closed(2.0)

    def _abort(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        if self._conn is not None:
            self._conn.abort()


class Worker(Blocking[_AsyncWorker]):
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
        token: str | None = None,
        tenant: int | None = None,
        tls: bool | ssl.SSLContext = False,
        ca: PathLike | None = None,
        cert: PathLike | None = None,
        key: PathLike | None = None,
    ) -> None:
        """``resume``: continue numbering after the last sequence number the server
        applied for this worker (asked with a checkpoint at start), for a worker that
        does not replay deterministically; by default numbering starts at 1, and a
        restarted worker resending from its checkpoint gets its old deltas dropped.

        ``token``: the worker's credential (needed when the server has ``[auth] required
        = true``); ``tenant``: the tenant to write to (default: the lowest the token
        grants, 0 without a token). Either one goes in the Handshake's auth extension
        (docs/protocols/ripple.md); without both the Handshake is the contract's own.

        ``tls``, ``ca``, ``cert``, ``key``: TLS, as :class:`headwater.AsyncClient` takes
        them. Under mutual TLS the client certificate can be the worker's credential: a
        server maps its common name to tenants (``[[auth.tokens]] cert_cn``)."""
        self.worker_id = worker_id
        self.schemas = {
            out: s if isinstance(s, rm.Schema) else schema_of(s, out) for out, s in outputs.items()
        }
        self.address = parse_server(server, DEFAULT_PORT)
        self.timeout = timeout
        self.reconnect_attempts = reconnect_attempts
        inner = _AsyncWorker(
            worker_id,
            self.schemas,
            server,
            heartbeat_s=heartbeat_s,
            timeout=timeout,
            reconnect_attempts=reconnect_attempts,
            auth=None if token is None and tenant is None else rm.HandshakeAuth(token, tenant),
            tls=client_context(tls, ca, cert, key),
        )
        runner = LoopThread.connected(
            inner, name="ripple-worker", closed_message=inner.closed_message
        )
        super().__init__(inner, runner)
        if resume:
            self._inner.number_after(self.checkpoint())

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
        returns the server's last applied sequence number. Raises WorkerError when the
        server could not make some of it durable (a full disk: it says why and closes
        the connection); what was sent is kept, and the next checkpoint() resends it."""
        return self._run(self._inner.checkpoint(checkpoint_id or uuid.uuid4().hex, epoch))

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
        return self._inner.send(output, key, delta, sequence_no, watermark_ns)

    def _kill(self) -> None:
        """Die as a killed process would: the connection dropped at once (what was not
        written yet is lost), no goodbye, no checkpoint, no reconnect. For tests."""
        self._runner.loop.call_soon_threadsafe(self._inner._abort)
        self._runner.stop()


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


__all__ = ["Worker", "WorkerError", "schema_of"]
