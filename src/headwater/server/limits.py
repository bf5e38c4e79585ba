"""What every listener shares to keep clients within ``[limits]``.

One :class:`ConnectionLimits` per server counts the open client connections of all
listeners together (``max_connections``) and every refusal by any limit, so one place
answers "how many are open, how many were turned away and why" (``/metrics``:
``headwater_limit_refusals_total{limit, listener}``).
"""

from __future__ import annotations

from headwater.server.answers import AnswerBudget
from headwater.server.config import LimitsConfig
from headwater.server.metrics import Metrics


class ConnectionLimits:
    """The open-connection count across listeners, refusals by limit, and the bytes
    of read answers held for peers (``read_answers_mib``)."""

    def __init__(self, config: LimitsConfig, metrics: Metrics) -> None:
        self.config = config
        self._metrics = metrics
        self.open = 0
        self.answers = AnswerBudget(config.read_answers_mib << 20)

    def admit(self, listener: str) -> bool:
        """Count a new connection on ``listener``; False (counted as a refusal) when
        ``max_connections`` are open already: the caller refuses it."""
        if self.open >= self.config.max_connections:
            self.refused("max_connections", listener)
            return False
        self.open += 1
        return True

    def release(self) -> None:
        """An admitted connection ended."""
        self.open -= 1

    def refused(self, limit: str, listener: str) -> None:
        """A client refused or closed by ``limit`` (a :class:`LimitsConfig` key)."""
        self._metrics.record_limit(limit, listener)
