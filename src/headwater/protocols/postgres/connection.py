"""The sans-I/O server side of one PostgreSQL connection: bytes in, events out.

The shell feeds bytes and pulls events one at a time (:meth:`next_event`), answering
each before it pulls the next: PostgreSQL answers in order, and what follows an error
depends on it (a simple Query's later statements are dropped; extended-protocol
messages are skipped up to the next Sync), so the connection must know an outcome
before it decides the next event.

What the connection answers itself (as :class:`Reply` events: send ``data``): the
SSL/GSSENC negotiation bytes, authentication challenges, ParseComplete, BindComplete,
CloseComplete, ReadyForQuery, and the statements the session owns (BEGIN/COMMIT/
ROLLBACK, SET/RESET/SHOW of settings, ``SELECT version()``). What it asks the shell:

- :class:`TlsRequested`: answer :meth:`decline_tls` (or, with TLS, start it);
- :class:`CancelRequested`: cancel that backend's running query; the connection is done;
- :class:`Authenticate`: the presented token (None under trust); answer :meth:`accept`
  or :meth:`refuse`;
- :class:`RunQuery`: run SQL on the engine; answer :meth:`complete` with the result, or
  :meth:`fail` with the error;
- :class:`DescribeStatement`: the result columns of an unexecuted statement; answer
  :meth:`describe_statement`.

A peer that breaks the protocol gets a FATAL ErrorResponse (:class:`Reject`) and is
closed; a bad value (parameters, settings) is an ERROR and the connection carries on.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from headwater.errors import ProtocolError, UsageError
from headwater.protocols import _connection
from headwater.protocols._connection import Close as Close
from headwater.protocols._stream import IncrementalDecoder

from . import messages as m
from . import statements as st
from . import types as t
from .auth import MECHANISM, ScramError, ScramExchange, TokenKeys

MAX_STARTUP = 10_000  # PostgreSQL's MAX_STARTUP_PACKET_LENGTH
MAX_AUTH_MESSAGE = 65_535  # PG_MAX_AUTH_TOKEN_LENGTH
MAX_MESSAGE = 16 * 1024 * 1024

SERVER_VERSION = "16.0"
VERSION_TEXT = f"PostgreSQL {SERVER_VERSION} (headwater; DuckDB SQL dialect)"
AS_OF = "headwater.as_of"
TENANT = "headwater.tenant"

# Reported at start-up (ParameterStatus) and answered by SHOW.
DEFAULT_SETTINGS = {
    "server_version": SERVER_VERSION,
    "server_version_num": "160000",
    "server_encoding": "UTF8",
    "client_encoding": "UTF8",
    "datestyle": "ISO, MDY",
    "timezone": "UTC",
    "intervalstyle": "postgres",
    "integer_datetimes": "on",
    "standard_conforming_strings": "on",
    "is_superuser": "off",
    "application_name": "",
    "default_transaction_read_only": "off",
    "in_hot_standby": "off",
    "transaction_isolation": "read committed",
    "search_path": "main",
    AS_OF: "latest",
}
_REPORTED = (
    "server_version",
    "server_encoding",
    "client_encoding",
    "DateStyle",
    "TimeZone",
    "IntervalStyle",
    "integer_datetimes",
    "standard_conforming_strings",
    "is_superuser",
    "application_name",
    "default_transaction_read_only",
    "in_hot_standby",
)
_STATUS_NAMES = {name.lower(): name for name in _REPORTED}


@dataclass(frozen=True, slots=True)
class Item:
    """A decoded message: ``type`` (None for a start-up packet) and its body."""

    type: bytes | None
    body: bytes


class _StartupDecoder(IncrementalDecoder[Item, m.MessageError]):
    """``length i32 | body``: the start-up packets (no type byte)."""

    __slots__ = ()
    head_size = 4

    def _check_header(self) -> bool:
        if len(self._buffer) < 4:
            return False
        (length,) = struct.unpack_from(">i", self._buffer)
        if not 8 <= length <= self.max_payload + 4:
            self._fail(m.MessageError(f"invalid start-up packet length {length}"))
            return False
        self._length = length - 4
        return True

    def _item(self, view: memoryview, length: int) -> Item:
        return Item(None, bytes(view[4 : 4 + length]))

    def take_rest(self) -> bytes:
        """The bytes after the start-up packet (the client may pipeline its next
        message): they belong to the typed-message decoder that follows."""
        rest = bytes(self._buffer)
        self._buffer = bytearray()
        return rest


class _MessageDecoder(IncrementalDecoder[Item, m.MessageError]):
    """``type u8 | length i32 | body``: every message after start-up."""

    __slots__ = ()
    head_size = 5

    def _check_header(self) -> bool:
        buffer = self._buffer
        if not buffer:
            return False
        if bytes(buffer[:1]) not in m.FRONTEND:
            self._fail(m.MessageError(f"invalid frontend message type {bytes(buffer[:1])!r}"))
            return False
        if len(buffer) < 5:
            return False
        (length,) = struct.unpack_from(">i", buffer, 1)
        if not 4 <= length <= self.max_payload + 4:
            self._fail(
                m.MessageError(
                    f"invalid message length {length} (at most {self.max_payload + 4})",
                    "08P01" if length < 4 else "54000",
                )
            )
            return False
        self._length = length - 4
        return True

    def _item(self, view: memoryview, length: int) -> Item:
        return Item(bytes(view[:1]), bytes(view[5 : 5 + length]))


# ---- events --------------------------------------------------------------------------


class Reply(_connection.Reply[str]):
    """Bytes the connection produced itself (``answer`` names them): send and carry on."""

    __slots__ = ()


class Reject(_connection.Reject[m.ErrorFields]):
    """A FATAL ErrorResponse (``answer``) to send before closing."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class TlsRequested:
    pass


