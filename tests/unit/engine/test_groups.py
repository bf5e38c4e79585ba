"""The group coordinator: Kafka's group protocol flows (join, sync, heartbeat, leave,
session and rebalance timeouts, generations, assignor selection, static members), and
offset commits refused from stale generations with Kafka's error names."""

from __future__ import annotations

import pytest

from headwater.engine.groups import (
    GroupConfig,
    GroupCoordinator,
    GroupState,
    JoinFailed,
    JoinResult,
    TopicPartition,
)
from headwater.engine.groups.errors import (
    FencedInstanceId,
    GroupError,
    GroupMaxSizeReached,
    IllegalGeneration,
    InconsistentGroupProtocol,
    InvalidSessionTimeout,
    RebalanceInProgress,
    UnknownMemberId,
)
from headwater.errors import InvalidRequest

SESSION = 10_000
REBALANCE = 30_000


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


def coordinator(clock: Clock, partitions: dict[str, int] | None = None) -> GroupCoordinator:
    counts = partitions if partitions is not None else {"s": 6}
    ids = iter(range(1000))
    return GroupCoordinator(
        lambda stream: counts.get(stream, 0),
        clock=clock,
        new_member_id=lambda client: f"{client or 'm'}-{next(ids)}",
    )


def join(
    c: GroupCoordinator,
    member_id: str = "",
    protocols: tuple[str, ...] = ("range",),
    streams: tuple[str, ...] = ("s",),
    **kw: object,
) -> tuple[str, list[JoinResult | JoinFailed]]:
    return c.join(
        "g",
        member_id,
        protocols=protocols,
        streams=streams,
        session_timeout_ms=SESSION,
        rebalance_timeout_ms=REBALANCE,
        **kw,  # type: ignore[arg-type]
    )


def results(replies: list[JoinResult | JoinFailed]) -> dict[str, JoinResult]:
    return {r.member_id: r for r in replies if isinstance(r, JoinResult)}


def test_first_member_joins_syncs_and_is_stable() -> None:
    clock = Clock()
    c = coordinator(clock)
    a, replies = join(c)
    (reply,) = replies
    assert reply == JoinResult(a, 1, "range", a, (a,))
    assert c.describe("g").state is GroupState.COMPLETING_REBALANCE
    sync = c.sync("g", a, 1)
    assert sync.assignment == tuple(TopicPartition("s", p) for p in range(6))
    assert c.describe("g").state is GroupState.STABLE
    c.heartbeat("g", a, 1)


def test_a_second_member_waits_until_the_first_rejoins() -> None:
    clock = Clock()
    c = coordinator(clock)
    a, _ = join(c)
    c.sync("g", a, 1)
    b, replies = join(c)
    assert replies == []  # b waits: a has not rejoined yet
    assert c.describe("g").state is GroupState.PREPARING_REBALANCE
    with pytest.raises(RebalanceInProgress) as raised:
        c.heartbeat("g", a, 1)
    assert raised.value.kafka_name == "REBALANCE_IN_PROGRESS" and raised.value.kafka_code == 27
    _, replies = join(c, a)
    got = results(replies)
    assert set(got) == {a, b}  # a's join completes b's pending one too
    assert {r.generation for r in got.values()} == {2} and got[b].leader == a
    sa, sb = c.sync("g", a, 2), c.sync("g", b, 2)
    assert len(sa.assignment) == len(sb.assignment) == 3
    # Eager: a gave up everything before it rejoined, so there is nothing left to revoke.
    assert sa.revoke == sb.revoke == () and not set(sa.assignment) & set(sb.assignment)
    assert c.describe("g").state is GroupState.STABLE


def test_stale_generation_and_unknown_members_are_refused() -> None:
    clock = Clock()
    c = coordinator(clock)
    a, _ = join(c)
    c.sync("g", a, 1)
    with pytest.raises(IllegalGeneration):
        c.sync("g", a, 0)
    with pytest.raises(IllegalGeneration):
        c.heartbeat("g", a, 7)
    with pytest.raises(UnknownMemberId):
        c.heartbeat("g", "nobody", 1)
    with pytest.raises(UnknownMemberId):
        join(c, "nobody")


def test_leave_rebalances_the_rest_at_once() -> None:
    clock = Clock()
    c = coordinator(clock)
    a, _ = join(c)
    b, _ = join(c)
    join(c, a)
    c.sync("g", a, 2)
    c.sync("g", b, 2)
    assert c.leave("g", b) == []
    _, replies = join(c, a)
    assert results(replies)[a].generation == 3
    assert len(c.sync("g", a, 3).assignment) == 6
    assert c.leave("g", a) == []  # the last member: the group is empty at once
    group = c.describe("g")
    assert group.state is GroupState.EMPTY and group.generation == 4


