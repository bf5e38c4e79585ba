"""Kafka's topic config names and the stream settings they are, read one way for every
front end that takes them: Kafka's CreateTopics and Rivven's CreateTopic (which uses
Kafka's names). Integers are Java longs, -1 is "no limit" for retention, and
``compact,delete`` is compaction with retention as set (headwater applies retention to
every policy)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from headwater.errors import InvalidRequest

# Kafka's topic configs and the stream settings they are (DescribeConfigs, CreateTopics).
TOPIC_CONFIGS: dict[str, str] = {
    "cleanup.policy": "cleanup_policy",
    "retention.ms": "retention_ms",
    "retention.bytes": "retention_bytes",
    "segment.bytes": "segment_bytes",
    "segment.ms": "segment_ms",
    "delete.retention.ms": "delete_retention_ms",
    "message.timestamp.type": "timestamp_type",
}
INT_SETTINGS = frozenset(
    ("retention_ms", "retention_bytes", "segment_bytes", "segment_ms", "delete_retention_ms")
)
_UNLIMITED = frozenset(("retention_ms", "retention_bytes"))  # -1: no limit, as in Kafka
_JAVA_LONG = range(-(2**63), 2**63)


def topic_settings(
    configs: Iterable[tuple[str, str | None]], known: Mapping[str, str] = TOPIC_CONFIGS
) -> dict[str, Any]:
    """The stream settings of ``configs`` (name, value; None: the default), by the names
    ``known`` maps; InvalidRequest for a name not there or a value not of its type."""
    settings: dict[str, Any] = {}
    for name, text in configs:
        setting = known.get(name)
        if setting is None:
            raise InvalidRequest(
                f"topic config {name!r} is not supported (one of {', '.join(known)})"
            )
        value: Any = text
        if text is not None and setting in INT_SETTINGS:
            try:
                value = int(text)
            except ValueError:
                raise InvalidRequest(f"{name} must be an integer") from None
            if value not in _JAVA_LONG:
                raise InvalidRequest(f"{name} {value} is not a 64-bit integer")
            if value == -1 and setting in _UNLIMITED:
                value = None
        if text is not None and setting == "cleanup_policy":
            # Kafka's "compact,delete" (Kafka Streams' windowed changelogs): compaction,
            # with retention as set.
            policies = {part.strip() for part in text.split(",")}
            value = "compact" if policies == {"compact", "delete"} else text
        settings[setting] = value
    return settings
