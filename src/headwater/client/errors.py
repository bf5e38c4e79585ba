"""Errors the SDK raises on its own (server errors are the other classes of
``headwater.errors``, under the same root :class:`~headwater.errors.HeadwaterError`).

* :class:`ServerUnavailable`: nothing answers at the address (refused, unreachable, the
  handshake timed out), or reconnecting failed after the configured attempts.
* :class:`ConnectionLost`: the connection broke while a request was in flight. For a
  request that changes data (append, create, delete) the server may or may not have
  applied it; ``maybe_applied`` says so and the SDK never resends it on its own.
* :class:`RequestTimeout`: no answer within the client's ``timeout``.
* :class:`EventTooLarge`: one event is bigger than an append may carry (4 MiB).
* :class:`SubscriptionClosed`: the server ended a subscription for a reason the SDK cannot
  recover from.

The classes live in :mod:`headwater.errors`; every SDK (streams, entities, Ripple)
raises the same ones.
"""

from __future__ import annotations

import json

from headwater.errors import (
    ClientClosed,
    ClientError,
    ConnectionLost,
    EventTooLarge,
    RequestTimeout,
    ServerUnavailable,
    SubscriptionClosed,
    error_for_code,
)


def http_api_error(status: int, body: bytes, url: str) -> Exception:
    """What a non-200 answer of the HTTP API raises: the ``headwater.errors`` class of its
    error body (``{"error": {"code", "message"}}``), or ServerUnavailable when the body is
    not JSON (something else answered)."""
    try:
        data = json.loads(body)
    except ValueError:
        return ServerUnavailable(f"{url} answered {status} without JSON")
    error = data.get("error", {}) if isinstance(data, dict) else {}
    return error_for_code(int(error.get("code", 0)), str(error.get("message", status)))


__all__ = [
    "ClientClosed",
    "ClientError",
    "ConnectionLost",
    "EventTooLarge",
    "RequestTimeout",
    "ServerUnavailable",
    "SubscriptionClosed",
    "http_api_error",
]
