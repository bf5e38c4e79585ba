"""The Rivven link of the connection core: one TCP connection speaking Rivven's
protobuf format (docs/protocols/rivven.md), beside the Kimberlite one.

:class:`RivvenLink` frames requests through the sans-I/O
:class:`~headwater.protocols.rivven.ClientConnection` (correlation ids, any number in
flight) and resolves each request's future with the answer's message (a
``pb.PublishResponse``, a ``pb.ErrorResponse``...). :class:`RivvenSession` is the
:class:`~.session.Session` over it (connect with the version Handshake and a PLAIN
Authenticate carrying the token, reconnect, retry what is safe) and turns an
ErrorResponse into the ``headwater.errors`` class the server raised: headwater's server
names it in the answer's ``details``; a Rivven code alone picks the nearest class.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any, ClassVar, Self, TypedDict, TypeVar

from google.protobuf.message import Message

from headwater.engine.groups import errors as group_errors
from headwater.errors import (
    AuthenticationFailed,
    HeadwaterError,
    InvalidOffset,
    InvalidRequest,
    NotLeader,
    RateLimited,
    StreamAlreadyExists,
    StreamNotFound,
    UnknownError,
    error_for_code,
)
from headwater.protocols.rivven import rivven_pb2 as pb
from headwater.protocols.rivven.connection import ClientConnection, ResponseFrame
from headwater.protocols.rivven.messages import PROTOCOL_VERSION, ErrorCode

from ..errors import ServerUnavailable
from .link import Link, Route
from .session import Resumable, Session
from .tls import PathLike, client_context

DEFAULT_PORT = 7404
DEFAULT_SERVER = f"127.0.0.1:{DEFAULT_PORT}"

M = TypeVar("M", bound=Message)

# Rivven's codes, for an answer that does not name headwater's class.
_BY_RIVVEN_CODE: dict[int, type[HeadwaterError]] = {
    ErrorCode.INVALID_REQUEST: InvalidRequest,
    ErrorCode.TOPIC_NOT_FOUND: StreamNotFound,
    ErrorCode.PARTITION_NOT_FOUND: InvalidRequest,
    ErrorCode.OFFSET_OUT_OF_RANGE: InvalidOffset,
    ErrorCode.NOT_LEADER: NotLeader,
    ErrorCode.INVALID_TOPIC: StreamAlreadyExists,
    ErrorCode.UNAUTHORIZED: AuthenticationFailed,
    ErrorCode.QUOTA_EXCEEDED: RateLimited,
}
_GROUP_ERRORS: dict[str, type[group_errors.GroupError]] = {
    cls.kafka_name: cls
    for cls in vars(group_errors).values()
    if isinstance(cls, type) and issubclass(cls, group_errors.GroupError) and cls.kafka_name
}


def error_of(answer: pb.ErrorResponse) -> HeadwaterError:
    """The exception an ErrorResponse stands for."""
    message = answer.message
    name, colon, rest = message.partition(": ")
    if colon and name in ErrorCode.__members__:
        message = rest  # the NAME: prefix every Rivven error carries
    details = answer.details
    group_error = _GROUP_ERRORS.get(details.get("kafka_error", ""))
    if group_error is not None:
        return group_error(message)
    code = details.get("error_code", "")
    if code.isdigit():
        error = error_for_code(int(code), message, details.get("error"))
    else:
        error = _BY_RIVVEN_CODE.get(answer.code, UnknownError)(message)
    if isinstance(error, NotLeader):
        # The leader's addresses, by listener (docs/protocols/rivven.md, "Errors").
        leader = {
            k.removeprefix("leader_"): v for k, v in details.items() if k.startswith("leader_")
        }
        error.leader = dict(leader) if leader else None
    return error


class Throttled(RateLimited):
    """A ThrottledResponse: the request was not served, its tenant being past a quota.
    :meth:`RivvenSession.request` sends it again after ``throttle_time_ms``; it is not
    retryable for the session's generic retry, whose backoff does not wait that time."""

    retryable = False

    def __init__(self, answer: pb.ThrottledResponse) -> None:
        super().__init__(
            f"{answer.entity} is past its {answer.quota_type}: retry after"
            f" {answer.throttle_time_ms} ms"
        )
        self.throttle_time_ms = answer.throttle_time_ms


class _CoordinatorElsewhere(NotLeader):
    """A NOT_COORDINATOR that names the coordinator's Rivven listener (a cluster:
    docs/cluster.md): refused before anything was done, so the session follows it as
    it follows a NotLeader's leader; ``refused`` is raised if the moves run out."""

    def __init__(self, refused: group_errors.NotCoordinator, listener: str, address: str):
        super().__init__(refused.message, {listener: address})
        self.refused = refused


class RivvenLink(Link[ResponseFrame, Message]):
    """One Rivven connection: answers matched by correlation id (no pushes)."""

    codec: ClientConnection

    def _dispatch(self, frame: ResponseFrame) -> None:
        answer: Message = getattr(frame.response, frame.kind)
        if self._deliver(frame.correlation_id, answer, push=False):
            return
        if frame.correlation_id == 0 and isinstance(answer, pb.ErrorResponse):
            # About the connection, not a request: the server closes it next.
            self.close_reason = f"the server refused the connection: {answer.message}"
        # Anything else answers a request nobody waits for any more (it timed out).

    def send(
        self, request: Message, route: Route | None = None
    ) -> tuple[int, asyncio.Future[Message]]:
        """Frame and write one request (an operation's message, such as a
        PublishRequest); its future gets the answer's message (or Lost)."""
        self._check()
        correlation_id, data = self.codec.send_request(request)
        return correlation_id, self._expect(correlation_id, data, route)