def test_session_timeout_removes_a_silent_member() -> None:
    clock = Clock()
    c = coordinator(clock)
    a, _ = join(c)
    b, _ = join(c)
    join(c, a)
    c.sync("g", a, 2)
    c.sync("g", b, 2)
    clock.now += SESSION - 1
    c.heartbeat("g", a, 2)  # a keeps its session; b says nothing
    assert c.tick() == []
    assert c.next_deadline() == clock.now + 1
    clock.now += 1
    c.tick()
    assert [m.member_id for m in c.describe("g").members] == [a]
    with pytest.raises(UnknownMemberId):
        c.heartbeat("g", b, 2)
    with pytest.raises(RebalanceInProgress):
        c.heartbeat("g", a, 2)


def test_rebalance_timeout_drops_members_that_do_not_rejoin() -> None:
    clock = Clock()
    c = coordinator(clock)
    a, _ = join(c)
    c.sync("g", a, 1)
    b, replies = join(c)
    assert replies == []
    # a heartbeats (learning of the rebalance) but never rejoins.
    clock.now += REBALANCE - 1
    with pytest.raises(RebalanceInProgress):
        c.heartbeat("g", a, 1)
    assert c.tick() == []
    clock.now += 1
    (reply,) = c.tick()
    assert reply == JoinResult(b, 2, "range", b, (b,))


def test_a_member_that_never_syncs_is_removed_at_the_rebalance_timeout() -> None:
    clock = Clock()
    c = coordinator(clock)
    a, _ = join(c)
    b, _ = join(c)
    join(c, a)
    c.sync("g", a, 2)
    for _ in range(3):  # heartbeats alone do not stand in for the SyncGroup
        clock.now += REBALANCE // 3
        c.heartbeat("g", a, 2)
        c.heartbeat("g", b, 2)
    c.tick()
    assert [m.member_id for m in c.describe("g").members] == [a]


def test_protocol_selection_and_inconsistent_protocols() -> None:
    clock = Clock()
    c = coordinator(clock)
    a, _ = join(c, protocols=("cooperative-sticky", "range"))
    b, _ = join(c, protocols=("range", "cooperative-sticky"))
    c_, _ = join(c, protocols=("range", "unknown-assignor"))
    _, replies = join(c, a, protocols=("cooperative-sticky", "range"))
    _, replies2 = join(c, b, protocols=("range", "cooperative-sticky"))
    got = results(replies + replies2)
    assert {r.protocol for r in got.values()} == {"range"}  # the only one all support
    with pytest.raises(InconsistentGroupProtocol) as raised:
        join(c, protocols=("roundrobin",))
    assert raised.value.kafka_code == 23
    with pytest.raises(InconsistentGroupProtocol):
        join(c, protocols=("no-such-assignor",))
    with pytest.raises(InvalidSessionTimeout):
        c.join("g", "", protocols=("range",), streams=("s",), session_timeout_ms=10)
    assert c_ in got


def test_votes_pick_the_most_preferred_common_assignor() -> None:
    clock = Clock()
    c = coordinator(clock)
    a, _ = join(c, protocols=("range", "roundrobin"))
    b, _ = join(c, protocols=("roundrobin", "range"))
    x, _ = join(c, protocols=("roundrobin", "range"))
    replies = join(c, a, protocols=("range", "roundrobin"))[1]
    replies += join(c, b, protocols=("roundrobin", "range"))[1]
    assert {r.protocol for r in results(replies).values()} == {"roundrobin"}
    assert x in results(replies)


def test_unchanged_follower_rejoin_in_stable_does_not_rebalance() -> None:
    clock = Clock()
    c = coordinator(clock)
    a, _ = join(c)
    b, _ = join(c)
    join(c, a)
    c.sync("g", a, 2)
    c.sync("g", b, 2)
    _, replies = join(c, b)
    assert results(replies)[b].generation == 2
    assert c.describe("g").state is GroupState.STABLE
    _, replies = join(c, b, streams=("s", "t"))  # changed subscription: rebalance
    assert replies == [] and c.describe("g").state is GroupState.PREPARING_REBALANCE


def test_cooperative_rebalance_revokes_before_it_hands_over() -> None:
    clock = Clock()
    c = coordinator(clock)
    coop = ("cooperative-sticky",)
    a, _ = join(c, protocols=coop)
    assert len(c.sync("g", a, 1).assignment) == 6
    b, _ = join(c, protocols=coop)
    with pytest.raises(RebalanceInProgress):
        c.heartbeat("g", a, 1)
    join(c, a, protocols=coop)
    sa, sb = c.sync("g", a, 2), c.sync("g", b, 2)
    # a keeps 3, revokes 3; b gets nothing while a still holds them.
    assert len(sa.assignment) == 3 and len(sa.revoke) == 3 and sb.assignment == ()
    # Every member synced: the coordinator starts the follow-up rebalance itself.
    assert c.describe("g").state is GroupState.PREPARING_REBALANCE
    join(c, a, protocols=coop)
    join(c, b, protocols=coop)
    sa3, sb3 = c.sync("g", a, 3), c.sync("g", b, 3)
    assert sa3.assignment == sa.assignment and sa3.revoke == ()  # a kept its three
    assert set(sb3.assignment) == set(sa.revoke)
    assert c.describe("g").state is GroupState.STABLE


