"""Where SQL tables come from: a small registry of table sources.

A :class:`TableSource` offers, per tenant, tables that know how far they have projected
the tenant log (:meth:`SqlTable.covered_position`) and can hand out an immutable
snapshot as of a position (:meth:`SqlTable.snapshot`). Streams are the built-in source
(:class:`StreamTables`); entity kinds plug in later as another source with the same
contract. Names share one namespace per tenant, so sources never collide.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Protocol

import pyarrow as pa

from headwater.engine.names import RESERVED_PREFIXES
from headwater.sql import projection as projection_module
from headwater.sql.projection import ChunkBuilder, StreamProjection
from headwater.sql.sealed import SCHEMA

if TYPE_CHECKING:
    from headwater.engine.engine import Engine, Stream

log = logging.getLogger(__name__)

BUDGET_CHECK_S = 0.05  # the tail budget is checked at most this often


class SqlTable(Protocol):
    """One table of one tenant. Called on the loop thread only."""

    @property
    def name(self) -> str: ...

    def covered_position(self, head: int) -> int:
        """Every change of this table below the returned tenant log position is
        projected. ``head`` is the tenant's committed position, read just before."""
        ...

    def request_catch_up(self) -> None:
        """Start projecting whatever is committed and not projected yet."""
        ...

    @property
    def history_from(self) -> int:
        """QueryAt answers positions from here on as it always did; below it retention
        has removed rows an answer had (0: every position)."""
        ...

    @property
    def error(self) -> str | None:
        """Why the last projection round failed, for a lag message (None: it did not)."""
        ...

    @property
    def damage(self) -> str | None:
        """Why the table cannot be projected past some point: its log holds a batch
        that does not read (a flipped bit on disk). Retrying cannot mend that, so the
        tenant's other tables do not wait for this one, and a query reading it is
        refused with a CorruptBatchError saying this (None: the table is sound)."""
        ...

    def snapshot(self, position: int) -> Callable[[], pa.Table]:
        """Capture the table as of ``position`` (exclusive); the returned function builds
        the Arrow table (in a worker thread) and never sees later changes. A stream's
        table is mostly memory-mapped sealed files: DuckDB scans it in place, reading only
        the columns a query names, so a full scan does not copy it into memory."""
        ...


class TableSource(Protocol):
    """A family of tables (streams, entity kinds, ...)."""

    def start(self) -> None: ...

    def tables(self, tenant_id: int) -> list[SqlTable]: ...

    async def close(self) -> None: ...


PARTITIONED_SCHEMA = SCHEMA.append(pa.field("partition", pa.int32(), nullable=False))


class StreamTable:
    """The SQL table of one stream: its partitions' projections together. A stream of
    one partition is its projection's table as it always was; with more, every row also
    has its ``partition``, the last column, so the columns before it keep their places.
    Positions are the tenant log's, assigned per append across partitions, so a
    snapshot at a position cuts every partition at the same point of the tenant log."""

    def __init__(self, stream: Stream, project: Callable[[Stream, int], StreamProjection]) -> None:
        """``project(stream, partition)`` makes a partition's projection (the builder,
        executor and progress callback of :class:`StreamTables` bound in)."""
        self.stream = stream
        self.name = stream.name
        self._project = project
        self.parts = [project(stream, n) for n in range(stream.partitions)]
        stream.partition_listeners.append(self._grown)

    def _grown(self, partitions: int) -> None:
        if self.parts and not self.parts[0].closed:
            self.parts += [
                self._project(self.stream, n) for n in range(len(self.parts), partitions)
            ]

    def covered_position(self, head: int) -> int:
        return min(part.covered_position(head) for part in self.parts)

    def request_catch_up(self) -> None:
        for part in self.parts:
            part.request_catch_up()

    @property
    def history_from(self) -> int:
        return max(part.history_from for part in self.parts)

    @property
    def error(self) -> str | None:
        return next((part.error for part in self.parts if part.error is not None), None)

    @property
    def damage(self) -> str | None:
        for part in self.parts:
            if part.damage is not None:
                if len(self.parts) == 1:
                    return part.damage
                return f"partition {part.partition}: {part.damage}"
        return None

    def snapshot(self, position: int) -> Callable[[], pa.Table]:
        if len(self.parts) == 1:
            return self.parts[0].snapshot(position)
        reads = [(part.partition, part.snapshot(position)) for part in self.parts]

        def table() -> pa.Table:
            tables = []
            for partition, read in reads:
                rows = read()
                column = pa.array([partition] * rows.num_rows, pa.int32())
                tables.append(rows.append_column(PARTITIONED_SCHEMA.field("partition"), column))
            return pa.concat_tables(tables)

        return table

    async def close(self) -> None:
        if self._grown in self.stream.partition_listeners:
            self.stream.partition_listeners.remove(self._grown)
        for part in self.parts:
            await part.close()


