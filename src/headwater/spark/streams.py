"""What executors and the driver do against the server: bounds of a stream, reading an
offset range as Arrow record batches, and idempotent appends.

Runs wherever Spark puts it: each call opens its own connection with the blocking SDK.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json

from headwater.client import Client, connect
from headwater.client.aio import split_events
from headwater.client.errors import ServerUnavailable
from headwater.client.results import QueryResult, RawReadResult
from headwater.errors import InvalidOffset, StreamNotFound, UsageError
from headwater.protocols.kimberlite.messages import EventBatch, http_port

from .options import ConnectionOptions, DataLossError

log = logging.getLogger(__name__)

READ_BYTES = 8 << 20
TIMESTAMP_TYPE_LOG_APPEND = 1  # Kafka's LogAppendTime: the server stamps each batch
SEQUENCES_PER_PRODUCER = 32  # the server remembers the last 64 sequences of a producer


def open_client(conn: ConnectionOptions) -> Client:
    return connect(conn.server, token=conn.token, tenant=conn.tenant, **conn.tls_options())


def _quote(name: str) -> str:
    return '"' + name + '"'  # names are [A-Za-z0-9_]: nothing to escape


@dataclass(frozen=True)
class Bounds:
    start: int  # first offset still stored (retention moves it)
    end: int  # offset the next append gets


def stream_bounds(client: Client, stream: str) -> Bounds:
    try:
        end = client.stream_info(stream).next_offset
    except StreamNotFound:
        raise UsageError(f"stream {stream} does not exist on {client.address}") from None
    first = client.query(f'SELECT min("offset") FROM {_quote(stream)}').scalar()
    start = end if first is None else int(str(first))
    return Bounds(min(start, end), end)


# Each (position - offset, timestamp) group is normally one run of consecutive offsets
# appended in one batch: a hash aggregate, several times cheaper than numbering the rows.
_GROUPS_SQL = """
    SELECT min("offset"), max("offset"), position - "offset" AS d, epoch_us(ts), count(*)
    FROM {table} WHERE "offset" >= ? AND "offset" < ? GROUP BY d, ts ORDER BY 1"""
# Exact runs even when a group is not contiguous (a timestamp repeated after a gap).
_RUNS_SQL = """
    SELECT min(o), max(o), d, t FROM (
        SELECT "offset" AS o, position - "offset" AS d, epoch_us(ts) AS t,
               "offset" - row_number() OVER (PARTITION BY position - "offset", ts
                                             ORDER BY "offset") AS g
        FROM {table} WHERE "offset" >= ? AND "offset" < ?)
    GROUP BY g, d, t ORDER BY 1"""

Run = tuple[int, int, int, int]  # first offset, last offset, position - offset, ts µs


def _metadata_runs(client: Client, stream: str, start: int, end: int) -> Future[list[Run]]:
    """(first, last, position - offset, timestamp µs) for each run of offsets appended in
    one batch: a handful of rows per range instead of one per event. Runs on the client's
    loop while the first page is read."""
    table = _quote(stream)

    def rows(result: QueryResult) -> list[tuple[int, ...]]:
        return [tuple(int(str(v)) for v in row) for row in result.rows]

    async def runs() -> list[Run]:
        groups = rows(await client.aio.query(_GROUPS_SQL.format(table=table), start, end))
        if all(last - first + 1 == n for first, last, _, _, n in groups):
            return [(g[0], g[1], g[2], g[3]) for g in groups]
        exact = rows(await client.aio.query(_RUNS_SQL.format(table=table), start, end))
        return [(r[0], r[1], r[2], r[3]) for r in exact]

    return client.submit(runs())


class _Metadata:
    def __init__(self, runs: list[Run]) -> None:
        self.runs = runs
        self.i = 0

    def columns(self, first: int, count: int) -> tuple[pa.Array, pa.Array]:
        """position and timestamp (µs) arrays for offsets first..first+count-1."""
        positions: list[pa.Array] = []
        stamps: list[pa.Array] = []
        offset, stop = first, first + count
        while offset < stop:
            while self.i < len(self.runs) and self.runs[self.i][1] < offset:
                self.i += 1
            run = self.runs[self.i] if self.i < len(self.runs) else None
            if run is None or run[0] > offset:  # no metadata (removed meanwhile): nulls
                n = (stop if run is None else min(stop, run[0])) - offset
                positions.append(pa.nulls(n, pa.int64()))
                stamps.append(pa.nulls(n, pa.int64()))
            else:
                n = min(stop, run[1] + 1) - offset
                positions.append(_counting(offset + run[2], n))
                stamps.append(pa.repeat(pa.scalar(run[3], pa.int64()), n))
            offset += n
        return pa.concat_arrays(positions), pa.concat_arrays(stamps)


def _binary_values(events: EventBatch) -> pa.Array:
    """The ``u64 len | bytes`` records of a wire page as an Arrow binary array: the record
    boundaries become Arrow offsets (each element = length prefix + value) and Arrow strips
    the 8-byte prefixes in C, instead of one Python bytes object per event."""
    offsets = pa.array(events.spans(), pa.int32()).buffers()[1]
    records = pa.Array.from_buffers(
        pa.binary(), events.count, [None, offsets, pa.py_buffer(events.section)]
    )
    return pc.binary_slice(records, 8, 1 << 30)  # an explicit stop: pyarrow 26 fails without


def _lines(values: pa.Array) -> pa.Buffer:
    """The values one per line (each followed by a newline), joined in C: the input of
    Arrow's JSON and CSV readers, with no Python object per event."""
    if len(values) == 0:
        return pa.py_buffer(b"")
    newline = pa.repeat(pa.scalar(b"", pa.binary()), len(values))
    lines = pc.binary_join_element_wise(values, newline, b"\n")  # a fresh array: offset 0
    size = pc.sum(pc.binary_length(lines)).as_py()
    return lines.buffers()[2].slice(0, size)


