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
  moves), a chunk at a time, each run of them as the leader's window was, in columns
  (:mod:`.copied`: decoded in a worker thread, compared with the committed state in
  numpy on the loop): readers, subscriptions and SQL on a follower see the kind up to
  the high watermark.
* **Taking over.** A node that becomes the leader first applies the rest of its copy
  (up to its end: the records above the old high watermark are the new leader's to
  keep), then takes writes; until then a write is NotLeader ("taking over").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from headwater.engine.engine import PartitionInfo, StreamInfo, StreamSettings
from headwater.engine.kinds.commit import commit_plan
from headwater.engine.kinds.copied import CopiedRun, copied_plan, copied_runs
from headwater.engine.kinds.errors import KindNotFound
from headwater.engine.kinds.model import (
    CHANGELOG_PREFIX,
    KindInfo,
    changelog_stream,
    kind_of_changelog,
)
from headwater.engine.kinds.state import KindState
from headwater.errors import NotLeader

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
        moved = NotLeader(f"no longer the leader of kind {state.info.name}")
        end = await state.committer.truncate_to(offset, moved)
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
            # NotLeader names the kind, its leader and the leader's listeners: the
            # cluster's check knows a changelog stream for its kind (cluster/view.py).
            engine.leader_check(tenant_id, stream, 0)
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
        """Apply changelog records from the state's applied offset below ``target``, a
        chunk at a time: decoded into runs of windows in a worker thread, each run then
        compared with the committed state and committed on the loop (:mod:`.copied`)."""
        start = state.applied_offset
        upto = min(target, start + FOLLOW_CHUNK)
        fields = state.info.fields

        def read() -> list[CopiedRun]:
            return copied_runs(state.log.batches(start, upto), start, upto, fields)

        runs = await asyncio.get_running_loop().run_in_executor(self._kinds.executor, read)
        if state.applied_offset != start:
            return  # rebuilt meanwhile: the next step starts from where it is now
        for run in runs:
            if run.entity_ids:
                commit_plan(copied_plan(state, run))  # before the next run is planned
            elif run.next_sequence is not None:  # an event kind's window of events only
                state.next_sequence = run.next_sequence
                state.applied_position = run.applied
        state.applied_offset = upto  # every record below it applied (or none was there)


__all__ = ["CHANGELOG_PREFIX", "KindChangelogs", "changelog_stream", "kind_of_changelog"]
