"""RESULT messages of streams and entity kinds.

A stream's RESULTs are built once per stored batch and shared by every subscriber of the
stream, so they are assembled from string pieces rather than through a dict and
``json.dumps`` per event: the JSON-quoted source id is computed once per batch and each
event costs one base64 encode, one UTF-8 decode and one JSON string quote (all in C).
:func:`batch_results` builds them straight from a stored batch (its values section,
record bounds and offsets) into one bytes template per batch, without decoding each event
into an :class:`~headwater.storage.batch.Event` first (about half the cost per event).
Arrow has no base64 kernel and JSON events need their quotes escaped one by one, so the
three C calls per event remain.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable, Mapping
from itertools import islice
from json.encoder import encode_basestring
from typing import Any

from headwater.protocols.kiwi.messages import dumps, result
from headwater.storage.batch import ATTR_KEYS, Batch, Event


def _text_or_null(data: bytes | None) -> str:
    """``data`` as a JSON string when it is UTF-8 text, else ``null``."""
    if data is None:
        return "null"
    try:
        return str(encode_basestring(data.decode()))
    except UnicodeDecodeError:
        return "null"


def stream_results(source_id: str, events: Iterable[Event], partition: int = 0) -> list[bytes]:
    """One RESULT payload per event of stream partition ``partition``: ``{sourceId,
    sourceType "kafka", payload (base64), partition, offset, key, value, timestamp}``."""
    head = '{"type":"RESULT","data":{"sourceId":' + dumps(source_id) + ',"sourceType":"kafka"'
    out: list[bytes] = []
    append = out.append
    b64 = base64.b64encode
    for event in events:
        value = event.value
        append(
            (
                f'{head},"payload":"{b64(value).decode("ascii")}","partition":{partition},'
                f'"offset":{event.offset},"key":{_text_or_null(event.key)},'
                f'"value":{_text_or_null(value)},"timestamp":{event.timestamp_ms}}}}}'
            ).encode()
        )
    return out


def batch_results(
    source_id: str, batch: Batch, start: int, stop: int, partition: int = 0
) -> list[bytes]:
    """The RESULT payloads of events [start, stop) of a stored batch of stream partition
    ``partition``: the same bytes as :func:`stream_results` over its decoded events."""
    if batch.attributes & ATTR_KEYS:  # keyed events: decode them
        return stream_results(source_id, islice(batch.events(start), stop - start), partition)
    head = '{"type":"RESULT","data":{"sourceId":' + dumps(source_id) + ',"sourceType":"kafka"'
    template = (
        head.replace("%", "%%")
        + ',"payload":"%s","partition":'
        + str(partition)
        + ',"offset":%d,"key":null,"value":%s,"timestamp":'
        + str(batch.first_timestamp_ms)
        + "}}"
    ).encode()
    section = batch.values_section()
    bounds = batch.value_bounds()
    offsets = batch.offsets()
    b64 = base64.b64encode
    out: list[bytes] = []
    append = out.append
    for i in range(start, stop):
        value = bytes(section[bounds[i] + 8 : bounds[i + 1]])
        try:
            text = encode_basestring(value.decode()).encode()
        except UnicodeDecodeError:
            text = b"null"
        append(template % (b64(value), offsets[i], text))
    return out


def field_json(value: object) -> Any:
    """A field value as JSON can carry it: bytes as base64, non-finite floats as null."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def entity_result(
    source_id: str, entity_id: bytes, change: str, version: int, fields: Mapping[str, object]
) -> bytes:
    """``{sourceId, sourceType "entity", entityId (hex), change, version, fields}``."""
    return result(
        {
            "sourceId": source_id,
            "sourceType": "entity",
            "entityId": entity_id.hex(),
            "change": change,
            "version": version,
            "fields": {name: field_json(v) for name, v in fields.items()},
        }
    )
