"""The asyncio shell of the Rivven front end: it only moves bytes.

Each request runs as its own task, so answers go out in completion order, matched by
correlation id (a long-polling Consume never holds up a Publish on the same
connection). Reading pauses while too many requests are in flight. Peer errors are
ErrorResponses and one warning line, never a traceback.

Auth: with ``[auth] required = true`` every request but Handshake, Ping and Authenticate
is refused UNAUTHORIZED until a PLAIN Authenticate presents a known token (its password);
the tenant is the token's (its lowest). Without required auth, a client may skip
Authenticate and acts for tenant 0. ``[limits] handshake_timeout_s`` is the time allowed
until the connection is accepted: with required auth by a successful Authenticate (the
pre-auth limits hold until then, a Handshake or not), without it by any request
decoded.
"""

from __future__ import annotations

import asyncio
import logging
import math
from functools import partial
from typing import TYPE_CHECKING

from google.protobuf.message import Message

from headwater.api.quotas import Quota, report_throttle
from headwater.errors import (
    AuthenticationFailed,
    HeadwaterError,
    InternalError,
    InvalidRequest,
    NotLeader,
)
from headwater.protocols.rivven import rivven_pb2 as pb
from headwater.protocols.rivven.connection import RequestFrame, ServerConnection
from headwater.protocols.rivven.frames import FrameTooLarge
from headwater.protocols.rivven.messages import ErrorCode, error_code_for
from headwater.server.answers import AnswerRoom
from headwater.server.app import Listener
from headwater.server.groups import GroupShells
from headwater.server.metrics import metrics_for
from headwater.server.rivven.handlers import (
    HANDLERS,
    Handler,
    PartitionNotFound,
    Session,
    TransactionalIds,
)
from headwater.server.tcp import (
    ConnectionGuard,
    ServerConnectionShell,
    finish_in_flight,
    start_tcp_listener,
)

if TYPE_CHECKING:
    from headwater.server.app import Server

log = logging.getLogger("headwater.rivven")

LISTENER = "rivven"
# Answered before authentication (the rest need an accepted token when auth is required).
OPEN_OPERATIONS = frozenset({"authenticate", "ping"})
# The operations a tenant's quotas refuse with a ThrottledResponse while it is in debt on
# one of their rates (docs/protocols/rivven.md, "Quotas"): the request is not served and
# the client sends it again after throttle_time_ms. The others wait their turn instead.
_PRODUCE = (Quota.PRODUCE, Quota.REQUESTS)
_CONSUME = (Quota.CONSUME, Quota.REQUESTS)
THROTTLED_OPERATIONS: dict[str, tuple[Quota, ...]] = {
    "publish": _PRODUCE,
    "publish_batch": _PRODUCE,
    "idempotent_publish": _PRODUCE,
    "transactional_publish": _PRODUCE,
    "consume": _CONSUME,
}
# Rivven's names of the rates (its QuotaManager's keys), for ThrottledResponse.quota_type.
QUOTA_TYPES = {
    Quota.PRODUCE: "produce_bytes_rate",
    Quota.CONSUME: "consume_bytes_rate",
    Quota.REQUESTS: "request_rate",
}


