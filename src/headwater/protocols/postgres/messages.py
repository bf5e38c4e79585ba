"""PostgreSQL v3 frontend/backend messages (docs/protocols/postgres.md).

Every message after start-up is ``type u8 | length i32 | body`` (the length counts
itself and the body, not the type); the start-up packets (StartupMessage, SSLRequest,
GSSENCRequest, CancelRequest) have no type byte: ``length i32 | code i32 | body``. All
integers are big-endian, strings are NUL-terminated UTF-8.

:data:`FRONTEND` is the declared table of what a client may send (type byte -> decoder
of the body); the ``encode_*`` functions build what the server sends, and the few
frontend encoders the tests and clients need. :func:`decode_backend` reads the server's
messages back (the conformance vectors and round-trip properties use it).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from headwater.engine.kinds.reader import BoundedReader, as_view
from headwater.errors import ProtocolError

PROTOCOL_VERSION = 196608  # 3.0
SSL_REQUEST_CODE = 80877103
GSSENC_REQUEST_CODE = 80877104
CANCEL_REQUEST_CODE = 80877102

_I16 = struct.Struct(">h")
_U16 = struct.Struct(">H")  # a count, read as PostgreSQL reads one (pq_getmsgint(msg, 2))
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_HEAD = struct.Struct(">ci")


class MessageError(ProtocolError):
    """A frontend message that does not decode: the connection answers with a FATAL
    ErrorResponse (``sqlstate``) and closes."""

    def __init__(self, message: str, sqlstate: str = "08P01") -> None:
        super().__init__(message)
        self.message = message
        self.sqlstate = sqlstate


class _Reader(BoundedReader):
    """Big-endian integers and NUL-terminated strings over the bounded reader."""

    __slots__ = ()

    def __init__(self, body: bytes | memoryview, what: str) -> None:
        super().__init__(as_view(body), lambda message: MessageError(f"{what}: {message}"))

    def int16(self, what: str) -> int:
        value: int = _I16.unpack_from(self.buf, self.need(2, what))[0]
        return value

    def int32(self, what: str) -> int:
        value: int = _I32.unpack_from(self.buf, self.need(4, what))[0]
        return value

    def cstring(self, what: str) -> str:
        start = self.pos
        end = bytes(self.buf[start : self.end]).find(b"\0")
        if end < 0:
            raise self.fail(f"{what}: string without its NUL terminator", start)
        text = self.text(end, what)
        self.pos += 1
        return text

    def count(self, what: str, item_bytes: int) -> int:
        """A 16-bit count (0 to 65,535, as PostgreSQL reads it) of items that fit."""
        n: int = _U16.unpack_from(self.buf, self.need(2, what))[0]
        return self.fits(n, item_bytes, what)


# ---- frontend messages ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartupMessage:
    protocol: int
    parameters: dict[str, str]


@dataclass(frozen=True, slots=True)
class SSLRequest:
    pass


@dataclass(frozen=True, slots=True)
class GSSENCRequest:
    pass


@dataclass(frozen=True, slots=True)
class CancelRequest:
    process_id: int
    secret_key: int


@dataclass(frozen=True, slots=True)
class Query:
    sql: str


@dataclass(frozen=True, slots=True)
class Parse:
    statement: str
    sql: str
    parameter_oids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Bind:
    portal: str
    statement: str
    parameter_formats: tuple[int, ...]
    parameters: tuple[bytes | None, ...]
    result_formats: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Describe:
    kind: str  # "S" statement or "P" portal
    name: str


@dataclass(frozen=True, slots=True)
class Execute:
    portal: str
    max_rows: int  # 0: all


@dataclass(frozen=True, slots=True)
class Close:
    kind: str  # "S" or "P"
    name: str


@dataclass(frozen=True, slots=True)
class Sync:
    pass


@dataclass(frozen=True, slots=True)
class Flush:
    pass


@dataclass(frozen=True, slots=True)
class Terminate:
    pass


@dataclass(frozen=True, slots=True)
class Password:
    """A ``p`` message: PasswordMessage, SASLInitialResponse or SASLResponse (which one
    depends on what the server asked for, so the connection reads the body)."""

    body: bytes


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A known message headwater does not serve (FunctionCall, COPY data)."""

    type: str


StartupPacket = StartupMessage | SSLRequest | GSSENCRequest | CancelRequest
FrontendMessage = (
    Query | Parse | Bind | Describe | Execute | Close | Sync | Flush | Terminate | Password
) | Unsupported


