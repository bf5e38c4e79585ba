"""What executors and the driver do against the server: the partitions of a stream and
their bounds, reading an offset range of one partition as Arrow record batches, and
idempotent appends placed by partition.

Runs wherever Spark puts it: each call opens its own connection with the blocking SDK
(and its keep-alive connection to the server's HTTP API, found through the Handshake).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json

from headwater.client import Client, connect
from headwater.client.arrow import HttpApi, append_pieces, by_partition, data_bytes
from headwater.client.errors import ServerUnavailable
from headwater.client.results import QueryResult, RawReadResult
from headwater.engine.partitioner import murmur2_spans
from headwater.errors import InvalidOffset, StreamNotFound, UsageError
from headwater.protocols.kimberlite.messages import EventBatch, http_port

from .options import READ_COMMITTED, ConnectionOptions, DataLossError, producer_id

log = logging.getLogger(__name__)

READ_BYTES = 8 << 20
TIMESTAMP_TYPE_CREATE = 0  # Kafka's CreateTime: the producer's timestamp
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
    """Partition 0's bounds over Kimberlite alone (for a server without the HTTP API)."""
    try:
        end = client.stream_info(stream).next_offset
    except StreamNotFound:
        raise UsageError(f"stream {stream} does not exist on {client.address}") from None
    first = client.query(f'SELECT min("offset") FROM {_quote(stream)}').scalar()
    start = end if first is None else int(str(first))
    return Bounds(min(start, end), end)


@dataclass(frozen=True)
class StreamPartitions:
    """A stream's partitions as a reader plans them: each one's bounds (its end is the
    last stable offset under read_committed, the committed end under read_uncommitted)
    and Kafka's timestamp type of the stream."""

    bounds: tuple[Bounds, ...]
    timestamp_type: int = TIMESTAMP_TYPE_LOG_APPEND
    over_http: bool = True  # False: Kimberlite only, which knows partition 0 alone


