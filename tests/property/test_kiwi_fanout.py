"""Kiwi fan-out: subscribers sharing one reader of a stream partition each get exactly
the events committed after they joined, whatever the reader's position when they joined,
however reads are cut and whatever gaps (compaction) the offsets have; a subscriber that
leaves gets nothing more and can join again at a later position."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headwater.errors import UsageError
from headwater.protocols.kiwi.fanout import Fanout

SUBSCRIBERS = ["a", "b", "c", "d"]

steps = st.lists(
    st.one_of(
        # Events committed: how many, and the gap (compacted offsets) before each.
        st.tuples(st.just("commit"), st.lists(st.integers(0, 2), min_size=1, max_size=6)),
        # The reader reads this many of the committed, unread events (0: all of them).
        st.tuples(st.just("read"), st.integers(0, 8)),
        st.tuples(st.just("join"), st.sampled_from(SUBSCRIBERS)),
        st.tuples(st.just("leave"), st.sampled_from(SUBSCRIBERS)),
    ),
    max_size=60,
)


@dataclass
class Partition:
    """Committed offsets, the reader's position in them, and what each subscriber got."""

    committed: list[int] = field(default_factory=list)
    end: int = 0  # the offset after the last committed event
    read: int = 0  # how many committed events the reader has read
    got: dict[str, list[int]] = field(default_factory=dict)
    expected: dict[str, list[int]] = field(default_factory=dict)


@settings(max_examples=300)
@given(steps)
def test_every_subscriber_gets_exactly_what_was_committed_while_it_was_subscribed(
    script: list[tuple[str, object]],
) -> None:
    fanout: Fanout[str] = Fanout()
    p = Partition()
    for action, arg in script:
        if action == "commit":
            assert isinstance(arg, list)
            for gap in arg:
                p.committed.append(p.end + gap)
                p.end += gap + 1
            for name in p.expected:  # the subscribers
                p.expected[name] += p.committed[-len(arg) :]
        elif action == "read":
            assert isinstance(arg, int)
            unread = len(p.committed) - p.read
            n = unread if arg == 0 else min(arg, unread)
            if n == 0:
                continue
            batch = p.committed[p.read : p.read + n]
            p.read += n
            # The read ends at the next committed offset, or at the end when it took all.
            end = p.committed[p.read] if p.read < len(p.committed) else p.end
            for name, index in fanout.route(batch[0], end, lambda batch=batch: batch):
                assert 0 <= index < len(batch)
                p.got[name] += batch[index:]
        elif action == "join":
            assert isinstance(arg, str)
            if arg in fanout:
                with pytest.raises(UsageError):
                    fanout.add(arg, p.end)
                continue
            fanout.add(arg, p.end)  # live: from the partition's end
            p.got[arg] = []
            p.expected[arg] = []
        else:
            assert isinstance(arg, str)
            assert fanout.remove(arg) == (arg in p.expected)
            if arg in p.expected:
                # What the reader had read of its events, it got; the rest never comes.
                got, expected = p.got.pop(arg), p.expected.pop(arg)
                assert got == expected[: len(got)]
                assert set(expected[len(got) :]) <= set(p.committed[p.read :])
    # Read everything committed: each subscriber got, in order, exactly its events.
    if p.read < len(p.committed):
        batch = p.committed[p.read :]
        for name, index in fanout.route(batch[0], p.end, lambda: batch):
            p.got[name] += batch[index:]
    for name in p.expected:
        assert p.got[name] == p.expected[name]
    assert sorted(fanout) == sorted(p.expected)
    assert len(fanout) == len(p.expected)


def test_route_asks_for_offsets_only_when_a_newcomer_starts_inside_the_read() -> None:
    fanout: Fanout[str] = Fanout()
    fanout.add("early", 0)

    def no_offsets() -> list[int]:
        raise AssertionError("offsets were not needed")

    assert fanout.route(0, 5, no_offsets) == [("early", 0)]
    fanout.add("late", 7)  # joined at 7 while the reader was still at 5
    assert fanout.route(5, 7, no_offsets) == [("early", 0)]  # [5, 7): before its start
    assert fanout.route(7, 10, no_offsets) == [("early", 0), ("late", 0)]
    fanout.add("gap", 12)
    # Offsets 10 and 11 were compacted away: the first event it gets is 13.
    assert fanout.route(13, 14, no_offsets) == [("early", 0), ("late", 0), ("gap", 0)]
    fanout.add("mid", 16)
    assert fanout.route(14, 18, lambda: [14, 15, 16, 17]) == [
        ("early", 0),
        ("late", 0),
        ("gap", 0),
        ("mid", 2),
    ]


def test_misuse_is_a_usage_error() -> None:
    fanout: Fanout[str] = Fanout()
    with pytest.raises(UsageError):
        fanout.add("a", -1)
    fanout.add("a", 0)
    with pytest.raises(UsageError):
        fanout.add("a", 3)
    assert fanout.remove("a") and not fanout.remove("a") and len(fanout) == 0
