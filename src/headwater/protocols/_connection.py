"""What the sans-I/O server connections share: the events a connection decides on its
own, and the receive loop that turns bytes into events.

Every framed protocol (Kimberlite, ConvergeDB, Ripple) has the same shell around its own
rules: bytes are fed to an incremental decoder; each complete item becomes exactly one
event, in arrival order (the protocol's :meth:`ServerConnection._on_item` decides which);
a framing error ends the input with a :class:`Reject` (send the protocol's last word, then
close) or a :class:`Close` (close without a word), always the last event; after either,
or after the peer's end of input, later bytes are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from headwater.engine.kinds.reader import Buffer
from headwater.errors import ProtocolError
from headwater.protocols._stream import IncrementalDecoder

AnswerT = TypeVar("AnswerT")
ItemT = TypeVar("ItemT")
EventT = TypeVar("EventT")


@dataclass(frozen=True, slots=True)
class Reply(Generic[AnswerT]):
    """An answer the connection produced itself (``answer``, framed as ``data``): send
    ``data`` and carry on."""

    answer: AnswerT
    data: bytes


@dataclass(frozen=True, slots=True)
class Reject(Generic[AnswerT]):
    """The peer broke the protocol: send ``data`` (``answer`` framed, the protocol's last
    word), then close the connection."""

    answer: AnswerT
    data: bytes
    reason: str


@dataclass(frozen=True, slots=True)
class Close:
    """Close the connection now, sending nothing."""

    reason: str


class ServerConnection(Generic[ItemT, EventT]):
    """The receive side of a server connection: :meth:`feed` and :meth:`next_event`, or
    :meth:`receive_data` for every event the bytes complete; :meth:`receive_eof`.
    ``EventT`` is the protocol's union of events (its :class:`Close` included).

    A subclass passes its decoder and says what an item means (:meth:`_on_item`) and
    what a framing error means (:meth:`_on_broken`).
    """

    __slots__ = ("_closed", "_decoder")

    eof_reason: ClassVar[str] = "connection ended inside a frame ({} bytes)"
    """The Close reason when the input ends inside an item (``{}``: the bytes held)."""

    def __init__(self, decoder: IncrementalDecoder[ItemT, Any]) -> None:
        self._decoder = decoder
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once a Reject or Close event was returned; later input is ignored."""
        return self._closed

    @property
    def buffered_bytes(self) -> int:
        return self._decoder.buffered_bytes

    def feed(self, data: Buffer) -> None:
        if not self._closed:
            self._decoder.feed(data)

    def next_event(self) -> EventT | None:
        """The next event from the bytes fed so far, None when more are needed."""
        if self._closed:
            return None
        try:
            item = self._decoder.next_item()
        except ProtocolError as exc:
            self._closed = True
            return self._on_broken(exc)
        if item is None:
            return None
        return self._on_item(item)

    def receive_data(self, data: Buffer) -> list[EventT]:
        """Feed ``data``; every event it completes, in order. Never raises on bad input."""
        self.feed(data)
        events: list[EventT] = []
        while (event := self.next_event()) is not None:
            events.append(event)
        return events

    def discard(self) -> None:
        """The connection is gone: later input is ignored and the bytes held are freed
        at once (see :meth:`IncrementalDecoder.discard`)."""
        self._closed = True
        self._decoder.discard()

    def receive_eof(self) -> list[Close]:
        """The peer closed its side: a Close event when it stopped inside an item."""
        if self._closed:
            return []
        self._closed = True
        if self._decoder.at_boundary:
            return []
        return [Close(self.eof_reason.format(self.buffered_bytes))]

    # ---- what a subclass provides -------------------------------------------------------

    def _on_item(self, item: ItemT) -> EventT:
        """The event for one complete item (it may set ``_closed``: nothing follows)."""
        raise NotImplementedError

    def _on_broken(self, exc: ProtocolError) -> EventT:
        """The last event (a Reject or a Close), for the decoder's framing error."""
        raise NotImplementedError
