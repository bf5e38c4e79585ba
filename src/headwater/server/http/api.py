"""REST handlers (docs/http-api.md; the contract is src/headwater/server/openapi.json)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from importlib import resources
from typing import Any

import pyarrow as pa
from aiohttp import web

import headwater
from headwater.api import (
    MAX_APPEND_BYTES,
    MAX_APPEND_EVENTS,
    EngineAPI,
    StreamInfo,
    StreamSettings,
)
from headwater.errors import InvalidOffset, InvalidRequest
from headwater.json_fields import json_fields
from headwater.server.http.app import (
    METRICS_KEY,
    PROTOCOL,
    HeldResponse,
    api_of,
    int_param,
    json_body,
    json_bytes,
    json_response,
    principal_of,
    read_body,
    record_append,
    server_of,
    tenant_of,
)
from headwater.server.http.arrow import (
    ARROW_MESSAGE_BYTES,
    append_arrow,
    partition_param,
    read_records,
    stream_arrow,
)
from headwater.server.http.events import (
    NDJSON_TYPES,
    decode_json,
    event_json,
    parse_json_array,
    parse_ndjson,
    parse_records,
)
from headwater.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from headwater.sql.projection import RANGE_SCHEMA
from headwater.sql.values import Timestamp, json_value

DEFAULT_READ_LIMIT = 100
MAX_READ_LIMIT = 10_000
MAX_READ_BYTES = 16 << 20

_OPENAPI: bytes | None = None


def openapi_document() -> bytes:
    global _OPENAPI
    if _OPENAPI is None:
        _OPENAPI = (resources.files("headwater.server") / "openapi.json").read_bytes()
    return _OPENAPI


def stream_json(info: StreamInfo) -> dict[str, Any]:
    return {
        "tenant_id": info.tenant_id,
        "stream_id": info.stream_id,
        "name": info.name,
        "created_ns": info.created_ns,
        "start_offset": info.start_offset,
        "next_offset": info.next_offset,
        "size_bytes": info.size_bytes,
        "segments": info.segments,
        "sync": info.sync,
        "settings": {
            k: v for k, v in asdict(info.settings).items() if v is not None and k != "partitions"
        },
        "partitions": info.partitions,
        "partition_offsets": [
            json_fields(p, omit=("size_bytes", "segments")) for p in info.partition_info
        ],
    }


def _named_stream(request: web.Request) -> tuple[EngineAPI, int, StreamInfo]:
    """The engine API, the request's tenant and the stream its path names."""
    tenant_id = tenant_of(request)
    api = api_of(request)
    return api, tenant_id, api.stream_named(tenant_id, request.match_info["name"])


# ---- service ------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    server = server_of(request)
    if not server.started:
        return json_response({"status": "starting"}, 503)
    if server.api.closing or server.stopping.is_set():
        return json_response({"status": "stopping"}, 503)
    return json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    """The Prometheus exposition: every series for an admin token (or when auth is not
    required and no token is given); a token's own tenants' series otherwise."""
    principal = principal_of(request)
    body = request.app[METRICS_KEY].render(None if principal.admin else principal.tenants)
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=openapi_document(), content_type="application/json")


async def info(request: web.Request) -> web.Response:
    tenant_id = tenant_of(request)
    server = server_of(request)
    tenant = api_of(request).tenant_info(tenant_id)
    snapshot = request.app[METRICS_KEY].snapshot()
    return json_response(
        {
            "server": "headwater",
            "version": headwater.__version__,
            "uptime_seconds": round(time.time() - server.started_at, 3),
            "listeners": {lst.name: lst.port for lst in server.listeners},
            "auth_required": server.config.auth.required,
            "tenant": {
                "id": tenant_id,
                "name": tenant.name,
                "log_position": tenant.log_position,
                "streams": tenant.streams,
            },
            "connections": snapshot["connections"],
            "subscriptions": snapshot["subscriptions"],
            "limits": {
                "append_max_events": MAX_APPEND_EVENTS,
                "append_max_bytes": MAX_APPEND_BYTES,
                "read_max_events": MAX_READ_LIMIT,
            },
        }
    )


# ---- streams ------------------------------------------------------------------------


