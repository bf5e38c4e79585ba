"""One Kiwi WebSocket connection: the sans-I/O :class:`KiwiConnection` plus its socket.

Sources call :meth:`KiwiSession.deliver` and :meth:`KiwiSession.source_closed` from the
event loop; both return at once. What a source delivers is in the session's format: text
frames, or, on a connection that opted into headwater's packing extension
(``/ws?pack=1``, :attr:`KiwiSession.packed`), the bare JSON messages, which the session
frames when it writes: the messages taken together go out as JSON arrays of them, up to
``PACK_MAX_BYTES`` a frame (docs/protocols/kiwi.md). What the core queues is written straight to the
transport while it takes more; once the transport pauses (the peer is not reading), the
core's bounded outbox fills and then sheds push events (LAG), and a single drain task
resumes writing when the transport has room again. A slow peer therefore costs the
engine and the other connections nothing but the bounded memory of its own queues.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from aiohttp import WSMsgType, web

from headwater.protocols.kiwi import messages as m
from headwater.protocols.kiwi.connection import KiwiConnection
from headwater.protocols.kiwi.frames import PACK_MAX_BYTES, packed_frames, text_frame

if TYPE_CHECKING:
    from headwater.server.kiwi.gateway import Gateway

log = logging.getLogger("headwater.kiwi")

PROTOCOL = "kiwi"  # the listener name of its limits in /metrics
_ENDED = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED)  # as ``async for`` stops

Detach = Callable[[], None]
CLOSE_TIMEOUT_SECONDS = 2.0
SHUTDOWN_MESSAGE = "the server is shutting down"


class KiwiSession:
    def __init__(
        self, gateway: Gateway, request: web.Request, ws: web.WebSocketResponse, tenant_id: int
    ) -> None:
        config = gateway.config
        self.gateway = gateway
        self.request = request
        self.ws = ws
        self.tenant_id = tenant_id
        self.packed = packing_requested(request)
        self.core = KiwiConnection(
            buffer_capacity=config.buffer_capacity,
            lag_notice_threshold=config.lag_notice_threshold,
            send_capacity=config.send_queue,
            frame=_bare if self.packed else text_frame,
        )
        self.detach: dict[str, Detach] = {}
        self.closed = False
        self._drain_task: asyncio.Task[None] | None = None
        # Kept: aiohttp's request looks them up through its protocol on every access,
        # and a fan-out writes to each session on every commit.
        self._transport = request.transport
        self._protocol = request.protocol
        self._room = asyncio.Event()
        self._room.set()

    # ---- commands -----------------------------------------------------------------------

    async def run(self) -> None:
        """Read commands until the peer closes, breaks the protocol or the server stops,
        or, holding no subscription, sends nothing (not even a ping) for
        ``[limits] idle_timeout_s``."""
        idle_timeout = self.gateway.server.config.limits.idle_timeout_s
        while True:
            try:
                msg = await self.ws.receive(timeout=idle_timeout)
            except TimeoutError:
                if self.detach:
                    continue  # a quiet subscriber is what subscribing is for
                self.gateway.server.limits.refused("idle_timeout_s", PROTOCOL)
                reason = f"nothing received for {idle_timeout:g} s and no subscription"
                log.info("closing %s: %s (limits.idle_timeout_s)", self.request.remote, reason)
                await self.close(m.CLOSE_GOING_AWAY, f"{reason} (limits.idle_timeout_s)")
                return
            if msg.type in _ENDED:
                return
            if msg.type is WSMsgType.TEXT or msg.type is WSMsgType.BINARY:
                try:
                    command = m.parse_command(msg.data)
                except m.KiwiProtocolError as exc:
                    await self.close(exc.close_code, exc.reason)
                    return
                self.handle(command)
                self.flush()
                # Replies count against the send queue too: a peer that sends commands
                # without reading the answers waits here instead of growing the queue.
                if not self._room.is_set():
                    await self._room.wait()
            elif msg.type is WSMsgType.ERROR:
                log.info("websocket error: %s", msg.data)
                return

    def handle(self, command: m.Command) -> None:
        core = self.core
        source_id = command.source_id
        if isinstance(command, m.Subscribe):
            if core.subscribed(source_id):
                core.reject_subscribe(source_id, "already subscribed to this source")
                return
            limit = self.gateway.server.config.limits.max_subscriptions_per_connection
            if len(self.detach) >= limit:
                self.gateway.server.limits.refused("max_subscriptions_per_connection", PROTOCOL)
                core.reject_subscribe(
                    source_id,
                    f"this connection has {limit} subscriptions, the most"
                    " limits.max_subscriptions_per_connection allows: unsubscribe one first",
                )
                return
            try:
                detach = self.gateway.attach(self, source_id)
            except SourceUnavailable as exc:
                core.reject_subscribe(source_id, str(exc))
                return
            self.detach[source_id] = detach
            core.subscribe(source_id, command.mode)
            self.gateway.subscriptions += 1
        elif isinstance(command, m.Unsubscribe):
            if core.unsubscribe(source_id):
                self._detach(source_id)
        else:
            core.request(source_id, command.n)

    def _detach(self, source_id: str) -> None:
        detach = self.detach.pop(source_id, None)
        if detach is not None:
            self.gateway.subscriptions -= 1
            try:
                detach()
            except Exception:
                log.exception("detaching %s failed", source_id)

    # ---- sources ------------------------------------------------------------------------

    def deliver(self, source_id: str, results: Sequence[bytes]) -> None:
        """A source's new events: RESULT messages as text frames, or bare when
        :attr:`packed`."""
        core = self.core
        transport = self._transport
        if (
            not self.packed
            and self._drain_task is None
            and not self.closed
            and transport is not None
            and not transport.is_closing()
            and core.push_now(source_id, len(results))
        ):
            # A push subscriber keeping up: written as they are, nothing queued.
            transport.writelines(results)
            if self._protocol.writing_paused:
                self._drain_task = asyncio.get_running_loop().create_task(self._drain())
            return
        lost = core.lost_events
        # A read can hold more events than the outbox: hand them over an outbox at a time
        # while the transport takes them, so only a peer that is not reading sheds.
        step = core.send_capacity
        start = 0
        while len(results) - start > step and self._writable():
            core.deliver(source_id, results[start : start + step])
            self.flush()
            start += step
        core.deliver(source_id, results[start:] if start else results)
        if core.lost_events != lost:
            self.gateway.metrics.record_ws_lag("kiwi", core.lost_events - lost)
        self.flush()

    def source_closed(self, source_id: str, message: str) -> None:
        """The source ended for this subscriber: SUBSCRIPTION_CLOSED."""
        if source_id not in self.detach:
            return
        self.detach.pop(source_id)
        self.gateway.subscriptions -= 1
        self.core.close_subscription(source_id, message)
        self.flush()

    # ---- the socket ---------------------------------------------------------------------

    def _writable(self) -> bool:
        if self.closed or self._drain_task is not None:
            return False
        transport = self._transport
        return transport is not None and not transport.is_closing()

    def flush(self) -> None:
        """Write what the core has queued, unless the transport is paused."""
        if not self._writable():
            transport = self._transport
            if self.closed or transport is None or transport.is_closing():
                self._room.set()  # nothing will drain: the reader goes on to the close
            elif self._drain_task is not None:
                # Replies to commands read meanwhile wait in the outbox: a full one
                # stops the reading of commands (run()) until the drain empties it.
                self._update_room()
            return
        transport = self._transport
        assert transport is not None
        # Taken until nothing comes or the socket is full: a pull subscription's buffer
        # refills the outbox one send_queue at a time, and what it still holds for a
        # REQUEST would otherwise wait for the next command or event.
        while frames := self.core.take_outgoing():
            transport.writelines(packed_frames(frames, PACK_MAX_BYTES) if self.packed else frames)
            if self._protocol.writing_paused:
                break
        if self._protocol.writing_paused:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        self._update_room()

    async def _drain(self) -> None:
        try:
            # Shielded: aiohttp's writers share one drain waiter, and cancelling this
            # task (release) would cancel it under the close frame's drain too.
            await asyncio.shield(self.request.writer.drain())
        except (ConnectionError, asyncio.CancelledError):
            self._room.set()  # the command reader goes on, and finds the connection gone
            return
        finally:
            self._drain_task = None
        self.flush()

    def _update_room(self) -> None:
        if self.core.full:
            self._room.clear()
        else:
            self._room.set()

    async def close(self, code: int, reason: str) -> None:
        """Flush what is queued, then close the WebSocket with ``code``."""
        self.flush()
        self.release()
        try:
            await asyncio.wait_for(
                self.ws.close(code=code, message=reason.encode()[:120]), CLOSE_TIMEOUT_SECONDS
            )
        except (TimeoutError, ConnectionError):
            pass  # a peer not reading, or gone: the connection ends anyway
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            # aiohttp's shared drain waiter was cancelled under the close frame (an
            # earlier close's timeout): the peer was not reading; the connection ends.

    async def shutdown(self) -> None:
        """Server shutdown: SUBSCRIPTION_CLOSED for every subscription, then close 1001."""
        for source_id in self.core.close_all(SHUTDOWN_MESSAGE):
            self._detach(source_id)
        await self.close(m.CLOSE_GOING_AWAY, SHUTDOWN_MESSAGE)

    def release(self) -> None:
        """Detach every source (the connection is ending); idempotent."""
        for source_id in list(self.detach):
            self._detach(source_id)
        self.closed = True
        self._room.set()
        if self._drain_task is not None:
            self._drain_task.cancel()
            self._drain_task = None


def packing_requested(request: web.Request) -> bool:
    """Did the client ask for packed frames (``?pack=1`` or ``?pack=true``)?"""
    return request.query.get("pack", "").lower() in ("1", "true")


def _bare(message: bytes) -> bytes:
    return message


class SourceUnavailable(Exception):
    """SUBSCRIBE_ERROR: the source does not exist, has ended or cannot be subscribed."""
