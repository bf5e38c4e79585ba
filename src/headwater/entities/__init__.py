"""Live entity state over ConvergeDB (port 7402): declare kinds as dataclasses, write
them as a source, read, scan and subscribe (docs/entities.md).

>>> from dataclasses import dataclass
>>> from headwater import entities
>>> @dataclass
... class Sensor:
...     site: str
...     temp: float
...     ok: bool = True
>>> with entities.connect("127.0.0.1:7402", name="ingest") as src:   # doctest: +SKIP
...     sensors = src.create_kind(Sensor)
...     src.assert_(sensors, "s1", Sensor("lab", 21.5))
...     src.flush()                                   # durable and visible
...     print(src.get(sensors, "s1").value)
...     for change in src.subscribe(sensors):         # bootstrap, then live changes
...         print(change.change, change.key, change.value)
"""

from headwater.client.errors import (
    ClientClosed,
    ClientError,
    ConnectionLost,
    RequestTimeout,
    ServerUnavailable,
)
from headwater.protocols.convergedb.fields import FieldType

from .aio import (
    DEFAULT_SERVER,
    AsyncEntityClient,
    AsyncEntitySubscription,
    AsyncEpoch,
    ResubscribeMode,
    connect_async,
)
from .catalog import DEFAULT_HTTP, KindDescription, describe_kind_async, list_kinds_async
from .errors import (
    AuthFailed,
    BadFieldData,
    BadFrame,
    EntityError,
    EntityNotFound,
    KindNotFound,
    LimitExceeded,
    NoEpoch,
    NoFreeSource,
    ReadOnly,
    ReservedName,
    SchemaConflict,
    SchemaIncompatible,
    SourceConflict,
    SubscriptionOverflow,
)
from .schema import (
    F32,
    F64,
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    Entity,
    EntityEvent,
    Kind,
    Timestamp,
    dataclass_fields,
    entity_id,
    key_text,
)
from .sync import EntityClient, EntitySubscription, Epoch, connect, describe_kind, list_kinds

__all__ = [
    "DEFAULT_HTTP",
    "DEFAULT_SERVER",
    "F32",
    "F64",
    "I8",
    "I16",
    "I32",
    "I64",
    "U8",
    "U16",
    "U32",
    "U64",
    "AsyncEntityClient",
    "AsyncEntitySubscription",
    "AsyncEpoch",
    "AuthFailed",
    "BadFieldData",
    "BadFrame",
    "ClientClosed",
    "ClientError",
    "ConnectionLost",
    "Entity",
    "EntityClient",
    "EntityError",
    "EntityEvent",
    "EntityNotFound",
    "EntitySubscription",
    "Epoch",
    "FieldType",
    "Kind",
    "KindDescription",
    "KindNotFound",
    "LimitExceeded",
    "NoEpoch",
    "NoFreeSource",
    "ReadOnly",
    "RequestTimeout",
    "ReservedName",
    "ResubscribeMode",
    "SchemaConflict",
    "SchemaIncompatible",
    "ServerUnavailable",
    "SourceConflict",
    "SubscriptionOverflow",
    "Timestamp",
    "connect",
    "connect_async",
    "dataclass_fields",
    "describe_kind",
    "describe_kind_async",
    "entity_id",
    "key_text",
    "list_kinds",
    "list_kinds_async",
]
