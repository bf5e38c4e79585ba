"""The writers of one tenant: source slots, presence, liveness, held entities, epochs.

A writer connects into one of 64 source slots (its bit in every source set) or reads
only. While connected it has an entity in the internal ``convergedb_connections`` kind
(its presence). When its connection ends it keeps its slot and its entities for its
liveness deadline (its grace period: the same slot asked for again takes them over);
a source silent past its deadline has its bit retracted from everything it holds. An
epoch (SOURCE_EPOCH_BEGIN..END) retracts what the source held at its beginning and did
not re-assert or patch by its end.

Each held slot's name and liveness deadline are kept in ``kinds/sources.json`` (written
in a worker thread whenever a slot changes hands or is freed), so a restart gives a
source that is away its own name and deadline, not a nameless default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from headwater.engine.kinds.errors import NoEpoch, NoFreeSource, ReadOnlySource, SourceConflict
from headwater.engine.kinds.fields import MAX_SOURCE_ID, FieldSpec, FieldType
from headwater.engine.kinds.model import AssertOp, KindsConfig, RetractOp, WriteOp
from headwater.engine.kinds.registry import KindRegistry
from headwater.engine.kinds.state import KindState
from headwater.storage.metadata import read_json, write_json_atomic

if TYPE_CHECKING:
    from headwater.engine.kinds.service import TenantKinds
    from headwater.engine.kinds.windows import Window

log = logging.getLogger(__name__)

SOURCES_FILE = "sources.json"  # beside the kind registry
PRESENCE_KIND = "convergedb_connections"
PRESENCE_FIELDS = (
    FieldSpec("source_id", FieldType.U8),
    FieldSpec("name", FieldType.STRING),
    FieldSpec("connected_at", FieldType.TIMESTAMP),
    FieldSpec("liveness_deadline_ms", FieldType.U32),
)


def presence_entity_id(source_id: int) -> bytes:
    """The ``convergedb_connections`` entity of a source: its id byte, then 31 zeros."""
    return bytes([source_id]) + bytes(31)


@dataclass(eq=False)
class Source:
    """A writer's slot (0..63) or a read-only reader (``source_id`` None).

    Call :meth:`touch` whenever the peer is heard from; :meth:`disconnect` when its
    connection ends (the liveness deadline then decides the fate of its entities).
    """

    tenant: TenantKinds = field(repr=False)
    source_id: int | None
    name: str
    deadline_ms: int
    on_dead: Callable[[], None] | None = field(repr=False)
    connected: bool = True
    last_seen: float = field(default_factory=time.monotonic)
    connected_at_ns: int = field(default_factory=time.time_ns)

    @property
    def read_only(self) -> bool:
        return self.source_id is None

    @property
    def bit(self) -> int:
        if self.source_id is None:
            raise ReadOnlySource("a read-only connection cannot write")
        return 1 << self.source_id

    def touch(self) -> None:
        self.last_seen = time.monotonic()

    def apply(self, ops: Sequence[WriteOp]) -> Window:
        return self.tenant.apply(self, ops)

    def disconnect(self) -> None:
        self.tenant.disconnect(self)


class Sources:
    """The source slots of one tenant, what each holds and its open epoch.

    Writes of its own (presence entities, retractions) go through the tenant's
    windows, as writes of the source whose slot it is.
    """

    def __init__(self, tenant: TenantKinds, registry: KindRegistry, config: KindsConfig) -> None:
        self.tenant = tenant
        self.registry = registry
        self.config = config
        self.by_slot: dict[int, Source] = {}  # slot -> holder (connected or in grace)
        # Open epochs: source -> kind -> entity ids asserted or patched since BEGIN.
        self.epochs: dict[int, dict[int, set[bytes]]] = {}
        # The held slots' names and deadlines: wanted on disk, and last written there.
        self.path = registry.directory / SOURCES_FILE
        self._wanted: dict[str, dict[str, object]] = {}
        self._written: dict[str, dict[str, object]] = {}
        self._saving: asyncio.Task[None] | None = None

    def _apply(self, sid: int, ops: Sequence[WriteOp]) -> None:
        if self.tenant.owner.clustered:
            # A kind another node leads is moved by replication alone: its leader
            # retracts for its own sources.
            kinds, writable = self.tenant.kinds, self.tenant.owner.writable_here
            blocked = {k for k in {op.kind_id for op in ops} if not writable(kinds[k])}
            if blocked:
                ops = [op for op in ops if op.kind_id not in blocked]
        self.tenant.windows.apply(sid, ops)

    def held_by(self, source_id: int, skip_kind: int | None = None) -> dict[int, list[bytes]]:
        """Kind -> the entity ids whose working source set has ``source_id``'s bit: the
        open window's entries over the flushing one's over the committed state, which is
        streamed (from the store past the hot set), so only the answer is held."""
        bit = 1 << source_id
        windows = self.tenant.windows
        layers = [w for w in (windows.pending, windows.flushing) if w is not None]
        out: dict[int, list[bytes]] = {}
        for kind_id, state in self.tenant.kinds.items():
            if kind_id == skip_kind:
                continue
            ids: list[bytes] = []
            seen: set[bytes] = set()
            for window in layers:  # the open window first: it is the newest
                for eid, entry in window.entities.get(kind_id, {}).items():
                    if eid in seen:
                        continue
                    seen.add(eid)
                    source_set = entry[0] if type(entry) is tuple else entry.source_set  # type: ignore[union-attr]
                    if source_set & bit:
                        ids.append(eid)
            if state.held_counts[source_id]:  # committed entities with the bit
                for eid, (_, source_set, _) in state.committed_items():
                    if source_set & bit and eid not in seen:
                        ids.append(eid)
            if ids:
                ids.sort()  # a sweep retracts (and versions) in id order, however stored
                out[kind_id] = ids
        return out

    def held_count(self, source_id: int, kinds: set[int]) -> int:
        """How many committed entities of ``kinds`` have ``source_id``'s bit."""
        return sum(
            state.held_counts[source_id]
            for kind_id, state in self.tenant.kinds.items()
            if kind_id in kinds
        )

    # ---- connections --------------------------------------------------------------------

    def connect(
        self,
        name: str,
        source_id: int | None,
        read_only: bool,
        deadline_ms: int,
        on_dead: Callable[[], None] | None,
    ) -> Source:
        """See :meth:`TenantKinds.connect`."""
        deadline = deadline_ms or self.config.default_liveness_ms
        if read_only:
            return Source(self.tenant, None, name, deadline, on_dead)
        if source_id is None:
            free = [s for s in range(MAX_SOURCE_ID + 1) if s not in self.by_slot]
            if not free:
                raise NoFreeSource("all 64 source slots of the tenant are taken")
            # A free slot whose bit entities still carry is another writer's, not yet
            # held for it: in a cluster, an old leader's writer until the node taking
            # over has applied its copy (hold_orphans). Taking it would hand that
            # writer's entities to this one (and retract them with it): taken last.
            kinds = set(self.tenant.kinds)
            source_id = next((s for s in free if not self.held_count(s, kinds)), free[0])
        elif not 0 <= source_id <= MAX_SOURCE_ID:
            raise SourceConflict(f"source_id {source_id} is outside 0..{MAX_SOURCE_ID}")
        else:
            holder = self.by_slot.get(source_id)
            if holder is not None and holder.connected:
                raise SourceConflict(f"source {source_id} is held by a live connection")
        source = Source(self.tenant, source_id, name, deadline, on_dead)
        self.by_slot[source_id] = source
        self._write_presence(source, present=True)
        self._remember()
        return source

    def disconnect(self, source: Source) -> None:
        """See :meth:`TenantKinds.disconnect`."""
        if not source.connected:
            return
        source.connected = False
        if self.tenant.closed:  # shutting down: the restart sees to presence and liveness
            return
        if source.source_id is None or self.by_slot.get(source.source_id) is not source:
            return
        self.epochs.pop(source.source_id, None)
        self._write_presence(source, present=False)

    def _write_presence(self, source: Source, *, present: bool) -> None:
        kind_id = self.registry.by_name.get(PRESENCE_KIND)
        if kind_id is None or source.source_id is None:
            return
        eid = presence_entity_id(source.source_id)
        op: WriteOp
        if present:
            values = (
                source.source_id,
                source.name[:1000],
                source.connected_at_ns,
                min(source.deadline_ms, 0xFFFF_FFFF),
            )
            op = AssertOp(kind_id, eid, values)
        else:
            op = RetractOp(kind_id, eid)
        self._apply(source.source_id, [op])

    def writer(self, source: Source) -> int:
        """The slot ``source`` writes as: ReadOnlySource for a reader, SourceConflict
        for a source whose slot was taken over."""
        if source.source_id is None:
            raise ReadOnlySource("a read-only connection cannot write")
        if self.by_slot.get(source.source_id) is not source:
            raise SourceConflict(f"source {source.source_id} was taken over")
        return source.source_id

    # ---- liveness -----------------------------------------------------------------------

    def check_liveness(self, now: float) -> list[Source]:
        """Retract for every source silent past its deadline; returns the dead."""
        dead = [s for s in self.by_slot.values() if (now - s.last_seen) * 1000 > s.deadline_ms]
        for source in dead:
            assert source.source_id is not None
            log.info(
                "source %d (%s) of tenant %d is dead",
                source.source_id,
                source.name,
                self.tenant.tenant_id,
            )
            was_connected = source.connected
            self.disconnect(source)
            self.retract_source(source.source_id)
            del self.by_slot[source.source_id]
            if was_connected and source.on_dead is not None:
                try:
                    source.on_dead()
                except Exception:
                    log.exception("on_dead callback failed")
        if dead:
            self._remember()
            # A retraction lost with its window (a full disk) leaves the dead sources'
            # bits on their entities and no slot to retract them again: each is then
            # held again as away, for one more deadline, as after a restart.
            deadlines = {s.source_id: s.deadline_ms for s in dead if s.source_id is not None}
            names = {s.source_id: s.name for s in dead if s.source_id is not None}

            window = self.tenant.windows.window_for_ack()

            def retracted(_: asyncio.Future[None]) -> None:
                if self.tenant.closed:
                    return  # shutting down: the restart holds them
                if window.failure() is not None:
                    # These slots only: another freed one whose retraction is in a
                    # later window still has its bit on committed entities too.
                    self.hold_orphans(deadlines, names, only=set(deadlines))
                    self._remember()

            window.done.add_done_callback(retracted)
        return dead

    def retract_source(self, source_id: int) -> int:
        """Clear ``source_id``'s bit from every entity it holds; returns how many."""
        held = self.held_by(source_id)
        ops: list[WriteOp] = [RetractOp(k, e) for k, eids in held.items() for e in eids]
        self._apply(source_id, ops)
        return len(ops)

    # ---- epochs -----------------------------------------------------------------------

    def begin_epoch(self, source: Source) -> None:
        """See :meth:`TenantKinds.begin_epoch`. The epoch records what the source
        writes from now on: at its end the source holds nothing else it did not hold at
        its beginning (only a source's own writes set its bit), so what it holds then
        and did not write is what it held at BEGIN and did not re-write."""
        sid = self.writer(source)
        self.epochs[sid] = {}

    def end_epoch(self, source: Source) -> int:
        """See :meth:`TenantKinds.end_epoch`; returns how many were retracted."""
        sid = self.writer(source)
        written = self.epochs.pop(sid, None)
        if written is None:
            raise NoEpoch("SOURCE_EPOCH_END without an open epoch")
        presence = self.registry.by_name.get(PRESENCE_KIND)
        ops: list[WriteOp] = []
        for kind_id, eids in self.held_by(sid, skip_kind=presence).items():
            rewritten = written.get(kind_id, set())
            ops += [RetractOp(kind_id, eid) for eid in eids if eid not in rewritten]
        self._apply(sid, ops)
        return len(ops)

    # ---- restart ------------------------------------------------------------------------

    def restarted(self, presence: KindState) -> None:
        """Nobody is connected after a restart: presence entities from before go, and
        every source holding entities gets one liveness deadline (its own, which
        sources.json or its presence entity kept) to come back, under its name."""
        deadlines: dict[int, int] = {}
        names: dict[int, str] = {}
        for entity in list(presence.scan_entities()):
            sid, name, _, deadline_ms = entity.values
            assert isinstance(sid, int) and isinstance(deadline_ms, int)
            deadlines[sid] = deadline_ms
            names[sid] = str(name or "")
            bits = entity.source_set
            for holder in range(MAX_SOURCE_ID + 1):
                if bits >> holder & 1:
                    self._apply(holder, [RetractOp(presence.info.kind_id, entity.entity_id)])
        # A source that disconnected before the restart has no presence entity left:
        # sources.json has what its slot was held under.
        for slot, kept in self._read_kept().items():
            names[slot] = kept[0]
            deadlines[slot] = kept[1]
        self.hold_orphans(deadlines, names)
        self._written = self._read_file()
        self._remember()  # slots that hold nothing any more are forgotten

    def hold_orphans(
        self,
        deadlines: dict[int, int] | None = None,
        names: dict[int, str] | None = None,
        only: set[int] | None = None,
    ) -> None:
        """Every slot (of ``only`` when given) whose bit committed entities carry and
        that no source here holds gets one liveness deadline (``deadlines``' or the
        default) to come back, under its name, before its entities are retracted: after
        a restart, in a cluster after taking over a kind's leadership (its writers were
        the old leader's), and after a dead source's retraction was lost."""
        presence = self.registry.by_name.get(PRESENCE_KIND)
        others = set(self.tenant.kinds) - {presence}
        for sid in range(MAX_SOURCE_ID + 1) if only is None else sorted(only):
            if sid not in self.by_slot and self.held_count(sid, others):
                deadline = (deadlines or {}).get(sid) or self.config.default_liveness_ms
                ghost = Source(self.tenant, sid, (names or {}).get(sid, ""), deadline, None)
                ghost.connected = False
                self.by_slot[sid] = ghost

    # ---- names and deadlines on disk ----------------------------------------------------

    def _read_file(self) -> dict[str, dict[str, object]]:
        if not self.path.exists():
            return {}
        try:
            data = read_json(self.path)
            held = data.get("sources", {}) if isinstance(data, dict) else {}
            return held if isinstance(held, dict) else {}
        except (OSError, ValueError) as exc:  # a damaged file costs names, not the start
            log.warning("%s could not be read (%s): sources come back unnamed", self.path, exc)
            return {}

    def _read_kept(self) -> dict[int, tuple[str, int]]:
        """slot -> (name, liveness deadline ms) as sources.json has them."""
        kept: dict[int, tuple[str, int]] = {}
        for slot, entry in self._read_file().items():
            if not (slot.isdigit() and isinstance(entry, dict)):
                continue
            name, deadline = entry.get("name"), entry.get("liveness_deadline_ms")
            if isinstance(name, str) and isinstance(deadline, int):
                kept[int(slot)] = (name, deadline)
        return kept

    def _remember(self) -> None:
        """Have sources.json hold the held slots' names and deadlines: written in a
        worker thread, one write at a time, the latest state last."""
        self._wanted = {
            str(sid): {"name": source.name, "liveness_deadline_ms": source.deadline_ms}
            for sid, source in sorted(self.by_slot.items())
        }
        if self._wanted != self._written and (self._saving is None or self._saving.done()):
            self._saving = asyncio.get_running_loop().create_task(self._save())

    async def _save(self) -> None:
        loop = asyncio.get_running_loop()
        while self._wanted != self._written:
            wanted = self._wanted
            try:
                await loop.run_in_executor(
                    self.tenant.owner.executor, write_json_atomic, self.path, {"sources": wanted}
                )
            except OSError as exc:
                log.error("%s not written (%s): names kept in memory only", self.path, exc)
                return
            self._written = wanted

    async def close(self) -> None:
        """Wait for the last write of sources.json."""
        if self._saving is not None:
            with contextlib.suppress(Exception):
                await self._saving
