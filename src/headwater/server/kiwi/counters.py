"""Counter sources (``[[kiwi.sources]]`` with ``type = "counter"``): min, min+1, ...
every interval_ms, up to max inclusive when set, then SUBSCRIPTION_CLOSED and the
source has ended. Ticks are scheduled against absolute deadlines, so a busy loop delays
a count but never drifts the rate; each count is encoded once for every subscriber."""

from __future__ import annotations

import asyncio
import logging

from headwater.protocols.kiwi.frames import text_frame
from headwater.protocols.kiwi.messages import counter_result
from headwater.server.config import CounterSource
from headwater.server.kiwi.session import Detach, KiwiSession, SourceUnavailable

log = logging.getLogger("headwater.kiwi")

ENDED_MESSAGE = "the counter reached its max and ended"


class Counter:
    def __init__(self, spec: CounterSource) -> None:
        self.spec = spec
        self.subscribers: dict[KiwiSession, None] = {}  # insertion-ordered set
        self.ended = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None and not self.ended:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def attach(self, session: KiwiSession) -> Detach:
        if self.ended:
            raise SourceUnavailable(ENDED_MESSAGE)
        self.subscribers[session] = None
        self.start()  # a lazy counter starts at its first subscription

        def detach() -> None:
            self.subscribers.pop(session, None)

        return detach

    async def _run(self) -> None:
        spec = self.spec
        loop = asyncio.get_running_loop()
        interval = spec.interval_ms / 1000
        started = loop.time()
        count = spec.min
        tick = 1
        while True:
            delay = started + tick * interval - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            message = counter_result(spec.source_id, count)
            frames, bare = [text_frame(message)], [message]
            for session in list(self.subscribers):
                session.deliver(spec.source_id, bare if session.packed else frames)
            if spec.max is not None and count >= spec.max:
                break
            count += 1
            tick += 1
        self.ended = True
        subscribers, self.subscribers = list(self.subscribers), {}
        for session in subscribers:
            session.source_closed(spec.source_id, ENDED_MESSAGE)
