"""One TCP connection of the asyncio client: bytes to and from the Kimberlite codec.

Requests are framed by :class:`~headwater.protocols.kimberlite.ClientConnection` and
written as soon as they are made, so any number can be in flight; each response is
matched to its request's future by request id. Subscription pushes (which reuse the
Subscribe's id) are routed to their subscription instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, cast

from headwater.errors import ProtocolError
from headwater.protocols.kimberlite.connection import ClientConnection
from headwater.protocols.kimberlite.messages import (
    ErrorResponse,
    RequestPayload,
    Response,
    ResponsePayload,
    SubscriptionClosedResponse,
    SubscriptionEventsResponse,
)


class PushTarget(Protocol):
    """What a subscription offers the connection for its pushes."""

    def _on_events(self, payload: SubscriptionEventsResponse) -> None: ...

    def _on_closed(self, payload: SubscriptionClosedResponse) -> None: ...


class NotSent(Exception):
    """The connection was already gone: the request never reached the socket."""


class Lost(Exception):
    """Set on the futures of requests in flight when the connection goes away."""


class Connection(asyncio.Protocol):
    def __init__(
        self,
        codec: ClientConnection,
        on_lost: Callable[[Connection, BaseException | None], None],
    ) -> None:
        self.codec = codec
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future[ResponsePayload]] = {}
        self.routes: dict[int, PushTarget] = {}
        self.closed = False
        self.close_reason: str | None = None
        self.last_id = 0
        self._lost = False
        self._writable = asyncio.Event()
        self._writable.set()

    # ---- transport callbacks ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        self.closed = True
        self._writable.set()
        self.on_lost(self, exc)

    def eof_received(self) -> bool | None:
        if self.close_reason is None:
            self.close_reason = "the server closed the connection"
        return False

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def data_received(self, data: bytes) -> None:
        try:
            responses = self.codec.receive_data(data)
        except ProtocolError as exc:
            self.close_reason = f"the server sent invalid bytes ({exc})"
            self.abort()
            return
        for response in responses:
            self._dispatch(response)

    def _dispatch(self, response: Response) -> None:
        payload = response.payload
        request_id = response.request_id
        if isinstance(payload, SubscriptionEventsResponse):
            target = self.routes.get(request_id)
            if target is not None:
                target._on_events(payload)
            return
        future = self.pending.pop(request_id, None)
        if future is not None:
            if not future.done():
                future.set_result(payload)
            return
        if isinstance(payload, SubscriptionClosedResponse):
            target = self.routes.pop(request_id, None)
            if target is not None:
                target._on_closed(payload)
            return
        if request_id == 0 and isinstance(payload, ErrorResponse):
            # A connection-level refusal; the server closes the connection next.
            self.close_reason = f"the server refused the connection: {payload.message}"
        # Anything else answers a request nobody waits for any more (it timed out).

    # ---- output -------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        transport = self.transport
        return not self.closed and transport is not None and not transport.is_closing()

    async def writable(self) -> None:
        """Wait until the transport takes more bytes; NotSent when the connection died."""
        if not self._writable.is_set():
            await self._writable.wait()
        if not self.usable:
            raise NotSent()

    def send(
        self, payload: RequestPayload, route: PushTarget | None = None
    ) -> tuple[int, asyncio.Future[ResponsePayload]]:
        """Frame and write one request; its future gets the response payload (or Lost)."""
        if not self.usable:
            raise NotSent()
        assert self.transport is not None
        request_id, data = self.codec.send_request(payload)
        self.last_id = request_id
        future: asyncio.Future[ResponsePayload] = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        if route is not None:
            self.routes[request_id] = route
        self.transport.write(data)
        return request_id, future

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
