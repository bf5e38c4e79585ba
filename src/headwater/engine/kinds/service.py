"""The kind engine: per-tenant kinds, multi-source entity state, coalesced durable
windows, source epochs, liveness and subscriptions (spec/PROTOCOLS.md §2).

How a write travels:

1. ``TenantKinds.apply(source, ops)`` checks every op first (an op that does not fit
   fails the whole call and nothing is applied), then applies the ops, grouped by
   partition (one partition per kind), to the *working* state (:mod:`.windows`).
2. The open window is flushed ``coalesce_ms`` (20 ms) after its first write: its net
   changes are appended to the kinds' changelogs, one group commit (fdatasync) per
   changelog for the whole window (:mod:`.commit`).
3. Once durable, the committed state (:mod:`.state`: what QUERY, scans, bootstrap and SQL
   read) moves on, each subscriber gets the window's net changes (:mod:`.notify`), and
   the window's waiters (ACKed writes, HEARTBEAT barriers) are released.
4. A kind whose changes waiting for its store (:mod:`.store`) are many or old enough
   gets a checkpoint, written in a worker thread.

Writers (slots, presence, liveness, epochs) are :mod:`.sources`; this module holds them
together: :class:`TenantKinds` is one tenant's kinds, :class:`KindsEngine` every
tenant's, with the background loops. Restart opens each kind's store and replays only
the changelog after its last checkpoint (the last record per entity wins), so the state
is identical to the state before.

Everything here runs on the asyncio loop thread; file work runs in the engine's workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from headwater.engine.engine import run_every
from headwater.engine.kinds.commit import WindowWriter
from headwater.engine.kinds.errors import KindNotFound, ReadOnlySource
from headwater.engine.kinds.model import (
    EntityState,
    KindInfo,
    KindsConfig,
    WriteOp,
    changelog_stream,
)
from headwater.engine.kinds.notify import subscribe
from headwater.engine.kinds.registry import KindRegistry, known_kind
from headwater.engine.kinds.replicated import KindChangelogs
from headwater.engine.kinds.sources import PRESENCE_FIELDS, PRESENCE_KIND, Source, Sources
from headwater.engine.kinds.state import KindState
from headwater.engine.kinds.store import STORE_DIR, KindStore
from headwater.engine.kinds.subscriptions import KindSubscription
from headwater.engine.kinds.windows import Window, Windows
from headwater.errors import StorageError
from headwater.storage.group_commit import GroupCommitter
from headwater.storage.log import LogConfig, PartitionLog
from headwater.tasks import cancel_and_wait

if TYPE_CHECKING:
    from headwater.engine.engine import Engine, Tenant

log = logging.getLogger(__name__)

KINDS_DIR = "kinds"


class TenantKinds:
    """Every kind, entity, source and subscription of one tenant."""

    def __init__(self, owner: KindsEngine, tenant: Tenant, registry: KindRegistry) -> None:
        self.owner = owner
        self.engine_tenant = tenant
        self.tenant_id = tenant.tenant_id
        self.registry = registry
        self.kinds: dict[int, KindState] = {}
        self.writers = Sources(self, registry, owner.config)
        self.sources = self.writers.by_slot  # slot -> holder (connected or in grace)
        self.epochs = self.writers.epochs  # source -> kind -> ids not re-written yet
        self.window_writer = WindowWriter(tenant, self.kinds, owner.engine)
        self.windows = Windows(self.tenant_id, self.kinds, self._write, owner.config.coalesce_ms)
        self._checkpoints: set[asyncio.Task[None]] = set()
        self.windows_flushed = 0
        self.changes_committed = 0
        # CREATE_KIND picks the next kind id, then awaits the changelog's opening and the
        # registry's save: one at a time, or two kinds would get one id.
        self._create_lock = asyncio.Lock()
        self.closed = False

    @property
    def config(self) -> KindsConfig:
        return self.owner.config

    # ---- kinds ------------------------------------------------------------------------

    def kind(self, kind_id: int) -> KindInfo:
        """The kind's current definition; KindNotFound when unknown."""
        return self.registry.kind(kind_id)

    def kind_state(self, kind_id: int) -> KindState:
        return known_kind(self.kinds, kind_id)

    def list_kinds(self) -> list[KindInfo]:
        return self.registry.kinds()

    def get_kind(self, name: str, fields: Sequence[tuple[str, int]] = ()) -> KindInfo:
        """GET_KIND: by name; ``fields``, when given, must be a prefix of the schema
        (SchemaIncompatible otherwise)."""
        return self.registry.resolve(name, fields)

    async def create_kind(
        self,
        name: str,
        fields: Sequence[tuple[str, int]],
        *,
        event_stream: bool = False,
        internal: bool = False,
    ) -> KindInfo:
        """CREATE_KIND: identical = the existing kind; appended fields = migration
        (schema_version + 1); anything else SchemaConflict; ReservedName for the reserved
        prefixes; KindLimitExceeded past 64 fields. Persisted before it returns."""
        async with self._create_lock:
            return await self._create_kind(name, fields, event_stream, internal)

    async def _create_kind(
        self, name: str, fields: Sequence[tuple[str, int]], event_stream: bool, internal: bool
    ) -> KindInfo:
        tenant = self.engine_tenant
        # Streams being created count: their names are taken before their create ends.
        taken = set(tenant.by_name) | tenant.reserved_names
        kind, changed = self.registry.plan_create(
            name, fields, event_stream=event_stream, internal=internal, taken_names=taken
        )
        if not changed:
            return kind
        loop = asyncio.get_running_loop()
        state = self.kinds.get(kind.kind_id)
        if state is None:
            # The name is the kind's from here: a stream created while the kind opens
            # must not take it too (both would be the same SQL table).
            tenant.kind_names.add(kind.name)
            try:
                state = await loop.run_in_executor(self.owner.executor, self.owner.open_kind, kind)
            except BaseException:
                tenant.kind_names.discard(kind.name)
                raise
        # The registry and the kind's state change together, before the save is awaited:
        # a GET_KIND answered meanwhile (another client; in a cluster, a kind the tick
        # is making) must find a kind its reads and writes then find too.
        self.registry.install(kind)
        created = kind.kind_id not in self.kinds
        if created:
            self.kinds[kind.kind_id] = state
            state.committer.start()
        else:
            state.migrate(kind)
            self.windows.migrated(state)
        try:
            await loop.run_in_executor(self.owner.executor, self.registry.save)
        except BaseException:
            log.exception("saving the kind registry failed")
            raise
        if created:
            self.owner.fire_kind_created(self, state)
            if self.owner.placement is not None and not kind.internal:
                # In a cluster: answered once the changelog is placed and has a leader.
                await self.owner.placement(self.tenant_id, kind)
        log.info(
            "kind %s (tenant %d, id %d) v%d",
            name,
            self.tenant_id,
            kind.kind_id,
            kind.schema_version,
        )
        return kind

    # ---- sources ------------------------------------------------------------------------

    def connect(
        self,
        name: str = "",
        *,
        source_id: int | None = None,
        read_only: bool = False,
        deadline_ms: int = 0,
        on_dead: Callable[[], None] | None = None,
    ) -> Source:
        """CONNECT: a read-only reader, the slot asked for (SourceConflict while a live
        connection holds it; a slot in its grace period is taken over with its
        entities), or the lowest free slot (NoFreeSource when all 64 are taken)."""
        return self.writers.connect(name, source_id, read_only, deadline_ms, on_dead)

    def holds(self, source_id: int) -> bool:
        """Whether a source holds the slot: connected, or gone and within its liveness
        deadline (after a restart: any slot whose bit entities carry). Not once its
        source was declared dead and its entities retracted."""
        return source_id in self.writers.by_slot

    def disconnect(self, source: Source) -> None:
        """The source's connection ended: its epoch is abandoned, its presence entity
        goes, and its entities stay until its liveness deadline passes."""
        self.writers.disconnect(source)

    def check_liveness(self, now: float) -> list[Source]:
        """Retract for every source silent past its deadline; returns the dead."""
        return self.writers.check_liveness(now)

    def retract_source(self, source_id: int) -> int:
        """Clear ``source_id``'s bit from every entity it holds; returns how many."""
        return self.writers.retract_source(source_id)

    # ---- epochs -----------------------------------------------------------------------

    def begin_epoch(self, source: Source) -> Window:
        """SOURCE_EPOCH_BEGIN: remember the entities this source holds (of every kind);
        an epoch already open is abandoned."""
        self.writers.begin_epoch(source)
        return self.windows.pending

    def end_epoch(self, source: Source) -> tuple[int, Window]:
        """SOURCE_EPOCH_END: retract what was not re-asserted or patched since BEGIN;
        ``(retracted_count, window)``. NoEpoch without an open epoch."""
        count = self.writers.end_epoch(source)
        return count, self.windows.window_for_ack()

    # ---- writes -----------------------------------------------------------------------

    def apply(self, source: Source, ops: Sequence[WriteOp]) -> Window:
        """Apply write ops as ``source`` (all checked before any applies; grouped by
        partition, each partition's ops in order); returns the window they are in."""
        sid = self.writers.writer(source)
        if self.closed:
            raise StorageError("the server is shutting down")
        for op in ops:
            state = known_kind(self.kinds, op.kind_id)
            if state.info.internal:
                raise ReadOnlySource(f"kind {state.info.name!r} is written by headwater only")
        if self.owner.clustered:
            # Only the leader of each kind's changelog takes its writes (before any applies).
            for kind_id in {op.kind_id for op in ops}:
                self.owner.changelogs.check_writable(self.tenant_id, self.kinds[kind_id])
        if len({op.kind_id for op in ops}) > 1:
            ops = sorted(ops, key=lambda op: op.kind_id)  # stable: order kept per kind
        self.windows.apply(sid, ops, self.epochs.get(sid))
        return self.windows.window_for_ack()

    async def _write(self, window: Window) -> None:
        self.changes_committed += await self.window_writer.write(window)
        self.windows_flushed += 1
        now = time.monotonic()
        for state in self.kinds.values():
            if state.checkpoint_due(now):
                self.start_checkpoint(state)

    def start_checkpoint(self, state: KindState) -> asyncio.Task[None]:
        """Write what ``state``'s store does not know yet, in a worker thread."""
        checkpoint = state.begin_checkpoint()

        async def write() -> None:
            loop = asyncio.get_running_loop()
            written = False
            try:
                await loop.run_in_executor(self.owner.executor, state.write_checkpoint, checkpoint)
                written = True
            except Exception:
                log.exception(
                    "checkpoint of kind %s (tenant %d) failed", state.info.name, self.tenant_id
                )
            finally:
                state.end_checkpoint(written)

        task = asyncio.get_running_loop().create_task(write())
        self._checkpoints.add(task)
        task.add_done_callback(self._checkpoints.discard)
        return task

    async def checkpoint(self) -> None:
        """Write every kind's pending changes to its store (at close, and for tests)."""
        for task in list(self._checkpoints):
            await task
        for state in self.kinds.values():
            if state.dirty or state.deleted:
                await self.start_checkpoint(state)

    async def barrier(self) -> None:
        """Return once every write applied before the call is durable and visible."""
        await self.windows.barrier()

    async def flush(self) -> None:
        """Make the open window durable and visible now (one flush at a time)."""
        await self.windows.flush()

    # ---- reads --------------------------------------------------------------------------

    def get(self, kind_id: int, entity_id: bytes) -> EntityState | None:
        """The committed state of an entity (what QUERY answers), None when absent."""
        return self.kind_state(kind_id).entity(entity_id)

    def scan(self, kind_id: int) -> Iterator[EntityState]:
        """Every committed entity of a kind, each read as it is when reached (so an
        entity changed meanwhile comes out newer; one deleted meanwhile is skipped)."""
        return self.kind_state(kind_id).scan_entities()

    def entity_count(self, kind_id: int) -> int:
        """How many live entities the kind has (committed)."""
        return self.kind_state(kind_id).count

    def source_entity_count(self, source_id: int, internal: bool = False) -> int:
        """How many committed entities have ``source_id``'s bit (of internal kinds too
        when ``internal``)."""
        kinds = {k for k, state in self.kinds.items() if internal or not state.info.internal}
        return self.writers.held_count(source_id, kinds)

    def subscribe(
        self, kind_id: int, *, include_previous: bool = False, events: bool = False
    ) -> KindSubscription:
        """Register a live subscription now (before any bootstrap :meth:`scan`)."""
        return subscribe(
            self.kind_state(kind_id),
            include_previous=include_previous,
            events=events,
            capacity=self.config.live_buffer,
        )

    async def close(self) -> None:
        self.closed = True
        await self.writers.close()  # the sources' names and deadlines on disk
        try:
            await self.windows.close()
        except Exception:
            log.exception("the last window of tenant %d was not written", self.tenant_id)
        try:
            await self.checkpoint()  # a clean restart then replays nothing
        except Exception:
            log.exception("the last checkpoint of tenant %d was not written", self.tenant_id)
        for state in self.kinds.values():
            for sub in list(state.subscribers):
                sub.close()
            await state.committer.aclose()
            state.close()


