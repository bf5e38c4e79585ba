"""Each assignor against the examples in Kafka's own javadoc (RangeAssignor,
RoundRobinAssignor, StickyAssignor), and the cooperative step."""

from __future__ import annotations

from headwater.engine.groups.assignors import (
    ASSIGNORS,
    MemberSubscription,
    TopicPartition,
    cooperative_step,
    range_assign,
    roundrobin_assign,
    sticky_assign,
)


def tps(text: str) -> list[TopicPartition]:
    """ "t0p0 t1p1" -> [("t0", 0), ("t1", 1)] in the order written."""
    out = []
    for item in text.split():
        topic, partition = item.split("p")
        out.append(TopicPartition(topic, int(partition)))
    return out


def members(
    subscriptions: dict[str, str], owned: dict[str, str] | None = None
) -> list[MemberSubscription]:
    owned = owned or {}
    return [
        MemberSubscription(name, frozenset(topics.split()), frozenset(tps(owned.get(name, ""))))
        for name, topics in subscriptions.items()
    ]


def as_sets(assignment: dict[str, list[TopicPartition]]) -> dict[str, set[TopicPartition]]:
    return {m: set(p) for m, p in assignment.items()}


def test_range_kafka_example() -> None:
    # Two consumers, t0 and t1 with 3 partitions each.
    got = range_assign(members({"C0": "t0 t1", "C1": "t0 t1"}), {"t0": 3, "t1": 3})
    assert got == {"C0": tps("t0p0 t0p1 t1p0 t1p1"), "C1": tps("t0p2 t1p2")}


def test_range_orders_static_members_by_instance_id() -> None:
    # After a restart the member ids changed order; the instance ids did not.
    subs = [
        MemberSubscription("C3", frozenset({"t0", "t1"}), instance_id="I0"),
        MemberSubscription("C2", frozenset({"t0", "t1"}), instance_id="I1"),
    ]
    got = range_assign(subs, {"t0": 3, "t1": 3})
    assert got == {"C3": tps("t0p0 t0p1 t1p0 t1p1"), "C2": tps("t0p2 t1p2")}


def test_roundrobin_kafka_examples() -> None:
    got = roundrobin_assign(members({"C0": "t0 t1", "C1": "t0 t1"}), {"t0": 3, "t1": 3})
    assert got == {"C0": tps("t0p0 t0p2 t1p1"), "C1": tps("t0p1 t1p0 t1p2")}
    # Differing subscriptions: a member not subscribed to a topic is skipped.
    subs = members({"C0": "t0", "C1": "t0 t1", "C2": "t0 t1 t2"})
    got = roundrobin_assign(subs, {"t0": 1, "t1": 2, "t2": 3})
    assert got == {"C0": tps("t0p0"), "C1": tps("t1p0"), "C2": tps("t1p1 t2p0 t2p1 t2p2")}
    three = members({"C0": "t0 t1", "C1": "t0 t1", "C2": "t0 t1"})
    got = roundrobin_assign(three, {"t0": 3, "t1": 3})
    assert got == {"C0": tps("t0p0 t1p0"), "C1": tps("t0p1 t1p1"), "C2": tps("t0p2 t1p2")}


def test_sticky_kafka_example_1() -> None:
    counts = {"t0": 2, "t1": 2, "t2": 2, "t3": 2}
    everything = "t0 t1 t2 t3"
    first = sticky_assign(members({"C0": everything, "C1": everything, "C2": everything}), counts)
    assert as_sets(first) == as_sets(
        {"C0": tps("t0p0 t1p1 t3p0"), "C1": tps("t0p1 t2p0 t3p1"), "C2": tps("t1p0 t2p1")}
    )
    # C1 leaves: C0 and C2 keep all they had; C1's partitions are shared out.
    owned = {"C0": "t0p0 t1p1 t3p0", "C2": "t1p0 t2p1"}
    second = sticky_assign(members({"C0": everything, "C2": everything}, owned), counts)
    assert as_sets(second) == as_sets(
        {"C0": tps("t0p0 t1p1 t3p0 t2p0"), "C2": tps("t1p0 t2p1 t0p1 t3p1")}
    )


def test_sticky_kafka_example_2() -> None:
    counts = {"t0": 1, "t1": 2, "t2": 3}
    subs = {"C0": "t0", "C1": "t0 t1", "C2": "t0 t1 t2"}
    first = sticky_assign(members(subs), counts)
    assert as_sets(first) == as_sets(
        {"C0": tps("t0p0"), "C1": tps("t1p0 t1p1"), "C2": tps("t2p0 t2p1 t2p2")}
    )
    # C0 leaves: sticky keeps 5 of the assignments (round robin would keep 3).
    owned = {"C1": "t1p0 t1p1", "C2": "t2p0 t2p1 t2p2"}
    second = sticky_assign(members({"C1": "t0 t1", "C2": "t0 t1 t2"}, owned), counts)
    assert as_sets(second) == as_sets({"C1": tps("t1p0 t1p1 t0p0"), "C2": tps("t2p0 t2p1 t2p2")})


def test_sticky_balances_a_newcomer_by_taking_only_what_it_must() -> None:
    owned = {"A": " ".join(f"sp{i}" for i in range(6))}
    got = sticky_assign(members({"A": "s", "B": "s", "C": "s"}, owned), {"s": 6})
    assert {m: len(p) for m, p in got.items()} == {"A": 2, "B": 2, "C": 2}
    assert set(got["A"]) <= set(tps(owned["A"]))  # A lost 4 and gained none


def test_cooperative_step_withholds_partitions_another_member_still_owns() -> None:
    subs = members({"A": "s", "B": "s"}, {"A": "sp0 sp1 sp2 sp3"})
    target = sticky_assign(subs, {"s": 4})
    assignment, withheld = cooperative_step(target, subs)
    assert len(target["B"]) == 2 and assignment["B"] == []
    assert withheld == set(target["B"])
    assert set(assignment["A"]) == set(target["A"])


def test_assignor_names_and_protocols_are_kafkas() -> None:
    assert sorted(ASSIGNORS) == ["cooperative-sticky", "range", "roundrobin"]
    assert [a.cooperative for a in ASSIGNORS.values()] == [False, False, True]


def test_streams_no_one_subscribes_and_missing_streams_get_nothing() -> None:
    subs = members({"A": "s missing", "B": "s"})
    for assignor in ASSIGNORS.values():
        got = assignor.assign(subs, {"s": 3, "other": 5, "missing": 0})
        assert sorted(p for ps in got.values() for p in ps) == tps("sp0 sp1 sp2")
