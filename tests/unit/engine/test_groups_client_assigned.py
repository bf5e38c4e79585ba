"""Groups whose leader assigns (Kafka clients' classic protocol): the coordinator picks
the protocol and the leader, each member gets what the leader's SyncGroup gave it, a
SyncGroup before the leader's waits for it and is failed when the group rebalances
first."""

from __future__ import annotations

import pytest

from headwater.engine.groups import (
    GroupCoordinator,
    GroupState,
    JoinResult,
    Reply,
    SyncFailed,
    SyncResult,
    TopicPartition,
)
from headwater.engine.groups.errors import (
    InconsistentGroupProtocol,
    RebalanceInProgress,
    UnknownMemberId,
)

SESSION = 10_000
REBALANCE = 30_000


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


def coordinator(clock: Clock) -> GroupCoordinator:
    ids = iter(range(1000))
    return GroupCoordinator(
        lambda stream: 4, clock=clock, new_member_id=lambda client: f"m-{next(ids)}"
    )


def join(
    c: GroupCoordinator,
    member_id: str = "",
    protocols: tuple[str, ...] = ("my-assignor",),
    client_assigns: bool = True,
) -> tuple[str, list[Reply]]:
    return c.join(
        "g",
        member_id,
        protocols=protocols,
        streams=("s",),
        session_timeout_ms=SESSION,
        rebalance_timeout_ms=REBALANCE,
        client_assigns=client_assigns,
    )


def tp(*partitions: int) -> list[TopicPartition]:
    return [TopicPartition("s", p) for p in partitions]


def two_members(c: GroupCoordinator) -> tuple[str, str]:
    """a and b in generation 2, both joins answered, nobody synced yet."""
    a, _ = join(c)
    assert c.sync_client("g", a, 1, None, {a: (tp(0, 1, 2, 3), b"all")})
    b, replies = join(c)  # a rebalance: a rejoins
    assert not replies
    _, replies = join(c, a)
    assert {r.member_id for r in replies if isinstance(r, JoinResult)} == {a, b}
    return a, b


def test_any_protocol_name_and_the_leaders_assignment_is_what_each_member_gets() -> None:
    c = coordinator(Clock())
    a, b = two_members(c)
    assert c.describe("g").leader == a
    # b syncs first: it waits for the leader's SyncGroup.
    assert c.sync_client("g", b, 2) == []
    replies = c.sync_client("g", a, 2, None, {a: (tp(3), b"A"), b: (tp(0, 1, 2), b"B")})
    by_member = {r.member_id: r for r in replies}
    assert by_member[a] == SyncResult(a, 2, tuple(tp(3)), tuple(tp(0, 1, 2)), b"A")
    assert by_member[b] == SyncResult(b, 2, tuple(tp(0, 1, 2)), (), b"B")
    assert c.describe("g").state is GroupState.STABLE
    # A later SyncGroup of the same generation gets the same answer at once.
    (again,) = c.sync_client("g", b, 2)
    assert isinstance(again, SyncResult) and again.data == b"B"
    described = {m.member_id: m for m in c.describe("g").members}
    assert described[b].assignment_data == b"B" and c.describe("g").client_assigned


def test_a_member_the_leader_does_not_name_gets_nothing() -> None:
    c = coordinator(Clock())
    a, b = two_members(c)
    replies = c.sync_client("g", a, 2, None, {a: (tp(0, 1, 2, 3), b"A")})
    (mine,) = replies
    assert isinstance(mine, SyncResult) and mine.member_id == a
    (theirs,) = c.sync_client("g", b, 2)
    assert theirs == SyncResult(b, 2, (), (), b"")


def test_a_waiting_sync_fails_when_a_member_leaves_before_the_leader_syncs() -> None:
    c = coordinator(Clock())
    a, b = two_members(c)
    assert c.sync_client("g", b, 2) == []
    _, replies = join(c)  # a new member: the group rebalances before a synced
    (failed,) = replies
    assert isinstance(failed, SyncFailed) and failed.member_id == b
    assert isinstance(failed.error, RebalanceInProgress)
    with pytest.raises(RebalanceInProgress):
        c.sync_client("g", a, 2, None, {a: (tp(0), b"A")})


def test_a_leader_that_never_syncs_is_removed_at_the_rebalance_timeout() -> None:
    clock = Clock()
    c = coordinator(clock)
    a, b = two_members(c)
    assert c.sync_client("g", b, 2) == []
    clock.now += REBALANCE
    replies = c.tick()
    failed = [r for r in replies if isinstance(r, SyncFailed)]
    assert [r.member_id for r in failed] == [b]
    assert isinstance(failed[0].error, RebalanceInProgress)
    with pytest.raises(UnknownMemberId):
        c.sync_client("g", a, 2)
    # b rejoins alone, leads, and assigns itself everything.
    _, replies = join(c, b)
    (joined,) = replies
    assert isinstance(joined, JoinResult) and joined.leader == b and joined.generation == 3
    (synced,) = c.sync_client("g", b, 3, None, {b: (tp(0, 1, 2, 3), b"B")})
    assert isinstance(synced, SyncResult) and synced.assignment == tuple(tp(0, 1, 2, 3))


def test_one_group_is_assigned_one_way() -> None:
    c = coordinator(Clock())
    join(c)
    with pytest.raises(InconsistentGroupProtocol):
        join(c, protocols=("range",), client_assigns=False)
    server = coordinator(Clock())
    a, _ = join(server, protocols=("range",), client_assigns=False)
    with pytest.raises(InconsistentGroupProtocol):
        join(server)
    # The coordinator-assigned member syncs as before, through either call.
    (result,) = server.sync_client("g", a, 1)
    assert isinstance(result, SyncResult) and len(result.assignment) == 4


def test_members_must_share_a_protocol() -> None:
    c = coordinator(Clock())
    join(c, protocols=("x", "y"))
    with pytest.raises(InconsistentGroupProtocol):
        join(c, protocols=("z",))
    _, replies = join(c, protocols=("y",))
    assert replies == []  # waits for the first member to rejoin
