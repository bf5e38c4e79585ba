"""The aiohttp application: JSON errors, authentication and the tenant of a request."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, overload

from aiohttp import web

from headwater.api.quotas import report_throttle
from headwater.errors import (
    AuthenticationFailed,
    HeadwaterError,
    InternalError,
    InvalidRequest,
    NotEnoughReplicas,
    NotLeader,
    TenantForbidden,
)
from headwater.server.answers import AnswerBudget
from headwater.server.http.events import decode_json
from headwater.server.metrics import Metrics

if TYPE_CHECKING:
    from headwater.api import EngineAPI
    from headwater.api.auth import Principal
    from headwater.server.app import Server

log = logging.getLogger("headwater.http")

PROTOCOL = "http"
# The largest body accepted: 4 MiB of event values plus JSON quoting and escaping.
MAX_BODY_BYTES = 16 << 20

SERVER_KEY: web.AppKey[Server] = web.AppKey("headwater_server")
METRICS_KEY: web.AppKey[Metrics] = web.AppKey("headwater_metrics")

# HTTP status of each error code (spec/PROTOCOLS.md §1); unknown codes answer 500.
STATUS_BY_CODE = {
    0: 500,  # Unknown
    1: 500,  # InternalError
    2: 400,  # InvalidRequest
    3: 401,  # AuthenticationFailed (403 when the token is known but lacks the tenant)
    4: 404,  # TenantNotFound
    5: 404,  # StreamNotFound
    6: 404,  # TableNotFound
    7: 400,  # QueryParseError
    8: 422,  # QueryExecutionError
    9: 422,  # PositionAhead
    10: 409,  # StreamAlreadyExists
    11: 400,  # InvalidOffset
    12: 503,  # StorageError
    13: 503,  # ProjectionLag
    14: 429,  # RateLimited
    15: 503,  # NotLeader while no node leads (421 when one does: error_response)
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=json_bytes(data), status=status, content_type="application/json")


def json_bytes(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()


class HeldResponse(web.Response):
    """A JSON answer counted in the server's read-answer budget (``[limits]
    read_answers_mib``, server/answers.py) until it is written: aiohttp's ``write_eof``
    returns once the transport has taken it (its buffer below the low-water mark), or
    until it is dropped unsent (the client left)."""

    def __init__(self, body: bytes, budget: AnswerBudget) -> None:
        super().__init__(body=body, content_type="application/json")
        budget.hold(len(body))
        self._release = weakref.finalize(self, budget.give_back, len(body))

    async def write_eof(self, data: bytes = b"") -> None:
        try:
            await super().write_eof(data)
        finally:
            self._release()


def record_append(
    request: web.Request,
    tenant_id: int,
    stream_name: str,
    events: int,
    value_bytes: int,
    started: float,
) -> None:
    """Count an acknowledged HTTP append in the metrics, its latency measured from
    ``started`` (a ``time.perf_counter()`` taken before the engine call)."""
    request.app[METRICS_KEY].record_append(
        PROTOCOL, tenant_id, stream_name, events, value_bytes, time.perf_counter() - started
    )


def error_body(code: int, name: str, message: str, retryable: bool) -> dict[str, Any]:
    return {"error": {"code": code, "name": name, "message": message, "retryable": retryable}}


def error_response(exc: HeadwaterError) -> web.Response:
    status = 403 if isinstance(exc, TenantForbidden) else STATUS_BY_CODE.get(exc.code, 500)
    body = error_body(exc.code, exc.name, exc.message, exc.retryable)
    if isinstance(exc, NotLeader) and exc.leader is not None:
        # A cluster's partition led elsewhere (docs/cluster.md): 421 Misdirected Request,
        # the leader's node id and addresses (its "http" among them) in the body.
        status = 421
        body["error"]["leader"] = exc.leader
    if isinstance(exc, NotEnoughReplicas):
        # acks=all in a cluster: Kafka's name for what happened, since only
        # NOT_ENOUGH_REPLICAS says nothing was stored (docs/cluster.md).
        body["error"]["replication"] = exc.reason
    response = json_response(body, status)
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="headwater"'
    if exc.retryable:
        response.headers["Retry-After"] = "1"
    return response


def server_of(request: web.Request) -> Server:
    return request.app[SERVER_KEY]


def api_of(request: web.Request) -> EngineAPI:
    server = server_of(request)
    if not server.started:
        raise InternalError("the engine is not open")
    return server.api


def token_of(request: web.Request, *, query_token: bool = False) -> str | None:
    """The request's bearer token: the ``Authorization: Bearer`` header, or, when
    ``query_token`` (WebSocket upgrades: browsers cannot set headers there), the
    ``?token=`` query parameter."""
    header = request.headers.get("Authorization")
    if header is not None:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise AuthenticationFailed("use 'Authorization: Bearer <token>'")
        return value.strip()
    if query_token:
        return request.query.get("token") or None
    return None


def tenant_of(request: web.Request, *, query_token: bool = False) -> int:
    """The request's tenant (``X-Headwater-Tenant`` or ``?tenant=``, default 0), after
    checking the bearer token (see :func:`token_of`) grants it and the tenant exists."""
    # Both are checked; the header wins when both are given.
    given = [
        _tenant_number(text)
        for text in (request.headers.get("X-Headwater-Tenant"), request.query.get("tenant"))
        if text is not None
    ]
    tenant_id = given[0] if given else 0
    principal_of(request, query_token=query_token).check_tenant(tenant_id)  # 403
    api_of(request).check_tenant(tenant_id)  # TenantNotFound
    return tenant_id


def principal_of(request: web.Request, *, query_token: bool = False) -> Principal:
    """Who sent the request, from its bearer token (see :func:`token_of`);
    AuthenticationFailed (401) when auth is required and the token is missing or
    unknown."""
    token = token_of(request, query_token=query_token)
    try:
        return api_of(request).authenticate(token)
    except AuthenticationFailed:
        raise AuthenticationFailed(
            "a valid bearer token is required" if token is None else "unknown token"
        ) from None


MAX_QUERY_INT = (1 << 63) - 1


@overload
def int_param(
    request: web.Request,
    name: str,
    default: int,
    *,
    at_least: int = 0,
    at_most: int = MAX_QUERY_INT,
) -> int: ...
@overload
def int_param(
    request: web.Request,
    name: str,
    default: None,
    *,
    at_least: int = 0,
    at_most: int = MAX_QUERY_INT,
) -> int | None: ...
def int_param(
    request: web.Request,
    name: str,
    default: int | None,
    *,
    at_least: int = 0,
    at_most: int = MAX_QUERY_INT,
) -> int | None:
    """Query parameter ``name`` as an integer in ``at_least..at_most`` (``default`` when
    absent or empty); InvalidRequest otherwise. Every one is an offset, a count, a
    position or an id: none is past a signed 64-bit number (``from=10**23`` was echoed
    back as a next_offset no client could hold)."""
    text = request.query.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise InvalidRequest(f"{name} must be an integer, not {text!r}") from None
    if not at_least <= value <= at_most:
        upper = "2**63-1" if at_most == MAX_QUERY_INT else str(at_most)
        raise InvalidRequest(f"{name} must be {at_least}..{upper}, not {value}")
    return value


def _tenant_number(text: str) -> int:
    try:
        tenant_id = int(text)
    except ValueError:
        tenant_id = -1
    if tenant_id < 0:
        raise InvalidRequest(f"tenant must be a non-negative integer, not {text!r}")
    return tenant_id


async def read_body(request: web.Request) -> bytes:
    """The request's body, read as it arrives: at most MAX_BODY_BYTES (413 past it, also
    for a body without a Content-Length), each wait for more of it at most
    ``[limits] handshake_timeout_s`` and the whole at most ``idle_timeout_s`` (408).

    A client that goes away mid-body (ConnectionResetError) leaves nothing behind: the
    part read is freed at once, not when the cyclic GC gets to the traceback that held
    it (aiohttp keeps the error on the request's payload, a cycle with this frame)."""
    limits = server_of(request).config.limits
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.idle_timeout_s
    body = bytearray()
    try:
        while True:
            # The next chunk within handshake_timeout_s, and the whole by the deadline.
            left = deadline - loop.time()
            gap = limits.handshake_timeout_s
            limit = "handshake_timeout_s" if gap <= left else "idle_timeout_s"
            try:
                async with asyncio.timeout(max(0.0, min(gap, left))):
                    chunk = await request.content.readany()
            except TimeoutError:
                raise BodyTimeout(limit, len(body)) from None
            if not chunk:
                return bytes(body)
            if len(body) + len(chunk) > MAX_BODY_BYTES:
                raise web.HTTPRequestEntityTooLarge(MAX_BODY_BYTES, len(body) + len(chunk))
            body += chunk
    except ConnectionError as exc:
        exc.__traceback__ = None  # breaks the payload -> error -> this frame cycle
        received = len(body)
        body.clear()
        raise ClientGone(f"the client left after sending {received} body bytes") from None
    except BaseException:
        body.clear()  # not returned (too large, stalled, cancelled): freed now
        raise


async def json_body(request: web.Request) -> Any:
    """The request's body parsed as JSON; InvalidRequest (400) when empty or not JSON."""
    body = await read_body(request)
    if not body:
        raise InvalidRequest("the request needs a JSON body")
    return decode_json(body, "the body")


class BodyTimeout(Exception):
    """The request body stopped arriving: ``limit`` ran out after ``received`` bytes."""

    def __init__(self, limit: str, received: int) -> None:
        super().__init__(f"the request body stalled after {received} bytes ({limit})")
        self.limit = limit


class ClientGone(Exception):
    """The client closed or reset its connection while its request was being read."""


def _http_error(exc: web.HTTPException) -> web.Response:
    """aiohttp's own errors (no route, wrong method, body too large) as JSON."""
    if exc.status == 413:
        message = f"the request body is larger than {MAX_BODY_BYTES} bytes"
    elif exc.status == 404:
        message = "no such route"
    elif exc.status == 405:
        message = "method not allowed on this route"
    else:
        message = exc.reason
    response = json_response(error_body(InvalidRequest.code, InvalidRequest.name, message, False))
    response.set_status(exc.status, exc.reason)
    for name in ("Allow",):
        if name in exc.headers:
            response.headers[name] = exc.headers[name]
    if exc.status == 413:
        # The rest of the body is not wanted: close (after a short linger) rather than
        # read it to keep the connection.
        response.force_close()
    return response


THROTTLE_HEADER = "X-Headwater-Throttle-Ms"


def _peer(request: web.Request) -> str:
    """The client's address (host:port) for a log line, also after it reset the
    connection (the handler noted it when the connection was made)."""
    peer = getattr(request.protocol, "peer", None)
    return peer if isinstance(peer, str) and peer != "?" else str(request.remote)


@web.middleware
async def throttle_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every answer says how long the tenant's quotas held it back (Kafka's
    throttle_time_ms), 0 when not at all; a streamed answer already sent cannot."""
    with report_throttle() as throttle:
        response = await handler(request)
    if not response.prepared:
        response.headers[THROTTLE_HEADER] = str(throttle.ms)
    return response


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    metrics = request.app[METRICS_KEY]
    try:
        length = request.content_length
        if length is not None and length > MAX_BODY_BYTES:
            # Refused from the header alone: not one byte of the body is read.
            raise web.HTTPRequestEntityTooLarge(MAX_BODY_BYTES, length)
        return await handler(request)
    except ClientGone as exc:  # nobody will read an answer: one line, no traceback
        log.warning("http: %s %s from %s: %s", request.method, request.path, _peer(request), exc)
        return web.Response(status=400)
    except ConnectionResetError as exc:  # gone while its answer was written (or closed
        # by a stop: it read nothing of it): nobody to answer, one line
        log.warning(
            "http: %s %s from %s: the connection closed while the answer was sent (%s)",
            request.method,
            request.path,
            _peer(request),
            exc,
        )
        return web.Response(status=400)
    except BodyTimeout as exc:
        metrics.record_limit(exc.limit, PROTOCOL)
        log.warning("http: %s %s from %s: %s", request.method, request.path, _peer(request), exc)
        response = error_response(InvalidRequest(str(exc)))
        response.set_status(408)
        response.force_close()
        return response
    except HeadwaterError as exc:
        metrics.record_error(PROTOCOL, exc)
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 413:
            metrics.record_limit("max_body_bytes", PROTOCOL)
        if exc.status >= 500:
            metrics.record_error(PROTOCOL, InternalError(exc.reason))
        else:
            metrics.record_error(PROTOCOL, InvalidRequest(exc.reason))
        return _http_error(exc)
    except Exception as exc:  # a bug of ours: answer, log, keep serving
        log.exception("%s %s failed", request.method, request.path)
        error = InternalError(f"internal error: {exc}")
        metrics.record_error(PROTOCOL, error)
        return error_response(error)
