"""Arrow IPC bodies of the HTTP API: a partition's records (keys and headers included)
read from its log, and an idempotent append of one record batch to one partition: the
columnar paths of bulk clients such as the Spark source and sink (docs/http-api.md,
"Records as Arrow" and "Append as Arrow").

Neither side does work per event on a value: values travel as Arrow binary arrays and
become the stored ``u64 len | bytes`` section in C (:func:`values_section`); keys and
headers are handed to the engine as they are only when a batch has them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from aiohttp import web

from headwater.api import MAX_APPEND_BYTES, MAX_APPEND_EVENTS
from headwater.errors import InvalidRequest
from headwater.server.http.app import (
    METRICS_KEY,
    PROTOCOL,
    api_of,
    int_param,
    json_response,
    read_body,
    record_append,
    server_of,
    tenant_of,
)
from headwater.sql.records import RECORDS_SCHEMA

ARROW_STREAM_TYPE = "application/vnd.apache.arrow.stream"
# About this many bytes an IPC message at most: each is a copy made to be sent (and may
# wait in the transport), so its size, not the events', bounds what a range read holds.
ARROW_MESSAGE_BYTES = 4 << 20
_ARROW_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # end-of-stream marker
MAX_U64 = (1 << 64) - 1


def partition_param(request: web.Request, partitions: int, name: str) -> int:
    """The ``partition`` query parameter (0 when absent), one the stream has."""
    partition = int_param(request, "partition", 0, at_least=0)
    if partition >= partitions:
        raise InvalidRequest(
            f"partition {partition} does not exist: stream {name!r} has "
            f"{partitions} (0..{partitions - 1})"
        )
    return partition


async def read_records(request: web.Request) -> web.StreamResponse:
    """``GET /api/streams/{name}/arrow?records=true``: offsets [from, to) of partition
    ``partition`` as an Arrow IPC stream of :data:`RECORDS_SCHEMA`, read from the log a
    round at a time (in a worker thread: it reads files), under ``isolation``
    (read_committed by default, or read_uncommitted). ``to`` defaults to the end that
    isolation allows and is cut there."""
    tenant_id = tenant_of(request)
    api = api_of(request)
    stream = api.stream_named(tenant_id, request.match_info["name"])
    partition = partition_param(request, stream.partitions, stream.name)
    isolation = request.query.get("isolation", "read_committed")
    start = int_param(request, "from", 0)
    end = int_param(request, "to", None)
    if end is not None and end < start:
        raise InvalidRequest(f"to ({end}) must not be below from ({start})")
    cursor = await api.stream_records(
        tenant_id,
        stream.stream_id,
        start,
        (1 << 63) - 1 if end is None else end,
        partition=partition,
        isolation=isolation,
    )

    async def batches() -> AsyncIterator[pa.RecordBatch]:
        while (batch := await asyncio.to_thread(cursor.next_batch)) is not None:
            yield batch

    return await stream_arrow(request, RECORDS_SCHEMA, batches(), tenant_id, stream.name)


async def stream_arrow(
    request: web.Request,
    schema: pa.Schema,
    messages: AsyncIterator[pa.RecordBatch],
    tenant_id: int,
    stream_name: str,
) -> web.StreamResponse:
    """An Arrow IPC stream response: ``schema``, then each record batch of ``messages``
    as one IPC message (one HTTP chunk, so a client reads each message whole), written
    as it comes, then the end-of-stream marker; the rows and their ``data`` bytes
    counted as a read of the stream."""
    response = web.StreamResponse(headers={"Content-Type": ARROW_STREAM_TYPE})
    await response.prepare(request)
    await response.write(memoryview(schema.serialize()))
    rows = value_bytes = 0
    # Each message is a copy held until the client reads it: it takes its room in
    # limits.read_answers_mib (server/answers.py) before it is read and made.
    budget = server_of(request).limits.answers
    batches = aiter(messages)
    while True:
        room = await budget.take_within(ARROW_MESSAGE_BYTES)
        held = room
        try:
            batch = await anext(batches, None)
            if batch is None:
                break
            message = memoryview(batch.serialize())
            if message.nbytes > room:  # one event larger than a message's room
                budget.hold(message.nbytes - room)
                held = message.nbytes
            await response.write(message)  # returns once the transport can take more
            del message
        finally:
            budget.give_back(held)
        rows += batch.num_rows
        data = batch.column("data")
        if len(data):  # its bytes from its first and last bounds, with no array built
            bounds = np.frombuffer(data.buffers()[1], np.int32, len(data) + 1, data.offset * 4)
            value_bytes += int(bounds[-1]) - int(bounds[0])
    await response.write(_ARROW_END)
    await response.write_eof()
    request.app[METRICS_KEY].record_read(PROTOCOL, tenant_id, stream_name, rows, value_bytes)
    return response


def _joined(heads: np.ndarray, items: pa.Array) -> memoryview:
    """Each fixed-size head (an element of ``heads``, a numpy array) followed by its
    item, all laid end to end: one Arrow kernel, no Python per item. The heads become a
    binary array as they lie (bounds 0, w, 2w, ...), with no cast or copy."""
    count = len(items)
    width = heads.dtype.itemsize
    bounds = np.arange(0, width * (count + 1), width, dtype=np.int32)
    head_items = pa.Array.from_buffers(
        pa.binary(), count, [None, pa.py_buffer(bounds), pa.py_buffer(heads)]
    )
    records = pc.binary_join_element_wise(head_items, items, b"")
    ends = np.frombuffer(records.buffers()[1], np.int32, count + 1, records.offset * 4)
    data = memoryview(records.buffers()[2]).cast("B")  # Arrow exports signed bytes
    return data[int(ends[0]) : int(ends[-1])]


_VALUE_HEAD = np.dtype("<u8")
_KEY_HEAD = np.dtype([("flags", "u1"), ("length", "<u4")])  # packed: 5 bytes


def values_section(values: pa.Array) -> tuple[memoryview, int]:
    """The stored values section (``u64 len | bytes`` per event) of a binary array, and
    its values' bytes."""
    lengths = pc.binary_length(values).to_numpy(zero_copy_only=False)
    return _joined(lengths.astype(_VALUE_HEAD), values), int(lengths.sum())