class StreamTables:
    """One table per stream (names with a reserved prefix are headwater's own: hidden)."""

    def __init__(
        self,
        engine: Engine,
        builder: ChunkBuilder,
        executor: Executor,
        on_progress: Callable[[], None],
    ) -> None:
        self.engine = engine
        self._builder = builder
        self._executor = executor
        self._on_progress = on_progress
        self.projections: dict[int, dict[int, StreamTable]] = {}  # tenant -> stream id
        self._started = False
        self._budget_check: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._started = True
        self.engine.stream_created_listeners.append(self._created)
        self.engine.stream_deleted_listeners.append(self._deleted)
        for stream in self.engine.all_streams():
            self._created(stream)

    def _created(self, stream: Stream) -> None:
        if stream.name.startswith(RESERVED_PREFIXES) or stream.deleted:
            return
        tenant = self.projections.setdefault(stream.tenant.tenant_id, {})
        if stream.stream_id not in tenant:
            tenant[stream.stream_id] = StreamTable(stream, self._project)

    def _project(self, stream: Stream, partition: int) -> StreamProjection:
        return StreamProjection(stream, self._builder, self._executor, self._progressed, partition)

    def _progressed(self) -> None:
        self._on_progress()
        # One budget check per BUDGET_CHECK_S at most: it reads every projection's tail,
        # and at start-up each of thousands of streams progresses in turn (a check per
        # progress made start-up quadratic in the number of streams: 3,000 streams took
        # over a minute to serve).
        if self._budget_check is None:
            self._budget_check = asyncio.get_running_loop().call_later(
                BUDGET_CHECK_S, self._keep_tails_in_budget
            )

    def _keep_tails_in_budget(self) -> None:
        """Seal the largest in-memory tails (into small files) while all tails together
        hold more than ``TAIL_BUDGET_BYTES``, down to half of it: each tail stays below a
        seal's size, but many streams' tails add up."""
        self._budget_check = None
        budget = projection_module.TAIL_BUDGET_BYTES
        tails = [
            (p.tail_bytes, p)
            for tenant in self.projections.values()
            for table in tenant.values()
            for p in table.parts
        ]
        total = sum(size for size, _ in tails)
        if total <= budget:
            return
        for size, projection in sorted(tails, key=lambda pair: -pair[0]):
            if total <= budget // 2:
                break
            projection.seal_tail()
            total -= size

    def _deleted(self, stream: Stream) -> None:
        projection = self.projections.get(stream.tenant.tenant_id, {}).pop(stream.stream_id, None)
        if projection is not None:
            task = asyncio.get_running_loop().create_task(projection.close())
            task.add_done_callback(lambda t: None if t.cancelled() else t.exception())
            self._on_progress()

    def projection(self, tenant_id: int, name: str, partition: int = 0) -> StreamProjection | None:
        """The projection of one partition (0 unless named) of stream ``name``."""
        for table in self.projections.get(tenant_id, {}).values():
            if table.name == name:
                return table.parts[partition] if partition < len(table.parts) else None
        return None

    def tables(self, tenant_id: int) -> list[SqlTable]:
        return list(self.projections.get(tenant_id, {}).values())

    async def close(self) -> None:
        if self._budget_check is not None:
            self._budget_check.cancel()
            self._budget_check = None
        if self._started:
            self._started = False
            for listeners, hook in (
                (self.engine.stream_created_listeners, self._created),
                (self.engine.stream_deleted_listeners, self._deleted),
            ):
                if hook in listeners:
                    listeners.remove(hook)
        projections = [p for tenant in self.projections.values() for p in tenant.values()]
        self.projections.clear()
        for projection in projections:
            await projection.close()
