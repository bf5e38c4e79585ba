"""The Kiwi gateway of one server: its sessions, counter sources and stream feeds (one
per stream partition with subscribers, shared by all of them: server/kiwi/streams.py).

A sourceId names, in this order, a counter of the config file (every tenant sees them),
a stream of the session's tenant or an entity kind of that tenant (streams and kinds
share one namespace).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from headwater.engine.kinds import KindsError
from headwater.errors import HeadwaterError, StreamNotFound
from headwater.server.kiwi.counters import Counter
from headwater.server.kiwi.kinds import attach_kind
from headwater.server.kiwi.session import PROTOCOL, Detach, KiwiSession, SourceUnavailable
from headwater.server.kiwi.streams import FeedKey, StreamFeed, attach_stream
from headwater.server.metrics import Metrics

if TYPE_CHECKING:
    from headwater.server.app import Server

log = logging.getLogger("headwater.kiwi")


class Gateway:
    def __init__(self, server: Server, metrics: Metrics) -> None:
        self.server = server
        self.config = server.config.kiwi
        self.metrics = metrics
        self.sessions: set[KiwiSession] = set()
        self.subscriptions = 0
        self.counters = {spec.source_id: Counter(spec) for spec in self.config.counters}
        self.feeds: dict[FeedKey, StreamFeed] = {}
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
        # Together: each may wait its close timeout for a client that does not read.
        await asyncio.gather(*(session.shutdown() for session in list(self.sessions)))

    # ---- sources ----------------------------------------------------------------------

    def attach(self, session: KiwiSession, source_id: str) -> Detach:
        """Subscribe ``session`` to a source; SourceUnavailable says why it cannot."""
        counter = self.counters.get(source_id)
        if counter is not None:
            return counter.attach(session)
        if not self.server.started:
            raise SourceUnavailable("the server is not running")
        api = self.server.api
        try:
            stream = api.stream_named(session.tenant_id, source_id)
        except StreamNotFound:
            pass  # perhaps a kind
        except HeadwaterError as exc:
            raise SourceUnavailable(exc.message) from None
        else:
            try:
                return attach_stream(self, session, stream)
            except HeadwaterError as exc:
                raise SourceUnavailable(exc.message) from None
        try:
            tenant_kinds = api.kinds(session.tenant_id)
            kind = tenant_kinds.get_kind(source_id)
        except (KindsError, HeadwaterError):
            raise SourceUnavailable(f"no source {source_id!r}") from None
        return attach_kind(session, tenant_kinds, kind, source_id)