def test_static_member_restart_keeps_its_assignment_without_a_rebalance() -> None:
    clock = Clock()
    c = coordinator(clock)
    a, _ = join(c, instance_id="i-a")
    b, _ = join(c, instance_id="i-b")
    join(c, a, instance_id="i-a")
    before = c.sync("g", a, 2).assignment
    c.sync("g", b, 2)
    # a's process restarts: a new member id for the same instance id.
    a2, replies = join(c, instance_id="i-a")
    assert a2 != a and results(replies)[a2].generation == 2
    assert c.describe("g").state is GroupState.STABLE
    assert c.sync("g", a2, 2, "i-a").assignment == before
    with pytest.raises(FencedInstanceId) as raised:
        c.heartbeat("g", a, 2, "i-a")
    assert raised.value.kafka_code == 82
    with pytest.raises(UnknownMemberId):
        c.heartbeat("g", a, 2)


def test_commit_checks_follow_kafka() -> None:
    clock = Clock()
    c = coordinator(clock)
    c.validate_commit("g")  # no group yet: a simple consumer may commit
    a, _ = join(c)
    with pytest.raises(RebalanceInProgress):  # joined, not yet synced
        c.validate_commit("g", a, 1)
    c.sync("g", a, 1)
    c.validate_commit("g", a, 1)
    with pytest.raises(IllegalGeneration) as stale:
        c.validate_commit("g", a, 0)
    assert stale.value.kafka_name == "ILLEGAL_GENERATION" and stale.value.kafka_code == 22
    with pytest.raises(UnknownMemberId) as unknown:
        c.validate_commit("g", "ghost", 1)
    assert unknown.value.kafka_code == 25
    with pytest.raises(UnknownMemberId):  # anonymous commits into a live group
        c.validate_commit("g")
    b, _ = join(c)  # a rebalance begins: a may still commit for its generation
    c.validate_commit("g", a, 1)
    join(c, a)
    with pytest.raises(IllegalGeneration):  # a generation went by
        c.validate_commit("g", a, 1)
    assert isinstance(stale.value, GroupError) and b


def test_a_stream_growing_rebalances_the_groups_that_consume_it() -> None:
    clock = Clock()
    counts = {"s": 2, "t": 1}
    c = coordinator(clock, counts)
    a, _ = join(c)
    assert len(c.sync("g", a, 1).assignment) == 2
    c.partitions_changed("t")  # nobody consumes t: nothing happens
    c.heartbeat("g", a, 1)
    counts["s"] = 3
    c.partitions_changed("s")
    with pytest.raises(RebalanceInProgress):
        c.heartbeat("g", a, 1)
    join(c, a)
    assert len(c.sync("g", a, 2).assignment) == 3


def test_group_size_limit_and_a_fenced_pending_join() -> None:
    clock = Clock()
    c = GroupCoordinator(lambda s: 4, clock=clock, config=GroupConfig(max_size=3))
    ids = iter(["a", "b", "c", "a2"])  # a refused join takes no id
    c.new_member_id = lambda _: next(ids)
    join(c, instance_id="ia")
    join(c)
    join(c, "a", instance_id="ia")  # generation 2: a and b
    join(c)  # c: a rebalance begins
    with pytest.raises(GroupMaxSizeReached) as raised:
        join(c)
    assert raised.value.kafka_code == 81
    _, replies = join(c, "a", instance_id="ia")
    assert replies == []  # a waits for b
    # a's process restarts while its join is pending: the old join is fenced.
    a2, replies = join(c, instance_id="ia")
    assert a2 == "a2"
    assert [(r.member_id, type(r.error)) for r in replies if isinstance(r, JoinFailed)] == [
        ("a", FencedInstanceId)
    ]
    _, replies = join(c, "b")
    got = results(replies)
    assert set(got) == {"a2", "b", "c"} and got["b"].generation == 3


def test_an_empty_group_can_be_deleted_a_live_one_not() -> None:
    clock = Clock()
    c = coordinator(clock)
    a, _ = join(c)
    with pytest.raises(InvalidRequest):
        c.delete_group("g")
    c.leave("g", a)
    c.delete_group("g")
    with pytest.raises(UnknownMemberId):
        c.describe("g")
