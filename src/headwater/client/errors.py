"""Errors the SDK raises on its own (server errors are the other classes of
``headwater.errors``, under the same root :class:`~headwater.errors.HeadwaterError`).
Every SDK (streams, entities, the Ripple worker) raises these.

* :class:`ServerUnavailable`: nothing answers at the address (refused, unreachable, the
  handshake timed out), or reconnecting failed after the configured attempts.
* :class:`ConnectionLost`: the connection broke while a request was in flight. For a
  request that changes data (append, create, delete) the server may or may not have
  applied it; ``maybe_applied`` says so and the SDK never resends it on its own.
* :class:`RequestTimeout`: no answer within the client's ``timeout``.
* :class:`EventTooLarge`: one event is bigger than an append may carry (4 MiB).
* :class:`SubscriptionClosed`: the server ended a subscription for a reason the SDK cannot
  recover from.
"""

from __future__ import annotations

import json

from headwater.errors import ErrorName, HeadwaterError, NotLeader


class ClientError(HeadwaterError):
    """Root of the errors the SDK raises itself (not sent by the server)."""

    name = ErrorName.CLIENT_ERROR


class ServerUnavailable(ClientError, ConnectionError):
    """No headwater server could be reached at the address."""

    name = ErrorName.SERVER_UNAVAILABLE


class ConnectionLost(ClientError, ConnectionError):
    """The connection broke before the request was answered.

    ``maybe_applied`` is True when the request changes data and had already been written
    to the socket: the server may have applied it, so it is not resent automatically.
    """

    name = ErrorName.CONNECTION_LOST

    def __init__(self, message: str, *, maybe_applied: bool = False) -> None:
        super().__init__(message)
        self.maybe_applied = maybe_applied


class RequestTimeout(ClientError, TimeoutError):
    """The server did not answer within the client's timeout."""

    name = ErrorName.REQUEST_TIMEOUT


class EventTooLarge(ClientError, ValueError):
    """An event exceeds what one append may carry; nothing was sent."""

    name = ErrorName.EVENT_TOO_LARGE


class SubscriptionClosed(ClientError):
    """The server ended the subscription (``reason`` is the wire's CloseReason)."""

    name = ErrorName.SUBSCRIPTION_CLOSED

    def __init__(self, message: str, reason: int) -> None:
        super().__init__(message)
        self.reason = reason


class ClientClosed(ClientError):
    """The client was closed; open a new one with ``headwater.connect``."""

    name = ErrorName.CLIENT_CLOSED


def http_api_error(status: int, body: bytes, url: str) -> Exception:
    """What a non-200 answer of the HTTP API raises: the ``headwater.errors`` class of its
    error body (``{"error": {"code", "name", "message"}}``: the name picks KindNotFound or
    EntityNotFound within code 6), or ServerUnavailable when the body is
    not JSON (something else answered). A NotLeader carries the body's ``leader``."""
    from headwater.errors import error_for_code

    try:
        data = json.loads(body)
    except ValueError:
        return ServerUnavailable(f"{url} answered {status} without JSON")
    error = data.get("error", {}) if isinstance(data, dict) else {}
    name = error.get("name")
    exc = error_for_code(
        int(error.get("code", 0)),
        str(error.get("message", status)),
        name if isinstance(name, str) else None,
    )
    leader = error.get("leader")
    if isinstance(exc, NotLeader) and isinstance(leader, dict):
        exc.leader = leader  # a cluster's 421: where to send the request (its "http")
    return exc
