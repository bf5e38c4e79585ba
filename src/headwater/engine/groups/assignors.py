"""Partition assignors: which member of a group consumes which partition.

Each assignor is a pure function of the members' subscriptions (the streams each wants,
the partitions it owns now) and the streams' partition counts, named as Kafka names them
so clients list them in their order of preference:

* ``range``: per stream, the partitions in order and the subscribed members in order
  (by static instance id, else member id); each member takes a contiguous run, the first
  ``partitions % members`` one more (Kafka's ``RangeAssignor``).
* ``roundrobin``: every partition of every subscribed stream in (stream, partition) order,
  dealt to the members in turn, skipping a member not subscribed to that stream (Kafka's
  ``RoundRobinAssignor``).
* ``cooperative-sticky``: balanced first (counts differ by at most one, or a member two
  short cannot take any of the fuller member's partitions), then sticky (a member keeps
  every partition it owns that balance allows), as Kafka's sticky assignors promise; their
  javadoc examples come out the same. It is *cooperative*: the coordinator never gives a
  partition to one member while another still owns it (:func:`cooperative_step`); the
  owner is first told to give it up, and the next rebalance hands it over.

range and roundrobin are *eager*: members give up everything before they rejoin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


class TopicPartition(NamedTuple):
    """One partition of one stream (Kafka's topic-partition)."""

    stream: str
    partition: int


@dataclass(frozen=True)
class MemberSubscription:
    """What the assignor knows of a member."""

    member_id: str
    streams: frozenset[str]
    owned: frozenset[TopicPartition] = field(default_factory=frozenset)
    instance_id: str | None = None

    @property
    def order(self) -> str:
        # Kafka orders static members by instance id, so a restart (new member id)
        # does not reshuffle the assignment.
        return self.instance_id if self.instance_id is not None else self.member_id


Assignment = dict[str, list[TopicPartition]]
AssignorFunction = Callable[[Sequence[MemberSubscription], Mapping[str, int]], Assignment]


def _partitions_of(stream: str, counts: Mapping[str, int]) -> list[TopicPartition]:
    return [TopicPartition(stream, p) for p in range(counts.get(stream, 0))]


def _subscribed_streams(members: Iterable[MemberSubscription]) -> list[str]:
    return sorted({s for m in members for s in m.streams})


def range_assign(members: Sequence[MemberSubscription], counts: Mapping[str, int]) -> Assignment:
    out: Assignment = {m.member_id: [] for m in members}
    ordered = sorted(members, key=lambda m: m.order)
    for stream in _subscribed_streams(members):
        partitions = _partitions_of(stream, counts)
        consumers = [m for m in ordered if stream in m.streams]
        each, extra = divmod(len(partitions), len(consumers))
        start = 0
        for i, member in enumerate(consumers):
            length = each + (1 if i < extra else 0)
            out[member.member_id].extend(partitions[start : start + length])
            start += length
    return out


def roundrobin_assign(
    members: Sequence[MemberSubscription], counts: Mapping[str, int]
) -> Assignment:
    out: Assignment = {m.member_id: [] for m in members}
    ordered = sorted(members, key=lambda m: m.order)
    turn = 0
    for stream in _subscribed_streams(members):
        for tp in _partitions_of(stream, counts):
            while stream not in ordered[turn % len(ordered)].streams:
                turn += 1
            out[ordered[turn % len(ordered)].member_id].append(tp)
            turn += 1
    return out


def sticky_assign(members: Sequence[MemberSubscription], counts: Mapping[str, int]) -> Assignment:
    """The balanced, sticky target assignment (before the cooperative step)."""
    ordered = sorted(members, key=lambda m: m.order)
    held: dict[str, list[TopicPartition]] = {m.member_id: [] for m in ordered}
    kept: dict[str, set[TopicPartition]] = {m.member_id: set() for m in ordered}
    owner: dict[TopicPartition, str] = {}
    # Keep what each member owns, where it still exists and is still subscribed.
    for member in ordered:
        for tp in sorted(member.owned):
            exists = tp.partition < counts.get(tp.stream, 0)
            if exists and tp.stream in member.streams and tp not in owner:
                owner[tp] = member.member_id
                held[member.member_id].append(tp)
                kept[member.member_id].add(tp)
    # Every other partition to the subscribed member holding fewest (then in order).
    for stream in _subscribed_streams(ordered):
        eligible = [m for m in ordered if stream in m.streams]
        for tp in _partitions_of(stream, counts):
            if tp not in owner:
                taker = min(eligible, key=lambda m: len(held[m.member_id]))
                owner[tp] = taker.member_id
                held[taker.member_id].append(tp)
    # Balance: move from the fullest to the emptiest while they differ by two or more and
    # the emptier can take one of the fuller's partitions. Each move lowers the sum of
    # squared counts, so this ends. Newly placed partitions move before kept ones.
    while True:
        moved = False
        by_count = sorted(ordered, key=lambda m: len(held[m.member_id]))
        for receiver in by_count:
            for giver in reversed(by_count):
                if len(held[giver.member_id]) - len(held[receiver.member_id]) < 2:
                    break
                movable = [tp for tp in held[giver.member_id] if tp.stream in receiver.streams]
                if not movable:
                    continue
                fresh = [tp for tp in movable if tp not in kept[giver.member_id]]
                tp = (fresh or movable)[-1]
                held[giver.member_id].remove(tp)
                held[receiver.member_id].append(tp)
                moved = True
                break
            if moved:
                break
        if not moved:
            return held


def cooperative_step(
    target: Mapping[str, Sequence[TopicPartition]], members: Sequence[MemberSubscription]
) -> tuple[Assignment, set[TopicPartition]]:
    """This generation's assignment on the way to ``target``: each member gets its target
    minus any partition another member still owns (that owner's target lacks it, so its
    assignment tells it to revoke it). Returns the assignment and the partitions held
    back, which the next rebalance hands over once their owners have let go."""
    owned_by = {tp: m.member_id for m in members for tp in m.owned}
    out: Assignment = {}
    withheld: set[TopicPartition] = set()
    for member_id, partitions in target.items():
        mine: list[TopicPartition] = []
        for tp in partitions:
            holder = owned_by.get(tp)
            if holder is None or holder == member_id:
                mine.append(tp)
            else:
                withheld.add(tp)
        out[member_id] = mine
    return out, withheld


@dataclass(frozen=True)
class Assignor:
    name: str
    assign: AssignorFunction
    cooperative: bool


ASSIGNORS: dict[str, Assignor] = {
    a.name: a
    for a in (
        Assignor("range", range_assign, cooperative=False),
        Assignor("roundrobin", roundrobin_assign, cooperative=False),
        Assignor("cooperative-sticky", sticky_assign, cooperative=True),
    )
}
