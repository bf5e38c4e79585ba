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

if TYPE_CHECKING:
    from headwater.engine.engine import Engine, Stream

log = logging.getLogger(__name__)


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
        self.projections: dict[int, dict[int, StreamProjection]] = {}  # tenant -> stream id
        self._started = False

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
            tenant[stream.stream_id] = StreamProjection(
                stream, self._builder, self._executor, self._progressed
            )

    def _progressed(self) -> None:
        self._on_progress()
        self._keep_tails_in_budget()

    def _keep_tails_in_budget(self) -> None:
        """Seal the largest in-memory tails (into small files) while all tails together
        hold more than ``TAIL_BUDGET_BYTES``, down to half of it: each tail stays below a
        seal's size, but many streams' tails add up."""
        budget = projection_module.TAIL_BUDGET_BYTES
        tails = [(p.tail_bytes, p) for t in self.projections.values() for p in t.values()]
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

    def projection(self, tenant_id: int, name: str) -> StreamProjection | None:
        for projection in self.projections.get(tenant_id, {}).values():
            if projection.name == name:
                return projection
        return None

    def tables(self, tenant_id: int) -> list[SqlTable]:
        return list(self.projections.get(tenant_id, {}).values())

    async def close(self) -> None:
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
