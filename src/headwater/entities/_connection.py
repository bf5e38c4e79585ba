"""One TCP connection of the entities client: a :class:`~headwater.client._core.link.Link` over
the ConvergeDB codec.

Requests are framed by :class:`~headwater.protocols.convergedb.ClientConnection`, which
allocates their stream ids and checks every reply against what was sent. A reply
resolves its request's future; notifications (STATE, DELETED, BOOTSTRAP_*, EVENT and a
subscription's ERROR) go to the subscription routed on their stream; an ERROR on stream
0 (a fire-and-forget request failed) goes to ``on_error``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from headwater.client._core.link import Link, Lost, NotSent, Route
from headwater.errors import UsageError
from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.connection import ClientConnection

__all__ = ["CdbConnection", "Lost", "NotSent", "is_reply"]


def is_reply(message: m.Message) -> bool:
    """ACKs, ERRORs and a QUERY's STATE answer a request; the rest are notifications."""
    if isinstance(message, m.State):
        return message.change == m.Change.QUERY
    return isinstance(message, m.Ack | m.ConnectAck | m.KindAck | m.EpochEndAck | m.ErrorMessage)


class CdbConnection(Link[m.Frame, m.Message]):
    codec: ClientConnection

    def __init__(
        self,
        on_lost: Callable[[CdbConnection, BaseException | None], None],
        on_error: Callable[[m.ErrorMessage], None],
    ) -> None:
        super().__init__(ClientConnection(), on_lost)
        self.on_error = on_error
        self.source_id: int | None = None

    def _dispatch(self, frame: m.Frame) -> None:
        message, stream_id = frame.message, frame.stream_id
        if stream_id == 0:
            if isinstance(message, m.ErrorMessage):
                self.on_error(message)
            return
        # A subscription's ERROR ends it (the server ended the subscription).
        final = isinstance(message, m.ErrorMessage)
        self._deliver(stream_id, message, reply=is_reply(message), final=final)

    def send(self, message: m.ClientMessage) -> None:
        """Frame and write a fire-and-forget request (on stream 0: no reply)."""
        self._check()
        stream_id, data = self.codec.send(message)
        if stream_id:
            raise UsageError(f"{message.opcode.name} gets a reply: send it with request()")
        self._post(data)

    def request(
        self, message: m.ClientMessage, *, ack: bool = False, route: Route | None = None
    ) -> tuple[int, asyncio.Future[m.Message]]:
        """Frame and write a request that gets a reply (with ``ack``, or by its kind)."""
        self._check()
        stream_id, data = self.codec.send(message, ack=ack)
        if not stream_id:
            raise UsageError(f"{message.opcode.name} gets no reply unless ack=True")
        return stream_id, self._expect(stream_id, data, route)
