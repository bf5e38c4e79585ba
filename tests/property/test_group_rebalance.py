"""Property test of the group coordinator: consumers (modelled as Kafka's client behaves)
join, rejoin, sync, heartbeat, leave, crash and (static members) restart in any order
while the clock jumps, sessions expire and partitions are added. At every step no two
members hold the same partition (in cooperative groups a partition is never handed over
before its holder let go; in eager ones members give up all before rejoining),
generations only grow, and once the rebalance settles every partition is held by exactly
one member, as the coordinator assigned it."""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from headwater.engine.groups import (
    GroupCoordinator,
    GroupState,
    JoinFailed,
    JoinResult,
    Reply,
    TopicPartition,
)
from headwater.engine.groups.errors import (
    IllegalGeneration,
    InconsistentGroupProtocol,
    RebalanceInProgress,
    UnknownMemberId,
)

SESSION = 10_000
REBALANCE = 20_000
PROTOCOLS = [
    ("cooperative-sticky",),
    ("range",),
    ("roundrobin",),
    ("cooperative-sticky", "range"),
    ("range", "roundrobin"),
]
SUBSCRIPTIONS = [("a",), ("a", "b"), ("b",)]


@dataclass
class Client:
    """One consumer as Kafka's client behaves."""

    member_id: str
    protocols: tuple[str, ...]
    streams: tuple[str, ...]
    instance_id: str | None = None  # a static member's group.instance.id
    owned: set[TopicPartition] = field(default_factory=set)
    generation: int = -1
    joined: JoinResult | None = None  # a join answered, not yet synced
    waiting: bool = False  # a join sent, not yet answered
    must_rejoin: bool = False

    @property
    def cooperative(self) -> bool:
        # Kafka's client is cooperative only if every assignor it lists is.
        return all(p == "cooperative-sticky" for p in self.protocols)


class GroupMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.counts = {"a": 3, "b": 5}
        ids = iter(range(1 << 30))
        # Member ids from a counter, so a run replays the same (hypothesis shrinks it).
        self.coordinator = GroupCoordinator(
            lambda stream: self.counts.get(stream, 0),
            clock=lambda: self.now,
            new_member_id=lambda client: f"m{next(ids):03d}",
        )
        self.clients: dict[str, Client] = {}
        self.last_generation = 0
        self.instances = 0

    # ---- the client side --------------------------------------------------------------

    def deliver(self, replies: list[Reply]) -> None:
        for reply in replies:
            client = self.clients.get(reply.member_id)
            if client is None:
                continue
            if isinstance(reply, JoinFailed):
                self.drop(client)
                continue
            client.waiting = False
            client.joined = reply
            client.generation = reply.generation

    def drop(self, client: Client) -> None:
        """The member is out of the group: Kafka's client loses its partitions."""
        client.owned.clear()
        self.clients.pop(client.member_id, None)

    def send_join(self, client: Client) -> None:
        if not client.cooperative:
            client.owned.clear()  # eager: revoke everything before rejoining
        client.must_rejoin = False
        client.joined = None
        client.waiting = True
        _, replies = self.coordinator.join(
            "g",
            client.member_id,
            protocols=client.protocols,
            streams=client.streams,
            session_timeout_ms=SESSION,
            rebalance_timeout_ms=REBALANCE,
            owned=set(client.owned),
            instance_id=client.instance_id,
        )
        self.deliver(replies)

    def send_sync(self, client: Client) -> None:
        assert client.joined is not None
        try:
            result = self.coordinator.sync(
                "g", client.member_id, client.joined.generation, client.instance_id
            )
        except RebalanceInProgress:
            client.joined = None
            client.must_rejoin = True
            return
        except (IllegalGeneration, UnknownMemberId):
            self.drop(client)
            return
        client.joined = None
        assert set(result.revoke) <= client.owned
        client.owned -= set(result.revoke)  # give up first ...
        # ... and only then take the new ones: nobody else may hold them.
        for other in self.clients.values():
            if other is not client:
                assert not other.owned & set(result.assignment), (client, other)
        client.owned = set(result.assignment)

    def send_heartbeat(self, client: Client) -> None:
        try:
            self.coordinator.heartbeat("g", client.member_id, client.generation, client.instance_id)
        except RebalanceInProgress:
            client.must_rejoin = True
        except (IllegalGeneration, UnknownMemberId):
            self.drop(client)

    def forget_removed(self) -> None:
        """Members the coordinator removed (timeouts) are out, as their next request
        would tell them."""
        group = self.coordinator.groups.get("g")
        present = {m for m in group.members} if group else set()
        for client in list(self.clients.values()):
            if client.member_id not in present:
                self.drop(client)

    def pick(self, data: st.DataObject) -> Client:
        return data.draw(st.sampled_from(sorted(self.clients.values(), key=lambda c: c.member_id)))

    # ---- rules ------------------------------------------------------------------------

    @rule(
        protocols=st.sampled_from(PROTOCOLS),
        streams=st.sampled_from(SUBSCRIPTIONS),
        static=st.booleans(),
    )
    def new_member(
        self, protocols: tuple[str, ...], streams: tuple[str, ...], static: bool
    ) -> None:
        if len(self.clients) >= 6:
            return
        self.instances += 1
        self.start(protocols, streams, f"i{self.instances}" if static else None)

    def start(
        self, protocols: tuple[str, ...], streams: tuple[str, ...], instance_id: str | None
    ) -> None:
        try:
            member_id, replies = self.coordinator.join(
                "g",
                "",
                protocols=protocols,
                streams=streams,
                session_timeout_ms=SESSION,
                rebalance_timeout_ms=REBALANCE,
                instance_id=instance_id,
            )
        except InconsistentGroupProtocol:
            return
        self.clients[member_id] = Client(member_id, protocols, streams, instance_id, waiting=True)
        self.deliver(replies)
        self.forget_removed()

    @precondition(lambda self: any(c.instance_id for c in self.clients.values()))
    @rule(data=st.data())
    def static_member_restarts(self, data: st.DataObject) -> None:
        """A static member's process restarts: the new one joins under a new member id
        with the same instance id and takes the old one's place (the old is fenced)."""
        static = sorted(c.member_id for c in self.clients.values() if c.instance_id)
        old = self.clients.pop(data.draw(st.sampled_from(static)))
        self.start(old.protocols, old.streams, old.instance_id)

    @precondition(lambda self: self.clients)
    @rule(data=st.data())
    def rejoin(self, data: st.DataObject) -> None:
        client = data.draw(
            st.sampled_from(sorted(self.clients.values(), key=lambda c: c.member_id))
        )
        if not client.waiting:
            self.send_join(client)
            self.forget_removed()

    @precondition(lambda self: any(c.joined for c in self.clients.values()))
    @rule(data=st.data())
    def sync(self, data: st.DataObject) -> None:
        ready = sorted((c for c in self.clients.values() if c.joined), key=lambda c: c.member_id)
        self.send_sync(data.draw(st.sampled_from(ready)))
        self.forget_removed()

    @precondition(lambda self: self.clients)
    @rule()
    def everyone_heartbeats(self) -> None:
        for client in list(self.clients.values()):
            if not client.waiting:
                self.send_heartbeat(client)

    @precondition(lambda self: self.clients)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        client = data.draw(
            st.sampled_from(sorted(self.clients.values(), key=lambda c: c.member_id))
        )
        client.owned.clear()
        self.clients.pop(client.member_id)
        self.deliver(self.coordinator.leave("g", client.member_id))
        self.forget_removed()

    @precondition(lambda self: self.clients)
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        """The process dies without a word: its session runs out later."""
        client = data.draw(
            st.sampled_from(sorted(self.clients.values(), key=lambda c: c.member_id))
        )
        self.clients.pop(client.member_id)

    @rule(step=st.sampled_from([1, 1_000, SESSION - 1, SESSION, REBALANCE, 3 * REBALANCE]))
    def clock_step(self, step: int) -> None:
        self.now += step
        self.deliver(self.coordinator.tick())
        self.forget_removed()

    @rule()
    def partitions_grow(self) -> None:
        self.counts["b"] += 1
        self.coordinator.partitions_changed("b")

    @rule(newest_first=st.booleans())
    def settle(self, newest_first: bool = True) -> None:
        """Every live member does what its client would until the group is stable (the
        newest members first syncing first is the order that would catch a partition
        handed over before its holder let go)."""
        for _ in range(12):
            if self.stable():
                break
            for client in list(self.clients.values()):
                if client.must_rejoin and not client.waiting and client.member_id in self.clients:
                    self.send_join(client)
            clients = list(self.clients.values())
            for client in reversed(clients) if newest_first else clients:
                if client.joined is not None and client.member_id in self.clients:
                    self.send_sync(client)
            for client in list(self.clients.values()):
                if not client.waiting and client.member_id in self.clients:
                    self.send_heartbeat(client)
            # Crashed members' sessions and pending joins run out.
            if not self.stable() and self.crashed_members():
                self.now += 3 * REBALANCE
                self.deliver(self.coordinator.tick())
                self.forget_removed()
        assert self.stable(), self.coordinator.describe("g")
        self.check_settled()

    def crashed_members(self) -> bool:
        group = self.coordinator.groups.get("g")
        return group is not None and any(m not in self.clients for m in group.members)

    def stable(self) -> bool:
        group = self.coordinator.groups.get("g")
        if group is None or group.state is GroupState.EMPTY:
            return not self.clients
        quiet = all(not (c.waiting or c.joined or c.must_rejoin) for c in self.clients.values())
        return group.state is GroupState.STABLE and quiet and not self.crashed_members()

    def check_settled(self) -> None:
        group = self.coordinator.groups.get("g")
        if group is None or not self.clients:
            return
        wanted = {s for c in self.clients.values() for s in c.streams}
        every = {TopicPartition(s, p) for s in wanted for p in range(self.counts[s])}
        held = [tp for c in self.clients.values() for tp in c.owned]
        assert sorted(held) == sorted(every)  # each exactly once
        for client in self.clients.values():
            member = group.members[client.member_id]
            assert set(member.assignment) == client.owned
            assert all(tp.stream in client.streams for tp in client.owned)
        if (
            group.protocol == "cooperative-sticky"
            and len({c.streams for c in self.clients.values()}) == 1
        ):
            sizes = [len(c.owned) for c in self.clients.values()]
            assert max(sizes) - min(sizes) <= 1

    # ---- invariants -------------------------------------------------------------------

    @invariant()
    def no_partition_held_twice(self) -> None:
        held = [tp for c in self.clients.values() for tp in c.owned]
        assert len(held) == len(set(held))

    @invariant()
    def nobody_is_assigned_what_another_still_holds(self) -> None:
        group = self.coordinator.groups.get("g")
        if group is None:
            return
        for client in self.clients.values():
            assigned = set(group.members[client.member_id].assignment)
            for other in self.clients.values():
                if other is not client:
                    assert not assigned & other.owned, (client, other)

    @invariant()
    def generations_only_grow(self) -> None:
        group = self.coordinator.groups.get("g")
        generation = group.generation if group else 0
        assert generation >= self.last_generation
        self.last_generation = generation
        assert all(c.generation <= generation for c in self.clients.values())

    def teardown(self) -> None:
        self.settle()


GroupMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestGroupRebalance = GroupMachine.TestCase