CancelRequested = m.CancelRequest
"""The CancelRequest packet is itself the event: cancel that backend's running query."""


@dataclass(frozen=True, slots=True)
class Authenticate:
    user: str
    token: str | None  # None: trust (no password asked)
    parameters: dict[str, str]


@dataclass(eq=False, slots=True)
class Prepared:
    sql: str
    statement: st.Statement
    parameter_oids: tuple[int, ...]


@dataclass(eq=False, slots=True)
class Portal:
    prepared: Prepared
    parameters: list[object]
    result_formats: tuple[int, ...]
    # Filled by the engine's answer (Describe or the first Execute), then drained.
    columns: list[m.Column] | None = None
    rows: list[list[object]] = field(default_factory=list)
    sent: int = 0
    tag: str = ""


@dataclass(frozen=True, slots=True)
class RunQuery:
    """Run ``sql`` with ``parameters`` (``as_of``: the tenant log position to read
    below, None for the latest); answer :meth:`ServerConnection.complete` or
    :meth:`ServerConnection.fail`."""

    sql: str
    parameters: list[object]
    as_of: int | None
    portal: Portal | None  # None: a simple Query's statement
    describe_only: bool  # a Describe of the portal: send its RowDescription, no rows
    max_rows: int = 0


@dataclass(frozen=True, slots=True)
class DescribeStatement:
    """The result columns of ``sql`` are wanted before any Bind: answer
    :meth:`ServerConnection.describe_statement`."""

    sql: str
    prepared: Prepared


Event = (
    Reply
    | Reject
    | Close
    | TlsRequested
    | CancelRequested
    | Authenticate
    | RunQuery
    | DescribeStatement
)


@dataclass(frozen=True, slots=True)
class QueryOutcome:
    """An engine result for :meth:`ServerConnection.complete`: column names, DuckDB type
    names (empty: inferred from the values) and rows of SQL-layer values. ``insert``: the
    statement was an INSERT (as the SQL layer's parser reads it, comments and all), whose
    answer is ``rows_affected, log_offset``."""

    columns: list[str]
    types: list[str]
    rows: list[list[object]]
    insert: bool = False


def _oids(outcome: QueryOutcome) -> list[int]:
    """Each column's OID: from DuckDB's type names, else (an INSERT's answer) from the
    first value that is not NULL."""
    if outcome.types:
        return [t.oid_for_duckdb(name) for name in outcome.types]
    return [
        t.oid_for_value(next((row[i] for row in outcome.rows if row[i] is not None), None))
        for i in range(len(outcome.columns))
    ]


def error_fields(sqlstate: str, message: str, severity: str = "ERROR") -> m.ErrorFields:
    return m.ErrorFields(severity, sqlstate, message)