async def list_streams(request: web.Request) -> web.Response:
    tenant_id = tenant_of(request)
    streams = api_of(request).list_streams(tenant_id)
    return json_response({"streams": [stream_json(s) for s in streams]})


async def create_stream(request: web.Request) -> web.Response:
    tenant_id = tenant_of(request)
    body = await json_body(request)
    if not isinstance(body, dict):
        raise InvalidRequest('the body must be an object like {"name": "orders"}')
    unknown = set(body) - {"name", "settings"}
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
    name = body.get("name")
    if not isinstance(name, str):
        raise InvalidRequest("name must be a string")
    raw_settings = body.get("settings")
    if raw_settings is None:
        raw_settings = {}
    if not isinstance(raw_settings, dict):
        raise InvalidRequest("settings must be an object")
    unknown = set(raw_settings) - set(StreamSettings.__dataclass_fields__)
    if unknown:
        raise InvalidRequest(f"unknown setting(s): {', '.join(sorted(unknown))}")
    try:
        settings = StreamSettings.from_dict(raw_settings)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"invalid settings: {exc}") from None
    created = await api_of(request).create_stream(tenant_id, name, settings)
    response = json_response(stream_json(created), 201)
    response.headers["Location"] = f"/api/streams/{created.name}"
    return response


async def describe_stream(request: web.Request) -> web.Response:
    _, _, stream = _named_stream(request)
    return json_response(stream_json(stream))


async def alter_stream(request: web.Request) -> web.Response:
    """``{"partitions": N}``: the stream gets N partitions (more than it has; the same
    count changes nothing; fewer is refused with 400, as Kafka refuses)."""
    api, tenant_id, stream = _named_stream(request)
    body = await json_body(request)
    if not isinstance(body, dict) or set(body) != {"partitions"}:
        raise InvalidRequest('the body must be {"partitions": N}: the one setting that changes')
    altered = await api.alter_partitions(tenant_id, stream.stream_id, body["partitions"])
    return json_response(stream_json(altered))


async def offset_for_time(request: web.Request) -> web.Response:
    """The first offset of a partition stored at or after ``timestamp_ms`` (null when no
    event is that late: wait at the end offset)."""
    api, tenant_id, stream = _named_stream(request)
    timestamp_ms = int_param(request, "timestamp_ms", None)
    if timestamp_ms is None:
        raise InvalidRequest("timestamp_ms (milliseconds since the epoch, UTC) is required")
    partition = int_param(request, "partition", 0, at_least=0)
    offset = await api.offset_for_timestamp(
        tenant_id, stream.stream_id, timestamp_ms, partition=partition
    )
    return json_response(
        {
            "partition": partition,
            "timestamp_ms": timestamp_ms,
            "offset": offset,
            "end_offset": api.stream_end(tenant_id, stream.stream_id, partition),
        }
    )


async def delete_stream(request: web.Request) -> web.Response:
    api, tenant_id, stream = _named_stream(request)
    await api.delete_stream(tenant_id, stream.stream_id)
    return web.Response(status=204)


# ---- events -------------------------------------------------------------------------


async def append_events(request: web.Request) -> web.Response:
    api, tenant_id, stream = _named_stream(request)
    encoding = request.query.get("encoding", "text")
    if encoding not in ("text", "base64"):
        raise InvalidRequest("encoding must be 'text' or 'base64'")
    body = await read_body(request)
    partition = int_param(request, "partition", 0, at_least=0)
    if request.content_type in ("application/json", "") and body.lstrip()[:1] == b"{":
        if "partition" in request.query or encoding != "text":
            raise InvalidRequest(
                "a records body names each record's partition and encoding itself"
                " (partition, value_b64): no partition or encoding parameter"
            )
        return await _append_records(request, api, tenant_id, stream, body)
    if request.content_type in NDJSON_TYPES:
        if encoding != "text":
            raise InvalidRequest("encoding=base64 applies to JSON array bodies only")
        values = parse_ndjson(body)
    elif request.content_type in ("application/json", "application/octet-stream", ""):
        values = parse_json_array(body, base64_strings=encoding == "base64")
    else:
        raise InvalidRequest(
            f"unsupported Content-Type {request.content_type!r}: "
            "use application/json (an array) or application/x-ndjson"
        )
    started = time.perf_counter()
    appended = await api.append(tenant_id, stream.stream_id, values, partition=partition)
    value_bytes = sum(map(len, values))
    record_append(request, tenant_id, stream.name, appended.count, value_bytes, started)
    return json_response(
        {
            "base_offset": appended.base_offset,
            "count": appended.count,
            "next_offset": appended.next_offset,
            "first_position": appended.first_position,
            "timestamp_ms": appended.timestamp_ms,
            "partition": partition,
        }
    )


