"""The group coordinator: Kafka's classic group protocol as a pure state machine.

No I/O and no clock of its own: every call takes effect at ``clock()`` (injected,
milliseconds), and the caller drives time with :meth:`GroupCoordinator.tick` at
:meth:`GroupCoordinator.next_deadline`. A JoinGroup may have to wait for the other
members (Kafka holds the request open); here :meth:`join` returns at once with the
replies that became ready, which may be for other members' earlier joins; a shell keeps
each member's pending join by member id and answers it when its reply appears.

A group moves Empty -> PreparingRebalance -> CompletingRebalance -> Stable and back to
PreparingRebalance whenever a member joins, leaves, changes its subscription or times
out (Kafka's states). A rebalance completes when every member has rejoined, or at the
rebalance timeout (the largest of the members'), when those that did not are removed;
it bumps the generation, picks the assignor every member supports (each member votes for
its first choice among them; the most votes wins, ties to the leader's preference) and
computes the assignment on the server (as Kafka's KIP-848 does, so a client needs no
assignor code). Each member then fetches its assignment with SyncGroup; a member that
does not within the rebalance timeout is removed. Heartbeats keep a member's session
(``session_timeout_ms``); a member silent past it is removed.

Cooperative rebalancing (``cooperative-sticky``): a member keeps what it can, and a
partition moving from A to B is first only taken from A (A's SyncGroup answer lists it
in ``revoke``); once every member has synced, the coordinator starts a follow-up
rebalance, in which the partition, now owned by nobody, goes to B. So no partition is
ever assigned to a member while another still holds it. Eager assignors (range,
roundrobin) assume a member gives up everything before it rejoins, as Kafka's do.

Assigned by the leader (``client_assigns``, Kafka's classic protocol as Kafka clients
speak it): the coordinator only picks the protocol (the same vote) and a leader; the
leader computes the assignment with its own assignor from the members' metadata and
sends it in its SyncGroup (:meth:`sync_client`), and every member gets what the leader
gave it, as opaque bytes with the partitions they name. A member's SyncGroup before the
leader's waits for it (Kafka holds the request open): its reply comes out of the
leader's call, or a SyncFailed when the group rebalances first. Cooperative protocols
are then the clients' own business (they revoke and rejoin themselves). One group is
assigned one way: a member asking the other is refused (InconsistentGroupProtocol).

Static membership: a member with a ``group.instance.id`` that rejoins under a new member
id (a restart) takes over the old member's place and assignment without a rebalance
when its subscription is unchanged; the old member id is fenced (FencedInstanceId).

Offsets: :meth:`validate_commit` applies Kafka's generation checks to an offset commit
(UNKNOWN_MEMBER_ID, ILLEGAL_GENERATION, REBALANCE_IN_PROGRESS); the offsets themselves
are kept by :mod:`headwater.engine.groups.offsets`.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from headwater.engine.groups.assignors import (
    ASSIGNORS,
    MemberSubscription,
    TopicPartition,
    cooperative_step,
)
from headwater.engine.groups.errors import (
    FencedInstanceId,
    GroupError,
    GroupMaxSizeReached,
    IllegalGeneration,
    InconsistentGroupProtocol,
    InvalidGroupId,
    InvalidSessionTimeout,
    RebalanceInProgress,
    UnknownMemberId,
)
from headwater.errors import InvalidRequest

NO_GENERATION = -1  # a commit from outside group management (Kafka's -1)


class GroupState(StrEnum):
    EMPTY = "Empty"
    PREPARING_REBALANCE = "PreparingRebalance"
    COMPLETING_REBALANCE = "CompletingRebalance"
    STABLE = "Stable"


@dataclass(frozen=True)
class GroupConfig:
    """Kafka's broker defaults (group.min/max.session.timeout.ms, group.max.size)."""

    min_session_timeout_ms: int = 6_000
    max_session_timeout_ms: int = 1_800_000
    max_size: int | None = None


