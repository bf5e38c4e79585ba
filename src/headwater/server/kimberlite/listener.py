"""The asyncio shell of the Kimberlite front end: it only moves bytes.

Each decoded request runs as its own task, so answers go out in completion order and a
slow query never holds up an append on the same connection; a plain AppendEvents outside
a cluster and without quotas needs none: its acknowledgement writes the answer. Reading
pauses while too many requests are in flight; pushes wait for the transport to drain, so
a slow reader holds back only its own subscriptions.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from headwater.api import CloseReason, EngineAPI
from headwater.errors import (
    HeadwaterError,
    InternalError,
    InvalidRequest,
    QueryExecutionError,
    RateLimited,
)
from headwater.protocols.kimberlite import messages as m
from headwater.protocols.kimberlite.connection import (
    ServerConnection,
)
from headwater.protocols.kimberlite.frames import MAX_FRAME, FrameTooLarge
from headwater.server.answers import AnswerRoom
from headwater.server.app import Listener
from headwater.server.kimberlite.commands import HANDLERS
from headwater.server.kimberlite.commands.append import append_events_inline
from headwater.server.kimberlite.session import Session
from headwater.server.metrics import metrics_for
from headwater.server.tcp import (
    ConnectionGuard,
    ServerConnectionShell,
    finish_in_flight,
    start_tcp_listener,
)

if TYPE_CHECKING:
    from headwater.server.app import Server

log = logging.getLogger("headwater.kimberlite")


class KimberliteConnection(ServerConnectionShell[ServerConnection]):
    def __init__(self, server: Server, connections: set[KimberliteConnection]) -> None:
        super().__init__()
        self.server = server
        self.protocol = ServerConnection()
        self.api: EngineAPI = server.api
        self.session = Session(self.api.auth)
        self.metrics = metrics_for(server)
        self._connections = connections
        self._writable = asyncio.Event()
        self._writable.set()
        self.guard = ConnectionGuard(server.limits, "kimberlite", self)
        self.answers = AnswerRoom(server.limits.answers)  # where ReadEvents answers wait

    # ---- transport callbacks --------------------------------------------------------

    def _connected(self) -> None:
        self.session.peer = self.guard.peer

    def _disconnected(self) -> None:
        self._writable.set()  # wake pushes so they notice the connection is gone
        self.answers.lost()
        self._end_subscriptions()

    def _ending(self) -> None:
        self._end_subscriptions()  # nothing more can be granted

    def _end_subscriptions(self) -> None:
        for sub, _tenant in list(self.session.subscriptions.values()):
            self.session.cancelling.add(sub.subscription_id)
            self.api.unsubscribe(sub, CloseReason.CLIENT_CANCELLED)
        self.session.subscriptions.clear()

    def pause_writing(self) -> None:
        self._writable.clear()
        self.answers.pause_writing()

    def resume_writing(self) -> None:
        self._writable.set()
        self.answers.resume_writing()

    # ---- limits ---------------------------------------------------------------------

    def refusal(self, limit: str, message: str) -> bytes:
        # Error with request id 0: about the connection, not a request. Too many
        # connections is worth retrying later; the other limits are the client's doing.
        code = RateLimited.code if limit == "max_connections" else InvalidRequest.code
        return self.protocol.send_error(0, code, message)

    def busy(self) -> bool:
        return bool(self.tasks or self.inline or self.session.subscriptions)

    # ---- requests -------------------------------------------------------------------

    async def _handle(self, request: m.Request) -> None:
        payload = request.payload
        try:
            if not isinstance(payload, m.HandshakeRequest):
                self.session.check_tenant(request.tenant_id)
                self.api.check_tenant(request.tenant_id)  # TenantNotFound before anything else
            handler = HANDLERS.get(type(payload))
            if handler is None:
                raise InvalidRequest(f"{type(payload).__name__} is not a request")
            response = await handler(self, request, payload)
        except Exception as exc:
            response = self.error_response(request, exc)
        if response is None:
            return
        try:
            chunks = self.protocol.send_chunks(m.Response(request.id, response))
        except FrameTooLarge as exc:
            # Only a query result is unbounded; say so rather than drop the answer.
            too_large = (
                QueryExecutionError
                if isinstance(response, (m.QueryResponse, m.QueryAtResponse))
                else InternalError
            )(
                f"the answer is {exc.payload_len} bytes, over the {MAX_FRAME}-byte frame limit: "
                "ask for less (LIMIT, fewer columns)"
            )
            self.metrics.record_error("kimberlite", too_large)
            error = m.ErrorResponse.from_exception(too_large)
            chunks = self.protocol.send_chunks(m.Response(request.id, error))
        self.write_chunks(chunks)

    def _answer_inline(self, request: m.Request) -> bool:
        """A lone AppendEvents outside a cluster and without quotas is answered from its
        acknowledgement, without a task (commands/append.py)."""
        payload = request.payload
        append_then = self.api.append_encoded_then
        if (
            type(payload) is not m.AppendEventsRequest
            or append_then is None
            or self.server.cluster is not None
        ):
            return False
        try:
            self.session.check_tenant(request.tenant_id)
            self.api.check_tenant(request.tenant_id)
            append_events_inline(self, request, payload, append_then)
        except Exception as exc:  # refused before anything was written
            self.send(request.id, self.error_response(request, exc))
        return True

    def error_response(self, request: m.Request, exc: Exception) -> m.ErrorResponse:
        """A failed request's answer: the client's error as it is, a bug of ours logged
        and answered as an internal error (the connection keeps serving)."""
        if not isinstance(exc, HeadwaterError):
            log.exception(
                "request %d (%s) failed", request.id, type(request.payload).__name__, exc_info=exc
            )
            exc = InternalError(f"internal error: {exc}")
        self.metrics.record_error("kimberlite", exc)
        return m.ErrorResponse.from_exception(exc)

    # ---- output ---------------------------------------------------------------------

    def send(self, request_id: int, payload: m.ResponsePayload) -> None:
        self.write_chunks(self.protocol.send_chunks(m.Response(request_id, payload)))

    async def drained(self) -> None:
        """Return once the transport accepts more (a push waits here, nothing else)."""
        if self.closed:
            raise ConnectionResetError("connection closed")
        await self._writable.wait()
        if self.closed:
            raise ConnectionResetError("connection closed")


async def start_kimberlite(server: Server, host: str, port: int) -> Listener:
    connections: set[KimberliteConnection] = set()

    async def drain() -> None:
        for connection in connections:  # answers waiting for a peer that does not read
            connection.answers.lost()
        # Appends answered without a task (``inline``) are in flight too.
        in_flight: list[asyncio.Future[None]] = [t for c in connections for t in c.tasks]
        in_flight += [c.inline_answered() for c in connections if c.inline]
        await finish_in_flight(in_flight)

    return await start_tcp_listener(
        server,
        "kimberlite",
        host,
        port,
        lambda: KimberliteConnection(server, connections),
        connections,
        subscriptions=lambda: sum(len(c.session.subscriptions) for c in connections),
        drain=drain,
    )
