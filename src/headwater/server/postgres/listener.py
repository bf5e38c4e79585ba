"""The asyncio shell of the PostgreSQL front end: it moves bytes and calls the engine API.

One worker task per connection pulls the protocol's events in order and answers each
before it pulls the next (PostgreSQL answers in order, and an error changes what comes
after it). Queries go to ``EngineAPI.query`` or, under ``SET headwater.as_of = <position>``,
``EngineAPI.query_at``: the same DuckDB tables, dialect and snapshots as Kimberlite's
Query/QueryAt and HTTP's /api/sql (a statement over PostgreSQL's catalog is first
rewritten for DuckDB: catalog.py). A CancelRequest on another connection cancels the
running query of the backend it names (57014).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from headwater.api import EngineAPI
from headwater.api.auth import Principal
from headwater.errors import (
    AuthenticationFailed,
    HeadwaterError,
    InvalidRequest,
    PositionAhead,
    ProjectionLag,
    QueryExecutionError,
    QueryParseError,
    RateLimited,
    StorageError,
    StreamNotFound,
    TableNotFound,
    TenantForbidden,
    TenantNotFound,
)
from headwater.protocols import postgres as pg
from headwater.protocols.postgres.connection import TENANT
from headwater.protocols.postgres.messages import ErrorFields, encode_error
from headwater.server.app import Listener
from headwater.server.metrics import metrics_for
from headwater.server.postgres import catalog
from headwater.server.tcp import (
    ConnectionGuard,
    finish_in_flight,
    start_tcp_listener,
    without_nagle,
)
from headwater.server.tls import context_for, failure_reason
from headwater.sql.statements import statement_kind, tokens
from headwater.sql.values import Timestamp

if TYPE_CHECKING:
    from headwater.server.app import Server

log = logging.getLogger("headwater.postgres")

MAX_BUFFERED = 1 << 20  # bytes received but not yet taken by the worker: reading pauses

# Limits of [limits] as PostgreSQL would name their refusal.
LIMIT_STATES = {
    "max_connections": "53300",  # too_many_connections
    "handshake_timeout_s": "08P01",  # as PostgreSQL's authentication_timeout
    "idle_timeout_s": "57P05",  # idle_session_timeout
}


class CancelledByClient(Exception):
    """A CancelRequest stopped the running query (57014, as PostgreSQL answers)."""


def sqlstate_for(exc: HeadwaterError) -> str:
    """The SQLSTATE of an engine error (docs/protocols/postgres.md, "Errors")."""
    message = exc.message
    if isinstance(exc, QueryParseError):
        return "42601"  # syntax_error
    if isinstance(exc, TableNotFound | StreamNotFound):
        return "42P01"  # undefined_table
    if isinstance(exc, QueryExecutionError):
        if "sql_timeout_ms" in message or "query cancelled" in message:
            return "57014"  # query_canceled
        if "sql_memory_mib" in message:
            return "53200"  # out_of_memory
        if "sql_result_mib" in message:
            return "54000"  # program_limit_exceeded
        if "shutting down" in message:
            return "57P01"  # admin_shutdown
        if "Binder Error" in message and "column" in message.lower():
            return "42703"  # undefined_column
        if "Catalog Error" in message and "unction" in message:
            return "42883"  # undefined_function
        if "Conversion Error" in message or "Invalid Input Error" in message:
            return "22P02"  # invalid_text_representation
        return "42000"  # syntax_error_or_access_rule_violation
    if isinstance(exc, TenantForbidden):
        return "42501"  # insufficient_privilege
    if isinstance(exc, AuthenticationFailed):
        return "28000"  # invalid_authorization_specification
    if isinstance(exc, TenantNotFound):
        return "3D000"  # invalid_catalog_name
    if isinstance(exc, PositionAhead | InvalidRequest):
        return "22023"  # invalid_parameter_value
    if isinstance(exc, ProjectionLag):
        return "55000"  # object_not_in_prerequisite_state (retry)
    if isinstance(exc, RateLimited):
        return "53400"  # configuration_limit_exceeded
    if isinstance(exc, StorageError):
        return "58030"  # io_error
    return "XX000"  # internal_error


def choose_tenant(
    principal: Principal, database: str, setting: str | None, named: Callable[[str], int | None]
) -> int:
    """The tenant a session acts for: the one ``options=-c headwater.tenant=X`` names, else
    the one its database names, where X is a tenant id, ``tenant_<id>`` or a tenant's name
    (``named`` looks names up); a database naming no tenant means the token's lowest
    tenant (0 when every tenant is allowed): psql's default database is the user name.
    A setting naming no tenant is TenantNotFound, and TenantForbidden is a tenant the
    token does not grant."""
    if setting is not None and setting.strip():
        tenant = _tenant_in(setting, named)
        if tenant is None:
            raise TenantNotFound(
                f"headwater.tenant {setting!r} names no tenant: give a tenant id, "
                "tenant_<id> or a tenant's name"
            )
    else:
        tenant = _tenant_in(database, named)
        if tenant is None:
            tenant = principal.default_tenant
    principal.check_tenant(tenant)
    return tenant


def _tenant_in(text: str, named: Callable[[str], int | None]) -> int | None:
    wanted = text.strip()
    number = wanted.lower().removeprefix("tenant_")
    if number.isdigit() and len(number) < 20:
        return int(number)
    return named(wanted)


class ListenerState:
    """What the connections of one listener share: the tokens' SCRAM keys and the open
    backends by process id (for CancelRequest)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.connections: set[PostgresConnection] = set()
        self.backends: dict[int, PostgresConnection] = {}
        auth = server.config.auth
        self.auth_method = "scram-sha-256" if auth.required else "trust"
        self.keys = pg.TokenKeys(auth.tokens) if auth.required else None
        self.tls = context_for(server)  # None: no [tls]; else every client must use it

    def new_process_id(self) -> int:
        while True:
            pid = secrets.randbelow((1 << 31) - 2) + 1
            if pid not in self.backends:
                return pid