class ServerConnection(_connection.ServerConnection[Item, Event]):
    """One PostgreSQL connection, server side.

    ``auth``: ``"trust"`` (no password asked), ``"password"`` (cleartext; for TLS) or
    ``"scram-sha-256"`` with ``keys`` (every token's SCRAM keys). ``require_tls``: a
    StartupMessage is refused unless TLS was started first (:meth:`accept_tls`).
    """

    eof_reason = "connection ended inside a message ({} bytes)"

    def __init__(
        self,
        *,
        auth: str = "scram-sha-256",
        keys: TokenKeys | None = None,
        max_message: int = MAX_MESSAGE,
        require_tls: bool = False,
    ) -> None:
        super().__init__(_StartupDecoder(MAX_STARTUP))
        if auth not in ("trust", "password", "scram-sha-256"):
            raise UsageError(f"unknown auth method {auth!r}")
        if auth == "scram-sha-256" and keys is None:
            raise UsageError("SCRAM needs the tokens' keys")
        self.auth = auth
        self.require_tls = require_tls
        self.tls_active = False
        self._negotiate = b""  # NegotiateProtocolVersion, sent before authentication
        self._keys = keys
        self._max_message = max_message
        self._state = "startup"  # startup, password, sasl, sasl-final, auth, ready
        self._scram: ScramExchange | None = None
        self.user = ""
        self.startup_parameters: dict[str, str] = {}
        self.settings = dict(DEFAULT_SETTINGS)
        # What RESET goes back to: the settings as the session started (the defaults,
        # the start-up packet's, the tenant chosen), as PostgreSQL's RESET does.
        self._session_defaults = dict(DEFAULT_SETTINGS)
        self.status = "I"  # ReadyForQuery: I idle, T in a block, E failed block
        # In a transaction block: the settings at its BEGIN (a ROLLBACK puts them back,
        # as PostgreSQL's SET is transactional) and the names SET LOCAL changed (their
        # BEGIN value comes back at its end, whichever).
        self._block_settings: dict[str, str] | None = None
        self._local_names: set[str] = set()
        self._pending: deque[Callable[[], Event | None]] = deque()
        self._in_simple = False  # the pending steps belong to a simple Query
        self._skipping = False  # an extended-protocol error: ignore until Sync
        self.statements: dict[str, Prepared] = {}
        self.portals: dict[str, Portal] = {}
        self._end_of_query = self._ready_step  # one object: the marker errors cut to

    @property
    def ready(self) -> bool:
        """Authenticated and serving queries."""
        return self._state == "ready"

    @property
    def as_of(self) -> int | None:
        value = self.settings[AS_OF]
        return None if value == "latest" else int(value)

    # ---- the event loop --------------------------------------------------------------

    def next_event(self) -> Event | None:
        while self._pending and not self._closed:
            event = self._pending.popleft()()
            if event is not None:
                return event
        return super().next_event()

    def _on_broken(self, exc: ProtocolError) -> Event:
        sqlstate = exc.sqlstate if isinstance(exc, m.MessageError) else "08P01"
        return self._reject(sqlstate, str(exc))

    def _reject(self, sqlstate: str, message: str) -> Reject:
        self._closed = True
        self._pending.clear()
        fields = error_fields(sqlstate, message, "FATAL")
        return Reject(fields, m.encode_error(fields), message)

    def _on_item(self, item: Item) -> Event:
        try:
            if item.type is None:
                return self._on_startup(m.decode_startup(item.body))
            message = m.decode_frontend(item.type, item.body)
        except m.MessageError as exc:
            return self._reject(exc.sqlstate, exc.message)
        if self._state != "ready":
            return self._on_auth(message)
        if self._skipping and not isinstance(message, m.Sync | m.Terminate):
            return Reply("ignored", b"")
        return self._on_message(message)

    # ---- start-up and authentication ---------------------------------------------------

    def _on_startup(self, packet: m.StartupPacket) -> Event:
        if isinstance(packet, m.SSLRequest):
            if self.tls_active:
                return self._reject("08P01", "SSLRequest inside TLS")
            return TlsRequested()
        if isinstance(packet, m.GSSENCRequest):
            return Reply("GSSENC refused", b"N")
        if isinstance(packet, m.CancelRequest):
            self._closed = True
            return packet
        if self.require_tls and not self.tls_active:
            return self._reject(
                "28000", "this server takes TLS connections only: connect with sslmode=require"
            )
        user = packet.parameters.get("user", "")
        if not user:
            return self._reject("28000", "no PostgreSQL user name specified in startup packet")
        self.user = user
        self.startup_parameters = dict(packet.parameters)
        options = [name for name in packet.parameters if name.startswith("_pq_.")]
        if packet.protocol & 0xFFFF or options:  # a newer 3.x or protocol options: 3.0 here
            self._negotiate = m.encode_negotiate_protocol_version(0, options)
        try:
            self._apply_startup_settings(packet.parameters)
        except m.MessageError as exc:
            return self._reject(exc.sqlstate, exc.message)
        assert isinstance(self._decoder, _StartupDecoder)
        rest = self._decoder.take_rest()
        self._decoder = _MessageDecoder(MAX_AUTH_MESSAGE)
        self._decoder.feed(rest)
        if self.auth == "trust":
            self._state = "auth"
            return Authenticate(user, None, self.startup_parameters)
        negotiate, self._negotiate = self._negotiate, b""
        if self.auth == "password":
            self._state = "password"
            return Reply(
                "AuthenticationCleartextPassword",
                negotiate + m.encode_authentication(m.AUTH_CLEARTEXT),
            )
        self._state = "sasl"
        return Reply("AuthenticationSASL", negotiate + m.encode_sasl_mechanisms([MECHANISM]))

    def _apply_startup_settings(self, parameters: dict[str, str]) -> None:
        for name, value in parameters.items():
            if name == "options":  # "-c name=value" pairs, as libpq's PGOPTIONS
                words = value.split()
                for i, word in enumerate(words):
                    setting = word[2:] if word.startswith("-c") and len(word) > 2 else None
                    if word == "-c" and i + 1 < len(words):
                        setting = words[i + 1]
                    if setting and "=" in setting:
                        key, _, val = setting.partition("=")
                        self._set(key.strip().lower(), val.strip())
            elif name not in ("user", "database", "replication"):
                self._set(name.lower(), value)

    def _on_auth(self, message: m.FrontendMessage) -> Event:
        if isinstance(message, m.Terminate):
            self._closed = True
            return Close("Terminate during authentication")
        if not isinstance(message, m.Password) or self._state not in (
            "password",
            "sasl",
            "sasl-final",
        ):
            return self._reject("08P01", f"unexpected {type(message).__name__} before ready")
        r = m._Reader(message.body, "authentication")
        try:
            if self._state == "password":
                token = r.cstring("password")
                r.finish("PasswordMessage")
                self._state = "auth"
                return Authenticate(self.user, token, self.startup_parameters)
            if self._state == "sasl":
                mechanism = r.cstring("SASL mechanism")
                length = r.int32("SASL data length")
                data = r.take(max(length, 0), "SASL data")
                r.finish("SASLInitialResponse")
                if mechanism != MECHANISM:
                    return self._reject("28000", f"unsupported SASL mechanism {mechanism!r}")
                assert self._keys is not None
                self._scram = self._keys.exchange()
                server_first = self._scram.client_first(data.decode())
                self._state = "sasl-final"
                return Reply(
                    "AuthenticationSASLContinue",
                    m.encode_authentication(m.AUTH_SASL_CONTINUE, server_first.encode()),
                )
            assert self._scram is not None
            token, server_final = self._scram.client_final(message.body.decode())
        except m.MessageError as exc:
            return self._reject(exc.sqlstate, exc.message)
        except UnicodeDecodeError:
            return self._reject("08P01", "SCRAM message is not UTF-8")
        except ScramError as exc:
            if exc.sqlstate == "28P01":
                return self._password_failed()
            return self._reject(exc.sqlstate, exc.message)
        self._state = "auth"
        self._pending.append(lambda: Authenticate(self.user, token, self.startup_parameters))
        return Reply(
            "AuthenticationSASLFinal",
            m.encode_authentication(m.AUTH_SASL_FINAL, server_final.encode()),
        )

    def _password_failed(self) -> Reject:
        return self._reject("28P01", f'password authentication failed for user "{self.user}"')

    def decline_tls(self) -> bytes:
        """Answer an SSLRequest: no TLS here; the client goes on in plain text (or
        gives up, as ``sslmode=require`` does)."""
        return b"N"

    def accept_tls(self) -> bytes | Reject:
        """Answer an SSLRequest with TLS: ``b"S"``, after which the shell starts TLS and
        sets :attr:`tls_active`. Bytes the client sent after its SSLRequest and before
        TLS would otherwise be taken as if they had come through TLS (CVE-2021-23214):
        then this is a Reject instead."""
        if self.buffered_bytes:
            return self._reject("08P01", "received unencrypted data after SSL request")
        return b"S"

    def accept(self, process_id: int, secret_key: int) -> bytes:
        """The Authenticate event succeeded: AuthenticationOk, the settings, the cancel
        key and the first ReadyForQuery."""
        if self._state != "auth":
            raise UsageError("accept() answers an Authenticate event")
        self._state = "ready"
        self._session_defaults = dict(self.settings)
        self._decoder.max_payload = self._max_message
        parts = [self._negotiate, m.encode_authentication(m.AUTH_OK)]
        for name in _REPORTED:
            parts.append(m.encode_parameter_status(name, self.settings[name.lower()]))
        parts.append(m.encode_backend_key_data(process_id, secret_key))
        parts.append(m.encode_ready_for_query(self.status))
        return b"".join(parts)

    def refuse(self, sqlstate: str, message: str) -> bytes:
        """The Authenticate event failed: the FATAL error to send before closing."""
        if sqlstate == "28P01":
            return self._password_failed().data
        return self._reject(sqlstate, message).data

    # ---- queries ----------------------------------------------------------------------

    def _on_message(self, message: m.FrontendMessage) -> Event:
        if isinstance(message, m.Query):
            return self._simple_query(message.sql)
        if isinstance(message, m.Sync):
            self._skipping = False
            if self.status == "I":
                self.portals.clear()
            return Reply("ReadyForQuery", m.encode_ready_for_query(self.status))
        if isinstance(message, m.Terminate):
            self._closed = True
            return Close("Terminate")
        if isinstance(message, m.Flush):
            return Reply("Flush", b"")
        if isinstance(message, m.Parse):
            return self._parse(message)
        if isinstance(message, m.Bind):
            return self._bind(message)
        if isinstance(message, m.Describe):
            return self._describe(message)
        if isinstance(message, m.Execute):
            return self._execute(message)
        if isinstance(message, m.Close):
            (self.statements if message.kind == "S" else self.portals).pop(message.name, None)
            return Reply("CloseComplete", m.CLOSE_COMPLETE)
        if isinstance(message, m.Unsupported):
            if message.type == "FunctionCall":
                data = self._error("0A000", "function calls are not supported")
                return Reply("error", data + m.encode_ready_for_query(self.status))
            return Reply("ignored", b"")  # COPY messages outside COPY: PostgreSQL ignores
        return self._reject("08P01", "unexpected password message after authentication")

    def _error(self, sqlstate: str, text: str) -> bytes:
        """An ERROR: the block fails; a simple Query's later statements are dropped;
        in the extended protocol, messages are skipped up to Sync."""
        if self.status == "T":
            self.status = "E"
        if self._in_simple:
            while self._pending and self._pending[0] is not self._end_of_query:
                self._pending.popleft()
        else:
            self._skipping = True
        return m.encode_error(error_fields(sqlstate, text))

    def _ready_step(self) -> Event:
        self._in_simple = False
        return Reply("ReadyForQuery", m.encode_ready_for_query(self.status))

    def _simple_query(self, sql: str) -> Event:
        texts = st.split_statements(sql)
        if not texts:
            return Reply(
                "EmptyQueryResponse",
                m.EMPTY_QUERY_RESPONSE + m.encode_ready_for_query(self.status),
            )
        self._in_simple = True
        for text in texts:
            self._pending.append(lambda text=text: self._simple_statement(text))  # type: ignore[misc]
        self._pending.append(self._end_of_query)
        return Reply("query", b"")

    def _simple_statement(self, text: str) -> Event:
        statement = self._resolve(st.classify(text))
        if isinstance(statement, st.Engine):
            if self.status == "E":
                return Reply("error", self._aborted())
            return RunQuery(statement.sql, [], self.as_of, None, describe_only=False)
        return Reply("session", self._session(statement, describe=True))

    def _resolve(self, statement: st.Statement) -> st.Statement:
        """A SHOW of something that is not a setting (``SHOW TABLES``) is DuckDB's."""
        if isinstance(statement, st.Show) and not self._known_setting(statement.name):
            return st.Engine(f"SHOW {statement.name}")
        return statement

    def _known_setting(self, name: str) -> bool:
        return name == "version" or name in self.settings or name == "all"

    def _aborted(self) -> bytes:
        return self._error(
            "25P02",
            "current transaction is aborted, commands ignored until end of transaction block",
        )

    def _session(self, statement: st.Statement, *, describe: bool) -> bytes:
        """Run a statement the session owns; its whole answer (rows and tag)."""
        if isinstance(statement, st.Transaction):
            tag = statement.action
            changed = b""
            if statement.action in ("BEGIN", "SAVEPOINT", "RELEASE"):
                # Savepoints mark nothing (no statement is undone): accepted so clients
                # that nest transactions (psycopg's conn.transaction()) work.
                if self.status == "E":
                    return self._aborted()
                if statement.action == "BEGIN" and self.status == "I":
                    self.status = "T"
                    self._block_settings, self._local_names = dict(self.settings), set()
            elif statement.action == "ROLLBACK TO":
                if self.status == "E":
                    self.status = "T"
                tag = "ROLLBACK"
            else:
                if self.status == "E":
                    tag = "ROLLBACK"
                changed = self._end_block(commit=tag == "COMMIT")
                self.status = "I"
            return m.encode_command_complete(tag) + changed
        if self.status == "E":
            return self._aborted()
        if isinstance(statement, st.Empty):
            return m.EMPTY_QUERY_RESPONSE
        if isinstance(statement, st.Discard | st.ResetAll):
            out = self._reset_all()
            if isinstance(statement, st.ResetAll):
                return m.encode_command_complete("RESET") + out
            self.statements.clear()
            self.portals.clear()
            return m.encode_command_complete("DISCARD ALL") + out
        if isinstance(statement, st.SetVariable):
            if statement.local and self._block_settings is None:
                # PostgreSQL: "SET LOCAL can only be used in transaction blocks" (a
                # warning), and it changes nothing.
                return m.encode_command_complete("SET")
            try:
                self._set(statement.name, statement.value)
            except m.MessageError as exc:
                return self._error(exc.sqlstate, exc.message)
            if statement.local:
                self._local_names.add(statement.name)
            out = m.encode_command_complete("RESET" if statement.value is None else "SET")
            reported = _STATUS_NAMES.get(statement.name)
            if reported is not None:
                out += m.encode_parameter_status(reported, self.settings[statement.name])
            return out
        assert isinstance(statement, st.Show | st.NoTypes)
        columns, rows, tag = self._show(
            statement.name if isinstance(statement, st.Show) else "pg_type"
        )
        head = m.encode_row_description(columns) if describe else b""
        return (
            head
            + b"".join(m.encode_data_row([v.encode() for v in row]) for row in rows)
            + m.encode_command_complete(tag)
        )

    def _show(self, name: str) -> tuple[list[m.Column], list[list[str]], str]:
        if name == "pg_type":  # st.NoTypes: the columns of psycopg's TypeInfo query
            columns = [m.Column(c, t.TEXT) for c in ("name", "regtype", "delimiter")]
            columns[1:1] = [m.Column("oid", t.OID, 4), m.Column("array_oid", t.OID, 4)]
            return columns, [], "SELECT 0"
        if name == "version":
            return [m.Column("version", t.TEXT)], [[VERSION_TEXT]], "SELECT 1"
        if name == "all":
            rows = [[k, v, ""] for k, v in sorted(self.settings.items())]
            columns = [m.Column(c, t.TEXT) for c in ("name", "setting", "description")]
            return columns, rows, "SHOW"
        return [m.Column(name, t.TEXT)], [[self.settings[name]]], "SHOW"

    def _end_block(self, *, commit: bool) -> bytes:
        """The transaction block ended: a ROLLBACK puts back every setting as it was at
        BEGIN (a SET in a block is undone with it, as in PostgreSQL: an as_of set in a
        rolled-back block went on serving later queries stale reads), a COMMIT those SET
        LOCAL changed. A ParameterStatus for each reported one that changed."""
        before, block = self.settings, self._block_settings
        self._block_settings = None
        if block is None:
            return b""
        names = self._local_names if commit else set(self.settings) | set(block)
        self.settings = dict(before)
        for name in names:
            if name in block:
                self.settings[name] = block[name]
            else:
                self.settings.pop(name, None)
        return b"".join(
            m.encode_parameter_status(reported, self.settings[name])
            for name, reported in _STATUS_NAMES.items()
            if before.get(name) != self.settings.get(name) and name in self.settings
        )

    def _reset_all(self) -> bytes:
        """Every setting back to its session default (the tenant to the connect-time
        one, which every statement still uses); a ParameterStatus for each reported one
        that changed."""
        before, self.settings = self.settings, dict(self._session_defaults)
        return b"".join(
            m.encode_parameter_status(reported, self.settings[name])
            for name, reported in _STATUS_NAMES.items()
            if before.get(name) != self.settings[name]
        )

    def _set(self, name: str, value: str | None) -> None:
        if value is None:  # RESET: the session's default (the tenant: connect time's)
            if name.startswith("headwater.") and name not in self._session_defaults:
                raise m.MessageError(f'unrecognized configuration parameter "{name}"', "42704")
            self.settings[name] = self._session_defaults.get(name, "")
            return
        if name == "client_encoding":
            return  # every string is UTF-8 here; reported as UTF8 whatever was asked
        if name == AS_OF:
            word = value.strip().lower()
            if word not in ("latest", "default") and not (word.isdigit() and len(word) < 20):
                raise m.MessageError(
                    f"{AS_OF} takes a tenant log position (a non-negative integer) or "
                    f"'latest', not {value!r}",
                    "22023",
                )
            value = "latest" if word == "default" else str(int(word)) if word.isdigit() else word
        elif name == TENANT:
            if self._state == "ready":
                raise m.MessageError(
                    f'parameter "{TENANT}" is chosen at connect time (dbname or options)',
                    "55P02",
                )
        elif name.startswith("headwater."):
            raise m.MessageError(f'unrecognized configuration parameter "{name}"', "42704")
        self.settings[name] = value

    # ---- the extended protocol --------------------------------------------------------

    def _parse(self, message: m.Parse) -> Event:
        if message.statement and message.statement in self.statements:
            return Reply(
                "error",
                self._error("42P05", f'prepared statement "{message.statement}" already exists'),
            )
        texts = st.split_statements(message.sql)
        if len(texts) > 1:
            return Reply(
                "error",
                self._error("42601", "cannot insert multiple commands into a prepared statement"),
            )
        statement = self._resolve(st.classify(texts[0])) if texts else st.Empty()
        if self._refused_in_failed_block(statement):
            return Reply("error", self._aborted())
        count = max(len(message.parameter_oids), st.parameter_count(message.sql))
        if count > st.MAX_PARAMETERS:
            # Refused before a type is kept per parameter: one short Parse naming
            # $30000000 would hold 30 million of them, and no Bind or
            # ParameterDescription could carry that many.
            return Reply(
                "error",
                self._error(
                    "54000",
                    f"a prepared statement takes at most {st.MAX_PARAMETERS} parameters,"
                    f" not ${count}",
                ),
            )
        oids = message.parameter_oids + (0,) * (count - len(message.parameter_oids))
        self.statements[message.statement] = Prepared(message.sql, statement, oids)
        return Reply("ParseComplete", m.PARSE_COMPLETE)

    def _bind(self, message: m.Bind) -> Event:
        prepared = self.statements.get(message.statement)
        if prepared is None:
            return Reply(
                "error",
                self._error("26000", f'prepared statement "{message.statement}" does not exist'),
            )
        if self._refused_in_failed_block(prepared.statement):
            return Reply("error", self._aborted())
        values = message.parameters
        oids = prepared.parameter_oids
        if len(values) != len(oids):
            return Reply(
                "error",
                self._error(
                    "08P01",
                    f"bind message supplies {len(values)} parameters, but prepared statement "
                    f'"{message.statement}" requires {len(oids)}',
                ),
            )
        formats = message.parameter_formats
        if len(formats) not in (0, 1, len(values)):
            return Reply("error", self._error("08P01", "bind message has a bad format count"))
        decoded: list[object] = []
        try:
            for i, (oid, value) in enumerate(zip(oids, values, strict=True)):
                binary = bool(formats[i if len(formats) > 1 else 0]) if formats else False
                decoded.append(t.decode_parameter(oid, binary, value))
        except m.MessageError as exc:
            return Reply("error", self._error(exc.sqlstate, exc.message))
        self.portals[message.portal] = Portal(prepared, decoded, message.result_formats)
        return Reply("BindComplete", m.BIND_COMPLETE)

    def _describe(self, message: m.Describe) -> Event:
        if message.kind == "S":
            prepared = self.statements.get(message.name)
            if prepared is None:
                return Reply(
                    "error",
                    self._error("26000", f'prepared statement "{message.name}" does not exist'),
                )
            if self._refused_in_failed_block(prepared.statement, describing=True):
                return Reply("error", self._aborted())
            head = m.encode_parameter_description(
                [oid or t.TEXT for oid in prepared.parameter_oids]
            )
            if isinstance(prepared.statement, st.Engine):
                self._pending.appendleft(lambda: DescribeStatement(prepared.sql, prepared))
                return Reply("ParameterDescription", head)
            return Reply("description", head + self._session_description(prepared.statement, ()))
        portal = self.portals.get(message.name)
        if portal is None:
            return Reply("error", self._error("34000", f'portal "{message.name}" does not exist'))
        statement = portal.prepared.statement
        if self._refused_in_failed_block(statement, describing=True):
            return Reply("error", self._aborted())
        if isinstance(statement, st.Engine):
            if portal.columns is not None:
                return Reply("RowDescription", self._row_description(portal))
            return RunQuery(
                statement.sql, portal.parameters, self.as_of, portal, describe_only=True
            )
        return Reply("description", self._session_description(statement, portal.result_formats))

    def _refused_in_failed_block(
        self, statement: st.Statement, *, describing: bool = False
    ) -> bool:
        """In a failed block (status E) PostgreSQL refuses (25P02) a Parse or Bind of
        anything but the statements that end the block, and a Describe of a statement
        that returns rows: nothing of the block may run, or be prepared to run, until it
        ends."""
        if self.status != "E" or isinstance(statement, st.Transaction):
            return False
        if describing:
            return isinstance(statement, st.Engine | st.Show | st.NoTypes)
        return True

    def _session_description(self, statement: st.Statement, formats: Sequence[int]) -> bytes:
        if isinstance(statement, st.Show) and self._known_setting(statement.name):
            columns, _, _ = self._show(statement.name)
            return m.encode_row_description(columns)
        if isinstance(statement, st.NoTypes):
            return m.encode_row_description(self._show("pg_type")[0])
        return m.NO_DATA

    def _execute(self, message: m.Execute) -> Event:
        portal = self.portals.get(message.portal)
        if portal is None:
            return Reply("error", self._error("34000", f'portal "{message.portal}" does not exist'))
        statement = portal.prepared.statement
        if not isinstance(statement, st.Engine):
            return Reply("session", self._session(statement, describe=False))
        if self.status == "E":
            return Reply("error", self._aborted())
        if portal.columns is not None:
            return Reply("rows", self._portal_rows(portal, message.max_rows))
        return RunQuery(
            statement.sql,
            portal.parameters,
            self.as_of,
            portal,
            describe_only=False,
            max_rows=message.max_rows,
        )

    # ---- the shell's answers -----------------------------------------------------------

    def complete(self, query: RunQuery, outcome: QueryOutcome) -> bytes:
        """The answer to a :class:`RunQuery`: its rows (or row description)."""
        if outcome.insert:
            # As PostgreSQL's INSERT without RETURNING: no rows, the count in the tag
            # (the engine answers rows_affected and log_offset).
            count = outcome.rows[0][0] if outcome.rows else 0
            outcome = QueryOutcome([], [], [])
            tag = f"INSERT 0 {count}"
        else:
            tag = f"SELECT {len(outcome.rows)}"
        oids = _oids(outcome)
        portal = query.portal
        formats = portal.result_formats if portal is not None else ()
        columns = [
            m.Column(
                name,
                oid,
                t.SIZES.get(oid, -1),
                format=formats[i if len(formats) > 1 else 0] if formats else 0,
            )
            for i, (name, oid) in enumerate(zip(outcome.columns, oids, strict=True))
        ]
        rows = outcome.rows
        if portal is None:
            target = Portal(Prepared(query.sql, st.Engine(query.sql), ()), [], ())
            target.columns, target.rows, target.tag = columns, rows, tag
            head = m.encode_row_description(columns) if columns else b""
            return head + self._portal_rows(target, 0)
        portal.columns, portal.rows, portal.tag = columns, rows, tag
        if query.describe_only:
            return self._row_description(portal)
        return self._portal_rows(portal, query.max_rows)

    def describe_later(self, query: RunQuery) -> bytes:
        """The answer to a Describe of a portal (``query.describe_only``) whose statement
        writes (an INSERT): NoData, as PostgreSQL answers for an INSERT without
        RETURNING. Nothing runs: the portal's Execute runs it, and a portal closed
        without one appends nothing."""
        if not query.describe_only:
            raise UsageError("describe_later() answers a Describe of a portal")
        return m.NO_DATA

    @staticmethod
    def _row_description(portal: Portal) -> bytes:
        if not portal.columns:
            return m.NO_DATA
        return m.encode_row_description(portal.columns)

    def _portal_rows(self, portal: Portal, max_rows: int) -> bytes:
        assert portal.columns is not None
        encoders = [t.column_encoder(c.type_oid, bool(c.format)) for c in portal.columns]
        end = len(portal.rows) if max_rows <= 0 else min(len(portal.rows), portal.sent + max_rows)
        try:
            out = [m.encode_data_rows(portal.rows[portal.sent : end], encoders)]
        except (ValueError, struct.error) as exc:
            # A value the format cannot carry (a date past PostgreSQL's int32 days in
            # binary): the statement fails as PostgreSQL's would, the session goes on.
            return self._error("22008", f"a result value cannot be sent in this format: {exc}")
        portal.sent = end
        if end < len(portal.rows):
            out.append(m.PORTAL_SUSPENDED)
        else:
            out.append(m.encode_command_complete(portal.tag))
        return b"".join(out)

    def describe_statement(self, prepared: Prepared, outcome: QueryOutcome | None) -> bytes:
        """The RowDescription of a described statement (None: it returns no rows)."""
        if outcome is None or not outcome.columns:
            return m.NO_DATA
        oids = _oids(outcome)
        return m.encode_row_description(
            [m.Column(n, o, t.SIZES.get(o, -1)) for n, o in zip(outcome.columns, oids, strict=True)]
        )

    def fail(self, sqlstate: str, message: str) -> bytes:
        """The answer to a RunQuery or DescribeStatement that failed: an ERROR."""
        return self._error(sqlstate, message)