@dataclass(frozen=True)
class JoinResult:
    """A completed JoinGroup: the member's id and generation, the assignor chosen, the
    leader and the members (Kafka gives the member list to the leader only; here the
    assignment is computed by the coordinator, so every member may see it)."""

    member_id: str
    generation: int
    protocol: str
    leader: str
    members: tuple[str, ...]


@dataclass(frozen=True)
class JoinFailed:
    """A pending JoinGroup answered with an error (its member was fenced meanwhile)."""

    member_id: str
    error: GroupError


@dataclass(frozen=True)
class SyncResult:
    """A member's assignment for ``generation``; ``revoke`` is what it held and must give
    up now (before it rejoins or commits for those partitions). In a group its leader
    assigns, ``data`` is the assignment exactly as the leader sent it."""

    member_id: str
    generation: int
    assignment: tuple[TopicPartition, ...]
    revoke: tuple[TopicPartition, ...]
    data: bytes = b""


@dataclass(frozen=True)
class SyncFailed:
    """A SyncGroup waiting on the leader's, answered with an error: the group rebalanced
    (or the member was removed or fenced) before the leader synced."""

    member_id: str
    error: GroupError


Reply = JoinResult | JoinFailed | SyncResult | SyncFailed


@dataclass
class Member:
    member_id: str
    client_id: str
    instance_id: str | None
    session_timeout_ms: int
    rebalance_timeout_ms: int
    protocols: tuple[str, ...]  # known assignor names, in the member's preference order
    streams: frozenset[str]
    deadline_ms: int  # the session expires here unless the member is heard from
    reported_owned: frozenset[TopicPartition] | None = None  # as it (re)joined
    holding: tuple[TopicPartition, ...] = ()  # what its last SyncGroup answer gave it
    assignment: tuple[TopicPartition, ...] = ()  # this generation's
    awaiting_join: bool = False
    synced: bool = False
    client_assigns: bool = False  # the group's leader assigns (sync_client)
    assignment_data: bytes = b""  # the leader's bytes for this member
    awaiting_sync: bool = False  # its SyncGroup waits for the leader's

    def session_expired(self, now: int) -> bool:
        """Whether its session has run out (a pending request keeps it alive)."""
        return not (self.awaiting_join or self.awaiting_sync) and self.deadline_ms <= now


@dataclass(frozen=True)
class MemberDescription:
    member_id: str
    client_id: str
    instance_id: str | None
    streams: tuple[str, ...]
    assignment: tuple[TopicPartition, ...]
    assignment_data: bytes = b""  # as the leader sent it (a group its leader assigns)


@dataclass(frozen=True)
class GroupDescription:
    group_id: str
    state: GroupState
    generation: int
    protocol: str | None
    leader: str | None
    members: tuple[MemberDescription, ...]
    client_assigned: bool = False


@dataclass
class Group:
    group_id: str
    state: GroupState = GroupState.EMPTY
    generation: int = 0
    protocol: str | None = None
    leader: str | None = None
    members: dict[str, Member] = field(default_factory=dict)  # in join order
    static: dict[str, str] = field(default_factory=dict)  # instance id -> member id
    rebalance_deadline_ms: int | None = None
    withheld: set[TopicPartition] = field(default_factory=set)
    assigned: bool = False  # the leader's assignment for this generation has arrived

    @property
    def client_assigned(self) -> bool:
        return any(m.client_assigns for m in self.members.values())

    def common_protocols(self, excluding: str | None = None) -> set[str] | None:
        """The assignors every member (but ``excluding``) supports; None: no members."""
        sets = [set(m.protocols) for m in self.members.values() if m.member_id != excluding]
        return set.intersection(*sets) if sets else None

    def select_protocol(self) -> str:
        common = self.common_protocols()
        assert common, "join checks every member shares an assignor"
        votes = Counter(next(p for p in m.protocols if p in common) for m in self.members.values())
        best = max(votes.values())
        leader = self.members.get(self.leader or "") or next(iter(self.members.values()))
        preference = leader.protocols
        return next(p for p in preference if votes.get(p) == best)

    def join_result(self, member_id: str) -> JoinResult:
        assert self.protocol is not None and self.leader is not None
        return JoinResult(
            member_id, self.generation, self.protocol, self.leader, tuple(self.members)
        )

    def describe(self) -> GroupDescription:
        return GroupDescription(
            self.group_id,
            self.state,
            self.generation,
            self.protocol,
            self.leader,
            tuple(
                MemberDescription(
                    m.member_id,
                    m.client_id,
                    m.instance_id,
                    tuple(sorted(m.streams)),
                    m.holding,
                    m.assignment_data if m.holding == m.assignment else b"",
                )
                for m in self.members.values()
            ),
            self.client_assigned,
        )


