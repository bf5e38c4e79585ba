"""The headwater Python SDK: a blocking :class:`Client` and an asyncio :class:`AsyncClient`
over the Kimberlite protocol.

>>> import headwater
>>> with headwater.connect("127.0.0.1:7401") as hw:                  # doctest: +SKIP
...     hw.create_stream("trades")
...     hw.append("trades", [b'{"sym":"A","px":10}'])
...     for event in hw.subscribe("trades", credits=100):
...         print(event.offset, event.value)
"""

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

__all__ = [
    "DEFAULT_SERVER",
    "AppendResult",
    "AsyncClient",
    "AsyncSubscription",
    "Client",
    "ClientClosed",
    "ClientError",
    "ConnectionLost",
    "DataClass",
    "Event",
    "EventTooLarge",
    "HeadwaterError",
    "Placement",
    "QueryResult",
    "ReadResult",
    "RequestTimeout",
    "ServerUnavailable",
    "StreamInfo",
    "Subscription",
    "SubscriptionClosed",
    "Timestamp",
    "connect",
    "connect_async",
    "parse_server",
    "split_events",
]
