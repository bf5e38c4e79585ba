"""JSON shapes of events and append bodies (docs/http-api.md)."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from headwater.api import MAX_APPEND_BYTES, MAX_APPEND_EVENTS
from headwater.errors import InvalidRequest
from headwater.storage.batch import Event

NDJSON_TYPES = frozenset({"application/x-ndjson", "application/ndjson", "application/jsonl"})


def event_json(event: Event) -> dict[str, Any]:
    """An event: ``value`` is its text when the bytes are UTF-8 (else null);
    ``value_b64`` always carries the exact bytes."""
    try:
        text: str | None = event.value.decode()
    except UnicodeDecodeError:
        text = None
    out: dict[str, Any] = {
        "offset": event.offset,
        "position": event.position,
        "timestamp_ms": event.timestamp_ms,
        "value": text,
        "value_b64": base64.b64encode(event.value).decode("ascii"),
    }
    if event.key is not None:
        out["key_b64"] = base64.b64encode(event.key).decode("ascii")
    if event.tombstone:
        out["tombstone"] = True
    return out


def decode_json(data: bytes, what: str) -> Any:
    """``data`` parsed as JSON; InvalidRequest (400) saying why ``what`` (e.g. "the
    body") is not valid JSON, or is nested too deeply to parse (``[[[...`` by the
    ten thousand: Python's recursion limit, which must not become a 500)."""
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest(f"{what} is JSON nested too deeply to parse") from None


def _check_limits(values: list[bytes]) -> list[bytes]:
    if not values:
        raise InvalidRequest("an append needs at least one event")
    if len(values) > MAX_APPEND_EVENTS:
        raise InvalidRequest(
            f"an append carries at most {MAX_APPEND_EVENTS} events, not {len(values)};"
            " split the body into several requests"
        )
    total = sum(map(len, values))
    if total > MAX_APPEND_BYTES:
        raise InvalidRequest(
            f"an append carries at most {MAX_APPEND_BYTES} bytes of event values, not {total};"
            " split the body into several requests"
        )
    return values


def _value_bytes(item: Any, index: int, base64_strings: bool) -> bytes:
    if isinstance(item, str):
        if base64_strings:
            try:
                return base64.b64decode(item, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidRequest(f"event {index} is not valid base64") from None
        return item.encode()
    if item is None:
        raise InvalidRequest(f"event {index} is null; send a string, number, object or array")
    return json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode()


def parse_json_array(body: bytes, *, base64_strings: bool = False) -> list[bytes]:
    """A JSON array body: strings become their UTF-8 bytes (or base64-decoded bytes),
    anything else its compact JSON text."""
    data = decode_json(body, "the body")
    if not isinstance(data, list):
        raise InvalidRequest("the body must be a JSON array of events (or NDJSON)")
    return _check_limits([_value_bytes(item, i, base64_strings) for i, item in enumerate(data)])


def parse_ndjson(body: bytes) -> list[bytes]:
    """NDJSON: each non-blank line is one event, stored exactly as sent (without its
    line ending); every line must be valid JSON."""
    values: list[bytes] = []
    for number, raw in enumerate(body.split(b"\n"), start=1):
        line = raw.rstrip(b"\r")
        if not line.strip():
            continue
        decode_json(line, f"NDJSON line {number}")
        values.append(bytes(line))
    return _check_limits(values)