def _random_member_id(client_id: str) -> str:
    return f"{client_id or 'member'}-{uuid.uuid4()}"


class GroupCoordinator:
    """Every consumer group of one tenant. ``partitions_of(stream)`` is a stream's
    partition count now (0: no such stream); ``clock()`` the time in milliseconds."""

    def __init__(
        self,
        partitions_of: Callable[[str], int],
        *,
        clock: Callable[[], int],
        config: GroupConfig | None = None,
        new_member_id: Callable[[str], str] = _random_member_id,
    ) -> None:
        self.partitions_of = partitions_of
        self.clock = clock
        self.config = config or GroupConfig()
        self.new_member_id = new_member_id
        self.groups: dict[str, Group] = {}
        self.rebalances = 0  # completed rebalances, for metrics
        # Replies for waiting SyncGroups that a state change answered: handed out with
        # the replies of the call that made the change.
        self._outbox: list[Reply] = []

    # ---- requests ---------------------------------------------------------------------

    def join(
        self,
        group_id: str,
        member_id: str,
        *,
        protocols: Sequence[str],
        streams: Iterable[str],
        client_id: str = "",
        instance_id: str | None = None,
        session_timeout_ms: int = 45_000,
        rebalance_timeout_ms: int = 300_000,
        owned: Iterable[TopicPartition] | None = None,
        client_assigns: bool = False,
    ) -> tuple[str, list[Reply]]:
        """JoinGroup. Returns the member's id (a new one when ``member_id`` is empty) and
        the replies now ready (this member's among them unless it must wait). With
        ``client_assigns`` the group's leader assigns (any protocol names; see
        :meth:`sync_client`); otherwise the coordinator, with the assignors it knows."""
        if not group_id:
            raise InvalidGroupId("a consumer group id must not be empty")
        low, high = self.config.min_session_timeout_ms, self.config.max_session_timeout_ms
        if not low <= session_timeout_ms <= high:
            raise InvalidSessionTimeout(
                f"session timeout {session_timeout_ms} ms is outside {low}..{high} ms"
            )
        if rebalance_timeout_ms <= 0:
            raise InvalidRequest("the rebalance timeout must be positive")
        if client_assigns:
            known = tuple(dict.fromkeys(protocols))
            if not known:
                raise InconsistentGroupProtocol("a member must offer at least one assignor")
        else:
            known = tuple(dict.fromkeys(p for p in protocols if p in ASSIGNORS))
            if not known:
                raise InconsistentGroupProtocol(
                    f"none of the assignors {list(protocols)} is one of {sorted(ASSIGNORS)}"
                )
        now = self.clock()
        group = self.groups.get(group_id) or Group(group_id)
        others = [m for m in group.members.values() if m.member_id != member_id]
        if others and others[0].client_assigns != client_assigns:
            raise InconsistentGroupProtocol(
                f"group {group_id!r} is assigned by its "
                + ("leader" if others[0].client_assigns else "coordinator")
                + ", the member asks otherwise"
            )
        self.groups[group_id] = group
        reported = None if owned is None else frozenset(owned)
        metadata = (known, frozenset(streams))
        replies: list[Reply] = []
        replaced = False
        if not member_id and instance_id is not None and instance_id in group.static:
            old = group.members[group.static[instance_id]]
            member_id = self.new_member_id(client_id)
            replies += self._replace_static(group, old, member_id)
            replaced = True
        elif not member_id:
            self._check_protocols(group, known, None)
            size = self.config.max_size
            if size is not None and len(group.members) >= size:
                raise GroupMaxSizeReached(f"group {group_id!r} has {size} members already")
            member_id = self.new_member_id(client_id)
            group.members[member_id] = Member(
                member_id,
                client_id,
                instance_id,
                session_timeout_ms,
                rebalance_timeout_ms,
                known,
                metadata[1],
                now + session_timeout_ms,
                reported_owned=reported,
                awaiting_join=True,
                client_assigns=client_assigns,
            )
            if instance_id is not None:
                group.static[instance_id] = member_id
            self._prepare_rebalance(group, now)
            return member_id, self._drain(replies + self._try_complete_join(group, now))
        member = self._member(group, member_id, instance_id)
        self._check_protocols(group, known, member_id)
        changed = (member.protocols, member.streams) != metadata
        member.protocols, member.streams = metadata
        member.session_timeout_ms = session_timeout_ms
        member.rebalance_timeout_ms = rebalance_timeout_ms
        member.deadline_ms = now + session_timeout_ms
        if reported is not None:
            member.reported_owned = reported
        if group.state is GroupState.PREPARING_REBALANCE:
            member.awaiting_join = True
            return member_id, self._drain(replies + self._try_complete_join(group, now))
        # Stable or CompletingRebalance: an unchanged follower (or a restarted static
        # member) gets the current generation again, as in Kafka; a leader's or a changed
        # member's join rebalances.
        quiet = (
            replaced or group.state is GroupState.COMPLETING_REBALANCE or member_id != group.leader
        )
        if not changed and quiet:
            return member_id, self._drain([*replies, group.join_result(member_id)])
        member.awaiting_join = True
        self._prepare_rebalance(group, now)
        return member_id, self._drain(replies + self._try_complete_join(group, now))

    def sync(
        self, group_id: str, member_id: str, generation: int, instance_id: str | None = None
    ) -> SyncResult:
        """SyncGroup: the member's assignment for ``generation`` (a group the
        coordinator assigns; see :meth:`sync_client` for one its leader assigns)."""
        group = self._group(group_id)
        member = self._member(group, member_id, instance_id)
        if member.client_assigns:
            raise InconsistentGroupProtocol(f"group {group_id!r} is assigned by its leader")
        if generation != group.generation:
            raise IllegalGeneration(
                f"generation {generation} is not group {group_id!r}'s ({group.generation})"
            )
        if group.state is GroupState.PREPARING_REBALANCE:
            raise RebalanceInProgress(f"group {group_id!r} is rebalancing: rejoin")
        now = self.clock()
        member.deadline_ms = now + member.session_timeout_ms
        kept = set(member.assignment)
        revoke = tuple(tp for tp in member.holding if tp not in kept)
        member.holding = member.assignment
        member.synced = True
        if group.state is GroupState.COMPLETING_REBALANCE and all(
            m.synced for m in group.members.values()
        ):
            group.state = GroupState.STABLE
            group.rebalance_deadline_ms = None
            if group.withheld:  # cooperative: hand over what has now been let go
                self._prepare_rebalance(group, now)
        return SyncResult(member_id, generation, member.assignment, revoke)

    def sync_client(
        self,
        group_id: str,
        member_id: str,
        generation: int,
        instance_id: str | None = None,
        assignments: Mapping[str, tuple[Sequence[TopicPartition], bytes]] | None = None,
    ) -> list[Reply]:
        """SyncGroup in a group its leader assigns. The leader's ``assignments`` (member
        id -> the partitions and the bytes it gave that member; a member it names not
        gets nothing) settle the generation. Returns the replies now ready: this
        member's unless it waits for the leader's SyncGroup, and, from the leader's, the
        waiting members' too. A group the coordinator assigns answers as :meth:`sync`."""
        group = self._group(group_id)
        member = self._member(group, member_id, instance_id)
        if not member.client_assigns:
            return [self.sync(group_id, member_id, generation, instance_id)]
        if generation != group.generation:
            raise IllegalGeneration(
                f"generation {generation} is not group {group_id!r}'s ({group.generation})"
            )
        if group.state is GroupState.PREPARING_REBALANCE:
            raise RebalanceInProgress(f"group {group_id!r} is rebalancing: rejoin")
        member.deadline_ms = self.clock() + member.session_timeout_ms
        member.synced = True
        if group.assigned:
            return [self._client_sync_result(member, generation)]
        if member_id != group.leader or assignments is None:
            member.awaiting_sync = True
            return []
        for each in group.members.values():
            partitions, data = assignments.get(each.member_id, ((), b""))
            each.assignment, each.assignment_data = tuple(sorted(partitions)), data
        group.assigned = True
        group.state = GroupState.STABLE
        group.rebalance_deadline_ms = None
        replies: list[Reply] = []
        for each in group.members.values():
            if each.awaiting_sync or each is member:
                each.awaiting_sync = False
                replies.append(self._client_sync_result(each, generation))
        return replies

    @staticmethod
    def _client_sync_result(member: Member, generation: int) -> SyncResult:
        kept = set(member.assignment)
        revoke = tuple(tp for tp in member.holding if tp not in kept)
        member.holding = member.assignment
        return SyncResult(
            member.member_id, generation, member.assignment, revoke, member.assignment_data
        )

    def heartbeat(
        self, group_id: str, member_id: str, generation: int, instance_id: str | None = None
    ) -> None:
        """Heartbeat: keeps the session; raises RebalanceInProgress when the member must
        rejoin, IllegalGeneration / UnknownMemberId when it fell out of the group."""
        group = self._group(group_id)
        member = self._member(group, member_id, instance_id)
        if generation != group.generation:
            raise IllegalGeneration(
                f"generation {generation} is not group {group_id!r}'s ({group.generation})"
            )
        member.deadline_ms = self.clock() + member.session_timeout_ms
        if group.state is GroupState.PREPARING_REBALANCE:
            raise RebalanceInProgress(f"group {group_id!r} is rebalancing: rejoin")

    def leave(self, group_id: str, member_id: str, instance_id: str | None = None) -> list[Reply]:
        """LeaveGroup: the member goes at once (no session timeout to wait out)."""
        group = self._group(group_id)
        self._member(group, member_id, instance_id)
        now = self.clock()
        self._remove(group, member_id, now)
        return self._drain(self._try_complete_join(group, now))

    def tick(self) -> list[Reply]:
        """Apply every deadline passed by now: sessions, rebalance and sync timeouts."""
        now = self.clock()
        replies: list[Reply] = []
        for group in self.groups.values():
            for member in list(group.members.values()):
                # A member waiting on its join (or on the leader's sync, as Kafka keeps
                # it alive) is answered by the rebalance deadline.
                if member.session_expired(now):
                    self._remove(group, member.member_id, now)
            deadline = group.rebalance_deadline_ms
            if deadline is not None and deadline <= now:
                if group.state is GroupState.PREPARING_REBALANCE:
                    for member in list(group.members.values()):
                        if not member.awaiting_join:
                            self._remove(group, member.member_id, now)
                elif group.state is GroupState.COMPLETING_REBALANCE:
                    for member in list(group.members.values()):
                        if not member.synced:
                            self._remove(group, member.member_id, now)
            replies += self._try_complete_join(group, now)
        return self._drain(replies)

    def next_deadline(self) -> int | None:
        """When :meth:`tick` next has something to do (None: nothing pending)."""
        deadlines = [
            d
            for group in self.groups.values()
            for d in (
                group.rebalance_deadline_ms,
                *(
                    m.deadline_ms
                    for m in group.members.values()
                    if not (m.awaiting_join or m.awaiting_sync)
                ),
            )
            if d is not None
        ]
        return min(deadlines, default=None)

    def validate_commit(
        self,
        group_id: str,
        member_id: str = "",
        generation: int = NO_GENERATION,
        instance_id: str | None = None,
    ) -> None:
        """Raise unless this member may commit offsets for the group now (Kafka's
        checks). A commit without member and generation is the simple consumer's (a
        manual assignment), allowed only while the group has no members."""
        if not group_id:
            raise InvalidGroupId("a consumer group id must not be empty")
        group = self.groups.get(group_id)
        anonymous = generation < 0 and not member_id and instance_id is None
        if group is None or group.state is GroupState.EMPTY:
            if anonymous:
                return
            raise UnknownMemberId(f"group {group_id!r} has no member {member_id!r}")
        if anonymous:
            raise UnknownMemberId(
                f"group {group_id!r} has members: a commit must name a member and generation"
            )
        member = self._member(group, member_id, instance_id)
        if generation != group.generation:
            raise IllegalGeneration(
                f"generation {generation} is not group {group_id!r}'s ({group.generation})"
            )
        if group.state is GroupState.COMPLETING_REBALANCE and not member.synced:
            raise RebalanceInProgress(f"group {group_id!r} is rebalancing: sync first")
        member.deadline_ms = self.clock() + member.session_timeout_ms

    def partitions_changed(self, stream: str) -> list[Reply]:
        """A stream's partition count changed (it grew): every group consuming it
        rebalances, its members learning so from their next heartbeat. Returns the
        replies of SyncGroups that were waiting (RebalanceInProgress)."""
        now = self.clock()
        for group in self.groups.values():
            settled = group.state in (GroupState.STABLE, GroupState.COMPLETING_REBALANCE)
            if settled and any(stream in m.streams for m in group.members.values()):
                self._prepare_rebalance(group, now)
        return self._drain([])

    def describe(self, group_id: str) -> GroupDescription:
        return self._group(group_id).describe()

    def delete_group(self, group_id: str) -> None:
        """Forget an empty group (its offsets are the offset store's to delete)."""
        group = self._group(group_id)
        if group.members:
            raise InvalidRequest(f"group {group_id!r} has members: it cannot be deleted")
        del self.groups[group_id]

    # ---- internals --------------------------------------------------------------------

    def _drain(self, replies: list[Reply]) -> list[Reply]:
        """``replies`` and the waiting SyncGroups' answers that a change made."""
        if not self._outbox:
            return replies
        out, self._outbox = self._outbox + replies, []
        return out

    def _fail_sync(self, member: Member, error: GroupError) -> None:
        if member.awaiting_sync:
            # Answered now: its session runs from here, as after any answer.
            member.awaiting_sync = False
            member.deadline_ms = self.clock() + member.session_timeout_ms
            self._outbox.append(SyncFailed(member.member_id, error))

    def _group(self, group_id: str) -> Group:
        group = self.groups.get(group_id)
        if group is None:
            raise UnknownMemberId(f"no consumer group {group_id!r}")
        return group

    @staticmethod
    def _member(group: Group, member_id: str, instance_id: str | None) -> Member:
        if instance_id is not None and group.static.get(instance_id, member_id) != member_id:
            raise FencedInstanceId(
                f"instance {instance_id!r} of group {group.group_id!r} has a newer member"
            )
        member = group.members.get(member_id)
        if member is None:
            raise UnknownMemberId(f"group {group.group_id!r} has no member {member_id!r}")
        return member

    @staticmethod
    def _check_protocols(group: Group, known: tuple[str, ...], member_id: str | None) -> None:
        common = group.common_protocols(excluding=member_id)
        if common is not None and not common & set(known):
            raise InconsistentGroupProtocol(
                f"group {group.group_id!r} uses {sorted(common)}; the member offers {list(known)}"
            )

    def _replace_static(self, group: Group, old: Member, member_id: str) -> list[Reply]:
        """A static member back under a new id: same place, same assignment; the old
        id is fenced (and its pending join, if any, answered so). The old process is
        presumed gone, as after a session timeout."""
        replies: list[Reply] = []
        if old.awaiting_join:
            replies.append(JoinFailed(old.member_id, FencedInstanceId("a newer member joined")))
        self._fail_sync(old, FencedInstanceId("a newer member joined"))
        del group.members[old.member_id]
        old.member_id = member_id
        old.holding = ()  # a new process: it holds nothing until its SyncGroup
        group.members[member_id] = old
        assert old.instance_id is not None
        group.static[old.instance_id] = member_id
        if group.leader is not None and group.leader not in group.members:
            group.leader = member_id
        return replies

    def _prepare_rebalance(self, group: Group, now: int) -> None:
        if group.state is GroupState.PREPARING_REBALANCE:
            return
        group.state = GroupState.PREPARING_REBALANCE
        timeouts = [m.rebalance_timeout_ms for m in group.members.values()]
        group.rebalance_deadline_ms = now + max(timeouts, default=0)
        group.assigned = False
        for member in group.members.values():
            member.synced = False
            self._fail_sync(member, RebalanceInProgress(f"group {group.group_id!r} rebalances"))

    def _remove(self, group: Group, member_id: str, now: int) -> None:
        member = group.members.pop(member_id)
        self._fail_sync(member, UnknownMemberId(f"member {member_id!r} left the group"))
        if member.instance_id is not None and group.static.get(member.instance_id) == member_id:
            del group.static[member.instance_id]
        if group.leader == member_id:
            group.leader = None
        if group.state in (GroupState.STABLE, GroupState.COMPLETING_REBALANCE):
            self._prepare_rebalance(group, now)

    @staticmethod
    def _owned(member: Member, cooperative: bool) -> frozenset[TopicPartition]:
        # Under an eager assignor a member gave up everything before rejoining. A member
        # owns at most what it was given: a claim beyond that is ignored.
        if not cooperative:
            return frozenset()
        holding = frozenset(member.holding)
        reported = member.reported_owned
        return holding if reported is None else holding & reported

    def _try_complete_join(self, group: Group, now: int) -> list[Reply]:
        if group.state is not GroupState.PREPARING_REBALANCE:
            return []
        if not all(m.awaiting_join for m in group.members.values()):
            return []
        group.generation += 1
        self.rebalances += 1
        if not group.members:
            group.state = GroupState.EMPTY
            group.protocol = group.leader = None
            group.rebalance_deadline_ms = None
            group.withheld = set()
            return []
        if group.leader not in group.members:
            group.leader = next(iter(group.members))
        group.protocol = group.select_protocol()
        if group.client_assigned:
            # The leader assigns: every member waits for its SyncGroup.
            group.withheld = set()
            for member in group.members.values():
                member.assignment, member.assignment_data = (), b""
            return self._await_syncs(group, now)
        assignor = ASSIGNORS[group.protocol]
        subscriptions = [
            MemberSubscription(
                m.member_id, m.streams, self._owned(m, assignor.cooperative), m.instance_id
            )
            for m in group.members.values()
        ]
        counts = {
            s: self.partitions_of(s) for s in sorted({s for m in subscriptions for s in m.streams})
        }
        target = assignor.assign(subscriptions, counts)
        if assignor.cooperative:
            assignment, group.withheld = cooperative_step(target, subscriptions)
        else:
            assignment, group.withheld = target, set()
        for member, subscription in zip(group.members.values(), subscriptions, strict=True):
            # What it still holds as it rejoined: its SyncGroup answer revokes from that
            # only (an eager member, or one that reported letting go, holds less).
            member.holding = tuple(sorted(subscription.owned))
            member.assignment = tuple(sorted(assignment[member.member_id]))
        return self._await_syncs(group, now)

    @staticmethod
    def _await_syncs(group: Group, now: int) -> list[Reply]:
        """Every member has rejoined and been given what it syncs to (an assignment, or
        none when the leader assigns): the group completes its rebalance, each member
        owing a SyncGroup within its session timeout, the group within the longest
        rebalance timeout; the answers to every member's JoinGroup."""
        for member in group.members.values():
            member.awaiting_join = member.synced = False
            member.reported_owned = None
            member.deadline_ms = now + member.session_timeout_ms
        group.state = GroupState.COMPLETING_REBALANCE
        group.rebalance_deadline_ms = now + max(
            m.rebalance_timeout_ms for m in group.members.values()
        )
        return [group.join_result(m) for m in group.members]