def stream_partitions(client: Client, stream: str, isolation: str) -> StreamPartitions:
    """Every partition of ``stream`` from the server's HTTP API; a server without it is
    read over Kimberlite, partition 0 only (a warning says so)."""
    try:
        api = client.http_api()
    except ServerUnavailable as exc:
        log.warning("%s; reading partition 0 of %s over Kimberlite only", exc, stream)
        return StreamPartitions((stream_bounds(client, stream),), over_http=False)
    with api:
        try:
            info = api.stream(stream)
        except StreamNotFound:
            raise UsageError(f"stream {stream} does not exist on {client.address}") from None
        except ServerUnavailable as exc:
            log.warning("%s; reading partition 0 of %s over Kimberlite only", exc, stream)
            return StreamPartitions((stream_bounds(client, stream),), over_http=False)

    # read_uncommitted stops at the high watermark (a cluster's; next_offset elsewhere,
    # and from a server too old to send it).
    def end_of(p: dict[str, Any]) -> int:
        if isolation == READ_COMMITTED:
            return int(p["last_stable_offset"])
        return int(p.get("high_watermark", p["next_offset"]))

    bounds = tuple(Bounds(int(p["start_offset"]), end_of(p)) for p in info["partition_offsets"])
    create_time = info["settings"].get("timestamp_type", "CreateTime") == "CreateTime"
    return StreamPartitions(
        bounds, TIMESTAMP_TYPE_CREATE if create_time else TIMESTAMP_TYPE_LOG_APPEND
    )


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
    """Reads offsets [start, end) of one partition of a stream into record batches of
    ``schema``."""

    conn: ConnectionOptions
    stream: str
    start: int
    end: int
    fail_on_data_loss: bool
    value_format: str
    schema: Any  # pa.Schema of the Spark columns
    partition: int = 0
    isolation: str = READ_COMMITTED
    timestamp_type: int = TIMESTAMP_TYPE_LOG_APPEND

    def batches(self, *, via_http: bool = True) -> Iterator[pa.RecordBatch]:
        """The range's rows. Columnar from the server's HTTP API when the Handshake
        advertises it (the partition's records with keys and headers, no work per event
        on either side), else (or when that API cannot be reached) pages of ReadEvents
        over the Kimberlite connection, which knows partition 0 and no keys."""
        with open_client(self.conn) as client:
            if via_http and http_port(client.capabilities) is not None:
                yielded = False
                try:
                    for batch in self._http_batches(client):
                        yielded = True
                        yield batch
                    return
                except ServerUnavailable as exc:
                    if yielded or self.partition != 0:
                        raise
                    log.warning("%s; reading over Kimberlite instead", exc)
            if self.partition != 0:
                raise ServerUnavailable(
                    f"partition {self.partition} of {self.stream} is read over the server's "
                    "HTTP API, which it does not advertise"
                )
            yield from self._batches(client, self.start)

    def _http_batches(self, client: Client) -> Iterator[pa.RecordBatch]:
        offset = self.start
        while offset < self.end:
            try:
                for part in client.read_arrow(
                    self.stream,
                    offset,
                    self.end,
                    partition=self.partition,
                    records=True,
                    isolation=self.isolation,
                ):
                    if part.num_rows:
                        offsets, position, stamps, values, keys, headers = part.columns
                        yield self._record_batch(offsets, values, position, stamps, keys, headers)
                        offset = offsets[-1].as_py() + 1
                # The server answers every record of the range that the isolation shows;
                # markers and aborted transactions leave gaps at its end, a partition
                # that ends before it (deleted and made again, say) is data loss.
                if offset < self.end:
                    bounds = stream_partitions(client, self.stream, self.isolation).bounds
                    end = bounds[self.partition].end if self.partition < len(bounds) else 0
                    if end < self.end:
                        raise DataLossError(
                            f"stream {self.stream} partition {self.partition} ends at {end}, "
                            f"before offset {self.end} that was planned"
                        )
                return
            except InvalidOffset as exc:
                offset = self._after_data_loss(client, offset, exc)
            except StreamNotFound:
                raise DataLossError(f"stream {self.stream} was deleted while read") from None

    def _after_data_loss(self, client: Client, offset: int, exc: InvalidOffset) -> int:
        """Where reading resumes after retention removed ``offset``: the partition's new
        start, or DataLossError when failOnDataLoss."""
        if self.partition == 0 and http_port(client.capabilities) is None:
            start = stream_bounds(client, self.stream).start
        else:
            start = (
                stream_partitions(client, self.stream, self.isolation).bounds[self.partition].start
            )
        if start <= offset:
            raise exc
        if self.fail_on_data_loss:
            where = f"stream {self.stream}" + (
                f" partition {self.partition}" if self.partition else ""
            )
            raise DataLossError(
                f"{where}: offsets {offset}..{start - 1} were removed by retention before "
                f"they were read ({exc}); set failOnDataLoss=false to skip them"
            ) from None
        return start

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
            if count <= 0 and not result.at_end and result.next_offset > offset:
                # From inside a hole in the offsets (compaction, a transaction's marker or
                # aborted batch): the server names the next offset present
                # (docs/protocols/kimberlite.md, ReadEvents over compacted streams).
                offset = result.next_offset
                if offset < self.end:
                    pending = self._fetch(client, offset)
                continue
            if count <= 0 and client.stream_info(self.stream).next_offset >= self.end:
                return  # the range ends in a hole (a marker, say): it is all read
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
        self,
        offsets: pa.Array,
        values: pa.Array,
        position: pa.Array,
        stamps: pa.Array,
        keys: pa.Array | None = None,
        headers: pa.Array | None = None,
    ) -> pa.RecordBatch:
        """Spark's columns for events of the partition: their offsets, values, log
        positions, timestamps (µs, int64 or timestamp), keys and headers (None: none)."""
        count = len(values)
        columns: dict[str, pa.Array] = {
            "key": pa.nulls(count, pa.binary()) if keys is None else keys,
            "stream": pa.repeat(pa.scalar(self.stream, pa.string()), count),
            "partition": pa.repeat(pa.scalar(self.partition, pa.int32()), count),
            "offset": offsets,
            "timestamp": stamps.cast(pa.timestamp("us", tz="UTC")),
            "timestampType": pa.repeat(pa.scalar(self.timestamp_type, pa.int32()), count),
            "position": position,
            "headers": pa.nulls(count, _HEADERS_TYPE) if headers is None else headers,
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


WRITE_COLUMNS = ("value", "key", "headers", "partition")


def check_write_schema(schema: pa.Schema) -> None:
    """Refuse, before any task runs, columns the sink cannot write: ``value`` (STRING or
    BINARY) is required; ``key`` (STRING or BINARY), ``headers`` (ARRAY<STRUCT<key
    STRING, value BINARY>>) and ``partition`` (an integer) are optional; other columns
    are not written (as Spark's Kafka sink)."""
    names = schema.names
    if "value" not in names:
        raise UsageError(
            "writing to a headwater stream needs a column named value (STRING or BINARY); "
            f"the columns are {', '.join(names)}"
        )
    for name in ("value", "key"):
        if name in names and not _is_bytes(schema.field(name).type):
            kind = schema.field(name).type
            raise UsageError(f"column {name} must be STRING or BINARY, not {kind}")
    if "partition" in names and not pa.types.is_integer(schema.field("partition").type):
        kind = schema.field("partition").type
        raise UsageError(f"column partition must be an integer, not {kind}")
    if "headers" in names:
        kind = schema.field("headers").type
        if not (
            pa.types.is_list(kind)
            and pa.types.is_struct(kind.value_type)
            and [f.name for f in kind.value_type] == ["key", "value"]
            and pa.types.is_string(kind.value_type.field("key").type)
            and _is_bytes(kind.value_type.field("value").type)
        ):
            raise UsageError(
                f"column headers must be ARRAY<STRUCT<key: STRING, value: BINARY>>, not {kind}"
            )


def _is_bytes(kind: pa.DataType) -> bool:
    return bool(
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    )


def _write_batch(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The columns an append carries, as the HTTP API takes them: ``value`` and ``key``
    binary, ``headers`` as stored."""
    check_write_schema(batch.schema)
    value = batch.column("value").cast(pa.binary())
    if value.null_count:
        raise UsageError("column value has nulls: every event needs a value")
    columns = {"value": value}
    # Kept when all NULL too: every batch of a task has the same columns (the server
    # stores a batch without keys or headers when they are all NULL).
    if "key" in batch.schema.names:
        columns["key"] = batch.column("key").cast(pa.binary())
    if "headers" in batch.schema.names:
        columns["headers"] = batch.column("headers").cast(_HEADERS_TYPE)
    return pa.RecordBatch.from_pydict(columns)


def murmur2_column(items: pa.Array) -> np.ndarray:
    """Kafka's murmur2 (uint32) of every item of a binary array without nulls, over
    its buffers as they are (no Python object per key)."""
    count = len(items)
    offsets = np.frombuffer(items.buffers()[1], np.int32, count + 1, items.offset * 4)
    data = items.buffers()[2]
    return murmur2_spans(b"" if data is None else memoryview(data), offsets)


def place(batch: pa.RecordBatch, partitions: int, sticky: int) -> np.ndarray:
    """The stream partition of each row, as the engine's partitioner places events: the
    row's ``partition`` when set (it must exist), else Kafka's ``murmur2(key)`` modulo the
    count when it has a key, else ``sticky`` (one partition for the whole batch, which
    the caller rotates batch by batch: a rerun of the task places every row again where
    it went the first time, which exactly-once needs)."""
    rows = batch.num_rows
    target = np.full(rows, sticky, np.int64)
    names = batch.schema.names
    if "key" in names:
        key = batch.column("key").cast(pa.binary())
        if key.null_count < rows:
            keyed = np.flatnonzero(pc.is_valid(key).to_numpy(zero_copy_only=False))
            hashes = murmur2_column(key.take(pa.array(keyed)))
            target[keyed] = (hashes & 0x7FFFFFFF).astype(np.int64) % partitions
    if "partition" in names:
        explicit = batch.column("partition")
        if explicit.null_count < rows:
            named = np.flatnonzero(pc.is_valid(explicit).to_numpy(zero_copy_only=False))
            chosen = explicit.take(pa.array(named)).to_numpy(zero_copy_only=False).astype(np.int64)
            bad = chosen[(chosen < 0) | (chosen >= partitions)]
            if len(bad):
                raise UsageError(
                    f"column partition: partition {int(bad[0])} does not exist; the stream has "
                    f"{partitions} (0..{partitions - 1})"
                )
            target[named] = chosen
    return target


class PartitionedAppender:
    """Appends a task's rows to the stream's partitions so that running the task again
    appends nothing new.

    Each row goes to its partition (:func:`place`). A partition's rows are gathered
    across input batches and sent as full Arrow appends (``POST
    /api/streams/{name}/arrow``) of an append's limits (10,000 rows or 4 MiB of values
    and keys, :data:`GATHER_ROWS` / :data:`GATHER_BYTES`), cut from the partition's rows
    in order; what is left goes when the input ends.
    The n-th append to stream partition p is sent by producer ``(job, task partition,
    p, n // SEQUENCES_PER_PRODUCER)`` with sequence ``n % SEQUENCES_PER_PRODUCER``, so a
    rerun sends the same (producer, sequence) pairs with the same rows first, and the
    server answers them from the partition's producer table instead of appending.

    When a task fails, Spark ends the writer's input early, at a batch boundary, as
    though it were complete, so the failed attempt's last append to a partition may
    hold only the first rows of the rerun's append of the same sequence (the rows are
    gathered by the same rule from the same input, in the same order). The server
    answers that append as stored, with the failed attempt's smaller count: the rest of
    its rows then go as the partition's next append (:meth:`_Sender.append`). Every
    attempt numbers its appends the same way from the same answers, so a rerun of a
    rerun holds too.
    """

    def __init__(self, conn: ConnectionOptions, stream: str, job: str, partition: int) -> None:
        self.conn = conn
        self.stream = stream
        self.job = job
        self.partition = partition  # the Spark task's

    def append(self, batches: Iterator[pa.RecordBatch]) -> WriteResult:
        with open_client(self.conn) as client, client.http_api() as api:
            try:
                partitions = int(api.stream(self.stream)["partitions"])
            except StreamNotFound:
                raise UsageError(f"stream {self.stream} does not exist on {api.address}") from None
            senders = [
                _Sender(client.http_api(), self.stream, p, self.job, self.partition)
                for p in range(partitions)
            ]
            try:
                self._place_and_send(batches, senders)
                for sender in senders:
                    sender.drain()
            finally:
                for sender in senders:
                    sender.close()
        result = WriteResult()
        for sender in senders:
            result.events += sender.events
            result.appends += sender.appends
        return result

    def _place_and_send(self, batches: Iterator[pa.RecordBatch], senders: list[_Sender]) -> None:
        partitions = len(senders)
        sticky = self.partition % partitions
        for batch in batches:
            if batch.num_rows == 0:
                continue
            target = place(batch, partitions, sticky)
            sticky = (sticky + 1) % partitions
            for p, part in by_partition(_write_batch(batch), target):
                senders[p].gather(part)
        for sender in senders:
            sender.flush()


GATHER_ROWS = 10_000  # a partition's rows are sent once this many are gathered ...
GATHER_BYTES = 4 << 20  # ... or this many bytes of values and keys (an append's limits)


class _Sender:
    """One stream partition's rows: gathered, then sent in order by a thread of their
    own over a connection of their own, so the task goes on placing rows while appends
    are in flight and the partitions' appends (and the server's fsyncs of them) overlap.
    At most ``IN_FLIGHT`` appends wait per partition; an error is raised by the next
    send. Sequences are given in the thread, in order, as appends are sent."""

    IN_FLIGHT = 2

    def __init__(self, api: HttpApi, stream: str, partition: int, job: str, task: int) -> None:
        self.api = api
        self.stream = stream
        self.partition = partition
        self.job = job
        self.task = task
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.in_flight: deque[Future[None]] = deque()
        self.gathered: list[pa.RecordBatch] = []
        self.gathered_rows = self.gathered_bytes = 0
        self.sent = 0  # appends sent (the next one's number), in the thread
        self.events = 0
        self.appends = 0

    def gather(self, rows: pa.RecordBatch) -> None:
        self.gather_rows(rows)
        if self.gathered_rows >= GATHER_ROWS or self.gathered_bytes >= GATHER_BYTES:
            self.flush(last=False)  # full appends; the rest keeps gathering

    def gather_rows(self, rows: pa.RecordBatch) -> None:
        self.gathered.append(rows)
        self.gathered_rows += rows.num_rows
        self.gathered_bytes += data_bytes(rows)

    def flush(self, *, last: bool = True) -> None:
        """Send what is gathered as appends within the limits; unless it is the
        ``last`` flush, the final piece (not full) stays gathered for the next."""
        if not self.gathered:
            return
        rows = pa.Table.from_batches(self.gathered).combine_chunks().to_batches()[0]
        self.gathered, self.gathered_rows, self.gathered_bytes = [], 0, 0
        pieces = list(append_pieces(rows))
        if not last:
            self.gather_rows(pieces.pop())
        for piece in pieces:
            while len(self.in_flight) >= self.IN_FLIGHT:
                self.in_flight.popleft().result()
            self.in_flight.append(self.pool.submit(self.append, piece))

    def append(self, rows: pa.RecordBatch) -> None:
        """Send ``rows`` as the partition's next append; when the server answers with
        fewer rows stored (a failed attempt sent only their first rows under this
        sequence), the rest as the append after it. (The server never answers 0.)"""
        while rows.num_rows:
            group, sequence = divmod(self.sent, SEQUENCES_PER_PRODUCER)
            producer = (producer_id(self.job, self.task, self.partition, group), sequence)
            answer = self.api.append_arrow(
                self.stream, rows, partition=self.partition, producer=producer
            )
            self.sent += 1
            # More stored than sent: an earlier attempt got further before its input
            # ended; these rows are the first of what it stored (this attempt's input
            # ended earlier still, so nothing follows them here).
            stored = min(int(answer["count"]), rows.num_rows)
            self.events += stored
            self.appends += 1
            rows = rows.slice(stored)

    def drain(self) -> None:
        while self.in_flight:
            self.in_flight.popleft().result()

    def close(self) -> None:
        for future in self.in_flight:
            future.cancel()
        self.pool.shutdown(wait=True)
        self.api.close()