# ---- the engine-wide object -------------------------------------------------------------


@dataclass
class _Hooks:
    kind_created: list[Callable[[TenantKinds, KindState], None]] = field(default_factory=list)


class KindsEngine:
    """Entity kinds of every tenant, on top of an open :class:`Engine`."""

    def __init__(self, engine: Engine, config: KindsConfig) -> None:
        self.engine = engine
        self.config = config
        self.executor = engine.executor
        self.tenants: dict[int, TenantKinds] = {}
        self.hooks = _Hooks()
        # In a cluster (replicated.py): replication reaches kind changelogs through
        # ``changelogs``; ``placement`` waits for a new kind's changelog to get a leader.
        self.changelogs = KindChangelogs(self)
        self.placement: Callable[[int, KindInfo], Awaitable[None]] | None = None
        self._liveness: asyncio.Task[None] | None = None
        self._maintenance: asyncio.Task[None] | None = None
        self.closed = False

    @classmethod
    async def open(cls, engine: Engine, config: KindsConfig | None = None) -> KindsEngine:
        """Load every tenant's kinds and rebuild their state from the changelogs."""
        kinds = cls(engine, config or KindsConfig())
        loop = asyncio.get_running_loop()
        for tenant in engine.tenants.values():
            await kinds._open_tenant(tenant, loop)
        kinds._liveness = loop.create_task(kinds._liveness_loop())
        interval = engine.config.maintenance_interval_ms
        if interval > 0:
            kinds._maintenance = loop.create_task(kinds._maintenance_loop(interval / 1000))
        return kinds

    async def _open_tenant(self, tenant: Tenant, loop: asyncio.AbstractEventLoop) -> TenantKinds:
        directory = tenant.directory / KINDS_DIR

        def load() -> tuple[KindRegistry, list[KindState]]:
            registry = KindRegistry.load(tenant.tenant_id, directory)
            states = [self.open_kind(info) for info in registry.kinds()]
            return registry, states

        registry, states = await loop.run_in_executor(self.executor, load)
        tk = TenantKinds(self, tenant, registry)
        for state in states:
            tk.kinds[state.info.kind_id] = state
            state.committer.start()
            tenant.kind_names.add(state.info.name)
            last = state.log.last_position
            if last is not None:
                tenant.next_position = max(tenant.next_position, last)
        self.tenants[tenant.tenant_id] = tk
        await tk.create_kind(PRESENCE_KIND, PRESENCE_FIELDS, internal=True)
        tk.writers.restarted(tk.kinds[registry.by_name[PRESENCE_KIND]])
        return tk

    def open_kind(self, info: KindInfo) -> KindState:
        """Open (creating) a kind's changelog and store, and its committed state from
        them (a new kind's store gets its first, empty, checkpoint); worker thread."""
        tenant = self.engine.tenant(info.tenant_id)
        kind_dir = tenant.directory / KINDS_DIR / str(info.kind_id)
        directory = kind_dir / "changelog"
        config = LogConfig(
            segment_bytes=self.engine.config.segment_bytes,
            cleanup_policy="compact",
            delete_retention_ms=self.engine.config.delete_retention_ms,
            sync=self.engine.config.sync,
        )
        plog = PartitionLog.open(Path(directory), config, self.engine.files)
        store = KindStore.open(Path(kind_dir) / STORE_DIR, sync=config.sync.kind != "none")
        state = KindState(
            info, plog, GroupCommitter(plog, self.executor), store, self.config.hot_entities
        )
        state.load()
        return state

    @property
    def clustered(self) -> bool:
        """A cluster node has set its rules on the engine (appends on leaders only)."""
        return self.engine.leader_check is not None

    def writable_here(self, state: KindState) -> bool:
        """Whether writes of headwater's own (retractions of a dead source, an epoch's
        end) may go to ``state``: always on a single node and for internal kinds; in a
        cluster only where this node leads the kind's changelog (a follower's state is
        its leader's copy, moved only by replication)."""
        if not self.clustered or state.info.internal:
            return True
        return self.changelogs.leads(state.info.tenant_id, changelog_stream(state.info.name))

    def fire_kind_created(self, tenant: TenantKinds, state: KindState) -> None:
        for hook in list(self.hooks.kind_created):
            try:
                hook(tenant, state)
            except Exception:
                log.exception("kind_created hook failed")

    def tenant(self, tenant_id: int) -> TenantKinds:
        """A tenant's kinds (TenantNotFound when the engine has no such tenant)."""
        tk = self.tenants.get(tenant_id)
        if tk is None:
            self.engine.tenant(tenant_id)  # raises TenantNotFound
            raise KindNotFound(f"tenant {tenant_id} has no kinds loaded")
        return tk

    async def _liveness_loop(self) -> None:
        interval = self.config.liveness_check_ms / 1000
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for tk in list(self.tenants.values()):
                try:
                    tk.check_liveness(now)
                except Exception:
                    log.exception("liveness check failed")
                # A checkpoint comes due after a window's flush; a cluster's follower
                # applies copied records and flushes no window of the kind, so its store
                # would never learn them and its hot set would grow with the kind.
                for state in list(tk.kinds.values()):
                    if state.following and state.checkpoint_due(now) and not state.log.closed:
                        tk.start_checkpoint(state)

    async def run_maintenance(self) -> int:
        """Compact every kind changelog once; returns the records removed."""
        removed = 0
        loop = asyncio.get_running_loop()
        for tk in list(self.tenants.values()):
            for state in list(tk.kinds.values()):
                if state.log.closed:
                    continue
                if self.clustered and not state.info.internal:
                    # Replicas copy batches at their offsets; compaction on each node
                    # on its own would part them (docs/cluster.md: not compacted yet).
                    continue
                result = await loop.run_in_executor(self.executor, state.log.compact)
                removed += result.events_removed
        return removed

    async def _maintenance_loop(self, interval: float) -> None:
        await run_every(interval, self.run_maintenance, "kind changelog maintenance", log)

    async def close(self) -> None:
        """Flush every open window, make it durable, close the changelogs."""
        if self.closed:
            return
        self.closed = True
        await cancel_and_wait(self._liveness, self._maintenance)
        for tk in self.tenants.values():
            await tk.close()
