"""SQL over a tenant's streams: Query, QueryAt and INSERT INTO (spec/PROTOCOLS.md §1).

Everything here is called on the engine's loop thread; DuckDB runs in worker threads.

* ``query`` reads your writes: it notes the tenant's next log position when it arrives
  (every acknowledged event lies below it) and waits, bounded, until the committed head
  and every projection of the tenant have passed it. It then reads a consistent prefix
  of the tenant log: the lowest position every projection covers (at least that one),
  so no event is seen without every earlier one.
* ``query_at(position)`` reads exactly the events below ``position``: beyond the committed
  head it is PositionAhead; a position some projection has not reached yet is
  ProjectionLag (retryable), without waiting.
* ``INSERT INTO <stream> ...`` evaluates its rows in DuckDB and appends them to the
  stream as one batch, answering ``rows_affected`` and ``log_offset`` (the first offset).

Every statement runs within :class:`~headwater.sql.limits.SqlLimits`: it waits for one of
``concurrency`` places (fairly per tenant), runs for at most ``timeout_ms`` and shares
DuckDB's memory (``memory_mib`` per running query, spilling to ``sql-spill/`` in the data
directory beyond it). A statement past a limit is QueryExecutionError naming the limit;
shutdown interrupts every running statement and refuses the queued ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from headwater.engine.engine import MAX_APPEND_BYTES, MAX_APPEND_EVENTS
from headwater.engine.transactions import stable_position
from headwater.errors import (
    CorruptBatchError,
    HeadwaterError,
    InvalidOffset,
    InvalidRequest,
    PositionAhead,
    ProjectionLag,
    QueryExecutionError,
    QueryParseError,
    StreamNotFound,
    TableNotFound,
)
from headwater.sql.duck import Database
from headwater.sql.limits import Deadline, FairQueue, SqlLimits
from headwater.sql.projection import ChunkBuilder, range_batches
from headwater.sql.statements import CATALOG_WORDS, InsertPlan, ParsedQuery, parse_query
from headwater.sql.tables import SqlTable, StreamTable, StreamTables, TableSource
from headwater.sql.values import (
    QueryResult,
    QueryValue,
    column_values,
    rows_from_columns,
    to_duckdb_param,
)

if TYPE_CHECKING:
    from headwater.engine.engine import Engine

log = logging.getLogger(__name__)
T = TypeVar("T")

INSERT_COLUMNS = ["rows_affected", "log_offset"]
POLL_SECONDS = 0.05
SPILL_DIRECTORY = "sql-spill"  # under the data directory: DuckDB's temp files


@dataclass(frozen=True, slots=True)
class _Rows:
    """An INSERT's evaluated rows, ready to append."""

    table: str
    values: list[bytes]


# Rows per Arrow batch taken from DuckDB while a result is measured against its bound.
_RESULT_BATCH_ROWS = 2048  # DuckDB's vector: a wide row makes a batch no bigger than it must
_INSERT_BATCH_ROWS = 256  # an INSERT's source is read this many rows at a time


# A result value's cost past its Arrow bytes: the Python object, its slot in the row,
# its share of the encoded answer (measured: 2.5 million rows of three BIGINTs, 60 MiB of
# Arrow, took an HTTP answer's server from 156 to 1,110 MiB).
_VALUE_BYTES = 100


class ResultTooLarge(QueryExecutionError):
    """A result past ``limits.sql_result_mib`` (a QueryExecutionError to clients)."""