async def _append_records(
    request: web.Request, api: EngineAPI, tenant_id: int, stream: StreamInfo, body: bytes
) -> web.Response:
    """A ``{"records": [...]}`` body: each record placed by the stream's partitioner
    (its partition, else its key's murmur2, else the batch's sticky partition)."""
    data = decode_json(body, "the body")
    if not isinstance(data, dict):
        raise InvalidRequest('the body must be {"records": [...]}, a JSON array or NDJSON')
    records = parse_records(data)
    started = time.perf_counter()
    placed = await api.append_partitioned(
        tenant_id,
        stream.stream_id,
        records.values,
        keys=records.keys,
        headers=records.headers,
        partitions=records.partitions,
        timestamps=records.timestamps,
    )
    value_bytes = sum(map(len, records.values))
    record_append(request, tenant_id, stream.name, len(records.values), value_bytes, started)
    return json_response(
        {
            "count": len(records.values),
            "records": [
                {"partition": p, "offset": o, "timestamp_ms": t}
                for p, o, t in zip(
                    placed.partitions, placed.offsets, placed.timestamps, strict=True
                )
            ],
        }
    )


async def read_events(request: web.Request) -> web.Response:
    api, tenant_id, stream = _named_stream(request)
    partition = partition_param(request, stream.partitions, stream.name)
    start_offset = stream.partition_info[partition].start_offset
    start = int_param(request, "from", 0)
    limit = int_param(request, "limit", DEFAULT_READ_LIMIT, at_least=1, at_most=MAX_READ_LIMIT)
    end = int_param(request, "to", None)
    if end is not None:
        if end < start:
            raise InvalidRequest(f"to ({end}) must not be below from ({start})")
        limit = min(limit, end - start)
    where = f"partition {partition}" if partition else "the stream"
    if start < start_offset:  # also when limit is 0
        raise InvalidOffset(
            f"offset {start} was removed by retention; {where} starts at {start_offset}"
        )
    events = []
    next_offset = max(start, start_offset)
    # What the page reads is the server's until the client has read it: it takes its
    # room in limits.read_answers_mib first (server/answers.py), then holds its JSON.
    budget = server_of(request).limits.answers
    if limit > 0:
        room = await budget.take_within(MAX_READ_BYTES)
        try:
            result = await api.read(
                tenant_id,
                stream.stream_id,
                start,
                max(room, 1),  # none only when the server is stopping: the first event
                max_events=limit,
                partition=partition,
            )
        finally:
            budget.give_back(room)
        events = list(result.events())
        # Past what it shows, the read may have passed what a reader never sees (markers,
        # aborted transactions' batches): a page of only those still moves the reader on.
        next_offset = events[-1].offset + 1 if events else max(next_offset, result.end_offset)
    request.app[METRICS_KEY].record_read(
        PROTOCOL, tenant_id, stream.name, len(events), sum(len(e.value) for e in events)
    )
    body = json_bytes(
        {
            "partition": partition,
            "events": [event_json(e, partition) for e in events],
            "next_offset": next_offset,
            "start_offset": start_offset,
            "end_offset": api.readable_end(tenant_id, stream.stream_id, partition),
        }
    )
    return HeldResponse(body, budget)


ARROW_MESSAGE_ROWS = 65_536  # rows per IPC message at most, one write each


