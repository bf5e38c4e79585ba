"""The asyncio shell of the Kafka front end: it moves bytes and runs the handlers.

Each decoded request runs as its own task (a Fetch long-polling must not hold up a
Produce or a Heartbeat on the same connection); the protocol hands back answers in
request order, as Kafka clients require. Reading pauses while too many requests are in
flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from kio.schema.errors import ErrorCode

from headwater.api.quotas import InOrder, Quota, report_throttle
from headwater.errors import AuthenticationFailed, HeadwaterError
from headwater.protocols.kafka import ApiKey, Close, Reply, Request, ServerConnection
from headwater.protocols.kafka.apis import response_type
from headwater.server.answers import AnswerRoom
from headwater.server.app import Listener
from headwater.server.kafka.build import build
from headwater.server.kafka.groups import KafkaGroups
from headwater.server.kafka.handlers import HANDLERS, SPLICED, Handler, Session
from headwater.server.kafka.scram import MECHANISM as SCRAM
from headwater.server.kafka.scram import ScramServer
from headwater.server.metrics import metrics_for
from headwater.server.tcp import (
    ConnectionGuard,
    TaskPerRequestConnection,
    finish_in_flight,
    start_tcp_listener,
    without_nagle,
)

if TYPE_CHECKING:
    from headwater.server.app import Server

log = logging.getLogger("headwater.kafka")

# Before SASL completes (when [auth] requires it) only these are served, as Kafka does.
SASL_MECHANISMS = ("PLAIN", SCRAM)
_BEFORE_AUTH = frozenset((ApiKey.API_VERSIONS, ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE))
# The requests a tenant's quotas throttle, and their first version of KIP-219: from it
# the broker answers at once with throttle_time_ms and mutes the connection for that
# long (the client backs off too); below it the answer waits and then reports the wait.
_THROTTLED = {ApiKey.PRODUCE: 6, ApiKey.FETCH: 8}


class KafkaConnection(TaskPerRequestConnection):
    max_inflight = 128  # answers go out in request order: a deep queue only waits

    def __init__(
        self,
        server: Server,
        connections: set[KafkaConnection],
        port: int,
        handlers: dict[ApiKey, Handler],
        stopping: asyncio.Event,
    ) -> None:
        super().__init__()
        self.server = server
        self.protocol = ServerConnection()
        self.api = server.api
        self._connections = connections
        self._port = port
        self._handlers = handlers
        self.guard = ConnectionGuard(server.limits, "kafka", self)
        self.stopping = stopping
        self.session = Session(self.api, "127.0.0.1", port, "?", stopping=stopping)
        self._mechanism: str | None = None
        self._scram: ScramServer | None = None
        self._sasl_failed = False
        self._muted_until = 0.0  # loop time: requests wait for it (a throttled tenant)
        self._unmuted = InOrder()
        self._line_moved: asyncio.Future[None] | None = None  # an answer went out

    # ---- transport callbacks --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.guard.admit(self._set_transport(transport)):
            return
        without_nagle(transport)
        local = transport.get_extra_info("sockname")
        host = local[0] if local else "127.0.0.1"
        cluster = None if self.server.cluster is None else self.server.cluster.view
        limits = self.server.limits
        self.session = Session(
            self.api,
            host,
            self._port,
            self.guard.peer,
            stopping=self.stopping,
            cluster=cluster,
            refused=lambda limit: limits.refused(limit, "kafka"),
            counted=partial(metrics_for(self.server).record_read, "kafka"),
            answers=AnswerRoom(limits.answers),
        )
        try:
            # Without [auth] required an unauthenticated client acts for tenant 0.
            principal = self.api.authenticate(None)
        except AuthenticationFailed:
            pass  # SASL first
        else:
            self.session.tenant_id = principal.default_tenant
            self.session.authenticated = True
            # The guard's handshake is still to come: the first whole request (as on
            # Rivven), so handshake_timeout_s and max_pending_bytes bound a peer that
            # never sends one, instead of a 100 MiB frame held until idle_timeout_s.
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.guard.release()
        self.session.answers.lost()
        self._moved_on()
        self._connections.discard(self)

    def pause_writing(self) -> None:
        self.session.answers.pause_writing()

    def resume_writing(self) -> None:
        self.session.answers.resume_writing()

    def data_received(self, data: bytes) -> None:
        for event in self.protocol.receive_data(data):
            if not self.guard.authed and self.session.authenticated:
                # Without [auth] required (see connection_made): a whole request. Kafka
                # clients start with ApiVersions, which the protocol answers (a Reply).
                self.guard.authenticated()
            if isinstance(event, Request):
                self._start(self._handle(event))
            elif isinstance(event, Reply):
                self._write(event.data)
                self._moved_on()
            elif isinstance(event, Close):
                log.warning("kafka %s: closing: %s", self.guard.peer, event.reason)
                self.close(abort=True)
                return
        self.guard.received()

    def eof_received(self) -> bool | None:
        self.protocol.receive_eof()
        self._close_when_answered()
        return True

    # ---- limits ---------------------------------------------------------------------

    def refusal(self, limit: str, message: str) -> bytes:
        # Kafka has no unsolicited error frame: a refused client sees the connection
        # close (the reason is in the server's log).
        return b""

    # ---- requests -------------------------------------------------------------------

    async def _handle(self, request: Request) -> None:
        session = self.session
        api_key = request.api_key
        if request.client_id:
            session.client_id = request.client_id
        handler = self._handlers.get(api_key)
        if not session.authenticated and api_key not in _BEFORE_AUTH:
            log.warning(
                "kafka %s: %s before SASL authentication: closing", session.peer, api_key.name
            )
            self.close()
            return
        try:
            if api_key is ApiKey.SASL_HANDSHAKE:
                fields: Mapping[str, Any] = self._sasl_handshake(
                    request.request, request.api_version
                )
            elif api_key is ApiKey.SASL_AUTHENTICATE:
                fields = await self._sasl_authenticate(request.request)
            elif handler is None:
                raise NotImplementedError(f"{api_key.name} has no handler")
            elif api_key is ApiKey.FETCH and not await self._answered_ahead(request):
                return  # the connection closed meanwhile
            elif api_key in _THROTTLED:
                fields = await self._throttled(handler, request)
            else:
                fields = await handler(session, request.request, request.api_version)
        except HeadwaterError as exc:
            log.warning("kafka %s: %s failed: %s", session.peer, api_key.name, exc)
            self.close()
            return
        except Exception:  # a bug of ours: log it, and the client reconnects
            log.exception(
                "kafka %s: %s v%d failed", session.peer, api_key.name, request.api_version
            )
            self.close()
            return
        if not request.expects_response or self.closed:
            return
        try:
            response = build(response_type(api_key, request.api_version), fields)
            self.write_chunks(self.protocol.send_chunks(request, response, fields.get(SPLICED)))
            self._moved_on()
        except Exception:  # a bug of ours: the client must not wait for an answer forever
            log.exception(
                "kafka %s: %s v%d answer not encoded",
                session.peer,
                api_key.name,
                request.api_version,
            )
            self.close()
            return
        if api_key is ApiKey.SASL_AUTHENTICATE and self._sasl_failed:
            self.close()  # Kafka closes the connection after a failed authentication

    async def _answered_ahead(self, request: Request) -> bool:
        """Wait until the requests before ``request`` are answered on the wire (False:
        the connection closed first). A Fetch's answer holds read buffers until its
        peer reads it; built behind a slow answer (a long poll, a JoinGroup), it would
        wait in memory, out of the transport's reach and of ``read_answers_mib``'s
        count. Kafka itself reads nothing more from a channel until it has answered."""
        while self.protocol.answers_ahead(request):
            if self.closed:
                return False
            if self._line_moved is None:
                self._line_moved = asyncio.get_running_loop().create_future()
            await self._line_moved
        return not self.closed

    def _moved_on(self) -> None:
        if self._line_moved is not None:
            self._line_moved.set_result(None)
            self._line_moved = None

    async def _throttled(self, handler: Handler, request: Request) -> Mapping[str, Any]:
        """A Produce or Fetch, its answer carrying the throttle time of the tenant's
        quotas (docs/operations.md, "Quotas")."""
        loop = asyncio.get_running_loop()
        # The channel is muted: Kafka reads nothing more until then, so the requests
        # waiting are then served in the order they came (a producer's batches stored
        # in the order it sent them).
        await self._unmuted.wait(self._muted_until - loop.time())
        kip219 = request.api_version >= _THROTTLED[request.api_key]
        session = self.session
        with report_throttle(deferred=kip219) as throttle:
            fields = await handler(session, request.request, request.api_version)
        if kip219:
            # Answered at once: the client is to wait until the tenant's debt is paid.
            seconds = self.api.quotas.owed(session.tenant_id)
            kind = Quota.PRODUCE if request.api_key is ApiKey.PRODUCE else Quota.CONSUME
            self.api.quotas.told(session.tenant_id, kind, seconds)
            self._muted_until = loop.time() + seconds
            throttle_ms = round(seconds * 1000)
        else:
            throttle_ms = throttle.ms  # waited already, before this answer
        return {**fields, "throttle_time": throttle_ms} if throttle_ms else fields

    # ---- SASL -----------------------------------------------------------------------

    def _sasl_handshake(self, request: Any, version: int) -> dict[str, Any]:
        self._mechanism = request.mechanism
        code = ErrorCode.none
        if version == 0:
            # v0 is announced only because librdkafka before 2.2 (Debian's kcat) enables
            # SASL when the range includes 0; it then uses v1. A v0 client would send
            # its tokens unframed, which this listener does not read: refused clearly.
            log.warning("kafka %s: SaslHandshake v0 (unframed tokens) refused", self.guard.peer)
            code = ErrorCode.unsupported_version
        elif request.mechanism not in SASL_MECHANISMS:
            log.warning("kafka %s: SASL mechanism %r refused", self.guard.peer, request.mechanism)
            code = ErrorCode.unsupported_sasl_mechanism
        return {"error_code": code, "mechanisms": list(SASL_MECHANISMS)}

    async def _sasl_authenticate(self, request: Any) -> dict[str, Any]:
        """PLAIN (RFC 4616): ``authzid NUL user NUL password``, or SCRAM-SHA-256's two
        rounds (:mod:`.scram`); the password is a headwater token and the tenant the
        lowest it grants."""
        answer: dict[str, Any] = {
            "error_code": ErrorCode.none,
            "error_message": None,
            "auth_bytes": b"",
            "session_lifetime": 0,
        }
        data = bytes(request.auth_bytes)
        try:
            if self._mechanism == "PLAIN":
                parts = data.split(b"\0")
                if len(parts) != 3:
                    raise AuthenticationFailed("a PLAIN message is authzid NUL user NUL password")
                principal = self.api.authenticate(parts[2].decode("utf-8", "replace") or None)
            elif self._mechanism == SCRAM:
                if self._scram is None:
                    self._scram = ScramServer()
                    answer["auth_bytes"] = self._scram.first(data)
                    return answer
                tokens = list(self.api.auth.config.tokens)
                token, answer["auth_bytes"] = await asyncio.to_thread(
                    self._scram.final, data, tokens
                )
                principal = self.api.authenticate(token)
            else:
                raise AuthenticationFailed(
                    f"SaslHandshake with a mechanism of {', '.join(SASL_MECHANISMS)} first"
                )
            tenant_id = self.api.session_tenant(principal)
        except AuthenticationFailed as exc:
            log.warning("kafka %s: SASL authentication failed: %s", self.guard.peer, exc)
            answer["error_code"] = ErrorCode.sasl_authentication_failed
            answer["error_message"] = f"authentication failed: {exc}"
            answer["auth_bytes"] = b""
            self._sasl_failed = True
            self.session.authenticated = False
            return answer
        self.session.tenant_id = tenant_id
        self.session.authenticated = True
        self.guard.authenticated()
        return answer


async def start_kafka(server: Server, host: str, port: int) -> Listener:
    connections: set[KafkaConnection] = set()
    bound: dict[str, int] = {"port": port}
    groups = KafkaGroups(server.api)
    stopping = asyncio.Event()
    handlers: dict[ApiKey, Handler] = {
        **HANDLERS,
        ApiKey.JOIN_GROUP: groups.join_group,
        ApiKey.SYNC_GROUP: groups.sync_group,
        ApiKey.HEARTBEAT: groups.heartbeat,
        ApiKey.LEAVE_GROUP: groups.leave_group,
        ApiKey.OFFSET_COMMIT: groups.offset_commit,
        ApiKey.OFFSET_FETCH: groups.offset_fetch,
        ApiKey.LIST_GROUPS: groups.list_groups,
        ApiKey.DESCRIBE_GROUPS: groups.describe_groups,
        ApiKey.DELETE_GROUPS: groups.delete_groups,
    }

    async def drain() -> None:
        # Long polls answer now and JoinGroups waiting for other members end: either
        # would hold the drain for its whole timeout.
        stopping.set()
        for connection in connections:  # answers waiting for a peer that does not read
            connection.session.answers.lost()
        await groups.close()
        await finish_in_flight([t for c in connections for t in c.tasks])

    listener = await start_tcp_listener(
        server,
        "kafka",
        host,
        port,
        lambda: KafkaConnection(server, connections, bound["port"], handlers, stopping),
        connections,
        drain=drain,
    )
    # Metadata names this node by the port actually bound (port 0: the one picked).
    bound["port"] = listener.port
    return listener
