"""The Kafka wire protocol, sans-I/O (docs/kafka.md).

- :mod:`.apis`: the implemented APIs and versions (exactly what ApiVersions announces);
- :mod:`.schema`: kio's message classes (generated from Kafka's message definitions),
  read by a bounded decoder of our own and written by kio;
- :mod:`.frames`: size-prefixed framing with request header v1/v2, response v0/v1;
- :mod:`.connection`: the server connection (requests out, answers in request order);
- :mod:`.records`: record batch v2, CRC-32C, the four codecs, transaction markers.

Error codes are kio's :class:`ErrorCode`: every code Kafka defines, with its retriable
flag.
"""

from kio.schema.errors import ErrorCode

from .apis import SUPPORTED, ApiKey, VersionRange, api_versions_response
from .connection import Close, Reply, Request, ServerConnection, ServerEvent
from .frames import MAX_REQUEST, FrameError, decode_response, encode_request, encode_response
from .records import (
    Compression,
    RecordBatch,
    RecordBatchError,
    RecordColumns,
    checked_together,
    split_batches,
)
from .schema import SchemaDecodeError

__all__ = [
    "MAX_REQUEST",
    "SUPPORTED",
    "ApiKey",
    "Close",
    "Compression",
    "ErrorCode",
    "FrameError",
    "RecordBatch",
    "RecordBatchError",
    "RecordColumns",
    "Reply",
    "Request",
    "SchemaDecodeError",
    "ServerConnection",
    "ServerEvent",
    "VersionRange",
    "api_versions_response",
    "checked_together",
    "decode_response",
    "encode_request",
    "encode_response",
    "split_batches",
]
