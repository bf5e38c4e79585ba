"""The headwater Python SDK: a blocking :class:`Client` and an asyncio :class:`AsyncClient`
over the Kimberlite protocol, and the partitioned log's :class:`Producer` /
:class:`AsyncProducer` and group :class:`Consumer` / :class:`AsyncConsumer` over Rivven.

>>> import headwater
>>> with headwater.connect("127.0.0.1:7401") as hw:                  # doctest: +SKIP
...     hw.create_stream("trades")
...     hw.append("trades", [b'{"sym":"A","px":10}'])
...     for event in hw.subscribe("trades", credits=100):
...         print(event.offset, event.value)
"""

from typing import TYPE_CHECKING

from headwater._lazy import lazy_getattr
from headwater.errors import HeadwaterError
from headwater.protocols.kimberlite.messages import DataClass, Placement, StreamInfo, Timestamp

from .aio import (
    DEFAULT_SERVER,
    AsyncClient,
    AsyncSubscription,
    connect_async,
    parse_server,
    split_events,
)
from .errors import (
    ClientClosed,
    ClientError,
    ConnectionLost,
    EventTooLarge,
    RequestTimeout,
    ServerUnavailable,
    SubscriptionClosed,
)
from .results import AppendResult, Event, QueryResult, ReadResult
from .sync import Client, Subscription, connect

if TYPE_CHECKING:
    from .consumer import AsyncConsumer, Consumer, ConsumerRecord, TopicPartition
    from .producer import AsyncProducer, Producer, RecordFuture, RecordMetadata

# The producer and consumer (numpy, the engine's partitioner and group errors) are
# imported on first use, so a Kimberlite-only client does not pay for them.
_LAZY = {
    "AsyncProducer": "producer",
    "Producer": "producer",
    "RecordFuture": "producer",
    "RecordMetadata": "producer",
    "AsyncConsumer": "consumer",
    "Consumer": "consumer",
    "ConsumerRecord": "consumer",
    "TopicPartition": "consumer",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "DEFAULT_SERVER",
    "AppendResult",
    "AsyncClient",
    "AsyncConsumer",
    "AsyncProducer",
    "AsyncSubscription",
    "Client",
    "ClientClosed",
    "ClientError",
    "ConnectionLost",
    "Consumer",
    "ConsumerRecord",
    "DataClass",
    "Event",
    "EventTooLarge",
    "HeadwaterError",
    "Placement",
    "Producer",
    "QueryResult",
    "ReadResult",
    "RecordFuture",
    "RecordMetadata",
    "RequestTimeout",
    "ServerUnavailable",
    "StreamInfo",
    "Subscription",
    "SubscriptionClosed",
    "Timestamp",
    "TopicPartition",
    "connect",
    "connect_async",
    "parse_server",
    "split_events",
]