async def read_arrow(request: web.Request) -> web.StreamResponse:
    """Offsets [from, to) of a stream partition (``partition``, default 0) as an Arrow
    IPC stream of (offset, position, ts, data), sliced from its SQL projection: a bulk
    read with no work per event, for columnar readers (the Spark data source). ``to``
    defaults to the partition's committed end. ``records=true``: keys and headers too,
    read from the log (:func:`headwater.server.http.arrow.read_records`), as does an
    ``isolation`` (the projection holds what read_committed readers see only)."""
    records = request.query.get("records", "false")
    if records not in ("true", "false"):
        raise InvalidRequest(f"records must be true or false, not {records!r}")
    if records == "true" or "isolation" in request.query:
        return await read_records(request)
    api, tenant_id, stream = _named_stream(request)
    partition = int_param(request, "partition", 0, at_least=0)
    start = int_param(request, "from", 0)
    end = int_param(request, "to", None)
    if end is None:
        end = max(start, api.readable_end(tenant_id, stream.stream_id, partition))
    elif end < start:
        raise InvalidRequest(f"to ({end}) must not be below from ({start})")
    batches = await api.stream_range(tenant_id, stream.name, start, end, partition)

    async def messages() -> AsyncIterator[pa.RecordBatch]:
        for batch in batches:
            step = ARROW_MESSAGE_ROWS
            if batch.num_rows and batch.nbytes > ARROW_MESSAGE_BYTES:
                step = max(1, min(step, batch.num_rows * ARROW_MESSAGE_BYTES // batch.nbytes))
            for first in range(0, batch.num_rows, step):
                yield batch.slice(first, step)

    return await stream_arrow(request, RANGE_SCHEMA, messages(), tenant_id, stream.name)


# ---- SQL ----------------------------------------------------------------------------


def _sql_param(value: Any, index: int) -> object:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, dict) and set(value) == {"timestamp_ns"}:
        ns = value["timestamp_ns"]
        if isinstance(ns, int) and not isinstance(ns, bool):
            return Timestamp(ns)
    raise InvalidRequest(
        f'parameter {index}: use null, a boolean, an integer, a string or {{"timestamp_ns": N}}'
    )


async def sql(request: web.Request) -> web.Response:
    tenant_id = tenant_of(request)
    body = await json_body(request)
    if not isinstance(body, dict):
        raise InvalidRequest('the body must be an object like {"sql": "SELECT 1"}')
    unknown = set(body) - {"sql", "params", "position"}
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
    text = body.get("sql")
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest("sql must be a non-empty string")
    raw_params = body.get("params") or []
    if not isinstance(raw_params, list):
        raise InvalidRequest("params must be an array")
    params = [_sql_param(v, i) for i, v in enumerate(raw_params)]
    position = body.get("position")
    service = api_of(request)
    if position is None:
        result = await service.query(tenant_id, text, params)
    else:
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise InvalidRequest("position must be a non-negative integer")
        result = await service.query_at(tenant_id, text, params, position)
    # Numbers as JSON numbers where a double holds them exactly (sql.values.json_value);
    # an INSERT's answer has no types (its two columns are counts).
    types = result.types or [""] * len(result.columns)
    rows = result.rows
    out: dict[str, Any] = {
        "columns": result.columns,
        "rows": [[json_value(v, t) for v, t in zip(row, types, strict=True)] for row in rows],
    }
    if position is not None:
        out["position"] = position
    return json_response(out)


# ---- routes -------------------------------------------------------------------------


async def ripple_workers(request: web.Request) -> web.Response:
    """Pipeline workers of the request's tenant on the Ripple listener: slots,
    heartbeats, sequence numbers and watermarks per output (an empty list when the
    listener is off)."""
    from headwater.server.ripple.listener import STATES

    tenant_id = tenant_of(request)
    states = STATES.get(server_of(request))
    workers = [] if states is None else states.workers(frozenset({tenant_id}))
    return json_response({"workers": workers})


ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/health", health),
    ("GET", "/ready", ready),
    ("GET", "/metrics", metrics),
    ("GET", "/openapi.json", openapi),
    ("GET", "/api/info", info),
    ("GET", "/api/streams", list_streams),
    ("POST", "/api/streams", create_stream),
    ("GET", "/api/streams/{name}", describe_stream),
    ("DELETE", "/api/streams/{name}", delete_stream),
    ("PATCH", "/api/streams/{name}", alter_stream),
    ("GET", "/api/streams/{name}/offsets", offset_for_time),
    ("POST", "/api/streams/{name}/events", append_events),
    ("GET", "/api/streams/{name}/events", read_events),
    ("GET", "/api/streams/{name}/arrow", read_arrow),
    ("POST", "/api/streams/{name}/arrow", append_arrow),
    ("POST", "/api/sql", sql),
    ("GET", "/api/ripple/workers", ripple_workers),
]