def _table_error(exc: duckdb.Error) -> HeadwaterError:
    message = str(exc)
    if isinstance(exc, duckdb.ParserException):
        return QueryParseError(message)
    if isinstance(exc, duckdb.CatalogException) and "Table with name" in message:
        return TableNotFound(message)
    return QueryExecutionError(message)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """``callback`` on ``loop``'s thread, from any thread (nothing once the loop closed:
    the process is exiting)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)


class SqlService:
    """DuckDB over Arrow projections of every tenant's streams (and later kinds)."""

    def __init__(
        self,
        engine: Engine,
        *,
        limits: SqlLimits | None = None,
        on_limit: Callable[[str], None] | None = None,
        projection_workers: int = 2,
        read_timeout: float = 30.0,
    ) -> None:
        self.engine = engine
        self.read_timeout = read_timeout
        self.limits = limits or SqlLimits()
        # Called on the loop thread with the [limits] key a statement was stopped by
        # (the server counts it in /metrics).
        self._on_limit = on_limit or (lambda limit: None)
        self._admission = FairQueue(self.limits.concurrency)
        # One worker per place: a statement holds its place until its thread returns,
        # even after its client has gone, so no statement waits for a thread.
        self._query_pool = ThreadPoolExecutor(self.limits.concurrency, thread_name_prefix="hw-sql")
        self._project_pool = ThreadPoolExecutor(projection_workers, thread_name_prefix="hw-proj")
        spill = engine.data_dir / SPILL_DIRECTORY
        shutil.rmtree(spill, ignore_errors=True)  # a crashed server's temp files
        self._db = Database(
            memory_limit=f"{self.limits.database_memory_mib}MiB",
            spill_directory=spill,
            spill_limit=f"{self.limits.spill_mib}MiB",
        )
        self._deadlines: set[Deadline] = set()
        # Projections check JSON with DuckDB in a database of their own: a statement
        # using all of the queries' memory must not fail the projections every
        # statement reads.
        self._projection_db = Database()
        self._builder = ChunkBuilder(self._projection_db)
        self._progress = asyncio.Event()
        self.streams = StreamTables(engine, self._builder, self._project_pool, self._signal)
        self.sources: list[TableSource] = [self.streams]
        self._started = False
        self._closed = False
        self._stopping = False
        self.queries = 0
        self.query_seconds_total = 0.0

    # ---- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Hook the engine and start projecting every existing stream (loop thread)."""
        if self._started:
            return
        self._started = True
        for source in self.sources:
            source.start()

    def add_source(self, source: TableSource) -> None:
        """Plug in another family of tables (e.g. entity kinds)."""
        self.sources.append(source)
        if self._started:
            source.start()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop_queries()
        for source in self.sources:
            await source.close()
        self._signal()
        self._db.interrupt_all()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._query_pool.shutdown, True)
        await loop.run_in_executor(None, self._project_pool.shutdown, True)
        self._builder.close()
        self._projection_db.close()
        self._db.close()

    @property
    def running_queries(self) -> int:
        """Statements holding one of the ``concurrency`` places."""
        return self._admission.running

    @property
    def queued_queries(self) -> int:
        """Statements waiting for a place."""
        return self._admission.queued

    def stop_queries(self) -> None:
        """Shutdown: interrupt every running statement and refuse queued and later ones
        (each client is told the server is shutting down). Loop thread."""
        if self._stopping:
            return
        self._stopping = True
        self._admission.refuse_all(QueryExecutionError("the server is shutting down"))
        for deadline in list(self._deadlines):
            deadline.stop()

    def _signal(self) -> None:
        """A projection moved: wake everyone waiting for one."""
        self._progress.set()
        self._progress = asyncio.Event()

    # ---- positions ------------------------------------------------------------------

    def tables(self, tenant_id: int) -> list[SqlTable]:
        return [t for source in self.sources for t in source.tables(tenant_id)]

    def covered_position(self, tenant_id: int) -> int:
        """The tenant log position below which every table has projected everything."""
        tenant = self.engine.tenant(tenant_id)
        head = tenant.committed_position
        covered = head
        for table in self.tables(tenant_id):
            if table.damage is None:  # a damaged table is refused, not waited for
                covered = min(covered, table.covered_position(head))
        return covered

    def _lag_message(self, tenant_id: int, covered: int, position: int) -> str:
        message = f"SQL projections reached position {covered}, not yet {position}"
        errors = [
            f"{t.name}: {error}" for t in self.tables(tenant_id) if (error := t.error) is not None
        ]
        return message + (f" (failing: {'; '.join(errors)})" if errors else "")

    async def wait_for_position(self, tenant_id: int, position: int, timeout: float) -> int:
        """Wait until every table of the tenant covers ``position``; returns the covered
        position (>= ``position``). ProjectionLag once they have not moved towards it
        for ``timeout`` seconds."""

        def kick() -> None:
            head = self.engine.tenant(tenant_id).committed_position
            for table in self.tables(tenant_id):
                if table.covered_position(head) < position:
                    table.request_catch_up()

        await self._wait(
            lambda: self.covered_position(tenant_id),
            position,
            kick,
            lambda: self._lag_message(tenant_id, self.covered_position(tenant_id), position),
            timeout,
        )
        return self.covered_position(tenant_id)

    async def _wait(
        self,
        reached: Callable[[], int],
        target: int,
        kick: Callable[[], None],
        lag_message: Callable[[], str],
        timeout: float,
    ) -> None:
        """Wait until ``reached() >= target``, kicking lagging projections. ProjectionLag
        once ``reached()`` has not moved for ``timeout`` seconds: a query waits as long
        as the projections are catching up (read your writes, however far behind a burst
        of appends left them), and a stalled one (failing, paused) is reported."""
        deadline = time.monotonic() + timeout
        last = reached()
        while True:
            progress = self._progress
            now = reached()
            if now >= target:
                return
            if self._closed:
                raise ProjectionLag("the SQL service is shutting down")
            if now > last:
                last, deadline = now, time.monotonic() + timeout
            kick()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ProjectionLag(lag_message())
            # Woken by projection progress; the poll covers heads that move without any
            # (an in-flight append to another stream finishing, or failing).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(progress.wait(), min(remaining, POLL_SECONDS))

    # ---- stream ranges ----------------------------------------------------------------

    async def stream_range(
        self, tenant_id: int, name: str, start: int, end: int, partition: int = 0
    ) -> list[pa.RecordBatch]:
        """Offsets [start, end) of one partition of a stream (0 unless named) from its
        projection, as record batches of ``offset, position, ts, data`` (zero-copy
        slices): a bulk read with no per-event work. ``end`` is clamped to the committed
        offset; the projection is awaited up to it. InvalidOffset when retention has
        removed ``start``."""
        stream = self.engine.stream_by_name(tenant_id, name)  # StreamNotFound
        plog = stream.partition_log(partition)  # InvalidRequest when it does not exist
        projection = self.streams.projection(tenant_id, stream.name, partition)
        if projection is None:
            raise InvalidRequest(f"stream {name} has no SQL projection")
        if start < 0 or end < start:
            raise InvalidRequest(f"bad range {start}..{end}: 0 <= from <= to")
        end = min(end, plog.last_stable_offset)  # read_committed: the projection's end

        def lag() -> str:
            error = f" (failing: {projection.error})" if projection.error else ""
            reached = projection.next_offset
            return f"stream {name} is projected up to offset {reached}, not {end}{error}"

        def kick() -> None:
            if projection.damage is not None:  # the range reaches a batch that does not read
                raise CorruptBatchError(projection.damage)
            projection.request_catch_up()

        await self._wait(
            lambda: projection.next_offset,
            end,
            kick,
            lag,
            self.read_timeout,
        )
        if projection.closed:
            raise StreamNotFound(f"stream {name} was deleted")
        if start < plog.start_offset:
            where = f"partition {partition}" if partition else "the stream"
            raise InvalidOffset(
                f"offset {start} was removed by retention; {where} starts at {plog.start_offset}"
            )
        return range_batches(projection.chunks, start, end)

    # ---- queries --------------------------------------------------------------------

    async def query(self, tenant_id: int, sql: str, params: Sequence[object] = ()) -> QueryResult:
        """Run ``sql`` over a prefix of the tenant log holding every event acknowledged
        before the call (read your writes)."""
        # Appends to different streams are acknowledged out of position order (each
        # stream fsyncs on its own), so the committed head may still sit below an event
        # already acknowledged. Every position claimed before now is below
        # ``next_position``: wait for that (in-flight appends finish within an fsync).
        claimed = self.engine.tenant(tenant_id).next_position
        # read_committed: an open transaction's events are not shown, so answer below
        # its first event instead of waiting for its end (QueryAt past it does wait).
        claimed = stable_position(self.engine, tenant_id, claimed)
        position = await self.wait_for_position(tenant_id, claimed, self.read_timeout)
        outcome = await self._run(tenant_id, sql, params, position, allow_insert=True)
        if isinstance(outcome, QueryResult):
            return outcome
        # A cancel (a client's CancelRequest, its connection gone) stops the evaluation
        # above, before anything is stored. Once the append has started it is the
        # statement's outcome, stored whoever stops waiting for it: it is finished and
        # answered, never reported cancelled (PostgreSQL never reports a committed INSERT
        # as cancelled: a client retrying a "cancelled" INSERT would store it twice).
        return await _despite_cancel(self._append(tenant_id, outcome))

    async def query_at(
        self, tenant_id: int, sql: str, params: Sequence[object], position: int
    ) -> QueryResult:
        """Run ``sql`` over exactly the tenant log positions below ``position``."""
        tenant = self.engine.tenant(tenant_id)
        head = tenant.committed_position
        if position < 0:
            raise InvalidRequest("a position is non-negative")
        if position > head:
            raise PositionAhead(f"position {position} is ahead of the log head {head}")
        covered = self.covered_position(tenant_id)
        if covered < position:
            for table in self.tables(tenant_id):
                table.request_catch_up()
            raise ProjectionLag(self._lag_message(tenant_id, covered, position))
        outcome = await self._run(
            tenant_id, sql, params, position, allow_insert=False, history=True
        )
        assert isinstance(outcome, QueryResult)
        return outcome

    async def _run(
        self,
        tenant_id: int,
        sql: str,
        params: Sequence[object],
        position: int,
        *,
        allow_insert: bool,
        history: bool = False,
    ) -> QueryResult | _Rows:
        """``history``: a QueryAt, whose answer at a position never changes; a table
        retention has removed rows of since is refused there, if the query reads it."""
        if self._closed or self._stopping:
            raise QueryExecutionError("the server is shutting down")
        tables = self.tables(tenant_id)
        snapshots = {t.name: t.snapshot(position) for t in tables}
        # Refused if the query reads them: a table whose rows retention has removed
        # since a QueryAt's position, a stream with a partition this cluster node holds
        # no replica of (empty here).
        head = self.engine.tenant(tenant_id).committed_position
        for table in tables:
            if history and position < table.history_from:
                # Its first answerable position may not be written yet: say so, and what
                # answers now (it named a position QueryAt then refused as ahead).
                when = " once the log reaches it (Query answers now)" * (table.history_from > head)
                snapshots[table.name] = _refusing(
                    InvalidOffset(
                        f"table {table.name!r} as of position {position}: retention has"
                        f" removed rows it had; QueryAt over it answers positions from"
                        f" {table.history_from} on{when}"
                    )
                )
            elif (missing := self._not_replicated(table)) is not None:
                snapshots[table.name] = _refusing(missing)
            elif table.damage is not None:
                snapshots[table.name] = _refusing(CorruptBatchError(table.damage))
        await self._admission.acquire(tenant_id)  # waits its tenant's turn
        loop = asyncio.get_running_loop()
        try:
            cursor = self._db.new_cursor()
        except BaseException:
            self._admission.release()
            raise
        deadline = Deadline(loop, cursor, self.limits.timeout_ms / 1000)
        self._deadlines.add(deadline)

        def finished() -> None:
            # The worker returned: only now may another statement have its place.
            deadline.finished()
            self._deadlines.discard(deadline)
            self._db.release(cursor)
            self._admission.release()

        started = time.perf_counter()
        try:
            work = self._query_pool.submit(
                self._execute, cursor, sql, list(params), snapshots, allow_insert
            )
        except BaseException:
            finished()
            raise
        work.add_done_callback(lambda _: _call_soon(loop, finished))
        try:
            return await asyncio.wrap_future(work)
        except asyncio.CancelledError:
            deadline.stop()  # nobody is waiting for the answer any more
            raise
        except duckdb.InterruptException:
            raise self._interrupted(deadline) from None
        except duckdb.OutOfMemoryException as exc:
            self._on_limit("sql_memory_mib")
            raise QueryExecutionError(self._memory_message(exc)) from None
        except ResultTooLarge:
            self._on_limit("sql_result_mib")
            raise
        finally:
            self.queries += 1
            self.query_seconds_total += time.perf_counter() - started

    def _interrupted(self, deadline: Deadline) -> QueryExecutionError:
        if deadline.timed_out:
            self._on_limit("sql_timeout_ms")
            return QueryExecutionError(
                f"query cancelled after {self.limits.timeout_ms} ms (limits.sql_timeout_ms)"
            )
        return QueryExecutionError("query cancelled: the server is shutting down")

    def _memory_message(self, exc: duckdb.OutOfMemoryException) -> str:
        limits = self.limits
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return (
            f"query needs more memory than limits.sql_memory_mib allows ({limits.memory_mib}"
            f" MiB per query, {limits.database_memory_mib} MiB shared by the"
            f" {limits.concurrency} queries that may run at once, {limits.spill_mib} MiB"
            f" of disk to spill to): {reason}"
        )

    def _not_replicated(self, table: SqlTable) -> HeadwaterError | None:
        if not isinstance(table, StreamTable):
            return None
        try:
            for partition in range(len(table.parts)):
                self.engine.check_replica(table.stream, partition)
        except HeadwaterError as exc:
            return exc
        return None

    async def _append(self, tenant_id: int, rows: _Rows) -> QueryResult:
        try:
            stream = self.engine.stream_by_name(tenant_id, rows.table)
        except StreamNotFound:
            raise TableNotFound(f"no stream named {rows.table!r} to insert into") from None
        if not rows.values:
            return QueryResult(list(INSERT_COLUMNS), [[0, stream.log.committed_offset]])
        try:
            info = await self.engine.append(tenant_id, stream.stream_id, rows.values)
        except InvalidRequest as exc:
            raise QueryExecutionError(f"INSERT refused: {exc.message}") from None
        return QueryResult(list(INSERT_COLUMNS), [[info.count, info.base_offset]])

    # ---- worker threads -------------------------------------------------------------

    def _execute(
        self,
        cur: duckdb.DuckDBPyConnection,
        sql: str,
        params: list[object],
        snapshots: dict[str, Callable[[], pa.Table]],
        allow_insert: bool,
    ) -> QueryResult | _Rows:
        """Run one statement on ``cur`` (its owner closes it). An interrupt or running
        out of memory is raised as DuckDB's own exception: the loop side knows which
        limit it was."""
        parsed = parse_query(sql, allow_insert=allow_insert)
        values = [to_duckdb_param(p) for p in params]
        try:
            self._register(cur, parsed, snapshots)
            if parsed.insert is not None:
                return self._evaluate_insert(cur, parsed.insert, values, snapshots)
            return self._select(cur, parsed.text, values)
        except (duckdb.InterruptException, duckdb.OutOfMemoryException):
            raise
        except duckdb.Error as exc:
            raise _table_error(exc) from None
        except pa.ArrowException as exc:
            raise QueryExecutionError(str(exc)) from None

    @staticmethod
    def _register(
        cur: duckdb.DuckDBPyConnection,
        parsed: ParsedQuery,
        snapshots: dict[str, Callable[[], pa.Table]],
    ) -> None:
        """Register the tables the query names (all of them when it reads the catalog).
        DuckDB resolves names case-insensitively: on a clash the exact spelling wins."""
        everything = not CATALOG_WORDS.isdisjoint(parsed.words)
        chosen: dict[str, str] = {}
        for name in snapshots:
            key = name.lower()
            if not everything and key not in parsed.words:
                continue
            if key not in chosen or name in parsed.text:
                chosen[key] = name
        for name in chosen.values():
            cur.register(name, snapshots[name]())

    def _bounded_table(self, rel: duckdb.DuckDBPyRelation) -> pa.Table:
        """The result, taken a batch at a time and refused once its cost in the server
        passes ``limits.sql_result_mib``: a SELECT of a whole stream must not become
        gigabytes of Arrow, Python values and JSON on the way to one answer. The cost
        counted is the Arrow bytes and, per value, what it costs as a Python object in
        its row and in the encoded answer."""
        limit = self.limits.result_mib << 20
        reader = rel.to_arrow_reader(_RESULT_BATCH_ROWS)
        batches: list[pa.RecordBatch] = []
        size = 0
        for batch in reader:
            size += batch.nbytes + batch.num_rows * batch.num_columns * _VALUE_BYTES
            if size > limit:
                reader.close()  # DuckDB stops producing the rest
                raise ResultTooLarge(
                    f"the result is over {self.limits.result_mib} MiB"
                    f" (limits.sql_result_mib; {sum(len(b) for b in batches) + len(batch)}"
                    " rows read so far): narrow it with WHERE, LIMIT or an aggregate, or"
                    " read the stream itself (HTTP /events or /arrow, the SDK's scan)"
                )
            batches.append(batch)
        return pa.Table.from_batches(batches, schema=reader.schema)

    def _select(
        self, cur: duckdb.DuckDBPyConnection, text: str, values: list[object]
    ) -> QueryResult:
        rel = cur.sql(text, params=values or None)
        if rel is None:
            return QueryResult([], [])
        columns = list(rel.columns)
        type_ids = [str(t.id) for t in rel.types]
        exported = rel
        if "time with time zone" in type_ids:
            # DuckDB exports TIME WITH TIME ZONE to Arrow as a time64: the UTC offset is
            # lost (12:34:56+02 read back 12:34:56). Its text, DuckDB's, keeps it.
            exported = rel.project(
                ", ".join(
                    f"CAST(#{i} AS VARCHAR)" if type_id == "time with time zone" else f"#{i}"
                    for i, type_id in enumerate(type_ids, start=1)
                )
            )
        table = self._bounded_table(exported)

        def text_cast(column: pa.ChunkedArray) -> list[Any]:
            cur.register("hw_text", pa.table({"c": column}))
            try:
                out = cur.sql("SELECT CAST(c AS VARCHAR) FROM hw_text").to_arrow_table()
            finally:
                cur.unregister("hw_text")
            return list(out.column(0).to_pylist())

        converted: list[list[QueryValue]] = [
            column_values(table.column(i), type_ids[i], text_cast) for i in range(len(columns))
        ]
        return QueryResult(
            columns,
            rows_from_columns(converted, table.num_rows),
            [str(t) for t in rel.types],
        )

    def _evaluate_insert(
        self,
        cur: duckdb.DuckDBPyConnection,
        plan: InsertPlan,
        values: list[object],
        snapshots: dict[str, Callable[[], pa.Table]],
    ) -> _Rows:
        target = plan.table
        if target not in snapshots:
            folded = [n for n in snapshots if n.lower() == target.lower()]
            if len(folded) != 1:
                raise TableNotFound(f"no stream named {target!r} to insert into")
            target = folded[0]
        rel = cur.sql(plan.source, params=values or None)
        if rel is None:
            raise QueryExecutionError("the INSERT source produced no rows")
        names = [c.lower() for c in rel.columns]
        table = self._insert_rows(rel)
        if plan.columns is not None:
            if len(plan.columns) != len(names):
                raise QueryExecutionError(
                    f"INSERT names {len(plan.columns)} columns but the rows have {len(names)}"
                )
            targets = list(plan.columns)
        elif plan.by_name:
            targets = names
        elif len(names) == 5:
            targets = ["offset", "position", "ts", "data", "json"]
        else:
            raise QueryExecutionError("INSERT INTO a stream needs a column list: (data) or (json)")
        if "data" not in targets and "json" not in targets:
            raise QueryExecutionError("INSERT INTO a stream gives data or json")
        if table.num_rows == 0:
            return _Rows(target, [])
        event: pa.Array | None = None
        if "json" in targets:
            event = self._json_bytes(cur, table.column(targets.index("json")))
        if "data" in targets:
            data = self._data_bytes(table.column(targets.index("data")))
            event = data if event is None else pc.if_else(pc.is_valid(data), data, event)
        assert event is not None
        if event.null_count:
            raise QueryExecutionError("every inserted row needs a non-NULL data or json value")
        return _Rows(target, event.to_pylist())

    @staticmethod
    def _insert_rows(rel: duckdb.DuckDBPyRelation) -> pa.Table:
        """An INSERT's source rows, read no further than an append takes: past
        MAX_APPEND_EVENTS rows, or twice MAX_APPEND_BYTES of Arrow (the events are made
        of it; the margin is for offsets and columns they are not made of: the append
        checks the events exactly), it is refused having read only that much (the whole
        source was taken first: a million-row SELECT grew the server by a gigabyte
        before its refusal)."""
        reader = rel.limit(MAX_APPEND_EVENTS + 1).to_arrow_reader(_INSERT_BATCH_ROWS)
        batches: list[pa.RecordBatch] = []
        rows = size = 0
        for batch in reader:
            rows += batch.num_rows
            size += batch.nbytes
            if rows > MAX_APPEND_EVENTS or size > 2 * MAX_APPEND_BYTES:
                reader.close()
                raise QueryExecutionError(
                    f"INSERT appends at most {MAX_APPEND_EVENTS} rows and"
                    f" {MAX_APPEND_BYTES >> 20} MiB at once: split the source (LIMIT, WHERE)"
                )
            batches.append(batch)
        return pa.Table.from_batches(batches, schema=reader.schema)

    @staticmethod
    def _data_bytes(column: pa.ChunkedArray) -> pa.Array:
        t = column.type
        if isinstance(t, pa.ExtensionType):
            column = column.cast(t.storage_type)
            t = t.storage_type
        if pa.types.is_null(t):
            return pa.nulls(len(column), pa.binary())
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            return column.combine_chunks().cast(pa.binary())
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return column.combine_chunks().cast(pa.binary())
        raise QueryExecutionError(f"data takes BLOB or VARCHAR values, not {t}")

    @staticmethod
    def _json_bytes(cur: duckdb.DuckDBPyConnection, column: pa.ChunkedArray) -> pa.Array:
        """JSON text of each value: text is checked and kept as written, anything else
        (numbers, lists, structs ...) is rendered by DuckDB's to_json."""
        t = column.type
        storage = t.storage_type if isinstance(t, pa.ExtensionType) else t
        textual = pa.types.is_string(storage) or pa.types.is_large_string(storage)
        if isinstance(t, pa.ExtensionType):
            column = column.cast(storage)
        if pa.types.is_null(storage):
            return pa.nulls(len(column), pa.binary())
        cur.register("hw_insert", pa.table({"c": column}))
        try:
            if textual:
                sql = "SELECT CASE WHEN c IS NULL OR json_valid(c) THEN c END, " + (
                    "c IS NOT NULL AND NOT json_valid(c) FROM hw_insert"
                )
            else:
                sql = "SELECT to_json(c)::VARCHAR, false FROM hw_insert"
            result = cur.sql(sql).to_arrow_table()
        finally:
            cur.unregister("hw_insert")
        if pc.any(result.column(1)).as_py():
            raise QueryExecutionError("json takes valid JSON text")
        return result.column(0).combine_chunks().cast(pa.binary())


async def _despite_cancel(work: Coroutine[Any, Any, T]) -> T:
    """``work``'s outcome, awaited to its end even if the awaiting task is cancelled
    meanwhile: that cancel is taken back (``uncancel``). A cancel of ``work`` itself
    (the loop closing) still ends it."""
    task = asyncio.ensure_future(work)
    current = asyncio.current_task()
    cancels = 0
    try:
        while True:
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                if task.cancelled():
                    raise
                cancels += 1
    finally:
        if current is not None:
            for _ in range(cancels):
                current.uncancel()


def _refusing(error: HeadwaterError) -> Callable[[], pa.Table]:
    """A table's snapshot that raises ``error`` when a query reads the table."""

    def refuse() -> pa.Table:
        raise error

    return refuse