def _counting(first: int, count: int) -> pa.Array:
    """first, first + 1, ... as int64, computed in C."""
    ones = pa.repeat(pa.scalar(1, pa.int64()), count)
    return pc.add(pc.cumulative_sum(ones), first - 1)


ROW_SCHEMA = pa.schema(
    [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("stream", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("timestampType", pa.int32()),
        ("position", pa.int64()),
    ]
)
"""The Arrow schema of a raw read's rows (no headers) as Spark declares it from
``ReadOptions.schema_ddl()``: for a :class:`RangeReader` used without Spark."""


@dataclass(frozen=True)
class RangeReader:
    """Reads offsets [start, end) of one stream into record batches of ``schema``."""

    conn: ConnectionOptions
    stream: str
    start: int
    end: int
    fail_on_data_loss: bool
    value_format: str
    schema: Any  # pa.Schema of the Spark columns

    def batches(self, *, via_http: bool = True) -> Iterator[pa.RecordBatch]:
        """The range's rows. Columnar from the server's HTTP API when the Handshake
        advertises it (no work per event on either side), else (or when that API cannot
        be reached) pages of ReadEvents over the Kimberlite connection."""
        with open_client(self.conn) as client:
            if via_http and http_port(client.capabilities) is not None:
                yielded = False
                try:
                    for batch in self._http_batches(client):
                        yielded = True
                        yield batch
                    return
                except ServerUnavailable as exc:
                    if yielded:
                        raise
                    log.warning("%s; reading over Kimberlite instead", exc)
            yield from self._batches(client, self.start)

    def _http_batches(self, client: Client) -> Iterator[pa.RecordBatch]:
        offset = self.start
        while offset < self.end:
            try:
                for part in client.read_arrow(self.stream, offset, self.end):
                    if part.num_rows:
                        offsets, position, stamps, values = part.columns
                        yield self._record_batch(offsets, values, position, stamps)
                        offset = offsets[-1].as_py() + 1
            except InvalidOffset as exc:
                offset = self._after_data_loss(client, offset, exc)
                continue
            except StreamNotFound:
                raise DataLossError(f"stream {self.stream} was deleted while read") from None
            if offset < self.end:
                raise DataLossError(
                    f"stream {self.stream} ends at {offset}, before offset {self.end} that "
                    "was planned"
                )

    def _after_data_loss(self, client: Client, offset: int, exc: InvalidOffset) -> int:
        """Where reading resumes after retention removed ``offset``: the stream's new
        start, or DataLossError when failOnDataLoss."""
        bounds = stream_bounds(client, self.stream)
        if bounds.start <= offset:
            raise exc
        if self.fail_on_data_loss:
            raise DataLossError(
                f"stream {self.stream}: offsets {offset}..{bounds.start - 1} were "
                f"removed by retention before they were read ({exc}); set "
                "failOnDataLoss=false to skip them"
            ) from None
        return bounds.start

    def _batches(self, client: Client, offset: int) -> Iterator[pa.RecordBatch]:
        meta: _Metadata | None = None
        runs = _metadata_runs(client, self.stream, offset, self.end)
        # One read in flight while the previous page becomes Arrow: the socket and the
        # server work while this thread converts.
        pending = self._fetch(client, offset)
        while offset < self.end:
            try:
                result = pending.result()
            except InvalidOffset as exc:
                offset = self._after_data_loss(client, offset, exc)
                meta = None
                runs = _metadata_runs(client, self.stream, offset, self.end)
                pending = self._fetch(client, offset)
                continue
            except StreamNotFound:
                raise DataLossError(f"stream {self.stream} was deleted while read") from None
            count = min(result.events.count, self.end - offset)
            if count <= 0:
                raise DataLossError(
                    f"stream {self.stream} ends at {result.next_offset}, "
                    f"before offset {self.end} that was planned"
                )
            next_offset = offset + count
            if next_offset < self.end:
                pending = self._fetch(client, next_offset)
            if meta is None:
                meta = _Metadata(runs.result())
            values = _binary_values(result.events).slice(0, count)
            position, stamps = meta.columns(offset, count)
            yield self._record_batch(_counting(offset, count), values, position, stamps)
            offset = next_offset

    def _fetch(self, client: Client, offset: int) -> Future[RawReadResult]:
        return client.submit(client.aio.read_batch(self.stream, offset, READ_BYTES))

    def _record_batch(
        self, offsets: pa.Array, values: pa.Array, position: pa.Array, stamps: pa.Array
    ) -> pa.RecordBatch:
        """Spark's columns for consecutive events: their offsets, values, log positions
        and timestamps (µs, int64 or timestamp)."""
        count = len(values)
        columns: dict[str, pa.Array] = {
            "key": pa.nulls(count, pa.binary()),
            "stream": pa.repeat(pa.scalar(self.stream, pa.string()), count),
            "partition": pa.repeat(pa.scalar(0, pa.int32()), count),
            "offset": offsets,
            "timestamp": stamps.cast(pa.timestamp("us", tz="UTC")),
            "timestampType": pa.repeat(pa.scalar(TIMESTAMP_TYPE_LOG_APPEND, pa.int32()), count),
            "position": position,
            "headers": pa.nulls(
                count, pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
            ),
        }
        if self.value_format == "raw":
            columns["value"] = values
        else:
            parsed = self._parse(offsets[0].as_py(), values)
            for name in parsed.column_names:
                columns[name] = parsed.column(name).combine_chunks()
        arrays = [columns[f.name].cast(f.type) for f in self.schema]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    def _parse(self, first: int, values: pa.Array) -> pa.Table:
        fields = [f for f in self.schema if f.name not in _META_COLUMNS]
        value_schema = pa.schema(fields)
        data = pa.BufferReader(_lines(values))
        where = f"stream {self.stream} offsets {first}..{first + len(values) - 1}"
        try:
            if self.value_format == "json":
                table = pa_json.read_json(
                    data,
                    parse_options=pa_json.ParseOptions(
                        explicit_schema=value_schema,
                        unexpected_field_behavior="ignore",
                        newlines_in_values=True,
                    ),
                )
            else:
                table = pa_csv.read_csv(
                    data,
                    read_options=pa_csv.ReadOptions(column_names=value_schema.names),
                    parse_options=pa_csv.ParseOptions(ignore_empty_lines=False),
                    convert_options=pa_csv.ConvertOptions(
                        column_types=value_schema, strings_can_be_null=True
                    ),
                )
        except pa.ArrowInvalid as exc:
            raise ValueError(f"{where}: values are not {self.value_format}: {exc}") from None
        if table.num_rows != len(values):
            raise ValueError(
                f"{where}: {len(values)} events gave {table.num_rows} {self.value_format} rows"
            )
        return table


_HEADERS_TYPE = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
_META_COLUMNS = frozenset(
    ("key", "stream", "partition", "offset", "timestamp", "timestampType", "position", "headers")
)


@dataclass
class WriteResult:
    events: int = 0
    appends: int = 0


def _values(batch: pa.RecordBatch) -> list[bytes]:
    column = batch.column("value")
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        column = column.cast(pa.binary())
    if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        raise UsageError(f"column value must be STRING or BINARY, not {column.type}")
    if column.null_count:
        raise UsageError("column value has nulls: every event needs a value")
    values: list[bytes] = column.to_pylist()
    return values


def check_write_columns(names: Sequence[str]) -> None:
    if "value" not in names:
        raise UsageError(
            "writing to a headwater stream needs a column named value (STRING or BINARY); "
            f"the columns are {', '.join(names)}"
        )
    carried = [n for n in ("key", "headers") if n in names]
    if carried:
        raise UsageError(
            f"column(s) {', '.join(carried)}: the Kimberlite protocol stores event values "
            "only; select the value column (and encode keys or headers into it)"
        )


class IdempotentAppender:
    """Appends a task's rows so that running the task again appends nothing new.

    Producer ids come from ``(job, partition, chunk // SEQUENCES_PER_PRODUCER)`` and the
    sequence is the chunk's place within its producer, so a retry sends the same
    (producer, sequence) pairs and the server answers them from its producer table.
    """

    def __init__(self, conn: ConnectionOptions, stream: str, job: str, partition: int) -> None:
        self.conn = conn
        self.stream = stream
        self.job = job
        self.partition = partition

    def append(self, batches: Iterator[pa.RecordBatch]) -> WriteResult:
        from .options import producer_id

        result = WriteResult()
        chunk = 0
        with open_client(self.conn) as client:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                check_write_columns(batch.schema.names)
                for events in split_events(_values(batch)):
                    group, sequence = divmod(chunk, SEQUENCES_PER_PRODUCER)
                    producer = producer_id(self.job, self.partition, group)
                    _, count = client.append_idempotent(self.stream, producer, sequence, events)
                    result.events += count
                    result.appends += 1
                    chunk += 1
        return result