def decode_startup(body: bytes | memoryview) -> StartupPacket:
    """A start-up packet from its bytes after the length."""
    r = _Reader(body, "start-up packet")
    code = r.int32("protocol code")
    if code == SSL_REQUEST_CODE:
        r.finish("SSLRequest")
        return SSLRequest()
    if code == GSSENC_REQUEST_CODE:
        r.finish("GSSENCRequest")
        return GSSENCRequest()
    if code == CANCEL_REQUEST_CODE:
        process_id = r.int32("process id")
        secret = r.int32("secret key")
        r.finish("CancelRequest")
        return CancelRequest(process_id, secret)
    if code >> 16 != 3:
        raise MessageError(
            f"unsupported frontend protocol {code >> 16}.{code & 0xFFFF}: server supports 3.0",
            "0A000",
        )
    parameters: dict[str, str] = {}
    while True:
        name = r.cstring("parameter name")
        if not name:
            break
        parameters[name] = r.cstring(f"parameter {name}")
    r.finish("StartupMessage")
    return StartupMessage(code, parameters)


def _query(r: _Reader) -> Query:
    return Query(r.cstring("query"))


def _parse(r: _Reader) -> Parse:
    name = r.cstring("statement name")
    sql = r.cstring("query")
    n = r.count("parameter type count", 4)
    return Parse(name, sql, tuple(r.int32("parameter type") & 0xFFFFFFFF for _ in range(n)))


def _bind(r: _Reader) -> Bind:
    portal = r.cstring("portal name")
    statement = r.cstring("statement name")
    formats = tuple(r.int16("parameter format") for _ in range(r.count("format count", 2)))
    values: list[bytes | None] = []
    for _ in range(r.count("parameter count", 4)):
        length = r.int32("parameter length")
        if length < -1:
            raise r.fail(f"parameter length {length}", r.pos - 4)
        values.append(None if length == -1 else r.take(length, "parameter value"))
    results = tuple(r.int16("result format") for _ in range(r.count("result format count", 2)))
    for code in (*formats, *results):
        if code not in (0, 1):
            raise MessageError(f"Bind: unsupported format code {code}")
    return Bind(portal, statement, formats, tuple(values), results)


def _kind(r: _Reader, what: str) -> str:
    kind = chr(r.u8(what))
    if kind not in ("S", "P"):
        raise r.fail(f"{what}: expected 'S' or 'P', got {kind!r}", r.pos - 1)
    return kind


def _describe(r: _Reader) -> Describe:
    return Describe(_kind(r, "Describe"), r.cstring("name"))


def _execute(r: _Reader) -> Execute:
    portal = r.cstring("portal name")
    return Execute(portal, max(0, r.int32("row limit")))


def _close(r: _Reader) -> Close:
    return Close(_kind(r, "Close"), r.cstring("name"))


def _password(r: _Reader) -> Password:
    return Password(r.take(r.remaining, "password"))


def _empty(message: Any) -> Callable[[_Reader], Any]:
    return lambda r: message


FRONTEND: dict[bytes, tuple[str, Callable[[_Reader], FrontendMessage]]] = {
    b"Q": ("Query", _query),
    b"P": ("Parse", _parse),
    b"B": ("Bind", _bind),
    b"D": ("Describe", _describe),
    b"E": ("Execute", _execute),
    b"C": ("Close", _close),
    b"S": ("Sync", _empty(Sync())),
    b"H": ("Flush", _empty(Flush())),
    b"X": ("Terminate", _empty(Terminate())),
    b"p": ("PasswordMessage", _password),
    b"F": ("FunctionCall", _empty(Unsupported("FunctionCall"))),
    b"d": ("CopyData", _empty(Unsupported("CopyData"))),
    b"c": ("CopyDone", _empty(Unsupported("CopyDone"))),
    b"f": ("CopyFail", _empty(Unsupported("CopyFail"))),
}
"""Every frontend message after start-up: type byte -> (name, body decoder)."""


def decode_frontend(type_byte: bytes, body: bytes | memoryview) -> FrontendMessage:
    entry = FRONTEND.get(type_byte)
    if entry is None:
        raise MessageError(f"invalid frontend message type {type_byte!r}")
    name, decode = entry
    r = _Reader(body, name)
    message = decode(r)
    if not isinstance(message, Password | Unsupported):
        r.finish(name)
    return message


# ---- encoding ------------------------------------------------------------------------


def _cstring(text: str) -> bytes:
    data = text.encode()
    if b"\0" in data:
        raise ValueError("a protocol string cannot hold NUL")
    return data + b"\0"


def message(type_byte: bytes, body: bytes = b"") -> bytes:
    """One typed message: type, length (counting itself) and body."""
    return _HEAD.pack(type_byte, len(body) + 4) + body


def encode_startup(parameters: dict[str, str], protocol: int = PROTOCOL_VERSION) -> bytes:
    body = (
        _I32.pack(protocol)
        + b"".join(_cstring(k) + _cstring(v) for k, v in parameters.items())
        + b"\0"
    )
    return _I32.pack(len(body) + 4) + body


