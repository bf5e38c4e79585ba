"""The partitioner: Kafka's murmur2 to the bit (Kafka's own test vectors, and
kafka-python's murmur2 on keys of every length 0-300 in one batch), keyed
partitions as Kafka's default partitioner, explicit partitions checked, and the sticky
partitioner's rotation on its two triggers."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from aiokafka.partitioner import murmur2 as aiokafka_murmur2
from hypothesis import given, settings

from headwater.engine.partitioner import (
    _FEW_KEYS,
    Partitioner,
    keyed_partition,
    murmur2,
    murmur2_batch,
    murmur2_spans,
)
from headwater.errors import InvalidRequest

# Kafka clients/src/test/java/org/apache/kafka/common/utils/UtilsTest.java, testMurmur2.
KAFKA_VECTORS = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


@pytest.mark.parametrize(("key", "expected"), KAFKA_VECTORS.items())
def test_murmur2_matches_kafka(key: bytes, expected: int) -> None:
    assert murmur2(key) == expected


def test_batch_hash_matches_kafka_vectors_together() -> None:
    # All in one batch, each key three times: 18 keys, past the handful (_FEW_KEYS)
    # hashed one by one in Python, so the numpy path runs.
    keys = [k for k in KAFKA_VECTORS for _ in range(3)]
    assert len(keys) > _FEW_KEYS
    hashes = murmur2_batch(keys)
    assert [int(h) - (1 << 32) if h & 0x80000000 else int(h) for h in hashes] == [
        KAFKA_VECTORS[k] for k in keys
    ]


def kafka_murmur2(key: bytes) -> int:
    """kafka-python's murmur2 (aiokafka keeps its code), one key at a time, unsigned."""
    return int(aiokafka_murmur2(key)) & 0xFFFFFFFF


KEYS_OF_ANY_LENGTH = st.lists(st.binary(max_size=300) | st.binary(max_size=9), max_size=80)


@settings(max_examples=300)
@given(KEYS_OF_ANY_LENGTH)
def test_batch_hash_is_kafka_pythons_for_keys_of_every_length(keys: list[bytes]) -> None:
    assert murmur2_batch(keys).tolist() == [kafka_murmur2(k) for k in keys]


