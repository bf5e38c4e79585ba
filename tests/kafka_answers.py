"""Kafka answers built as the front end builds them (``server.kafka.build``), for tests
of their encoding."""

from __future__ import annotations

from typing import Any

from headwater.protocols.kafka import ApiKey
from headwater.protocols.kafka.apis import response_type
from headwater.server.kafka.build import build


def fetch_answer(*records: bytes | None, topic: str = "t", version: int = 12) -> Any:
    """A Fetch answer of one topic whose partition ``i`` holds ``records[i]``."""
    partitions = [{"partition_index": i, "records": value} for i, value in enumerate(records)]
    fields = {"responses": [{"topic": topic, "partitions": partitions}]}
    return build(response_type(ApiKey.FETCH, version), fields)