def encode_ssl_request() -> bytes:
    return _I32.pack(8) + _I32.pack(SSL_REQUEST_CODE)


def encode_cancel_request(process_id: int, secret_key: int) -> bytes:
    return (
        _I32.pack(16)
        + _I32.pack(CANCEL_REQUEST_CODE)
        + _I32.pack(process_id)
        + _I32.pack(secret_key)
    )


def encode_frontend(msg: FrontendMessage) -> bytes:
    """A frontend message's bytes (clients and tests; the server never sends these)."""
    if isinstance(msg, Query):
        return message(b"Q", _cstring(msg.sql))
    if isinstance(msg, Parse):
        oids = b"".join(_U32.pack(oid) for oid in msg.parameter_oids)
        body = _cstring(msg.statement) + _cstring(msg.sql)
        return message(b"P", body + _U16.pack(len(msg.parameter_oids)) + oids)
    if isinstance(msg, Bind):
        parts = [_cstring(msg.portal), _cstring(msg.statement)]
        parts.append(_U16.pack(len(msg.parameter_formats)))
        parts += [_I16.pack(f) for f in msg.parameter_formats]
        parts.append(_U16.pack(len(msg.parameters)))
        for value in msg.parameters:
            parts.append(_I32.pack(-1) if value is None else _I32.pack(len(value)) + value)
        parts.append(_U16.pack(len(msg.result_formats)))
        parts += [_I16.pack(f) for f in msg.result_formats]
        return message(b"B", b"".join(parts))
    if isinstance(msg, Describe):
        return message(b"D", msg.kind.encode() + _cstring(msg.name))
    if isinstance(msg, Execute):
        return message(b"E", _cstring(msg.portal) + _I32.pack(msg.max_rows))
    if isinstance(msg, Close):
        return message(b"C", msg.kind.encode() + _cstring(msg.name))
    if isinstance(msg, Password):
        return message(b"p", msg.body)
    simple = {Sync: b"S", Flush: b"H", Terminate: b"X"}
    if type(msg) in simple:
        return message(simple[type(msg)])
    raise ValueError(f"cannot encode {msg!r}")


# ---- backend messages ----------------------------------------------------------------

AUTH_OK = 0
AUTH_CLEARTEXT = 3
AUTH_SASL = 10
AUTH_SASL_CONTINUE = 11
AUTH_SASL_FINAL = 12


@dataclass(frozen=True, slots=True)
class Column:
    """One RowDescription field."""

    name: str
    type_oid: int
    type_size: int = -1
    type_modifier: int = -1
    format: int = 0  # 0 text, 1 binary
    table_oid: int = 0
    attribute: int = 0


@dataclass(frozen=True, slots=True)
class ErrorFields:
    """An ErrorResponse or NoticeResponse."""

    severity: str  # ERROR, FATAL, NOTICE ...
    sqlstate: str
    message: str
    detail: str | None = None
    hint: str | None = None
    extra: dict[str, str] = field(default_factory=dict)


def encode_authentication(code: int, data: bytes = b"") -> bytes:
    return message(b"R", _I32.pack(code) + data)


def encode_sasl_mechanisms(mechanisms: Sequence[str]) -> bytes:
    return encode_authentication(AUTH_SASL, b"".join(_cstring(m) for m in mechanisms) + b"\0")


def encode_negotiate_protocol_version(minor: int, unrecognized: Sequence[str]) -> bytes:
    """The newest 3.x minor version served, and the ``_pq_.`` options not understood."""
    body = _I32.pack(minor) + _I32.pack(len(unrecognized))
    return message(b"v", body + b"".join(_cstring(o) for o in unrecognized))


def encode_parameter_status(name: str, value: str) -> bytes:
    return message(b"S", _cstring(name) + _cstring(value))


def encode_backend_key_data(process_id: int, secret_key: int) -> bytes:
    return message(b"K", _I32.pack(process_id) + _I32.pack(secret_key))


def encode_ready_for_query(status: str) -> bytes:
    return message(b"Z", status.encode())


def encode_row_description(columns: Sequence[Column]) -> bytes:
    parts = [_I16.pack(len(columns))]
    for c in columns:
        parts.append(_cstring(c.name))
        parts.append(
            struct.pack(
                ">IhIhih",
                c.table_oid,
                c.attribute,
                c.type_oid,
                c.type_size,
                c.type_modifier,
                c.format,
            )
        )
    return message(b"T", b"".join(parts))


def encode_data_row(values: Sequence[bytes | None]) -> bytes:
    parts = [_I16.pack(len(values))]
    for v in values:
        parts.append(_I32.pack(-1) if v is None else _I32.pack(len(v)) + v)
    return message(b"D", b"".join(parts))


_NULL = _I32.pack(-1)


