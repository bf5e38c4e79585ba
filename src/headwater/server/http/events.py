"""JSON shapes of events and append bodies (docs/http-api.md)."""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any

from headwater.api import MAX_APPEND_BYTES, MAX_APPEND_EVENTS
from headwater.errors import InvalidRequest
from headwater.storage.batch import Event

NDJSON_TYPES = frozenset({"application/x-ndjson", "application/ndjson", "application/jsonl"})


def _text(data: bytes) -> str | None:
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def event_json(event: Event, partition: int = 0) -> dict[str, Any]:
    """An event: ``value`` (and ``key``, a header's ``value``) is its text when the bytes
    are UTF-8 (else null); ``value_b64`` (``key_b64``) always carries the exact bytes."""
    out: dict[str, Any] = {
        "partition": partition,
        "offset": event.offset,
        "position": event.position,
        "timestamp_ms": event.timestamp_ms,
        "value": _text(event.value),
        "value_b64": _b64(event.value),
    }
    if event.key is not None:
        out["key"] = _text(event.key)
        out["key_b64"] = _b64(event.key)
    if event.headers:
        out["headers"] = [
            {"name": name.decode(errors="replace"), "value": _text(value), "value_b64": _b64(value)}
            for name, value in event.headers
        ]
    if event.tombstone:
        out["tombstone"] = True
    return out


@dataclass(frozen=True)
class Records:
    """The ``{"records": [...]}`` append body, as columns for ``append_partitioned``
    (a column is None when no record set it)."""

    values: list[bytes]
    keys: list[bytes | None] | None
    headers: list[tuple[tuple[bytes, bytes], ...]] | None
    partitions: list[int | None] | None
    timestamps: list[int | None] | None


_RECORD_FIELDS = frozenset(
    {"value", "value_b64", "key", "key_b64", "headers", "partition", "timestamp_ms"}
)
_HEADER_FIELDS = frozenset({"name", "value", "value_b64"})


def _decode_base64(text: str) -> bytes | None:
    """``text`` as padded base64 with nothing else (the OpenAPI file's pattern for every
    ``*_b64`` field), decoded; None when it is not."""
    try:
        decoded = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    # Python also takes padding past a whole quantum ("AAAA="), which the pattern refuses:
    # the server refuses it too, so a body the spec calls invalid is never stored.
    return decoded if len(text) == len(base64.b64encode(decoded)) else None


def _bytes_field(item: dict[str, Any], name: str, where: str) -> bytes | None:
    """``item[name]`` (text, stored as UTF-8) or ``item[name + "_b64"]`` (base64 of the
    exact bytes); None when neither is there."""
    text, encoded = item.get(name), item.get(name + "_b64")
    if text is not None and encoded is not None:
        raise InvalidRequest(f"{where}: give {name} or {name}_b64, not both")
    if encoded is not None:
        if not isinstance(encoded, str):
            raise InvalidRequest(f"{where}: {name}_b64 must be a base64 string")
        decoded = _decode_base64(encoded)
        if decoded is None:
            raise InvalidRequest(f"{where}: {name}_b64 is not valid base64")
        return decoded
    if text is not None and not isinstance(text, str):
        raise InvalidRequest(f"{where}: {name} must be a string")
    return None if text is None else text.encode()


def _int_field(item: dict[str, Any], name: str, where: str) -> int | None:
    value = item.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 63:
        raise InvalidRequest(f"{where}: {name} must be an integer from 0 to 2**63-1")
    return value