class RivvenConnection(ServerConnectionShell[ServerConnection]):
    def __init__(
        self,
        server: Server,
        connections: set[RivvenConnection],
        transactions: TransactionalIds,
        address: tuple[str, int],
        stopping: asyncio.Event,
        groups: GroupShells,
    ) -> None:
        super().__init__()
        self.server = server
        self.protocol = ServerConnection()
        self.metrics = metrics_for(server)
        self.session = Session(
            server.api,
            transactions,
            *address,
            stopping,
            groups,
            answers=AnswerRoom(server.limits.answers),
            counted=partial(self.metrics.record_read, LISTENER),
        )
        # When this connection's refused publish or consume (by the quotas it spends)
        # may come back and be served: its turn, kept while other clients add debt.
        self._turns: dict[tuple[Quota, ...], float] = {}
        self._connections = connections
        self.guard = ConnectionGuard(server.limits, LISTENER, self)

    # ---- transport callbacks --------------------------------------------------------

    def _connected(self) -> None:
        # Metadata names the address this client reached, as the Kafka listener's does:
        # the bind address (0.0.0.0 on every interface) sent a client to its own host.
        assert self.transport is not None
        local = self.transport.get_extra_info("sockname")
        if local:
            self.session.host = local[0]
        self.session.tls = self.transport.get_extra_info("ssl_object") is not None

    def _disconnected(self) -> None:
        self.session.answers.lost()

    def pause_writing(self) -> None:
        self.session.answers.pause_writing()

    def resume_writing(self) -> None:
        self.session.answers.resume_writing()

    def _replied(self, response: pb.Response) -> None:
        if response.WhichOneof("response_type") == "handshake_result":
            # With auth required only a token lifts the limits of a connection not yet
            # accepted (a Handshake alone left a 10 MiB frame readable, for ever).
            if not self.session.api.auth.required:
                self._accepted()
        else:
            log.warning("rivven %s: %s", self.guard.peer, response.error.message)

    # ---- limits ---------------------------------------------------------------------

    def refusal(self, limit: str, message: str) -> bytes:
        # Correlation id 0: about the connection, not a request. Too many connections is
        # worth retrying later (a quota's code); the other limits are the client's doing.
        code = ErrorCode.QUOTA_EXCEEDED if limit == "max_connections" else ErrorCode.TIMEOUT
        if limit == "max_pending_bytes":
            code = ErrorCode.INVALID_REQUEST
        return self.protocol.send_error(0, code, message)

    def _accepted(self) -> None:
        self.guard.authenticated()

    # ---- requests -------------------------------------------------------------------

    async def _handle(self, frame: RequestFrame) -> None:
        operation = frame.operation
        correlation_id = frame.correlation_id
        session = self.session
        try:
            required = session.api.auth.required
            if not required:
                # Any request decoded accepts the connection, whatever its answer: a
                # first request refused (or a long poll) was closed at the handshake
                # timeout as never accepted.
                self._accepted()
            elif session.principal is None and operation not in OPEN_OPERATIONS:
                raise AuthenticationFailed(
                    f"{operation} needs an accepted token first: Authenticate (PLAIN,"
                    " the token as password)"
                )
            handler = HANDLERS.get(operation)
            if handler is None:
                raise UnsupportedOperation(
                    f"{operation} is not supported by headwater (docs/protocols/rivven.md)"
                )
            session.client_id = frame.request.header.client_id or self.protocol.client_id
            request = getattr(frame.request, operation)
            kinds = THROTTLED_OPERATIONS.get(operation)
            if kinds is not None and session.api.quotas.enabled:
                response = await self._throttled(handler, request, kinds)
            else:
                response = await handler(session, request)
            if session.principal is not None:
                self._accepted()
            data = self._answer(correlation_id, response)
        except HeadwaterError as exc:
            self.metrics.record_error(LISTENER, exc)
            code = ErrorCode.PARTITION_NOT_FOUND
            if not isinstance(exc, PartitionNotFound):
                code = error_code_for(exc)
            log.warning(
                "rivven %s: %s %d refused: %s", self.guard.peer, operation, correlation_id, exc
            )
            data = self.protocol.send_error(correlation_id, code, str(exc), details=_details(exc))
        except Exception as exc:  # a bug of ours: answer, log, keep serving
            log.exception("rivven request %d (%s) failed", correlation_id, operation)
            internal = InternalError(f"internal error: {exc}")
            self.metrics.record_error(LISTENER, internal)
            data = self.protocol.send_error(correlation_id, ErrorCode.UNKNOWN, str(internal))
        self._write(data)

    async def _throttled(
        self, handler: Handler, request: Message, kinds: tuple[Quota, ...]
    ) -> Message:
        """A publish or consume of a tenant with quotas. In debt on one of the rates it
        spends, it is refused with a ThrottledResponse (Rivven's answer: wait
        throttle_time_ms, then retry), nothing served; otherwise it is served at once,
        spending without waiting, so the debt it leaves refuses the tenant's next one."""
        session = self.session
        quotas = session.api.quotas
        tenant_id = session.tenant_id
        owed, kind = quotas.debt(tenant_id, kinds)
        now = quotas.now()
        turn = self._turns.pop(kinds, None)
        if kind is not None and (turn is None or now < turn):
            # Its turn is when the debt it met is paid: sent again then, it is served
            # whatever debt others added meanwhile (it was refused for ever while
            # another client kept the tenant at its rate).
            turn = now + owed if turn is None else turn
            self._turns[kinds] = turn
            quotas.told(tenant_id, kind, turn - now)
            return pb.ThrottledResponse(
                throttle_time_ms=math.ceil((turn - now) * 1000),
                quota_type=QUOTA_TYPES[kind],
                entity=f"tenant:{tenant_id}",
            )
        with report_throttle(deferred=True):
            return await handler(session, request)

    def _answer(self, correlation_id: int, response: Message) -> bytes:
        try:
            return self.protocol.send(correlation_id, response)
        except FrameTooLarge as exc:
            # Only a Consume's records are unbounded by the request; say so.
            return self.protocol.send_error(
                correlation_id,
                ErrorCode.MESSAGE_TOO_LARGE,
                f"the answer is over the frame limit ({exc}): ask for fewer records"
                " (max_messages, max_bytes)",
            )


def _details(exc: HeadwaterError) -> dict[str, str]:
    """What an ErrorResponse carries beyond Rivven's code (headwater's SDK raises the
    same class from it): the error's name and Kimberlite code, and a group error's
    Kafka name."""
    details = {"error": str(exc.name), "error_code": str(exc.code)}
    kafka_name = getattr(exc, "kafka_name", None)
    if isinstance(kafka_name, str):
        details["kafka_error"] = kafka_name
    if isinstance(exc, NotLeader) and exc.leader is not None:
        # A cluster's partition led elsewhere: the leader's id and addresses, which the
        # SDK follows (leader_rivven).
        details.update({f"leader_{name}": str(value) for name, value in exc.leader.items()})
    return details


class UnsupportedOperation(InvalidRequest):
    """An operation of the schema headwater does not answer (INVALID_REQUEST)."""


async def start_rivven(server: Server, host: str, port: int) -> Listener:
    connections: set[RivvenConnection] = set()
    transactions = TransactionalIds()
    server.api.on_transactional_id_expired(transactions.forget)
    groups = GroupShells(server.api)
    stopping = asyncio.Event()
    bound = {"port": port}

    async def drain() -> None:
        stopping.set()  # long polls answer now with what they have
        for connection in connections:  # answers waiting for a peer that does not read
            connection.session.answers.lost()
        await groups.close()  # and JoinGroups waiting for other members end
        await finish_in_flight([t for c in connections for t in c.tasks])

    listener = await start_tcp_listener(
        server,
        LISTENER,
        host,
        port,
        lambda: RivvenConnection(
            server, connections, transactions, (host, bound["port"]), stopping, groups
        ),
        connections,
        drain=drain,
    )
    bound["port"] = listener.port  # metadata names the port actually bound
    return listener
