"""One TCP connection of the asyncio client: a :class:`~headwater.client._core.link.Link` over
the Kimberlite codec.

Requests are framed by :class:`~headwater.protocols.kimberlite.ClientConnection`, which
numbers them; each response resolves its request's future by request id. Subscription
pushes (which reuse the Subscribe's id) go to their subscription instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from headwater.protocols.kimberlite.connection import ClientConnection
from headwater.protocols.kimberlite.messages import (
    ErrorResponse,
    RequestPayload,
    Response,
    ResponsePayload,
    SubscriptionClosedResponse,
    SubscriptionEventsResponse,
)

from ._core.link import Link, Lost, NotSent, Route

__all__ = ["Connection", "Lost", "NotSent"]


class Connection(Link[Response, ResponsePayload]):
    codec: ClientConnection

    def __init__(
        self,
        codec: ClientConnection,
        on_lost: Callable[[Connection, BaseException | None], None],
    ) -> None:
        super().__init__(codec, on_lost)
        self.last_id = 0

    def _dispatch(self, response: Response) -> None:
        payload = response.payload
        request_id = response.request_id
        if isinstance(payload, SubscriptionEventsResponse):
            self._deliver(request_id, payload, reply=False)
        elif isinstance(payload, SubscriptionClosedResponse):
            self._deliver(request_id, payload, final=True)
        elif self._deliver(request_id, payload, push=False):
            pass
        elif request_id == 0 and isinstance(payload, ErrorResponse):
            # A connection-level refusal; the server closes the connection next.
            self.close_reason = f"the server refused the connection: {payload.message}"
        # Anything else answers a request nobody waits for any more (it timed out).

    def send(
        self, payload: RequestPayload, route: Route | None = None
    ) -> tuple[int, asyncio.Future[ResponsePayload]]:
        """Frame and write one request; its future gets the response payload (or Lost)."""
        self._check()
        request_id, data = self.codec.send_request(payload)
        self.last_id = request_id
        return request_id, self._expect(request_id, data, route)