class PostgresConnection(asyncio.Protocol):
    def __init__(self, state: ListenerState) -> None:
        self.state = state
        server = state.server
        self.api: EngineAPI = server.api
        self.metrics = metrics_for(server)
        self.protocol = pg.ServerConnection(
            auth=state.auth_method, keys=state.keys, require_tls=state.tls is not None
        )
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.tenant = 0
        self.process_id = 0
        self.secret_key = 0
        self.running: asyncio.Task[pg.QueryOutcome] | None = None
        self._cancel_requested = False
        self._wake = asyncio.Event()
        self._writable = asyncio.Event()  # cleared while the transport's buffer is full
        self._writable.set()
        self._eof = False
        self._reading_paused = False
        self._worker: asyncio.Task[None] | None = None
        self.closed = False
        self.guard = ConnectionGuard(server.limits, "postgres", self)

    # ---- transport callbacks ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if not self.guard.admit(self.transport):
            return
        self.peer = self.guard.peer
        without_nagle(self.transport)
        self.state.connections.add(self)
        self._worker = asyncio.get_running_loop().create_task(self._work())

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended()

    def _ended(self) -> None:
        """The connection is gone: give back its place and stop its work. Called by
        ``connection_lost``, and by the TLS upgrade when the connection closed during
        the handshake, where asyncio and uvloop may never call ``connection_lost`` (the
        TLS layer swallows it): so it may run twice."""
        self.closed = True
        self._writable.set()
        self.guard.release()
        self.state.connections.discard(self)
        if self.state.backends.get(self.process_id) is self:
            del self.state.backends[self.process_id]
        if self.running is not None:
            self.running.cancel()
        if self._worker is not None:
            self._worker.cancel()

    def data_received(self, data: bytes) -> None:
        self.protocol.feed(data)
        self._wake.set()
        if not self.guard.received():
            return
        if self.protocol.buffered_bytes > MAX_BUFFERED and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def eof_received(self) -> bool | None:
        self._eof = True
        self._wake.set()
        return True  # the worker closes once it has answered what arrived

    # ---- the worker ---------------------------------------------------------------------

    async def _work(self) -> None:
        try:
            while not self.closed:
                # A client that sends and does not read holds its answers in our buffer:
                # take nothing more until it reads (its input then waits, bounded).
                await self._writable.wait()
                event = self.protocol.next_event()
                if event is None:
                    if self._eof:
                        for close in self.protocol.receive_eof():
                            log.info("postgres %s: %s", self.peer, close.reason)
                        self.close()
                        return
                    if self._reading_paused and self.transport is not None:
                        self._reading_paused = False
                        self.transport.resume_reading()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._handle(event)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug of ours: log it, drop this connection, keep serving
            log.exception("postgres %s: connection failed", self.peer)
            self.close()

    async def _handle(self, event: pg.Event) -> None:
        if isinstance(event, pg.Reply):
            self._write(event.data)
        elif isinstance(event, pg.RunQuery):
            self._write(await self._run(event))
        elif isinstance(event, pg.DescribeStatement):
            self._write(await self._describe(event))
        elif isinstance(event, pg.Reject):
            log.warning("postgres %s: refused: %s", self.peer, event.reason)
            self._write(event.data)
            self.close()
        elif isinstance(event, pg.Close):
            self.close()
        elif isinstance(event, pg.TlsRequested):
            await self._start_tls()
        elif isinstance(event, pg.Authenticate):
            self._authenticate(event)
        elif isinstance(event, pg.CancelRequested):
            self._cancel(event)
            self.close()

    async def _start_tls(self) -> None:
        """Answer an SSLRequest: 'N' without [tls]; with it 'S', then the TLS handshake
        on this connection (the client's StartupMessage comes through TLS)."""
        context = self.state.tls
        if context is None:
            self._write(self.protocol.decline_tls())
            return
        answer = self.protocol.accept_tls()
        if isinstance(answer, pg.Reject):
            await self._handle(answer)
            return
        self._write(answer)
        assert self.transport is not None
        try:
            transport = await asyncio.get_running_loop().start_tls(
                self.transport,
                self,
                context,
                server_side=True,
                # The guard's handshake_timeout_s (counted from the connection) decides,
                # with an error naming it; this only must not be shorter.
                ssl_handshake_timeout=self.state.server.config.limits.handshake_timeout_s + 1.0,
            )
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            log.warning("postgres %s: TLS handshake failed: %s", self.peer, failure_reason(exc))
            self.close()
            self._ended()
            return
        if transport is None or self.closed:
            # The peer went away, or a limit closed the connection, during the handshake.
            self.close()
            self._ended()
            return
        self.transport = transport
        self.guard.upgraded(transport)
        self.protocol.tls_active = True

    def _authenticate(self, event: pg.Authenticate) -> None:
        try:
            principal = self.api.authenticate(event.token)
            self.tenant = choose_tenant(
                principal,
                event.parameters.get("database", ""),
                self.protocol.settings.get(TENANT),
                self.api.tenant_named,
            )
            self.api.check_tenant(self.tenant)
        except HeadwaterError as exc:
            state = "28P01" if type(exc) is AuthenticationFailed else sqlstate_for(exc)
            log.warning("postgres %s: refused user %r: %s", self.peer, event.user, exc)
            self.metrics.record_error("postgres", exc)
            self._write(self.protocol.refuse(state, str(exc)))
            self.close()
            return
        self.process_id = self.state.new_process_id()
        self.secret_key = secrets.randbits(31)
        self.state.backends[self.process_id] = self
        self.protocol.settings[TENANT] = str(self.tenant)
        self._write(self.protocol.accept(self.process_id, self.secret_key))
        self.guard.authenticated()

    def _cancel(self, event: pg.CancelRequested) -> None:
        backend = self.state.backends.get(event.process_id)
        if backend is None or not secrets.compare_digest(
            backend.secret_key.to_bytes(4, "big"), event.secret_key.to_bytes(4, "big", signed=True)
        ):
            log.info("postgres %s: cancel request for no matching backend", self.peer)
            return
        if backend.running is not None:
            backend._cancel_requested = True
            backend.running.cancel()

    # ---- queries ------------------------------------------------------------------------

    def _for_duckdb(self, sql: str) -> str:
        """PostgreSQL's catalog and functions, as browsing tools use them (catalog.py).
        current_user and current_database() are the names the client connected with
        (PostgreSQL's database defaults to the user's name)."""
        user = self.protocol.user
        database = self.protocol.startup_parameters.get("database") or user
        return catalog.rewrite(sql, self.protocol.settings, user=user, database=database)

    async def _query(
        self, sql: str, parameters: list[object], as_of: int | None
    ) -> pg.QueryOutcome:
        if as_of is None:
            result = await self.api.query(self.tenant, sql, parameters)
        else:
            result = await self.api.query_at(self.tenant, sql, parameters, as_of)
        rows: list[list[object]] = [
            [value.ns if isinstance(value, Timestamp) else value for value in row]
            for row in result.rows
        ]
        return pg.QueryOutcome(result.columns, result.types, rows)

    async def _outcome(
        self, sql: str, parameters: list[object], as_of: int | None
    ) -> pg.QueryOutcome:
        """Run a query as a task a CancelRequest can cancel."""
        self._cancel_requested = False
        self.running = asyncio.get_running_loop().create_task(self._query(sql, parameters, as_of))
        try:
            return await self.running
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._cancel_requested and (current is None or not current.cancelling()):
                raise CancelledByClient from None
            raise
        finally:
            self.running = None

    async def _run(self, event: pg.RunQuery) -> bytes:
        sql = self._for_duckdb(event.sql)
        # One reading of what the statement is, the SQL layer's (comments and all).
        insert = statement_kind(sql) == "insert"
        if event.describe_only and insert:
            # A Describe never runs what writes: the INSERT runs at Execute.
            return self.protocol.describe_later(event)
        try:
            outcome = await self._outcome(sql, event.parameters, event.as_of)
        except HeadwaterError as exc:
            return self._failed(exc)
        except CancelledByClient:
            return self.protocol.fail("57014", "canceling statement due to user request")
        if insert:
            outcome = pg.QueryOutcome(outcome.columns, outcome.types, outcome.rows, insert=True)
        return self.protocol.complete(event, outcome)

    async def _describe(self, event: pg.DescribeStatement) -> bytes:
        """Columns of a statement before any Bind: a read runs as ``LIMIT 0`` with NULL
        parameters; an INSERT returns no rows and runs nothing. What the statement is,
        is the SQL layer's reading (a comment before INSERT is no read)."""
        sql = event.sql.strip().rstrip(";")
        kind = statement_kind(self._for_duckdb(sql))
        if kind == "insert":
            return self.protocol.describe_statement(event.prepared, None)
        if kind == "read" and _first_word(sql) in (
            "select",
            "with",
            "values",
            "from",
            "table",
            "(",
        ):
            # The newline ends a trailing -- comment before the closing parenthesis.
            sql = f"SELECT * FROM ({sql}\n) AS headwater_describe LIMIT 0"
        parameters: list[object] = [None] * len(event.prepared.parameter_oids)
        try:
            outcome = await self._outcome(self._for_duckdb(sql), parameters, self.protocol.as_of)
        except HeadwaterError as exc:
            return self._failed(exc)
        except CancelledByClient:
            return self.protocol.fail("57014", "canceling statement due to user request")
        return self.protocol.describe_statement(event.prepared, outcome)

    def _failed(self, exc: HeadwaterError) -> bytes:
        self.metrics.record_error("postgres", exc)
        return self.protocol.fail(sqlstate_for(exc), exc.message)

    # ---- output ---------------------------------------------------------------------------

    def busy(self) -> bool:
        return self.running is not None

    def refusal(self, limit: str, message: str) -> bytes:
        fields = ErrorFields("FATAL", LIMIT_STATES.get(limit, "53400"), message)
        return encode_error(fields)

    def _write(self, data: bytes) -> None:
        if data and self.transport is not None and not self.closed:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()


def _first_word(sql: str) -> str:
    """The first token of ``sql``, lower-cased, comments skipped ("" if none)."""
    try:
        found = tokens(sql)
    except HeadwaterError:
        return ""
    return found[0].word if found else ""


async def start_postgres(server: Server, host: str, port: int) -> Listener:
    state = ListenerState(server)

    async def drain() -> None:
        # Each connection runs at most one query.
        await finish_in_flight([c.running for c in state.connections if c.running is not None])

    return await start_tcp_listener(
        server,
        "postgres",
        host,
        port,
        lambda: PostgresConnection(state),
        state.connections,
        drain=drain,
        starttls=True,  # TLS is asked for by SSLRequest on the plain port, as PostgreSQL does
    )