def parse_records(data: dict[str, Any]) -> Records:
    """``{"records": [{"value" | "value_b64", "key" | "key_b64", "headers": [{"name",
    "value" | "value_b64"}], "partition", "timestamp_ms"}]}``: every field but the value
    optional. Checked whole before anything is stored."""
    if set(data) != {"records"} or not isinstance(data["records"], list):
        raise InvalidRequest('an object body is {"records": [...]}, with nothing else')
    values: list[bytes] = []
    keys: list[bytes | None] = []
    headers: list[tuple[tuple[bytes, bytes], ...]] = []
    partitions: list[int | None] = []
    timestamps: list[int | None] = []
    for index, item in enumerate(data["records"]):
        where = f"record {index}"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object with a value")
        unknown = set(item) - _RECORD_FIELDS
        if unknown:
            raise InvalidRequest(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        value = _bytes_field(item, "value", where)
        if value is None:
            raise InvalidRequest(f"{where} has no value (value or value_b64)")
        values.append(value)
        keys.append(_bytes_field(item, "key", where))
        raw_headers = item.get("headers") or []
        if not isinstance(raw_headers, list):
            raise InvalidRequest(f"{where}: headers must be a list of {{name, value}}")
        pairs: list[tuple[bytes, bytes]] = []
        for h, header in enumerate(raw_headers):
            at = f"{where} header {h}"
            if not isinstance(header, dict) or not isinstance(header.get("name"), str):
                raise InvalidRequest(f"{at} must be an object with a name string")
            if set(header) - _HEADER_FIELDS:
                raise InvalidRequest(f"{at}: fields are name, value and value_b64")
            pairs.append((header["name"].encode(), _bytes_field(header, "value", at) or b""))
        headers.append(tuple(pairs))
        partitions.append(_int_field(item, "partition", where))
        timestamps.append(_int_field(item, "timestamp_ms", where))
    _check_limits(values)
    return Records(
        values=values,
        keys=keys if any(k is not None for k in keys) else None,
        headers=headers if any(headers) else None,
        partitions=partitions if any(p is not None for p in partitions) else None,
        timestamps=timestamps if any(t is not None for t in timestamps) else None,
    )


class _NotJson(ValueError):
    """NaN, Infinity or -Infinity: Python's json reads them, JSON (RFC 8259) has none."""


def _not_json(name: str) -> Any:
    raise _NotJson(name)


_DECODER = json.JSONDecoder(parse_constant=_not_json)
_SPACE = re.compile(r"[ \t\n\r]*")
# JSON text without its insignificant whitespace: strings are kept whole (escapes and
# all), the whitespace between tokens dropped, every other character kept as sent.
_STRING_OR_SPACE = re.compile(r'("(?:[^"\\]|\\.)*")|[ \t\n\r]+')


def decode_json(data: bytes, what: str) -> Any:
    """``data`` parsed as JSON; InvalidRequest (400) saying why ``what`` (e.g. "the
    body") is not valid JSON (NaN and Infinity, which Python reads, are not), or is
    nested too deeply to parse (``[[[...`` by the ten thousand: Python's recursion
    limit, which must not become a 500)."""
    try:
        value = _DECODER.decode(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"{what} is not valid JSON: {exc}") from None
    except _NotJson as exc:
        raise InvalidRequest(f"{what} is not valid JSON: {exc} is not a JSON value") from None
    except RecursionError:
        raise InvalidRequest(f"{what} is JSON nested too deeply to parse") from None
    if _SURROGATE_ESCAPE.search(data) is not None and _has_lone_surrogate(value):
        raise InvalidRequest(
            f"{what} has a string with a lone surrogate (a \\ud800-\\udfff escape"
            " not in a pair): not valid Unicode, which nothing could store or send on"
        )
    return value


def _array_items(body: bytes) -> list[tuple[Any, str]]:
    """Each element of a JSON array body, parsed and as its text was sent (a number's
    digits as written: parsed, 0.10000000000000000555 became 0.1, 1e400 Infinity and
    1E2 100.0). InvalidRequest as :func:`decode_json`."""
    value = decode_json(body, "the body")
    if not isinstance(value, list):
        raise InvalidRequest("the body must be a JSON array of events (or NDJSON)")
    # The array is valid JSON, so a walk from element to element cannot fail: after
    # each one, whitespace, a comma (or the closing bracket), whitespace.
    text = body.decode()
    space = _SPACE.match
    at = space(text, space(text).end() + 1).end()  # type: ignore[union-attr]
    sent: list[str] = []
    for _ in value:
        end = _DECODER.raw_decode(text, at)[1]
        sent.append(text[at:end])
        at = space(text, space(text, end).end() + 1).end()  # type: ignore[union-attr]
    return list(zip(value, sent, strict=True))


# JSON's \uD800-\uDFFF escapes are the only way a parsed string can hold a surrogate.
# Only a high escape not followed by a low one, or a low one not after a high one, can
# be lone: a body of pairs (what json.dumps makes of every emoji) is not walked value
# by value, nor is one without such escapes (nearly all). An escaped backslash before
# "ud800" matches too; the walk then finds nothing.
_HIGH = rb"\\u[dD][89abAB][0-9a-fA-F]{2}"
_LOW = rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
_SURROGATE_ESCAPE = re.compile(_HIGH + rb"(?!" + _LOW + rb")|(?<!" + _HIGH + rb")" + _LOW)


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode()
                except UnicodeEncodeError:
                    return True
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
    return False


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


def _value_bytes(item: Any, sent: str, index: int, base64_strings: bool) -> bytes:
    """An array element's stored bytes: a string's UTF-8 (or its base64's bytes), any
    other value its JSON text as ``sent`` without the whitespace between tokens."""
    if isinstance(item, str):
        if base64_strings:
            decoded = _decode_base64(item)
            if decoded is None:
                raise InvalidRequest(f"event {index} is not valid base64")
            return decoded
        return item.encode()
    if item is None:
        raise InvalidRequest(f"event {index} is null; send a string, number, object or array")
    return _STRING_OR_SPACE.sub(lambda m: m.group(1) or "", sent).encode()


def parse_json_array(body: bytes, *, base64_strings: bool = False) -> list[bytes]:
    """A JSON array body: strings become their UTF-8 bytes (or base64-decoded bytes),
    anything else its JSON text as sent, without the whitespace between tokens."""
    items = _array_items(body)
    return _check_limits(
        [_value_bytes(item, sent, i, base64_strings) for i, (item, sent) in enumerate(items)]
    )


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
