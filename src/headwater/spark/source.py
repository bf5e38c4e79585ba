"""The ``headwater`` format for Spark's Python Data Source API (pyspark >= 4.2: admission
control, ``latestOffset(start, limit)`` and Trigger.AvailableNow for Python sources).

Only picklable options live in these objects: Spark ships readers and writers to executors,
and every executor task connects to the server itself (see :mod:`.streams`).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from headwater.client import Client
from headwater.errors import StreamAlreadyExists, UsageError

from .kind_writer import ROWS_PER_BATCH, KindWriteOptions, batch_job_sequence, write_rows
from .kinds import EARLIEST as EARLIEST_POSITION
from .kinds import LATEST as LATEST_POSITION
from .kinds import (
    KindReadOptions,
    changes_end,
    changes_partition_count,
    kind_columns,
    partition_count,
    read_changes,
    read_share,
    schema_ddl,
)
from .options import (
    EARLIEST,
    LATEST,
    ConnectionOptions,
    DataLossError,
    Offsets,
    ReadOptions,
    WriteOptions,
    limit_offsets,
    offsets_from_json,
    offsets_json,
    split_range,
)
from .streams import (
    TIMESTAMP_TYPE_LOG_APPEND,
    PartitionedAppender,
    RangeReader,
    check_write_schema,
    open_client,
    stream_partitions,
)

P = ParamSpec("P")

FORMAT = "headwater"
BATCH_ID_PROPERTY = "streaming.sql.batchId"
QUERY_ID_PROPERTY = "sql.streaming.queryId"  # the id kept in the checkpoint


class HeadwaterDataSource(DataSource):
    """``spark.read.format("headwater")`` and friends; see docs/spark.md."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def _kind_options(self) -> KindReadOptions | None:
        lowered = {str(k).lower(): str(v) for k, v in self.options.items()}
        return KindReadOptions.parse(lowered) if "kind" in lowered else None

    def schema(self) -> str:
        kind = self._kind_options()
        if kind is not None:
            with open_client(kind.connection) as client:
                return schema_ddl(kind_columns(client, kind))
        return ReadOptions.parse(self.options).schema_ddl()

    def reader(self, schema: StructType) -> DataSourceReader:
        kind = self._kind_options()
        if kind is not None:
            return HeadwaterKindReader(kind, schema)
        return HeadwaterBatchReader(ReadOptions.parse(self.options), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        kind = self._kind_options()
        if kind is not None:
            if kind.as_of is not None:
                raise UsageError(
                    "option asOf reads a kind's state in batch; a streaming read starts "
                    "at startingPosition"
                )
            return HeadwaterKindChangesReader(kind, schema)
        return HeadwaterStreamReader(ReadOptions.parse(self.options), schema)

    def _kind_write_options(self, schema: StructType) -> KindWriteOptions | None:
        lowered = {str(k).lower(): str(v) for k, v in self.options.items()}
        if "kind" not in lowered:
            return None
        options = KindWriteOptions.parse(lowered)
        options.ripple_schema(_arrow_schema(schema))  # a bad schema fails before any task
        if options.ripple_server is None:
            # Here, on the driver: the tasks get the Ripple address as a plain option.
            with open_client(options.connection) as client:
                options = options.with_ripple_server(client.capabilities)
        return options

    def writer(
        self, schema: StructType, overwrite: bool
    ) -> HeadwaterBatchWriter | HeadwaterKindBatchWriter:
        micro_batch = _micro_batch(self.options)
        kind = self._kind_write_options(schema)
        if kind is not None:
            if micro_batch is not None:  # inside foreachBatch: as the streaming writer
                query_id, batch_id = micro_batch
                return HeadwaterKindBatchWriter(
                    kind, batch_id * ROWS_PER_BATCH + 1, f"spark/{kind.kind}/{query_id}"
                )
            first = batch_job_sequence(time.time_ns() // 10**6)
            return HeadwaterKindBatchWriter(kind, first, f"spark/{kind.kind}")
        options = WriteOptions.parse(self.options)
        _prepare_write(options, schema)
        if micro_batch is not None:
            return HeadwaterBatchWriter(options, job=f"{micro_batch[0]}/{micro_batch[1]}")
        return HeadwaterBatchWriter(options, job=uuid.uuid4().hex)

    def streamWriter(
        self, schema: StructType, overwrite: bool
    ) -> HeadwaterStreamWriter | HeadwaterKindStreamWriter:
        kind = self._kind_write_options(schema)
        if kind is not None:
            return HeadwaterKindStreamWriter(kind)
        options = WriteOptions.parse(self.options)
        _prepare_write(options, schema)
        return HeadwaterStreamWriter(options)


def _micro_batch(options: Any) -> tuple[str, int] | None:
    """Options queryId and batchId: a batch write inside ``foreachBatch`` that numbers
    what it sends as the streaming writer does for that query and batch, so the batch run
    again after a failure or restart changes nothing twice."""
    lowered = {str(k).lower(): str(v) for k, v in options.items()}
    query_id, batch_id = lowered.get("queryid"), lowered.get("batchid")
    if query_id is None and batch_id is None:
        return None
    if not query_id or batch_id is None or not batch_id.isdigit():
        raise UsageError(
            "options queryId and batchId go together: the streaming query's id and the "
            "micro-batch id (a non-negative integer) that foreachBatch was given"
        )
    return query_id, int(batch_id)


def _prepare_write(options: WriteOptions, schema: StructType) -> None:
    check_write_schema(_arrow_schema(schema))
    if not options.create:
        return
    with open_client(options.connection) as client, contextlib.suppress(StreamAlreadyExists):
        client.create_stream(options.stream)


@dataclass(frozen=True)
class OffsetRange(InputPartition):
    """Offsets [start, end) of one partition of a stream: one Spark partition (a long
    range is split into several, maxOffsetsPerPartition)."""

    stream: str
    partition: int
    start: int
    end: int
    timestamp_type: int = TIMESTAMP_TYPE_LOG_APPEND
    # A partition the stream gained after the query started is read from its first
    # stored offset, as Spark's Kafka source does: what retention removed is no loss.
    from_first_stored: bool = False


def _arrow_schema(schema: StructType) -> pa.Schema:
    return to_arrow_schema(schema, timezone="UTC")


def _read(options: ReadOptions, schema: StructType, part: OffsetRange) -> Iterator[pa.RecordBatch]:
    reader = RangeReader(
        options.connection,
        part.stream,
        part.start,
        part.end,
        options.fail_on_data_loss and not part.from_first_stored,
        options.value_format,
        _arrow_schema(schema),
        partition=part.partition,
        isolation=options.isolation,
        timestamp_type=part.timestamp_type,
    )
    return reader.batches()


def _resolve(spec: int, start: int, end: int, where: str, name: str) -> int:
    if spec == EARLIEST:
        return start
    if spec == LATEST:
        return end
    if spec > end:
        raise UsageError(f"{name} offset {spec} of {where} is past its end ({end})")
    return spec


def _where(stream: str, partition: int) -> str:
    return f"stream {stream} partition {partition}"


Key = tuple[str, int]  # (stream, partition)


def _flat(offsets: Offsets) -> dict[Key, int]:
    return {(s, p): o for s, parts in offsets.items() for p, o in parts.items()}


def _nested(flat: dict[Key, int]) -> Offsets:
    out: Offsets = {}
    for (stream, partition), offset in flat.items():
        out.setdefault(stream, {})[partition] = offset
    return out


class HeadwaterBatchReader(DataSourceReader):
    def __init__(self, options: ReadOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema

    def partitions(self) -> Sequence[InputPartition]:
        """One or more Spark partitions per stream partition (as Spark's Kafka source),
        so the partitions are read in parallel."""
        parts: list[InputPartition] = []
        options = self.options
        with open_client(options.connection) as client:
            for stream in options.streams:
                found = stream_partitions(client, stream, options.isolation)
                ends = (  # the two ends of the range read, each with its option
                    (options.starting[stream], "startingOffsets"),
                    (options.ending[stream], "endingOffsets"),
                )
                for offsets, option in ends:
                    offsets.check(stream, len(found.bounds), option)
                for partition, bounds in enumerate(found.bounds):
                    where = _where(stream, partition)
                    start, end = (
                        _resolve(offsets.at(partition), bounds.start, bounds.end, where, option)
                        for offsets, option in ends
                    )
                    if start > end:
                        # As Spark's Kafka source: a range backwards is the options'
                        # mistake, not an empty read (it read nothing, silently).
                        raise UsageError(
                            f"{where}: startingOffsets {start} is past endingOffsets {end}"
                        )
                    if start < bounds.start:
                        if options.fail_on_data_loss:
                            raise DataLossError(
                                f"{where}: offsets {start}..{bounds.start - 1} were removed "
                                "by retention; set failOnDataLoss=false to skip them"
                            )
                        start = bounds.start
                    for a, b in split_range(start, end, options.split):
                        parts.append(OffsetRange(stream, partition, a, b, found.timestamp_type))
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, OffsetRange):
            # No offsets to read (an empty stream, or start == end): Spark runs one task
            # with a placeholder InputPartition(None) instead of none.
            return iter(())
        return _read(self.options, self.schema, partition)


def _read_kind(
    options: KindReadOptions,
    schema: StructType,
    read: Callable[Concatenate[Client, KindReadOptions, pa.Schema, P], Iterator[pa.RecordBatch]],
    *args: P.args,
    **kwargs: P.kwargs,
) -> Iterator[pa.RecordBatch]:
    """A task's share of a kind (``read``: its state or its changes), on a client of its
    own."""
    with open_client(options.connection) as client:
        yield from read(client, options, _arrow_schema(schema), *args, **kwargs)


@dataclass(frozen=True)
class KindShare(InputPartition):
    index: int
    parts: int


class HeadwaterKindReader(DataSourceReader):
    """A kind's state, split by entity id hash; each task asks the server for its share."""

    def __init__(self, options: KindReadOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema

    def partitions(self) -> Sequence[InputPartition]:
        with open_client(self.options.connection) as client:
            parts = partition_count(client, self.options, len(self.schema.fields))
        return [KindShare(i, parts) for i in range(parts)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KindShare)
        return _read_kind(self.options, self.schema, read_share, partition.index, partition.parts)


@dataclass(frozen=True)
class ChangesShare(InputPartition):
    start: int
    end: int
    index: int
    parts: int


class HeadwaterKindChangesReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A kind's changelog as a stream; offsets are ``{"position": N}`` (see .kinds). The
    driver-side client is made on first use and never pickled."""

    def __init__(self, options: KindReadOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema
        self._client: Any = None
        self._target: int | None = None  # Trigger.AvailableNow: the end fixed at start
        self._initial: int | None = None  # the starting position, resolved once

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None
        return state

    def _end(self) -> int:
        if self._client is None or self._client.closed:
            self._client = open_client(self.options.connection)
        return changes_end(self._client, self.options)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._end()

    def initialOffset(self) -> dict[str, Any]:
        # Spark asks at every trigger until the first batch is in its log, and again when
        # that batch runs: "latest" is resolved once, or an append in between is skipped.
        if self._initial is None:
            starting = self.options.starting
            if starting == EARLIEST_POSITION:
                self._initial = 0
            elif starting == LATEST_POSITION:
                self._initial = self._end()
            else:
                self._initial = int(starting)
        return {"position": self._initial}

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        end = max(self._end(), int(start["position"]))
        if self._target is not None:
            end = min(end, max(self._target, int(start["position"])))
        return {"position": end}

    def reportLatestOffset(self) -> dict[str, Any]:
        return {"position": self._end()}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        lo, hi = int(start["position"]), int(end["position"])
        if hi <= lo:
            return []
        if self._client is None or self._client.closed:
            self._client = open_client(self.options.connection)
        parts = changes_partition_count(self._client, self.options, len(self.schema.fields), lo, hi)
        return [ChangesShare(lo, hi, i, parts) for i in range(parts)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, ChangesShare)
        span = (partition.start, partition.end)
        return _read_kind(
            self.options, self.schema, read_changes, span, partition.index, partition.parts
        )

    def commit(self, end: dict[str, Any]) -> None:
        pass  # nothing is held server-side: Spark's checkpoint has the position

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class HeadwaterStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch reads; offsets are ``{stream: {partition: offset}}`` as Spark's Kafka
    source keeps them. The driver-side client is made on first use and never pickled."""

    def __init__(self, options: ReadOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema
        self._client: Any = None
        self._target: dict[Key, int] | None = None  # Trigger.AvailableNow: ends fixed at start
        self._initial: dict[Key, int] | None = None  # the starting offsets, resolved once
        self._timestamp_types: dict[str, int] = {}

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = {k: b for k, (_, b) in self._bounds().items()}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None
        return state

    def _bounds(self) -> dict[Key, tuple[int, int]]:
        """(first stored, end) of every partition of every stream read."""
        if self._client is None or self._client.closed:
            self._client = open_client(self.options.connection)
        result: dict[Key, tuple[int, int]] = {}
        for stream in self.options.streams:
            found = stream_partitions(self._client, stream, self.options.isolation)
            self._timestamp_types[stream] = found.timestamp_type
            for partition, b in enumerate(found.bounds):
                result[(stream, partition)] = (b.start, b.end)
        return result

    def initialOffset(self) -> dict[str, Any]:
        # Spark asks at every trigger until the first batch is in its log, and again when
        # that batch runs: "latest" is resolved once, or an append in between is skipped.
        if self._initial is None:
            bounds = self._bounds()
            for stream in self.options.streams:
                count = sum(1 for s, _ in bounds if s == stream)
                self.options.starting[stream].check(stream, count, "startingOffsets")
            self._initial = {
                (s, p): _resolve(self.options.starting[s].at(p), a, b, _where(s, p), "start")
                for (s, p), (a, b) in bounds.items()
            }
        return offsets_json(_nested(self._initial))

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_offsets_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.options.max_offsets_per_trigger)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        bounds = self._bounds()
        begin = self._checked_start(_flat(offsets_from_json(start)), bounds)
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        latest = {k: b for k, (_, b) in bounds.items()}
        if self._target is not None:
            # A partition gained since AvailableNow started is not waited for.
            latest = {k: min(b, self._target.get(k, begin[k])) for k, b in latest.items()}
        return offsets_json(_nested(limit_offsets(begin, latest, max_rows)))

    def reportLatestOffset(self) -> dict[str, Any]:
        return offsets_json(_nested({k: b for k, (_, b) in self._bounds().items()}))

    def _checked_start(
        self, start: dict[Key, int], bounds: dict[Key, tuple[int, int]]
    ) -> dict[Key, int]:
        """Where reading really starts in each partition: past what retention removed,
        or DataLossError; a partition gained since the query started, at its first
        stored offset."""
        begin = {}
        for key, (first, _) in bounds.items():
            offset = start.get(key, first)
            if offset < first:
                if self.options.fail_on_data_loss:
                    raise DataLossError(
                        f"{_where(*key)}: offsets {offset}..{first - 1} were removed by "
                        "retention before the query read them; set failOnDataLoss=false "
                        "to skip them"
                    )
                offset = first
            begin[key] = offset
        return begin

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        begin, stop = _flat(offsets_from_json(start)), _flat(offsets_from_json(end))
        if not self._timestamp_types:
            self._bounds()
        parts: list[InputPartition] = []
        for key in sorted(stop):
            stream, partition = key
            new = key not in begin  # gained since the batch before: from its first offset
            kind = self._timestamp_types.get(stream, TIMESTAMP_TYPE_LOG_APPEND)
            for lo, hi in split_range(begin.get(key, 0), stop[key], self.options.split):
                parts.append(OffsetRange(stream, partition, lo, hi, kind, new))
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, OffsetRange)
        return _read(self.options, self.schema, partition)

    def commit(self, end: dict[str, Any]) -> None:
        pass  # nothing is held server-side for a query: Spark's checkpoint has the offsets

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


@dataclass(frozen=True)
class AppendCommit(WriterCommitMessage):
    partition: int
    events: int
    appends: int


def _task_partition() -> tuple[int, TaskContext | None]:
    context = TaskContext.get()
    return (context.partitionId() if context is not None else 0), context


class HeadwaterBatchWriter(DataSourceArrowWriter):
    """``df.write.format("headwater")``: a retried task re-sends the same (producer,
    sequence) pairs, which the server recognises, so nothing is appended twice."""

    def __init__(self, options: WriteOptions, job: str) -> None:
        self.options = options
        self.job = job  # made once on the driver: every attempt of a task shares it

    def write(self, iterator: Iterator[pa.RecordBatch]) -> AppendCommit:
        partition, _ = _task_partition()
        appender = PartitionedAppender(
            self.options.connection, self.options.stream, self.job, partition
        )
        result = appender.append(iterator)
        return AppendCommit(partition, result.events, result.appends)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        pass  # every append is durable when acknowledged

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        pass  # appends cannot be withdrawn; a rerun of the job is a new job id


class HeadwaterStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("headwater")``: producer ids come from (query id, batch id,
    partition), both kept in Spark's checkpoint, so a batch Spark runs again after a
    failure or a restart appends nothing twice."""

    def __init__(self, options: WriteOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[pa.RecordBatch]) -> AppendCommit:
        partition, query_id, batch_id = _streaming_task()
        job = f"{query_id}/{batch_id}"
        appender = PartitionedAppender(self.options.connection, self.options.stream, job, partition)
        result = appender.append(iterator)
        return AppendCommit(partition, result.events, result.appends)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        pass  # appends were durable when acknowledged

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        pass  # the rerun of this batch id re-sends the same (producer, sequence) pairs


@dataclass(frozen=True)
class KindCommit(WriterCommitMessage):
    partition: int
    rows: int


def _streaming_task() -> tuple[int, str, int]:
    """(partition, query id, batch id) of the running streaming task."""
    partition, context = _task_partition()
    if context is None:
        raise RuntimeError("the headwater stream writer runs only inside a Spark task")
    batch_id = context.getLocalProperty(BATCH_ID_PROPERTY)
    query_id = context.getLocalProperty(QUERY_ID_PROPERTY)
    if batch_id is None or query_id is None:
        raise RuntimeError(
            f"Spark did not pass {BATCH_ID_PROPERTY} / {QUERY_ID_PROPERTY} to the task"
        )
    return partition, query_id, int(batch_id)


class HeadwaterKindBatchWriter(DataSourceArrowWriter):
    """``df.write.format("headwater").option("kind", ...)``: rows become Ripple deltas
    from worker ``spark/<kind>/<partition>``, numbered from the job's first sequence
    number (stamped on the driver), so a retried task's deltas are dropped. Inside
    ``foreachBatch`` with options queryId and batchId: the streaming writer's workers and
    numbers (``spark/<kind>/<query id>/<partition>`` from batch id * 2**32 + 1)."""

    def __init__(self, options: KindWriteOptions, first_sequence: int, worker_prefix: str) -> None:
        self.options = options
        self.first_sequence = first_sequence  # every attempt of a task shares it
        self.worker_prefix = worker_prefix

    def write(self, iterator: Iterator[pa.RecordBatch]) -> KindCommit:
        partition, _ = _task_partition()
        worker = f"{self.worker_prefix}/{partition}"
        result = write_rows(self.options, iterator, worker, self.first_sequence)
        return KindCommit(partition, result.rows)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        pass  # every task checkpointed its deltas before it reported success

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        pass  # applied deltas stay; a rerun is a later job with higher numbers


class HeadwaterKindStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("headwater").option("kind", ...)``: worker
    ``spark/<kind>/<query id>/<partition>``, sequence numbers from the batch id up, so a batch
    run again after a failure or restart changes nothing twice."""

    def __init__(self, options: KindWriteOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[pa.RecordBatch]) -> KindCommit:
        partition, query_id, batch_id = _streaming_task()
        worker = f"spark/{self.options.kind}/{query_id}/{partition}"
        first = batch_id * ROWS_PER_BATCH + 1
        result = write_rows(self.options, iterator, worker, first_sequence=first)
        return KindCommit(partition, result.rows)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        pass  # every task checkpointed its deltas before it reported success

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        pass  # the rerun of this batch id re-sends the same (worker, sequence) pairs


def register(spark: Any) -> None:
    """Register the format with a SparkSession (installing the package does it too)."""
    spark.dataSource.register(HeadwaterDataSource)


__all__ = ["ConnectionOptions", "HeadwaterDataSource", "register"]