def keys_section(keys: pa.Array) -> bytes:
    """The stored keys section (``u8 flags | u32 len | bytes`` per event, flags 1 for a
    key, 0 and no bytes for NULL) of a binary array."""
    heads = np.empty(len(keys), _KEY_HEAD)
    if keys.null_count:
        heads["flags"] = pc.is_valid(keys).to_numpy(zero_copy_only=False)  # KEY_PRESENT is 1
        keys = pc.fill_null(keys, pa.scalar(b"", pa.binary()))
    else:  # every event keyed, the common case: no mask to build
        heads["flags"] = 1
    heads["length"] = pc.binary_length(keys).to_numpy(zero_copy_only=False)
    return bytes(_joined(heads, keys))


def _binary_column(batch: pa.RecordBatch, name: str) -> pa.Array | None:
    index = batch.schema.get_field_index(name)
    if index < 0:
        return None
    column = batch.column(index)
    kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_large_binary(kind):
        column = column.cast(pa.binary())
    if not pa.types.is_binary(column.type):
        raise InvalidRequest(f"column {name} must be binary or string, not {column.type}")
    return column


def _headers(batch: pa.RecordBatch) -> list[tuple[tuple[bytes, bytes], ...]] | None:
    index = batch.schema.get_field_index("headers")
    if index < 0:
        return None
    column = batch.column(index)
    if not column.type.equals(RECORDS_SCHEMA.field("headers").type):
        raise InvalidRequest(
            f"column headers must be list<struct<key: string, value: binary>>, not {column.type}"
        )
    if column.null_count == len(column):
        return None
    out: list[tuple[tuple[bytes, bytes], ...]] = []
    for entry in column.to_pylist():  # only batches that carry headers pay this
        pairs = entry or ()
        if any(p["key"] is None or p["value"] is None for p in pairs):
            raise InvalidRequest("a header needs a key and a value")
        out.append(tuple((p["key"].encode(), p["value"]) for p in pairs))
    return out


async def append_arrow(request: web.Request) -> web.Response:
    """``POST /api/streams/{name}/arrow?partition=N[&producer_id=P&sequence=S]``: one
    Arrow IPC stream of one record batch (columns ``value``, and optionally ``key`` and
    ``headers``) appended as one batch to partition N, all or nothing. With a producer
    id and sequence the append is idempotent as Kimberlite's AppendIdempotent: a retry
    of the same (producer, sequence) is answered with where it was stored, and nothing
    is appended twice."""
    tenant_id = tenant_of(request)
    api = api_of(request)
    stream = api.stream_named(tenant_id, request.match_info["name"])
    partition = partition_param(request, stream.partitions, stream.name)
    producer_id = int_param(request, "producer_id", None, at_least=0, at_most=MAX_U64)
    sequence = int_param(request, "sequence", None, at_least=0, at_most=MAX_U64)
    if (producer_id is None) != (sequence is None):
        raise InvalidRequest("producer_id and sequence go together")
    if request.content_type != ARROW_STREAM_TYPE:
        raise InvalidRequest(f"the body must be {ARROW_STREAM_TYPE}, not {request.content_type!r}")
    body = await read_body(request)
    try:
        table = pa.ipc.open_stream(body).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise InvalidRequest(f"the body is not an Arrow IPC stream: {exc}") from None
    if not 1 <= table.num_rows <= MAX_APPEND_EVENTS:
        raise InvalidRequest(
            f"an append carries 1..{MAX_APPEND_EVENTS} events, not {table.num_rows}"
        )
    batch = table.combine_chunks().to_batches()[0]
    unknown = set(batch.schema.names) - {"value", "key", "headers"}
    if unknown:
        raise InvalidRequest(f"unknown column(s) {', '.join(sorted(unknown))}: value, key, headers")
    values = _binary_column(batch, "value")
    if values is None:
        raise InvalidRequest("the batch needs a value column")
    if values.null_count:
        raise InvalidRequest("column value has nulls: every event needs a value")
    section, value_bytes = values_section(values)
    if value_bytes > MAX_APPEND_BYTES:
        raise InvalidRequest(f"an append carries at most {MAX_APPEND_BYTES} bytes of events")
    keys = _binary_column(batch, "key")
    started = time.perf_counter()
    appended = await api.append_encoded(
        tenant_id,
        stream.stream_id,
        section,
        batch.num_rows,
        value_bytes=value_bytes,
        partition=partition,
        keys_section=None if keys is None or keys.null_count == len(keys) else keys_section(keys),
        headers=_headers(batch),
        producer=None if producer_id is None or sequence is None else (producer_id, sequence),
    )
    record_append(request, tenant_id, stream.name, appended.count, value_bytes, started)
    return json_response(
        {
            "partition": partition,
            "base_offset": appended.base_offset,
            "count": appended.count,
            "next_offset": appended.next_offset,
        }
    )
