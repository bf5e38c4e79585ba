"""A kind's changelog as a replicated partition (docs/cluster.md, "Entity kinds").

In a cluster every (non-internal) kind's changelog is partition 0 of an internal
stream named :func:`changelog_stream` (``hw_kind_<kind name>``): the controller places
it like any partition, its leader takes the kind's writes, and followers copy its
batches byte for byte (through :class:`KindChangelogs`, which replication reaches a
kind's changelog by, as it reaches a stream partition by name).

* **Leader.** A write to a kind whose changelog this node does not lead is NotLeader
  (naming the leader), refused NotEnoughReplicas when the ISR is below
  min_insync_replicas, and a window is made visible and acknowledged only once the
  in-sync replicas hold its changelog records (:mod:`.commit`). The engine's
  ``leader_check`` and ``replica_acks``, which a cluster node sets for streams, are
  the same checks here.
* **Follower.** Copied records are applied to the follower's own committed state up to
  the high watermark it last learned (:meth:`KindChangelogs.moved`, called when it
  moves), each run of them as the leader's window was: readers, subscriptions and SQL
  on a follower see the kind up to the high watermark.
* **Taking over.** A node that becomes the leader first applies the rest of its copy
  (up to its end: the records above the old high watermark are the new leader's to
  keep), then takes writes; until then a write is NotLeader ("taking over").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING

from headwater.engine.engine import PartitionInfo, StreamInfo, StreamSettings
from headwater.engine.kinds.commit import FlushPlan, commit_plan
from headwater.engine.kinds.errors import KindNotFound
from headwater.engine.kinds.model import (
    CHANGELOG_PREFIX,
    ChangeType,
    KindInfo,
    changelog_stream,
    kind_of_changelog,
)
from headwater.engine.kinds.state import SEQUENCE_KEY, SOURCE_SET, KindState
from headwater.errors import NotLeader
from headwater.storage.batch import Event

if TYPE_CHECKING:
    from headwater.engine.kinds.service import KindsEngine, TenantKinds

log = logging.getLogger(__name__)

FOLLOW_CHUNK = 4096  # changelog records read per step of a follower's catch-up


def replicated(state: KindState) -> bool:
    """Internal kinds (each node's connections) stay the node's own."""
    return not state.info.internal


class KindChangelogs:
    """Every replicated kind changelog of this node, by the stream name etcd knows it by."""

    def __init__(self, kinds: KindsEngine) -> None:
        self._kinds = kinds
        self._follow_tasks: dict[KindState, asyncio.Task[None]] = {}
        self._again: set[KindState] = set()

    # ---- finding ------------------------------------------------------------------------

    def state(self, tenant_id: int, stream: str) -> KindState:
        """The kind state of a changelog stream; KindNotFound when not here (yet)."""
        name = kind_of_changelog(stream)
        tk = self._kinds.tenants.get(tenant_id)
        kind_id = None if tk is None or name is None else tk.registry.by_name.get(name)
        state = None if tk is None or kind_id is None else tk.kinds.get(kind_id)
        if state is None or not replicated(state):
            raise KindNotFound(f"no replicated kind changelog {stream} of tenant {tenant_id}")
        return state

    def holds(self, tenant_id: int, stream: str) -> bool:
        try:
            self.state(tenant_id, stream)
        except KindNotFound:
            return False
        return True

    def tenant(self, tenant_id: int) -> TenantKinds:
        return self._kinds.tenant(tenant_id)

    def kinds(self, tenant_id: int) -> list[KindInfo]:
        """The tenant's replicated kinds here (none for a tenant without kinds)."""
        tk = self._kinds.tenants.get(tenant_id)
        if tk is None:
            return []
        return [state.info for state in tk.kinds.values() if replicated(state)]

    def streams(self, tenant_id: int) -> list[StreamInfo]:
        """The tenant's replicated kind changelogs, each as a stream of one partition
        (what the cluster registers, reports and places). Its ``stream_id`` is the
        kind id negated: never a stream's, and never reused (kinds are not deleted)."""
        tk = self._kinds.tenants.get(tenant_id)
        if tk is None:
            return []
        found = []
        for state in tk.kinds.values():
            if not replicated(state):
                continue
            plog = state.log
            start, end = plog.start_offset, plog.committed_offset
            size, segments = plog.size_bytes, len(plog.segments)
            part = PartitionInfo(0, start, end, size, segments, end, plog.readable_offset)
            found.append(
                StreamInfo(
                    tenant_id,
                    -state.info.kind_id,
                    changelog_stream(state.info.name),
                    0,
                    start,
                    end,
                    size,
                    segments,
                    StreamSettings(),
                    plog.config.sync.kind,
                    1,
                    (part,),
                )
            )
        return found

    def set_placement(self, placement: Callable[[int, KindInfo], Awaitable[None]]) -> None:
        """CREATE_KIND of a new kind awaits ``placement(tenant, kind)`` before it is
        answered (the cluster registers the changelog and waits for its leader)."""
        self._kinds.placement = placement

    def kick_leaders(self, tenant_id: int) -> None:
        """Each tick: a kind this node now leads but has not applied all of (it was a
        follower) applies the rest of its copy, so it takes writes without waiting for
        the first one to be refused."""
        for info in self.kinds(tenant_id):
            stream = changelog_stream(info.name)
            state = self.state(tenant_id, stream)
            if state.following and self.leads(tenant_id, stream):
                self._start_follow(tenant_id, state)

    # ---- replication's side -------------------------------------------------------------

    async def append_stored(self, tenant_id: int, stream: str, data: bytes) -> int:
        """A follower appends its leader's batches as they are; the new end once durable
        (applied to the state later, up to the high watermark: :meth:`moved`)."""
        state = self.state(tenant_id, stream)
        end = state.log.append_stored(data)
        tenant = self._kinds.engine.tenant(tenant_id)
        last = state.log.last_position
        if last is not None and last > tenant.next_position:
            # The copies carry the leader's tenant log positions (the kind's versions):
            # this node's next versions pass them.
            tenant.next_position = last
        await state.committer.committed(end)
        return end

    async def truncate(self, tenant_id: int, stream: str, offset: int) -> int:
        """Cut a divergent tail; a state that had applied any of it is rebuilt from the
        changelog (and its store) as at open. The new end."""
        state = self.state(tenant_id, stream)
        loop = asyncio.get_running_loop()
        executor = self._kinds.executor
        end = await loop.run_in_executor(executor, state.log.truncate_to, offset)
        if state.applied_offset > end:
            log.warning(
                "kind %s (tenant %d): applied changelog past the cut at %d; rebuilding its state",
                state.info.name,
                tenant_id,
                end,
            )
            running = self._follow_tasks.get(state)
            if running is not None:
                await asyncio.gather(running, return_exceptions=True)
            await loop.run_in_executor(executor, state.rebuild)
        return end

    def limit(self, tenant_id: int, stream: str, limit: Callable[[], int]) -> None:
        """Followers apply the changelog below ``limit()`` (the high watermark)."""
        self.state(tenant_id, stream).replica_limit = limit

    def moved(self, tenant_id: int, stream: str) -> None:
        """The changelog's high watermark moved (or leadership changed): a follower
        applies what it now may; a new leader applies the rest of its copy."""
        try:
            state = self.state(tenant_id, stream)
        except KindNotFound:
            return
        if self.leads(tenant_id, stream) and not state.following:
            return  # its own windows move its state
        state.following = True
        self._start_follow(tenant_id, state)

    def leads(self, tenant_id: int, stream: str) -> bool:
        check = self._kinds.engine.leader_check
        if check is None:
            return True
        try:
            check(tenant_id, stream, 0)
        except NotLeader:
            return False
        return True

    def check_writable(self, tenant_id: int, state: KindState) -> None:
        """Before a write: NotLeader unless this node leads the kind's changelog and
        has applied all of it; NotEnoughReplicas below min ISR (nothing applied)."""
        engine = self._kinds.engine
        stream = changelog_stream(state.info.name)
        if engine.leader_check is not None:
            try:
                engine.leader_check(tenant_id, stream, 0)
            except NotLeader as exc:
                raise NotLeader(_kind_message(state, exc.message), exc.leader) from None
            if state.following:
                self._start_follow(tenant_id, state)
                raise NotLeader(
                    f"this node is taking over the leadership of kind {state.info.name}: "
                    "retry shortly"
                )
        if engine.replica_acks is not None:
            engine.replica_acks.check_min_isr(tenant_id, stream, 0)

    # ---- a follower's catch-up -----------------------------------------------------------

    def _start_follow(self, tenant_id: int, state: KindState) -> None:
        running = self._follow_tasks.get(state)
        if running is not None and not running.done():
            self._again.add(state)  # it looks again when done
            return
        task = asyncio.get_running_loop().create_task(self._follow(tenant_id, state))
        self._follow_tasks[state] = task
        task.add_done_callback(lambda _t: self._follow_tasks.pop(state, None))

    async def _follow(self, tenant_id: int, state: KindState) -> None:
        stream = changelog_stream(state.info.name)
        try:
            while True:
                self._again.discard(state)
                leading = self.leads(tenant_id, stream)
                committed = state.log.committed_offset
                limit = state.replica_limit
                target = committed if leading or limit is None else min(limit(), committed)
                if state.applied_offset < target:
                    await self._apply_upto(state, target)
                    continue
                if leading:
                    state.following = False  # every record applied: it takes writes now
                    # The old leader's writers hold entities: each gets its liveness
                    # deadline here to reconnect, or its entities are retracted.
                    self._kinds.tenant(tenant_id).writers.hold_orphans()
                    log.info("kind %s (tenant %d): leading", state.info.name, tenant_id)
                if state not in self._again:
                    return
        except Exception:
            log.exception("applying the changelog of kind %s failed", state.info.name)

    async def _apply_upto(self, state: KindState, target: int) -> None:
        """Apply changelog records from the state's applied offset below ``target``,
        read in a worker thread a chunk at a time."""
        start = state.applied_offset
        upto = min(target, start + FOLLOW_CHUNK)

        def read() -> list[Event]:
            return list(state.log.events(start, upto))

        events = await asyncio.get_running_loop().run_in_executor(self._kinds.executor, read)
        if state.applied_offset != start:
            return  # rebuilt meanwhile: the next step starts from where it is now
        for plan in _plans(state, events):
            commit_plan(plan)  # before the next is planned: it reads the state this leaves
        state.applied_offset = upto  # every record below it applied (or none was there)


def _kind_message(state: KindState, message: str) -> str:
    """NotLeader's message for a kind: the changelog partition named as the kind."""
    stream = changelog_stream(state.info.name)
    return message.replace(f"partition 0 of {stream}", f"kind {state.info.name}")


def _plans(state: KindState, events: list[Event]) -> Iterator[FlushPlan]:
    """The leader's windows again: runs of records with consecutive versions (tenant
    log positions) and distinct entities, each committed as one window (versions
    ``first + i``, net changes against the committed state as the leader had it)."""
    plan: FlushPlan | None = None
    seen: set[bytes] = set()
    unpack_set = SOURCE_SET.unpack_from
    created, updated, deleted = (
        int(ChangeType.CREATED),
        int(ChangeType.UPDATED),
        int(ChangeType.DELETED),
    )
    for event in events:
        eid = event.key
        if eid is None:
            continue
        if eid == SEQUENCE_KEY:
            if plan is not None:
                plan.next_sequence = unpack_set(event.value)[0]
                plan.applied = event.position + 1
                plan.applied_offset = event.offset + 1
            else:
                state.next_sequence = unpack_set(event.value)[0]
            continue
        if plan is None or eid in seen or plan.first + len(plan.entity_ids) != event.position:
            if plan is not None:
                yield plan  # committed by the caller before the next one is planned
            plan = FlushPlan(
                state, state.info.fields, event.position, [], [], [], [], [], None, [], [],
                state.next_sequence if plan is None else plan.next_sequence,
            )  # fmt: skip
            seen = set()
        seen.add(eid)
        committed = state.lookup(eid)
        before = None if committed is None else (committed[1], committed[2])
        plan.entity_ids.append(eid)
        if event.tombstone:
            plan.deleted.append(len(plan.changes))
            plan.changes.append(deleted)
            plan.source_sets.append(0)
            plan.records.append(b"")
            plan.previous.append(None)
            if before is not None:
                plan.added -= 1
                plan.moves[before[0], 0] = plan.moves.get((before[0], 0), 0) + 1
        else:
            source_set = unpack_set(event.value)[0]
            record = state.whole_record(bytes(event.value[SOURCE_SET.size :]))
            plan.changes.append(created if before is None else updated)
            plan.source_sets.append(source_set)
            plan.records.append(record)
            plan.previous.append(None if before is None else before[1])
            if before is None:
                plan.added += 1
            move = (0 if before is None else before[0], source_set)
            plan.moves[move] = plan.moves.get(move, 0) + 1
        plan.applied = event.position + 1
        plan.applied_offset = event.offset + 1
    if plan is not None:
        yield plan


__all__ = ["CHANGELOG_PREFIX", "KindChangelogs", "changelog_stream", "kind_of_changelog"]