@given(st.lists(st.integers(0, 300), min_size=1, max_size=20), st.binary(min_size=1))
def test_every_length_0_to_300_in_one_batch_and_alone(extra: list[int], seed: bytes) -> None:
    # Each length 0..300 (empty included) once, plus some drawn again, in one batch (the
    # longest _FEW_KEYS finish one key at a time) and each alone (in Python).
    filler = (seed * (300 // len(seed) + 1))[:300]
    keys = [filler[:n] for n in [*range(301), *extra]]
    expected = [kafka_murmur2(k) for k in keys]
    assert murmur2_batch(keys).tolist() == expected
    assert [murmur2(k) & 0xFFFFFFFF for k in keys] == expected


def test_one_long_key_among_short_ones() -> None:
    # 256 KiB: 65,536 blocks mixed one key at a time after the short keys are done.
    keys = [bytes(range(256)) * 1024, *(b"k%d" % i for i in range(100))]
    assert murmur2_batch(keys).tolist() == [kafka_murmur2(k) for k in keys]


@given(st.lists(st.binary(max_size=40), max_size=30), st.integers(0, 5), st.integers(0, 5))
def test_spans_of_a_buffer_need_not_start_at_zero(keys: list[bytes], lead: int, trail: int) -> None:
    # As an Arrow array sliced from a bigger one hands them: bytes before the first key
    # and after the last are not hashed.
    data = b"\xaa" * lead + b"".join(keys) + b"\xbb" * trail
    bounds = [lead]
    for key in keys:
        bounds.append(bounds[-1] + len(key))
    assert murmur2_spans(data, bounds).tolist() == [kafka_murmur2(k) for k in keys]


@given(st.lists(st.none() | st.binary(max_size=300), min_size=1, max_size=60), st.integers(1, 64))
def test_null_keys_are_sticky_and_empty_keys_hash(keys: list[bytes | None], n: int) -> None:
    partitioner = Partitioner()
    got = partitioner.partition(keys, n).tolist()
    for key, p in zip(keys, got, strict=True):
        if key is None:  # not hashed: the batch's sticky partition
            assert p == partitioner.sticky
        else:
            assert p == (kafka_murmur2(key) & 0x7FFFFFFF) % n


@given(st.lists(st.binary(max_size=20), min_size=1, max_size=40), st.integers(1, 64))
def test_keyed_partition_is_positive_murmur2_mod_n(keys: list[bytes], n: int) -> None:
    got = Partitioner().partition(keys, n).tolist()
    assert got == [(murmur2(k) & 0x7FFFFFFF) % n for k in keys]
    assert got == [keyed_partition(k, n) for k in keys]
    assert all(0 <= p < n for p in got)


def test_keyed_examples_by_hand() -> None:
    # "21" hashes to -973932308: toPositive clears the sign bit (not abs()).
    assert keyed_partition(b"21", 6) == (-973932308 & 0x7FFFFFFF) % 6
    assert keyed_partition(b"abc", 7) == 479470107 % 7


def test_explicit_partition_wins_and_is_checked() -> None:
    partitioner = Partitioner()
    got = partitioner.partition([b"21", None, b"x"], 4, explicit=[3, 2, None])
    assert got.tolist() == [3, 2, keyed_partition(b"x", 4)]
    with pytest.raises(InvalidRequest, match="partition 4 does not exist"):
        partitioner.partition([None], 4, explicit=[4])
    with pytest.raises(InvalidRequest):
        partitioner.partition([None, None], 4, explicit=[1])
    with pytest.raises(InvalidRequest):
        partitioner.partition([None], 0)


class Clock:
    def __init__(self) -> None:
        self.now = 100_000

    def __call__(self) -> int:
        return self.now


def test_sticky_one_partition_per_batch_until_the_count_trigger() -> None:
    clock = Clock()
    partitioner = Partitioner(batch_messages=10, linger_ms=100, clock=clock)
    first = partitioner.partition([None] * 6, 3)
    assert set(first.tolist()) == {0}
    # 6 < 10: the next batch sticks (and may carry the count past 10: never split).
    assert set(partitioner.partition([None] * 6, 3).tolist()) == {0}
    # 12 >= 10: the next batch rotates to the next partition.
    assert set(partitioner.partition([None] * 2, 3).tolist()) == {1}
    assert partitioner.rotations == 1
    # Keyed and explicit events do not count toward the sticky partition's batch.
    mixed = partitioner.partition([None, b"k", None], 3, explicit=[None, None, 0])
    assert mixed.tolist() == [1, keyed_partition(b"k", 3), 0]
    assert partitioner.sticky_count == 3


def test_sticky_rotates_on_the_time_trigger_and_wraps() -> None:
    clock = Clock()
    partitioner = Partitioner(batch_messages=1000, linger_ms=100, clock=clock)
    seen = []
    for _ in range(4):
        seen.append(int(partitioner.partition([None], 3)[0]))
        clock.now += 99  # under the linger: sticks
        seen.append(int(partitioner.partition([None], 3)[0]))
        clock.now += 1  # 100 ms since chosen: the next batch rotates
    assert seen == [0, 0, 1, 1, 2, 2, 0, 0]


def test_sticky_time_only_when_batch_messages_is_zero() -> None:
    clock = Clock()
    partitioner = Partitioner(batch_messages=0, linger_ms=50, clock=clock)
    assert set(partitioner.partition([None] * 50_000, 2).tolist()) == {0}
    assert set(partitioner.partition([None], 2).tolist()) == {0}
    clock.now += 50
    assert set(partitioner.partition([None], 2).tolist()) == {1}


def test_sticky_spreads_over_every_partition_in_turn() -> None:
    clock = Clock()
    partitioner = Partitioner(batch_messages=100, clock=clock)
    counts = [0] * 5
    for _ in range(50):
        for p in partitioner.partition([None] * 100, 5).tolist():
            counts[p] += 1
    assert counts == [1000] * 5
