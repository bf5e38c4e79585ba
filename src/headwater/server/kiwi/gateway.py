"""The Kiwi gateway of one server: its sessions, counter sources and the shared RESULT
frames of stream batches.

A sourceId names, in this order, a counter of the config file (every tenant sees them),
a stream of the session's tenant or an entity kind of that tenant (streams and kinds
share one namespace).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from headwater.engine.engine import Stream
from headwater.engine.kinds import KindsError
from headwater.errors import HeadwaterError
from headwater.protocols.kiwi.frames import text_frame
from headwater.protocols.kiwi.results import stream_results
from headwater.server.kiwi.counters import Counter
from headwater.server.kiwi.kinds import attach_kind
from headwater.server.kiwi.session import Detach, KiwiSession, SourceUnavailable
from headwater.server.kiwi.streams import attach_stream
from headwater.server.metrics import Metrics
from headwater.storage.log import ReadResult

if TYPE_CHECKING:
    from headwater.server.app import Server

log = logging.getLogger("headwater.kiwi")

PROTOCOL = "kiwi"
# Frames of recent stream batches, shared by every subscriber of the stream: subscribers
# that keep up read the same batches within moments of each other.
FRAME_CACHE_BYTES = 64 << 20

BatchKey = tuple[int, int, int, bytes]


class Gateway:
    def __init__(self, server: Server, metrics: Metrics) -> None:
        self.server = server
        self.config = server.config.kiwi
        self.metrics = metrics
        self.sessions: set[KiwiSession] = set()
        self.subscriptions = 0
        self.counters = {spec.source_id: Counter(spec) for spec in self.config.counters}
        self._frames: OrderedDict[BatchKey, list[bytes]] = OrderedDict()
        self._frames_bytes = 0
        self._frame_sizes: dict[BatchKey, int] = {}
        metrics.add_connections_source(PROTOCOL, lambda: len(self.sessions))
        metrics.add_subscriptions_source(PROTOCOL, lambda: self.subscriptions)

    def start(self) -> None:
        """Start the counters that are not lazy (server start)."""
        for counter in self.counters.values():
            if not counter.spec.lazy:
                counter.start()

    async def shutdown(self) -> None:
        """SUBSCRIPTION_CLOSED to everyone, close every WebSocket (1001), stop counters."""
        for counter in self.counters.values():
            counter.stop()
        for session in list(self.sessions):
            await session.shutdown()

    # ---- sources ----------------------------------------------------------------------

    def attach(self, session: KiwiSession, source_id: str) -> Detach:
        """Subscribe ``session`` to a source; SourceUnavailable says why it cannot."""
        counter = self.counters.get(source_id)
        if counter is not None:
            return counter.attach(session)
        engine = self.server.engine
        if engine is None:
            raise SourceUnavailable("the server is not running")
        tenant = engine.tenant(session.tenant_id)
        stream_id = tenant.by_name.get(source_id)
        if stream_id is not None:
            try:
                stream = engine.stream(session.tenant_id, stream_id)
            except HeadwaterError as exc:
                raise SourceUnavailable(exc.message) from None
            return attach_stream(self, session, stream)
        try:
            tenant_kinds = self.server.kinds.tenant(session.tenant_id)
            kind = tenant_kinds.get_kind(source_id)
        except (KindsError, HeadwaterError):
            raise SourceUnavailable(f"no source {source_id!r}") from None
        return attach_kind(session, tenant_kinds, kind, source_id)

    def stream_frames(self, stream: Stream, result: ReadResult) -> list[bytes]:
        """The framed RESULTs of a read, encoded once per stored batch for everyone."""
        out: list[bytes] = []
        cache = self._frames
        for span in result.spans:
            batch = span.batch
            base, crc = batch.identity
            key = (stream.tenant.tenant_id, stream.stream_id, base, crc)
            frames = cache.get(key)
            if frames is None:
                frames = [text_frame(p) for p in stream_results(stream.name, batch.events())]
                self._remember(key, frames)
            else:
                cache.move_to_end(key)
            if span.start == 0 and span.stop == len(frames):
                out.extend(frames)
            else:
                out.extend(frames[span.start : span.stop])
        return out

    def _remember(self, key: BatchKey, frames: list[bytes]) -> None:
        size = sum(map(len, frames))
        self._frames[key] = frames
        self._frame_sizes[key] = size
        self._frames_bytes += size
        while self._frames_bytes > FRAME_CACHE_BYTES and len(self._frames) > 1:
            old, _ = self._frames.popitem(last=False)
            self._frames_bytes -= self._frame_sizes.pop(old)