def encode_data_rows(
    rows: Sequence[Sequence[object]], encoders: Sequence[Callable[[object], bytes]]
) -> bytes:
    """DataRow messages of ``rows``, each value not None written by its column's
    encoder (the hot loop of a result: one pass, no intermediate lists per value)."""
    count = _I16.pack(len(encoders))
    pack = _I32.pack
    out: list[bytes] = []
    for row in rows:
        parts = [count]
        for encode, value in zip(encoders, row, strict=True):
            if value is None:
                parts.append(_NULL)
            else:
                data = encode(value)
                parts.append(pack(len(data)))
                parts.append(data)
        body = b"".join(parts)
        out.append(b"D" + pack(len(body) + 4) + body)
    return b"".join(out)


def encode_command_complete(tag: str) -> bytes:
    return message(b"C", _cstring(tag))


def encode_parameter_description(oids: Sequence[int]) -> bytes:
    return message(b"t", _U16.pack(len(oids)) + b"".join(_U32.pack(o) for o in oids))


PARSE_COMPLETE = message(b"1")
BIND_COMPLETE = message(b"2")
CLOSE_COMPLETE = message(b"3")
NO_DATA = message(b"n")
PORTAL_SUSPENDED = message(b"s")
EMPTY_QUERY_RESPONSE = message(b"I")


def encode_error(fields: ErrorFields, type_byte: bytes = b"E") -> bytes:
    """An ErrorResponse (``E``) or NoticeResponse (``N``). The message text is cleaned
    of NULs (a DuckDB error may quote one back)."""
    items = [
        (b"S", fields.severity),
        (b"V", fields.severity),
        (b"C", fields.sqlstate),
        (b"M", fields.message),
    ]
    if fields.detail:
        items.append((b"D", fields.detail))
    if fields.hint:
        items.append((b"H", fields.hint))
    items += [(k.encode(), v) for k, v in fields.extra.items()]
    body = b"".join(k + _cstring(v.replace("\0", "\\0")) for k, v in items)
    return message(type_byte, body + b"\0")


# ---- reading the server's messages back (tests and clients) --------------------------


@dataclass(frozen=True, slots=True)
class BackendMessage:
    """A decoded server message: its type and fields (by name)."""

    type: str
    fields: dict[str, Any]


def decode_backend(type_byte: bytes, body: bytes | memoryview) -> BackendMessage:
    """One server message from its type byte and body (for tests and clients)."""
    t = type_byte.decode("latin-1")
    r = _Reader(body, f"backend message {t!r}")
    out: dict[str, Any] = {}
    if t == "R":
        out["code"] = r.int32("code")
        out["data"] = r.take(r.remaining, "data")
    elif t == "S":
        out["name"] = r.cstring("name")
        out["value"] = r.cstring("value")
    elif t == "K":
        out["process_id"] = r.int32("pid")
        out["secret_key"] = r.int32("key")
    elif t == "Z":
        out["status"] = chr(r.u8("status"))
    elif t == "T":
        columns = []
        for _ in range(r.count("fields", 19)):
            name = r.cstring("field name")
            table_oid = r.int32("table") & 0xFFFFFFFF
            attribute = r.int16("attribute")
            oid = r.int32("type") & 0xFFFFFFFF
            size = r.int16("size")
            modifier = r.int32("modifier")
            fmt = r.int16("format")
            columns.append(Column(name, oid, size, modifier, fmt, table_oid, attribute))
        out["columns"] = columns
    elif t == "D":
        values: list[bytes | None] = []
        for _ in range(r.count("values", 4)):
            n = r.int32("length")
            values.append(None if n == -1 else r.take(n, "value"))
        out["values"] = values
    elif t == "C":
        out["tag"] = r.cstring("tag")
    elif t in ("E", "N"):
        items: dict[str, str] = {}
        while (code := r.u8("field type")) != 0:
            items[chr(code)] = r.cstring("field")
        out.update(items)
    elif t == "v":
        out["minor"] = r.int32("minor")
        out["options"] = [r.cstring("option") for _ in range(r.int32("count"))]
    elif t == "t":
        out["oids"] = [r.int32("oid") & 0xFFFFFFFF for _ in range(r.count("oids", 4))]
    elif t not in ("1", "2", "3", "n", "s", "I"):
        raise MessageError(f"unknown backend message {t!r}")
    r.finish(f"backend message {t!r}")
    return BackendMessage(t, out)


def split_backend(data: bytes) -> list[BackendMessage]:
    """Every complete server message in ``data`` (one-byte answers such as the SSLRequest
    'N' are not messages: strip them first)."""
    out = []
    pos = 0
    while pos + 5 <= len(data):
        type_byte, length = _HEAD.unpack_from(data, pos)
        if pos + 1 + length > len(data):
            break
        out.append(decode_backend(type_byte, data[pos + 5 : pos + 1 + length]))
        pos += 1 + length
    return out