class RivvenSession(Session[RivvenLink, Resumable[Any]]):
    """A client's connection to a server's Rivven listener (see the module)."""

    default_port: ClassVar[int] = DEFAULT_PORT
    service = "headwater (Rivven)"
    listener = "rivven"

    def __init__(self, server: str, client_id: str, connection: ConnectionOptions) -> None:
        """The :class:`ConnectionOptions` given, their defaults for the rest."""
        super().__init__(
            server,
            connection.get("timeout", 30.0),
            connection.get("reconnect", True),
            connection.get("reconnect_attempts", 10),
            connection.get("backoff_base", 0.05),
            connection.get("backoff_max", 2.0),
            connection.get("retries", 5),
            tls=client_context(
                connection.get("tls", False),
                connection.get("ca"),
                connection.get("cert"),
                connection.get("key"),
            ),
        )
        self.token = connection.get("token")
        self.client_id = client_id
        self.requests = 0  # requests written, handy in tests and for monitoring
        self.throttled = 0  # ThrottledResponses answered (each request sent again)

    async def _open(self) -> RivvenLink:
        codec = ClientConnection(self.client_id)
        conn = await self._dial(lambda: RivvenLink(codec, self._on_lost))
        hello = await self._greet(
            conn,
            lambda c: c.send(
                pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION, client_id=self.client_id)
            ),
            "Handshake",
            pb.HandshakeResultResponse,
        )
        if not hello.compatible:
            conn.close()
            raise ServerUnavailable(f"{self._where}: {hello.message}")
        if self.token is not None:
            # Over TLS, ask the server to refuse a cleartext link (the token must not
            # cross one if a proxy or a misconfiguration stripped the TLS).
            plain = pb.PlainAuth(
                username=self.client_id, password=self.token, require_tls=self.tls is not None
            )
            await self._greet(
                conn,
                lambda c: c.send(pb.AuthenticateRequest(plain=plain)),
                "Authenticate",
                pb.AuthenticateResponse,
            )
        return conn

    def _error_of(self, reply: Any) -> HeadwaterError | None:
        if isinstance(reply, pb.ThrottledResponse):
            return Throttled(reply)
        if not isinstance(reply, pb.ErrorResponse):
            return None
        error = error_of(reply)
        if isinstance(error, group_errors.NotCoordinator):
            # Groups' offsets and transactions are answered by their coordinator only;
            # its message names its listeners as a NotLeader's does.
            address = NotLeader(error.message).address_of(self.listener)
            if address is not None:
                return _CoordinatorElsewhere(error, self.listener, address)
        return error

    async def request(
        self, message: Message, expect: type[M], *, safe: bool, wait: float | None = None
    ) -> M:
        """Send one request and return its answer (``expect``), retrying when ``safe``;
        an ErrorResponse raises its error. ``wait``: seconds the server may hold it.

        A ThrottledResponse (its tenant past a quota: docs/protocols/rivven.md,
        "Quotas") means the request was not served: it is sent again as it was, after
        throttle_time_ms, however often (an idempotent publish keeps its sequence, so
        it is stored once)."""
        what = type(message).__name__.removesuffix("Request")

        def post(conn: RivvenLink) -> tuple[int, asyncio.Future[Message]]:
            sent = conn.send(message)
            self.requests += 1
            return sent

        while True:
            try:
                return await self._exchange(post, what, expect, safe=safe, wait=wait)
            except Throttled as throttled:
                self.throttled += 1
                await asyncio.sleep(throttled.throttle_time_ms / 1000)
            except _CoordinatorElsewhere as moved:
                raise moved.refused from None  # followed `retries` times, still refused


class ConnectionOptions(TypedDict, total=False):
    """The connection options the SDK's producer and consumer both take, with their
    defaults: ``token`` (None), ``timeout`` (30.0 s), ``reconnect`` (True), ``retries``
    (5), ``reconnect_attempts`` (10), ``backoff_base`` (0.05 s), ``backoff_max`` (2.0
    s), ``tls`` (False, or an ``ssl.SSLContext``), ``ca``/``cert``/``key`` (None)."""

    token: str | None
    timeout: float | None
    reconnect: bool
    retries: int
    reconnect_attempts: int
    backoff_base: float
    backoff_max: float
    tls: bool | ssl.SSLContext
    ca: PathLike | None
    cert: PathLike | None
    key: PathLike | None


class RivvenClient:
    """What the producer and the consumer share: one :class:`RivvenSession` made from
    the :class:`ConnectionOptions`, and the ``async with`` lifecycle around it."""

    def __init__(self, server: str, client_id: str, connection: ConnectionOptions) -> None:
        unknown = connection.keys() - ConnectionOptions.__optional_keys__
        if unknown:  # what an explicit keyword list would raise
            raise TypeError(
                f"{type(self).__name__}.__init__() got an unexpected keyword argument "
                f"{sorted(unknown)[0]!r}"
            )
        self._session = RivvenSession(server, client_id, connection)
        self._closed = False

    @property
    def reconnects(self) -> int:
        return self._session.reconnects

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def throttled(self) -> int:
        """Requests the server answered with a ThrottledResponse (its tenant past a
        quota), each sent again after the time it named."""
        return self._session.throttled

    async def _ensure(self) -> None:
        await self._session._ensure()

    async def start(self) -> Self:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
